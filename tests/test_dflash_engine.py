"""DFlash decoding in the engine is lossless: the same tokens as plain decoding, and the same
stopping points, whatever the drafter proposes."""

import pytest
import torch
from conftest import spy_on_agreements, tiny_dflash_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agentflash.engine.engine as engine_mod
from agentflash.engine.model_runner import _linears
from agentflash.engine.request import SamplingParams
from agentflash.models.qwen3 import reordered_bytes


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return tiny_dflash_engine(tiny_model_dir)


def plain(engine, ids, **kw):
    return engine.generate(ids, SamplingParams(speculation="off", **kw))


def dflash(engine, ids, **kw):
    return engine.generate(ids, SamplingParams(speculation="dflash", **kw))


def committed(contexts, pending):
    """Tokens the first row holds: its context's positions, those it takes in, its last."""
    waiting = 0 if pending is None or pending[0] is None else pending[0].shape[0]
    return contexts[0].length + waiting + 1


class Oracle:
    """A drafter that proposes the target's own greedy continuation, wrong from slot ``k`` on,
    so that blocks are accepted in long runs and stops fall inside accepted blocks."""

    def __init__(self, prompt_len, reference, wrong_at):
        self.prompt_len, self.reference, self.wrong_at = prompt_len, reference, wrong_at

    def __call__(self, drafter, embed, logits, last_tokens, contexts, block_size, num_slots,
                 pending=None):
        done = committed(contexts, pending) - self.prompt_len  # tokens already committed
        out = torch.tensor(self.reference[done : done + block_size - 1] + [0] * block_size)
        out = out[: block_size - 1].clone()
        if self.wrong_at < block_size - 1:
            out[self.wrong_at] = (out[self.wrong_at] + 1) % 4000
        return torch.nn.functional.one_hot(out[:num_slots], 4096).float()[None]  # [1, T, V]


prompt_ids = st.lists(st.integers(10, 4000), min_size=1, max_size=40)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=prompt_ids, block=st.integers(2, 16), max_tokens=st.integers(1, 40))
def test_random_drafter_greedy_equals_plain(engine, ids, block, max_tokens):
    a = plain(engine, ids, max_tokens=max_tokens, ignore_eos=True)
    b = dflash(engine, ids, max_tokens=max_tokens, ignore_eos=True, block_size=block)
    assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
    assert b.stats["mode"] == "dflash"
    drafts = b.stats["draft_forwards"] + b.stats["lookup_drafts"]  # the drafter's or the text's
    assert drafts >= 1 or max_tokens <= 2  # room for a draft after the first token


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ids=prompt_ids,
    block=st.integers(2, 16),
    max_tokens=st.integers(1, 48),
    wrong_at=st.integers(0, 20),
    stop_index=st.integers(0, 47),
    use_string=st.booleans(),
)
def test_accepted_blocks_stop_where_plain_decoding_stops(
    engine, monkeypatch, ids, block, max_tokens, wrong_at, stop_index, use_string
):
    free = plain(engine, ids, max_tokens=48, ignore_eos=True)
    kw = {"max_tokens": max_tokens}
    stop_token = free.token_ids[stop_index]
    if use_string:
        piece = engine.tokenizer.decode([stop_token])
        kw["stop"] = (piece,) if piece.strip() else ()
        kw["ignore_eos"] = True
    else:
        kw["stop_token_ids"] = (stop_token,)
    expected = plain(engine, ids, **kw)
    monkeypatch.setattr(engine_mod, "draft_logits", Oracle(len(ids), free.token_ids, wrong_at))
    got = dflash(engine, ids, block_size=block, **kw)
    monkeypatch.undo()
    assert got.token_ids == expected.token_ids
    assert got.text == expected.text and got.finish_reason == expected.finish_reason
    if wrong_at >= block - 1 and len(got.token_ids) > block:
        assert got.stats["tau"] > 1.5  # whole blocks were accepted


def test_batched_dflash_and_plain_rows_decode_as_if_alone(engine):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (5, 17, 33, 8)]
    modes = ["dflash", "off", "dflash", "dflash"]
    alone = [
        engine.generate(
            p, SamplingParams(max_tokens=25, ignore_eos=True, speculation=m, block_size=4 + 3 * i)
        )
        for i, (p, m) in enumerate(zip(prompts, modes))
    ]
    reqs = [
        engine.submit(
            p, SamplingParams(max_tokens=25, ignore_eos=True, speculation=m, block_size=4 + 3 * i)
        )
        for i, (p, m) in enumerate(zip(prompts, modes))
    ]
    while engine.has_work:
        engine.step()
    for req, ref in zip(reqs, alone):
        assert engine.result(req).token_ids == ref.token_ids
    assert engine.cache.num_free == engine.cache.num_slots


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(engine):
    ids = list(range(100, 130))
    kw = dict(max_tokens=30, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    assert dflash(engine, ids, **kw).token_ids == plain(engine, ids, **kw).token_ids



def test_short_blocks_verify_the_head_of_a_full_drafter_block(engine, monkeypatch):
    """The drafter always fills the block it was trained on; a row asking for a shorter block
    verifies that block's first drafts (a block of fewer masks is text the drafter never saw),
    the only slots whose logits are computed."""
    drafted, verified = [], []

    def spy(drafter, embed, logits, last_tokens, contexts, block_size, num_slots, pending):
        out = real_draft(drafter, embed, logits, last_tokens, contexts, block_size, num_slots,
                         pending)
        drafted.append((block_size, out.argmax(-1)[0].tolist()))
        assert out.shape[1] == num_slots <= 3  # logits only for the slots it may verify
        return out

    def forward(rows, *args, **kwargs):
        verified.append(list(rows[0].tokens))
        return real_forward(rows, *args, **kwargs)

    real_draft, real_forward = engine_mod.draft_logits, engine.runner.forward
    monkeypatch.setattr(engine_mod, "draft_logits", spy)
    monkeypatch.setattr(engine.runner, "forward", forward)
    monkeypatch.setattr(engine.cost, "lookup_slots", lambda *args: 0)  # drafter blocks only
    ids = list(range(200, 230))
    out = dflash(engine, ids, max_tokens=30, ignore_eos=True, block_size=4)
    monkeypatch.undo()
    assert drafted and {size for size, _ in drafted} == {engine.drafter.cfg.block_size}
    blocks = [v for v in verified[1:] if len(v) > 1]  # after the prompt: the verify forwards
    assert len(blocks) == len(drafted)
    for block, (_, draft) in zip(blocks, drafted):
        assert block[1:] == draft[: len(block) - 1] and len(block) <= 4
    assert out.token_ids == plain(engine, ids, max_tokens=30, ignore_eos=True).token_ids


def test_a_looping_output_is_drafted_from_itself_and_stays_exact(engine):
    """A random drafter never lands; the random target's greedy output soon loops. Rows then
    verify what their own text suggests, and the output is still plain decoding's."""
    ids = [300, 301, 302] * 6
    out = dflash(engine, ids, max_tokens=60, ignore_eos=True)
    assert out.stats["lookup_drafts"] > 0
    assert out.stats["target_forwards"] < 60 / 2  # the loop is verified many tokens at a time
    assert out.token_ids == plain(engine, ids, max_tokens=60, ignore_eos=True).token_ids


def test_a_loop_is_verified_past_the_drafters_block(engine, monkeypatch):
    """Where a request's text keeps looping, its lookups grow past the drafter's block (the
    router prices blocks up to ``MAX_SLOTS``), and the output is still plain decoding's."""
    verified = []
    real_forward = engine.runner.forward

    def forward(rows, *args, **kwargs):
        verified.extend(len(r.tokens) for r in rows if not r.last_only)
        return real_forward(rows, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", forward)
    ids = [300, 301, 302] * 6
    out = dflash(engine, ids, max_tokens=200, ignore_eos=True)
    monkeypatch.undo()
    assert max(verified) > engine.drafter.cfg.block_size
    assert out.token_ids == plain(engine, ids, max_tokens=200, ignore_eos=True).token_ids


def agreeing_lookups(engine, monkeypatch):
    """A prompt, its plain output, and a spy on the agreeing-lookup verifies of a fresh router
    (``spy_on_agreements``) where the text, looked up, is that output on from every point and
    the drafter (an ``Oracle`` returned with them) fails at its third slot."""
    ids = list(range(500, 530))
    free = plain(engine, ids, max_tokens=60, ignore_eos=True).token_ids

    def looked_up(tokens, num, *args):
        done = len(tokens) - len(ids)
        return free[done : done + num]

    seen = spy_on_agreements(monkeypatch, engine)  # a fresh router, after the drafter only
    monkeypatch.setattr(engine_mod, "lookup_draft", looked_up)
    return ids, free, seen, Oracle(len(ids), free, wrong_at=2)


def test_a_lookup_that_agrees_with_a_failing_block_is_verified_in_its_place(engine, monkeypatch):
    """The drafter's blocks fail at their third slot; the text, looked up, begins as they do
    and goes on right: once the router has seen that on a verify of a block, it verifies the
    lookup in its place, on past the drafter's block, and the output is still plain
    decoding's."""
    ids, free, seen, oracle = agreeing_lookups(engine, monkeypatch)
    monkeypatch.setattr(engine_mod, "draft_logits", oracle)
    out = dflash(engine, ids, max_tokens=60, ignore_eos=True)
    assert out.token_ids == free
    assert seen[0][:1] == (False,) and seen[0][2] == 2  # the block first, failing at slot 2
    lookups = [(n, accepted) for verified_lookup, n, accepted in seen if verified_lookup]
    slots = engine.drafter.cfg.block_size - 1
    assert lookups and max(accepted for _, accepted in lookups) > slots  # past the block


def test_a_lookup_whose_token_the_drafter_rules_out_where_they_part_is_not_a_candidate(
    engine, monkeypatch
):
    """As above, but the drafter is sure of its wrong third token (the lookup's right one at
    odds of e^-10 against it; every block 16 long, so that the two part within it): the
    lookup is neither verified nor counted among the agreements, and the output is still plain
    decoding's."""
    ids, free, seen, oracle = agreeing_lookups(engine, monkeypatch)
    monkeypatch.setattr(engine_mod, "draft_logits", lambda *a, **k: 10.0 * oracle(*a, **k))
    out = dflash(engine, ids, max_tokens=60, ignore_eos=True, block_size=16)
    assert out.token_ids == free
    assert seen == [] and out.stats["lookup_drafts"] == 0
    monkeypatch.setattr(engine_mod, "draft_logits", oracle)  # at odds of e^-1 it is
    assert dflash(engine, ids, max_tokens=60, ignore_eos=True, block_size=16).token_ids == free
    assert seen


def test_a_stop_among_accepted_drafts_counts_no_miss_after_it(engine, monkeypatch):
    """The drafts after a stop were never needed, and the target's choice after the end says
    nothing of the drafter: the router's acceptance counts end at the stop."""
    for start in range(2000, 4000, 100):  # a prompt whose output changes token early on
        ids = list(range(start, start + 30))
        free = plain(engine, ids, max_tokens=16, ignore_eos=True).token_ids
        fresh = [i for i in range(3, 7) if free[i] not in free[:i]]  # drafted at slot i - 1
        if fresh:
            stop = fresh[0]
            break
    seen = []
    real = engine.cost.observe_draft

    def spy(routing, kind, accepted, drafted):
        seen.append((accepted, drafted))
        real(routing, kind, accepted, drafted)

    monkeypatch.setattr(engine.cost, "observe_draft", spy)
    monkeypatch.setattr(engine.cost, "lookup_slots", lambda *args: 0)  # drafter blocks only
    # the first block drafts free[1:8], right up to the stop, wrong just after it
    monkeypatch.setattr(engine_mod, "draft_logits", Oracle(len(ids), free, wrong_at=stop))
    out = dflash(engine, ids, max_tokens=16, block_size=8, stop_token_ids=(free[stop],))
    assert out.token_ids == free[: stop + 1] and out.finish_reason == "stop"
    assert seen == [(stop, stop)]  # not (stop, 7): no miss counted past the stop


def test_memory_in_use_counts_what_live_requests_hold_and_nothing_after(engine):
    engine.prefix_cache.clear()
    engine.reset_memory_peak()
    cache = engine.cache
    per_token = 2 * sum(k.shape[1] * k.shape[3] * k.element_size() for k in cache.k)
    reqs = [engine.submit(list(range(10, 10 + n)), SamplingParams(max_tokens=20, ignore_eos=True,
                                                                  speculation=m))
            for n, m in ((40, "dflash"), (25, "off"))]
    for _ in range(3):
        engine.step()
    now = engine.memory_in_use()
    assert now.kv == per_token * sum(r.num_cached for r in reqs) > 0
    drafting, plain_row = reqs
    assert plain_row.draft_context is None
    assert now.draft == drafting.draft_context.num_bytes > 0
    # a context's storage holds at least its positions in every draft layer, keys and values
    cfg = engine.drafter.cfg
    per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert now.draft >= per_position * drafting.draft_context.length
    while engine.has_work:
        engine.step()
    peak = engine.memory_peak
    assert peak.kv >= now.kv and peak.draft >= now.draft
    assert engine.peak_total_bytes <= peak.total
    done = engine.memory_in_use()
    assert (done.kv, done.draft) == (0, 0)  # finished requests hold nothing
    # ...nor does a request its caller keeps for its result (its drafter context outlived it,
    # 11 times the engine's peak in a bench round)
    assert drafting.draft_context is None and drafting.kept_hidden is None
    assert drafting.pending_hidden == []
    cancelled = engine.submit(list(range(10, 50)), SamplingParams(max_tokens=20, ignore_eos=True,
                                                                   speculation="dflash"))
    engine.step()
    assert cancelled.draft_context is not None
    engine.cancel(cancelled)
    engine.step()
    assert cancelled.is_finished and cancelled.draft_context is None
    assert done.prefix == engine.prefix_cache.num_bytes > 0  # the cache keeps their sequences
    # the entries kept in the requests' last steps, beside their slots: in the peak too
    assert peak.prefix == done.prefix and engine.peak_total_bytes > done.prefix + now.kv
    weights = engine.weight_bytes()
    # the parameters, and the reordered copies oneDNN's matmul reads where it runs them
    reordered = {"target": reordered_bytes(engine.model),
                 "drafter": reordered_bytes(engine.drafter)}
    assert engine.reordered_weight_bytes() == reordered
    products = engine.runner.products
    assert reordered["target"] == sum(
        linear.weight.numel() * 4 for linear in _linears(engine.model, in_forward=True)
        if products is not None and products.on_onednn(linear))
    assert weights["target"] == sum(p.numel() * 4 for p in engine.model.parameters()) + reordered[
        "target"]
    assert weights["drafter"] == sum(
        p.numel() * 4 for p in engine.drafter.parameters()) + reordered["drafter"] > 0
    assert engine.kv_pool_bytes() == per_token * cache.k[0].shape[0] * cache.k[0].shape[2]


def test_a_pool_that_grows_mid_flight_changes_no_output(tiny_model_dir):
    # the pool starts at 256 positions a slot: a 300-token prompt arriving beside decoding rows
    # grows it (a copy of every slot, cached rows included) between two of their steps
    g = torch.Generator().manual_seed(5)
    engine = tiny_dflash_engine(tiny_model_dir, max_len=512)
    assert engine.cache.capacity == 256
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (20, 35, 300)]
    modes = ["dflash", "off", "dflash"]
    alone = [engine.generate(p, SamplingParams(max_tokens=40, ignore_eos=True, speculation=m))
             for p, m in zip(prompts, modes)]
    fresh = tiny_dflash_engine(tiny_model_dir, max_len=512)
    early = [fresh.submit(p, SamplingParams(max_tokens=40, ignore_eos=True, speculation=m))
             for p, m in zip(prompts[:2], modes[:2])]
    for _ in range(4):
        fresh.step()
    assert fresh.cache.capacity == 256 and all(len(r.output_ids) > 1 for r in early)
    late = fresh.submit(prompts[2], SamplingParams(max_tokens=40, ignore_eos=True,
                                                   speculation=modes[2]))
    while fresh.has_work:
        fresh.step()
    assert fresh.cache.capacity == 448  # 256 -> 320 for the prompt, -> 448 (400 in chunks)
    for req, ref in zip(early + [late], alone, strict=True):
        assert fresh.result(req).token_ids == ref.token_ids


def test_a_finished_sequences_entry_holds_no_more_hidden_states_than_it_counts(
    engine, monkeypatch
):
    """A stop among accepted drafts ends the sequence before the verified positions do: its
    entry's hidden states were a view of all of them (the prefix cache counted 43 positions and
    the entry kept 49 alive, in a demo run)."""
    for start in range(2000, 4000, 100):  # a prompt whose output changes token early on
        ids = list(range(start, start + 30))
        free = plain(engine, ids, max_tokens=16, ignore_eos=True).token_ids
        fresh = [i for i in range(3, 7) if free[i] not in free[:i]]
        if fresh:
            stop = fresh[0]
            break
    monkeypatch.setattr(engine.cost, "lookup_slots", lambda *args: 0)  # drafter blocks only
    monkeypatch.setattr(engine_mod, "draft_logits", Oracle(len(ids), free, wrong_at=8))
    engine.prefix_cache.clear()
    out = dflash(engine, ids, max_tokens=16, block_size=8, stop_token_ids=(free[stop],))
    assert out.token_ids == free[: stop + 1]
    entry = max(engine.prefix_cache._entries.values(), key=lambda e: len(e.tokens))
    assert len(entry.tokens) == len(ids) + stop + 1
    hidden = entry.hidden
    assert len(hidden) == len(entry.tokens)
    assert hidden.untyped_storage().nbytes() == hidden.numel() * hidden.element_size()
