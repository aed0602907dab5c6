"""Which parts of a model each pipeline stage holds, and cutting a model down to one stage.

A stage is named by its top-level parts: the model's direct children (``"tok_embeddings"``,
``"norm"``) and the blocks of its block container (``"layers.0"``). By default
(:func:`default_stages`) the first ``nn.ModuleDict`` or ``nn.ModuleList`` among the model's children
holds the blocks: they are split evenly (the first stages take one more when they do not divide),
what comes before the container goes to the first stage and what comes after to the last, as
torchtitan splits a Llama. A module may name its own split with ``pipeline_stages(num_stages)``.

:func:`keep_stage` removes, in place, every part a stage does not hold: a removed child becomes
``None`` and a removed block leaves its container, so every parameter keeps its fully qualified name
(``layers.3.attention.wq.weight`` on the stage that holds block 3): checkpoints keyed by name
(:mod:`backends.checkpoint_io.optimizer_names`) read the same on any number of stages. The model's
``forward`` must run the parts a stage holds (``x = self.tok_embeddings(tokens) if
self.tok_embeddings is not None else tokens``; iterating over the container yields its own blocks).

Example:
    >>> model = torch.nn.Module()
    >>> model.embed = torch.nn.Embedding(4, 2)
    >>> model.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
    >>> model.head = torch.nn.Linear(2, 4)
    >>> default_stages(model, 2)
    [['embed', 'layers.0', 'layers.1'], ['layers.2', 'head']]
    >>> keep_stage(model, ['layers.2', 'head'])
    >>> [name for name, _ in model.named_parameters()]
    ['layers.2.weight', 'layers.2.bias', 'head.weight', 'head.bias']
"""

from typing import List, Sequence, Tuple

import torch

BLOCK_CONTAINERS = (torch.nn.ModuleDict, torch.nn.ModuleList)


def block_container(module: torch.nn.Module) -> Tuple[str, torch.nn.Module]:
    """``(name, container)`` of the first ``nn.ModuleDict`` / ``nn.ModuleList`` among ``module``'s children.

    Raises:
        ValueError: ``module`` has none (naming its children and what to define instead).
    """
    for name, child in module.named_children():
        if isinstance(child, BLOCK_CONTAINERS):
            return name, child
    children = [name for name, _ in module.named_children()]
    raise ValueError(
        f"{type(module).__name__} has no nn.ModuleDict or nn.ModuleList of blocks among its children {children}: a "
        "pipeline splits the blocks of the first one between its stages. Keep the blocks in one, or define "
        "pipeline_stages(num_stages) returning each stage's top-level names (e.g. [['embed', 'layers.0'], ['layers.1', 'head']])"
    )


def default_stages(module: torch.nn.Module, num_stages: int) -> List[List[str]]:
    """Each stage's top-level names: the blocks split evenly, what comes before them on the first
    stage, what comes after them on the last.

    Raises:
        ValueError: ``num_stages`` is below 1, or above the number of blocks, or there is no container.
    """
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"the number of pipeline stages is {num_stages!r}; allowed: an integer >= 1")
    container_name, container = block_container(module)
    blocks = [f"{container_name}.{key}" for key in container._modules]
    if len(blocks) < num_stages:
        raise ValueError(
            f"{type(module).__name__}.{container_name} holds {len(blocks)} block(s), too few for {num_stages} pipeline "
            f"stages: use pipeline_parallel_size <= {len(blocks)}, or define pipeline_stages(num_stages)"
        )
    children = [name for name, child in module.named_children()]
    position = children.index(container_name)
    stages: List[List[str]] = []
    start = 0
    for index in range(num_stages):
        size = len(blocks) // num_stages + (1 if index < len(blocks) % num_stages else 0)
        stages.append(blocks[start : start + size])
        start += size
    stages[0] = children[:position] + stages[0]
    stages[-1] = stages[-1] + children[position + 1 :]
    return stages


def top_level_names(module: torch.nn.Module) -> List[str]:
    """Every name a stage may hold: ``module``'s children, its block container expanded into its blocks.

    Example:
        >>> model = torch.nn.Module(); model.layers = torch.nn.ModuleList([torch.nn.ReLU()]); model.head = torch.nn.ReLU()
        >>> top_level_names(model)
        ['layers.0', 'head']
    """
    container_name = next((name for name, child in module.named_children() if isinstance(child, BLOCK_CONTAINERS)), None)
    names: List[str] = []
    for name, child in module.named_children():
        if name == container_name:
            names.extend(f"{name}.{key}" for key in child._modules)
        else:
            names.append(name)
    return names


def check_stages(module: torch.nn.Module, stages: Sequence[Sequence[str]], num_stages: int) -> None:
    """Refuse a split that is not every part of ``module`` exactly once, in ``num_stages`` stages.

    Raises:
        ValueError: naming the parts missing, repeated or unknown, or the number of stages.
    """
    if len(stages) != num_stages:
        raise ValueError(f"pipeline_stages({num_stages}) returned {len(stages)} stage(s); allowed: exactly {num_stages}")
    known = top_level_names(module)
    named = [name for stage in stages for name in stage]
    unknown = sorted(set(named) - set(known))
    repeated = sorted({name for name in named if named.count(name) > 1})
    missing = [name for name in known if name not in named and _has_parameters(module, name)]
    empty = [index for index, stage in enumerate(stages) if not stage]
    problems = [
        f"{label}: {names}"
        for label, names in (
            ("unknown", unknown),
            ("on several stages", repeated),
            ("on no stage", missing),
            ("empty stages", empty),
        )
        if names
    ]
    if problems:
        raise ValueError(
            f"the pipeline split of {type(module).__name__} is not each part on one stage ({'; '.join(problems)}); "
            f"the parts are {known}"
        )
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"{type(module).__name__} holds parameters of its own {own}, which no stage can hold: move them into a submodule"
        )


def keep_stage(module: torch.nn.Module, names: Sequence[str]) -> None:
    """Remove from ``module``, in place, every part that is not in ``names`` (one stage's): children
    become ``None``, blocks leave their container; every parameter kept keeps its name."""
    kept = set(names)
    container_name = next((name for name, child in module.named_children() if isinstance(child, BLOCK_CONTAINERS)), None)
    for name, child in list(module.named_children()):
        if name == container_name:
            for key in list(child._modules):
                if f"{name}.{key}" not in kept:
                    del child._modules[key]
        elif name not in kept:
            setattr(module, name, None)


def _has_parameters(module: torch.nn.Module, name: str) -> bool:
    return any(True for _ in module.get_submodule(name).parameters())
