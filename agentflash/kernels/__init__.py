"""Triton kernels for the engine's GPU path, one kernel per file, each beside its torch reference.

The engine calls them through ``agentflash.grammar.constraint`` on CUDA tensors only; on the CPU
the torch and numpy paths stay (the CPU is what this repository benchmarks on). ``triton`` is
imported by the kernel files alone, so ``import agentflash`` and the tests work without it; the
tests run the kernels on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``) against the
references. The repository's top-level ``kernels/`` is this folder.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def has_triton() -> bool:
    """Whether ``triton`` can be imported (it comes with PyTorch's CUDA wheels)."""
    return importlib.util.find_spec("triton") is not None


def use_kernels(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s work goes to a Triton kernel: a CUDA tensor with Triton installed."""
    return tensor.is_cuda and has_triton()
