"""Reading YAML a run did not write itself (``--config`` files, a run's ``config.yaml``) within bounds.

PyYAML's ``safe_load`` runs no code, but a few hundred bytes of anchors and aliases (an "alias
bomb": each list names the previous one nine times) stand for billions of values. The loaded
object shares them, so it is small, but anything that walks it (flattening, comparing, a
message showing it) walks every one: minutes of work and gigabytes of memory. So
:func:`load_yaml` counts, on the composed node graph and before anything is built, how many
values the document stands for with every alias expanded, and refuses a document over
:data:`MAX_VALUES` values or :data:`MAX_DEPTH` levels deep (a deep nesting would otherwise
end in ``RecursionError``).

Before any node is built, a streaming pass over the parser's events (libyaml's when installed)
counts the values and the depth and stops at the first one over a bound, so a large document
without aliases is refused in a fraction of a second and a few MB, not after composing its whole
node graph (a 2 MB file took 194 s and 980 MB); text over :data:`MAX_CHARS` is refused unread.
A mapping that names a key twice is refused naming the key and both lines (PyYAML keeps the last
silently: two ``trainer:`` sections would drop the first), and a value PyYAML cannot build (an
integer over Python's digit limit) is refused naming its line, never a raw ``ValueError``.
"""

from typing import Any, Dict, List, Tuple

MAX_VALUES = 100_000
"""The most values (scalars, lists, mappings; aliases counted as what they stand for) a document may hold."""
MAX_DEPTH = 200
"""The deepest nesting of lists and mappings a document may have."""
MAX_CHARS = 16 << 20
"""The longest YAML text read (characters): a config is kilobytes; :data:`MAX_VALUES` values fit in a few MB."""


class YamlRefused(ValueError):
    """A YAML document over the bounds (or not YAML at all), with a message saying which and why.

    Example:
        >>> load_yaml("a: &a [1, 1, 1]\\nb: &b [*a, *a, *a]\\nc: [*b, *b, *b]", max_values=20)
        Traceback (most recent call last):
        ...
        framework.config.bounded_yaml.YamlRefused: the YAML stands for more than 20 values once its aliases are expanded ...
    """


def load_yaml(text: str, max_values: int = MAX_VALUES, max_depth: int = MAX_DEPTH) -> Any:
    """``yaml.safe_load(text)``, refused when it holds more than ``max_values`` values (aliases expanded),
    nests past ``max_depth`` levels, names a key twice in one mapping or is longer than :data:`MAX_CHARS`;
    counted on the parser's events, then on the node graph, before any value is built.

    Raises:
        YamlRefused: over a bound, a duplicate key, a value that cannot be built, or not valid YAML
            (PyYAML's message, bounded).

    Example:
        >>> load_yaml("trainer: {epochs: 3}")
        {'trainer': {'epochs': 3}}
        >>> load_yaml("trainer: {epochs: 3}\\ntrainer: {epochs: 4}")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        framework.config.bounded_yaml.YamlRefused: the key 'trainer' appears twice in one mapping (lines 1 and 2): ...
    """
    import yaml  # on first use: importing it costs more than the rest of the config code

    from framework.config.bounded_repr import bounded_text

    if len(text) > MAX_CHARS:
        raise YamlRefused(f"the YAML is {len(text)} characters long; the most read is {MAX_CHARS}")
    loader = _loader_class()(text)
    try:
        try:
            _check_events(loader, max_values, max_depth)
            loader.dispose()
            loader = _loader_class()(text)
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


def _loader_class() -> Any:
    """PyYAML's safe loader (libyaml's parser when installed: about 5 times faster), building integers
    over Python's digit limit as a :class:`YamlRefused` naming their line instead of a raw ``ValueError``."""
    global _LOADER
    if _LOADER is None:
        import yaml

        base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

        class BoundedLoader(base):  # type: ignore[valid-type,misc]
            def construct_yaml_int(self, node: Any) -> Any:
                try:
                    return super().construct_yaml_int(node)
                except ValueError as error:
                    raise YamlRefused(
                        f"line {node.start_mark.line + 1}: the value {node.value[:40]!r}... ({len(node.value)} characters) "
                        f"cannot be read as an integer ({str(error)[:120]}); write a shorter number or quote it as a string"
                    ) from None

        BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
        _LOADER = BoundedLoader
    return _LOADER


_LOADER: Any = None


def _check_events(loader: Any, max_values: int, max_depth: int) -> None:
    """Stream the parser's events, refusing at the first value over ``max_values`` (aliases count once
    here; :func:`_check_size` expands them) or level over ``max_depth``: nothing is kept, nothing built."""
    import yaml

    values, depth = 0, 0
    while loader.check_event():
        event = loader.get_event()
        if isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent, yaml.CollectionStartEvent)):
            values += 1
            if values > max_values:
                raise YamlRefused(f"the YAML holds more than {max_values} values; the most allowed is {max_values}")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > max_depth:
                raise YamlRefused(f"the YAML is nested more than {max_depth} levels deep")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _check_duplicates(node: Any) -> None:
    """Refuse a mapping ``node`` that names a scalar key twice (merge keys ``<<`` aside)."""
    counts: Dict[Tuple[str, str], List[int]] = {}
    for key, _ in node.value:
        if type(key).__name__ == "ScalarNode" and key.tag != "tag:yaml.org,2002:merge":
            lines = counts.setdefault((key.tag, key.value), [])
            lines.append(key.start_mark.line + 1)
            if len(lines) > 1:
                raise YamlRefused(
                    f"the key {key.value[:100]!r} appears twice in one mapping (lines {lines[0]} and {lines[1]}): "
                    "the second would silently replace the first; write it once"
                )


def _check_size(root: Any, max_values: int, max_depth: int) -> None:
    """Count the values ``root`` stands for (aliased nodes once per reference), without recursion."""
    import yaml

    expanded: Dict[int, int] = {}  # id(node) -> values it stands for, once known
    stack: List[Tuple[Any, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, children_done = stack.pop()
        if id(node) in expanded:
            continue
        if isinstance(node, yaml.ScalarNode):
            expanded[id(node)] = 1
            continue
        if depth > max_depth:  # levels of lists and mappings, as the event pass counts them
            raise YamlRefused(f"the YAML is nested more than {max_depth} levels deep")
        if isinstance(node, yaml.MappingNode) and not children_done:
            _check_duplicates(node)
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
