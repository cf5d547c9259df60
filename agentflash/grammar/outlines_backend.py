"""The outlines-core backend: JSON Schema and regex compiled to a token-level DFA index.

Differences from llguidance, by construction: no Lark grammars (so no tool-choice turns, which need
special tokens), no recursive schemas (outlines-core cuts recursion at a fixed depth and would
silently emit values the schema rejects, so they are refused), JSON separators are whitespace
patterns (``JsonStyle.DUMPS`` allows an optional space around ``,`` and ``:``, so json.dumps
layout is allowed but not enforced), and forced tokens are only states with a single legal token.

What outlines-core 0.2.14 would get wrong is refused when the grammar compiles, naming the field:
assertions its regex ignores (bounds, in ``$defs`` too) or keeps at some values only
(``minProperties`` 2 as 1), ``allOf`` / ``oneOf`` / ``not`` / ``dependentSchemas`` / ``if``, the
``email`` format, a string ``pattern`` that could write a raw quote, backslash or control character
(``_pattern_fault``), and a language in which a match goes on through text that is none (a
top-level number, ``a(bc)?``), whose continuations its index drops (``check_continuations``,
against llguidance on the same source). Property names go to it in their JSON spelling
(``_json_spelled``): it escapes them for its regex, not for JSON, and the keys of a const's objects
for neither; a pattern's ``\\d`` and ``\\w`` as the ASCII classes ECMA-262 means
(``_ascii_classes``), not Unicode's. A regex's anchors at its ends are dropped (``_unanchored``):
it fails on a leading one.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentflash.grammar.checks import (
    UNIQUE_ITEMS_REFUSED,
    UncheckedSubschema,
    ignored_keyword,
    inexact_message,
    inexact_value,
    locate_schema_error,
    pointer,
    recursive_ref,
    resolve_ref,
    subschemas,
    value_outside_type,
)
from agentflash.grammar.constraint import (
    CompiledGrammar,
    Constraint,
    GrammarError,
    allowed_token_ids,
)
from agentflash.grammar.sources import GrammarKind, GrammarSource, JsonStyle, with_subschemas
from agentflash.grammar.tokenizers import TokenizerInfo, llguidance_tokenizer
from agentflash.json_formats import DATE_PATTERNS

WHITESPACE_PATTERNS: dict[JsonStyle, str | None] = {
    JsonStyle.DUMPS: "[ ]?",
    JsonStyle.COMPACT: "",
    JsonStyle.FLEXIBLE: None,  # outlines-core's default
}
MAX_ROLLBACK = 1024  # committed tokens a Guide can undo; past them a new one replays the rest
MAX_FORCED = 64  # forced tokens returned at once
MAX_CONTINUATION_CHECKS = 64  # complete matches check_continuations compares, shallowest first


def _outlines() -> Any:
    try:
        import outlines_core
    except ImportError:
        raise GrammarError(
            "the outlines backend needs the outlines-core package "
            "(pip install 'outlines-core>=0.2.11')"
        ) from None
    return outlines_core


@dataclass(frozen=True)
class Vocabularies:
    """outlines-core's ``Vocabulary`` of the tokenizer, and of its tokens of one character or
    one byte alone (``probe``; the bytes spell the characters a tokenizer splits): an index
    over those has the regex's states with few tokens each, cheap to walk
    (``check_continuations``)."""

    full: Any
    probe: Any
    probe_ids: frozenset[int]


def build_tokenizer(info: TokenizerInfo) -> Vocabularies:
    """outlines-core's vocabularies: every ordinary token's bytes (special and added tokens are
    left out: they never occur inside JSON or regex output), plus the end token."""
    lltok = llguidance_tokenizer(info)
    by_bytes: dict[bytes, list[int]] = {}
    for token in range(lltok.vocab_size):
        if token == info.eos_token_id or lltok.is_special_token(token):
            continue
        text = lltok.decode_bytes([token])
        if text:
            by_bytes.setdefault(text, []).append(token)
    chars = {text: ids[:1] for text, ids in by_bytes.items()
             if len(text) == 1 or _one_character(text)}
    vocabulary = _outlines().Vocabulary
    return Vocabularies(vocabulary(info.eos_token_id, by_bytes),
                        vocabulary(info.eos_token_id, chars),
                        frozenset(ids[0] for ids in chars.values()))


def _one_character(text: bytes) -> bool:
    try:
        return len(text.decode("utf-8")) == 1
    except UnicodeDecodeError:  # a byte of a character
        return False


def _schema_regex(source: GrammarSource, schema: Any) -> str:
    oc = _outlines()
    return oc.json_schema.build_regex_from_schema(
        json.dumps(_json_spelled(schema)),
        whitespace_pattern=WHITESPACE_PATTERNS[source.json_style],
    )


def _json_spelling(name: str) -> str:
    """``name`` as JSON writes it between its quotes (``a"b`` -> ``a\\"b``)."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


# what Rust's regex::escape escapes (regex-syntax's meta characters)
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _keys_spelled(value: Any) -> Any:
    """The ``const`` / ``enum`` value ``value`` whose objects' keys are regexes of their JSON
    spelling: outlines-core 0.2.14 puts such a key into its regex as it is, neither escaped for
    JSON nor for the regex (``{"a.b": 1}`` let ``{"axb": 1}`` through)."""
    if isinstance(value, dict):
        return {"".join("\\" + c if c in _REGEX_META else c for c in _json_spelling(key)):
                _keys_spelled(sub) for key, sub in value.items()}
    if isinstance(value, list):
        return [_keys_spelled(sub) for sub in value]
    return value


def _json_spelled(schema: Any) -> Any:
    """``schema`` with the names in ``properties`` and ``required`` written as JSON spells them
    (and the ``$ref`` steps through them): outlines-core 0.2.14 puts a name into its regex as
    it is (regex-escaped, not JSON-escaped), so that it wrote ``{"a"b": 1}``; and the keys of
    objects in ``const`` and ``enum`` as regexes of their JSON spelling (``_keys_spelled``)."""
    maps = {id(node["properties"]) for _, node in subschemas(schema, [])
            if isinstance(node, dict) and isinstance(node.get("properties"), dict)}

    def spelled_ref(ref: str) -> str:
        # outlines-core reads a ref's steps as they are (split at "/", no unescaping)
        head, sep, fragment = ref.partition("#")
        node, parts = schema, fragment.split("/")
        for i, part in enumerate(parts):
            if not part:
                continue
            if id(node) in maps:
                parts[i] = _json_spelling(part)
            node = node.get(part) if isinstance(node, dict) else None
        return head + sep + "/".join(parts)

    def spelled(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = with_subschemas(node, lambda sub, key: spelled(sub))
        if isinstance(out.get("properties"), dict):
            out["properties"] = {_json_spelling(name): sub
                                 for name, sub in out["properties"].items()}
        if isinstance(out.get("required"), list):
            out["required"] = [_json_spelling(name) if isinstance(name, str) else name
                               for name in out["required"]]
        if isinstance(out.get("pattern"), str):
            out["pattern"] = _ascii_classes(out["pattern"])
        if isinstance(out.get("$ref"), str):
            out["$ref"] = spelled_ref(out["$ref"])
        if "const" in out:
            out["const"] = _keys_spelled(out["const"])
        if isinstance(out.get("enum"), list):
            out["enum"] = [_keys_spelled(value) for value in out["enum"]]
        return out

    return spelled(schema)


# ECMA-262's classes (JSON Schema's regex dialect): ASCII, as llguidance reads a schema's pattern;
# Rust's regex (outlines-core's) reads them as Unicode's ('^[a-z]\d$' wrote 'x۸'). A nested class
# is a class inside one too ([\d_] is [[0-9]_])
_ASCII_CLASSES = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}


def _ascii_classes(pattern: str) -> str:
    """A schema's ``pattern`` with ``\\d``, ``\\D``, ``\\w`` and ``\\W`` written as the ASCII
    classes ECMA-262 means by them, inside a class too (an escaped backslash before a ``d`` is
    left: ``\\\\d``)."""
    if "\\" not in pattern:
        return pattern
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            out.append(_ASCII_CLASSES.get(pattern[i + 1], pattern[i:i + 2]))
            i += 2
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)


def _schema_error(source: GrammarSource, schema: Any) -> str | None:
    try:
        _schema_regex(source, schema)
    except (ValueError, TypeError) as err:  # TypeError: a lone surrogate
        return str(err)
    return None


def source_regex(source: GrammarSource) -> str:
    """The regular expression outlines-core compiles for ``source``."""
    if source.kind is GrammarKind.REGEX:
        return _unanchored(source.text)
    if source.kind is GrammarKind.LARK:
        raise GrammarError(
            f"{source.origin}: the outlines backend supports JSON Schema and regex "
            "only; use the llguidance backend for Lark grammars and tool_choice"
        )
    schema = source.schema
    inexact = inexact_value(schema, "outlines")
    if inexact is not None:
        raise GrammarError(f"{source.origin}: {inexact[0]}: "
                           f"{inexact_message(inexact[1], 'outlines')}")
    unsupported = _unsupported(schema)
    if unsupported is not None:
        where, what = unsupported
        raise GrammarError(f"{source.origin}: {where}: {what}; use the llguidance backend")
    loop = recursive_ref(schema)
    if loop is not None:
        raise GrammarError(
            f"{source.origin}: {loop}: recursive schemas are not supported by the "
            "outlines backend (outlines-core cuts recursion at a fixed depth); "
            "use the llguidance backend"
        )
    try:
        pattern = _schema_regex(source, schema)
    except (ValueError, TypeError) as err:
        where = locate_schema_error(schema, lambda s: _schema_error(source, s))
        message = " ".join(str(err).split())
        raise GrammarError(f"{source.origin}: {where}: {message}") from None
    try:
        ignored = ignored_keyword(_date_formats_kept(schema), lambda s: _schema_regex(source, s))
    except UncheckedSubschema as err:
        raise GrammarError(
            f"{source.origin}: {err.where}: outlines-core cannot compile this subschema on its "
            f"own ({err.message}), so whether it keeps its assertions cannot be checked; use "
            f"the llguidance backend") from None
    if ignored is not None:
        where, keyword, counts = ignored
        if keyword == "uniqueItems":  # (llguidance refuses it too)
            raise GrammarError(f"{source.origin}: {where}: {UNIQUE_ITEMS_REFUSED}")
        what = (f"ignores {keyword!r}" if counts is None else
                f"does not keep {keyword!r} {counts[0]}: it writes the same as for "
                f"{keyword!r} {counts[1]}")
        raise GrammarError(
            f"{source.origin}: {where}: outlines-core {what}, so "
            f"its output could break the schema; use the llguidance backend"
        )
    return pattern


def _unanchored(pattern: str) -> str:
    """``pattern`` less the ``^`` / ``\\A`` it starts with (after its leading inline flags,
    ``(?i)``) and the ``$`` / ``\\z`` it ends with. outlines-core 0.2.14 cannot build an index
    where the regex asserts the start ("anchored universal start state doesn't exist"; ``^$``
    too), and the output is matched whole anyway: there they say nothing, whatever is between
    (``^a|b$`` is ``a|b``, as llguidance reads it). A quantified ``^`` is kept (llguidance
    refuses ``^*`` and ``^?``; ``^+`` and ``^{1}`` outlines-core refuses, saying so), and an
    escaped ``$`` or ``z``."""
    flags = ""
    while True:
        group = _INLINE_FLAGS.match(pattern)
        if group is not None:  # (?i) applies to what follows: the anchor may be after it
            flags, pattern = flags + group.group(), pattern[group.end():]
            continue
        anchor = next((a for a in ("^", "\\A") if pattern.startswith(a)), None)
        if anchor is None or pattern[len(anchor):][:1] in ("*", "+", "?", "{"):
            break
        pattern = pattern[len(anchor):]
    while pattern.endswith(("$", "\\z")):
        body = pattern[:-1]
        escapes = len(body) - len(body.rstrip("\\"))  # backslashes right before it
        if escapes % 2 != (pattern[-1] == "z"):  # "\\$" and "\\\\z" are no anchors
            break
        pattern = body[:-1] if pattern[-1] == "z" else body
    return flags + pattern


# a group of inline flags alone (no ":"), as Rust's regex writes them
_INLINE_FLAGS = re.compile(r"\(\?[imsRUux-]+\)")


# keywords outlines-core reads wrongly (0.2.14): allOf's branches one after another ({..}{..});
# oneOf as anyOf; not, dependentSchemas and if/then/else dropped
_UNSUPPORTED = {
    "allOf": "outlines-core writes allOf's branches one after the other, not one value",
    "oneOf": "outlines-core reads oneOf as anyOf, letting a value match several branches",
    "not": "outlines-core ignores 'not'",
    "dependentSchemas": "outlines-core ignores 'dependentSchemas'",
    "if": "outlines-core ignores 'if', 'then' and 'else'",
}
# formats whose outlines-core pattern lets text through that is not a JSON string
_UNSOUND_FORMATS = {"email": "its email pattern writes a raw quote, which JSON refuses",
                    "uri": "its uri pattern writes a raw quote or backslash, which JSON refuses"}


# beside these outlines-core ignores a string's pattern (refused by ``ignored_keyword``, saying so)
_PATTERN_IGNORED_BESIDE = ("enum", "const", "minLength", "maxLength")


_KIND_KEYWORDS = {
    "object": ("properties", "required", "additionalProperties", "patternProperties",
               "minProperties", "maxProperties"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
    "string": ("minLength", "maxLength", "pattern", "format"),
}


def _branch_outside_type(node: dict, root: Any) -> tuple[str, int] | None:
    """(keyword, index) of an anyOf or oneOf branch beside a ``type`` that may write a value of
    another type (outlines-core writes the branches and ignores the type)."""
    if "type" not in node:
        return None
    types = node["type"] if isinstance(node["type"], list) else [node["type"]]
    allowed = {*types, "integer"} if "number" in types else set(types)
    for keyword in ("anyOf", "oneOf"):
        for i, branch in enumerate(node.get(keyword) or []):
            if not _keeps_to(branch, allowed, root, 0):
                return keyword, i
    return None


def _keeps_to(branch: Any, allowed: set[str], root: Any, depth: int) -> bool:
    """Whether every value ``branch`` lets outlines-core write is of one of the ``allowed``
    types, as far as its keywords say: its ``type``, else what its keywords are of (an
    object's ``properties``), its ``const`` or ``enum`` values, where its ``$ref`` points, its
    own anyOf's branches; False where none says."""
    if not isinstance(branch, dict) or depth > 16:
        return False
    kind = branch.get("type")
    if kind is not None:
        return set(kind if isinstance(kind, list) else [kind]) <= allowed
    if "const" in branch or "enum" in branch:
        values = {k: branch[k] for k in ("const", "enum") if k in branch}
        return value_outside_type({**values, "type": sorted(allowed)}) is None
    if isinstance(branch.get("$ref"), str):
        target = resolve_ref(root, branch["$ref"])
        return target is not None and _keeps_to(target, allowed, root, depth + 1)
    if isinstance(branch.get("anyOf"), list) and branch["anyOf"]:
        return all(_keeps_to(b, allowed, root, depth + 1) for b in branch["anyOf"])
    return any(any(k in branch for k in keys) and kind in allowed
               for kind, keys in _KIND_KEYWORDS.items())


def _unsupported(schema: Any) -> tuple[str, str] | None:
    """(pointer, why) of the first keyword outlines-core would not keep to, or None."""
    for path, node in subschemas(schema, []):
        if not isinstance(node, dict):
            continue
        for keyword, why in _UNSUPPORTED.items():
            if keyword in node:
                return pointer(path), why
        if "properties" in node and "anyOf" in node:
            return pointer(path), "outlines-core ignores anyOf beside properties"
        listed, required = node.get("properties", {}), node.get("required")
        types = node.get("type", "object")  # (required says nothing of a string, say)
        if isinstance(listed, dict) and isinstance(required, list) and "object" in (
                types if isinstance(types, list) else [types]):
            unlisted = [name for name in required if name not in listed]
            if unlisted:  # it writes listed keys only, and none would be the required one
                return pointer(path), (f"outlines-core ignores required {unlisted[0]!r}, "
                                       f"which properties does not list")
        if node.get("enum") == []:  # it writes the key and no value: not JSON
            return pointer(path), "outlines-core writes no value for an enum of none"
        branch = _branch_outside_type(node, schema)
        if branch is not None:  # (a tool's parameters without a type are an object's, and
            # it wrote '"arguments": "Oslo"' for an anyOf of a string and an object)
            return pointer(path), (f"outlines-core ignores 'type' beside '{branch[0]}': "
                                   f"{branch[0]}[{branch[1]}] may write a value of another "
                                   f"type")
        outside = value_outside_type(node)
        if outside is not None:
            return pointer(path), (f"outlines-core ignores 'type' beside '{outside[0]}': it "
                                   f"would write {json.dumps(outside[1])}, which the type refuses")
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt.lower() in _UNSOUND_FORMATS:
            return pointer(path), (f"format {fmt!r} is not supported by outlines-core "
                                   f"({_UNSOUND_FORMATS[fmt.lower()]})")
        pattern, kinds = node.get("pattern"), node.get("type")
        if isinstance(pattern, str) and "string" in (kinds if isinstance(kinds, list)
                                                     else [kinds]) and not any(
                keyword in node for keyword in _PATTERN_IGNORED_BESIDE):
            why = _pattern_fault(pattern)
            if why is not None:
                return pointer([*path, "pattern"]), why
    return None


@functools.cache
def _byte_vocabulary() -> Any:
    """outlines-core's ``Vocabulary`` of the 256 bytes (token ``b`` is byte ``b``; 256 ends):
    an index over it is its regex's byte automaton."""
    return _outlines().Vocabulary(256, {bytes([b]): [b] for b in range(256)})


# the byte automaton of "[^"\\\x00-\x1f]*": state -> byte -> state (None: no match)
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


def _json_step(state: int, byte: int) -> int | None:
    if state == 0:
        return 1 if byte == _QUOTE else None
    if state == 1:
        return 2 if byte == _QUOTE else None if byte < 0x20 or byte == _BACKSLASH else 1
    return None


@functools.lru_cache(maxsize=256)  # a function of the text alone: a schema repeats one
def _pattern_fault(pattern: str) -> str | None:
    """Why outlines-core 0.2.14 would write other than a JSON string of ``pattern``, or None.
    It writes the pattern (less a ``^`` and a ``$`` around it) between quotes as it is,
    ``("pattern")``, so whatever its language holds of ``"``, ``\\`` and U+0000-U+001F goes
    raw into the JSON text (invalid, or a string that decodes to another value than the
    pattern matched), and a top-level ``|`` splits the quotes apart (``("a|b")``). Decided on
    the index of ``("pattern")`` over the 256 bytes (its byte automaton): every path to a
    match must spell a quote, bytes none of those, a quote; and on that of the pattern alone,
    from inside the string (``("a"|"b")`` is JSON strings, but ``a"|"b`` matches a quote): no
    path to a match may spell one of them. An anchor elsewhere than around the whole pattern
    (``^a$|^b$``) leaves the index no way to finish the string: refused. None too where
    outlines-core cannot build it otherwise (refused where the schema's index is built)."""
    inner = pattern[1:-1] if pattern.startswith("^") and pattern.endswith("$") else pattern
    written = _ascii_classes(inner)  # (as _json_spelled gives it)
    oc = _outlines()
    errors = []
    try:
        index = oc.Index(f'("{written}")', _byte_vocabulary())
    except ValueError as err:
        index = None
        errors.append(str(err))
    try:  # it compiles between the quotes; alone it must too, or it reads across them
        alone = oc.Index(written, _byte_vocabulary())
    except ValueError as err:
        alone = None
        errors.append(str(err))
    if any("anchored universal start state" in error for error in errors):
        return (f"outlines-core takes '^' and '$' only around the whole pattern, and in "
                f"{pattern!r} an anchor elsewhere leaves it no way to finish the string")
    if index is None:
        return None
    if alone is None and "error building NFA" in errors[-1]:
        return (f"outlines-core writes a pattern between quotes as it is, and {inner!r} "
                "is no regex by itself: read with them, it takes them apart")
    if not _finishes(index):  # '\d+$': its '$' before the closing quote, no match reached
        return (f"outlines-core takes '^' and '$' only around the whole pattern, and in "
                f"{pattern!r} an anchor elsewhere leaves it no way to finish the string")
    text = _unescaped_text(index, 0)
    if text is None and alone is not None:
        text = _unescaped_text(alone, 1)
    if text is None:
        return None
    return ("outlines-core matches a pattern against the JSON text, not the string it "
            f"spells, and by this one it could write {text!r} (a raw quote, backslash or "
            "control character, or text outside the string)")


def _finishes(index: Any) -> bool:
    """Whether a match of ``index`` can be reached from its start."""
    transitions, finals = index.get_transitions(), set(index.get_final_states())
    start = index.get_initial_state()
    seen, stack = {start}, [start]
    while stack:
        for target in transitions.get(stack.pop(), {}).values():
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return not seen.isdisjoint(finals)


def _unescaped_text(index: Any, json_state: int) -> str | None:
    """The shortest text (up to where it breaks) on a path of ``index`` to a match that is no
    JSON string without escapes (``json_state`` 0), or no text inside one (1), or None."""
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    sources: dict[int, list[int]] = {}
    for state, moves in transitions.items():
        for target in moves.values():
            sources.setdefault(target, []).append(state)
    live, stack = set(finals), list(finals)  # the states a match is reachable from
    while stack:
        for state in sources.get(stack.pop(), []):
            if state not in live:
                live.add(state)
                stack.append(state)
    done = 2 if json_state == 0 else 1  # where a match must leave the JSON automaton
    start = (index.get_initial_state(), json_state)
    paths, queue = {start: b""}, [start]
    for state, json_state in queue:  # breadth first
        path = paths[state, json_state]
        if state in finals and json_state != done:
            return path.decode("utf-8", "replace")
        for token, target in transitions.get(state, {}).items():
            if token == 256 or target not in live:  # 256: the end
                continue
            step = _json_step(json_state, token)
            if step is None:
                return (path + bytes([token])).decode("utf-8", "replace")
            if (target, step) not in paths:
                paths[target, step] = path + bytes([token])
                queue.append((target, step))
    return None


def _date_formats_kept(schema: Any) -> Any:
    """``schema`` without the date formats that ``sources.exact_dates`` put a pattern beside:
    outlines-core writes by the pattern, which is the whole format, so ignoring the format
    loses nothing."""
    if not isinstance(schema, dict):
        return schema
    out = with_subschemas(schema, lambda sub, key: _date_formats_kept(sub))
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in DATE_PATTERNS and out.get("pattern") == DATE_PATTERNS[fmt]:
        del out["format"]
    return out


def _index_error(source: GrammarSource, schema: Any, vocabulary: Any) -> str | None:
    """outlines-core's error building the index of the standalone ``schema``, or None."""
    try:
        _outlines().Index(_schema_regex(source, schema), vocabulary)
    except ValueError as err:
        return str(err)
    return None


def _subpattern(schema: Any, where: str) -> str:
    """The ``pattern`` of the subschema at pointer ``where``, if it has one (else "")."""
    node = resolve_ref(schema, where)
    pattern = node.get("pattern") if isinstance(node, dict) else None
    return pattern if isinstance(pattern, str) else ""


def _regex_syntax_error(pattern: str) -> str | None:
    # outlines-core's own message ("error building NFA") does not say what is wrong
    import llguidance

    return (
        llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(pattern))
        or None
    )


class OutlinesGrammar(CompiledGrammar):
    """An outlines-core ``Index`` plus per-state facts shared by all requests."""

    def __init__(self, source: GrammarSource, vocabularies: Vocabularies, vocab_size: int,
                 eos_token_id: int):
        self.source, self.vocab_size, self.eos_token_id = source, vocab_size, eos_token_id
        self.pattern, self.vocabularies = source_regex(source), vocabularies
        pattern, vocabulary = self.pattern, vocabularies.full
        try:
            self.index = _outlines().Index(pattern, vocabulary)
        except ValueError as err:
            if source.kind is GrammarKind.REGEX:
                message = " ".join((_regex_syntax_error(pattern) or str(err)).split())
                if "anchored universal start state" in message:  # (^a), a|^b: llguidance's
                    message = ("it takes '^' or '\\A' only at the very start, after inline "
                               "flags alone (where they are dropped), not quantified, in a "
                               "group or in an alternative")
                raise GrammarError(
                    f"{source.origin}: outlines-core cannot compile this regex: {message}"
                ) from None
            # the field whose pattern it cannot build (its message quotes the whole regex)
            where = locate_schema_error(source.schema,
                                        lambda s: _index_error(source, s, vocabulary))
            message = " ".join((_regex_syntax_error(_subpattern(source.schema, where))
                                or str(err)).split())
            raise GrammarError(
                f"{source.origin}: {where}: outlines-core cannot compile this schema: {message}"
            ) from None
        self._single: dict[int, int | None] = {}  # state -> its only legal token, if just one

    def single_token(self, state: int) -> int | None:
        """The only legal token in ``state`` (the end token included), or None."""
        if state not in self._single:
            allowed = self.index.get_allowed_tokens(state)
            self._single[state] = allowed[0] if len(allowed) == 1 else None
        return self._single[state]

    def new_constraint(self) -> OutlinesConstraint:
        guide = _outlines().Guide(self.index, max_rollback=MAX_ROLLBACK)
        return OutlinesConstraint(self, guide)


class OutlinesConstraint(Constraint):
    """A request's outlines-core ``Guide`` behind the ``Constraint`` interface."""

    def __init__(self, grammar: OutlinesGrammar, guide: Any):
        super().__init__(grammar.vocab_size, grammar.eos_token_id)
        self._grammar, self._index, self._guide = grammar, grammar.index, guide
        self._tokens: list[int] = []  # committed, for a rollback past the Guide's states
        self._stored = 0  # states the Guide holds to roll back to (the last MAX_ROLLBACK)

    def _validate(self, tokens: Sequence[int]) -> int:
        state = self._guide.get_state()
        for n, token in enumerate(tokens):
            state = self._index.get_next_state(state, token)
            if state is None:
                return n
        return len(tokens)

    def _consume(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self._guide.advance(token, return_tokens=False)
        self._tokens.extend(tokens)
        self._stored = min(self._stored + len(tokens), MAX_ROLLBACK)

    def _rollback(self, num_tokens: int) -> None:
        if num_tokens <= self._stored:
            self._guide.rollback_state(num_tokens)
            self._stored -= num_tokens
            del self._tokens[len(self._tokens) - num_tokens :]
            return
        # past the states the Guide keeps (``reset`` after a long output raised "only 1024
        # states stored"): a new one walks what stays
        kept = self._tokens[: len(self._tokens) - num_tokens]
        self._guide = _outlines().Guide(self._index, max_rollback=MAX_ROLLBACK)
        self._tokens, self._stored = [], 0
        self._consume(kept)

    def _is_accepting(self) -> bool:
        return self._index.is_final_state(self._guide.get_state())

    def _only_end_allowed(self) -> bool:
        return self._grammar.single_token(self._guide.get_state()) == self.eos_token_id

    def _fill(self, out: torch.Tensor) -> None:
        self._guide.write_mask_into(out.data_ptr(), out.numel(), out.element_size())

    def _forced(self) -> list[int]:
        forced: list[int] = []
        state = self._guide.get_state()
        while len(forced) < MAX_FORCED:
            token = self._grammar.single_token(state)
            if token is None or token == self.eos_token_id:
                break
            forced.append(token)
            state = self._index.get_next_state(state, token)
        return forced


def check_continuations(grammar: OutlinesGrammar, reference: CompiledGrammar,
                        decode: Any) -> None:
    """Refuse ``grammar`` where outlines-core's index lost a way on: outlines-core (0.2.14)
    drops a match's continuations that pass through text that is no match (``12`` then
    ``.5`` for a number, ``ab`` then ``cd`` for ``ab|abcd``), so that it ends the output early.
    The check walks an index of the same regex over the tokenizer's tokens of one character
    or one byte (its states are the regex's, with few tokens each): at each complete match,
    reached by its shortest path, the characters and bytes ``reference`` (llguidance on the
    same source) allows must be the index's too. Where those tokens cannot spell a match (a
    tokenizer without byte tokens), the whole index is walked. Only a language in which a
    match can go on has such states: a JSON object or array ends at its bracket, so only
    regexes and top-level scalars are walked. A longer token that ends inside a character is
    not checked."""
    source = grammar.source
    if source.kind is GrammarKind.JSON_SCHEMA and _bracketed(source.schema):
        return
    vocabularies = grammar.vocabularies
    try:  # the characters compared: the probe's tokens
        probe = _outlines().Index(grammar.pattern, vocabularies.probe)
        compared = vocabularies.probe_ids
    except ValueError:  # no match of one-character tokens: the whole index (slower)
        probe, compared = grammar.index, _whole_characters(grammar, decode)
    start = probe.get_initial_state()
    finals, paths, queue = set(probe.get_final_states()), {start: []}, [start]
    transitions = probe.get_transitions()
    for state in queue:  # breadth first: the shortest path to every state
        for token, target in transitions.get(state, {}).items():
            if target not in paths:
                paths[target] = paths[state] + [token]
                queue.append(target)
    checked = 0
    for state in (s for s in queue if s in finals):  # the shallowest first
        if checked == MAX_CONTINUATION_CHECKS:
            return
        path, follow = paths[state], reference.new_constraint()
        if follow.validate_draft(path) < len(path):
            continue  # the two read the source differently here: nothing to compare
        follow.advance(path)
        checked += 1
        kept = set(probe.get_allowed_tokens(state))
        allowed = allowed_token_ids(follow.bitmask(), grammar.vocab_size)
        lost = [t for t in allowed if t in compared and t not in kept]
        if lost:
            on = decode(path + lost[:1])
            on = (f"{on!r}" if not on.endswith("\ufffd") else  # a byte of a character
                  f"{decode(path)!r} and a character the tokenizer splits into bytes")
            raise GrammarError(
                f"{source.origin}: outlines-core ends the output after {decode(path)!r}, where "
                f"it may go on ({on}): its index drops what follows a complete match through "
                "text that is none; use the llguidance backend")


def _whole_characters(grammar: OutlinesGrammar, decode: Any) -> frozenset[int]:
    """The tokens of whole characters (not ending inside one), end token left out."""
    return frozenset(t for t in range(grammar.vocab_size)
                     if t != grammar.eos_token_id and not decode([t]).endswith("\ufffd"))


def _bracketed(schema: Any) -> bool:
    """Whether every value of ``schema`` is a JSON object or array (nothing follows it)."""
    if not isinstance(schema, dict):
        return False
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return isinstance(kinds, list) and bool(kinds) and set(kinds) <= {"object", "array"}


def compile_source(source: GrammarSource, vocabularies: Vocabularies, info: TokenizerInfo
                   ) -> OutlinesGrammar:
    return OutlinesGrammar(source, vocabularies, info.vocab_size, info.eos_token_id)
