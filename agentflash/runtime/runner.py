"""The one agent loop. ``Runner.run_streamed`` drives it and hands out its events as they happen;
``Runner.run`` collects the same events and returns the result.

Per turn: the backend streams the model's reply; each tool call is dispatched the moment it closes
(concurrently with the rest of the reply and with the other calls); when the reply and its calls
are done, the turn ends in one of three ways: tools ran (another turn), a handoff (another agent
takes over), or the final output.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import json
import math
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, aclosing, asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

import anyio
import sniffio

from agentflash import aio
from agentflash.backends import base as model
from agentflash.backends.base import Backend, ForceTool, ModelRequest, ToolChoice
from agentflash.errors import UserError, UserErrors
from agentflash.runtime import events as ev
from agentflash.runtime.agent import Agent, Guardrail, OutputValidationError, handoff_tool_spec
from agentflash.runtime.errors import (
    GuardrailTripped,
    MaxTurnsExceeded,
    ModelBehaviorError,
    RunCancelled,
)
from agentflash.runtime.tools import Tool, ToolOutcome, error_result, run_tool, tool_spec
from agentflash.runtime.tracing import Span, SpanKind, Tracer, generation_attributes
from agentflash.tool_format import begun_call, load_body

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup


@dataclass(frozen=True)
class ToolCallRecord:
    """A tool call of the run and what the model got back."""

    agent: str
    call_id: str
    name: str
    arguments: dict[str, Any]
    result: str
    is_error: bool
    duration_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments, "result": self.result}


@dataclass
class RunResult:
    """A finished run."""

    final_output: Any  # text, or an instance of the last agent's output type
    last_agent: str
    messages: list[dict[str, Any]]  # the conversation, without system messages (OpenAI format)
    tool_calls: list[ToolCallRecord]
    generations: list[ev.GenerationStats]
    tracer: Tracer

    @property
    def finish_reason(self) -> str:
        """How the final answer's generation ended: ``stop``, or ``length`` where max_tokens
        cut the answer (a text answer is then returned as it was cut)."""
        return self.generations[-1].finish_reason if self.generations else "stop"

    def stats(self) -> dict[str, Any]:
        """Totals over the run's generations, and each generation's own stats."""
        gens = [g.stats for g in self.generations]
        new = sum(s.get("new_tokens", 0) for s in gens)
        forwards = sum(s.get("target_forwards", 0) for s in gens)
        wall = sum(s.get("wall_s", 0.0) for s in gens)
        return {
            "turns": len(gens),
            "modes": sorted({s.get("mode", "?") for s in gens}),
            "prompt_tokens": sum(s.get("prompt_tokens", 0) for s in gens),
            # of which the engine's prefix cache supplied (a turn re-sends the turns before it)
            "cached_prompt_tokens": sum(s.get("cached_prompt_tokens", 0) for s in gens),
            "new_tokens": new,
            "target_forwards": forwards,
            "draft_forwards": sum(s.get("draft_forwards", 0) for s in gens),
            # no forward at all (one-token or wholly forced replies): the engine's tau, its
            # tokens; a remote server counts none (its 0.0)
            "tau": round(new / forwards, 3) if forwards else (
                float(new) if gens and all(s.get("mode") != "remote" for s in gens) else 0.0),
            "wall_s": round(wall, 4),
            "tokens_per_s": round(new / wall, 2) if wall > 0 else 0.0,
            "generations": gens,
        }


def _why_calls_failed(calls: list[ToolCallRecord]) -> str:
    """What the last turn's failed calls got back, for an error that ends the run (an agent
    without tools whose model writes a call uses its turns up on them)."""
    if not calls:
        return ""
    try:
        reason = json.loads(calls[-1].result)["error"]
    except (ValueError, KeyError, TypeError):
        reason = calls[-1].result
    return f" (its last turn's call of {calls[-1].name!r} failed: {reason})"


# --- how a turn ends: a small tagged union ------------------------------------------------------


@dataclass(frozen=True)
class ToolsRan:
    """The model called tools; their results are in the conversation. Another turn follows.
    ``called``: a call reached a tool with valid arguments (what ``required`` or a forced tool
    asks for; a malformed call, an unknown tool or invalid arguments leave the choice as it was)."""

    called: bool = True


@dataclass(frozen=True)
class HandoffTo:
    target: Agent
    reason: str


@dataclass(frozen=True)
class Final:
    output: Any


TurnEnd = ToolsRan | HandoffTo | Final


@dataclass
class _Turn:
    """What one turn produced, in the order the model wrote it."""

    text: list[str] = field(default_factory=list)
    calls: list[model.ToolCall | model.MalformedToolCall] = field(default_factory=list)
    call_indexes: list[int] = field(default_factory=list)  # each call's index in the reply
    outcomes: dict[str, ToolOutcome] = field(default_factory=dict)  # by call id
    finish: model.ModelFinish | None = None
    span: Span | None = None  # the turn's


class _Loop:
    """The state of one run: the current agent, the conversation, and what happened so far."""

    def __init__(self, agent: Agent, input: str | list[dict[str, Any]], backend: Backend,
                 tracer: Tracer, trace_parent: Span | None, emit: Callable[[ev.RunEvent], None]):
        self.agent, self.input, self.backend, self.tracer = agent, input, backend, tracer
        self.trace_parent, self.emit = trace_parent, emit
        self.messages = _input_messages(input)
        self.tool_calls: list[ToolCallRecord] = []
        self.generations: list[ev.GenerationStats] = []
        # the agents (by identity: two may share a name) that called a tool or handed off in
        # this run: their tool_choice is spent, also when the conversation comes back to them
        self.called: set[int] = set()

    async def run(self) -> RunResult:
        attrs = {"gen_ai.operation.name": "invoke_workflow", "gen_ai.agent.name": self.agent.name}
        with self.tracer.span(SpanKind.RUN, f"run {self.agent.name}", self.trace_parent,
                              attrs) as span:
            self.agent.turn_tools()  # an agent changed since it was built is checked first
            await _guard(self.agent, "input", self.agent.input_guardrails, self.input)
            # each agent's turns in this run, whenever it held the conversation: its max_turns
            # bounds them, so handoffs that go round in a cycle end too
            held: dict[int, int] = {}
            failed: list[ToolCallRecord] = []  # the last turn's calls, where every one failed
            for turn in itertools.count(1):
                self.agent.turn_tools()  # one handed to, or changed since: checked first
                held[id(self.agent)] = held.get(id(self.agent), 0) + 1
                if held[id(self.agent)] > self.agent.max_turns:
                    raise MaxTurnsExceeded(f"agent {self.agent.name!r} reached max_turns "
                                           f"({self.agent.max_turns}) without a final output"
                                           f"{_why_calls_failed(failed)}")
                before = len(self.tool_calls)
                end = await self.turn(turn, span)
                calls = self.tool_calls[before:]
                failed = calls if calls and all(c.is_error for c in calls) else []
                if isinstance(end, ToolsRan):
                    if end.called:
                        self.called.add(id(self.agent))
                elif isinstance(end, HandoffTo):
                    self.emit(ev.HandoffOccurred(self.agent.name, end.target.name, end.reason))
                    self.called.add(id(self.agent))
                    self.agent = end.target
                elif isinstance(end, Final):
                    await _guard(self.agent, "output", self.agent.output_guardrails,
                                 end.output)
                    self.emit(ev.FinalOutput(self.agent.name, end.output))
                    return RunResult(end.output, self.agent.name, self.messages, self.tool_calls,
                                     self.generations, self.tracer)
                else:
                    raise AssertionError(f"unknown turn end {end!r}")
        raise AssertionError("the turn loop ended without a result")

    def request(self, tools: dict[str, Tool], handoffs: dict[str, Agent]) -> ModelRequest:
        agent = self.agent
        choice = agent.tool_choice
        if id(agent) in self.called and choice is not ToolChoice.AUTO:
            # a forced or required call was made: now answer (in the output schema, if any)
            choice = ToolChoice.NONE if agent.output else ToolChoice.AUTO
        specs = [tool_spec(t) for t in tools.values()]
        specs += [handoff_tool_spec(target) for target in handoffs.values()]
        system = {"role": "system", "content": agent.system_prompt()}
        return ModelRequest([system, *self.messages], specs, choice,
                            agent.output.schema if agent.output else None, agent.decoding)

    async def turn(self, number: int, run_span: Span) -> TurnEnd:
        agent = self.agent
        tools, handoffs = agent.turn_tools()
        request = self.request(tools, handoffs)
        self.emit(ev.AgentTurnStarted(agent.name, number))
        turn = _Turn()
        attrs = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent.name,
                 "agentflash.turn": number}
        with self.tracer.span(SpanKind.TURN, f"invoke_agent {agent.name}", run_span, attrs) as span:
            turn.span = span
            with single_errors():
                async with anyio.create_task_group() as tools_running:
                    start_tool = partial(tools_running.start_soon, self.call_tool)
                    await self.generate(request, turn, span, number, tools,
                                        lambda t, call: start_tool(t, call, turn, span))
            end = self.end_turn(request, turn, tools, handoffs)
            if isinstance(end, HandoffTo):  # the turn that handed the conversation over
                span.attributes["agentflash.handoff.to"] = end.target.name
            return end

    async def generate(self, request: ModelRequest, turn: _Turn, span: Span, number: int,
                       tools: dict[str, Tool], dispatch: Any) -> None:
        """Stream the model's reply, dispatching each tool call as it closes."""
        agent = self.agent
        attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.model": self.backend.model_name,
                 "gen_ai.provider.name": self.backend.provider_name,
                 "gen_ai.output.type": "json" if request.output_schema else None,
                 "gen_ai.request.temperature": request.decoding.temperature,
                 "gen_ai.request.max_tokens": request.decoding.max_tokens,
                 "gen_ai.request.seed": request.decoding.seed}
        with self.tracer.span(SpanKind.GENERATION, f"chat {self.backend.model_name}", span,
                              attrs) as gen_span, _naming_the_turn(agent.name, number):
            async with aclosing(_event_stream(self.backend, request)) as stream:
                async for event in stream:
                    if turn.finish is not None:
                        raise TypeError(f"{type(self.backend).__name__}.stream yielded "
                                        f"{event!r} after its ModelFinish")
                    if isinstance(event, model.TextDelta):
                        turn.text.append(event.text)
                        self.emit(ev.TextDelta(agent.name, event.text))
                    elif isinstance(event, model.ToolCallDelta):
                        self.emit(ev.ToolCallDelta(agent.name, event.index, event.name,
                                                   event.arguments_delta))
                    elif isinstance(event, model.ToolCallReady):
                        call = event.call
                        if any(c.id == call.id for c in turn.calls):  # a result per id
                            raise TypeError(f"{type(self.backend).__name__}.stream yielded two "
                                            f"tool calls with the id {call.id!r} in one reply: "
                                            f"each call's result must find its own call")
                        turn.calls.append(call)
                        turn.call_indexes.append(event.index)
                        _check_call_allowed(agent, request, call)
                        if isinstance(call, model.ToolCall) and call.name in tools:
                            dispatch(tools[call.name], call)
                    elif isinstance(event, model.ModelFinish):
                        turn.finish = event
                    else:  # a backend that breaks its contract (one of the user's own)
                        raise TypeError(f"{type(self.backend).__name__}.stream yielded "
                                        f"{event!r}, not a model event")
            if turn.finish is None:
                raise TypeError(f"{type(self.backend).__name__}.stream ended without a "
                                f"ModelFinish")
            # in the order the model wrote them (a server may finish a later call first)
            order = sorted(range(len(turn.calls)), key=turn.call_indexes.__getitem__)
            turn.calls = [turn.calls[i] for i in order]
            gen_span.attributes.update(generation_attributes(turn.finish.stats,
                                                             turn.finish.finish_reason))
        stats = ev.GenerationStats(agent.name, number, turn.finish.finish_reason, turn.finish.stats)
        self.generations.append(stats)
        self.emit(stats)

    async def call_tool(self, t: Tool, call: model.ToolCall, turn: _Turn, span: Span) -> None:
        agent = self.agent.name
        self.emit(ev.ToolStarted(agent, call.id, call.name, call.arguments))
        attrs = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": call.name,
                 "gen_ai.tool.call.id": call.id, "gen_ai.tool.type": "function"}
        with self.tracer.span(SpanKind.TOOL, f"execute_tool {call.name}", span, attrs) as tool_span:
            outcome = await run_tool(t, call.arguments)
            tool_span.attributes["agentflash.tool.is_error"] = outcome.is_error
            if outcome.is_error:  # "type: message", as a span that raised says it
                tool_span.error = _span_error(outcome.error_type or "tool_error", outcome.output)
        turn.outcomes[call.id] = outcome
        self.emit(ev.ToolResult(agent, call.id, call.name, call.arguments, outcome.output,
                                outcome.is_error, outcome.duration_s))

    def end_turn(self, request: ModelRequest, turn: _Turn, tools: dict[str, Tool],
                 handoffs: dict[str, Agent]) -> TurnEnd:
        agent, text = self.agent, "".join(turn.text).strip()
        if not turn.calls:
            if request.tool_choice is ToolChoice.REQUIRED or isinstance(request.tool_choice,
                                                                        ForceTool):
                raise ModelBehaviorError(f"agent {agent.name!r} must call a tool on this turn "
                                         f"(tool_choice {_choice_name(request.tool_choice)}) but "
                                         f"answered with text: {_clip(text)}")
            self.messages.append({"role": "assistant", "content": text})
            return Final(self.parse_output(text, turn.finish.finish_reason == "length"))
        handoff: HandoffTo | None = None
        results: list[dict[str, Any]] = []
        for call in turn.calls:
            output, is_error = self.call_result(call, turn, tools, handoffs, handoff)
            if isinstance(call, model.ToolCall) and call.name in handoffs and not is_error:
                handoff = HandoffTo(handoffs[call.name], str(call.arguments.get("reason", "")))
            results.append({"role": "tool", "tool_call_id": call.id,
                            "name": _call_name(call), "content": output})
        self.messages.append({"role": "assistant", "content": text,
                              "tool_calls": [_message_call(c) for c in turn.calls]})
        self.messages += results
        called = any(isinstance(c, model.ToolCall) and c.name in tools
                     and turn.outcomes[c.id].error_type != "invalid_arguments"
                     for c in turn.calls)
        return handoff if handoff is not None else ToolsRan(called)

    def call_result(self, call: model.ToolCall | model.MalformedToolCall, turn: _Turn,
                    tools: dict[str, Tool], handoffs: dict[str, Agent],
                    handoff: HandoffTo | None) -> tuple[str, bool]:
        """The result the model reads for ``call``, and whether it is an error."""
        if isinstance(call, model.ToolCall) and call.name in tools:
            outcome = turn.outcomes[call.id]  # the tool ran while the model was writing
            self._record(call.id, call.name, call.arguments, outcome.output, outcome.is_error,
                         outcome.duration_s)
            return outcome.output, outcome.is_error
        if isinstance(call, model.MalformedToolCall):  # what it wrote is in the result
            output = error_result(f"malformed tool call ({call.error}): {call.body}")
            is_error = True
        elif call.name in handoffs and (problem := _handoff_arguments_problem(call)):
            output, is_error = error_result(f"invalid arguments for {call.name}: {problem}"), True
        elif call.name in handoffs:
            if handoff is None:
                target = handoffs[call.name].name
                output, is_error = json.dumps({"status": "ok", "assistant": target}), False
            else:
                output, is_error = error_result(f"only one handoff per turn; the conversation "
                                                f"goes to {handoff.target.name}"), True
        else:
            known = ", ".join(sorted([*tools, *handoffs])) or "none"
            output, is_error = error_result(f"unknown tool {call.name!r} (tools: {known})"), True
        name, arguments = _call_name(call), _call_args(call)
        # answered by the runtime itself: started and done at once, each result after its start
        self.emit(ev.ToolStarted(self.agent.name, call.id, name, arguments))
        attrs = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
                 "gen_ai.tool.call.id": call.id}
        if isinstance(call, model.MalformedToolCall):
            why = "malformed_tool_call"
        elif call.name in handoffs:
            why, attrs["gen_ai.tool.type"] = "handoff_refused", "handoff"
        else:
            why = "unknown_tool"
        with self.tracer.span(SpanKind.TOOL, f"execute_tool {name}", turn.span, attrs) as span:
            span.attributes["agentflash.tool.is_error"] = is_error  # as a tool's that ran
            if is_error:  # every call has its span, those that ran no tool too
                span.error = _span_error(why, output)
        self._record(call.id, name, arguments, output, is_error, 0.0)
        self.emit(ev.ToolResult(self.agent.name, call.id, name, arguments, output, is_error, 0.0))
        return output, is_error

    def _record(self, call_id: str, name: str, arguments: dict[str, Any], result: str,
                is_error: bool, duration_s: float) -> None:
        self.tool_calls.append(ToolCallRecord(self.agent.name, call_id, name, arguments, result,
                                              is_error, duration_s))

    def parse_output(self, text: str, cut: bool = False) -> Any:
        """The agent's final output from its reply (``cut``: the reply ended at max_tokens)."""
        spec = self.agent.output
        if spec is None:
            return text
        try:
            # an object, array or string cut short does not parse; a number does (848 of
            # 8481), and would be a wrong value
            if cut and text.strip()[-1:].isdigit():
                raise OutputValidationError("the number was cut at max_tokens")
            return spec.parse(text)
        except OutputValidationError as err:
            why = f"{err}; the reply was cut at max_tokens" if cut and "cut" not in str(err) \
                else str(err)
            raise ModelBehaviorError(
                f"agent {self.agent.name!r} must answer with {spec.name} but its reply does not "
                f"match ({why}): {_clip(text)}") from None


def _check_call_allowed(agent: Agent, request: ModelRequest,
                        call: model.ToolCall | model.MalformedToolCall) -> None:
    """A call the tool choice forbids stops the run before anything is dispatched."""
    choice = request.tool_choice
    if choice is ToolChoice.NONE:
        raise ModelBehaviorError(f"agent {agent.name!r} called {_call_name(call)!r} although "
                                 f"tool_choice is none")
    # a malformed call (one cut at max_tokens, say) names no tool for sure: its error goes back
    # to the model, as under any other tool choice
    if isinstance(choice, ForceTool) and isinstance(call, model.ToolCall) \
            and call.name != choice.name:
        raise ModelBehaviorError(f"agent {agent.name!r} called {call.name!r} although "
                                 f"tool_choice forces {choice.name!r}")


def _choice_name(choice: Any) -> str:
    return choice.name if isinstance(choice, ForceTool) else choice.value


def _call_name(call: model.ToolCall | model.MalformedToolCall) -> str:
    """The name a call goes back to the model under in the conversation: what it wrote, or
    ``invalid`` where that is no name (an empty one too: serve and OpenAI refuse a call of
    ``""``, and the turn after it failed there)."""
    if isinstance(call, model.ToolCall):
        name = call.name
    else:
        body, problem = load_body(call.body)  # whatever the model wrote: 5,000 digits, too deep
        if problem is None and isinstance(body, dict):
            name = body.get("name")
        else:  # cut short: the name it began with (the name the stream's deltas gave it)
            begun = begun_call(call.body)
            name = begun[0] if begun else None
    return name if isinstance(name, str) and name else "invalid"


def _handoff_arguments_problem(call: model.ToolCall) -> str | None:
    """What is wrong with a handoff's arguments (``{"reason": str}``), which a backend without
    the grammar may write otherwise; None if nothing."""
    extra = sorted(set(call.arguments) - {"reason"})
    if extra:
        return f"{extra[0]}: not an argument of a handoff (reason)"
    if not isinstance(call.arguments.get("reason", ""), str):
        return "reason: must be a string"
    return None


def _call_args(call: model.ToolCall | model.MalformedToolCall) -> dict[str, Any]:
    return call.arguments if isinstance(call, model.ToolCall) else {}


def _event_stream(backend: Backend, request: ModelRequest) -> AsyncIterator[model.ModelEvent]:
    """``backend.stream(request)`` as an async generator, or a ``TypeError`` naming the backend
    where that is no async iterator (an ``async def`` that returns, a plain generator: an
    AttributeError of aclose)."""
    stream = backend.stream(request)
    if not (hasattr(stream, "__anext__") and hasattr(stream, "__aiter__")):
        if inspect.iscoroutine(stream) or inspect.isgenerator(stream):
            stream.close()  # (a coroutine never awaited warns)
        raise TypeError(f"{type(backend).__name__}.stream must be an async iterator (async "
                        f"def with yield), got {type(stream).__name__}")
    if hasattr(stream, "aclose"):
        return stream

    async def events() -> AsyncIterator[model.ModelEvent]:  # an iterator without aclose
        async for event in stream:
            yield event

    return events()


def _message_call(call: model.ToolCall | model.MalformedToolCall) -> dict[str, Any]:
    """A call as an OpenAI assistant message lists it, arguments as JSON text: a malformed call
    has none (the text it was is in its error result), so that the conversation is one that a
    next run, a server or a chat template takes."""
    arguments = "{}"
    if isinstance(call, model.ToolCall):  # as the model wrote them, as a server replays them
        arguments = call.arguments_text or json.dumps(call.arguments, ensure_ascii=False)
    return {"id": call.id, "type": "function",
            "function": {"name": _call_name(call), "arguments": arguments}}


def _clip(text: str, limit: int = 200) -> str:
    text = text.replace("\n", " ")
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _span_error(kind: str, output: str) -> str:
    """A failed call's span error, "kind: message": the message of the result the model reads
    (``{"status": "error", "error": "RuntimeError: down"}``), not that JSON, nor its type twice."""
    try:
        message = json.loads(output).get("error")
    except (ValueError, AttributeError):
        message = None
    if not isinstance(message, str):
        return f"{kind}: {output}"
    return message if message == kind or message.startswith(f"{kind}: ") \
        else f"{kind}: {message}"


def _input_messages(input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(input, str):
        if not input.strip():
            raise UserError("the run's input is empty")
        from agentflash.inputs import check_unicode

        check_unicode(input, "the run's input")
        return [{"role": "user", "content": input}]
    if isinstance(input, list) and input:
        from agentflash.inputs import check_messages

        messages = list(check_messages(input, "the run's input"))  # (naming a bad one's place)
        if any(m["role"] in ("system", "developer") for m in messages):
            raise UserError("the run's input must not hold system or developer messages (the "
                            "agent's instructions are the system prompt)")
        return messages
    raise UserError("the run's input must be a string or a non-empty list of chat messages")


@contextmanager
def _naming_the_turn(agent: str, number: int) -> Iterator[None]:
    """A backend's refusal of a turn's request (a conversation past the engine's length, a
    speculation it cannot do) names the agent and the turn it came from."""
    try:
        yield
    except UserError as err:  # of the same class (a GrammarError stays one)
        where = f"agent {agent!r}, turn {number}: "
        if isinstance(err, UserErrors):
            raise UserErrors([where + p for p in err.problems]) from None
        try:
            named = type(err)(where + str(err))
        except TypeError:  # a class built from other arguments than its message
            named = UserError(where + str(err))
        raise named from None


async def _guard(agent: Agent, kind: str, guardrails: list[Guardrail], value: Any) -> None:
    for guardrail in guardrails:
        reason = await guardrail(value, f"agent {agent.name!r}: {kind} ")
        if reason is not None:
            raise GuardrailTripped(kind, guardrail.name, reason)


# --- errors out of task groups ------------------------------------------------------------------


def sole_error(group: BaseExceptionGroup) -> BaseException | None:
    """The one exception inside (nested) groups, or None when there are several."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    return leaves[0] if len(leaves) == 1 else None


@contextmanager
def single_errors() -> Iterator[None]:
    """Let a task group's single error out as itself rather than wrapped in a group. Only an
    ``Exception``: a ``SystemExit`` or ``KeyboardInterrupt`` raised bare past anyio's task group
    aborted the event loop before it stopped its worker threads, and the process never exited."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaf = sole_error(group)
        if not isinstance(leaf, Exception):
            raise
        raise leaf from leaf.__cause__


# --- the public API -----------------------------------------------------------------------------


E = TypeVar("E")
R = TypeVar("R")


class Streamed(Generic[E, R]):
    """Work in progress: ``async for event in it`` gives its events as they happen (and raises
    its error, if it failed, once they are out); ``result`` is there once it finished."""

    def __init__(self) -> None:
        self._send, self._receive = anyio.create_memory_object_stream[E](math.inf)
        self._scope = anyio.CancelScope()
        self._result: R | None = None
        self._error: BaseException | None = None
        self._finished = False
        self._iterated = False
        self._closed = False  # its block was left with its events unread
        self.trace: Any = None  # what a cancelled run's RunCancelled carries as its tracer

    def cancel(self) -> None:
        """Stop the work: generations are cancelled in the engine, running tools are cancelled."""
        self._scope.cancel()

    @property
    def is_finished(self) -> bool:
        return self._finished

    @property
    def result(self) -> R:
        """The result; raises the work's error if it failed (``RunCancelled`` if cancelled)."""
        if self._error is not None:
            raise self._error
        if not self._finished:
            raise UserError("not finished yet: read the events first")
        return self._result  # type: ignore[return-value]

    async def __aiter__(self) -> AsyncIterator[E]:
        """The events; a failure is raised after them (a ``cancel()`` just ends them). Once:
        a loop left early leaves the work running, its later events unread."""
        if self._iterated:
            raise UserError("the events were read already: iterate a streamed run once")
        if self._closed:
            raise UserError("the run's block was left before its events were read: iterate "
                            "the run inside its `async with` (its result is there)")
        self._iterated = True
        async with self._receive:
            async for event in self._receive:
                yield event
        if self._error is not None and not isinstance(self._error, RunCancelled):
            raise self._error

    def _emit(self, event: E) -> None:
        try:
            self._send.send_nowait(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # nobody reads them any more: the work goes on to its result

    async def _drive(self, work: Callable[[Callable[[E], None]], Awaitable[R]]) -> None:
        try:
            with self._scope:
                try:
                    self._result = await work(self._emit)
                    self._finished = True
                except Exception as err:
                    self._error = err
        finally:  # cancelled by this run's cancel(), or from outside it (a timeout around it)
            if not self._finished and self._error is None:
                self._error = RunCancelled("the run was cancelled")
                self._error.tracer = self.trace
            self._finished = True
            self._send.close()


@asynccontextmanager
async def streaming(work: Callable[[Callable[[E], None]], Awaitable[R]]
                    ) -> AsyncIterator[Streamed[E, R]]:
    """Run ``work(emit)`` in a task, handing out what it emits; leaving the block cancels it."""
    run: Streamed[E, R] = Streamed()
    leaving: BaseException | None = None  # sys.exit or Ctrl-C in the caller's own block
    with single_errors():
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run._drive, work)
                try:
                    yield run
                except (SystemExit, KeyboardInterrupt) as err:  # raised as itself, past the
                    leaving = err  # group (which wrapped it), once the run's task has ended
                finally:
                    run.cancel()
        finally:
            if not run._iterated:  # its events never read: nobody will (ResourceWarning)
                run._receive.close()
                run._closed = True
    if leaving is not None:
        raise leaving


StreamedRun = Streamed[ev.RunEvent, RunResult]


class Runner:
    """Runs agents. ``backend`` defaults to the embedded engine with the bundled demo model,
    opened for the run; pass one open backend to share the engine across runs."""

    @staticmethod
    async def run(agent: Agent, input: str | list[dict[str, Any]], *,
                  backend: Backend | None = None, tracer: Tracer | None = None,
                  trace_parent: Span | None = None) -> RunResult:
        """Run ``agent`` on ``input`` to its final output (the streamed run's events, collected)."""
        async with Runner.run_streamed(agent, input, backend=backend, tracer=tracer,
                                       trace_parent=trace_parent) as run:
            async for _ in run:
                pass
        return run.result

    @staticmethod
    def run_sync(agent: Agent, input: str | list[dict[str, Any]], **options: Any) -> RunResult:
        """``Runner.run`` from synchronous code."""
        try:  # an asyncio loop (in a callback of its own too), or trio's (which says so in
            asyncio.get_running_loop()  # a thread-local: not in a worker thread, whose copied
        except RuntimeError:  # context may still name the library that started it)
            if sniffio.thread_local.name is None:  # none: as it should be
                # in the caller's context, less the library that a worker thread's copy of it
                # may name (asyncio.to_thread's: anyio refused, "Already running asyncio")
                context = contextvars.copy_context()
                context.run(sniffio.current_async_library_cvar.set, None)
                return context.run(aio.run, partial(Runner.run, agent, input, **options))
        raise UserError("Runner.run_sync cannot run inside an event loop (an async function, "
                        "Jupyter): use await Runner.run(...) there")

    @staticmethod
    def run_streamed(agent: Agent, input: str | list[dict[str, Any]], *,
                     backend: Backend | None = None, tracer: Tracer | None = None,
                     trace_parent: Span | None = None) -> _StreamedRunContext:
        """``async with Runner.run_streamed(agent, input) as run: async for event in run: ...``

        Leaving the block while the run is still going cancels it.
        """
        return _StreamedRunContext(_run_streamed(agent, input, backend=backend, tracer=tracer,
                                                 trace_parent=trace_parent))


class _StreamedRunContext:
    """What ``Runner.run_streamed`` returns: a context manager, and only that (used as a stream
    or awaited, it says how to use it)."""

    def __init__(self, manager: Any):
        self._manager = manager

    async def __aenter__(self) -> StreamedRun:
        return await self._manager.__aenter__()

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._manager.__aexit__(*exc)

    def _misused(self) -> UserError:
        return UserError("Runner.run_streamed is a context manager: "
                         "async with Runner.run_streamed(agent, input) as run: "
                         "async for event in run: ...")

    def __aiter__(self) -> Any:
        raise self._misused()

    def __await__(self) -> Any:
        raise self._misused()


@asynccontextmanager
async def _run_streamed(agent: Agent, input: str | list[dict[str, Any]], *,
                        backend: Backend | None, tracer: Tracer | None,
                        trace_parent: Span | None) -> AsyncIterator[StreamedRun]:
    if not isinstance(agent, Agent):
        raise UserError(f"Runner needs an Agent, got {type(agent).__name__}")
    if backend is not None and not isinstance(backend, Backend):
        made = (f"the class {backend.__name__}: make one ({backend.__name__}(...))"
                if isinstance(backend, type) else type(backend).__name__)
        raise UserError(f"backend must be a Backend (LocalBackend('demo'), "
                        f"OpenAIBackend(url, model), ...), got {made}")
    if tracer is not None and not isinstance(tracer, Tracer):
        raise UserError(f"tracer must be a Tracer, got {type(tracer).__name__}")
    with single_errors():
        async with AsyncExitStack() as stack:
            if backend is None:
                from agentflash.backends.local import LocalBackend

                backend = await stack.enter_async_context(LocalBackend())
            chosen, trace = backend, tracer or Tracer()

            async def work(emit: Callable[[ev.RunEvent], None]) -> RunResult:
                try:
                    return await _Loop(agent, input, chosen, trace, trace_parent, emit).run()
                except Exception as err:  # its trace, as a result's: what ran, and where it
                    # broke (a turn the backend refused, a guardrail of the user's that raised);
                    # this run's, where a run inside it (a guardrail's agent) raised it first
                    with suppress(AttributeError):  # (an exception with slots)
                        err.tracer = trace
                    raise

            async with streaming(work) as run:
                run.trace = trace
                yield run
