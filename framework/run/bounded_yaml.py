"""Reading YAML a run did not write itself (``--config`` files, a run's ``config.yaml``) within bounds.

PyYAML's ``safe_load`` runs no code, but a few hundred bytes of anchors and aliases (an "alias
bomb": each list names the previous one nine times) stand for billions of values. The loaded
object shares them, so it is small, but anything that walks it (flattening, comparing, a
message showing it) walks every one: minutes of work and gigabytes of memory. So
:func:`load_yaml` counts, on the composed node graph and before anything is built, how many
values the document stands for with every alias expanded, and refuses a document over
:data:`MAX_VALUES` values or :data:`MAX_DEPTH` levels deep (a deep nesting would otherwise
end in ``RecursionError``).
"""

from typing import Any, Dict, List, Tuple

MAX_VALUES = 100_000
"""The most values (scalars, lists, mappings; aliases counted as what they stand for) a document may hold."""
MAX_DEPTH = 200
"""The deepest nesting of lists and mappings a document may have."""


class YamlRefused(ValueError):
    """A YAML document over the bounds (or not YAML at all), with a message saying which and why.

    Example:
        >>> load_yaml("a: &a [1, 1, 1]\\nb: &b [*a, *a, *a]\\nc: [*b, *b, *b]", max_values=20)
        Traceback (most recent call last):
        ...
        framework.run.bounded_yaml.YamlRefused: the YAML stands for more than 20 values once its aliases are expanded ...
    """


def load_yaml(text: str, max_values: int = MAX_VALUES, max_depth: int = MAX_DEPTH) -> Any:
    """``yaml.safe_load(text)``, refused when its aliases expand past ``max_values`` values or its
    nesting passes ``max_depth`` levels; counted on the node graph before any value is built.

    Raises:
        YamlRefused: over a bound, or not valid YAML (PyYAML's message, bounded).

    Example:
        >>> load_yaml("trainer: {epochs: 3}")
        {'trainer': {'epochs': 3}}
    """
    import yaml  # on first use: importing it costs more than the rest of the config code

    from framework.run.bounded_repr import bounded_text

    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise YamlRefused(f"the YAML is nested too deep (the most allowed: {max_depth} levels)") from None
        except yaml.YAMLError as error:
            raise YamlRefused(f"not valid YAML: {bounded_text(str(error), 600)}") from None
        if node is None:
            return None
        _check_size(node, max_values, max_depth)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_size(root: Any, max_values: int, max_depth: int) -> None:
    """Count the values ``root`` stands for (aliased nodes once per reference), without recursion."""
    import yaml

    expanded: Dict[int, int] = {}  # id(node) -> values it stands for, once known
    stack: List[Tuple[Any, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, children_done = stack.pop()
        if id(node) in expanded:
            continue
        if depth > max_depth:
            raise YamlRefused(f"the YAML is nested more than {max_depth} levels deep")
        if isinstance(node, yaml.ScalarNode):
            expanded[id(node)] = 1
            continue
        children = [item for pair in node.value for item in pair] if isinstance(node, yaml.MappingNode) else node.value
        if children_done:
            total = 1 + sum(expanded.get(id(child), 0) for child in children)
            if total > max_values:
                raise YamlRefused(
                    f"the YAML stands for more than {max_values} values once its aliases are expanded "
                    f"(an alias bomb?); the most allowed is {max_values}"
                )
            expanded[id(node)] = total
            continue
        stack.append((node, depth, True))
        stack.extend((child, depth + 1, False) for child in children if id(child) not in expanded)
