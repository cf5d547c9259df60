"""Incremental detokenisation: the text of a token list, grown one step at a time."""

from __future__ import annotations


class Detokenizer:
    """Decodes a request's output and hands out the text written since the last call.

    Text ending in an incomplete UTF-8 sequence is held back until the next token completes it.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.emitted = 0  # characters handed out so far

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def delta(self, token_ids: list[int], final: bool = False) -> str:
        text = self.text(token_ids)
        if not final and text.endswith("\ufffd"):
            return ""
        new = text[self.emitted :]
        self.emitted = len(text)
        return new
