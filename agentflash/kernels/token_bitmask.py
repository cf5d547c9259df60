"""Mask logits in place with a packed token bitmask: ``-inf`` where a token is not allowed.

A grammar's mask over V tokens is W = ceil(V / 32) int32 words per row, token ``t`` allowed when
bit ``t % 32`` of word ``t // 32`` is set (llguidance's and XGrammar's layout). Grammar-constrained
verification masks every verify position of a draft; on the GPU this kernel reads the packed words
directly instead of unpacking them into a [rows, V] bool tensor first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentflash.kernels import on_device

BLOCK = 1024  # tokens per program


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr, bitmask_ptr, vocab_size, logits_stride, bitmask_stride, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    in_vocab = tokens < vocab_size
    words = tl.load(bitmask_ptr + row * bitmask_stride + tokens // 32, mask=in_vocab, other=0)
    allowed = ((words >> (tokens % 32)) & 1) != 0
    tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits [..., V] of tokens that ``bitmask`` [..., W] (int32, the same leading
    shape or broadcastable to it, on the logits' device) does not allow to ``-inf``, in place;
    returns ``logits``."""
    vocab_size = logits.shape[-1]
    _check(logits, bitmask)
    rows = logits.reshape(-1, vocab_size)  # [N, V]: a copy where the rows are not evenly strided
    masks = bitmask.expand(*logits.shape[:-1], bitmask.shape[-1])
    masks = masks.reshape(-1, bitmask.shape[-1]).contiguous()  # [N, W]
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(vocab_size, BLOCK))
        with on_device(logits.device):
            _apply_token_bitmask_kernel[grid](
                rows, masks, vocab_size, rows.stride(0), masks.stride(0), BLOCK=BLOCK
            )
        if rows.data_ptr() != logits.data_ptr():  # reshape copied: the copy was masked
            logits.copy_(rows.view(logits.shape))
    return logits


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``apply_token_bitmask_`` in plain torch, in place."""
    from agentflash.grammar.constraint import unpack_bitmask

    _check(logits, bitmask)
    allowed = unpack_bitmask(bitmask, logits.shape[-1])  # [..., V]
    return logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if bitmask.dtype != torch.int32:
        raise TypeError(f"a token bitmask is int32, not {bitmask.dtype}")
    if bitmask.shape[-1] * 32 < logits.shape[-1]:
        raise ValueError(f"a bitmask of {bitmask.shape[-1]} words is narrower than "
                         f"{logits.shape[-1]} logits")
    if bitmask.device != logits.device:
        raise ValueError(f"the bitmask is on {bitmask.device}, the logits on {logits.device}")
    if logits.stride(-1) != 1:
        raise ValueError("the logits' last dimension must be contiguous")
