"""The run loop on the scripted backend: tool dispatch, concurrency, errors, handoffs, structured
output, guardrails, max turns, tool choice and cancellation."""

import asyncio
import copy
import json
import pickle
import threading
from typing import Literal

import anyio
import pytest
from pydantic import BaseModel

from agentflash.backends.base import Decoding, ForceTool, ToolChoice
from agentflash.backends.scripted import ScriptedBackend, ScriptedTurn, tool_call_text
from agentflash.errors import UserError
from agentflash.json_formats import value_validator
from agentflash.runtime import (
    Agent,
    AgentTurnStarted,
    FinalOutput,
    GenerationStats,
    Guardrail,
    GuardrailTripped,
    HandoffOccurred,
    MaxTurnsExceeded,
    ModelBehaviorError,
    RunCancelled,
    Runner,
    TextDelta,
    ToolCallDelta,
    ToolResult,
    ToolStarted,
    tool,
)
from agentflash.runtime.agent import OutputValidationError, handoff_tool_name, output_spec


@tool
def get_weather(city: str, days: int = 1) -> dict:
    """Get the weather forecast for a city."""
    return {"status": "ok", "city": city, "days": days}


def run(agent, script, input="Use get_weather with city Oslo.", **options):
    """The run's result and every event it streamed."""
    backend = ScriptedBackend(script)

    async def main():
        events = []
        async with Runner.run_streamed(agent, input, backend=backend, **options) as streamed:
            async for event in streamed:
                events.append(event)
        return streamed.result, events

    result, events = anyio.run(main)
    return result, events, backend


def test_text_reply_is_the_final_output():
    result, events, backend = run(Agent("a"), ["Hello there."])
    assert result.final_output == "Hello there." and result.last_agent == "a"
    assert isinstance(events[0], AgentTurnStarted) and isinstance(events[-1], FinalOutput)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hello there."
    request = backend.requests[0]
    assert request.messages[0] == {"role": "system", "content": "You are a helpful assistant."}
    assert request.messages[1:] == [{"role": "user", "content": "Use get_weather with city Oslo."}]
    assert result.messages[-1] == {"role": "assistant", "content": "Hello there."}


def test_an_inputs_text_parts_are_joined():
    # OpenAI's content parts, as serve and generate read them (the run refused them)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Use get_weather "},
                                          {"type": "text", "text": "with city Oslo."}]}]
    result, _, backend = run(Agent("a"), ["Hello there."], input=parts)
    assert backend.requests[0].messages[1:] == [
        {"role": "user", "content": "Use get_weather with city Oslo."}]
    assert result.messages[0]["content"] == "Use get_weather with city Oslo."
    assert parts[0]["content"][0]["text"] == "Use get_weather "  # (the caller's list kept)


def test_a_run_on_a_backend_without_torch_does_not_import_it():
    # the first turn imported torch (checking its messages), seconds inside the step's time
    import subprocess
    import sys

    code = ("import sys\n"
            "from agentflash.backends.scripted import ScriptedBackend\n"
            "from agentflash.runtime import Agent, Runner\n"
            "r = Runner.run_sync(Agent('a'), [{'role': 'user', 'content': 'hi'}],\n"
            "                    backend=ScriptedBackend(['hello']))\n"
            "print(r.final_output, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["hello", "False"]


def test_tool_call_round_trip_and_the_messages_the_model_sees_next():
    agent = Agent("a", tools=[get_weather])
    result, events, backend = run(agent, [
        ScriptedTurn.calls(("get_weather", {"city": "Oslo", "days": 3})),
        "get_weather returned status ok."])
    assert result.final_output == "get_weather returned status ok."
    assert [r.to_dict() for r in result.tool_calls] == [{
        "name": "get_weather", "arguments": {"city": "Oslo", "days": 3},
        "result": '{"status": "ok", "city": "Oslo", "days": 3}'}]
    second = backend.requests[1].messages
    assert second[2]["role"] == "assistant" and second[2]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}
    assert second[3] == {"role": "tool", "tool_call_id": second[2]["tool_calls"][0]["id"],
                         "name": "get_weather",
                         "content": '{"status": "ok", "city": "Oslo", "days": 3}'}
    assert backend.requests[0].tools[0]["function"]["name"] == "get_weather"
    deltas = "".join(e.arguments_delta for e in events if isinstance(e, ToolCallDelta))
    assert json.loads(deltas) == {"city": "Oslo", "days": 3}
    assert sum(isinstance(e, GenerationStats) for e in events) == 2


def test_a_call_is_dispatched_while_the_model_is_still_writing():
    started = []

    @tool
    async def lookup(key: str) -> str:
        started.append(key)
        return key.upper()

    agent = Agent("a", tools=[lookup])
    reply = ScriptedTurn(tool_call_text("lookup", {"key": "x"}) + " and now a long tail " * 4,
                         delay_s=0.02)
    _, events, _ = run(agent, [reply, "done"])
    kinds = [type(e).__name__ for e in events]
    first_result = kinds.index("ToolResult")
    assert "TextDelta" in kinds[first_result + 1:]  # the result came before the prose ended
    assert kinds.index("ToolStarted") < kinds.index("GenerationStats")


def meeting_tool(tool_name: str, calls: int):
    """A tool whose calls return (``"<name> ok"``) only once ``calls`` of them run at once."""
    all_running, running = anyio.Event(), []

    @tool(name=tool_name, timeout_s=3)
    async def meet(name: str) -> str:
        running.append(name)
        if len(running) == calls:
            all_running.set()
        await all_running.wait()
        return f"{name} ok"

    return meet


def test_parallel_calls_run_concurrently():
    agent = Agent("a", tools=[meeting_tool("wait_for_partner", 2)])
    result, _, _ = run(agent, [ScriptedTurn.calls(("wait_for_partner", {"name": "x"}),
                                                  ("wait_for_partner", {"name": "y"})), "done"])
    assert [(c.result, c.is_error) for c in result.tool_calls] == [("x ok", False),
                                                                   ("y ok", False)]


def test_tool_errors_timeouts_bad_calls_go_back_to_the_model():
    @tool(timeout_s=0.1)
    async def hang() -> str:
        await anyio.sleep(10)
        return "never"

    @tool
    def explode(x: int) -> int:
        raise RuntimeError("the service is down")

    agent = Agent("a", tools=[hang, explode])
    script = [ScriptedTurn(tool_call_text("hang") + tool_call_text("explode", {"x": 1})
                           + tool_call_text("explode", {"x": "one"}) + tool_call_text("nope")
                           + '<tool_call>{"name": "explode", "arguments": {"x": </tool_call>'
                           + '<tool_call>{"name": "expl</tool_call>'
                           + '<tool_call>{"name": "", "arguments": {}}</tool_call>'),
              "Sorry, the tools failed."]
    result, events, backend = run(agent, script)
    assert result.final_output == "Sorry, the tools failed."
    errors = [json.loads(c.result)["error"] for c in result.tool_calls]
    assert all(c.is_error for c in result.tool_calls) and len(errors) == 7
    # a call that breaks off after its name keeps the name (it was 'invalid'); a call of no
    # name goes back as 'invalid' (a call of "" is refused by serve and OpenAI: the next turn
    # failed there)
    assert [c.name for c in result.tool_calls] == ["hang", "explode", "explode", "nope",
                                                   "explode", "invalid", "invalid"]
    called = [c["function"]["name"] for c in backend.requests[1].messages[-8]["tool_calls"]]
    assert called == [c.name for c in result.tool_calls]
    assert "unknown tool ''" in errors[6]
    assert "hang timed out after 0.1 s" in errors[0]
    assert "RuntimeError: the service is down" in errors[1]
    assert "invalid arguments for explode: x:" in errors[2]
    assert "unknown tool 'nope' (tools: explode, hang)" in errors[3]
    # what the model wrote goes back to it in the result, not as the call's arguments
    assert errors[4].startswith("malformed tool call (invalid JSON")
    assert errors[4].endswith('{"name": "explode", "arguments": {"x":')
    tool_messages = [m for m in backend.requests[1].messages if m["role"] == "tool"]
    assert [json.loads(m["content"])["error"] for m in tool_messages] == errors
    # the conversation the run leaves is one a next run takes as its input
    Runner.run_sync(agent, result.messages, backend=ScriptedBackend(["again"]))
    assert sum(isinstance(e, ToolResult) for e in events) == 7
    started = [e.call_id for e in events if isinstance(e, ToolStarted)]
    results = [e.call_id for e in events if isinstance(e, ToolResult)]
    assert sorted(started) == sorted(results)  # each result pairs with its start
    assert all(events.index(next(e for e in events if isinstance(e, ToolStarted)
                                 and e.call_id == cid))
               < events.index(next(e for e in events if isinstance(e, ToolResult)
                                   and e.call_id == cid)) for cid in results)


def test_an_answer_with_nan_is_not_json():
    class Reading(BaseModel):
        value: float

    spec = output_spec(Reading)
    assert spec.parse('{"value": 1.5}') == Reading(value=1.5)
    for text in ('{"value": NaN}', '{"value": -Infinity}'):
        with pytest.raises(OutputValidationError, match="reply: not JSON"):
            spec.parse(text)


def test_a_call_whose_json_python_cannot_read_goes_back_to_the_model():
    # valid JSON to its grammar, but past what Python converts or recurses into: malformed
    @tool
    def add(a: int) -> int:
        return a

    digits = '{"name": "add", "arguments": {"a": ' + "9" * 5000 + "}}"
    # (deep past 3.13's reader, which reads 5,000 levels where 3.11's recursion stops)
    deep = '{"name": "add", "arguments": {"a": ' + "[" * 20000 + "]" * 20000 + "}}"
    script = [ScriptedTurn(f"<tool_call>{digits}</tool_call><tool_call>{deep}</tool_call>"),
              "done"]
    result, _, _ = run(Agent("a", tools=[add]), script)
    assert result.final_output == "done"
    assert [(c.name, c.is_error) for c in result.tool_calls] == [("add", True), ("add", True)]
    assert all(json.loads(c.result)["error"].startswith("malformed tool call (invalid JSON")
               for c in result.tool_calls)


def test_handoff_passes_the_conversation_to_the_target():
    writer = Agent("writer", instructions="You write summaries.", handoff_description="Writes.")
    other = Agent("other")
    triage = Agent("triage", handoffs=[writer, other])
    result, events, backend = run(triage, [
        ScriptedTurn(tool_call_text("transfer_to_writer", {"reason": "needs prose"})
                     + tool_call_text("transfer_to_other")),
        "A short summary."])
    assert result.final_output == "A short summary." and result.last_agent == "writer"
    assert [e for e in events if isinstance(e, HandoffOccurred)] == [
        HandoffOccurred("triage", "writer", "needs prose")]
    names = [t["function"]["name"] for t in backend.requests[0].tools]
    assert names == ["transfer_to_writer", "transfer_to_other"]
    assert "Writes." in backend.requests[0].tools[0]["function"]["description"]
    second = backend.requests[1]
    assert second.messages[0] == {"role": "system", "content": "You write summaries."}
    assert second.messages[1]["content"] == "Use get_weather with city Oslo."
    results = [json.loads(c.result) for c in result.tool_calls]
    assert results[0] == {"status": "ok", "assistant": "writer"}
    assert "only one handoff per turn" in results[1]["error"]


class Trip(BaseModel):
    city: str
    days: int


def test_structured_output_is_parsed_into_the_output_type():
    agent = Agent("planner", output_type=Trip)
    result, events, backend = run(agent, ['{"city": "Oslo", "days": 3}'])
    assert result.final_output == Trip(city="Oslo", days=3)
    assert events[-1] == FinalOutput("planner", Trip(city="Oslo", days=3))
    request = backend.requests[0]
    assert request.output_schema == {"type": "object", "additionalProperties": False,
                                     "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                                     "required": ["city", "days"]}
    assert '"days"' in request.messages[0]["content"]  # the schema is shown to the model


@pytest.mark.parametrize("reply, problem", [
    ("Oslo for three days.", "reply: not JSON (Expecting value)"),
    ('{"city": "Oslo", "days": "three"}', "days:"),
    ('{"city": "Oslo", "days": true}', "days: Input should be a valid integer"),
    # a key the schema shown refuses, which pydantic dropped (a model without the grammar)
    ('{"city": "Oslo", "days": 3, "notes": "x"}', "notes: Extra inputs are not permitted"),
    (ScriptedTurn('{"city": "Oslo", "da', finish_reason="length"), "cut at max_tokens"),
])
def test_a_reply_that_is_not_the_output_type_stops_the_run_without_retrying(reply, problem):
    agent = Agent("planner", output_type=Trip)
    with pytest.raises(ModelBehaviorError, match="must answer with Trip") as err:
        run(agent, [reply, '{"city": "Oslo", "days": 3}'])
    assert problem in str(err.value)
    assert ("cut at max_tokens" in str(err.value)) == isinstance(reply, ScriptedTurn)


def test_a_dict_schema_s_date_and_time_are_checked_as_the_grammar_writes_them():
    """A reply without the grammar (a remote server's) that was no date passed a dict schema,
    where a pydantic model refused it; a time is RFC 3339's, with its offset."""
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                               "t": {"type": "string", "format": "time"}}}
    agent = Agent("a", output_type=schema)
    for reply in ('{"d": "2024-02-30"}', '{"d": "soon"}', '{"t": "12:30:00"}'):
        with pytest.raises(ModelBehaviorError, match="is not a '(date|time)'"):
            run(agent, [reply])
    reply = '{"d": "2024-02-29", "t": "12:30:00Z"}'
    assert run(agent, [reply])[0].final_output == json.loads(reply)


def test_an_output_schema_s_pattern_ends_at_the_text_s_end():
    """Python's "$" (jsonschema's re.search) matched before a last newline: a remote server's
    "2024-02-29\\n" passed as a date, "ab\\n" a pattern's ^[a-z]+$."""
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                               "w": {"type": "string", "pattern": "^[a-z]+$"}}}
    agent = Agent("a", output_type=schema)
    for reply, problem in (('{"d": "2024-02-29\\n"}', "is not a 'date'"),
                           ('{"w": "ab\\n"}', "does not match")):
        with pytest.raises(ModelBehaviorError, match=problem):
            run(agent, [reply])
    reply = '{"d": "2024-02-29", "w": "ab"}'
    assert run(agent, [reply])[0].final_output == json.loads(reply)
    # an anchor "$" anywhere; a "$" escaped or in a class is the character
    for pattern, text, taken in (("^(?:a$|b)", "a\n", False), ("^(?:a$|b)", "b\n", True),
                                 ("^[$]$", "$", True), ("^[$]$", "$\n", False),
                                 ("^a\\$$", "a$", True), ("^a\\$$", "a$\n", False),
                                 ("^[]$]+$", "]$", True), ("^[^]a]$", "$\n", False)):
        assert value_validator({"pattern": pattern}).is_valid(text) == taken, (pattern, text)


def test_a_key_s_pattern_ends_at_the_key_s_end():
    """Only "pattern" read "$" as JSON Schema does: patternProperties, additionalProperties
    and unevaluatedProperties matched a key with re.search, and {"abc\\n": 1} passed keys of
    ^[a-z]+$ alone."""
    keys = {"patternProperties": {"^[a-z]+$": {"type": "integer"}}}
    agent = Agent("a", output_type={"type": "object", **keys, "additionalProperties": False})
    with pytest.raises(ModelBehaviorError, match="does not match any of the regexes"):
        run(agent, ['{"abc\\n": 1}'])
    assert run(agent, ['{"abc": 1}'])[0].final_output == {"abc": 1}
    for schema, value, taken in (
            (keys, {"abc\n": "x"}, True), (keys, {"abc": "x"}, False),
            ({**keys, "additionalProperties": {"type": "string"}}, {"abc\n": 1}, False),
            ({**keys, "additionalProperties": {"type": "string"}}, {"abc\n": "x"}, True),
            ({**keys, "unevaluatedProperties": False}, {"abc\n": 1}, False),
            ({"allOf": [keys], "unevaluatedProperties": False}, {"abc\n": 1}, False),
            ({"$defs": {"k": keys}, "$ref": "#/$defs/k", "unevaluatedProperties": False},
             {"abc": 1}, True),
            ({"allOf": [keys], "unevaluatedProperties": False}, {"abc": 1}, True)):
        assert value_validator(schema).is_valid(value) == taken, (schema, value)


def test_multiple_of_is_exact_on_the_numbers_as_written():
    """jsonschema divides floats: 0.07 / 0.01 is 7.000000000000001, and an answer the grammar
    wrote under multipleOf 0.01 (it checks the decimal text) failed the agent's own check."""
    from decimal import Decimal

    import numpy as np

    agent = Agent("a", output_type={"type": "object", "properties": {
        "price": {"type": "number", "multipleOf": 0.01}}, "required": ["price"]})
    for reply in ('{"price": 0.07}', '{"price": 1.15}', '{"price": 0.29}', '{"price": 7}'):
        assert run(agent, [reply])[0].final_output == json.loads(reply)
    with pytest.raises(ModelBehaviorError, match="is not a multiple of 0.01"):
        run(agent, ['{"price": 0.071}'])
    for step, value, taken in ((0.1, 0.3, True), (0.1, 0.7, True), (0.1, 0.35, False),
                               (3, 9.0, True), (3, 2**60, False), (0.5, float("inf"), False),
                               (0.5, float("nan"), False), (2.5, 7.5, True),
                               (3, 3 * 10**5000, True), (3, 10**5000, False),  # (past 4,300
                               (10**5000, 0.5, False),  # digits an int's text raised)
                               (0.5, np.float64(1.5), True), (0.5, np.int64(4), True),
                               (0.5, Decimal("2"), True), (1, Decimal("3"), True),
                               (0.1, Decimal("0.3"), True), (0.5, np.float64(1.2), False),
                               (0.5, Decimal("NaN"), False), (0.5, Decimal("Infinity"), False),
                               (0.01, Decimal("1E-10000000"), False),  # (Fraction: 8 s)
                               (0.01, Decimal("100E-4"), True), (0.01, Decimal("0E-99999"), True)):
        assert value_validator({"multipleOf": step}).is_valid(value) == taken, (step, value)


def test_a_number_cut_at_max_tokens_is_no_answer_a_whole_value_is():
    """A number cut short still parses (848 of 8481): not an answer. An object the grammar
    closed on the last token is whole, cut or not."""
    with pytest.raises(ModelBehaviorError, match="the number was cut at max_tokens"):
        run(Agent("a", output_type=int), [ScriptedTurn("848", finish_reason="length")])
    result, _, _ = run(Agent("a", output_type=int), [ScriptedTurn("848")])
    assert result.final_output == 848

    class City(BaseModel):
        city: str

    result, _, _ = run(Agent("a", output_type=City),
                       [ScriptedTurn('{"city": "Oslo"}', finish_reason="length")])
    assert result.final_output == City(city="Oslo")


def test_json_schema_output_type():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    result, _, _ = run(Agent("a", output_type=schema), ['{"n": 4}'])
    assert result.final_output == {"n": 4}
    with pytest.raises(ModelBehaviorError, match="'n' is a required property"):
        run(Agent("a", output_type=schema), ['{"m": 4}'])
    # Python's json reads NaN (past "minimum", and printed as invalid JSON): no JSON number
    bounded = {"type": "object", "properties": {"x": {"type": "number", "minimum": 0}}}
    with pytest.raises(ModelBehaviorError, match="not JSON \\(NaN is not a JSON number\\)"):
        run(Agent("a", output_type=bounded), ['{"x": NaN}'])
    # a number JSON's grammar allows past a float's range: Python read it as infinity
    with pytest.raises(ModelBehaviorError, match="not JSON \\(1e999 is past the range of a "):
        run(Agent("a", output_type=bounded), ['{"x": 1e999}'])


def test_input_guardrail_stops_the_run_before_any_model_turn():
    def no_passwords(text):
        return "the input mentions a password" if "password" in text else None

    agent = Agent("a", input_guardrails=[no_passwords])
    backend = ScriptedBackend(["never"])
    with pytest.raises(GuardrailTripped, match="input guardrail 'no_passwords' stopped the run: "
                                               "the input mentions a password") as err:
        Runner.run_sync(agent, "my password is x", backend=backend)
    assert backend.requests == []
    # back from a process pool: __init__ was called with its message alone (a TypeError)
    back = pickle.loads(pickle.dumps(err.value))
    assert (str(back), back.kind, back.reason) == (str(err.value), "input", err.value.reason)
    assert back.tracer.timeline() == err.value.tracer.timeline()  # its trace came along
    from agentflash.runtime.tracing import Tracer

    sink = object()  # a copy in this process exports where the tracer did; a pickle cannot
    class Mine(Tracer):
        def __init__(self, sinks=None):
            super().__init__(sinks)
            self.lock = threading.Lock()  # (a deep copy of it raised a TypeError)

    for copied in (copy.copy(Mine([sink])), copy.deepcopy(Mine([sink]))):
        assert copied.sinks == [sink] and type(copied) is Mine
    assert Runner.run_sync(agent, "hello", backend=backend).final_output == "never"


def test_output_guardrail_sees_the_final_output():
    async def short_trips(trip):
        return f"{trip.days} days is too long" if trip.days > 7 else None

    agent = Agent("planner", output_type=Trip, output_guardrails=[short_trips])
    assert run(agent, ['{"city": "Oslo", "days": 3}'])[0].final_output.days == 3
    with pytest.raises(GuardrailTripped, match="output guardrail 'short_trips'.*30 days"):
        run(agent, ['{"city": "Oslo", "days": 30}'])


def test_max_turns_stops_a_model_that_keeps_calling_tools():
    agent = Agent("a", tools=[get_weather], max_turns=3)
    loop = [ScriptedTurn.calls(("get_weather", {"city": "Oslo"}))] * 5
    backend = ScriptedBackend(loop)
    with pytest.raises(MaxTurnsExceeded, match=r"agent 'a' reached max_turns \(3\)"):
        Runner.run_sync(agent, "go", backend=backend)
    assert len(backend.requests) == 3


def test_max_turns_names_why_the_last_turns_calls_failed():
    # an agent without tools whose model writes a call anyway (the demo model does) uses its
    # turns up on calls of tools it does not have: the error says so
    agent = Agent("writer", max_turns=1)
    backend = ScriptedBackend([ScriptedTurn.calls(("compute_weather", {"city": "Oslo"}))])
    with pytest.raises(MaxTurnsExceeded, match=r"agent 'writer' reached max_turns \(1\) without "
                                               r"a final output \(its last turn's call of "
                                               r"'compute_weather' failed: unknown tool "
                                               r"'compute_weather' \(tools: none\)\)$"):
        Runner.run_sync(agent, "go", backend=backend)
    agent = Agent("a", tools=[get_weather], max_turns=1)  # a call that ran: nothing to add
    backend = ScriptedBackend([ScriptedTurn.calls(("get_weather", {"city": "Oslo"}))])
    with pytest.raises(MaxTurnsExceeded, match=r"reached max_turns \(1\) without a final "
                                               r"output$"):
        Runner.run_sync(agent, "go", backend=backend)


def test_max_turns_counts_the_turns_of_the_agent_that_holds_the_conversation():
    forecaster = Agent("forecaster", max_turns=1)
    triage = Agent("triage", handoffs=[forecaster])
    handoff = tool_call_text("transfer_to_forecaster", {"reason": "weather"})
    backend = ScriptedBackend([handoff, "sunny"])  # the forecaster's one turn answers
    assert Runner.run_sync(triage, "hi", backend=backend).final_output == "sunny"
    backend = ScriptedBackend([handoff, ScriptedTurn.calls(("get_weather", {"city": "Oslo"})),
                               "sunny"])
    forecaster.tools.append(get_weather)
    with pytest.raises(MaxTurnsExceeded, match=r"agent 'forecaster' reached max_turns \(1\)"):
        Runner.run_sync(triage, "hi", backend=backend)
    assert len(backend.requests) == 2  # the triage's turn and the forecaster's one


def test_handoffs_that_go_round_in_a_cycle_end_at_max_turns():
    b = Agent("b", max_turns=3)
    a = Agent("a", handoffs=[b], tool_choice=ForceTool("transfer_to_b"), max_turns=2)
    b.handoffs.append(a)

    def hand_over(request):  # each agent hands the conversation to the other, forever
        name = request.tools[0]["function"]["name"]
        return ScriptedTurn(tool_call_text(name, {"reason": "yours"}))

    backend = ScriptedBackend(hand_over)
    with pytest.raises(MaxTurnsExceeded, match=r"agent 'a' reached max_turns \(2\)"):
        Runner.run_sync(a, "hi", backend=backend)
    assert len(backend.requests) == 4  # a, b, a, b: a's third turn is over its two


def test_a_forced_tool_choice_stays_spent_when_the_conversation_comes_back():
    """``tool_choice`` holds until the agent has called a tool in the run: a handoff back to it
    forced it again (its answer refused, or a forced handoff back and forth to max_turns)."""
    specialist = Agent("specialist")
    triage = Agent("triage", tools=[get_weather], handoffs=[specialist],
                   tool_choice="required")
    specialist.handoffs.append(triage)
    result, _, backend = run(triage, [
        ScriptedTurn.calls(("get_weather", {"city": "Oslo"})),
        ScriptedTurn.calls(("transfer_to_specialist", {"reason": "go"})),
        ScriptedTurn.calls(("transfer_to_triage", {"reason": "back"})), "All done."])
    assert (result.final_output, result.last_agent) == ("All done.", "triage")
    assert [r.tool_choice for r in backend.requests] == [
        ToolChoice.REQUIRED, ToolChoice.AUTO, ToolChoice.AUTO, ToolChoice.AUTO]


def test_a_spent_tool_choice_is_the_agent_s_own_not_its_name_s():
    """Two agents of one name: the one that handed off spent the other's ``required`` too,
    whose first turn was not forced and whose text answer ended the run."""
    worker = Agent("support", tools=[get_weather], tool_choice="required")
    front = Agent("support", handoffs=[worker])
    result, _, backend = run(front, [
        ScriptedTurn.calls(("transfer_to_support", {"reason": "go"})),
        ScriptedTurn.calls(("get_weather", {"city": "Oslo"})), "Sunny."])
    assert [r.tool_choice for r in backend.requests] == [
        ToolChoice.AUTO, ToolChoice.REQUIRED, ToolChoice.AUTO]
    assert [c.name for c in result.tool_calls] == ["transfer_to_support", "get_weather"]


def test_a_call_is_given_back_to_the_model_as_it_wrote_it():
    """json.dumps re-wrote it (Z\\u00fcrich for Zürich, 2.0 for 2.00), and the next turn's
    prompt was another than a server's, which replays a call as written."""
    written = '{"city":"Zürich", "days": 2}'
    result, _, backend = run(Agent("a", tools=[get_weather]), [
        ScriptedTurn(f'<tool_call>\n{{"name": "get_weather", "arguments": {written}}}\n'
                     f'</tool_call>'),
        ScriptedTurn('<tool_call>\n{"arguments": {"city": "Zürich"}, "name": "get_weather"}'
                     '\n</tool_call>'), "Sunny."])
    calls = [m["tool_calls"][0]["function"]["arguments"]
             for m in backend.requests[2].messages if m.get("tool_calls")]
    assert calls == [written, '{"city": "Zürich"}']  # (another key order: re-written)
    assert [c.arguments for c in result.tool_calls] == [{"city": "Zürich", "days": 2},
                                                        {"city": "Zürich"}]


def test_agents_named_in_other_scripts_get_handoff_tools_of_their_own():
    """Every letter outside A-Z became "_": two agents named in Chinese were both
    transfer_to___, and an agent could not hand off to both."""
    weather, translate = Agent("天气"), Agent("翻译")
    triage = Agent("Café", handoffs=[weather, translate])
    result, _, backend = run(triage, [
        ScriptedTurn.calls(("transfer_to_u7ffbu8bd1", {"reason": "translate"})), "好"])
    assert (result.final_output, result.last_agent) == ("好", "翻译")
    names = [t["function"]["name"] for t in backend.requests[0].tools]
    assert names == ["transfer_to_u5929u6c14", "transfer_to_u7ffbu8bd1"]
    # long names that begin alike: cut, with a hash of the whole name
    a, b = Agent("天气预报员北京上海广州深圳"), Agent("天气预报员北京上海广州杭州")
    Agent("triage", handoffs=[a, b])  # no clash
    assert len({handoff_tool_name(a), handoff_tool_name(b)}) == 2
    assert all(len(handoff_tool_name(x)) <= 64 for x in (a, b))


def test_a_required_call_is_made_only_by_a_call_that_reaches_a_tool():
    agent = Agent("a", tools=[get_weather], tool_choice="required")
    script = [ScriptedTurn('<tool_call>{"name": "get_weather", "arguments": {"ci'),  # cut
              ScriptedTurn.calls(("get_weather", {"town": "Oslo"})),  # invalid arguments
              ScriptedTurn.calls(("nope", {})),  # no such tool
              ScriptedTurn.calls(("get_weather", {"city": "Oslo"})), "sunny"]
    result, _, backend = run(agent, script)
    assert result.final_output == "sunny" and result.finish_reason == "stop"
    assert [r.tool_choice for r in backend.requests] == [ToolChoice.REQUIRED] * 4 + [
        ToolChoice.AUTO]


def test_an_answer_cut_by_max_tokens_says_so(tiny_model_dir):
    from agentflash.backends.local import LocalBackend

    async def main():
        async with LocalBackend(str(tiny_model_dir), drafter="none") as backend:
            agent = Agent("a", decoding=Decoding(max_tokens=3, temperature=0))
            one = Agent("b", decoding=Decoding(max_tokens=1, temperature=0))
            return (await Runner.run(agent, "Tell me a long story.", backend=backend),
                    await Runner.run(one, "Tell me a long story.", backend=backend))

    result, one = anyio.run(main)
    assert result.finish_reason == "length" and result.stats()["new_tokens"] == 3
    # the prompt's forward gave the one token, no decode forward: tau is the engine's, 1.0
    stats = one.stats()
    assert (stats["target_forwards"], stats["tau"]) == (0, 1.0) == (
        0, stats["generations"][0]["tau"])


def test_an_agent_changed_after_it_was_built_is_checked_as_when_built():
    class Answer(BaseModel):
        city: str

    agent = Agent("a")
    agent.output_type = Answer
    agent.tool_choice = "required"  # checked at the run: fields that must agree change in turn
    with pytest.raises(UserError, match="tool_choice is required but the agent has no tools"):
        run(agent, ["x"])
    agent.tools.append(get_weather.fn)  # a plain function, as the constructor takes them
    script = [ScriptedTurn.calls(("get_weather", {"city": "Oslo"})), '{"city": "Oslo"}']
    result, _, backend = run(agent, script)
    assert result.final_output == Answer(city="Oslo")
    assert backend.requests[0].tool_choice is ToolChoice.REQUIRED
    assert backend.requests[0].tools[0]["function"]["name"] == "get_weather"
    agent.max_turns = 0
    with pytest.raises(UserError, match="max_turns must be a positive integer"):
        run(agent, ["x"])
    # a list changed in place is checked too
    twice = Agent("t", tools=[get_weather])
    twice.tools.append(get_weather)
    with pytest.raises(UserError, match="tool 'get_weather' is listed twice"):
        twice.turn_tools()
    # a handoff target renamed to no name (re.sub's TypeError before)
    target = Agent("b")
    source = Agent("a", handoffs=[target])
    for bad in (None, " "):
        target.name = bad
        with pytest.raises(UserError, match="a handoff target's Agent.name must be a non-empty"):
            source.turn_tools()
    # a forced tool swapped for another, one field after the other
    def lookup(key: str) -> str:
        """Look a key up."""
        return key

    swap = Agent("s", tools=[get_weather], tool_choice=ForceTool("get_weather"))
    swap.tools = [lookup]
    swap.tool_choice = ForceTool("lookup")
    assert swap.turn_tools()[0].keys() == {"lookup"}
    # a handoff target changed, and one changed by a tool in the run: checked before its
    # max_turns was compared (a TypeError, or MaxTurnsExceeded blaming the model)
    for bad in (0, "3"):
        target.name, target.max_turns = "b", bad
        with pytest.raises(UserError, match=f"agent 'b': max_turns must .* got {bad!r}"):
            run(source, [ScriptedTurn.calls(("transfer_to_b", {"reason": "go"})), "x"])

    @tool
    def shrink() -> str:
        """Shrink."""
        me.max_turns = "5"
        return "ok"

    me = Agent("me", tools=[shrink])
    with pytest.raises(UserError, match="agent 'me': max_turns must .* got '5'"):
        run(me, [ScriptedTurn.calls(("shrink", {})), "x"])


@pytest.mark.parametrize("fields, error", [
    ({"tools": [5]}, "agent 'a': tools[0]: @tool needs a function, got int"),
    ({"input_guardrails": [print, 5]}, "agent 'a': input_guardrails[1]: a guardrail needs a "
                                       "function, got int"),
    ({"output_guardrails": ["x"]}, "agent 'a': output_guardrails[0]: a guardrail needs a "
                                   "function, got str"),
    ({"handoff_description": 5}, "agent 'a': handoff_description must be a string, got int"),
])
def test_a_bad_tool_or_guardrail_names_its_agent_and_field(fields, error):
    with pytest.raises(UserError) as err:
        Agent("a", **fields)
    assert str(err.value) == error


def test_a_guardrail_s_name_that_is_no_string_is_refused():
    with pytest.raises(UserError, match="^guardrail name must be a string, got int$"):
        Guardrail(print, name=5)  # kept, and shown in errors as 5
    assert Guardrail(print, name=None).name == Guardrail(print).name == "print"


def test_a_guardrail_s_bad_verdict_names_its_agent_and_kind():
    agent = Agent("a", output_guardrails=[lambda output: False])
    with pytest.raises(UserError, match=r"^agent 'a': output guardrail '<lambda>' must return "
                                        r"None or a reason \(str\), got bool$"):
        run(agent, ["hi"])


def test_a_handoff_with_arguments_a_handoff_has_not_is_refused():
    writer = Agent("writer")
    triage = Agent("triage", handoffs=[writer])
    script = [ScriptedTurn(tool_call_text("transfer_to_writer", {"reason": 5})),
              ScriptedTurn(tool_call_text("transfer_to_writer", {"why": "x"})),
              ScriptedTurn(tool_call_text("transfer_to_writer", {"reason": "prose"})), "Done."]
    result, _, _ = run(triage, script)
    assert result.last_agent == "writer" and result.final_output == "Done."
    errors = [json.loads(c.result).get("error") for c in result.tool_calls]
    assert errors == ["invalid arguments for transfer_to_writer: reason: must be a string",
                      "invalid arguments for transfer_to_writer: why: not an argument of a "
                      "handoff (reason)", None]


def test_tool_choice_is_checked_and_resets_after_a_call():
    agent = Agent("a", tools=[get_weather], tool_choice="required")
    result, _, backend = run(agent, [ScriptedTurn.calls(("get_weather", {"city": "Oslo"})), "ok"])
    assert [r.tool_choice for r in backend.requests] == [ToolChoice.REQUIRED, ToolChoice.AUTO]
    with pytest.raises(ModelBehaviorError, match="must call a tool on this turn"):
        run(agent, ["I will not."])
    forced = Agent("a", tools=[get_weather], tool_choice=ForceTool("get_weather"))
    with pytest.raises(ModelBehaviorError, match="although tool_choice forces 'get_weather'"):
        run(forced, [ScriptedTurn.calls(("transfer_to_x", {}))])
    # a call cut at max_tokens is not a call of another tool: its error goes back to the model
    cut = ScriptedTurn('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os',
                       finish_reason="length")
    result, _, backend = run(forced, [cut, ScriptedTurn.calls(("get_weather", {"city": "Oslo"})),
                                      "done"])
    assert result.final_output == "done"
    first, second = result.tool_calls
    assert first.is_error and "not closed with </tool_call>" in json.loads(first.result)["error"]
    assert not second.is_error and second.arguments == {"city": "Oslo"}
    called = []

    @tool
    def record(x: int) -> int:
        called.append(x)
        return x

    silent = Agent("a", tools=[record], tool_choice=ToolChoice.NONE)
    with pytest.raises(ModelBehaviorError, match="although tool_choice is none"):
        run(silent, [ScriptedTurn.calls(("record", {"x": 1}))])
    assert called == []  # a forbidden call is never dispatched


def test_cancelling_a_run_stops_the_generation_and_running_tools():
    cancelled = []

    @tool
    async def forever() -> str:
        try:
            await anyio.sleep(30)
        finally:
            cancelled.append(True)
        return "never"

    agent = Agent("a", tools=[forever])
    slow_reply = ScriptedTurn(tool_call_text("forever") + " still writing" * 50, delay_s=0.01)
    backend = ScriptedBackend([slow_reply])

    async def main():
        with anyio.fail_after(10):
            async with Runner.run_streamed(agent, "go", backend=backend) as streamed:
                async for event in streamed:
                    if isinstance(event, ToolStarted):
                        streamed.cancel()
        assert streamed.is_finished
        with pytest.raises(RunCancelled):
            _ = streamed.result

    anyio.run(main)
    assert cancelled == [True]


def test_a_streamed_run_cancelled_from_outside_is_finished_and_cancelled():
    # a timeout around the run left it "not finished" (result: "read the events first") and
    # its event stream open
    @tool
    async def slow() -> str:
        """Slow."""
        await anyio.sleep(30)
        return "never"

    backend = ScriptedBackend([ScriptedTurn.calls(("slow", {})), "ok"])

    async def main():
        with anyio.move_on_after(0.2):
            async with Runner.run_streamed(Agent("a", tools=[slow]), "go",
                                           backend=backend) as streamed:
                async for _ in streamed:
                    pass
        return streamed

    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        streamed = anyio.run(main)
        assert streamed.is_finished
        with pytest.raises(RunCancelled):
            _ = streamed.result
        del streamed
        gc.collect()
    assert not [w for w in caught if "MemoryObjectSendStream" in str(w.message)]


def test_a_tool_whose_own_awaited_task_is_cancelled_fails_like_any_tool():
    """A CancelledError raised inside the tool (a task it awaited was cancelled), not by a
    cancel scope around the run, is the tool's failure: an error result for the model."""
    import asyncio

    @tool
    async def fetch() -> str:
        """Fetch something."""
        inner = asyncio.ensure_future(asyncio.sleep(10))
        asyncio.get_running_loop().call_later(0.01, inner.cancel)
        await inner
        return "never"

    agent = Agent("a", tools=[fetch])
    result, events, _ = run(agent, [tool_call_text("fetch"), "It failed."])
    assert result.final_output == "It failed."
    (done,) = [e for e in events if isinstance(e, ToolResult)]
    assert done.is_error and json.loads(done.output) == {"status": "error",
                                                         "error": "CancelledError"}


def test_system_exit_in_a_run_exits_the_process(tmp_path):
    """sys.exit in a guardrail (or a tool) leaves anyio.run as SystemExit and the process
    ends: raised bare past anyio's task group it aborted the loop before anyio stopped its
    worker threads, and the interpreter waited for them forever."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import sys, time, anyio\n"
        "from agentflash.backends.scripted import ScriptedBackend\n"
        "from agentflash.runtime import Agent, Runner\n"
        "def guard(text):\n"
        "    sys.exit(3)\n"
        "async def main():\n"
        "    await anyio.to_thread.run_sync(time.sleep, 0.01)\n"
        "    await Runner.run(Agent('f', input_guardrails=[guard]), 'hi',\n"
        "                     backend=ScriptedBackend(['hello']))\n"
        "anyio.run(main)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=60)
    assert done.returncode == 3, done.stderr.decode()[-2000:]


@pytest.mark.parametrize("library", ["asyncio", "trio"])
def test_system_exit_in_the_callers_block_exits_the_process_with_its_code(tmp_path, library):
    """sys.exit(4) while reading a streamed run's events: the task group wrapped it in a
    BaseExceptionGroup, an exit of 1 with a traceback (and no except SystemExit caught it)."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import sys, time, anyio\n"
        "from agentflash.backends.scripted import ScriptedBackend, ScriptedTurn\n"
        "from agentflash.runtime import Agent, Runner\n"
        "async def main():\n"
        "    await anyio.to_thread.run_sync(time.sleep, 0.01)\n"
        "    backend = ScriptedBackend([ScriptedTurn('word ' * 50, delay_s=0.01)])\n"
        "    async with Runner.run_streamed(Agent('f'), 'hi', backend=backend) as run:\n"
        "        async for event in run:\n"
        "            sys.exit(4)\n"
        f"anyio.run(main, backend={library!r})\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=60)
    assert done.returncode == 4 and not done.stderr, done.stderr.decode()[-2000:]


def test_leaving_the_block_early_cancels_the_run():
    backend = ScriptedBackend([ScriptedTurn("word " * 200, delay_s=0.01)])

    async def main():
        with anyio.fail_after(5):
            async with Runner.run_streamed(Agent("a"), "go", backend=backend) as streamed:
                async for event in streamed:
                    if isinstance(event, TextDelta):
                        break
        return streamed

    streamed = anyio.run(main)
    with pytest.raises(RunCancelled):
        _ = streamed.result


def test_a_loop_left_early_inside_the_block_leaves_the_run_going_to_its_result():
    backend = ScriptedBackend([ScriptedTurn("word " * 20, delay_s=0.01)])

    async def main():
        with anyio.fail_after(5):
            async with Runner.run_streamed(Agent("a"), "go", backend=backend) as streamed:
                async for event in streamed:
                    if isinstance(event, TextDelta):
                        break  # the rest of the events go unread
                while not streamed.is_finished:
                    await anyio.sleep(0.01)
                with pytest.raises(UserError, match="iterate a streamed run once"):
                    async for _ in streamed:
                        pass
        return streamed

    assert anyio.run(main).result.final_output == ("word " * 20).strip()


def test_run_collects_the_same_events_as_the_streamed_run():
    agent = Agent("a", tools=[get_weather])
    script = [ScriptedTurn.calls(("get_weather", {"city": "Oslo"})), "Sunny."]
    streamed_result, events, _ = run(agent, script)
    result = anyio.run(lambda: Runner.run(agent, "x", backend=ScriptedBackend(script)))
    assert result.final_output == streamed_result.final_output == events[-1].output
    assert [c.to_dict() for c in result.tool_calls] == [c.to_dict() for c in
                                                        streamed_result.tool_calls]
    assert result.stats()["turns"] == 2 and result.stats()["new_tokens"] > 0


def test_runs_share_one_backend_concurrently():
    rendezvous = meeting_tool("rendezvous", 4)  # answers once the four runs are under way
    agents = [Agent(f"agent{i}", tools=[rendezvous]) for i in range(4)]

    def turn(request):
        if request.messages[-1]["role"] == "tool":
            return ScriptedTurn(f"I am {request.messages[0]['content']}", delay_s=0.01)
        return ScriptedTurn.calls(("rendezvous", {"name": "me"}))

    backend = ScriptedBackend(turn)
    outputs = {}

    async def main():
        async def one(agent):
            result = await Runner.run(agent, "who?", backend=backend)
            outputs[agent.name] = (result.final_output, [c.result for c in result.tool_calls])

        async with anyio.create_task_group() as tg:
            for agent in agents:
                tg.start_soon(one, agent)

    anyio.run(main)
    assert outputs == {f"agent{i}": ("I am You are a helpful assistant.", ["me ok"])
                       for i in range(4)}


def test_agent_definition_errors():
    with pytest.raises(UserError, match="name must be a non-empty string"):
        Agent("")
    with pytest.raises(UserError, match="tool 'get_weather' is listed twice"):
        Agent("a", tools=[get_weather, get_weather])
    with pytest.raises(UserError, match="tool_choice names 'nope'"):
        Agent("a", tools=[get_weather], tool_choice=ForceTool("nope"))
    with pytest.raises(UserError, match="tool_choice must be auto, required, none"):
        Agent("a", tool_choice="sometimes")
    with pytest.raises(UserError, match="required but the agent has no tools or handoffs"):
        Agent("a", tool_choice="required")
    # a handoff is a tool the model calls: it may be required or named
    writer = Agent("writer")
    assert Agent("a", handoffs=[writer], tool_choice="required").tool_choice == "required"
    assert Agent("a", handoffs=[writer], tool_choice=ForceTool("transfer_to_writer"))
    with pytest.raises(UserError, match="max_turns must be a positive integer"):
        Agent("a", max_turns=0)
    with pytest.raises(UserError, match="decoding.temperature"):
        Agent("a", decoding=Decoding(temperature=-1))

    @tool(name="transfer_to_b")
    def impostor(reason: str) -> str:
        return reason

    with pytest.raises(UserError, match="'transfer_to_b' clashes"):
        Runner.run_sync(Agent("a", tools=[impostor], handoffs=[Agent("b")]), "x",
                        backend=ScriptedBackend([]))
    with pytest.raises(UserError, match="input must be a string or a non-empty list"):
        Runner.run_sync(Agent("a"), [], backend=ScriptedBackend([]))
    for role in ("system", "developer"):
        with pytest.raises(UserError, match="must not hold system or developer messages"):
            Runner.run_sync(Agent("a"), [{"role": role, "content": "x"}],
                            backend=ScriptedBackend([]))
    # a message without a role, or not an object: named by its place (the input was "not a
    # list of chat messages")
    for bad, named in (({"content": "x"}, r"messages\[1\]\.role must be one of"),
                       ("oops", r"messages\[1\] must be an object")):
        with pytest.raises(UserError, match=f"the run's input: {named}"):
            Runner.run_sync(Agent("a"), [{"role": "user", "content": "hi"}, bad],
                            backend=ScriptedBackend([]))
    # found when the agent is built, not at its first turn
    with pytest.raises(UserError, match="tools must be a list, got FunctionTool"):
        Agent("a", tools=get_weather)
    with pytest.raises(UserError, match="handoffs must be Agents, got str"):
        Agent("a", handoffs=["b"])
    with pytest.raises(UserError, match="'transfer_to_b' clashes"):
        Agent("a", handoffs=[Agent("b"), Agent("b")])
    with pytest.raises(UserError, match=r"^agent 'a': output schema: #: uniqueItems is not "
                                        r"supported"):
        Agent("a", output_type={"type": "array", "uniqueItems": True})
    with pytest.raises(UserError, match="pydantic cannot describe it") as err:
        Agent("a", output_type=True)
    assert "\n" not in str(err.value)

    class Thing:
        pass

    with pytest.raises(UserError, match="output_type Thing: pydantic cannot describe it: Unable "
                                        "to generate pydantic-core schema for") as err:
        Agent("a", output_type=Thing)
    assert "arbitrary_types_allowed" not in str(err.value)  # an output_type has no model_config
    # the run's input, checked as the command line checks a messages file
    with pytest.raises(UserError, match=r"input: messages\[0\].content must be a string"):
        Runner.run_sync(Agent("a"), [{"role": "user"}], backend=ScriptedBackend([]))
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    with pytest.raises(UserError, match=r"tool_calls\[0\].arguments is not JSON"):
        Runner.run_sync(Agent("a"), history, backend=ScriptedBackend([]))


def test_a_conversation_continues_from_a_result_s_messages():
    agent = Agent("a", tools=[get_weather])
    first, _, _ = run(agent, [ScriptedTurn.calls(("get_weather", {"city": "Oslo"})), "Sunny."])
    follow_up = [*first.messages, {"role": "user", "content": "And tomorrow?"}]
    second, _, backend = run(agent, ["Rain."], input=follow_up)
    assert second.final_output == "Rain."
    assert backend.requests[0].messages[1:] == follow_up
    assert [m["role"] for m in second.messages] == ["user", "assistant", "tool", "assistant",
                                                    "user", "assistant"]


def test_common_mistakes_with_the_runner_are_named():
    import pydantic

    from agentflash.backends.local import LocalBackend

    agent = Agent("a")
    with pytest.raises(UserError, match="backend must be a Backend .* got str"):
        Runner.run_sync(agent, "hi", backend="demo")
    with pytest.raises(UserError, match=r"got the class LocalBackend: make one \(LocalBackend"):
        Runner.run_sync(agent, "hi", backend=LocalBackend)
    with pytest.raises(UserError, match="tracer must be a Tracer, got str"):
        Runner.run_sync(agent, "hi", backend=ScriptedBackend(["x"]), tracer="t")
    with pytest.raises(UserError, match="output_type BaseModel: give a model of your own"):
        Agent("b", output_type=pydantic.BaseModel)

    async def inside_a_loop():
        with pytest.raises(UserError, match=r"use await Runner.run\(\.\.\.\) there"):
            Runner.run_sync(agent, "hi", backend=ScriptedBackend(["x"]))
        with pytest.raises(UserError, match="run_streamed is a context manager: async with"):
            async for _ in Runner.run_streamed(agent, "hi", backend=ScriptedBackend(["x"])):
                pass
        with pytest.raises(UserError, match="run_streamed is a context manager"):
            await Runner.run_streamed(agent, "hi", backend=ScriptedBackend(["x"]))

    anyio.run(inside_a_loop)
    anyio.run(inside_a_loop, backend="trio")  # trio said "Already running trio in this thread"

    async def in_a_worker_thread():  # no loop there (its context, copied, names asyncio's)
        return await asyncio.to_thread(
            lambda: Runner.run_sync(agent, "hi", backend=ScriptedBackend(["x"])).final_output)

    assert anyio.run(in_a_worker_thread) == "x"


def test_a_run_under_trio_is_a_run_under_asyncio():
    agent = Agent("a", tools=[get_weather])

    async def main():
        backend = ScriptedBackend([ScriptedTurn.calls(("get_weather", {"city": "Oslo"})),
                                   "done"])
        result = await Runner.run(agent, "weather?", backend=backend)
        return result.final_output, [c.result for c in result.tool_calls]

    assert anyio.run(main, backend="trio") == anyio.run(main)


def test_a_local_backend_opened_twice_says_so(tiny_model_dir):
    from agentflash.backends.local import LocalBackend

    async def main():
        backend = LocalBackend(str(tiny_model_dir), drafter="none")
        async with backend:
            with pytest.raises(UserError, match="this LocalBackend is already open"):
                async with backend:
                    pass

    anyio.run(main)

    # two tasks opening it at once: the second was let in while the first built its engine;
    # each built one, the first to close closed the other's, the second to close raised an
    # AttributeError, and an engine thread was left running (across threads: a hang)
    async def both():  # (the demo: its load is long enough for the second to come in)
        backend, said = LocalBackend("demo", drafter="none"), []

        async def open_and_run():
            try:
                async with backend:
                    await anyio.sleep(0.2)
                    said.append("opened")
            except UserError as err:
                said.append(str(err))

        async with anyio.create_task_group() as tg:
            tg.start_soon(open_and_run)
            tg.start_soon(open_and_run)
        return said

    said = anyio.run(both)
    copy.deepcopy(LocalBackend("demo", drafter="none"))  # (a lock of its own could not be)
    assert sorted(said)[0] == "opened" and sorted(said)[1].startswith(
        "this LocalBackend is already open"), said
    assert "agentflash-engine" not in [t.name for t in threading.enumerate()]  # none left


def test_a_turn_the_engine_refuses_names_the_agent_and_an_empty_guardrail_reason_is_an_error(
        tiny_model_dir):
    from agentflash.backends.local import LocalBackend

    @tool
    def flood() -> str:
        return "word " * 3000  # more than the engine holds per request

    agent = Agent("reader", tools=[flood], tool_choice=ForceTool("flood"))

    async def main():
        async with LocalBackend(str(tiny_model_dir), drafter="none", max_len=512) as backend:
            with pytest.raises(UserError, match=r"agent 'reader', turn 2: the prompt has \d+ "
                                                r"tokens; this engine holds 512 per request "
                                                r"\(max_len\), a prompt of at most 511"):
                await Runner.run(agent, "read it", backend=backend)

    anyio.run(main)
    quiet = Agent("q", input_guardrails=[lambda text: ""])
    with pytest.raises(UserError, match="returned an empty reason: return None"):
        Runner.run_sync(quiet, "hi", backend=ScriptedBackend(["x"]))


def test_a_refused_turn_keeps_the_class_of_its_error(tiny_model_dir):
    from agentflash.backends.local import LocalBackend
    from agentflash.grammar import GrammarError

    class Tagged(BaseModel):
        tag: Literal["</tool_call>"]  # text the tokenizer reads as a special token

    async def main():
        async with LocalBackend(str(tiny_model_dir), drafter="none") as backend:
            await Runner.run(Agent("a", output_type=Tagged), "hi", backend=backend)

    with pytest.raises(GrammarError, match="agent 'a', turn 1: .*holds '</tool_call>'"):
        anyio.run(main)


def test_a_streamed_run_whose_events_are_not_read_leaves_nothing_open():
    """Its receive stream was left open (a ResourceWarning when collected)."""
    async def main():
        backend = ScriptedBackend(["hello"])
        async with backend, Runner.run_streamed(Agent("a"), "hi", backend=backend) as run:
            await anyio.sleep(0.1)
        with pytest.raises(anyio.ClosedResourceError):  # open: EndOfStream
            run._receive.receive_nowait()
        return run.result.final_output

    assert anyio.run(main) == "hello"


def test_a_backend_that_breaks_the_stream_s_contract_is_named():
    from agentflash.backends.base import Backend, ModelFinish, TextDelta

    class Mine(Backend):
        model_name, provider_name = "mine", "me"

        def __init__(self, events):
            self.events = events

        async def stream(self, request):
            for event in self.events:
                yield event

    # an assert said it (gone under python -O: an AttributeError of None later)
    with pytest.raises(TypeError, match="Mine.stream ended without a ModelFinish"):
        Runner.run_sync(Agent("a"), "hi", backend=Mine([TextDelta("hello")]))
    with pytest.raises(TypeError, match="Mine.stream yielded 'hello', not a model event"):
        Runner.run_sync(Agent("a"), "hi", backend=Mine(["hello"]))
    finish = ModelFinish("stop", {})
    with pytest.raises(TypeError, match=r"Mine.stream yielded TextDelta\(text='late'\) after "
                                        r"its ModelFinish"):  # (it became the final output)
        Runner.run_sync(Agent("a"), "hi", backend=Mine([TextDelta("x"), finish,
                                                        TextDelta("late")]))
    # two calls of one id: the first was given the second's result (echo(x=1) returned 2)
    from agentflash.backends.base import ToolCall, ToolCallReady

    @tool
    def echo(x: int) -> int:
        """Echo."""
        return x

    twice = [ToolCallReady(i, ToolCall("same", "echo", {"x": i})) for i in (1, 2)]
    with pytest.raises(TypeError, match="Mine.stream yielded two tool calls with the id 'same' "
                                        "in one reply"):
        Runner.run_sync(Agent("a", tools=[echo]), "hi", backend=Mine([*twice, finish]))

    class NoGenerator(Mine):  # an AttributeError of aclose, naming nothing
        async def stream(self, request):
            return [TextDelta("hello")]

    class Iterator(Mine):  # an async iterator without aclose is one (as the hint says)
        def stream(self, request):
            events = iter(self.events)

            class It:
                def __aiter__(self):
                    return self

                async def __anext__(self):
                    try:
                        return next(events)
                    except StopIteration:
                        raise StopAsyncIteration from None
            return It()

    assert Runner.run_sync(Agent("a"), "hi", backend=Iterator([TextDelta("x"), finish])
                           ).final_output == "x"

    class OnlyNext(Mine):  # "'async for' requires an object with __aiter__", naming nothing
        def stream(self, request):
            class It:
                async def __anext__(self):
                    raise StopAsyncIteration
            return It()

    with pytest.raises(TypeError, match="OnlyNext.stream must be an async iterator"):
        Runner.run_sync(Agent("a"), "hi", backend=OnlyNext([]))
    with pytest.raises(TypeError, match="NoGenerator.stream must be an async iterator "
                                        r"\(async def with yield\), got coroutine"):
        Runner.run_sync(Agent("a"), "hi", backend=NoGenerator([]))
