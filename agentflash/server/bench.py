"""``agentflash bench-server``: what the HTTP path costs over the in-process engine.

One workload (held-out prompts of the bench suites, with their tools, greedy) runs three ways:
in process (``prepare`` + ``AsyncEngine``, what an embedded caller does), and against
``agentflash serve`` on the same model in its own process, as plain JSON responses and as
server-sent event streams. Each path keeps ``concurrency`` requests in flight. The overhead is the
mean latency over the in-process one; every path must write as many tokens for each request
(``same_tokens`` compares the counts, which the three paths report alike).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from agentflash import aio
from agentflash.console import print_whole
from agentflash.errors import UserError

PATHS = ("engine", "http", "http-stream")


@dataclass(frozen=True)
class Outcome:
    """One request as a path saw it."""

    latency_s: float
    first_s: float | None  # time to the first text or call delta (or the end, if none came)
    completion_tokens: int


def run(model: str = "demo", suites: tuple[str, ...] = ("tool_call", "prose"),
        num_prompts: int = 8, max_tokens: int = 64, concurrency: tuple[int, ...] = (1, 4),
        drafter: str = "none", rounds: int = 3) -> dict[str, Any]:
    """The three paths at each concurrency level; returns the report (rows and config).

    ``drafter`` defaults to none: with a drafter, the router of each engine (in process, and in
    the server's process) learns its own cost model and may route differently, which is noise in
    a measurement of the HTTP path.

    The paths take turns ``rounds`` times, and each row is the round with the median mean
    latency, so that a slow spell of the machine lands on every path rather than on one."""
    from agentflash.bench import held_out_prompts
    from agentflash.engine.async_engine import run_in_own_thread
    from agentflash.server.app import ServerConfig, load_engine

    if min(num_prompts, max_tokens, rounds) < 1 or not concurrency or min(concurrency) < 1:
        raise UserError("--num-prompts, --max-tokens, --rounds and --concurrency levels must be "
                        "positive")
    config = ServerConfig(model=model, drafter=drafter, max_tokens=max_tokens)
    bodies = [{"model": config.name, "messages": p.messages, "tools": p.tools or None,
               "max_tokens": max_tokens, "temperature": 0}
              for suite in suites for p in held_out_prompts(suite, num_prompts)]
    bodies = [{k: v for k, v in b.items() if v is not None} for b in bodies]
    if max(concurrency) > len(bodies):  # a row named 8 in flight that had 2 would say 8
        raise UserError(f"--concurrency {max(concurrency)}: at most {len(bodies)} requests could "
                        f"be in flight ({len(bodies)} prompts); raise --num-prompts")
    # Loaded as the server loads its own, in a thread that ends with the loading: torch work on
    # the main thread (which lives on) followed by steps on the engine thread runs those steps
    # about half as fast here (two OpenMP thread teams on two cores), which would flatter the
    # server path.
    engine = aio.run(run_in_own_thread, load_engine, config)
    measured: list[dict[str, Any]] = []
    with server_process(config, max_concurrent=max(concurrency)) as url:
        for _ in range(rounds):
            aio.run(_engine_rows, engine, bodies, concurrency, measured)
            aio.run(_http_rows, url, bodies, concurrency, measured)
    rows = _median_rounds(measured)
    _add_overheads(rows)
    return {"config": {"model": model, "suites": list(suites), "num_requests": len(bodies),
                       "max_tokens": max_tokens, "concurrency": list(concurrency),
                       "rounds": rounds, "drafter": "none" if engine.drafter is None else drafter},
            "rows": rows}


@contextmanager
def server_process(config: Any, max_concurrent: int, timeout_s: float = 600.0) -> Iterator[str]:
    """``agentflash serve`` for ``config`` in a child process on a free loopback port; yields
    its base URL once it answers ``/health``, and stops it (SIGINT) afterwards."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "agentflash.cli", "serve", "--model", config.model,
           "--drafter", config.drafter, "--port", str(port), "--max-tokens",
           str(config.max_tokens), "--max-concurrent", str(max(max_concurrent, 1))]
    env = {k: v for k, v in os.environ.items() if k != "AGENTFLASH_API_KEY"}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise UserError(f"agentflash serve did not start: {log.read()[-2000:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).is_success:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _median_rounds(measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per path and concurrency, the round whose mean latency is the median (of an even number
    of rounds, the faster of the two middle ones: ``--rounds 2`` showed the slower)."""
    keys = list(dict.fromkeys((r["path"], r["concurrency"]) for r in measured))
    keys.sort(key=lambda k: (PATHS.index(k[0]), k[1]))
    rows = []
    for key in keys:
        same = sorted((r for r in measured if (r["path"], r["concurrency"]) == key),
                      key=lambda r: r["latency_mean_ms"])
        rows.append({**same[(len(same) - 1) // 2], "rounds": len(same),
                     "every_round_tokens": [r["completion_tokens"] for r in same]})
    return rows


async def _engine_rows(engine: Any, bodies: list[dict[str, Any]], levels: tuple[int, ...],
                       rows: list[dict[str, Any]]) -> None:
    from agentflash.engine.async_engine import AsyncEngine
    from agentflash.server.chat import Finished, ReplyWriter, prepare, reply_events
    from agentflash.server.protocol import parse_request

    requests = [parse_request(json.dumps(body).encode()) for body in bodies]
    async with AsyncEngine(engine) as aengine:
        async def one(request: Any) -> Outcome:
            # the reply's events as the server streams them: "first" is its first delta, as
            # the http-stream path times it (the first token, a call's <tool_call>, reaches a
            # client with the call's name, some 16 tokens later)
            t0 = time.perf_counter()
            job = await anyio.to_thread.run_sync(prepare, request, engine, request.max_tokens)
            first, tokens, writer = None, 0, ReplyWriter()
            async with aclosing(reply_events(aengine, job)) as events:
                async for event in events:
                    finished = isinstance(event, Finished)
                    if first is None and (finished or writer.deltas(event)):
                        first = time.perf_counter() - t0
                    if finished:
                        tokens = len(event.result.token_ids)
            return Outcome(time.perf_counter() - t0, first, tokens)

        await _measure(one, requests, max(levels), "warmup", [])  # both sides warm again
        for level in levels:
            await _measure(one, requests, level, "engine", rows)


async def _http_rows(url: str, bodies: list[dict[str, Any]], levels: tuple[int, ...],
                     rows: list[dict[str, Any]]) -> None:
    import httpx

    limits = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def plain(body: dict[str, Any]) -> Outcome:
            t0 = time.perf_counter()
            response = await client.post("/chat/completions", json=body)
            response.raise_for_status()
            usage = response.json()["usage"]
            return Outcome(time.perf_counter() - t0, None, usage["completion_tokens"])

        async def streamed(body: dict[str, Any]) -> Outcome:
            t0, first, tokens = time.perf_counter(), None, 0
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for choice in chunk["choices"]:
                        delta = choice["delta"]
                        written = delta.get("content") or delta.get("tool_calls")
                        if first is None and (written or choice["finish_reason"]):
                            first = time.perf_counter() - t0
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            return Outcome(time.perf_counter() - t0, first, tokens)

        await _measure(plain, bodies, max(levels), "warmup", [])  # after the other path ran
        for level in levels:
            await _measure(plain, bodies, level, "http", rows)
            await _measure(streamed, bodies, level, "http-stream", rows)


async def _measure(one: Callable[[Any], Awaitable[Outcome]], items: list[Any], level: int,
                   path: str, rows: list[dict[str, Any]]) -> None:
    """Run ``one`` over every item with ``level`` in flight; appends the path's row."""
    outcomes: list[Outcome | None] = [None] * len(items)
    slots = anyio.Semaphore(level)

    async def run_one(i: int) -> None:
        async with slots:
            outcomes[i] = await one(items[i])

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(items)):
            tg.start_soon(run_one, i)
    wall = time.perf_counter() - t0
    done = [o for o in outcomes if o is not None]
    latencies = sorted(o.latency_s for o in done)
    firsts = [o.first_s for o in done if o.first_s is not None]
    tokens = [o.completion_tokens for o in done]
    rows.append({
        "path": path, "concurrency": level, "requests": len(done), "wall_s": round(wall, 4),
        "requests_per_s": round(len(done) / wall, 2), "tokens_per_s": round(sum(tokens) / wall, 1),
        "latency_mean_ms": round(1000 * statistics.fmean(latencies), 2),
        "latency_p50_ms": round(1000 * statistics.median(latencies), 2),
        "latency_p95_ms": round(1000 * latencies[math.ceil(0.95 * len(latencies)) - 1],
                                2),  # nearest rank
        "first_token_mean_ms": round(1000 * statistics.fmean(firsts), 2) if firsts else None,
        "completion_tokens": tokens,
    })


def _add_overheads(rows: list[dict[str, Any]]) -> None:
    """Each row's mean latency over the engine's at the same concurrency, and whether it wrote,
    in every round, the same number of tokens for every request as the engine's rounds (the
    shown round's alone were compared: a round that stopped early, the fastest, was never it)."""
    engine = {r["concurrency"]: r for r in rows if r["path"] == "engine"}
    engine_rounds = {c: r["every_round_tokens"] for c, r in engine.items()}
    for r in rows:
        base = engine[r["concurrency"]]
        r["overhead_ms_per_request"] = round(r["latency_mean_ms"] - base["latency_mean_ms"], 2)
        r["overhead_pct"] = round(100 * (r["latency_mean_ms"] / base["latency_mean_ms"] - 1), 1)
        counts = r.pop("every_round_tokens") + engine_rounds[r["concurrency"]]
        r["same_tokens"] = all(c == base["completion_tokens"] for c in counts)


def print_table(report: dict[str, Any]) -> None:
    from rich.table import Table

    cfg = report["config"]
    table = Table(title=f"agentflash bench-server ({cfg['model']}, {cfg['num_requests']} requests, "
                        f"max_tokens {cfg['max_tokens']}, greedy)")
    cols = ("path", "in flight", "req/s", "tokens/s", "mean ms", "p50 ms", "p95 ms",
            "first ms", "overhead ms", "overhead %", "same tokens")
    for col in cols:
        table.add_column(col, justify="left" if col == "path" else "right")
    for r in report["rows"]:
        first = r["first_token_mean_ms"]
        table.add_row(r["path"], str(r["concurrency"]), f"{r['requests_per_s']:.2f}",
                      f"{r['tokens_per_s']:.1f}", f"{r['latency_mean_ms']:.1f}",
                      f"{r['latency_p50_ms']:.1f}", f"{r['latency_p95_ms']:.1f}",
                      "-" if first is None else f"{first:.1f}",
                      f"{r['overhead_ms_per_request']:+.1f}", f"{r['overhead_pct']:+.1f}",
                      "yes" if r["same_tokens"] else "NO")
    print_whole(table)
