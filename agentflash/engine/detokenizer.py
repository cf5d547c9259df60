"""Incremental detokenisation: the text of a token list, grown one step at a time."""

from __future__ import annotations


class Detokenizer:
    """Decodes a request's output and hands out the text written since the last call.

    Text that ends in an incomplete UTF-8 sequence, or in what may be the start of a stop string,
    is held back until the next tokens settle it; a stop string itself is never handed out.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.emitted = 0  # characters handed out so far

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def delta(self, token_ids: list[int], final: bool = False, cut: int | None = None) -> str:
        """New text; ``cut`` is where a stop string begins, once the request stopped on one."""
        text = self.text(token_ids)
        if cut is not None:
            text = text[:cut]
        elif not final:
            text = text.rstrip("\ufffd") if text.endswith("\ufffd") else text
            text = text[: len(text) - self._held(text)]
        new = text[self.emitted :]
        self.emitted = max(self.emitted, len(text))
        return new

    def _held(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that a stop string starts with."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[-n:]):
                    best = n
                    break
        return best
