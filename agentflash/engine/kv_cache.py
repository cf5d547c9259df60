"""A slot-based KV cache: every running request owns one slot of ``max_len`` positions.

Cropping a request's cache (after a rejected draft) is setting its length; nothing moves.
"""

from __future__ import annotations

import torch

from agentflash.models.qwen3 import EXACT_CHUNK, LayerCache, ModelConfig, PackedRows


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        # positions held per slot: max_len rounded up to whole chunks of exact attention
        capacity = -(-max_len // EXACT_CHUNK) * EXACT_CHUNK
        shape = (num_slots, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.num_slots, self.max_len = num_slots, max_len
        self.keys_transposed = False
        self._free = list(range(num_slots - 1, -1, -1))

    def transpose_keys_(self) -> None:
        """Store the keys transposed ([slots, KV, D, capacity] in memory, the same
        [slots, KV, capacity, D] view), as ``exact_attention`` needs; the cache must be empty."""
        if not self.keys_transposed:
            self.k = [k.transpose(2, 3).contiguous().transpose(2, 3) for k in self.k]
            self.keys_transposed = True

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        assert self._free, "allocate() called with no free slot"
        return self._free.pop()

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} released twice"
        self._free.append(slot)

    def layer_views(self, rows: PackedRows) -> list[LayerCache]:
        """Every layer's view of the slots that one packed forward reads and writes."""
        return [LayerCache(k, v, rows) for k, v in zip(self.k, self.v)]
