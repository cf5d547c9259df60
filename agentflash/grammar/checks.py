"""Compile-time checks that need no tokenizer: is the schema well formed, can the grammar finish,
and where in a schema does a backend's error come from.

"Can finish" is productivity: a JSON Schema whose required values recurse without a base case, or
a Lark rule that only ever expands into itself, accepts no finite output, so constrained decoding
would run until ``max_tokens``. Both are caught here, naming the field or rule.
"""

from __future__ import annotations

import copy
import decimal
import functools
import json
import math
import re
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote

from agentflash.grammar.constraint import GrammarError

# --- JSON Schema -----------------------------------------------------------------------------


def pointer(parts: list[str | int]) -> str:
    """A JSON pointer ``#/a/b`` (RFC 6901 escaping) from path parts."""
    escaped = (str(p).replace("~", "~0").replace("/", "~1") for p in parts)
    return "#" + "".join("/" + p for p in escaped)


# llguidance reads a grammar's JSON with serde_json, whose parser refuses text nested deeper
# than 127 arrays and objects ("recursion limit exceeded"), and a schema's JSON goes in 3 levels
# down ({"grammars": [{"json_schema": ...}]}): 124 is the deepest schema it compiles; a Lark
# rule's %json body is read on its own: 127
MAX_SCHEMA_DEPTH = 124
MAX_JSON_BODY_DEPTH = 127


def json_depth(value: Any, limit: int) -> int:
    """How deep the dicts and lists (tuples) of ``value`` nest, as its JSON text nests (``{}``
    is 1, a string 0), counted without recursion; past ``limit`` the count stops at
    ``limit + 1`` (a value that holds itself is endless)."""
    if not isinstance(value, (dict, list, tuple)):
        return 0
    deepest, stack = 0, [(value, 1)]
    pop, push = stack.pop, stack.append
    while stack:  # (depth first: a value that holds itself is past the limit at once)
        node, depth = pop()
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list, tuple)):
                push((child, depth + 1))
    return deepest


def check_depth(schema: Any, origin: str, limit: int = MAX_SCHEMA_DEPTH, why: str = "") -> int:
    """How deep ``schema`` nests (``json_depth``); raise ``GrammarError`` if deeper than
    ``limit`` objects and arrays (``why``: what else sets the limit): measured, not found by a
    walk's RecursionError, so the verdict is the same whatever stack the caller has used."""
    depth = json_depth(schema, limit)
    if depth > limit:
        raise GrammarError(f"{origin}: the schema is nested too deeply: more than {limit} "
                           f"levels of objects and arrays, the most llguidance reads{why}")
    return depth


@contextmanager
def recursion_room(frames: int = 12 * MAX_SCHEMA_DEPTH) -> Iterator[None]:
    """Python's recursion limit ``frames`` above the caller's stack while the block runs: the
    walks of a schema recurse (jsonschema's 8 frames a level: 1,005 frames at depth 124, more
    than Python's default limit), and a schema llguidance compiles was refused as "nested too
    deeply", or not, by how deep the caller's stack was. The limit is put back when the last
    block that raised it ends (unless something else changed it meanwhile: then what it set is
    kept, and a block that raises it after the change puts that back)."""
    global _room_holders, _room_before, _room_set
    frame, used = sys._getframe(), 0
    while frame is not None:
        frame, used = frame.f_back, used + 1
    with _ROOM_LOCK:
        if _room_holders == 0 or sys.getrecursionlimit() != _room_set:
            _room_before = _room_set = sys.getrecursionlimit()
        _room_holders += 1
        if sys.getrecursionlimit() < used + frames:
            _room_set = used + frames
            sys.setrecursionlimit(_room_set)
    try:
        yield
    finally:
        with _ROOM_LOCK:
            _room_holders -= 1
            if _room_holders == 0 and sys.getrecursionlimit() == _room_set:
                sys.setrecursionlimit(_room_before)


_ROOM_LOCK = threading.Lock()
_room_holders = 0  # the blocks in ``recursion_room`` now
_room_before = _room_set = 0  # the limit before the first of them, and the one set since


def check_schema(schema: Any, origin: str, max_depth: int | None = MAX_SCHEMA_DEPTH,
                 depth_why: str = "") -> None:
    """Raise ``GrammarError`` if ``schema`` nests deeper than ``max_depth`` (``check_depth``;
    None: the caller has), breaks its meta-schema or can never be finished.

    A schema that passed is remembered (by its JSON), so that the same tools sent with every
    request are checked once (the meta-schema's check is ``meets_meta_schema``'s walk, 0.1-2 ms
    a tool schema, and jsonschema's validation, 5-15 ms, where the walk does not pass it)."""
    if max_depth is not None:
        check_depth(schema, origin, max_depth, depth_why)
    with recursion_room():
        _check_schema_once(schema, origin)


def _check_schema_once(schema: Any, origin: str) -> None:
    try:  # the schema's JSON, half a surrogate pair kept apart from a whole one's escape
        key = json.dumps(schema, sort_keys=True, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        key = None  # not JSON: checked (and refused) below
    if key is not None and _holds_tuple(schema):
        key = None  # JSON writes a tuple as a list, which the check tells apart
    with _PASSED_LOCK:  # the server prepares its requests in worker threads
        if key is not None and key in _PASSED:
            _PASSED.move_to_end(key)
            return
    try:
        _check_schema(schema, origin)
    except RecursionError:  # not within the room ``check_schema`` makes: jsonschema's walks
        raise GrammarError(f"{origin}: the schema is nested too deeply") from None
    if key is not None:
        with _PASSED_LOCK:
            _PASSED[key] = None
            if len(_PASSED) > _PASSED_SIZE:
                _PASSED.popitem(last=False)


def _holds_tuple(node: Any) -> bool:
    if isinstance(node, tuple):
        return True
    if isinstance(node, dict):
        return any(_holds_tuple(v) for v in node.values())
    return isinstance(node, list) and any(_holds_tuple(v) for v in node)


_PASSED: OrderedDict[str, None] = OrderedDict()  # the schemas ``check_schema`` passed, latest last
_PASSED_SIZE = 1024
_PASSED_LOCK = threading.Lock()


def _check_schema(schema: Any, origin: str) -> None:
    import jsonschema

    broken = _lone_surrogate(schema, [])
    if broken is not None:
        where, char = broken
        raise GrammarError(f"{origin}: {where}: holds {char!r}, half of a surrogate pair, no "
                           f"character (JSON's escape of one, or a byte that is not UTF-8)")

    if isinstance(schema, dict):
        cls = jsonschema.Draft202012Validator  # whose meta-schema names a $schema of 1 or []
        if isinstance(schema.get("$schema"), str):  # (validator_for raised on them: a 500)
            cls = jsonschema.validators.validator_for(schema, default=cls)
        if not (cls is jsonschema.Draft202012Validator and meets_meta_schema(schema)):
            meta = cls(cls.META_SCHEMA)
            error = jsonschema.exceptions.best_match(meta.iter_errors(schema))
            if error is not None:
                where = pointer(list(error.absolute_path))
                raise GrammarError(f"{origin}: {where}: not a valid JSON Schema: "
                                   f"{error.message}")
    loose = loose_option(schema)
    if loose is not None:
        raise GrammarError(f"{origin}: {loose}")
    contradiction = _contradictory_bounds(schema)
    if contradiction is not None:
        raise GrammarError(f"{origin}: {contradiction[0]}: {contradiction[1]}")
    unfinished = _unfinishable(schema)
    if unfinished is not None:
        where, reason = unfinished
        raise GrammarError(
            f"{origin}: {where}: no finite JSON value satisfies this schema: {reason}"
        )


# --- the meta-schema, fast -------------------------------------------------------------------
# jsonschema's validation of a schema against draft 2020-12's meta-schema costs 5-15 ms a tool
# schema (most of it resolving $ref and $dynamicRef on every step), and a new tool pays it on its
# first use. ``meets_meta_schema`` walks the same meta-schema, compiled once into closures, and
# answers only "it passes": anything else (a fault, a value it does not know how jsonschema
# reads) goes to jsonschema, whose error names the field.


class _Unsure(Exception):
    """A value whose verdict ``meets_meta_schema`` leaves to jsonschema."""


_META_URI = "https://json-schema.org/draft/2020-12/schema"
# keywords that only annotate: they pass every value
_META_ANNOTATIONS = frozenset({"$schema", "$id", "$vocabulary", "$dynamicAnchor", "$defs",
                               "$comment", "title", "description", "default", "deprecated",
                               "format"})  # format: jsonschema checks none without a checker
_TYPE_TESTS: dict[str, Callable[[Any], bool]] = {  # jsonschema's draft 2020-12 type checker
    "array": lambda v: isinstance(v, list),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: not isinstance(v, bool) and (
        isinstance(v, int) or isinstance(v, float) and v.is_integer()),
    "null": lambda v: v is None,
    "number": lambda v: not isinstance(v, bool) and isinstance(v, (int, float)),
    "object": lambda v: isinstance(v, dict),
    "string": lambda v: isinstance(v, str),
}
_Test = Callable[[Any], bool]
_meta_test: _Test | None = None
_META_LOCK = threading.Lock()


def meets_meta_schema(schema: Any) -> bool:
    """True where ``schema`` (plain JSON values) surely passes draft 2020-12's meta-schema as
    jsonschema validates it; False where it fails or the walk is unsure (jsonschema decides)."""
    global _meta_test
    if _meta_test is None:
        with _META_LOCK:
            if _meta_test is None:
                try:
                    _meta_test = _compile_meta()
                except (_Unsure, ImportError):  # another meta-schema: jsonschema's to walk
                    _meta_test = lambda value: False  # noqa: E731
    try:
        return _meta_test(schema)
    except (_Unsure, RecursionError):
        return False


def _compile_meta() -> _Test:
    """The 2020-12 meta-schema as one test (its ``$dynamicRef: #meta`` s resolve to the root:
    every vocabulary's meta-schema has that anchor, and validation starts at the root)."""
    from urllib.parse import urldefrag, urljoin

    from jsonschema_specifications import REGISTRY

    compiled: dict[str, _Test] = {}

    def ref_test(uri: str) -> _Test:
        def late(value: Any) -> bool:  # refs may cycle: resolved on first use
            return compiled[uri](value)
        if uri not in compiled:
            compiled[uri] = late  # placeholder while compiling
            document, fragment = urldefrag(uri)
            node = resolve_ref(REGISTRY.contents(document), "#" + fragment)
            if node is None:
                raise _Unsure(uri)
            compiled[uri] = test(node, document)
        return late

    def test(node: Any, base: str) -> _Test:
        if node is True:
            return lambda value: True
        if not isinstance(node, dict):
            raise _Unsure(repr(node))
        if node.get("$dynamicAnchor", "meta") != "meta":
            raise _Unsure(node["$dynamicAnchor"])
        parts = [keyword(name, arg, node, base) for name, arg in node.items()
                 if name not in _META_ANNOTATIONS]
        return _all_of(parts)

    def keyword(name: str, arg: Any, node: dict, base: str) -> _Test:
        if name == "$ref":
            return ref_test(urljoin(base, arg))
        if name == "$dynamicRef":
            if arg != "#meta":
                raise _Unsure(arg)
            return ref_test(_META_URI)
        if name == "allOf":
            return _all_of([test(sub, base) for sub in arg])
        if name == "anyOf":
            subs = [test(sub, base) for sub in arg]
            return lambda value: any(sub(value) for sub in subs)
        if name == "type":
            tests = [_TYPE_TESTS[t] for t in ([arg] if isinstance(arg, str) else arg)]
            return lambda value: any(t(value) for t in tests)
        if name == "enum":
            if not all(isinstance(v, str) for v in arg):
                raise _Unsure(repr(arg))
            allowed = frozenset(arg)  # jsonschema: a string equals only the same string
            return lambda value: isinstance(value, str) and value in allowed
        if name == "properties":
            props = {key: test(sub, base) for key, sub in arg.items()}

            def listed(value: Any) -> bool:
                if isinstance(value, dict):
                    for k, v in value.items():
                        if k in props and not props[k](v):
                            return False
                return True
            return listed
        if name == "additionalProperties":
            if "patternProperties" in node:
                raise _Unsure(name)
            listed, extra = set(node.get("properties", {})), test(arg, base)
            return lambda value: not isinstance(value, dict) or all(
                extra(v) for k, v in value.items() if k not in listed)
        if name == "propertyNames":
            names = test(arg, base)
            return lambda value: not isinstance(value, dict) or all(map(names, value))
        if name == "items":
            if "prefixItems" in node:
                raise _Unsure(name)
            each = test(arg, base)
            return lambda value: not isinstance(value, list) or all(map(each, value))
        if name == "minItems":
            return lambda value: not isinstance(value, list) or len(value) >= arg
        if name == "uniqueItems":
            return lambda value: not arg or not isinstance(value, list) or _unique(value)
        if name == "pattern":
            compiled_pattern = re.compile(arg)
            return lambda value: (not isinstance(value, str)
                                  or compiled_pattern.search(value) is not None)
        if name in ("minimum", "exclusiveMinimum"):
            number = _TYPE_TESTS["number"]
            if name == "minimum":
                return lambda value: not number(value) or value >= arg
            return lambda value: not number(value) or value > arg
        raise _Unsure(name)  # a keyword this walk does not know: jsonschema validates

    root = ref_test(_META_URI)

    def guarded(value: Any) -> bool:
        _plain_json(value)
        return root(value)

    return guarded


def _all_of(parts: list[_Test]) -> _Test:
    """One test of ``parts`` all passing, in their order (a loop: the meta-schema's nested
    allOf of vocabularies ran a generator per node and level)."""
    if len(parts) == 1:
        return parts[0]

    def every(value: Any) -> bool:
        for part in parts:
            if not part(value):
                return False
        return True
    return every


def _unique(items: list) -> bool:
    if not all(isinstance(item, str) for item in items):
        raise _Unsure("uniqueItems")  # jsonschema's equality of other values: its own to apply
    return len(set(items)) == len(items)


def _plain_json(value: Any) -> None:
    """Raise ``_Unsure`` unless ``value`` is made of JSON's own values (dicts with string keys,
    lists, strings, finite numbers, booleans, None), whose reading by jsonschema the walk
    follows."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _Unsure(repr(key))
            _plain_json(item)
    elif isinstance(value, list):
        for item in value:
            _plain_json(item)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _Unsure(repr(value))
    elif not (value is None or isinstance(value, (str, int))):  # bool is an int
        raise _Unsure(type(value).__name__)


# llguidance's options (a schema's "x-guidance") that let it write what the schema refuses
_LOOSE_OPTIONS = {
    "lenient": "llguidance then drops the keywords it cannot hold (not, if, ...)",
    "coerce_one_of": "llguidance then reads oneOf as anyOf, a value matching several branches",
}


def loose_option(schema: Any) -> str | None:
    """Where ``schema`` turns on an llguidance option under which the grammar writes values the
    schema refuses, and why that is refused; None if it turns on none."""
    options = schema.get("x-guidance") if isinstance(schema, dict) else None
    for name, why in _LOOSE_OPTIONS.items():
        if isinstance(options, dict) and options.get(name):
            return (f"#/x-guidance/{name}: refused: {why}, and the output would not match "
                    f"the schema")
    return None


def _lone_surrogate(node: Any, path: list[str | int]) -> tuple[str, str] | None:
    """Where a string of ``node`` (a key or a value) holds a lone surrogate, and that character;
    None if none does."""
    if isinstance(node, str):
        try:
            node.encode("utf-8")
        except UnicodeEncodeError as err:
            return pointer(path), node[err.start]
        return None
    items = (node.items() if isinstance(node, dict) else enumerate(node)
             if isinstance(node, list) else ())
    for key, value in items:
        found = _lone_surrogate(key, path) if isinstance(key, str) else None
        if found is not None:
            return f"{found[0]}, the key {key!r}", found[1]
        found = _lone_surrogate(value, [*path, key])
        if found is not None:
            return found
    return None


_BOUNDS = (
    ("minimum", "maximum"),
    ("exclusiveMinimum", "maximum"),
    ("minimum", "exclusiveMaximum"),
    ("exclusiveMinimum", "exclusiveMaximum"),
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
    ("minContains", "maxContains"),
)


def _contradictory_bounds(schema: Any) -> tuple[str, str] | None:
    """(pointer, message) of the first subschema whose lower bound exceeds its upper bound.

    Even where the schema stays satisfiable (an optional property that can then never appear),
    such a pair is a mistake worth reporting rather than silently dropping the field.
    """
    for path, node in subschemas(schema, []):
        if not isinstance(node, dict):
            continue
        for low_key, high_key in _BOUNDS:
            low, high = node.get(low_key), node.get(high_key)
            if low is None or high is None or not all(  # (most nodes have neither)
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)
            ):
                continue
            strict = low_key.startswith("exclusive") or high_key.startswith("exclusive")
            if low > high or (strict and low == high):
                return pointer(path), f"{low_key} ({low}) leaves no value under {high_key} ({high})"
        found = (_no_integer_between(node) or _no_value_of_type(node)
                 or _bounds_llguidance_misreads(node))
        if found:
            return pointer(path), found
    return None


_EXACT_INTEGERS = 2**53  # past it a float (llguidance reads bounds as floats) skips integers


def _float_holds(value: int | float) -> bool:
    try:
        return float(value) == value
    except OverflowError:  # past a float altogether
        return False


def _bounds_llguidance_misreads(node: dict) -> str | None:
    """Bounds llguidance (1.9) turns into a range that lets a value past them through, where
    the output would then fail its schema: an integer's past 2^53 (read as floats:
    maximum 12345678901234567 let 12345678901234568 through), and an exclusive bound at a whole
    number N, nearer zero, whose range lies within one unit of it (exclusiveMinimum 0 with
    maximum 0.5 let 0 through)."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    bounds = {k: v for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
              if _is_number(v := node.get(k))}
    if "integer" in types:
        for key, value in bounds.items():
            if abs(value) > _EXACT_INTEGERS and not _float_holds(value) and value != 2**63 - 1:
                return (f"{key} ({value}) is past 2^53 ({_EXACT_INTEGERS}) and no float's, "
                        f"where llguidance reads bounds as floats (and so lets integers past "
                        f"them through or refuses the bound itself): leave the bound out, or "
                        f"give one a float holds, of at most 10^17 (llguidance builds no "
                        f"range from a minimum of 2^60), or a maximum of 2^63 - 1")
    if "number" not in types:
        return None
    low, high = bounds.get("exclusiveMinimum"), bounds.get("exclusiveMaximum")
    upper = min((v for k, v in bounds.items() if k.endswith("aximum")), default=None)
    lower = max((v for k, v in bounds.items() if k.endswith("inimum")), default=None)
    # an exclusive edge that an inclusive bound on its side keeps out already is no matter
    for key, edge, other, inside in (
            ("exclusiveMinimum", low, upper, low is not None and low >= 0 and upper is not None
             and upper < low + 1 and not bounds.get("minimum", low) > low),
            ("exclusiveMaximum", high, lower, high is not None and high < 0 and lower is not None
             and lower > high - 1 and not bounds.get("maximum", high) < high)):
        if inside and float(edge).is_integer():
            instead = (f"minimum {edge + 1e-6:g}" if key == "exclusiveMinimum"
                       else f"maximum {edge - 1e-6:.7g}")
            return (f"{key} ({edge}) with the range within one unit of it ({other}): "
                    f"llguidance lets {int(edge)} itself through there; give an inclusive "
                    f"bound a fraction past it instead (e.g. {instead}) or widen the range")
    return None


def inexact_value(schema: Any, backend: str) -> tuple[str, Any] | None:
    """(pointer, number) of the first number in an ``enum`` or ``const`` of ``schema`` (in an
    object or array value too) that ``backend`` ("llguidance" or "outlines") may write as
    another number, or None. Both read a schema's numbers with serde_json's parser, which is
    exact for an integer (to 64 bits) and for a float whose shortest digits are below 2^53
    with a decimal exponent within 22 (one exact product or quotient of exact floats); else it
    may be a unit in the last place off (``0.1234567891234567`` and ``-1.5e-300`` came back
    as other floats). llguidance then writes a number through a float: an integer past 2^53
    as its float (9007199254740993 as ...992), and a whole float without an exponent (1.5e300
    as '15' and 299 zeros, which Python reads as an integer, not 1.5e300); outlines-core writes
    an integer of 64 bits as it is and a float in its shortest digits, but an integer past 64
    bits as a float (1.2345678901234568e+29). An integer whose float is -2^63 is refused on
    both: llguidance crashes the process on it (a segmentation fault; 1.9.1), and outlines'
    compile checks against it."""
    for path, node in _objects(schema, []):
        for key in ("const", "enum"):
            if key in node:
                for value in _numbers(node[key]):
                    if not _writes_exactly(value, backend):
                        return pointer(path + [key]), value
    return None


def _objects(node: Any, path: list[str | int]) -> Iterator[tuple[list[str | int], dict]]:
    """Every object of a schema but those inside a ``const`` or an ``enum`` (whose numbers are
    read whole), under a keyword or not: a ``$ref`` reaches any of them (``#/foo`` beside the
    schema's keywords, ``#/default``), and llguidance read a number there it crashes on. A map
    of names to subschemas (``properties``) is no schema: a property named ``const`` is a
    subschema. (Over-strict where no ``$ref`` reaches: an ``x-example`` holding ``{"const":
    2**60 + 1}`` is refused.)"""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _objects(item, path + [i])
    elif isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    yield from _objects(sub, path + [key, name])
            elif key not in ("const", "enum"):
                yield from _objects(value, path + [key])


# keywords whose value maps names to subschemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def inexact_message(value: int | float, backend: str) -> str:
    """Why ``inexact_value``'s ``value`` is refused, and what to give instead."""
    reader = "llguidance" if backend == "llguidance" else "outlines-core"
    if isinstance(value, int) and -_INT64 * 2 < value < _INT64 * 2 and float(value) == -_INT64:
        why = "llguidance crashes on an integer whose float is -2^63"
    elif isinstance(value, int):
        why = (f"{reader} reads an integer past "
               f"{'2^53 as a float' if backend == 'llguidance' else '64 bits as a float'}")
    else:
        why = (f"{reader} reads a number of more than 15 digits or an exponent past 22 "
               f"inexactly")
    return (f"{json.dumps(value)} would be written as another number ({why}): give it as a "
            f"string, or a number it holds exactly")


def _numbers(value: Any) -> Iterator[int | float]:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)


_INT64 = 2**63


def _writes_exactly(value: int | float, backend: str) -> bool:
    if isinstance(value, int):
        if abs(value) <= _EXACT_INTEGERS:
            return True
        if not -_INT64 * 2 < value < _INT64 * 2 or float(value) == -_INT64:
            return False
        if backend == "outlines":  # (serde_json's i64 and u64, written as they are)
            return -_INT64 <= value < _INT64 * 2
        return float(value) == value and abs(value) < _INT64  # (written as the float's i64)
    if not math.isfinite(value):
        return True  # (not JSON: the schema's own check refuses it)
    sign, digits, exponent = decimal.Decimal(repr(value)).as_tuple()
    significand = int("".join(map(str, digits)))
    if significand >= _EXACT_INTEGERS or abs(exponent) > 22:
        return False  # serde_json's parse may be a unit in the last place off
    if backend == "llguidance" and value.is_integer():  # its digits, no exponent: an integer
        return int(decimal.Decimal(repr(value))) == value
    return True


def _is_number(value: Any) -> bool:
    """A JSON number (an int of any size: math.isfinite would overflow on one past a float)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _no_integer_between(node: dict) -> str | None:
    """Why an integer schema's bounds, each consistent, hold no integer (1.2 to 1.8)."""
    if node.get("type") != "integer":
        return None
    bounds = {k: v for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
              if _is_number(v := node.get(k))}
    # the least and the greatest integer each bound allows, with the bound
    lows = [(math.ceil(v) if k == "minimum" else math.floor(v) + 1, k, v)
            for k, v in bounds.items() if k.endswith("inimum")]
    highs = [(math.floor(v) if k == "maximum" else math.ceil(v) - 1, k, v)
             for k, v in bounds.items() if k.endswith("aximum")]
    if not lows or not highs:
        return None
    low, high = max(lows), min(highs)
    if low[0] > high[0]:
        return f"no integer lies between {low[1]} ({low[2]}) and {high[1]} ({high[2]})"
    return None


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: _is_number(v) and (isinstance(v, int) or v.is_integer()),
    "number": _is_number,
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _no_value_of_type(node: dict) -> str | None:
    """Why an ``enum`` or ``const`` holds no value of the node's ``type``."""
    for key, types, values in _typed_values(node):
        if values and not any(_JSON_TYPES[t](v) for v in values for t in types):
            return f"no value of {key} is of type {' or '.join(types)}"
    return None


def value_outside_type(node: dict) -> tuple[str, Any] | None:
    """(``enum`` or ``const``, a value of it that is of no type of the node's ``type``), or
    None: JSON Schema refuses that value, where a backend that reads only the values writes it."""
    for key, types, values in _typed_values(node):
        for value in values:
            if not any(_JSON_TYPES[t](value) for t in types):
                return key, value
    return None


def _typed_values(node: dict) -> Iterator[tuple[str, list[str], list[Any]]]:
    """(``enum`` or ``const``, the node's types, its values) of each the node has, where its
    ``type`` names JSON types."""
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not all(t in _JSON_TYPES for t in types):
        return
    if isinstance(node.get("enum"), list):
        yield "enum", types, node["enum"]
    if "const" in node:
        yield "const", types, [node["const"]]


def resolve_ref(root: Any, ref: str, anchors: dict[str, Any] | None = None) -> Any:
    """The subschema a local ``$ref`` points at (a JSON pointer, or a ``$anchor``'s name), or
    None if it is not a local one. ``anchors``: ``anchor_index(root)``, for a caller resolving
    many refs (each would walk the schema)."""
    if not ref.startswith("#"):
        return None
    if ref != "#" and not ref.startswith("#/"):  # "#num": the subschema whose $anchor is num
        return (anchor_index(root) if anchors is None else anchors).get(ref[1:])
    node = root
    for raw in ref[1:].split("/")[1:]:  # a URI fragment: percent-encoded ("a%20b"), then ~
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def unresolved_ref(schema: Any) -> tuple[str, str] | None:
    """(pointer, ref) of the first ``$ref`` or ``$dynamicRef`` that does not point inside
    ``schema`` (a URL, which validating it would fetch; a pointer or anchor to nothing), or
    None."""
    anchors = anchor_index(schema)
    for path, node in subschemas(schema, []):
        for keyword in ("$ref", "$dynamicRef"):
            ref = node.get(keyword) if isinstance(node, dict) else None
            if ref is not None and (not isinstance(ref, str)
                                    or resolve_ref(schema, ref, anchors) is None):
                return pointer(path + [keyword]), ref
    return None


def anchor_index(root: Any) -> dict[str, Any]:
    """Each anchor's name to the first subschema that declares it (a ``$dynamicAnchor`` names
    its subschema for a plain ``#name`` too)."""
    index: dict[str, Any] = {}
    for _, node in subschemas(root, []):
        if isinstance(node, dict):
            for keyword in ("$anchor", "$dynamicAnchor"):
                name = node.get(keyword)
                if isinstance(name, str):
                    index.setdefault(name, node)
    return index


class _Productivity:
    """Which subschemas admit a finite instance (least fixpoint over ``$ref`` targets)."""

    def __init__(self, root: Any):
        self.root = root
        self.anchors = anchor_index(root)
        self.known: set[str] = set()  # refs whose target admits a finite instance
        refs = sorted(set(_local_refs(root)))
        changed = True
        while changed:
            changed = False
            for ref in refs:
                target = resolve_ref(root, ref, self.anchors)
                if ref not in self.known and (target is None or self.finite(target)):
                    self.known.add(ref)
                    changed = True

    def finite(self, node: Any) -> bool:
        return not list(self.blockers(node))

    def blockers(self, node: Any) -> Iterator[tuple[list[str | int], Any]]:
        """(relative path, subschema) of each part that keeps ``node`` from a finite instance;
        a ``$ref`` part yields its ref string as the subschema."""
        if node is False:
            yield [], False
            return
        if not isinstance(node, dict) or "enum" in node or "const" in node:
            return
        ref = node.get("$ref")
        if (isinstance(ref, str) and ref not in self.known
                and resolve_ref(self.root, ref, self.anchors) is not None):
            yield ["$ref"], ref
        for i, sub in enumerate(node.get("allOf", [])):
            if not self.finite(sub):
                yield ["allOf", i], sub
        for key in ("anyOf", "oneOf"):
            subs = node.get(key)
            if subs and not any(self.finite(s) for s in subs):
                yield [key, 0], subs[0]
        parts = list(_all_of_parts(node, []))  # the node and what its allOf adds to it
        types = next((p["type"] for _, p in parts if "type" in p), None)
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or set(types) - {"object", "array"}:
            return
        options = []
        if "object" in types:
            options.append(list(self._object_blockers(parts)))
        if "array" in types:
            options.append(list(self._array_blockers(node)))
        if options and all(options):  # no listed type admits a finite instance
            yield from options[0]

    def _object_blockers(self, parts: list[tuple[list[str | int], dict]]
                         ) -> Iterator[tuple[list[str | int], Any]]:
        """What keeps an object of ``parts`` (a node and its allOf subschemas, all of which it
        must satisfy) from a finite instance: a required property, or the properties that
        ``minProperties`` asks for beyond the required ones, that no finite value can fill."""
        required = list(dict.fromkeys(n for _, p in parts for n in p.get("required", [])
                                      if isinstance(n, str)))
        for name in required:
            for path, sub in _property_schemas(parts, name):
                if not self.finite(sub):
                    yield path, sub
                    break
        wanted = max([p.get("minProperties", 0) for _, p in parts
                      if isinstance(p.get("minProperties", 0), int)] or [0])
        if wanted <= len(required):
            return
        listed = {n for _, p in parts for n in p.get("properties", {}) if n not in required}
        fillable = [n for n in listed
                    if all(self.finite(sub) for _, sub in _property_schemas(parts, n))]
        if len(required) + len(fillable) >= wanted:
            return
        for path, part in parts:  # other names: each part's patterns or additionalProperties
            others = [(path + ["patternProperties", k], v)
                      for k, v in part.get("patternProperties", {}).items()]
            others.append((path + ["additionalProperties"], part.get("additionalProperties", True)))
            if not any(self.finite(sub) for _, sub in others):
                yield others[-1]
                return

    def _array_blockers(self, node: dict) -> Iterator[tuple[list[str | int], Any]]:
        prefix = node.get("prefixItems", [])
        # past the prefix every item is ``items``: one look (a loop to ``minItems`` of 1e23
        # never ended)
        wanted = node.get("minItems", 0)
        if not isinstance(wanted, int):  # 2.0: the compile names it (a TypeError here)
            return
        for i in range(min(wanted, len(prefix) + 1)):
            if i < len(prefix):
                if not self.finite(prefix[i]):
                    yield ["prefixItems", i], prefix[i]
            elif not self.finite(node.get("items", True)):
                yield ["items"], node["items"]
                return


def _all_of_parts(node: dict, path: list[str | int]
                  ) -> Iterator[tuple[list[str | int], dict]]:
    """``node`` and, depth first, the object subschemas of its ``allOf``, with their paths."""
    yield path, node
    for i, sub in enumerate(node.get("allOf", [])):
        if isinstance(sub, dict):
            yield from _all_of_parts(sub, path + ["allOf", i])


def _property_schemas(parts: list[tuple[list[str | int], dict]], name: str
                      ) -> Iterator[tuple[list[str | int], Any]]:
    """Each schema a property ``name`` must match, one per part: its entry in ``properties``,
    else those of the ``patternProperties`` that match it, else ``additionalProperties``."""
    for path, part in parts:
        props = part.get("properties", {})
        if name in props:
            yield path + ["properties", name], props[name]
            continue
        patterns = part.get("patternProperties", {})
        matches = {k: matches_pattern(k, name) for k in patterns}
        if None in matches.values():
            continue  # a pattern Python cannot read: what the name must match is not known
        matched = [(path + ["patternProperties", k], v) for k, v in patterns.items()
                   if matches[k]]
        if matched:
            yield from matched
        elif "additionalProperties" in part:
            yield path + ["additionalProperties"], part["additionalProperties"]


def matches_pattern(pattern: str, name: str) -> bool | None:
    """Whether a ``patternProperties`` pattern matches ``name``; None for a pattern Python's
    ``re`` cannot read (``\\p{Lu}``), whose part then refuses nothing: these checks must never
    refuse a schema that can finish."""
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return None


def _local_refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            yield ref
        for value in node.values():
            yield from _local_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _local_refs(value)


def _unfinishable(schema: Any) -> tuple[str, str] | None:
    """(pointer of the culprit, why) if no finite instance exists."""
    prod = _Productivity(schema)
    if prod.finite(schema):
        return None
    path: list[str | int] = []
    node, seen = schema, set()
    while True:
        path_part, sub = next(iter(prod.blockers(node)))
        if path_part == ["$ref"]:
            if sub in seen:
                return pointer(path), (
                    f"the required value there refers back to {sub} without "
                    "an alternative that ends the recursion"
                )
            seen.add(sub)
            node = resolve_ref(schema, sub, prod.anchors)
            path = _ref_path(sub)
            continue
        if path_part == []:
            return pointer(path), "the schema there is false"
        path, node = path + path_part, sub


def _ref_path(ref: str) -> list[str | int]:
    return [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/")[1:]]


# where a JSON Schema holds subschemas: maps of them, lists of them, and single ones
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_SINGLES = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)


# any of them (most subschemas, a string's or a number's, hold none: looked up at once)
SCHEMA_KEYWORDS = frozenset(SCHEMA_MAPS + SCHEMA_LISTS + SCHEMA_SINGLES)


def _children(node: Any) -> Iterator[tuple[list[str | int], Any]]:
    if not isinstance(node, dict) or node.keys().isdisjoint(SCHEMA_KEYWORDS):
        return
    for key in SCHEMA_MAPS:
        for name, sub in (node.get(key) or {}).items():
            yield [key, name], sub
    for key in SCHEMA_LISTS:
        for i, sub in enumerate(node.get(key) or []):
            yield [key, i], sub
    for key in SCHEMA_SINGLES:
        sub = node.get(key)
        if isinstance(sub, list):  # draft-04 style tuple ``items``
            for i, item in enumerate(sub):
                yield [key, i], item
        elif isinstance(sub, (dict, bool)) and key in node:
            yield [key], sub


def subschemas(node: Any, path: list[str | int]) -> Iterator[tuple[list[str | int], Any]]:
    """(path, subschema) of ``node`` and every schema inside it, ``path`` first."""
    yield path, node
    for part, sub in _children(node):
        yield from subschemas(sub, path + part)


# the keywords that apply a subschema to the same value (no step into it): a loop of them and
# $refs checks a value against itself without end
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas")


def ref_loop(schema: Any) -> str | None:
    """The pointer of a subschema the root reaches whose ``$ref`` or ``$dynamicRef`` (through
    ``allOf``, ``anyOf``, ``not`` and the like, never a step into a property or an item) leads
    back to itself, or None. A validator recurses there until Python's limit, for the values
    that reach it."""
    where: dict[int, str] = {id(node): pointer(path) for path, node in subschemas(schema, [])
                             if isinstance(node, dict)}
    anchors = anchor_index(schema)

    def refs(node: dict) -> Iterator[Any]:
        for keyword in ("$ref", "$dynamicRef"):
            ref = node.get(keyword)
            if isinstance(ref, str):
                target = resolve_ref(schema, ref, anchors)
                if isinstance(target, dict):  # (under a keyword of no schema's too)
                    where.setdefault(id(target), ref)
                    yield target

    def in_place(node: dict) -> Iterator[Any]:
        yield from refs(node)
        for key in _IN_PLACE:
            sub = node.get(key)
            if isinstance(sub, list):
                yield from sub
            elif isinstance(sub, dict):
                yield from (sub.values() if key == "dependentSchemas" else [sub])

    def reached(node: dict) -> Iterator[Any]:  # every subschema a value may be checked against
        yield from refs(node)
        for part, sub in _children(node):
            if part[0] not in ("$defs", "definitions"):  # (a definition is reached by a ref)
                yield sub

    # the subschemas the root reaches (an unused $defs entry is never checked against)
    seen: dict[int, dict] = {}
    todo = [schema] if isinstance(schema, dict) else []
    while todo:
        node = todo.pop()
        if id(node) not in seen:
            seen[id(node)] = node
            todo.extend(sub for sub in reached(node) if isinstance(sub, dict))
    state: dict[int, int] = {}  # 1: on the path being walked, 2: done
    for start, node in seen.items():
        if start in state:
            continue
        state[start] = 1
        stack = [(start, iter(in_place(node)))]
        while stack:
            current, successors = stack[-1]
            step = next(successors, None)
            if step is None:
                state[current] = 2
                stack.pop()
            elif isinstance(step, dict):
                if state.get(id(step)) == 1:
                    return where.get(id(step), "#")
                if id(step) not in state:
                    state[id(step)] = 1
                    stack.append((id(step), iter(in_place(step))))
    return None


# Assertion keywords, with the values that assert nothing.
_ASSERTIONS = {
    "minimum": None,
    "maximum": None,
    "exclusiveMinimum": None,
    "exclusiveMaximum": None,
    "multipleOf": None,
    "minLength": 0,
    "maxLength": None,
    "pattern": None,
    "format": None,
    "minItems": 0,
    "maxItems": None,
    "uniqueItems": False,
    "minProperties": 0,
    "maxProperties": None,
    "dependentRequired": None,
    "patternProperties": None,
    "propertyNames": None,
    "contains": None,
}


# why ``uniqueItems`` (a set's schema) is refused, by both backends (llguidance said only
# 'Unimplemented keys: ["uniqueItems"]'): a grammar writes an array's items one after another
# and cannot keep them apart
UNIQUE_ITEMS_REFUSED = ("uniqueItems is not supported (a set's or frozenset's schema; a false "
                        "one asks nothing: leave it out): the grammar cannot keep an array's "
                        "items apart; use a list (list[...], an array without uniqueItems)")


class UncheckedSubschema(Exception):
    """A subschema with an assertion that the backend cannot compile on its own (a ``$ref`` into
    its root's ``properties``), nor the whole schema without it: whether it keeps the assertion
    cannot be checked."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where, self.message = where, message


# Count keywords, with the value one step looser: a backend may keep some of a bound's values and
# not others (outlines-core 0.2.14 writes minProperties 2 as 1, maxProperties 1 as none), which
# the form with and without the keyword cannot show
_COUNTS = {
    "minLength": -1,
    "maxLength": 1,
    "minItems": -1,
    "maxItems": 1,
    "minProperties": -1,
    "maxProperties": 1,
}


def ignored_keyword(schema: Any, output_of: Callable[[Any], str]
                    ) -> tuple[str, str, tuple[int, int] | None] | None:
    """(pointer, keyword, counts) of an assertion a backend silently ignores, or None.

    ``output_of`` compiles a standalone schema to the backend's own form (a regex for
    outlines-core) or raises ValueError or TypeError; an assertion whose removal leaves that
    form unchanged was ignored (``counts`` None), and the backend would let values through that
    the schema rejects. So was a count (``_COUNTS``) whose form is that of the count one step
    looser (``counts``: (2, 1) where minProperties 2's is 1's, which lets a one-key object
    through). One
    the form cannot do without (compiling fails without it: a ``format`` the backend does not
    know beside a ``pattern``) was not. A subschema that does not compile on its own is judged
    in the whole schema (the whole's form without the assertion where it stands);
    ``UncheckedSubschema`` where the whole does not compile either.
    """
    roots = schema if isinstance(schema, dict) else {}
    defs = {k: roots[k] for k in ("$defs", "definitions") if k in roots}
    whole: list[Any] = []  # the whole schema's form, once one subschema needs it

    def in_context(path: list[str | int], keyword: str, value: Any, err: Exception) -> Any:
        try:
            if not whole:
                whole.append(output_of(schema))
            return whole[0], output_of(_replaced(schema, path, keyword, value))
        except (ValueError, TypeError):
            raise UncheckedSubschema(pointer(path), " ".join(str(err).split())) from None

    for path, node in subschemas(schema, []):  # $defs too: a $ref reaches what they assert
        if not isinstance(node, dict):
            continue
        asserted = [k for k, no_op in _ASSERTIONS.items() if k in node and node[k] != no_op]
        if not asserted:
            continue
        standalone = {**node, **{k: v for k, v in defs.items() if k not in node}}
        try:
            alone: Any = output_of(standalone)
        except (ValueError, TypeError) as err:
            alone = err
        for keyword in asserted:
            count = node[keyword]
            looser = None
            if (keyword in _COUNTS and isinstance(count, int) and not isinstance(count, bool)
                    and count + _COUNTS[keyword] >= 0):
                looser = count + _COUNTS[keyword]
            for value in (_ABSENT, looser) if looser is not None else (_ABSENT,):
                try:
                    if isinstance(alone, Exception):
                        kept, other = in_context(path, keyword, value, alone)
                    else:
                        kept = alone
                        other = output_of(_replaced(standalone, [], keyword, value))
                except (ValueError, TypeError):
                    continue
                if other == kept:
                    return pointer(path), keyword, None if value is _ABSENT else (count, value)
    return None


_ABSENT = object()  # (a keyword left out)


def _replaced(schema: Any, path: list[str | int], keyword: str, value: Any) -> Any:
    """A copy of ``schema`` whose subschema at ``path`` has ``keyword`` set to ``value``, or
    left out (``_ABSENT``)."""
    if not path:
        copied = {k: v for k, v in schema.items() if k != keyword}
        if value is not _ABSENT:
            copied[keyword] = value
        return copied
    copied = copy.copy(schema)
    copied[path[0]] = _replaced(schema[path[0]], path[1:], keyword, value)
    return copied


def locate_schema_error(schema: Any, error_of: Callable[[Any], str | None],
                        same_error: bool = False) -> str:
    """The pointer of the deepest subschema that fails on its own (``error_of`` returns the
    backend's error for a standalone schema, or None); ``#`` when only the whole one fails.
    With ``same_error``, only a subschema that fails with its parent's error: one failing for
    a reason of its own is not where the whole one's error is (a ``propertyNames`` at the root
    beside a property whose ``not`` fails too).

    Each subschema is tried with the root's ``$defs``/``definitions`` so that local refs resolve.
    """
    roots = schema if isinstance(schema, dict) else {}
    defs = {k: roots[k] for k in ("$defs", "definitions") if k in roots}
    path: list[str | int] = []
    node = schema
    error = error_of(schema) if same_error else None
    while True:
        for part, sub in _children(node):
            standalone = (
                {**sub, **{k: v for k, v in defs.items() if k not in sub}}
                if isinstance(sub, dict)
                else sub
            )
            found = error_of(standalone)
            if found is not None and (not same_error or found == error):
                path, node = path + part, sub
                break
        else:
            return pointer(path)


# --- Lark ------------------------------------------------------------------------------------

_LARK_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r]+|\\\n)
  | (?P<nl>\n)
  | (?P<comment>(//|\#)[^\n]*)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<special><[^<>\s]+>)
  | (?P<directive>%[a-z_]+)
  | (?P<name>@?[_a-zA-Z][_a-zA-Z0-9]*(?:-[_a-zA-Z0-9]+)*)
  | (?P<number>\d+)
  | (?P<op>\.\.|->|::|[:|()\[\]?*+{},~=&.!^])
""",
    re.VERBOSE,
)


class _Unparsed(Exception):
    """The text uses syntax this checker does not follow; llguidance still checks it."""


@functools.lru_cache(maxsize=4)
def _lark_tokens(text: str) -> tuple[tuple[str, str], ...]:
    """The tokens of a Lark grammar's ``text``, but its whitespace and comments; memoised: a
    turn's grammar is read five times at its first use (its checks when built, then
    ``json_bodies``, ``special_tokens`` and ``written_literals`` when compiled), 0.1 ms each at
    four tools."""
    tokens, pos = [], 0
    while pos < len(text):
        match = _LARK_TOKEN.match(text, pos)
        if match is None:
            raise _Unparsed(text[pos : pos + 20])
        kind = match.lastgroup
        assert kind is not None
        if kind == "directive" and text[match.end() :].lstrip(" \t").startswith("{"):
            start = text.index("{", match.end())
            end = _json_object_end(text, start)
            tokens.append(("json", text[pos:end]))
            pos = end
            continue
        if kind not in ("ws", "comment"):
            tokens.append((kind, match.group()))
        pos = match.end()
    return tuple(tokens)


def special_tokens(text: str) -> list[str] | None:
    """The special tokens (``<|im_end|>``, ``<[2]>``) a Lark grammar writes: outside its strings
    and ``%json`` bodies, where the same characters are text; None if the checker cannot read
    the grammar."""
    try:
        return [value for kind, value in _lark_tokens(text) if kind == "special"]
    except _Unparsed:
        return None


def written_literals(lark_text: str | None, schema: Any = None) -> list[tuple[str, str]]:
    """(where, text) of each literal a grammar writes as text: a JSON ``schema``'s property names
    and enum and const strings, or a Lark grammar's strings and its ``%json`` schemas' literals.
    A Lark regex's literal runs are among them, but under a negation (``~``: it names a text
    to keep out; ``_negated_regexes``), and a schema's patterns' (``_schema_literals``), but
    under ``not``; what the checker cannot read is left out."""
    if lark_text is None:
        return list(_schema_literals(schema, []))
    try:
        tokens = _lark_tokens(lark_text)
    except _Unparsed:
        return []
    found: list[tuple[str, str]] = []
    run: list[str] = []  # strings one after another in a rule: written as one text
    negated = _negated_regexes(tokens)  # (one names a text to keep it out)
    for i, (kind, value) in enumerate(tokens):  # (whitespace is not among them)
        if kind != "string" and len(run) > 1:  # '"<" "tool_call>"' writes <tool_call>
            found.append(_joined(run))
        run = run + [value] if kind == "string" else []
        if kind == "string":
            found.append((f"the string {value}", value))
        elif kind == "regex" and i not in negated:
            found += [(f"the regex {value}: its literal {lit!r}", lit)
                      for lit in regex_literals(value[1:value.rindex("/")])]
        elif kind == "json":
            try:
                body = json.loads(value[value.index("{"):])
            except ValueError:
                continue
            found += [(f"%json {where}", lit) for where, lit in _schema_literals(body, [])]
    if len(run) > 1:
        found.append(_joined(run))
    return found


def _is_negation(tokens: Sequence[tuple[str, str]], i: int) -> bool:
    """Whether ``tokens[i]`` is a ``~`` before an operand, not the repetition ``item ~ 3`` (one
    after an operand or a group and before a count: ``"q" ~/abc/`` is a negation)."""
    if tokens[i] != ("op", "~"):
        return False
    before = tokens[i - 1] if i else ("nl", "")
    after = tokens[i + 1] if i + 1 < len(tokens) else ("nl", "")
    return not ((before[0] in ("name", "string", "regex", "special") or before == ("op", ")"))
                and after[0] == "number")


def _negated_regexes(tokens: Sequence[tuple[str, str]]) -> set[int]:
    """The indices of a Lark grammar's regexes under a negation (a ``~`` before an operand, not
    the repetition ``item ~ 3``): the one after it, those of a group after it, and those of the
    rules and terminals it names, and of what these name in turn."""
    bodies: dict[str, list[int]] = {}  # a rule's name: its tokens' indices
    current: str | None = None
    line = 0  # where the line begins
    for i, (kind, value) in enumerate(tokens):
        if kind == "nl":
            line = i + 1
        if (kind, value) == ("op", ":"):  # NAME:, ?name: or NAME.2: begins a definition
            if current is not None:  # its header on this line is none of the one before
                bodies[current] = [j for j in bodies[current] if j < line]
            current = next((v for k, v in reversed(tokens[line:i]) if k == "name"), None)
            bodies.setdefault(current or "", [])
        elif current is not None:
            bodies[current].append(i)
    regexes: set[int] = set()
    names: list[str] = []
    for i in range(len(tokens)):
        if not _is_negation(tokens, i):
            continue
        depth, j = 0, i + 1
        while j < len(tokens):  # the operand: a regex, a name or a group
            kind, value = tokens[j]
            depth += (value == "(") - (value == ")") if kind == "op" else 0
            if kind == "regex":
                regexes.add(j)
            elif kind == "name":
                names.append(value)
            if depth <= 0:
                break
            j += 1
    seen: set[str] = set()
    while names:
        name = names.pop()
        if name in seen:
            continue
        seen.add(name)
        for j in bodies.get(name, []):
            kind, value = tokens[j]
            if kind == "regex":
                regexes.add(j)
            elif kind == "name":
                names.append(value)
    return regexes


def _joined(strings: list[str]) -> tuple[str, str]:
    """(where, text) of Lark strings written one after another, as one literal."""
    return (f"the strings {' '.join(strings)}",
            "".join(v.removesuffix("i")[1:-1] for v in strings))


def regex_literals(pattern: str) -> list[str]:
    """The runs of literal characters a regex writes (``<tool_call>`` in ``<tool_call>[a-z]+``),
    read by Python's regex parser: none where it cannot read the (Rust-syntax) pattern."""
    return list(_regex_literals(pattern))


# Rust regex syntax Python's parser lacks, after an even run of backslashes: a Unicode class
# (\p{Lu}, \PN) and the end of text (\z)
_RUST_ONLY = re.compile(r"((?<!\\)(?:\\\\)*)\\(?:[pP](?:\{[^}]*\}|[A-Za-z])|(z))")


# (every turn's grammar with free text has the same regexes: 0.6 ms to parse at each compile)
@functools.lru_cache(maxsize=256)
def _regex_literals(pattern: str) -> tuple[str, ...]:
    try:
        from re import _parser as parser  # type: ignore[attr-defined]
    except ImportError:  # Python 3.10
        import sre_parse as parser
    try:
        with warnings.catch_warnings():  # Rust's [a&&b] is Python's "possible set intersection"
            warnings.simplefilter("ignore")
            tree = parser.parse(pattern)
    except Exception:  # noqa: BLE001  (a syntax Python's parser lacks)
        neutral = _RUST_ONLY.sub(lambda m: m[1] + ("$" if m[2] == "z" else "(?:a|b)"), pattern)
        if neutral != pattern:  # \p{Lu}, \z: what they match holds no literal run
            return _regex_literals(neutral)
        # else the whole pattern, its braced code points (\x{3c}) read and its other escapes
        # dropped, as one run: a special token's text in it is refused even where the pattern
        # may not write it (over-strict, never missed)
        text = re.sub(r"\\[xuU]\{([0-9A-Fa-f]{1,6})\}",
                      lambda m: chr(min(int(m[1], 16), sys.maxunicode)), pattern)
        return (re.sub(r"\\(.)", r"\1", text),)
    runs: list[str] = []

    def walk(sequence: Any) -> None:
        run: list[str] = []
        for op, arg in sequence:
            name = str(op)
            text = _literal_text([(op, arg)])  # "(<)tool_cal{1}[l]>": one run
            if text is not None:
                run.append(text)
                continue
            if run:
                runs.append("".join(run))
                run = []
            if name == "SUBPATTERN":
                walk(arg[-1])
            elif name == "BRANCH":
                for branch in arg[1]:
                    walk(branch)
            elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                walk(arg[2])
            elif name == "ATOMIC_GROUP":
                walk(arg)
        if run:
            runs.append("".join(run))

    walk(tree)
    return tuple(runs)


def _literal_text(sequence: Any) -> str | None:
    """The one text a parsed regex ``sequence`` matches where it is literal characters alone:
    a character, a class of one (``[l]``), a group of such and a repeat of such an exact number
    of times (``l{1}``); else None."""
    out = []
    for op, arg in sequence:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(arg))
        elif name == "IN" and len(arg) == 1 and str(arg[0][0]) == "LITERAL":
            out.append(chr(arg[0][1]))
        elif name == "SUBPATTERN" and (inner := _literal_text(arg[-1])) is not None:
            out.append(inner)
        elif (name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") and arg[0] == arg[1]
              and arg[0] <= 64 and (inner := _literal_text(arg[2])) is not None):
            out.append(inner * arg[0])
        else:
            return None
    return "".join(out)


def _schema_literals(node: Any, path: list[str | int],
                     negated: bool = False) -> Iterator[tuple[str, str]]:
    """(where, text) of the literals a schema writes: its property names, its enum and const
    strings, and the literal runs of its ``pattern`` s and ``patternProperties`` ' names but
    those under ``not`` (``negated``: there a pattern names a text to keep out)."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _schema_literals(item, path + [i], negated)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in ("enum", "const"):
            for text in _strings(value):
                yield pointer(path + [key]), text
        elif key == "properties" and isinstance(value, dict):
            for name, sub in value.items():
                yield pointer(path + [key]), name
                yield from _schema_literals(sub, path + [key, name], negated)
        elif key == "pattern" and isinstance(value, str):
            if not negated:  # (a string's: every match holds the run, or its branch's does)
                yield from _pattern_literals(value, path + [key])
        elif key == "patternProperties" and isinstance(value, dict):
            for name, sub in value.items():
                if not negated:
                    yield from _pattern_literals(name, path + [key, name])
                yield from _schema_literals(sub, path + [key, name], negated)
        elif key not in ("description", "title", "$comment", "examples", "default"):
            yield from _schema_literals(value, path + [key], negated or key == "not")


def _pattern_literals(pattern: str, path: list[str | int]) -> Iterator[tuple[str, str]]:
    for run in regex_literals(pattern):
        yield f"{pointer(path)}: its literal {run!r}", run


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)


def _json_object_end(text: str, start: int) -> int:
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError as err:
        raise _Unparsed(str(err)) from None
    return end


def _is_terminal(name: str) -> bool:
    stripped = name.lstrip("_@")
    return not stripped or stripped[0].isupper()


def _split_definitions(tokens: Sequence[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Rule name -> body tokens, for lowercase rules; terminals and statements are skipped."""
    rules: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    i = 0
    while i < len(tokens):
        header = _header_end(tokens, i)
        if header is not None:
            name = tokens[i][1]
            current = None if _is_terminal(name) else rules.setdefault(name, [])
            if current is not None and current:
                current.append(("op", "|"))
            i = header
            continue
        kind, value = tokens[i]
        if kind == "directive" or kind == "json" and value.startswith("%llguidance"):
            current = None  # %ignore / %import / %declare / %llguidance statements
            while i < len(tokens) and tokens[i][0] != "nl":
                i += 1
            continue
        if current is not None and kind != "nl":
            current.append((kind, value))
        i += 1
    return rules


def _header_end(tokens: Sequence[tuple[str, str]], i: int) -> int | None:
    """Index after ``name[.N][[options]] :`` if a definition starts at ``i``."""
    if tokens[i][0] != "name" or (i > 0 and tokens[i - 1][0] != "nl"):
        return None
    j = i + 1
    if j + 1 < len(tokens) and tokens[j] == ("op", ".") and tokens[j + 1][0] == "number":
        j += 2
    if j < len(tokens) and tokens[j] == ("op", "["):
        depth = 0
        while j < len(tokens):
            depth += {"[": 1, "]": -1}.get(tokens[j][1], 0) if tokens[j][0] == "op" else 0
            j += 1
            if depth == 0:
                break
    if j < len(tokens) and tokens[j] == ("op", ":"):
        return j + 1
    return None


class _RuleParser:
    """Recursive descent over one rule body, building a small productivity expression:
    ("any", [...]) one of, ("all", [...]) each of, ("ref", name), ("yes",)."""

    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.i = tokens, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        token = self.tokens[self.i]
        self.i += 1
        return token

    def parse(self) -> tuple:
        expr = self.alternatives()
        if self.peek() is not None:
            raise _Unparsed(str(self.peek()))
        return expr

    def alternatives(self) -> tuple:
        alts = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.take()
            alts.append(self.sequence())
        return ("any", alts)

    def sequence(self) -> tuple:
        items = []
        while (tok := self.peek()) is not None and tok not in (
            ("op", "|"),
            ("op", ")"),
            ("op", "]"),
        ):
            if tok == ("op", "->"):
                self.take()
                self.take()  # the alias name
                continue
            items.append(self.postfix(self.atom()))
        return ("all", items)

    def atom(self) -> tuple:
        kind, value = self.take()
        if kind in ("string", "regex", "special", "json"):
            if self.peek() == ("op", ".."):  # "a".."z" character range
                self.take()
                self.take()
            return ("yes",)
        if kind == "name":
            return ("yes",) if _is_terminal(value) else ("ref", value)
        if (kind, value) == ("op", "("):
            inner = self.alternatives()
            self.expect(")")
            return inner
        if (kind, value) == ("op", "["):
            self.alternatives()
            self.expect("]")
            return ("yes",)
        raise _Unparsed(value)

    def postfix(self, expr: tuple) -> tuple:
        while (tok := self.peek()) is not None and tok[0] == "op" and tok[1] in "?*+{~":
            op = self.take()[1]
            if op in "?*":
                expr = ("yes",)
            elif op == "{":
                low = self.take()[1] if self.peek() and self.peek()[0] == "number" else "0"
                while self.peek() != ("op", "}"):
                    self.take()
                self.take()
                expr = ("yes",) if int(low) == 0 else expr
            elif op == "~":
                low = self.take()[1]
                if self.peek() == ("op", ".."):
                    self.take()
                    self.take()
                expr = ("yes",) if int(low) == 0 else expr
        return expr

    def expect(self, op: str) -> None:
        if self.take() != ("op", op):
            raise _Unparsed(op)


def _finite(expr: tuple, known: set[str], rules: dict[str, tuple]) -> bool:
    tag = expr[0]
    if tag == "yes":
        return True
    if tag == "ref":
        return expr[1] in known or expr[1] not in rules  # unknown names: llguidance reports them
    if tag == "all":
        return all(_finite(e, known, rules) for e in expr[1])
    return any(_finite(e, known, rules) for e in expr[1])


def json_bodies(text: str) -> list[tuple[str, Any]]:
    """(rule, schema) of every ``%json`` schema in a rule of a Lark grammar it can read."""
    try:
        bodies = _split_definitions(_lark_tokens(text))
    except (_Unparsed, IndexError, ValueError):
        return []
    found = []
    for rule, tokens in bodies.items():
        for kind, value in tokens:
            if kind == "json" and value.startswith("%json"):
                try:
                    found.append((rule, json.loads(value[value.index("{"):])))
                except ValueError:
                    continue
    return found


def unproductive_rules(text: str) -> list[str] | None:
    """Lowercase rules of a Lark grammar with no finite expansion, or None if not understood."""
    try:
        bodies = _split_definitions(_lark_tokens(text))
        rules = {name: _RuleParser(body).parse() for name, body in bodies.items()}
        known: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, expr in rules.items():
                if name not in known and _finite(expr, known, rules):
                    known.add(name)
                    changed = True
    except (_Unparsed, IndexError, ValueError, RecursionError):  # nested past Python's stack:
        return None  # llguidance judges it ("too deeply nested")
    return sorted(set(rules) - known)


def check_lark_finishes(text: str, origin: str) -> None:
    """Raise ``GrammarError`` if a rule of a Lark grammar has no finite expansion (``start``: the
    grammar can never finish; another: a reply that enters it never ends), or a ``%json``
    schema in it has no finite value or bounds llguidance misreads (as ``json_schema``'s)."""
    for rule, body in json_bodies(text):
        loose = loose_option(body)
        if loose is not None:
            raise GrammarError(f"{origin}: %json in rule {rule!r}: {loose}")
        unfinished = _unfinishable(body)
        if unfinished is not None:
            where, reason = unfinished
            raise GrammarError(f"{origin}: %json in rule {rule!r}: {where}: no finite JSON value "
                               f"satisfies this schema: {reason}")
        contradiction = _contradictory_bounds(body)
        if contradiction is not None:
            raise GrammarError(f"{origin}: %json in rule {rule!r}: {contradiction[0]}: "
                               f"{contradiction[1]}")
    stuck = unproductive_rules(text)
    if stuck and "start" in stuck:
        others = ", ".join(r for r in stuck if r != "start")
        detail = f" (rules that only expand into themselves: {others})" if others else ""
        raise GrammarError(
            f"{origin}: the grammar can never finish: rule 'start' has no finite expansion{detail}"
        )
    if stuck:
        raise GrammarError(f"{origin}: rule {stuck[0]!r} has no finite expansion: a reply that "
                           f"enters it never ends")


def recursive_ref(schema: Any) -> str | None:
    """A local ``$ref`` whose expansion re-enters itself (the schema is recursive), or None."""
    clean: set[str] = set()  # targets fully expanded without re-entering the chain
    anchors = anchor_index(schema)

    def within(location: str, ref: str) -> bool:
        return ref == "#" or location == ref or location.startswith(ref + "/")

    def walk(node: Any, location: str, chain: list[str]) -> str | None:
        if isinstance(node, list):
            items: Any = ((str(i), v) for i, v in enumerate(node))
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and ref not in clean:
                target = resolve_ref(schema, ref, anchors)
                if target is not None:
                    if any(within(loc, ref) for loc in (*chain, location)):
                        return ref
                    found = walk(target, ref, [*chain, location])
                    if found is not None:
                        return found
                    clean.add(ref)
            items = ((k, v) for k, v in node.items() if k != "$ref")
        else:
            return None
        for key, value in items:
            escaped = key.replace("~", "~0").replace("/", "~1")
            found = walk(value, f"{location}/{escaped}", chain)
            if found is not None:
                return found
        return None

    return walk(schema, "#", [])


def may_write_special_bytes(text: str) -> bool:
    """Whether a Lark grammar has a negation (``~/abc/``, ``~"x"``): its language holds every
    byte string but its operand's, and llguidance (1.9.1) lets the special tokens (the 0xFF
    byte and their names) through its masks there, then refuses them as text when the token is
    consumed. An intersection with an operand that holds no 0xFF (``/(?s:.)*/ & ~/abc/``) holds
    none either, but is counted too: what this costs is a cheaper mask's check, not a refusal.
    A repetition (``item ~ 3``) is none; True where the checker cannot read the grammar and it
    has a ``~``."""
    try:
        tokens = _lark_tokens(text)
    except _Unparsed:
        return "~" in text
    return any(_is_negation(tokens, i) for i in range(len(tokens)))
