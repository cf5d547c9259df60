"""A slot-based KV cache: every running request owns one slot of up to ``max_len`` positions.

Cropping a request's cache (after a rejected draft) is setting its length; nothing moves. The
pool holds about as many positions per slot as the longest request has needed so far (up to
``max_len``), not ``max_len`` from the start: its memory follows the requests' lengths.
"""

from __future__ import annotations

import heapq

import torch

from agentflash.models.qwen3 import (
    EXACT_CHUNK,
    LayerCache,
    ModelConfig,
    PackedRows,
    write_value_chunks,
)

FIRST_CAPACITY = 4 * EXACT_CHUNK  # positions per slot before any request needs more


def whole_chunks(n: int) -> int:
    """``n`` positions rounded up to whole chunks of exact attention."""
    return -(-n // EXACT_CHUNK) * EXACT_CHUNK


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        capacity: int | None = None,
    ):
        """``capacity``: positions per slot to start with (default ``FIRST_CAPACITY``; rounded
        up to whole chunks, at most ``max_capacity``)."""
        self.max_capacity = whole_chunks(max_len)  # positions a slot may come to hold
        capacity = min(self.max_capacity, whole_chunks(capacity or FIRST_CAPACITY))
        shape = (num_slots, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.num_slots, self.max_len, self.dtype = num_slots, max_len, dtype
        self.exact = False  # laid out for exact attention
        self._free = list(range(num_slots))  # a heap: the lowest free slot is taken first

    @property
    def capacity(self) -> int:
        """Positions each slot holds now."""
        return self.k[0].shape[2]

    def ensure(self, length: int) -> None:
        """Make every slot hold at least ``length`` positions, growing the pool by at least a
        quarter (a copy of it, so rarely: at most ten times on the way to 2,048 positions) in
        whole chunks, up to ``max_len``; what is cached stays where it is."""
        assert length <= self.max_capacity, f"{length} positions in a slot of {self.max_len}"
        if length <= self.capacity:
            return
        capacity = min(self.max_capacity, whole_chunks(max(self.capacity * 5 // 4, length)))
        # both grown before either is kept: a failed allocation (out of memory) left the keys
        # grown and the values not, and every later request past the old capacity failed
        k = [self._grown_keys(k, capacity) for k in self.k]
        v = [self._grown_values(v, capacity) for v in self.v]
        self.k, self.v = k, v

    def _grown_keys(self, k: torch.Tensor, capacity: int) -> torch.Tensor:
        slots, kv, old, d = k.shape
        if self.exact:  # stored transposed: [slots, KV, D, capacity] in memory
            grown = k.new_zeros(slots, kv, d, capacity)
            grown[..., :old] = k.transpose(2, 3)
            return grown.transpose(2, 3)
        grown = k.new_zeros(slots, kv, capacity, d)
        grown[:, :, :old] = k
        return grown

    def _grown_values(self, v: torch.Tensor, capacity: int) -> torch.Tensor:
        if self.exact:  # chunks of positions first: [capacity / EXACT_CHUNK, slots, KV, C, D]
            more = v.new_zeros(capacity // EXACT_CHUNK - v.shape[0], *v.shape[1:])
            return torch.cat((v, more))
        return self._grown_keys(v, capacity)  # the same layout as the keys

    def lay_out_for_exact_attention_(self) -> None:
        """Store the keys transposed ([slots, KV, D, capacity] in memory under the same
        [slots, KV, capacity, D] view) and the values in chunks of positions
        ([capacity / EXACT_CHUNK, slots, KV, EXACT_CHUNK, D]), as ``exact_attention`` reads
        them; the cache must be empty."""
        if self.exact:
            return
        self.k = [k.transpose(2, 3).contiguous().transpose(2, 3) for k in self.k]
        slots, kv, capacity, d = self.v[0].shape
        shape = (capacity // EXACT_CHUNK, slots, kv, EXACT_CHUNK, d)
        self.v = [v.new_zeros(shape) for v in self.v]
        self.exact = True

    def cached(self, slot: int, length: int) -> list[torch.Tensor]:
        """Every layer's keys, then every layer's values, of ``slot`` up to ``length`` [KV, len, D]
        (copies)."""
        keys = [k[slot, :, :length].clone() for k in self.k]
        if not self.exact:
            return keys + [v[slot, :, :length].clone() for v in self.v]
        chunks = -(-length // EXACT_CHUNK)  # [chunks, KV, C, D] -> [KV, chunks * C, D]
        values = [v[:chunks, slot].transpose(0, 1).flatten(1, 2)[:, :length] for v in self.v]
        # a clone, not .contiguous(): within one chunk the view may be contiguous already (64
        # positions; any length with one KV head), and an entry kept a live view of the pool
        return keys + [v.clone(memory_format=torch.contiguous_format) for v in values]

    def write(self, slot: int, kv: list[torch.Tensor]) -> None:
        """Put ``kv`` (as ``cached`` returns it: every layer's keys, then values [KV, len, D]) at
        positions ``0 .. len - 1`` of ``slot``."""
        num_layers = len(self.k)
        assert len(kv) == 2 * num_layers, "keys and values of every layer"
        length = kv[0].shape[1]
        self.ensure(length)
        for k_pool, v_pool, keys, values in zip(self.k, self.v, kv[:num_layers], kv[num_layers:]):
            k_pool[slot, :, :length] = keys
            if self.exact:
                write_value_chunks(v_pool, slot, 0, values)
            else:
                v_pool[slot, :, :length] = values

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """The lowest free slot: the running requests stay in the first slots, which the
        one-token rows of a step attend in one batch (``ModelRunner``: slots ``0 .. highest``;
        scattered over a wide cache they fell back to a call per row: 8 prose streams after a
        32-stream burst went from about 1,200 to 900 tok/s)."""
        assert self._free, "allocate() called with no free slot"
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        assert slot not in self._free, f"slot {slot} released twice"
        heapq.heappush(self._free, slot)

    def layer_views(self, rows: PackedRows) -> list[LayerCache]:
        """Every layer's view of the slots that one packed forward reads and writes."""
        return [LayerCache(k, v, rows, self.exact) for k, v in zip(self.k, self.v)]
