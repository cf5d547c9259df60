"""The default backend: llguidance (an Earley parser over a lazily built lexer, with token-level
draft validation, rollback and fast-forward tokens)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from agentflash.grammar.checks import (
    UNIQUE_ITEMS_REFUSED,
    locate_schema_error,
    may_write_special_bytes,
    recursion_room,
)
from agentflash.grammar.compiler import LRU
from agentflash.grammar.constraint import (
    CompiledGrammar,
    Constraint,
    GrammarError,
    GrammarFailed,
    bit_is_set,
    bitmask_width,
)
from agentflash.grammar.sources import (
    GrammarKind,
    GrammarSource,
    JsonStyle,
    without_date_formats,
)
from agentflash.grammar.tokenizers import TokenizerInfo, chat_end_ids, llguidance_tokenizer
from agentflash.tool_format import OPEN

# x-guidance options per layout; a schema's own "x-guidance" key overrides them.
JSON_STYLE_OPTIONS: dict[JsonStyle, dict[str, Any]] = {
    JsonStyle.DUMPS: {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    JsonStyle.COMPACT: {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    JsonStyle.FLEXIBLE: {},
}


# The tokens of free text in the turns' grammars (``tool_calls.texts_without``): none holds the
# tool-call tag's first character. llguidance computes, once per tokenizer, which tokens a
# slice's regex matches; a mask where a lexeme takes any run of such text sets them at once
# and walks the others (a free-text mask at Qwen3's 151k tokens: 2.0 ms, then 0.2)
FREE_TEXT_SLICE = f"[^\\x{ord(OPEN[0]):02X}]+"


def build_tokenizer(info: TokenizerInfo) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer, over the model's vocabulary size (about 1 s at 150k),
    with its default slices and free text's."""
    return llguidance_tokenizer(
        info, n_vocab=info.vocab_size,
        slices=[*llguidance.LLTokenizer.general_slices(), FREE_TEXT_SLICE])


def grammar_text(source: GrammarSource) -> str:
    """The llguidance grammar definition of ``source``."""
    if source.kind is GrammarKind.JSON_SCHEMA:
        text = source.text
        if '"format"' in text:  # the dates' formats their patterns make redundant
            try:
                text = json.dumps(without_date_formats(json.loads(text)), ensure_ascii=False)
            except (ValueError, RecursionError):  # as it is: llguidance names the fault
                text = source.text
        return llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults=JSON_STYLE_OPTIONS[source.json_style]
        )
    if source.kind is GrammarKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(source.text)
    if source.kind is GrammarKind.LARK:
        return llguidance.LLMatcher.grammar_from_lark(source.text)
    raise AssertionError(f"unknown grammar kind {source.kind}")


def _schema_error(source: GrammarSource, schema: Any) -> str | None:
    if isinstance(schema, bool):  # a subschema true or false is not what fails (the checks
        return None               # before compiling refuse a schema false as a whole)
    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema, allow_nan=False), defaults=JSON_STYLE_OPTIONS[source.json_style]
        )
    except (ValueError, RecursionError) as err:  # nested past llguidance's limit, NaN, ...
        return str(err) or type(err).__name__
    return llguidance.LLMatcher.validate_grammar(text) or None


@recursion_room()
def check_schema_supported(
    schema: Any, origin: str, json_style: JsonStyle = JsonStyle.DUMPS
) -> None:
    """Raise ``GrammarError`` naming the field if llguidance cannot compile ``schema`` (no
    tokenizer needed, so tools can be checked when they are declared)."""
    source = GrammarSource(GrammarKind.JSON_SCHEMA, json.dumps(schema), json_style, origin)
    _check_exact_values(source)  # first: llguidance crashes on some (-2^63), as at compile
    message = _schema_error(source, schema)
    if message is not None:
        raise GrammarError(_describe_error(source, message))


def _describe_error(source: GrammarSource, message: str) -> str:
    message = _unique_items_said(_LOOSE_ADVICE.sub("", _one_line(message)))
    if source.kind is GrammarKind.JSON_SCHEMA:
        where = locate_schema_error(source.schema, lambda s: _schema_error(source, s),
                                    same_error=True)
        return f"{source.origin}: {where}: {message}"
    if source.kind is GrammarKind.REGEX:
        return f"{source.origin}: invalid regex {source.text!r}: {message}"
    return f"{source.origin}: {message}"


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def _unique_items_said(message: str) -> str:
    """llguidance's ``message`` with its refusal of ``uniqueItems`` in our words (what to use
    instead); the other keys it names kept in its own."""
    found = _UNIMPLEMENTED.search(message)
    if found is None or '"uniqueItems"' not in found.group(1).split(", "):
        return message
    others = [key for key in found.group(1).split(", ") if key != '"uniqueItems"']
    ours = UNIQUE_ITEMS_REFUSED + (f"; Unimplemented keys: [{', '.join(others)}]"
                                   if others else "")
    return message[:found.start()] + ours + message[found.end():]


# llguidance's advice to turn on an option that makes it write what the schema refuses
_LOOSE_ADVICE = re.compile(r"\s*Enable '\w+' option to approximate oneOf with anyOf\.?")


def _one_line(message: str) -> str:
    """llguidance's message on one line; a regex parser's report (the pattern and a caret under
    the fault, then ``error: ...``, then the grammar line) keeps its first line and its error."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    errors = [line.removeprefix("error:").strip() for line in lines[1:]
              if line.startswith("error:")]
    if errors:
        return f"{lines[0]} {errors[0]}"
    return " ".join(lines)


class LLGuidanceGrammar(CompiledGrammar):
    """A validated llguidance grammar and a pristine matcher that requests copy."""

    def __init__(
        self,
        source: GrammarSource,
        tokenizer: llguidance.LLTokenizer,
        vocab_size: int,
        eos_token_id: int,
        special_ids: np.ndarray | None = None,
        names_specials: bool = True,
    ):
        self.source, self.vocab_size, self.eos_token_id = source, vocab_size, eos_token_id
        # the special tokens a mask may let through that consuming refuses, cleared after every
        # mask: None where the grammar has no lexeme that may hold their bytes
        # (``may_write_special_bytes``: a bare negation), as for nearly every grammar. Where it
        # names no special token, it takes none (but the end token) and they are all cleared
        # at once; else each one the mask lets through is checked
        self.special_ids = special_ids
        self.special_keep: np.ndarray | None = None  # the mask's words without their bits
        if special_ids is not None and not names_specials:
            keep = np.full(bitmask_width(vocab_size) * 32, True)
            keep[special_ids] = False
            self.special_keep = np.packbits(keep, bitorder="little").view(np.uint32)
        try:
            text = grammar_text(source)
        except ValueError as err:  # a schema past llguidance's nesting limit, and the like
            raise GrammarError(f"{source.origin}: {_one_line(str(err))}") from None
        # the matcher's construction validates the grammar as validate_grammar does (the same
        # compile, the tokenizer's limits: the default ones), and reports the same first error;
        # validating apart first compiled every grammar twice (3.5 of 12 ms a 12-property tool)
        self._tokenizer, self._text = tokenizer, text
        # llguidance's mask where bytes are forced is the first of the forced bytes' canonical
        # tokens alone, except where a grammar turns forcing off (``_allows_one``): a Lark
        # grammar's ``%llguidance`` options are JSON, so a \u escape may spell the key
        # (``no\u005fforcing``); llguidance writes the directive itself as it is
        self.masks_forced_canonically = "no_forcing" not in text and not (
            "%llguidance" in text and "\\u" in text)
        self._matcher = self.fresh_matcher()
        if self._matcher.is_error():
            raise GrammarError(_describe_error(source, self._matcher.get_error()))
        self.warnings: list[str] = self._matcher.get_grammar_warnings()
        # The requests' matchers are copies of ``_matcher`` and share its lazily built lexer,
        # which a limit reached on one request's path ("too many expressions constructed")
        # leaves failing for all of them. The generation counts the lexers replaced so.
        self.generation = 0
        self._lock = threading.Lock()

    def fresh_matcher(self) -> llguidance.LLMatcher:
        """A matcher at the grammar's start with a lexer of its own."""
        return llguidance.LLMatcher(self._tokenizer, self._text, log_level=0)

    def new_constraint(self) -> LLGuidanceConstraint:
        with self._lock:
            return LLGuidanceConstraint(self._matcher.deep_copy(), self.vocab_size,
                                        self.eos_token_id, self, self.generation)

    def lexer_failed(self, generation: int) -> None:
        """A request's copy of generation ``generation`` reached a lexer limit: later requests
        copy a fresh matcher, and the earlier ones move to matchers of their own."""
        with self._lock:
            if generation == self.generation:
                self._matcher = self.fresh_matcher()
                self.generation += 1


def _matcher_failed(matcher: llguidance.LLMatcher) -> GrammarFailed:
    """A matcher's error, its first line (the rest is llguidance's state and grammar); a limit
    where its lexer's ("lexer error: too many expressions constructed"), else a token it
    refused or a rollback it could not make (a fault, not the request's)."""
    error = matcher.get_error().strip().split("\n", 1)[0]
    return GrammarFailed(error, limit="lexer error" in error)


class LLGuidanceConstraint(Constraint):
    """A request's llguidance matcher behind the ``Constraint`` interface."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_id: int,
                 grammar: LLGuidanceGrammar | None = None, generation: int | None = None):
        super().__init__(vocab_size, eos_token_id)
        self._matcher = matcher
        # the grammar whose shared lexer the matcher uses (its generation), None once the
        # matcher has a lexer of its own (``_run``)
        self._grammar, self._generation = grammar, generation
        self._fed: list[int] = []  # the tokens consumed, to replay on a matcher of its own
        self._ff: list[int] | None = None  # ``_ff_tokens`` of this state, once asked

    @property
    def _m(self) -> llguidance.LLMatcher:
        if self._generation is not None and self._generation != self._grammar.generation:
            self._own_matcher()  # the shared lexer failed another request: not used again
        return self._matcher

    def _own_matcher(self) -> None:
        fresh = self._grammar.fresh_matcher()
        if self._fed and not fresh.consume_tokens(self._fed):
            raise _matcher_failed(fresh)
        self._matcher, self._generation = fresh, None

    def _run(self, method: str, *args: Any) -> Any:
        """The matcher's ``method(*args)``; where it reached a limit of the lexer the requests
        share, again on a matcher of this request's own (a limit it reaches there too is its
        own failure)."""
        m = self._m
        result = getattr(m, method)(*args)
        if self._generation is None or not m.is_error() or "lexer error" not in m.get_error():
            return result
        self._grammar.lexer_failed(self._generation)
        self._own_matcher()
        return getattr(self._matcher, method)(*args)

    def _validate(self, tokens: Sequence[int]) -> int:
        return self._run("validate_tokens", list(tokens))

    def _recheck(self, tokens: list[int], legal: int) -> int:
        # llguidance (1.9.1) reports a lexer limit met while validating as a refusal (fewer
        # valid, no error): ``advance`` raised GrammarViolation, a fault (a 500 in serve),
        # where a limit is the request's (a 400), and the retry on a lexer of the request's
        # own never ran. Consuming on a copy says which (only here: a refusal in a walk is
        # routine, and this costs a hundred times a check)
        limit = self._limit_met(tokens[: legal + 1])
        if limit is None:
            return legal
        if self._generation is None:  # its own lexer: the request's own limit
            raise limit
        self._grammar.lexer_failed(self._generation)  # the shared one: again on its own
        self._own_matcher()
        legal = self._matcher.validate_tokens(tokens)
        limit = self._limit_met(tokens[: legal + 1]) if legal < len(tokens) else None
        if limit is not None:
            raise limit
        return legal

    def _limit_met(self, tokens: list[int]) -> GrammarFailed | None:
        """The lexer limit that consuming ``tokens`` meets, on a copy (None: none)."""
        probe = self._m.deep_copy()
        if probe.consume_tokens(tokens) or "lexer error" not in probe.get_error():
            return None
        return _matcher_failed(probe)

    def _consume(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        self._ff = None
        if not self._run("consume_tokens", tokens) and not self._consumed_on_own(tokens):
            raise self._failed()
        self._fed += tokens

    def _consumed_on_own(self, tokens: list[int]) -> bool:
        """Whether a matcher with a lexer of the request's own takes ``tokens`` that the shared
        lexer refused, and the request now uses it: a limit met on another path (a walk's
        validation, which says only "fewer valid") leaves the shared lexer refusing what the
        grammar allows, as "doesn't satisfy the grammar" (a fault, a 500, where a limit is the
        request's). A limit met on its own is the request's (``GrammarFailed.limit``)."""
        if self._generation is None:
            return False
        fresh = self._grammar.fresh_matcher()
        if not fresh.consume_tokens(self._fed + tokens):
            if "lexer error" in fresh.get_error():
                raise _matcher_failed(fresh)
            return False  # refused there too: the shared lexer's error stands
        self._grammar.lexer_failed(self._generation)
        self._matcher, self._generation = fresh, None
        return True

    def _rollback(self, num_tokens: int) -> None:
        self._ff = None
        if not self._m.rollback(num_tokens):
            raise self._failed()
        del self._fed[len(self._fed) - num_tokens:]

    def _failed(self) -> GrammarFailed:
        return _matcher_failed(self._m)

    def _is_accepting(self) -> bool:
        return self._m.is_accepting()

    def _only_end_allowed(self) -> bool:
        return self._m.is_stopped() and self._m.is_accepting()

    def _fill(self, out: torch.Tensor) -> None:
        self._run("unsafe_compute_mask_ptr", out.data_ptr(), out.numel() * out.element_size())
        if self._m.is_error():
            error = self._m.get_error()
            if error.startswith("NoExtension"):
                out.zero_()  # a dead end: no token can follow (compile rejects such grammars)
                return
            # a parser resource limit
            raise GrammarFailed(f"llguidance could not compute the mask: "
                                f"{error.strip().split(chr(10), 1)[0]}", limit=True)
        if self._grammar is not None and self._grammar.special_ids is not None:
            self._clear_refused_specials(out)

    def _clear_refused_specials(self, out: torch.Tensor) -> None:
        # llguidance (1.9.1) walks the token trie for the mask with the special tokens in it as
        # 0xFF and their names; a negated lexeme (~/abc/) matches those bytes, so the mask let
        # them all through (<|im_start|>, <[4100]>), and consuming, which never takes 0xFF as
        # text (only a special token the grammar names), refused them: GrammarViolation
        words = out.numpy().view(np.uint32)
        if self._grammar.special_keep is not None:
            words &= self._grammar.special_keep
            return
        ids = self._grammar.special_ids
        for token in ids[(words[ids >> 5] >> (ids & 31)) & 1 == 1].tolist():
            if self._validate([token]) != 1:
                words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)

    def _copy(self) -> LLGuidanceConstraint:
        # Walks ahead (drafts, masks along them, forced-token checks) run on a copy of the
        # matcher: committing and rolling back on the live one left it, after some walks,
        # computing masks that let a token through that it then refused to consume (llguidance
        # 1.9.1; a tool call's last property took '",' as if more properties followed).
        copy = LLGuidanceConstraint(self._m.deep_copy(), self.vocab_size, self.eos_token_id,
                                    self._grammar, self._generation)
        copy._num_fed, copy._ended, copy._fed = self._num_fed, self._ended, list(self._fed)
        copy._ff = self._ff
        return copy

    def _allows_one(self, token: int) -> bool:
        # where the grammar forces bytes, the mask keeps them to their canonical tokens ('"]')
        # and validate_tokens takes any tokenization ('"' then ']'): the mask decides, as in
        # plain constrained decoding. llguidance (1.9.1, TokenParser::compute_mask) allows there
        # the first forced token alone; forced bytes that no whole token takes yet (a '"' that
        # may still grow into '",') it masks as validate_tokens checks a token (the tokens
        # that are a prefix of those bytes, or begin with them and go on legally). Both are
        # read off without filling a mask (half the cost), as tests/test_grammar.py checks for
        # every token of many forced states; a grammar that turns forcing off is masked
        forced = self._ff_tokens()
        if self._grammar is not None and self._grammar.masks_forced_canonically:
            return token == forced[0] if forced else self._validate([token]) == 1
        if forced or self._run("compute_ff_bytes"):
            row = self._scratch_row()
            row.zero_()
            self._fill(row)
            return bit_is_set(row, token, self.vocab_size)
        return self._validate([token]) == 1

    def _take_one(self, token: int) -> bool:
        # where the mask is a one-token validate (no forced token), validate and consume are
        # one call: try_consume_tokens consumes what validate_tokens takes, and a refusal
        # leaves the matcher as it was
        forced = self._ff_tokens()
        if forced or (self._grammar is None or not self._grammar.masks_forced_canonically):
            return super()._take_one(token)
        if not self._run("try_consume_tokens", [token]):
            return False
        self._ff = None
        self._fed.append(token)
        return True

    def _ff_tokens(self) -> list[int]:
        """llguidance's forced tokens in this state (once a state: a forced run's tokens are
        asked by the walk and again by the check of its next token)."""
        if self._ff is None:
            # no forced byte, no forced token (the bytes are ~100x cheaper to ask)
            self._ff = self._run("compute_ff_tokens") if self._run("compute_ff_bytes") else []
        return self._ff

    def _forced(self) -> list[int]:
        if self._grammar is not None and not self._grammar.masks_forced_canonically:
            # forcing turned off: llguidance still names forced tokens, but its mask lets
            # other tokenizations of the bytes through ('he' or 'h'), which plain constrained
            # decoding chooses among; committed unlooked, the target's choice was lost
            return []
        forced = list(self._ff_tokens())
        if self.eos_token_id in forced:
            forced = forced[: forced.index(self.eos_token_id)]
        return forced


def compile_source(
    source: GrammarSource, tokenizer: llguidance.LLTokenizer, info: TokenizerInfo
) -> LLGuidanceGrammar:
    if source.kind is GrammarKind.LARK:
        _check_no_end_token(source, info)
    _check_no_special_text(source, info, tokenizer)
    _check_exact_values(source)
    if source.free_text:
        from agentflash.grammar.tool_calls import with_reasoning_tokens

        added = getattr(info.tokenizer, "added_tokens_decoder", None) or {}
        source = with_reasoning_tokens(source, {t.content: i for i, t in added.items()
                                                if not t.special})
    special_ids, names_specials = None, True
    if source.kind is GrammarKind.LARK and "~" in source.text and may_write_special_bytes(
            source.text):
        from agentflash.grammar.checks import special_tokens

        special_ids, names_specials = _special_ids(tokenizer, info), special_tokens(
            source.text) != []  # (None: not read)
    return LLGuidanceGrammar(source, tokenizer, info.vocab_size, info.eos_token_id, special_ids,
                             names_specials)


_special_id_cache = LRU(8)  # (per tokenizer, as the converted tokenizers)


def _special_ids(tokenizer: llguidance.LLTokenizer, info: TokenizerInfo) -> np.ndarray:
    """The tokens llguidance reads as special (0xFF and a name: <|im_start|>, the unnamed ids
    past the tokenizer's, <[4100]>), but the end token, whose bit ``fill_bitmask`` sets; per
    tokenizer (33 ms at 152k tokens, paid by grammars ``may_write_special_bytes`` only)."""
    return _special_id_cache.get_or_make(info, lambda: np.array(
        [t for t in range(info.vocab_size)
         if t != info.eos_token_id and tokenizer.is_special_token(t)], np.int64))


def _check_no_special_text(source: GrammarSource, info: TokenizerInfo,
                           tokenizer: llguidance.LLTokenizer) -> None:
    """A literal the grammar writes as text that holds a special token's text (an enum value
    ``</tool_call>``) cannot be written: the tokenizer reads that text as the special token,
    which the grammar does not take as text, and every request would fail at that point."""
    from agentflash.grammar.checks import regex_literals, written_literals

    added = getattr(info.tokenizer, "get_added_vocab", None)
    # the added tokens llguidance keeps out of text (<tool_call> too); another added token
    # ("zzqq") is text to it like any other
    specials = [t for t, i in (added() if added is not None else {}).items()
                if len(t) > 1 and i < tokenizer.vocab_size and tokenizer.is_special_token(i)]
    if not specials:
        return
    if source.kind is GrammarKind.REGEX:
        literals = [(f"the literal {run!r}", run) for run in regex_literals(source.text)]
    elif source.kind is GrammarKind.JSON_SCHEMA:
        literals = written_literals(None, source.schema)
    else:
        literals = written_literals(source.text)
    for where, text in literals:
        token = next((t for t in specials if t in text), None)
        if token is not None:
            raise GrammarError(f"{source.origin}: {where} holds {token!r}, the text of a special "
                               f"token of this tokenizer: the grammar cannot write it as text")


# a number that ``checks.inexact_value`` may refuse has 16 digits or more, or an exponent
_LONG_NUMBER = re.compile(r"[0-9][0-9.]{15}|[0-9][eE][-+]?[0-9]")


def _check_exact_values(source: GrammarSource) -> None:
    """An enum or const number llguidance would write as another number is refused, naming
    the field (``checks.inexact_value``): the output would fail its schema."""
    from agentflash.grammar.checks import inexact_message, inexact_value, json_bodies

    if _LONG_NUMBER.search(source.text) is None:  # (no number of 16 digits or an exponent:
        return  # none to refuse: a turn's %json bodies are not read again, 0.17 ms of 8.4)
    if source.kind is GrammarKind.JSON_SCHEMA:
        schemas = [("", source.schema)]
    elif source.kind is GrammarKind.LARK and "%json" in source.text:
        schemas = [(f"%json in rule {rule!r}: ", body) for rule, body in json_bodies(source.text)]
    else:
        return
    for where, schema in schemas:
        found = inexact_value(schema, "llguidance")
        if found is not None:
            raise GrammarError(f"{source.origin}: {where}{found[0]}: "
                               f"{inexact_message(found[1], 'llguidance')}")


def _check_no_end_token(source: GrammarSource, info: TokenizerInfo) -> None:
    """The end token is the engine's to place (wherever the grammar is complete): a grammar that
    writes it itself could never be complete after it, and every request would get stuck."""
    from agentflash.grammar.checks import special_tokens

    written = special_tokens(source.text) or []  # in a string or a %json schema it is text
    if not written:
        return
    # the engine ends a turn at any of them (<|endoftext|> too): the reply would end there,
    # "stop", before the grammar is complete
    convert = getattr(info.tokenizer, "convert_ids_to_tokens", None)
    for end in dict.fromkeys([info.eos_token_id, *chat_end_ids(info.tokenizer)]):
        name = convert(end) if convert is not None else None
        for spelling in (name, f"<[{end}]>"):
            if spelling and spelling in written:
                raise GrammarError(f"{source.origin}: the grammar writes the end token "
                                   f"{spelling}: leave it out (the reply ends wherever the "
                                   f"grammar is complete)")
