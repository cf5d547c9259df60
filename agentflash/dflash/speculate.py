"""Draft, verify, accept: the DFlash speculation rules as small tensor functions.

One speculation step for a request whose last committed token is ``x`` at position ``p``:

1. draft: ``draft_block`` runs the drafter on ``[x, mask x (B-1)]`` and takes the argmax of slots
   ``1..B-1``: ``T = B-1`` draft tokens.
2. verify: the target runs causally over ``[x, d_1 .. d_T]`` (positions ``p .. p+T``) and yields
   ``T+1`` rows of logits; row ``i`` predicts the token after slot ``i``.
3. accept: ``greedy_accept`` (temperature 0) or ``sample_accept`` (the draft as a one-hot
   proposal) returns how many draft tokens stand and the target's own next token, the bonus.
   ``num_accepted + 1`` tokens are committed; the output equals plain decoding's.

Nothing here knows about requests, caches or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from agentflash.dflash.drafter import DFlashDrafter, DraftContext


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Accept draft tokens while they equal the target's argmax; then the target's token.

    ``draft_tokens`` [T], ``target_logits`` [T+1, V]. Returns ``(num_accepted, bonus_token)``
    with ``0 <= num_accepted <= T``.
    """
    assert target_logits.shape[0] == draft_tokens.shape[0] + 1, (
        "verify yields one more row than there are drafts"
    )
    return accept_choices(draft_tokens.tolist(), target_logits.argmax(-1).tolist())


def accept_choices(draft: Sequence[int], choices: Sequence[int]) -> tuple[int, int]:
    """``greedy_accept`` from the target's choice (argmax) at each verify position: ``draft``
    [T], ``choices`` [T+1] (the engine takes every row's argmaxes in one call)."""
    num_accepted = next((j for j, t in enumerate(draft) if t != choices[j]), len(draft))
    return num_accepted, choices[num_accepted]


def greedy_accept_batch(
    draft_tokens: torch.Tensor, num_drafts: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy_accept`` over rows whose drafts differ in length.

    ``draft_tokens`` [B, T] (row ``b`` uses its first ``num_drafts[b]`` entries), ``num_drafts``
    [B], ``target_logits`` [B, T+1, V] (row ``b`` uses its first ``num_drafts[b] + 1`` rows).
    Returns ``num_accepted`` [B] and ``bonus`` [B].
    """
    b, t = draft_tokens.shape
    target = target_logits.argmax(-1)  # [B, T+1]
    in_draft = torch.arange(t, device=draft_tokens.device)[None] < num_drafts[:, None]  # [B, T]
    matches = ((draft_tokens == target[:, :t]) & in_draft).int()
    num_accepted = matches.cumprod(1).sum(1)  # [B]
    bonus = target.gather(1, num_accepted[:, None])[:, 0]  # [B]
    return num_accepted, bonus


def sample_accept(
    draft_tokens: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator | None,
    dead: list[bool] | None = None,
) -> tuple[int, int]:
    """Lossless acceptance of a one-hot proposal under sampling.

    ``draft_tokens`` [T]; ``target_probs`` [T+1, V]: the target's sampling distribution at every
    verify position (temperature and top-p applied, each row summing to 1). Position ``i`` draws
    the target's own token from row ``i`` with ``generator``; the draft token stands only if the
    draw equals it, and the first draw that differs is the bonus. Each committed token is thus one
    draw from the target's distribution given the committed prefix, taken in the same order and
    with the same ``torch.multinomial`` call as plain decoding, so a seeded request commits the
    same tokens in both modes (up to floating-point differences between a block forward and
    one-token forwards). Returns ``(num_accepted, bonus_token)``. ``dead``: the rows a
    grammar's mask left no token in, where a draw that reaches one raises ``GrammarFailed``.
    """
    t = draft_tokens.shape[0]
    assert target_probs.shape[0] == t + 1, "verify yields one more row than there are drafts"
    for i in range(t + 1):
        if dead is not None and dead[i]:
            from agentflash.grammar.constraint import NO_LEGAL_TOKEN, GrammarFailed

            raise GrammarFailed(NO_LEGAL_TOKEN)
        token = int(torch.multinomial(target_probs[i], 1, generator=generator))
        if i == t or token != int(draft_tokens[i]):
            return i, token
    raise AssertionError("unreachable: the last position always returns")


def draft_logits(
    drafter: DFlashDrafter,
    embed: Callable[[torch.Tensor], torch.Tensor],
    logits: Callable[[torch.Tensor], torch.Tensor],
    last_tokens: torch.Tensor,
    contexts: list[DraftContext],
    block_size: int | None = None,
    num_slots: int | None = None,
    pending: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """The drafter's logits [B, num_slots, V] for slots 1..num_slots of one block per request
    (all of them, block_size - 1, by default: the block is drafted whole either way, but the
    logits of slots nobody verifies are not worth their product with the vocabulary).

    ``embed`` and ``logits`` are the target's (``Qwen3Model.embed`` and ``Qwen3Model.logits``);
    ``last_tokens`` [B] are the requests' last committed tokens, whose positions are the lengths
    of their contexts (the context holds the target's hidden states of every earlier position),
    or, with ``pending`` (``DFlashDrafter.draft_forward``: hidden states the contexts take in
    first), those lengths plus the pending positions.
    """
    size = block_size or drafter.cfg.block_size
    assert size >= 2, "a block drafts at least one token"
    num_slots = size - 1 if num_slots is None else num_slots
    assert 1 <= num_slots < size, f"{num_slots} slots of a block of {size}"
    b = last_tokens.shape[0]
    device = drafter.fc.weight.device
    ids = torch.full((b, size), drafter.cfg.mask_token_id, dtype=torch.long, device=device)
    ids[:, 0] = last_tokens
    waiting = [0] * b if pending is None else [0 if p is None else p.shape[0] for p in pending]
    starts = torch.tensor([c.length + n for c, n in zip(contexts, waiting, strict=True)],
                          device=device)
    positions = starts[:, None] + torch.arange(size, device=device)  # [B, size]
    with torch.no_grad():
        hidden = drafter.draft_forward(embed(ids), positions, contexts, pending)  # [B, size, H]
        return logits(hidden[:, 1 : 1 + num_slots])  # [B, num_slots, V]


def draft_block(
    drafter: DFlashDrafter,
    embed: Callable[[torch.Tensor], torch.Tensor],
    logits: Callable[[torch.Tensor], torch.Tensor],
    last_tokens: torch.Tensor,
    contexts: list[DraftContext],
    block_size: int | None = None,
) -> torch.Tensor:
    """Greedy draft tokens [B, block_size-1] for one block per request (see ``draft_logits``)."""
    return draft_logits(drafter, embed, logits, last_tokens, contexts, block_size).argmax(-1)


def lookup_draft(
    tokens: list[int], num: int, ngrams: tuple[int, ...] = (3, 2), window: int = 1024
) -> list[int]:
    """Draft by looking the text up in itself: the ``num`` tokens that followed the latest
    earlier occurrence of its last ``n`` tokens (the longest ``n`` of ``ngrams`` that occurs),
    within the last ``window`` tokens; [] if none does.

    The drafter has never seen a model repeat itself; looking up the text catches what it
    cannot: a loop of the same value, a key list written again, a line copied. A match that
    runs into the end of the text goes on as the loop it is.
    """
    seq = np.asarray(tokens[-window:])
    length = len(seq)
    for n in ngrams:
        if length <= n:
            continue
        suffix = seq[length - n :]
        match = np.ones(length - n, dtype=bool)  # start s: s + n <= length - 1, before the end
        for j in range(n):
            match &= seq[j : length - n + j] == suffix[j]
        starts = np.flatnonzero(match)
        if starts.size:
            # what followed, copied on past the end where the match runs into it (a loop of
            # period p repeats: token i of the draft is token i - p of the text so far)
            out = seq[int(starts[-1]) + n :].tolist()[:num]
            period = length - (int(starts[-1]) + n)
            while len(out) < num:
                out.append(out[len(out) - period])
            return out
    return []
