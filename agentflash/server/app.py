"""``agentflash serve``: the OpenAI-compatible HTTP API on one shared engine (a Starlette app).

    POST /v1/chat/completions   tools, tool_choice, parallel_tool_calls, response_format,
                                temperature, top_p, seed, max_tokens, stop, stream (SSE), usage;
                                each response carries the engine's stats in ``agentflash``
    GET  /v1/models             the one served model
    GET  /v1/models/{model}     it, by name (another name: 404)
    GET  /health                liveness and requests in flight (no API key needed)

Every request that reaches the engine shares its batches. Limits (body size, ``max_tokens``,
requests in flight) and every bad request end in a 4xx with OpenAI's error body; a client that
goes away cancels its request in the engine at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from agentflash import aio
from agentflash.engine.async_engine import AsyncEngine, run_in_own_thread
from agentflash.engine.engine import Engine, EngineConfig
from agentflash.errors import UserError
from agentflash.server import protocol
from agentflash.server.chat import (
    ChatJob,
    Finished,
    ReplyWriter,
    engine_failure,
    prepare,
    reply_events,
    speculation_stats,
    usage,
)
from agentflash.server.protocol import APIError, ChatCompletionRequest

log = logging.getLogger("agentflash.server")


@dataclass(frozen=True)
class ServerConfig:
    """How the server runs. Checked when built; a bad value names its field."""

    model: str = "demo"  # demo | a Hugging Face model directory
    drafter: str = "auto"  # auto | demo | none | a DFlash drafter directory
    host: str = "127.0.0.1"  # loopback unless asked otherwise
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* needs ``Authorization: Bearer <key>``
    served_name: str | None = None  # the ``model`` clients ask for; default: demo or the dir name
    max_body_bytes: int = 1 << 20  # larger request bodies get a 413
    # a request body that has not arrived whole after this many seconds gets a 408 (a client
    # that never finishes its body held one of the max_concurrent places for ever)
    body_timeout_s: float = 30.0
    max_tokens: int = 1024  # the most a request may ask for (and its default)
    max_concurrent: int = 64  # requests in flight; more get a 429
    max_running: int = 8  # requests the engine decodes in one batch (the rest wait in its queue)
    max_len: int = 2048  # tokens per request, prompt and reply
    # caps max_running to the requests of max_len tokens whose keys and values (and drafter
    # contexts) fit; None: no cap
    kv_budget_mb: float | None = None
    # prompts' keys and values kept for the prompts that begin the same way (a client's next
    # turn re-sends its history); 0: none
    prefix_cache_mb: float = 64.0

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tokens", "max_concurrent", "max_running", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"server {name} must be a positive integer, got {value!r}")
        cache_mb = self.prefix_cache_mb
        if not isinstance(cache_mb, int | float) or isinstance(cache_mb, bool) or cache_mb < 0:
            raise UserError(f"server prefix_cache_mb must be 0 or more, got {cache_mb!r}")
        budget = self.kv_budget_mb
        if budget is not None and (not isinstance(budget, int | float) or isinstance(budget, bool)
                                   or not budget > 0):
            raise UserError(f"server kv_budget_mb must be positive, got {budget!r}")
        from agentflash.engine.limits import limit_problems

        for _name, problem in limit_problems(self.max_running, self.max_len, cache_mb, budget):
            raise UserError(f"server {problem}")  # max_len 1: before the model loads
        timeout = self.body_timeout_s
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
            raise UserError(f"server body_timeout_s must be positive, got {timeout!r}")
        if not 0 <= self.port <= 65535:
            raise UserError(f"server port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise UserError("server api_key is empty (leave it out to serve without a key)")
        # an unset variable's value ("--host $HOST"): "" binds every interface, as 0.0.0.0 says
        # out loud (the banner read http://:8000)
        if not isinstance(self.host, str) or not self.host.strip():
            raise UserError(f"server host is empty, got {self.host!r} (127.0.0.1 by default; "
                            f"0.0.0.0 for every interface)")
        if self.served_name is not None and not self.served_name.strip():
            raise UserError("server served_name is empty (leave it out to serve the model's "
                            "name)")

    @property
    def name(self) -> str:
        if self.served_name:
            return self.served_name
        return "demo" if self.model == "demo" else Path(self.model).name


def load_engine(config: ServerConfig) -> Engine:
    """The engine a config names (weights loaded now)."""
    drafter = None if config.drafter == "none" else config.drafter
    try:  # the engine's own limits (max_len of at least 2, ...)
        limits = EngineConfig(max_running=config.max_running, max_len=config.max_len,
                              kv_budget_mb=config.kv_budget_mb,
                              prefix_cache_mb=config.prefix_cache_mb)
    except ValueError as err:
        raise UserError(f"server {err}") from None
    return Engine.from_pretrained(config.model, limits, drafter=drafter)


class Server:
    """The app's state: one engine, the requests in flight, the limits."""

    def __init__(self, config: ServerConfig, engine: Engine | None = None):
        self.config, self.engine = config, engine
        self.aengine: AsyncEngine | None = None
        self.engine_down: anyio.Event | None = None  # set once the engine stopped (or crashed)
        self._loop: asyncio.AbstractEventLoop | None = None  # the lifespan's, where it is set
        self.in_flight = 0
        self.created = protocol.now()

    def stopping(self) -> None:
        """The server is shutting down: end the replies in flight now, with the engine_stopped
        error (a stream's error event, a 503), not once uvicorn's grace period has passed and
        it cancels them (a cut stream, a plain-text 500, a traceback each). Safe to call from a
        signal handler or another thread."""
        if self._loop is not None and self.engine_down is not None:
            self._loop.call_soon_threadsafe(self.engine_down.set)

    # --- routes --------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        up = self.engine_down is not None and not self.engine_down.is_set()
        return JSONResponse({"status": "ok" if up else "engine stopped", "model": self.config.name,
                             "requests_in_flight": self.in_flight}, status_code=200 if up else 503)

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse(protocol.model_list([self.config.name], self.created))

    async def model(self, request: Request) -> Response:
        self.authorize(request)
        name = request.path_params["model"]
        if name != self.config.name:
            raise APIError(404, f"model {name!r} is not served here (this server serves "
                                f"{self.config.name!r})", type="not_found_error", param="model",
                           code="model_not_found")
        return JSONResponse(protocol.model_list([name], self.created)["data"][0])

    async def chat_completions(self, request: Request) -> Any:
        self.authorize(request)
        check_json_content_type(request)
        release = self.admit()
        streaming = False
        try:
            chat = protocol.parse_request(await read_body(request, self.config.max_body_bytes,
                                                          self.config.body_timeout_s))
            if chat.model != self.config.name:
                raise APIError(404, f"model {chat.model!r} is not served here (this server "
                                    f"serves {self.config.name!r})", type="not_found_error",
                               param="model", code="model_not_found")
            engine_down = self.check_engine()
            job = await anyio.to_thread.run_sync(prepare, chat, self.engine,
                                                 self.config.max_tokens)
            ident, created = f"chatcmpl-{uuid.uuid4().hex}", protocol.now()
            if chat.stream:
                streaming = True
                return EventStream(self.chunks(job, chat, ident, created), on_close=release,
                                   abort=engine_down)
            return await self.complete(job, ident, created, request.receive, engine_down)
        finally:
            if not streaming:
                release()

    # --- one completion ------------------------------------------------------------------------

    async def complete(self, job: ChatJob, ident: str, created: int, receive: Receive,
                       engine_down: anyio.Event) -> Response:
        """The whole reply as one ``chat.completion``; cancelled if the client goes away."""
        writer, result = ReplyWriter(), None
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_when_gone, receive, tg.cancel_scope)
            tg.start_soon(_cancel_when_set, engine_down, tg.cancel_scope)
            async with aclosing(reply_events(self.aengine, job)) as events:
                async for event in events:
                    if isinstance(event, Finished):
                        result = event.result
                        writer.close()
                    else:
                        writer.deltas(event)
            tg.cancel_scope.cancel()
        if result is None:
            self.check_engine()
            return Response(status_code=499)  # the client is gone; nobody reads this
        failure = engine_failure(result)
        if failure is not None:
            raise failure
        return JSONResponse(protocol.completion(
            ident, self.config.name, created, writer.text(), writer.tool_calls(),
            writer.finish_reason(result), usage(result), speculation_stats(result)))

    async def chunks(self, job: ChatJob, chat: ChatCompletionRequest, ident: str, created: int
                     ) -> AsyncIterator[bytes]:
        """Server-sent ``chat.completion.chunk`` events, then ``[DONE]``."""
        name, writer = self.config.name, ReplyWriter()
        opened = False

        def delta_chunk(delta: dict[str, Any]) -> bytes:
            # the first delta carries the role, and content "" or, where a call comes first,
            # null: what the whole reply's content is then, once the client has added it up
            nonlocal opened
            if not opened:
                opened = True
                delta = {"role": "assistant",
                         "content": None if "tool_calls" in delta else "", **delta}
            return protocol.sse(protocol.chunk(ident, name, created, delta))

        async with aclosing(reply_events(self.aengine, job)) as events:
            async for event in events:
                if not isinstance(event, Finished):
                    for delta in writer.deltas(event):
                        yield delta_chunk(delta)
                    continue
                result = event.result
                failure = engine_failure(result)
                if failure is not None:  # the stream ends with the error, as when the engine stops
                    yield protocol.sse(failure.body())
                    return
                for delta in writer.close():
                    yield delta_chunk(delta)
                if not opened:  # an empty reply
                    yield delta_chunk({})
                yield protocol.sse(protocol.chunk(
                    ident, name, created, writer.last_delta(), writer.finish_reason(result),
                    agentflash=speculation_stats(result)))
                if chat.wants_usage_chunk:
                    yield protocol.sse(protocol.usage_chunk(ident, name, created, usage(result)))
                yield protocol.sse("[DONE]")

    # --- admission -----------------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 key.encode()):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer "
                                "<key>'", code="invalid_api_key")

    def check_engine(self) -> anyio.Event:
        """The event set when the engine stops; a 503 if it has stopped already."""
        down = self.engine_down
        if down is None or down.is_set():
            raise APIError(503, "the engine has stopped; see the server's log", type="server_error",
                           code="engine_stopped")
        return down

    def admit(self) -> Callable[[], None]:
        """Count a request in flight; returns the function that releases it (idempotent)."""
        if self.in_flight >= self.config.max_concurrent:
            raise APIError(429, f"this server handles {self.config.max_concurrent} requests at "
                                f"once; retry shortly", type="rate_limit_error",
                           code="too_many_requests")
        self.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.in_flight -= 1

        return release

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.engine is None:
            self.engine = await run_in_own_thread(load_engine, self.config)
        self.engine_down = anyio.Event()
        self._loop = asyncio.get_running_loop()
        async with AsyncEngine(self.engine) as aengine:
            self.aengine = aengine
            try:
                yield
            finally:
                self.engine_down.set()


def check_json_content_type(request: Request) -> None:
    """A 415 unless the body is said to be JSON (``application/json``, ``application/*+json``),
    as vLLM answers: a web page may send any site a POST of ``text/plain``, a form, or a body
    of no type without asking (no CORS preflight), and a server without a key on this machine
    then ran its requests."""
    said = request.headers.get("content-type", "")
    kind = said.split(";")[0].strip().lower()
    main, _, sub = kind.partition("/")
    if main != "application" or not (sub == "json" or sub.endswith("+json")):
        raise APIError(415, f"the request body must be JSON (content-type application/json), "
                            f"not {kind or 'empty'}", code="unsupported_media_type")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, or a 413 once it passes ``limit`` bytes. An oversized body is still
    read (up to 16 times the limit) so that the client receives the 413 instead of a reset.
    A body not read whole within ``timeout_s`` seconds is a 408."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > 16 * limit:
        raise _too_large(int(declared), limit)
    body, total = bytearray(), 0
    try:
        with anyio.move_on_after(timeout_s) as deadline:
            async for part in request.stream():
                total += len(part)
                if total <= limit:
                    body += part
                elif total > 16 * limit:
                    break
    except ClientDisconnect:  # nobody to answer: no internal error to log
        raise APIError(499, "the client went away while sending its request",
                       code="client_closed_request") from None
    if deadline.cancelled_caught:
        raise APIError(408, f"the request body did not arrive whole within {timeout_s:g} s "
                            f"({total} bytes came)", code="request_timeout")
    if total > limit:
        raise _too_large(total, limit)
    return bytes(body)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body has {size} bytes; this server takes at most {limit}",
                    code="request_too_large")


async def _until_gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel_when_gone(receive: Receive, scope: anyio.CancelScope) -> None:
    await _until_gone(receive)
    scope.cancel()


async def _cancel_when_set(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


class EventStream:
    """A ``text/event-stream`` response that stops its events (and so the engine request) the
    moment the client disconnects, whatever the ASGI server's version of the spec. If ``abort``
    is set first (the engine stopped), the stream ends with an error event."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None],
                 abort: anyio.Event):
        self.events, self.on_close, self.abort = events, on_close, abort

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_when_gone, receive, tg.cancel_scope)
                tg.start_soon(self._abort_when_set, send, tg.cancel_scope)
                async with aclosing(self.events) as events:
                    async for data in events:
                        await send({"type": "http.response.body", "body": data,
                                    "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError:  # the connection broke while sending
            pass
        finally:
            self.on_close()

    async def _abort_when_set(self, send: Send, scope: anyio.CancelScope) -> None:
        await self.abort.wait()
        scope.cancel()
        with anyio.CancelScope(shield=True):
            body = APIError(503, "the engine has stopped; see the server's log",
                            type="server_error", code="engine_stopped").body()
            await send({"type": "http.response.body", "body": protocol.sse(body),
                        "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


# --- the app -------------------------------------------------------------------------------------


def create_app(config: ServerConfig = ServerConfig(), engine: Engine | None = None) -> Starlette:
    """The ASGI app. ``engine``: serve this already built engine (else the config's model is
    loaded at startup). The engine runs while the app's lifespan does."""
    server = Server(config, engine)
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=server.lifespan, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, Exception: _server_error})
    app.state.server = server
    return app


async def _api_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, APIError)
    return JSONResponse(err.body(), status_code=err.status)


async def _http_error(request: Request, err: Exception) -> Response:
    assert isinstance(err, HTTPException)
    kinds = {404: "not_found_error", 405: "invalid_request_error"}
    body = APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}",
                    type=kinds.get(err.status_code, "invalid_request_error")).body()
    return JSONResponse(body, status_code=err.status_code, headers=err.headers)


async def _server_error(request: Request, err: Exception) -> Response:
    log.exception("internal error on %s %s", request.method, request.url.path)
    body = APIError(500, f"internal server error: {type(err).__name__}",
                    type="server_error").body()
    return JSONResponse(body, status_code=500)


# --- running it ----------------------------------------------------------------------------------


def _uvicorn_config(app: Starlette, log_level: str) -> Any:
    import copy

    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    logging_config = copy.deepcopy(LOGGING_CONFIG)  # the access log on stderr, as the rest:
    logging_config["handlers"]["access"]["stream"] = "ext://sys.stderr"  # stdout is the user's
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5,
                          h11_max_incomplete_event_size=64 * 1024, log_config=logging_config)


def _uvicorn_server(app: Starlette, log_level: str) -> Any:
    """uvicorn's server, which on Ctrl-C or SIGTERM also tells the app it is stopping
    (``Server.stopping``) before it waits for the connections to close."""
    import uvicorn

    class Stopping(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.server.stopping()
            super().handle_exit(sig, frame)

    return Stopping(_uvicorn_config(app, log_level))


def serve(config: ServerConfig, engine: Engine | None = None, log_level: str = "info") -> None:
    """Run the server in the foreground until interrupted."""
    sock = _bind(config.host, config.port)
    if engine is None:  # loaded here, so that a bad model or budget is a clear error, not a
        try:  # failed startup inside uvicorn; in a thread of its own (see ``run_in_own_thread``)
            engine = aio.run(run_in_own_thread, load_engine, config)
        except BaseException:
            sock.close()
            raise
    server = _uvicorn_server(create_app(config, engine), log_level)
    # on stderr, as the command's other lines: the port bound (--port 0: the one picked), and
    # the tokens a request holds (--max-len, cut to the model's max_position_embeddings)
    host = f"[{config.host}]" if ":" in config.host else config.host  # IPv6, as a URL has it
    sock.listen(2048)  # (uvicorn's backlog): a client that read the line below is not refused
    print(f"agentflash serve: serving {config.name} on http://{host}:"
          f"{sock.getsockname()[1]}/v1 (requests of at most {engine.scheduler.cfg.max_len} "
          f"tokens)", file=sys.stderr, flush=True)
    server.run(sockets=[sock])


@contextmanager
def serving_in_thread(config: ServerConfig = ServerConfig(port=0), engine: Engine | None = None,
                      log_level: str = "warning") -> Iterator[str]:
    """Run the server in a background thread; yields its base URL (``http://host:port/v1``).
    ``port`` 0 picks a free port."""
    with running_in_thread(create_app(config, engine), config.host, config.port,
                           log_level) as url:
        yield url


@contextmanager
def running_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0,
                      log_level: str = "warning", timeout_s: float = 300.0) -> Iterator[str]:
    """Run any ASGI ``app`` under uvicorn in a background thread until the block ends."""
    import uvicorn

    sock = _bind(host, port)
    server = uvicorn.Server(_uvicorn_config(app, log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="agentflash-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(timeout=30)
            sock.close()
            raise RuntimeError("the server did not start (see its log above)")
        time.sleep(0.01)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    try:
        yield f"http://{shown}:{bound_port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto given explicitly: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # without it every response pays a 40 ms delayed-ACK stall between headers and body.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.set_inheritable(True)
    return sock
