"""Keys and values of prompts (after their prefill) and of finished sequences (prompt and answer)
kept, so that a prompt that begins the same way (an agent's next turn: the same system prompt,
tools and history, its last answer, then what is new) prefills only what follows the longest
cached beginning.

An entry is a copy of one sequence's keys and values in every layer, and, when the steps
captured them, the target hidden states the drafter reads, so that a DFlash request resumes its
drafter context too. Entries are evicted least recently used first, within a byte budget. On
the CPU the engine's forwards are batch-invariant (``ModelRunner``): a position's keys, values
and hidden states are bitwise the same whether it was prefilled whole, after a cached prefix or
decoded, so a hit changes no output, only the time to the first token.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PrefixEntry:
    tokens: np.ndarray  # [P] the sequence's token ids
    kv: list[torch.Tensor]  # every layer's keys, then values [KV, P, D] (``KVCache.cached``)
    hidden: torch.Tensor | None  # [P, K*H] the drafter's target layers; None when not captured

    @property
    def num_bytes(self) -> int:
        tensors = self.kv + ([self.hidden] if self.hidden is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class PrefixHit:
    entry: PrefixEntry
    length: int  # positions of the entry the prompt reuses


class PrefixCache:
    def __init__(self, budget_bytes: int, min_tokens: int = 32):
        """``min_tokens``: the shortest prefix worth reusing (shorter ones are prefilled)."""
        self.budget_bytes, self.min_tokens = budget_bytes, min_tokens
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recent first
        self._next_key = 0
        self.num_bytes = 0
        self._hidden_ids: set[int] = set()  # the entries' hidden states (``holds``)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int], with_hidden: bool) -> PrefixHit | None:
        """The entry sharing the longest beginning with ``prompt`` (at most all but its last
        token: the prompt's forward needs one token to give logits), if at least ``min_tokens``
        long; ``with_hidden``: only entries that carry hidden states."""
        tokens = np.asarray(prompt, dtype=np.int64)
        best_key, best = None, 0
        for key, entry in self._entries.items():
            if with_hidden and entry.hidden is None:
                continue
            n = _common_length(entry.tokens, tokens[:-1])
            if n > best:
                best_key, best = key, n
        if best_key is None or best < self.min_tokens:
            return None
        self._entries.move_to_end(best_key)
        return PrefixHit(self._entries[best_key], best)

    def fits(self, num_bytes: int) -> bool:
        """Whether an entry of ``num_bytes`` is within the budget (kept at all)."""
        return num_bytes <= self.budget_bytes

    def longest(self, bytes_per_token: int) -> int:
        """The most positions an entry of ``bytes_per_token`` a position may have."""
        return self.budget_bytes // bytes_per_token

    def holds(self, hidden: torch.Tensor) -> bool:
        """Whether an entry keeps ``hidden`` (the very tensor) as its hidden states."""
        return id(hidden) in self._hidden_ids

    def covers(self, sequence: list[int], with_hidden: bool) -> bool:
        """Whether an entry holds all of ``sequence`` (with hidden states if ``with_hidden``);
        it becomes the most recent."""
        tokens = np.asarray(sequence, dtype=np.int64)
        for key, entry in self._entries.items():
            if len(entry.tokens) >= len(tokens) and (entry.hidden is not None or not with_hidden):
                if _common_length(entry.tokens, tokens) == len(tokens):
                    self._entries.move_to_end(key)
                    return True
        return False

    def insert(self, sequence: list[int], kv: list[torch.Tensor], hidden: torch.Tensor | None):
        """Keep ``sequence``'s keys and values (and hidden states), unless an entry covers them
        or they are more than the budget holds; entries that are a beginning of it, with no
        more than it carries, are dropped for it."""
        if len(sequence) < self.min_tokens or self.budget_bytes <= 0:
            return
        new = PrefixEntry(np.asarray(sequence, dtype=np.int64), kv, hidden)
        if not self.fits(new.num_bytes):  # kept nowhere: the entries it covers stay
            return
        tokens = new.tokens
        covered = []  # entries the new one covers: one pass over them all
        for key, entry in self._entries.items():
            n = _common_length(entry.tokens, tokens)
            if n == len(tokens) and (hidden is None or entry.hidden is not None):
                self._entries.move_to_end(key)  # it covers the new one
                return
            if n == len(entry.tokens) and (entry.hidden is None or hidden is not None):
                covered.append(key)
        for key in covered:
            self._drop(key)
        while self.num_bytes + new.num_bytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[self._next_key] = new
        self._next_key += 1
        self.num_bytes += new.num_bytes
        if hidden is not None:
            self._hidden_ids.add(id(hidden))

    def clear(self) -> None:
        self._entries.clear()
        self._hidden_ids.clear()
        self.num_bytes = 0

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.num_bytes -= entry.num_bytes
        if entry.hidden is not None:
            self._hidden_ids.discard(id(entry.hidden))


def _common_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
