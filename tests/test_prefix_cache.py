"""The prefix cache: a prompt that begins like a cached one prefills only the rest, and gets
exactly the tokens it gets without the cache."""

import pytest
import torch
from conftest import tiny_dflash_engine

from agentflash.engine.prefix_cache import PrefixCache
from agentflash.engine.request import SamplingParams

KV_LAYERS = 2


def kv(length: int, value: float = 1.0) -> list[torch.Tensor]:
    return [torch.full((2, length, 4), value) for _ in range(2 * KV_LAYERS)]


def entry_bytes(length: int, hidden: bool = False) -> int:
    return 4 * (2 * KV_LAYERS * 2 * length * 4 + (length * 8 if hidden else 0))


def test_lookup_takes_the_longest_shared_beginning_but_never_the_last_token():
    cache = PrefixCache(budget_bytes=10**6, min_tokens=4)
    cache.insert(list(range(10)), kv(10), None)
    cache.insert([0, 1, 2, 3, 4, 5, 99, 98], kv(8), None)
    hit = cache.lookup(list(range(20)), with_hidden=False)
    assert hit.length == 10 and list(hit.entry.tokens) == list(range(10))
    assert cache.lookup([0, 1, 2, 3, 4, 5, 99, 7, 7], with_hidden=False).length == 7
    assert cache.lookup(list(range(10)), with_hidden=False).length == 9  # one left to feed
    assert cache.lookup([0, 1, 2, 7, 7, 7], with_hidden=False) is None  # under min_tokens
    assert cache.lookup([5, 1, 2, 3, 4, 5], with_hidden=False) is None


def test_lookup_for_a_drafting_request_needs_hidden_states():
    cache = PrefixCache(budget_bytes=10**6, min_tokens=2)
    cache.insert([1, 2, 3, 4], kv(4), None)
    assert cache.lookup([1, 2, 3, 4, 5], with_hidden=True) is None
    cache.insert([1, 2, 3], kv(3), torch.zeros(3, 8))  # kept: it carries what the other lacks
    hit = cache.lookup([1, 2, 3, 4, 5], with_hidden=True)
    assert hit.length == 3 and hit.entry.hidden is not None
    assert cache.lookup([1, 2, 3, 4, 5], with_hidden=False).length == 4


def test_covered_entries_go_and_the_least_recent_is_evicted_within_the_budget():
    cache = PrefixCache(budget_bytes=2 * entry_bytes(10) + 1, min_tokens=2)
    cache.insert([1, 2, 3, 4], kv(4), None)
    cache.insert(list(range(1, 11)), kv(10), None)  # covers [1, 2, 3, 4]
    assert len(cache) == 1 and cache.num_bytes == entry_bytes(10)
    cache.insert([1, 2, 3], kv(3), None)  # covered by what is there
    assert len(cache) == 1
    cache.insert(list(range(20, 30)), kv(10), None)
    cache.lookup(list(range(1, 12)), with_hidden=False)  # the first is now the most recent
    cache.insert(list(range(40, 50)), kv(10), None)
    assert len(cache) == 2 and cache.num_bytes <= cache.budget_bytes
    assert cache.lookup(list(range(20, 31)), with_hidden=False) is None  # evicted
    assert cache.lookup(list(range(1, 12)), with_hidden=False).length == 10
    cache.insert(list(range(100, 200)), kv(100), None)  # larger than the budget: not kept
    assert len(cache) == 2
    # ... nor does one that begins with a kept entry take that entry with it (a turn whose
    # answer outgrew the budget dropped its prompt's entry, which the next turn would reuse)
    cache.insert(list(range(1, 101)), kv(100), None)
    assert len(cache) == 2 and cache.lookup(list(range(1, 12)), with_hidden=False).length == 10
    cache.clear()
    assert len(cache) == 0 and cache.num_bytes == 0


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return tiny_dflash_engine(tiny_model_dir)


def two_turns(engine):
    first = engine.chat_prompt([{"role": "system", "content": "You are an agent. " * 8},
                                {"role": "user", "content": "Book a table for two."}])
    second = first + engine.tokenizer("<tool_call>\n{}\n</tool_call><|im_end|>\n<|im_start|>"
                                      "user\nIt is booked. Anything else?<|im_end|>\n"
                                      "<|im_start|>assistant\n")["input_ids"]
    return first, second


@pytest.mark.parametrize("speculation", ["off", "dflash", "auto"])
def test_the_next_turn_prefills_only_what_is_new_and_writes_the_same_tokens(engine, speculation):
    first, second = two_turns(engine)
    block = 8 if speculation == "dflash" else None  # not the router's: it learns as it runs
    params = SamplingParams(max_tokens=24, ignore_eos=True, speculation=speculation,
                            block_size=block)
    engine.prefix_cache.clear()
    engine.generate(first, params)
    warm = engine.generate(second, params)
    engine.prefix_cache.clear()
    cold = engine.generate(second, params)
    assert warm.stats["cached_prompt_tokens"] == len(first)
    assert cold.stats["cached_prompt_tokens"] == 0
    assert warm.token_ids == cold.token_ids
    if speculation == "dflash":  # the drafter's context resumed from the cached hidden states
        assert warm.stats["tau"] == cold.stats["tau"]
        assert warm.stats["draft_forwards"] == cold.stats["draft_forwards"]


@pytest.mark.parametrize("speculation", ["off", "dflash", "auto"])
def test_a_next_turn_that_repeats_the_answer_prefills_only_what_follows_it(engine, speculation):
    """The finished sequence is kept, answer included: an agent's next turn re-sends it."""
    first, _ = two_turns(engine)
    block = 8 if speculation == "dflash" else None
    params = SamplingParams(max_tokens=24, ignore_eos=True, speculation=speculation,
                            block_size=block)
    engine.prefix_cache.clear()
    answer = engine.generate(first, params).token_ids
    second = first + answer + engine.tokenizer("<|im_end|>\n<|im_start|>user\nThanks.<|im_end|>"
                                               "\n<|im_start|>assistant\n")["input_ids"]
    warm = engine.generate(second, params)
    engine.prefix_cache.clear()
    cold = engine.generate(second, params)
    # every answer token but the last was fed back (the last too, where a verify ran past it)
    assert warm.stats["cached_prompt_tokens"] >= len(first) + len(answer) - 1
    assert cold.stats["cached_prompt_tokens"] == 0
    assert warm.token_ids == cold.token_ids
    if speculation == "dflash":  # the drafter resumed from the answer's hidden states too
        assert warm.stats["tau"] == cold.stats["tau"]
        assert warm.stats["draft_forwards"] == cold.stats["draft_forwards"]
    assert engine.prefix_cache.num_bytes <= engine.prefix_cache.budget_bytes


def test_a_drafting_request_skips_entries_without_hidden_states(engine):
    first, second = two_turns(engine)
    engine.prefix_cache.clear()
    engine.generate(first, SamplingParams(max_tokens=4, speculation="off"))  # nothing captured
    params = SamplingParams(max_tokens=16, ignore_eos=True, speculation="dflash", block_size=8)
    missed = engine.generate(second, params)
    assert missed.stats["cached_prompt_tokens"] == 0
    hit = engine.generate(second, params)  # the first dflash request left its hidden states
    assert hit.stats["cached_prompt_tokens"] == len(second) - 1
    assert hit.token_ids == missed.token_ids and hit.stats["tau"] == missed.stats["tau"]


def test_requests_sharing_a_system_prompt_in_one_batch_match_their_runs_alone(engine):
    system = {"role": "system", "content": "Answer briefly and call tools when needed. " * 6}
    prompts = [engine.chat_prompt([system, {"role": "user", "content": f"Question {i}?"}])
               for i in range(7)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, speculation="auto")
    alone = []
    for ids in prompts:
        engine.prefix_cache.clear()
        alone.append(engine.generate(ids, params).token_ids)
    engine.prefix_cache.clear()
    reqs = [engine.submit(ids, params) for ids in prompts]  # 4 run at once, 3 queue
    while not all(r.is_finished for r in reqs):
        engine.step()
    assert [r.output_ids for r in reqs] == alone
    assert any(r.stats.cached_prompt_tokens > 0 for r in reqs)
    assert engine.scheduler.cache.num_free == engine.scheduler.cfg.max_running
    assert engine.prefix_cache.num_bytes <= engine.prefix_cache.budget_bytes


def test_an_entry_is_a_copy_that_a_slots_next_request_cannot_change(engine):
    """A prompt of one chunk of exact attention's values (64 tokens) kept a view of its slot:
    the next request in that slot rewrote the entry, and a prompt beginning with it decoded
    from other values than without the cache."""
    first = engine.chat_prompt([{"role": "user", "content": "Tell me about cats. " * 20}])[:64]
    other = engine.chat_prompt([{"role": "user", "content": "Reverse a list in Python. " * 8}])
    params = SamplingParams(max_tokens=12, ignore_eos=True, speculation="off")
    engine.prefix_cache.clear()
    engine.generate(first, SamplingParams(max_tokens=1, speculation="off"))
    (entry,) = engine.prefix_cache._entries.values()
    kept = [t.clone() for t in entry.kv]
    pool = {t.untyped_storage().data_ptr() for t in engine.cache.k + engine.cache.v}
    assert not pool & {t.untyped_storage().data_ptr() for t in entry.kv}
    engine.generate(other, SamplingParams(max_tokens=1, speculation="off"))  # the same slot
    assert all(torch.equal(a, b) for a, b in zip(entry.kv, kept))
    follows = first + other[:20]
    hit = engine.generate(follows, params)
    assert hit.stats["cached_prompt_tokens"] == 64
    engine.prefix_cache.clear()
    assert hit.token_ids == engine.generate(follows, params).token_ids


def test_a_zero_budget_keeps_nothing(tiny_model_dir):
    from agentflash.engine.engine import Engine, EngineConfig
    from agentflash.models.loading import load_model, load_tokenizer

    model, _, _ = load_model(tiny_model_dir)
    engine = Engine(model, load_tokenizer(tiny_model_dir), EngineConfig(prefix_cache_mb=0))
    first, second = two_turns(engine)
    engine.generate(first, SamplingParams(max_tokens=4))
    assert engine.generate(second, SamplingParams(max_tokens=4)).stats["cached_prompt_tokens"] == 0
    assert len(engine.prefix_cache) == 0
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        EngineConfig(prefix_cache_mb=-1)


def test_without_exact_attention_the_cache_still_serves_the_next_turn(tiny_model_dir):
    """Off the CPU the engine attends with SDPA (``batch_invariant=False``, as here): a hit then
    equals a full prefill up to rounding, like batching; the slot layout is the plain one."""
    from agentflash.engine.engine import Engine, EngineConfig
    from agentflash.models.loading import load_model, load_tokenizer

    model, _, _ = load_model(tiny_model_dir)
    engine = Engine(model, load_tokenizer(tiny_model_dir), EngineConfig(batch_invariant=False))
    assert not engine.cache.exact
    first, second = two_turns(engine)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.generate(first, params)
    warm = engine.generate(second, params)
    engine.prefix_cache.clear()
    cold = engine.generate(second, params)
    assert warm.stats["cached_prompt_tokens"] == len(first)
    assert warm.token_ids == cold.token_ids


def with_prefix_budget(engine, tiny_model_dir, budget_bytes: int, **config):
    """``engine``'s target and drafter, with a prefix cache of ``budget_bytes``."""
    from agentflash.engine.engine import Engine, EngineConfig

    config = EngineConfig(prefix_cache_mb=budget_bytes / 2**20, **config)
    return Engine(engine.model, engine.tokenizer, config, tiny_model_dir, engine.drafter)


# the tiny target and drafter: keys and values 4 layers x 2 kv heads x 16 dims x (k, v) x 4 bytes
# = 1 KiB a position; the hidden states the drafter reads 2 layers x 64 x 4 bytes = 512 bytes
ENTRY_POSITION = 1024 + 512


def test_memory_in_use_counts_the_hidden_states_drafting_requests_keep(engine):
    """A drafting request keeps its positions' hidden states for its finished sequence's entry:
    they were counted nowhere (28% on top of what memory_in_use said in a demo run)."""
    engine.prefix_cache.clear()
    engine.reset_memory_peak()
    first, _ = two_turns(engine)
    drafting = engine.submit(first, SamplingParams(max_tokens=24, ignore_eos=True,
                                                   speculation="dflash", block_size=8))
    plain_row = engine.submit(first[:-3], SamplingParams(max_tokens=24, ignore_eos=True,
                                                         speculation="off"))
    for _ in range(3):
        engine.step()
    assert plain_row.kept_hidden is None
    kept = drafting.kept_hidden
    assert sum(len(t) for t in kept) == drafting.num_cached  # every cached position's
    now = engine.memory_in_use()
    # its prompt's states are its prompt's entry's (the same tensor, counted in the cache)
    assert now.kept == 512 * (drafting.num_cached - len(first)) > 0
    assert engine.prefix_cache.holds(kept[0]) and engine.drafter.hidden_bytes(1) == 512
    assert now.total == now.kv + now.draft + now.prefix + now.kept
    engine.prefix_cache.clear()  # the request alone holds them now
    assert engine.memory_in_use().kept == 512 * drafting.num_cached
    assert engine.memory_peak.kept > 0
    while engine.has_work:
        engine.step()
    assert engine.memory_in_use().kept == 0


def test_nothing_is_kept_where_no_entry_with_hidden_states_fits(engine, tiny_model_dir):
    """A budget below the shortest entry (32 positions) kept nothing, yet every drafting
    request kept its states and copied its keys and values for an entry the cache refused."""
    first, _ = two_turns(engine)
    params = SamplingParams(max_tokens=24, ignore_eos=True, speculation="dflash", block_size=8)
    small = with_prefix_budget(engine, tiny_model_dir, 32 * ENTRY_POSITION - 1)
    copies = []
    cached = small.cache.cached
    small.cache.cached = lambda slot, n: copies.append(n) or cached(slot, n)
    req = small.submit(first, params)
    small.step()
    assert req.kept_hidden is None and small.memory_in_use().kept == 0
    while small.has_work:
        small.step()
    assert copies == [] and len(small.prefix_cache) == 0
    assert req.output_ids == engine.generate(first, SamplingParams(
        max_tokens=24, ignore_eos=True, speculation="off")).token_ids


def test_a_request_stops_keeping_once_its_entry_outgrows_the_budget(engine, tiny_model_dir):
    """Its prompt's entry fits, its finished sequence's does not: it keeps its states until
    its cached positions' entry could not fit, then frees them and offers nothing at the end."""
    first, _ = two_turns(engine)
    fits = len(first) + 5  # positions an entry may have
    params = SamplingParams(max_tokens=24, ignore_eos=True, speculation="dflash", block_size=8)
    small = with_prefix_budget(engine, tiny_model_dir, fits * ENTRY_POSITION)
    req = small.submit(first, params)
    seen = []
    while small.has_work:
        small.step()
        if not req.is_finished:
            seen.append((req.num_cached, req.kept_hidden is not None))
    assert all(kept == (cached <= fits) for cached, kept in seen)
    assert any(kept for _, kept in seen) and not all(kept for _, kept in seen)
    (entry,) = small.prefix_cache._entries.values()  # the prompt's alone
    assert len(entry.tokens) == len(first)
    # a budget of exactly the finished sequence's entry keeps it
    n = min(req.num_cached, req.num_tokens)
    exact = with_prefix_budget(engine, tiny_model_dir, n * ENTRY_POSITION)
    again = exact.generate(first, params)
    assert again.token_ids == req.output_ids
    assert [len(e.tokens) for e in exact.prefix_cache._entries.values()] == [n]
    assert exact.prefix_cache.num_bytes == exact.prefix_cache.budget_bytes


def test_a_prompt_that_hit_an_entry_without_states_still_offers_its_keys_and_values(
        engine, tiny_model_dir):
    """A plain request admitted beside a drafting one has its prompt's states captured; its
    prompt hit an entry of keys and values alone, so its own entry holds them alone too, and
    that fits where one with states would not: it was offered nothing (ba23fda)."""
    first, second = two_turns(engine)
    kv_position = 1024  # the tiny model's keys and values a position (ENTRY_POSITION less 512)
    small = with_prefix_budget(engine, tiny_model_dir, (len(second) + 2) * kv_position,
                               max_running=4)
    off = SamplingParams(max_tokens=4, ignore_eos=True, speculation="off")
    small.generate(first, off)  # alone: nothing captured, an entry of keys and values
    plain = small.submit(second, off)
    drafting = small.submit(engine.chat_prompt([{"role": "user", "content": "x"}]),
                            SamplingParams(max_tokens=4, speculation="dflash"))
    while not (plain.is_finished and drafting.is_finished):
        small.step()
    assert plain.stats.cached_prompt_tokens == len(first)
    assert len(second) in [len(e.tokens) for e in small.prefix_cache._entries.values()]
