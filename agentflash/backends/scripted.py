"""A backend that replays scripted replies, for tests and offline demos of the runtime's logic.

Each reply is Hermes-format text (prose and ``<tool_call>`` blocks); it goes through the same
incremental parser as the embedded engine's output, in small chunks, optionally with a pause
between chunks so that a test can watch tool calls being dispatched while the reply goes on.
"""

from __future__ import annotations

import inspect
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel

from agentflash.backends.base import Backend, ModelEvent, ModelFinish, ModelRequest
from agentflash.backends.local import HermesStreamParser
from agentflash.errors import UserError
from agentflash.tool_format import CLOSE, OPEN


def tool_call_text(name: str, arguments: dict[str, Any] | None = None) -> str:
    """A tool-call block as the chat format writes it."""
    body = json.dumps({"name": name, "arguments": arguments or {}})
    return f"{OPEN}\n{body}\n{CLOSE}"


@dataclass(frozen=True)
class ScriptedTurn:
    """One scripted reply."""

    text: str  # Hermes-format text: prose and tool-call blocks
    finish_reason: str = "stop"
    chunk_size: int = 4  # characters per streamed chunk
    delay_s: float = 0.0  # pause after each chunk
    stats: dict[str, Any] | None = None  # figures to report in place of the replay's own

    @classmethod
    def calls(cls, *calls: tuple[str, dict[str, Any]], text: str = "",
              **options: Any) -> ScriptedTurn:
        """A reply of optional prose followed by tool calls ``(name, arguments)``."""
        return cls(text + "\n".join(tool_call_text(n, a) for n, a in calls), **options)


Reply = ScriptedTurn | str
Script = Sequence[Reply] | Callable[[ModelRequest], Reply | Awaitable[Reply]]


class ScriptedBackend(Backend):
    """Replays ``script``: a list of replies taken in order, or a function (sync or async) from the
    request to the reply, for concurrent runs where the order of requests is not fixed. Every
    request received is kept in ``requests``."""

    model_name = "scripted"

    def __init__(self, script: Script):
        self._script = script
        self._next = iter(script) if not callable(script) else None
        self.requests: list[ModelRequest] = []
        self._turns = itertools.count()

    async def _reply(self, request: ModelRequest) -> ScriptedTurn:
        if self._next is None:
            reply = self._script(request)  # type: ignore[operator]
            if inspect.isawaitable(reply):
                reply = await reply
        else:
            reply = next(self._next, None)
            if reply is None:
                raise UserError(f"the script has no reply left for request {len(self.requests)} "
                                f"({len(self._script)} replies were given)")  # type: ignore[arg-type]
        return ScriptedTurn(reply) if isinstance(reply, str) else reply

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        self.requests.append(request)
        turn = await self._reply(request)
        parser = HermesStreamParser(f"call_{next(self._turns)}")
        started = time.perf_counter()
        chunks = [turn.text[i : i + turn.chunk_size]
                  for i in range(0, len(turn.text), turn.chunk_size)]
        for chunk in chunks:
            for event in parser.feed(chunk):
                yield event
            if turn.delay_s:
                await anyio.sleep(turn.delay_s)
            else:
                await anyio.lowlevel.checkpoint()
        for event in parser.close(turn.finish_reason):
            yield event
        wall = time.perf_counter() - started
        stats = {"mode": "scripted", "prompt_tokens": 0, "new_tokens": len(chunks),
                 "target_forwards": len(chunks), "draft_forwards": 0, "tau": 1.0,
                 "wall_s": round(wall, 4),
                 "tokens_per_s": round(len(chunks) / wall, 2) if wall > 0 else 0.0,
                 "segments": []}
        yield ModelFinish(turn.finish_reason, {**stats, **(turn.stats or {})})
