"""The default backend: llguidance (an Earley parser over a lazily built lexer, with token-level
draft validation, rollback and fast-forward tokens)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
import torch

from agentflash.grammar.checks import locate_schema_error
from agentflash.grammar.constraint import (
    CompiledGrammar,
    Constraint,
    GrammarError,
    GrammarFailed,
    bit_is_set,
)
from agentflash.grammar.sources import GrammarKind, GrammarSource, JsonStyle
from agentflash.grammar.tokenizers import TokenizerInfo, chat_end_ids

# x-guidance options per layout; a schema's own "x-guidance" key overrides them.
JSON_STYLE_OPTIONS: dict[JsonStyle, dict[str, Any]] = {
    JsonStyle.DUMPS: {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    JsonStyle.COMPACT: {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    JsonStyle.FLEXIBLE: {},
}


def build_tokenizer(info: TokenizerInfo) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer, over the model's vocabulary size (about 1 s at 150k)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(
        info.tokenizer, n_vocab=info.vocab_size, eos_token=info.eos_token_id
    )


def grammar_text(source: GrammarSource) -> str:
    """The llguidance grammar definition of ``source``."""
    if source.kind is GrammarKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(
            source.text, defaults=JSON_STYLE_OPTIONS[source.json_style]
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


def check_schema_supported(
    schema: Any, origin: str, json_style: JsonStyle = JsonStyle.DUMPS
) -> None:
    """Raise ``GrammarError`` naming the field if llguidance cannot compile ``schema`` (no
    tokenizer needed, so tools can be checked when they are declared)."""
    source = GrammarSource(GrammarKind.JSON_SCHEMA, json.dumps(schema), json_style, origin)
    message = _schema_error(source, schema)
    if message is not None:
        raise GrammarError(_describe_error(source, message))


def _describe_error(source: GrammarSource, message: str) -> str:
    message = _one_line(message)
    if source.kind is GrammarKind.JSON_SCHEMA:
        where = locate_schema_error(source.schema, lambda s: _schema_error(source, s))
        return f"{source.origin}: {where}: {message}"
    if source.kind is GrammarKind.REGEX:
        return f"{source.origin}: invalid regex {source.text!r}: {message}"
    return f"{source.origin}: {message}"


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
    ):
        self.source, self.vocab_size, self.eos_token_id = source, vocab_size, eos_token_id
        try:
            text = grammar_text(source)
        except ValueError as err:  # a schema past llguidance's nesting limit, and the like
            raise GrammarError(f"{source.origin}: {_one_line(str(err))}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if is_error:
            raise GrammarError(_describe_error(source, messages[0]))
        self.warnings: list[str] = messages
        self._matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(_describe_error(source, self._matcher.get_error()))

    def new_constraint(self) -> LLGuidanceConstraint:
        return LLGuidanceConstraint(self._matcher.deep_copy(), self.vocab_size, self.eos_token_id)


class LLGuidanceConstraint(Constraint):
    """A request's llguidance matcher behind the ``Constraint`` interface."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_id: int):
        super().__init__(vocab_size, eos_token_id)
        self._m = matcher

    def _validate(self, tokens: Sequence[int]) -> int:
        return self._m.validate_tokens(list(tokens))

    def _consume(self, tokens: Sequence[int]) -> None:
        if not self._m.consume_tokens(list(tokens)):
            raise self._failed()

    def _rollback(self, num_tokens: int) -> None:
        if not self._m.rollback(num_tokens):
            raise self._failed()

    def _failed(self) -> GrammarFailed:
        """The matcher's error, its first line (the rest is llguidance's state and grammar)."""
        return GrammarFailed(self._m.get_error().strip().split("\n", 1)[0])

    def _is_accepting(self) -> bool:
        return self._m.is_accepting()

    def _only_end_allowed(self) -> bool:
        return self._m.is_stopped() and self._m.is_accepting()

    def _fill(self, out: torch.Tensor) -> None:
        self._m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * out.element_size())
        if self._m.is_error():
            error = self._m.get_error()
            if error.startswith("NoExtension"):
                out.zero_()  # a dead end: no token can follow (compile rejects such grammars)
                return
            # a parser resource limit
            raise GrammarFailed(f"llguidance could not compute the mask: "
                                f"{error.strip().split(chr(10), 1)[0]}")

    def _copy(self) -> LLGuidanceConstraint:
        # Walks ahead (drafts, masks along them, forced-token checks) run on a copy of the
        # matcher: committing and rolling back on the live one left it, after some walks,
        # computing masks that let a token through that it then refused to consume (llguidance
        # 1.9.1; a tool call's last property took '",' as if more properties followed).
        copy = LLGuidanceConstraint(self._m.deep_copy(), self.vocab_size, self.eos_token_id)
        copy._num_fed, copy._ended = self._num_fed, self._ended
        return copy

    def _allows_one(self, token: int) -> bool:
        # where the grammar forces bytes, the mask keeps them to their canonical tokens ('"]')
        # and validate_tokens takes any tokenization ('"' then ']'): the mask decides, as in
        # plain constrained decoding
        if self._m.compute_ff_bytes():
            row = self._scratch_row()
            row.zero_()
            self._fill(row)
            return bit_is_set(row, token, self.vocab_size)
        return self._m.validate_tokens([token]) == 1

    def _forced(self) -> list[int]:
        if not self._m.compute_ff_bytes():  # no forced byte, no forced token (~100x cheaper)
            return []
        forced = self._m.compute_ff_tokens()
        if self.eos_token_id in forced:
            forced = forced[: forced.index(self.eos_token_id)]
        return forced


def compile_source(
    source: GrammarSource, tokenizer: llguidance.LLTokenizer, info: TokenizerInfo
) -> LLGuidanceGrammar:
    if source.kind is GrammarKind.LARK:
        _check_no_end_token(source, info)
    _check_no_special_text(source, info, tokenizer)
    return LLGuidanceGrammar(source, tokenizer, info.vocab_size, info.eos_token_id)


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
