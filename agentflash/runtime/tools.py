"""Tools: ``@tool`` on a Python function, and HTTP tools that call one declared URL.

A function's signature, type hints and docstring give a pydantic model of its arguments; the
strict JSON Schema the model sees is that model's schema, and the model validates the arguments
of every call in pydantic's strict mode: a value of another type than the schema's is refused
(lax mode converted ``"2"`` or ``true`` to an integer). What the grammar writes passes, but
for a number past a float's range (``1e400``, which a call's JSON refuses: Python reads it as
infinity; an integer past it, which pydantic reads as infinity for a float, is refused with the
call's arguments; llguidance bounds a number only within 2^63 and without an exponent, so no schema
keeps it out of a ``float``) and the bounds pydantic alone checks (a datetime's, time's or
duration's; ``PastDate`` and ``FutureDate``; the README lists them). Without the grammar a
key the schema does not list is refused too (``undeclared_key``: pydantic drops it from a nested
model), and a ``Decimal`` written as a number still passes.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import decimal
import enum
import functools
import inspect
import json
import math
import re
import sys
import threading
import types
import typing
import warnings
from collections import UserString
from collections.abc import Callable, Iterator, Mapping, MappingView, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, overload
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import anyio
import anyio.from_thread
import anyio.lowlevel
import pydantic
import pydantic.json_schema
import pydantic_core
from pydantic.fields import FieldInfo

from agentflash.errors import UserError, described, is_number, shown_url
from agentflash.json_formats import (
    bytes_pattern,
    date_bounds,
    decimal_pattern,
    ip_address_pattern,
    temporal_pattern,
    url_pattern,
    uuid_pattern,
)
from agentflash.tool_format import TOOL_NAME

if sys.version_info < (3, 11):  # anyio's own dependency there
    from exceptiongroup import ExceptionGroup



class ToolArgumentsError(ValueError):
    """The model's arguments do not fit the tool's schema (reported back to the model)."""


# --- docstrings ---------------------------------------------------------------------------------

PARAM_SECTIONS = {"args", "arguments", "parameters", "params", "keyword args",
                  "keyword arguments", "other parameters"}
OTHER_SECTIONS = {"returns", "return", "yields", "raises", "examples", "example", "notes",
                  "note", "see also", "references", "attributes", "warnings", "todo"}
# name(s) (type, which may hold parentheses): description -- NumPy lists "a, b : int"
_ENTRY = re.compile(r"^\*{0,2}(\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?:\((.*?)\))?\s*(?::\s*(.*))?$")
_SPHINX = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """A docstring's summary and its parameter descriptions (Google, NumPy or Sphinx style)."""
    lines = inspect.cleandoc(doc or "").splitlines()
    summary: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    numpy = False
    body: list[str] = []
    i = 0
    while i < len(lines):
        line, text = lines[i], lines[i].strip()
        is_underline = i + 1 < len(lines) and re.fullmatch(r"-{3,}", lines[i + 1].strip() or "x")
        header = text.rstrip(":").lower()
        if not line.startswith(" ") and (is_underline or (text.endswith(":") and header in
                                                          PARAM_SECTIONS | OTHER_SECTIONS)):
            _flush_section(section, numpy, body, params)
            section, numpy, body = header, bool(is_underline), []
            i += 2 if is_underline else 1
            continue
        sphinx = _SPHINX.match(text)
        if sphinx:
            _flush_section(section, numpy, body, params)
            section, body = f":param {sphinx.group(1)}", []
            params[sphinx.group(1)] = sphinx.group(2).strip()
        elif text.startswith(":"):
            section = "sphinx-other"
        elif section and section.startswith(":param ") and line.startswith((" ", "\t")):
            name = section.removeprefix(":param ")  # the field's text goes on, indented
            params[name] = f"{params[name]} {text}".strip()
        elif section and section.startswith(":param ") and text:
            section = None
            summary.append(text)
        elif section is None:
            summary.append(text)
        else:
            body.append(line)
        i += 1
    _flush_section(section, numpy, body, params)
    return " ".join(s for s in summary if s), params


def _flush_section(section: str | None, numpy: bool, body: list[str], out: dict[str, str]) -> None:
    if section not in PARAM_SECTIONS:
        return
    indents = [len(b) - len(b.lstrip()) for b in body if b.strip()]
    if not indents:
        return
    base = min(indents)
    names: list[str] = []
    for line in body:
        if not line.strip():
            continue
        if len(line) - len(line.lstrip()) == base and (m := _ENTRY.match(line.strip())):
            names = [n.strip().lstrip("*") for n in m.group(1).split(",")]
            for name in names:
                out[name] = "" if numpy else (m.group(3) or "").strip()
        else:
            for name in names:
                out[name] = (out[name] + " " + line.strip()).strip()


# --- schemas ------------------------------------------------------------------------------------


# Models read schemas best in the layout of their training data (``type`` first, then
# ``properties`` and ``required``), so schemas keep these keys in this order.
_KEY_ORDER = ("type", "description", "enum", "items", "properties", "required")


class GrammarJsonSchema(pydantic.json_schema.GenerateJsonSchema):
    """pydantic's JSON Schema, tightened where pydantic's JSON validation is stricter than the
    schema says, since the grammar writes whatever the schema allows: a ``Decimal`` is a
    decimal number of its digits (``_decimal``), a dict with integer keys has keys that are
    integers (pydantic names no pattern for them), dates, times and durations are ones
    pydantic reads (``temporal_pattern``: a naive datetime without an offset, an aware one with
    it), and a URL of some schemes (``HttpUrl``) begins with one of them."""

    def generate(self, schema, mode="validation"):
        return _known_formats(super().generate(schema, mode))

    def decimal_schema(self, schema):
        return _decimal(schema) if self.mode == "validation" else super().decimal_schema(schema)

    def date_schema(self, schema):
        out = _temporal(super().date_schema(schema))
        bound = {key: _a_date(schema[key]) for key in ("ge", "gt", "le", "lt")
                 if schema.get(key) is not None}  # pydantic keeps "2020-01-01" as given
        low, high = bound.get("ge"), bound.get("le")
        if "gt" in bound:
            low = max(low or datetime.date.min, _next_day(bound["gt"], 1))
        if "lt" in bound:
            high = min(high or datetime.date.max, _next_day(bound["lt"], -1))
        if low is not None and high is not None and low > high:
            raise NotBindable(f"no date lies within its bounds ({low} to {high})")
        bounds = date_bounds(low, high)  # which pydantic checks and names no pattern of
        return {**out, "allOf": [{"pattern": p} for p in bounds]} if bounds else out

    def time_schema(self, schema):
        return _temporal(super().time_schema(schema), schema.get("tz_constraint"))

    def datetime_schema(self, schema):
        return _temporal(super().datetime_schema(schema), schema.get("tz_constraint"))

    def timedelta_schema(self, schema):
        return _temporal(super().timedelta_schema(schema))

    def url_schema(self, schema):
        out = super().url_schema(schema)
        schemes = schema.get("allowed_schemes")
        if schemes and out.get("type") == "string":
            out["pattern"] = url_pattern(schemes)
        return out

    def _get_alias_name(self, field, name):
        alias = field.get("validation_alias") if self.mode == "validation" else None
        config = getattr(self, "_config", None)
        if (isinstance(alias, list) and not getattr(config, "validate_by_name", False)
                and not any(isinstance(p, list) and len(p) == 1 and isinstance(p[0], str)
                            for p in alias)):
            raise NotBindable(f"field {name!r} is read from a path (AliasPath {alias}), and "
                              f"the schema can only name a key: give it a key of its own "
                              f"(AliasChoices with a name first, or validate_by_name)")
        return super()._get_alias_name(field, name)

    def literal_schema(self, schema):
        # a member of an Enum that is not of its value's type (no str or int mixin) is no
        # JSON value to pydantic: it refuses the value the schema names
        if self.mode == "validation" and any(
                isinstance(v, enum.Enum) and not isinstance(v, type(v.value))
                for v in schema["expected"]):
            raise NotBindable(f"a Literal of enum members ({schema['expected']}) reads no JSON "
                              f"value: take the Enum, a Literal of its values, or make it a "
                              f"str (or int) Enum")
        if self.mode == "validation":
            _no_bytes("a Literal", schema["expected"])
        return super().literal_schema(schema)

    def enum_schema(self, schema):
        if self.mode == "validation":
            _no_bytes(f"the Enum {schema['cls'].__name__}", [m.value for m in schema["members"]])
        return super().enum_schema(schema)

    def bytes_schema(self, schema):
        out = super().bytes_schema(schema)
        if self.mode != "validation":
            return out
        out.pop("format", None)  # ser_json_bytes's (base64url, which llguidance refused)
        encoding = self._config.val_json_bytes
        if encoding in ("base64", "hex"):  # any string was written, and most were refused
            low, high = schema.get("min_length"), schema.get("max_length")
            pattern = bytes_pattern(encoding, low, high)
            if pattern is None:
                raise NotBindable(f"no bytes are at least {low} and at most {high} long")
            out = {key: v for key, v in out.items() if key not in ("minLength", "maxLength")}
            out["pattern"] = pattern  # (the bounds are the decoded bytes', in it)
        elif schema.get("max_length") is not None:
            # pydantic counts the UTF-8 bytes, the grammar characters ("ééé" is 6 bytes):
            # ASCII, whose characters are one byte each
            out["pattern"] = ASCII_PATTERN
        return out

    def complex_schema(self, schema):
        # pydantic reads a number, or a string of one with an imaginary part ("1+2j")
        return {"type": "string", "pattern": COMPLEX_PATTERN}

    def json_schema(self, schema):
        raise NotBindable("a pydantic.Json[...] value is a string of JSON that pydantic parses, "
                          "and the grammar cannot bind what the string holds: take the value "
                          "itself (Json[int] -> int)")

    def _common_dict_schema(self, schema):
        out = super()._common_dict_schema(schema)
        keys = schema.get("keys_schema", {})
        if keys.get("type") == "str":  # the model's str_* settings bind its keys too
            keys = {**_str_config(self._config.config_dict), **keys}
        pattern = _key_pattern(keys)
        patterns = out.get("patternProperties", {})
        if (pattern is None and keys.get("type") == "bytes" and len(patterns) == 1
                and self._config.val_json_bytes in ("base64", "hex")):
            pattern = next(iter(patterns))  # bytes_schema's, all the key's schema: closed
        if pattern is not None and ("additionalProperties" in out or len(patterns) == 1):
            # keys the grammar writes as pydantic reads them; JSON Schema's propertyNames,
            # which pydantic names for an enum, a literal, a UUID, a date or a str of a
            # length, llguidance lacks
            values = out.pop("additionalProperties", None) or next(iter(patterns.values()))
            out.pop("propertyNames", None)
            out["patternProperties"] = {pattern: values}
            out["additionalProperties"] = False
        return out

    def dataclass_args_schema(self, schema):
        if self.mode == "validation":  # a field of init=False takes no value: pydantic drops it
            schema = {**schema, "fields": [f for f in schema["fields"] if f.get("init", True)]}
        return super().dataclass_args_schema(schema)


def _no_bytes(what: str, values: list[Any]) -> None:
    """``NotBindable`` where ``values`` (a Literal's, an Enum's) hold bytes: pydantic's schema
    names b"a" as the string "a", and pydantic reads no JSON value as b"a" (a call the
    grammar wrote was refused; as a dict's key, json.dumps failed on it)."""
    raw = [v for v in values if isinstance(v, (bytes, bytearray))]
    if raw:
        texts = ", ".join(repr(bytes(v).decode("utf-8", "replace")) for v in raw)
        raise NotBindable(f"{what} holds bytes ({', '.join(map(repr, raw))}), which pydantic "
                          f"reads from no JSON value (no string is bytes there): take str "
                          f"values ({texts})")


# formats pydantic names that llguidance lacks, where any string is one pydantic reads (a
# ``Path``, ``bytes`` as UTF-8, a ``SecretStr``) or one it checks beyond a pattern (a
# ``FilePath`` exists): the string's other bounds stay, and a path that is not a file is an
# invalid argument the model reads
_ANY_STRING_FORMATS = frozenset({"path", "binary", "password", "file-path", "directory-path",
                                 "new-path", "socket-path"})
_FORMAT_PATTERNS = {f"uuid{n}": uuid_pattern(n) for n in range(1, 9)}


def _known_formats(node: Any) -> Any:
    """The schema ``node`` with the formats above made a pattern llguidance writes, or left
    out, in it and its subschemas (a property named ``format`` is none)."""
    from agentflash.grammar.sources import with_subschemas

    if not isinstance(node, dict):
        return node
    out = with_subschemas(node, lambda sub, key: _known_formats(sub))
    format = out.get("format")
    if not isinstance(format, str):
        return out
    if format in _ANY_STRING_FORMATS:
        del out["format"]
    elif format == "ipvanyaddress":
        out.pop("format")
        out["pattern"] = ip_address_pattern()
    elif format in _FORMAT_PATTERNS:
        out.pop("format")
        out["pattern"] = _FORMAT_PATTERNS[format]
    return out


def _a_date(value: Any) -> datetime.date:
    """A date bound as pydantic reads it (a date, or its ISO text)."""
    try:
        return pydantic.TypeAdapter(datetime.date).validate_python(value)
    except pydantic.ValidationError:
        raise NotBindable(f"the bound {value!r} is no date") from None


def _next_day(day: datetime.date, step: int) -> datetime.date:
    try:
        return day + datetime.timedelta(days=step)
    except OverflowError:  # past 9999-12-31 (before 0001-01-01): no day there
        raise NotBindable(f"no date lies {'after' if step > 0 else 'before'} {day}") from None


class NotBindable(ValueError):
    """A type whose values pydantic checks beyond any schema the grammar can write to."""


def _temporal(schema: dict[str, Any], tz_constraint: str | int | None = None) -> dict[str, Any]:
    format = schema.get("format")
    pattern = temporal_pattern(format, tz_constraint)
    if schema.get("type") != "string" or not pattern:
        return schema
    if format in ("date-time", "time") and tz_constraint in (None, "naive"):
        # JSON Schema's date-time and time have an offset, a naive one none: the pattern alone
        return {**{k: v for k, v in schema.items() if k != "format"}, "pattern": pattern}
    return {**schema, "pattern": pattern}


def _decimal(schema: dict[str, Any]) -> dict[str, Any]:
    """A ``Decimal``'s schema: a string of a decimal number within its digits, or, where it has
    bounds (which no pattern holds), a number within them and its digits (below 10^15 where no
    digits are given). pydantic's own schema allows a number of any digits, a string with an
    exponent of any size and so infinity."""
    digits, places = schema.get("max_digits"), schema.get("decimal_places")
    bounds = {key: schema[key] for key in ("multiple_of", "ge", "gt", "le", "lt")
              if schema.get(key) is not None}
    if not bounds:
        return {"type": "string", "pattern": decimal_pattern(digits, places)}
    decimal_pattern(digits, places)  # the same check of the digits
    if places is not None and digits is not None:
        places = min(places, digits)  # 0.123 has 3 digits: places past max_digits add none
    number: dict[str, Any] = {"type": "number"}
    for key, name in (("ge", "minimum"), ("gt", "exclusiveMinimum"), ("le", "maximum"),
                      ("lt", "exclusiveMaximum")):
        if key in bounds:
            number[name] = float(bounds[key])
    # each branch: k places after the point at most, so a multiple of 10^-k below 10^(digits-k)
    branches = []
    for k in ([places] if places is not None else range(digits + 1) if digits is not None
              else [None]):
        branch = dict(number)
        step = _multiple(bounds.get("multiple_of"), k)
        if step is not None:
            branch["multipleOf"] = step
        # pydantic reads a number through a float: below 10^15 its digits stay what they were
        top = 10 ** (digits - min(k or 0, digits)) if digits is not None else 10 ** 15
        branch["exclusiveMaximum"] = min(branch.get("exclusiveMaximum", math.inf), top)
        branch["exclusiveMinimum"] = max(branch.get("exclusiveMinimum", -math.inf), -top)
        parts = [branch]
        if places is not None and k == digits:  # no whole digits: pydantic reads 0 as one
            # the multiples of step but 0, in two ranges (inclusive: llguidance lets 0 through
            # an exclusive bound at 0 where the range ends within one unit of it)
            parts = [{**branch, "maximum": min(branch.get("maximum", math.inf), -step)},
                     {**branch, "minimum": max(branch.get("minimum", -math.inf), step)}]
            parts = [p for p in parts if max(p["exclusiveMinimum"], p.get("minimum", -math.inf))
                     < min(p["exclusiveMaximum"], p.get("maximum", math.inf))] or parts
        branches += parts
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def _multiple(multiple_of: Any, places: int | None) -> float | int | None:
    """The least common multiple of ``multiple_of`` and 10^-places (either may be None)."""
    if places is None:
        return None if multiple_of is None else float(multiple_of)
    if multiple_of is None:
        return 1 if places == 0 else float(decimal.Decimal(1).scaleb(-places))
    given = decimal.Decimal(str(multiple_of))
    scale = max(places, -given.as_tuple().exponent, 0)
    lcm = math.lcm(int(given.scaleb(scale)), 10 ** (scale - places))
    out = decimal.Decimal(lcm).scaleb(-scale)
    return int(out) if out == out.to_integral_value() else float(out)


def _key_pattern(keys: dict[str, Any]) -> str | None:
    """The pattern of a dict's keys of type ``keys`` (pydantic's core schema), as pydantic
    reads them from JSON's strings; None where no pattern is known."""
    kind = keys.get("type")
    values = ([m.value for m in keys["members"]] if kind == "enum"
              else keys.get("expected") if kind == "literal" else None)
    if values and all(isinstance(v, str) for v in values):
        return "^(?:" + "|".join(_literal(v) for v in values) + ")$"
    if values:  # Literal[1, 2]: pydantic reads no key "1" as 1; an IntEnum's "1" it reads
        texts = [v if isinstance(v, str) else _json_text(v) for v in values]
        read = [t for t in texts if t is not None and _reads_key(keys, t)]
        if not read:
            strings = ", ".join(repr(t) for t in texts if t is not None)
            raise NotBindable(f"a dict's keys of {values} are none that pydantic reads from "
                              f"JSON, whose keys are strings: take a Literal of strings"
                              + (f" ({strings})" if strings else ""))
        return "^(?:" + "|".join(_literal(t) for t in read) + ")$"
    if kind == "str":
        return _str_key(keys)
    if kind == "uuid":
        return uuid_pattern(keys.get("version"))
    if kind in ("date", "datetime", "time", "timedelta") and not _bounded(keys):
        return temporal_pattern(_TEMPORAL_FORMATS[kind], keys.get("tz_constraint"))
    if kind == "decimal":  # pydantic's own key pattern, and the object left open: any key
        if _bounded(keys) or keys.get("multiple_of") is not None:
            raise _bounded_keys(keys)
        return decimal_pattern(keys.get("max_digits"), keys.get("decimal_places"))
    if kind == "int":
        return _integer_key(keys)
    # (allow_inf_nan=False: the key pattern writes no inf or nan; past a float's range, 1e400,
    # is a value's caveat too)
    if kind == "float" and (_bounded(keys) or keys.get("multiple_of") is not None):
        raise _bounded_keys(keys)
    return {"float": NUMBER_KEY, "bool": "^(?:true|false)$"}.get(kind)


def _json_text(value: Any) -> str | None:
    """``value`` as JSON text, or None for one JSON has not (bytes)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return None


def _str_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The str constraints a model's ``ConfigDict(str_...)`` gives where a str has its own none
    (those that say something: no min_length 0, no False)."""
    out = {}
    for own in ("strip_whitespace", "min_length", "max_length", "to_lower", "to_upper"):
        value = config.get(f"str_{own}")
        if value is not None and value is not False and not (own == "min_length" and not value):
            out[own] = value
    return out


def _str_key(keys: dict[str, Any]) -> str | None:
    """The pattern of a str key (pydantic's ``constr``): its own, or its length's bounds as one
    (pydantic names them in propertyNames, which llguidance lacks); ``NotBindable`` where it
    has both, or a least length counted once pydantic has stripped the key
    (``strip_whitespace``: "  " is no key of one character). pydantic counts a key before it
    changes its case (to_lower, to_upper: "ß" is one character, "SS" once read), and a most
    length it counts after stripping holds every key the pattern lets the model write."""
    low, high = keys.get("min_length"), keys.get("max_length")
    if low is None and high is None:
        return keys.get("pattern")
    changes = [k for k in ("strip_whitespace", "to_lower", "to_upper") if keys.get(k)]
    bounds = ", ".join(f"{k}={keys[k]!r}" for k in ("min_length", "max_length", "pattern",
                                                     *changes) if keys.get(k) is not None)
    if keys.get("pattern") is not None:
        raise NotBindable(f"a dict's keys of type str ({bounds}) are checked by pydantic, and "
                          f"agentflash builds no key pattern that holds both the pattern and "
                          f"the length: write the length into the pattern (^[a-z]{{1,3}}$: "
                          f"one to three letters)")
    if low and keys.get("strip_whitespace"):
        raise NotBindable(f"a dict's keys of type str ({bounds}) are counted by pydantic once "
                          f"it has stripped their whitespace, and a key's pattern counts what "
                          f"the model writes (\"  \" is no key of one character): drop "
                          f"strip_whitespace or the min_length from the key's type or its "
                          f"model's config (check the key in the function)")
    return f"^[\\s\\S]{{{low or 0},{'' if high is None else high}}}$"


def _reads_key(keys: dict[str, Any], text: str) -> bool:
    """Whether pydantic reads the JSON key ``text`` as a key of the core schema ``keys``."""
    validator = pydantic_core.SchemaValidator(
        {"type": "dict", "keys_schema": keys, "values_schema": {"type": "any"}})
    try:
        validator.validate_json(json.dumps({text: None}), strict=True)
    except pydantic.ValidationError:
        return False
    return True


def _integer_key(keys: dict[str, Any]) -> str:
    """The pattern of an integer key within its bounds: a sign's (ge=0, gt=0, le=0, lt=0),
    else ``NotBindable``."""
    ge, gt, le, lt = (keys.get(k) for k in ("ge", "gt", "le", "lt"))
    low = max([b for b in (ge, None if gt is None else gt + 1) if b is not None], default=None)
    high = min([b for b in (le, None if lt is None else lt - 1) if b is not None], default=None)
    patterns = {(None, None): INTEGER_KEY, (0, None): r"^(0|[1-9][0-9]*)$",
                (1, None): r"^[1-9][0-9]*$", (None, 0): r"^(0|-[1-9][0-9]*)$",
                (None, -1): r"^-[1-9][0-9]*$"}
    if keys.get("multiple_of") not in (None, 1) or (low, high) not in patterns:
        raise _bounded_keys(keys)
    return patterns[(low, high)]


def _bounded_keys(keys: dict[str, Any]) -> NotBindable:
    bounds = ", ".join(f"{k}={keys[k]!r}" for k in ("ge", "gt", "le", "lt", "multiple_of")
                       if k in keys)  # (a Decimal's digits its pattern holds)
    return NotBindable(f"a dict's keys of type {keys['type']} ({bounds}) are checked by "
                       f"pydantic, and agentflash builds no key pattern that holds these bounds "
                       f"(only a sign's, of integers): drop them from the key's type (check the "
                       f"key in the function)")


_TEMPORAL_FORMATS = {"date": "date", "datetime": "date-time", "time": "time",
                     "timedelta": "duration"}


def _bounded(schema: dict[str, Any]) -> bool:
    return any(schema.get(key) is not None for key in ("ge", "gt", "le", "lt", "now_op"))


def _literal(text: str) -> str:
    """``text`` as a regex of Rust's syntax (llguidance's), which Python's re reads too."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$" else c for c in text)


_REAL = "[0-9]+(?:\\.[0-9]+)?"
COMPLEX_PATTERN = f"^-?(?:{_REAL}(?:[+-]{_REAL}j)?|{_REAL}j)$"
INTEGER_KEY = r"^-?(0|[1-9][0-9]*)$"
ASCII_PATTERN = r"^[\x00-\x7F]*$"
NUMBER_KEY = r"^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?$"
# what pydantic raises where it cannot make a schema of a type: the tool or agent names it
SCHEMA_ERRORS = (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, TypeError,
                 ValueError, pydantic_core.SchemaError, ImportError, RecursionError)


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema without pydantic's titles, its keys in ``_KEY_ORDER``, every object closed
    to unknown keys (``close_objects``)."""
    from agentflash.grammar.sources import close_objects

    return close_objects(_untitled(schema))


def _untitled(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_untitled(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    first = [k for k in _KEY_ORDER if k in schema]
    out = {k: schema[k] for k in [*first, *schema] if k != "title"}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {k: _untitled(v) for k, v in out[key].items()}
    for key in ("anyOf", "allOf", "oneOf", "prefixItems", "items", "additionalProperties", "not"):
        if key in out:
            out[key] = _untitled(out[key])
    return out


def _check_name(name: str, where: str) -> str:
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise UserError(f"{where}: tool name {name!r} must be 1-64 letters, digits, '_' or '-'")
    return name


def _check_description(description: Any, where: str) -> None:
    """A tool's description (``None``: its docstring's) a string: 5 or b"x" was shown to the
    model as the text of another value, "5" or "b'x'"."""
    if description is not None and not isinstance(description, str):
        raise UserError(f"{where}: description must be a string, got "
                        f"{type(description).__name__}")


def _check_timeout(timeout_s: Any, where: str) -> None:
    if timeout_s is not None and not (is_number(timeout_s) and timeout_s > 0):
        raise UserError(f"{where}: timeout_s must be a positive number, got {timeout_s!r}")


def format_result(value: Any) -> str:
    """A tool's return value as the text the model reads."""
    if isinstance(value, str):
        return _characters(value)
    # json.dumps layout: the one chat-format models are trained to read
    jsonable = pydantic_core.to_jsonable_python(value, fallback=_fallback)
    _check_keys_kept(value, jsonable)
    return _characters(json.dumps(_finite(jsonable), ensure_ascii=False, allow_nan=False))


def _check_keys_kept(value: Any, jsonable: Any) -> None:
    """A ``ValueError`` where two keys of a dict in ``value`` became one in ``jsonable`` (1 and
    "1" are both "1" in JSON: one of the two values was dropped without a word)."""
    if isinstance(value, pydantic.BaseModel):  # its values under the keys it is written with
        try:  # (aliases, extras; a RootModel's root)
            value = value.model_dump(by_alias=True)
        except Exception:  # a serializer that only writes JSON: pydantic wrote it, as it does
            return
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping) and isinstance(jsonable, dict):
        if len(jsonable) < len(value):
            seen: dict[str, Any] = {}
            for key in value:
                text = _key_text(key)
                if text in seen:
                    raise ValueError(f"the keys {seen[text]!r} and {key!r} are one key, "
                                     f"{text!r}, in JSON")
                seen[text] = key
        for key, item in value.items():
            _check_keys_kept(item, jsonable.get(_key_text(key)))
    elif isinstance(value, (list, tuple)) and isinstance(jsonable, list):
        for item, written in zip(value, jsonable):
            _check_keys_kept(item, written)


def _key_text(key: Any) -> str:
    """The text a dict's ``key`` is written as (True as "true", an enum as its value)."""
    if type(key) is str:  # as it is: no call to pydantic for each key of every result
        return key
    return next(iter(pydantic_core.to_jsonable_python({key: 0}, fallback=str)))


def _fallback(value: Any) -> Any:
    """What pydantic cannot write: numpy's numbers and arrays as the Python values they hold
    (``tolist``: np.int64(3) is 3, not "3"; an array a list, not "[0 1 2]"), else its text."""
    tolist = getattr(type(value), "tolist", None)
    if callable(tolist) and type(value).__module__.split(".")[0] == "torch":
        # a tensor as the values it holds, not its shortened text ("tensor([0., ..., 9.])"):
        # as numpy's, a float narrower than 64 bits by its shortest digits (0.1, not 0.10000000149)
        value = value.detach().cpu()
        if str(value.dtype) == "torch.float16":  # numpy has it: its shortest digits (0.1)
            value = value.numpy()
        elif value.is_floating_point() and value.element_size() < 8:  # bfloat16 as float32
            value = value.float().numpy()
        else:
            return pydantic_core.to_jsonable_python(value.tolist(), fallback=str)
    if callable(tolist) and type(value).__module__ == "numpy":
        import numpy as np

        if value.dtype.kind == "f" and value.dtype.itemsize < 8:
            # each float32 by the shortest digits that are it (0.1, not 0.10000000149...)
            digits = [float(str(x)) for x in np.asarray(value).ravel()]
            value = np.array(digits, dtype=np.float64).reshape(np.shape(value))
        return pydantic_core.to_jsonable_python(value.tolist(), fallback=str)
    # containers pydantic does not know, as the JSON of what they hold, not their repr
    # ("dict_keys(['a'])", "range(0, 2)", "<memory at 0x...>"); not any Collection: a
    # DataFrame is one, and its items are only its column names
    if isinstance(value, UserString):  # a Sequence of UserStrings: list() never ended
        return str(value)
    if isinstance(value, memoryview):  # bytes written as bytes are, typed items as numbers
        if value.format.lstrip("@=<>!") in ("B", "b", "c"):
            value = value.tobytes()
        else:
            try:
                value = value.tolist()
            except NotImplementedError:  # a format tolist does not read: half floats, "<i4"
                import numpy as np

                try:
                    return _fallback(np.asarray(value))
                except (ValueError, TypeError):  # nor numpy: ctypes' "<u", "<P"
                    value = value.tobytes()
    elif isinstance(value, Mapping):  # a MappingProxyType
        value = dict(value)
    elif isinstance(value, (Sequence, Set, MappingView)):  # a range, an array, dict views
        value = list(value)
    else:
        return str(value)
    return pydantic_core.to_jsonable_python(value, fallback=_fallback)


def _finite(value: Any) -> Any:
    """NaN and the infinities, which JSON has not, as the strings pydantic writes for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def _characters(text: str) -> str:
    """``text`` with each lone surrogate (a byte that was not UTF-8, from a file name or a
    command's output read with ``surrogateescape``) as U+FFFD: no tokenizer takes them."""
    return _SURROGATE.sub("\ufffd", text)


def error_result(message: str) -> str:
    """An error result, in ``format_result``'s layout (its characters as they are)."""
    return _characters(json.dumps({"status": "error", "error": message}, ensure_ascii=False))


# --- function tools -----------------------------------------------------------------------------


@dataclass(frozen=True)
class FunctionTool:
    """A Python function (sync or async) the model can call."""

    name: str
    description: str
    params_model: type[pydantic.BaseModel]  # validates the arguments before every call
    parameters: dict[str, Any]  # the strict JSON Schema of ``params_model``
    fn: Callable[..., Any]
    timeout_s: float | None = None
    positional: tuple[str, ...] = field(default=(), repr=False)  # positional-only parameters

    async def call(self, arguments: dict[str, Any]) -> Any:
        """Validate ``arguments`` and call the function (a sync one in a daemon thread of its
        own, ``_in_daemon_thread``: not one of anyio's workers, so ``anyio.from_thread`` needs
        a token there; a tool that needs the event loop is best written async)."""
        try:
            # as JSON, which the arguments are: strict, since the schema the model is shown
            # allows no "2" or true for an integer, nor 1 or "yes" for a bool (lax validation
            # converted them), and in JSON a strict model still takes a date or an enum from
            # a string (in Python mode it does not)
            validated = self.params_model.model_validate_json(json.dumps(arguments),
                                                              strict=True)
        except pydantic.ValidationError as err:
            raise ToolArgumentsError(_validation_message(self.name, err)) from None
        extra = undeclared_key(arguments, self.parameters)
        if extra is not None:
            raise ToolArgumentsError(f"invalid arguments for {self.name}: "
                                     f"{'.'.join(map(str, extra))}: Extra inputs are not "
                                     f"permitted")
        huge = self._read_as_infinity(arguments, validated)
        if huge:
            raise ToolArgumentsError(f"invalid arguments for {self.name}: " + "; ".join(
                f"{'.'.join(map(str, path)) or 'arguments'}: the integer of {digits} digits "
                f"is past a float's range (read as a float, it is infinity)"
                for path, digits in huge))
        values = {name: validated.__dict__[name] for name in type(validated).model_fields}
        args = [values.pop(name) for name in self.positional]
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(*args, **values)
        elif inspect.isasyncgenfunction(self.fn):  # what it yields, as a list (under the timeout)
            return [item async for item in self.fn(*args, **values)]
        else:
            stop = threading.Event()  # a generator's items are taken until the call ends
            try:
                result = await _in_daemon_thread(
                    functools.partial(_drained, stop, self.fn, *args, **values))
            finally:  # timed out or cancelled: stop taking them
                stop.set()
        if inspect.isawaitable(result):  # an async function behind a plain wrapper
            result = await result
        if inspect.isasyncgen(result):  # ... an async generator function behind one
            result = [item async for item in result]
        return result

    def _read_as_infinity(self, arguments: dict[str, Any], validated: Any
                          ) -> list[tuple[tuple[str | int, ...], int]]:
        """Where the call's JSON gives an integer past a float's range that pydantic read as a
        float, infinity (an int's, a Decimal's stays what it was), with its digits: where the
        validated arguments hold infinities, each such integer is replaced in turn by the
        integer of its sign at the edge of a float's range (what a field whose 0 is refused,
        a PositiveInt, still takes), then by 1 and 0 (where a validator scales the edge back
        to infinity, or the field refuses it: multiple_of 0.5), and those whose replacement
        leaves fewer are named (one refused by every value is not: that says nothing of
        infinity); where none alone does (a set of
        two), all at once. A path is not followed: validators move values (a model
        validator swapping two fields, a key's AfterValidator), and an infinity already in
        the defaults (a dataclass's max_price = inf) is in every count alike."""
        huge = list(_past_a_float(arguments))
        count = _infinities(validated) if huge else 0
        if not count:
            return []

        def fewer(paths: list[tuple[str | int, ...]]) -> bool:
            for probe in (_FLOAT_MAX, 1, 0):  # the edge, then small values a validator scales
                changed = arguments
                for path in paths:
                    changed = _replaced(changed, path, probe)
                try:
                    again = self.params_model.model_validate_json(json.dumps(changed),
                                                                  strict=True)
                except pydantic.ValidationError:
                    continue
                if _infinities(again) < count:
                    return True
            return False

        guilty = [(path, digits) for path, digits in huge if fewer([path])]
        if not guilty and len(huge) > 1 and fewer([path for path, _ in huge]):
            guilty = huge
        return guilty

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the underlying function directly (no validation)."""
        return self.fn(*args, **kwargs)


def _past_a_float(value: Any, path: tuple[str | int, ...] = ()
                  ) -> Iterator[tuple[tuple[str | int, ...], int]]:
    """Where the JSON ``value`` holds an integer past a float's range (1 and 400 zeros: JSON's
    grammar and llguidance's allow it, and pydantic reads it as infinity where it wants a
    float), with its digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _FLOAT_MAX:
        yield path, len(str(abs(value)))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _past_a_float(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _past_a_float(item, (*path, i))


_FLOAT_MAX = int(sys.float_info.max)


def _replaced(value: Any, path: tuple[str | int, ...], probe: int = _FLOAT_MAX) -> Any:
    """The JSON ``value`` with the integer of its sign at the edge of a float's range at
    ``path`` (copied along it)."""
    if not path:
        return probe if value > 0 else -probe
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replaced(value[head], rest, probe)}
    return [*value[:head], _replaced(value[head], rest, probe), *value[head + 1:]]


def _infinities(value: Any) -> int:
    """How many infinite floats validated arguments hold (in models' and dataclasses' fields,
    sequences, sets, mappings' keys and values)."""
    if isinstance(value, float):
        return math.isinf(value)
    if isinstance(value, pydantic.BaseModel):
        return sum(_infinities(getattr(value, name, None)) for name in type(value).model_fields)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_infinities(getattr(value, f.name, None)) for f in dataclasses.fields(value))
    if isinstance(value, Mapping):
        return sum(_infinities(k) + _infinities(v) for k, v in value.items())
    if isinstance(value, (Sequence, Set)) and not isinstance(value, (str, bytes, bytearray)):
        return sum(_infinities(item) for item in value)
    return 0


def _drained(stop: threading.Event, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(...)``, a generator's items as a list: taken where ``fn`` runs (its thread, under
    its timeout), not where the result is written for the model; no more once ``stop`` is set
    (the call timed out, or was cancelled), and the generator is closed."""
    result = fn(*args, **kwargs)
    if not inspect.isgenerator(result):
        return result
    items = []
    for item in result:
        if stop.is_set():
            result.close()
            break
        items.append(item)
    return items


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a daemon thread of its own. A call that outlives its timeout (or its run, or a
    Ctrl-C) keeps running there until it returns, but holds neither the run nor the process's
    exit: a worker thread of anyio's pool would be joined when the interpreter exits. It sees
    the caller's context variables (and so its current trace span), as an async tool would."""
    token = anyio.lowlevel.current_token()
    context = contextvars.copy_context()
    try:  # not a dependency of anyio's any more; where it is not, nothing marks the library
        import sniffio
    except ImportError:
        pass
    else:  # but not that an async library runs here (as anyio's own worker threads): a tool
        # that runs an event loop of its own (Runner.run_sync, anyio.run) was refused
        context.run(sniffio.current_async_library_cvar.set, None)
    done = anyio.Event()
    outcome: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            outcome.append((True, context.run(fn)))
        except BaseException as err:  # re-raised in the caller
            outcome.append((False, err))
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except anyio.RunFinishedError:  # nobody waits any more
            pass

    threading.Thread(target=target, name="agentflash-tool", daemon=True).start()
    await done.wait()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _raised_by_the_tool() -> bool:
    """Whether a cancellation exception that reached ``run_tool`` came from inside the tool
    rather than from a cancel scope around it: under asyncio, one that nobody requested of the
    running task (a cancel scope's cancellation is requested of the task it cancels)."""
    import asyncio

    try:
        task = asyncio.current_task()
    except RuntimeError:  # another event loop (trio): its cancellation cannot be raised by hand
        return False
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    return cancelling is not None and cancelling() == 0


def undeclared_key(value: Any, schema: Any, root: Any = None,
                   path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """Where ``value`` holds a key that an object of the closed ``schema`` (``strict_schema``:
    what the grammar writes) does not take, or None. pydantic drops such a key of a model
    (``extra="ignore"``, its default) where the schema the model was shown refuses it: a
    model without the grammar (a remote server) wrote it, and it was silently lost."""
    from agentflash.grammar.checks import matches_pattern  # (None: a pattern of llguidance's
    # dialect, \p{Lu}, which Python cannot read: the key may match it)

    root = schema if root is None else root
    if not isinstance(schema, dict):
        return None
    if isinstance(schema.get("$ref"), str):
        found = undeclared_key(value, _referred(schema, root), root, path)
        if found is not None:
            return found
    branches = [b for b in (schema.get("anyOf") or schema.get("oneOf") or [])
                if _json_type(b, root) == _json_type_of(value)]
    if len(branches) == 1:  # Optional[Model]: the one branch the value can be
        return undeclared_key(value, branches[0], root, path)
    if branches:  # a union of models: the branches the value is meant for (its tag's, where
        # its constant fields tell), where none of them takes the key
        meant = [b for b in branches if _may_be(value, b, root)] or branches
        found = [undeclared_key(value, b, root, path) for b in meant]
        return None if None in found else found[0]
    if isinstance(value, dict):
        fields = schema.get("properties") or {}
        patterns = schema.get("patternProperties") or {}
        rest = schema.get("additionalProperties")
        for key, item in value.items():
            # JSON Schema's order: the key's property, else every pattern it matches, else
            # additionalProperties (a pattern Python cannot read takes the key)
            subs = ([fields[key]] if key in fields
                    else [sub for pattern, sub in patterns.items()
                          if matches_pattern(pattern, key) is not False])
            if not subs and rest is False:
                return (*path, key)
            for sub in subs or [rest]:
                found = undeclared_key(item, sub, root, (*path, key))
                if found is not None:
                    return found
    elif isinstance(value, list):
        prefix = schema.get("prefixItems") or []
        for i, item in enumerate(value):
            found = undeclared_key(item, prefix[i] if i < len(prefix) else schema.get("items"),
                                   root, (*path, i))
            if found is not None:
                return found
    return None


def _may_be(value: Any, schema: Any, root: Any) -> bool:
    """Whether an object ``value`` has every key the object ``schema`` requires, and the value
    its ``const`` or ``enum`` properties allow (a tagged union's tag): the branches of a union
    that pydantic may validate it as."""
    if isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        schema = _referred(schema, root)
    if not isinstance(schema, dict) or not isinstance(value, dict):
        return True
    if any(key not in value for key in schema.get("required") or []):
        return False
    for key, sub in (schema.get("properties") or {}).items():
        if isinstance(sub, dict) and isinstance(sub.get("$ref"), str):
            sub = _referred(sub, root)
        if key in value and isinstance(sub, dict) and (
                ("const" in sub and value[key] != sub["const"])
                or (isinstance(sub.get("enum"), list) and value[key] not in sub["enum"])):
            return False
    return True


def _json_type_of(value: Any) -> str:
    return "object" if isinstance(value, dict) else "array" if isinstance(value, list) else ""


def _referred(schema: dict[str, Any], root: Any) -> Any:
    """The subschema of ``root`` that ``schema``'s local ``$ref`` names (None for another)."""
    ref: str = schema["$ref"]
    if not ref.startswith("#/"):
        return None
    target: Any = root
    for part in ref[2:].split("/"):
        target = target.get(part) if isinstance(target, dict) else None
    return target


def _json_type(schema: Any, root: Any) -> str:
    """A subschema's "object" or "array" (through a local ``$ref``), else ""."""
    if isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        schema = _referred(schema, root)
    if not isinstance(schema, dict):
        return ""
    kind = schema.get("type")
    if kind in ("object", "array"):
        return kind
    return "object" if "properties" in schema else "array" if "items" in schema else ""


def _validation_message(name: str, err: pydantic.ValidationError) -> str:
    problems = []
    for e in err.errors(include_url=False):
        where = ".".join(str(p) for p in e["loc"]) or "arguments"
        problems.append(f"{where}: {e['msg']}")
    return f"invalid arguments for {name}: " + "; ".join(problems)


def _in_a_class(fn: Any) -> bool:
    """Whether ``fn`` is a plain function defined in a class's body (its ``__qualname__``
    ``W.get`` or ``f.<locals>.W.get``, not ``get`` nor ``f.<locals>.get``)."""
    if not inspect.isfunction(fn):  # a bound method's self is no parameter of its signature
        return False
    parts = getattr(fn, "__qualname__", "").split(".")
    return len(parts) >= 2 and parts[-2] != "<locals>"


def _check_bound(fn: Any, source: Any, where: str) -> None:
    """``UserError`` where ``fn`` is a method taken from its class's body, whose first parameter
    (``self``, ``cls``) is still to be given: @tool on a method. "'self' has no type hint"
    invited a hint, which put self into the schema, for the model to write (and a hint of the
    class itself failed to resolve, inside a function). A first ``self``/``cls`` hinted as a
    value a model can give (a staticmethod's ``cls: int``, a class label, a list, a model) is
    a parameter (``_the_owner``)."""
    if not _in_a_class(source):
        return
    try:
        first = next(iter(inspect.signature(fn).parameters.values()), None)
    except (ValueError, TypeError):  # what the signature's own check below reports
        return
    if first is None or first.name not in ("self", "cls"):
        return
    owner = (source.__module__, source.__qualname__.rsplit(".", 1)[0])
    if first.annotation is inspect.Parameter.empty or _the_owner(
            _resolved(first.annotation, source), owner):
        raise UserError(_unbound_method(where, source, first.name))


def _resolved(hint: Any, fn: Any) -> Any:
    """``hint`` with a string (or one inside it) read in ``fn``'s module, else ``None``."""
    holder = types.SimpleNamespace(__annotations__={"hint": hint})
    try:
        return typing.get_type_hints(holder, getattr(fn, "__globals__", {}),
                                     include_extras=True)["hint"]
    except Exception:  # noqa: BLE001  (a name of the class's own body, a TypeVar's "W[T]")
        return None


_SELVES = tuple(t for t in (getattr(typing, "Self", None),
                             getattr(sys.modules.get("typing_extensions"), "Self", None)) if t)


def _the_owner(hint: Any, owner: tuple[str, str]) -> bool:
    """Whether a first ``self``/``cls`` hinted ``hint`` (resolved; ``None`` where it did not
    resolve) means the instance or class of ``owner`` (its module and qualified name: a model
    of another module by the same name is a value), or nothing a model
    gives: ``Any``, ``object``, ``type`` / ``type[...]``, ``Self``, a TypeVar, the owner
    itself (also parametrized, or inside Optional/Union), a Protocol, an unresolved string.
    Any other hint (a scalar, a list, a date, a model, a NewType) is a value, a parameter."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if hint is None or hint is Any or hint is object or hint in _SELVES:
        return True
    if isinstance(hint, typing.TypeVar) or hint is type or typing.get_origin(hint) is type:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_the_owner(a, owner) for a in typing.get_args(hint))
    cls = typing.get_origin(hint) or hint  # "Weather[T]"
    return isinstance(cls, type) and (
        (getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)) == owner
        or getattr(cls, "_is_protocol", False))


def _unbound_method(where: str, fn: Any, first: str) -> str:
    owner, attr = fn.__qualname__.split(".")[-2:]
    if first == "cls":
        bound = f"{owner}.{attr} of a @classmethod, as tool({owner}.{attr})"
    else:
        bound = f"obj.{attr} of an instance obj = {owner}(...), as tool(obj.{attr})"
    return (f"{where}: is an unbound method (its first parameter {first!r} is no argument a "
            f"model can give): pass the bound method instead ({bound} or "
            f"Agent(tools=[...])), or make it a @staticmethod without {first}")


# classes whose docstrings describe themselves, never a tool of the user's: Python's own (object's
# "Call self as a function." for an undocumented __call__), pydantic's (BaseModel's)
_LIBRARIES = frozenset(sys.stdlib_module_names) | {"pydantic", "pydantic_core",
                                                   "typing_extensions"}


def _docstring(source: Any, instance: Any = None) -> str:
    """The docstring the user wrote for a tool of ``source``: a class's own (``_class_doc``);
    a routine's own, else that of the method it overrides in a class of the user's
    (``inspect.getdoc``'s rule, less the docs of Python's and pydantic's classes); for a
    callable object (``instance``, ``source`` its class's ``__call__``), its ``__call__``'s,
    else its class's own. '' where the user wrote none."""
    if isinstance(source, type):
        return _class_doc(source)
    owner = type(instance) if instance is not None else None
    if owner is None:
        own = getattr(source, "__doc__", None)
        if isinstance(own, str):
            return inspect.cleandoc(own)
        if inspect.ismethod(source):  # bound to an instance, or to a class (a classmethod)
            owner = source.__self__ if isinstance(source.__self__, type) else type(
                source.__self__)
        else:
            owner = _defining_class(source)
    doc = ""
    name = getattr(source, "__name__", None)
    if owner is not None and isinstance(name, str):
        doc = next((inspect.cleandoc(d) for d in (
            # only the classes that define it: vars(c).get(name) of the others is None, whose
            # __doc__ is a string from Python 3.13 on ("The type of the None singleton.")
            getattr(vars(c)[name], "__doc__", None) for c in owner.__mro__
            if vars(c).get(name) is not None
            and str(getattr(c, "__module__", None) or "").partition(".")[0]
            not in _LIBRARIES) if isinstance(d, str)), "")
    return doc or (_class_doc(owner) if instance is not None else "")


def _defining_class(fn: Any) -> type | None:
    """The class whose body defines the function ``fn`` (a staticmethod), found by its
    qualified name in its module, else ``None`` (a function of a function's body)."""
    parts = getattr(fn, "__qualname__", "").split(".")
    holder = sys.modules.get(getattr(fn, "__module__", None) or "")
    for part in parts[:-1]:
        holder = getattr(holder, part, None)
    return holder if len(parts) > 1 and isinstance(holder, type) else None


def _class_doc(cls: type) -> str:
    """The class's own docstring (not one it inherits: BaseModel's), less the one a dataclass or
    a namedtuple is given where it has none, ``DC(x: int)``, ``NT(x,)``."""
    doc = vars(cls).get("__doc__")
    if not isinstance(doc, str):
        return ""
    made: set[str] = set()
    if dataclasses.is_dataclass(cls):  # dataclasses' text: the class's name and signature
        made.add(cls.__name__)
        try:
            made.add(cls.__name__ + str(inspect.signature(cls)).replace(" -> None", ""))
        except (TypeError, ValueError):
            pass
    fields = getattr(cls, "_fields", None)
    if issubclass(cls, tuple) and isinstance(fields, tuple):  # namedtuple's: "NT(x,)" or "NT(x)"
        names = ", ".join(map(str, fields))
        made |= {f"{cls.__name__}({names})", f"{cls.__name__}({names},)"}
    return "" if doc in made else inspect.cleandoc(doc)


def function_tool(fn: Callable[..., Any], *, name: str | None = None,
                  description: str | None = None, timeout_s: float | None = None) -> FunctionTool:
    """A ``FunctionTool`` from ``fn``'s signature, type hints and docstring."""
    if isinstance(fn, classmethod):  # @tool over @classmethod: no class to bind it to yet
        where = getattr(fn.__func__, "__qualname__", repr(fn.__func__))
        owner, _, attr = where.rpartition(".")
        owner = owner.rpartition(".")[2]
        bound = (f"tool({owner}.{attr}) after the class" if owner not in ("", "<locals>")
                 else "tool() of the method bound to its class")
        raise UserError(f"{where}: @tool over @classmethod would make the tool before its class "
                        f"exists: keep the @classmethod alone and make the tool with {bound}")
    if not callable(fn):
        raise UserError(f"@tool needs a function, got {type(fn).__name__}")
    where = getattr(fn, "__qualname__", repr(fn))
    if name is None and not hasattr(fn, "__name__"):  # a functools.partial, a callable object
        raise UserError(f"{where}: has no __name__; give the tool one (tool(name=...))")
    name = _check_name(fn.__name__ if name is None else name, where)
    _check_description(description, where)
    _check_timeout(timeout_s, where)
    # where the hints and the docstring are: a partial's function, a callable object's __call__
    source, instance = fn, None
    while isinstance(source, functools.partial):
        source = source.func
    if not (inspect.isroutine(source) or isinstance(source, type)):  # an object with __call__
        instance, source = source, type(source).__call__
    _check_bound(fn, source, where)
    summary, param_docs = parse_docstring(_docstring(source, instance))
    try:
        hints = typing.get_type_hints(source, include_extras=True)
    except Exception as err:  # unresolvable forward references and the like
        raise UserError(f"{where}: cannot read the type hints: {err}") from None
    init = getattr(source, "__init__", None)
    if isinstance(source, type) and inspect.isfunction(init):
        # a class: its parameters are its __init__'s, and so are their hints (a ClassVar of
        # the same name is none), read with the names of the class that defines it (a nested
        # Enum); but **data of pydantic's own __init__, whose fields are the signature's
        owner = next(c for c in source.__mro__ if "__init__" in vars(c))
        named = [p.name for p in inspect.signature(init).parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        try:
            own = typing.get_type_hints(init, localns=dict(vars(owner)), include_extras=True)
        except Exception:  # noqa: BLE001  (the class's own hints, as before)
            own = {}
        hints |= {name: hint for name, hint in own.items() if name in named}
    try:
        signature = inspect.signature(fn)
    except (ValueError, TypeError) as err:  # a builtin of C (max): no signature to read
        raise UserError(f"{where}: its signature cannot be read ({err}): wrap it in a "
                        f"function with typed parameters") from None
    fields: dict[str, Any] = {}
    positional = []
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            stars = "*" if param.kind is param.VAR_POSITIONAL else "**"
            raise UserError(f"{where}: a tool cannot take {stars}{param.name} (nor any *args "
                            f"or **kwargs): list its parameters")
        if param.name not in hints:
            raise UserError(f"{where}: parameter {param.name!r} has no type hint (the tool's "
                            f"schema is made from the hints)")
        if param.name == "model_config":  # pydantic reads it as the model's settings
            raise UserError(f"{where}: parameter 'model_config' is a name pydantic keeps for "
                            f"itself; rename it")
        if param.name.startswith("_"):  # pydantic's private attributes, and create_model's
            # own keywords (__doc__ raised an AttributeError, __module__ was dropped unsaid)
            raise UserError(f"{where}: parameter {param.name!r} begins with an underscore, "
                            f"which pydantic keeps for private attributes; rename it")
        if param.kind is param.POSITIONAL_ONLY:
            positional.append(param.name)
        doc = param_docs.get(param.name)
        if isinstance(param.default, FieldInfo):  # x: int = Field(3, ge=0): the field itself
            info = param.default
            if doc and not info.description:  # set through pydantic, whose models rebuild it
                info = FieldInfo.merge_field_infos(info, description=doc)
        else:
            default = ... if param.default is param.empty else param.default
            # x: Annotated[int, Field(description=...)]: its own words over the docstring's
            own = any(isinstance(m, FieldInfo) and m.description
                      for m in getattr(hints[param.name], "__metadata__", ()))
            info = pydantic.Field(default) if own else pydantic.Field(default, description=doc)
        fields[param.name] = (hints[param.name], info)
    try:
        model, schema = _arguments_model(f"{name}_arguments", fields)
    except NotBindable as err:
        name = next(n for n, (hint, _) in fields.items() if not _bindable(hint))
        raise UserError(f"{where}: parameter {name!r}: {err}") from None
    except SCHEMA_ERRORS as err:
        raise UserError(_undescribed(where, f"{name}_arguments", fields, err)) from None
    _check_defaults(model, where)
    from agentflash.grammar.tool_calls import check_parameters

    check_parameters(schema, where)  # one the grammar can bind a call to (set[int]: it cannot)
    return FunctionTool(name, description if description is not None else summary, model, schema,
                        fn, timeout_s, tuple(positional))


def _arguments_model(name: str, fields: dict[str, Any]
                     ) -> tuple[type[pydantic.BaseModel], dict[str, Any]]:
    """The model of a tool's arguments (``fields``: each a hint and its ``FieldInfo``) and its
    strict JSON Schema."""
    with warnings.catch_warnings():  # a parameter named json or copy is the tool's own
        warnings.filterwarnings("ignore", message=".*shadows an attribute in parent")
        model = pydantic.create_model(name, __config__=pydantic.ConfigDict(extra="forbid"),
                                      **fields)
    return model, strict_schema(model.model_json_schema(schema_generator=GrammarJsonSchema))


def _undescribed(where: str, model_name: str, fields: dict[str, Any], err: Exception) -> str:
    """The error of a tool whose parameters pydantic cannot describe (``err``), naming the first
    one it cannot describe alone (a Callable's "Cannot generate a JsonSchema for
    core_schema.CallableSchema" named none), without pydantic's advice (``schema_problem``)."""
    for name, spec in fields.items():
        try:
            _arguments_model(model_name, {name: spec})  # (pydantic's words name the model)
        except NotBindable:
            continue
        except SCHEMA_ERRORS as own:
            advice = ""
            if isinstance(own, (pydantic.PydanticSchemaGenerationError,
                                pydantic.PydanticInvalidForJsonSchema)):  # its type's
                advice = ("; a tool's arguments are JSON the model writes: give it a type "
                          "pydantic describes (str, int, a list, a model)")
            return (f"{where}: parameter {name!r}: pydantic cannot describe it: "
                    f"{schema_problem(own)}{advice}")
    return f"{where}: pydantic cannot describe the parameters: {schema_problem(err)}"


def schema_problem(err: Exception) -> str:
    """What pydantic says it cannot describe: its error's first line (then come paragraphs),
    less its advice to set ``arbitrary_types_allowed`` in a model_config, which a tool or an
    output_type has none of (and with which the type would still have no JSON Schema); a
    SchemaError's last line, its cause ("look-around ... is not supported" under "Error
    building "model" validator:")."""
    lines = str(err).strip().splitlines() or [type(err).__name__]
    text = lines[-1] if isinstance(err, pydantic_core.SchemaError) else lines[0]
    return re.split(r"\.? Set `arbitrary_types_allowed", text)[0]


def _check_defaults(model: type[pydantic.BaseModel], where: str) -> None:
    """Each parameter's default a value of its type (``x: int = "3"`` passes as 3): a call that
    left it out handed the function a value its schema refuses (``x: int = "x"``, or
    ``Field(-1, ge=0)``). A default of None is Python's old spelling of an optional one."""
    for name, info in model.model_fields.items():
        if info.is_required() or info.default is None or info.default_factory is not None:
            continue
        hint = (typing.Annotated[(info.annotation, *info.metadata)] if info.metadata
                else info.annotation)  # the field's constraints (ge=0) with its type
        try:
            pydantic.TypeAdapter(hint).validate_python(info.default)
        except pydantic.ValidationError as err:
            problem = err.errors()[0]["msg"]
            raise UserError(f"{where}: parameter {name!r}: its default {info.default!r} is "
                            f"not a value of its type: {problem}") from None
        except Exception:  # the parameter's own validator, meant for what the model writes
            continue  # (a "L2" its default is already parsed from): it cannot tell


def _bindable(hint: Any) -> bool:
    """Whether the grammar can bind a value of type ``hint`` (``NotBindable``)."""
    try:
        pydantic.TypeAdapter(hint).json_schema(schema_generator=GrammarJsonSchema)
    except NotBindable:
        return False
    except SCHEMA_ERRORS:
        pass
    return True


@overload
def tool(fn: Callable[..., Any], /) -> FunctionTool: ...
@overload
def tool(*, name: str | None = None, description: str | None = None,
         timeout_s: float | None = None) -> Callable[[Callable[..., Any]], FunctionTool]: ...


def tool(fn: Callable[..., Any] | None = None, /, *, name: str | None = None,
         description: str | None = None, timeout_s: float | None = None):
    """Make a function (sync or async) a tool: ``@tool`` or ``@tool(name=..., timeout_s=...)``.

    Every parameter needs a type hint; parameter descriptions come from the docstring's ``Args:``
    (Google), ``Parameters`` (NumPy) or ``:param x:`` (Sphinx) entries, the tool's description
    from the docstring's summary. The docstring is the one the user wrote (``_docstring``): a
    class's own, a callable object's ``__call__``'s else its class's; never one inherited from
    Python's or pydantic's classes, nor the one dataclasses or namedtuple make of the fields.
    """
    if fn is not None:
        return function_tool(fn, name=name, description=description, timeout_s=timeout_s)
    return functools.partial(function_tool, name=name, description=description,
                             timeout_s=timeout_s)


# --- HTTP tools ---------------------------------------------------------------------------------

HTTP_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def no_parameters() -> dict[str, Any]:
    """The schema of a tool that takes no arguments."""
    return {"type": "object", "properties": {}, "additionalProperties": False}


MAX_REPLY_BYTES = 1 << 20  # an http tool's reply, at most (far more than a prompt holds)


@dataclass(frozen=True)
class HttpTool:
    """Calls one declared URL with the model's arguments (query string for GET and DELETE, JSON
    body otherwise). The URL is fixed: arguments never change it, and redirects are not followed."""

    name: str
    description: str
    method: str
    url: str
    parameters: dict[str, Any] = field(default_factory=no_parameters)
    timeout_s: float | None = 10.0

    def __post_init__(self) -> None:
        """Checks the definition; a ``UserError``'s ``key`` is the field it names (a
        workflow's error names that key's line)."""
        checks = ((("name",), self._check_name), (("description",), self._check_description),
                  (("http", "method"), self._check_method),
                  (("http", "url"), self._check_url), (("timeout_s",), self._check_timeout),
                  (("parameters",), self._check_parameters))
        for key, check in checks:
            try:
                check()
            except UserError as err:
                err.key = key  # type: ignore[attr-defined]
                raise

    def _check_name(self) -> None:
        _check_name(self.name, f"http tool {self.name!r}")

    def _check_description(self) -> None:
        if not isinstance(self.description, str):  # None too: it has no docstring to read
            raise UserError(f"http tool {self.name!r}: description must be a string, got "
                            f"{type(self.description).__name__}")

    def _check_method(self) -> None:
        if self.method not in HTTP_METHODS:
            raise UserError(f"http tool {self.name!r}: method must be one of "
                            f"{', '.join(HTTP_METHODS)}, got {self.method!r}")

    def _check_url(self) -> None:
        import httpx  # imported now, so that the first call does not stall the loop

        try:
            parts = urlsplit(self.url)
            parts.port  # noqa: B018  (raises on a port that is no number or past 65535)
            httpx.URL(self.url)
        except (ValueError, httpx.InvalidURL) as err:
            raise UserError(f"http tool {self.name!r}: url {self.shown_url!r} is not a valid "
                            f"URL: {err}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"http tool {self.name!r}: url must be an absolute http(s) URL, "
                            f"got {self.shown_url!r}")
        if any(ch.isspace() or not ch.isprintable() for ch in self.url):
            # httpx sends "exa mple.com" as the host exa%20mple.com, which no name resolves
            raise UserError(f"http tool {self.name!r}: url {self.shown_url!r} holds a blank or "
                            f"a control character: percent-encode it")

    def _check_timeout(self) -> None:
        _check_timeout(self.timeout_s, f"http tool {self.name!r}")

    def _check_parameters(self) -> None:
        from agentflash.grammar.tool_calls import check_parameters

        # what a call's arguments are constrained to: checked now, not at the first call
        check_parameters(self.parameters, f"http tool {self.name!r}")
        clash = sorted(self._declared_query() & set(self.parameters.get("properties", {})))
        if clash:
            raise UserError(f"http tool {self.name!r}: parameter {clash[0]!r} is also in the "
                            f"url's query, which arguments never change")

    @property
    def shown_url(self) -> str:
        """The URL as errors show it, to the model too: without a user, password or query,
        where a key may be."""
        return shown_url(self.url)

    def _declared_query(self) -> set[str]:
        """The query keys of the declared URL where arguments go in the query (else none)."""
        if self.method not in ("GET", "DELETE"):
            return set()
        return {key for key, _ in parse_qsl(urlsplit(self.url).query, keep_blank_values=True)}

    async def call(self, arguments: dict[str, Any]) -> Any:
        import httpx

        from agentflash.grammar.sources import close_objects, exact_dates
        from agentflash.json_formats import error_message, value_validator

        # what the grammar lets the model write: no keys the schema does not list, formats kept,
        # a pattern's "$" as JSON Schema reads it (the text's end, not before a newline)
        schema = exact_dates(close_objects(self.parameters))
        errors = sorted(value_validator(schema).iter_errors(arguments), key=str)
        problems = [f"{'.'.join(map(str, e.absolute_path)) or 'arguments'}: "
                    f"{error_message(e)}" for e in errors]
        problems += [f"{key}: is the url's own query parameter"
                     for key in sorted(self._declared_query() & set(arguments))]
        if problems:
            raise ToolArgumentsError(f"invalid arguments for {self.name}: {'; '.join(problems)}")
        query = self.method in ("GET", "DELETE")
        url = self.url
        encoded = urlencode(_query(arguments), doseq=True, quote_via=quote) if query else ""
        if encoded:  # (an empty list is no pair)
            # the model's arguments after the query the declared URL has, which is sent as
            # written (httpx's params re-encode it: ?acl as ?acl=, a signature's %20 as +)
            base, hash_, fragment = url.partition("#")
            query_of = urlsplit(base).query
            joiner = ("" if base.endswith("?") or (query_of and base.endswith("&"))
                      else "&" if query_of else "?")
            url = base + joiner + encoded + hash_ + fragment
        async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False) as client:
            async with client.stream(self.method, url,
                                     json=None if query else arguments) as response:
                body = bytearray()  # read up to the cap (held in memory, then in the prompt)
                async for piece in response.aiter_bytes():
                    body += piece
                    if len(body) > MAX_REPLY_BYTES:
                        raise RuntimeError(
                            f"HTTP {response.status_code} from {self.shown_url}: the reply is "
                            f"larger than {MAX_REPLY_BYTES >> 20} MiB (a tool's result goes into "
                            "the model's prompt)")
        text = body.decode(response.encoding or "utf-8", errors="replace")
        if not response.is_success:
            raise RuntimeError(f"HTTP {response.status_code} from {self.shown_url}: {text[:300]}")
        if response.headers.get("content-type", "").startswith("application/json"):
            try:  # the bytes: json finds their encoding (a BOM, UTF-16) as response.json() did
                return json.loads(bytes(body))
            except ValueError:  # empty (204 No Content) or not JSON after all: its text
                pass
        return text


def _query(arguments: dict[str, Any]) -> dict[str, Any]:
    """Query parameters: scalars and lists of scalars as they are, anything else as JSON."""
    def encode(v: Any) -> Any:
        if isinstance(v, bool):
            return "true" if v else "false"
        return v if isinstance(v, (str, int, float)) else json.dumps(v)
    return {k: [encode(x) for x in v] if isinstance(v, list) else encode(v)
            for k, v in arguments.items() if v is not None}


Tool = FunctionTool | HttpTool


def tool_spec(t: Tool) -> dict[str, Any]:
    """The tool in the OpenAI tools-list format."""
    return {"type": "function", "function": {"name": t.name, "description": t.description,
                                             "parameters": t.parameters}}


@dataclass(frozen=True)
class ToolOutcome:
    """What a tool call gave the model: its result text, or the error it reported."""

    output: str
    is_error: bool
    duration_s: float
    error_type: str | None = None  # the exception's type, or timeout, invalid_arguments...


async def run_tool(t: Tool, arguments: dict[str, Any]) -> ToolOutcome:
    """Call ``t``; an exception or a timeout becomes an error result for the model."""
    started = anyio.current_time()

    def failed(message: str, error_type: str) -> ToolOutcome:
        return ToolOutcome(error_result(message), True, anyio.current_time() - started,
                           error_type)

    try:
        with anyio.move_on_after(t.timeout_s) as scope:
            value = await t.call(arguments)
        if scope.cancelled_caught:
            return failed(f"{t.name} timed out after {t.timeout_s:g} s", "timeout")
    except ToolArgumentsError as err:
        return failed(str(err), "invalid_arguments")
    except Exception as err:  # the tool's own failure is the model's to handle
        while isinstance(err, ExceptionGroup) and len(err.exceptions) == 1:
            err = err.exceptions[0]  # a task group's one failure, not "unhandled errors in..."
        if isinstance(err, RuntimeError) and isinstance(err.__cause__, StopIteration):
            err = err.__cause__  # next() on an empty iterator: a coroutine cannot raise it
        return failed(described(err), type(err).__name__)
    except SystemExit as err:  # a tool that wraps a command line's main(): not the run's exit
        return failed(f"{t.name} called exit({err.code!r})", "SystemExit")
    except anyio.get_cancelled_exc_class() as err:
        if sys.version_info < (3, 11) and type(err).__module__.startswith("asyncio"):
            # no Task.cancelling(): a cancel scope around the tool raises here again
            await anyio.lowlevel.checkpoint_if_cancelled()
        elif not _raised_by_the_tool():
            raise  # the run (or its caller) is cancelled
        # a task the tool awaited was cancelled under it: its failure, like any other
        return failed(described(err), type(err).__name__)
    try:
        return ToolOutcome(format_result(value), False, anyio.current_time() - started)
    except Exception as err:  # bytes that are not UTF-8, a list that holds itself, a bad __str__
        return failed(f"{t.name} returned a value that cannot be written as JSON: "
                      f"{described(err)}", "unserializable_result")


