"""The engine behind anyio: many tasks submit requests and read their tokens as a stream.

One driver task runs ``Engine.step`` in a worker thread while there is work and hands each step's
tokens to the streams of their requests, so a stream is fed by the same loop that serves every
other request sharing the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from agentflash.engine.detokenizer import Detokenizer
from agentflash.engine.engine import Engine, GenerationResult
from agentflash.engine.request import Request, SamplingParams


@dataclass
class TokenEvent:
    """New tokens of one request, with the text they complete."""

    token_ids: list[int]
    text: str


@dataclass
class FinishEvent:
    """The request is done; ``result`` holds the whole output and its stats."""

    result: GenerationResult


class AsyncEngine:
    """Use as ``async with AsyncEngine(engine) as aengine:`` and call ``stream`` from any task."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._streams: dict[int, MemoryObjectSendStream] = {}
        self._detok: dict[int, Detokenizer] = {}
        self._wake = anyio.Event()
        self._tg: TaskGroup | None = None

    async def __aenter__(self) -> AsyncEngine:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._drive)
        return self

    async def __aexit__(self, *exc) -> bool | None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        return await self._tg.__aexit__(*exc)

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent | FinishEvent]:
        """Token events as they are decoded, then one ``FinishEvent``.

        Leaving the iteration early (or being cancelled) cancels the request in the engine.
        """
        send, receive = anyio.create_memory_object_stream[TokenEvent | FinishEvent](
            max_buffer_size=1 << 16
        )
        req = self.engine.submit(prompt_ids, params)
        self._streams[req.id] = send
        self._detok[req.id] = Detokenizer(self.engine.tokenizer, params.stop)
        self._wake.set()
        try:
            async with receive:
                async for event in receive:
                    yield event
        finally:
            if not req.is_finished:
                self.engine.cancel(req)
                self._wake.set()
            self._streams.pop(req.id, None)
            self._detok.pop(req.id, None)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        async for event in self.stream(prompt_ids, params):
            if isinstance(event, FinishEvent):
                return event.result
        raise AssertionError("stream ended without a FinishEvent")

    async def _drive(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self.engine.has_work:
                outputs = await anyio.to_thread.run_sync(self.engine.step)
                for out in outputs:
                    self._publish(out.request, out.new_ids)

    def _publish(self, req: Request, new_ids: list[int]) -> None:
        send = self._streams.get(req.id)
        if send is None:
            return
        if new_ids:
            text = self._detok[req.id].delta(
                req.output_ids, final=req.is_finished, cut=req.stop_text_len
            )
            send.send_nowait(TokenEvent(new_ids, text))
        if req.is_finished:
            send.send_nowait(FinishEvent(self.engine.result(req)))
            send.close()


@asynccontextmanager
async def serving(engine: Engine) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine(engine) as aengine:
        yield aengine
