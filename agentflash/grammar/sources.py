"""Where grammars come from: JSON Schema (dict or file), pydantic models, regex, Lark/EBNF text.

A ``GrammarSource`` is a small frozen value (kind, canonical text, JSON style); it is what the
compile cache keys on, together with the tokenizer. Constructors check what they can without a
tokenizer (JSON syntax, the JSON Schema meta-schema, schemas and Lark grammars that can never
finish) and raise ``GrammarError`` naming the source and the field.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urldefrag, urljoin

from agentflash.errors import missing_file
from agentflash.grammar.checks import (
    MAX_SCHEMA_DEPTH,
    SCHEMA_KEYWORDS,
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    SCHEMA_SINGLES,
    anchor_index,
    check_depth,
    check_lark_finishes,
    check_schema,
    recursion_room,
    resolve_ref,
)
from agentflash.grammar.constraint import GrammarError
from agentflash.json_formats import DATE_PATTERNS
from agentflash.tool_format import loads_strict


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    LARK = "lark"


class JsonStyle(enum.Enum):
    """How generated JSON is laid out (a model writes best in the layout it was trained on)."""

    DUMPS = "dumps"  # json.dumps defaults: ", " and ": ", no other whitespace (the chat format)
    COMPACT = "compact"  # "," and ":", no whitespace
    FLEXIBLE = "flexible"  # any JSON whitespace


@dataclass(frozen=True)
class GrammarSource:
    """A grammar before compilation. ``text`` is canonical: JSON text for schemas."""

    kind: GrammarKind
    text: str
    json_style: JsonStyle = JsonStyle.DUMPS
    origin: str = field(default="grammar", compare=False)  # named in error messages
    # an assistant turn whose text outside tool calls is a JSON schema's answer (the router
    # counts that text as a schema segment, as it does a JSON schema's whole reply)
    answers_in_schema: bool = field(default=False, compare=False)
    # an assistant turn's grammar with free text (``tool_calls.with_reasoning_tokens``)
    free_text: bool = False

    @property
    def schema(self) -> Any:
        assert self.kind is GrammarKind.JSON_SCHEMA
        return json.loads(self.text)


_OPEN_ENDED = (
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
)


def with_subschemas(node: dict[str, Any], each: Callable[[Any, str], Any]) -> dict[str, Any]:
    """A copy of the schema ``node`` whose subschemas are ``each(subschema, key)``, ``key`` the
    keyword they are under (``properties``, ``anyOf``, ``items``, ...)."""
    out = dict(node)
    if out.keys().isdisjoint(SCHEMA_KEYWORDS):
        return out
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: each(sub, key) for name, sub in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [each(sub, key) for sub in out[key]]
    for key in SCHEMA_SINGLES:
        if isinstance(out.get(key), list):  # draft-04 tuple ``items``
            out[key] = [each(sub, key) for sub in out[key]]
        elif key in out:
            out[key] = each(out[key], key)
    return out


def close_objects(node: Any, close: bool = True) -> Any:
    """A copy of ``node`` where every object schema that lists its properties, and says nothing
    else about other keys, takes no other keys: what OpenAI's strict mode asks of a schema and
    what outlines and xgrammar generate by default. JSON Schema lets an object have any keys it
    does not mention, and a model given that freedom invents them (the demo model adds keys to
    its answers until max tokens, and arguments the tool does not take). Left open: an object
    that says anything about other keys (but compositions that only say which of its keys it
    requires, "a or b": ``_neutral``), one that requires a key it does not list, and the
    schemas that describe one object together with others (closing each would forbid the
    others' keys): the branches of an ``allOf``, those of an ``anyOf`` / ``oneOf`` beside
    properties, a ``$ref`` or another composition, or in such a branch, and what such a branch,
    or a ``$ref`` beside what may admit other keys (``_neutral``), names (by
    a pointer, an anchor, or the root's ``$id``); and one of a ``const`` or an ``enum``, whose
    values are the objects it may be."""
    node = _unshared(node)  # one dict at two places is two objects, each closed or not
    composing, closable = _composition(node)
    return _close(node, close, composing, closable)


def _unshared(node: Any) -> Any:
    """A copy of the JSON value ``node`` whose dicts and lists appear once each (deepcopy
    keeps a dict shared by two places one dict)."""
    if isinstance(node, dict):
        return {key: _unshared(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_unshared(value) for value in node]
    return node


def _close(node: Any, close: bool, composing: set[int], closable: set[int]) -> Any:
    if not isinstance(node, dict):
        return node

    close = close and id(node) not in composing  # a ref describing it with others names it

    def each(sub: Any, key: str) -> Any:
        return _close(sub, not _shares(node, key, not close), composing, closable)

    out = with_subschemas(node, each)
    listed = out.get("properties")
    required = out.get("required", [])
    if (
        close
        and isinstance(listed, dict)
        # (its compositions may say which of its keys it requires: "a or b" inline)
        and (not any(key in node for key in _OPEN_ENDED) or id(node) in closable)
        and "const" not in node  # its values say what the object holds: closing could
        and "enum" not in node  # refuse every one (a const with a key it does not list)
        and isinstance(required, list)
        and all(isinstance(name, str) and name in listed for name in required)
    ):
        out["additionalProperties"] = False
    return out


# keywords that describe the object they sit in: beside one another, each part is one of
# several descriptions of that object (closing one would forbid what the others add)
_DESCRIBING = ("properties", "allOf", "anyOf", "oneOf", "$ref")


def _beside(node: dict, key: str) -> bool:
    """Whether ``node`` describes its object with another keyword beside ``key``'s."""
    return any(other in node for other in _DESCRIBING if other != key)


# keywords that may let an object have keys beside a ref's object's (or ask for them): beside
# the ref, they leave its object open; any other keyword (a title, `nullable`, bounds of other
# types, `maxProperties`) leaves it closed
_ADMITS_KEYS = frozenset({"properties", "patternProperties", "additionalProperties",
                          "unevaluatedProperties", "propertyNames", "dependentSchemas",
                          "dependencies", "dependentRequired", "if", "then", "else", "not",
                          "const", "enum", "$dynamicRef"})


def _neutral(node: Any, listed: frozenset[str], resolve: Callable[[str], Any],
             memo: dict[tuple[int, frozenset[str]], bool]) -> bool:
    """Whether ``node``, beside a ref whose object lists the keys ``listed``, asks for no key
    but those: ``required`` of them, ``minProperties`` within their number, keywords of
    ``_ADMITS_KEYS`` nowhere, compositions of such (through refs), as "a or b" (``anyOf`` of
    ``required``). Memoized per node and keys (refs fan out), whatever the path to it."""
    if not isinstance(node, dict):
        return node is True
    key = (id(node), listed)
    if key not in memo:
        memo[key] = False  # (a ref back to it while it is read: open)
        try:
            memo[key] = all(_neutral_keyword(k, v, listed, resolve, memo)
                            for k, v in node.items())
        except RecursionError:  # not read through: no verdict to keep for another path
            del memo[key]
            raise
    return memo[key]


def _neutral_keyword(key: str, value: Any, listed: frozenset[str],
                     resolve: Callable[[str], Any],
                     memo: dict[tuple[int, frozenset[str]], bool]) -> bool:
    if key == "required":
        return isinstance(value, list) and all(isinstance(v, str) and v in listed for v in value)
    if key == "minProperties":
        return isinstance(value, int) and value <= len(listed)
    if key in ("allOf", "anyOf", "oneOf"):
        return isinstance(value, list) and all(
            _neutral(branch, listed, resolve, memo) for branch in value)
    if key == "$ref":
        return isinstance(value, str) and _neutral(resolve(value), listed, resolve, memo)
    return key not in _ADMITS_KEYS


def _neutral_beside(node: dict, target: Any, resolve: Callable[[str], Any],
                    memo: dict[tuple[int, frozenset[str]], bool]) -> bool:
    """Whether ``node``'s keywords beside its ``$ref`` (to ``target``) are ``_neutral``; a chain
    of refs past what Python's recursion reads from here is not (its object is left open)."""
    listed = _listed_keys(target, resolve)
    try:  # (the siblings' own dict, made here, is not kept in the memo)
        return all(_neutral_keyword(key, value, listed, resolve, memo)
                   for key, value in node.items() if key != "$ref")
    except RecursionError:
        return False


def _listed_keys(target: Any, resolve: Callable[[str], Any]) -> frozenset[str]:
    """The keys the object a ref reaches lists, through refs to refs."""
    for _ in range(16):
        if not isinstance(target, dict):
            break
        if isinstance(target.get("properties"), dict):
            return frozenset(target["properties"])
        if not isinstance(target.get("$ref"), str):
            break
        target = resolve(target["$ref"])
    return frozenset()


def _shares(node: dict, key: str, shared: bool) -> bool:
    """Whether the subschemas under ``node``'s ``key`` describe an object together with other
    schemas: an ``allOf``'s branches, and an ``anyOf`` / ``oneOf``'s beside properties, a
    ``$ref`` or another composition of the node's own, or in a node that is itself such a part
    (``shared``)."""
    return key == "allOf" or (key in ("anyOf", "oneOf") and (shared or _beside(node, key)))


def _composition(root: Any) -> tuple[set[int], set[int]]:
    """The ids of the subschemas that a ``$ref`` describing an object together with other
    schemas points at, through refs to refs (an ``allOf`` branch's, a shared ``anyOf`` /
    ``oneOf`` branch's, and one beside anything but ``_neutral`` keywords), however the ref is
    spelled: a pointer anywhere in the schema, escaped or not, an anchor, or the root's own
    ``$id`` with a fragment; and the ids of the objects listing properties whose own
    compositions (no ref, no other open-ended keyword) are ``_neutral`` to them, as "a or b"
    written inline: closable. One pass: each node is walked at most once shared and once
    not."""
    anchors = anchor_index(root)
    own_id = root.get("$id") if isinstance(root, dict) else None

    def resolve(ref: str) -> Any:
        return resolve_ref(root, _local_ref(ref, own_id), anchors)

    found: set[int] = set()
    closable: set[int] = set()
    seen: set[tuple[int, bool]] = set()
    memo: dict[tuple[int, frozenset[str]], bool] = {}
    work: list[tuple[Any, bool]] = [(root, False)]
    while work:
        node, shared = work.pop()
        if not isinstance(node, dict) or (id(node), shared) in seen:
            continue
        seen.add((id(node), shared))
        ref = node.get("$ref")
        target = resolve(ref) if isinstance(ref, str) else None
        if isinstance(target, dict):
            if shared or not _neutral_beside(node, target, resolve, memo):
                found.add(id(target))  # it describes the object with the others
                work.append((target, True))
        elif _neutral_compositions(node, resolve, memo):
            closable.add(id(node))
        work += [(sub, _shares(node, key, shared)) for sub, key in _keyed_subschemas(node)]
    return found, closable


def _neutral_compositions(node: dict, resolve: Callable[[str], Any],
                          memo: dict[tuple[int, frozenset[str]], bool]) -> bool:
    """Whether ``node`` lists properties and its only open-ended keywords are compositions
    ``_neutral`` to them."""
    listed = node.get("properties")
    own = [key for key in _OPEN_ENDED if key in node]
    if not isinstance(listed, dict) or not own or any(
            key not in ("allOf", "anyOf", "oneOf") for key in own):
        return False
    try:
        return all(_neutral_keyword(key, node[key], frozenset(listed), resolve, memo)
                   for key in own)
    except RecursionError:
        return False


def _keyed_subschemas(node: dict) -> list[tuple[Any, str]]:
    """``node``'s subschemas, each with the keyword it is under."""
    parts: list[tuple[Any, str]] = []
    with_subschemas(node, lambda sub, key: parts.append((sub, key)))
    return parts


def _local_ref(ref: str, own_id: Any) -> str:
    """``ref`` as a fragment of the schema, where it names the root by its ``$id`` (absolute or
    relative to it: ``https://e.x/s#/$defs/a``, ``s#/$defs/a``)."""
    if not isinstance(own_id, str) or ref.startswith("#"):
        return ref
    try:
        uri, fragment = urldefrag(urljoin(own_id, ref))
        return "#" + fragment if uri == urldefrag(own_id)[0] else ref
    except ValueError:  # "http://[": the schema's checks name it
        return ref


def exact_dates(node: Any) -> Any:
    """A copy of ``node`` where every ``date``, ``date-time`` or ``time`` format has
    ``DATE_PATTERNS``'s pattern (beside its own, in an ``allOf``, where it has one): RFC 3339's
    full-date is a day of its month and year, and the grammar's format allows February 29 of
    any year (and year 0000, which Python's dates, and so jsonschema's format check, refuse),
    and a time's second 60 (a leap second jsonschema's check refuses at most times)."""
    if not isinstance(node, dict):
        return node
    out = with_subschemas(node, lambda sub, key: exact_dates(sub))
    fmt = out.get("format")  # not yet checked against the meta-schema: maybe no string
    pattern = DATE_PATTERNS.get(fmt) if isinstance(fmt, str) else None
    if pattern is None or out.get("pattern") == pattern:
        return out
    if "pattern" not in out:
        out["pattern"] = pattern
    else:  # both hold: "-02-29$" alone let 2021-02-29 through
        branches = out.get("allOf") if isinstance(out.get("allOf"), list) else []
        out["allOf"] = [*branches, {"pattern": pattern}]
    return out


def check_dated_depth(schema: Any, origin: str, limit: int = MAX_SCHEMA_DEPTH,
                      why: str = "") -> int:
    """``check_depth`` of ``schema``, and of it as the grammar writes it (``exact_dates``: a
    date's pattern beside another goes in an ``allOf``, 2 levels down) where that can pass
    ``limit``: a schema within it was refused at its first compile by llguidance's "recursion
    limit exceeded"."""
    depth = check_depth(schema, origin, limit, why)
    if depth > limit - 2:
        with recursion_room():
            dated = exact_dates(schema)
        check_depth(dated, origin, limit, f"{why} (with the date patterns its formats add)")
    return depth


def without_date_formats(node: Any) -> Any:
    """A copy of ``node`` without the ``date``, ``date-time`` and ``time`` formats that
    ``exact_dates`` put ``DATE_PATTERNS``'s pattern beside: the pattern takes no string that the
    format refuses (llguidance's formats take any year, February 29 and a second 60), so the
    pair is the pattern's language, which llguidance compiled with the format's regex beside
    it (0.25-0.4 ms each). Another format is kept, an unknown one too (its error stands)."""
    if not isinstance(node, dict):
        return node
    out = with_subschemas(node, lambda sub, key: without_date_formats(sub))
    fmt = out.get("format")
    pattern = DATE_PATTERNS.get(fmt) if isinstance(fmt, str) else None
    if pattern is not None and out.get("pattern") == pattern:
        del out["format"]
    return out


def json_schema(
    schema: dict[str, Any] | bool,
    *,
    origin: str = "schema",
    json_style: JsonStyle = JsonStyle.DUMPS,
    strict: bool = True,
) -> GrammarSource:
    """A JSON Schema given as a Python object. ``strict`` (the default) closes its objects to
    keys they do not list (``close_objects``); an object that should take others says so
    (``"additionalProperties": true`` or a schema)."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(
            f"{origin}: a JSON Schema must be an object or a boolean, got {type(schema).__name__}"
        )
    if schema is True:  # any JSON value: the empty schema (grammar compilers take objects)
        schema = {}
    try:
        depth = check_depth(schema, origin)
    except GrammarError:
        _serialisable(schema, origin)  # one that holds itself is no JSON: say so
        raise
    with recursion_room():
        try:
            written = exact_dates(close_objects(schema) if strict else schema)
            text = json.dumps(written, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise GrammarError(f"{origin}: the schema is not JSON-serialisable: {err}") from None
        except RecursionError:  # a chain of refs past the room close_objects had
            raise GrammarError(f"{origin}: the schema is nested too deeply") from None
        if depth > MAX_SCHEMA_DEPTH - 2:  # a date's pattern goes in an allOf: 2 levels down
            check_depth(written, origin, why=" (with the date patterns its formats add)")
        check_schema(schema, origin, max_depth=None)
    return GrammarSource(GrammarKind.JSON_SCHEMA, text, json_style, origin)


def _serialisable(schema: Any, origin: str) -> None:
    try:
        json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise GrammarError(f"{origin}: the schema is not JSON-serialisable: {err}") from None
    except RecursionError:  # nested past Python's stack: the caller's error says how deep
        pass


def json_schema_file(
    path: str | Path, *, json_style: JsonStyle = JsonStyle.DUMPS, strict: bool = True
) -> GrammarSource:
    """A JSON Schema read from a ``.json`` file (``strict``: see ``json_schema``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GrammarError(f"{path}: schema file {missing_file(path)}") from None
    except OSError as err:
        raise GrammarError(f"{path}: cannot read the schema: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise GrammarError(f"{path}: not UTF-8 text (byte {err.start})") from None
    return json_schema_text(text, origin=str(path), json_style=json_style, strict=strict)


def json_schema_text(
    text: str, *, origin: str, json_style: JsonStyle = JsonStyle.DUMPS, strict: bool = True
) -> GrammarSource:
    """A JSON Schema given as JSON text (a file's, standard input's) that errors name
    ``origin`` (``strict``: see ``json_schema``)."""
    try:
        schema = loads_strict(text, unique_keys=True)
    except json.JSONDecodeError as err:
        raise GrammarError(f"{origin}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from None
    except ValueError as err:
        raise GrammarError(f"{origin}: invalid JSON: {err}") from None
    return json_schema(schema, origin=origin, json_style=json_style, strict=strict)


def pydantic_model(
    model: type, *, json_style: JsonStyle = JsonStyle.DUMPS, strict: bool = True
) -> GrammarSource:
    """The JSON Schema of a pydantic model class (or any type pydantic can describe), as tools'
    and agents' output types make it: of values pydantic reads (a naive datetime without an
    offset, a Decimal within its digits; see ``GrammarJsonSchema``)."""
    from pydantic import PydanticUserError, TypeAdapter

    from agentflash.runtime.tools import GrammarJsonSchema

    name = getattr(model, "__name__", repr(model))
    try:
        schema = TypeAdapter(model).json_schema(schema_generator=GrammarJsonSchema)
    except (PydanticUserError, TypeError, ValueError) as err:
        raise GrammarError(f"{name}: pydantic cannot produce a JSON Schema: {err}") from None
    return json_schema(schema, origin=name, json_style=json_style, strict=strict)


def regex(pattern: str, *, origin: str = "regex") -> GrammarSource:
    """A regular expression (Rust ``regex`` syntax) the whole output must match."""
    if not isinstance(pattern, str):
        raise GrammarError(f"{origin}: a regex must be a string, got {type(pattern).__name__}")
    return GrammarSource(GrammarKind.REGEX, pattern, origin=origin)


def lark(text: str, *, origin: str = "grammar") -> GrammarSource:
    """A Lark grammar in llguidance's dialect (``start`` is the top rule; ``%json {...}`` and
    special tokens such as ``<tool_call>`` may appear in rules). The end token is implicit: it
    becomes legal wherever ``start`` is complete, so the grammar does not mention it (one that
    does is refused when compiled).

    A ``%json`` schema is laid out as llguidance lays it out by default, with whitespace free
    between tokens (a small model may then write newlines until max tokens); the layout of
    ``json_schema`` (``json.dumps``'s) is ``"x-guidance": {"whitespace_flexible": false,
    "item_separator": ", ", "key_separator": ": "}`` in that schema."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"{origin}: the grammar is empty")
    check_lark_finishes(text, origin)
    return GrammarSource(GrammarKind.LARK, text, origin=origin)


def _unicode_escapes(text: str) -> str:
    """GBNF's ``\\u`` (four hex digits) and ``\\U`` (eight) escapes as the converter keeps
    them whole: it strips their leading zeros (``\\u00e9`` became ``\\ue9``, which Lark
    refuses), so one below U+0100 becomes ``\\xHH`` and a larger one its character."""
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch != "\\" or i + 1 == len(text):
            out.append(ch)
            i += 1
            continue
        width = {"u": 4, "U": 8}.get(text[i + 1], 0)
        digits = text[i + 2:i + 2 + width]
        if width and len(digits) == width and all(c in "0123456789abcdefABCDEF" for c in digits):
            code = int(digits, 16)
            if code < 0x100:
                out.append(f"\\x{code:02x}")
            elif code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF:
                out.append(chr(code))
            else:
                out.append(text[i:i + 2 + width])  # left to the converter to refuse
            i += 2 + width
        else:  # another escape, \\ included: as it is
            out.append(text[i:i + 2])
            i += 2
    return "".join(out)


def ebnf(text: str, *, origin: str = "grammar") -> GrammarSource:
    """A GBNF/EBNF grammar (llama.cpp syntax, ``root ::= ...``), converted to Lark."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if not isinstance(text, str):
        raise GrammarError(f"{origin}: an EBNF grammar must be a string, got "
                           f"{type(text).__name__}")
    try:  # GBNF always: a rule named start made it look like Lark ("start ::=" has "start :")
        converted = gbnf_to_lark(_unicode_escapes(text))
    except Exception as err:  # the converter raises its own error types and plain exceptions
        if "Rule 'start' already exists" in str(err):  # it names root start
            raise GrammarError(f"{origin}: a rule named 'start' cannot be converted (root "
                               f"becomes start): rename it") from None
        raise GrammarError(f"{origin}: cannot read the EBNF grammar: {err}") from None
    try:
        return lark(converted, origin=origin)
    except GrammarError as err:  # the conversion renamed root to start: name the user's rule
        raise GrammarError(str(err).replace("rule 'start'", "rule 'root'")) from None
