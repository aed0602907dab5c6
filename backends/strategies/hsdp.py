"""HSDP (hybrid sharded data parallel): the data-parallel ranks as replica groups.

With ``data_parallel_replicate_size = R`` the ``D`` data-parallel ranks form ``R`` groups of
``D / R`` consecutive ranks (under torchrun and Slurm, the ranks of one node are consecutive):
FSDP2 shards every parameter within a group (all-gathers and reduce-scatters stay inside it) and
all-reduces the gradients across the groups. The mesh is ``("dp_replicate", "dp_shard")``, and
``("dp_replicate", "dp_shard", "tp")`` under the model-parallel strategy, where its two data-parallel
dimensions are also flattened into ``"dp"`` (the rows that read distinct data, for metric
reductions). Every (replicate, shard) pair reads its own share of the data, so the data-parallel
rank and size are the same as without replicas, and so is the training result (up to the order of
the gradient sums). R = 1 (None) is plain FSDP: one flat mesh over every data-parallel rank.
"""

from typing import Any, Optional

REPLICATE_DIM, SHARD_DIM, TENSOR_DIM, DATA_DIM = "dp_replicate", "dp_shard", "tp", "dp"
HSDP_DIM_NAMES = (REPLICATE_DIM, SHARD_DIM)
"""The names of an HSDP mesh's dimensions: parameters are ``Replicate()`` on the first, sharded on the second."""


def checked_replicate_size(value: Optional[int]) -> Optional[int]:
    """``value`` when it is a valid ``data_parallel_replicate_size`` (None or an integer >= 1).

    Raises:
        ValueError: naming the value and what is allowed.

    Example:
        >>> checked_replicate_size(2), checked_replicate_size(None)
        (2, None)
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            f"data_parallel_replicate_size={value!r} is invalid; allowed: None (one replica group: shard over every "
            "data-parallel rank) or an integer >= 1 that divides the data-parallel size (usually the number of nodes)"
        )
    return value


def check_replicate_size(replicas: int, data_parallel_size: int, described: str) -> None:
    """Refuse ``replicas`` groups that do not split ``data_parallel_size`` ranks evenly.

    ``described`` says where the data-parallel size comes from (shown in the message).

    Raises:
        ValueError: naming the value, the data-parallel size and the sizes allowed.

    Example:
        >>> check_replicate_size(2, 4, "4 processes")
        >>> check_replicate_size(3, 4, "4 processes")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: data_parallel_replicate_size=3 does not divide the data-parallel size 4 (4 processes); allowed: ...
    """
    if data_parallel_size % replicas:
        divisors = [n for n in range(1, data_parallel_size + 1) if data_parallel_size % n == 0]
        raise ValueError(
            f"data_parallel_replicate_size={replicas} does not divide the data-parallel size {data_parallel_size} "
            f"({described}); allowed: one of {divisors} (equal replica groups, each sharding the parameters over "
            "data-parallel size / replicas ranks: usually the number of nodes) or None"
        )


def hsdp_mesh(device_type: str, replicas: int, shard: int, tensor_parallel: Optional[int] = None) -> Any:
    """The ``("dp_replicate", "dp_shard")`` mesh of ``replicas x shard`` ranks (collective: call it
    on every rank), with a trailing ``"tp"`` dimension of ``tensor_parallel`` ranks when given; then
    ``mesh["dp"]`` is the flattened data-parallel dimensions (rank ``r`` at ``r // tensor_parallel``).

    Example (on each of 4 ranks; tests/test_hsdp.py runs it)::

        mesh = hsdp_mesh("cpu", 2, 2)
        mesh.mesh_dim_names  # ('dp_replicate', 'dp_shard')
    """
    from torch.distributed.device_mesh import init_device_mesh

    if tensor_parallel is None:
        return init_device_mesh(device_type, (replicas, shard), mesh_dim_names=HSDP_DIM_NAMES)
    mesh = init_device_mesh(device_type, (replicas, shard, tensor_parallel), mesh_dim_names=(*HSDP_DIM_NAMES, TENSOR_DIM))
    mesh[HSDP_DIM_NAMES]._flatten(DATA_DIM)  # one group per row of data-parallel ranks (torch has no public call)
    return mesh
