"""Which requests run in the next step: new prompts admitted under limits, beside decoding ones."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from agentflash.engine.kv_cache import KVCache
from agentflash.engine.request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits that keep the engine alive under load."""

    max_running: int = 8  # requests decoding at once (each holds one cache slot)
    max_len: int = 2048  # prompt + output tokens of one request (one cache slot)
    max_prefill_tokens: int = 4096  # prompt tokens admitted together into one forward


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, cache: KVCache):
        self.cfg, self.cache = cfg, cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Request], list[Request]]:
        """This step's newly admitted requests (their prompts) and the requests already decoding.

        Both share the step's one forward. Waiting requests are admitted while slots allow and
        their prompts (packed, so their tokens add up) stay within ``max_prefill_tokens``.
        """
        decoding = list(self.running)
        admitted: list[Request] = []
        tokens = 0
        while self.waiting and self.cache.num_free and len(self.running) < self.cfg.max_running:
            tokens += len(self.waiting[0].prompt_ids)
            if admitted and tokens > self.cfg.max_prefill_tokens:
                break
            req = self.waiting.popleft()
            req.slot = self.cache.allocate()
            req.status = Status.RUNNING
            self.running.append(req)
            admitted.append(req)
        return admitted, decoding

    def finish(self, req: Request) -> None:
        """Free a finished or cancelled request's slot."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.slot is not None:
            self.cache.release(req.slot)
            req.slot = None
        req.status = Status.FINISHED
