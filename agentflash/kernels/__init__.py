"""Triton kernels for the engine's GPU path, one kernel per file, each beside its torch reference.

The engine calls them through ``agentflash.grammar.constraint`` on CUDA tensors only; on the CPU
the torch and numpy paths stay (the CPU is what this repository benchmarks on). ``triton`` is
imported by the kernel files alone, so ``import agentflash`` and the tests work without it; the
tests run the kernels on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``) against the
references. The repository's top-level ``kernels/`` is this folder.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import warnings

import torch


@functools.cache
def has_triton() -> bool:
    """Whether the ``triton`` package is installed (it comes with PyTorch's CUDA wheels)."""
    return importlib.util.find_spec("triton") is not None


def use_kernels(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s work goes to a Triton kernel: a CUDA tensor of some logits, on a
    device where the kernels were seen to run."""
    return (tensor.is_cuda and tensor.dim() > 0 and tensor.shape[-1] > 0
            and kernels_run_on(tensor.device))


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Where a kernel launches for tensors on ``device``: Triton launches on the current CUDA
    device, not the tensors' (on ``cuda:1`` its launcher refused the pointers)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def kernels_run_on(device: torch.device) -> bool:
    """Whether the kernels run on ``device``, tried once a device: ``triton`` installed, its
    launcher built (at first use, with a C compiler and Python's headers, which slim images
    lack) and a small case right. Where they do not, a warning says why, once, and the torch
    path does their work (every constrained request failed instead)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _tried(device)


@functools.cache
def _tried(device: torch.device) -> bool:
    if not has_triton():
        return False
    try:
        from agentflash.kernels.masked_argmax import masked_argmax
        from agentflash.kernels.token_bitmask import apply_token_bitmask_

        logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]], device=device)
        bitmask = torch.tensor([[0b1101]], dtype=torch.int32, device=device)  # not token 1
        best = masked_argmax(logits, bitmask).tolist()
        masked = apply_token_bitmask_(logits.clone(), bitmask).tolist()
        if best != [3] or masked != [[0.0, float("-inf"), 1.0, 2.0]]:
            raise RuntimeError(f"a small case gave {best} and {masked}")
    except Exception as err:  # noqa: BLE001 (whatever the launch raised: the torch path works)
        warnings.warn(f"agentflash: the Triton kernels do not run on {device} "
                      f"({type(err).__name__}: {err}); the torch path does their work",
                      RuntimeWarning, stacklevel=3)
        return False
    return True
