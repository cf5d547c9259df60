"""Target forwards over a batch of requests, each at its own cache offset.

The rows' new tokens are packed into one sequence, so embeddings, projections, MLPs and the
lm_head run on real tokens only; attention runs per row over its own slot (``LayerCache.attend``).
A prompt's prefill and decoding rows can share a forward without padding each other.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import torch
import torch.nn.functional as F

from agentflash.engine.kv_cache import KVCache
from agentflash.models.qwen3 import (
    EXACT_CHUNK,
    MLP,
    Attention,
    ExactBlockRows,
    ExactMasks,
    ExactTokenRows,
    Linear,
    PackedRows,
    Qwen3Model,
    SingleTokenRows,
    Span,
    batch_invariant_,
    chunk_reach,
    padded_rows,
    query_chunks,
)

log = logging.getLogger(__name__)

MAX_BLOCK = 64  # the longest verify block that attends batched with others (longer: alone)
# verify blocks of different lengths attend batched (exact attention), the shorter ones padded
# with zero queries to the longest, where the queries computed (the longest's length times the
# slots batched over, rows or not) are at most this many times the real ones: padding costs
# attention work that grows with the context, attending apart a fixed cost per row and layer
# (measured on the demo model at 300 cached tokens, side by side: ten blocks of 2-6 tokens beside
# 21 one-token rows 15.4 -> 13.1 ms batched; sixteen blocks of 2-32 tokens all padded to 32,
# twice their queries, 26.8 -> 29.1 ms)
BLOCK_PAD_RATIO = 1.5
# Row counts at which the exactness probe compares a projection's rows with each row alone:
# every count a step of a few requests has, and a spread of prompt lengths up to 2,048
PROBE_ROW_COUNTS = (*range(1, 49), 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
# the sweep of one projection stops at the row count past these multiply-adds (the demo's
# lm_head sweeps every count; a 151k-token lm_head of 4,096 inputs stops after 3 rows)
PROBE_MACS = 4 * 10**9


class Products(NamedTuple):
    """How the exact path's projections run (``Linear``): on oneDNN's matmul or MKL's, their
    rows padded to a multiple of ``row_multiple`` (exact attention's too); with oneDNN, the
    projections of the shapes in ``mkl_shapes`` ((out, in) features) on MKL's, where it
    computes them faster (``mkl_where_faster``)."""

    onednn: bool
    row_multiple: int
    mkl_shapes: frozenset[tuple[int, int]] = frozenset()

    def on_onednn(self, linear: Linear) -> bool:
        """Whether ``linear`` runs on oneDNN's matmul."""
        return self.onednn and tuple(linear.weight.shape) not in self.mkl_shapes

    def __str__(self) -> str:
        kernel = "oneDNN" if self.onednn else "MKL"
        shapes = ", ".join(f"{i}->{o}" for o, i in sorted(self.mkl_shapes, key=lambda s: s[::-1]))
        mkl = f" (MKL for the {shapes} projections)" if shapes else ""
        return f"{kernel}{mkl}, rows padded to a multiple of {self.row_multiple}"


# what the probe tries, in turn: MKL's AVX-512 kernels keep the exact path unpadded; on an AMD
# EPYC (MKL's AVX2 kernels) oneDNN's and MKL's do with rows padded to 4, oneDNN's the faster
EXACT_PRODUCTS = (
    Products(False, 1),
    *((Products(True, 4),) if torch.backends.mkldnn.is_available() else ()),
    Products(False, 4),
    Products(False, 8),
)


@dataclass
class Row:
    """One request's share of a forward: new tokens written from cache position ``start``."""

    slot: int
    start: int
    tokens: list[int]
    last_only: bool = False  # only the last token's logits are wanted (a prompt's first token)


@dataclass
class ForwardOutput:
    """A forward's outputs by row.

    ``logits`` holds row i's at ``[i, :len(row i)]`` (padded with zeros to the longest) or, when
    the row (or the forward) is ``last_only``, its last token's alone at ``[i, 0]``.
    """

    logits: torch.Tensor  # [B, T, V], T the most logits of a row
    # per row [its tokens, K*H]: the captured layers, concatenated (views of one packed tensor:
    # a step that holds a long prompt beside one-token rows pads nothing)
    hidden: list[torch.Tensor] | None


class ModelRunner:
    def __init__(
        self,
        model: Qwen3Model,
        cache: KVCache,
        batch_single_tokens: bool | None = None,
        batch_invariant: bool = True,
        check_exactness: bool = True,
        products: Products = Products(False, 1),
    ):
        """``batch_single_tokens``: attend the one-token rows in one call over their gathered
        slots rather than one call per row. The default does so off the CPU, where calls are
        dear; on the CPU gathering the slots costs more than the calls it saves.

        ``batch_invariant``: on the CPU, make the model's projections batch-invariant
        (``batch_invariant_``) and attend every row with ``exact_attention`` (the cache laid out
        for it; the one-token rows of a forward together, in one batch over their slots, without
        gathering them): a row's logits are then bitwise those it has alone, a verify block's
        those of one-token decoding, and a prompt's keys and values the same however it is cut
        (a prompt prefilled after a cached prefix of it: ``PrefixCache``), so greedy output
        depends neither on the requests a step is shared with, nor on speculation, nor on what
        the prefix cache held. That rests on how this machine's GEMM kernels block their work,
        so it is probed first (``exact_products``, with ``check_exactness``; without it the
        projections run as ``products`` say): the probe picks the projections' kernel and the
        row multiple the products are padded to (``Linear``; MKL's unpadded on its AVX-512
        kernels, oneDNN's padded to 4 on an AMD EPYC); where none keeps a row the same in every
        batch, the runner warns and runs the plain path (``exactness_problem`` says why), whose
        rows agree to rounding only.
        """
        self.model, self.cache = model, cache
        self._group = model.cfg.num_heads // model.cfg.num_kv_heads  # query heads per key head
        self.device = next(model.parameters()).device
        if batch_single_tokens is None:
            batch_single_tokens = self.device.type != "cpu"
        self.batch_single_tokens = batch_single_tokens
        self.batch_invariant = (
            batch_invariant and self.device.type == "cpu" and not batch_single_tokens
        )
        self.exactness_problem: str | None = None  # why the exact path was refused, if it was
        self.products: Products | None = None  # the exact path's projections, if it runs
        if self.batch_invariant:
            batch_invariant_(model)
            self.products, self.exactness_problem = (
                exact_products(model) if check_exactness else (products, None))
            _set_products(model, self.products)
        # the exact path's products' rows padded to a multiple of this
        self.row_multiple = self.products.row_multiple if self.products else 0
        if self.exactness_problem is not None:
            log.warning("exact decoding is off on this machine: %s; greedy output may then "
                        "differ at near ties with the rows a step batches and with speculation",
                        self.exactness_problem)
            self.batch_invariant = False
        if self.batch_invariant:
            cache.lay_out_for_exact_attention_()
            self._masks = ExactMasks(cache.max_capacity, self._group, self.device, cache.dtype,
                                     self.row_multiple)

    @torch.inference_mode()
    def forward(
        self, rows: list[Row], last_only: bool = False, capture_layers: tuple[int, ...] = ()
    ) -> ForwardOutput:
        """Feed every row's tokens causally after its cached prefix; rows may differ in length.

        The rows run as one packed sequence: the forward costs the sum of their tokens, and the
        lm_head runs on the last token alone of a row that is (or of every row when) ``last_only``.
        """
        for r in rows:
            assert r.tokens and r.start + len(r.tokens) <= self.cache.max_len, "forward past a slot"
        assert len({r.slot for r in rows}) == len(rows), "two rows in one slot"
        if self.batch_invariant:  # a thread's first forward (the probe's too): warmed up first
            warm_up_threads()
        self.cache.ensure(max(r.start + len(r.tokens) for r in rows))
        groups = self._block_groups(rows)
        order = self._packing_order(rows, groups)
        packed = [rows[i] for i in order]
        ids = torch.tensor([t for r in packed for t in r.tokens], device=self.device)  # [N]
        positions = [p for r in packed for p in range(r.start, r.start + len(r.tokens))]
        positions = torch.tensor(positions, device=self.device)  # [N]
        caches = self.cache.layer_views(self._layout(packed, [len(g) for g in groups]))
        hidden, captured = self.model(ids[None], positions[None], caches, None, capture_layers)
        begins = [0] * len(rows)  # where each row starts in the packed sequence
        for i, begin in zip(order, accumulate((len(r.tokens) for r in packed), initial=0)):
            begins[i] = begin
        lengths = [len(r.tokens) for r in rows]
        counts = [1 if last_only or r.last_only else len(r.tokens) for r in rows]
        wanted = [p for b, n, c in zip(begins, lengths, counts) for p in range(b + n - c, b + n)]
        if wanted != list(range(hidden.shape[1])):
            hidden = hidden[:, wanted]  # the lm_head runs on these tokens only
        logits_begins = list(accumulate(counts[:-1], initial=0))
        logits = _pad(self.model.logits(hidden[0]), logits_begins, counts)  # [B, T, V]
        context = None
        if captured:
            packed_hidden = torch.cat(captured, dim=-1)[0]  # [N, K*H]
            context = [packed_hidden[b : b + n] for b, n in zip(begins, lengths)]
        return ForwardOutput(logits, context)

    def _packing_order(self, rows: list[Row], groups: list[list[int]]) -> list[int]:
        """Rows in packed order: the one-token rows first when they attend together, then (exact
        attention) the groups of verify blocks that attend together, then the rest."""
        if not (self.batch_single_tokens or self.batch_invariant):
            return list(range(len(rows)))
        singles = [i for i, r in enumerate(rows) if self._single(r)]
        grouped = [i for group in groups for i in group]
        taken = set(singles) | set(grouped)
        return singles + grouped + [i for i in range(len(rows)) if i not in taken]

    def _block_groups(self, rows: list[Row]) -> list[list[int]]:
        """The verify blocks of ``rows`` that attend together (exact attention), by group: from
        the longest block down, each group the most blocks next in length whose batch computes
        at most ``BLOCK_PAD_RATIO`` times their tokens' queries (the longest's length over slots
        ``0 ..`` the highest of theirs: ``exact_attention_blocks``), if two."""
        if not self.batch_invariant:
            return []
        blocks = [i for i, r in enumerate(rows) if self._in_block(r)]
        blocks.sort(key=lambda i: -len(rows[i].tokens))
        groups = []
        while len(blocks) >= 2:
            t, upto, tokens, size = len(rows[blocks[0]].tokens), 0, 0, 1
            for k, i in enumerate(blocks, start=1):  # the cost of the first k blocks
                upto, tokens = max(upto, rows[i].slot + 1), tokens + len(rows[i].tokens)
                if k > 1 and t * upto <= BLOCK_PAD_RATIO * tokens:
                    size = k
            if size > 1:
                groups.append(sorted(blocks[:size]))
            blocks = blocks[size:]  # else the longest attends alone
        return groups

    @staticmethod
    def _in_block(row: Row) -> bool:
        """Whether ``row`` is a verify block that may attend batched with others."""
        return row.start > 0 and 2 <= len(row.tokens) <= MAX_BLOCK

    def _single(self, row: Row) -> bool:
        """Whether ``row`` may attend together with other one-token rows."""
        return len(row.tokens) == 1 and (self.batch_single_tokens or row.start > 0)

    def _layout(self, packed: list[Row], group_sizes: list[int]) -> PackedRows:
        """Which packed tokens belong to which slot, and the masks their attention needs;
        ``group_sizes``: the rows of each group of verify blocks that attend together, packed
        in turn right after the one-token rows (``_packing_order``)."""
        num_single = 0
        if self.batch_single_tokens or self.batch_invariant:
            num_single = next((i for i, r in enumerate(packed) if not self._single(r)), len(packed))
            num_single = num_single if num_single > 1 else 0  # a lone row needs no gathering
        single = None
        if num_single and self.batch_single_tokens:
            single = self._single_token_rows(packed[:num_single])
        elif num_single:  # exact rows: batched over the slots up to theirs, if not too sparse
            upto = 1 + max(r.slot for r in packed[:num_single])
            if upto <= 2 * num_single:
                single = self._exact_token_rows(packed[:num_single], upto)
            else:
                num_single = 0
        # the groups of verify blocks come right after the one-token rows (packed first,
        # batched or not: one token each)
        row = sum(1 for r in packed if self._single(r))
        blocks, grouped, begin = [], set(), row
        for size in group_sizes:
            blocks.append(self._exact_block_rows(packed[row : row + size], begin))
            grouped.update(range(row, row + size))
            begin += blocks[-1].num_tokens
            row += size
        spans, begin = [], num_single
        for i, r in enumerate(packed[num_single:], start=num_single):
            if i in grouped:
                begin += len(r.tokens)
                continue
            end = begin + len(r.tokens)
            t = end - begin
            if self.batch_invariant:  # prompts, decoding and verify rows alike
                biases = tuple(self._masks(r.start + first, n) for first, n in query_chunks(t))
                spans.append(Span(r.slot, r.start, begin, end, None, exact_bias=biases))
            else:
                spans.append(Span(r.slot, r.start, begin, end, self._causal_mask(r.start, t)))
            begin = end
        return PackedRows(single, spans, tuple(blocks))

    def _exact_block_rows(self, rows: list[Row], begin: int) -> ExactBlockRows:
        """Verify blocks ``rows`` (packed from token ``begin``) batched over slots
        ``0 .. upto - 1``, each padded to the longest's ``t`` tokens with zero queries; a
        padded query sees what its row's last token does."""
        lengths = [len(r.tokens) for r in rows]
        t, upto = max(lengths), 1 + max(r.slot for r in rows)
        slots = torch.tensor([r.slot for r in rows], device=self.device)
        token_slots = torch.tensor([r.slot for r in rows for _ in r.tokens], device=self.device)
        positions = [r.start + i for r in rows for i in range(len(r.tokens))]
        last = torch.zeros(upto, t, dtype=torch.long, device=self.device)
        # query i of a slot's block sees keys 0 .. its position (a padded one: the last token's)
        starts = torch.tensor([r.start for r in rows], device=self.device)[:, None]
        ends = torch.tensor(lengths, device=self.device)[:, None] - 1
        last[slots] = starts + torch.arange(t, device=self.device).minimum(ends)  # [B2, t]
        width = -(-max(r.start + n for r, n in zip(rows, lengths)) // EXACT_CHUNK) * EXACT_CHUNK
        bias = self._masks.up_to(last.view(-1), width).view(upto, 1, t, width)
        kv, g = self.model.cfg.num_kv_heads, self._group
        bias = bias.expand(upto, kv * g, t, width).reshape(upto * kv, g * t, width)
        padded = padded_rows(g * t, self.row_multiple)  # padded rows see every key
        if padded > g * t:
            bias = F.pad(bias, (0, 0, 0, padded - g * t))
        reach = chunk_reach([r.slot for r in rows], [r.start + n - 1 for r, n in
                                                     zip(rows, lengths)], upto)
        padded_index = None
        if min(lengths) < t:
            padded_index = torch.tensor([b * t + i for b, n in enumerate(lengths)
                                         for i in range(n)], device=self.device)
        return ExactBlockRows(slots, t, begin, len(positions), upto, token_slots,
                              torch.tensor(positions, device=self.device), bias, reach,
                              padded_index)

    def _exact_token_rows(self, rows: list[Row], upto: int) -> ExactTokenRows:
        """One-token rows for ``exact_attention_rows``: each slot's queries see its row's cached
        prefix; a slot without a row sees its first key (computed, finite, dropped)."""
        positions = torch.tensor([r.start for r in rows], device=self.device)  # [B1]
        slots = torch.tensor([r.slot for r in rows], device=self.device)
        width = -(-(max(r.start for r in rows) + 1) // EXACT_CHUNK) * EXACT_CHUNK
        last = torch.zeros(upto, dtype=torch.long, device=self.device)
        last[slots] = positions
        bias = self._masks.up_to(last, width)  # [upto, L]
        kv, m = self.model.cfg.num_kv_heads, padded_rows(self._group, self.row_multiple)
        bias = bias[:, None, None].expand(upto, kv, m, width).reshape(upto * kv, m, width)
        reach = chunk_reach([r.slot for r in rows], [r.start for r in rows], upto)
        return ExactTokenRows(slots, positions, upto, bias, reach)

    def _causal_mask(self, start: int, t: int) -> torch.Tensor | None:
        """[T, start + T]: new token i sees the prefix and the new tokens up to itself; None when
        every key is visible (one token) or plain causal attention does (no prefix)."""
        if start == 0 or t == 1:
            return None
        query_pos = start + torch.arange(t, device=self.device)[:, None]  # [T, 1]
        return torch.arange(start + t, device=self.device) <= query_pos

    def _single_token_rows(self, rows: list[Row]) -> SingleTokenRows:
        positions = torch.tensor([r.start for r in rows], device=self.device)  # [B1]
        attend_len = max(r.start for r in rows) + 1
        mask = None
        if len({r.start for r in rows}) > 1:
            keys = torch.arange(attend_len, device=self.device)
            mask = (keys <= positions[:, None])[:, None, None]  # [B1, 1, 1, S]
        slots = torch.tensor([r.slot for r in rows], device=self.device)
        return SingleTokenRows(slots, positions, attend_len, mask)


def _pad(packed: torch.Tensor, begins: list[int], lengths: list[int]) -> torch.Tensor:
    """Packed rows [N, F] -> [B, T, F] in row order, T the longest row, zeros after each row."""
    b, t = len(lengths), max(lengths)
    if packed.shape[0] == b * t and begins == list(range(0, b * t, t)):  # in order, one length
        return packed.view(b, t, -1)
    out = packed.new_zeros(b, t, packed.shape[-1])
    for i, (begin, n) in enumerate(zip(begins, lengths)):
        out[i, :n] = packed[begin : begin + n]
    return out


_warmed_up = threading.local()  # .counts: the thread counts this thread has warmed up at


def warm_up_threads() -> None:
    """Run one parallel transcendental op before this thread's model math, once a thread and
    thread count (each thread that runs parallel ops gets its own OpenMP team: the engine's
    stepping thread too).

    Seen on this project's machines (torch 2.13's CPU wheel, 2 threads): in a few percent of
    processes the first such op computes the part of its tensor that the second thread takes
    with other bits (``cos`` of 19,200 numbers: its second half, in the last bits); the same call
    again, and every op after it, got the usual bits. That op was the first forward's rotary
    ``cos``: the forward got other logits, and as it was the exactness probe's, the probe
    refused the exact path for that process (10 of 110 demo engines loaded one evening, 0 of
    110 with this warm-up first). The cause inside torch is not known."""
    counts = getattr(_warmed_up, "counts", None)
    if counts is None:
        counts = _warmed_up.counts = set()
    threads = torch.get_num_threads()
    if threads in counts:
        return
    counts.add(threads)
    x = torch.linspace(0.0, 8.0, 1 << 16)  # 32 grains of ATen's 2,048 numbers: every thread
    x.cos().add_(x.sin()).add_(x.exp())


_probed: weakref.WeakKeyDictionary[Qwen3Model, dict[int, tuple[Products | None, str | None]]] = (
    weakref.WeakKeyDictionary()
)


def exact_products(model: Qwen3Model) -> tuple[Products | None, str | None]:
    """The projections' kernel and row multiple (``Products``) at which the exact path (a model
    made ``batch_invariant_``, attending with exact attention) is bitwise exact on this
    machine's kernels, and None; or None and why none of ``EXACT_PRODUCTS`` is.

    Its bitwise guarantees are not the BLAS library's: they were measured on its kernels (a
    projection's rows are the same for every row count from 2 with column-major weights, on
    MKL's AVX-512 kernels at the demo's widths, not at 896 or 1,024 inputs; on its AVX2
    kernels, as an AMD EPYC gets, and on oneDNN's there, only with the rows padded to a
    multiple of 4). So the probe runs, with each of ``EXACT_PRODUCTS`` in turn, the model's own
    projections at ``PROBE_ROW_COUNTS`` rows, and forwards in which a row is batched, a verify
    block decoded and a prompt cut, against each row alone. A probe, not a proof: it samples
    the shapes a step can have. Where oneDNN's kernels keep it, the projections MKL's compute
    faster move to MKL's (``mkl_where_faster``, ``with_mkl_for``: probed again). Done once per
    model and thread count (the kernels' blocking follows both); the demo model's takes 0.3-0.4
    s a try, and 0.3 s to time the kernels. Leaves the model's projections as the last try had
    them.
    """
    by_threads = _probed.setdefault(model, {})
    threads = torch.get_num_threads()
    if threads not in by_threads:
        problems = []
        with torch.inference_mode():
            for products in EXACT_PRODUCTS:
                _set_products(model, products)
                problem = _probe_projections(model) or _probe_forwards(model, products)
                if problem is None:
                    if products.onednn:
                        faster = mkl_where_faster(list(_linears(model, in_forward=True)),
                                                  products.row_multiple)
                        products = with_mkl_for(model, products, faster)
                    break
                problems.append(f"{problem} ({products})" if problems else problem)
        by_threads[threads] = (None, "; ".join(problems)) if problem else (products, None)
    return by_threads[threads]


def with_mkl_for(model: Qwen3Model, products: Products, shapes: frozenset[tuple[int, int]]
                 ) -> Products:
    """``products`` (on oneDNN, exact) with the projections of ``shapes`` ((out, in) features)
    moved to MKL's kernels, if the exact path stays exact so (probed again), else
    ``products``. Leaves the model's projections as the products returned say."""
    if not shapes:
        return products
    mixed = products._replace(mkl_shapes=shapes)
    _set_products(model, mixed)  # the projections left on oneDNN's kept the probe already
    problem = _probe_projections(model, only=shapes) or _probe_forwards(model, mixed)
    if problem is None:
        return mixed
    log.info("the exact path keeps every projection on oneDNN: with %s, %s", mixed, problem)
    _set_products(model, products)
    return products


# Row counts at which both kernels are timed on a projection: a step of one-token rows, one
# with a verify block, a few rows' blocks. (At a prompt's hundreds of rows the two take about
# the same time; oneDNN's matmul costs some 50 us a call more at the demo's widths on a Zen 3
# EPYC, which its kernels make up for on the lm_head and the MLP's input only.)
KERNEL_TIMING_ROWS = (4, 16, 64)
# a row count is timed on a projection up to these multiply-adds a call (about a millisecond):
# a wide model's lm_head (Qwen3's 151k tokens) is not timed at all, and stays on oneDNN's
KERNEL_TIMING_MACS = 2**26


def mkl_where_faster(
    linears: list[Linear],
    row_multiple: int,
    rows: tuple[int, ...] = KERNEL_TIMING_ROWS,
    rounds: int = 7,
    calls: int = 4,
    margin: float = 0.1,
) -> frozenset[tuple[int, int]]:
    """The shapes ((out, in) features) of ``linears`` whose products of ``rows`` rows (padded
    to ``row_multiple``) MKL's kernels compute in less time than oneDNN's, by more than
    ``margin`` of oneDNN's: the median of ``rounds`` timings of ``calls`` calls at each row
    count (those within ``KERNEL_TIMING_MACS``), summed over them, the kernels taking turns in
    alternating order (a machine's drift lands on both). About 0.3 s on the demo model. Leaves
    every one of ``linears`` on oneDNN's, its rows padded to ``row_multiple``."""
    by_shape: dict[tuple[int, int], Linear] = {}
    for linear in linears:
        linear.onednn, linear.row_multiple = True, row_multiple
        by_shape.setdefault(tuple(linear.weight.shape), linear)
    faster = set()
    with torch.inference_mode():
        for shape, linear in by_shape.items():
            seconds = {True: 0.0, False: 0.0}  # by kernel: oneDNN, MKL
            timed = [n for n in rows if n * linear.weight.numel() <= KERNEL_TIMING_MACS]
            for n in timed:
                x = torch.zeros(n, shape[1], dtype=linear.weight.dtype,
                                device=linear.weight.device)
                times: dict[bool, list[float]] = {True: [], False: []}
                for k in range(rounds + 1):  # the first round warms both up, untimed
                    for onednn in (True, False) if k % 2 else (False, True):
                        linear.onednn = onednn
                        start = time.perf_counter()
                        for _ in range(calls):
                            linear(x)
                        if k:
                            times[onednn].append(time.perf_counter() - start)
                for onednn, ts in times.items():
                    seconds[onednn] += sorted(ts)[len(ts) // 2]
            linear.onednn = True
            if timed and seconds[False] < (1 - margin) * seconds[True]:
                faster.add(shape)
    return frozenset(faster)


def exactness_problem(model: Qwen3Model) -> str | None:
    """Why the exact path is not bitwise exact on this machine's kernels however its
    projections run, or None (``exact_products``)."""
    return exact_products(model)[1]


def _set_products(model: Qwen3Model, products: Products | None) -> None:
    """Every projection of ``model`` run as ``products`` say (None: MKL's, rows unpadded)."""
    for linear in _linears(model):
        linear.onednn = bool(products and products.on_onednn(linear))
        linear.row_multiple = products.row_multiple if products else 0
        if not linear.onednn:
            linear.__dict__.pop("_reordered", None)  # oneDNN's reordered copy, if a try made one


def _linears(model: Qwen3Model, in_forward: bool = False) -> Iterator[Linear]:
    """Every projection of ``model``, the fused ones (not registered submodules) too;
    ``in_forward``: only those an inference forward runs, not the ones a fused projection
    stands for (views of its weight: oneDNN's matmul takes a slow path on such strides)."""
    fused_away = set()
    if in_forward:
        for module in model.modules():
            if isinstance(module, Attention) and module._fused is not None:
                fused_away |= {id(module.q_proj), id(module.k_proj), id(module.v_proj)}
            elif isinstance(module, MLP) and module._fused is not None:
                fused_away |= {id(module.gate_proj), id(module.up_proj)}
    for module in model.modules():
        if isinstance(module, Linear) and id(module) not in fused_away:
            yield module
        elif isinstance(module, Attention | MLP) and module._fused is not None:
            yield module._fused


def _probe_projections(model: Qwen3Model, only: frozenset[tuple[int, int]] | None = None
                       ) -> str | None:
    """Where a projection's row differs from the row alone (first, middle and last rows of a
    batch of each of ``PROBE_ROW_COUNTS``, within ``PROBE_MACS``), or None; ``only``: the
    projections of these shapes ((out, in) features), not every one."""
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for linear in _linears(model, in_forward=True):
        weight = linear.weight
        shape = (*weight.shape, weight.stride(), linear.bias is not None, weight.dtype)
        if shape in seen or (only is not None and tuple(weight.shape) not in only):
            continue
        seen.add(shape)
        probes = torch.randn(3, weight.shape[1], generator=gen).to(weight)
        alone = torch.cat([linear(probes[i : i + 1]) for i in range(3)])
        filler = torch.randn(max(PROBE_ROW_COUNTS), weight.shape[1], generator=gen).to(weight)
        counts = accumulate(PROBE_ROW_COUNTS)  # rows swept so far
        for n, swept in zip(PROBE_ROW_COUNTS, counts):
            if swept * weight.numel() > PROBE_MACS:
                break
            batch = filler[:n].clone()
            where = {0: 0, n // 2: 1, n - 1: 2}  # row -> probe (a later one wins a shared row)
            for row, probe in where.items():
                batch[row] = probes[probe]
            out = linear(batch)
            for row, probe in where.items():
                if not torch.equal(out[row], alone[probe]):
                    return (f"a projection of {weight.shape[1]} to {weight.shape[0]} features "
                            f"gives row {row} of {n} other bits than the row alone")
    return None


def _probe_forwards(model: Qwen3Model, products: Products) -> str | None:
    """Where a forward's row differs from the row alone: rows of each kind batched in one
    step, a verify block against one-token decoding, a prompt prefilled after a cut, verify
    blocks of two lengths attending together against decoding."""
    cfg, device = model.cfg, next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()

    def runner() -> ModelRunner:
        cache = KVCache(cfg, 4, 6 * EXACT_CHUNK, device, model.lm_head.weight.dtype)
        return ModelRunner(model, cache, batch_single_tokens=False, check_exactness=False,
                           products=products)

    alone, mixed = runner(), runner()
    # the first prompt's queries attend in more than one chunk of 128 (``query_chunks``)
    prompts = [tokens(n) for n in (300, 9, 33)]
    whole = [alone.forward([Row(slot, 0, p)]).logits[0] for slot, p in enumerate(prompts)]
    cut = 137  # a prompt prefilled after a cached prefix of it
    mixed.forward([Row(0, 0, prompts[0][:cut])])
    rest = mixed.forward([Row(0, cut, prompts[0][cut:])]).logits[0]
    if not torch.equal(rest, whole[0][cut:]):
        return "a prompt prefilled after a cut of it gets other logits than prefilled whole"
    for slot in (1, 2):
        mixed.forward([Row(slot, 0, prompts[slot])])
    block, first, second, prompt = tokens(16), tokens(1), tokens(1), tokens(3)
    rows = [Row(0, 300, block), Row(1, 9, first), Row(2, 33, second), Row(3, 0, prompt)]
    out = mixed.forward(rows).logits
    decoded = torch.cat([alone.forward([Row(0, 300 + i, [t])]).logits[0] for i, t in
                         enumerate(block)])
    if not torch.equal(out[0], decoded):
        return "a verify block batched with other rows gets other logits than decoding"
    for i, r in enumerate(rows[1:], start=1):
        own = alone.forward([r]).logits[0]
        if not torch.equal(out[i, : own.shape[0]], own):
            return f"a row of {len(r.tokens)} tokens gets other logits batched than alone"
    # verify blocks of two lengths attending in one batch, the shorter padded with zero queries
    # (``exact_attention_blocks``), beside a one-token row
    longer, shorter, third = tokens(16), tokens(12), tokens(1)
    rows = [Row(0, 316, longer), Row(1, 10, shorter), Row(2, 34, third)]
    assert mixed._block_groups(rows) == [[0, 1]], "the probe's blocks attend together"
    out = mixed.forward(rows).logits
    for i, r in enumerate(rows):
        decoded = torch.cat([alone.forward([Row(r.slot, r.start + j, [t])]).logits[0]
                             for j, t in enumerate(r.tokens)])
        if not torch.equal(out[i, : len(r.tokens)], decoded):
            return (f"a verify block of {len(r.tokens)} tokens batched with one of another "
                    "length gets other logits than decoding")
    return None
