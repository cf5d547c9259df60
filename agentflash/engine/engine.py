"""The embedded inference engine: requests in, one batched step at a time, tokens out."""

from __future__ import annotations

import inspect
import json
import logging
import math
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jinja2
import torch

from agentflash.dflash.speculate import accept_choices, draft_logits, lookup_draft
from agentflash.engine.detokenizer import OutputDecoder, StepText, StopCheck
from agentflash.engine.kv_cache import KVCache, whole_chunks
from agentflash.engine.limits import limit_problems
from agentflash.engine.model_runner import ModelRunner, Row
from agentflash.engine.prefix_cache import PrefixCache, PrefixHit
from agentflash.engine.request import FinishReason, Request, SamplingParams, Speculation, Status
from agentflash.engine.sampling import accept, argmax, sample
from agentflash.engine.scheduler import Scheduler, SchedulerConfig
from agentflash.errors import ChatTemplateError, UserError, is_int
from agentflash.grammar.constraint import GrammarFailed, apply_bitmask_, greedy_verify
from agentflash.grammar.sources import GrammarKind
from agentflash.grammar.tokenizers import chat_end_ids
from agentflash.models.qwen3 import reordered_bytes
from agentflash.router.policy import (
    AGREEMENT,
    FORK_ODDS,
    MAX_SLOTS,
    Candidate,
    CostModel,
    StepShape,
    fork_odds,
    priors_from_validation,
)
from agentflash.router.segments import SegmentKind
from agentflash.tool_format import parse_tool_calls

log = logging.getLogger(__name__)

# a greedy constrained row's draft ends at the walk's WALK_FIXES-th fixed slot (a drafted token
# the grammar forbade, ``constrained_draft``'s ``max_fixes``): past it the verify almost never
# accepts (bench prompts, demo: 5 of 22 blocks past a tool call's 2nd fix-up, none of 61 in JSON),
# and the slots cost grammar time and verify positions; at 3, JSON's grammar time fell 14% and its
# request CPU time 7%, tool calls' were unchanged (at 2 their tau fell 6%)
WALK_FIXES: int | None = 3


@dataclass(frozen=True)
class EngineConfig:
    """Where the engine runs and how much it holds at once."""

    device: str = "cpu"
    max_running: int = 8  # requests decoding together; each owns a KV-cache slot
    max_len: int = 2048  # tokens per request (prompt + output)
    # caps the slots to the requests of max_len tokens that fit (their keys and values, and the
    # drafter's context of each and the hidden states each keeps for the prefix cache); None:
    # max_running slots
    kv_budget_mb: float | None = None
    # CPU: a row's logits bitwise the same whatever shares its step, and a verify block's
    # those of one-token decoding (ModelRunner); costs a lone one-token forward about 13% on
    # MKL's AVX-512 kernels (its row is padded to two: half the two-row kernel, half the
    # padding), about 2% on an AMD EPYC (oneDNN's kernels, rows padded to four, where 8 rows,
    # verify blocks and prefills cost a third less than the plain path's); exact attention costs
    # about what SDPA does (a prompt's prefill about 8% more at 200-470 tokens, 20% at 900), and
    # a prompt prefilled after a cached prefix has bitwise the keys and values it has prefilled
    # whole
    batch_invariant: bool = True
    # prompts' keys and values kept after their prefill (``PrefixCache``), so that a prompt that
    # begins the same way (an agent's next turn) prefills only what is new; 0: none
    prefix_cache_mb: float = 64.0

    def __post_init__(self) -> None:
        problems = limit_problems(self.max_running, self.max_len, self.prefix_cache_mb,
                                  self.kv_budget_mb)
        if problems:
            raise ValueError(problems[0][1])
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must name a torch device (cpu, cuda, cuda:1, ...), "
                             f"got {self.device!r}") from None
        if device.type not in ("cpu", "cuda"):  # mps, xpu, meta: a torch error deep in a load
            raise ValueError(f"device {self.device!r}: the engine runs on cpu or cuda")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: this torch has no CUDA device")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {self.device!r}: this machine has "
                             f"{torch.cuda.device_count()} CUDA devices")


@dataclass(frozen=True)
class MemoryUse:
    """Bytes the engine's requests hold beyond the weights (the KV pool that holds their keys
    and values, grown to its longest request, is ``Engine.kv_pool_bytes``)."""

    kv: int = 0  # the target's keys and values of the live requests' tokens
    draft: int = 0  # the live requests' drafter contexts (their storage, room to grow included)
    prefix: int = 0  # the prefix cache's entries (keys, values and, for drafting, hidden states)
    # the target hidden states the live drafting requests keep for their finished sequences'
    # entries (``Engine._keep_sequence``), but what an entry holds already (their prompts')
    kept: int = 0

    @property
    def total(self) -> int:
        return self.kv + self.draft + self.prefix + self.kept

    def max(self, other: MemoryUse) -> MemoryUse:
        """Each part's larger value (peaks of the parts, which need not fall on one step)."""
        return MemoryUse(max(self.kv, other.kv), max(self.draft, other.draft),
                         max(self.prefix, other.prefix), max(self.kept, other.kept))


@dataclass(frozen=True)
class BlockDraft:
    """What one row feeds the verify forward after its last token."""

    tokens: list[int]
    forced: int  # how many of them the grammar forced (free: no model proposed them)
    drafted: bool  # whether the drafter ran for this row this step
    masks: torch.Tensor | None = None  # verify masks along the tokens, if the draft made them
    looked_up: bool = False  # the tokens came from the request's own text (``lookup_draft``)
    # the draft not verified that begins as this one does (the drafter's block and a lookup):
    # the verify says how far it would have stood (``CostModel.observe_agreement``)
    rival: list[int] | None = None
    rival_slots: int = 0  # a looked-up row's: the slots the drafter filled in its rival
    # the leading tokens (a forced run) the request's grammar committed already: a greedy row's
    # run goes into the grammar before its walk, which starts after it (nothing is consumed
    # twice), and its verify accepts it without a look (the mask of a forced state allows its
    # forced token alone)
    committed: int = 0

    @property
    def slots(self) -> int:
        """Draft slots the drafter filled for this row (0 where it did not run)."""
        if not self.drafted:
            return 0
        if self.looked_up:
            return self.rival_slots
        return len(self.tokens) - self.forced


@dataclass
class StepOutput:
    """What one step did for one request."""

    request: Request
    new_ids: list[int]


@dataclass
class GenerationResult:
    """A finished request, as ``agentflash generate --json`` prints it."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict[str, Any]
    error: str | None = None  # why the engine failed the request (finish_reason "error")
    grammar_limit: bool = False  # ...its grammar reached a limit (``GrammarFailed.limit``)
    # the reply may hold tool calls (``SamplingParams.tool_calls``): without tools a
    # <tool_call> is text like any, and no call (as serve reads it)
    calls_in_text: bool = True

    def to_dict(self) -> dict[str, Any]:
        calls, _ = parse_tool_calls(self.text) if self.calls_in_text else ([], [])
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "tool_calls": [c.to_dict() for c in calls],
            "finish_reason": self.finish_reason,
            "stats": self.stats,
        }
        if self.error is not None:
            out["error"] = self.error
        return out


class Engine:
    """Owns the model, its KV cache and the scheduler; ``step()`` runs one target forward."""

    def __init__(
        self,
        model,
        tokenizer,
        config: EngineConfig = EngineConfig(),
        model_dir: Path | None = None,
        drafter=None,
    ):
        self.model, self.tokenizer, self.config, self.model_dir = (
            model,
            tokenizer,
            config,
            model_dir,
        )
        self.decode_output = OutputDecoder(tokenizer)  # a reply's text of its tokens
        self._markers = marker_pattern(tokenizer)  # (inert_markers)
        self.drafter = drafter  # a DFlashDrafter, or None for plain decoding only
        if drafter is not None:
            weight, own = next(model.parameters()), next(drafter.parameters())
            if (own.dtype, own.device) != (weight.dtype, weight.device):  # it reads the target's
                # states: a copy as loaded for it (another engine may draft with this one)
                drafter = self.drafter = drafter.cast_copy(weight.device, weight.dtype)
            drafter.fuse_()
        max_len = min(config.max_len, model.cfg.max_position_embeddings)
        dtype = next(model.parameters()).dtype
        budget = config.prefix_cache_mb * 2**20  # past 1.7e302 MB an infinity: no bound
        self.prefix_cache = PrefixCache(int(budget) if budget < math.inf else sys.maxsize)
        slots = num_slots(model.cfg, config, max_len, dtype, drafter, self.prefix_cache)
        try:
            self.cache = KVCache(model.cfg, slots, max_len, torch.device(config.device), dtype)
        except RuntimeError as err:  # out of memory: say which setting asked for it
            raise UserError(f"cannot allocate the KV cache for max_running {slots} (lower it, or "
                            f"set kv_budget_mb): {str(err).splitlines()[0]}") from None
        self.runner = ModelRunner(model, self.cache, batch_invariant=config.batch_invariant)
        if drafter is not None:  # the drafter follows the target onto oneDNN's kernels
            products = self.runner.products
            drafter.use_onednn_(products is not None and products.onednn,
                                products.mkl_shapes if products else frozenset())
        self.scheduler = Scheduler(SchedulerConfig(slots, max_len), self.cache)
        self.eos_ids = end_of_turn_ids(tokenizer, model_dir)
        self.cost = self.new_router_state()  # what the router has measured of this engine
        self._inbox: deque[Request] = deque()  # filled from any thread, drained by step()
        # the thread that alone may step this engine while an AsyncEngine serves it
        self.stepping_thread: int | None = None
        self._cancels: deque[Request] = deque()
        # the most held at once since ``reset_memory_peak`` (``memory_in_use`` after each forward)
        self.memory_peak = MemoryUse()
        self.peak_total_bytes = 0
        self._kv_bytes_per_token = 2 * sum(k.shape[1] * k.shape[3] * k.element_size()
                                           for k in self.cache.k)

    def new_router_state(self) -> CostModel:
        """A router state that has measured nothing yet: its tau per kind starts from the
        drafter's validation tau, where it has one."""
        cost = CostModel()
        if self.drafter is not None and self.drafter.validation_tau:
            cost.prior_tau.update(priors_from_validation(self.drafter.validation_tau))
        return cost

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path = "demo",
        config: EngineConfig = EngineConfig(),
        drafter: str | Path | None = "auto",
    ) -> Engine:
        """Load a Hugging Face causal-LM directory (or ``demo``) with its tokenizer.

        ``drafter``: a DFlash drafter directory, ``demo``, ``None`` for none, or ``auto`` (the
        demo drafter for the demo model, none otherwise).
        """
        from agentflash.dflash.checkpoint import load_drafter_config
        from agentflash.models.loading import (
            drafter_dir,
            load_drafter_for,
            load_model,
            load_tokenizer,
            resolve_drafter,
        )

        drafter = resolve_drafter(model, drafter)
        if drafter is not None:  # a bad drafter is named before the target takes its time
            load_drafter_config(drafter_dir(drafter))
        net, _, model_dir = load_model(model, device=config.device)
        draft_net = load_drafter_for(net, drafter, config.device) if drafter is not None else None
        return cls(net, load_tokenizer(model_dir, net.cfg.vocab_size), config, model_dir,
                   draft_net)

    # --- prompts ---------------------------------------------------------------------------

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` under the model's chat template, ready for the reply.
        ``template_kwargs`` are variables of the template (Qwen3's ``enable_thinking``)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"{self.model_dir}: the tokenizer has no chat template")
        self.check_template_kwargs(template_kwargs)
        messages = inert_markers(messages, self._markers)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=True,
                **(template_kwargs or {}),
            )
        except jinja2.TemplateSyntaxError as err:
            file = self.model_dir and Path(self.model_dir) / "chat_template.jinja"
            where = str(file) if file and file.is_file() else f"{self.model_dir}: chat template"
            raise ChatTemplateError(f"{where}:{err.lineno}: {err.message}",
                                    f"line {err.lineno}: {err.message}") from None
        except jinja2.TemplateError as err:  # the template's raise_exception, or a missing part
            raise ChatTemplateError(f"{self.model_dir}: the chat template refused these "
                                    f"messages: {err}", str(err)) from None
        except Exception as err:  # what its own expressions raise ("'str' / 'int'")
            reason = f"{type(err).__name__}: {err}"
            raise ChatTemplateError(f"{self.model_dir}: the chat template failed on these "
                                    f"messages: {reason}", reason) from None
        from agentflash.inputs import check_unicode  # callers name the field; this, the rest

        check_unicode(text, "the chat prompt (messages, tools or instructions)")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def check_template_kwargs(self, template_kwargs: dict[str, Any] | None) -> None:
        """``check_template_kwargs`` for this engine's tokenizer (its class's method: ``self``
        is a parameter too)."""
        check_template_kwargs(template_kwargs, type(self.tokenizer).apply_chat_template)

    # --- requests --------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request; safe to call from any thread."""
        self.check_prompt(prompt_ids)
        vocab = self.model.cfg.vocab_size
        bad = next((t for t in params.stop_token_ids if not _is_token(t, vocab)), None)
        if bad is not None:
            raise UserError(f"stop_token_ids holds {bad!r}, outside the vocabulary "
                            f"(0..{vocab - 1})")
        if params.speculation is Speculation.DFLASH and self.drafter is None:
            raise UserError("speculation dflash needs a drafter, and this engine has none "
                            "(Engine.from_pretrained(..., drafter=DIR or 'demo'); or speculation "
                            "auto or off)")
        req = Request([int(t) for t in prompt_ids], params)
        req.step_text = StepText(self.decode_output)
        if params.stop:
            req.stop_check = StopCheck(self.decode_output, params.stop, params.tool_calls)
        if params.grammar is not None:
            req.constraint = self.compile(params.grammar).new_constraint()
            answers = params.grammar.answers_in_schema  # text outside calls: the answer
            req.segments.schema_bound = params.grammar.kind is GrammarKind.JSON_SCHEMA or answers
            req.segments.calls_beside = answers
        self._inbox.append(req)
        return req

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """A ``UserError`` unless ``prompt_ids`` are token ids of this model that leave room for
        one new token within ``max_len`` (what ``submit`` checks first)."""
        if not isinstance(prompt_ids, (list, tuple)):
            raise UserError(f"the prompt must be a list of token ids, got "
                            f"{type(prompt_ids).__name__}")
        if not prompt_ids:
            raise UserError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        # one bad id would fail every step this request shares, so none gets that far (a list
        # of Python ints in range, the common case, is checked in a few C loops: per id in
        # Python, a 340-token prompt took 0.8 ms)
        plain_ints = set(map(type, prompt_ids)) == {int}
        if plain_ints and 0 <= min(prompt_ids) and max(prompt_ids) < vocab:
            bad = None
        else:
            bad = next((i for i, t in enumerate(prompt_ids) if not _is_token(t, vocab)), None)
        if bad is not None:
            raise UserError(f"prompt token {bad} is {prompt_ids[bad]!r}; token ids are integers "
                            f"in the vocabulary (0..{vocab - 1})")
        limit = self.scheduler.cfg.max_len
        if len(prompt_ids) + 1 > limit:
            raise UserError(
                f"the prompt has {len(prompt_ids)} tokens; this engine holds {limit} per request "
                f"(max_len), a prompt of at most {limit - 1} and a token of reply"
            )

    def compile(self, source):  # -> agentflash.grammar.CompiledGrammar
        """A grammar source compiled for this engine's tokenizer and vocabulary (cached)."""
        from agentflash.grammar import compile_grammar

        return compile_grammar(
            source,
            self.tokenizer,
            vocab_size=self.model.cfg.vocab_size,
            eos_token_id=self.tokenizer.eos_token_id,
        )

    def cancel(self, req: Request) -> None:
        """Stop a request at the next step and free its cache slot; safe from any thread."""
        self._cancels.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self._inbox or self._cancels or self.scheduler.has_work)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One scheduling decision and one target forward; returns the tokens it produced.

        The forward holds every decoding request's verify row (its last token, then its draft or
        forced run) and the prompts of newly admitted requests, each row at its own offset.
        """
        self._check_stepping_thread()
        self._drain_inbox()
        admitted, decoding = self.scheduler.schedule()
        if not admitted and not decoding:
            return []
        self.cost.begin_step()
        t0 = time.perf_counter()
        for req in admitted:
            if self.drafter is not None and req.params.speculation is not Speculation.OFF:
                req.stats.mode = req.params.speculation.value
                req.draft_context = self.drafter.new_context()
        hits = {r.id: self._reuse_prefix(r) for r in admitted}
        leads = {r.id: self._lead(r) for r in admitted}
        kinds = {r.id: r.segments.kind for r in decoding}
        drafting = [r for r in decoding if r.draft_context is not None]
        sizes = {r.id: self._draft_len(r, kinds[r.id]) for r in drafting}
        found = self._lookups(decoding, kinds, sizes)
        speculating = self._route(decoding, kinds, sizes, found)
        routed = {r.id for r in speculating}
        drafts = self._draft(speculating, sizes, kinds, found)
        drafts.update(self._forced_runs([r for r in decoding if r.id not in drafts]))
        # their grammar failed
        failed = [StepOutput(r, []) for r in decoding + admitted if r.is_finished]
        decoding = [r for r in decoding if not r.is_finished]
        admitted = [r for r in admitted if not r.is_finished]
        rows = [Row(r.slot, r.num_cached, r.uncached_ids() + drafts[r.id].tokens) for r in decoding]
        rows += [Row(r.slot, r.num_cached, r.uncached_ids() + leads[r.id], last_only=True)
                 for r in admitted]
        if not rows:  # every request of the step failed before the forward
            return failed
        tracked = any(r.draft_context is not None for r in decoding + admitted)
        out = self.runner.forward(rows, capture_layers=self._capture(tracked))
        self._note_memory(decoding + admitted, rows)
        self._mask_verify_logits(decoding, drafts, out.logits)
        # greedy rows' choices, every position of every row in one call (sampling rows and
        # constrained rows' masked positions read their logits again)
        top = argmax(out.logits).tolist()
        outputs = failed + [
            self._isolated(
                req, self._settle, req, i, drafts[req.id], out, kinds[req.id], req.id in routed,
                top[i],
            )
            if not req.is_finished  # else its masks failed: it ends with nothing new
            else StepOutput(req, [])
            for i, req in enumerate(decoding)
        ]
        outputs += [
            self._isolated(req, self._first_token, req, len(decoding) + i, rows[len(decoding) + i],
                           out, top[len(decoding) + i][0], hits[req.id], leads[req.id])
            for i, req in enumerate(admitted)
        ]
        seconds = time.perf_counter() - t0
        drafted = [d for d in drafts.values() if d.drafted]
        shape = StepShape(
            rows=len(decoding),
            tokens=sum(len(r.tokens) for r in rows[: len(decoding)]),
            block_rows=sum(len(r.tokens) > 1 for r in rows[: len(decoding)]),
            drafted_rows=len(drafted),
            draft_slots=sum(d.slots for d in drafted),
        )
        if decoding and not admitted:  # prompts would blur what a decode step costs
            self.cost.observe_step(shape, seconds)
        return outputs

    def _isolated(self, req: Request, work, *args) -> StepOutput:
        """``work(*args)`` for one request; if it raises, that request alone fails."""
        try:
            return work(*args)
        except Exception as err:  # the request's own state (its grammar) broke: end it alone
            self._fail_alone(req, err)
            return StepOutput(req, [])

    def _fail_alone(self, req: Request, err: Exception) -> None:
        if req.is_finished:  # failed already in this step (another path met the same state)
            return
        if isinstance(err, GrammarFailed):  # the request's grammar, not the engine: no traceback
            log.warning("request %d failed (%s); the other requests go on", req.id, err)
        else:
            log.exception("request %d failed; the other requests go on", req.id)
        req.grammar_limit = isinstance(err, GrammarFailed) and err.limit
        self.fail(req, f"{type(err).__name__}: {err}")

    def _lead(self, req: Request) -> list[int]:
        """The tokens a newly admitted request's grammar forces before its first choice (a tool
        call's opening up to its name, a JSON answer's first key), fed to the target with its
        prompt: the prompt's forward then yields the first token the model chooses, and the
        first verify's slots are all the drafter's. Within the room left but one; none without
        a grammar (or where it failed: the request then fails alone). A request with room for
        one token takes the first forced one here: the grammar's, not the model's choice."""
        forced = self._forced_tokens(req)
        return forced[: max(1, self._room(req) - 1)] if forced else []

    def _first_token(
        self, req: Request, i: int, row: Row, out, top: int, hit: PrefixHit | None,
        lead: list[int],
    ) -> StepOutput:
        """A newly admitted request after its prompt's forward: the ``lead`` its grammar forced
        (fed after the prompt), then its first token of its own (``top``: its logits' argmax).
        ``hit``: the cached beginning of its prompt it started from."""
        req.num_cached = row.start + len(row.tokens)
        hidden = out.hidden[i] if out.hidden is not None else None
        if req.draft_context is not None:
            req.pending_hidden.append(hidden)
        fed = len(row.tokens) - len(lead)  # the prompt's tokens the forward fed
        self._keep_prompt(req, hidden[:fed] if hidden is not None else None, hit)
        mode = "plain"  # no draft: the prompt's forward chose it (a later step's segment of
        # the same kind takes it in, in that step's mode: ``SegmentTracker.record``)
        forced: list[int] = []
        if lead:
            if req.kept_hidden is not None:
                self._keep(req, hidden[fed:].clone())
            forced = self._commit(req, lead)
            start = len(req.output_ids) - len(forced)
            for n in range(1, len(forced) + 1):  # a token at a time, each in the segment it
                # opens or is in: nothing chose them, so a required call's <tool_call> is the
                # call's, not prose
                req.segments.feed(req.step_text.delta(req.output_ids, start + n))
                req.segments.record(req.segments.kind, mode, 1, 0, forced=1, accepted=1)
            if req.is_finished:  # a stop among them
                req.stats.first_step_tokens = len(forced)
                return StepOutput(req, forced)
        logits = out.logits[i, 0]  # a last_only row's one row of logits
        in_grammar = False  # the constraint has committed the token already
        if req.params.is_greedy and req.constraint is None:
            token = top
        elif req.params.is_greedy:
            with grammar_clock([req]):
                _, token = greedy_verify(req.constraint, [], logits[None], top=[top], commit=True)
            in_grammar = True
        else:
            if req.constraint is not None:
                with grammar_clock([req]):
                    apply_bitmask_(logits, req.constraint.bitmask())
            token = sample(logits, req.params.temperature, req.params.top_p, req.generator)
        committed = self._commit(req, [token], in_grammar)
        self._check_kept(req)
        self._track(req, req.segments.kind, mode, committed, 0)
        req.stats.first_step_tokens = len(forced) + len(committed)
        return StepOutput(req, forced + committed)

    def _reuse_prefix(self, req: Request) -> PrefixHit | None:
        """Start a newly admitted request's cache slot (and drafter context) from the longest
        cached beginning of its prompt, if any."""
        hit = self.prefix_cache.lookup(req.prompt_ids, with_hidden=req.draft_context is not None)
        if hit is None:
            return None
        self.cache.write(req.slot, [t[:, : hit.length] for t in hit.entry.kv])
        req.num_cached = req.stats.cached_prompt_tokens = hit.length
        if req.draft_context is not None:
            req.pending_hidden.append(hit.entry.hidden[: hit.length])
        return hit

    def _keep_prompt(
        self, req: Request, hidden: torch.Tensor | None, hit: PrefixHit | None
    ) -> None:
        """Offer the prefilled prompt's keys and values to the prefix cache, with its hidden
        states when the forward captured them (``hidden``: those of the tokens it fed); a
        drafting request keeps them for its finished sequence too (``_keep_sequence``)."""
        if self.prefix_cache.budget_bytes <= 0:
            return
        if hit is not None and hit.entry.hidden is None:
            hidden = None  # the prompt's entry holds keys and values alone, as the hit's
        if hidden is not None and not self._may_keep(len(req.prompt_ids)):
            return  # no entry of its states fits the budget, now or as it grows: none copied
        if hidden is not None:  # a copy, not a view that keeps the whole step's states alive
            hidden = hidden.clone() if hit is None else torch.cat(
                (hit.entry.hidden[: hit.length], hidden))
        if hidden is not None and req.draft_context is not None:
            req.kept_hidden, req.kept_bytes = [], 0
            self._keep(req, hidden)
        self._offer(req.prompt_ids, req.slot, hidden)

    def _keep(self, req: Request, hidden: torch.Tensor) -> None:
        """Keep the hidden states of ``req``'s next cached positions for its sequence's entry."""
        req.kept_hidden.append(hidden)
        req.kept_bytes += hidden.nbytes

    def _check_kept(self, req: Request) -> None:
        """After a commit that left ``req`` running: stop keeping its hidden states (and free
        them) once no entry of its cached positions could fit the prefix cache. Its sequence's
        entry, when it finishes, is at least that long."""
        if req.kept_hidden is not None and not self._may_keep(req.num_cached):
            req.kept_hidden, req.kept_bytes = None, 0

    def _may_keep(self, length: int) -> bool:
        """Whether an entry with hidden states of ``length`` positions or more, as many as the
        prefix cache keeps at least, could fit its budget."""
        return self.prefix_cache.fits(
            self._entry_bytes(max(length, self.prefix_cache.min_tokens), with_hidden=True))

    def _entry_bytes(self, length: int, with_hidden: bool) -> int:
        """A prefix-cache entry's bytes (``PrefixEntry.num_bytes``)."""
        hidden = self.drafter.hidden_bytes(length) if with_hidden else 0
        return self._kv_bytes_per_token * length + hidden

    def _keep_sequence(self, req: Request) -> None:
        """Offer a finished request's prompt and answer (every position in its slot) to the
        prefix cache: an agent's next turn begins with both, wherever the chat template renders
        the answer as the model wrote it. On the CPU a decoded position's keys, values and hidden
        states are bitwise those a prefill of the same tokens computes, so a hit changes no
        output here either."""
        n = min(req.num_cached, req.num_tokens)
        if self.prefix_cache.budget_bytes <= 0 or req.slot is None or n <= len(req.prompt_ids):
            return  # nothing past the prompt, which is kept already
        if req.draft_context is not None and req.kept_hidden is None:
            return  # its entry, hidden states and all, cannot fit (``_check_kept``)
        hidden = _first_rows(req.kept_hidden, n) if req.kept_hidden is not None else None
        req.kept_hidden, req.kept_bytes = None, 0
        if hidden is not None and len(hidden) < n:
            hidden = None
        self._offer(req.all_ids[:n], req.slot, hidden)

    def _offer(self, tokens: list[int], slot: int, hidden: torch.Tensor | None) -> None:
        """Copy the keys and values of ``tokens`` (positions ``0 ..`` of ``slot``) into the
        prefix cache, unless they are too few, more than its budget holds or an entry holds them
        already."""
        cache, with_hidden = self.prefix_cache, hidden is not None
        if (len(tokens) < cache.min_tokens
                or not cache.fits(self._entry_bytes(len(tokens), with_hidden))
                or cache.covers(tokens, with_hidden=with_hidden)):
            return
        cache.insert(tokens, self.cache.cached(slot, len(tokens)), hidden)
        # the entry beside the slot it was copied from (and the step's other requests): more
        # than the forward's note, where a request's last step keeps its answer
        self._note_memory(list(self.scheduler.running))

    def _settle(
        self,
        req: Request,
        i: int,
        draft: BlockDraft,
        out,
        kind: SegmentKind,
        routed: bool,
        top: list[int],
    ) -> StepOutput:
        """A decoding request after the verify forward: accept a prefix of its draft, commit it
        with the target's next token, and keep the hidden states its drafter will need.
        ``top``: the argmax of the row's logits at each position."""
        logits = out.logits[i, : len(draft.tokens) + 1]  # [T+1, V]: row j predicts after slot j
        top = top[: len(draft.tokens) + 1]
        in_grammar = False  # the constraint has committed the accepted tokens already
        if req.params.is_greedy and req.constraint is None:
            num_accepted, bonus = accept_choices(draft.tokens, top)
        elif req.params.is_greedy:  # masks made where needed; the grammar advances as it goes
            run = draft.committed  # in the grammar already, accepted (a forced run)
            with grammar_clock([req]):
                num_accepted, bonus = greedy_verify(req.constraint, draft.tokens[run:],
                                                    logits[run:], draft.masks, top[run:],
                                                    commit=True)
            num_accepted += run
            in_grammar = True
        else:  # sampling rows' logits were masked at every position (_mask_verify_logits)
            num_accepted, bonus = accept(
                torch.tensor(draft.tokens, dtype=torch.long), logits, req.params, req.generator
            )
        req.stats.target_forwards += 1
        req.num_cached += 1 + num_accepted
        fed = out.hidden[i][: 1 + num_accepted] if out.hidden is not None else None
        if req.kept_hidden is not None:  # before the commit: a stop there keeps the sequence
            if fed is None:
                req.kept_hidden, req.kept_bytes = None, 0
            else:
                self._keep(req, fed.clone())  # not a view of the whole step's states
        committed = self._commit(req, draft.tokens[:num_accepted] + [bonus], in_grammar)
        self._check_kept(req)
        # a stop among the accepted drafts ends the request there: the drafts after it were
        # never needed, and the target's choice after the end (not a token it would write) says
        # nothing of the drafter; counted as a miss, every answer's last verify was one
        accepted, drafted = num_accepted, len(draft.tokens)
        if req.is_finished and len(committed) <= num_accepted:
            accepted = drafted = len(committed)
        if draft.rival is not None and accepted == num_accepted:  # not cut short by a stop
            self.cost.observe_agreement(kind, draft.tokens, num_accepted, bonus, draft.rival,
                                        draft.looked_up)
        if draft.drafted and not draft.looked_up:
            self.cost.observe_draft(req.routing, kind, accepted, drafted)
        elif draft.looked_up and draft.rival is None:
            self.cost.observe_lookup(req.routing, accepted, drafted)
        self._track(req, kind, "dflash" if routed else "plain", committed, 1, draft, num_accepted)
        if req.draft_context is not None and not req.is_finished:
            # projected into the drafter's context when the request next drafts
            req.pending_hidden.append(fed)
        return StepOutput(req, committed)

    def _commit(self, req: Request, tokens: list[int], in_grammar: bool = False) -> list[int]:
        """Append ``tokens`` (``append_tokens``) and advance the request's grammar over what was
        appended, unless ``in_grammar``: its constraint committed them all already (where a stop
        condition cuts them short, the request finishes and its constraint is not read again)."""
        committed = self.append_tokens(req, tokens)
        if req.constraint is not None and not in_grammar:
            with grammar_clock([req]):
                req.constraint.advance(committed)
        return committed

    def _mask_verify_logits(
        self, batch: list[Request], drafts: dict[int, BlockDraft], logits: torch.Tensor
    ) -> None:
        """Mask every verify position of constrained sampling rows along their draft path, in
        place (greedy rows need few masks: ``greedy_verify`` makes them as it settles)."""
        rows = [
            i for i, r in enumerate(batch) if r.constraint is not None and not r.params.is_greedy
        ]
        if not rows:
            return
        with grammar_clock([batch[i] for i in rows]):
            self._mask_rows(batch, rows, drafts, logits)

    def _mask_rows(
        self, batch: list[Request], rows: list[int], drafts: dict[int, BlockDraft], logits
    ) -> None:
        """The masks of ``rows`` along their drafts, applied; a row whose grammar fails ends.
        Constrained drafts bring their masks; the others' are walked here."""
        from agentflash.grammar import masks_along_drafts

        walked = []
        for i in rows:
            draft = drafts[batch[i].id]
            if draft.masks is None:
                walked.append(i)
            else:
                apply_bitmask_(logits[i, : draft.masks.shape[0]], draft.masks)
        rows = walked
        try:
            masks = masks_along_drafts(
                [batch[i].constraint for i in rows], [drafts[batch[i].id].tokens for i in rows]
            )
        except Exception:  # find the rows at fault: each of them fails alone
            masks = [None] * len(rows)
            for n, i in enumerate(rows):
                try:
                    masks[n] = batch[i].constraint.masks_along_draft(drafts[batch[i].id].tokens)
                except Exception as err:
                    self._fail_alone(batch[i], err)
        for i, mask in zip(rows, masks):
            if mask is not None:
                apply_bitmask_(logits[i, : mask.shape[0]], mask)

    def _lookups(self, decoding: list[Request], kinds: dict[int, SegmentKind],
                 sizes: dict[int, int]) -> dict[int, list[int]]:
        """Each row's own text as a draft (``lookup_draft``), for the rows where the router
        would verify one rather than the drafter's block if found: found before the plan, which
        prices a row by the draft it would verify."""
        found = {}
        for r in decoding:
            size = sizes.get(r.id, 0)
            if size <= 0 or r.draft_context is None:
                continue
            longest = self._lookup_limit(r, size)
            # no search when even the longest lookup would lose to the drafter (the common case)
            if self.cost.lookup_slots(r.routing, kinds[r.id], size, longest) > 0:
                found[r.id] = lookup_draft(r.all_ids, longest)
        return found

    def _route(
        self,
        decoding: list[Request],
        kinds: dict[int, SegmentKind],
        sizes: dict[int, int],
        found: dict[int, list[int]],
    ) -> list[Request]:
        """The rows that draft this step: those that asked for DFlash, and those whose drafts
        the router expects to save the batch more time than they add to its step."""
        able = [r for r in decoding if sizes.get(r.id, 0) > 0]
        if not able:
            return []
        candidates = [
            Candidate(r.routing, kinds[r.id], sizes[r.id],
                      forced=r.params.speculation is Speculation.DFLASH,
                      backlog=r.num_cached - r.draft_context.length,  # positions to project
                      lookup=len(found.get(r.id, ())))
            for r in able
        ]
        chosen = self.cost.plan(len(decoding), candidates)
        return [r for r, yes in zip(able, chosen) if yes]

    def _track(
        self,
        req: Request,
        kind: SegmentKind,
        mode: str,
        committed: list[int],
        forwards: int,
        draft: BlockDraft | None = None,
        accepted: int = 0,
    ) -> None:
        drafted = len(draft.tokens) - draft.forced if draft else 0
        forced = draft.forced if draft else 0
        req.segments.record(
            kind,
            mode,
            len(committed),
            forwards,
            drafted=drafted,
            forced=forced,
            accepted=min(accepted, len(committed)),
        )
        req.segments.feed(req.step_text.delta(req.output_ids, len(req.output_ids)))

    def _draft(
        self, reqs: list[Request], sizes: dict[int, int], kinds: dict[int, SegmentKind],
        found: dict[int, list[int]],
    ) -> dict[int, BlockDraft]:
        """One drafter forward for the requests that speculate this step.

        A constrained row whose grammar forces a run that fills every slot the drafter would
        fill needs no drafter this step: it verifies the whole forced run, even past the block.
        A shorter run leaves the drafter the slots after it. Unconstrained rows
        take the drafter's argmax per slot; constrained rows walk the drafter's slots under their
        grammar (every drafted token legal, forced tokens filled in for free): the router's size
        counts the tokens the drafter proposes, and a forced run where the walk ends goes into
        the draft whole.
        """
        if not reqs:
            return {}
        drafts, forced_now = {}, {}
        slots = self.drafter.cfg.block_size - 1
        for r in reqs:
            forced = forced_now[r.id] = self._forced_tokens(r)
            if forced is not None and sizes[r.id] > 0 and len(forced) >= max(slots, sizes[r.id]):
                run = forced[: max(0, self._room(r) - 1)]
                drafts[r.id] = BlockDraft(run, len(run), False,
                                          committed=self._commit_run(r, run))
        reqs = [r for r in reqs if sizes[r.id] > 0 and r.id not in drafts and not r.is_finished]
        for r in reqs:
            looked_up = self._lookup(r, sizes[r.id], kinds[r.id], found.get(r.id, []))
            if looked_up is not None:
                drafts[r.id] = looked_up
        reqs = [r for r in reqs if r.id not in drafts and not r.is_finished]
        if not reqs:
            return drafts
        # the drafter fills at least its trained block (its slots attend to each other, so a
        # shorter block of masks is text it never saw: on the demo drafter, tau fell from 5.3
        # to 3.9 on tool calls at the same verified lengths); rows verify their first
        # ``sizes[r.id]`` drafts
        block = max(self.drafter.cfg.block_size, max(sizes[r.id] for r in reqs) + 1)
        last = torch.tensor([r.output_ids[-1] for r in reqs])
        # the target hidden states committed since each row last drafted: its context takes
        # them in within the draft forward
        pending = [torch.cat(r.pending_hidden) if r.pending_hidden else None for r in reqs]
        for r in reqs:
            r.pending_hidden.clear()
        contexts = [r.draft_context for r in reqs]
        # the slots verified: an unconstrained row's size; a constrained row walks every slot
        # (the grammar's forced tokens fill some of them without counting)
        slots = max(block - 1 if r.constraint is not None else sizes[r.id] for r in reqs)
        logits = draft_logits(
            self.drafter, self.model.embed, self.model.logits, last, contexts, block, slots,
            pending,
        )  # [B, slots, V]
        best = argmax(logits)  # [B, slots]
        for i, r in enumerate(reqs):
            r.stats.draft_forwards += 1
            n = sizes[r.id]
            if r.constraint is None:
                drafts[r.id] = self._agreed(r, kinds[r.id], BlockDraft(best[i, :n].tolist(), 0,
                                                                       True), logits[i])
                continue
            from agentflash.grammar import constrained_draft

            room = self._room(r) - 1
            # a greedy row's forced run goes into its grammar now: the walk starts after it
            run = forced_now[r.id][:room] if r.params.is_greedy else []
            if run and not self._commit_run(r, run):
                continue  # its grammar failed
            try:
                with grammar_clock([r]):
                    walk = constrained_draft(r.constraint, logits[i, len(run):],
                                             best[i, len(run):].tolist(), max_drafted=n,
                                             max_tokens=room - len(run),
                                             forced_now=[] if run else forced_now[r.id],
                                             with_masks=not r.params.is_greedy,
                                             max_fixes=WALK_FIXES if r.params.is_greedy
                                             else None)
            except Exception as err:
                self._fail_alone(r, err)
                continue
            drafts[r.id] = self._agreed(
                r, kinds[r.id], BlockDraft(run + walk.tokens, len(run) + walk.num_forced, True,
                                           walk.masks, committed=len(run)),
                logits[i])
        return drafts

    def _commit_run(self, req: Request, run: list[int]) -> int:
        """Commit a greedy constrained row's forced ``run`` (the head of its draft) on its
        grammar before the verify, which accepts it unlooked (``BlockDraft.committed``); how
        many tokens that is: none for a sampling row (its verify masks every position), or where
        its grammar failed (the request then fails alone)."""
        if not run or req.constraint is None or not req.params.is_greedy:
            return 0
        try:
            with grammar_clock([req]):
                req.constraint._commit(run)  # legal: the grammar forced them
        except Exception as err:
            self._fail_alone(req, err)
            return 0
        return len(run)

    def _lookup(self, req: Request, size: int, kind: SegmentKind, found: list[int]
                ) -> BlockDraft | None:
        """The request's own text as its draft (``found``, ``_lookups``), as many tokens as the
        router finds best, when it expects them to commit more per second than the drafter's
        (cut at the first token the grammar forbids)."""
        take = self.cost.lookup_slots(req.routing, kind, size, len(found))
        if take == 0:
            return None
        found = self._legal_head(req, found[:take])
        if not found:
            return None
        req.stats.lookup_drafts += 1
        return BlockDraft(found, 0, False, looked_up=True)

    def _lookup_limit(self, req: Request, size: int) -> int:
        """The most tokens a lookup may draft for a row whose block holds ``size`` drafts: the
        block the request asked for; else up to the longest block the router prices (its text's
        loops and copies run on past the drafter's block, and the router's per-position rates
        say how far a draft of them stands); within the room left."""
        longest = size if req.params.block_size else max(size, MAX_SLOTS - 1)
        return min(longest, self._room(req) - 1)

    def _legal_head(self, req: Request, tokens: list[int]) -> list[int] | None:
        """``tokens`` up to the first the request's grammar forbids (all without a grammar);
        None if its grammar failed (the request then fails alone)."""
        if req.constraint is None:
            return tokens
        try:
            with grammar_clock([req]):
                return tokens[: req.constraint.mask_prefix(tokens)]
        except Exception as err:
            self._fail_alone(req, err)
            return None

    def _agreed(
        self, req: Request, kind: SegmentKind, block: BlockDraft, logits: torch.Tensor
    ) -> BlockDraft:
        """The drafter's ``block`` for a row (``logits`` [slots, V]: the drafter's, which
        proposed it); or, where the request's own text suggests a run that begins with the
        block's first ``AGREEMENT`` tokens, and the drafter does not all but rule out its token
        where the two part (``fork_odds`` at least ``FORK_ODDS``), that run (cut at the first
        token the grammar forbids) in its place when the router expects it to commit more per
        second (``agreed_slots``: it may run on past the block, as far as ``_lookup``'s). Either
        way the draft not verified goes along as the rival the verify is compared with. Not for
        a constrained sampling row: it verifies with the masks its walk made along the block."""
        drafted = block.tokens
        if len(drafted) < AGREEMENT or block.masks is not None:
            return block
        found = lookup_draft(req.all_ids, self._lookup_limit(req, len(drafted)))
        if found[:AGREEMENT] != drafted[:AGREEMENT]:
            return block
        if fork_odds(drafted, found, logits) < FORK_ODDS:
            return block
        take = self.cost.agreed_slots(req.routing, kind, len(drafted), len(found))
        if take == 0:  # counted as the rival as it is: a token the grammar forbids is one the
            return replace(block, rival=found)  # target does not write either
        run = drafted[: block.committed]  # in the grammar already: the lookup goes on from it
        if found[:take][: len(run)] != run:  # it leaves (or stops in) the forced run
            return replace(block, rival=found)
        head = self._legal_head(req, found[len(run):take])  # at least the block's first tokens
        if head is None:
            return block
        req.stats.lookup_drafts += 1
        return BlockDraft(run + head, 0, True, looked_up=True, rival=drafted,
                          rival_slots=block.slots, committed=len(run))

    def _forced_runs(self, reqs: list[Request]) -> dict[int, BlockDraft]:
        """For rows that do not draft: the tokens their grammar forces, verified for free."""
        runs = {}
        for r in reqs:
            forced = self._forced_tokens(r)
            if forced is None:
                continue
            run = forced[: max(0, self._room(r) - 1)]
            runs[r.id] = BlockDraft(run, len(run), False, committed=self._commit_run(r, run))
        return runs

    def _forced_tokens(self, req: Request) -> list[int] | None:
        """What the request's grammar forces next ([] without one); None if its grammar failed
        (the request then fails alone)."""
        if req.constraint is None:
            return []
        try:
            with grammar_clock([req]):
                return req.constraint.forced_tokens()
        except Exception as err:
            self._fail_alone(req, err)
            return None

    def _draft_len(self, req: Request, kind: SegmentKind) -> int:
        """Draft tokens for this step: the request's block size if it set one, else the router's
        choice for the segment (at most the drafter's block), within the room left."""
        block = req.params.block_size or self.cost.block_size(
            req.routing, kind, self.drafter.cfg.block_size
        )
        return max(0, min(block - 1, self._room(req) - 1))

    def _room(self, req: Request) -> int:
        """Tokens this request may still commit."""
        return min(
            req.params.max_tokens - len(req.output_ids), self.scheduler.cfg.max_len - req.num_tokens
        )

    def _capture(self, speculative: bool) -> tuple[int, ...]:
        return self.drafter.cfg.target_layer_ids if speculative else ()

    def _drain_inbox(self) -> None:
        while self._inbox:
            req = self._inbox.popleft()
            if not req.is_finished:  # cancelled or failed while queued: never scheduled
                self.scheduler.add(req)
        self.apply_cancels()

    def apply_cancels(self) -> None:
        """Finish the requests ``cancel`` was called on (a step does this first); call it on the
        thread that runs ``step``, or once that thread has stopped."""
        while self._cancels:
            req = self._cancels.popleft()
            if not req.is_finished:
                if req in self._inbox:  # not queued yet: it must not be scheduled later
                    self._inbox.remove(req)
                req.finish_reason = FinishReason.CANCELLED
                self._finish(req)

    def append_tokens(self, req: Request, tokens: list[int]) -> list[int]:
        """Commit ``tokens`` one by one, stopping where plain decoding would stop.

        Returns the tokens actually committed (a prefix of ``tokens``).
        """
        params = req.params
        for n, token in enumerate(tokens, start=1):
            req.output_ids.append(token)
            if req.stats.first_token_at is None:
                req.stats.first_token_at = time.perf_counter()
            if self._hits_stop(req, token):
                req.finish_reason = FinishReason.STOP
            elif (
                len(req.output_ids) >= params.max_tokens
                or req.num_tokens >= self.scheduler.cfg.max_len
            ):
                req.finish_reason = FinishReason.LENGTH
            if req.finish_reason is not None:
                self._finish(req)
                return tokens[:n]
        return tokens

    def _hits_stop(self, req: Request, token: int) -> bool:
        params = req.params
        if req.stop_check is not None:  # first: a stop token that ends a stop string cuts
            at = req.stop_check(req.output_ids)  # the text there too
            if at is not None:
                req.stop_text_len = at
                return True
        return token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos)

    def _finish(self, req: Request) -> None:
        req.stats.finished_at = time.perf_counter()
        if req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self._keep_sequence(req)
        self.scheduler.finish(req)
        # the drafter's state goes with the slot: a caller keeps its requests for their results
        # (a round of the bench, a batch), and their contexts outgrew the engine's own count
        req.draft_context, req.kept_hidden, req.kept_bytes = None, None, 0
        req.pending_hidden.clear()

    # --- memory ----------------------------------------------------------------------------

    def weight_bytes(self) -> dict[str, int]:
        """The target's and the drafter's parameters, in bytes (the drafter: 0 when none), and
        the copies of their projections' weights that oneDNN's matmul reads (``reordered_bytes``;
        made at a projection's first forward on that path)."""
        def size(net) -> int:
            if net is None:
                return 0
            params = sum(p.numel() * p.element_size() for p in net.parameters())
            return params + reordered_bytes(net)

        return {"target": size(self.model), "drafter": size(self.drafter)}

    def reordered_weight_bytes(self) -> dict[str, int]:
        """The part of ``weight_bytes`` that is oneDNN's reordered copies: which projections run
        on oneDNN is timed as the process starts (``mkl_where_faster``), so it varies from one
        process to the next (0 where none does)."""
        return {"target": reordered_bytes(self.model),
                "drafter": 0 if self.drafter is None else reordered_bytes(self.drafter)}

    def kv_pool_bytes(self) -> int:
        """The KV pool allocated now: every slot, as many positions as the longest request has
        needed so far (``KVCache.ensure``), up to ``max_len``."""
        return sum(t.numel() * t.element_size() for t in self.cache.k + self.cache.v)

    def memory_in_use(self, reqs: list[Request] | None = None,
                      lengths: list[int] | None = None) -> MemoryUse:
        """What ``reqs`` (default: the running requests) hold now, with ``lengths`` the tokens
        each has in its KV slot (default: those already cached)."""
        reqs = list(self.scheduler.running) if reqs is None else reqs
        lengths = [r.num_cached for r in reqs] if lengths is None else lengths
        per_token = self._kv_bytes_per_token
        draft = sum(r.draft_context.num_bytes for r in reqs if r.draft_context is not None)
        kept = sum(self._kept_bytes(r) for r in reqs if r.kept_hidden is not None)
        return MemoryUse(per_token * sum(lengths), draft, self.prefix_cache.num_bytes, kept)

    def _kept_bytes(self, req: Request) -> int:
        """The hidden states ``req`` keeps, but its prompt's while its prompt's entry holds them
        (the same tensor, counted in the prefix cache's bytes)."""
        first = req.kept_hidden[0]
        return req.kept_bytes - (first.nbytes if self.prefix_cache.holds(first) else 0)

    def reset_memory_peak(self) -> None:
        self.memory_peak, self.peak_total_bytes = MemoryUse(), 0

    def _note_memory(self, reqs: list[Request], rows: list[Row] | None = None) -> None:
        # after the forward every row's tokens, drafts included, have keys and values in its slot
        # (without ``rows``: those cached)
        now = self.memory_in_use(reqs, None if rows is None else
                                 [row.start + len(row.tokens) for row in rows])
        self.memory_peak = self.memory_peak.max(now)
        self.peak_total_bytes = max(self.peak_total_bytes, now.total)

    # --- results ---------------------------------------------------------------------------

    def result(self, req: Request) -> GenerationResult:
        """The finished request as text, token ids and stats."""
        if req.status is not Status.FINISHED or req.finish_reason is None:
            raise UserError(f"request {req.id} has not finished: step the engine until "
                            f"req.is_finished (or use Engine.generate)")
        text = self.decode_output(req.output_ids)
        if req.stop_text_len is not None:
            text = text[: req.stop_text_len]
        return GenerationResult(
            text, list(req.output_ids), req.finish_reason.value, request_stats(req), req.error,
            req.grammar_limit, req.params.tool_calls,
        )

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Run one request to completion (other queued requests advance with it)."""
        self._check_stepping_thread()
        req = self.submit(prompt_ids, params)
        while not req.is_finished:
            try:
                self.step()
            except Exception as err:  # raised to the caller; the engine serves on
                self.fail_step(err)
                raise
        return self.result(req)

    def _check_stepping_thread(self) -> None:
        if self.stepping_thread not in (None, threading.get_ident()):
            raise UserError("an AsyncEngine serves this engine: its thread alone steps it; "
                            "use `await aengine.generate(...)` or `aengine.stream(...)`")

    # --- failures --------------------------------------------------------------------------

    def fail_step(self, err: Exception) -> list[Request]:
        """After ``step`` raised ``err``: fail the requests it was running or admitting (whose
        state it may have left half-updated; none running: it failed on the waiting ones, as
        each step would), and return them. Left, each later step failed on them again."""
        failed = list(self.scheduler.running) or list(self.scheduler.waiting)
        for req in failed:
            self.fail(req, f"a step raised {type(err).__name__}: {err}")
        return failed

    def fail(self, req: Request, message: str) -> None:
        """Finish ``req`` with ``FinishReason.ERROR`` and free its cache slot; ``message`` (why)
        goes into its result. Call it on the thread that runs ``step``."""
        if req.is_finished:
            return
        if req in self._inbox:  # not queued yet: it must not be scheduled later
            self._inbox.remove(req)
        req.finish_reason, req.error = FinishReason.ERROR, message
        self._finish(req)


_MARKUP = re.compile(r"<[^\s<>]+>")  # <tool_call>, <|fim_prefix|>, </think>


def marker_pattern(tokenizer) -> re.Pattern[str] | None:
    """A pattern of the texts of the tokenizer's special tokens (``<|im_start|>``) and of its
    added tokens written as markup (``<tool_response>``, ``<|fim_prefix|>``): the markers a
    conversation's structure is written with; None if it has none. (An added token of plain
    text, a run of spaces or a word, is text.)"""
    texts = set(getattr(tokenizer, "all_special_tokens", ()))
    texts |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
              if t.special or _MARKUP.fullmatch(t.content)}
    texts = {t for t in texts if isinstance(t, str) and len(t) > 1}
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def inert_markers(messages: list[dict[str, Any]], markers: re.Pattern[str] | None
                  ) -> list[dict[str, Any]]:
    """``messages`` where the text a user or a tool wrote holds no marker (``marker_pattern``)
    as one: a zero-width space after its first character, so that the tokenizer reads it as
    text, as OpenAI's API does, not as the token the template writes. A web page an ``http:``
    tool fetched could otherwise end the tool's turn and open a system one."""
    if markers is None:
        return messages

    def inert(text: Any) -> Any:
        if not isinstance(text, str) or markers.search(text) is None:
            return text
        return markers.sub(lambda m: m[0][0] + "\u200b" + m[0][1:], text)

    out = []
    for message in messages:
        if isinstance(message, dict) and message.get("role") in ("user", "tool"):
            content = message.get("content")
            if isinstance(content, list):  # parts: {"type": "text", "text": ...}
                content = [{**part, "text": inert(part.get("text"))}
                           if isinstance(part, dict) and "text" in part else part
                           for part in content]
            else:
                content = inert(content)
            if content is not message.get("content"):
                message = {**message, "content": content}
        out.append(message)
    return out


def check_template_kwargs(template_kwargs: dict[str, Any] | None,
                          apply_chat_template: Callable[..., Any] | None = None) -> None:
    """A ``UserError`` naming the key, unless ``template_kwargs`` is None or a dict of a chat
    template's own variables (``template_kwargs_problems``)."""
    if template_kwargs is None:
        return
    if not isinstance(template_kwargs, dict):
        raise UserError(f"chat_template_kwargs must be an object, got "
                        f"{type(template_kwargs).__name__}")
    for key, why in template_kwargs_problems(template_kwargs, apply_chat_template)[:1]:
        raise UserError(f"chat_template_kwargs{'' if key is None else '.' + key}: {why}")


def template_kwargs_problems(template_kwargs: dict[str, Any],
                             apply_chat_template: Callable[..., Any] | None = None
                             ) -> list[tuple[str | None, str]]:
    """(key, what is wrong) for each key of ``template_kwargs`` that is no variable of a chat
    template: one of ``apply_chat_template``'s parameters (``tools``, ``tokenize``;
    transformers' tokenizers' by default), which the engine sets; key None where it is no
    name at all."""
    if apply_chat_template is None:
        from transformers import PreTrainedTokenizerBase

        apply_chat_template = PreTrainedTokenizerBase.apply_chat_template
    own = dict(inspect.signature(apply_chat_template).parameters)
    try:  # what apply_chat_template hands the template's renderer by name (conversations)
        from transformers.utils.chat_template_utils import render_jinja_template

        own |= inspect.signature(render_jinja_template).parameters
    except ImportError:
        pass
    problems: list[tuple[str | None, str]] = []
    for key in template_kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            problems.append((None, f"{key!r} is not a template variable's name"))
        elif key == "messages" or (  # (what it hands the template the conversation as)
                key in own and own[key].kind is not inspect.Parameter.VAR_KEYWORD):
            problems.append((key, "a parameter of apply_chat_template, which the engine sets, "
                                  "not a variable of the template"))
    return problems


def _is_token(value: Any, vocab_size: int) -> bool:
    return is_int(value) and 0 <= value < vocab_size


@contextmanager
def grammar_clock(reqs: list[Request]) -> Iterator[None]:
    """Charge the time of the block to the grammar work of ``reqs``, in equal shares."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        share = (time.perf_counter() - t0) / len(reqs)
        for r in reqs:
            r.stats.grammar_s += share


def _first_rows(pieces: list[torch.Tensor], n: int) -> torch.Tensor:
    """The first ``n`` rows of ``pieces`` one after another, in a tensor of their own: not a view
    of more (a stop among accepted drafts ends a sequence before its verified positions do),
    whose storage an entry would keep alive beyond the bytes it counts."""
    head, total = [], 0
    for piece in pieces:
        if total >= n:
            break
        head.append(piece[: n - total])
        total += len(head[-1])
    return torch.cat(head)


def num_slots(cfg, config: EngineConfig, max_len: int, dtype: torch.dtype, drafter=None,
              prefix: PrefixCache | None = None) -> int:
    """KV-cache slots: ``max_running``, or fewer if the memory budget holds fewer requests of
    ``max_len`` tokens (their target keys and values, a slot's whole chunks of them as the
    pool holds them, and with a drafter its context too, and the hidden states it keeps for
    ``prefix``, the prefix cache: as many positions as its longest entry, up to ``max_len``)."""
    if config.kv_budget_mb is None:
        return config.max_running
    itemsize = torch.tensor([], dtype=dtype).element_size()
    positions = whole_chunks(max_len)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    target = per_token * positions
    draft = drafter.context_bytes(max_len) if drafter is not None else 0
    kept = 0
    if drafter is not None and prefix is not None:
        longest = min(max_len, prefix.longest(per_token + drafter.hidden_bytes(1)))
        kept = drafter.hidden_bytes(longest) if longest >= prefix.min_tokens else 0
    budget = config.kv_budget_mb * 2**20  # past 1.7e302 MB an infinity (// gave NaN)
    fits = int(budget // (target + draft + kept)) if budget < math.inf else config.max_running
    if fits < 1:
        need = f"{target / 2**20:.2f} MB of keys and values"
        if draft:
            need += f" and {draft / 2**20:.2f} MB of drafter context"
        if kept:
            need += f" and {kept / 2**20:.2f} MB of hidden states kept for the prefix cache"
        raise UserError(
            f"kv_budget_mb {config.kv_budget_mb} holds no request of {max_len} tokens "
            f"(one needs {need})"
        )
    return min(config.max_running, fits)


def end_of_turn_ids(tokenizer, model_dir: Path | None = None) -> set[int]:
    """Token ids that end an assistant turn: the tokenizer's eos, the chat end markers, and the
    ``eos_token_id`` (one or a list) of the model's ``generation_config.json``, as transformers'
    ``generate`` stops on them."""
    ids = set(chat_end_ids(tokenizer))
    path = model_dir / "generation_config.json" if model_dir is not None else None
    if path is not None and path.is_file():
        try:
            listed = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as err:
            raise UserError(f"{path}: cannot read it: {err}") from None
        listed = listed if isinstance(listed, list) else [listed]
        ids.update(t for t in listed if is_int(t))
    return ids


def request_stats(req: Request) -> dict[str, Any]:
    s = req.stats
    end = s.finished_at or time.perf_counter()
    wall = end - s.started
    new = len(req.output_ids)
    return {
        "mode": s.mode,
        "prompt_tokens": len(req.prompt_ids),
        "cached_prompt_tokens": s.cached_prompt_tokens,  # reused from the prefix cache
        "new_tokens": new,
        "target_forwards": s.target_forwards,
        "draft_forwards": s.draft_forwards,
        "lookup_drafts": s.lookup_drafts,
        "tau": round(new / s.target_forwards, 3) if s.target_forwards else float(new),
        "wall_s": round(wall, 4),
        "ttft_s": round((s.first_token_at or end) - s.started, 4),  # the prompt's prefill mostly
        "first_step_tokens": s.first_step_tokens,
        "grammar_s": round(s.grammar_s, 5),
        "tokens_per_s": round(new / wall, 2) if wall > 0 else 0.0,
        "segments": [seg.to_dict() for seg in req.segments.segments],
    }
