"""Load a Hugging Face causal-LM directory (or the bundled demo) into the engine's decoder."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

from agentflash.errors import UserError, expand_user
from agentflash.models.qwen3 import ModelConfig, Qwen3Model

DEMO_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"


def load_drafter_for(target: Qwen3Model, drafter: str | Path, device: str | torch.device = "cpu"):
    """A DFlash drafter (``demo`` or a directory) checked against the target it will serve."""
    from agentflash.dflash.checkpoint import load_drafter, validate_against_target

    path = drafter_dir(drafter)
    net = load_drafter(path, device=device, dtype=next(target.parameters()).dtype)
    validate_against_target(net.cfg, target.cfg, where=str(path))
    net.validation_tau = read_validation_tau(path)
    return net


def resolve_drafter(model: str | Path, drafter: str | Path | None) -> str | Path | None:
    """The drafter an engine loads for ``drafter``: ``auto`` is the demo drafter for the demo
    model, none otherwise."""
    if drafter != "auto":
        return drafter
    shipped = str(model) == "demo" and (DEMO_DIR / "drafter" / "config.json").exists()
    return "demo" if shipped else None


def drafter_dir(drafter: str | Path) -> Path:
    """``demo`` names the bundled drafter; anything else is a directory path."""
    return DEMO_DIR / "drafter" if str(drafter) == "demo" else expand_user(drafter)


def read_validation_tau(drafter_dir: Path) -> dict[str, float] | None:
    """``val_tau`` of the drafter's ``train_drafter.json`` (written by ``agentflash train
    drafter``), or None when the directory has none (a published z-lab drafter)."""
    path = Path(drafter_dir) / "train_drafter.json"
    if not path.exists():
        return None
    taus = read_json(path, "train_drafter.json").get("val_tau")
    if taus is None:
        return None
    if not isinstance(taus, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1 for v in taus.values()
    ):
        raise UserError(f"{path}: val_tau must map kinds of text to numbers >= 1, got {taus!r}")
    return {str(k): float(v) for k, v in taus.items()}


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """``demo`` names the bundled model; anything else is a directory path."""
    if str(name_or_path) == "demo":
        return DEMO_DIR / "target"
    path = expand_user(name_or_path)
    if not path.exists():
        raise UserError(f"{path}: model directory does not exist")
    if not path.is_dir():
        raise UserError(f"{path}: is not a directory (expected a Hugging Face model directory)")
    return path


def read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.exists():
        raise UserError(f"{path}: missing {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}: malformed JSON in {what}: {err.msg}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: cannot read the {what}: not UTF-8 text") from None
    except OSError as err:  # a directory of that name, no permission
        raise UserError(f"{path}: cannot read the {what}: {err.strerror or err}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: {what} must be a JSON object")
    return data


def load_config(model_dir: Path) -> tuple[ModelConfig, dict[str, Any]]:
    raw = read_json(model_dir / "config.json", "config.json")
    try:
        return ModelConfig.from_hf(raw), raw
    except ValueError as err:
        raise UserError(f"{model_dir / 'config.json'}: {err}") from None


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """Tensors of ``model.safetensors`` or of every shard listed in its index."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        shards = read_json(index, "safetensors index")
        shards = shards.get("weight_map") if isinstance(shards, dict) else None
        if not isinstance(shards, dict) or not all(isinstance(f, str) for f in shards.values()):
            raise UserError(f"{index}: weight_map must map each weight's name to its file")
        files = [model_dir / name for name in sorted(set(shards.values()))]
    else:
        raise UserError(f"{model_dir}: no model.safetensors (or model.safetensors.index.json)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError) as err:
            raise UserError(f"{file}: cannot read safetensors: {err}") from None
    return state


def load_model(
    name_or_path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[Qwen3Model, dict[str, Any], Path]:
    """Build the decoder for a model directory and load its weights."""
    model_dir = resolve_model_dir(name_or_path)
    cfg, raw = load_config(model_dir)
    state = load_state_dict(model_dir)
    if state and not any(k.startswith("model.") for k in state):
        # a base model's save (transformers' Qwen3Model): its keys without the causal LM's
        # ``model.`` prefix, as transformers loads them
        state = {k if k == "lm_head.weight" else f"model.{k}": v for k, v in state.items()}
    # the rotary frequencies older checkpoints stored as buffers: computed from the config, as
    # transformers does
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings and "lm_head.weight" in state:
        embed = state.get("model.embed_tokens.weight")
        if embed is None:  # the one tied matrix saved under the head's name
            state["model.embed_tokens.weight"] = state.pop("lm_head.weight")
        elif embed is not None and not torch.equal(state["lm_head.weight"], embed):
            # transformers 5 does not tie an lm_head the checkpoint holds with other values
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
        else:
            del state["lm_head.weight"]
    # Qwen2 has biases on q, k and v; Llama and Qwen3 none (``check_decoder_fields`` refuses
    # ``attention_bias``), and bias weights there are unexpected, not used
    model = Qwen3Model(cfg, attn_bias=raw.get("model_type") == "qwen2")
    expected = model.state_dict()
    wrong = next((k for k, v in state.items() if k in expected and v.shape != expected[k].shape),
                 None)
    if wrong is not None:
        raise UserError(f"{model_dir}: weight {wrong} has shape {tuple(state[wrong].shape)}, "
                        f"config.json implies {tuple(expected[wrong].shape)}")
    result = model.load_state_dict(state, strict=False)
    missing = [
        k for k in result.missing_keys if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    ]
    if missing or result.unexpected_keys:
        problem = (
            f"missing weights {missing[:3]}"
            if missing
            else f"unexpected weights {result.unexpected_keys[:3]}"
        )
        raise UserError(f"{model_dir}: weights do not match config.json: {problem}")
    if dtype is None:
        dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return model.to(device=device, dtype=dtype).eval(), raw, model_dir


# the tokenizer's JSON files transformers reads, named where one does not parse
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json")


def load_tokenizer(model_dir: Path, vocab_size: int | None = None):
    """The directory's tokenizer; a clear error if it is missing or unreadable, or (given the
    model's ``vocab_size``) if its largest token id is past the model's rows."""
    from transformers import AutoTokenizer

    if (
        not (model_dir / "tokenizer.json").exists()
        and not (model_dir / "tokenizer_config.json").exists()
    ):
        raise UserError(f"{model_dir}: no tokenizer (tokenizer.json or tokenizer_config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as err:  # transformers raises many kinds here; name the directory once
        for name in _TOKENIZER_JSON:  # transformers' message does not say which file
            if (model_dir / name).is_file():
                read_json(model_dir / name, name)  # raises naming the file and line
        raise UserError(f"{model_dir}: cannot load tokenizer: {err}") from None
    if vocab_size is not None:
        # a text would tokenize to an id past the embedding, refused per request as a bad
        # prompt token, though the user wrote text (the largest id, not the count: ids may
        # leave holes)
        top = max(tokenizer.get_vocab().values(), default=-1)
        if top >= vocab_size:
            raise UserError(
                f"{model_dir}: the tokenizer's largest token id is {top}, past config.json's "
                f"vocab_size ({vocab_size}, ids 0..{vocab_size - 1}): text would tokenize to "
                f"ids the model has no row for")
    # the engine checks a prompt's length against its own limit (max_len), with an error
    # naming the request: the tokenizer's warning about it was a second line on stderr
    tokenizer.model_max_length = sys.maxsize
    return tokenizer
