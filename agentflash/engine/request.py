"""A request, its sampling parameters and its run-time state."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from agentflash.engine.detokenizer import StepText, StopCheck
from agentflash.errors import (
    SEED_TEXT,
    TEMPERATURE_TEXT,
    is_int,
    is_number,
    is_seed,
    is_temperature,
)
from agentflash.grammar.sources import GrammarSource
from agentflash.router.policy import RequestRouting
from agentflash.router.segments import SegmentTracker


class Speculation(enum.Enum):
    """Whether a request decodes with DFlash block speculation."""

    AUTO = "auto"  # dflash when the engine has a drafter (the router refines this per segment)
    DFLASH = "dflash"
    OFF = "off"


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes. Checked when built; a bad value names its field."""

    max_tokens: int = 256
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings; the text ends before the first one written
    # the reply may hold tool calls (the prompt gave tools): a stop string is not matched
    # inside one (``tool_format.stop_at``); without tools a ``<tool_call>`` is text like any
    tool_calls: bool = True
    stop_token_ids: tuple[int, ...] = ()  # in addition to the tokenizer's end-of-turn tokens
    ignore_eos: bool = False
    speculation: Speculation = Speculation.AUTO
    block_size: int | None = None  # DFlash block (the committed token + drafts); None: drafter's
    grammar: GrammarSource | None = None  # output constrained to it (agentflash.grammar sources)

    def __post_init__(self) -> None:
        if isinstance(self.speculation, str):
            try:
                object.__setattr__(self, "speculation", Speculation(self.speculation))
            except ValueError:
                pass
        if not isinstance(self.speculation, Speculation):
            raise ValueError(f"speculation must be auto, dflash or off, got {self.speculation!r}")
        block = self.block_size
        if block is not None and not (is_int(block) and 2 <= block <= 64):
            raise ValueError(f"block_size must be an integer in [2, 64], got {self.block_size!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        object.__setattr__(self, "max_tokens", int(self.max_tokens))  # a numpy integer too
        if not is_temperature(self.temperature):
            raise ValueError(f"temperature must be {TEMPERATURE_TEXT}, got {self.temperature!r}")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not is_seed(self.seed):
            raise ValueError(f"seed must be {SEED_TEXT}, got {self.seed!r}")
        for name in ("temperature", "top_p"):  # numpy numbers as Python's (torch wants them)
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.stop_token_ids, tuple) or not all(
                is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must hold token ids (integers from 0), "
                             f"got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.grammar is not None and not isinstance(self.grammar, GrammarSource):
            raise ValueError(f"grammar must be a GrammarSource (agentflash.grammar: json_schema, "
                             f"regex, lark, pydantic_model, assistant_turn), got "
                             f"{type(self.grammar).__name__}")
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop, tuple):
            raise ValueError(f"stop must be a tuple or list of strings, got {self.stop!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        for name in ("ignore_eos", "tool_calls"):  # "no" ignored the end token
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # an end-of-turn token or a stop string
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"
    ERROR = "error"  # the engine failed while running it; ``Request.error`` says how


_ids = itertools.count()


@dataclass
class RequestStats:
    """Counts the engine keeps for one request (decode phase; the prefill is not counted)."""

    mode: str = "plain"
    target_forwards: int = 0
    draft_forwards: int = 0
    cached_prompt_tokens: int = 0  # the prompt's beginning taken from the prefix cache
    lookup_drafts: int = 0  # verifies of a draft looked up in its own text
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    # tokens the prompt's forward gave: the first token, after the forced opening it fed
    first_step_tokens: int = 0
    finished_at: float | None = None
    grammar_s: float = 0.0  # time spent on its grammar: masks, forced tokens, draft walks, commits


class Request:
    """One generation: prompt, parameters, the tokens produced so far and its cache slot."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams):
        self.id = next(_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: FinishReason | None = None
        self.slot: int | None = None
        self.num_cached = 0  # tokens whose keys/values are in the cache
        self.stop_text_len: int | None = None  # where a stop string cut the text
        self.error: str | None = None  # why the engine failed it (``FinishReason.ERROR``)
        self.grammar_limit = False  # ...its grammar reached a limit (``GrammarFailed.limit``)
        self.stats = RequestStats()
        self.draft_context = None  # a DraftContext while the request decodes with DFlash
        self.pending_hidden: list[torch.Tensor] = []  # target hidden states not yet in it
        # the hidden states of every cached position, for the prefix cache to keep with the
        # finished sequence (None: not captured, or no prefix cache)
        self.kept_hidden: list[torch.Tensor] | None = None
        self.kept_bytes = 0  # their storage
        self.constraint = None  # a grammar Constraint, advanced over committed tokens
        self.segments = SegmentTracker()
        # what the reply's text grew by at each step, for ``segments`` (the engine's decoder)
        self.step_text: StepText | None = None
        # where a stop string begins in its text (``tool_format.stop_at``), a token at a time
        self.stop_check: StopCheck | None = None
        self.routing = RequestRouting()
        self.generator: torch.Generator | None = None
        if not params.is_greedy:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:  # its own entropy: torch.seed() reseeded the process's generator
                self.generator.seed()

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def uncached_ids(self) -> list[int]:
        """Tokens the next target forward must feed (prompt on prefill, then the last token)."""
        return self.all_ids[self.num_cached :]
