"""Train a DFlash drafter for a target, following SpecForge's recipe.

1. The target regenerates the answers to the corpus prompts (greedy, with the engine), so the
   drafter learns what this target writes rather than what the corpus says.
2. Each step takes a few sequences, runs the frozen target once over them to capture the hidden
   states of ``target_layer_ids``, and samples up to ``num_anchors`` anchor positions in every
   response. Anchor ``a`` makes the block ``[token a, mask x (B-1)]`` at positions ``a..a+B-1``;
   slot ``k`` is labelled with token ``a+k`` and slot 0 is not in the loss.
3. All blocks of a sequence are trained in one forward. A block sees the target context of the
   positions strictly before its anchor, which is what it has when drafting: the anchor is the
   last committed token, sampled from the previous verify's logits, and has not been through the
   target yet. It also sees its own block, bidirectionally.
4. Cross-entropy weighted by ``exp(-(k-1)/gamma)`` (early slots matter most: a miss there ends
   the accepted run); AdamW, linear warmup then cosine decay, gradient clipping.

Validation tau is measured by drafting and greedily verifying held-out sequences, block by block,
exactly as decoding would (``validation_tau``), per kind of text. Checkpoints go to
``OUT/checkpoints/latest.pt`` every ``save_every`` steps and a rerun resumes from there; the
losses go to ``OUT/train_log.jsonl``; the drafter is saved in z-lab's format into ``OUT``.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentflash.dflash.checkpoint import default_target_layer_ids, save_drafter
from agentflash.dflash.drafter import DFlashDrafter, DrafterConfig
from agentflash.dflash.speculate import draft_block
from agentflash.errors import UserError, expand_user
from agentflash.models.qwen3 import Qwen3Model
from agentflash.train import corpus as corpus_mod
from agentflash.train import tokenizer as tokenizer_mod
from agentflash.train.runs import (
    check_settings,
    init_dir,
    make_out_dir,
    open_log,
    run_settings,
    target_name,
    writing,
)

IGNORE = -100


@dataclass(frozen=True)
class DrafterTrainConfig:
    """Drafter shape, data and optimisation settings."""

    num_layers: int = 2  # draft decoder layers
    target_layer_ids: tuple[int, ...] = ()  # empty: evenly spaced (default_target_layer_ids)
    block_size: int = 16
    mask_token_id: int | None = None  # None: the tokenizer's <|mask|>, else the first unused id
    num_anchors: int = 512  # blocks per sequence and step, at most
    loss_gamma: float = 7.0  # slot k weighs exp(-(k-1)/gamma)
    steps: int = 2000
    batch_size: int = 4  # sequences per step
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_response_tokens: int = 384  # regenerated answer length, at most
    max_seq_len: int = 1536  # prompt + answer; longer prompts are skipped
    regen_batch: int = 16  # requests the engine decodes together while regenerating
    num_val_per_kind: int = 16  # held-out conversations per kind of text
    val_every: int = 250
    save_every: int = 100
    seed: int = 0
    device: str = "cpu"
    init: str | None = None  # a drafter directory (or "demo") whose weights start a new run
    # share of tool-call conversations answered as the engine serves them when tools are given:
    # tool_choice auto, call bodies constrained to the tools' schemas
    constrained_tool_calls: float = 0.0
    corpus: corpus_mod.CorpusConfig = field(
        default_factory=lambda: corpus_mod.CorpusConfig(
            seed=1, num_tool_call=6000, num_code=1000, num_math=1500, num_prose=1500
        )
    )

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}")
        if self.num_anchors < 1 or self.batch_size < 1 or self.steps < 1:
            raise ValueError("num_anchors, batch_size and steps must be positive")
        if not 0.0 < self.lr < math.inf:  # NaN too
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if self.init is not None and self.init != "demo" and not expand_user(self.init).is_dir():
            raise ValueError(f"init: {self.init} is not a drafter directory")
        if not 0.0 <= self.constrained_tool_calls <= 1.0:
            raise ValueError(
                f"constrained_tool_calls must be in [0, 1], got {self.constrained_tool_calls}"
            )
        if self.max_response_tokens < 2 or self.max_seq_len <= self.max_response_tokens:
            raise ValueError("max_seq_len must exceed max_response_tokens, which must be >= 2")


@dataclass
class Sample:
    """One regenerated sequence: prompt tokens followed by the target's own answer."""

    ids: list[int]
    prompt_len: int
    kind: str  # tool_call, code, math or prose

    @property
    def num_response(self) -> int:
        return len(self.ids) - self.prompt_len


# --- data -------------------------------------------------------------------------------------


def split_corpus(convos: list[dict], num_val_per_kind: int) -> tuple[list[dict], list[dict]]:
    """The last ``num_val_per_kind`` conversations of each kind are held out, and no training
    one begins as one of them does (the code, prose and math generators draw from small pools:
    8 of 16 code validation prompts were training prompts too, their answers the same) nor
    gives the same first answer (a code prompt asks for one function in three wordings: 4 of
    16 were asked another way in training, 2 of them answered token for token alike)."""
    seen: dict[str, int] = defaultdict(int)
    val_ids = set()
    for i in range(len(convos) - 1, -1, -1):
        kind = convos[i]["kind"]
        if seen[kind] < num_val_per_kind:
            seen[kind] += 1
            val_ids.add(i)
    val = [c for i, c in enumerate(convos) if i in val_ids]
    held = {_opening(c) for c in val}
    answers = {a for c in val if (a := _first_answer(c))}
    train = [c for i, c in enumerate(convos) if i not in val_ids and _opening(c) not in held
             and _first_answer(c) not in answers]
    return train, val


def _opening(convo: dict) -> str:
    """What a conversation's first answer is to: its tools and the messages before it."""
    messages = convo["messages"]
    first = next((j for j, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return json.dumps([convo["tools"], messages[:first]], sort_keys=True)


def _first_answer(convo: dict) -> str:
    """A conversation's first assistant message (its text or its calls), or "" if none."""
    first = next((m for m in convo["messages"] if m["role"] == "assistant"), None)
    return "" if first is None else json.dumps(first, sort_keys=True)


def turn_prompts(convo: dict, chat_prompt: Callable[..., list[int]]) -> list[list[int]]:
    """Token ids of the conversation up to each assistant turn, ready for the answer, as
    ``chat_prompt`` (``Engine.chat_prompt``: the target's own chat template) renders what an
    agent sends (calls as OpenAI's messages list them): the prompts the target is served."""
    messages = corpus_mod.wire_messages(convo["messages"])
    return [chat_prompt(messages[:j], convo["tools"])
            for j, message in enumerate(messages) if message["role"] == "assistant"]


def regenerate(
    engine, prompts: list[tuple], max_tokens: int, label: str
) -> list[Sample]:
    """The target's greedy answers to ``prompts`` (ids, kind[, grammar source or None]),
    decoded together by ``engine``."""
    from rich.progress import Progress

    from agentflash.engine.request import SamplingParams

    requests = []
    for ids, kind, *rest in prompts:
        grammar = rest[0] if rest else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar)
        requests.append((engine.submit(ids, params), ids, kind))
    with Progress(transient=True) as progress:
        task = progress.add_task(f"regenerating {label}", total=len(requests))
        while engine.has_work:
            finished = sum(1 for out in engine.step() if out.request.is_finished)
            progress.update(task, advance=finished)
    return [Sample(ids + list(req.output_ids), len(ids), kind) for req, ids, kind in requests]


def _served_grammars(convos: list[dict], share: float) -> list:
    """The grammar the engine would serve each conversation's turns under when it has tools
    (tool_choice auto), for ``share`` of the tool-call conversations, spread evenly: the k-th
    is when ``floor((k + 1) * share)`` steps up (the first of every hundred conversations of
    any kind took 88% of a validation split's tool calls for a share of 60%); None for others."""
    from agentflash.grammar import assistant_turn

    out, k = [], 0
    for convo in convos:
        grammar = None
        if convo["kind"] == "tool_call" and convo["tools"]:
            if math.floor((k + 1) * share) > math.floor(k * share):
                grammar = assistant_turn(convo["tools"], "auto")
            k += 1
        out.append(grammar)
    return out


def target_fingerprint(target: Qwen3Model) -> str:
    """A digest of every weight's sum and sum of magnitudes: cached answers of another target
    are not reused (the embeddings, final norm and lm_head alone took a fine-tune of the same
    base that left them as they were, LoRA's, for the base: its drafter learned the base's
    answers)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, t in target.state_dict().items():
            total, size = t.sum(dtype=torch.float64), t.abs().sum(dtype=torch.float64)
            digest.update(f"{name} {float(total):.9e} {float(size):.9e};".encode())
    return digest.hexdigest()[:32]


def build_samples(
    target: Qwen3Model, tokenizer, cfg: DrafterTrainConfig, cache_path: Path
) -> tuple[list[Sample], list[Sample]]:
    """Train and validation sequences, regenerated once and cached in ``cache_path``."""
    settings = {
        "target": target_fingerprint(target),
        # the prompts: the target's chat template (edited, the answers are made again), and
        # their layout (2: the template's own rendering of what agents send; before: the demo's)
        # and split
        "chat_template": getattr(tokenizer, "chat_template", None),
        # (3: no training prompt a validation one; the constrained share spread; 4: nor a
        # training first answer a validation one's)
        "prompts": 4,
        "corpus": asdict(cfg.corpus),
        "max_response_tokens": cfg.max_response_tokens,
        "max_seq_len": cfg.max_seq_len,
        "num_val_per_kind": cfg.num_val_per_kind,
        "constrained_tool_calls": cfg.constrained_tool_calls,
    }
    cached = _cached_samples(cache_path, settings)
    if cached is not None:
        return cached
    from agentflash.engine.engine import Engine, EngineConfig

    train_convos, val_convos = split_corpus(corpus_mod.generate(cfg.corpus), cfg.num_val_per_kind)
    engine = Engine(
        target,
        tokenizer,
        EngineConfig(device=cfg.device, max_running=cfg.regen_batch, max_len=cfg.max_seq_len),
    )
    limit = engine.scheduler.cfg.max_len - cfg.max_response_tokens  # room left for the answer
    splits = []
    for label, convos in (("train", train_convos), ("val", val_convos)):
        prompts = [
            (ids, c["kind"], grammar)
            for c, grammar in zip(convos, _served_grammars(convos, cfg.constrained_tool_calls))
            for ids in turn_prompts(c, engine.chat_prompt)
            if len(ids) <= limit
        ]
        samples = regenerate(engine, prompts, cfg.max_response_tokens, label)
        splits.append([s for s in samples if s.num_response >= 2])
    tmp = cache_path.with_name(cache_path.name + ".tmp")  # a write cut short is no cache
    with writing(tmp, "the target's answers"):
        tmp.write_text(
            json.dumps(
                {
                    "settings": settings,
                    "train": [asdict(s) for s in splits[0]],
                    "val": [asdict(s) for s in splits[1]],
                }
            ),
            encoding="utf-8",
        )
        tmp.replace(cache_path)
    return splits[0], splits[1]


def _cached_samples(
    cache_path: Path, settings: dict[str, Any]
) -> tuple[list[Sample], list[Sample]] | None:
    """The samples ``cache_path`` keeps for ``settings``; None if it keeps others or cannot be
    read (cut short by an earlier version's write): they are made again."""
    if not cache_path.exists():
        return None
    try:
        cached = json.loads(cache_path.read_text(encoding="utf-8"))
        if cached.get("settings") != settings:
            return None
        return [Sample(**s) for s in cached["train"]], [Sample(**s) for s in cached["val"]]
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        print(f"drafter: {cache_path} cannot be read ({type(err).__name__}: {err}); the target "
              "answers again", flush=True)
        return None


# --- target features and blocks ----------------------------------------------------------------


class _NoCache:
    """A full-sequence forward without a KV cache: attend to the keys just computed."""

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


@torch.no_grad()
def target_hidden(
    target: Qwen3Model, sequences: list[list[int]], layer_ids: tuple[int, ...]
) -> torch.Tensor:
    """Captured target layers [B, S, K*H] of right-padded ``sequences`` (causal, so the padding
    does not reach the real positions)."""
    device = next(target.parameters()).device
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq)
    positions = torch.arange(longest).expand(len(sequences), longest)
    caches = [_NoCache() for _ in range(target.cfg.num_layers)]
    _, captured = target(ids.to(device), positions.to(device), caches, None, layer_ids)
    return torch.cat(captured, dim=-1)


@dataclass
class Blocks:
    """N blocks per sequence (padded with empty blocks): ids, positions, labels [B, N, T]."""

    ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor  # IGNORE at slot 0, past the sequence and in padding blocks
    anchors: torch.Tensor  # [B, N]: a block sees the context positions before its anchor


def make_blocks(
    samples: list[Sample], block_size: int, num_anchors: int, mask_token_id: int, rng: random.Random
) -> Blocks:
    """Sample anchors in every response and build its blocks."""
    chosen = []
    for s in samples:
        candidates = range(s.prompt_len, len(s.ids) - 1)  # each anchor has a next token to learn
        chosen.append(sorted(rng.sample(candidates, min(num_anchors, len(candidates)))))
    b, n, t = len(samples), max(len(a) for a in chosen), block_size
    ids = torch.full((b, n, t), mask_token_id, dtype=torch.long)
    labels = torch.full((b, n, t), IGNORE, dtype=torch.long)
    anchors = torch.zeros(b, n, dtype=torch.long)
    for i, (s, rows) in enumerate(zip(samples, chosen, strict=True)):
        seq = torch.tensor(s.ids)
        for j, a in enumerate(rows):
            ids[i, j, 0] = seq[a]
            span = seq[a + 1 : a + t]
            labels[i, j, 1 : 1 + len(span)] = span
            anchors[i, j] = a
    positions = anchors[..., None] + torch.arange(t)
    return Blocks(ids, positions, labels, anchors)


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weights [T-1] of slots 1..T-1: exp(-(k-1)/gamma)."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def block_loss(
    drafter: DFlashDrafter, target: Qwen3Model, hidden: torch.Tensor, blocks: Blocks, gamma: float
) -> tuple[torch.Tensor, float]:
    """Weighted cross-entropy of all blocks, and the accuracy of slot 1."""
    device = hidden.device
    ids, positions = blocks.ids.to(device), blocks.positions.to(device)
    labels, anchors = blocks.labels[:, :, 1:].to(device), blocks.anchors.to(device)
    s = hidden.shape[1]
    with torch.no_grad():
        embeds = target.embed(ids)  # [B, N, T, H]
    context = drafter.context_kv(hidden, torch.arange(s, device=device).expand(hidden.shape[0], s))
    visible = torch.arange(s, device=device)[None, None] < anchors[..., None]  # [B, N, S]
    out = drafter(embeds, positions, context, visible)  # [B, N, T, H]
    logits = target.logits(out[:, :, 1:])  # [B, N, T-1, V]
    ce = F.cross_entropy(
        logits.flatten(0, 2), labels.flatten(), ignore_index=IGNORE, reduction="none"
    ).view_as(labels)
    valid = (labels != IGNORE).float()
    weights = slot_weights(ids.shape[-1], gamma).to(device) * valid
    loss = (ce * weights).sum() / weights.sum()
    first = valid[..., 0].bool()
    accuracy = (logits[..., 0, :].argmax(-1) == labels[..., 0])[first].float().mean()
    return loss, float(accuracy)


# --- validation ------------------------------------------------------------------------------


@torch.no_grad()
def validation_tau(
    drafter: DFlashDrafter,
    target: Qwen3Model,
    samples: list[Sample],
    block_size: int | None = None,
    batch: int = 8,
) -> dict[str, float]:
    """Mean tokens committed per target forward when decoding ``samples`` with DFlash, greedy.

    Each sample's answer is the target's greedy output, so verifying a block is comparing it with
    the answer: the accepted run is the draft's longest prefix equal to it, plus the target's
    token. Returns tau per kind and over all (``all``).
    """
    size = block_size or drafter.cfg.block_size
    was_training = drafter.training
    drafter.eval()
    per_kind: dict[str, list[int]] = defaultdict(list)
    for lo in range(0, len(samples), batch):
        chunk = samples[lo : lo + batch]
        hidden = target_hidden(target, [s.ids for s in chunk], drafter.cfg.target_layer_ids)
        for kind, produced in _simulate(drafter, target, chunk, hidden, size):
            per_kind[kind].append(produced)
    drafter.train(was_training)
    taus = {kind: sum(v) / len(v) for kind, v in sorted(per_kind.items())}
    every = [p for v in per_kind.values() for p in v]
    taus["all"] = sum(every) / len(every) if every else 0.0
    return taus


def _simulate(drafter, target, chunk: list[Sample], hidden: torch.Tensor, size: int):
    """Yield (kind, tokens committed) for every draft-and-verify step of every sample."""
    contexts = [drafter.new_context() for _ in chunk]
    drafter.extend(contexts, [hidden[i, : s.prompt_len] for i, s in enumerate(chunk)])
    pos = [s.prompt_len for s in chunk]  # the last committed token; the prefill produced it
    active = [i for i, s in enumerate(chunk) if pos[i] < len(s.ids) - 1]
    while active:
        last = torch.tensor([chunk[i].ids[pos[i]] for i in active], device=hidden.device)
        drafts = draft_block(
            drafter, target.embed, target.logits, last, [contexts[i] for i in active], size
        ).tolist()
        new_hidden = []
        for draft, i in zip(drafts, active, strict=True):
            seq, p = chunk[i].ids, pos[i]
            truth = seq[p + 1 : p + size]
            accepted = next(
                (k for k, (d, y) in enumerate(zip(draft, truth, strict=False)) if d != y),
                len(truth),
            )
            produced = min(accepted + 1, len(seq) - 1 - p)
            yield chunk[i].kind, produced
            new_hidden.append(hidden[i, p : p + produced])
            pos[i] += produced
        drafter.extend([contexts[i] for i in active], new_hidden)
        active = [i for i in active if pos[i] < len(chunk[i].ids) - 1]


# --- the run ---------------------------------------------------------------------------------


def drafter_config(
    target: Qwen3Model, cfg: DrafterTrainConfig, mask_token_id: int
) -> DrafterConfig:
    """A drafter as wide as the target (it shares its embeddings and lm_head)."""
    t = target.cfg
    layer_ids = cfg.target_layer_ids or default_target_layer_ids(t.num_layers, cfg.num_layers)
    return DrafterConfig(
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_layers=cfg.num_layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        rope_theta=t.rope_theta,
        rms_norm_eps=t.rms_norm_eps,
        block_size=cfg.block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=layer_ids,
        num_target_layers=t.num_layers,
        vocab_size=t.vocab_size,
        max_position_embeddings=t.max_position_embeddings,
    )


def choose_mask_token(tokenizer, vocab_size: int, override: int | None) -> int:
    """The token that fills block slots: configured, the tokenizer's <|mask|>, or the first
    embedding row the tokenizer never produces (z-lab's choice for Qwen3: 151669)."""
    if override is not None:
        return override
    mask = tokenizer.convert_tokens_to_ids(tokenizer_mod.MASK)
    if isinstance(mask, int) and mask != tokenizer.unk_token_id:
        return mask
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    raise UserError(
        "the target's tokenizer has no <|mask|> token and no unused embedding row; "
        "set mask_token_id"
    )


def drafter_settings(cfg: DrafterTrainConfig) -> dict[str, Any]:
    """The run's settings its checkpoints keep (``runs.run_settings``), ``--init`` as the
    directory it names wherever the run is started from (``demo`` as it is)."""
    settings = run_settings(cfg)
    if cfg.init not in (None, "demo"):
        settings["init"] = init_dir(cfg.init)
    return settings


def new_drafter(cfg: DrafterConfig, seed: int) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    for module in drafter.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    return drafter


def lr_at(step: int, cfg: DrafterTrainConfig) -> float:
    warmup = max(1, round(cfg.warmup_ratio * cfg.steps))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def batch_indices(step: int, cfg: DrafterTrainConfig, num_samples: int) -> list[int]:
    """Sequences of ``step``: a seeded shuffle per epoch, so a resumed run sees the same data."""
    out = []
    for k in range(step * cfg.batch_size, (step + 1) * cfg.batch_size):
        epoch, i = divmod(k, num_samples)
        gen = torch.Generator().manual_seed(cfg.seed + epoch)
        order = torch.randperm(num_samples, generator=gen)
        out.append(int(order[i]))
    return out


def train_drafter(
    target_dir: str | Path, out_dir: str | Path, cfg: DrafterTrainConfig = DrafterTrainConfig()
) -> Path:
    """Train a drafter for the target in ``target_dir`` (or ``demo``) and save it in ``out_dir``.

    Resumes from ``out_dir/checkpoints/latest.pt`` when present. Returns ``out_dir``, which then
    holds ``config.json`` and ``model.safetensors`` in z-lab's format, ``train_log.jsonl`` and
    ``train_drafter.json`` (settings, validation tau per kind, training time).
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from agentflash.models.loading import load_model, load_tokenizer

    out_dir = Path(out_dir)
    target, _, model_dir = load_model(target_dir, device=cfg.device, dtype=torch.float32)
    target.requires_grad_(False)
    tokenizer = load_tokenizer(model_dir, target.cfg.vocab_size)
    if not getattr(tokenizer, "chat_template", None):  # the target answers served prompts
        raise UserError(f"{model_dir}: the tokenizer has no chat template: the drafter learns "
                        f"the target's answers to prompts as it is served, in its template")
    mask_id = choose_mask_token(tokenizer, target.cfg.vocab_size, cfg.mask_token_id)
    dcfg = drafter_config(target, cfg, mask_id)
    # --init is read and checked before the target answers the corpus (minutes of work)
    initial = _init_from(cfg.init, dcfg) if cfg.init is not None else None
    # a run to resume, checked too: after the answers, a drafter of other settings was found
    # minutes later, and the answers' cache was already rewritten for the new settings
    saved = _checkpoint(out_dir / "checkpoints", dcfg, drafter_settings(cfg))
    make_out_dir(out_dir)  # once all is checked: no empty --out left
    train, val = build_samples(target, tokenizer, cfg, out_dir / "responses.json")
    # the engine that answered the corpus (where the answers were not cached) laid the target's
    # weights out for inference in place (fused, other strides), and its gradients then differ
    # (by 1e-7): training reads the target as loaded, as a run whose answers were cached does
    del target
    target = load_model(target_dir, device=cfg.device, dtype=torch.float32)[0]
    target.requires_grad_(False)
    if not train:
        raise UserError(f"{out_dir}: no training sequences (every answer had under 2 tokens)")
    drafter = new_drafter(dcfg, cfg.seed).to(cfg.device).train()
    opt = torch.optim.AdamW(
        drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    ckpt_dir = out_dir / "checkpoints"
    start = _resume(saved, drafter, opt)
    trained_for = target_name(target_dir)
    if start == 0 and initial is not None:
        drafter.load_state_dict(initial.state_dict())
    num_params = sum(p.numel() for p in drafter.parameters())
    print(
        f"drafter: {num_params / 1e6:.2f}M parameters, {dcfg.num_layers} layers reading target "
        f"layers {list(dcfg.target_layer_ids)}; {len(train)} train / {len(val)} val sequences; "
        f"steps {start}..{cfg.steps}"
    )
    log = open_log(out_dir / "train_log.jsonl", start)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
    )
    # training time of the steps kept: the run's earlier segments' (to its checkpoint) and this
    t0, taus = time.time(), {}
    earlier = float(saved.get("train_seconds", 0.0)) if saved is not None else 0.0
    with Progress(*columns) as progress:
        task = progress.add_task("drafter", total=cfg.steps, completed=start, info="")
        for step in range(start, cfg.steps):
            loss, acc = _train_step(drafter, target, opt, train, step, cfg)
            seq_s = (step + 1 - start) * cfg.batch_size / (time.time() - t0)
            log.write(
                json.dumps(
                    {
                        "step": step + 1,
                        "loss": round(loss, 4),
                        "acc1": round(acc, 4),
                        "lr": lr_at(step, cfg),
                    }
                )
                + "\n"
            )
            progress.update(
                task, advance=1, info=f"loss {loss:.3f}  acc@1 {acc:.2f}  {seq_s:.1f} seq/s"
            )
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                _save_checkpoint(ckpt_dir, step + 1, drafter, opt, dcfg, trained_for,
                                 drafter_settings(cfg), earlier + time.time() - t0)
            if val and ((step + 1) % cfg.val_every == 0 or step + 1 == cfg.steps):
                taus = validation_tau(drafter, target, val)
                log.write(json.dumps({"step": step + 1, "val_tau": _rounded(taus)}) + "\n")
                progress.console.print(f"step {step + 1}: val tau " + _format_taus(taus))
    if val and not taus:  # nothing left to train: still report where the drafter stands
        taus = validation_tau(drafter, target, val)
    log.close()
    with writing(out_dir, "the drafter"):
        save_drafter(drafter.eval(), out_dir)
    # the target layers it reads, the default ones too (they were [] then), and what it was
    # started from (a resumed run may be given no --init: its weights are the checkpoint's)
    started_from = drafter_settings(cfg)["init"] if cfg.init is not None or saved is None \
        else (saved.get("settings") or {}).get("init")
    summary = {
        "drafter": {**asdict(cfg), "target_layer_ids": list(dcfg.target_layer_ids),
                    "init": started_from},
        "params": num_params,
        "val_tau": _rounded(taus),
        "train_seconds": round(earlier + time.time() - t0, 1),  # (a resumed run's: its last
        # segment's alone)
        "mask_token_id": mask_id,
    }
    with writing(out_dir / "train_drafter.json", "the summary"):
        (out_dir / "train_drafter.json").write_text(json.dumps(summary, indent=2) + "\n")
    return out_dir


def _train_step(
    drafter, target, opt, train: list[Sample], step: int, cfg: DrafterTrainConfig
) -> tuple[float, float]:
    samples = [train[i] for i in batch_indices(step, cfg, len(train))]
    rng = random.Random(cfg.seed * 1_000_003 + step)
    blocks = make_blocks(samples, cfg.block_size, cfg.num_anchors, drafter.cfg.mask_token_id, rng)
    hidden = target_hidden(target, [s.ids for s in samples], drafter.cfg.target_layer_ids)
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    loss, acc = block_loss(drafter, target, hidden, blocks, cfg.loss_gamma)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
    opt.step()
    return loss.item(), acc


def _rounded(taus: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in taus.items()}


def _format_taus(taus: dict[str, float]) -> str:
    return "  ".join(f"{kind} {tau:.2f}" for kind, tau in taus.items())


def _save_checkpoint(ckpt_dir: Path, step: int, drafter, opt, dcfg: DrafterConfig,
                     target: str, settings: dict[str, Any], seconds: float) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "drafter": drafter.state_dict(),
        "opt": opt.state_dict(),
        "drafter_config": asdict(dcfg),
        "settings": settings,  # a rerun with other flags is refused (runs.check_settings)
        "train_seconds": seconds,  # of the steps to here, over the run's segments
        "target": target,  # a rerun on another target is refused (runs.check_out_dir)
    }
    tmp = ckpt_dir / "latest.pt.tmp"
    with writing(tmp, "the checkpoint"):
        torch.save(state, tmp)
        tmp.replace(ckpt_dir / "latest.pt")


def _init_from(source: str, dcfg: DrafterConfig) -> DFlashDrafter:
    """The drafter in ``source`` (a directory or ``demo``) to start from, whose shape must be
    the one this run trains, except that it may read fewer target layers or have fewer layers:
    a drafter reading a subset of this run's target layers is widened (``widen_context``), a
    shallower one deepened (``deepen``); either drafts as it did until training gives the new
    weights a say."""
    from agentflash.dflash.checkpoint import load_drafter
    from agentflash.models.loading import drafter_dir

    path = drafter_dir(source)
    init = load_drafter(path, dtype=torch.float32)
    mine, theirs = asdict(dcfg), asdict(init.cfg)
    diff = {k: v for k, v in theirs.items() if mine[k] != v}
    if "num_layers" in diff and init.cfg.num_layers < dcfg.num_layers:
        init = deepen(init, dcfg.num_layers)
        del diff["num_layers"]
    if set(diff) == {"target_layer_ids"} and set(init.cfg.target_layer_ids) < set(
        dcfg.target_layer_ids
    ):
        init = widen_context(init, dcfg.target_layer_ids)
    elif diff:
        raise UserError(f"{path}: --init drafter differs from the one to train in {diff}")
    return init


def deepen(drafter: DFlashDrafter, num_layers: int) -> DFlashDrafter:
    """A copy of ``drafter`` with layers added after its own up to ``num_layers``, that computes
    exactly what it did: each new layer's output projections (attention ``o_proj``, MLP
    ``down_proj``) are zero, so it adds nothing to the residual stream until training gives it
    weight (its other weights start as the last layer's)."""
    old = drafter.cfg.num_layers
    if num_layers <= old:
        raise ValueError(f"{num_layers} layers do not deepen a drafter of {old}")
    deep = DFlashDrafter(replace(drafter.cfg, num_layers=num_layers))
    state = drafter.state_dict()
    last = f"layers.{old - 1}."
    for i in range(old, num_layers):
        for name, tensor in list(state.items()):
            if name.startswith(last):
                new = f"layers.{i}." + name[len(last):]
                zero = name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
                state[new] = torch.zeros_like(tensor) if zero else tensor.clone()
    deep.load_state_dict(state)
    return deep.to(drafter.fc.weight.dtype)


def widen_context(drafter: DFlashDrafter, layer_ids: tuple[int, ...]) -> DFlashDrafter:
    """A copy of ``drafter`` that reads target layers ``layer_ids`` (a superset of its own) and
    computes exactly what it did: ``fc``'s columns for the new layers are zero, so their hidden
    states add nothing to the context until training gives them weight."""
    old = drafter.cfg.target_layer_ids
    if not set(old) <= set(layer_ids):
        raise ValueError(f"target layers {list(layer_ids)} do not include {list(old)}")
    wide = DFlashDrafter(replace(drafter.cfg, target_layer_ids=tuple(layer_ids)))
    state = drafter.state_dict()
    hidden = drafter.cfg.hidden_size
    fc = state["fc.weight"].new_zeros(hidden, hidden * len(layer_ids))
    for j, layer in enumerate(old):  # the context is the captured layers side by side, in order
        i = layer_ids.index(layer)
        fc[:, i * hidden : (i + 1) * hidden] = state["fc.weight"][:, j * hidden : (j + 1) * hidden]
    state["fc.weight"] = fc
    wide.load_state_dict(state)
    return wide.to(drafter.fc.weight.dtype)


def _checkpoint(ckpt_dir: Path, dcfg: DrafterConfig, settings: dict[str, Any]
                ) -> dict[str, Any] | None:
    """The run's latest checkpoint (None: none yet), if it is of a drafter of ``dcfg`` and of
    a run of ``settings`` (``run_settings``)."""
    path = ckpt_dir / "latest.pt"
    if not path.exists():
        return None
    # on the CPU whatever device wrote it (the optimizer's state moves to the parameters'):
    # a run checkpointed on a GPU did not resume on a machine without one
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    if state["drafter_config"] != asdict(dcfg):
        had, asked = state["drafter_config"], asdict(dcfg)
        diff = ", ".join(f"{k} {had.get(k)!r} there, {asked[k]!r} asked"
                         for k in asked if had.get(k) != asked[k])
        raise UserError(f"{path}: checkpoint is of a different drafter ({diff}); use another "
                        f"--out or delete it")
    check_settings(path, state.get("settings"), settings, shape_checked=True)
    return state


def _resume(state: dict[str, Any] | None, drafter, opt) -> int:
    """The step to go on from: ``state``'s (a checkpoint), loaded into ``drafter`` and ``opt``."""
    if state is None:
        return 0
    drafter.load_state_dict(state["drafter"])
    opt.load_state_dict(state["opt"])
    return int(state["step"])
