"""``agentflash bench``: decoding modes and their peers side by side, in one run, on one model.

Prompts come from the training corpus' generators with other seeds, grouped in suites by kind
of text. The tool-call, JSON and agent prompts are held out that way; the code, prose and math
ones are not all: those generators draw from small pools (the standard library's 969 functions
and 3,130 docstrings, 712 percent questions), so of 16 a suite 12 code, 7 prose and 3 math
prompts are word for word in the target's corpus (and 16 code, 13 prose answers), and some in
the drafters' (the README's demo-model section says more). Every row decodes the same prompts
greedily; the table reports tokens/s, the ratio to plain decoding, tau and whether the output
equals plain greedy output.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import random
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from agentflash.console import print_whole
from agentflash.engine.engine import Engine, MemoryUse
from agentflash.engine.request import SamplingParams
from agentflash.errors import UserError
from agentflash.train import corpus

SUITES = ("tool_call", "code", "math", "prose")  # "json", "mixed" and "agent" are extra suites
ALL_SUITES = (*SUITES, "json", "mixed", "agent")
HELD_OUT_SEED = 1_000_003  # the training corpus uses seed 0


@dataclass(frozen=True)
class Prompt:
    kind: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    expected: list[dict[str, Any]] | None = None  # the corpus' tool calls, for tool_call prompts
    schema: dict[str, Any] | None = None  # the answer's JSON schema, for json prompts
    # tool_call prompts: the conversation up to its second assistant turn (the calls and the
    # tools' results added), what an agent sends next
    next_turn: list[dict[str, Any]] | None = None


def held_out_prompts(kind: str, num: int, seed: int = HELD_OUT_SEED) -> list[Prompt]:
    """``num`` conversations of ``kind`` cut before their first assistant turn."""
    if kind == "json":
        rng = random.Random(seed + 17)
        out = []
        for _ in range(num):
            convo = corpus.tool_call_conversation(rng)
            schema = corpus.random_object(rng, 1)
            msgs = [m for m in convo["messages"] if m["role"] in ("system", "user")][:2]
            msgs[-1] = {"role": "user", "content": msgs[-1]["content"] + " Answer in JSON."}
            out.append(Prompt("json", msgs, [], schema=schema))
        return out
    if kind == "mixed":
        per_kind = [held_out_prompts(k, num, seed) for k in SUITES]
        return [p for group in zip(*per_kind) for p in group][:num]
    if kind == "agent":  # two turns of tool use: the calls, then the answer to their results
        calls = held_out_prompts("tool_call", 4 * num, seed)
        return [p for p in calls if p.next_turn][:num]
    if kind not in corpus.KINDS:
        raise UserError(f"unknown suite {kind!r} (known: {', '.join(ALL_SUITES)})")
    rng = random.Random(seed + SUITES.index(kind))
    prompts = []
    while len(prompts) < num:
        convo = corpus.KINDS[kind](rng)
        msgs = convo["messages"]
        first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        calls = msgs[first].get("tool_calls")
        if kind == "tool_call" and not calls:
            continue  # keep the suite about writing calls
        later = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > first]
        second = later[0] if later else None
        next_turn = msgs[:second] if calls and second is not None else None
        prompts.append(Prompt(kind, msgs[:first], convo["tools"], calls, next_turn=next_turn))
    return prompts


class Timed(NamedTuple):
    """One request through the engine (``_time_engine``)."""

    output: list[int]
    wall_s: float
    target_forwards: int
    decoding_s: float  # after the prompt's step (its first token)
    first_step_tokens: int  # the tokens that step gave (a forced opening before the first)
    grammar_s: float
    segments: list[dict[str, Any]]
    cached_prompt_tokens: int  # taken from the prefix cache
    memory: MemoryUse  # the most the engine held beyond its weights, part by part...
    memory_bytes: int  # ...and in all at once


_ROUTER_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _as_mode(engine: Engine, speculation: str) -> None:
    """Give the engine the router state of ``speculation``'s runs. The bench's modes take turns
    on one engine; each keeps its own state, so the router row learns only from its own requests,
    as an engine serving them alone would, not from the plain or always-dflash rounds' steps."""
    states = _ROUTER_STATES.setdefault(engine, {})
    if speculation not in states:
        states[speculation] = engine.new_router_state()
    engine.cost = states[speculation]


def _time_engine(
    engine: Engine,
    ids: list[int],
    max_tokens: int,
    speculation: str = "off",
    grammar=None,
    keep_prefix_cache: bool = False,
) -> Timed:
    """One request, timed. The prefix cache is emptied first unless ``keep_prefix_cache``: the
    modes run the same prompts, and one must not start where another left off."""
    params = SamplingParams(max_tokens=max_tokens, speculation=speculation, grammar=grammar)
    if grammar is not None:
        engine.compile(grammar)  # compiled once and cached, as for a running agent's tools
    if not keep_prefix_cache:
        engine.prefix_cache.clear()
    _as_mode(engine, speculation)
    engine.reset_memory_peak()
    t0 = time.perf_counter()
    result = engine.generate(ids, params)
    wall = time.perf_counter() - t0
    stats = result.stats
    return Timed(result.token_ids, wall, stats["target_forwards"], wall - stats["ttft_s"],
                 stats["first_step_tokens"], stats["grammar_s"], stats["segments"],
                 stats["cached_prompt_tokens"], engine.memory_peak, engine.peak_total_bytes)


def _time_hf(
    hf_model, index: int, ids: list[int], *, max_tokens: int, eos: list[int], **kwargs
) -> tuple[list[int], float]:
    """transformers' ``generate`` (greedy) on prompt ``ids``: its tokens and seconds."""
    inputs = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **kwargs,
        )
    return out[0, len(ids) :].tolist(), time.perf_counter() - t0


def run(
    model: str, suites: list[str], num_prompts: int, max_tokens: int, drafter: str | None = "auto"
) -> dict[str, Any]:
    """Every row on every suite; returns ``{"rows": [...], "config": {...}}``.

    Suites ``tool_call`` and ``json`` also get grammar-constrained rows (``tool_choice=required``
    over the prompt's tools; the prompt's JSON schema), compared with constrained plain decoding.
    """
    from transformers import AutoModelForCausalLM

    engine = Engine.from_pretrained(model, drafter=drafter)
    hf_model = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    eos = sorted(engine.eos_ids)
    rows = []
    outlines_skipped = None  # why outlines' row was left out, if it was
    for suite in suites:
        items = held_out_prompts(suite, num_prompts)
        prompts = [engine.chat_prompt(p.messages, p.tools) for p in items]
        if suite == "agent":
            rows += _agent_rows(engine, items, prompts, max_tokens)
            continue
        if suite != "json":
            peers = {name: functools.partial(_time_hf, hf_model, max_tokens=max_tokens, eos=eos,
                                             **kwargs)
                     for name, kwargs in (("transformers", {}),
                                          ("prompt_lookup", {"prompt_lookup_num_tokens": 10}))}
            rows += _engine_rows(engine, suite, prompts, max_tokens, [None] * len(prompts), "",
                                 peers)
        grammars = _grammars(suite, items)
        if grammars:
            peers = {}
            if importlib.util.find_spec("outlines") is not None:
                # on JSON outlines' default backend (outlines-core) applies its masks with its
                # own kernel; the tools' grammar (Lark) goes through its llguidance backend
                skipped = outlines_masks_wrong() if suite == "json" else None
                if skipped is None:
                    peers["outlines"] = _outlines_peer(engine, hf_model, suite, items, grammars,
                                                       max_tokens)
                else:
                    outlines_skipped = skipped
            constrained = _engine_rows(engine, suite, prompts, max_tokens, grammars, "+grammar",
                                       peers)
            for row in constrained:
                if row["mode"].endswith("+grammar") or row["mode"] == "outlines":
                    row.update(_validity(engine, suite, items, row["outputs"]))
            rows += constrained
    for row in rows:
        # plain decoding of the row's kind: constrained plain for the constrained rows and
        # outlines' generator (under the same grammar), plain for the others
        constrained = row["mode"].endswith("+grammar") or row["mode"] == "outlines"
        row["ratio_base"] = "plain+grammar" if constrained else "plain"
        base = next(r for r in rows if r["suite"] == row["suite"]
                    and r["mode"] == row["ratio_base"])
        row["ratio_to_plain"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        if "decode_tokens_per_s" in row:  # None where the base decoded nothing after its
            # first step (max tokens 1)
            row["decode_ratio_to_plain"] = (
                round(row["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
                if base["decode_tokens_per_s"] else None)
        row.pop("outputs")
    return {
        "config": {
            "model": model,
            "drafter": str(drafter),
            "num_prompts": num_prompts,
            "max_tokens": max_tokens,
            "threads": torch.get_num_threads(),
            "exact_path_off": engine.runner.exactness_problem,
            "outlines_skipped": outlines_skipped,
            **_memory_config(engine),
        },
        "rows": rows,
    }


def outlines_masks_wrong() -> str | None:
    """Why outlines' generator cannot run here, or None: its mask kernel (outlines_core's, under
    ``torch.compile``) is checked against the bitmask it applies. Where torch's inductor writes
    AVX2 code (ATen's AVX2 capability; torch 2.13) its int32 shifts give other bits than eager,
    so the kernel lets through tokens the grammar refuses, and the generator raises on the
    first one it picks; with ATen's default capability inductor cannot build it at all."""
    from outlines_core.kernels.torch import apply_token_bitmask_inplace

    from agentflash.grammar.constraint import unpack_bitmask

    gen = torch.Generator().manual_seed(0)
    mask = torch.randint(-(2**31), 2**31 - 1, (1, 128), dtype=torch.int32, generator=gen)
    logits = torch.zeros(1, 128 * 32)
    try:
        apply_token_bitmask_inplace(logits, mask)
    except Exception as err:  # inductor could not build it (ATen's default capability)
        return (f"outlines' mask kernel (torch.compile) fails on this CPU "
                f"({type(err).__name__}); its row is left out")
    if torch.equal(torch.isfinite(logits), unpack_bitmask(mask, 128 * 32)):
        return None
    return ("outlines' mask kernel (torch.compile) masks other tokens than its bitmask on this "
            "CPU; its row is left out")


def _outlines_peer(engine: Engine, hf_model, suite: str, items: list[Prompt], grammars: list,
                   max_tokens: int) -> Callable[[int, list[int]], tuple[list[int], float]]:
    """outlines' own generator on the same transformers model, prompts and output types (greedy):
    on ``json`` the prompt's schema (``JsonSchema``), on ``tool_call`` the tools' grammar the
    engine decodes under (``CFG``, the same Lark text, on outlines' llguidance backend). It is
    given the engine's prompt as it is, its chat template already applied (outlines wraps a
    string in a user turn and applies the template again, where the tokenizer has one: every
    one of its answers was to another conversation), checked token by token. Its tokens are the
    ones it generated (transformers' streamer hands them over), not its text tokenized again,
    which merges some of them."""
    import outlines
    from outlines.types import CFG, JsonSchema

    model = outlines.from_transformers(hf_model, engine.tokenizer)
    model.type_adapter.has_chat_template = False  # the prompt is the rendered conversation

    def run(index: int, ids: list[int]) -> tuple[list[int], float]:
        if suite == "json":  # compiled here, untimed
            schema = JsonSchema(json.dumps(items[index].schema))
            generator = outlines.Generator(model, schema)
        else:
            generator = outlines.Generator(model, CFG(grammars[index].text), backend="llguidance")
        text = engine.tokenizer.decode(ids)
        generator(text, max_new_tokens=1, do_sample=False)  # warm: outlines builds lazily
        generated = _Generated()
        t0 = time.perf_counter()
        generator(text, max_new_tokens=max_tokens, do_sample=False, streamer=generated)
        seconds = time.perf_counter() - t0
        if generated.prompt != ids:
            raise RuntimeError(f"outlines read another prompt than the engine's: "
                               f"{len(generated.prompt)} tokens, {len(ids)} the engine's")
        return generated.ids, seconds

    return run


class _Generated:
    """A transformers streamer that keeps the ids a ``generate`` call writes, and its prompt
    (what its first call hands over)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.prompt: list[int] | None = None

    def put(self, value: torch.Tensor) -> None:
        if self.prompt is None:
            self.prompt = value.reshape(-1).tolist()
        else:
            self.ids += value.reshape(-1).tolist()

    def end(self) -> None:
        pass


def _validity(
    engine: Engine, suite: str, items: list[Prompt], outputs: list[list[int]]
) -> dict[str, int]:
    """Of a constrained row's outputs: how many the model finished (its turn ended before max
    tokens; an answer cut there is unfinished under any grammar), and how many of those are what
    the grammar promises (``_valid_answer``)."""
    finished = [(item, out) for item, out in zip(items, outputs, strict=True)
                if out and out[-1] in engine.eos_ids]
    valid = sum(
        _valid_answer(suite, item, engine.tokenizer.decode(out, skip_special_tokens=True))
        for item, out in finished
    )
    return {"finished": len(finished), "valid": valid}


def _valid_answer(suite: str, item: Prompt, text: str) -> bool:
    """On ``tool_call``: calls (at least one) of the prompt's tools with arguments valid under
    their schemas; on ``json``: JSON valid under the prompt's schema."""
    import jsonschema

    from agentflash.tool_format import loads_strict, parse_tool_calls, repeats_a_key

    if suite == "tool_call":
        calls, bad = parse_tool_calls(text)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in item.tools}
        return bool(calls) and not bad and not repeats_a_key(text) and all(
            c.name in schemas
            and jsonschema.Draft202012Validator(schemas[c.name]).is_valid(c.arguments)
            for c in calls
        )
    try:  # (a key given twice: JSON reads its last value, a stream shows the first)
        answer = loads_strict(text, unique_keys=True)
    except (ValueError, RecursionError):
        return False
    return jsonschema.Draft202012Validator(item.schema).is_valid(answer)


def _grammars(suite: str, items: list[Prompt]) -> list:
    from agentflash.grammar import assistant_turn, json_schema

    if suite == "tool_call":
        return [assistant_turn(p.tools, "required") for p in items]
    if suite == "json":
        return [json_schema(p.schema) for p in items]
    if suite == "agent":  # as the runtime decodes an agent's turns: the tools' grammar, auto
        return [assistant_turn(p.tools, "auto") for p in items]
    return []


def _engine_rows(
    engine: Engine,
    suite: str,
    prompts: list[list[int]],
    max_tokens: int,
    grammars: list,
    suffix: str,
    peers: dict[str, Callable[[int, list[int]], tuple[list[int], float]]] | None = None,
) -> list[dict[str, Any]]:
    """The engine's plain row and, with a drafter, its dflash and router (auto) rows (identity
    against plain), then a row for each of ``peers`` (name: a function of the prompt's index and
    ids giving the tokens it wrote and its seconds; identity against plain too). The modes and
    the peers take turns prompt by prompt, so a slow stretch of the machine falls on all of them
    alike (the peers ran after the engine's rows: their ratios compared runs minutes apart)."""
    peers = peers or {}
    modes = ["off"] + (["dflash", "auto"] if engine.drafter is not None else [])
    for speculation in modes:
        _time_engine(engine, prompts[0], 8, speculation, grammars[0])  # warm-up
    by_mode: dict[str, list] = {m: [] for m in modes}
    by_peer: dict[str, list] = {name: [] for name in peers}
    for i, (ids, g) in enumerate(zip(prompts, grammars)):
        for speculation in modes:
            by_mode[speculation].append(_time_engine(engine, ids, max_tokens, speculation, g))
        for name, peer in peers.items():
            by_peer[name].append(peer(i, ids))
    rows: list[dict[str, Any]] = []
    for speculation in modes:
        name = {"off": "plain", "dflash": "dflash", "auto": "auto"}[speculation] + suffix
        rows.append(_mode_row(engine, suite, name, by_mode[speculation], rows,
                              grammar=bool(suffix), drafts=speculation != "off"))
    for name, runs in by_peer.items():
        rows.append(_row(suite, name, [out for out, _ in runs], rows[0]["outputs"],
                         [seconds for _, seconds in runs], None))
    return rows


def _agent_rows(
    engine: Engine, items: list[Prompt], prompts: list[list[int]], max_tokens: int
) -> list[dict[str, Any]]:
    """Two turns of tool use per conversation, both timed and both under the tools' grammar
    (``tool_choice`` auto, as the runtime decodes an agent's turns): the calls, then (the
    conversation with the model's own reply and the tools' results, ``_answered``) the answer.
    With the prefix cache, the second turn prefills only what the first did not; the rows ``...,
    no prefix cache`` empty it between the turns. The modes take turns conversation by
    conversation."""
    modes = [("plain", "off", True), ("dflash", "dflash", True), ("auto", "auto", True),
             ("plain, no prefix cache", "off", False), ("dflash, no prefix cache", "dflash", False)]
    if engine.drafter is None:
        modes = [m for m in modes if m[1] == "off"]
    grammars = _grammars("agent", items)
    turns = [(ids, engine.chat_prompt(_answered(engine, p, ids, max_tokens, g), p.tools), g)
             for p, ids, g in zip(items, prompts, grammars, strict=True)]
    for _, speculation, _ in modes:
        _time_engine(engine, turns[0][0], 8, speculation, turns[0][2])  # warm-up
    by_mode: dict[str, list] = {name: [] for name, _, _ in modes}
    for first, second, grammar in turns:
        for name, speculation, keep in modes:
            by_mode[name].append(_time_engine(engine, first, max_tokens, speculation, grammar))
            by_mode[name].append(_time_engine(engine, second, max_tokens, speculation, grammar,
                                              keep_prefix_cache=keep))
    rows: list[dict[str, Any]] = []
    for name, speculation, _ in modes:
        rows.append(_mode_row(engine, "agent", name, by_mode[name], rows, grammar=True,
                              drafts=speculation != "off"))
    return rows


def _mode_row(
    engine: Engine, suite: str, name: str, runs: list[Timed], rows: list[dict[str, Any]],
    grammar: bool = False, drafts: bool = False,
) -> dict[str, Any]:
    """An engine row from its runs (``_time_engine``); identity against ``rows[0]``, if any.
    ``drafts``: whether the mode may draft (its memory counts the drafter's weights)."""
    outs = [r.output for r in runs]
    ref = rows[0]["outputs"] if rows else outs
    wall = sum(r.wall_s for r in runs)
    row = _row(suite, name, outs, ref, [r.wall_s for r in runs], [r.target_forwards for r in runs])
    # after the prompt's step: the decoding speed, without the prompt's prefill (nor the forced
    # opening it fed, which came out with the first token)
    after_step = sum(len(r.output) - r.first_step_tokens for r in runs)
    decoding = sum(r.decoding_s for r in runs)
    row["decode_tokens_per_s"] = round(after_step / max(decoding, 1e-9), 2)
    row["ttft_ms"] = round(1000 * sum(r.wall_s - r.decoding_s for r in runs) / len(runs), 2)
    row["cached_prompt_tokens"] = sum(r.cached_prompt_tokens for r in runs)
    if grammar:  # constrained rows: the share of their time the grammar took, of the whole
        # requests and of their decoding steps (the grammar's work in the prompt's step, the
        # forced opening and the first token's mask, is counted in the numerator: about 0.25 ms
        # a tool call, some 5% of the grammar's time)
        grammar_s = sum(r.grammar_s for r in runs)
        row["grammar_share"] = round(grammar_s / wall, 4)
        row["grammar_share_of_decoding"] = round(grammar_s / max(decoding, 1e-9), 4)
    row.update(_memory_fields(engine, drafts, [r.memory for r in runs],
                              max(r.memory_bytes for r in runs)))
    bodies = [seg for r in runs for seg in r.segments if seg["kind"] == "tool_call"]
    body_tokens = sum(seg["tokens"] for seg in bodies)
    body_forwards = sum(seg["target_forwards"] for seg in bodies)
    if body_forwards:  # tau inside <tool_call> bodies alone
        row["tool_call_body_tau"] = round(body_tokens / body_forwards, 3)
    return row


def _memory_fields(engine: Engine, drafts: bool, parts: list[MemoryUse], held: int
                   ) -> dict[str, Any]:
    """A mode's memory in MiB: the weights it reads (the drafter's too when it drafts) plus the
    most its requests held at once beyond them (``held``), and each part's own peak; the
    weights' parameters apart from oneDNN's reordered copies of them, whose size depends on
    the kernels the process chose as it started."""
    weights, copies = engine.weight_bytes(), engine.reordered_weight_bytes()
    read = weights["target"] + (weights["drafter"] if drafts else 0)
    copied = copies["target"] + (copies["drafter"] if drafts else 0)
    peak = MemoryUse()
    for p in parts:
        peak = peak.max(p)
    return {"memory_mb": _mb(read + held),
            "memory_parts_mb": {"weights": _mb(read - copied), "weights_reordered": _mb(copied),
                                "kv": _mb(peak.kv), "draft_context": _mb(peak.draft),
                                "prefix_cache": _mb(peak.prefix), "kept_hidden": _mb(peak.kept)}}


def _memory_config(engine: Engine) -> dict[str, Any]:
    """The weights, the KV pool as the run left it (grown to its longest request; rows count
    what their requests held) and the process's peak resident memory (the peers' models and
    libraries included)."""
    import resource

    peak_rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    weights, copies = engine.weight_bytes(), engine.reordered_weight_bytes()
    return {"weights_mb": {k: _mb(v - copies[k]) for k, v in weights.items()},
            "weights_reordered_mb": {k: _mb(v) for k, v in copies.items()},
            "kv_pool_mb": _mb(engine.kv_pool_bytes()),
            "peak_rss_mb": round(peak_rss_kb / 2**10, 1)}


def _caption(table, report: dict[str, Any]) -> None:
    """Say under ``table`` what the run could not do as asked: the exact path off
    (``ModelRunner``), a peer left out (``outlines_masks_wrong``)."""
    cfg = report["config"]
    notes = []
    if any(r.get("ratio_base") == "plain+grammar" for r in report["rows"]):
        notes.append("x plain: the +grammar rows and outlines' are x plain+grammar (constrained "
                     "plain decoding)")
    if cfg.get("exact_path_off"):
        notes.append(f"exact path off on this machine ({cfg['exact_path_off']}): an output can "
                     "differ from the reference at a near tie")
    if cfg.get("outlines_skipped"):
        notes.append(cfg["outlines_skipped"])
    if notes:
        table.caption = "\n".join(notes)


def _mb(num_bytes: int) -> float:
    return round(num_bytes / 2**20, 3)


def _row(
    suite: str,
    mode: str,
    outputs: list[list[int]],
    reference: list[list[int]],
    seconds: list[float],
    forwards: list[int] | None,
) -> dict[str, Any]:
    tokens = sum(len(o) for o in outputs)
    return {
        "suite": suite,
        "mode": mode,
        "new_tokens": tokens,
        "tokens_per_s": round(tokens / sum(seconds), 2),
        "tau": round(tokens / sum(forwards), 3) if forwards and sum(forwards) else None,
        "identical_to_plain": all(_same(o, r) for o, r in zip(outputs, reference)),
        "outputs": outputs,
    }


def _same(output: list[int], reference: list[int]) -> bool:
    # transformers stops after the eos token too, and pads nothing at batch size 1
    return output == reference


def print_table(report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(
        title=f"agentflash bench ({report['config']['model']}, "
        f"{report['config']['num_prompts']} prompts/suite, greedy)"
    )
    cols = ("suite", "mode", "tokens", "tokens/s", "x plain", "decode tok/s", "x plain",
            "ttft ms", "tau", "body tau", "grammar % of decoding", "valid", "memory MiB",
            "identical")
    for col in cols:
        table.add_column(col, justify="right" if col not in ("suite", "mode") else "left")
    for r in report["rows"]:
        decoding = "decode_tokens_per_s" in r
        table.add_row(
            r["suite"],
            r["mode"],
            str(r["new_tokens"]),
            f"{r['tokens_per_s']:.1f}",
            f"{r['ratio_to_plain']:.2f}",
            f"{r['decode_tokens_per_s']:.1f}" if decoding else "-",
            f"{r['decode_ratio_to_plain']:.2f}"
            if decoding and r["decode_ratio_to_plain"] is not None else "-",
            f"{r['ttft_ms']:.1f}" if decoding else "-",
            "-" if r["tau"] is None else f"{r['tau']:.2f}",
            f"{r['tool_call_body_tau']:.2f}" if "tool_call_body_tau" in r else "-",
            f"{100 * r['grammar_share_of_decoding']:.1f}" if "grammar_share" in r else "-",
            f"{r['valid']}/{r['finished']}" if "valid" in r else "-",
            f"{r['memory_mb']:.1f}" if "memory_mb" in r else "-",
            "yes" if r["identical_to_plain"] else "NO",
        )
    _caption(table, report)
    print_whole(table)


def eval_tool_calls(model: str, num: int, max_tokens: int = 256) -> dict[str, Any]:
    """Unconstrained greedy replies to held-out tool requests, scored by what they get right
    (``scored_call``)."""
    engine = Engine.from_pretrained(model)
    counts = {
        "prompts": 0,
        "wrote_call": 0,
        "valid_json": 0,
        "known_name": 0,
        "arguments_valid": 0,
        "exact_match": 0,
    }
    for p in held_out_prompts("tool_call", num):
        result = engine.generate(
            engine.chat_prompt(p.messages, p.tools), SamplingParams(max_tokens=max_tokens)
        )
        counts["prompts"] += 1
        for key, hit in scored_call(result.text, p).items():
            counts[key] += hit
    rates = {k: round(v / counts["prompts"], 3) for k, v in counts.items() if k != "prompts"}
    return {"model": model, "counts": counts, "rates": rates}


def scored_call(text: str, prompt: Prompt) -> dict[str, bool]:
    """How far a reply to a tool-call ``prompt`` went: it wrote a call, every call's body is
    JSON, every call is well formed and names one of the prompt's tools, their arguments are
    valid under its schemas (none giving a key twice: its first value is not the one read), and
    they are the calls the corpus made (``same_json``)."""
    import jsonschema

    from agentflash.tool_format import load_body, parse_tool_calls, repeats_a_key

    calls, bad = parse_tool_calls(text)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in prompt.tools}
    known = bool(calls) and not bad and all(c.name in schemas for c in calls)
    valid = known and not repeats_a_key(text) and all(
        jsonschema.Draft202012Validator(schemas[c.name]).is_valid(c.arguments) for c in calls)
    return {
        "wrote_call": bool(calls or bad),
        # (a body that is JSON but no call, its arguments as a string say, is valid JSON: it
        # was counted out here, as a call that names no tool is below)
        "valid_json": bool(calls or bad) and all(load_body(b.body)[1] is None for b in bad),
        "known_name": known,
        "arguments_valid": valid,
        # value for value as JSON tells them apart (Python's == took 0 for false: a call its
        # schema refuses matched)
        "exact_match": valid and same_json([c.to_dict() for c in calls], prompt.expected),
    }


def same_json(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same JSON value: a boolean is no number (Python's ``==``
    has ``False == 0``), numbers compare by value (``1 == 1.0``, as JSON Schema's ``const``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    if isinstance(a, (dict, list)) or isinstance(b, (dict, list)):
        return False
    return a == b


MODES = {"plain": "off", "dflash": "dflash", "auto": "auto"}


def _run_at(
    engine: Engine,
    convos: list[list[list[int]]],
    level: int,
    max_tokens: int,
    speculation: str,
    grammars: list | None = None,
) -> tuple[list[list[int]], float, list[float], int]:
    """Every conversation's turns (prompts) through the engine, ``level`` conversations in
    flight at a time: a turn is submitted as the one before it finishes, a new conversation as
    one ends; ``grammars``: each conversation's (None: unconstrained). Returns outputs (turn by
    turn, conversation by conversation), wall time, latencies and target forwards."""
    queue = list(enumerate(convos))
    reqs: dict[tuple[int, int], Any] = {}
    live: list[tuple[int, int]] = []  # (conversation, turn) in flight
    engine.prefix_cache.clear()  # the modes and rounds run the same prompts
    _as_mode(engine, speculation)
    engine.reset_memory_peak()
    params = [SamplingParams(max_tokens=max_tokens, speculation=speculation, grammar=g)
              for g in (grammars or [None] * len(convos))]
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < level:
            c, turns = queue.pop(0)
            reqs[c, 0] = engine.submit(turns[0], params[c])
            live.append((c, 0))
        engine.step()
        for c, t in [key for key in live if reqs[key].is_finished]:
            live.remove((c, t))
            if t + 1 < len(convos[c]):  # the agent's next turn
                reqs[c, t + 1] = engine.submit(convos[c][t + 1], params[c])
                live.append((c, t + 1))
    wall = time.perf_counter() - t0
    done = [reqs[key] for key in sorted(reqs)]
    latencies = [r.stats.finished_at - r.stats.started for r in done]
    return [r.output_ids for r in done], wall, latencies, sum(r.stats.target_forwards for r in done)


def run_concurrency(
    model: str,
    suites: list[str],
    levels: list[int],
    max_tokens: int,
    drafter: str | None = "auto",
    num_prompts: int | None = None,
    rounds: int = 3,
) -> dict[str, Any]:
    """Plain, always-dflash and router rows at each concurrency, side by side in one run.

    Every level decodes the same ``num_prompts`` prompts (default: the highest level) with
    ``level`` requests in flight at a time. The modes take turns ``rounds`` times, in a rotated
    order each round, and each row is its median round by tokens/s, so that a slow spell of the
    machine lands on every mode. Suite ``mixed`` interleaves prompts of every kind; in suite
    ``agent`` a prompt is a conversation of two turns, the second submitted when the first ends
    (its prompt begins with the first's: the prefix cache holds it), both under the tools'
    grammar (``tool_choice`` auto), as the runtime decodes an agent's turns; the other suites
    decode without their grammars, as the single-stream table's unconstrained rows. Outputs are
    checked against each prompt run alone with plain greedy decoding.
    """
    from agentflash.engine.engine import EngineConfig
    from agentflash.models.loading import resolve_drafter

    if rounds < 1 or not levels or min(levels) < 1:
        raise UserError("rounds and concurrency levels must be positive")
    num_prompts = num_prompts or max(levels)
    if max(levels) > num_prompts:  # a level's label says how many requests were in flight
        raise UserError(f"--concurrency {max(levels)} is more than --num-prompts {num_prompts}: "
                        f"at most {num_prompts} requests could be in flight")
    if resolve_drafter(model, drafter) is None:  # before the model loads
        raise UserError("the concurrency benchmark compares dflash rows: load a drafter")
    engine = Engine.from_pretrained(model, EngineConfig(max_running=max(levels)), drafter=drafter)
    rows = []
    for suite in suites:
        items = held_out_prompts(suite, num_prompts)
        convos = [[engine.chat_prompt(p.messages, p.tools)] for p in items]
        grammars = _grammars(suite, items) if suite == "agent" else [None] * len(items)
        if suite == "agent":  # the answer turn: the reply (the same at every level) sent back
            for p, turns, g in zip(items, convos, grammars, strict=True):
                turns.append(engine.chat_prompt(_answered(engine, p, turns[0], max_tokens, g),
                                                p.tools))
        alone = []
        _as_mode(engine, "off")
        for turns, g in zip(convos, grammars, strict=True):
            for ids in turns:
                engine.prefix_cache.clear()
                params = SamplingParams(max_tokens=max_tokens, speculation="off", grammar=g)
                alone.append(engine.generate(ids, params).token_ids)
        for level in levels:
            measured: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
            for k in range(rounds):
                # each round the modes take turns in another order (plain, dflash, auto; then
                # dflash, auto, plain; ...): a machine that slows down or speeds up within a
                # round does not always favour the same mode
                turns = list(MODES.items())
                for mode, speculation in turns[k % len(turns):] + turns[: k % len(turns)]:
                    # warm the allocator
                    _run_at(engine, convos[:1], 1, 8, speculation, grammars[:1])
                    runs = _run_at(engine, convos, level, max_tokens, speculation, grammars)
                    row = _concurrency_row(suite, level, mode, alone, *runs)
                    row.update(_memory_fields(engine, speculation != "off", [engine.memory_peak],
                                              engine.peak_total_bytes))
                    measured[mode].append(row)
            for tries in measured.values():
                # every round's tokens/s in round order: the machine's spread, beside the median
                # (of an even count, the mean of the middle two; the row's other columns are
                # the lower middle round's)
                spread = [r["tokens_per_s"] for r in tries]
                middle = sorted(tries, key=lambda r: r["tokens_per_s"])[(len(tries) - 1) // 2]
                # every round's outputs against the alone run's (the shown round's were: a
                # round that stopped early, the fastest, was never it)
                rows.append({**middle, "tokens_per_s": round(statistics.median(spread), 2),
                             "rounds": rounds, "tokens_per_s_rounds": spread,
                             "identical_to_alone": all(r["identical_to_alone"] for r in tries)})
            # the router against the better fixed mode round by round: the three runs of a
            # round are minutes closer in time than the rounds' medians, so the machine's drift
            # weighs less on the ratio
            paired = sorted(
                a["tokens_per_s"] / max(p["tokens_per_s"], d["tokens_per_s"])
                for p, d, a in zip(measured["plain"], measured["dflash"], measured["auto"])
            )
            rows[-1]["vs_better_rounds"] = [round(x, 3) for x in paired]
            rows[-1]["vs_better_median"] = round(statistics.median(paired), 3)
    for row in rows:
        base = next(
            r
            for r in rows
            if r["suite"] == row["suite"]
            and r["concurrency"] == row["concurrency"]
            and r["mode"] == "plain"
        )
        row["ratio_to_plain"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
    return {
        "config": {
            "model": model,
            "levels": levels,
            "num_prompts": num_prompts,
            "max_tokens": max_tokens,
            "rounds": rounds,
            "threads": torch.get_num_threads(),
            "exact_path_off": engine.runner.exactness_problem,
            **_memory_config(engine),
        },
        "rows": rows,
    }


def _answered(engine: Engine, prompt: Prompt, ids: list[int], max_tokens: int, grammar=None
              ) -> list[dict[str, Any]]:
    """An agent's answer turn after the model's own greedy reply to ``ids`` (``answer_turn``),
    decoded under ``grammar`` (the agent's). The reply is the same in every mode (outputs are
    identical to plain greedy decoding), so it is computed once, with plain decoding, off the
    clock."""
    engine.prefix_cache.clear()
    _as_mode(engine, "off")
    params = SamplingParams(max_tokens=max_tokens, speculation="off", grammar=grammar)
    reply = engine.generate(ids, params).text
    engine.prefix_cache.clear()
    return answer_turn(prompt, reply)


def answer_turn(prompt: Prompt, reply: str) -> list[dict[str, Any]]:
    """The messages of an agent's answer turn: the prompt's, then ``reply`` as the runtime sends
    it back (its calls parsed into OpenAI ``tool_calls``), then the tools' results of the
    held-out conversation."""
    from agentflash.tool_format import parse_tool_calls, text_outside_calls

    calls, _ = parse_tool_calls(reply)
    tool_calls = [{"id": f"call_{i}", "type": "function",
                   "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                  for i, c in enumerate(calls)]
    results = [m for m in prompt.next_turn[len(prompt.messages):] if m["role"] == "tool"]
    reply_message = {"role": "assistant", "content": text_outside_calls(reply),
                     "tool_calls": tool_calls}
    return [*prompt.messages, reply_message, *results]


def _concurrency_row(
    suite: str,
    level: int,
    mode: str,
    alone: list[list[int]],
    outs: list[list[int]],
    wall: float,
    lat: list[float],
    forwards: int,
) -> dict[str, Any]:
    tokens = sum(len(o) for o in outs)
    lat = sorted(lat)
    return {
        "suite": suite,
        "concurrency": level,
        "mode": mode,
        "new_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "latency_median_s": round(statistics.median(lat), 3),
        "latency_p95_s": round(lat[math.ceil(0.95 * len(lat)) - 1], 3),  # nearest rank
        "tau": round(tokens / forwards, 3) if forwards else None,
        "identical_to_alone": all(o == a for o, a in zip(outs, alone, strict=True)),
    }


def print_concurrency_table(report: dict[str, Any]) -> None:
    from rich.table import Table

    cfg = report["config"]
    table = Table(
        title=f"agentflash bench --concurrency ({cfg['model']}, {cfg['num_prompts']} prompts per "
        f"suite, median of {cfg['rounds']} rounds, greedy)"
    )
    cols = ("suite", "streams", "mode", "tokens/s", "rounds' range", "x plain", "p50 s",
            "p95 s", "tau", "memory MiB", "identical", "auto / better, paired")
    for col in cols:
        table.add_column(col, justify="left" if col in ("suite", "mode") else "right")
    for r in report["rows"]:
        table.add_row(
            r["suite"],
            str(r["concurrency"]),
            r["mode"],
            f"{r['tokens_per_s']:.1f}",
            f"{min(r['tokens_per_s_rounds']):.0f}-{max(r['tokens_per_s_rounds']):.0f}",
            f"{r['ratio_to_plain']:.2f}",
            f"{r['latency_median_s']:.2f}",
            f"{r['latency_p95_s']:.2f}",
            "-" if r["tau"] is None else f"{r['tau']:.2f}",
            f"{r['memory_mb']:.1f}",
            "yes" if r["identical_to_alone"] else "NO",
            f"{r['vs_better_median']:.3f} ({min(r['vs_better_rounds']):.2f}-"
            f"{max(r['vs_better_rounds']):.2f})" if "vs_better_median" in r else "",
        )
    _caption(table, report)
    print_whole(table)
