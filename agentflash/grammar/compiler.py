"""Compiling a grammar source for a tokenizer, with a cache keyed by (source, tokenizer)."""

from __future__ import annotations

import enum
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from agentflash.grammar.checks import (
    json_bodies,
    locate_schema_error,
    pointer,
    recursion_room,
    subschemas,
)
from agentflash.grammar.constraint import (
    CompiledGrammar,
    GrammarError,
    GrammarFailed,
    GrammarViolation,
    first_allowed_token,
)
from agentflash.grammar.sources import GrammarKind, GrammarSource
from agentflash.grammar.tokenizers import TokenizerInfo, tokenizer_info
from agentflash.json_formats import DATE_PATTERNS


class Backend(enum.Enum):
    LLGUIDANCE = "llguidance"  # the default: every source kind, fast-forward tokens
    OUTLINES = "outlines"  # outlines-core: JSON Schema and regex only


class LRU:
    """A small thread-safe least-recently-used map of at most ``capacity`` entries, and, with
    ``weigh`` (an entry's key to its weight), of at most ``max_weight`` in all (the newest entry
    is kept whatever its weight)."""

    def __init__(self, capacity: int, max_weight: int | None = None,
                 weigh: Callable[[Any], int] | None = None):
        self.capacity, self._items, self._lock = capacity, OrderedDict(), threading.Lock()
        self.max_weight, self._weigh, self.weight = max_weight, weigh, 0
        self.hits = self.misses = 0
        self._making: dict[Any, threading.Lock] = {}  # a lock per key being made

    def get_or_make(self, key: Any, make: Any) -> Any:
        """The value of ``key``, made by ``make()`` and kept if missing: once, while other
        threads asking for the same key wait for it (the server prepares requests in worker
        threads: eight first requests with the same tools converted the 151k-token tokenizer
        six times, 1.5 GB at once). A ``make`` that raises keeps nothing."""
        value = self.get(key)
        if value is not None:
            return value
        with self._lock:
            making = self._making.setdefault(key, threading.Lock())
        try:
            with making:
                with self._lock:
                    value = self._items.get(key)
                if value is None:
                    value = make()
                    self.put(key, value)
        finally:
            with self._lock:
                if self._making.get(key) is making:
                    del self._making[key]
        return value

    def get(self, key: Any) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
                self._items.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            if key not in self._items:
                self.weight += self._weight(key)
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity or (
                    self.max_weight is not None and self.weight > self.max_weight
                    and len(self._items) > 1):
                old, _ = self._items.popitem(last=False)
                self.weight -= self._weight(old)

    def _weight(self, key: Any) -> int:
        return self._weigh(key) if self._weigh is not None else 0

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.hits = self.misses = self.weight = 0

    def __len__(self) -> int:
        return len(self._items)


# compiled grammars, weighed by their source's length: a grammar of a thousand tools (700 kB of
# schemas) holds about 26 MB, and 256 of them held 7 GB; 4M characters of sources keep at most
# about 150 MB of such grammars, and 256 of a few tools' each
MAX_SOURCE_CHARS = 4_000_000
_grammars = LRU(256, MAX_SOURCE_CHARS, lambda key: len(key[1].text))
_tokenizers = LRU(8)  # converted tokenizers are large at 150k tokens


def compile_grammar(
    source: GrammarSource,
    tokenizer: Any,
    *,
    backend: Backend = Backend.LLGUIDANCE,
    vocab_size: int | None = None,
    eos_token_id: int | None = None,
    use_cache: bool = True,
) -> CompiledGrammar:
    """Compile ``source`` for a fast Hugging Face ``tokenizer`` and a model with ``vocab_size``
    logits; cached, so a request calls it freely (``use_cache=False`` recompiles, for timing).
    Raises ``GrammarError`` (a ``UserError``) for a bad source, an unsupported feature, or a
    grammar that can never finish."""
    info = tokenizer_info(tokenizer, vocab_size, eos_token_id)
    key = (backend, source, info)

    @recursion_room()  # (the checks of a schema's fields recurse by its depth)
    def compiled() -> CompiledGrammar:
        try:
            grammar = _build(backend, source, info)
            if backend is Backend.LLGUIDANCE:
                _check_patterns(source, info)
            _check_can_start(grammar, source, info)
            if backend is Backend.OUTLINES:
                _check_outlines_continuations(grammar, source, info)
        except GrammarError as err:
            named = _named_tools(str(err), source)
            if named == str(err):
                raise
            raise GrammarError(named) from None
        return grammar

    if not use_cache:
        grammar = compiled()
        _grammars.put(key, grammar)
        return grammar
    return _grammars.get_or_make(key, compiled)


_UNION_POINTER = re.compile(r"(?:%json )?#/anyOf/(\d+)/properties/arguments(?![\w-])")


def _named_tools(message: str, source: GrammarSource) -> str:
    """``message`` where a pointer into the union of the tools' calls (``tool_call_schema``:
    ``#/anyOf/1/properties/arguments/...``) names the tool instead: ``tool 'lookup' parameters
    #/...``, as the user wrote it."""
    if (_UNION_POINTER.search(message) is None
            or not source.origin.startswith(("tools", "tool_choice="))):
        return message
    schemas = ([source.schema] if source.kind is GrammarKind.JSON_SCHEMA
               else [schema for _, schema in json_bodies(source.text)])
    unions = [s for s in schemas if _is_call_union(s)]
    # one union, and no other schema beside it (an answer's) with an anyOf of its own that the
    # pointer could be in
    if len(unions) != 1 or any(isinstance(s, dict) and "anyOf" in s
                               for s in schemas if s is not unions[0]):
        return message
    names = [branch["properties"]["name"]["const"] for branch in unions[0]["anyOf"]]

    def tool(match: re.Match[str]) -> str:
        i = int(match[1])
        return f"tool {names[i]!r} parameters #" if i < len(names) else match[0]

    return _UNION_POINTER.sub(tool, message)


def _is_call_union(schema: Any) -> bool:
    """Whether ``schema`` is ``tool_call_schema``'s union of the tools' calls."""
    branches = schema.get("anyOf") if isinstance(schema, dict) else None
    return isinstance(branches, list) and bool(branches) and all(map(_is_call_branch, branches))


def _is_call_branch(branch: Any) -> bool:
    """Whether ``branch`` is one tool's in ``tool_call_schema``'s union."""
    return (isinstance(branch, dict) and branch.get("required") == ["name", "arguments"]
            and isinstance(branch.get("properties"), dict)
            and set(branch["properties"]) == {"name", "arguments"}
            and isinstance(branch["properties"]["name"], dict)
            and isinstance(branch["properties"]["name"].get("const"), str))


def _check_outlines_continuations(grammar: CompiledGrammar, source: GrammarSource,
                                  info: TokenizerInfo) -> None:
    """outlines-core's index against llguidance's on the same source (where llguidance takes
    it): ``outlines_backend.check_continuations``."""
    from agentflash.grammar.outlines_backend import check_continuations

    try:
        reference = compile_grammar(source, info.tokenizer, vocab_size=info.vocab_size,
                                    eos_token_id=info.eos_token_id)
    except GrammarError:
        return
    check_continuations(grammar, reference, info.tokenizer.decode)


def _build(backend: Backend, source: GrammarSource, info: TokenizerInfo) -> CompiledGrammar:
    if backend is Backend.LLGUIDANCE:
        from agentflash.grammar import llguidance_backend as impl
    elif backend is Backend.OUTLINES:
        from agentflash.grammar import outlines_backend as impl  # type: ignore[no-redef]
    else:
        raise AssertionError(f"unknown backend {backend}")
    converted = _tokenizers.get_or_make((backend, info), lambda: impl.build_tokenizer(info))
    return impl.compile_source(source, converted, info)


def _check_can_start(grammar: CompiledGrammar, source: GrammarSource,
                     info: TokenizerInfo | None = None) -> None:
    problem, start = _first_masks(grammar)
    if problem is not None:  # the field, where a schema's fails on its own
        where = ""
        if source.kind is GrammarKind.JSON_SCHEMA and info is not None:
            where = locate_schema_error(source.schema, lambda s: _fails_alone(s, source, info))
            where = f"{where}: "
        raise GrammarError(f"{source.origin}: {where}{problem}")
    if not grammar.new_constraint().is_accepting() and not start.any():
        raise GrammarError(
            f"{source.origin}: no output matches this grammar (no token can start "
            "it and the empty output is not a match)"
        )


PROBE_STEPS = 1  # the steps a request's first tokens are probed for (``_first_masks``)


def _first_masks(grammar: CompiledGrammar) -> tuple[str | None, Any]:
    """The first mask of a request, or why the masks of its first ``PROBE_STEPS`` steps (the
    grammar's forced run, else its first allowed token) cannot be computed: llguidance builds
    its lexer as the masks need it, and a limit it reaches there (``a{1000}{1000}``: "too many
    expressions constructed", at the first ``a``) failed every request's first steps."""
    try:
        constraint = grammar.new_constraint()
        start = mask = constraint.bitmask()
        for _ in range(PROBE_STEPS):
            first = first_allowed_token(mask, grammar.vocab_size)
            step = constraint.forced_tokens() or ([] if first is None else [first])
            step = [t for t in step if t != grammar.eos_token_id]
            if not step:
                break
            constraint.advance(step)
            mask = constraint.bitmask()
    except GrammarFailed as err:
        return str(err), None
    except GrammarViolation as err:  # the backend's mask and its check of a token disagree:
        # every request would fail where its model took that token (a 500 in serve)
        return f"the grammar's first mask allows a token that it then refuses ({err})", None
    return None, start


def _check_patterns(source: GrammarSource, info: TokenizerInfo) -> None:
    """Each ``pattern`` of a schema's strings (of a Lark grammar's ``%json`` schemas too), its
    first masks probed alone: llguidance's lexer builds a pattern's states as the masks reach
    it, and a limit met there failed a request in mid-reply (a server's 500) wherever the
    pattern was not the first thing written: a later property, an array's items, a tool's
    arguments after free text."""
    if source.kind is GrammarKind.JSON_SCHEMA:
        schemas = [("", source.schema)]
    elif source.kind is GrammarKind.LARK:
        schemas = [(f"rule {rule}: ", schema) for rule, schema in json_bodies(source.text)]
    else:
        return
    for where, schema in schemas:
        for path, node in subschemas(schema, []):
            pattern = node.get("pattern") if isinstance(node, dict) else None
            if (isinstance(pattern, str) and pattern not in _SAFE_PATTERNS
                    and not fixed_width(pattern)):
                problem = _patterns.get_or_make(
                    (pattern, info), lambda p=pattern: _pattern_problem(p, info))
                if problem:
                    raise GrammarError(f"{source.origin}: {where}"
                                       f"{pointer([*path, 'pattern'])}: {problem}")


# the patterns ``exact_dates`` puts beside every date format, not probed: finite languages
# of strings of at most 35 characters, whose lexer states are bounded whatever the tokenizer;
# their first masks are computed with a hundredth of the lexer's limits (the probe, 0.6-1 ms
# each at Qwen3's vocabulary, was paid by every new tool with a date;
# ``test_the_date_patterns_pass_their_probe``)
_SAFE_PATTERNS = frozenset(DATE_PATTERNS.values())

# one position of a fixed-width pattern: an ASCII letter, digit or mark that JSON writes as
# itself, or a class of them (ranges within the capitals, the small letters or the digits;
# ``\d`` is ASCII's in llguidance), once or a fixed number of times
_FIXED_ATOM = re.compile(
    r"(?:[A-Za-z0-9_ #:,@/-]|\\[.+()/:#-]|\\d"
    r"|\[(?:[A-Z](?:-[A-Z])?|[a-z](?:-[a-z])?|[0-9](?:-[0-9])?|_|\\d)+\])"
    r"(?:\{([1-9][0-9]?)\})?")
MAX_FIXED_WIDTH = 64


def fixed_width(pattern: str) -> bool:
    """Whether ``pattern`` is ``^...$`` around at most ``MAX_FIXED_WIDTH`` positions, each one
    ASCII character of a class written as itself in JSON (``^[A-Z]{3}$``, ``^#[0-9a-f]{6}$``,
    ``^\\d{3}-\\d{4}$``): not probed (``_check_patterns``). Every derivative of such a regex
    is one of its suffixes, so its lexer has at most ``MAX_FIXED_WIDTH + 2`` states whatever
    the tokenizer, a hundredth of llguidance's limits more than met
    (``test_fixed_width_patterns_are_far_from_the_lexer_limits``); its probe was 1.3 ms at
    Qwen3's vocabulary, paid by each new tool with an airport code or a colour."""
    if len(pattern) < 3 or pattern[0] != "^" or pattern[-1] != "$":
        return False
    pos, width, end = 1, 0, len(pattern) - 1
    while pos < end:
        match = _FIXED_ATOM.match(pattern, pos, end)
        if match is None:
            return False
        width += int(match[1] or 1)
        pos = match.end()
    return 0 < width <= MAX_FIXED_WIDTH


def _pattern_problem(pattern: str, info: TokenizerInfo) -> str:
    """Why a string of ``pattern`` cannot be started (its first masks), or "" if it can."""
    from agentflash.grammar.sources import json_schema

    try:
        alone = json_schema({"type": "string", "pattern": pattern}, origin="pattern",
                            strict=False)
        return _first_masks(_build(Backend.LLGUIDANCE, alone, info))[0] or ""
    except GrammarError:  # the whole schema's compile names a pattern llguidance refuses
        return ""


# a pattern's problem ("" for none) per tokenizer, weighed by the patterns' length as the
# grammars are by their sources'
_patterns = LRU(1024, MAX_SOURCE_CHARS, lambda key: len(key[0]))


def _fails_alone(schema: Any, source: GrammarSource, info: TokenizerInfo) -> str | None:
    from agentflash.grammar.sources import json_schema

    try:
        part = json_schema(schema, origin=source.origin, json_style=source.json_style,
                           strict=False)
        return _first_masks(_build(Backend.LLGUIDANCE, part, info))[0]
    except GrammarError:
        return None


def cache_info() -> dict[str, int]:
    """Sizes and hit counts of the compile caches."""
    return {
        "grammars": len(_grammars),
        "source_chars": _grammars.weight,
        "hits": _grammars.hits,
        "misses": _grammars.misses,
        "patterns": len(_patterns),  # the patterns' probes (a problem or none, per tokenizer)
        "tokenizers": len(_tokenizers),
    }


def clear_cache(*, tokenizers: bool = True) -> None:
    """Empty the compile caches: the compiled grammars, the patterns' probes and, unless
    ``tokenizers`` is False, the converted tokenizers (a new schema's first compile, timed
    without the tokenizer's one-time conversion)."""
    _grammars.clear()
    _patterns.clear()
    if tokenizers:
        _tokenizers.clear()
