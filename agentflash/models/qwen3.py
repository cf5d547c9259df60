"""A compact Qwen3 / Llama decoder that reads Hugging Face safetensors.

The engine runs this instead of transformers' model so that one forward can serve several requests
of different lengths from a slot-based KV cache, verify a block causally, and return the hidden
states of chosen layers for the DFlash drafter. Weight names are the Hugging Face ones, so
``load_state_dict`` takes a ``model.safetensors`` as it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
        if "DFlashDraftModel" in architectures(cfg):
            raise ValueError("this is a DFlash drafter (architectures DFlashDraftModel): give it "
                             "as the drafter (--drafter DIR; to train drafter, --init DIR) "
                             "beside the model it drafts for")
        if model_type not in ("qwen3", "llama", "qwen2"):
            raise ValueError(f"model_type {model_type!r} is not supported (qwen3, qwen2, llama)")
        check_decoder_fields(cfg, model_type)
        try:
            heads = cfg["num_attention_heads"]
            check_sizes(cfg, ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads"))
            check_sizes(cfg, ("num_key_value_heads", "head_dim", "max_position_embeddings"),
                         optional=True)
            if (cfg.get("max_position_embeddings") or 4096) < 2:
                raise ValueError("max_position_embeddings must be at least 2 (a prompt token and "
                                 "one more)")
            if heads % (cfg.get("num_key_value_heads") or heads):
                raise ValueError(f"num_attention_heads {heads} is not a multiple of "
                                 f"num_key_value_heads {cfg['num_key_value_heads']}")
            return cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=head_dim_field(cfg, model_type),
                rope_theta=rope_theta_field(cfg),
                rms_norm_eps=positive_number(cfg, "rms_norm_eps", 1e-6),
                tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
                qk_norm=model_type == "qwen3",
                max_position_embeddings=cfg.get("max_position_embeddings") or 4096,
            )
        except KeyError as err:
            raise ValueError(f"config.json has no field {err.args[0]!r}") from None


def check_decoder_fields(cfg: dict[str, Any], model_type: str) -> None:
    """Refuse what this decoder does not compute, which would load and then write other text
    than the model: scaled rope and sliding-window layers (``check_plain_attention``), another
    activation, biases Llama or Qwen3 may declare."""
    check_plain_attention(cfg, model_type)
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported (silu only)")
    if cfg.get("attention_bias") and model_type != "qwen2":
        raise ValueError("attention_bias is true: biases on the attention projections are not "
                         "supported for this model_type")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias is true: biases on the MLP projections are not supported")


def check_plain_attention(cfg: dict[str, Any], model_type: str = "qwen3") -> None:
    """Refuse a ``config.json`` (a target's or a drafter's) asking for scaled rope (transformers
    4's ``rope_scaling`` or 5's ``rope_parameters``) or sliding-window layers."""
    for field in ("rope_scaling", "rope_parameters"):
        scaling = cfg.get(field) or {}
        if not isinstance(scaling, dict):
            raise ValueError(f"{field} must be an object, got {scaling!r}")
        if scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"{field} {scaling!r} is not supported (plain rope only)")
    types = cfg.get("layer_types") or ["full_attention"]
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ValueError(f"layer_types must be a list of strings, got {types!r}")
    layers = cfg.get("num_hidden_layers")
    if cfg.get("layer_types") and isinstance(layers, int) and 0 < layers != len(types):
        raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers is {layers}")
    kinds = set(types)
    if kinds != {"full_attention"}:
        raise ValueError(f"layer_types {sorted(kinds)}: sliding-window attention is not "
                         f"supported (full attention only)")
    # without layer_types, transformers' Qwen2/Qwen3 make layers from max_window_layers on
    # sliding where use_sliding_window and a sliding_window (absent: its default, 4096) are
    # set; layer_types, where given, decides alone (as it does there); Llama reads neither
    window = cfg.get("sliding_window", 4096)
    if model_type in ("qwen2", "qwen3") and not cfg.get("layer_types") and cfg.get(
            "use_sliding_window") and window is not None:
        first = cfg.get("max_window_layers", 28)
        if not (isinstance(layers, int) and isinstance(first, int)) or first < layers:
            raise ValueError(f"use_sliding_window true with sliding_window {window!r}: layers "
                             f"from max_window_layers {first!r} on (of {layers!r}) are "
                             f"sliding-window attention, which is not supported (full "
                             f"attention only)")


def architectures(cfg: dict[str, Any]) -> list[str]:
    """``architectures`` (absent or null: none), which must be a list of strings."""
    archs = cfg.get("architectures")
    if archs is None:
        return []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"architectures must be a list of strings, got {archs!r}")
    return archs


def check_sizes(cfg: dict[str, Any], names: tuple[str, ...], optional: bool = False) -> None:
    """Each field a positive integer (``optional``: or absent, or null); ``KeyError`` if not
    ``optional`` and missing."""
    for name in names:
        value = cfg.get(name) if optional else cfg[name]
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def head_dim_field(cfg: dict[str, Any], model_type: str) -> int:
    """``head_dim``, or where absent or null transformers' default for ``model_type``: 128 for
    Qwen3 (``Qwen3Config``'s), the hidden size over the heads for Llama and Qwen2 (read after
    ``check_sizes``)."""
    if cfg.get("head_dim") is not None:
        return cfg["head_dim"]
    return 128 if model_type == "qwen3" else cfg["hidden_size"] // cfg["num_attention_heads"]


def rope_theta_field(cfg: dict[str, Any]) -> float:
    """``rope_theta`` (transformers 5's ``rope_parameters`` first; 10000 where absent), a
    positive number or a ``ValueError`` naming the field."""
    params = cfg.get("rope_parameters") or {}
    where = "rope_parameters" if params.get("rope_theta") is not None else None
    theta = params.get("rope_theta") if where else cfg.get("rope_theta")
    if theta is None:
        return 10000.0
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        name = f"{where}.rope_theta" if where else "rope_theta"
        raise ValueError(f"{name} must be a positive number, got {theta!r}")
    return float(theta)


def positive_number(cfg: dict[str, Any], name: str, default: float) -> float:
    """The field ``name``, a positive number (``default`` where absent or null)."""
    value = cfg.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def _flag(cfg: dict[str, Any], name: str) -> bool:
    value = cfg.get(name, False)
    if not isinstance(value, bool):  # "false" read as true tied the lm_head to the embeddings
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


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
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._frequencies(None), persistent=False)

    def _frequencies(self, device: torch.device | None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        return (1.0 / self.theta**exponents).float().to(device)

    def _apply(self, fn, recurse: bool = True):
        # moved with the model, never cast: a bf16 model's frequencies in bf16 (as ``.to``
        # casts buffers) were 0.4% off, a phase error growing with the distance between tokens
        # (1 rad at 1k tokens for Qwen3's rope); transformers keeps them in float32
        super()._apply(fn, recurse)
        self.inv_freq = self._frequencies(self.inv_freq.device)
        return self

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


def padded_rows(n: int, multiple: int) -> int:
    """The rows a batch-invariant product of ``n`` rows runs on (``Linear``, exact attention):
    at least two (one row takes a matrix-vector path), a multiple of ``multiple``."""
    return max(2, -(-n // multiple) * multiple)


class Linear(nn.Linear):
    """``nn.Linear`` that can give a row the same output whatever rows share its matmul.

    CPU GEMM kernels pick their blocking by the number of rows, so a row's output changed in
    its last bits with the batch around it (and greedy decoding followed the change at a near
    tie). With the weight stored column-major, MKL's AVX-512 kernels gave bitwise the same rows
    for every row count from 2 up (measured from 2 to 300); a single row, which takes a
    matrix-vector path, is padded to two (``row_multiple`` 1). The kernels MKL runs on an AMD
    EPYC (its AVX2 ones) give a product of 2 or 3 rows other bits than one of 4 or more, and
    one whose row count is not a multiple of 4 other bits in its first rows: padded with zero
    rows to a multiple of 4 (``row_multiple`` 4), every row count from 1 to 365 gave each row
    the bits it has alone; so did oneDNN's matmul there (``onednn``: its AVX-512 kernels, which
    MKL does not run on that CPU, at 2x the speed of MKL's on a 365-token prefill and 2.6x on
    the lm_head of a one-token row). The exactness probe picks the kernel and the multiple
    (``ModelRunner``); a multiple of 0 leaves the rows as they come. ``batch_invariant_``
    switches a model to this.
    """

    row_multiple = 0
    onednn = False  # oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``), not MKL's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # under autograd (training: a drafter learns through the target's lm_head) as it comes:
        # oneDNN's op has no gradient
        if not self.row_multiple or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        n = x.numel() // x.shape[-1]
        m = padded_rows(n, self.row_multiple)
        if m == n and not self.onednn:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(n, x.shape[-1])
        if m != n:
            rows = F.pad(rows, (0, 0, 0, m - n))
        if self.onednn:
            out = torch.ops.mkldnn._linear_pointwise(rows, self._onednn_weight(), self.bias,
                                                     "none", [], "")
        else:
            out = F.linear(rows, self.weight, self.bias)
        return out[:n].view(*x.shape[:-1], -1)

    def _onednn_weight(self) -> torch.Tensor:
        """The weight as oneDNN's matmul reads it: reordered into its blocked layout once (from
        the row-major copy: the exact path stores weights column-major, as MKL's kernels want
        them), and again whenever the weight changes (its storage or its version). Given the
        stored weight, the matmul reorders it on every call: on the demo model's shapes at 4
        rows (2 threads, AMD EPYC 7002) the lm_head took 171 us that takes 115 reordered once,
        the fused MLP input 81 -> 64, the MLP output 67 -> 46 (at 16 rows 464 -> 298, 139 ->
        127, 86 -> 75), with bitwise the same output. Float32 on the CPU only (oneDNN reorders
        bf16 only where the CPU has AVX-512's bf16 support)."""
        w = self.weight
        if w.dtype != torch.float32 or w.device.type != "cpu":
            return w
        key = (w.data_ptr(), w._version, tuple(w.shape), tuple(w.stride()))
        reordered = self.__dict__.get("_reordered")
        if reordered is None or reordered[0] != key:
            with torch.no_grad():
                rows = w.detach().contiguous()
                reordered = (key, torch.ops.mkldnn._reorder_linear_weight(rows, None))
            self.__dict__["_reordered"] = reordered
        return reordered[1]


def reordered_bytes(net: nn.Module) -> int:
    """Bytes the reordered weights of ``net``'s projections (``Linear._onednn_weight``; the fused
    ones too) hold beside the parameters: counted as their weights' floats (oneDNN's blocked
    layout is opaque; it holds at least as many)."""
    seen, total = set(), 0
    for module in net.modules():
        for linear in (module, getattr(module, "_fused", None)):
            if isinstance(linear, Linear) and id(linear) not in seen:
                seen.add(id(linear))
                if "_reordered" in linear.__dict__:
                    total += linear.weight.numel() * linear.weight.element_size()
    return total


def batch_invariant_(model: nn.Module) -> nn.Module:
    """Make every ``Linear`` of ``model`` give each row the output it has alone (see ``Linear``),
    and let the projections that read the same input run as one (``fused``); in place, the same
    parameter names and shapes. For CPU inference."""
    for module in model.modules():
        if isinstance(module, Linear):
            weight = module.weight.data
            if weight.stride() != (1, weight.shape[0]):
                module.weight.data = weight.t().contiguous().t()
            module.row_multiple = module.row_multiple or 1  # a probed multiple stays
    for module in list(model.modules()):
        if isinstance(module, Attention | MLP):
            fuse_projections_(module)
    return model


def fuse_projections_(module: nn.Module) -> None:
    """Let the projections of an attention (q/k/v) or an MLP (gate/up) that read the same
    input run as one (``fused``), and an attention's query and key heads be normed in one call
    (``norm_heads``; its heads' norm weights side by side, copied). Not registered submodules:
    the parameter names stay the checkpoint's. Nothing to do if already fused."""
    if module._fused is not None:
        return
    if isinstance(module, MLP):
        object.__setattr__(module, "_fused", fused([module.gate_proj, module.up_proj]))
        return
    object.__setattr__(module, "_fused", fused([module.q_proj, module.k_proj, module.v_proj]))
    if module.qk_norm:  # every query head's norm weight, then every key head's
        weight = torch.cat((module.q_norm.weight.detach().expand(module.num_heads, -1),
                            module.k_norm.weight.detach().expand(module.num_kv_heads, -1)))
        object.__setattr__(module, "_qk_norm_weight", weight)


def norm_heads(heads: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm`` of every head of ``heads`` [..., H, D] by its own row of ``weight`` [H, D]
    (bitwise per element what each head's norm gives), query and key heads in one call."""
    normed = F.rms_norm(heads.float(), (heads.shape[-1],), None, eps) * weight.float()
    return normed.to(heads.dtype)


def fused(linears: list[Linear]) -> Linear:
    """One batch-invariant ``Linear`` whose outputs are those of ``linears`` side by side (a
    matmul call instead of several: on the CPU a call costs more than these small products).
    The originals keep their names and become views of its weight, so nothing is stored
    twice."""
    weight = torch.cat([lin.weight.data for lin in linears])
    weight = weight.t().contiguous().t()  # column-major, as ``batch_invariant_`` stores them
    biases = [lin.bias for lin in linears]
    out = Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None)
    out.weight.data = weight
    if out.bias is not None:
        out.bias.data = torch.cat([b.data for b in biases])
    out.row_multiple = 1
    begin = 0
    for lin in linears:
        end = begin + lin.out_features
        lin.weight.data = weight[begin:end]
        if lin.bias is not None:
            lin.bias.data = out.bias.data[begin:end]
        begin = end
    out.requires_grad_(False)
    return out


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    _fused: Linear | None = None  # gate_proj and up_proj as one (``batch_invariant_``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None and not torch.is_grad_enabled():
            gate, up = self._fused(x).split(self.up_proj.out_features, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    _fused: Linear | None = None  # q_proj, k_proj and v_proj as one (``batch_invariant_``)
    _qk_norm_weight: torch.Tensor | None = None  # [heads + kv heads, D], with ``_fused``

    def __init__(self, cfg: ModelConfig, bias: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
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
        if self._fused is not None:
            q, k, v = self._fused_qkv(x, cos, sin)
        else:
            q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
            k = apply_rotary(k.transpose(1, 2), cos, sin)  # [B, KV, T, D]
        if isinstance(cache, LayerCache):  # the engine's packed rows: B = 1, T = all their tokens
            out = cache.attend(q, k, v)
        else:  # rows of one length that attend to what ``write`` returns (training)
            keys, values = cache.write(k, v)  # [B, KV, S, D] with S the attended length
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=mask is None and t > 1, enable_gqa=True
            )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _fused_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [B, H, T, D], keys and values [B, KV, T, D] from one projection, the query
        and key heads normed and rotated together (bitwise the same per element as apart, in
        half the calls: on the CPU a one-token forward pays its calls, not its arithmetic)."""
        b, t, _ = x.shape
        heads, d = self.num_heads + self.num_kv_heads, self.head_dim
        qkv = self._fused(x)
        qk = qkv[..., : heads * d].view(b, t, heads, d)
        if self.qk_norm:
            qk = norm_heads(qk, self._qk_norm_weight, self.q_norm.eps)
        qk = apply_rotary(qk, cos.transpose(1, 2), sin.transpose(1, 2)).transpose(1, 2)
        v = qkv[..., heads * d :].view(b, t, self.num_kv_heads, d).transpose(1, 2)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v


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


@dataclass(frozen=True)
class Span:
    """One row of a packed forward: tokens ``begin:end``, cached in ``slot`` from ``start``."""

    slot: int
    start: int
    begin: int
    end: int
    mask: torch.Tensor | None  # [T, start + T] causal after the prefix; None when not needed
    # attend with ``exact_attention`` under these additive masks [rows, L] (``ExactMasks``),
    # one per ``EXACT_QUERY_CHUNK`` queries: a query's result then does not depend on the block
    # around it (a verify block gives bitwise the logits of one-token decoding, a prompt the
    # same keys and values however it is cut); None: one SDPA call for the row
    exact_bias: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class SingleTokenRows:
    """Rows of one token each, packed first, attended together over their slots padded to ``S``."""

    slots: torch.Tensor  # [B1]
    positions: torch.Tensor  # [B1] where each row's token is cached
    attend_len: int  # S: the longest row's cached length after this forward
    mask: torch.Tensor | None  # [B1, 1, 1, S]: each row's own length; None when all are equal


@dataclass(frozen=True)
class ExactTokenRows:
    """Rows of one token each after a cached prefix, packed first, attended together with
    ``exact_attention_rows``: slots ``0 .. upto - 1`` in one batch (a slot with no row is
    computed and dropped), keys padded to ``width``."""

    slots: torch.Tensor  # [B1]
    positions: torch.Tensor  # [B1] where each row's token is cached
    upto: int  # slots computed: one past the highest slot of a row
    bias: torch.Tensor  # [upto * KV, rows, width]: what each slot's query rows see
    reach: tuple[int, ...]  # per chunk of EXACT_CHUNK keys: the slots computed in it


@dataclass(frozen=True)
class ExactBlockRows:
    """Rows of up to ``t`` tokens each after a cached prefix (verify blocks), packed one after
    the other from token ``begin``, attended together with ``exact_attention_blocks``: slots
    ``0 .. upto - 1`` in one batch (a slot with no row is computed and dropped), a shorter row's
    queries padded with zero queries to ``t``."""

    slots: torch.Tensor  # [B2]
    t: int
    begin: int  # where the first row's tokens are in the packed sequence
    num_tokens: int  # the rows' tokens: B2 * t when no row is shorter
    upto: int  # slots computed: one past the highest slot of a row
    token_slots: torch.Tensor  # [num_tokens]: each token's slot...
    token_positions: torch.Tensor  # [num_tokens]: ...and cache position
    bias: torch.Tensor  # [upto * KV, padded_rows(G * t), width]: what each slot's query rows see
    reach: tuple[int, ...]  # per chunk of EXACT_CHUNK keys: the slots computed in it
    # [num_tokens]: where each token is among the rows padded to t ([B2 * t]); None: unpadded
    padded_index: torch.Tensor | None = None


@dataclass(frozen=True)
class PackedRows:
    """How the tokens of one packed forward [1, N] split into rows of the slot cache."""

    # tokens 0..B1-1, when single-token rows attend together
    single: SingleTokenRows | ExactTokenRows | None
    spans: list[Span]  # every other row, attended alone...
    # ...but verify blocks of about one length, together (each group in one batch)
    blocks: tuple[ExactBlockRows, ...] = ()


class LayerCache:
    """One layer's keys/values in the slot cache during one packed forward.

    ``attend`` writes every row's new keys/values at its own offset, then lets each row attend to
    its slot's cached prefix and its own new tokens, causally; no row pays for another's length.
    """

    def __init__(
        self, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: PackedRows, exact: bool = False
    ):
        # [num_slots, KV, max_len, D]; with ``exact`` (``KVCache.lay_out_for_exact_attention_``)
        # the keys are stored transposed under that view and the values are
        # [max_len / EXACT_CHUNK, num_slots, KV, EXACT_CHUNK, D]
        self.k_pool, self.v_pool = k_pool, v_pool
        self.rows, self.exact = rows, exact

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, H, N, D]; k, v: [1, KV, N, D] -> [1, H, N, D]
        outs = [(span.begin, self._attend_span(span, q, k, v)) for span in self.rows.spans]
        if isinstance(self.rows.single, ExactTokenRows):
            exact = exact_attention_rows(q, k, v, self.k_pool, self.v_pool, self.rows.single)
            outs.append((0, exact))
        elif self.rows.single is not None:
            outs.append((0, self._attend_single(self.rows.single, q, k, v)))
        for blocks in self.rows.blocks:
            exact = exact_attention_blocks(q, k, v, self.k_pool, self.v_pool, blocks)
            outs.append((blocks.begin, exact))
        outs.sort(key=lambda part: part[0])  # in packed order
        return outs[0][1] if len(outs) == 1 else torch.cat([out for _, out in outs], dim=2)

    def _attend_span(
        self, span: Span, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        t = span.end - span.begin
        q, k, v = (x.narrow(2, span.begin, t) for x in (q, k, v))  # [1, *, T, D]
        k_slot = self.k_pool[span.slot]  # [KV, max_len, D]
        k_slot.narrow(1, span.start, t).copy_(k[0])
        if self.exact:
            write_value_chunks(self.v_pool, span.slot, span.start, v[0])
            outs = [
                exact_attention(q.narrow(2, first, n), k_slot, self.v_pool, span.slot, bias)
                for (first, n), bias in zip(query_chunks(t), span.exact_bias, strict=True)
            ]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        v_slot = self.v_pool[span.slot]
        v_slot.narrow(1, span.start, t).copy_(v[0])
        if span.start > 0:  # the cached prefix and the new tokens: [1, KV, start + T, D]
            k, v = k_slot[None, :, : span.start + t], v_slot[None, :, : span.start + t]
        causal = span.start == 0 and t > 1
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=span.mask, is_causal=causal, enable_gqa=True
        )

    def _attend_single(
        self, rows: SingleTokenRows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        b1 = rows.slots.shape[0]
        self.k_pool[rows.slots, :, rows.positions] = k[0, :, :b1].transpose(0, 1)  # [B1, KV, D]
        self.v_pool[rows.slots, :, rows.positions] = v[0, :, :b1].transpose(0, 1)
        keys = self.k_pool[:, :, : rows.attend_len].index_select(0, rows.slots)  # [B1, KV, S, D]
        values = self.v_pool[:, :, : rows.attend_len].index_select(0, rows.slots)
        q = q[0, :, :b1].transpose(0, 1)[:, :, None]  # [B1, H, 1, D]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=rows.mask, enable_gqa=True)
        return out[:, :, 0].transpose(0, 1)[None]  # [1, H, B1, D]


EXACT_CHUNK = 64  # keys per partial product in ``exact_attention``
# a long row's queries attend in chunks of this many, each chunk to the keys up to its last
# query (bitwise the same: see ``exact_attention``): causal attention does half the work, and a
# chunk's scores stay in the CPU's cache (a 470-token prompt's attention 2x faster, 2 threads)
EXACT_QUERY_CHUNK = 128


def query_chunks(t: int) -> list[tuple[int, int]]:
    """(first query, size) of each ``EXACT_QUERY_CHUNK`` of a ``t``-token row."""
    return [(first, min(EXACT_QUERY_CHUNK, t - first)) for first in range(0, t, EXACT_QUERY_CHUNK)]


class ExactMasks:
    """Additive masks [rows, L] for ``exact_attention``, cut as views from one step vector.

    For ``t`` queries cached from ``start``, with ``group`` query heads per key head, row
    ``j * t + i`` is query ``i`` of a group's head ``j`` and sees keys ``0 .. start + i``; L is
    ``start + t`` rounded up to ``EXACT_CHUNK``. The rows are padded to ``padded_rows`` (with
    ``row_multiple``, as the projections are; ``exact_attention`` pads its queries with zeros to
    them); a padded row sees every key (a one-token row's sees what the row does). A one-token
    row's mask is a view: no tensor is built per row and step.
    """

    def __init__(
        self,
        capacity: int,
        group: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        row_multiple: int = 1,
    ):
        self.capacity, self.group, self.row_multiple = capacity, group, row_multiple
        inf = torch.full((capacity,), float("-inf"), device=device, dtype=dtype)
        zeros = torch.zeros(capacity, device=device, dtype=dtype)
        self._steps = torch.cat((zeros, inf))  # [2 * capacity], in the scores' dtype

    def __call__(self, start: int, t: int) -> torch.Tensor:
        width = -(-(start + t) // EXACT_CHUNK) * EXACT_CHUNK
        windows = self._steps.unfold(0, width, 1)  # window o: 0 up to key capacity - 1 - o
        first = self.capacity - start - t  # the window of query t - 1; query i's is + (t-1-i)
        rows = padded_rows(self.group * t, self.row_multiple)
        if t == 1:
            return windows[first][None].expand(rows, width)
        bias = windows[first : first + t].flip(0).repeat(self.group, 1)
        return F.pad(bias, (0, 0, 0, rows - bias.shape[0])) if rows > bias.shape[0] else bias

    def up_to(self, last: torch.Tensor, width: int) -> torch.Tensor:
        """[len(last), width]: row i sees keys ``0 .. last[i]``."""
        return self._steps.unfold(0, width, 1)[self.capacity - 1 - last]


def write_value_chunks(v_pool: torch.Tensor, slot: int, start: int, v: torch.Tensor) -> None:
    """Write values v [KV, T, D] at positions ``start ..`` of ``slot`` in a pool stored in chunks
    [max_len / EXACT_CHUNK, slots, KV, EXACT_CHUNK, D]."""
    pos, end = start, start + v.shape[1]
    while pos < end:
        chunk, offset = divmod(pos, EXACT_CHUNK)
        n = min(end - pos, EXACT_CHUNK - offset)
        v_pool[chunk, slot, :, offset : offset + n] = v[:, pos - start : pos - start + n]
        pos += n


def exact_attention(
    q: torch.Tensor, k_slot: torch.Tensor, v_pool: torch.Tensor, slot: int, bias: torch.Tensor
) -> torch.Tensor:
    """Causal attention of one row's new queries over its slot, each query's result bitwise the
    same whatever block it comes in (a verify block's are those of one-token decoding) and
    whatever rows share the step (``exact_attention_rows`` gives a one-token row the same).

    q [1, H, T, D]; k_slot [KV, capacity, D] with the keys stored transposed; v_pool
    [capacity / EXACT_CHUNK, slots, KV, EXACT_CHUNK, D]; bias from ``ExactMasks``. Measured on
    the CPU kernels: a query row's scores are bitwise the same for any number of rows from 2 and
    any number of keys when the keys are stored transposed; softmax is unchanged by extra masked
    keys; and the weighted sum of values is a sum, chunk after chunk, of ``EXACT_CHUNK``-key
    partial products, so extra masked keys only add exact zeros (one product over all keys
    rounds differently with the row count). The query rows are padded with zeros to the mask's
    rows (``padded_rows``: a lone row, as the one-row kernels round differently; and on some
    kernels to a multiple of 4, see ``Linear``). About 50-75 us a call at 400 keys where SDPA
    takes 20-35 us, and a 16-token verify block 120-180 us where 16 one-query SDPA calls took
    560 us (2 threads, demo model's heads).
    """
    kv, d = k_slot.shape[0], k_slot.shape[-1]
    rows, width = bias.shape
    t = q.shape[2]
    queries = q[0].reshape(kv, -1, d)  # [KV, group * T, D]: row j * T + i is head j's query i
    if queries.shape[1] < rows:  # padded to the mask's rows
        queries = F.pad(queries, (0, 0, 0, rows - queries.shape[1]))
    keys = k_slot.transpose(1, 2)[:, :, :width]  # [KV, D, L], rows contiguous
    probs = torch.softmax(torch.baddbmm(bias, queries, keys, alpha=d**-0.5), dim=-1)
    n = width // EXACT_CHUNK
    out = torch.stack(
        [
            sum_chunks(torch.bmm(
                probs[h].view(rows, n, EXACT_CHUNK).transpose(0, 1),  # [n, rows, C]
                v_pool[:n, slot, h],  # [n, C, D]
            ))  # [rows, D]: the chunks' partial products summed, chunk after chunk
            for h in range(kv)
        ]
    )  # [KV, rows, D]
    return out[:, : q.shape[1] // kv * t].reshape(1, -1, t, d)  # the real rows, as [1, H, T, D]


def exact_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    rows: ExactTokenRows,
) -> torch.Tensor:
    """``exact_attention`` for the one-token rows packed first (``rows``), in one batch over
    slots ``0 .. upto - 1`` (``_attend_slots``). Writes their keys and values.
    q [1, H, N, D]; k, v [1, KV, N, D]; returns [1, H, B1, D]."""
    b1 = rows.slots.shape[0]
    kv, d = k.shape[1], k.shape[-1]
    group = q.shape[1] // kv
    _write_tokens(k_pool, v_pool, rows.slots, rows.positions, k[0, :, :b1], v[0, :, :b1])
    m = rows.bias.shape[1]  # query rows per slot and key head: the group, padded (zeros)
    mine = q[0, :, :b1].transpose(0, 1).reshape(b1, kv, group, d)  # [B1, KV, G, D]
    queries = q.new_zeros(rows.upto, kv, m, d)
    queries[rows.slots, :, :group] = mine
    out = _attend_slots(queries, k_pool, v_pool, rows.bias, rows.reach)
    out = out.index_select(0, rows.slots)
    return out[:, :, :group].reshape(b1, kv * group, d).transpose(0, 1)[None]  # [1, H, B1, D]


def exact_attention_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    rows: ExactBlockRows,
) -> torch.Tensor:
    """``exact_attention`` for rows of up to ``rows.t`` tokens each (verify blocks), in one batch
    over slots ``0 .. upto - 1`` (``_attend_slots``): each (slot, key head) has its ``G * t``
    query rows, as a block of ``t`` tokens alone; a shorter row's missing tokens are zero
    queries, computed and dropped (a query row's result does not depend on the other rows').
    Writes their keys and values. q [1, H, N, D]; k, v [1, KV, N, D]; returns
    [1, H, num_tokens, D] for the packed tokens ``begin .. begin + num_tokens``."""
    b2, t = rows.slots.shape[0], rows.t
    kv, d = k.shape[1], k.shape[-1]
    group = q.shape[1] // kv
    lo, hi = rows.begin, rows.begin + rows.num_tokens
    _write_tokens(k_pool, v_pool, rows.token_slots, rows.token_positions, k[0, :, lo:hi],
                  v[0, :, lo:hi])
    mine = q[0, :, lo:hi]  # [H, num_tokens, D]
    if rows.padded_index is not None:  # each row's tokens at its place among t
        mine = mine.new_zeros(kv * group, b2 * t, d).index_copy_(1, rows.padded_index, mine)
    m = group * t  # then zero rows up to the mask's (``padded_rows``)
    # row g * t + i of a (slot, key head): query head g's token i, as in ``exact_attention``
    mine = mine.reshape(kv, group, b2, t, d).permute(2, 0, 1, 3, 4).reshape(b2, kv, m, d)
    queries = q.new_zeros(rows.upto, kv, rows.bias.shape[1], d)
    queries[rows.slots, :, :m] = mine
    out = _attend_slots(queries, k_pool, v_pool, rows.bias, rows.reach)
    out = out.index_select(0, rows.slots)[:, :, :m]
    out = out.reshape(b2, kv, group, t, d).permute(1, 2, 0, 3, 4).reshape(kv * group, b2 * t, d)
    if rows.padded_index is not None:
        out = out.index_select(1, rows.padded_index)
    return out[None]


def _write_tokens(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write keys and values k, v [KV, N, D] of N tokens at ``positions`` [N] of ``slots`` [N]
    (keys stored transposed, values in ``EXACT_CHUNK`` chunks)."""
    k_pool[slots, :, positions] = k.transpose(0, 1)  # [N, KV, D]
    chunk, offset = positions // EXACT_CHUNK, positions % EXACT_CHUNK
    v_pool[chunk, slots, :, offset] = v.transpose(0, 1)


def _attend_slots(
    queries: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    bias: torch.Tensor,
    reach: Sequence[int],
) -> torch.Tensor:
    """Exact attention of queries [upto, KV, m, D] over slots ``0 .. upto - 1``, one batch
    element per (slot, key head) under ``bias`` [upto * KV, m, L]: the products of
    ``exact_attention``, so each query row's result is bitwise what it gets alone (keys padded
    to a common width change neither the softmax nor the chunk sums). ``reach[c]``: the slots
    ``0 .. reach[c] - 1`` whose rows see keys in chunk ``c`` (``chunk_reach``); the other slots'
    partial products there are exact zeros (their keys are masked), so they are not computed.
    Where every slot reaches every chunk of a pool of ``upto`` slots, the partial products are
    one batched call (bitwise the same as a call per chunk, checked on random pools of 1 to 32
    slots); else one call per chunk over its slots, reading the values in place (a batch over
    chunks of fewer slots than the pool's would copy them: at 8 rows in a pool of 32 slots,
    2 MB a layer). Returns [upto, KV, m, D]."""
    upto, kv, m, d = queries.shape
    slots, width = upto * kv, bias.shape[-1]
    keys = k_pool[:upto].transpose(2, 3).reshape(slots, d, -1)[:, :, :width]
    n = width // EXACT_CHUNK
    assert len(reach) == n, "one reach per chunk of keys"
    scores = torch.baddbmm(bias, queries.view(slots, m, d), keys, alpha=d**-0.5)
    probs = torch.softmax(scores, dim=-1)  # [slots * KV, m, L]
    # every chunk's probabilities: [n * slots * KV, m, C], chunk after chunk
    chunked = probs.view(slots, m, n, EXACT_CHUNK).permute(2, 0, 1, 3).reshape(n * slots, m, -1)
    if upto == v_pool.shape[1] and all(r == upto for r in reach):
        values = v_pool[:n].view(n * slots, EXACT_CHUNK, d)
        parts = torch.bmm(chunked, values).view(n, slots, m, d)
    else:
        parts = queries.new_zeros(n, slots, m, d)
        for c, r in enumerate(reach):
            torch.bmm(chunked[c * slots : c * slots + r * kv],
                      v_pool[c, :r].view(r * kv, EXACT_CHUNK, d), out=parts[c, : r * kv])
    return sum_chunks(parts).view(upto, kv, m, d)


def chunk_reach(slots: Sequence[int], last: Sequence[int], upto: int) -> tuple[int, ...]:
    """For ``_attend_slots``: per chunk of ``EXACT_CHUNK`` keys up to the furthest of ``last``
    (each row's last key, the row in ``slots``), how many leading slots have a row that sees a
    key in it. Chunk 0 computes every slot up to ``upto`` (a slot without a row sees its first
    key: computed, finite, dropped)."""
    n = max(last) // EXACT_CHUNK + 1
    reach = [upto] + [0] * (n - 1)
    for slot, key in zip(slots, last, strict=True):
        for c in range(1, key // EXACT_CHUNK + 1):
            reach[c] = max(reach[c], slot + 1)
    return tuple(reach)


def sum_chunks(parts: torch.Tensor) -> torch.Tensor:
    """``parts`` [n, ...] summed over its first dimension, bitwise the same whatever all-zero
    chunks follow (the keys past a query's last, masked). Measured on the CPU kernels: a sum
    over the first dimension is so where each chunk holds a multiple of 32 numbers (a head of
    64 or 128 always does), not otherwise (16-number heads at an odd number of rows); other
    chunks are padded to a multiple of 64 numbers first."""
    inner = parts.numel() // parts.shape[0]  # no view made: this runs per head and layer
    if inner % 64 == 0:
        return parts.sum(0)
    padded = F.pad(parts.reshape(parts.shape[0], inner), (0, -inner % 64))
    return padded.sum(0)[:inner].view(parts.shape[1:])


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
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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

        ``capture_layers`` are 0-based layer indices; what is taken of layer ``i`` is what
        Hugging Face calls ``hidden_states[i + 1]``: its output, and for the last layer the
        final-normed states (as HF's, the features a z-lab or SpecForge drafter was trained on).
        """
        x = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        captured = []
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, caches[i], mask)
            if i in capture_layers:
                captured.append(x)
        x = self.model.norm(x)
        if len(self.model.layers) - 1 in capture_layers:
            captured[-1] = x
        return x, captured

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
