"""Drafter checkpoints in z-lab's format: layer choice, round trip, reference keys, clear errors."""

import json

import pytest
import torch
from safetensors.torch import save_file

from agentflash.dflash.checkpoint import (
    default_target_layer_ids,
    load_drafter,
    save_drafter,
    validate_against_target,
)
from agentflash.dflash.drafter import DFlashDrafter, DrafterConfig
from agentflash.errors import UserError
from agentflash.models.qwen3 import ModelConfig


def qwen3_8b_dflash_b16_scaled() -> dict:
    """z-lab/Qwen3-8B-DFlash-b16's config.json with the widths scaled down (4096 -> 64)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 16,
        "bos_token_id": 151643,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 192,
        "layer_types": ["full_attention"] * 5,
        "max_position_embeddings": 40960,
        "max_window_layers": 5,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 5,
        "num_key_value_heads": 1,
        "num_target_layers": 36,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def reference_state_dict(hidden=64, inter=192, heads=4, kv=1, head_dim=16, layers=5, k=5):
    """Random tensors under the reference's key names, spelled out here rather than derived."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    state = {
        "fc.weight": rand(hidden, k * hidden),
        "hidden_norm.weight": rand(hidden),
        "norm.weight": rand(hidden),
    }
    for i in range(layers):
        p = f"layers.{i}."
        state.update(
            {
                p + "input_layernorm.weight": rand(hidden),
                p + "post_attention_layernorm.weight": rand(hidden),
                p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": rand(kv * head_dim, hidden),
                p + "self_attn.v_proj.weight": rand(kv * head_dim, hidden),
                p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                p + "self_attn.q_norm.weight": rand(head_dim),
                p + "self_attn.k_norm.weight": rand(head_dim),
                p + "mlp.gate_proj.weight": rand(inter, hidden),
                p + "mlp.up_proj.weight": rand(inter, hidden),
                p + "mlp.down_proj.weight": rand(hidden, inter),
            }
        )
    return state


def write_reference_dir(path, config=None, state=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or qwen3_8b_dflash_b16_scaled()))
    save_file(state if state is not None else reference_state_dict(), path / "model.safetensors")
    return path


def qwen3_8b_target(hidden=64, layers=36, vocab=151936) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=192,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qk_norm=True,
        max_position_embeddings=40960,
    )


@pytest.mark.parametrize(
    "target_layers, draft_layers, expected",
    [
        (36, 5, (1, 9, 17, 25, 33)),  # Qwen3-8B and the b16 drafter
        (36, 1, (18,)),
        (28, 5, (1, 7, 13, 19, 25)),
        (6, 2, (1, 3)),
        (4, 3, (1,)),  # the span holds one layer: read it once
        (1, 2, (0,)),
    ],
)
def test_default_target_layer_ids(target_layers, draft_layers, expected):
    assert default_target_layer_ids(target_layers, draft_layers) == expected


def test_default_target_layer_ids_rejects_empty():
    with pytest.raises(ValueError, match="at least one"):
        default_target_layer_ids(36, 0)


def test_reference_checkpoint_loads(tmp_path):
    state = reference_state_dict()
    drafter = load_drafter(write_reference_dir(tmp_path / "b16", state=state))
    cfg = drafter.cfg
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (64, 5, 4, 1)
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_target_layers) == (16, 151669, 36)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.rope_theta == 1e6
    loaded = drafter.state_dict()
    assert drafter.fc.weight.dtype == torch.float32
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor.float()), name
    assert torch.equal(
        drafter.layers[3].self_attn.k_norm.weight, state["layers.3.self_attn.k_norm.weight"].float()
    )
    validate_against_target(cfg, qwen3_8b_target())
    ctx = drafter.new_context()
    drafter.extend([ctx], [torch.randn(7, 5 * 64)])
    out = drafter.draft_forward(torch.randn(1, 16, 64), (7 + torch.arange(16))[None], [ctx])
    assert out.shape == (1, 16, 64) and torch.isfinite(out).all()


def test_round_trip_keeps_config_and_weights(tmp_path):
    cfg = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        block_size=8,
        mask_token_id=3,
        target_layer_ids=(1, 3),
        num_target_layers=6,
        vocab_size=50,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_()
    save_drafter(drafter, tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["block_size"] == 8 and raw["num_target_layers"] == 6
    assert raw["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 3]}
    assert raw["num_hidden_layers"] == 2 and raw["hidden_size"] == 32 and raw["dtype"] == "float32"
    loaded = load_drafter(tmp_path / "d")
    assert loaded.cfg == cfg
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_bfloat16_round_trip(tmp_path):
    drafter = load_drafter(write_reference_dir(tmp_path / "a")).to(torch.bfloat16)
    save_drafter(drafter, tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"
    again = load_drafter(tmp_path / "b", dtype=torch.bfloat16)
    assert again.fc.weight.dtype == torch.bfloat16
    assert torch.equal(again.fc.weight, drafter.fc.weight)


def _edit(config: dict, changes: dict) -> dict:
    config = json.loads(json.dumps(config))
    for key, value in changes.items():
        if key.startswith("dflash."):
            config["dflash_config"][key[len("dflash.") :]] = value
        elif value is None:
            config.pop(key)
        else:
            config[key] = value
    return config


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "expected \\['DFlashDraftModel'\\]"),
        # a TypeError; a string was read as its letters: "xDFlashDraftModel" passed
        ({"architectures": 5}, "architectures must be a list of strings, got 5"),
        ({"architectures": "xDFlashDraftModel"}, "architectures must be a list of strings"),
        ({"model_type": "llama"}, "model_type"),
        ({"attention_bias": True}, "attention_bias"),
        ({"layer_types": ["sliding_attention"] * 5}, "layer_types"),
        ({"hidden_size": None}, "hidden_size"),
        ({"dflash_config": {"target_layer_ids": [1, 9]}}, "mask_token_id"),
        ({"dflash.target_layer_ids": [1, 9, 40]}, "num_target_layers"),
        ({"dflash.target_layer_ids": [9, 1]}, "increasing"),
        ({"dflash.mask_token_id": 200000}, "vocabulary"),
        ({"dflash.output_multiplier": 2.0}, "output_multiplier"),
        ({"dflash_config": [1]}, "dflash_config must be an object"),
        # read loosely before: "13" as layers [1, 3], 1.5 as 1, true as 1 head
        ({"dflash.target_layer_ids": "13"}, "target_layer_ids must be a list of layer indexes"),
        ({"dflash.target_layer_ids": [1.5, 3]}, "target_layer_ids must be a list of layer"),
        ({"num_attention_heads": True}, "must be a positive integer, got True"),
        # the fields a target's config.json is refused for: a ZeroDivisionError, or a drafter
        # loaded to run another network than its checkpoint's (gelu run as SiLU, theta 0 as
        # 10000)
        ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be a positive"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_theta": 0}, "rope_theta must be a positive number, got 0"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive number, got -1.0"),
        ({"rms_norm_eps": "abc"}, "rms_norm_eps must be a positive number, got 'abc'"),
        # a TypeError from comparing them ("'<=' not supported"), or an AttributeError
        ({"dflash.mask_token_id": "3"}, "mask_token_id must be an integer, got '3'"),
        ({"dflash.mask_token_id": None}, "mask_token_id must be an integer, got None"),
        ({"num_target_layers": "36"}, "num_target_layers must be an integer, got '36'"),
        ({"rope_parameters": [1]}, r"rope_parameters must be an object, got \[1\]"),
        # z-lab's DFlashDraftModel masks the block causally there (it loaded, drafting worse)
        ({"is_causal": True}, "is_causal true .* is not supported"),
    ],
)
def test_bad_config_is_a_user_error_naming_the_file(tmp_path, changes, message):
    path = write_reference_dir(tmp_path / "d", config=_edit(qwen3_8b_dflash_b16_scaled(), changes))
    with pytest.raises(UserError, match=message) as err:
        load_drafter(path)
    assert str(path / "config.json") in str(err.value)


def test_missing_or_malformed_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_drafter(tmp_path / "nowhere")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(UserError, match="a-file: is not a directory"):
        load_drafter(tmp_path / "a-file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="missing drafter config.json"):
        load_drafter(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text('{"architectures": [')
    with pytest.raises(UserError, match="malformed JSON"):
        load_drafter(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(qwen3_8b_dflash_b16_scaled()))
    with pytest.raises(UserError, match="no model.safetensors"):
        load_drafter(tmp_path / "empty")


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda s: s.pop("layers.4.mlp.up_proj.weight"),
            "missing \\['layers.4.mlp.up_proj.weight'\\]",
        ),
        (
            lambda s: s.update({"model.fc.weight": s["fc.weight"].clone()}),
            "unexpected \\['model.fc.weight'\\]",
        ),
        (
            lambda s: s.update({"fc.weight": torch.zeros(64, 3 * 64)}),
            "fc.weight has shape \\[64, 192\\]",
        ),
    ],
)
def test_weights_that_do_not_fit_the_config(tmp_path, edit, message):
    state = reference_state_dict()
    edit(state)
    path = write_reference_dir(tmp_path / "d", state=state)
    with pytest.raises(UserError, match=message) as err:
        load_drafter(path)
    assert str(path) in str(err.value)


def test_validate_against_target_names_the_mismatch(tmp_path):
    cfg = load_drafter(write_reference_dir(tmp_path / "d")).cfg
    with pytest.raises(UserError, match="hidden_size 64 does not match the target's 128"):
        validate_against_target(cfg, qwen3_8b_target(hidden=128), where="my-drafter")
    with pytest.raises(
        UserError, match="my-drafter: trained for a target of 36 layers, this target has 28"
    ):
        validate_against_target(cfg, qwen3_8b_target(layers=28), where="my-drafter")
    unrecorded = DrafterConfig(**{**cfg.__dict__, "num_target_layers": None})
    with pytest.raises(UserError, match="layers \\[33\\] that the target lacks .*0..27"):
        validate_against_target(unrecorded, qwen3_8b_target(layers=28))
    # its mask token inside the drafter's vocabulary is inside the target's too
    with pytest.raises(UserError, match="vocab_size 151936 does not match the target's 4096"):
        validate_against_target(cfg, qwen3_8b_target(vocab=4096))


def test_a_null_max_position_embeddings_takes_its_default(tmp_path):
    # as a target's config.json does (the drafter's positions are the target's): it was refused
    # as "must be a positive integer, got None"
    config = qwen3_8b_dflash_b16_scaled()
    config["max_position_embeddings"] = None  # (_edit drops a field set to None)
    path = write_reference_dir(tmp_path / "d", config=config)
    assert load_drafter(path).cfg.max_position_embeddings == 40960
    path = write_reference_dir(tmp_path / "z", config=_edit(qwen3_8b_dflash_b16_scaled(),
                                                            {"max_position_embeddings": 0}))
    with pytest.raises(UserError, match="max_position_embeddings must be a positive integer"):
        load_drafter(path)
