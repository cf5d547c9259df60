"""Per segment and per step: speculate with DFlash, or decode one token at a time?

The choice is a cost model fed by what the engine measures while it runs:

- how often a drafted position is accepted, per segment kind and per request: each verified
  draft is a run of accepted positions ended by a rejection (or by the end of the block, which
  says nothing about the next position), so the acceptance rate is ``p = accepted / (accepted +
  rejections)`` over decayed counts, and a block of ``k`` drafts is expected to commit
  ``tau(k) = 1 + p + ... + p^k`` tokens. Short blocks (cut by the room left, or chosen short) do
  not bias ``p`` down the way an average of committed counts would. The request's own counts
  take over from the kind's once it has drafted a few times;
- the wall time of a decode step as a linear function of its shape, fitted online (least squares
  with forgetting, pulled towards a prior): a fixed cost, a cost per verified token, the drafter's
  fixed cost when any row drafts, and a cost per drafted slot.

A step's rows share its time. Drafting a block of ``k`` slots for one row adds
``k * (per token + per slot)`` to the step (the drafter's fixed cost is added once, whatever the
number of rows that draft) and gains that row ``tau - 1`` tokens. Each step drafts for the
most predictable rows up to the count that commits the most tokens per second of step time. So
one request alone speculates when ``tau`` beats the verify-to-plain cost ratio, and in a wide
batch drafts must pay for the time they add to every other row's step. A kind routed to plain
decoding is still probed with DFlash once every ``probe_every`` steps of the engine, by the row
that is cheapest to probe (the least target context waiting to be projected into its drafter), so
that its acceptance estimate follows the text without every request paying for probes.
"""

from __future__ import annotations

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


@dataclass
class Acceptance:
    """Decayed counts of accepted draft positions and of rejections (one per verify that
    rejected a draft token), for one segment kind."""

    accepted: float = 0.0
    rejected: float = 0.0
    steps: int = 0

    def observe(self, accepted: int, drafted: int, keep: float) -> None:
        self.accepted = keep * self.accepted + accepted
        self.rejected = keep * self.rejected + (accepted < drafted)
        self.steps += 1

    @property
    def rate(self) -> float:
        total = self.accepted + self.rejected
        return self.accepted / total if total > 0 else 0.0


def prior_acceptance(tau: float, weight: float = 4.0) -> Acceptance:
    """Counts worth ``weight`` rejections whose rate gives an unbounded block ``tau`` tokens."""
    rate = 1 - 1 / tau  # tau = 1 / (1 - p) for an endless block
    return Acceptance(accepted=weight * rate / (1 - rate), rejected=weight)


def expected_tokens(rate: float, slots: int) -> float:
    """Tokens a step commits, drafts of ``slots`` positions each accepted with ``rate``:
    ``1 + p + ... + p^slots`` (the target's own token always counts)."""
    if rate >= 1.0:
        return slots + 1.0
    return (1 - rate ** (slots + 1)) / (1 - rate)


@dataclass
class RequestRouting:
    """One request's own view: acceptance per kind."""

    acceptance: dict[SegmentKind, Acceptance] = field(default_factory=dict)


@dataclass
class Candidate:
    """A row that may draft this step: its routing state, segment kind and draft length."""

    routing: RequestRouting
    kind: SegmentKind
    slots: int  # draft tokens it would verify (block size - 1)
    forced: bool = False  # the request asked for DFlash: it drafts whatever the cost
    backlog: int = 0  # target positions its drafter has yet to take in (the cost of a probe)


@dataclass
class CostModel:
    """Measured speeds, shared by every request of one engine."""

    keep: float = 0.9  # weight of older acceptance counts per new verify (a request's own: 0.8)
    probe_every: int = 32  # engine steps between DFlash probes of a kind routed to plain
    _since_drafted: dict[SegmentKind, int] = field(default_factory=dict)
    forget: float = 0.97  # weight of older step measurements, per new one
    prior_weight: float = 2.0  # how many steps' worth of evidence the prior cost counts for
    acceptance: dict[SegmentKind, Acceptance] = field(
        default_factory=lambda: {k: prior_acceptance(t) for k, t in PRIOR_TAU.items()}
    )
    _gram: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))
    _moment: np.ndarray = field(default_factory=lambda: np.zeros(4))
    _unit: float | None = None  # seconds of a one-token plain step, from the first measurement
    refit_every: int = 8  # steps between refits of the step-time model (a 4x4 solve)
    _fit: np.ndarray | None = None
    _since_fit: int = 0

    # --- measurements --------------------------------------------------------------------

    def observe_draft(
        self, routing: RequestRouting, kind: SegmentKind, accepted: int, drafted: int
    ) -> None:
        """A verify of ``kind`` accepted ``accepted`` of ``drafted`` draft tokens."""
        self.acceptance.setdefault(kind, prior_acceptance(PRIOR_TAU[kind])).observe(
            accepted, drafted, self.keep
        )
        routing.acceptance.setdefault(kind, Acceptance()).observe(accepted, drafted, 0.8)

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """A decode step of ``shape`` took ``seconds``."""
        x = shape.features()
        if self._unit is None:
            self._unit = seconds / float(PRIOR_COST @ x)
        self._gram = self.forget * self._gram + np.outer(x, x)
        self._moment = self.forget * self._moment + x * seconds
        self._since_fit += 1

    def step_cost(self) -> np.ndarray:
        """Fitted seconds per feature: fixed, per verified token, drafter, per drafted slot."""
        if self._fit is None or self._since_fit >= self.refit_every:
            self._fit, self._since_fit = self._solve(), 0
        return self._fit

    def _solve(self) -> np.ndarray:
        unit = self._unit if self._unit is not None else 1.0
        prior = PRIOR_COST * unit
        # ridge regression towards the prior: the prior counts as ``prior_weight`` steps of
        # evidence per feature, so an unmeasured feature (the drafter, before any row drafted)
        # keeps its prior cost
        reg = self.prior_weight * np.diag([1.0, 16.0**2, 1.0, 16.0**2])
        cost = np.linalg.solve(self._gram + reg, self._moment + reg @ prior)
        return np.maximum(cost, 0.05 * prior)  # noise must not make a feature free

    # --- decisions -------------------------------------------------------------------------

    def acceptance_rate(self, routing: RequestRouting, kind: SegmentKind) -> float:
        """The expected chance that a drafted position of ``kind`` is accepted, for this request."""
        counts = self.acceptance.get(kind)
        shared = (counts or prior_acceptance(PRIOR_TAU[kind])).rate
        own = routing.acceptance.get(kind)
        if own is None:
            return shared
        trust = min(1.0, own.steps / 4)
        return trust * own.rate + (1 - trust) * shared

    def expected_tau(
        self, routing: RequestRouting, kind: SegmentKind, slots: int | None = None
    ) -> float:
        """Tokens a verify step is expected to commit with ``slots`` drafts (None: an endless
        block, capped at 64)."""
        return expected_tokens(self.acceptance_rate(routing, kind), 63 if slots is None else slots)

    def verify_cost_ratio(self, slots: int = 15) -> float:
        """Predicted wall time of a one-row DFlash step of ``slots`` drafts over a plain step."""
        c = self.step_cost()
        plain = c[0] + c[1]
        return (plain + c[2] + slots * (c[1] + c[3])) / plain

    def plan(self, rows: int, candidates: list[Candidate]) -> list[bool]:
        """Which candidates draft this step, in a step of ``rows`` decoding rows.

        Candidates are ranked (those that asked for DFlash, then by expected tau) and the step
        drafts the top ``m`` of them for the ``m`` that commits the most tokens per second of
        step time; the drafter's fixed cost is paid once, by however many rows draft. Kinds left
        out are probed now and then.
        """
        c = self.step_cost()
        taus = [self.expected_tau(x.routing, x.kind, x.slots) for x in candidates]
        order = sorted(range(len(candidates)), key=lambda i: (not candidates[i].forced, -taus[i]))
        must = sum(x.forced for x in candidates)
        seconds, tokens = c[0] + rows * c[1], float(rows)  # every row plain
        best_m, best_rate = 0, tokens / seconds
        for m, i in enumerate(order, start=1):
            x = candidates[i]
            seconds += x.slots * (c[1] + c[3]) + (c[2] if m == 1 else 0.0)
            tokens += taus[i] - 1
            if m <= must or tokens / seconds > best_rate:
                best_m, best_rate = m, tokens / seconds
        chosen = [False] * len(candidates)
        for rank, i in enumerate(order):
            chosen[i] = rank < best_m
        self._probe(candidates, chosen)
        return chosen

    def _probe(self, candidates: list[Candidate], chosen: list[bool]) -> None:
        """Count the step for every kind left undrafted; one whose count reaches
        ``probe_every`` is probed by its cheapest candidate."""
        drafted = {x.kind for x, yes in zip(candidates, chosen) if yes}
        for kind in drafted:
            self._since_drafted[kind] = 0
        waiting: dict[SegmentKind, list[int]] = {}
        for i, x in enumerate(candidates):
            if x.kind not in drafted:
                waiting.setdefault(x.kind, []).append(i)
        for kind, index in waiting.items():
            self._since_drafted[kind] = self._since_drafted.get(kind, 0) + 1
            if self._since_drafted[kind] >= self.probe_every:
                chosen[min(index, key=lambda i: candidates[i].backlog)] = True
                self._since_drafted[kind] = 0

    def block_size(self, routing: RequestRouting, kind: SegmentKind, max_block: int) -> int:
        """Block to draft (the committed token and its drafts, at most ``max_block``): the one
        whose expected tokens per second of a one-row DFlash step are highest. Every slot costs
        verify and draft compute, so blocks are short where drafts fail early."""
        rate = self.acceptance_rate(routing, kind)
        c = self.step_cost()
        fixed, per_slot = c[0] + c[1] + c[2], c[1] + c[3]
        slots = max(
            range(1, max(2, max_block)),
            key=lambda k: expected_tokens(rate, k) / (fixed + k * per_slot),
        )
        return min(max_block, slots + 1)
