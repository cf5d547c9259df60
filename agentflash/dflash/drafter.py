"""The DFlash drafter network and its weight names (z-lab ``DFlashDraftModel`` layout).

A few Qwen3-style decoder layers draft a whole block in one forward. The block is
``[last committed token, <mask> x (B-1)]``, embedded with the target's ``embed_tokens``; the
drafter's final hidden states go through the target's ``lm_head``. The drafter has neither of its
own. What it sees of the past is the target's hidden states of K layers, concatenated, fused by
``fc`` and ``hidden_norm``, and injected as extra keys/values into every layer:

    keys   = cat(k_proj(context), k_proj(block))      queries from the block only
    values = cat(v_proj(context), v_proj(block))      no causal mask

Positions are absolute: context token ``j`` sits at ``j``, block slot ``i`` at ``start + i`` where
``start`` is the position of the block's first (committed) token. The context is the target's
hidden states of every position before ``start``: the block's first token has not been through the
target yet when the block is drafted.

Weight names (unprefixed, as in z-lab checkpoints): ``fc.weight``, ``hidden_norm.weight``,
``norm.weight`` and per layer ``layers.{i}.input_layernorm.weight``,
``layers.{i}.post_attention_layernorm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agentflash.models.qwen3 import (
    MLP,
    RMSNorm,
    Rotary,
    apply_rotary,
    fuse_projections_,
    norm_heads,
)

# new context positions, over every row, that a draft forward projects in its own products
# (``DFlashDrafter.draft_forward``): a step's accepted tokens; not a prompt's hundreds, whose
# queries the block's projection would compute for nothing
TAKE_IN = 128


@dataclass(frozen=True)
class DrafterConfig:
    """Shape of a drafter and how it plugs into its target. Checked when built (``ValueError``)."""

    hidden_size: int  # equals the target's: the block is embedded by the target
    intermediate_size: int
    num_layers: int  # draft decoder layers
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    block_size: int  # tokens per block, the committed one included (16 in z-lab's b16)
    mask_token_id: int  # fills the block's slots 1..B-1
    target_layer_ids: tuple[int, ...]  # 0-based target layers whose outputs form the context
    num_target_layers: int | None  # the target's depth, when the checkpoint records it
    vocab_size: int  # the target's vocabulary (recorded for serving engines)
    max_position_embeddings: int = 40960

    def __post_init__(self) -> None:
        ids = self.target_layer_ids
        # a string's characters ("13" as [1, 3]) and 1.5 as 1 were read as layers
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"target_layer_ids must be a list of layer indexes, got {ids!r}")
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in ids))
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size must be an integer >= 2, got {self.block_size!r}")
        for name in ("mask_token_id", "num_target_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | None) or (
                    name == "mask_token_id" and value is None):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.num_target_layers is not None and self.num_target_layers < 1:
            raise ValueError(f"num_target_layers must be positive, got {self.num_target_layers}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                f"(vocab_size {self.vocab_size})"
            )
        self._check_layer_ids()

    def _check_layer_ids(self) -> None:
        ids = self.target_layer_ids
        if not ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if ids[0] < 0 or any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
            raise ValueError(
                f"target_layer_ids must be non-negative and increasing, got {list(ids)}"
            )
        if self.num_target_layers is not None and ids[-1] >= self.num_target_layers:
            raise ValueError(
                f"target_layer_ids {list(ids)} reach past num_target_layers "
                f"({self.num_target_layers})"
            )

    @property
    def num_context_layers(self) -> int:
        """K: how many target layers are concatenated into the context features."""
        return len(self.target_layer_ids)


class DraftContext:
    """One request's projected target context: per draft layer, keys and values [KV, len, D].

    Grows as the target's hidden states of committed tokens arrive (``DFlashDrafter.extend``);
    the block's own keys and values are never stored. Full storage grows to a quarter more than
    it needs, in whole chunks of ``CHUNK`` positions: a copy every few steps at most, and at
    most a fifth of it unused, plus a chunk. (Doubling left up to half unused: at 32 tool-call
    streams the contexts of the demo drafter's two layers held 43 MB beside the 73 MB of keys
    and values of the target's six.)
    """

    CHUNK = 64

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.length = 0
        shape = (num_kv_heads, 0, head_dim)
        self._k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self._v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        itemsize = self._k[0].element_size()
        self._position_bytes = 2 * num_layers * num_kv_heads * head_dim * itemsize  # keys, values

    @property
    def capacity(self) -> int:
        return self._k[0].shape[1]

    @property
    def num_bytes(self) -> int:
        """The storage held (every position of ``capacity``, in every layer)."""
        return self.capacity * self._position_bytes

    def keys(self, layer: int) -> torch.Tensor:
        return self._k[layer][:, : self.length]  # [KV, len, D]

    def values(self, layer: int) -> torch.Tensor:
        return self._v[layer][:, : self.length]  # [KV, len, D]

    def with_room(self, layer: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [KV, len + t, D] of ``layer``: the context's, then ``t`` positions of
        its storage past its end where a block's own keys and values are written while it
        drafts (never counted in ``length``: the next ``append`` writes over them)."""
        if self.length + t > self.capacity:
            self._grow(self.length + t)
        end = self.length + t
        return self._k[layer][:, :end], self._v[layer][:, :end]

    def reserve(self, t: int) -> None:
        """Storage for ``t`` positions past the end (grown if need be)."""
        if self.length + t > self.capacity:
            self._grow(self.length + t)

    def storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole storage [KV, capacity, D] of ``layer``'s keys and values, for a forward
        that writes positions past the end into it (``reserve`` first; ``took_in`` after)."""
        return self._k[layer], self._v[layer]

    def took_in(self, t: int) -> None:
        """Count the next ``t`` positions, written into every layer's ``storage``."""
        assert self.length + t <= self.capacity, "reserve the room first"
        self.length += t

    def append(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add ``t`` positions: one (keys, values) pair [KV, t, D] per draft layer."""
        assert len(layer_kv) == len(self._k), "one (keys, values) pair per draft layer"
        t = layer_kv[0][0].shape[1]
        if self.length + t > self.capacity:
            self._grow(self.length + t)
        for store_k, store_v, (k, v) in zip(self._k, self._v, layer_kv, strict=True):
            store_k[:, self.length : self.length + t] = k
            store_v[:, self.length : self.length + t] = v
        self.length += t

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        assert 0 <= length <= self.length, f"crop to {length} of a context of {self.length}"
        self.length = length

    def reset(self) -> None:
        self.length = 0

    @classmethod
    def capacity_for(cls, needed: int) -> int:
        """The storage grown to hold ``needed`` positions: a quarter more, in whole chunks."""
        return -(-(needed + needed // 4) // cls.CHUNK) * cls.CHUNK

    def _grow(self, needed: int) -> None:
        capacity = self.capacity_for(needed)
        for store in (self._k, self._v):
            for i, old in enumerate(store):
                new = old.new_empty(old.shape[0], capacity, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                store[i] = new


class DraftAttention(nn.Module):
    """GQA attention whose keys/values are the context's followed by the block's."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    # with ``DFlashDrafter.fuse_`` (``fuse_projections_``): q_proj, k_proj and v_proj as one,
    # and the query and key heads' norm weights side by side [heads + kv heads, D]
    _fused: nn.Linear | None = None
    _qk_norm_weight: torch.Tensor | None = None
    qk_norm = True  # a drafter's heads are always normed

    @property
    def _drafting(self) -> bool:
        """Whether the fused projections serve (fused, and no gradient is being recorded)."""
        return self._fused is not None and not torch.is_grad_enabled()

    def keys_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values of ``x`` [..., S, H]; both [..., KV, S, D]."""
        if self._drafting:  # k_proj and v_proj side by side in the fused weight
            kv_weight = self._fused.weight[self.num_heads * self.head_dim :]
            k, v = F.linear(x, kv_weight).unflatten(-1, (2 * self.num_kv_heads, -1)).chunk(2, -2)
        else:
            k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
            v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        k = apply_rotary(self.k_norm(k), cos[..., None, :], sin[..., None, :])  # [..., S, KV, D]
        return k.transpose(-2, -3), v.transpose(-2, -3)

    def _queries_keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated queries [..., T, Hq, D], keys and values [..., KV, T, D] of ``x`` [..., T, H]."""
        if not self._drafting:
            q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
            q = apply_rotary(q, cos[..., None, :], sin[..., None, :])
            return (q, *self.keys_values(x, cos, sin))
        # one projection; query and key heads normed and rotated together
        heads = self.num_heads + self.num_kv_heads
        qkv = self._fused(x).unflatten(-1, (heads + self.num_kv_heads, self.head_dim))
        qk = norm_heads(qkv[..., :heads, :], self._qk_norm_weight, self.q_norm.eps)
        qk = apply_rotary(qk, cos[..., None, :], sin[..., None, :])
        q, k, v = qk[..., : self.num_heads, :], qk[..., self.num_heads :, :], qkv[..., heads:, :]
        return q, k.transpose(-2, -3), v.transpose(-2, -3)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor | list[torch.Tensor],
        ctx_v: torch.Tensor | list[torch.Tensor],
        ctx_visible: torch.Tensor | None,
    ) -> torch.Tensor:
        # x: [B, N, T, H], N blocks of T slots per row; cos, sin: [B, N, T, D]
        # ctx_k, ctx_v: [B, KV, S, D]; ctx_visible: [B, N, S] (True where a block sees the context)
        # or, drafting (one block per row), per row its context's storage [KV, len + T, D] whose
        # last T positions are free (``DraftContext.with_room``): the block's own keys and
        # values are written there, and each row attends in place (no copy of any context)
        b, n, t, _ = x.shape
        q, k, v = self._queries_keys_values(x, cos, sin)  # [B, N, T, Hq, D], [B, N, KV, T, D]
        if isinstance(ctx_k, list):
            assert n == 1 and ctx_visible is None, "drafting in place: one block per row"
            out = self._attend_in_place(q[:, 0], k[:, 0], v[:, 0], ctx_k, ctx_v)
        else:
            out = self._attend_blocks(q, k, v, ctx_k, ctx_v, ctx_visible)
        return self.o_proj(out.reshape(b, n, t, -1))

    def attend_taking_in(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        stores: list[tuple[torch.Tensor, torch.Tensor]],
        starts: list[int],
        lengths: list[int],
    ) -> torch.Tensor:
        """Drafting (fused projections): one block per row, and positions its context takes in
        first, in one projection. ``x`` [B, T, H] the normed block; ``ctx`` [S, H] the new
        context positions of every row in turn (``lengths[i]`` of row ``i``, from its context's
        ``starts[i]``); ``cos``, ``sin`` [B*T + S, D] for the block's rows, then the context's;
        ``stores[i]`` row ``i``'s storage of this layer's keys and values (``storage``, room
        reserved). The context's keys and values are written into its storage, the block's
        after them, and each row attends there in place."""
        b, t, width = x.shape
        heads = self.num_heads + self.num_kv_heads
        rows = torch.cat((x.reshape(b * t, width), ctx))  # the context's queries go unused
        qkv = self._fused(rows).unflatten(-1, (heads + self.num_kv_heads, self.head_dim))
        qk = norm_heads(qkv[:, :heads], self._qk_norm_weight, self.q_norm.eps)
        qk = apply_rotary(qk, cos[:, None], sin[:, None])
        k = qk[:, self.num_heads :].transpose(0, 1)  # [KV, B*T + S, D]
        v = qkv[:, heads:].transpose(0, 1)
        q = qk[: b * t, : self.num_heads].unflatten(0, (b, t)).transpose(1, 2)  # [B, Hq, T, D]
        outs, lo = [], b * t
        for i, ((keys, values), start, n) in enumerate(zip(stores, starts, lengths, strict=True)):
            keys[:, start : start + n] = k[:, lo : lo + n]
            values[:, start : start + n] = v[:, lo : lo + n]
            lo += n
            end = start + n + t
            keys[:, start + n : end] = k[:, i * t : (i + 1) * t]
            values[:, start + n : end] = v[:, i * t : (i + 1) * t]
            outs.append(F.scaled_dot_product_attention(
                q[i : i + 1], keys[None, :, :end], values[None, :, :end], enable_gqa=True
            ))  # [1, Hq, T, D]
        return self.o_proj(torch.cat(outs).transpose(1, 2).reshape(b, t, -1))

    @staticmethod
    def _attend_in_place(q, k, v, ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor]):
        # q: [B, T, Hq, D]; k, v: [B, KV, T, D]; ctx_k[i], ctx_v[i]: [KV, len_i + T, D].
        # One call per row: rows of different lengths need no padding (every context copied
        # per step: at 32 rows of 450 positions the draft forward took 27 ms with it, 25 without)
        t = k.shape[2]
        outs = []
        for i, (keys, values) in enumerate(zip(ctx_k, ctx_v, strict=True)):
            keys[:, -t:] = k[i]
            values[:, -t:] = v[i]
            outs.append(F.scaled_dot_product_attention(
                q[i : i + 1].transpose(1, 2), keys[None], values[None], enable_gqa=True
            ))  # [1, Hq, T, D]
        return torch.cat(outs).transpose(1, 2)[:, None]  # [B, 1, T, Hq, D]

    def _attend_blocks(self, q, k, v, ctx_k, ctx_v, ctx_visible) -> torch.Tensor:
        # Many blocks per row (training): every block sees part of one shared context and only its
        # own slots, so scores are built per block instead of one [N*T, S+N*T] masked matrix.
        b, n, t, _, d = q.shape
        groups = self.num_heads // self.num_kv_heads
        q = q * d**-0.5  # scaled here, on the small tensor, rather than on the scores
        q = q.view(b, n, t, self.num_kv_heads, groups, d)
        q = q.permute(0, 3, 4, 1, 2, 5)  # [B, KV, G, N, T, D]
        ctx_scores = torch.einsum("bkgntd,bksd->bkgnts", q, ctx_k)
        own_scores = torch.einsum("bkgntd,bnkud->bkgntu", q, k)  # u: the block's own slots
        if ctx_visible is not None:
            hidden = ~ctx_visible[:, None, None, :, None, :]  # [B, 1, 1, N, 1, S]
            ctx_scores.masked_fill_(hidden, float("-inf"))
        scores = torch.cat((ctx_scores, own_scores), dim=-1)  # [B, KV, G, N, T, S+T]
        probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype)
        ctx_probs, own_probs = probs.split([ctx_k.shape[2], t], dim=-1)
        out = torch.einsum("bkgnts,bksd->bkgntd", ctx_probs, ctx_v) + torch.einsum(
            "bkgntu,bnkud->bkgntd", own_probs, v
        )
        return out.permute(0, 3, 4, 1, 2, 5).reshape(b, n, t, self.num_heads, d)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_visible):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, ctx_visible)
        return x + self.mlp(self.post_attention_layernorm(x))

    def draft_taking_in(self, x, ctx, cos, sin, stores, starts, lengths):
        """``forward`` of one block per row that takes in new context positions first
        (``DraftAttention.attend_taking_in``)."""
        attn = self.self_attn.attend_taking_in(
            self.input_layernorm(x), ctx, cos, sin, stores, starts, lengths)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The draft network. Parameter names are the z-lab checkpoint keys, unprefixed."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_context_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)  # a buffer, not a checkpoint key
        # tau per kind of text on its training run's held-out answers (``train_drafter.json``),
        # when the checkpoint ships it: the router's starting estimate
        self.validation_tau: dict[str, float] | None = None

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., D] for integer ``positions`` [...]."""
        freqs = positions.float()[..., None] * self.rotary.inv_freq  # [..., D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def context_kv(
        self, target_hidden: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, the context's keys and values [B, KV, S, D].

        ``target_hidden`` [B, S, K*H] are the target's captured layers, concatenated in
        ``target_layer_ids`` order; ``positions`` [B, S] their absolute positions.
        """
        ctx = self.hidden_norm(self.fc(target_hidden))  # [B, S, H]
        cos, sin = self.rope(positions, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]] | list[tuple[list, list]],
        ctx_visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [B, N, T, H] of N blocks per row.

        ``block_embeds`` [B, N, T, H]: target embeddings of each block; ``positions`` [B, N, T];
        ``context`` from ``context_kv`` (one [B, KV, S, D] pair per layer); ``ctx_visible``
        [B, N, S] says which context positions each block attends to (None: all). Drafting
        (N = 1), a layer's pair may instead be per-row lists of ``DraftContext.with_room``
        views [KV, len + T, D], their last T positions free for the block's own keys and values.
        """
        cos, sin = self.rope(positions, block_embeds.dtype)
        x = block_embeds
        for layer, (ctx_k, ctx_v) in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, ctx_k, ctx_v, ctx_visible)
        return self.norm(x)

    # --- drafting: one block per request, against each request's cached context ---------------

    def fuse_(self) -> DFlashDrafter:
        """For drafting: let the projections that read the same input run as one matmul
        (``fused``) and norm and rotate query and key heads together: 7% off a block's draft
        forward on the demo drafter, its logits bitwise the same. In place, with the same
        parameter names (the originals become views of the fused weights). Training (with
        gradients) goes through the parameters as before; the query and key norm weights are
        copied, so fuse a drafter after training it."""
        for layer in self.layers:
            fuse_projections_(layer.self_attn)
            fuse_projections_(layer.mlp)
        return self

    def cast_copy(self, device: torch.device, dtype: torch.dtype) -> DFlashDrafter:
        """A new drafter with these weights in ``dtype`` on ``device``, unfused (``fuse_`` it):
        built from the state dict, not deep-copied (a fused projection's oneDNN-reordered weight
        cannot be), and this one left as it is for whoever drafts with it."""
        out = DFlashDrafter(self.cfg)
        out.load_state_dict(self.state_dict())
        out.validation_tau = self.validation_tau
        return out.to(device=device, dtype=dtype).train(self.training)

    def use_onednn_(self, onednn: bool = True, mkl_shapes: frozenset[tuple[int, int]] = frozenset()
                    ) -> DFlashDrafter:
        """Run the fused projections (``fuse_`` first) on oneDNN's matmul (``Linear.onednn``),
        but those of ``mkl_shapes`` ((out, in) features) on MKL's, as the target's exact path
        does where its probe chose oneDNN (an AMD EPYC, where oneDNN's kernels are the faster:
        a tool-call block's draft forward 2.95 -> 2.61 ms, side by side; on a Zen 3 MKL's the
        faster on the narrower projections: ``Products.mkl_shapes``). Drafts need no
        exactness: the target's verification decides."""
        for layer in self.layers:
            for projection in (layer.self_attn._fused, layer.mlp._fused):
                if projection is not None:
                    projection.onednn = onednn and tuple(projection.weight.shape) not in mkl_shapes
                    if not projection.onednn:
                        projection.__dict__.pop("_reordered", None)
        return self

    def new_context(self) -> DraftContext:
        weight = self.fc.weight
        return DraftContext(
            self.cfg.num_layers,
            self.cfg.num_kv_heads,
            self.cfg.head_dim,
            weight.device,
            weight.dtype,
        )

    def context_bytes(self, positions: int) -> int:
        """About the most a request's context holds for ``positions`` tokens: their keys and
        values in every draft layer, a block's room and the storage's slack to grow."""
        capacity = DraftContext.capacity_for(positions + self.cfg.block_size)
        cfg, itemsize = self.cfg, self.fc.weight.element_size()
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * capacity * itemsize

    def hidden_bytes(self, positions: int) -> int:
        """The target's hidden states it reads for ``positions`` tokens [positions, K*H], in its
        dtype (the target's, which it is cast to)."""
        return positions * self.fc.in_features * self.fc.weight.element_size()

    @torch.no_grad()
    def extend(self, contexts: list[DraftContext], target_hidden: list[torch.Tensor]) -> None:
        """Append newly committed positions to each request's context.

        ``target_hidden[i]`` [t_i, K*H] are the target's captured hidden states of the next
        ``t_i`` positions of request ``i`` (they continue at ``contexts[i].length``). All rows are
        projected in one pass.
        """
        assert len(contexts) == len(target_hidden), "one hidden-state chunk per context"
        lengths = [h.shape[0] for h in target_hidden]
        positions = torch.cat(
            [
                c.length + torch.arange(h.shape[0])
                for c, h in zip(contexts, target_hidden, strict=True)
            ]
        )
        hidden = torch.cat(target_hidden).to(self.fc.weight.dtype)[None]  # [1, sum t, K*H]
        per_layer = self.context_kv(hidden, positions.to(hidden.device)[None])
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        for i, ctx in enumerate(contexts):
            lo, hi = offsets[i], offsets[i + 1]
            ctx.append([(k[0, :, lo:hi], v[0, :, lo:hi]) for k, v in per_layer])

    @torch.no_grad()
    def draft_forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        contexts: list[DraftContext],
        pending: list[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, T, H] of one block per request.

        ``block_embeds`` [B, T, H]: the target's embeddings of ``[last token, mask, ...]``;
        ``positions`` [B, T]: absolute positions (slot ``i`` at ``contexts[b].length + i`` when the
        context holds every earlier position); rows may have contexts of different lengths.
        ``pending[b]``: the target's hidden states [n, K*H] of the positions request ``b``
        committed since its context last grew (None: none), taken in first (``extend``), and
        counted in ``positions`` (slot ``i`` at ``length + n + i``). Up to ``TAKE_IN`` of them in
        all are projected in the block's own products, a few calls fewer than ``extend`` and
        then the block (side by side in the engine on 16 tool-call prompts, the demo drafter's
        draft call 4.29 -> 3.89 ms); more (a prompt's) go through ``extend`` first.
        """
        assert block_embeds.shape[0] == len(contexts), "one context per block"
        t = block_embeds.shape[1]
        if pending is not None:
            lengths = [0 if p is None else p.shape[0] for p in pending]
            if self.layers[0].self_attn._drafting and 0 < sum(lengths) <= TAKE_IN:
                return self._draft_taking_in(block_embeds, positions, contexts, pending, lengths)
            rows = [(c, p) for c, p, n in zip(contexts, pending, lengths, strict=True) if n]
            if rows:
                self.extend([c for c, _ in rows], [p for _, p in rows])
        rooms = [[c.with_room(layer, t) for c in contexts] for layer in range(self.cfg.num_layers)]
        kv = [([k for k, _ in room], [v for _, v in room]) for room in rooms]
        return self(block_embeds[:, None], positions[:, None], kv)[:, 0]

    def _draft_taking_in(self, block_embeds, positions, contexts, pending, lengths):
        t = block_embeds.shape[1]
        starts = [c.length for c in contexts]
        hidden = torch.cat([p for p in pending if p is not None]).to(self.fc.weight.dtype)
        ctx = self.hidden_norm(self.fc(hidden))  # [S, H]
        ctx_positions = torch.cat([s + torch.arange(n) for s, n in zip(starts, lengths)])
        rows = torch.cat((positions.reshape(-1), ctx_positions.to(positions.device)))
        cos, sin = self.rope(rows, ctx.dtype)  # [B*T + S, D]
        for c, n in zip(contexts, lengths, strict=True):
            c.reserve(n + t)
        x = block_embeds
        for i, layer in enumerate(self.layers):
            stores = [c.storage(i) for c in contexts]
            x = layer.draft_taking_in(x, ctx, cos, sin, stores, starts, lengths)
        for c, n in zip(contexts, lengths, strict=True):
            c.took_in(n)
        return self.norm(x)
