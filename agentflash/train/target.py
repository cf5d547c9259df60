"""Train the demo target: a small Qwen3 (transformers config) on the synthetic agent corpus.

One command reproduces the shipped model: ``agentflash train target --out DIR``. Checkpoints are
written every ``save_every`` steps and a run resumes from the newest one in ``DIR/checkpoints``.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from agentflash.errors import UserError
from agentflash.train import corpus as corpus_mod
from agentflash.train import tokenizer as tokenizer_mod
from agentflash.train.runs import check_settings, make_out_dir, open_log, run_settings, writing


@dataclass(frozen=True)
class TargetTrainConfig:
    """Model shape and optimisation settings of the demo target."""

    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    vocab_size: int = 4096
    seq_len: int = 1024
    batch_size: int = 4
    steps: int = 1400
    lr: float = 2e-3
    warmup_steps: int = 60
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    save_every: int = 100
    seed: int = 0


def qwen3_config(cfg: TargetTrainConfig, tokenizer):  # -> transformers.Qwen3Config
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids(tokenizer_mod.EOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(tokenizer_mod.IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(tokenizer_mod.EOS),
    )


def build_tokenizer(out_dir: Path, convos: list[dict], vocab_size: int) -> None:
    texts = (tokenizer_mod.render(c["messages"], c["tools"]) for c in convos)
    tokenizer_mod.train_tokenizer(texts, out_dir, vocab_size=vocab_size)


def _saved_tokenizer(out_dir: Path):  # -> PreTrainedTokenizerFast | None
    """The tokenizer an earlier run of ``out_dir`` saved (``tokenizer.json`` is written last), or
    None."""
    from transformers import AutoTokenizer

    if not (out_dir / "tokenizer.json").exists():
        return None
    try:
        return AutoTokenizer.from_pretrained(out_dir)
    except Exception as err:  # transformers raises many kinds here
        raise UserError(f"{out_dir / 'tokenizer.json'}: cannot load the tokenizer an earlier "
                        f"run saved ({err}): remove it to train the tokenizer again") from None


def token_stream(convos: list[dict], tokenizer) -> torch.Tensor:
    """All conversations rendered, tokenised and joined by the end-of-text token."""
    texts = [tokenizer_mod.render(c["messages"], c["tools"]) for c in convos]
    sep = tokenizer.convert_tokens_to_ids(tokenizer_mod.EOS)
    ids: list[int] = []
    for chunk in range(0, len(texts), 1000):
        for row in tokenizer(texts[chunk : chunk + 1000], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            ids.append(sep)
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, cfg: TargetTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def target_settings(cfg: TargetTrainConfig,
                    corpus_cfg: corpus_mod.CorpusConfig = corpus_mod.CorpusConfig()) -> dict:
    """The run's settings its checkpoints keep (``runs.run_settings``), its corpus' too."""
    return {**run_settings(cfg), "corpus": run_settings(corpus_cfg)}


def train_target(
    out_dir: Path,
    cfg: TargetTrainConfig = TargetTrainConfig(),
    corpus_cfg: corpus_mod.CorpusConfig = corpus_mod.CorpusConfig(),
) -> Path:
    """Train tokenizer and target into ``out_dir`` (resuming if checkpoints exist)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    torch.manual_seed(cfg.seed)
    make_out_dir(out_dir)
    tokenizer = _saved_tokenizer(out_dir)  # a resumed run's (an unreadable one named first)
    print("target: generating the corpus", flush=True)  # a minute or so before the first step
    convos = corpus_mod.generate(corpus_cfg)
    if tokenizer is None:
        print(f"target: training the tokenizer on {len(convos)} conversations", flush=True)
        build_tokenizer(out_dir, convos, cfg.vocab_size)
        tokenizer = AutoTokenizer.from_pretrained(out_dir)
    data = token_stream(convos, tokenizer)
    num_windows = len(data) // cfg.seq_len
    model = Qwen3ForCausalLM(qwen3_config(cfg, tokenizer))
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    ckpt_dir = out_dir / "checkpoints"
    settings = target_settings(cfg, corpus_cfg)
    start = _resume(ckpt_dir, model, opt, settings)
    order = torch.randperm(num_windows, generator=torch.Generator().manual_seed(cfg.seed))
    log = open_log(out_dir / "train_log.jsonl", start)
    print(
        f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{len(data) / 1e6:.2f}M corpus tokens, steps {start}..{cfg.steps}"
    )
    t0 = time.time()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns) as progress:
        task = progress.add_task("target", total=cfg.steps, completed=start, info="")
        for step in range(start, cfg.steps):
            idx = order[(torch.arange(cfg.batch_size) + step * cfg.batch_size) % num_windows]
            batch = torch.stack([data[i * cfg.seq_len : (i + 1) * cfg.seq_len] for i in idx])
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            elapsed = time.time() - t0
            tok_s = (step + 1 - start) * cfg.batch_size * cfg.seq_len / elapsed
            log.write(
                json.dumps(
                    {
                        "step": step + 1,
                        "loss": round(loss.item(), 4),
                        "lr": lr_at(step, cfg),
                        "tokens_per_s": round(tok_s),
                    }
                )
                + "\n"
            )
            progress.update(task, advance=1, info=f"loss {loss.item():.3f}  {tok_s:.0f} tok/s")
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                _save_checkpoint(ckpt_dir, step + 1, model, opt, settings)
    model.config.dtype = "float32"
    with writing(out_dir, "the model"):
        model.save_pretrained(out_dir, safe_serialization=True)
        (out_dir / "train_config.json").write_text(
            json.dumps({"target": asdict(cfg), "corpus": asdict(corpus_cfg)}, indent=2) + "\n"
        )
    return out_dir


def _save_checkpoint(ckpt_dir: Path, step: int, model, opt, settings: dict) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "settings": settings,  # a rerun with other flags is refused (runs.check_settings)
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
    }
    tmp = ckpt_dir / "latest.pt.tmp"
    with writing(tmp, "the checkpoint"):
        torch.save(state, tmp)
        tmp.replace(ckpt_dir / "latest.pt")


def _resume(ckpt_dir: Path, model, opt, settings: dict) -> int:
    path = ckpt_dir / "latest.pt"
    if not path.exists():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=False)  # (a GPU's run too)
    check_settings(path, state.get("settings"), settings)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    torch.set_rng_state(state["rng"])
    random.setstate(state["py_rng"])
    return int(state["step"])
