"""Target forwards over a batch of requests, each at its own cache offset."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentflash.engine.kv_cache import KVCache
from agentflash.models.qwen3 import Qwen3Model


@dataclass
class Row:
    """One request's share of a forward: new tokens written from cache position ``start``."""

    slot: int
    start: int
    tokens: list[int]


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, T, V] (T = 1 when only the last position was asked for)
    hidden: torch.Tensor | None  # [B, T, K*H]: captured target layers, concatenated


class ModelRunner:
    def __init__(self, model: Qwen3Model, cache: KVCache):
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def forward(
        self, rows: list[Row], last_only: bool = False, capture_layers: tuple[int, ...] = ()
    ) -> ForwardOutput:
        """Feed every row's tokens causally after its cached prefix; rows may differ in length."""
        lengths = [len(r.tokens) for r in rows]
        t = max(lengths)
        input_ids = torch.zeros(len(rows), t, dtype=torch.long)
        positions = torch.empty(len(rows), t, dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : lengths[i]] = torch.tensor(r.tokens)
            positions[i] = r.start + torch.arange(t)
        attend_len = max(r.start + t for r in rows)
        assert attend_len <= self.cache.max_len, "forward past the cache slot"
        slots = torch.tensor([r.slot for r in rows])
        mask = self._mask(rows, t, attend_len)
        caches = self.cache.layer_views(
            slots.to(self.device), positions.to(self.device), attend_len
        )
        hidden, captured = self.model(
            input_ids.to(self.device), positions.to(self.device), caches, mask, capture_layers
        )
        if last_only:
            idx = torch.tensor([n - 1 for n in lengths], device=self.device)
            hidden = hidden[torch.arange(len(rows), device=self.device), idx][:, None]
        context = torch.cat(captured, dim=-1) if captured else None
        return ForwardOutput(self.model.logits(hidden), context)

    def _mask(self, rows: list[Row], t: int, attend_len: int) -> torch.Tensor | None:
        if len(rows) == 1 and (t == 1 or rows[0].start == 0):
            return None  # one row: full attention to the cache, or plain causal from position 0
        starts = torch.tensor([r.start for r in rows])[:, None, None]  # [B, 1, 1]
        query_pos = starts + torch.arange(t)[None, :, None]  # [B, T, 1]
        key_pos = torch.arange(attend_len)[None, None, :]  # [1, 1, S]
        return (key_pos <= query_pos)[:, None].to(self.device)  # [B, 1, T, S]
