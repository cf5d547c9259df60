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
    out = runner(ours).forward([Row(0, 0, ids[0].tolist())], capture_layers=(0, 2))
    torch.testing.assert_close(out.hidden[0], torch.cat([hf[1], hf[3]], dim=-1)[0], atol=1e-4,
                               rtol=1e-4)
