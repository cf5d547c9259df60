"""Spans for runs, agent turns, generations and tool calls, with their timings and speed stats.

Span attributes follow the OpenTelemetry GenAI semantic conventions (``gen_ai.operation.name``,
``gen_ai.agent.name``, ``gen_ai.request.model``, ``gen_ai.usage.output_tokens``,
``gen_ai.tool.name``...), with the engine's speed figures under ``agentflash.*``. Every trace can be
printed as a plain-text timeline; when the ``opentelemetry`` packages are importable, spans are
also exported live to the global OpenTelemetry tracer provider (configure its exporter as usual).
"""

from __future__ import annotations

import asyncio
import copy
import enum
import itertools
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentflash.errors import described


class SpanKind(str, enum.Enum):
    RUN = "run"  # a run (or a whole workflow)
    TURN = "turn"  # one agent turn: a generation and the tool calls it made
    GENERATION = "generation"
    TOOL = "tool"


_span_ids = itertools.count(1)


@dataclass
class Span:
    kind: SpanKind
    name: str
    parent: Span | None
    attributes: dict[str, Any] = field(default_factory=dict)
    start: float = field(default_factory=time.perf_counter)
    start_ns: int = field(default_factory=time.time_ns)
    end: float | None = None
    error: str | None = None
    id: int = field(default_factory=lambda: next(_span_ids))

    @property
    def duration_s(self) -> float:
        return (self.end if self.end is not None else time.perf_counter()) - self.start

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1


class SpanSink(Protocol):
    def on_start(self, span: Span) -> None: ...
    def on_end(self, span: Span) -> None: ...


class Tracer:
    """Collects the spans of one run or workflow; ``sinks`` see every span start and end
    (by default an OpenTelemetry exporter when opentelemetry is importable)."""

    def __init__(self, sinks: list[SpanSink] | None = None):
        self.spans: list[Span] = []
        self.sinks = default_sinks() if sinks is None else sinks

    def __getstate__(self) -> dict[str, Any]:
        # pickled (an error's trace, back from a process pool): the spans to read; the sinks
        # are this process's exporters (OpenTelemetry's hold modules and threads)
        return {"spans": self.spans, "sinks": []}

    def __copy__(self) -> Tracer:  # a copy in this process keeps exporting where it did
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __deepcopy__(self, memo: dict[int, Any]) -> Tracer:  # its own spans, the same sinks
        copied = memo[id(self)] = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)  # (a subclass's lock or client, shared)
        copied.spans = copy.deepcopy(self.spans, memo)
        copied.sinks = copy.copy(self.sinks)
        return copied

    @contextmanager
    def span(self, kind: SpanKind, name: str, parent: Span | None,
             attributes: dict[str, Any] | None = None) -> Iterator[Span]:
        """A span around the block; an exception leaving the block marks it failed."""
        span = Span(kind, name, parent, dict(attributes or {}))
        self.spans.append(span)
        for sink in self.sinks:
            sink.on_start(span)
        try:
            yield span
        except BaseException as err:
            # a cancellation's text is anyio's scope and task (a line of internals); asked of
            # asyncio's class, not anyio's, which needs a running loop (a span of sync code)
            # (a message whose __str__ fails: the type alone, not that failure in its place)
            span.error = span.error or (f"{type(err).__name__}: cancelled"
                                        if _is_cancellation(err) else described(err))
            raise
        finally:
            span.end = time.perf_counter()
            for sink in reversed(self.sinks):  # as they started, the last first: each sink's
                sink.on_end(span)  # context is detached in the order it was attached

    def timeline(self) -> str:
        """The spans as an indented plain-text timeline: offset, duration, name, key figures."""
        if not self.spans:
            return "(no spans)"
        origin = min(s.start for s in self.spans)
        lines = []
        for span in _tree_order(self.spans):
            figures = _figures(span)
            status = f"  FAILED {span.error}" if span.error else ""
            lines.append(f"{span.start - origin:8.3f}s {span.duration_s * 1000:9.1f} ms  "
                         f"{'  ' * span.depth}{span.name}{figures}{status}")
        return "\n".join(lines)


def _is_cancellation(err: BaseException) -> bool:
    """Whether ``err`` is the event loop's cancellation: asyncio's, or trio's (anyio runs on
    either; its own ``get_cancelled_exc_class`` needs a running loop)."""
    kind = type(err)
    return isinstance(err, asyncio.CancelledError) or (
        kind.__name__ == "Cancelled" and kind.__module__.split(".")[0] == "trio")


def _tree_order(spans: list[Span]) -> list[Span]:
    children: dict[int | None, list[Span]] = {}
    for s in spans:
        children.setdefault(s.parent.id if s.parent else None, []).append(s)
    known = {s.id for s in spans}
    roots = [s for s in spans if s.parent is None or s.parent.id not in known]
    out: list[Span] = []

    def walk(span: Span) -> None:
        out.append(span)
        for child in sorted(children.get(span.id, []), key=lambda c: c.start):
            walk(child)

    for root in sorted(roots, key=lambda r: r.start):
        walk(root)
    return out


_SHOWN = {"agentflash.mode": "mode", "gen_ai.usage.output_tokens": "tokens",
          "agentflash.tau": "tau", "agentflash.tokens_per_s": "tok/s",
          "agentflash.tokens.drafted": "drafted", "agentflash.tokens.accepted": "accepted",
          "agentflash.tokens.forced": "forced",
          "agentflash.finish_reason": "finish", "agentflash.tool.is_error": "error",
          "agentflash.handoff.to": "handoff"}


def _figures(span: Span) -> str:
    parts = [f"{label}={span.attributes[key]}" for key, label in _SHOWN.items()
             if key in span.attributes]
    return "  [" + " ".join(parts) + "]" if parts else ""


def default_sinks() -> list[SpanSink]:
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        return []
    return [OtelSink()]


def _otel_value(value: Any) -> Any:
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, bool, int, float))
                                                for v in value):
        return list(value)
    return json.dumps(value, default=str)


class OtelSink:
    """Mirrors spans into OpenTelemetry as they start and end (imported lazily)."""

    # context keys every sink reads: a root span's (its id, the context before any sink started
    # it), and each provider's span current there (a sink's provider -> span: a run inside a
    # tool has sinks of its own, to the same providers)
    _outer_key: str | None = None
    _own_key: str | None = None

    def __init__(self, tracer_provider: Any = None):
        from opentelemetry import context, trace

        self._trace, self._context = trace, context
        self._tracer = trace.get_tracer("agentflash", tracer_provider=tracer_provider)
        self._live: dict[int, Any] = {}
        # the provider it exports to, named once: the global one (None, or the one that is
        # global now: a run's own sinks may name it so) as "global" (resolved at each start, a
        # provider set while a run was in flight split one run's spans between two keys)
        self._given = tracer_provider  # (held: its id names it while the sink lives)
        self._key = ("global" if tracer_provider is None
                     or tracer_provider is trace.get_tracer_provider() else id(tracer_provider))
        if OtelSink._outer_key is None:
            OtelSink._outer_key = context.create_key("agentflash.outer")
            OtelSink._own_key = context.create_key("agentflash.own")

    def _root_context(self, span: Span, current: Any) -> tuple[Any, Any]:
        """Where a root span starts, and the context before any sink started it. With two
        sinks, the second's root was the first's span's child, and a run inside a tool of
        another run hung off the other sink's tool span: a root starts in the application's
        context, or, where that is a span of agentflash's sinks (a run inside a tool), under
        the span of this sink's provider there."""
        mark = self._context.get_value(OtelSink._outer_key, current)
        before = mark[1] if mark is not None and mark[0] == span.id else current
        own = self._context.get_value(OtelSink._own_key, before) or {}
        now = self._trace.get_current_span(before)
        if self._key in own and any(now is s for s in own.values()):
            return self._trace.set_span_in_context(own[self._key]), before
        return before, before

    def on_start(self, span: Span) -> None:
        parent = self._live.get(span.parent.id, (None,))[0] if span.parent else None
        current = self._context.get_current()
        if parent is not None:
            context = self._trace.set_span_in_context(parent)
        else:
            context, before = self._root_context(span, current)
        kind = (self._trace.SpanKind.CLIENT if span.kind is SpanKind.GENERATION
                else self._trace.SpanKind.INTERNAL)
        # what is known at the start (the operation, the model asked for): samplers and span
        # processors read it there
        known = {k: _otel_value(v) for k, v in span.attributes.items() if v is not None}
        otel = self._tracer.start_span(span.name, context=context, kind=kind,
                                       start_time=span.start_ns, attributes=known)
        # current while it runs: spans a tool (or the application) opens inside it nest there
        inner = self._trace.set_span_in_context(otel, current)
        own = self._context.get_value(OtelSink._own_key, current) or {}
        inner = self._context.set_value(OtelSink._own_key, {**own, self._key: otel}, inner)
        if parent is None:
            inner = self._context.set_value(OtelSink._outer_key, (span.id, before), inner)
        token = self._context.attach(inner)
        self._live[span.id] = (otel, token)

    def on_end(self, span: Span) -> None:
        otel, token = self._live.pop(span.id)
        self._context.detach(token)
        for key, value in span.attributes.items():
            if value is not None:
                otel.set_attribute(key, _otel_value(value))
        if span.error:
            from opentelemetry.trace import Status, StatusCode

            otel.set_attribute("error.type", span.error.split(":", 1)[0])
            otel.set_status(Status(StatusCode.ERROR, span.error))
        otel.end(end_time=span.start_ns + int(span.duration_s * 1e9))


# Per-segment token counts the engine may report, summed over a generation's segments.
SEGMENT_COUNTS = ("drafted", "accepted", "forced")


def generation_attributes(stats: dict[str, Any], finish_reason: str) -> dict[str, Any]:
    """A generation span's attributes from the engine's stats."""
    segments = stats.get("segments") or []
    totals = {f"agentflash.tokens.{key}": sum(seg.get(key, 0) for seg in segments)
              for key in SEGMENT_COUNTS if any(key in seg for seg in segments)}
    return {**totals,
        "gen_ai.usage.input_tokens": stats.get("prompt_tokens"),
        "gen_ai.usage.cache_read.input_tokens": stats.get("cached_prompt_tokens"),
        "gen_ai.usage.output_tokens": stats.get("new_tokens"),
        "gen_ai.response.finish_reasons": [finish_reason],
        "agentflash.finish_reason": finish_reason,
        "agentflash.mode": stats.get("mode"),
        "agentflash.tau": stats.get("tau"),
        "agentflash.target_forwards": stats.get("target_forwards"),
        "agentflash.draft_forwards": stats.get("draft_forwards"),
        "agentflash.tokens_per_s": stats.get("tokens_per_s"),
        "agentflash.segments": json.dumps(stats.get("segments", [])),  # a list of objects
    }
