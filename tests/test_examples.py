"""Every example runs here: the workflows and SDK scripts, on a scripted model that writes the
way the demo model was trained to (their logic), and on a tiny random model through the real
engine and the command line (their mechanics)."""

import importlib.util
import json
import re
from pathlib import Path

import anyio
import pytest
from typer.testing import CliRunner

from agentflash.backends.local import LocalBackend
from agentflash.backends.scripted import ScriptedBackend, ScriptedTurn
from agentflash.cli import app
from agentflash.runtime import GuardrailTripped, load_workflow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WORKFLOWS = sorted(EXAMPLES.glob("*.yaml"))


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


flights_server = load_example("flights_server")
weather_tools = load_example("weather_tools")


@pytest.fixture(scope="module")
def flights():
    with flights_server.serving():
        yield


def _value(text: str):
    return int(text) if text.isdigit() else text


def demo_like(request) -> ScriptedTurn | str:
    """Replies in the demo model's trained format: "Use NAME with k v, k v." becomes a call, a
    tool result becomes "NAME returned status S with id N.", a structured answer is JSON."""
    last = request.messages[-1]
    if last["role"] == "tool":
        result = json.loads(last["content"])
        if request.output_schema:
            keys = request.output_schema["properties"]
            return json.dumps({k: v for k, v in result.items() if k in keys})
        return f"{last['name']} returned status {result['status']} with id {result.get('id')}."
    use = re.match(r"Use (\w+) with (.*)\.$", last["content"])
    if use:
        pairs = (part.split(" ", 1) for part in use.group(2).split(", "))
        return ScriptedTurn.calls((use.group(1), {k: _value(v) for k, v in pairs}))
    trip = re.match(r"Plan a trip to (\w+) for (\d+) days\.", last["content"])
    if trip and request.output_schema:
        return json.dumps({"city": trip.group(1), "days": int(trip.group(2))})
    return "A short summary."


def run_workflow(name: str, inputs=None):
    wf = load_workflow(EXAMPLES / f"{name}.yaml")
    return anyio.run(lambda: wf.run(inputs, backend=ScriptedBackend(demo_like)))


def test_every_example_workflow_validates():
    assert {p.stem for p in WORKFLOWS} == {"travel", "handoff", "structured"}
    for path in WORKFLOWS:
        result = CliRunner().invoke(app, ["validate", str(path)])
        assert result.exit_code == 0 and ": ok (workflow" in result.stdout


def test_travel_calls_a_python_and_an_http_tool_concurrently(flights):
    result = run_workflow("travel", {"city": "Oslo", "days": "3"})
    weather = weather_tools.get_weather("Oslo", 3)
    flight = result.steps["flights"].tool_calls[0]
    assert result.steps["weather"].tool_calls[0].to_dict() == {
        "name": "get_weather", "arguments": {"city": "Oslo", "days": 3},
        "result": json.dumps(weather)}
    assert flight.name == "search_flights" and flight.arguments == {"to": "Oslo"}
    assert json.loads(flight.result)["flights"][0].startswith("AF")  # from the real server
    assert result.outputs["weather"] == f"get_weather returned status ok with id {weather['id']}."
    assert result.outputs["flights"].startswith("search_flights returned status ok with id ")
    assert result.outputs["summary"] == "A short summary."
    spans = {s.name: s for s in result.tracer.spans}
    weather_run, flights_run = spans["run forecaster"], spans["run booker"]
    assert weather_run.start < flights_run.end and flights_run.start < weather_run.end


def test_handoff_passes_the_question_to_the_forecaster():
    result = run_workflow("handoff", {"city": "Lima"})
    step = result.steps["ask"]
    assert step.agent == "forecaster"
    assert step.tool_calls[0].to_dict() == {
        "name": "transfer_to_forecaster", "arguments": {"reason": "weather in Lima"},
        "result": '{"status": "ok", "assistant": "forecaster"}'}
    assert result.outputs == {"answer": "transfer_to_forecaster returned status ok with id None."}


def test_structured_outputs_keep_their_structure():
    result = run_workflow("structured", {"city": "Rome"})
    booking = weather_tools.book_hotel("Rome", 2)
    assert result.outputs == {"plan": {"city": "Rome", "days": 3},
                              "booking": {"status": "ok", "id": booking["id"]}}
    assert result.steps["hotel"].tool_calls[0].arguments == {"city": "Rome", "guests": 2}


def cli(*args):
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_travel_runs_on_the_engine_with_the_json_contract(tiny_model_dir, flights):
    code, out, err = cli("run", str(EXAMPLES / "travel.yaml"), "--model", str(tiny_model_dir),
                         "--input", "city=Paris", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc) == {"outputs", "steps", "stats"}
    assert set(doc["outputs"]) == {"weather", "flights", "summary"}
    for step in ("weather", "flights", "summary"):
        assert set(doc["steps"][step]) == {"output", "tool_calls", "stats"}
        stats = doc["steps"][step]["stats"]
        assert stats["modes"] == ["plain"] and 0 < stats["new_tokens"] <= 64 * stats["turns"]
        assert all("kind" in seg for seg in stats["generations"][0]["segments"])
    assert doc["stats"]["steps"] == 3 and doc["stats"]["new_tokens"] > 0


def test_handoff_runs_on_the_engine_with_a_live_view(tiny_model_dir):
    code, out, err = cli("run", str(EXAMPLES / "handoff.yaml"), "--model", str(tiny_model_dir))
    assert code == 0, err
    assert out.startswith("answer: ")
    assert "workflow handoff" in err and "ask" in err and "tok/s" in err
    assert err.endswith("┘\n")  # the view's last line ends: what follows it starts a line


def test_structured_fails_clearly_on_a_random_model(tiny_model_dir):
    # Under the grammar a random model still never ends its JSON: it writes digits until
    # max_tokens. The runner stops the run and says why.
    code, out, err = cli("run", str(EXAMPLES / "structured.yaml"), "--model", str(tiny_model_dir),
                         "--json")
    assert code == 1
    # stdout is JSON still: the error, and the steps that finished (none: each cut its JSON)
    assert json.loads(out) == {"error": err.removeprefix("error: ").strip(), "steps": {}}
    assert re.match(r"error: step '(plan|hotel)' \(agent '(planner|concierge)'\) failed: ", err)
    assert "cut at max_tokens" in err
    assert "Traceback" not in err


def test_bad_cli_inputs_exit_2(tmp_path):
    code, _, err = cli("run", str(EXAMPLES / "travel.yaml"), "--input", "days=many")
    assert code == 2 and "input 'days' must be of type integer, got 'many'" in err
    code, _, err = cli("run", str(tmp_path / "missing.yaml"))
    assert code == 2 and "file does not exist" in err


def test_sdk_tools_script(tiny_model_dir, capsys):
    sdk = load_example("sdk_tools")
    script = ScriptedBackend([ScriptedTurn.calls(("get_weather", {"city": "Oslo", "days": 3})),
                              "get_weather returned status ok with id 403."])
    result = anyio.run(sdk.main, script)
    assert result.final_output == "get_weather returned status ok with id 403."
    assert result.tool_calls[0].result == json.dumps(sdk.get_weather("Oslo", 3))
    printed = capsys.readouterr().out
    assert "get_weather({'city': 'Oslo', 'days': 3}) -> " in printed and "run assistant" in printed
    result = anyio.run(sdk.main, LocalBackend(tiny_model_dir))
    assert result.stats()["new_tokens"] > 0 and "final output:" in capsys.readouterr().out


def test_sdk_handoff_script(tiny_model_dir, capsys):
    sdk = load_example("sdk_handoff")
    results = anyio.run(sdk.main, ScriptedBackend(demo_like))
    assert isinstance(results["secret"], GuardrailTripped)
    assert results["Oslo"].last_agent == results["Lima"].last_agent == "forecaster"
    assert "secret: input guardrail 'no_secrets' stopped the run" in capsys.readouterr().out
    results = anyio.run(sdk.main, LocalBackend(tiny_model_dir))
    assert {k for k, r in results.items() if not isinstance(r, GuardrailTripped)} == {"Oslo",
                                                                                     "Lima"}


def test_live_view_follows_the_run():
    from agentflash.runtime.live_view import WorkflowView
    from agentflash.runtime.workflow import StepEvent

    wf = load_workflow(EXAMPLES / "handoff.yaml")
    view = WorkflowView(wf)
    seen = []

    async def main():
        async with wf.run_streamed(backend=ScriptedBackend(demo_like)) as run:
            async for event in run:
                view.update(event)
                if isinstance(event, StepEvent) and type(event.event).__name__ == "ToolCallDelta":
                    seen.append(view.rows["ask"].writing)

    anyio.run(main)
    assert seen[-1] == 'transfer_to_forecaster({"reason": "weather in Lima"}'
    row = view.rows["ask"]
    assert row.status == "done" and row.agent == "forecaster"
    assert row.tools == ["transfer_to_forecaster ok"] and row.new_tokens > 0


def test_live_view_marks_each_call_of_a_tool_by_its_own_result():
    # two calls of one tool finishing out of order: the first result marked the first cell
    from agentflash.runtime import events as ev
    from agentflash.runtime.live_view import WorkflowView
    from agentflash.runtime.workflow import StepEvent

    view = WorkflowView(load_workflow(EXAMPLES / "handoff.yaml"))
    step = next(iter(view.rows))
    for call_id, seconds in (("c0", 1.0), ("c1", 0.0)):
        view.update(StepEvent(step, ev.ToolStarted("a", call_id, "wait", {"s": seconds})))
    view.update(StepEvent(step, ev.ToolResult("a", "c1", "wait", {"s": 0.0}, "{}", False, 0.0)))
    view.update(StepEvent(step, ev.ToolResult("a", "c0", "wait", {"s": 1.0}, "{}", True, 0.1)))
    view.update(StepEvent(step, ev.ToolResult("a", "c2", "nope", {}, "{}", True, 0.0)))
    assert view.rows[step].tools == ["wait failed", "wait ok", "nope failed"]
    # text after a call writes its own cell (it was written after the call's: 'wait({"s": 1} Ok')
    view.update(StepEvent(step, ev.ToolCallDelta("a", 0, "wait", '{"s": 1}')))
    view.update(StepEvent(step, ev.TextDelta("a", " Checking now.")))
    assert view.rows[step].writing == " Checking now."
    view.update(StepEvent(step, ev.ToolCallDelta("a", 1, "wait", '{"s": 2}')))
    assert view.rows[step].writing == 'wait({"s": 2}'


def test_live_view_marks_the_failed_step_and_the_cancelled_ones_apart():
    from agentflash.runtime.errors import MaxTurnsExceeded, StepFailed
    from agentflash.runtime.live_view import WorkflowView, _Row

    view = WorkflowView(load_workflow(EXAMPLES / "handoff.yaml"))
    view.rows = {"bad": _Row("looper"), "other": _Row("writer"), "later": _Row("writer")}
    view.rows["bad"].status = view.rows["other"].status = "running"
    view.fail(StepFailed("bad", "looper", MaxTurnsExceeded("agent 'looper' reached max_turns")))
    assert (view.rows["bad"].status, view.rows["bad"].writing) == (
        "failed", "agent 'looper' reached max_turns")
    assert (view.rows["other"].status, view.rows["other"].writing) == ("cancelled", "")
    assert view.rows["later"].status == "not run"  # never started
    view.rows["other"].status = "running"
    view.fail(KeyboardInterrupt())  # Ctrl-C: what ran is cancelled, not failed
    assert view.rows["other"].status == "cancelled"
    # a step that failed before it started (its input's template): failed, with the reason
    view.rows = {"early": _Row("writer"), "later": _Row("writer")}
    view.fail(StepFailed("early", "writer", ValueError("template error: no element 0")))
    assert (view.rows["early"].status, view.rows["early"].writing) == (
        "failed", "template error: no element 0")
    assert view.rows["later"].status == "not run"


def test_live_view_fits_any_terminal_with_every_status_shown():
    """At any width the table fits, a step is one line, and its status and counts stay whole
    (rich squeezed them to nothing once a row was too wide); long names are cut, below 90
    columns the tool calls and the writing are left out, below 47 the counts, then the agent
    (at 20 columns every cell was blank)."""
    from rich.console import Console

    from agentflash.runtime.errors import StepFailed
    from agentflash.runtime.live_view import WorkflowView

    view = WorkflowView(load_workflow(EXAMPLES / "travel.yaml"))
    long_step = "a_step_whose_identifier_goes_on_and_on_and_on"
    view.rows[long_step] = view.rows.pop("weather")
    view.rows[long_step].status = "running"
    view.rows[long_step].tools = ["lookup_flights ok", "get_weather ok"]
    reason = "cannot reach http://127.0.0.1:9/v1/chat/completions after 5 attempts: refused"
    view.fail(StepFailed(long_step, "forecaster", RuntimeError(reason)))
    for width in (20, 30, 40, 46, 47, 50, 60, 80, 100, 160):
        console = Console(width=width, record=True)
        console.print(view)
        lines = console.export_text().splitlines()
        assert max(map(len, lines)) <= width, (width, lines)
        body = [line for line in lines if line.startswith("│")]
        assert len(body) == len(view.rows), (width, lines)  # one line a step
        (failed,) = [line for line in body if "│ failed    │" in line]
        assert failed.startswith("│ a_s") and sum("not run" in line for line in body) == 2
        assert ("│ fore" in failed) == (width >= 30), (width, failed)  # the agent, then
        assert ("│      0 │" in failed) == (width >= 40), (width, failed)  # its tokens
        assert ("│ cannot reach" in failed) == (width >= 90), (width, failed)


def test_live_view_shows_text_that_looks_like_markup_as_it_is():
    """What a model writes and an error's message are shown as text: "d[key]" is not rich's
    markup (it was left out), and "[/b]" does not end the view with a MarkupError."""
    from rich.console import Console

    from agentflash.runtime.errors import StepFailed
    from agentflash.runtime.live_view import WorkflowView, _Row

    view = WorkflowView(load_workflow(EXAMPLES / "handoff.yaml"))
    view.rows = {"coder": _Row("coder", "running", writing="d[key] = a[i] + 1"),
                 "bad": _Row("writer", "running")}
    view.fail(StepFailed("bad", "writer", RuntimeError("see [/b] and [bold]")))
    view.rows["coder"].status, view.rows["coder"].writing = "running", "d[key] = a[i] + 1"
    console = Console(width=160, record=True)
    console.print(view)
    text = console.export_text()
    assert "d[key] = a[i] + 1" in text and "see [/b] and [bold]" in text
