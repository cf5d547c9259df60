"""The one interface the engine uses to keep a request's output inside a grammar.

A ``CompiledGrammar`` is immutable and shared (it lives in the compile cache); each request gets
its own ``Constraint`` from ``grammar.new_constraint()``. Masks are packed bitmasks: int32 words
``[..., ceil(V / 32)]`` over the model vocabulary V, bit ``t % 32`` of word ``t // 32`` set when
token ``t`` is allowed (the layout llguidance, outlines-core and xgrammar share). Token ids the
tokenizer does not have (model vocabularies are often padded) are never allowed.

The end-of-turn token (``eos_token_id``) is handled here, the same way for every backend: it is
legal exactly when the output so far is complete, committing it finishes the constraint, and once
finished the only "allowed" token is the end token itself (so masked logits never become all
``-inf``).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from agentflash.errors import UserError
from agentflash.kernels import use_kernels


class GrammarError(UserError):
    """A grammar that cannot be used: bad syntax, an unsupported feature, or one that can never
    finish. Raised when the grammar is compiled; the message names the source and the field."""


# why a request ends where a grammar's mask leaves no token (greedy, sampled, verified)
NO_LEGAL_TOKEN = "no legal token: the grammar is stuck here"


class GrammarFailed(RuntimeError):
    """The grammar cannot go on while a request decodes (a parser limit; a dead end that the
    compile checks did not see): that request ends with an error, the others go on. ``limit``:
    a limit of llguidance's lexer or parser that the grammar reached (the request's schema is
    too complex for it), not a fault of the engine's or of llguidance's."""

    def __init__(self, message: str, limit: bool = False):
        super().__init__(message)
        self.limit = limit


class GrammarViolation(ValueError):
    """A token the grammar forbids was committed (an engine bug: commit only legal tokens)."""


def bitmask_width(vocab_size: int) -> int:
    """Number of int32 words in one packed mask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A zeroed (nothing allowed) bitmask ``[rows, W]`` on the CPU, where grammars fill it."""
    return torch.zeros(rows, bitmask_width(vocab_size), dtype=torch.int32)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool mask ``[..., V]`` from a packed bitmask ``[..., W]``; True where allowed."""
    if bitmask.device.type == "cpu":  # numpy's unpackbits is ~10x faster than tensor shifts
        return torch.from_numpy(_unpacked(bitmask, vocab_size))
    shifts = _BIT_SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _BIT_SHIFTS.setdefault(
            bitmask.device, torch.arange(32, dtype=torch.int32, device=bitmask.device)
        )
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [..., W, 32]
    return bits.flatten(-2)[..., :vocab_size].bool()  # [..., V]


def _unpacked(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """``unpack_bitmask`` of a CPU bitmask, as a numpy bool array."""
    words = bitmask.contiguous().numpy().view(np.uint8)
    return np.unpackbits(words, axis=-1, count=vocab_size, bitorder="little").view(np.bool_)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to -inf, in place; returns ``logits``.

    ``logits`` is ``[..., V]``, ``bitmask`` is ``[..., W]`` with the same leading shape (or
    broadcastable to it); it is moved to the logits' device.
    """
    vocab_size = logits.shape[-1]
    assert bitmask.shape[-1] * 32 >= vocab_size, "bitmask narrower than the logits"
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if use_kernels(logits):  # the packed words read in place, no [..., V] bool tensor
        from agentflash.kernels.token_bitmask import apply_token_bitmask_

        if logits.stride(-1) == 1:
            return apply_token_bitmask_(logits, bitmask)
        # the kernel reads rows of contiguous tokens (a transposed view: the CPU path took it)
        return logits.copy_(apply_token_bitmask_(logits.contiguous(), bitmask))
    allowed = unpack_bitmask(bitmask, vocab_size)
    return logits.masked_fill_(allowed.logical_not_(), float("-inf"))


def allowed_token_ids(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a one-row bitmask ``[W]`` allows, ascending."""
    return unpack_bitmask(bitmask, vocab_size).nonzero().flatten().tolist()


def first_allowed_token(bitmask: torch.Tensor, vocab_size: int) -> int | None:
    """The least token id a one-row CPU bitmask ``[W]`` allows, or None: ``allowed_token_ids``'s
    first without listing them all (free text's mask allows 150k, 5 ms to list)."""
    words = bitmask.contiguous().numpy().view(np.uint32)
    nonzero = np.flatnonzero(words)
    if not len(nonzero):
        return None
    word = int(words[nonzero[0]])
    token = int(nonzero[0]) * 32 + (word & -word).bit_length() - 1  # its lowest set bit
    return token if token < vocab_size else None


class Constraint(abc.ABC):
    """One request's position in a grammar, advanced over committed tokens only.

    Per decode step (plain constrained decoding): ``fill_bitmask`` -> mask the logits -> sample ->
    ``advance([token])``. Per speculation step: ``validate_draft`` cuts the draft,
    ``masks_along_draft`` gives one mask per verify position, the engine accepts a prefix, then
    ``advance(committed)``. ``constrained_draft`` walks the drafter's logits under the grammar.

    Subclasses implement the ``_``-prefixed primitives over tokens other than the end token; this
    class adds the end-token rules and the draft operations on top of them.
    """

    def __init__(self, vocab_size: int, eos_token_id: int):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._num_fed = 0  # tokens the backend has consumed (the end token is never fed)
        self._ended = False  # the end token was committed
        self._row: torch.Tensor | None = None  # ``_scratch_row``

    # --- backend primitives ----------------------------------------------------------------

    def _recheck(self, tokens: list[int], legal: int) -> int:
        """``legal`` of ``tokens`` as ``advance`` takes them, where the backend's validation
        may have refused one for a limit of its own (``GrammarFailed``); by default as is."""
        return legal

    @abc.abstractmethod
    def _validate(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` (none of them the end token) are legal; no state change."""

    @abc.abstractmethod
    def _consume(self, tokens: Sequence[int]) -> None:
        """Consume ``tokens``, which ``_validate`` has accepted."""

    @abc.abstractmethod
    def _rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` consumed tokens."""

    @abc.abstractmethod
    def _is_accepting(self) -> bool:
        """Whether the output so far is complete (the end token may follow)."""

    @abc.abstractmethod
    def _only_end_allowed(self) -> bool:
        """Whether the output is complete and nothing but the end token may follow."""

    @abc.abstractmethod
    def _fill(self, out: torch.Tensor) -> None:
        """Write the current mask into the zeroed int32 row ``out`` [W] (the end token's bit is
        set or cleared afterwards by ``fill_bitmask``)."""

    @abc.abstractmethod
    def _forced(self) -> list[int]:
        """Tokens (not the end token) that every legal continuation starts with."""

    def _copy(self) -> Constraint | None:
        """An independent constraint in this state, to walk ahead on, or None if the backend
        cannot copy its state (walks then commit here and roll back)."""
        return None

    # --- state -----------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Committed tokens, the end token included."""
        return self._num_fed + int(self._ended)

    def is_accepting(self) -> bool:
        """Whether the output so far is a complete match (the end token is legal now)."""
        return not self._ended and self._is_accepting()

    def is_finished(self) -> bool:
        """Whether the end token was committed; nothing may follow."""
        return self._ended

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit ``tokens``; raises ``GrammarViolation`` (state unchanged) if one is illegal.
        After the end token only the end token is allowed (the mask's rule), and it commits
        nothing more: a request that ignores the end token writes it again."""
        tokens = list(tokens)
        if self.eos_token_id in tokens:
            end = tokens.index(self.eos_token_id) + (not self._ended)
            if all(t == self.eos_token_id for t in tokens[end:]):
                tokens = tokens[:end]
        legal = self.validate_draft(tokens)
        if legal < len(tokens):
            legal = self._recheck(tokens, legal)
        if legal < len(tokens):
            raise GrammarViolation(
                f"token {tokens[legal]} at draft position {legal} is not allowed by the grammar "
                f"after {self.num_tokens} committed tokens"
            )
        self._commit(tokens)

    def _commit(self, tokens: list[int]) -> None:
        # tokens are legal: only the last one may be the end token
        if tokens and tokens[-1] == self.eos_token_id:
            body = tokens[:-1]
            self._consume(body)
            self._num_fed += len(body)
            self._ended = True
        elif tokens:
            self._consume(tokens)
            self._num_fed += len(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` committed tokens (the end token counts as one)."""
        assert 0 <= num_tokens <= self.num_tokens, f"cannot roll back {num_tokens} tokens"
        if num_tokens and self._ended:
            self._ended = False
            num_tokens -= 1
        if num_tokens:
            self._rollback(num_tokens)
            self._num_fed -= num_tokens

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self.rollback(self.num_tokens)

    # --- masks -----------------------------------------------------------------------------

    def fill_bitmask(self, out: torch.Tensor) -> None:
        """Write the mask of the current state into the CPU int32 row ``out`` [W]."""
        assert out.dtype == torch.int32 and out.is_cpu and out.is_contiguous() and out.dim() == 1
        assert out.numel() == bitmask_width(self.vocab_size), "mask row has the wrong width"
        out.zero_()
        words = out.numpy()  # a view: one word is read and written (cheaper than tensor indexing)
        word, bit = self.eos_token_id // 32, _bit(self.eos_token_id)
        if self._ended:
            words[word] = bit
            return
        self._fill(out)
        # the end token's bit follows this class's rule, whatever the backend's own convention
        if self._is_accepting():
            words[word] |= bit
        else:
            words[word] &= ~bit

    def bitmask(self) -> torch.Tensor:
        """The current mask as a new int32 tensor [W]."""
        out = allocate_bitmask(1, self.vocab_size)[0]
        self.fill_bitmask(out)
        return out

    def allowed_mask(self) -> torch.Tensor:
        """The current mask as a bool tensor [V]."""
        return unpack_bitmask(self.bitmask(), self.vocab_size)

    # --- drafts ----------------------------------------------------------------------------

    def validate_draft(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows from the current state (no change).

        Nothing may follow the end token, so at most the tokens up to and including the first
        end token count.
        """
        if self._ended:
            return 0
        tokens = list(tokens)
        end = tokens.index(self.eos_token_id) if self.eos_token_id in tokens else len(tokens)
        body = tokens[:end]
        first_bad = next((i for i, t in enumerate(body) if not 0 <= t < self.vocab_size), end)
        legal = self._validate(body[:first_bad]) if first_bad else 0
        if legal < end or end == len(tokens):
            return legal
        return end + 1 if self._accepts_after(body) else end

    def mask_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` plain constrained decoding could write: each allowed by
        the mask where it stands (``validate_draft`` takes any tokenization of forced text,
        the mask its canonical tokens only). No change; for drafts the grammar did not walk
        (a lookup in the request's text)."""
        with self._walk() as ahead:
            for n, token in enumerate(tokens):
                if not ahead.take(token):
                    return n
        return len(tokens)

    def allows(self, token: int) -> bool:
        """Whether the mask allows ``token`` next (the walks ask this once a drafted slot, and
        verification where the target's choice is not the draft's): ``validate_draft([token])
        == 1`` except where a backend's mask is narrower (``_allows_one``)."""
        if self._ended or not 0 <= token < self.vocab_size:
            return False
        if token == self.eos_token_id:
            return self._is_accepting()
        return self._allows_one(token)

    def take(self, token: int) -> bool:
        """Commit ``token`` if the mask allows it (``allows``) and say whether it did: a walk's
        check and commit of a drafted token in one (llguidance: one call, ``_take_one``)."""
        if self._ended or not 0 <= token < self.vocab_size:
            return False
        if token == self.eos_token_id:
            if not self._is_accepting():
                return False
            self._ended = True
            return True
        if not self._take_one(token):
            return False
        self._num_fed += 1
        return True

    def _take_one(self, token: int) -> bool:
        """Consume ``token`` (not the end token) if the mask allows it; whether it did."""
        if not self._allows_one(token):
            return False
        self._consume([token])
        return True

    def _allows_one(self, token: int) -> bool:
        """Whether the mask allows ``token`` (not the end token); a backend whose mask is
        narrower than its token check in some states overrides this."""
        return self._validate([token]) == 1

    def _accepts_after(self, body: list[int]) -> bool:
        """Whether the output would be complete after the legal tokens ``body``; no change."""
        with self._walk() as ahead:
            ahead._commit(body)
            return ahead._is_accepting()

    def _ends_after(self, forced: list[int]) -> bool:
        """Whether only the end token may follow the legal tokens ``forced``; no change."""
        with self._walk() as ahead:
            ahead._commit(forced)
            return ahead._only_end_allowed()

    @contextmanager
    def _walk(self) -> Iterator[Constraint]:
        """A constraint to commit tokens on ahead of the request: a copy where the backend can
        copy (llguidance: walks committed and rolled back on the live matcher once left it
        allowing a token it then refused), else this one, rolled back afterwards."""
        copy = self._copy()
        if copy is not None:
            yield copy
            return
        start = self.num_tokens
        try:
            yield self
        finally:
            self.rollback(self.num_tokens - start)

    def masks_along_draft(self, tokens: Sequence[int]) -> torch.Tensor:
        """One mask per verify position along a legal draft: ``[len(tokens) + 1, W]``.

        Row 0 is the current mask; row i+1 is the mask after ``tokens[:i+1]``. The state is the
        same afterwards. Cut the draft with ``validate_draft`` first: an illegal token raises
        ``GrammarViolation``.
        """
        return masks_along_drafts([self], [tokens])[0]

    def mask_after(self, tokens: Sequence[int]) -> torch.Tensor:
        """The mask [W] after the legal ``tokens`` (the current one for none); no change."""
        out = allocate_bitmask(1, self.vocab_size)[0]
        if not tokens:
            self.fill_bitmask(out)
            return out
        with self._walk() as ahead:
            ahead._commit(list(tokens))
            ahead.fill_bitmask(out)
        return out

    def mask_unless_allowed(self, tokens: Sequence[int], token: int) -> torch.Tensor | None:
        """None if ``token`` may follow the legal ``tokens``; else the mask [W] after them (a
        token checked alone costs a fraction of a mask). No change."""
        if not tokens:
            return None if self.allows(token) else self.mask_after(())
        with self._walk() as ahead:
            ahead._commit(list(tokens))
            if ahead.allows(token):
                return None
            out = allocate_bitmask(1, self.vocab_size)[0]
            ahead.fill_bitmask(out)
            return out

    def _masks_one_by_one(self, tokens: list[int]) -> torch.Tensor:
        out = allocate_bitmask(len(tokens) + 1, self.vocab_size)
        self.fill_bitmask(out[0])
        with self._walk() as ahead:
            for i, token in enumerate(tokens):
                ahead._commit([token])
                ahead.fill_bitmask(out[i + 1])
        return out

    def _scratch_row(self) -> torch.Tensor:
        """A mask row [W] that a walk or a verify of this request fills and reads at once, never
        keeps (one allocation per request, and per walk's copy where it asks ``allows``)."""
        if self._row is None:
            self._row = allocate_bitmask(1, self.vocab_size)[0]
        return self._row

    def _commit_forced(self, limit: int) -> list[int]:
        """Commit and return ``forced_tokens()[:limit]``, asking whether the end token follows
        the forced run after committing it rather than on a copy (for a walk's own copy)."""
        if self._ended or limit <= 0:
            return []
        if self._only_end_allowed():
            self._commit([self.eos_token_id])
            return [self.eos_token_id]
        forced = self._forced()[:limit]
        self._commit(forced)
        if forced and len(forced) < limit and self._only_end_allowed():
            self._commit([self.eos_token_id])
            forced.append(self.eos_token_id)
        return forced

    def forced_tokens(self) -> list[int]:
        """Tokens every legal continuation starts with, free to commit or to draft.

        Ends with the end token when the grammar allows nothing else after them; empty when the
        next token is a real choice (or the constraint is finished).
        """
        if self._ended:
            return []
        if self._only_end_allowed():
            return [self.eos_token_id]
        forced = self._forced()
        if forced and self._ends_after(forced):
            forced.append(self.eos_token_id)
        return forced


def _bit(token: int) -> int:
    # the int32 word value with only this token's bit set (bit 31 is the sign bit)
    value = 1 << (token % 32)
    return value - (1 << 32) if value >= 1 << 31 else value


def masks_along_drafts(
    constraints: Sequence[Constraint], drafts: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """``masks_along_draft`` for a batch of requests: ``[len(draft) + 1, W]`` per request.

    Each mask is computed token by token along its draft, on a copy of the constraint where the
    backend can copy (llguidance). llguidance's batched draft-mask call
    (``unsafe_compute_mask_ptr_with_draft_token``, 1.9.1) walks and rolls back the live matchers,
    and walks with rollbacks on a live matcher left it, after some steps, allowing a token (a
    string-closing ``",`` after a tool call's last property) that it then refused to consume.
    """
    drafts = [list(d) for d in drafts]
    for constraint, draft in zip(constraints, drafts, strict=True):
        legal = constraint.validate_draft(draft)
        if legal < len(draft):
            raise GrammarViolation(
                f"draft token {draft[legal]} at position {legal} is not "
                "allowed by the grammar; cut drafts with validate_draft"
            )
    return [c._masks_one_by_one(d) for c, d in zip(constraints, drafts, strict=True)]


def greedy_verify(
    constraint: Constraint,
    draft: Sequence[int],
    logits: torch.Tensor,
    masks: torch.Tensor | None = None,
    top: Sequence[int] | None = None,
    commit: bool = False,
) -> tuple[int, int]:
    """Greedy acceptance of the legal ``draft`` [T] under the grammar: exactly what
    ``greedy_accept`` gives on ``logits`` [T+1, V] masked at every verify position along the
    draft, with only the masks it needs. Where the target's own argmax is the drafted token,
    that token is legal and masking cannot change the argmax, so no mask is needed; a mask is
    made (``mask_unless_allowed``: after the draft so far) only where they differ and the
    target's choice is illegal, and then the legal argmax decides. ``masks`` [T+1, W]: the
    masks along the draft if its walk made them; ``top``: the logits' argmax per position if
    the caller has it. Returns ``(num_accepted, next_token)``; the constraint is unchanged, or,
    with ``commit``, has committed the accepted drafts and the next token (what the request
    commits next: no walk on a copy up to the first mismatch, no second pass to commit)."""
    if top is None:
        top = logits.argmax(-1).tolist()
    assert len(top) == len(draft) + 1, "verify yields one more row than there are drafts"
    done = 0  # with ``commit``: the drafts committed so far
    for j, token in enumerate(top):
        drafted = draft[j] if j < len(draft) else None
        if token == drafted:
            continue
        if masks is not None:
            row = masks[j] if not bit_is_set(masks[j], token, constraint.vocab_size) else None
        elif commit:  # the drafts up to here are legal and, matched so far, accepted
            _commit_to_end(constraint, draft[done:j])
            done = j
            row = None
            if not constraint.allows(token):
                row = constraint._scratch_row()
                constraint.fill_bitmask(row)
        else:
            row = constraint.mask_unless_allowed(draft[:j], token)
        if row is not None:  # the target's choice is illegal: the legal argmax decides
            token = _masked_argmax(row, logits[j], constraint.vocab_size)
            if token == drafted:
                continue
        if commit:
            _commit_to_end(constraint, [*draft[done:j], token])
        return j, token
    raise AssertionError("unreachable: the last position has no draft to match")


def _commit_to_end(constraint: Constraint, tokens: Sequence[int]) -> None:
    """Commit the legal ``tokens`` up to the end token (a request stops there)."""
    end = constraint.eos_token_id
    tokens = list(tokens)
    if end in tokens:
        tokens = tokens[: tokens.index(end) + 1]
    if tokens and not constraint.is_finished():
        constraint._commit(tokens)


@dataclass(frozen=True)
class Draft:
    """Tokens drafted under a grammar, how many of them the grammar forced, and the verify masks
    along them if the walk was asked for them."""

    tokens: list[int]
    num_forced: int
    masks: torch.Tensor | None  # [len(tokens) + 1, W]: row i is the mask after tokens[:i]


def constrained_draft(
    constraint: Constraint,
    draft_logits: torch.Tensor,
    proposals: Sequence[int] | None = None,
    use_forced: bool = True,
    max_drafted: int | None = None,
    max_tokens: int | None = None,
    forced_now: Sequence[int] | None = None,
    with_masks: bool = True,
    max_fixes: int | None = None,
) -> Draft:
    """Walk a block of drafter logits ``[K, V]`` left to right under the grammar.

    At each slot: if the grammar forces tokens, they fill the next slots at no model cost;
    otherwise the slot takes its plain argmax when the slot's mask allows it, else the argmax of
    its allowed tokens. The walk runs ahead of the constraint (``Constraint._walk``), whose
    state is unchanged. Every drafted token is legal; the walk stops after the end token. Slot
    k's logits propose the k-th token of the draft; forced tokens fill slots without reading
    their logits. ``proposals`` is the per-slot argmax if the caller has it already. The masks
    it returns equal ``masks_along_draft(tokens)``: the verify forward needs no second walk.

    ``max_drafted`` caps the tokens the drafter proposes (default: its ``K`` slots); forced
    tokens do not count against it. ``max_tokens`` caps the draft, forced tokens included
    (default ``K``); above ``K``, a forced run may go on past the drafter's last slot, since a
    forced token costs the verify forward only its position. ``forced_now`` is
    ``constraint.forced_tokens()`` if the caller has it already. ``with_masks=False`` (greedy
    verification, ``greedy_verify``, makes the few masks it needs) checks a drafted token
    alone, and makes a slot's mask only where that token is illegal; ``masks`` is then None.
    ``max_fixes``: the draft ends at the ``max_fixes``-th slot whose drafted token was illegal
    (the fixed token its last): the drafter proposed the whole block at once, so its later slots
    assumed a prefix the draft no longer has (default: walk every slot).
    """
    num_slots = draft_logits.shape[0]
    max_drafted = num_slots if max_drafted is None else min(max_drafted, num_slots)
    max_tokens = num_slots if max_tokens is None else max_tokens
    best = list(proposals) if proposals is not None else draft_logits.argmax(dim=-1).tolist()
    if with_masks:
        masks = allocate_bitmask(min(max_tokens, num_slots) + 1, constraint.vocab_size)
    else:  # one row, filled and read where a drafted token is illegal
        masks = constraint._scratch_row()[None]
    tokens: list[int] = []
    num_forced = 0
    fixes_left = max_fixes if max_fixes is not None else -1
    after_run = False  # the last tokens were a forced run (as long as the grammar forces)
    with constraint._walk() as ahead:
        while len(tokens) < max_tokens and not ahead.is_finished():
            room = max_tokens - len(tokens)
            if not use_forced or after_run:
                forced = []
            elif forced_now is not None and not tokens:  # the walk's start: the caller's
                forced, forced_now = list(forced_now)[:room], None
                if not with_masks:
                    ahead._commit(forced)
            elif with_masks:
                forced = ahead.forced_tokens()[:room]
            else:  # the whole run committed in one call, the end token checked without a copy
                forced = ahead._commit_forced(room)
            if with_masks and len(tokens) + len(forced) >= masks.shape[0]:
                masks = _grow(masks, len(tokens) + len(forced) + 1)
            if with_masks:  # a mask before each forced token
                for token in forced:
                    ahead.fill_bitmask(masks[len(tokens)])
                    ahead._commit([token])
                    tokens.append(token)
            else:  # committed above
                tokens.extend(forced)
            num_forced += len(forced)
            after_run = bool(forced)
            if forced:
                continue
            slot = len(tokens)
            if slot >= num_slots or slot - num_forced >= max_drafted:
                break
            token = best[slot]
            row = masks[slot if with_masks else 0]
            if with_masks:
                ahead.fill_bitmask(row)
                legal = bit_is_set(row, token, ahead.vocab_size)
            else:  # one token checked (and committed if legal) costs a fraction of a mask
                legal = ahead.take(token)
                if not legal:
                    ahead.fill_bitmask(row)
            if not legal:  # the slot's best legal token (no ranking of the whole block first)
                token = _masked_argmax(row, draft_logits[slot], ahead.vocab_size)
            if with_masks or not legal:
                ahead._commit([token])
            tokens.append(token)
            if not legal:
                fixes_left -= 1
                if fixes_left == 0:
                    break
        if not with_masks:
            return Draft(tokens, num_forced, None)
        ahead.fill_bitmask(masks[len(tokens)])
    return Draft(tokens, num_forced, masks[: len(tokens) + 1])


def _grow(masks: torch.Tensor, rows: int) -> torch.Tensor:
    """``masks`` with at least ``rows`` rows (the new ones zeroed), doubling to amortise."""
    grown = allocate_bitmask(max(rows, 2 * masks.shape[0]), masks.shape[1] * 32)
    grown[: masks.shape[0]] = masks
    return grown


def bit_is_set(row: torch.Tensor, token: int, vocab_size: int) -> bool:
    """Whether the mask row [W] allows ``token``."""
    return 0 <= token < vocab_size and (int(row[token // 32]) >> (token % 32)) & 1 == 1


def _masked_argmax(row: torch.Tensor, logits: torch.Tensor, vocab_size: int) -> int:
    if use_kernels(logits):  # on the GPU: one kernel, one int read back
        from agentflash.kernels.masked_argmax import masked_argmax

        token = int(masked_argmax(logits.detach()[None, :vocab_size].contiguous(),
                                  row.to(logits.device)[None].contiguous())[0])
        if token < 0:
            raise GrammarFailed(NO_LEGAL_TOKEN)
        return token
    bits = _unpacked(row, vocab_size) if row.device.type == "cpu" else (
        unpack_bitmask(row, vocab_size).cpu().numpy())
    # compare only the legal tokens' scores (the first highest of them, as an argmax over the
    # masked row gives): cheaper than masking a whole row
    allowed = np.flatnonzero(bits)
    if not len(allowed):
        raise GrammarFailed(NO_LEGAL_TOKEN)
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        values = logits.detach().numpy()  # numpy throughout: no tensor ops
        return int(allowed[values[allowed].argmax()])
    ids = torch.from_numpy(allowed)
    return int(ids[int(logits.detach()[ids.to(logits.device)].argmax())])


class CompiledGrammar(abc.ABC):
    """A grammar compiled for one tokenizer and vocabulary; immutable and shared."""

    vocab_size: int
    eos_token_id: int

    @abc.abstractmethod
    def new_constraint(self) -> Constraint:
        """A fresh per-request constraint at the start of the grammar."""
