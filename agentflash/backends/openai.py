"""Any OpenAI-compatible server as a backend (``agentflash serve``, vLLM, SGLang, OpenAI), over
httpx with streaming.

The runtime's request becomes one streamed ``/chat/completions`` call: tools, ``tool_choice``
and the output schema (as ``response_format``) go to the server, whose grammar backend
constrains decoding. The streamed ``delta.tool_calls`` become the same model events as the
embedded engine's: argument deltas as they arrive, and each call ready the moment its arguments
form a complete JSON object (one left unfinished, at the end of the reply; malformed if the
reply was cut by ``length``), so the runner dispatches it while the server keeps writing.
Connection errors, timeouts before the reply starts and HTTP 408, 409, 429, 500, 502, 503
and 504 are retried with exponential backoff (honouring ``Retry-After`` up to the backoff's
cap); other errors name the server, the status and the server's message.

    async with OpenAIBackend("http://127.0.0.1:8000/v1", "demo") as backend:
        result = await Runner.run(agent, "...", backend=backend)
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx

from agentflash.backends.base import (
    Backend,
    Decoding,
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
    ToolChoiceSpec,
    template_kwargs,
    unclosed_call_error,
)
from agentflash.backends.local import HermesStreamParser
from agentflash.errors import UserError, is_int, shown_url
from agentflash.runtime.errors import RunError
from agentflash.tool_format import load_body

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
# the finish reasons of a reply the server cut short (SGLang's and vLLM's abort and error, a
# content filter): not an answer. Any other ends a whole reply (stop, tool_calls, length, and
# other servers' words for them: eos, eos_token, stop_sequence, Mistral's model_length)
CUT_SHORT = frozenset({"abort", "error", "content_filter", "cancelled"})
# the most of a reply that is no answer (an error's body, a proxy's page) read for its message
MAX_ERROR_CHARS = 1 << 20
LENGTH = frozenset({"length", "model_length"})


class ServerUnavailable(RunError):
    """The server could not be reached or kept failing (after the retries), or broke a stream."""


class _NoDataYet(ServerUnavailable):
    """An attempt whose reply brought no data at all: it may be made again."""


class _Silent(ServerUnavailable):
    """A reply stream that sent nothing for ``timeout_s``."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently failed calls are retried."""

    max_retries: int = 4  # attempts after the first
    backoff_s: float = 0.5  # the first wait; doubled each time, with jitter
    max_backoff_s: float = 8.0

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait before retry ``attempt`` (0-based)."""
        if retry_after is not None:
            try:
                seconds = float(retry_after)
            except ValueError:
                seconds = math.nan  # an HTTP date: use the backoff
            if math.isfinite(seconds):
                return min(max(seconds, 0.0), self.max_backoff_s)
        base = min(self.backoff_s * 2**attempt, self.max_backoff_s)
        return base * (0.5 + random.random() / 2)


def _tool_names(tools: list[Any]) -> list[str]:
    """The names of a request's tools, OpenAI's ``{"function": {"name"}}`` or bare."""
    specs = [t.get("function", t) if isinstance(t, dict) else None for t in tools]
    return [s["name"] for s in specs if isinstance(s, dict) and isinstance(s.get("name"), str)]


def base_url_problem(base_url: Any) -> str | None:
    """What keeps ``base_url`` from naming a server to reach (``validate`` says it too); the URL
    shown without a user, password or query (``shown_url``)."""
    if not isinstance(base_url, str) or not base_url.lower().startswith(("http://",
                                                                           "https://")):
        shown = shown_url(base_url) if isinstance(base_url, str) else base_url
        return f"must be an http:// or https:// URL, got {shown!r}"
    try:
        url = httpx.URL(base_url)
        if not url.host:
            return f"{shown_url(base_url)!r} names no host"
        host = url.raw_host.decode("ascii", "replace")  # (a unicode name as IDNA has it)
        if ":" not in host and not re.fullmatch(r"[A-Za-z0-9._-]+", host):  # (no IPv6 literal)
            return f"{shown_url(base_url)!r}: its host holds a character no host name can"
        if url.port is not None and not 0 < url.port < 65536:
            return f"{shown_url(base_url)!r}: port {url.port} is not one of 1 to 65535"
    except httpx.InvalidURL as err:
        return f"{shown_url(base_url)!r} is not a valid URL: {err}"
    return None


def completions_url(base_url: str) -> str:
    """``/chat/completions`` under ``base_url``, its query kept after it (an Azure-style
    ``...?api-version=...``: appended to the text, the path landed in the query)."""
    parts = urlsplit(base_url)
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/") + "/chat/completions",
                       parts.query, ""))


class OpenAIBackend(Backend):
    """A remote OpenAI-compatible chat-completions server. Open it with ``async with``; one open
    backend serves any number of concurrent runs (one HTTP connection pool).

    ``base_url`` ends where ``/chat/completions`` is appended (``http://host:8000/v1``).
    ``api_key`` (or the environment variable ``api_key_env``) is sent as a bearer token.
    ``timeout_s`` bounds each wait for data (the reply's start, then every chunk).
    ``chat_template_kwargs`` go with every request, in the field of that name (vLLM's, SGLang's
    and ``agentflash serve``'s: the served model's template variables, Qwen3's
    ``{"enable_thinking": False}``).
    """

    provider_name = "openai"  # the API it speaks, whichever server answers

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 api_key_env: str | None = None, timeout_s: float = 120.0,
                 connect_timeout_s: float = 10.0, retry: RetryPolicy = RetryPolicy(),
                 chat_template_kwargs: dict[str, Any] | None = None):
        problem = base_url_problem(base_url)
        if problem:
            raise UserError(f"model.base_url {problem}")
        if not isinstance(model, str) or not model:
            raise UserError("model.model must name the served model")
        if api_key is None and api_key_env is not None:
            api_key = os.environ.get(api_key_env)
            if not api_key:
                raise UserError(f"model.api_key_env names {api_key_env}, which is not set")
        # its path without a trailing "/" (its query as it is: a "/" there is the query's)
        parts = urlsplit(base_url)
        self.base_url = urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"),
                                    parts.query, ""))
        self.model_name = model
        self.shown_url = shown_url(self.base_url)  # in messages: no user, password or query
        self._completions = completions_url(self.base_url)  # made once, not a request each
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.retry = retry
        if api_key and not (api_key.isascii() and api_key.isprintable()
                            and not any(ch.isspace() for ch in api_key)):
            source = f"model.api_key_env {api_key_env}" if api_key_env else "the api_key"
            raise UserError(f"{source} holds a character that cannot go in an HTTP header "
                            f"(a space or a line end copied with it?)")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.AsyncClient | None = None
        self.chat_template_kwargs = template_kwargs(chat_template_kwargs)

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> OpenAIBackend:
        if not spec.base_url or not spec.model:
            raise UserError("model.backend openai needs model.base_url and model.model")
        return cls(spec.base_url, spec.model, api_key_env=spec.api_key_env,
                   timeout_s=spec.timeout_s, retry=RetryPolicy(max_retries=spec.max_retries),
                   chat_template_kwargs=spec.chat_template_kwargs)

    async def __aenter__(self) -> OpenAIBackend:
        if self._client is not None:  # (an assert, gone under python -O: the inner exit
            # closed the outer block's client)
            raise UserError("this OpenAIBackend is already open: open it once "
                            "(async with backend: ...) and hand it to every run")
        # any number of concurrent runs: no cap of connections (httpx's is 100, and the 101st
        # request waited on the pool under the read timeout: a PoolTimeout)
        self._client = httpx.AsyncClient(headers=self._headers, timeout=self.timeout,
                                         limits=httpx.Limits(max_connections=None,
                                                             max_keepalive_connections=20))
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
        return None

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        if self._client is None:
            raise UserError("open the OpenAIBackend first: `async with OpenAIBackend(...) as b:`")
        started = time.perf_counter()
        body = request_body(self.model_name, request)
        if self.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        tries = _Tries(self.retry)  # one budget for every kind of retry of this call
        while True:
            # calls the server passes on as text are read, as the embedded engine reads them:
            # in a turn without tools too (there it sends no tools, and the server parses none)
            reader = _ChunkReader(_tool_names(request.tools),
                                  text_calls=request.tool_choice is not ToolChoice.NONE,
                                  parsed_calls=bool(request.tools)
                                  and request.tool_choice is not ToolChoice.NONE,
                                  answers=request.output_schema is not None)
            try:
                async with aclosing(self._reply(body, reader, tries)) as events:
                    async for event in events:
                        yield event
            except _NoDataYet as err:  # a connection that broke before any data
                if tries.spent:
                    raise ServerUnavailable(f"{err} (after {tries.made} attempts)") from None
                await anyio.sleep(tries.delay())
                continue
            break
        if reader.finish_reason is None:  # a reply cut off without a word: not a whole one
            raise ServerUnavailable(f"{self.shown_url}: the reply stream ended without a "
                                    f"finish_reason")
        for event in reader.close():
            yield event
        yield ModelFinish(reader.finish_reason, reader.stats(time.perf_counter() - started))

    async def _reply(self, body: dict[str, Any], reader: _ChunkReader, tries: _Tries
                     ) -> AsyncIterator[ModelEvent]:
        """One attempt: the reply's events as ``reader`` reads them. ``_NoDataYet`` where the
        connection broke, or the stream ended, before any data (nothing was handed on: the
        attempt may be made again; a server that is slow to start is not asked again, which
        would queue it anew). A connection that breaks or falls silent after the reply's
        finish_reason loses nothing of the answer (at most the usage counts sent after it)."""
        got_data = False
        async with self._post(body, tries) as response, \
                aclosing(self._events(response)) as stream:
            try:
                async for data in stream:
                    got_data = True
                    if data == "[DONE]":
                        break
                    try:
                        events = reader.read(self._chunk(data))
                    except (TypeError, AttributeError, ValueError) as err:
                        raise ServerUnavailable(f"{self.shown_url}: the stream sent a chunk this "
                                                f"client cannot read ({type(err).__name__}: "
                                                f"{err}): {data[:200]!r}") from None
                    for event in events:
                        yield event
            except _Silent as err:
                if reader.finish_reason is not None:  # the answer is whole
                    return
                raise ServerUnavailable(str(err)) from None  # (the class a caller may name)
            except httpx.RequestError as err:  # transport, and a body that does not decode
                if reader.finish_reason is not None:  # the answer is whole
                    return
                error = _NoDataYet if not got_data else ServerUnavailable
                raise error(f"{self.shown_url}: the reply stream broke: "
                            f"{_describe(err)}") from None
        if not got_data:  # a 200 with an empty body
            raise _NoDataYet(f"{self.shown_url}: the reply stream ended before any data")

    async def _events(self, response: httpx.Response) -> AsyncIterator[str]:
        """The ``data`` of the reply's events, each within ``timeout_s`` of the one before (a
        proxy's keep-alive comments reset the socket's read timeout, not this one); an
        ``event: error`` raises with its message; a body that is not an event stream (a JSON
        error with status 200, a proxy's HTML page) raises with what it says."""
        kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
        texts: AsyncIterator[str] = response.aiter_text()
        if kind not in ("", "text/event-stream"):
            # a JSON error, a proxy's page or its text; or an event stream under another
            # name (text/plain, application/x-ndjson: servers that exist), which its first
            # line tells, as OpenAI's own client reads it
            first = ""
            async for text in texts:
                first += text
                if first.strip() or len(first) >= MAX_ERROR_CHARS:
                    break
            if not _SSE_FIELD.match(first.lstrip()):
                text = first + await _head_text(texts, MAX_ERROR_CHARS - len(first))
                raise ServerUnavailable(f"{self.shown_url}: the server answered with {kind}, not "
                                        f"an event stream: {_error_message(text)}")
            texts = _chained(first, texts)
        wait = self.timeout.read
        async with aclosing(_sse_events(texts)) as events:
            # one deadline, which only a chunk moves on: named keep-alives (event: ping) do not
            deadline = anyio.current_time() + (wait if wait is not None else math.inf)
            while True:
                with anyio.move_on_after(deadline - anyio.current_time()) as scope:
                    item = await anext(events, None)
                if scope.cancelled_caught:
                    raise _Silent(f"{self.shown_url}: no data in {wait:g} s (timeout_s)")
                if item is None:
                    return
                name, data = item
                if name in ("message", "error"):
                    deadline = anyio.current_time() + (wait if wait is not None else math.inf)
                if name == "error":
                    obj = _parse(data)
                    raise ServerUnavailable(f"{self.shown_url}: the server stopped the reply: "
                                            f"{_error_message(obj if obj is not None else data)}")
                if name == "message":  # others (a ping) are not chunks
                    yield data

    def _chunk(self, data: str) -> dict[str, Any]:
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise ServerUnavailable(f"{self.shown_url}: the stream sent invalid JSON: "
                                    f"{data[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise ServerUnavailable(f"{self.shown_url}: the stream sent {data[:200]!r}")
        if chunk.get("error") is not None or chunk.get("object") == "error":  # not "error": null
            raise ServerUnavailable(f"{self.shown_url}: the server stopped the reply: "
                                    f"{_error_message(chunk)}")
        finish = next((c.get("finish_reason") for c in chunk.get("choices") or []
                       if isinstance(c, dict) and c.get("finish_reason")), None)
        if isinstance(finish, str) and finish.lower() in CUT_SHORT:
            raise ServerUnavailable(f"{self.shown_url}: the server ended the reply with "
                                    f"finish_reason {finish!r}")
        return chunk

    @asynccontextmanager
    async def _post(self, body: dict[str, Any], tries: _Tries) -> AsyncIterator[httpx.Response]:
        """The streamed response of ``/chat/completions`` once it answered 200, retrying
        connection errors, timeouts and the statuses of ``RETRY_STATUS`` while ``tries`` lasts."""
        assert self._client is not None
        url, shown = self._completions, shown_url(self._completions)
        while True:
            tries.made += 1
            try:
                response = await self._client.send(
                    self._client.build_request("POST", url, json=body), stream=True)
            except httpx.TransportError as err:
                if tries.spent:
                    raise ServerUnavailable(f"{shown}: {_describe(err)} (after {tries.made} "
                                            f"attempts)") from None
                await anyio.sleep(tries.delay())
                continue
            if response.status_code == 200:
                try:
                    yield response
                finally:
                    await response.aclose()
                return
            try:
                text = await _head_text(response.aiter_text())
            except httpx.HTTPError as err:  # its body cut off or stalled: the status tells
                text = f"(its body could not be read: {_describe(err)})"
            finally:
                await response.aclose()
            if response.status_code in RETRY_STATUS and not tries.spent:
                await anyio.sleep(tries.delay(response.headers.get("retry-after")))
                continue
            message = f"{shown}: HTTP {response.status_code}: {_error_message(text)}"
            if response.status_code in RETRY_STATUS:
                raise ServerUnavailable(f"{message} (after {tries.made} attempts)")
            raise UserError(message)


class _Tries:
    """The attempts at one call, counted across its kinds of retry (a refused or failed
    request, a reply that broke before any data), so that they add up to at most
    ``1 + max_retries`` requests, not their product."""

    def __init__(self, policy: RetryPolicy):
        self.policy, self.made = policy, 0

    @property
    def spent(self) -> bool:
        """Whether the attempt just made was the last one allowed."""
        return self.made > self.policy.max_retries

    def delay(self, retry_after: str | None = None) -> float:
        """Seconds to wait before the next attempt."""
        return self.policy.delay(self.made - 1, retry_after)


def from_spec(spec: ModelSpec) -> Backend:
    """The backend a workflow's ``model:`` section names (``backend: openai``)."""
    return OpenAIBackend.from_spec(spec)


# --- the request ---------------------------------------------------------------------------------


def _wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as OpenAI's API takes them: an assistant's calls in its ``{"type":
    "function", "function": {"name", "arguments"}}`` form with the arguments as JSON text,
    where the runtime also takes bare ``{"name", "arguments"}`` calls and arguments as an
    object (as chat templates read them)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_wire_call(call) for call in calls]}
        out.append(message)
    return out


def _wire_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", call)
    arguments = fn.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    wired = {k: v for k, v in call.items() if k not in ("function", "name", "arguments")}
    return {**wired, "type": "function", "function": {"name": fn["name"],
                                                      "arguments": arguments}}


def request_body(model: str, request: ModelRequest) -> dict[str, Any]:
    """The ``/chat/completions`` body of one model turn.

    The tools go with every tool choice, ``none`` included (the server keeps the reply free of
    calls; the model still reads the tools it called before). The output schema becomes a
    ``json_schema`` response format. DFlash settings other than the defaults go in the
    ``agentflash`` extension object, which ``agentflash serve`` reads and other servers ignore.
    """
    d: Decoding = request.decoding
    body: dict[str, Any] = {"model": model, "messages": _wire_messages(request.messages),
                            "temperature": d.temperature, "max_tokens": d.max_tokens,
                            "stream": True, "stream_options": {"include_usage": True}}
    if d.seed is not None:
        body["seed"] = d.seed
    if request.tools:
        body["tools"] = request.tools
        body["tool_choice"] = _tool_choice(request.tool_choice)
    if request.output_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": request.output_schema}}
    if d.speculation is not Speculation.AUTO or d.block_size is not None:
        options: dict[str, Any] = {"speculation": d.speculation.value}
        if d.block_size is not None:
            options["block_size"] = d.block_size
        body["agentflash"] = options
    return body


def _tool_choice(choice: ToolChoiceSpec) -> str | dict[str, Any]:
    if isinstance(choice, ForceTool):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, ToolChoice):
        return choice.value
    raise AssertionError(f"unknown tool choice {choice!r}")


# --- the reply -----------------------------------------------------------------------------------


_SSE_FIELD = re.compile(r"(data|event|id|retry)?:")  # what an event stream's line begins with


async def _chained(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for text in rest:
        yield text


async def _sse_events(texts: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """The ``(event, data)`` of each server-sent event (event ``message`` unless named) of a
    stream's ``texts``."""
    lines: list[str] = []
    name = "message"
    async for line in _sse_lines(texts):
        if line.startswith("data:"):
            lines.append(line[5:].removeprefix(" "))
        elif line.startswith("event:"):
            name = line[6:].strip() or "message"
        elif not line:  # an event ends (one without data is none, but its name ends too)
            if lines:
                yield name, "\n".join(lines)
            lines, name = [], "message"
    if lines:
        yield name, "\n".join(lines)


async def _sse_lines(texts: AsyncIterator[str]) -> AsyncIterator[str]:
    """The stream's lines, each ended by CR, LF or CR LF only, as SSE ends them: httpx's lines
    (``str.splitlines``) end also at U+2028, U+2029 and U+0085, which JSON text holds raw."""
    pending, after_cr = "", False
    async for text in texts:
        if after_cr and text.startswith("\n"):  # a CR LF split between two reads
            text, after_cr = text[1:], False
        if not text:
            continue
        after_cr = text.endswith("\r")
        *done, pending = _LINE_END.split(pending + text)
        for line in done:
            yield line
    if pending:
        yield pending


_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass
class _RemoteCall:
    id: str  # unique in the reply
    name: str
    arguments: str = ""
    is_ready: bool = False
    server_id: str | None = None  # the id the server gave it
    held: str = ""  # the first half of a surrogate pair its arguments' last piece ended with
    # begun by a piece that only repeated the call before's name (and id): a call once its
    # arguments come, nothing if none do (a trailing empty piece)
    tentative: bool = False


def _paired(text: str) -> tuple[str, str]:
    """``text`` whole, and the first half of a surrogate pair it ends with (or ""): a server
    that splits text in UTF-16 units sends an emoji's two surrogates (JSON's ``\\ud83d``,
    ``\\ude00``) in two chunks; the first waits for the second, the pair becomes its
    character, and one left alone becomes U+FFFD."""
    held = ""
    if text and "\ud800" <= text[-1] <= "\udbff":  # the first half: its second may come
        text, held = text[:-1], text[-1]
    if any("\ud800" <= ch <= "\udfff" for ch in text):
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text, held


TEXT_CALLS = 1 << 20  # the index of a reply's first call read from its text


def _after_structured(events: list[ModelEvent]) -> list[ModelEvent]:
    """The events of calls read from a reply's text, indexed after any the server sent as
    ``tool_calls`` (a reply of both keeps each call's index its own)."""
    return [replace(e, index=e.index + TEXT_CALLS)
            if isinstance(e, ToolCallDelta | ToolCallReady) else e for e in events]


class _ChunkReader:
    """``chat.completion.chunk`` objects in, model events out."""

    def __init__(self, tool_names: Iterable[str] = (), text_calls: bool = False,
                 parsed_calls: bool = False, answers: bool = False) -> None:
        self.tool_names = set(tool_names)  # the request's tools: a name streamed in pieces
        # a server without a tool-call parser (or whose parser gave up) sends the model's
        # Hermes calls as text: with ``text_calls`` (the request's tools may be called) they
        # are read from it, as the embedded engine reads them (the reply's text was the
        # agent's answer, its <tool_call> markup and all, and no tool ran)
        # (``answers``: an output schema's answer is the reply whole, ``HermesStreamParser``)
        self._text_calls = HermesStreamParser(f"call_{uuid.uuid4().hex[:8]}", answers) if (
            text_calls) else None
        self.calls: dict[int, _RemoteCall] = {}  # by index in the reply, in the order begun
        self._slots: dict[Any, int] = {}  # the server's index of a call -> its index here
        self._last_slot: Any = 0
        self.finish_reason: str | None = None  # until a choice says why it ended
        self.usage: dict[str, Any] = {}
        self.engine_stats: dict[str, Any] = {}
        self._held = ""  # the first half of a surrogate pair, until its second comes
        self._said = False  # whether the reply has sent text (not blank) or a call
        # the server parses calls (the request has tools): one it could not name is not sent
        self._parsed_calls = parsed_calls

    def read(self, chunk: dict[str, Any]) -> list[ModelEvent]:
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("agentflash"), dict):
            self.engine_stats = chunk["agentflash"]
        events: list[ModelEvent] = []
        for choice in chunk.get("choices") or []:
            finish = choice.get("finish_reason")
            if finish:  # those of a reply cut short are refused by ``_chunk``; read first: a
                # call whose arguments come whole with "length" is not run (``_tool_call_delta``)
                self.finish_reason = "length" if str(finish).lower() in LENGTH else "stop"
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content is not None and not isinstance(content, str):
                raise TypeError(f"delta.content is {type(content).__name__}, not text")
            content = self._characters(content or "")
            self._said = self._said or bool(content.strip()) or bool(delta.get("tool_calls"))
            if content and self._text_calls is not None:
                events += _after_structured(self._text_calls.feed(content))
            elif content:
                events.append(TextDelta(content))
            for entry in delta.get("tool_calls") or []:
                events += self._tool_call_delta(entry)
        return events

    def _characters(self, text: str) -> str:
        """``text`` whole (``_paired``), the half of a pair it ends with held for the next."""
        text, self._held = _paired(self._held + text)
        return text

    def _tool_call_delta(self, entry: dict[str, Any]) -> list[ModelEvent]:
        events: list[ModelEvent] = []
        fn = entry.get("function") or {}
        name = fn.get("name") or ""
        if not isinstance(name, str) or not isinstance(entry.get("id") or "", str):
            raise TypeError("a tool call's id and function.name are text")
        slot = entry.get("index")
        slot = self._last_slot if slot is None else slot  # pieces without one: the last call's
        self._last_slot = slot
        index = self._slots.get(slot)
        call = self.calls.get(index) if index is not None else None
        piece = fn.get("arguments") or ""
        if not isinstance(piece, str):
            raise TypeError(f"function.arguments is {type(piece).__name__}, not text")
        id_ = entry.get("id")
        if (call is not None and name and call.name and name != call.name
                and not call.arguments.strip() and id_ in (None, "", call.server_id)
                and any(t.startswith(call.name + name) for t in self.tool_names)):
            call.name, name = call.name + name, ""  # its name in pieces ("get_", "weather")
        replaced = None  # a call that no piece can reach any more: its index begins another
        tentative = False
        if call is not None and self._starts_another(call, id_, name, piece):
            tentative = not piece.strip() and name == call.name and id_ in (None, "",
                                                                            call.server_id)
            call, replaced = None, index
        if call is None:  # a new call: the ones before it whose arguments are whole are ready
            # (a server may interleave the calls' pieces: an unfinished one stays open)
            index = self._slots[slot] = len(self.calls)
            # and so is one this call replaces at its index, arguments or none (``{}``)
            events += self._ready(lambda i: i == replaced or (i < index
                                                              and self._is_whole(self.calls[i])))
            call = self.calls[index] = _RemoteCall(self._unique_id(id_), name, server_id=id_,
                                                   tentative=tentative)
        elif name and not call.name:
            call.name = name  # its first pieces came without one
        if call.is_ready:  # a piece after the call was handed on: nothing may be lost
            if piece.strip():
                raise ValueError(f"arguments {piece[:80]!r} came after call {call.name!r} was "
                                 f"whole")
            return events
        piece, call.held = _paired(call.held + piece)  # as the content's (``_characters``)
        call.arguments += piece
        if call.tentative and not call.arguments.strip():
            return events  # nothing to show until its arguments come
        events.append(ToolCallDelta(index, call.name, piece))
        if piece.rstrip().endswith("}") and self._is_whole(call) and self.finish_reason != "length":
            events += self._ready(lambda i: i == index)
        return events

    def _starts_another(self, call: _RemoteCall, id_: str | None, name: str,
                        piece: str) -> bool:
        """Whether a piece at ``call``'s index begins another call (servers that give every
        call one index, or none). Another id does where it names a tool or brings arguments
        once ``call`` is whole (an id that changes within a call, as some servers send, does
        not); without a telling id, a name or a new JSON object does once ``call`` is whole, or
        another tool's name once a call without arguments has its name (a name repeated on
        every piece of a call comes while its arguments are still being written)."""
        whole = self._is_whole(call)
        if id_ and call.server_id and id_ != call.server_id:
            return bool(name) or (whole and bool(piece.strip()))
        if whole:
            return bool(name) or piece.lstrip().startswith("{")
        if call.arguments.strip():
            return False
        return bool(name) and bool(call.name) and name != call.name

    def _unique_id(self, id_: str | None) -> str:
        """The server's id for a new call, made unique in the reply (some servers give every
        call of a turn one id: each call's result must find its own call)."""
        taken = {c.id for c in self.calls.values()}
        new = id_ or f"call_{uuid.uuid4().hex}"
        n = 2
        while new in taken:
            new, n = f"{id_}_{n}", n + 1
        return new

    @staticmethod
    def _is_whole(call: _RemoteCall, empty_is: bool = False) -> bool:
        """Whether ``call``'s arguments are a whole JSON object (``empty_is``: none count)."""
        if not call.arguments.strip():
            return empty_is
        # an object's text ends with its brace: no parse of the whole arguments on every piece
        # of a long string (asked at each delta, that was quadratic: 400 KB took 12 s)
        return call.arguments.rstrip().endswith("}") and isinstance(
            load_body(call.arguments)[0], dict)

    def _ready(self, which: Any, cut: bool = False) -> list[ModelEvent]:
        """The calls ``which`` takes that are not ready yet, ready now; ``cut``: the reply
        ended with ``length``, which cut them (a tool runs on no call it left unclosed, even
        one whose arguments are a whole object, or none yet)."""
        events: list[ModelEvent] = []
        for index, call in sorted(self.calls.items()):
            if call.is_ready or not which(index) or (call.tentative
                                                      and not call.arguments.strip()):
                continue  # (a trailing piece that repeated a name is no call)
            call.is_ready = True
            args, _ = load_body(call.arguments or "{}")  # NaN refused, as the grammar's
            if isinstance(args, dict) and call.name and not cut:
                events.append(ToolCallReady(index, ToolCall(call.id, call.name, args,
                                                            call.arguments.strip())))
                continue
            if cut and call.name:  # its body as the model wrote it, as the embedded engine's
                # reader gives it (its arguments as a JSON string in the body, and other words,
                # were another result to the model, and the next turn went another way)
                body = (f'{{"name": {json.dumps(call.name)}, "arguments": '
                        f'{call.arguments}').rstrip()
                error = unclosed_call_error("length")
            else:
                body = json.dumps({"name": call.name, "arguments": call.arguments})
                error = ("the call names no tool" if not call.name
                         else "the arguments are not a JSON object" if args is not None
                         else "the arguments are not valid JSON")
            events.append(ToolCallReady(index, MalformedToolCall(call.id, body, error)))
        return events

    def close(self) -> list[ModelEvent]:
        held = "\ufffd" if self._held else ""  # a half that never got its pair
        self._held = ""
        if self._text_calls is not None:
            parser = self._text_calls
            events = _after_structured(parser.feed(held) + parser.close(self.finish_reason
                                                                        or "stop"))
        else:
            events = [TextDelta(held)] if held else []
        events += self._ready(lambda i: True, cut=self.finish_reason == "length")
        if self.finish_reason == "length" and self._parsed_calls and not (
                self._said or self.calls):
            # nothing said, cut, where the server parses calls: a call cut before its name was
            # whole, which it cannot send (agentflash serve, vLLM's parsers): malformed, as
            # the embedded engine gives it (its text was the run's output ""); without tools
            # the server sends a call's markup as text, and an empty reply is one
            events.append(ToolCallReady(0, MalformedToolCall(f"call_{uuid.uuid4().hex[:8]}", "",
                                                             unclosed_call_error("length"))))
        return events

    def stats(self, wall_s: float) -> dict[str, Any]:
        """The engine's stats when the server is ``agentflash serve``; otherwise what the usage
        tells (forwards unknown: 0)."""
        stats = {"mode": "remote", "target_forwards": 0, "draft_forwards": 0, "tau": 0.0,
                 "wall_s": round(wall_s, 4), "segments": []}
        new = _count(self.usage.get("completion_tokens"))
        details = self.usage.get("prompt_tokens_details")
        details = details if isinstance(details, dict) else {}
        stats.update(prompt_tokens=_count(self.usage.get("prompt_tokens")), new_tokens=new,
                     cached_prompt_tokens=_count(details.get("cached_tokens")),
                     tokens_per_s=round(new / wall_s, 2) if wall_s > 0 else 0.0)
        stats.update(self.engine_stats)
        return stats


def _count(value: Any) -> int:
    """A token count from the usage object; 0 where the server gave none it could mean."""
    return int(value) if is_int(value) and value >= 0 else 0


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


async def _head_text(texts: AsyncIterator[str], limit: int | None = None) -> str:
    """The first ``limit`` characters (``MAX_ERROR_CHARS``) of a reply that is no answer (an
    error's body, a proxy's page): what its message may quote, never a whole body that may be
    gigabytes."""
    limit = MAX_ERROR_CHARS if limit is None else limit
    head = ""
    if limit > 0:
        async for text in texts:
            head += text
            if len(head) >= limit:
                break
    return head[:limit]


def _error_message(body: str | dict[str, Any]) -> str:
    """The ``error.message`` of an OpenAI error body, else the body itself (clipped)."""
    obj = body if isinstance(body, dict) else _parse(body)
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        obj = obj["error"]
    elif isinstance(obj, dict) and isinstance(obj.get("error"), str):
        return obj["error"]
    if isinstance(obj, dict) and isinstance(obj.get("message"), str):  # also vLLM's older form
        code = obj.get("code") or obj.get("type")
        return f"{obj['message']} ({code})" if code else obj["message"]
    text = body if isinstance(body, str) else json.dumps(body)
    title = re.search(r"<title[^>]*>(.*?)</title>", text, re.IGNORECASE | re.DOTALL)
    if title is not None and title.group(1).strip():  # a proxy's page: its title says it
        text = title.group(1)
    return " ".join(text.split())[:300] or "(empty body)"  # on one line


def _describe(err: httpx.TransportError) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
