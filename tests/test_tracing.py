"""Spans of a run: their tree, timings, speed stats, the plain timeline and OpenTelemetry export."""

import anyio
import pytest

from agentflash.backends.scripted import ScriptedBackend, ScriptedTurn
from agentflash.runtime import Agent, Runner, tool
from agentflash.runtime.runner import _span_error
from agentflash.runtime.tracing import SpanKind, Tracer


@tool
async def get_weather(city: str) -> dict:
    """Get the weather."""
    await anyio.sleep(0.05)
    return {"status": "ok", "city": city}


@tool
def broken(city: str) -> dict:
    """Always fails."""
    raise RuntimeError("down")


SCRIPT = [ScriptedTurn.calls(("get_weather", {"city": "Oslo"}), ("broken", {"city": "Oslo"})),
          "Sunny in Oslo."]


def traced_run(tracer: Tracer):
    agent = Agent("forecaster", tools=[get_weather, broken])
    return Runner.run_sync(agent, "weather?", backend=ScriptedBackend(SCRIPT), tracer=tracer)


def test_spans_form_a_tree_with_timings_and_stats():
    tracer = Tracer(sinks=[])
    result = traced_run(tracer)
    assert result.tracer is tracer
    kinds = [(s.kind, s.name) for s in tracer.spans]
    assert kinds == [(SpanKind.RUN, "run forecaster"),
                     (SpanKind.TURN, "invoke_agent forecaster"),
                     (SpanKind.GENERATION, "chat scripted"),
                     (SpanKind.TOOL, "execute_tool get_weather"),
                     (SpanKind.TOOL, "execute_tool broken"),
                     (SpanKind.TURN, "invoke_agent forecaster"),
                     (SpanKind.GENERATION, "chat scripted")]
    run, turn, gen, ok_tool, bad_tool = tracer.spans[:5]
    assert turn.parent is run and gen.parent is turn and ok_tool.parent is turn
    assert all(s.end is not None and s.end >= s.start for s in tracer.spans)
    assert ok_tool.duration_s >= 0.05 and run.duration_s >= ok_tool.duration_s
    assert gen.attributes["gen_ai.operation.name"] == "chat"
    assert gen.attributes["agentflash.mode"] == "scripted"
    assert gen.attributes["gen_ai.usage.output_tokens"] > 0
    assert ok_tool.attributes["gen_ai.tool.name"] == "get_weather" and ok_tool.error is None
    # the failure as the model reads it, not that JSON with its type again
    assert bad_tool.error == "RuntimeError: down", bad_tool.error
    assert _span_error("RuntimeError", '{"status": "error", "error": "RuntimeError"}') == \
        "RuntimeError"  # (an exception without a message: its type once)
    timeline = tracer.timeline()
    assert timeline.splitlines()[0].endswith("run forecaster")
    assert "      execute_tool broken  [error=True]  FAILED" in timeline
    assert "chat scripted  [mode=scripted tokens=" in timeline


def test_a_call_that_runs_no_tool_has_its_span_too():
    # an unknown tool's call and a malformed one were answered with no span in the trace
    tracer = Tracer(sinks=[])
    script = [ScriptedTurn.calls(("nope", {})).text
              + '<tool_call>\n{"name": "get_weather", "arguments":\n</tool_call>', "Done."]
    Runner.run_sync(Agent("a", tools=[get_weather]), "go", backend=ScriptedBackend(script),
                    tracer=tracer)
    tools = [s for s in tracer.spans if s.kind is SpanKind.TOOL]
    assert [s.name for s in tools] == ["execute_tool nope", "execute_tool get_weather"]
    assert tools[0].error.startswith("unknown_tool: ") and "unknown tool 'nope'" in tools[0].error
    assert tools[1].error.startswith("malformed_tool_call: ")
    assert all(s.parent.kind is SpanKind.TURN for s in tools)
    # marked as a tool's that ran and failed is (a query on it missed these)
    assert all(s.attributes["agentflash.tool.is_error"] is True for s in tools)


def test_a_run_the_backend_refuses_keeps_its_trace_on_the_error():
    # only a RunError carried it: a turn the backend refused (a UserError) had none
    from agentflash.errors import UserError

    def refused(request):
        raise UserError("HTTP 401: refused")

    with pytest.raises(UserError, match="turn 1: HTTP 401: refused") as err:
        Runner.run_sync(Agent("a"), "hi", backend=ScriptedBackend(refused))
    lines = err.value.tracer.timeline().splitlines()
    assert lines[0].endswith("run a  FAILED UserError: agent 'a', turn 1: HTTP 401: refused")
    assert "chat scripted  FAILED" in lines[-1]


def test_every_failed_or_cancelled_run_keeps_its_trace_on_the_error(tmp_path):
    """Only a RunError or a UserError carried it: a guardrail of the user's that raised, a
    backend's own exception and a cancelled run (RunCancelled) had none."""
    from agentflash.runtime import Guardrail, RunCancelled
    from agentflash.runtime.errors import ModelBehaviorError

    def broken(text):
        raise ValueError("guardrail bug")

    with pytest.raises(ValueError, match="guardrail bug") as err:
        Runner.run_sync(Agent("a", input_guardrails=[Guardrail(broken)]), "hi",
                        backend=ScriptedBackend(["ok"]))
    assert "FAILED ValueError: guardrail bug" in err.value.tracer.timeline()

    def down(request):
        raise RuntimeError("backend down")

    with pytest.raises(RuntimeError) as err:
        Runner.run_sync(Agent("a"), "hi", backend=ScriptedBackend(down))
    assert "FAILED RuntimeError" in err.value.tracer.timeline()

    async def cancelled():
        async with Runner.run_streamed(Agent("a"), "hi", backend=ScriptedBackend(
                [ScriptedTurn("slow", delay_s=5)])) as run:
            run.cancel()
        return run

    for loop, cancellation in (("asyncio", "CancelledError"), ("trio", "Cancelled")):
        run = anyio.run(cancelled, backend=loop)
        with pytest.raises(RunCancelled) as err:
            print(run.result)
        assert err.value.tracer is not None
        # its spans say it was cancelled, not which of anyio's scopes and tasks did it (trio's
        # said "cancelled due to explicit from task <Task ...>")
        failed = [s.error for s in err.value.tracer.spans if s.error]
        assert failed and all(e == f"{cancellation}: cancelled" for e in failed), failed
    # a run's own trace where a run inside it (a guardrail's agent) raised the error first:
    # the inner run's was kept, and the outer run's was lost
    async def judged(text):
        await Runner.run(Agent("checker", output_type=int), text,
                         backend=ScriptedBackend(["not a number"]))

    with pytest.raises(ModelBehaviorError, match="'checker' must answer") as err:
        Runner.run_sync(Agent("outer", input_guardrails=[Guardrail(judged)]), "hi",
                        backend=ScriptedBackend(["ok"]))
    assert [s.name for s in err.value.tracer.spans][0] == "run outer"
    # a workflow's too (its RunCancelled had none: its tracer was made inside the run's task)
    from agentflash.runtime.workflow import load_workflow

    (tmp_path / "w.yaml").write_text("version: 1\nname: w\nagents: {a: {instructions: hi}}\n"
                                     "steps: [{id: s, agent: a, input: go}]\n")
    flow = load_workflow(tmp_path / "w.yaml")

    async def cancelled_flow():
        async with flow.run_streamed(backend=ScriptedBackend(
                [ScriptedTurn("slow", delay_s=5)])) as run:
            await anyio.sleep(0.2)
            run.cancel()
        return run

    run = anyio.run(cancelled_flow)
    with pytest.raises(RunCancelled) as err:
        print(run.result)
    assert "invoke_workflow w" in err.value.tracer.timeline()
    # and a run whose block was left before its events were read says so when iterated
    async def iterate_late():
        async with Runner.run_streamed(Agent("a"), "hi", backend=ScriptedBackend(["ok"])) as run:
            pass
        return [event async for event in run]

    from agentflash.errors import UserError

    with pytest.raises(UserError, match="block was left before its events were read"):
        anyio.run(iterate_late)


def test_a_span_of_sync_code_keeps_the_error_that_left_it():
    # asking anyio for its cancellation class outside an event loop raised NoEventLoopError
    # in place of the user's own error
    from agentflash.runtime import Tracer
    from agentflash.runtime.tracing import SpanKind

    tracer = Tracer()
    with pytest.raises(KeyError, match="city"), tracer.span(SpanKind.TOOL, "lookup", None):
        raise KeyError("city")
    assert tracer.spans[0].error == "KeyError: 'city'"


def test_an_error_whose_message_fails_is_the_error_the_span_and_the_run_keep():
    # str(err) raising in the span's handler put a TypeError in place of the user's error, and
    # left the span unmarked
    class PolicyDenied(Exception):
        def __init__(self, rule):
            self.rule = rule

        def __str__(self):
            return "denied by " + self.rule  # an int: this fails

    def check(output):
        raise PolicyDenied(rule=42)

    from agentflash.runtime.agent import Guardrail

    agent = Agent(name="A", instructions="a", output_guardrails=[Guardrail(check)])
    tracer = Tracer(sinks=[])
    with pytest.raises(PolicyDenied):
        anyio.run(lambda: Runner.run(agent, "hi", backend=ScriptedBackend(["done"]),
                                     tracer=tracer))
    assert [s.error for s in tracer.spans if s.kind is SpanKind.RUN] == ["PolicyDenied"]
    from agentflash.runtime import StepFailed

    assert str(StepFailed("one", "A", PolicyDenied(rule=42))) == (
        "step 'one' (agent 'A') failed: PolicyDenied")


def test_two_opentelemetry_sinks_each_get_the_tree():
    # the sinks ended in the order they started (contexts detached out of order: a span the
    # application opened later nested under an ended one), and the second sink's roots were
    # children of the first sink's spans
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agentflash.runtime.tracing import OtelSink

    exporters, sinks = [], []
    for _ in range(2):
        exporter, provider = InMemorySpanExporter(), TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        exporters.append(exporter)
        sinks.append(OtelSink(provider))
    app = TracerProvider().get_tracer("app")

    def check(output):
        with app.start_as_current_span("output check") as span:
            return span

    from agentflash.runtime.agent import Guardrail

    opened = []
    agent = Agent(name="A", instructions="a",
                  output_guardrails=[Guardrail(lambda output: opened.append(check(output)))])
    traced_run(Tracer(sinks=sinks))
    Runner.run_sync(agent, "hi", backend=ScriptedBackend(["done"]), tracer=Tracer(sinks=sinks))
    for exporter in exporters:
        spans = exporter.get_finished_spans()
        ids = {s.context.span_id: s.name for s in spans}
        parents = {s.name: ids.get(s.parent.span_id, "foreign") if s.parent else None
                   for s in spans}
        assert parents["run forecaster"] is None and parents["run A"] is None
        assert parents["invoke_agent forecaster"] == "run forecaster"
        assert parents["execute_tool broken"] == "invoke_agent forecaster"
    (span,) = opened  # the guardrail's span: under the run, not the turn that had ended
    names = {s.context.span_id: s.name for s in exporters[1].get_finished_spans()}
    assert names[span.parent.span_id] == "run A"
    # a run inside a tool of another run (its own tracer and sinks, to the same providers)
    # nests under each provider's own tool span (the first's hung off the second's), and under
    # a span the application opened there
    made = []
    for exporter in exporters:
        exporter.clear()
        made.append(TracerProvider())
        made[-1].add_span_processor(SimpleSpanProcessor(exporter))

    def sinks_again():
        return [OtelSink(provider) for provider in made]

    outer = Tracer(sinks=sinks_again())
    with outer.span(SpanKind.RUN, "outer", None) as root:
        with outer.span(SpanKind.TOOL, "tool", root):
            with Tracer(sinks=sinks_again()).span(SpanKind.RUN, "inner", None):
                pass
            with made[0].get_tracer("app").start_as_current_span("app"):
                with Tracer(sinks=sinks_again()).span(SpanKind.RUN, "inner 2", None):
                    pass
    for exporter in exporters:
        spans = exporter.get_finished_spans()
        ids = {s.context.span_id: s.name for s in spans}
        parents = {s.name: ids.get(s.parent.span_id, "foreign") if s.parent else None
                   for s in spans}
        assert parents["inner"] == "tool", parents
    app_id = next(s for s in exporters[0].get_finished_spans() if s.name == "app").context.span_id
    for exporter in exporters:
        (inner,) = (s for s in exporter.get_finished_spans() if s.name == "inner 2")
        assert inner.parent.span_id == app_id
    # the global provider named two ways (default_sinks' None, a run's own sinks given
    # trace.get_tracer_provider()) is one provider: its inner root hung off another's span
    from opentelemetry import trace

    assert OtelSink()._key == OtelSink(trace.get_tracer_provider())._key == "global"


def test_opentelemetry_export_follows_the_genai_conventions():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agentflash.runtime.tracing import OtelSink

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traced_run(Tracer(sinks=[OtelSink(provider)]))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"run forecaster", "invoke_agent forecaster", "chat scripted",
                          "execute_tool get_weather", "execute_tool broken"}
    chat, tool_span = spans["chat scripted"], spans["execute_tool get_weather"]
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["gen_ai.request.model"] == "scripted"
    assert tuple(chat.attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    assert chat.attributes["agentflash.segments"] == "[]"
    assert tool_span.attributes["gen_ai.tool.name"] == "get_weather"
    turns = [s for s in exporter.get_finished_spans() if s.name.startswith("invoke_agent")]
    first_turn = min(turns, key=lambda s: s.start_time)
    assert tool_span.parent.span_id == first_turn.context.span_id
    assert first_turn.parent.span_id == spans["run forecaster"].context.span_id
    assert spans["execute_tool broken"].status.status_code.name == "ERROR"
    assert spans["execute_tool broken"].attributes["error.type"] == "RuntimeError"
    assert tool_span.end_time - tool_span.start_time >= 50_000_000  # ns


def test_opentelemetry_spans_carry_the_provider_output_type_and_cache_reads_from_the_start():
    # gen_ai.provider.name (required) and gen_ai.output.type were missing, cached prompt tokens
    # went under agentflash's own name, and a span processor saw no attribute at a span's start
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agentflash.runtime.tracing import OtelSink

    at_start = {}

    class OnStart(SpanProcessor):
        def on_start(self, span, parent_context=None):
            at_start[span.name] = dict(span.attributes or {})

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(OnStart())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    reply = ScriptedTurn('{"x": 1}', stats={"cached_prompt_tokens": 7})
    Runner.run_sync(Agent("a", output_type=schema), "hi", backend=ScriptedBackend([reply]),
                    tracer=Tracer(sinks=[OtelSink(provider)]))
    (chat,) = [s for s in exporter.get_finished_spans() if s.name == "chat scripted"]
    assert chat.attributes["gen_ai.provider.name"] == "agentflash"
    assert chat.attributes["gen_ai.output.type"] == "json"
    assert chat.attributes["gen_ai.usage.cache_read.input_tokens"] == 7
    assert at_start["chat scripted"]["gen_ai.operation.name"] == "chat"
    assert at_start["chat scripted"]["gen_ai.request.model"] == "scripted"
    from agentflash.backends.openai import OpenAIBackend

    assert OpenAIBackend("http://127.0.0.1:9/v1", "m").provider_name == "openai"


def test_spans_a_tool_opens_nest_under_its_execute_tool_span():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agentflash.runtime.tracing import OtelSink

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = provider.get_tracer("app")

    @tool
    def query(q: str) -> str:  # sync: runs in a thread of its own
        with app.start_as_current_span("db query"):
            return "rows"

    @tool
    async def fetch(url: str) -> str:
        with app.start_as_current_span("http get"):
            return "page"

    agent = Agent("a", tools=[query, fetch])
    script = [ScriptedTurn.calls(("query", {"q": "x"}), ("fetch", {"url": "y"})), "done"]
    Runner.run_sync(agent, "go", backend=ScriptedBackend(script),
                    tracer=Tracer(sinks=[OtelSink(provider)]))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    for inner, outer in (("db query", "execute_tool query"), ("http get", "execute_tool fetch")):
        assert spans[inner].parent.span_id == spans[outer].context.span_id


def test_default_sinks_follow_what_is_importable():
    from agentflash.runtime.tracing import OtelSink, default_sinks

    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        assert default_sinks() == []
    else:
        assert [type(s) for s in default_sinks()] == [OtelSink]


def test_speculation_figures_of_the_segments_reach_the_spans():
    segments = [{"kind": "tool_call", "mode": "dflash", "tokens": 30, "drafted": 40,
                 "accepted": 25, "forced": 9},
                {"kind": "prose", "mode": "plain", "tokens": 5, "drafted": 0, "accepted": 0,
                 "forced": 0}]
    reply = ScriptedTurn("Done.", stats={"mode": "auto", "tau": 5.2, "segments": segments})
    tracer = Tracer(sinks=[])
    Runner.run_sync(Agent("a"), "go", backend=ScriptedBackend([reply]), tracer=tracer)
    gen = next(s for s in tracer.spans if s.kind is SpanKind.GENERATION)
    assert gen.attributes["agentflash.tokens.drafted"] == 40
    assert gen.attributes["agentflash.tokens.accepted"] == 25
    assert gen.attributes["agentflash.tokens.forced"] == 9
    assert gen.attributes["agentflash.tau"] == 5.2
    timeline = tracer.timeline()
    assert "mode=auto" in timeline and "drafted=40 accepted=25 forced=9" in timeline


def test_workflow_steps_and_handoffs_have_their_own_marks_in_the_trace():
    from pathlib import Path

    from agentflash.backends.scripted import tool_call_text
    from agentflash.runtime import load_workflow

    path = Path(__file__).resolve().parent.parent / "examples" / "handoff.yaml"
    wf = load_workflow(path)
    script = [ScriptedTurn(tool_call_text("transfer_to_forecaster", {"reason": "weather"})),
              "Sunny."]
    result = anyio.run(lambda: wf.run({"city": "Lima"}, backend=ScriptedBackend(script)))
    spans = result.tracer.spans
    (step,) = [s for s in spans if "agentflash.step.id" in s.attributes]
    assert step.name == f"step {step.attributes['agentflash.step.id']}"
    assert step.parent is spans[0] and spans[0].name == f"invoke_workflow {wf.name}"
    run = next(s for s in spans if s.parent is step)
    assert run.kind is SpanKind.RUN and run.name.startswith("run ")
    turns = [s for s in spans if s.kind is SpanKind.TURN]
    assert [t.attributes.get("agentflash.handoff.to") for t in turns] == ["forecaster", None]
    (call,) = [s for s in spans if s.kind is SpanKind.TOOL]
    assert call.name == "execute_tool transfer_to_forecaster" and call.parent is turns[0]
    assert call.attributes["gen_ai.tool.type"] == "handoff" and call.error is None
