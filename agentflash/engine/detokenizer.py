"""Incremental detokenisation: the text of a token list, grown one step at a time."""

from __future__ import annotations

import functools
from typing import Any

from agentflash.tool_format import CLOSE, OPEN, CallBlocks, StopFinder


class OutputDecoder:
    """The text of a reply's tokens: what the grammar and the model wrote, without special
    tokens but the tool-call tags (a tokenizer may make ``<tool_call>`` special; the reply's
    calls are read from the text), and with its first token's leading space (SentencePiece
    decoders strip it from the first token decoded, where the grammar counted it). Made once
    per engine: a tokenizer changed after that is not seen."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        added = (tokenizer.backend_tokenizer.get_added_tokens_decoder()
                 if hasattr(tokenizer, "backend_tokenizer") else None)
        self.fast = added is not None
        if not self.fast:  # not a fast Hugging Face tokenizer: its own decoding
            return
        special = {i for i, t in added.items() if t.special} | set(tokenizer.all_special_ids)
        tags = {i for i in special if i in added and added[i].content in (OPEN, CLOSE)}
        self.skipped = frozenset(special - tags)
        # decoded before the reply, and its own text cut off the result
        self.context = tokenizer.encode("a", add_special_tokens=False)
        self.head = tokenizer.decode(self.context, skip_special_tokens=False)

    @functools.cached_property
    def byte_tokens(self) -> frozenset[int]:
        """Byte-fallback tokens (``<0xE2>``): a run of them is decoded as one, all U+FFFD if a
        byte in it is invalid. Read once, where a step first needs them."""
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        return frozenset(i for t, i in vocab.items()
                         if len(t) == 6 and t.startswith("<0x") and t.endswith(">"))

    def __call__(self, token_ids: list[int]) -> str:
        if not self.fast:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)
        ids = [t for t in token_ids if t not in self.skipped]
        text = self.tokenizer.decode(self.context + ids, skip_special_tokens=False)
        if text.startswith(self.head):
            return text[len(self.head):]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def settled(text: str) -> str:
    """``text`` less an incomplete UTF-8 sequence at its end (decoded as U+FFFD), which the next
    tokens may complete."""
    return text.rstrip("\ufffd") if text.endswith("\ufffd") else text


class ReplyText:
    """The settled text (``settled``) of a reply's tokens as they grow, decoded from the tokens
    after the last point where the text was whole, not from the whole reply (O(step) a call;
    StepText's window): where it ends in no U+FFFD, no character is cut there, so none will be;
    but a byte-fallback decoder reads a run of byte tokens (``<0xE2>``) as one, all U+FFFD if a
    byte in it is invalid (``<0x41>`` reads ``A``, then U+FFFD once ``<0x80>`` follows), so the
    window starts again before such a run, never inside one; and a special token is left out
    before decoding, so the tokens on either side of it are read as one (bytes of a character,
    a run). A window that ends in U+FFFD (or such a token) starts again at a cut within its
    last 9 tokens where its text splits (``head + tail == text``, the tail not empty).
    ``stable``: how much of the text every later one begins with. A decoder
    whose text of some tokens is not that of each part (not a fast tokenizer: SentencePiece's
    own strips a part's first space; ``clean_up_tokenization_spaces`` joins `` .`` across
    parts) decodes the whole reply, stable nowhere."""

    def __init__(self, decode: OutputDecoder):
        self.decode = decode
        tokenizer = getattr(decode, "tokenizer", None)
        self.local = (getattr(decode, "fast", False)
                      and not getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.head = ""  # the text of ``token_ids[:start]``, which later tokens leave as it is
        self.start = 0
        self.stable = 0
        # an id the tokenizer does not have (a model's rows outnumber its tokens: Qwen3's
        # 151,936 to 151,669; a hole in its ids) decodes to nothing: left out like a special one
        self.id_to_token = tokenizer.backend_tokenizer.id_to_token if self.local else None

    @functools.cached_property
    def _joined(self) -> frozenset[int]:
        """Tokens that may be read as one with the next: byte-fallback and left-out ones."""
        return self.decode.byte_tokens | self.decode.skipped

    def _joins(self, token: int) -> bool:
        return token in self._joined or self.id_to_token(token) is None

    def _left_out(self, token: int) -> bool:
        return token in self.decode.skipped or self.id_to_token(token) is None

    def update(self, token_ids: list[int], end: int) -> str:
        """The settled text of ``token_ids[:end]`` (the tokens before those read before)."""
        if not self.local:
            return settled(self.decode(token_ids[:end]))
        tail = self.decode(token_ids[self.start : end])
        if end > self.start and not tail.endswith("\ufffd") and not self._joins(
                token_ids[end - 1]):
            self.head, self.start, tail = self.head + tail, end, ""
        elif end - self.start > 1:
            tail = self._cut(token_ids, end, tail)
        self.stable = len(self.head.rstrip("\ufffd"))
        return (self.head + tail).rstrip("\ufffd")

    def _cut(self, token_ids: list[int], end: int, tail: str) -> str:
        """``tail`` from a later start, where one splits it."""
        for cut in range(end - 1, max(self.start, end - 10), -1):
            if self._left_out(token_ids[cut]) or self._joins(token_ids[cut - 1]) and (
                    self._joins(token_ids[cut])):
                continue
            right = self.decode(token_ids[cut:end])
            if not right or not tail.endswith(right):
                continue
            left = self.decode(token_ids[self.start : cut])
            if left + right == tail:
                self.head, self.start = self.head + left, cut
                return right
        return tail


class StopCheck:
    """Where the first stop string begins in a reply's text (``stop_at``), read a token at a
    time as the reply grows (O(token) a token: ``ReplyText``, ``StopFinder``)."""

    def __init__(self, decode: OutputDecoder, stop: tuple[str, ...], tool_calls: bool = True):
        self.text = ReplyText(decode)
        self.finder = StopFinder(stop, tool_calls)

    def __call__(self, token_ids: list[int]) -> int | None:
        """Where in the text of ``token_ids`` (the tokens of the last call and more)."""
        text = self.text.update(token_ids, len(token_ids))
        return self.finder.find(text, self.text.stable)


class StepText:
    """What a reply's text grew by at each step, for the segment tracker: the text less up to 3
    trailing U+FFFD (an incomplete UTF-8 character at the end, at most 3 bytes, decodes to one,
    or on a byte-fallback decoder to one a byte, which the next tokens may complete; those
    before them are final, the text's own or invalid bytes), decoded from the last few tokens,
    not the whole reply (O(step)). Each step's tokens decoded alone split a character whose
    bytes two steps wrote (``×`` on the demo tokenizer) into two U+FFFD."""

    def __init__(self, decode: OutputDecoder):
        self.decode = decode
        self.start = 0  # the text of ``token_ids[:start]`` is handed out, and ends a character
        self.emitted = 0  # characters of the text of ``token_ids[start:]`` handed out
        self.end = 0  # the tokens read so far

    def delta(self, token_ids: list[int], end: int) -> str:
        """The text ``token_ids[:end]`` adds to what was handed out."""
        text = self.decode(token_ids[self.start : end])
        if not text.endswith("\ufffd"):
            new = text[self.emitted :]
            self.start, self.emitted, self.end = end, 0, end
            return new
        if end - self.end > 1:
            # a token at a time: a byte-fallback decoder writes a run of byte tokens that ends
            # inside a character as one U+FFFD a byte, the whole characters before it included
            return "".join(self._step(token_ids, e) for e in range(self.end + 1, end + 1))
        return self._step(token_ids, end, text)

    def _step(self, token_ids: list[int], end: int, text: str | None = None) -> str:
        self.end = end
        if text is None:
            text = self.decode(token_ids[self.start : end])
            if not text.endswith("\ufffd"):
                new = text[self.emitted :]
                self.start, self.emitted = end, 0
                return new
        whole = text[: len(text) - min(len(text) - len(text.rstrip("\ufffd")), 3)]
        new = whole[self.emitted :]
        self.emitted = max(self.emitted, len(whole))
        # the window starts again at a token within the last 9 (the held U+FFFD are at most 3
        # characters of at most 3 bytes: U+FFFD itself, an invalid or incomplete sequence)
        # where the text splits (``head + tail == text``: no character spans the cut, so none
        # will) and whose head is handed out, so that a run of steps that each end in U+FFFD,
        # incomplete or final, does not grow it; a tail is decoded first, its head only where
        # the tail holds what is held back
        # a byte-fallback decoder reads a run of byte tokens as one, all U+FFFD if a byte in it
        # is invalid: where the window holds such (a U+FFFD more than an incomplete character's
        # three), no cut inside a run, whose tail alone would read valid
        run = getattr(self.decode, "byte_tokens", ()) if "\ufffd" in text[:-3] else ()
        for cut in range(end - 1, max(self.start, end - 10), -1):
            if token_ids[cut - 1] in run and token_ids[cut] in run:
                continue
            tail = self.decode(token_ids[cut:end])
            if len(text) - len(tail) > self.emitted or not text.endswith(tail):
                continue
            if self.decode(token_ids[self.start : cut]) + tail == text:
                self.start, self.emitted = cut, self.emitted - (len(text) - len(tail))
                break
        return new


class Detokenizer:
    """Decodes a request's output and hands out the text written since the last call.

    Text that ends in an incomplete UTF-8 sequence, or in what may be the start of a stop string,
    is held back until the next tokens settle it; a stop string itself is never handed out. With
    stop strings and ``tool_calls`` (stops are not matched inside a call), so is the text after
    an open call's first ``</tool_call>``, until it is known whether the call ended there
    (``unsettled_from``): a stop after it was handed out, and then cut off the result.
    """

    def __init__(self, decode: OutputDecoder, stop: tuple[str, ...] = (),
                 tool_calls: bool = True):
        self.decode, self.stop, self.tool_calls = decode, stop, tool_calls
        self.emitted = 0  # characters handed out so far
        self.reply = ReplyText(decode)  # the text so far, a step at a time
        # the calls of the text handed out or held (``unsettled_from``, a step at a time)
        self.calls = CallBlocks() if stop and tool_calls else None
        self.longest = max(map(len, stop), default=1)

    def text(self, token_ids: list[int]) -> str:
        return self.decode(token_ids)

    def delta(self, token_ids: list[int], final: bool = False, cut: int | None = None) -> str:
        """New text (of ``token_ids``: the last call's and more); ``cut`` is where a stop string
        begins, once the request stopped on one."""
        if cut is not None:
            text = self.text(token_ids)[:cut]
        elif final:
            text = self.text(token_ids)
        else:
            text = self.reply.update(token_ids, len(token_ids))
            text = text[: len(text) - self._held(text)]
            if self.calls is not None:
                text = self._settled_calls(text)
        new = text[self.emitted :]
        self.emitted = max(self.emitted, len(text))
        return new

    def _settled_calls(self, text: str) -> str:
        """``text`` less what follows an open call's first ``</tool_call>`` (``unsettled_from``).
        It is the reply's settled text less what a stop string may begin with (shorter than
        the longest), so every later one begins with its stable text less that much."""
        self.calls.advance(text, max(0, self.reply.stable - self.longest + 1))
        blocks = self.calls.tail(text)
        if blocks and blocks[-1][2] is None:
            at = text.find(CLOSE, blocks[-1][1])
            if at >= 0:
                return text[:at]
        return text

    def _held(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that a stop string starts with."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[-n:]):
                    best = n
                    break
        return best
