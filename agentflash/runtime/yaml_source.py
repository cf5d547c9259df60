"""YAML read with the line of every key, so that every error names its file, line and key."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agentflash.errors import UserError, missing_file

Keys = tuple[Any, ...]  # a path into the document: mapping keys and list indexes


def dotted(keys: Keys) -> str:
    """``agents.planner.tools[1]``"""
    out = ""
    for key in keys:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or "(top level)"


@dataclass
class YamlDoc:
    """A YAML file's data and the line where each key (or list item) starts."""

    path: Path
    data: Any
    lines: dict[Keys, int] = field(default_factory=dict)
    # the values its aliases may expand it to: an alias of anchors of aliases doubles them at
    # every level ("a billion laughs": 450 bytes took 3.5 GB and more than a minute)
    budget: int = 0

    def line(self, keys: Keys) -> int:
        """The line of ``keys``, or of its nearest ancestor that is in the file."""
        keys = tuple(keys)
        while keys not in self.lines and keys:
            keys = keys[:-1]
        return self.lines.get(keys, 1)

    def where(self, keys: Keys) -> str:
        """``file:line: key.path``"""
        return f"{self.path}:{self.line(keys)}: {dotted(keys)}"


class _Loader(yaml.SafeLoader):
    """Safe YAML with YAML 1.2's booleans, true and false only: YAML 1.1 also reads on, off,
    yes and no as booleans, so that ``speculation: off`` was false and refused. Nor are dates
    and times read as such (YAML 1.2 has no timestamps): ``default: 2024-01-01`` in a schema is
    the string JSON has, where a date object made the schema unwritable as JSON. Numbers are
    YAML 1.2's too: ``010`` is 10 (1.1: octal 8), ``5e-1`` is 0.5 (1.1: a string), ``0o17`` is
    15 and ``1_000`` a string."""


def _compose_alias(self: _Loader, parent: Any, index: Any) -> yaml.Node:
    """The node an alias names, as a copy that knows the alias's line: the errors found in it
    name where the alias stands (a step repeated by ``- *step``), not the anchor's line."""
    if not self.check_event(yaml.AliasEvent):
        self.written = getattr(self, "written", 0) + 1  # the nodes the file writes out
        return yaml.SafeLoader.compose_node(self, parent, index)
    line = self.peek_event().start_mark.line + 1
    anchor = yaml.SafeLoader.compose_node(self, parent, index)
    here = copy.copy(anchor)
    if isinstance(here, yaml.CollectionNode):  # its own list: flattening the anchor's merge
        here.value = list(here.value)          # keys (<<) in place must not empty this one's
        here.origin = anchor  # whose merge keys are flattened once for all its aliases
    here.alias_line = line
    return here


_Loader.compose_node = _compose_alias


# (``value``: YAML 1.1's ``=``, which no constructor builds: a plain ``=`` was refused)
_YAML_1_1_ONLY = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp",
                  "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:value")
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML_1_1_ONLY]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool",
                              re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
# YAML 1.2's core schema; an integer is tried first
_Loader.add_implicit_resolver("tag:yaml.org,2002:int",
                              re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))


# the most bits an integer may have: about 4,000 decimal digits (Python writes none past 4,300
# in decimal, and a message quoting one failed with a traceback)
MOST_INTEGER_BITS = 13_000


def _integer(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """YAML 1.2's integer: decimal (leading zeros too), ``0o`` octal or ``0x`` hexadecimal."""
    text = loader.construct_scalar(node)
    try:
        if re.fullmatch(r"0o[0-7]+|0x[0-9a-fA-F]+", text):
            value = int(text[2:], 8 if text[1] == "o" else 16)
        elif re.fullmatch(r"[-+]?[0-9]+", text):
            value = int(text, 10) if len(text) < 4_000 else 1 << MOST_INTEGER_BITS
        else:
            value = loader.construct_yaml_int(node)  # an explicit !!int of YAML 1.1's spellings
    except ValueError:  # decimal digits past Python's limit, in YAML 1.1's spellings; or none
        if not re.fullmatch(r"[-+]?[0-9_]+", text):
            raise
        value = 1 << MOST_INTEGER_BITS
    if value.bit_length() > MOST_INTEGER_BITS:
        raise yaml.constructor.ConstructorError(
            None, None, f"an integer of {len(text)} characters: no value here is that large",
            node.start_mark)
    return value


_Loader.add_constructor("tag:yaml.org,2002:int", _integer)


EXPANSION = 100  # how many times the values a file writes out its aliases may make it


def load_yaml(path: str | Path) -> YamlDoc:
    """Parse ``path`` (safe YAML: no Python objects), keeping the line of every key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: file {missing_file(path)}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read the file: {err}") from None
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise UserError(f"{path}:1: the file is empty")
        doc = YamlDoc(path, None, {(): node.start_mark.line + 1},
                      budget=EXPANSION * loader.written + 10_000)
        doc.data = _build(loader, node, (), doc)
        return doc
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = err.problem or err.context or "malformed YAML"
        raise UserError(f"{path}:{line}: invalid YAML: {problem}") from None
    except yaml.YAMLError as err:
        raise UserError(f"{path}: invalid YAML: {err}") from None
    except RecursionError:
        raise UserError(f"{path}: the YAML nests deeper than it can be read") from None
    finally:
        loader.dispose()


_MERGE = "tag:yaml.org,2002:merge"


def _flatten(node: yaml.MappingNode, doc: YamlDoc, keys: Keys, source: bool = False) -> None:
    """``node``'s merge keys (``<<``) replaced, in place, by the pairs of the mappings they
    merge that it does not write itself, each key once: from the first mapping listed that has
    it (YAML's merge key), before the mapping's own pairs. PyYAML's ``flatten_mapping`` listed
    the later mappings first and dropped repeated keys by object identity, so of
    ``<<: [*a, *b]`` a one-letter key (an interned string) came from ``a`` and a longer one
    from ``b``. A merged mapping that merges is flattened first, once for all the aliases of
    its anchor (each flattened its own copy: merges of merges took time as the square of the
    aliases). ``node.merged_at``: the line a merged pair is named at, where it came through
    an alias (the alias's, as inside an alias). ``source``: ``node`` is merged (``keys`` are
    those of the mapping merging it), and no other check sees its own keys."""
    if getattr(node, "flattened", False):
        return
    origin = getattr(node, "origin", None)
    if origin is not None:  # an alias's copy: its anchor's pairs
        _flatten(origin, doc, keys, source)
        node.value, node.merged_at, node.flattened = list(origin.value), origin.merged_at, True
        return
    merged, own, merged_at, merging = [], [], {}, None
    for key_node, value_node in node.value:
        if key_node.tag != _MERGE:
            own.append((key_node, value_node))
            continue
        if merging is not None:
            raise UserError(f"{doc.path}:{key_node.start_mark.line + 1}: {dotted(keys)}: the "
                            f"merge key (<<) appears twice (first on line {merging}): merge "
                            f"the mappings as one list, <<: [*a, *b]")
        merging = key_node.start_mark.line + 1
        sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
        done = set()
        for merged_node in sources:
            line = getattr(merged_node, "alias_line", merged_node.start_mark.line + 1)
            if not isinstance(merged_node, yaml.MappingNode):
                kind = "list" if isinstance(merged_node, yaml.SequenceNode) else "scalar"
                raise UserError(f"{doc.path}:{line}: {dotted(keys)}: << merges a mapping or a "
                                f"list of mappings, not a {kind}")
            anchor = getattr(merged_node, "origin", merged_node)
            if id(anchor) in done:  # listed again: its keys are taken already
                continue
            done.add(id(anchor))
            _flatten(merged_node, doc, keys, source=True)
            alias = getattr(merged_node, "alias_line", None)
            for key_node_, value_node_ in merged_node.value:
                merged.append((key_node_, value_node_))
                at = alias or merged_node.merged_at.get(id(key_node_))
                if at is not None:
                    merged_at[id(key_node_)] = at
    taken: dict[Any, int] = {}
    for key_node, _ in own:
        key = _key_of(key_node)
        if source and key in taken:  # (a mapping built is checked where it is built)
            raise UserError(f"{doc.path}:{key_node.start_mark.line + 1}: {dotted(keys)}: the "
                            f"key {key_node.value!r} appears twice in a mapping it merges "
                            f"(first on line {taken[key]})")
        taken[key] = key_node.start_mark.line + 1
    kept = []
    for key_node, value_node in merged:
        key = _key_of(key_node)
        if key not in taken:
            taken[key] = 0
            kept.append((key_node, value_node))
    node.value, node.merged_at, node.flattened = kept + own, merged_at, True


def _key_of(node: yaml.Node) -> Any:
    """A key node as merging compares it: a scalar by its tag and text."""
    return (node.tag, node.value) if isinstance(node, yaml.ScalarNode) else id(node)


def _build(loader: _Loader, node: yaml.Node, keys: Keys, doc: YamlDoc,
           at: int | None = None) -> Any:
    """``node`` as plain data, with the line of every key in ``doc``: ``at`` for all of it
    inside an alias (the alias's line)."""
    at = getattr(node, "alias_line", at)
    doc.budget -= 1
    if doc.budget < 0:
        raise UserError(f"{doc.path}:{at or node.start_mark.line + 1}: {dotted(keys)}: its "
                        f"aliases expand the file past {EXPANSION} times the values it writes "
                        f"out (an alias repeats all its anchor holds): write the values out")
    if isinstance(node, yaml.MappingNode):
        # its own keys, as written: kept on the node, which flattening changes in place and an
        # alias (of a mapping holding it) reaches again
        if not hasattr(node, "own_keys"):
            node.own_keys = {id(k) for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"}
        own = node.own_keys
        _flatten(node, doc, keys)  # YAML merge keys (<<): the merged pairs come first
        out: dict[str, Any] = {}
        written: set[str] = set()  # the keys this mapping writes itself
        for key_node, value_node in node.value:
            inside = at or node.merged_at.get(id(key_node))  # an alias's line, if merged by one
            key = _construct(loader, key_node, keys, doc, inside)
            line = inside or key_node.start_mark.line + 1
            if not isinstance(key, str):
                raise UserError(f"{doc.path}:{line}: {dotted(keys)}: keys must be strings, "
                                f"got {key!r}")
            if id(key_node) in own:  # a merged key is overridden by the mapping's own
                if key in written:
                    raise UserError(f"{doc.path}:{line}: {dotted((*keys, key))}: the key "
                                    f"appears twice (first on line {doc.lines[(*keys, key)]})")
                written.add(key)
            doc.lines[(*keys, key)] = line
            out[key] = _build(loader, value_node, (*keys, key), doc, inside)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            doc.lines[(*keys, i)] = at or getattr(item, "alias_line", item.start_mark.line + 1)
            items.append(_build(loader, item, (*keys, i), doc, at))
        return items
    if node.tag == _MERGE:  # a plain << that is no key: the text (it was refused)
        return node.value
    value = _construct(loader, node, keys, doc, at)
    if value is not None and not isinstance(value, (str, int, float)):  # bool is an int
        # an explicit tag (!!binary, !!timestamp): a value JSON has no form for
        tag = node.tag.replace("tag:yaml.org,2002:", "!!")
        line = at or node.start_mark.line + 1
        raise UserError(f"{doc.path}:{line}: {dotted(keys)}: a {tag} value is not one JSON has "
                        "(text, a number, a boolean or null)")
    return value


def _construct(loader: _Loader, node: yaml.Node, keys: Keys, doc: YamlDoc,
               at: int | None) -> Any:
    """A scalar's value; a ``UserError`` at its line where an explicit tag names a type PyYAML
    cannot read it as (``!!int abc``, ``!!bool maybe``, ``!!float ''``: tracebacks before)."""
    try:
        return loader.construct_object(node, deep=True)
    except (ValueError, LookupError, AttributeError, TypeError):
        tag = node.tag.replace("tag:yaml.org,2002:", "!!")
        where = f"{doc.path}:{at or node.start_mark.line + 1}: {dotted(keys)}"
        if not isinstance(node, yaml.ScalarNode):  # (a complex key's inner value)
            raise UserError(f"{where}: a value inside is not of the type its tag names") from None
        text = node.value if len(node.value) <= 40 else node.value[:40] + "..."
        raise UserError(f"{where}: {text!r} is not a {tag} value") from None
