"""One chat completion on the shared engine: the request made into a prompt, sampling parameters
and a grammar; the engine's token stream made into OpenAI deltas.

``prepare`` checks everything a request can get wrong before anything is queued, so a bad
request is a 400 and never a half-sent stream. ``reply_events`` is the one generation loop: the
streaming endpoint sends its events as chunks, the plain one collects the same events
(``ReplyWriter`` does both).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from agentflash.backends.base import (
    MalformedToolCall,
    ModelEvent,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallReady,
)
from agentflash.backends.local import HermesStreamParser
from agentflash.engine.async_engine import AsyncEngine, FinishEvent
from agentflash.engine.engine import Engine, GenerationResult
from agentflash.engine.request import FinishReason, SamplingParams, Speculation
from agentflash.errors import MIN_TEMPERATURE, ChatTemplateError, UserError
from agentflash.grammar import (
    GrammarError,
    GrammarSource,
    ToolChoice,
    ToolChoiceMode,
    assistant_turn,
    json_schema,
    tool_specs,
)
from agentflash.grammar.compiler import LRU, MAX_SOURCE_CHARS
from agentflash.grammar.llguidance_backend import check_schema_supported
from agentflash.inputs import leading_system
from agentflash.server.protocol import APIError, ChatCompletionRequest, Message
from agentflash.tool_format import begun_call

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request leaves it out


@dataclass(frozen=True)
class ChatJob:
    """A checked request, ready for the engine."""

    prompt_ids: list[int]
    params: SamplingParams
    parses_tool_calls: bool  # the reply may hold tool calls (tools given, tool_choice not none)


def prepare(request: ChatCompletionRequest, engine: Engine, max_tokens_limit: int) -> ChatJob:
    """The engine job of ``request``, or an ``APIError`` naming what is wrong. Blocking: it
    renders the chat template and compiles the grammar (cached), so run it in a worker thread."""
    tools = [t.model_dump(exclude_unset=True) for t in request.tools or []]
    choice = _tool_choice(request, tools)
    answer_schema = _answer_schema(request)
    grammar = reply_grammar(tools, choice, request.parallel_tool_calls is not False,
                            answer_schema, answer_strict=_answer_strict(request))
    whole = answer_schema is not None or choice.mode in (ToolChoiceMode.REQUIRED,
                                                         ToolChoiceMode.NAMED)
    if request.stop_strings and whole:
        raise APIError(400, "stop cannot cut a reply the grammar binds whole (a response_format, "
                            "tool_choice required or a named tool): it would not parse",
                       param="stop")
    try:
        engine.check_template_kwargs(request.chat_template_kwargs)
    except UserError as err:
        raise APIError(400, str(err), param="chat_template_kwargs") from None
    try:
        prompt_ids = engine.chat_prompt(chat_messages(request.messages), tools,
                                        request.chat_template_kwargs)
    except ChatTemplateError as err:  # (not the server's paths)
        raise APIError(400, f"the model's chat template rejects these messages: {err.reason}",
                       param="messages") from None
    except UserError as err:
        raise APIError(400, str(err), param="messages") from None
    except Exception as err:  # what else a model's own chat template raises
        raise APIError(400, f"the model's chat template rejects these messages: {err}",
                       param="messages") from None
    max_len = engine.scheduler.cfg.max_len
    if len(prompt_ids) + 1 > max_len:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this model holds {max_len} "
                            f"tokens per request (prompt and reply): a prompt of at most "
                            f"{max_len - 1}", param="messages",
                       code="context_length_exceeded")
    field = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    max_tokens = request.max_completion_tokens or request.max_tokens
    if max_tokens is not None and max_tokens > max_tokens_limit:
        raise APIError(400, f"{field} is {max_tokens}; this server allows at most "
                            f"{max_tokens_limit}", param=field)
    if grammar is not None:  # after the cheap checks: a refused request compiles nothing
        try:
            engine.compile(grammar)
        except GrammarError as err:
            raise APIError(400, f"cannot constrain the reply: {err}",
                           param="response_format" if not tools else "tools") from None
    room = max_len - len(prompt_ids)
    options = request.agentflash
    temperature = DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    # OpenAI's API takes any from 0: a temperature too small to sample with, and a nucleus of
    # no mass (its smallest set keeps the likeliest token alone), are greedy
    if temperature < MIN_TEMPERATURE or top_p == 0:
        temperature, top_p = 0.0, 1.0
    calls = bool(tools) and choice.mode is not ToolChoiceMode.NONE  # the reply may hold calls
    try:
        params = SamplingParams(
            max_tokens=min(max_tokens or max_tokens_limit, room),
            temperature=temperature,
            top_p=top_p,
            seed=request.seed,
            stop=request.stop_strings,
            tool_calls=calls,
            speculation=options.speculation if options else "auto",
            block_size=options.block_size if options else None,
            grammar=grammar,
        )
    except ValueError as err:  # the protocol's own checks catch these first; none is a 500
        raise APIError(400, str(err)) from None
    if params.speculation is Speculation.DFLASH and engine.drafter is None:
        raise APIError(400, "speculation dflash needs a drafter, and this server has none "
                            "(agentflash serve --drafter DIR)", param="agentflash.speculation")
    return ChatJob(prompt_ids, params, calls)


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The messages as the chat template reads them: system and developer messages become the one
    leading system message; content parts are joined into text; a user's or assistant's
    ``name`` is passed on (Qwen's template shows none, another may)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role in ("system", "developer"):
            out.append({"role": m.role, "content": m.text})
        # a participant's name goes to the template, which shows it where it has a place
        named = {"name": m.name} if m.name is not None else {}
        if m.role == "user":
            out.append({"role": "user", "content": m.text, **named})
        elif m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": m.text, **named}
            if m.tool_calls:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            out.append(msg)
        elif m.role == "tool":
            out.append({"role": "tool", "content": m.text, "tool_call_id": m.tool_call_id})
    return leading_system(out)


def _tool_choice(request: ChatCompletionRequest, tools: list[dict[str, Any]]) -> ToolChoice:
    raw = request.tool_choice
    choice = ToolChoice.parse(raw.model_dump() if hasattr(raw, "model_dump") else raw)
    if choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED) and not tools:
        raise APIError(400, f"tool_choice {choice.name or choice.mode.value!r} needs tools",
                       param="tool_choice")
    if choice.mode is ToolChoiceMode.NAMED:
        names = [t["function"]["name"] for t in tools]
        if choice.name not in names:
            raise APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools "
                                f"({', '.join(names)})", param="tool_choice")
    return choice


def _answer_schema(request: ChatCompletionRequest) -> dict[str, Any] | None:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format: type json_schema needs json_schema.schema",
                       param="response_format.json_schema")
    return fmt.json_schema.schema_


def _answer_strict(request: ChatCompletionRequest) -> bool:
    """The response format's objects closed unless the client turned its strict mode off (a
    tool's ``strict`` is the tool's: ``tool_specs`` reads it)."""
    fmt = request.response_format
    return not (fmt is not None and fmt.json_schema is not None and fmt.json_schema.strict is False)


def reply_grammar(tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool,
                  answer_schema: dict[str, Any] | None, answer_strict: bool = True
                  ) -> GrammarSource | None:
    """The grammar of the reply (``assistant_turn``, as the embedded backend builds it), or None
    for free text when there are neither tools nor a response format nor ``tool_choice`` none.

    With tools the reply follows ``tool_choice`` (``none``: text without calls); a response
    format makes the reply's text the answer in that format. Object schemas are closed to the
    properties they list, as OpenAI's strict mode does, but a tool's marked ``"strict": false``
    and the format's where ``answer_strict`` is False.
    """
    if not tools and answer_schema is None and choice.mode is not ToolChoiceMode.NONE:
        return None  # (none without tools: text without calls, as generate and agents have it)
    # Agents send the same tools turn after turn; checking their schemas is most of the cost.
    key = json.dumps([tools, choice.mode.value, choice.name, parallel, answer_schema,
                      answer_strict])
    return _turn_grammars.get_or_make(key, lambda: _turn_grammar(key))


# weighed by the keys' length, as the compile cache weighs its sources: a request of a thousand
# tools is a key of most of a megabyte
_turn_grammars = LRU(256, MAX_SOURCE_CHARS, len)


def _turn_grammar(key: str) -> GrammarSource:
    """``reply_grammar`` for its arguments as JSON text (a failure raises and is not cached)."""
    tools, mode, name, parallel, answer_schema, answer_strict = json.loads(key)
    choice = ToolChoice(ToolChoiceMode(mode), name)
    try:
        specs = tool_specs(tools)
    except GrammarError as err:
        raise APIError(400, str(err), param="tools") from None
    if answer_schema is not None:
        try:
            json_schema(answer_schema, origin="response_format.json_schema.schema")
            check_schema_supported(answer_schema, "response_format.json_schema.schema")
        except GrammarError as err:
            raise APIError(400, str(err), param="response_format.json_schema.schema") from None
    try:
        return assistant_turn(specs, choice, parallel, output_schema=answer_schema,
                              output_strict=answer_strict)
    except GrammarError as err:
        raise APIError(400, str(err), param="tools" if specs else "response_format") from None


# --- the generation loop ------------------------------------------------------------------------


@dataclass(frozen=True)
class Finished:
    """The engine finished the request."""

    result: GenerationResult


async def reply_events(aengine: AsyncEngine, job: ChatJob
                       ) -> AsyncIterator[ModelEvent | Finished]:
    """Text, tool-call deltas and closed calls as the engine decodes them, then ``Finished``.
    Leaving the iteration early (a client that went away) cancels the request in the engine."""
    grammar = job.params.grammar
    parser = HermesStreamParser(answers=grammar is not None and grammar.answers_in_schema) if (
        job.parses_tool_calls) else None
    async with aclosing(aengine.stream(job.prompt_ids, job.params)) as tokens:
        async for event in tokens:
            if isinstance(event, FinishEvent):
                for parsed in parser.close(event.result.finish_reason) if parser else []:
                    yield parsed
                yield Finished(event.result)
                return
            if parser is not None:
                for parsed in parser.feed(event.text):
                    yield parsed
            elif event.text:
                yield TextDelta(event.text)
    raise AssertionError("the engine stream ended without a FinishEvent")


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""
    sent: bool = False  # whether a delta of this call went out
    index: int = 0  # its index among the reply's calls
    # the arguments sent so far: up to their last "}" until the call closes, so that a client
    # that runs a call once its arguments are a whole object (the runtime's own backend) does
    # not run one the reply then leaves unclosed (cut by max_tokens)
    out: int = 0

    def unsent(self, whole: bool) -> str:
        """The arguments not sent yet: all of them if ``whole``, else up to a last "}"."""
        end = len(self.arguments)
        if not whole and self.arguments.rstrip().endswith("}"):
            end = self.arguments.rstrip().rfind("}")
        piece = self.arguments[self.out : max(end, self.out)]
        self.out += len(piece)
        return piece


@dataclass
class ReplyWriter:
    """Turns reply events into chunk deltas and keeps the whole reply for the final object."""

    content: list[str] = field(default_factory=list)
    calls: dict[int, _Call] = field(default_factory=dict)
    complete: list[int] = field(default_factory=list)  # indexes of well-formed calls
    cut: list[int] = field(default_factory=list)  # of calls that do not parse, sent as calls
    # whitespace held back: beside a call it separates calls and is not content; before text,
    # or at the end of a reply whose last word was text, it is
    _blank: str = ""
    _after_call: bool = False

    def deltas(self, event: ModelEvent) -> list[dict[str, Any]]:
        """The chunk deltas ``event`` adds (maybe none)."""
        if isinstance(event, TextDelta):
            # the whitespace it ends with is held like a blank delta: whether it is content
            # must not depend on how the text was cut into deltas (a block of accepted tokens)
            words = event.text.rstrip()
            if not words:
                self._blank += event.text
                return []
            text, self._after_call = self._blank + words, False
            self._blank = event.text[len(words):]
            self.content.append(text)
            return [{"content": text}]
        if isinstance(event, ToolCallDelta):
            self._blank, self._after_call = "", True
            call = self.calls.get(event.index)
            if call is None:
                call = self.calls[event.index] = _Call(f"call_{uuid.uuid4().hex[:24]}", event.name,
                                                       index=len(self.calls))
            call.arguments += event.arguments_delta
            return self._send(event.index, whole=False)
        if isinstance(event, ToolCallReady):
            return self._ready(event.index, event.call)
        raise AssertionError(f"unknown reply event {event!r}")

    def _send(self, index: int, whole: bool) -> list[dict[str, Any]]:
        """The delta of call ``index``'s arguments not sent yet (``_Call.unsent``), with
        its id and name if it is its first; none if there is nothing to send."""
        call = self.calls[index]
        piece = call.unsent(whole)
        if call.sent and not piece:
            return []
        entry: dict[str, Any] = {"index": call.index, "function": {"arguments": piece}}
        if not call.sent:
            entry.update(id=call.id, type="function")
            entry["function"] = {"name": call.name, "arguments": piece}
            call.sent = True
        return [{"tool_calls": [entry]}]

    def close(self) -> list[dict[str, Any]]:
        """The deltas the reply's end lets out: the whitespace it ended with, after text."""
        blank, self._blank = self._blank, ""
        if not blank or self._after_call:
            return []
        self.content.append(blank)
        return [{"content": blank}]

    def last_delta(self) -> dict[str, Any]:
        """The finish chunk's delta: the ends of the cut calls' arguments, held back until the
        finish reason (length) goes with them (``_Call.out``)."""
        pieces = [{"index": call.index, "function": {"arguments": call.unsent(True)}}
                  for call in (self.calls[i] for i in self.cut)]
        pieces = [p for p in pieces if p["function"]["arguments"]]
        return {"tool_calls": pieces} if pieces else {}

    def _ready(self, index: int, call: ToolCall | MalformedToolCall) -> list[dict[str, Any]]:
        if isinstance(call, ToolCall):
            deltas = []
            if index not in self.calls:  # no delta came first: the call is sent whole now
                deltas = self.deltas(ToolCallDelta(index, call.name, json.dumps(call.arguments)))
            self.complete.append(index)
            return deltas + self._send(index, whole=True)
        # A call that does not parse: the grammar binds every call's body, so max_tokens cut
        # it. Where its deltas went out as a call's, the whole reply holds it as the stream did,
        # its arguments as written (finish reason length, as OpenAI's API gives a call cut
        # there); where none did but its name is whole, it is sent as a call now (the runtime's
        # own backend reads it as a call too, not as the answer); where its name was never
        # read, it is neither call nor text: a client would take its markup ('{"name":') for
        # the model's answer.
        if index in self.calls:
            self.cut.append(index)
            return []
        begun = begun_call(call.body)
        if begun is None:  # (the blank before it is beside a call, as the stream held it)
            return []
        deltas = self.deltas(ToolCallDelta(index, *begun))
        self.cut.append(index)
        return deltas

    def tool_calls(self) -> list[dict[str, Any]]:
        return [{"id": self.calls[i].id, "type": "function",
                 "function": {"name": self.calls[i].name, "arguments": self.calls[i].arguments}}
                for i in sorted(self.complete + self.cut)]

    def text(self) -> str | None:
        """The content as the stream sent it (a leading blank with the first text after it);
        null for a reply of calls alone, "" for an empty one (as a streamed reply adds up)."""
        text = "".join(self.content)
        return None if not text and self.calls else text

    def finish_reason(self, result: GenerationResult) -> str:
        if result.finish_reason == "length":
            return "length"
        return "tool_calls" if self.complete else "stop"


def engine_failure(result: GenerationResult) -> APIError | None:
    """The error of a request the engine failed (finish reason ``error``): a 400 where its
    grammar reached a limit of llguidance's in mid-reply (the request's schema or tools too
    complex for it, where the checks at compile time did not reach), else a 500 (a fault of
    the engine's or of llguidance's: a token its mask allowed and it then refused); None for a
    request that did not fail."""
    if result.finish_reason != FinishReason.ERROR.value:
        return None
    if result.grammar_limit:
        return APIError(400, f"the grammar of this request's response_format or tools could not "
                             f"go on after {len(result.token_ids)} tokens of the reply: "
                             f"{result.error}; simplify the schema (its patterns, its size)",
                        code="grammar_limit")
    return APIError(500, f"the engine failed this request: {result.error} (see the server's log)",
                    type="server_error", code="engine_error")


def usage(result: GenerationResult) -> dict[str, Any]:
    prompt = int(result.stats.get("prompt_tokens", 0))
    completion = len(result.token_ids)
    cached = int(result.stats.get("cached_prompt_tokens", 0))  # from the engine's prefix cache
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def speculation_stats(result: GenerationResult) -> dict[str, Any]:
    """The ``agentflash`` extension of a response: how the engine decoded it (mode, tau,
    target and draft forwards, segments, tokens/s)."""
    return dict(result.stats)
