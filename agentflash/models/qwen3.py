"""A compact Qwen3 / Llama decoder that reads Hugging Face safetensors.

The engine runs this instead of transformers' model so that one forward can serve several requests
of different lengths from a slot-based KV cache, verify a block causally, and return the hidden
states of chosen layers for the DFlash drafter. Weight names are the Hugging Face ones, so
``load_state_dict`` takes a ``model.safetensors`` as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Hugging Face ``config.json`` that the decoder needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3 normalises queries and keys per head; Llama does not
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed ``config.json``; raises ``ValueError`` naming a missing field."""
        model_type = cfg.get("model_type")
        if model_type not in ("qwen3", "llama", "qwen2"):
            raise ValueError(f"model_type {model_type!r} is not supported (qwen3, qwen2, llama)")
        scaling = cfg.get("rope_scaling") or {}
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling {scaling!r} is not supported")
        try:
            heads = cfg["num_attention_heads"]
            return cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                rope_theta=float(_rope_theta(cfg)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qk_norm=model_type == "qwen3",
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            )
        except KeyError as err:
            raise ValueError(f"config.json has no field {err.args[0]!r}") from None


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return params.get("rope_theta") or cfg.get("rope_theta") or 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding, half-split layout as in Hugging Face Qwen3/Llama."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerCache,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = apply_rotary(k.transpose(1, 2), cos, sin)  # [B, KV, T, D]
        keys, values = cache.write(k, v)  # [B, KV, S, D] with S the attended length
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None and t > 1, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_bias: bool = False):
        super().__init__()
        self.self_attn = Attention(cfg, bias=attn_bias)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LayerCache:
    """Where one layer reads and writes keys/values during one forward.

    ``write`` stores the new keys/values of every row at its own offset and returns the keys and
    values that the forward attends to (all rows padded to the same length ``S``).
    """

    def __init__(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: torch.Tensor,
        write_pos: torch.Tensor,
        attend_len: int,
    ):
        self.k_pool, self.v_pool = k_pool, v_pool  # [num_slots, KV, max_len, D]
        self.slots, self.write_pos, self.attend_len = slots, write_pos, attend_len

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: [B, KV, T, D]; write_pos: [B, T] absolute cache positions
        b, _, t, _ = k.shape
        if b == 1:
            s = int(self.slots[0])
            start = int(self.write_pos[0, 0])
            self.k_pool[s, :, start : start + t] = k[0]
            self.v_pool[s, :, start : start + t] = v[0]
            return (
                self.k_pool[s : s + 1, :, : self.attend_len],
                self.v_pool[s : s + 1, :, : self.attend_len],
            )
        rows = self.slots[:, None].expand(b, t)
        self.k_pool[rows, :, self.write_pos] = k.transpose(1, 2)
        self.v_pool[rows, :, self.write_pos] = v.transpose(1, 2)
        return self.k_pool[self.slots, :, : self.attend_len], self.v_pool[
            self.slots, :, : self.attend_len
        ]


class Qwen3Model(nn.Module):
    """Decoder stack with Hugging Face parameter names (``model.*`` and ``lm_head``)."""

    def __init__(self, cfg: ModelConfig, attn_bias: bool = False):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(
            DecoderLayer(cfg, attn_bias) for _ in range(cfg.num_layers)
        )
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[LayerCache],
        mask: torch.Tensor | None,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the stack; returns final-normed hidden states [B, T, H] and captured layer outputs.

        ``capture_layers`` are 0-based layer indices; the output of layer ``i`` is what Hugging
        Face calls ``hidden_states[i + 1]``.
        """
        x = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        captured = []
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, caches[i], mask)
            if i in capture_layers:
                captured.append(x)
        return self.model.norm(x), captured

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
