"""The shared engine under load: queueing beyond its limits, cancellations, no leaks."""

import random
import sys

import anyio
import pytest
from conftest import tiny_dflash_engine

from agentflash.engine.async_engine import AsyncEngine, FinishEvent
from agentflash.engine.engine import Engine, EngineConfig
from agentflash.engine.request import SamplingParams
from agentflash.errors import UserError


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_pretrained(tiny_model_dir, EngineConfig(max_running=6, max_len=128))


def test_hundreds_of_requests_with_random_cancellations_all_end_and_free_the_pool(engine):
    rng = random.Random(0)
    reqs = [
        engine.submit(
            [rng.randint(10, 4000) for _ in range(rng.randint(1, 30))],
            SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True),
        )
        for _ in range(300)
    ]
    cancelled = set(rng.sample(range(300), 60))
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        assert len(engine.scheduler.running) <= 6
        for i in list(cancelled):
            if rng.random() < 0.05:
                engine.cancel(reqs[i])
                cancelled.discard(i)
        assert steps < 300 * 14, "a request waits forever"
    assert all(r.is_finished for r in reqs)
    finished = [r for r in reqs if r.finish_reason.value == "length"]
    assert all(len(r.output_ids) == r.params.max_tokens for r in finished)
    assert len(finished) >= 240
    assert engine.cache.num_free == engine.cache.num_slots


def test_many_async_streams_with_cancellations(engine):
    rng = random.Random(1)

    async def main():
        done, cancelled = [], []
        async with AsyncEngine(engine) as aengine:

            async def client(i):
                ids = [rng.randint(10, 4000) for _ in range(rng.randint(1, 20))]
                with anyio.move_on_after(rng.choice([0.001, 0.01, 60])) as scope:
                    async for ev in aengine.stream(
                        ids, SamplingParams(max_tokens=10, ignore_eos=True)
                    ):
                        if isinstance(ev, FinishEvent):
                            done.append(ev.result)
                if scope.cancelled_caught:
                    cancelled.append(i)

            async with anyio.create_task_group() as tg:
                for i in range(120):
                    tg.start_soon(client, i)
            with anyio.fail_after(30):
                while engine.has_work:
                    await anyio.sleep(0.01)
        return done, cancelled

    done, cancelled = anyio.run(main)
    assert len(done) + len(cancelled) == 120
    assert all(len(r.token_ids) == 10 for r in done)
    assert engine.cache.num_free == engine.cache.num_slots


def test_kv_budget_caps_slots_and_rejects_a_budget_that_holds_nothing(tiny_model_dir):
    # tiny model: 4 layers x 2 kv heads x 16 dims x 128 positions x 4 bytes x (k, v) = 128 KiB a slot  # noqa: E501
    e = Engine.from_pretrained(
        tiny_model_dir, EngineConfig(max_running=8, max_len=128, kv_budget_mb=0.4)
    )
    assert e.cache.num_slots == 3
    # a budget of more bytes than a float holds (1e308 MB): max_running's slots (a ValueError,
    # "cannot convert float NaN to integer", a traceback out of serve --kv-budget-mb 1e308)
    e = Engine.from_pretrained(
        tiny_model_dir, EngineConfig(max_running=4, max_len=128, kv_budget_mb=1e308))
    assert e.cache.num_slots == 4
    e = Engine.from_pretrained(  # and a prefix cache of as many: no bound (an OverflowError)
        tiny_model_dir, EngineConfig(max_len=128, prefix_cache_mb=1e308))
    assert e.prefix_cache.budget_bytes == sys.maxsize
    with pytest.raises(UserError, match="holds no request"):
        Engine.from_pretrained(tiny_model_dir, EngineConfig(max_len=128, kv_budget_mb=0.05))
    # a drafter's contexts come out of the same budget: one layer x 2 kv heads x 16 dims x
    # 192 positions (128, a block of 16 and a quarter's room to grow, in chunks of 64) x 4 bytes
    # x (k, v) = 48 KiB a request, so 0.4 MB holds two requests where it held three
    drafting = tiny_dflash_engine(tiny_model_dir, max_len=128)
    assert drafting.drafter.context_bytes(128) == 48 * 2**10

    def slots(**config):
        config = EngineConfig(max_running=8, max_len=128, **config)
        e = Engine(drafting.model, drafting.tokenizer, config, tiny_model_dir, drafting.drafter)
        return e.cache.num_slots

    assert slots(kv_budget_mb=0.4, prefix_cache_mb=0) == 2
    # ...and with the prefix cache on, the target hidden states a drafting request keeps for its
    # finished sequence's entry (they were left out: 0.4 MB held two requests of 240 KiB): 128
    # positions x 2 layers x 64 x 4 bytes = 64 KiB, as many positions as the cache's longest
    # entry (1.5 KiB a position with its keys and values), up to max_len, none below 32
    assert slots(kv_budget_mb=0.4) == 1
    assert slots(kv_budget_mb=0.42, prefix_cache_mb=0.09375) == 2  # 64 positions: 32 KiB
    assert slots(kv_budget_mb=0.42, prefix_cache_mb=0.09375 * 2) == 1
    assert slots(kv_budget_mb=0.4, prefix_cache_mb=31 * 1.5 / 2**10) == 2  # under 32 positions
    config = EngineConfig(max_running=8, max_len=128, kv_budget_mb=0.13)
    need = (r"needs 0.12 MB of keys and values and 0.05 MB of drafter context and 0.06 MB of "
            r"hidden states kept for the prefix cache")
    with pytest.raises(UserError, match=need):
        Engine(drafting.model, drafting.tokenizer, config, tiny_model_dir, drafting.drafter)
    Engine(drafting.model, drafting.tokenizer, config, tiny_model_dir)  # fits without a drafter
    # a slot holds whole chunks of 64 positions: 129 tokens take 192, 192 KiB a slot, so 0.4 MB
    # holds two (three at 129 positions each overran the budget by half)
    e = Engine.from_pretrained(
        tiny_model_dir, EngineConfig(max_running=8, max_len=129, kv_budget_mb=0.4))
    assert e.cache.num_slots == 2
    e.cache.ensure(129)
    assert e.kv_pool_bytes() <= 0.4 * 2**20


def test_waiting_requests_are_prefilled_together_within_the_token_budget(engine):
    prompts = [[11 + i] * (5 + 3 * i) for i in range(4)]
    reqs = [engine.submit(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in prompts]
    outputs = engine.step()
    assert [o.request for o in outputs] == reqs  # four prompts, one forward
    assert all(len(r.output_ids) == 1 and r.num_cached == len(r.prompt_ids) for r in reqs)
    while engine.has_work:
        engine.step()
    alone = [engine.generate(p, SamplingParams(max_tokens=3, ignore_eos=True)).token_ids
             for p in prompts]
    assert [r.output_ids for r in reqs] == alone


def test_new_requests_take_the_lowest_free_slots(engine):
    """Running requests stay packed in the first slots, whatever order the last ones ended in:
    the one-token rows of a step attend in one batch over slots 0 .. the highest."""
    cache = engine.cache
    held = [cache.allocate() for _ in range(cache.num_slots)]
    assert held == list(range(cache.num_slots))
    for slot in (3, 1, 2, 0):
        cache.release(slot)
    assert [cache.allocate() for _ in range(2)] == [0, 1]
    for slot in set(held) - {2, 3}:
        cache.release(slot)
    assert cache.num_free == cache.num_slots
