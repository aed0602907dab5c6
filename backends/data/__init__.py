"""Data placement: which samples a rank reads (``samplers``, ``streams``) and how a batch
reaches the device (``batch``).

Example:
    >>> from backends.data.batch import map_tensors
    >>> map_tensors({"x": 1}, lambda tensor: tensor)
    {'x': 1}
"""
