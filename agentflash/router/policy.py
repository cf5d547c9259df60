"""Per segment and per step: speculate with DFlash, or decode one token at a time?

The choice is a cost model fed by what the engine measures while it runs:

- how often a draft position is accepted, per position, per segment kind and per request: a
  verify reaches position ``j`` when every earlier draft stood, and accepts it or not; the rate
  ``q_j = accepted_j / reached_j`` over decayed counts (a kind's decay per engine step, so
  that a wide step's verifies count alike; a request's per verify), a request's own counts
  shrunk towards its kind's and those towards a prior. A block of ``k`` drafts is expected to commit
  ``tau(k) = 1 + q0 + q0 q1 + ...`` tokens. Blocks cut short (by the room left, or chosen short)
  say nothing of the positions they did not reach, so they do not bias the estimate, and bursty
  text (a tool call that is right once its key is) gets long blocks;
- the wall time of a decode step as a linear function of its shape, fitted online (least squares
  with forgetting, pulled towards a prior; a step counts for at most ``SLOW_STEP_CAP`` times
  its predicted time): a fixed cost, a cost per one-token row, a cost per
  verified token past a row's first, the drafter's fixed cost when any row drafts, a cost per
  block row (a row verifying more than one token) and a cost per drafted slot. One-token rows
  and block rows are priced apart because they cost differently (the one-token rows attend
  together; a block row's attention is its own or shared with blocks of about its length: on the
  demo model's CPU a one-token row adds about 0.05 of a one-row plain step, a block row of 16
  tokens about 1), and because a step's two kinds of row must not be fitted as one: a run of
  steps that draft every row says nothing of what a row decoding plain costs, and a fit that
  shared one cost per row between them priced a 32-row plain step at four times its 6 ms after
  such a run, and never decoded plain to learn better.

A step's rows share its time. Drafting a block of ``k`` slots for one row adds the block row's
cost over a one-token row's and ``k * (per token + per slot)`` to the step (the drafter's fixed
cost is added once, whatever the number of rows that draft) and gains that row ``tau - 1``
tokens, each worth the time a token takes plain in a batch of that many rows (its share of
the fixed cost, and a one-token row's). Each step drafts for the rows whose drafts gain the most
time, up to the count that gains the most. So one request alone speculates when ``tau`` beats
the verify-to-plain cost ratio, and in a wide batch, where a plain token is cheap, drafts must
pay for the time they add to every other row's step. A kind routed to plain decoding is still
probed with DFlash once every ``probe_every`` steps of the engine, by the row that is cheapest
to probe (the least target context waiting to be projected into its drafter), in a step where a
draft could pay at all, so that its acceptance estimate follows the text without every request
paying for probes; the period doubles with each probe after which the kind stays plain. The
counts of a kind decoded plain also age with every step (``age_plain``), so one bad stretch
does not keep a kind plain for the rest of a generation: its estimate drifts back to the prior,
and it drafts again where the prior pays at the current batch.

A row that drafts may verify what its own text suggests instead (``lookup_draft``: what followed
the latest earlier occurrence of its last tokens) when that is expected to commit more per second
than the drafter's block (``lookup_slots``): the drafter has never seen a model loop, a lookup
costs no drafter forward, and its acceptance is tracked per request like the drafter's.
Where the drafter did draft, a lookup that begins with the drafter's first ``AGREEMENT`` tokens
may be verified in place of its block (``agreed_slots``): two guesses that agree are likely on
the text, and code copies names and lines on past where a drafter trained on blocks of 16 can
see. Where the two part within the block, the drafter has said how likely the lookup's token is
there: a lookup whose token it all but rules out (odds under ``FORK_ODDS`` against its own) is
no candidate, and is not counted among the agreements either, so that the rates the choice is
made on are those of the lookups it is made between. Whichever of the two is verified, the
verify's tokens say how far the other would have stood (up to where the verified one failed:
beyond, it is not counted), and the router keeps per kind the per-position rates of both on
such steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
LOOKUP_PRIOR_TAU = 2.0  # a draft looked up in the text, before the request has tried one
# Step cost per feature, in units of a one-row plain step (measured on the demo model's CPU with
# prompts of 20-400 tokens: a one-token row 0.05-0.13, a verified token with its drafted slot
# 0.07, the drafter 0.5). A feature no step measures keeps its prior: one-token rows are priced
# low, as a mistake on that side makes the router decode plain and so measure them.
# fixed, one-token row, verified token past a row's first, drafter, block row, drafted slot
PRIOR_COST = np.array([0.9, 0.05, 0.05, 0.5, 0.1, 0.02])
UNIT_STEPS = 16  # the first decode steps whose median cost puts the prior in seconds
# a measured step counts for at most this many times the time the fit predicts for it: a step
# slowed by another process (a helper saw 3.7-20.7 ms, twice over 500 ms, for steps of about
# 5 ms) must not price the features of the steps that burst happened to take (a burst on steps
# that draft routed a kind plain, and it drafted again only when probed). A step truly dearer
# than predicted still moves the fit up, by up to this factor each time
SLOW_STEP_CAP = 3.0
COST_SCALE = np.array([1.0, 8.0, 16.0, 1.0, 4.0, 16.0])  # a feature's typical size, for the ridge


@dataclass(frozen=True)
class StepShape:
    """What a decode step computed: the features its wall time is fitted on."""

    rows: int  # decoding rows
    tokens: int  # verified tokens over every row (a plain row verifies one)
    block_rows: int  # rows that verify more than one token (a draft, a forced run)
    drafted_rows: int  # rows the drafter ran for
    draft_slots: int  # drafted slots over those rows

    def features(self) -> np.ndarray:
        return np.array(
            [
                1.0,
                self.rows - self.block_rows,
                self.tokens - self.rows,
                float(self.drafted_rows > 0),
                self.block_rows,
                self.draft_slots,
            ]
        )


MAX_SLOTS = 64  # the longest block a request may ask for
AGREEMENT = 2  # leading tokens a lookup shares with the drafter's block to stand in for it
# where an agreeing lookup and the drafter's block part, the least odds the drafter gives the
# lookup's token against its own for the lookup to be a candidate (``fork_odds``). Simulated
# greedy, 16 prompts a kind of another seed than the bench's, verifying the lookup at every
# agreement -> only at odds from 0.05: code tau 5.71 -> 5.78, prose 4.83 -> 4.95, tool calls
# 7.16 -> 7.54 (at 0.02: 5.73, 4.96, 7.49; at 0.3: 5.62, 4.95, 7.63). In the engine, side by
# side on the bench's prompts (16 a suite, 256 tokens): tool calls 7.97-8.23 -> 8.32-8.51,
# prose 3.95-3.96 -> 4.02-4.06, code 5.77-5.78 -> 5.80-5.81 (and in one pass 5.68 -> 5.54:
# the router's choices follow its timings), constrained tool calls and JSON unchanged
FORK_ODDS = 0.05


class Acceptance:
    """Decayed counts, per draft position ``j``, of verifies that reached it (every earlier draft
    accepted, the draft at least ``j + 1`` long) and of those that accepted it, for one segment
    kind. Acceptance is tracked per position because structured text is bursty: once a tool
    call's key is right, the rest of it usually is too, which one rate for every position would
    not capture. Drafts cut short say nothing of the positions they did not reach."""

    def __init__(self) -> None:
        self.reached = np.zeros(MAX_SLOTS)
        self.accepted = np.zeros(MAX_SLOTS)
        self.steps = 0
        self._step: int | None = None  # the engine step of the last verify counted

    def observe(self, accepted: int, drafted: int, keep: float, step: int | None = None) -> None:
        """Count a verify; older counts keep ``keep`` of their weight per verify, or, given the
        engine ``step``, per step (the verifies of one step count alike)."""
        reached = min(accepted + 1, drafted)  # positions 0..accepted (the rejected one included)
        if step is None or self._step is None or step != self._step:
            factor = keep if step is None or self._step is None else keep ** (step - self._step)
            self.reached *= factor
            self.accepted *= factor
            self._step = step
        self.reached[:reached] += 1
        self.accepted[:accepted] += 1
        self.steps += 1

    def age(self, keep: float) -> None:
        """Discount the counts without a new verify (a step decoded plain): the text moves on,
        and the estimate drifts back towards the prior it is shrunk to."""
        self.reached *= keep
        self.accepted *= keep
        self.steps += 1  # the rates changed: what was derived from them is stale

    def rates(self, prior: np.ndarray, weight: float) -> np.ndarray:
        """Per-position acceptance, these counts shrunk towards ``prior`` (worth ``weight``
        verifies at each position)."""
        return (self.accepted + weight * prior) / (self.reached + weight)

    def chained_rates(self, first: float, weight: float) -> np.ndarray:
        """Per-position acceptance with each position's counts shrunk towards the rate of the
        position before it (the first position's towards ``first``, each worth ``weight``
        verifies): a position no verify has reached is as likely as the deepest one reached.
        For drafts as long as these rates make them (a lookup), a flat prior would hold every
        position past the longest draft tried at the prior, and the drafts short however often
        they stand whole."""
        out = np.empty(MAX_SLOTS)
        reached = np.flatnonzero(self.reached > 0)
        deepest = int(reached[-1]) + 1 if reached.size else 0
        rate = first
        for j in range(deepest):
            rate = (self.accepted[j] + weight * rate) / (self.reached[j] + weight)
            out[j] = rate
        out[deepest:] = rate
        return out


def fork_odds(block: list[int], lookup: list[int], logits) -> float:
    """Odds the drafter gives the lookup's token against the block's own where the two first
    differ (``logits`` [slots, V]: the drafter's, slot ``k`` proposing the block's ``k``-th
    token); infinite where they do not differ within the block, or past the slots' logits (a
    forced run: the drafter did not choose there)."""
    fork = matched(block, lookup)
    if fork >= min(len(block), len(lookup), logits.shape[0]):
        return math.inf
    row = logits[fork]
    return math.exp(min(float(row[lookup[fork]] - row[block[fork]]), 50.0))


def matched(draft: list[int], truth: list[int]) -> int:
    """Leading tokens of ``draft`` equal to ``truth``'s."""
    n = 0
    for a, b in zip(draft, truth):
        if a != b:
            break
        n += 1
    return n


def prior_rates(tau: float) -> np.ndarray:
    """Per-position rates of a kind before any measurement: one rate ``p`` everywhere, with
    ``tau = 1 / (1 - p)`` tokens for an endless block."""
    return np.full(MAX_SLOTS, 1 - 1 / tau)


@dataclass
class RequestRouting:
    """One request's own view: acceptance per kind."""

    acceptance: dict[SegmentKind, Acceptance] = field(default_factory=dict)
    lookup: Acceptance = field(default_factory=lambda: Acceptance())  # its text looked up in itself
    # what the router derived from the counts, kept until they change (it asks every step)
    cache: dict[tuple, tuple] = field(default_factory=dict)


@dataclass
class Candidate:
    """A row that may draft this step: its routing state, segment kind and draft length."""

    routing: RequestRouting
    kind: SegmentKind
    slots: int  # draft tokens it would verify (block size - 1)
    forced: bool = False  # the request asked for DFlash: it drafts whatever the cost
    backlog: int = 0  # target positions its drafter has yet to take in (the cost of a probe)
    lookup: int = 0  # tokens its own text offers as a draft this step (``lookup_draft``)


def priors_from_validation(val_tau: dict[str, float]) -> dict[SegmentKind, float]:
    """Starting tau per segment kind from a drafter's validation tau per kind of text
    (``tool_call``, ``code``, ``math``, ``prose``; schema-bound answers are JSON like tool calls).
    Kinds it does not name keep ``PRIOR_TAU``."""
    out = {}
    for kind in SegmentKind:
        name = "tool_call" if kind is SegmentKind.SCHEMA else kind.value
        if name in val_tau:
            out[kind] = min(max(float(val_tau[name]), 1.0), float(MAX_SLOTS))
    return out


@dataclass
class CostModel:
    """Measured speeds, shared by every request of one engine."""

    # tau per kind before any measurement (a drafter's own validation tau, where it has one)
    prior_tau: dict[SegmentKind, float] = field(default_factory=lambda: dict(PRIOR_TAU))

    keep: float = 0.9  # weight of a kind's older acceptance counts per engine step with verifies
    # of it (a request's own: 0.8 per verify)
    _steps: int = 0  # engine steps begun (``begin_step``)
    probe_every: int = 32  # engine steps between DFlash probes of a kind routed to plain...
    max_probe_every: int = 256  # ...doubling after each probe that left it plain, up to this
    age_plain: float = 0.97  # weight kept by a kind's acceptance counts per step it decodes plain
    age_every: int = 8  # ...applied every this many steps
    _since_drafted: dict[SegmentKind, int] = field(default_factory=dict)
    _probe_interval: dict[SegmentKind, int] = field(default_factory=dict)
    forget: float = 0.97  # weight of older step measurements, per new one
    prior_weight: float = 2.0  # how many steps' worth of evidence the prior cost counts for
    acceptance: dict[SegmentKind, Acceptance] = field(default_factory=dict)
    rate_prior_weight: float = 4.0  # verifies' worth of the prior, per position
    request_weight: float = 4.0  # verifies' worth of the kind's rates in a request's own
    _gram: np.ndarray = field(default_factory=lambda: np.zeros((6, 6)))
    _moment: np.ndarray = field(default_factory=lambda: np.zeros(6))
    _unit: float | None = None  # seconds of a one-token plain step: ``_first_ratios``' median
    # the first UNIT_STEPS steps' seconds over their prior cost in units: their median scales
    # the prior, not the first step's alone (a first step slowed by another process scaled it
    # 20-40x; kinds routed plain then priced the drafter at that prior, and probes never paid:
    # at one stream of the mixed workload the router decoded 70-100% plain, 2.1x slower)
    _first_ratios: list[float] = field(default_factory=list)
    refit_every: int = 8  # steps between refits of the step-time model (a 6x6 solve)
    _fit: np.ndarray | None = None
    _fits: int = 0
    _since_fit: int = 0
    # what was derived for requests with no counts of their own for a kind: the same for all
    _derived: dict[tuple, tuple] = field(default_factory=dict)
    # per kind, on steps where a lookup agreed with the drafter's block: (the lookup's counts,
    # the block's), each counted whichever of the two was verified (``observe_agreement``)
    agreed: dict[SegmentKind, tuple[Acceptance, Acceptance]] = field(default_factory=dict)

    # --- measurements --------------------------------------------------------------------

    def observe_draft(
        self, routing: RequestRouting, kind: SegmentKind, accepted: int, drafted: int
    ) -> None:
        """A verify of ``kind`` accepted ``accepted`` of ``drafted`` draft tokens."""
        # a kind's counts age per engine step: with many rows a step brings many verifies,
        # and aged per verify the counts held little more than the last step's (at the end of
        # a run, its slowest requests': the hardest text set every new request's estimate)
        self.acceptance.setdefault(kind, Acceptance()).observe(
            accepted, drafted, self.keep, self._steps
        )
        routing.acceptance.setdefault(kind, Acceptance()).observe(accepted, drafted, 0.8)

    def begin_step(self) -> None:
        """The engine begins a step: the verifies counted from now on are one step newer."""
        self._steps += 1

    def observe_lookup(self, routing: RequestRouting, accepted: int, drafted: int) -> None:
        """A verify of a draft looked up in the request's own text accepted ``accepted``."""
        routing.lookup.observe(accepted, drafted, 0.8)

    def _lookup_tau(self, routing: RequestRouting, slots: int) -> float:
        """Tokens a verify of ``slots`` tokens looked up in the request's text is expected to
        commit, once the request has tried it (0 before: the prior alone must not make rows
        draft)."""
        if routing.lookup.steps == 0:
            return 0.0
        return float(self._lookup_tokens(routing)[min(slots, MAX_SLOTS) - 1])

    def _lookup_tokens(self, routing: RequestRouting) -> np.ndarray:
        """[MAX_SLOTS]: entry ``k - 1`` is the expected tau of ``k`` looked-up tokens, cached
        until the request's lookup counts change (the plan and the lookup ask every step)."""
        hit = routing.cache.get(("lookup",))
        if hit is not None and hit[0] == routing.lookup.steps:
            return hit[1]
        rates = routing.lookup.chained_rates(1 - 1 / LOOKUP_PRIOR_TAU, self.request_weight)
        tokens = 1.0 + np.cumprod(rates).cumsum()
        routing.cache[("lookup",)] = (routing.lookup.steps, tokens)
        return tokens

    def lookup_slots(
        self, routing: RequestRouting, kind: SegmentKind, slots: int, found: int
    ) -> int:
        """How many of the ``found`` tokens the request's own text suggests a row should verify
        instead of the drafter's ``slots``: the count with the most expected tokens per second
        of a one-row step (a lookup costs no drafter forward), or 0 where the drafter's draft is
        expected to do better. The lookup starts from a prior of one token in two (tau 2), so
        the drafter keeps a row until its drafts fail where the text repeats itself."""
        if found == 0 or slots == 0:
            return 0
        c = self.step_cost()
        # kept until the counts or the fit change: every row of every step asks (``_lookups``),
        # and the rows that share their counts (none of their own) share the answer
        key = ("lookup_slots", kind, slots, min(found, MAX_SLOTS))
        version = (self._version(routing, kind), routing.lookup.steps, self._fits)
        cache = self._derived_for(routing, kind) if not routing.lookup.steps else routing.cache
        hit = cache.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        fixed, _, token, drafter, block, slot = c
        tokens = self._lookup_tokens(routing)[: min(found, MAX_SLOTS)]  # k looked up: [k-1]
        cost = fixed + block + token * np.arange(1, len(tokens) + 1)
        best = int(np.argmax(tokens / cost))
        drafted = self.expected_tau(routing, kind, slots) / (
            fixed + block + drafter + slots * (token + slot)
        )
        take = best + 1 if tokens[best] / cost[best] > drafted else 0
        cache[key] = (version, take)
        return take

    def observe_agreement(
        self, kind: SegmentKind, verified: list[int], accepted: int, target_next: int,
        rival: list[int], lookup_verified: bool,
    ) -> None:
        """A verify of ``verified`` (a lookup if ``lookup_verified``, else the drafter's block)
        accepted ``accepted`` tokens, then the target chose ``target_next``; ``rival`` is the
        other draft, which agreed with it on its first tokens. The target's tokens are known up
        to its choice: the rival is counted up to where it leaves them, or, where it follows
        them to their end, as a draft cut there (the positions after say nothing)."""
        lookup, block = self.agreed.setdefault(kind, (Acceptance(), Acceptance()))
        ours, theirs = (lookup, block) if lookup_verified else (block, lookup)
        ours.observe(accepted, len(verified), self.keep, self._steps)
        truth = [*verified[:accepted], target_next]
        stood = matched(rival, truth)
        known = stood < len(rival) and stood < len(truth)  # it left the target's tokens here
        theirs.observe(stood, len(rival) if known else stood, self.keep, self._steps)

    def agreed_slots(
        self, routing: RequestRouting, kind: SegmentKind, slots: int, found: int
    ) -> int:
        """How many of ``found`` looked-up tokens that agree with the drafter's ``slots`` drafts
        a row should verify in their place: the count with the most expected tokens per second
        of a one-row step, or 0 where the drafts are expected to do as well. The drafter has run
        either way. The block is priced at its rates for this request shrunk towards what such
        steps of the kind have shown, the lookup at those steps' rates of it, each position's
        shrunk towards the one before (the positions past the deepest one seen at the
        deepest one's rate); with nothing seen, the drafter's block is kept."""
        if found == 0 or slots == 0:
            return 0
        base = self.acceptance_rates(routing, kind)
        lookup, block = self.agreed.get(kind, (None, None))
        if lookup is None or block is None:
            return 0  # nothing seen yet: the lookups are counted from the drafter's verifies
        drafter_rates = block.rates(base, self.rate_prior_weight)
        lookup_rates = lookup.chained_rates(float(base[0]), self.rate_prior_weight)
        fixed, _, token, drafter, block_row, slot = self.step_cost()
        paid = fixed + block_row + drafter + slots * slot  # the drafter ran for this row
        tokens = (1.0 + np.cumprod(lookup_rates).cumsum())[: min(found, MAX_SLOTS)]
        rate = tokens / (paid + token * np.arange(1, len(tokens) + 1))
        best = int(np.argmax(rate))
        kept = (1.0 + np.cumprod(drafter_rates).cumsum())[slots - 1] / (paid + token * slots)
        return best + 1 if rate[best] > kept else 0

    def observe_step(self, shape: StepShape, seconds: float) -> None:
        """A decode step of ``shape`` took ``seconds``."""
        x = shape.features()
        if len(self._first_ratios) < UNIT_STEPS:
            self._first_ratios.append(seconds / float(PRIOR_COST @ x))
            self._unit = float(np.median(self._first_ratios))
            self._fit = None  # refit at the next question: the prior's scale moved
        seconds = min(seconds, SLOW_STEP_CAP * self.decode_seconds(shape))
        self._gram = self.forget * self._gram + np.outer(x, x)
        self._moment = self.forget * self._moment + x * seconds
        self._since_fit += 1

    def decode_seconds(self, shape: StepShape) -> float:
        """Predicted wall time of a decode step of ``shape``."""
        return float(self.step_cost() @ shape.features())

    @property
    def is_measured(self) -> bool:
        """Whether a decode step has been measured (the costs have a unit in seconds)."""
        return self._unit is not None

    def step_cost(self) -> np.ndarray:
        """Fitted seconds per feature: fixed, per one-token row, per verified token past a row's
        first, drafter, per block row, per drafted slot."""
        if self._fit is None or self._since_fit >= self.refit_every:
            self._fit, self._since_fit = self._solve(), 0
            self._fits += 1
        return self._fit

    def _solve(self) -> np.ndarray:
        unit = self._unit if self._unit is not None else 1.0
        prior = PRIOR_COST * unit
        # ridge regression towards the prior: the prior counts as ``prior_weight`` steps of
        # evidence per feature, so an unmeasured feature (the drafter, before any row drafted)
        # keeps its prior cost
        reg = self.prior_weight * np.diag(COST_SCALE**2)
        cost = np.linalg.solve(self._gram + reg, self._moment + reg @ prior)
        return np.maximum(cost, 0.05 * prior)  # noise must not make a feature free

    # --- decisions -------------------------------------------------------------------------

    def _version(self, routing: RequestRouting, kind: SegmentKind) -> tuple[int, int]:
        shared, own = self.acceptance.get(kind), routing.acceptance.get(kind)
        return (shared.steps if shared else -1, own.steps if own else -1)

    def _derived_for(self, routing: RequestRouting, kind: SegmentKind) -> dict[tuple, tuple]:
        """Where what is derived from the counts of ``kind`` is kept: the request's own cache,
        or, while it has no counts of its own for the kind, one shared by all such requests
        (for them it is the same: a step of many plain rows derives it once, not once a row)."""
        return routing.cache if kind in routing.acceptance else self._derived

    def _tokens_by_slots(self, routing: RequestRouting, kind: SegmentKind) -> np.ndarray:
        """[MAX_SLOTS]: entry ``k - 1`` is ``tau(k)``, cached until the counts change."""
        version = self._version(routing, kind)
        cache = self._derived_for(routing, kind)
        hit = cache.get(("tau", kind))
        if hit is not None and hit[0] == version:
            return hit[1]
        tokens = 1.0 + np.cumprod(self.acceptance_rates(routing, kind)).cumsum()
        cache[("tau", kind)] = (version, tokens)
        return tokens

    def acceptance_rates(self, routing: RequestRouting, kind: SegmentKind) -> np.ndarray:
        """Per-position chance that a draft of ``kind`` stands, for this request: its own counts
        shrunk towards the kind's, which are shrunk towards the prior."""
        rates = prior_rates(self.prior_tau[kind])
        shared = self.acceptance.get(kind)
        if shared is not None:
            rates = shared.rates(rates, self.rate_prior_weight)
        own = routing.acceptance.get(kind)
        if own is not None:
            rates = own.rates(rates, self.request_weight)
        return rates

    def expected_tau(
        self, routing: RequestRouting, kind: SegmentKind, slots: int | None = None
    ) -> float:
        """Tokens a verify step is expected to commit with ``slots`` drafts (None: the longest
        block)."""
        return float(self._tokens_by_slots(routing, kind)[min(slots or MAX_SLOTS, MAX_SLOTS) - 1])

    def verify_cost_ratio(self, slots: int = 15) -> float:
        """Predicted wall time of a one-row DFlash step of ``slots`` drafts over a plain step."""
        fixed, single, token, drafter, block, slot = self.step_cost()
        return (fixed + block + drafter + slots * (token + slot)) / (fixed + single)

    def plan(self, rows: int, candidates: list[Candidate]) -> list[bool]:
        """Which candidates draft this step, in a step of ``rows`` decoding rows.

        A token is worth the time it takes plain in a batch of ``rows``: its share of a step's
        fixed cost and a one-token row (``worth``). Drafting a candidate gains it ``tau - 1``
        tokens for the time its block adds to the step (its expected tau: the drafter's, or the
        lookup's where the request's text offers one this step that it would verify,
        ``lookup_slots``, for a row of the lookup's length; a record of loops earlier in the
        text priced every later step, where the drafter's blocks failed with no lookup to be
        found); the drafter's fixed cost is paid once, by however many rows draft with it, and
        by none that verify a lookup. The rows that asked for DFlash draft; of the rest, with
        the drafter launched every row that gains drafts, without it every lookup that gains:
        the step takes whichever saves more. Pricing a token by the batch, not by the step's
        own tokens per second, is what a batch that keeps its rows costs: each row holds its
        place for as many steps as it takes, so a row left plain beside rows that draft costs
        the batch its steps, however fast those others make the step (the demo model,
        ``agentflash bench --concurrency 8,32 --suites mixed --rounds 6``, router over the
        better fixed mode, median of the rounds: 0.89 -> 0.96 at 8 streams, 0.93 -> 0.94 at
        32). A prompt prefilled in the step changes nothing here: it costs the same with or
        without a draft. Kinds left out are probed now and then.
        """
        fixed, single, token, drafter, block, slot = self.step_cost()
        worth = fixed / max(rows, 1) + single  # seconds a token takes plain in this batch

        def gain(x: Candidate, tau: float) -> float:
            """Seconds drafting ``x`` saves the batch (the drafter's launch aside)."""
            return (tau - 1) * worth - (block - single + x.slots * (token + slot))

        def priced(x: Candidate) -> tuple[float, bool]:
            """``gain``, and whether the row needs the drafter's forward: not where the engine
            verifies the lookup its text offers instead, whose verify row is as long as the
            lookup (it was charged as the drafter's block: a 40-token lookup as 3 slots, chosen
            at a loss in wide steps) and which no drafter slot costs."""
            looked_up = self.lookup_slots(x.routing, x.kind, x.slots, x.lookup)
            # a lookup the request has not tried is priced as the drafter's block: its prior
            # alone must not decide (``_lookup_tau``), and priced at none it left the row plain
            # for good, never tried (a JSON answer's tau 7.6 -> 3.6 under the router)
            if not looked_up or not x.routing.lookup.steps:
                return gain(x, self.expected_tau(x.routing, x.kind, x.slots)), True
            tau = self._lookup_tau(x.routing, looked_up)
            return (tau - 1) * worth - (block - single + looked_up * token), False

        gains, launches = zip(*map(priced, candidates)) if candidates else ((), ())

        def net(rows: list[int]) -> float:
            """What drafting ``rows`` saves: their gains, less the drafter's fixed cost, once,
            if any of them drafts with it."""
            return sum(gains[i] for i in rows) - drafter * any(launches[i] for i in rows)

        forced = [i for i, x in enumerate(candidates) if x.forced]
        paying = [i for i, x in enumerate(candidates) if not x.forced and gains[i] > 0]
        # with the drafter launched, every row that pays drafts; without, only lookups (a
        # drafter row ranked first took its launch into every choice that held a lookup row)
        options = [forced, forced + [i for i in paying if not launches[i]], forced + paying]
        drafts = set(max(options, key=net))  # (a tie: the fewest rows)
        chosen = [i in drafts for i in range(len(candidates))]
        launched = any(launches[i] for i in drafts)

        def could_pay(x: Candidate) -> bool:
            """Whether drafting ``x`` would pay in this step if every draft stood (the drafter's
            launch paid already where a row drafts with it: a lookup row launches none)."""
            return gain(x, x.slots + 1) > drafter * (not launched)

        self._probe(candidates, chosen, could_pay)
        return chosen

    def _probe(
        self,
        candidates: list[Candidate],
        chosen: list[bool],
        could_pay: Callable[[Candidate], bool],
    ) -> None:
        """Count the step for every kind left undrafted; one whose count reaches its interval
        is probed by its cheapest candidate, in the first step where a draft could pay at all
        (``could_pay``: were every draft to stand; in a wide step of one-token rows none can,
        and what a probe would learn could not change the plan). The interval starts at
        ``probe_every`` and doubles with every probe after which the kind stayed plain (up to
        ``max_probe_every``): a probe costs a drafted step, and a kind that keeps losing needs
        fewer of them."""
        drafted = {x.kind for x, yes in zip(candidates, chosen) if yes}
        for kind in drafted:  # fresh counts: no probe needed for a while
            self._since_drafted[kind] = 0
        # the back-off resets where the plan chose to draft a kind, not where requests that
        # asked for DFlash drafted it whatever it costs (their counts can still make it pay)
        for kind in {x.kind for x, yes in zip(candidates, chosen) if yes and not x.forced}:
            self._probe_interval[kind] = self.probe_every
        waiting: dict[SegmentKind, list[int]] = {}
        for i, x in enumerate(candidates):
            if x.kind not in drafted:
                waiting.setdefault(x.kind, []).append(i)
        for kind, index in waiting.items():
            self._since_drafted[kind] = self._since_drafted.get(kind, 0) + 1
            if self._since_drafted[kind] % self.age_every == 0:  # a few steps' ageing at once:
                # ageing makes every row's estimates stale, and they are not free to redo
                for acceptance in [self.acceptance.get(kind)] + [
                    candidates[i].routing.acceptance.get(kind) for i in index
                ]:
                    if acceptance is not None:
                        acceptance.age(self.age_plain**self.age_every)
            interval = self._probe_interval.get(kind, self.probe_every)
            if self._since_drafted[kind] >= interval:
                probe = min(index, key=lambda i: candidates[i].backlog)
                if not could_pay(candidates[probe]):
                    continue  # due, and probed once the step is narrow enough to gain
                chosen[probe] = True
                self._since_drafted[kind] = 0
                self._probe_interval[kind] = min(2 * interval, self.max_probe_every)

    def block_size(self, routing: RequestRouting, kind: SegmentKind, max_block: int) -> int:
        """Block to draft (the committed token and its drafts, at most ``max_block``): the one
        whose expected tokens per second of a one-row DFlash step are highest. Every slot costs
        verify and draft compute, so blocks are short where drafts fail early."""
        c = self.step_cost()
        key = ("block", kind, max_block)
        version = (self._version(routing, kind), self._fits)
        cache = self._derived_for(routing, kind)
        hit = cache.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        fixed, _, token, drafter, block, slot = c
        fixed, per_slot = fixed + block + drafter, token + slot
        tokens = self._tokens_by_slots(routing, kind)[: max(1, max_block - 1)]  # k drafts: [k-1]
        slots = 1 + int(np.argmax(tokens / (fixed + per_slot * np.arange(1, len(tokens) + 1))))
        size = min(max_block, slots + 1)
        cache[key] = (version, size)
        return size
