"""Loading Hugging Face directories: real configs with random weights, and clear errors."""

import json
import shutil

import pytest
import torch

from agentflash.engine.kv_cache import KVCache
from agentflash.engine.model_runner import ModelRunner, Row
from agentflash.errors import UserError
from agentflash.models.loading import load_model, load_tokenizer

# Qwen/Qwen3-0.6B's config.json, with the sizes cut down so that random weights stay tiny.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def _tiny_qwen3(tmp_path, **change):
    """A random-weight Qwen3 saved by transformers, and its tensors to edit."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = dict(QWEN3_0_6B, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=2048)
    Qwen3ForCausalLM(Qwen3Config(**{**cfg, **change})).save_pretrained(tmp_path)
    return load_file(tmp_path / "model.safetensors")


def _same_logits_as_transformers(path):
    from transformers import AutoModelForCausalLM

    ours, _, _ = load_model(path)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 2048, (1, 12))
    runner = ModelRunner(ours, KVCache(ours.cfg, 1, 64, torch.device("cpu"), torch.float32))
    got = runner.forward([Row(0, 0, ids[0].tolist())]).logits
    torch.testing.assert_close(got, theirs(ids).logits, atol=1e-4, rtol=1e-4)
    return ours


def test_random_weight_model_from_a_real_qwen3_config(tmp_path):
    _tiny_qwen3(tmp_path)
    ours = _same_logits_as_transformers(tmp_path)
    assert ours.cfg.rope_theta == 1e6 and ours.cfg.qk_norm and ours.cfg.head_dim == 32


def test_missing_directory(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_malformed_config(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text('{"model_type": "qwen3",\n  "hidden_size": }')
    with pytest.raises(UserError, match=r"config.json:2: malformed JSON"):
        load_model(tmp_path / "m")
    # bytes that are not text, a directory of the name: a traceback each
    (tmp_path / "m" / "config.json").write_bytes(b'\xff{}')
    with pytest.raises(UserError, match=r"config.json: cannot read the config.json: not UTF-8"):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    (tmp_path / "m" / "config.json").mkdir()
    with pytest.raises(UserError, match=r"config.json: cannot read the config.json: Is a dir"):
        load_model(tmp_path / "m")


def test_config_missing_a_field_and_unsupported_type(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="no field 'hidden_size'"):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2")))
    with pytest.raises(UserError, match="'gpt2' is not supported"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("change, message", [
    (dict(vocab_size="abc"), "vocab_size must be a positive integer, got 'abc'"),
    (dict(num_attention_heads=0), "num_attention_heads must be a positive integer, got 0"),
    (dict(num_attention_heads=None), "num_attention_heads must be a positive integer, got None"),
    (dict(num_key_value_heads=3),
     "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (dict(max_position_embeddings=1), "max_position_embeddings must be at least 2"),
    # these were read loosely: "false" tied the lm_head, a string or 0 slipped through
    (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false, got 'false'"),
    (dict(rms_norm_eps="1e-6"), "rms_norm_eps must be a positive number, got '1e-6'"),
    (dict(rope_theta=0, rope_parameters=None), "rope_theta must be a positive number, got 0"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}),
     r"rope_parameters.rope_theta must be a positive number, got -1.0"),
    # an AttributeError, or blamed on the tokenizer (transformers reads config.json there)
    (dict(rope_parameters=["x"]), r"rope_parameters must be an object, got \['x'\]"),
    (dict(rope_scaling="linear"), "rope_scaling must be an object, got 'linear'"),
    (dict(layer_types="full_attention"), "layer_types must be a list of strings"),
    (dict(layer_types=["full_attention"]), "layer_types has 1 entries, num_hidden_layers is 4"),
    (dict(architectures=5), "architectures must be a list of strings, got 5"),  # a TypeError
])
def test_config_sizes_are_checked_before_any_tensor_is_built(tiny_model_dir, tmp_path, change,
                                                              message):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(UserError, match=f"config.json: {message}"):
        load_model(tmp_path / "m")


def test_missing_weights_and_weights_that_do_not_fit(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no model.safetensors"):
        load_model(tmp_path / "m")
    shutil.copy(tiny_model_dir / "model.safetensors", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        dict(cfg, num_hidden_layers=5, layer_types=["full_attention"] * 5)))
    with pytest.raises(UserError, match="weights do not match"):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(cfg, vocab_size=100)))
    with pytest.raises(UserError, match=r"weight model.embed_tokens.weight has shape \(\d+, "
                                        r"\d+\), config.json implies \(100, "):
        load_model(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="cannot read safetensors"):
        load_model(tmp_path / "m")


def test_a_null_field_takes_its_default_and_a_bad_shard_index_is_named(tiny_model_dir,
                                                                        tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(cfg,
                                                                max_position_embeddings=None)))
    model, _, _ = load_model(tmp_path / "m")  # a TypeError from comparing None, before
    assert model.cfg.max_position_embeddings == 4096
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "shard.safetensors")
    for index in ({"weight_map": [1, 2]}, {"weight_map": {"a": 1}}, {"metadata": {}}):
        (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(UserError, match=r"model.safetensors.index.json: weight_map must "
                                            r"map each weight's name to its file"):
            load_model(tmp_path / "m")


def test_checkpoints_transformers_loads_compute_what_it_computes(tmp_path):
    from safetensors.torch import save_file

    # older checkpoints keep the rotary frequencies as buffers (refused as unexpected weights)
    state = _tiny_qwen3(tmp_path / "a")
    state.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(16)
                  for i in range(2)})
    save_file(state, tmp_path / "a" / "model.safetensors", metadata={"format": "pt"})
    _same_logits_as_transformers(tmp_path / "a")
    # tie_word_embeddings true, and an lm_head with its own values: transformers 5 does not tie
    # them (the engine used the embeddings)
    state = _tiny_qwen3(tmp_path / "b")
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, tmp_path / "b" / "model.safetensors", metadata={"format": "pt"})
    _same_logits_as_transformers(tmp_path / "b")
    # Qwen3 without head_dim: Qwen3Config's 128, not hidden_size / heads (refused for shapes)
    _tiny_qwen3(tmp_path / "c", head_dim=128)
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    del cfg["head_dim"]
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    _same_logits_as_transformers(tmp_path / "c")
    # a base model's keys, without the causal LM's "model." prefix (missing weights, before)
    state = _tiny_qwen3(tmp_path / "d")
    bare = {k.removeprefix("model."): v for k, v in state.items() if k != "lm_head.weight"}
    save_file(bare, tmp_path / "d" / "model.safetensors", metadata={"format": "pt"})
    _same_logits_as_transformers(tmp_path / "d")
    # tied, and the one matrix saved as lm_head.weight (it was dropped as the tied copy)
    state = _tiny_qwen3(tmp_path / "e")
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, tmp_path / "e" / "model.safetensors", metadata={"format": "pt"})
    _same_logits_as_transformers(tmp_path / "e")
    # use_sliding_window with every layer below max_window_layers: full attention in
    # transformers (its layer_types say so), refused on the flag before
    for kind in ("Qwen3Config", "Qwen2Config"):
        import transformers
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        path = tmp_path / f"slide_{kind}"
        config = getattr(transformers, kind)(**SMALL, use_sliding_window=True, sliding_window=4,
                                              max_window_layers=2)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        _same_logits_as_transformers(path)  # 12 tokens: past the window of 4
        cfg = json.loads((path / "config.json").read_text())
        del cfg["layer_types"]  # a config older than layer_types: decided as transformers does
        (path / "config.json").write_text(json.dumps(cfg))
        _same_logits_as_transformers(path)
        cfg["max_window_layers"] = 1  # layer 1 slides
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(UserError, match=r"use_sliding_window true with sliding_window 4: "
                                            r"layers from max_window_layers 1 on \(of 2\) are "
                                            r"sliding-window attention"):
            load_model(path)
        del cfg["sliding_window"]  # absent: transformers' default window, 4096
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(UserError, match="use_sliding_window true with sliding_window 4096"):
            load_model(path)
    # Llama reads none of those fields: full attention, as transformers computes it
    path = tmp_path / "slide_llama"
    config = transformers.LlamaConfig(**SMALL, use_sliding_window=True, sliding_window=4,
                                      max_window_layers=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    _same_logits_as_transformers(path)


def test_bias_weights_a_config_does_not_declare_are_refused(tmp_path):
    from safetensors.torch import save_file

    # transformers ignores them; the engine added them to the projections and wrote other text
    state = _tiny_qwen3(tmp_path)
    for i in range(2):
        for proj in ("q", "k", "v"):
            rows = state[f"model.layers.{i}.self_attn.{proj}_proj.weight"].shape[0]
            state[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.randn(rows)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"unexpected weights \['model.layers.0.self_attn.q_proj"):
        load_model(tmp_path)


def test_missing_tokenizer(tmp_path):
    with pytest.raises(UserError, match="no tokenizer"):
        load_tokenizer(tmp_path)


def test_a_malformed_tokenizer_file_is_named_with_its_line(tiny_model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copytree(tiny_model_dir, tmp_path / name)
        (tmp_path / name / name).write_text('{\n  "version": "1.0",\n  oops\n}')
        with pytest.raises(UserError, match=rf"{name}:3: malformed JSON in {name}"):
            load_tokenizer(tmp_path / name)


def test_a_tokenizer_with_more_tokens_than_the_model_has_rows_is_refused(tiny_model_dir,
                                                                          tmp_path):
    from agentflash.engine.engine import Engine

    _tiny_qwen3(tmp_path)  # 2048 rows; the demo tokenizer beside it has 4096 tokens
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, tmp_path / name)
    with pytest.raises(UserError, match=r"the tokenizer's largest token id is 4095, past "
                                        r"config.json's vocab_size \(2048, ids 0..2047\)"):
        Engine.from_pretrained(tmp_path, drafter=None)
    assert len(load_tokenizer(tmp_path)) == 4096  # without the model's size: no check
    # the largest id, not the count: a token moved past the rows leaves a hole below
    holed = tmp_path / "holed"
    shutil.copytree(tiny_model_dir, holed)
    spec = json.loads((holed / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    moved = next(t for t, i in vocab.items() if i == 4000)
    vocab[moved] = 4500
    (holed / "tokenizer.json").write_text(json.dumps(spec))
    assert len(load_tokenizer(holed)) == 4096
    with pytest.raises(UserError, match=r"largest token id is 4500, past config.json's "
                                        r"vocab_size \(4096"):
        load_tokenizer(holed, 4096)


SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2048)


@pytest.mark.parametrize("make, message", [
    (lambda t: t.Qwen3Config(**SMALL, rope_scaling={"rope_type": "linear", "factor": 4.0}),
     r"rope_parameters .*'linear'.* is not supported \(plain rope only\)"),
    (lambda t: t.LlamaConfig(**SMALL, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                    "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64}),
     r"rope_parameters .*'llama3'.* is not supported \(plain rope only\)"),
    (lambda t: t.Qwen3Config(**SMALL, use_sliding_window=True, sliding_window=4,
                             max_window_layers=0),
     "sliding-window attention"),
    (lambda t: t.Qwen3Config(**SMALL, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda t: t.LlamaConfig(**SMALL, attention_bias=True), "attention_bias is true"),
    (lambda t: t.LlamaConfig(**SMALL, mlp_bias=True), "mlp_bias is true"),
])
def test_configs_whose_model_this_decoder_would_compute_wrongly_are_refused(tmp_path, make,
                                                                          message):
    import transformers

    make(transformers).save_pretrained(tmp_path)  # as transformers writes config.json today
    with pytest.raises(UserError, match=message):
        load_model(tmp_path)


def test_a_drafter_given_as_the_model_is_named(tmp_path):
    from agentflash.models.loading import DEMO_DIR

    with pytest.raises(UserError, match=r"this is a DFlash drafter .* \(--drafter DIR; to "
                                        r"train drafter, --init DIR\)"):
        load_model(DEMO_DIR / "drafter")


def test_a_bad_drafter_is_named_before_the_target_loads(tmp_path, monkeypatch):
    # a real target takes minutes to load: its drafter's path was checked after it
    import agentflash.models.loading as loading
    from agentflash.engine.engine import Engine

    def no_loading(*_, **__):
        raise AssertionError("the target was loaded before the drafter was checked")

    monkeypatch.setattr(loading, "load_model", no_loading)
    with pytest.raises(UserError, match="nowhere: drafter directory does not exist"):
        Engine.from_pretrained("demo", drafter=tmp_path / "nowhere")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    with pytest.raises(UserError, match="expected \\['DFlashDraftModel'\\]"):
        Engine.from_pretrained("demo", drafter=tmp_path / "d")


def test_the_eos_ids_of_generation_config_end_the_reply(tiny_model_dir, tmp_path):
    from agentflash.engine.engine import Engine, EngineConfig
    from agentflash.engine.request import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0)
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_len=128), drafter=None)
    ids = engine.chat_prompt([{"role": "user", "content": "hello"}])
    free = engine.generate(ids, params).token_ids
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    ends = free[2]  # a token the model writes: as a second eos (Llama 3's <|eom_id|>, say)
    (tmp_path / "m" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [engine.tokenizer.eos_token_id, ends]}))
    again = Engine.from_pretrained(tmp_path / "m", EngineConfig(max_len=128), drafter=None)
    result = again.generate(ids, params)
    assert result.token_ids == free[: free.index(ends) + 1] and result.finish_reason == "stop"
