"""The engine behind anyio: many tasks submit requests and read their tokens as a stream.

An engine thread, owned by the ``AsyncEngine`` from ``__aenter__`` to ``__aexit__``, runs every
``Engine.step`` while there is work and hands each step's tokens to the event loop, which feeds
the streams of their requests; the loop itself never runs the model. One thread because torch
keeps a team of OpenMP workers for every live thread that ran it, and once there are more
workers than cores they sleep between parallel regions instead of spinning: steps then run about
twice as slowly on a 2-core machine. For the same reason ``run_in_own_thread`` loads a model in a
thread that ends with the loading (an anyio worker thread would live on with its team).

A step that raises fails the requests it was running or admitting (finish reason ``error``, the
traceback in the log); the engine goes on serving the others.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectSendStream

from agentflash.engine.detokenizer import Detokenizer
from agentflash.engine.engine import Engine, GenerationResult, StepOutput
from agentflash.engine.request import Request, SamplingParams
from agentflash.errors import UserError

log = logging.getLogger("agentflash.engine")

T = TypeVar("T")


@dataclass
class TokenEvent:
    """New tokens of one request, with the text they complete."""

    token_ids: list[int]
    text: str


@dataclass
class FinishEvent:
    """The request is done; ``result`` holds the whole output and its stats (``finish_reason``
    ``error`` with ``result.error`` when the engine failed it)."""

    result: GenerationResult


@dataclass
class _Stream:
    """A request being streamed, and where its events go."""

    req: Request
    send: MemoryObjectSendStream
    detok: Detokenizer
    num_sent: int = 0  # output tokens sent in its events
    finished: bool = False  # its FinishEvent is sent


class AsyncEngine:
    """Use as ``async with AsyncEngine(engine) as aengine:`` and call ``stream`` from any task
    of that event loop."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._streams: dict[int, _Stream] = {}
        self._wake = threading.Event()  # set when the engine may have work
        self._stopping = False
        self._stepping = False  # the engine thread is in a step (in torch's work)
        self._thread: threading.Thread | None = None
        self._loop_token: anyio.lowlevel.EventLoopToken | None = None

    async def __aenter__(self) -> AsyncEngine:
        assert self._thread is None, "this AsyncEngine is already running"
        if self.engine.stepping_thread is not None:
            raise UserError("another AsyncEngine serves this engine already")
        self._loop_token = anyio.lowlevel.current_token()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="agentflash-engine", daemon=True)
        self._thread.start()
        self.engine.stepping_thread = self._thread.ident
        _running.add(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Stops the engine thread after its current step; requests still open fail."""
        thread, self._thread = self._thread, None
        assert thread is not None, "this AsyncEngine is not running"
        self._stopping = True
        self._wake.set()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(thread.join)
        _running.discard(self)
        self.engine.stepping_thread = None
        # the engine thread is gone: safe here. Streams cancelled just before it stopped had
        # no step left to free their slots
        self.engine.apply_cancels()
        for stream in list(self._streams.values()):
            if not stream.req.is_finished:
                self.engine.fail(stream.req, "the engine stopped before the request finished")
                self._publish(stream.req, [])

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent | FinishEvent]:
        """Token events as they are decoded, then one ``FinishEvent``.

        Leaving the iteration early (or being cancelled) cancels the request in the engine once
        the generator is closed. A generator left without being closed is closed by the event
        loop later (under asyncio, soon after the loop; kept in a variable, when collected); for
        the request to end at once, hold the stream as
        ``async with contextlib.aclosing(aengine.stream(...)) as events:``.
        """
        if self._thread is None:
            raise UserError("the AsyncEngine is not running: stream inside "
                            "`async with AsyncEngine(engine) as aengine:`")
        if anyio.lowlevel.current_token() != self._loop_token:  # its events would never come
            raise UserError("this engine (backend) was opened in another event loop: use it "
                            "in the loop that opened it, or open one in this loop")
        send, receive = anyio.create_memory_object_stream[TokenEvent | FinishEvent](
            max_buffer_size=1 << 16
        )
        req = self.engine.submit(prompt_ids, params)
        detok = Detokenizer(self.engine.decode_output, params.stop, params.tool_calls)
        self._streams[req.id] = _Stream(req, send, detok)
        self._wake.set()
        try:
            async with receive:
                async for event in receive:
                    yield event
        finally:
            if not req.is_finished:
                self.engine.cancel(req)
                self._wake.set()
            left = self._streams.pop(req.id, None)
            if left is not None:  # (left early: nothing will end it; unclosed, a ResourceWarning)
                left.send.close()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        # closed at once (its stream's entry freed now, not when the loop finalizes it: trio
        # kept it past the engine's exit)
        async with aclosing(self.stream(prompt_ids, params)) as events:
            async for event in events:
                if isinstance(event, FinishEvent):
                    return event.result
        raise AssertionError("stream ended without a FinishEvent")

    # --- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        """Steps while there is work, each step's outputs handed to the loop; sleeps otherwise."""
        while not self._stopping:
            self._wake.wait()
            self._wake.clear()
            while True:
                # said before _stopping is read: the exit hook sets _stopping, then waits while
                # this is set, so no step begins once it has stopped waiting
                self._stepping = True
                if self._stopping or not self.engine.has_work:
                    self._stepping = False
                    break
                try:
                    outputs, raised = self._step()
                finally:
                    self._stepping = False
                try:  # waits for the loop: the streams read requests the next step changes
                    anyio.from_thread.run_sync(self._publish_all, outputs, raised,
                                               token=self._loop_token)
                except anyio.RunFinishedError:
                    return

    def _step(self) -> tuple[list[StepOutput], bool]:
        """One engine step, and whether it raised. If it did, the requests it was running or
        admitting (whose state it may have left half-updated) fail, and the outputs say so."""
        try:
            return self.engine.step(), False
        except Exception as err:
            log.exception("an engine step failed; failing the requests it was running")
            return [StepOutput(req, []) for req in self.engine.fail_step(err)], True

    # --- on the event loop -----------------------------------------------------------------

    def _publish_all(self, outputs: list[StepOutput], raised: bool = False) -> None:
        """``outputs`` to their streams; after a step that raised, also the end of every
        request that finished in it before it raised (its outputs were lost with the step)."""
        if raised:
            published = {out.request.id for out in outputs}
            outputs = outputs + [StepOutput(s.req, s.req.output_ids[s.num_sent:])
                                 for s in self._streams.values()
                                 if s.req.is_finished and not s.finished
                                 and s.req.id not in published]
        for out in outputs:
            try:
                self._publish(out.request, out.new_ids)
            except Exception:  # a bug in making events: that stream ends, its request is cancelled
                log.exception("request %d: cannot hand its tokens to its stream", out.request.id)
                self._streams.pop(out.request.id).send.close()
                self.engine.cancel(out.request)

    def _publish(self, req: Request, new_ids: list[int]) -> None:
        stream = self._streams.get(req.id)
        if stream is None:
            return
        if new_ids or req.is_finished:  # an end with no new token (an error) flushes held text
            text = stream.detok.delta(req.output_ids, final=req.is_finished, cut=req.stop_text_len)
            if new_ids or text:
                stream.send.send_nowait(TokenEvent(new_ids, text))
                stream.num_sent += len(new_ids)
        if req.is_finished:
            stream.send.send_nowait(FinishEvent(self.engine.result(req)))
            stream.send.close()
            stream.finished = True


# the engines whose threads run: stopped when the process exits (below)
_running: weakref.WeakSet[AsyncEngine] = weakref.WeakSet()


@atexit.register
def _stop_engines(timeout_s: float = 30.0) -> None:
    """Let the engine threads of engines never closed (a script that ends while a run is going)
    finish their step and stop: a daemon thread still in torch's work while the interpreter
    finalizes aborted the process ("terminate called without an active exception"). A thread
    out of a step may wait on for its event loop (one stopped, never to run again): no harm,
    and not waited for."""
    engines = list(_running)
    for aengine in engines:
        aengine._stopping = True
        aengine._wake.set()
    deadline = time.monotonic() + timeout_s
    while any(a._stepping for a in engines) and time.monotonic() < deadline:
        time.sleep(0.005)


@asynccontextmanager
async def serving(engine: Engine) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(engine) as aengine:
        yield aengine


LOAD_THREAD = "agentflash-load"  # the name of ``run_in_own_thread``'s threads


def loading() -> bool:
    """Whether a ``run_in_own_thread`` call's work is still running (a wait for it that was
    cancelled leaves it running: it cannot be stopped). A process that exits the usual way
    waits for it first (its thread is no daemon: finalizing beside torch's threads at work
    aborted the process, "terminate called without an active exception"); the command line,
    interrupted, exits at once with ``os._exit``."""
    return any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate())


async def run_in_own_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a new thread that ends with it: load a model this way before serving it,
    so that the OpenMP workers torch starts for the loading end too (see the module's doc)."""
    outcome: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as err:  # re-raised in the caller
            outcome.append((False, err))

    # no daemon (not inherited from a daemon thread that calls this either): see ``loading``;
    # a load that never ends (a stalled read of the weights) then holds up the process's exit
    thread = threading.Thread(target=target, name=LOAD_THREAD, daemon=False)
    thread.start()
    # Polled, not joined in a worker thread: the load itself cannot be stopped, but a cancelled
    # wait returns at once (``loading``). Joined in anyio's worker thread, the wait could not be
    # cancelled: Ctrl-C printed "interrupted" and the command waited out the load (10-60 s).
    while thread.is_alive():
        await anyio.sleep(0.02)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
