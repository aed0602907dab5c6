"""The process around a run: preemption signals, the launcher's death, logging setup.

A package beside ``loop/``, not inside it: the arguments (``preemption_signals``), the loggers and the
conformance kit use preemption too, and none of them should import the loop to get it.
"""
