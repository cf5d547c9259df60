"""The engine's decoder against transformers' Qwen3 on tiny random-weight models."""

import pytest
import torch

from agentflash.engine.kv_cache import KVCache
from agentflash.engine.model_runner import ModelRunner, Row
from agentflash.models.loading import load_model


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ours, _, _ = load_model(tiny_model_dir)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return ours, theirs


def runner(model, slots=4, max_len=256):
    return ModelRunner(
        model, KVCache(model.cfg, slots, max_len, torch.device("cpu"), torch.float32)
    )


def test_prefill_logits_match_transformers(pair):
    ours, theirs = pair
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 37))
    expected = theirs(ids).logits[0]
    got = runner(ours).forward([Row(0, 0, ids[0].tolist())]).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_bf16_model_keeps_its_rotary_frequencies_in_float32():
    # Module.to casts buffers: in bf16 the frequencies were 0.4% off, cos 0.36 from
    # transformers' at position 2,000 (which keeps them in float32)
    from transformers import AutoModelForCausalLM

    from agentflash.models.loading import load_drafter_for

    ours, _, model_dir = load_model("demo", dtype=torch.bfloat16)
    exact = load_model("demo")[0].rotary.inv_freq
    drafter = load_drafter_for(ours, "demo")
    copy = drafter.cast_copy(torch.device("cpu"), torch.bfloat16)
    for rotary in (ours.rotary, drafter.rotary, copy.rotary):
        assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, exact)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    positions = torch.arange(2048)[None]
    cos, _ = theirs.model.rotary_emb(torch.zeros(1, dtype=torch.bfloat16), positions)
    got, _ = ours.rotary.cos_sin(positions, torch.bfloat16)
    assert (got[0, 0].float() - cos[0].float()).abs().max() <= 0.01


def test_incremental_and_batched_rows_match_full_forward(pair):
    ours, theirs = pair
    seqs = [torch.randint(0, ours.cfg.vocab_size, (n,)) for n in (23, 9, 40)]
    expected = [theirs(s[None]).logits[0] for s in seqs]
    r = runner(ours)
    # prefill each prompt but its last 5 tokens alone, then feed blocks of different lengths together  # noqa: E501
    for slot, s in enumerate(seqs):
        r.forward([Row(slot, 0, s[:-5].tolist())])
    rows = [
        Row(0, 18, seqs[0][18:].tolist()),
        Row(1, 4, seqs[1][4:6].tolist()),
        Row(2, 35, seqs[2][35:36].tolist()),
    ]
    out = r.forward(rows).logits
    torch.testing.assert_close(out[0, :5], expected[0][18:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1, :2], expected[1][4:6], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[2, :1], expected[2][35:36], atol=1e-4, rtol=1e-4)


def test_captured_hidden_states_are_hf_hidden_states(pair):
    ours, theirs = pair
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 12))
    hf = theirs(ids, output_hidden_states=True).hidden_states
    last = ours.cfg.num_layers - 1  # HF's last hidden state is after the final norm (it was
    # taken before: a drafter reading that layer got features it was not trained on)
    out = runner(ours).forward([Row(0, 0, ids[0].tolist())], capture_layers=(0, 2, last))
    torch.testing.assert_close(out.hidden[0], torch.cat([hf[1], hf[3], hf[last + 1]], dim=-1)[0],
                               atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_a_projection_on_onednn_reads_its_weight_reordered_once_and_again_after_it_changes():
    from agentflash.models.qwen3 import Linear, reordered_bytes

    torch.manual_seed(0)
    linear = Linear(64, 96, bias=False)
    with torch.no_grad():  # stored column-major, as the exact path stores it
        linear.weight.set_(linear.weight.t().contiguous().t())
    linear.onednn, linear.row_multiple = True, 4
    x = torch.randn(7, 64)
    with torch.inference_mode():
        for n in (1, 4, 7):  # bitwise what oneDNN gives from the weight as stored
            rows = torch.nn.functional.pad(x[:n], (0, 0, 0, -n % 4))
            stored = torch.ops.mkldnn._linear_pointwise(rows, linear.weight, None, "none", [], "")
            assert torch.equal(linear(x[:n]), stored[:n])
        first = linear._onednn_weight()
        assert linear._onednn_weight() is first  # reordered once
        assert reordered_bytes(linear) == 64 * 96 * 4
    with torch.no_grad():
        linear.weight.mul_(2.0)  # a new version of the weight: reordered again
    with torch.inference_mode():
        assert linear._onednn_weight() is not first
        assert torch.allclose(linear(x), 2.0 * torch.nn.functional.linear(x, linear.weight / 2.0),
                              atol=1e-4)
