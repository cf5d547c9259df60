"""Drafter checkpoints in z-lab's format, so that published DFlash drafters load as they are.

A checkpoint directory holds ``config.json``: the usual Qwen3 fields plus
``architectures: ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` and
``dflash_config: {mask_token_id, target_layer_ids}``; and ``model.safetensors`` with unprefixed
keys (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ...).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from agentflash.dflash.drafter import DFlashDrafter, DrafterConfig
from agentflash.errors import UserError, expand_user
from agentflash.models.loading import load_state_dict, read_json
from agentflash.models.qwen3 import (
    ModelConfig,
    architectures,
    check_decoder_fields,
    check_sizes,
    head_dim_field,
    positive_number,
    rope_theta_field,
)

ARCHITECTURE = "DFlashDraftModel"
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Target layers a new drafter reads: evenly spaced from 1 to L-3; one draft layer uses L//2.

    36 target layers and 5 draft layers give (1, 9, 17, 25, 33). Shallow targets, where the span
    holds fewer layers than asked for, get each layer once.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(
            f"need at least one target and one draft layer, got "
            f"{num_target_layers} and {num_draft_layers}"
        )
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start = min(1, num_target_layers - 1)
    end = max(start, num_target_layers - 3)
    step = (end - start) / (num_draft_layers - 1)
    return tuple(sorted({math.floor(start + i * step + 0.5) for i in range(num_draft_layers)}))


# --- config.json ----------------------------------------------------------------------------


def config_to_hf(cfg: DrafterConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The ``config.json`` of a drafter, field for field as z-lab writes it."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "initializer_range": 0.02,
        "dtype": _DTYPES.get(dtype, "float32"),
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
        },
    }


def config_from_hf(raw: dict[str, Any]) -> DrafterConfig:
    """Parse a drafter ``config.json``; ``ValueError`` names the field that is wrong."""
    _check_supported(raw)
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ValueError("dflash_config must be an object")

    def pick(name: str, default: Any = KeyError) -> Any:
        # z-lab reads dflash_config first and falls back to the top level
        if name in dflash:
            return dflash[name]
        if name in raw:
            return raw[name]
        if default is KeyError:
            raise ValueError(f"has no field dflash_config.{name}")
        return default

    try:
        # the fields as a target's are checked: a drafter is a Qwen3 decoder too
        check_sizes(raw, ("hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "vocab_size"))
        check_sizes(raw, ("num_key_value_heads", "head_dim"), optional=True)
        heads = raw["num_attention_heads"]
        return DrafterConfig(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim_field(raw, "qwen3"),
            rope_theta=rope_theta_field(raw),
            rms_norm_eps=positive_number(raw, "rms_norm_eps", 1e-6),
            block_size=pick("block_size", 16),
            mask_token_id=pick("mask_token_id"),
            target_layer_ids=pick("target_layer_ids"),
            num_target_layers=pick("num_target_layers", None),
            vocab_size=raw["vocab_size"],
            max_position_embeddings=(40960 if raw.get("max_position_embeddings") is None
                                     else raw["max_position_embeddings"]),
        )
    except KeyError as err:
        raise ValueError(f"has no field {err.args[0]!r}") from None
    except TypeError as err:
        raise ValueError(f"has a field of the wrong type: {err}") from None


def _check_supported(raw: dict[str, Any]) -> None:
    archs = architectures(raw)
    if ARCHITECTURE not in archs:
        if "DFlash2DraftModel" in archs:
            raise ValueError(
                "architectures is DFlash2DraftModel (candidate selector and "
                "convolutions), which agentflash does not run; use a DFlashDraftModel"
            )
        raise ValueError(f"architectures is {archs!r}, expected [{ARCHITECTURE!r}]")
    if raw.get("model_type", "qwen3") != "qwen3":
        raise ValueError(f"model_type {raw['model_type']!r} is not supported (qwen3)")
    # plain rope and attention, SiLU, no biases: what DFlashDrafter computes
    check_decoder_fields(raw, "qwen3")
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ValueError("dflash_config must be an object")
    for name in ("input_embedding_scale", "output_multiplier"):
        if dflash.get(name) not in (None, 1, 1.0):
            raise ValueError(f"dflash_config.{name} = {dflash[name]!r} is not supported")
    if dflash.get("final_logit_softcapping"):
        raise ValueError("dflash_config.final_logit_softcapping is not supported")
    # z-lab's DFlashDraftModel masks the block causally where is_causal is true; agentflash's
    # drafter attends to the whole block, as the published drafters (is_causal false) do
    if raw.get("is_causal"):
        raise ValueError("is_causal true (a causal mask inside the block) is not supported: "
                         "agentflash's drafter attends to the whole block")


# --- directories ----------------------------------------------------------------------------


def save_drafter(drafter: DFlashDrafter, out_dir: Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``out_dir``; returns ``out_dir``."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = drafter.fc.weight.dtype
    config = config_to_hf(drafter.cfg, dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


def load_drafter_config(path: Path) -> DrafterConfig:
    """The ``DrafterConfig`` of a checkpoint directory; ``UserError`` names file and problem."""
    path = expand_user(path)
    if not path.exists():
        raise UserError(f"{path}: drafter directory does not exist")
    if not path.is_dir():
        raise UserError(f"{path}: is not a directory (expected a DFlash drafter directory)")
    config_path = path / "config.json"
    raw = read_json(config_path, "drafter config.json")
    try:
        return config_from_hf(raw)
    except ValueError as err:
        raise UserError(f"{config_path}: {err}") from None


def load_drafter(
    path: Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DFlashDrafter:
    """Build a drafter from a z-lab-format directory and load its weights."""
    path = expand_user(path)
    cfg = load_drafter_config(path)
    drafter = DFlashDrafter(cfg)
    state = load_state_dict(path)
    _check_state(path, drafter, state)
    drafter.load_state_dict(state)
    if dtype is None:
        dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return drafter.to(device=device, dtype=dtype).eval()


def _check_state(path: Path, drafter: DFlashDrafter, state: dict[str, torch.Tensor]) -> None:
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise UserError(f"{path}: weights do not match config.json: missing {missing[:3]}")
    if unexpected:
        raise UserError(f"{path}: weights do not match config.json: unexpected {unexpected[:3]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise UserError(
                f"{path}: weight {name} has shape {list(tensor.shape)}, config.json "
                f"implies {list(expected[name].shape)}"
            )


def validate_against_target(
    drafter_cfg: DrafterConfig, target_cfg: ModelConfig, where: str = "drafter"
) -> None:
    """``UserError`` when a drafter cannot serve a target; ``where`` names the drafter."""
    if drafter_cfg.hidden_size != target_cfg.hidden_size:
        raise UserError(
            f"{where}: hidden_size {drafter_cfg.hidden_size} does not match the "
            f"target's {target_cfg.hidden_size} (the drafter reads the target's "
            "embeddings and feeds its lm_head)"
        )
    layers = target_cfg.num_layers
    if drafter_cfg.num_target_layers is not None and drafter_cfg.num_target_layers != layers:
        raise UserError(
            f"{where}: trained for a target of {drafter_cfg.num_target_layers} "
            f"layers, this target has {layers}"
        )
    outside = [i for i in drafter_cfg.target_layer_ids if not 0 <= i < layers]
    if outside:
        raise UserError(
            f"{where}: target_layer_ids {list(drafter_cfg.target_layer_ids)} name "
            f"layers {outside} that the target lacks (it has layers 0..{layers - 1})"
        )
    if drafter_cfg.vocab_size != target_cfg.vocab_size:
        raise UserError(
            f"{where}: vocab_size {drafter_cfg.vocab_size} does not match the target's "
            f"{target_cfg.vocab_size} (a drafter is trained on its target's tokenizer)"
        )
