"""Per segment and per step: speculate with DFlash, or decode one token at a time?

The choice is a cost model fed by what the engine measures while it runs:

- tau per segment kind and per request (tokens committed per verify step under DFlash), as
  exponential moving averages, the request's own estimate taking over once it has seen a few
  steps of that kind;
- the wall time of a decode step as a linear function of its shape, fitted online (least squares
  with forgetting, pulled towards a prior): a fixed cost, a cost per verified token, the drafter's
  fixed cost when any row drafts, and a cost per drafted slot.

A step's rows share its time. Drafting a block of ``k`` slots for one row adds
``k * (per token + per slot)`` to the step (the drafter's fixed cost is added once, whatever the
number of rows that draft) and gains that row ``tau - 1`` tokens. Each step drafts for the
most predictable rows up to the count that commits the most tokens per second of step time. So
one request alone speculates when ``tau`` beats the verify-to-plain cost ratio, and in a wide
batch drafts must pay for the time they add to every other row's step. A kind routed to plain
decoding is still probed with DFlash now and then, so that its tau estimate follows the text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from agentflash.router.segments import SegmentKind

# Before anything is measured: structured text is predictable, prose less so.
PRIOR_TAU = {
    SegmentKind.TOOL_CALL: 6.0,
    SegmentKind.SCHEMA: 6.0,
    SegmentKind.CODE: 4.0,
    SegmentKind.MATH: 4.0,
    SegmentKind.PROSE: 2.0,
}
# Step cost per feature, in units of a one-token plain step (measured on the demo model's CPU:
# a 16-token block forward costs 1.5-1.9 one-token forwards, the drafter about 0.6-1).
PRIOR_COST = np.array([0.9, 0.06, 0.7, 0.03])  # fixed, per verified token, drafter, per slot


@dataclass(frozen=True)
class StepShape:
    """What a decode step computed: the features its wall time is fitted on."""

    tokens: int  # verified tokens over every row (a plain row verifies one)
    drafted_rows: int  # rows the drafter ran for
    draft_slots: int  # drafted slots over those rows

    def features(self) -> np.ndarray:
        return np.array([1.0, self.tokens, float(self.drafted_rows > 0), self.draft_slots])


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class RequestRouting:
    """One request's own view: tau per kind, and steps since its last DFlash probe."""

    tau: dict[SegmentKind, float] = field(default_factory=dict)
    steps: dict[SegmentKind, int] = field(default_factory=dict)
    since_probe: int = 0


@dataclass
class Candidate:
    """A row that may draft this step: its routing state, segment kind and draft length."""

    routing: RequestRouting
    kind: SegmentKind
    slots: int  # draft tokens it would verify (block size - 1)
    forced: bool = False  # the request asked for DFlash: it drafts whatever the cost


@dataclass
class CostModel:
    """Measured speeds, shared by every request of one engine."""

    alpha: float = 0.2  # weight of a new tau measurement in the moving averages
    probe_every: int = 16  # plain steps between DFlash probes of a kind routed to plain
    forget: float = 0.97  # weight of older step measurements, per new one
    prior_weight: float = 2.0  # how many steps' worth of evidence the prior cost counts for
    tau: dict[SegmentKind, float] = field(default_factory=lambda: dict(PRIOR_TAU))
    _gram: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))
    _moment: np.ndarray = field(default_factory=lambda: np.zeros(4))
    _unit: float | None = None  # seconds of a one-token plain step, from the first measurement

    # --- measurements --------------------------------------------------------------------

    def observe_tau(self, routing: RequestRouting, kind: SegmentKind, committed: int) -> None:
        """A DFlash step of ``kind`` committed ``committed`` tokens (accepted + 1)."""
        self.tau[kind] = _ema(self.tau.get(kind), committed, self.alpha)
        routing.tau[kind] = _ema(routing.tau.get(kind), committed, 0.3)
        routing.steps[kind] = routing.steps.get(kind, 0) + 1

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """A decode step of ``shape`` took ``seconds``."""
        x = shape.features()
        if self._unit is None:
            self._unit = seconds / float(PRIOR_COST @ x)
        self._gram = self.forget * self._gram + np.outer(x, x)
        self._moment = self.forget * self._moment + x * seconds

    def step_cost(self) -> np.ndarray:
        """Fitted seconds per feature: fixed, per verified token, drafter, per drafted slot."""
        unit = self._unit if self._unit is not None else 1.0
        prior = PRIOR_COST * unit
        # ridge regression towards the prior: the prior counts as ``prior_weight`` steps of
        # evidence per feature, so an unmeasured feature (the drafter, before any row drafted)
        # keeps its prior cost
        reg = self.prior_weight * np.diag([1.0, 16.0**2, 1.0, 16.0**2])
        cost = np.linalg.solve(self._gram + reg, self._moment + reg @ prior)
        return np.maximum(cost, 0.05 * prior)  # noise must not make a feature free

    # --- decisions -------------------------------------------------------------------------

    def expected_tau(self, routing: RequestRouting, kind: SegmentKind) -> float:
        shared = self.tau.get(kind, PRIOR_TAU[kind])
        own, seen = routing.tau.get(kind), routing.steps.get(kind, 0)
        if own is None:
            return shared
        trust = min(1.0, seen / 4)
        return trust * own + (1 - trust) * shared

    def verify_cost_ratio(self, slots: int = 15) -> float:
        """Predicted wall time of a one-row DFlash step of ``slots`` drafts over a plain step."""
        c = self.step_cost()
        plain = c[0] + c[1]
        return (plain + c[2] + slots * (c[1] + c[3])) / plain

    def plan(self, rows: int, candidates: list[Candidate]) -> list[bool]:
        """Which candidates draft this step, in a step of ``rows`` decoding rows.

        Candidates are ranked (those that asked for DFlash, then by expected tau) and the step
        drafts the top ``m`` of them for the ``m`` that commits the most tokens per second of
        step time; the drafter's fixed cost is paid once, by however many rows draft. A candidate
        left out counts towards its next probe.
        """
        c = self.step_cost()
        taus = [self.expected_tau(x.routing, x.kind) for x in candidates]
        order = sorted(range(len(candidates)), key=lambda i: (not candidates[i].forced, -taus[i]))
        must = sum(x.forced for x in candidates)
        seconds, tokens = c[0] + rows * c[1], float(rows)  # every row plain
        best_m, best_rate = 0, tokens / seconds
        for m, i in enumerate(order, start=1):
            x = candidates[i]
            seconds += x.slots * (c[1] + c[3]) + (c[2] if m == 1 else 0.0)
            tokens += min(taus[i], x.slots + 1) - 1
            if m <= must or tokens / seconds > best_rate:
                best_m, best_rate = m, tokens / seconds
        chosen = [False] * len(candidates)
        for rank, i in enumerate(order):
            x = candidates[i]
            if rank < best_m:
                chosen[i] = True
                x.routing.since_probe = 0
                continue
            x.routing.since_probe += 1
            # one probe per ``probe_every`` steps of the batch, whatever the number of rows
            if x.routing.since_probe >= self.probe_every * max(1, rows):
                chosen[i] = True
                x.routing.since_probe = 0
        return chosen

    def block_size(self, routing: RequestRouting, kind: SegmentKind, max_block: int) -> int:
        """Block to draft: about twice the expected tau (short blocks where drafts fail early,
        since every slot costs verify and draft compute), between 4 and ``max_block``."""
        tau = self.expected_tau(routing, kind)
        return max(min(4, max_block), min(max_block, 2 * math.ceil(tau) + 2))
