"""The embedded engine as a backend: one shared ``AsyncEngine``, the Hermes text stream parsed
into model events as it is decoded.

Every agent and run that is handed the same open ``LocalBackend`` shares one engine, so their
requests are batched together step by step. The weights of a model directory are loaded once per
process; each open backend owns its own engine (KV cache and scheduler) around them.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio

from agentflash.backends.base import (
    Backend,
    ForceTool,
    MalformedToolCall,
    ModelEvent,
    ModelFinish,
    ModelRequest,
    ModelSpec,
    Speculation,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallReady,
    ToolChoice,
    template_kwargs,
    unclosed_call_error,
)
from agentflash.errors import UserError, expand_user
from agentflash.runtime.errors import RunError
from agentflash.tool_format import CLOSE, OPEN, CallEnd, JsonScan, parse_body
from agentflash.tool_format import MalformedToolCall as ParsedMalformed

# a conversation this long is tokenized off the event loop (``LocalBackend._prompt_ids``)
LONG_PROMPT_CHARS = 100_000
# ``{"name": "<name>", "arguments": `` at the start of a call body: from here on the arguments
# can be streamed as they are written.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _OpenCall:
    """The body of one ``<tool_call>`` being written, and how much of its arguments was sent."""

    def __init__(self, index: int):
        self.index = index
        self.body = ""  # the text handed to ``extend``: the body up to where it may end
        self.closer = CallEnd()  # where it ends
        self.name: str | None = None
        self.args_start = 0  # where the arguments value begins in ``body``
        self.args_end: int | None = None  # one past its end, once the value closed
        self.sent = 0  # characters of the arguments handed out
        self._pos = 0  # scanner position in ``body``
        self._json = JsonScan()  # over the arguments value, from ``args_start``
        self.tag_from = 0  # where a closing tag in the closer's text may begin, searched so far

    def extend(self, text: str) -> list[ModelEvent]:
        self.body += text
        events: list[ModelEvent] = []
        if self.name is None:
            if not self._read_head():
                return events
            events.append(ToolCallDelta(self.index, self.name, ""))
        self._scan()
        if self.args_end is not None:
            limit = self.args_end
        else:  # only the inside of an object or array is known to be arguments text
            limit = self._pos if self._json.depth > 0 else self.args_start + self.sent
        chunk = self.body[self.args_start + self.sent : limit]
        if chunk:
            self.sent += len(chunk)
            events.append(ToolCallDelta(self.index, self.name, chunk))
        return events

    def _read_head(self) -> bool:
        match = _HEAD.match(self.body)
        if match is None or match.end() == len(self.body):  # wait for the value's first character
            return False
        try:
            self.name = json.loads(f'"{match.group(1)}"')
        except json.JSONDecodeError:
            return False
        self.args_start = self._pos = match.end()
        return True

    def _scan(self) -> None:
        """Advance over the arguments value, noting where it ends (strings are skipped)."""
        body, scan = self.body, self._json
        while self._pos < len(body) and self.args_end is None:
            c = body[self._pos]
            self._pos += 1
            closing = c in "}]" and not scan.in_string and scan.depth == 1
            scan.step(c)
            if closing:
                self.args_end = self._pos

    def finish(self, call_id: str) -> list[ModelEvent]:
        """The call closed: its last argument delta and the parsed call (or why it is malformed)."""
        events: list[ModelEvent] = []
        call = parse_body(self.body)  # as ``parse_tool_calls`` reads a whole reply
        if isinstance(call, ParsedMalformed):
            return [ToolCallReady(self.index, MalformedToolCall(call_id, call.body, call.error))]
        written = ""
        if self.name is None:  # written in another key order: nothing was streamed
            events.append(ToolCallDelta(self.index, call.name,
                                        json.dumps(call.arguments, ensure_ascii=False)))
        elif self.args_end is not None:
            written = self.body[self.args_start : self.args_end]
            if self.args_start + self.sent < self.args_end:
                rest = self.body[self.args_start + self.sent : self.args_end]
                events.append(ToolCallDelta(self.index, self.name, rest))
        events.append(ToolCallReady(self.index, ToolCall(call_id, call.name, call.arguments,
                                                         written)))
        return events


class HermesStreamParser:
    """Turns a Hermes-format reply, fed in chunks of any size, into model events: prose outside
    ``<tool_call>`` blocks, argument deltas inside them, and each call as its block closes."""

    def __init__(self, id_prefix: str = "call", answers: bool = False):
        self._ids = (f"{id_prefix}_{n}" for n in itertools.count())
        self._buf = ""  # text not yet handed out (a tag may be starting at its end)
        self._call: _OpenCall | None = None
        self._num_calls = 0
        # ``answers``: the turn's grammar makes the reply calls or one answer in a schema
        # (``assistant_turn``'s ``output_schema``), so a reply that begins as a JSON object,
        # array or string is the answer, whole: its strings may spell the tag (an answer that
        # quoted "<tool_call>" was read as a broken call). Decided at its first character that
        # is not blank: a server that binds no grammar may write calls after a blank line or
        # a few words
        self._answers = answers
        self._answering = False

    def feed(self, text: str) -> list[ModelEvent]:
        self._buf += text
        if self._answers and not self._num_calls and not self._answering:
            head = self._buf.lstrip()
            if not head:  # blank so far: undecided
                return []
            self._answers = False  # decided
            self._answering = head[0] in '{["'
        if self._answering:
            text, self._buf = self._buf, ""
            return [TextDelta(text)] if text else []
        events: list[ModelEvent] = []
        while True:
            if self._call is not None:  # the call ends at its first closing tag outside a string
                call, closer = self._call, self._call.closer
                closer.feed(self._buf)
                self._buf = ""
                if closer.end is None:  # (held from a tag in a string: where the quotes do
                    # not pair, the call ends there after all, ``CallEnd.fallback``)
                    # searched from where the last search left off: a call's arguments come in
                    # token-sized pieces, and searching the whole body each time was quadratic
                    # (400 KB of arguments: 6 s)
                    tag = closer.text.find(CLOSE, call.tag_from)
                    call.tag_from = max(call.tag_from, len(closer.text) - len(CLOSE) + 1) if (
                        tag < 0) else tag
                    return events + self._extend(closer.pos if tag < 0 else min(closer.pos, tag))
                events += self._extend(closer.end) + call.finish(next(self._ids))
                self._buf = closer.text[closer.end + len(CLOSE) :]
                self._call = None
                continue
            at = self._buf.find(OPEN)
            if at < 0:
                cut = len(self._buf) - _partial_suffix(self._buf, OPEN)
                events += self._take(self._buf[:cut])
                self._buf = self._buf[cut:]
                return events
            events += self._take(self._buf[:at])
            self._buf = self._buf[at + len(OPEN) :]
            self._call = _OpenCall(self._num_calls)
            self._num_calls += 1

    def close(self, finish_reason: str) -> list[ModelEvent]:
        """The reply ended: flush held text; a call still open is malformed."""
        events = self._take(self._buf)
        self._buf = ""
        if self._call is None:
            return events
        call, closer = self._call, self._call.closer
        end = closer.fallback()
        if end is not None:  # its quotes do not pair: it ends at its first tag after all
            events += self._extend(end)
            call.body = call.body[:end]
            events += call.finish(next(self._ids))
            self._call = None
            return events + self.feed(closer.text[end + len(CLOSE) :]) + self.close(finish_reason)
        events += self._extend(len(closer.text))
        self._call = None
        error = unclosed_call_error(finish_reason)
        return events + [ToolCallReady(call.index, MalformedToolCall(next(self._ids),
                                                                     call.body.strip(), error))]

    def _extend(self, upto: int) -> list[ModelEvent]:
        """Hand the open call its body up to ``upto`` (a position in the closer's text)."""
        call = self._call
        piece = call.closer.text[len(call.body) : upto]
        return call.extend(piece) if piece else []

    def _take(self, text: str) -> list[ModelEvent]:
        if not text:
            return []
        if self._call is not None:
            return self._call.extend(text)
        return [TextDelta(text)]


# --- the engine ---------------------------------------------------------------------------------

_weights: dict[tuple[str, str], Any] = {}
_weights_lock = threading.Lock()


def load_weights(model: str, drafter: str = "auto") -> tuple[Any, Any, Path, Any]:
    """The decoder, tokenizer, model directory and DFlash drafter (or None) of ``model``
    (``demo`` or a directory), loaded once per process.

    ``drafter``: ``auto`` (the demo drafter with the demo model when it is shipped, none
    otherwise), ``demo``, ``none`` or a drafter directory.
    """
    from agentflash.models.loading import (
        DEMO_DIR,
        load_drafter_for,
        load_model,
        load_tokenizer,
        resolve_model_dir,
    )

    if drafter == "auto":
        shipped = model == "demo" and (DEMO_DIR / "drafter" / "config.json").exists()
        drafter = "demo" if shipped else "none"
    key = (str(resolve_model_dir(model).resolve()), drafter)
    with _weights_lock:
        if key not in _weights:
            net, _, model_dir = load_model(key[0])
            draft = load_drafter_for(net, drafter) if drafter != "none" else None
            _weights[key] = (net, load_tokenizer(model_dir, net.cfg.vocab_size), model_dir, draft)
        return _weights[key]


def check_drafter(drafter: str | Path | None) -> str | Path:
    """``auto``, ``demo``, ``none`` or an existing drafter directory; ``None`` is ``none``, as
    ``Engine.from_pretrained`` reads it."""
    if drafter is None:
        return "none"
    if not isinstance(drafter, (str, os.PathLike)):  # 5 raised os.fspath's TypeError
        raise UserError(f"drafter must be 'auto', 'demo', 'none' (or None) or a drafter "
                        f"directory, got {type(drafter).__name__}")
    if drafter not in ("auto", "demo", "none") and not expand_user(drafter).is_dir():
        raise UserError(f"{drafter}: drafter directory does not exist")
    return drafter


class EngineFailed(RunError):
    """The embedded engine failed a turn (the log has its traceback)."""


_CLAIM = threading.Lock()  # LocalBackend's check-and-set of _claimed (one for all: a backend
# with a lock of its own could no longer be copied or pickled)


class LocalBackend(Backend):
    """The embedded engine. ``async with LocalBackend("demo") as backend:`` then hand ``backend``
    to every run that should share the engine.

    ``model`` is ``demo`` or a Hugging Face model directory; ``drafter`` is ``auto`` (the demo
    drafter with the demo model when it is shipped), ``demo``, ``none`` (or ``None``, as
    ``Engine.from_pretrained`` reads it) or a DFlash drafter directory. ``prefix_cache_mb``
    sizes the engine's prefix cache (0: off); ``max_running``, ``max_len`` and
    ``kv_budget_mb`` are its limits (``EngineConfig``). ``engine`` serves an already built
    ``Engine`` instead. ``chat_template_kwargs`` are variables of the model's
    chat template for every turn (Qwen3's ``{"enable_thinking": False}``).
    """

    def __init__(self, model: str | Path = "demo", *, drafter: str | Path | None = "auto",
                 prefix_cache_mb: float = 64.0, max_running: int = 8, max_len: int = 2048,
                 kv_budget_mb: float | None = None, engine: Any = None,
                 chat_template_kwargs: dict[str, Any] | None = None):
        from agentflash.engine.engine import Engine, EngineConfig

        if engine is not None and not isinstance(engine, Engine):  # its AttributeError at open
            from agentflash.engine.async_engine import AsyncEngine

            served = " (an AsyncEngine: give its .engine)" if isinstance(engine,
                                                                        AsyncEngine) else ""
            raise UserError(f"engine must be an Engine (Engine.from_pretrained(...)), got "
                            f"{type(engine).__name__}{served}")
        if not isinstance(model, (str, os.PathLike)):  # str(None): "None: model directory ..."
            raise UserError(f"model must be 'demo' or a model directory, got "
                            f"{type(model).__name__}")
        try:
            self.config = EngineConfig(max_running=max_running, max_len=max_len,
                                       kv_budget_mb=kv_budget_mb, prefix_cache_mb=prefix_cache_mb)
        except ValueError as err:
            raise UserError(str(err)) from None
        self.model = os.fspath(model)  # (str() of a PathLike of the user's is its repr)
        self.drafter = check_drafter(drafter)
        self.model_name = "demo" if self.model == "demo" else Path(self.model).name
        self.chat_template_kwargs = template_kwargs(chat_template_kwargs)
        self._engine = engine
        self._aengine: Any = None
        # set from the first line of __aenter__ to the end of __aexit__: a second opener (a task
        # or a thread beside the first) is refused before it builds an engine of its own
        self._claimed = False

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> LocalBackend:
        return cls(spec.resolve(spec.path), drafter=spec.resolve(spec.drafter),
                   prefix_cache_mb=spec.prefix_cache_mb, max_running=spec.max_running,
                   max_len=spec.max_len, kv_budget_mb=spec.kv_budget_mb,
                   chat_template_kwargs=spec.chat_template_kwargs)

    async def __aenter__(self) -> LocalBackend:
        from agentflash.engine.async_engine import AsyncEngine, run_in_own_thread
        from agentflash.engine.engine import Engine

        with _CLAIM:
            if self._claimed:
                raise UserError("this LocalBackend is already open: open it once "
                                "(async with backend: ...) and hand it to every run")
            self._claimed = True
        try:
            if self._engine is None:

                def build() -> Engine:  # here too: filling the KV cache starts an OpenMP team
                    net, tokenizer, model_dir, draft = load_weights(self.model, self.drafter)
                    return Engine(net, tokenizer, self.config, model_dir=model_dir,
                                  drafter=draft)

                self._engine = await run_in_own_thread(build)
            self._engine.check_template_kwargs(self.chat_template_kwargs)
            aengine = AsyncEngine(self._engine)
            await aengine.__aenter__()
        except BaseException:  # a refusal or a cancelled load leaves this backend closed
            self._claimed = False
            raise
        self._aengine = aengine
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        aengine, self._aengine = self._aengine, None
        try:  # the caller's exception, if any, propagates as it is, not wrapped in a group
            if aengine is not None:
                await aengine.__aexit__(None, None, None)
        finally:
            self._claimed = False
        return None

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        from agentflash.engine.async_engine import FinishEvent
        from agentflash.engine.request import FinishReason

        if self._aengine is None:
            raise UserError("open the LocalBackend first: "
                            "`async with LocalBackend(...) as backend:`")
        # calls are read from the text, in a turn without tools too (a model trained on tool
        # use writes them anyway: a call of a tool the agent lacks goes back as an error)
        parser = HermesStreamParser(f"call_{uuid.uuid4().hex[:8]}",
                                    answers=request.output_schema is not None)
        prompt_ids = await self._prompt_ids(request)
        async with aclosing(self._engine_stream(request, prompt_ids)) as tokens:
            async for event in tokens:
                if isinstance(event, FinishEvent):
                    result = event.result
                    if result.finish_reason == FinishReason.ERROR.value:
                        raise EngineFailed(f"{self.model_name}: the engine failed this turn: "
                                           f"{result.error}")
                    for parsed in parser.close(result.finish_reason):
                        yield parsed
                    yield ModelFinish(result.finish_reason, result.stats)
                    return
                for parsed in parser.feed(event.text):
                    yield parsed
        raise AssertionError("the engine stream ended without a FinishEvent")

    async def _prompt_ids(self, request: ModelRequest) -> list[int]:
        """The turn's prompt under the chat template. A long conversation (a tool's huge
        result) is rendered and tokenized in a worker thread: on the event loop it held every
        other run still (2 s for 2M characters); the tokenizer runs no torch, so the worker
        starts no OpenMP team (the engine module's concern)."""
        size = sum(len(str(m.get("content") or "")) for m in request.messages)
        kwargs = self.chat_template_kwargs
        if size < LONG_PROMPT_CHARS:
            return self._engine.chat_prompt(request.messages, request.tools, kwargs)
        return await anyio.to_thread.run_sync(self._engine.chat_prompt, request.messages,
                                              request.tools, kwargs)

    def _engine_stream(self, request: ModelRequest, prompt_ids: list[int]
                       ) -> AsyncIterator[Any]:
        """The one place a turn reaches the engine.

        Decoding settings go to the engine's router and drafter; the request's ``tool_choice``
        and ``output_schema`` become the turn's grammar. The tools are shown under every tool
        choice, ``none`` included (as OpenAI-compatible servers render them): the grammar keeps
        the reply free of calls, the model still reads what it called before, and the prompt
        begins like the turn's earlier ones, so the prefix cache serves it.
        """
        if request.decoding.speculation is Speculation.DFLASH and self._engine.drafter is None:
            raise UserError("decoding.speculation 'dflash' needs a drafter: LocalBackend(..., "
                            "drafter='demo' or a drafter directory), model.drafter in a "
                            "workflow (or use speculation auto or off)")
        return self._aengine.stream(prompt_ids, sampling_params(request))


def sampling_params(request: ModelRequest) -> Any:
    """The engine's parameters for one turn: its decoding settings and the grammar of its tool
    choice and output schema, so that calls and structured answers are valid by construction."""
    from agentflash.engine.request import SamplingParams

    decoding = request.decoding
    return SamplingParams(max_tokens=decoding.max_tokens, temperature=decoding.temperature,
                          seed=decoding.seed, speculation=decoding.speculation.value,
                          block_size=decoding.block_size, grammar=turn_grammar(request))


def turn_grammar(request: ModelRequest) -> Any:
    """``assistant_turn`` over the request's tools, tool choice and output schema (or None).
    Without tools, ``tool_choice`` none still binds the turn to text without calls (a model
    trained on tool use may write one); ``auto`` leaves it free: the grammar's masks cost a
    plain turn about 3% and DFlash's acceptance about 9% (measured on the demo model)."""
    from agentflash.grammar import assistant_turn

    if not request.tools and request.output_schema is None:
        return assistant_turn([], "none") if request.tool_choice is ToolChoice.NONE else None
    choice = request.tool_choice
    # a forced tool in the object form: a tool may be named none, auto or required
    value = ({"type": "function", "function": {"name": choice.name}}
             if isinstance(choice, ForceTool) else choice.value)
    return assistant_turn(request.tools, value, output_schema=request.output_schema)


def from_spec(spec: ModelSpec) -> Backend:
    """The backend a workflow's ``model:`` section names (``backend: local``)."""
    return LocalBackend.from_spec(spec)
