"""The bundled demo model: it loads by name, writes tool calls for tools it never saw, and its
drafter speeds decoding without changing a token."""

import pytest

from agentflash.bench import held_out_prompts
from agentflash.engine.engine import Engine
from agentflash.engine.request import SamplingParams
from agentflash.models.loading import DEMO_DIR
from agentflash.tool_format import parse_tool_calls


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained("demo")


def test_demo_loads_by_name_with_its_tokenizer_and_template(engine):
    assert engine.model_dir == DEMO_DIR / "target"
    assert engine.tokenizer.chat_template
    assert sum(p.numel() for p in engine.model.parameters()) < 30e6


def test_demo_writes_valid_calls_to_held_out_tools(engine):
    prompts = held_out_prompts("tool_call", 12)
    valid = 0
    for p in prompts:
        res = engine.generate(
            engine.chat_prompt(p.messages, p.tools), SamplingParams(max_tokens=160)
        )
        calls, bad = parse_tool_calls(res.text)
        names = {t["function"]["name"] for t in p.tools}
        valid += bool(calls) and not bad and all(c.name in names for c in calls)
    assert valid >= 9  # measured: see `agentflash eval-tool-calls`


@pytest.mark.skipif(not (DEMO_DIR / "drafter" / "config.json").exists(), reason="no demo drafter")
def test_demo_drafter_is_lossless_and_accepts_blocks_on_tool_calls(engine):
    assert engine.drafter is not None
    taus = []
    for p in held_out_prompts("tool_call", 4) + held_out_prompts("prose", 2):
        ids = engine.chat_prompt(p.messages, p.tools)
        plain = engine.generate(ids, SamplingParams(max_tokens=96, speculation="off"))
        spec = engine.generate(ids, SamplingParams(max_tokens=96, speculation="dflash"))
        assert spec.token_ids == plain.token_ids
        if p.kind == "tool_call":
            taus.append(spec.stats["tau"])
    assert sum(taus) / len(taus) > 2.0


@pytest.mark.skipif(not (DEMO_DIR / "drafter" / "config.json").exists(), reason="no demo drafter")
def test_the_drafter_follows_the_targets_kernels_and_drafts_losslessly_on_either(engine):
    """The drafter's fused projections run on oneDNN's matmul where the target's exact path
    does, its projections of a shape the target runs on MKL's on MKL's
    (``DFlashDrafter.use_onednn_``), and dflash output is plain output on either kernel."""
    products = engine.runner.products
    onednn = products is not None and products.onednn
    layers = engine.drafter.layers
    fused = [p for layer in layers for p in (layer.self_attn._fused, layer.mlp._fused)]
    assert fused and all(p.onednn == (products.on_onednn(p) if products else False)
                         for p in fused)
    p = held_out_prompts("tool_call", 1)[0]
    ids = engine.chat_prompt(p.messages, p.tools)
    plain = engine.generate(ids, SamplingParams(max_tokens=64, speculation="off")).token_ids
    try:
        for kernel in (True, False):
            engine.drafter.use_onednn_(kernel)
            spec = engine.generate(ids, SamplingParams(max_tokens=64, speculation="dflash"))
            assert spec.token_ids == plain and spec.stats["tau"] > 1.5
    finally:
        engine.drafter.use_onednn_(onednn, products.mkl_shapes if products else frozenset())
