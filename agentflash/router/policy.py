"""Per segment and per step: speculate with DFlash, or decode one token at a time?

The choice is a cost model fed by what the engine measures while it runs:

- tau per segment kind and per request (tokens committed per verify step under DFlash), as
  exponential moving averages, the request's own estimate taking over once it has seen a few
  steps of that kind;
- the wall time of a verify step (draft + block forward) and of a plain step, per batch size, as
  moving averages.

DFlash is chosen when ``tau / t_dflash > 1 / t_plain``, i.e. when it commits more tokens per
second. A kind routed to plain decoding is still probed with DFlash now and then, so that its
tau estimate follows the text being written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from agentflash.router.segments import SegmentKind

# Before anything is measured: structured text is predictable, prose less so.
PRIOR_TAU = {
    SegmentKind.TOOL_CALL: 6.0,
    SegmentKind.SCHEMA: 6.0,
    SegmentKind.CODE: 4.0,
    SegmentKind.MATH: 4.0,
    SegmentKind.PROSE: 2.0,
}
PRIOR_VERIFY_COST = (
    1.8  # a 16-token block forward against a one-token forward (measured range 1.5-1.9)
)


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class RequestRouting:
    """One request's own view: tau per kind, and steps since its last DFlash probe."""

    tau: dict[SegmentKind, float] = field(default_factory=dict)
    steps: dict[SegmentKind, int] = field(default_factory=dict)
    since_probe: int = 0


@dataclass
class CostModel:
    """Measured speeds, shared by every request of one engine."""

    alpha: float = 0.2  # weight of a new measurement in the moving averages
    probe_every: int = 16  # plain steps between DFlash probes of a kind routed to plain
    tau: dict[SegmentKind, float] = field(default_factory=lambda: dict(PRIOR_TAU))
    step_time: dict[tuple[str, int], float] = field(default_factory=dict)  # (mode, batch bucket)

    # --- measurements --------------------------------------------------------------------

    def observe_tau(self, routing: RequestRouting, kind: SegmentKind, committed: int) -> None:
        """A DFlash step of ``kind`` committed ``committed`` tokens (accepted + 1)."""
        self.tau[kind] = _ema(self.tau.get(kind), committed, self.alpha)
        routing.tau[kind] = _ema(routing.tau.get(kind), committed, 0.3)
        routing.steps[kind] = routing.steps.get(kind, 0) + 1

    def observe_step(self, mode: str, batch_size: int, seconds: float) -> None:
        key = (mode, _bucket(batch_size))
        self.step_time[key] = _ema(self.step_time.get(key), seconds, self.alpha)

    # --- decisions -------------------------------------------------------------------------

    def expected_tau(self, routing: RequestRouting, kind: SegmentKind) -> float:
        shared = self.tau.get(kind, PRIOR_TAU[kind])
        own, seen = routing.tau.get(kind), routing.steps.get(kind, 0)
        if own is None:
            return shared
        trust = min(1.0, seen / 4)
        return trust * own + (1 - trust) * shared

    def verify_cost_ratio(self, batch_size: int) -> float:
        """Wall time of a DFlash step over a plain step at this batch size."""
        b = _bucket(batch_size)
        spec, plain = self.step_time.get(("dflash", b)), self.step_time.get(("plain", b))
        if spec is None or plain is None:
            return PRIOR_VERIFY_COST
        return spec / plain

    def choose_dflash(self, routing: RequestRouting, kind: SegmentKind, batch_size: int) -> bool:
        if self.expected_tau(routing, kind) > self.verify_cost_ratio(batch_size):
            routing.since_probe = 0
            return True
        routing.since_probe += 1
        # one probe per ``probe_every`` batch steps, whatever the number of requests in the batch
        if routing.since_probe >= self.probe_every * max(1, batch_size):
            routing.since_probe = 0
            return True
        return False

    def block_size(self, routing: RequestRouting, kind: SegmentKind, max_block: int) -> int:
        """Block to draft: about twice the expected tau (short blocks where drafts fail early,
        since every slot costs verify and draft compute), between 4 and ``max_block``."""
        tau = self.expected_tau(routing, kind)
        return max(min(4, max_block), min(max_block, 2 * math.ceil(tau) + 2))


def _bucket(batch_size: int) -> int:
    """Batch sizes grouped by powers of two: 1, 2, 4, 8, ..."""
    return 1 << (max(1, batch_size) - 1).bit_length()
