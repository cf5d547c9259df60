"""The argmax of each row of logits over the tokens a packed bitmask allows.

Greedy decoding under a grammar takes the best legal token where the model's own choice is
illegal (a verify position whose target argmax the grammar forbids; a drafter slot likewise).
On the GPU this kernel returns it without unpacking the mask or masking a copy of the logits:
one program per row scans the vocabulary in blocks and keeps the first of equal maxima, as
``torch.argmax`` does, for which a NaN is above every number (the first NaN wins). A row that
allows no token gets -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentflash.kernels import on_device

BLOCK = 1024  # tokens a program reads at a time


@triton.jit
def _masked_argmax_kernel(
    logits_ptr, bitmask_ptr, out_ptr, vocab_size, logits_stride, bitmask_stride,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    best = tl.full((), float("-inf"), tl.float32)
    best_token = tl.full((), -1, tl.int32)
    best_nan = tl.full((), 0, tl.int32)  # best_token is an allowed NaN: nothing beats it
    for start in range(0, vocab_size, BLOCK):
        tokens = start + tl.arange(0, BLOCK)  # [BLOCK]
        in_vocab = tokens < vocab_size
        words = tl.load(bitmask_ptr + row * bitmask_stride + tokens // 32, mask=in_vocab, other=0)
        allowed = in_vocab & (((words >> (tokens % 32)) & 1) != 0)
        values = tl.load(logits_ptr + row * logits_stride + tokens, mask=allowed,
                         other=float("-inf")).to(tl.float32)
        top = tl.max(values, axis=0)
        # the first allowed token at the block's maximum (-inf included: an allowed token whose
        # logit is -inf is still the answer when nothing else is allowed)
        first = tl.min(tl.where(allowed & (values == top), tokens, vocab_size), axis=0)
        found = first < vocab_size
        # a later block wins only with a strictly greater value: the first maximum stands
        take = found & ((top > best) | (best_token < 0))
        # tl.max skips NaN, and a NaN equals nothing: the block's first allowed NaN, if any
        nan = tl.min(tl.where(allowed & (values != values), tokens, vocab_size), axis=0)
        take_nan = (nan < vocab_size) & (best_nan == 0)
        take = take & (best_nan == 0) & (nan >= vocab_size)
        best_token = tl.where(take_nan, nan, tl.where(take, first, best_token))
        best = tl.where(take, top, best)
        best_nan = tl.where(take_nan, 1, best_nan)
    tl.store(out_ptr + row, best_token)


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The allowed argmax [N] (int32; -1 where nothing is allowed) of ``logits`` [N, V] under
    ``bitmask`` [N, W] (int32, on the logits' device)."""
    _check(logits, bitmask)
    out = torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)
    if logits.shape[0]:
        with on_device(logits.device):
            _masked_argmax_kernel[(logits.shape[0],)](
                logits, bitmask, out, logits.shape[1], logits.stride(0), bitmask.stride(0),
                BLOCK=BLOCK,
            )
    return out


def masked_argmax_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``masked_argmax`` in plain torch."""
    from agentflash.grammar.constraint import unpack_bitmask

    _check(logits, bitmask)
    allowed = unpack_bitmask(bitmask, logits.shape[1])  # [N, V]
    # allowed tokens rank above every disallowed one; among them, the logit decides
    ranked = torch.where(allowed, logits.float(), torch.tensor(float("-inf"), device=logits.device))
    best = ranked.argmax(-1)
    first_allowed = allowed.int().argmax(-1)  # where every allowed logit is -inf
    best = torch.where(ranked.max(-1).values == float("-inf"), first_allowed, best)
    return torch.where(allowed.any(-1), best, -1).int()


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits [N, V] and bitmask [N, W], not {list(logits.shape)} and "
                         f"{list(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise TypeError(f"a token bitmask is int32, not {bitmask.dtype}")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words is narrower than "
                         f"{logits.shape[1]} logits")
    if bitmask.device != logits.device:
        raise ValueError(f"the bitmask is on {bitmask.device}, the logits on {logits.device}")
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("the logits' and the bitmask's last dimensions must be contiguous")
