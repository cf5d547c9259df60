"""The segment router: kinds switch inside one generation, the cost model decides per step,
and per-request overrides are obeyed."""

import json
import math

import numpy as np
import pytest
import torch
from conftest import tiny_dflash_engine

from agentflash.engine.request import SamplingParams
from agentflash.router.policy import (
    Acceptance,
    Candidate,
    CostModel,
    RequestRouting,
    StepShape,
    fork_odds,
)
from agentflash.router.segments import SegmentKind, SegmentTracker


def kinds_along(pieces):
    tracker = SegmentTracker()
    seen = []
    for piece in pieces:
        seen.append(tracker.kind)
        tracker.feed(piece)
    return seen + [tracker.kind]


def test_segments_switch_at_their_boundaries():
    pieces = [
        "Let me check.",
        "\n",
        "<tool_call>",
        '\n{"name": "f",',
        ' "arguments": {}}\n',
        "</tool_call>",
        "Here",
        " is code:\n``",
        "`python\n",
        "x = 1\n",
        "``",
        "`\n",
        "Total: 12 ",
        "* 3",
        " = 36",
        "\n",
        "Done.",
    ]
    k = kinds_along(pieces)
    P, T, C, M = SegmentKind.PROSE, SegmentKind.TOOL_CALL, SegmentKind.CODE, SegmentKind.MATH
    assert k == [P, P, P, T, T, T, P, P, P, C, C, C, P, P, M, M, P, P]


def test_a_fence_inside_a_tool_calls_json_opens_no_code_block():
    pieces = ["<tool_call>", '\n{"name": "run", "arguments": {"code": "``', '`"}}\n',
              "</tool_call>", "\nThe weather is nice."]
    k = kinds_along(pieces)
    P, T = SegmentKind.PROSE, SegmentKind.TOOL_CALL
    assert k == [P, T, T, T, P, P]


@pytest.mark.parametrize(
    ("pieces", "kinds"),
    [  # backticks inside a line are inline code: all of the rest was counted as code
     (["Use ``` to open a block.\n", "Then prose.\n"], "PPP"),
     (["The ```x``` here and ``` there.\n", "prose\n"], "PPP"),
     (["```python\n", "x = 1\n", "```\n", "prose"], "PCCPP"),
     (["~~", "~python\n", "x = 1\n", "~~~\n", "prose"], "PPCCPP"),  # a tilde fence: unseen
     # a longer fence holds a shorter one: the inner code was prose, the text after it code
     (["````md\n", "```python\n", "x = 1\n", "```\n", "````\n", "prose"], "PCCCCPP"),
     (["   ```\n", "x\n", "    ```\n", "```  \n", "p"], "PCCCPP"),  # 4 spaces: no fence
     (["```\n", "~~~\n", "``` no\n", "``", "`", "\n", "p"], "PCCCCPPP"),  # only "```" closes
     (["```js\n", "x\n", "```", " not yet\n", "```\n"], "PCCPCP"),
     (["text </tool_call>```\n", "more"], "PPP"),
     (["```\r\n", "x = 1\r\n", "```\r\n", "prose"], "PCCPP"),  # CRLF: it never closed
    ],
)
def test_a_code_fence_is_a_line_of_its_own(pieces, kinds):
    names = {"P": SegmentKind.PROSE, "C": SegmentKind.CODE}
    assert kinds_along(pieces) == [names[k] for k in kinds]


def test_a_long_line_is_searched_for_a_calculation_once_not_at_every_step(monkeypatch):
    # every step searched the whole line so far: a line of 120,000 characters took 13 s
    import agentflash.router.segments as segments

    scanned = []

    class Counting:
        def search(self, text, pos=0):
            scanned.append(len(text) - pos)
            return real.search(text, pos)

    real = segments._MATH_DENSE
    monkeypatch.setattr(segments, "_MATH_DENSE", Counting())
    tracker = SegmentTracker()
    n = 5000
    for _ in range(n):
        tracker.feed("w ")
        assert tracker.kind is SegmentKind.PROSE
    tracker.feed("so 12 * 3 = 36")
    assert tracker.kind is SegmentKind.MATH
    assert sum(scanned) < 100 * n
    tracker.feed(" and on\n")
    assert tracker.kind is SegmentKind.PROSE


def test_a_calculation_is_seen_as_the_whole_lines_search_sees_it():
    import random

    from agentflash.router.segments import _MATH_LINE

    rng = random.Random(0)
    alphabet = ["1", "23", " ", "   ", " " * 70, "\t", "+", "*", "÷", "(", "a", "x = ", "-"]
    for _ in range(300):
        tracker, line = SegmentTracker(), ""
        for _ in range(rng.randrange(1, 12)):
            piece = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4)))
            tracker.feed(piece)
            line += piece
            math = _MATH_LINE.search(line) is not None
            assert (tracker.kind is SegmentKind.MATH) == math, repr(line)
    for pieces in (["12 +", " " * 70, "3"], ["12", *[" "] * 70, "+3"]):  # blanks of any length
        tracker = SegmentTracker()
        for piece in pieces:
            tracker.feed(piece)
        assert tracker.kind is SegmentKind.MATH, pieces


def test_a_calculation_inside_a_call_ends_with_it():
    # the call's JSON held a date: the prose after it on its line was counted as math
    P, T, M = SegmentKind.PROSE, SegmentKind.TOOL_CALL, SegmentKind.MATH
    call = '<tool_call>{"name": "book", "arguments": {"date": "2024-05-01"}}'
    assert kinds_along([call, "</tool_call>", " I have booked it", " for 2 + 2", "\n"]) == [
        P, T, P, P, M, P]
    assert kinds_along(["12 *", " 3 <tool_call>", "{}", "</tool_call>", " then"]) == [
        P, P, T, T, P, P]


def test_schema_bound_reply_is_one_schema_segment():
    tracker = SegmentTracker(schema_bound=True)
    tracker.feed('{"a": 1 + 2}')
    assert tracker.kind is SegmentKind.SCHEMA


def test_recorded_segments_merge_same_kind_and_mode():
    tracker = SegmentTracker()
    tracker.record(SegmentKind.PROSE, "plain", 1, 0)
    tracker.record(SegmentKind.PROSE, "plain", 1, 1)
    tracker.record(SegmentKind.TOOL_CALL, "dflash", 9, 1)
    tracker.record(SegmentKind.TOOL_CALL, "dflash", 7, 1, drafted=15, accepted=6, forced=4)
    assert [s.to_dict() for s in tracker.segments] == [
        {"kind": "prose", "mode": "plain", "tokens": 2, "target_forwards": 1, "tau": 2.0,
         "drafted": 0, "accepted": 0, "forced": 0},
        {"kind": "tool_call", "mode": "dflash", "tokens": 16, "target_forwards": 2, "tau": 8.0,
         "drafted": 15, "accepted": 6, "forced": 4},
    ]


def test_the_prompt_steps_tokens_join_the_next_steps_segment_in_its_mode():
    # the first token and a forced opening come with the prompt's forward, drafted by nothing
    tracker = SegmentTracker()
    tracker.record(SegmentKind.PROSE, "plain", 1, 0)
    tracker.record(SegmentKind.PROSE, "dflash", 5, 1, drafted=7, accepted=4)
    tracker.record(SegmentKind.PROSE, "plain", 1, 1)
    assert [(s.mode, s.tokens, s.target_forwards) for s in tracker.segments] == [
        ("dflash", 6, 1), ("plain", 1, 1)]
    alone = SegmentTracker()  # a reply that ended at the prompt's step: plain
    alone.record(SegmentKind.TOOL_CALL, "plain", 3, 0, forced=3, accepted=3)
    alone.record(SegmentKind.PROSE, "dflash", 4, 1)
    assert [(s.kind.value, s.mode) for s in alone.segments] == [
        ("tool_call", "plain"), ("prose", "dflash")]


def test_segments_say_dflash_only_where_the_drafter_drafted(tiny_model_dir):
    engine = tiny_dflash_engine(tiny_model_dir, block_size=8, max_len=256)
    ids = list(range(50, 70))
    for speculation, mode in (("off", "plain"), ("dflash", "dflash")):
        params = SamplingParams(max_tokens=12, ignore_eos=True, speculation=speculation)
        segments = engine.generate(ids, params).stats["segments"]
        assert {s["mode"] for s in segments} == {mode}, segments
    engine.cost.prior_tau = dict.fromkeys(engine.cost.prior_tau, 1.0)  # drafts never pay
    auto = engine.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    assert auto.stats["draft_forwards"] == auto.stats["lookup_drafts"] == 0
    assert {s["mode"] for s in auto.stats["segments"]} == {"plain"}


def verify(cost, routing, kind, accepted, drafted):
    """One verify of ``routing``'s request, in a step of its own (as the engine counts it)."""
    cost.begin_step()
    cost.observe_draft(routing, kind, accepted, drafted)


def choose(cost, routing, kind, rows=1, slots=15, lookup=0):
    return cost.plan(rows, [Candidate(routing, kind, slots, lookup=lookup)])[0]


def test_cost_model_follows_measurements_and_probes_plain_kinds():
    cost, routing = CostModel(probe_every=4), RequestRouting()
    assert choose(cost, routing, SegmentKind.TOOL_CALL)  # prior: predictable
    for _ in range(20):
        verify(cost, routing, SegmentKind.PROSE, 0, 15)  # drafts keep failing on prose
    decisions = [choose(cost, routing, SegmentKind.PROSE) for _ in range(12)]
    # plain, with a probe after 4 steps, then (the probe failing) after 8
    assert decisions == [False] * 3 + [True] + [False] * 7 + [True]
    for _ in range(10):
        verify(cost, routing, SegmentKind.PROSE, 12, 15)  # the prose became predictable
    assert choose(cost, routing, SegmentKind.PROSE)


# fixed, one-token row, token past a row's first, drafter, block row, slot
TRUE_COST = np.array([2e-3, 0.1e-3, 0.15e-3, 1.5e-3, 0.3e-3, 0.06e-3])


def drafting(rows, drafted, slots):
    """A step of ``rows`` rows, ``drafted`` of which verify ``slots`` drafts each."""
    return StepShape(rows, rows + drafted * slots, drafted, drafted, drafted * slots)


def plain(rows):
    return StepShape(rows, rows, 0, 0, 0)


def test_step_cost_is_fitted_from_measured_steps():
    cost = CostModel()
    rng = np.random.default_rng(0)
    for _ in range(200):
        rows = int(rng.integers(1, 9))
        shape = drafting(rows, int(rng.integers(0, min(rows, 2) + 1)), int(rng.integers(3, 16)))
        cost.observe_step(shape, float(TRUE_COST @ shape.features()))
    assert cost.step_cost() == pytest.approx(TRUE_COST, rel=0.35)  # the prior pulls a little
    one = float(TRUE_COST @ plain(1).features())
    spec = float(TRUE_COST @ drafting(1, 1, 15).features())
    assert cost.verify_cost_ratio(15) == pytest.approx(spec / one, rel=0.05)


def test_a_slow_first_step_does_not_scale_the_prior():
    # another process slowed the first step 40x: the drafter, not measured yet, kept its
    # prior cost in that unit (40x), and a kind routed plain never drafted to correct it
    slowed, cost = CostModel(), CostModel()
    slowed.observe_step(plain(1), 40 * float(TRUE_COST @ plain(1).features()))
    slowed.step_cost()  # asked at once (a refit every 8 steps must not keep that scale)
    for n in range(15):
        for model in (slowed, cost):
            model.observe_step(plain(1), float(TRUE_COST @ plain(1).features()))
        if n >= 2:  # the slow step no longer the median
            assert slowed.step_cost()[3] == pytest.approx(cost.step_cost()[3], rel=0.1), n


def fitted_tool_call_cost():
    """A cost model fitted on plain and one-draft steps of 1-8 rows (``TRUE_COST``), and a
    tool-call request whose drafts have stood about 4 tokens a verify."""
    cost = CostModel()
    for rows in (1, 2, 4, 8) * 20:
        for shape in (plain(rows), drafting(rows, 1, 15)):
            cost.observe_step(shape, float(TRUE_COST @ shape.features()))
    routing = RequestRouting()
    for _ in range(10):
        verify(cost, routing, SegmentKind.TOOL_CALL, 3, 15)  # tau(15) about 4
    return cost, routing


def test_a_draft_must_pay_for_the_time_it_adds_to_every_row_of_the_step():
    cost, routing = fitted_tool_call_cost()
    # alone, 3 more tokens per step beat the 2.2x longer step; beside 7 plain rows they do not
    assert choose(cost, routing, SegmentKind.TOOL_CALL, rows=1)
    assert not choose(cost, routing, SegmentKind.TOOL_CALL, rows=8)
    # of two candidates the more predictable one drafts first and pays the drafter's fixed cost
    sure, unsure = RequestRouting(), RequestRouting()
    for _ in range(10):
        verify(cost, sure, SegmentKind.MATH, 8, 15)
        verify(cost, unsure, SegmentKind.PROSE, 1, 15)
    plan = cost.plan(2, [Candidate(unsure, SegmentKind.PROSE, 15),
                         Candidate(sure, SegmentKind.MATH, 15)])
    assert plan == [False, True]
    # a request that asked for DFlash drafts whatever the cost
    assert cost.plan(8, [Candidate(unsure, SegmentKind.PROSE, 15, forced=True)]) == [True]


def test_a_token_is_worth_what_it_takes_plain_in_a_batch_of_that_many_rows():
    # the CPU engine's shape of costs: a step's fixed cost dear, a one-token row cheap
    true_cost = np.array([2.5e-3, 0.12e-3, 0.1e-3, 1.3e-3, 0.8e-3, 0.02e-3])
    cost = CostModel()
    for rows in (1, 2, 4, 8, 16, 32) * 10:
        for shape in (plain(rows), drafting(rows, rows // 2, 7), drafting(rows, 1, 15)):
            cost.observe_step(shape, float(true_cost @ shape.features()))
    calls = [RequestRouting() for _ in range(7)]
    prose = RequestRouting()
    for _ in range(10):
        for routing in calls:
            verify(cost, routing, SegmentKind.TOOL_CALL, 12, 15)
    for _ in range(10):
        verify(cost, prose, SegmentKind.PROSE, 6, 7)  # about 5.6 tokens a verify
    rows = [Candidate(r, SegmentKind.TOOL_CALL, 15) for r in calls]
    rows.append(Candidate(prose, SegmentKind.PROSE, 7))
    # beside seven tool calls that draft, the prose row drafts too: plain, it would hold its
    # place in the batch for every token (the seven's drafts make the step's own tokens per
    # second higher than its draft would, which is no reason to leave it plain)
    assert cost.plan(8, rows) == [True] * 8
    # among 31 one-token rows, where a plain token costs a thirty-second of the fixed cost, the
    # same prose draft does not pay for the time its block adds
    assert cost.plan(32, [rows[-1]]) == [False]


def test_one_token_rows_and_block_rows_are_priced_apart():
    # the CPU engine: one-token rows attend together, each verify block on its own
    true_cost = np.array([2.5e-3, 0.12e-3, 0.1e-3, 1.3e-3, 0.8e-3, 0.02e-3])
    cost = CostModel()
    # a stretch of steps in which every row drafts (requests that asked for DFlash)...
    for rows in (1, 2, 4, 8) * 20:
        for slots in (3, 7, 15):
            shape = drafting(rows, rows, slots)
            cost.observe_step(shape, float(true_cost @ shape.features()))
    # ...says nothing of a row decoding plain: a wide plain step is not priced as if its rows
    # cost what block rows do (a fit that shared one cost per row priced it at 3.5x)
    wide = plain(32)
    truth = float(true_cost @ wide.features())
    assert cost.decode_seconds(wide) == pytest.approx(truth, rel=0.25)
    fitted = cost.step_cost()
    assert fitted[4] == pytest.approx(true_cost[4], rel=0.2)
    assert fitted[2] + fitted[5] == pytest.approx(true_cost[2] + true_cost[5], rel=0.1)
    # 32 prose rows whose drafts commit about 2.5 tokens decode plain
    routings = [RequestRouting() for _ in range(32)]
    for routing in routings:
        for _ in range(10):
            verify(cost, routing, SegmentKind.PROSE, 2, 7)
    assert not any(cost.plan(32, [Candidate(r, SegmentKind.PROSE, 7) for r in routings]))
    # steps with rows of both kinds tell their costs apart
    for rows in (1, 2, 4, 8, 16, 32) * 10:
        for shape in (plain(rows), drafting(rows, rows // 2, 7), drafting(rows, 1, 15)):
            cost.observe_step(shape, float(true_cost @ shape.features()))
    assert cost.step_cost()[1] == pytest.approx(true_cost[1], rel=0.15)
    for shape in (plain(32), drafting(16, 8, 7)):
        assert cost.decode_seconds(shape) == pytest.approx(true_cost @ shape.features(), rel=0.1)


def test_overrides_are_obeyed(tiny_model_dir):
    engine = tiny_dflash_engine(tiny_model_dir, block_size=8, max_len=256)
    ids = list(range(50, 70))
    off = engine.generate(ids, SamplingParams(max_tokens=20, ignore_eos=True, speculation="off"))
    assert off.stats["mode"] == "plain" and off.stats["draft_forwards"] == 0
    on = engine.generate(ids, SamplingParams(max_tokens=20, ignore_eos=True, speculation="dflash"))
    # every step drafts (with the drafter, or from the text itself), but for a last one with
    # room for one token only
    drafts = on.stats["draft_forwards"] + on.stats["lookup_drafts"]
    assert on.stats["target_forwards"] - 1 <= drafts <= on.stats["target_forwards"]
    # a random drafter is never accepted: auto learns that and mostly decodes plainly
    for _ in range(3):
        auto = engine.generate(ids, SamplingParams(max_tokens=40, ignore_eos=True))
    assert auto.stats["mode"] == "auto"
    assert auto.stats["draft_forwards"] < auto.stats["target_forwards"] / 2
    assert auto.token_ids[:20] == off.token_ids == on.token_ids


def test_acceptance_ignores_drafts_cut_short_and_follows_bursts():
    # drafts cut to 2 tokens by the room left, always fully accepted: nothing said of position 2+
    cost, routing = CostModel(), RequestRouting()
    before = cost.acceptance_rates(routing, SegmentKind.CODE)
    for _ in range(10):
        verify(cost, routing, SegmentKind.CODE, 2, 2)
    after = cost.acceptance_rates(routing, SegmentKind.CODE)
    assert (after[:2] > before[:2]).all() and after[2:] == pytest.approx(before[2:])
    # one accepted then a rejection, every time: a 15-slot block commits about 2
    for _ in range(40):
        verify(cost, routing, SegmentKind.MATH, 1, 15)
    assert 1.8 < cost.expected_tau(routing, SegmentKind.MATH, 15) < 2.5  # priors pull a little
    # bursty: half the drafts fail at once, the other half run the whole block
    for i in range(40):
        verify(cost, routing, SegmentKind.TOOL_CALL, 15 * (i % 2), 15)
    rates = cost.acceptance_rates(routing, SegmentKind.TOOL_CALL)
    assert rates[0] == pytest.approx(0.5, abs=0.1) and rates[1:15].min() > 0.9
    assert cost.block_size(routing, SegmentKind.TOOL_CALL, 16) == 16


def test_block_size_follows_the_acceptance_rate_within_bounds():
    cost, routing = CostModel(), RequestRouting()
    tool = cost.block_size(routing, SegmentKind.TOOL_CALL, 16)  # prior tau 6
    prose = cost.block_size(routing, SegmentKind.PROSE, 16)  # prior tau 2
    assert 16 >= tool > prose >= 3
    for _ in range(30):
        verify(cost, routing, SegmentKind.PROSE, 0, 15)
    assert cost.block_size(routing, SegmentKind.PROSE, 16) == 2  # one draft: it never lands
    for _ in range(30):
        verify(cost, routing, SegmentKind.MATH, 15, 15)
    assert cost.block_size(routing, SegmentKind.MATH, 16) == 16  # every draft lands
    assert cost.block_size(routing, SegmentKind.TOOL_CALL, 3) <= 3


def test_rows_that_draft_together_share_the_drafters_fixed_cost():
    # a device where verifying is cheap and the drafter's launch is dear
    true_cost = np.array([2e-3, 0.05e-3, 0.05e-3, 4e-3, 0.05e-3, 0.01e-3])
    cost = CostModel()
    for rows in (1, 2, 4, 8) * 20:
        for shape in (plain(rows), drafting(rows, rows, 15), drafting(rows, 1, 15)):
            cost.observe_step(shape, float(true_cost @ shape.features()))
    routings = [RequestRouting() for _ in range(8)]
    for routing in routings:
        for _ in range(10):
            verify(cost, routing, SegmentKind.TOOL_CALL, 7, 15)
    # one row alone among seven plain ones does not pay for the drafter; all eight together do
    assert cost.plan(8, [Candidate(routings[0], SegmentKind.TOOL_CALL, 15)]) == [False]
    together = [Candidate(r, SegmentKind.TOOL_CALL, 15) for r in routings]
    assert cost.plan(8, together) == [True] * 8


def test_a_plain_kind_is_probed_once_per_period_by_its_cheapest_row():
    cost = CostModel(probe_every=4)
    routings = [RequestRouting() for _ in range(3)]
    for routing in routings:
        for _ in range(20):
            verify(cost, routing, SegmentKind.PROSE, 0, 15)
    rows = [Candidate(r, SegmentKind.PROSE, 3, backlog=b) for r, b in zip(routings, (90, 7, 40))]
    plans = [cost.plan(3, rows) for _ in range(12)]
    probes = [[i for i, yes in enumerate(p) if yes] for p in plans]
    # one row per period, the one with the least backlog; the period doubles while prose loses
    assert probes == [[]] * 3 + [[1]] + [[]] * 7 + [[1]]
    assert cost._probe_interval[SegmentKind.PROSE] == 16


def test_a_probe_waits_for_a_step_where_a_draft_could_pay():
    # the CPU engine: a one-token row adds little to a step, a drafted block a lot
    true_cost = np.array([2.5e-3, 0.1e-3, 0.1e-3, 1.3e-3, 0.8e-3, 0.02e-3])
    cost = CostModel(probe_every=4)
    for rows in (1, 2, 4, 8, 16, 32) * 10:
        for shape in (plain(rows), drafting(rows, 1, 7)):
            cost.observe_step(shape, float(true_cost @ shape.features()))
    routings = [RequestRouting() for _ in range(32)]
    for routing in routings:
        for _ in range(20):
            verify(cost, routing, SegmentKind.PROSE, 0, 7)
    rows = [Candidate(r, SegmentKind.PROSE, 7) for r in routings]
    # at 32 rows even a draft that stood whole would cost more than its 7 tokens bring: the
    # probe that is due waits...
    assert not any(any(cost.plan(32, rows)) for _ in range(12))
    # ...for a step of few rows, where what it learns could make drafting pay
    assert cost.plan(2, rows[:2]).count(True) == 1


def test_probes_back_off_while_a_kind_loses_and_reset_once_it_pays():
    cost, routing = CostModel(probe_every=2, max_probe_every=8), RequestRouting()
    for _ in range(20):
        verify(cost, routing, SegmentKind.PROSE, 0, 15)
    probed = [i for i in range(40) if choose(cost, routing, SegmentKind.PROSE)]
    assert probed == [1, 5, 13, 21, 29, 37]  # after 2, 4, 8, 8, ... steps
    for _ in range(10):
        verify(cost, routing, SegmentKind.PROSE, 14, 15)  # prose became predictable
    assert choose(cost, routing, SegmentKind.PROSE)
    assert cost._probe_interval[SegmentKind.PROSE] == 2


def test_rows_that_asked_for_dflash_do_not_reset_the_probe_back_off():
    cost, routing = CostModel(probe_every=2, max_probe_every=8), RequestRouting()
    for _ in range(20):
        verify(cost, routing, SegmentKind.PROSE, 0, 15)
    for _ in range(20):  # prose loses: the period grows to its longest
        choose(cost, routing, SegmentKind.PROSE)
    assert cost._probe_interval[SegmentKind.PROSE] == 8
    forced = Candidate(RequestRouting(), SegmentKind.PROSE, 15, forced=True)
    plain = Candidate(routing, SegmentKind.PROSE, 15)
    assert cost.plan(2, [forced, plain]) == [True, False]  # drafted, as it asked
    assert cost._probe_interval[SegmentKind.PROSE] == 8
    assert cost._since_drafted[SegmentKind.PROSE] == 0  # but its counts are fresh


def test_a_bad_stretch_ages_while_the_kind_decodes_plain():
    """Counts age with the steps a kind spends plain: after a stretch of failed drafts the
    estimate drifts back to the prior, and a kind whose prior pays drafts again, probe or not."""
    def first_draft(age_plain):
        cost, routing = CostModel(probe_every=10_000, age_plain=age_plain), RequestRouting()
        for _ in range(6):
            verify(cost, routing, SegmentKind.CODE, 0, 15)  # a stretch the drafter misses
        return next((i for i in range(300) if choose(cost, routing, SegmentKind.CODE)), None)

    assert 0 < first_draft(0.97) < 100
    assert first_draft(1.0) is None  # without ageing, only probes would ever draft it again


def test_a_row_drafts_from_its_own_text_where_the_drafter_fails_and_the_text_repeats():
    cost, routing = CostModel(), RequestRouting()
    # at first the drafter is trusted on tool calls: the text's own suggestion waits
    assert cost.lookup_slots(routing, SegmentKind.TOOL_CALL, 7, 15) == 0
    for _ in range(8):
        verify(cost, routing, SegmentKind.TOOL_CALL, 0, 7)  # a loop the drafter misses
    assert cost.lookup_slots(routing, SegmentKind.TOOL_CALL, 7, 0) == 0  # nothing to look up
    assert 0 < cost.lookup_slots(routing, SegmentKind.TOOL_CALL, 7, 15)
    for _ in range(8):
        cost.observe_lookup(routing, 15, 15)  # the loop goes on, every looked-up token stands
    assert cost.lookup_slots(routing, SegmentKind.TOOL_CALL, 3, 15) > 3  # past the drafter's
    # the plan counts on the lookup too: a row whose drafter fails but whose text repeats
    # keeps drafting, where one without a lookup record goes plain
    assert choose(cost, routing, SegmentKind.TOOL_CALL, rows=1, slots=7, lookup=15)
    untried = RequestRouting()
    for _ in range(8):
        verify(cost, untried, SegmentKind.TOOL_CALL, 0, 7)
    assert not choose(cost, untried, SegmentKind.TOOL_CALL, rows=1, slots=7, lookup=15)
    # ...but only in a step whose text offers a lookup: with none the drafter's block would be
    # verified, which its record says fails (the loop's record kept a row drafting at a loss,
    # step after step, once the text had moved on)
    assert not choose(cost, routing, SegmentKind.TOOL_CALL, rows=1, slots=7, lookup=0)
    for _ in range(12):
        cost.observe_lookup(routing, 0, 15)  # the text moved on...
        verify(cost, routing, SegmentKind.TOOL_CALL, 7, 7)  # ...where the drafter lands
    assert cost.lookup_slots(routing, SegmentKind.TOOL_CALL, 7, 15) == 0


def test_a_lookup_is_priced_at_its_own_length_and_needs_no_drafter():
    # a loop whose 63-token lookups mostly stand, a drafter that fails: the engine verifies a
    # 40-token lookup, which was charged as the drafter's 3 slots (chosen at a loss in wide
    # steps) and with the drafter's launch, which it does not run
    cost, routing = CostModel(), RequestRouting()
    for _ in range(10):
        cost.observe_lookup(routing, 40, 63)
        verify(cost, routing, SegmentKind.TOOL_CALL, 0, 3)
    fixed, single, token, drafter, block, slot = cost.step_cost()
    take = cost.lookup_slots(routing, SegmentKind.TOOL_CALL, 3, 63)
    tau = cost._lookup_tau(routing, take)
    assert take > 3
    for rows in (1, 8, 32, 64):
        saved = (tau - 1) * (fixed / rows + single) - (block - single + take * token)
        chosen = choose(cost, routing, SegmentKind.TOOL_CALL, rows=rows, slots=3, lookup=63)
        assert chosen == (saved > 0), (rows, saved)
    assert not choose(cost, routing, SegmentKind.TOOL_CALL, rows=64, slots=3, lookup=63)
    assert choose(cost, routing, SegmentKind.TOOL_CALL, rows=1, slots=3, lookup=63)


def test_a_lookup_not_tried_yet_is_priced_as_the_drafter_s_block():
    # priced at none (a lookup's tau before the request has tried one), the row stayed plain
    # for good, its lookup never tried: a JSON answer's tau fell from 7.6 to 3.6 under auto
    cost, routing = CostModel(), RequestRouting()
    for _ in range(6):
        verify(cost, routing, SegmentKind.TOOL_CALL, 1, 3)
    assert cost.lookup_slots(routing, SegmentKind.TOOL_CALL, 3, 63) > 0
    assert routing.lookup.steps == 0
    assert choose(cost, routing, SegmentKind.TOOL_CALL, rows=1, slots=3, lookup=63)


def test_a_lookup_row_that_pays_drafts_beside_a_drafter_row_that_does_not():
    # the plan took the best prefix of the rows by gain: a drafter row ranked above a lookup
    # row took the drafter's launch into every choice holding the lookup; and a probe fired
    # where the lookup row, which launches no drafter, was all that drafted
    kind = SegmentKind.TOOL_CALL
    cost = CostModel(probe_every=10**9, max_probe_every=10**9)
    looping = RequestRouting()
    for _ in range(10):
        cost.observe_lookup(looping, 40, 63)
        verify(cost, looping, kind, 0, 3)
    standing = RequestRouting()
    for _ in range(30):
        verify(cost, standing, kind, 15, 15)
    fixed, single, token, drafter, block, slot = cost.step_cost()
    rows = 7
    worth = fixed / rows + single
    take = cost.lookup_slots(looping, kind, 3, 4)
    lookup_gain = (cost._lookup_tau(looping, take) - 1) * worth - (block - single + take * token)
    drafter_gain = (cost.expected_tau(standing, kind, 3) - 1) * worth - (
        block - single + 3 * (token + slot))
    assert take and 0 < lookup_gain < drafter_gain and lookup_gain + drafter_gain < drafter
    assert cost.plan(rows, [Candidate(looping, kind, 3, lookup=4),
                            Candidate(standing, kind, 3)]) == [True, False]
    probed = CostModel(probe_every=4)
    for _ in range(10):
        probed.observe_lookup(looping, 40, 63)
        verify(probed, looping, kind, 0, 3)
    failing = RequestRouting()
    for _ in range(20):
        verify(probed, failing, SegmentKind.PROSE, 0, 3)
    steps = [probed.plan(12, [Candidate(looping, kind, 3, lookup=63),
                              Candidate(failing, SegmentKind.PROSE, 3)]) for _ in range(8)]
    assert all(chosen == [True, False] for chosen in steps), steps


def test_the_draft_not_verified_is_counted_as_far_as_the_target_shows_it():
    cost = CostModel()
    block = [5, 6, 7, 8]
    # the lookup, verified: two tokens stand, then the target writes 9; the block left the
    # target's tokens at its third (7 != 9): counted reached there, not accepted
    cost.observe_agreement(SegmentKind.CODE, [5, 6, 1, 1, 1, 1], 2, 9, block, True)
    lookup, drafter = cost.agreed[SegmentKind.CODE]
    assert list(lookup.reached[:7]) == [1, 1, 1, 0, 0, 0, 0]
    assert list(lookup.accepted[:3]) == [1, 1, 0]
    assert list(drafter.reached[:5]) == [1, 1, 1, 0, 0] and list(drafter.accepted[:3]) == [1, 1, 0]
    # the block, verified, fails at its third token where the lookup follows the target to
    # its last shown token: the lookup's later positions are unknown, not misses
    cost = CostModel()
    cost.observe_agreement(SegmentKind.CODE, block, 2, 3, [5, 6, 3, 4, 4], False)
    lookup, drafter = cost.agreed[SegmentKind.CODE]
    assert list(drafter.reached[:4]) == [1, 1, 1, 0] and list(drafter.accepted[:3]) == [1, 1, 0]
    assert list(lookup.reached[:5]) == [1, 1, 1, 0, 0] and list(lookup.accepted[:4]) == [1, 1, 1, 0]


def test_the_drafter_gives_odds_for_the_lookup_where_the_two_part():
    logits = torch.zeros(4, 10)
    logits[2, 7], logits[2, 3] = 2.0, -1.0  # at slot 2 the block has 7, the lookup 3
    odds = fork_odds([1, 2, 7, 4], [1, 2, 3, 4, 5], logits)
    assert odds == pytest.approx(math.exp(-3.0))
    assert fork_odds([1, 2, 7], [1, 2, 7, 9], logits) == math.inf  # the lookup goes on from it
    assert fork_odds([1, 2, 7, 4, 6], [1, 2, 7, 4, 5], logits) == math.inf  # past the logits
    logits[2, 3] = 1e4  # a token the drafter prefers, where the grammar chose for it
    assert math.isfinite(fork_odds([1, 2, 7, 4], [1, 2, 3], logits))


def test_a_lookup_that_agrees_with_the_block_is_verified_in_its_place_where_it_stands_longer():
    cost, routing = CostModel(), RequestRouting()
    for _ in range(8):
        verify(cost, routing, SegmentKind.CODE, 3, 15)
    assert cost.agreed_slots(routing, SegmentKind.CODE, 15, 40) == 0  # nothing seen: the block
    truth = list(range(100, 140))
    for _ in range(8):  # the block fails at its fourth token; the lookup copies the line on
        cost.begin_step()
        block = truth[:3] + [1] + truth[4:15]
        cost.observe_agreement(SegmentKind.CODE, block, 3, truth[3], truth[:40], False)
    assert cost.agreed_slots(routing, SegmentKind.CODE, 15, 0) == 0  # nothing looked up
    take = cost.agreed_slots(routing, SegmentKind.CODE, 15, 40)
    assert take > 3
    for _ in range(12):  # verified, the lookup stands whole: it grows past the block
        cost.begin_step()
        cost.observe_agreement(SegmentKind.CODE, truth[:take], take, 7, block, True)
        take = cost.agreed_slots(routing, SegmentKind.CODE, 15, 40)
    assert take > 15
    other = CostModel()  # where the lookups leave the text early and the blocks do not
    for _ in range(12):
        other.begin_step()
        other.observe_agreement(SegmentKind.PROSE, truth[:15], 15, 7, truth[:3] + [1] * 30, False)
    assert other.agreed_slots(routing, SegmentKind.PROSE, 15, 33) == 0


def test_looked_up_drafts_that_stand_whole_grow_past_the_lengths_tried():
    cost, routing = CostModel(), RequestRouting()
    for _ in range(8):
        verify(cost, routing, SegmentKind.TOOL_CALL, 0, 7)  # the drafter misses a loop
    lengths = []
    for _ in range(6):
        take = cost.lookup_slots(routing, SegmentKind.TOOL_CALL, 7, 15)
        lengths.append(take)
        cost.observe_lookup(routing, take, take)  # every looked-up token stands
    # positions no lookup reached yet are as likely as the deepest one reached, so the drafts
    # grow to the whole block; with a flat prior they stayed where the first ones stopped
    assert lengths[0] < 15 and lengths[-1] == 15
    assert lengths == sorted(lengths)
    for _ in range(6):
        cost.observe_lookup(routing, 2, 15)  # the loop breaks after two tokens, every time
    assert cost.lookup_slots(routing, SegmentKind.TOOL_CALL, 7, 15) <= 6  # and shrink back


def test_chained_rates_shrink_each_position_towards_the_one_before():
    acc = Acceptance()
    assert (acc.chained_rates(0.5, 4.0) == 0.5).all()  # nothing seen: the prior everywhere
    for _ in range(3):
        acc.observe(3, 3, 1.0)  # three positions reached and accepted, three times
    rates = acc.chained_rates(0.5, 4.0)
    assert rates[0] == (3 + 4 * 0.5) / (3 + 4)
    assert rates[1] == (3 + 4 * rates[0]) / (3 + 4) and rates[1] > rates[0]
    assert (rates[3:] == rates[2]).all()  # past the deepest position reached: its rate


def test_a_drafters_validation_tau_is_the_routers_starting_estimate(tmp_path):
    from agentflash.engine.engine import Engine
    from agentflash.errors import UserError
    from agentflash.models.loading import DEMO_DIR, read_validation_tau
    from agentflash.router.policy import PRIOR_TAU, prior_rates

    shipped = json.loads((DEMO_DIR / "drafter" / "train_drafter.json").read_text())["val_tau"]
    engine = Engine.from_pretrained("demo")
    fresh = RequestRouting()
    assert engine.cost.prior_tau[SegmentKind.PROSE] == shipped["prose"]
    assert engine.cost.prior_tau[SegmentKind.SCHEMA] == shipped["tool_call"]  # JSON, like calls
    np.testing.assert_allclose(
        engine.cost.acceptance_rates(fresh, SegmentKind.CODE), prior_rates(shipped["code"])
    )
    assert CostModel().prior_tau == PRIOR_TAU  # a drafter without a training record
    assert read_validation_tau(tmp_path) is None
    (tmp_path / "train_drafter.json").write_text(json.dumps({"val_tau": {"code": "fast"}}))
    with pytest.raises(UserError, match="train_drafter.json: val_tau"):
        read_validation_tau(tmp_path)


def test_a_kinds_counts_age_per_step_not_per_verify():
    """With many rows a step brings many verifies: aged per verify, a kind's counts held little
    more than the last step's, and at the end of a run the last steps are its slowest (hardest)
    requests'; every new request then started from their estimate."""
    cost = CostModel()
    easy = [RequestRouting() for _ in range(32)]
    cost.begin_step()
    for routing in easy:  # one wide step where the drafts stand
        cost.observe_draft(routing, SegmentKind.TOOL_CALL, 14, 15)
    cost.begin_step()
    for routing in easy[:4]:  # the four slowest requests' next step: their drafts fail
        cost.observe_draft(routing, SegmentKind.TOOL_CALL, 0, 15)
    fresh = cost.acceptance_rates(RequestRouting(), SegmentKind.TOOL_CALL)
    assert fresh[0] > 0.8  # 32 verifies that stood, and 4 that did not
    # verifies in steps of their own keep aging per verify, as a lone request's do
    alone = CostModel()
    for accepted in [14] * 32 + [0] * 4:
        verify(alone, RequestRouting(), SegmentKind.TOOL_CALL, accepted, 15)
    assert alone.acceptance_rates(RequestRouting(), SegmentKind.TOOL_CALL)[0] < 0.75


def test_a_burst_of_slow_steps_does_not_price_the_features_it_happened_to_take():
    # another process slowed ten steps that drafted 20x: taken at face value they priced the
    # drafter so that a tool call alone decoded plain (and drafted again only when probed)
    cost, routing = fitted_tool_call_cost()
    assert choose(cost, routing, SegmentKind.TOOL_CALL)
    for _ in range(10):
        shape = drafting(1, 1, 15)
        cost.observe_step(shape, 20 * float(TRUE_COST @ shape.features()))
    assert choose(cost, routing, SegmentKind.TOOL_CALL)
    # steps truly dearer than the fit predicts (the machine at 2.5x) still move it, as fast as
    # taken at face value
    dearer = 2.5 * TRUE_COST
    for rows in (1, 2, 4, 8) * 10:
        for shape in (plain(rows), drafting(rows, 1, 15)):
            cost.observe_step(shape, float(dearer @ shape.features()))
    for shape in (plain(1), plain(8), drafting(1, 1, 15)):
        assert cost.decode_seconds(shape) == pytest.approx(dearer @ shape.features(), rel=0.1)


def kinds_by_steps(tokenizer, ids, ends):
    """The tracker's kind after each step, a step committing ``ids`` up to each of ``ends``, fed
    as the engine feeds it."""
    from agentflash.engine.detokenizer import OutputDecoder, StepText

    tracker, text = SegmentTracker(), StepText(OutputDecoder(tokenizer))
    seen = {}
    for end in ends:
        tracker.feed(text.delta(ids, end))
        seen[end] = tracker.kind
    return seen


SPLIT_TEXTS = [  # the demo tokenizer writes × and ÷ as two byte tokens each; (text, has math)
    ("So 3×4 is twelve and more words here.\n", True),
    ("Then 12÷4 gives three, more words.\n", True),
    ("Café 1 − 2 ok é×3\n", False),
    ("Here:\n```python\nx = 1  # é×\n```\nDone 2×2.\n", True),
    ('I will call <tool_call>\n{"name": "f", "arguments": {"x": "3×4"}}\n</tool_call> ok\n', False),
]


@pytest.mark.parametrize(("text", "math"), SPLIT_TEXTS)
def test_segments_do_not_depend_on_how_the_steps_split_the_text(demo_tokenizer_dir, text, math):
    # each step's tokens were decoded alone: a × whose two bytes two steps wrote was read as two
    # U+FFFD, and "3×4" was math in one block and prose a token a step
    import random

    from transformers import AutoTokenizer

    from agentflash.engine.detokenizer import OutputDecoder, settled

    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    decode = OutputDecoder(tok)
    ids = tok.encode(text, add_special_tokens=False)
    assert decode(ids) == text
    if "×" in text:
        assert "\ufffd" in decode(ids[: next(i for i in range(len(ids))
                                              if "×" in decode(ids[: i + 1]))])
    truth = {}
    for end in range(1, len(ids) + 1):  # the text so far, whole (less a character begun)
        tracker = SegmentTracker()
        tracker.feed(settled(decode(ids[:end])))
        truth[end] = tracker.kind
    assert kinds_by_steps(tok, ids, range(1, len(ids) + 1)) == truth  # a token a step
    rng = random.Random(0)
    for _ in range(30):  # in random blocks
        ends = sorted(set(rng.sample(range(1, len(ids)), rng.randrange(len(ids) // 2)))
                      | {len(ids)})
        assert kinds_by_steps(tok, ids, ends) == {end: truth[end] for end in ends}, ends
    assert (SegmentKind.MATH in truth.values()) == math


def test_a_step_text_window_starts_after_the_last_whole_character(demo_tokenizer_dir):
    # steps that each end inside a character: each decodes its own tokens and the few before
    from transformers import AutoTokenizer

    from agentflash.engine.detokenizer import OutputDecoder, StepText

    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    ids = tok.encode("×" * 200, add_special_tokens=False)
    assert len(ids) == 400
    text, out = StepText(OutputDecoder(tok)), ""
    for end in range(3, len(ids), 2):  # every step ends after a ×'s first byte
        out += text.delta(ids, end)
        assert end - text.start <= 3
    assert out == "×" * 199


def test_a_character_whose_bytes_the_grammar_forced_a_token_at_a_time_is_read_whole(
        tiny_model_dir):
    from agentflash.grammar import regex

    engine = tiny_dflash_engine(tiny_model_dir, block_size=8, max_len=256)
    res = engine.generate(list(range(50, 70)), SamplingParams(
        max_tokens=12, grammar=regex(r"So 3×4 is [a-z]{1,3}"), speculation="off"))
    assert res.text.startswith("So 3×4 is ")
    assert "math" in [s["kind"] for s in res.stats["segments"]], res.stats["segments"]


def test_a_tag_inside_a_calls_json_string_does_not_end_the_call():
    # the tracker closed the call on any </tool_call>: the parser reads on past one in a string
    pieces = ["<tool_call>", '\n{"name": "note", "arguments": {"text": "the tag ', "</tool_call>",
              ' ends a call", "n": "12 34"}}\n', "</tool_call>", " Done 2 + 2"]
    P, T, M = SegmentKind.PROSE, SegmentKind.TOOL_CALL, SegmentKind.MATH
    assert kinds_along(pieces) == [P, T, T, T, T, P, M]


CALL_TEXTS = [
    '<tool_call>\n{"name": "note", "arguments": {"text": "a </tool_call> in it"}}\n</tool_call>'
    " then 3 * 4\nok",
    'x <tool_call>{"name": "f", "arguments": {"s": "\\"</tool_call>\\\\", "n": 1}}</tool_call>ok',
    # no JSON: its quotes do not pair, and its first tag ends it (``CallEnd.fallback``)
    '<tool_call>{"name": "f", "arguments": {"q": "it"s "a</tool_call> then 2+2\n```\nx\n',
    '<tool_call>{"name": "f", "arguments": {"q": "a</tool_call>b", 7}}</tool_call> 1*2',
    '<tool_call>{"a": "</tool_call>"} tail </tool_call><tool_call>{}</tool_call> 5 - 1',
    '```\n<tool_call>{"c": "```"}</tool_call>\n```\n<tool_call>\n{"u": "\\u00e9</tool_call>"',
    # a line break in a string is no JSON (only once something follows it: JSON's reader was
    # given the body without the blanks that end it)
    '<tool_call>{"a": "x</tool_call>\n+ 2*3 more"}</tool_call>',
]


@pytest.mark.parametrize("text", CALL_TEXTS)
def test_a_call_ends_where_the_parser_ends_it_however_the_text_is_split(text):
    import random

    from agentflash.tool_format import _blocks

    def kinds(ends):
        tracker, seen, start = SegmentTracker(), {}, 0
        for end in ends:
            tracker.feed(text[start:end])
            seen[end], start = tracker.kind, end
        return seen

    truth = {}
    for end in range(1, len(text) + 1):
        blocks = _blocks(text[:end])
        in_call = bool(blocks) and blocks[-1][2] is None
        truth[end] = whole = kinds([end])[end]
        assert (whole is SegmentKind.TOOL_CALL) == in_call, text[:end]
    assert kinds(range(1, len(text) + 1)) == truth  # a character at a time
    rng = random.Random(0)
    for _ in range(100):
        ends = sorted(set(rng.sample(range(1, len(text)), rng.randrange(len(text) // 3)))
                      | {len(text)})
        assert kinds(ends) == {end: truth[end] for end in ends}, ends


def test_a_tag_in_a_calls_string_costs_a_step_its_own_length(monkeypatch):
    # once the body holds a tag in a string, each piece is read as JSON with the body before it
    # (the call ends at that tag once the body is no JSON): but not a piece that only goes on
    # with the string
    import agentflash.tool_format as tool_format

    read = []
    real = tool_format._json_or_its_beginning

    def counting(text):
        read.append(len(text))
        return real(text)

    monkeypatch.setattr(tool_format, "_json_or_its_beginning", counting)
    tracker = SegmentTracker()
    tracker.feed('<tool_call>{"name": "note", "arguments": {"text": "the tag </tool_call>')
    n = 3000
    for _ in range(n):
        tracker.feed(" w\\n \\u00e9")
        assert tracker.kind is SegmentKind.TOOL_CALL
    assert sum(read) < 100 * n
    tracker.feed('", "x": 1}}</tool_call>')
    assert tracker.kind is SegmentKind.PROSE


@pytest.mark.parametrize("run", ["the character", "invalid bytes"])
def test_a_step_text_window_stays_bounded_on_a_run_of_final_replacement_characters(
        demo_tokenizer_dir, run):
    # the text less all its trailing U+FFFD was handed out: a run that never changes (U+FFFD
    # itself, lone continuation bytes) held the window open, each step decoding all of it; the
    # last 3 U+FFFD are held back (at most 9 tokens here: three U+FFFD of 3 bytes), and a step
    # decodes the window (<= 10 tokens), tails of 1 to 9 tokens and one head (<= 9)
    from transformers import AutoTokenizer

    from agentflash.engine.detokenizer import OutputDecoder, StepText

    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    decode = OutputDecoder(tok)
    lone = tok.convert_tokens_to_ids("Ĺ")  # the byte 0x97: a continuation, never a character
    assert decode([lone] * 3) == "\ufffd" * 3
    ids = tok.encode("It says ", add_special_tokens=False)
    ids += tok.encode("\ufffd" * 100, add_special_tokens=False) if run == "the character" \
        else [lone] * 300
    decoded = []

    def counting(token_ids):
        decoded.append(len(token_ids))
        return decode(token_ids)

    text, out = StepText(counting), ""
    for end in range(1, len(ids) + 1):  # a token a step
        out += text.delta(ids, end)
        assert end - text.start <= (9 if run == "the character" else 3)
        whole = decode(ids[:end])
        assert out == whole[: len(whole) - min(len(whole) - len(whole.rstrip("\ufffd")), 3)]
    assert len(ids) >= 300 and max(decoded) <= 10 and sum(decoded) <= 64 * len(ids)
    assert out == "It says " + "\ufffd" * (97 if run == "the character" else 297)
