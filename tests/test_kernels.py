"""The Triton kernels against their torch references, on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, set in conftest.py where no GPU is present), and against the grammar
layer's CPU paths that the engine takes off the GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from agentflash.grammar.constraint import _masked_argmax, apply_bitmask_  # noqa: E402
from agentflash.kernels.masked_argmax import masked_argmax, masked_argmax_reference  # noqa: E402
from agentflash.kernels.token_bitmask import (  # noqa: E402
    apply_token_bitmask_,
    apply_token_bitmask_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCABS = [1, 31, 32, 33, 1000, 1024, 1025, 4096, 5000]


def _random_bitmask(rows: int, vocab: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """[rows, W] int32 words with each token's bit set with probability ``density`` (bit 31
    included: negative words), and the padding bits past ``vocab`` set too, as garbage."""
    words = (vocab + 31) // 32
    bits = torch.rand(rows, words * 32, generator=gen) < density
    packed = np.packbits(bits.numpy(), axis=-1, bitorder="little").view(np.int32)
    return torch.from_numpy(packed.copy()).to(DEVICE)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("density", [0.0, 0.02, 0.5, 1.0])
def test_apply_token_bitmask_matches_reference(vocab, density):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=gen).to(DEVICE)
    mask = _random_bitmask(3, vocab, density, gen)
    out = apply_token_bitmask_(logits.clone(), mask)
    expected = apply_token_bitmask_reference(logits.clone(), mask)
    assert torch.equal(out, expected)
    assert torch.equal(out.cpu(), apply_bitmask_(logits.clone().cpu(), mask.cpu()))
    allowed = torch.isfinite(out)
    assert allowed.sum() == round(float(allowed.numel() * density)) or 0 < density < 1


def test_apply_token_bitmask_on_rows_of_a_verify_block():
    """The engine masks the first positions of one row of [B, T, V] verify logits, in place,
    with one mask per position, and a single mask broadcast over positions."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 300, generator=gen).to(DEVICE)
    masks = _random_bitmask(3, 300, 0.3, gen)
    expected = logits.clone()
    apply_token_bitmask_reference(expected[1, :3], masks)
    apply_token_bitmask_(logits[1, :3], masks)
    assert torch.equal(logits, expected)  # row 0 and the positions after 3 untouched
    one = masks[0]
    apply_token_bitmask_reference(expected[0], one)
    apply_token_bitmask_(logits[0], one)
    assert torch.equal(logits, expected)
    # rows that are not one even stride (the first 3 positions of both rows), and words that
    # are not contiguous: the same as the reference
    words = _random_bitmask(2 * 3, 300, 0.3, gen).view(2, 3, -1)
    odd = words.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert odd.stride(-1) != 1 or odd.stride(0) != words.stride(0)
    apply_token_bitmask_reference(expected[:, :3], words)
    apply_token_bitmask_(logits[:, :3], odd)
    assert torch.equal(logits, expected)
    cols = _random_bitmask(10, 300, 0.4, gen)  # [10, W] read through a transposed view
    bits = cols.t().contiguous().t()
    assert bits.stride(-1) != 1 and torch.equal(bits, cols)
    apply_token_bitmask_reference(expected[1], bits[:5])
    apply_token_bitmask_(logits[1], bits[:5])
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_token_bitmask_keeps_dtype(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 70, generator=gen).to(DEVICE, dtype)
    mask = _random_bitmask(2, 70, 0.5, gen)
    out = apply_token_bitmask_(logits.clone(), mask)
    assert out.dtype == dtype
    assert torch.equal(out, apply_token_bitmask_reference(logits.clone(), mask))


def test_apply_token_bitmask_refuses_bad_input():
    logits = torch.randn(2, 70, device=DEVICE)
    with pytest.raises(ValueError, match="narrower"):
        apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="int32"):
        apply_token_bitmask_(logits, torch.zeros(2, 3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        apply_token_bitmask_(logits.t(), torch.zeros(70, 1, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("density", [0.0, 0.002, 0.3, 1.0])
def test_masked_argmax_matches_reference(vocab, density):
    gen = torch.Generator().manual_seed(7 * vocab)
    logits = torch.randn(4, vocab, generator=gen).to(DEVICE)
    mask = _random_bitmask(4, vocab, density, gen)
    out = masked_argmax(logits, mask)
    assert torch.equal(out, masked_argmax_reference(logits, mask))
    for row in range(4):  # the grammar layer's CPU path (numpy) picks the same tokens
        if int(out[row]) >= 0:
            assert int(out[row]) == _masked_argmax(mask[row].cpu(), logits[row].cpu(), vocab)
        else:
            assert not torch.isfinite(apply_bitmask_(logits[row].cpu().clone(),
                                                     mask[row].cpu())).any()


def test_masked_argmax_ties_and_infinities():
    """The first of equal maxima, across the kernel's blocks too; an allowed -inf logit is
    still the answer when nothing else is allowed; -1 for a row that allows nothing."""
    vocab = 3000
    logits = torch.full((4, vocab), -5.0)
    logits[0, [10, 1500, 2999]] = 7.0  # a tie in three blocks: the first wins
    logits[1, [2048, 2049]] = float("inf")
    logits[2] = float("-inf")
    words = (vocab + 31) // 32
    mask = torch.zeros(4, words, dtype=torch.int32)
    mask[0] = -1  # everything allowed
    mask[1] = -1
    mask[2, 2000 // 32] = 1 << (2000 % 32)  # only token 2000, at -inf
    logits, mask = logits.to(DEVICE), mask.to(DEVICE)
    out = masked_argmax(logits, mask).tolist()
    assert out == [10, 2048, 2000, -1]
    assert out == masked_argmax_reference(logits, mask).tolist()


def test_masked_argmax_takes_the_first_allowed_nan_as_torch_argmax_does():
    # the kernel skipped NaN: another token, and "no legal token" where only the NaN was allowed
    vocab = 3000
    logits = torch.arange(vocab, dtype=torch.float32).repeat(4, 1)
    logits[:, [5, 2500]] = float("nan")
    logits[2, 2999] = float("inf")
    words = (vocab + 31) // 32
    mask = torch.full((4, words), -1, dtype=torch.int32)
    mask[1] = 0
    mask[1, 0] = 1 << 5  # only the NaN
    mask[3, 0] = 0  # the first NaN's block not allowed: the one in a later block
    logits, mask = logits.to(DEVICE), mask.to(DEVICE)
    out = masked_argmax(logits, mask).tolist()
    assert out == [5, 5, 5, 2500]
    assert out == masked_argmax_reference(logits, mask).tolist()
    for row in range(4):
        assert _masked_argmax(mask[row].cpu(), logits[row].cpu(), vocab) == out[row]


def test_masked_argmax_of_reduced_precision_logits():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 2100, generator=gen).to(DEVICE, torch.float16)
    mask = _random_bitmask(3, 2100, 0.1, gen)
    assert torch.equal(masked_argmax(logits, mask), masked_argmax_reference(logits, mask))


def test_masked_argmax_refuses_bad_input():
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        masked_argmax(torch.randn(70, device=DEVICE),
                      torch.zeros(1, 3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="narrower"):
        masked_argmax(torch.randn(1, 70, device=DEVICE),
                      torch.zeros(1, 2, dtype=torch.int32, device=DEVICE))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors stand in for the GPU's")
def test_the_grammar_layer_takes_the_kernels_for_gpu_tensors(monkeypatch):
    """``apply_bitmask_`` and the greedy fallback's masked argmax go to the kernels where
    ``use_kernels`` says so (CUDA tensors; here the interpreter's CPU tensors stand in), and
    give what their CPU paths give."""
    from agentflash.grammar import constraint

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 1100, generator=gen)
    mask = _random_bitmask(3, 1100, 0.05, gen).cpu()
    cpu_masked = apply_bitmask_(logits.clone(), mask)
    cpu_best = [_masked_argmax(mask[i], logits[i], 1100) for i in range(3)]
    calls = []
    monkeypatch.setattr(constraint, "use_kernels", lambda t: calls.append(t.shape) or True)
    assert torch.equal(apply_bitmask_(logits.clone(), mask), cpu_masked)
    assert [_masked_argmax(mask[i], logits[i], 1100) for i in range(3)] == cpu_best
    assert len(calls) == 4
    with pytest.raises(constraint.GrammarFailed, match="no legal token"):
        _masked_argmax(torch.zeros_like(mask[0]), logits[0], 1100)
    # logits whose tokens are not contiguous (a transposed view, one of its columns): as on
    # the CPU (the kernels refused them with a ValueError)
    across = logits.t().contiguous().t()
    assert across.stride(-1) != 1 and torch.equal(across, logits)
    assert torch.equal(apply_bitmask_(across, mask), cpu_masked) and across.stride(-1) != 1
    columns = logits.t().contiguous()
    assert [_masked_argmax(mask[i], columns[:, i], 1100) for i in range(3)] == cpu_best


def test_kernels_are_used_only_where_a_launch_was_seen_to_work():
    """Triton builds its launcher at first use (a C compiler, Python's headers): where it
    cannot, or no driver is there, a warning says so once and the torch path does the work
    (every constrained request failed). Here the interpreter runs them, and without it the
    CPU has no driver."""
    from agentflash.kernels import kernels_run_on

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py, where no GPU is
    assert kernels_run_on(torch.device("cpu")) is interpreted
    code = ("import warnings, torch\n"
            "from agentflash.kernels import kernels_run_on\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    print(kernels_run_on(torch.device('cpu')), kernels_run_on(torch.device('cpu')))\n"
            "print(len(seen), seen[0].category.__name__, seen[0].message)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first == "False False"
    assert second.startswith("1 RuntimeWarning agentflash: the Triton kernels do not run on cpu (")
    assert second.endswith("); the torch path does their work")
