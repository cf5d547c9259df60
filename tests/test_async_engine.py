"""The AsyncEngine: steps on its one engine thread, a failing step fails only its requests,
cancelled and abandoned streams free their slots."""

import dataclasses
import logging
import subprocess
import sys
import threading
import time

import anyio
import pytest

from agentflash.engine.async_engine import AsyncEngine, FinishEvent, TokenEvent, run_in_own_thread
from agentflash.engine.engine import Engine, EngineConfig
from agentflash.engine.request import SamplingParams
from agentflash.errors import UserError

LONG = SamplingParams(max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_pretrained(tiny_model_dir, EngineConfig(max_running=4, max_len=512))


def prompt(n: int) -> list[int]:
    return [100 + 7 * i + n for i in range(5 + n)]


async def wait_idle(engine: Engine) -> None:
    with anyio.fail_after(30):
        while engine.has_work:
            await anyio.sleep(0.01)


def assert_all_slots_free(engine: Engine) -> None:
    assert not engine.has_work and engine.cache.num_free == engine.cache.num_slots


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(engine, caplog, monkeypatch):
    # The forward that admits this prompt raises, as a kernel or a device would.
    bad_prompt = [11, 12, 4001]
    forward = engine.runner.forward

    def failing_forward(rows, *args, **kwargs):
        if any(r.start == 0 and r.tokens == bad_prompt for r in rows):
            raise IndexError("index out of range in self")
        return forward(rows, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", failing_forward)
    expected = engine.generate(prompt(3), SHORT)
    results = {}

    async def main():
        async with AsyncEngine(engine) as aengine:
            decoding = anyio.Event()

            async def running():  # decoding when the bad request is admitted
                async for event in aengine.stream(prompt(1), LONG):
                    decoding.set()
                    if isinstance(event, FinishEvent):
                        results["running"] = event.result

            async with anyio.create_task_group() as tg:
                tg.start_soon(running)
                await decoding.wait()
                results["bad"] = await aengine.generate(bad_prompt, SHORT)
            results["later"] = await aengine.generate(prompt(3), SHORT)
            await wait_idle(engine)

    with caplog.at_level(logging.ERROR, logger="agentflash.engine"):
        anyio.run(main)
    bad = results["bad"]
    assert bad.finish_reason == "error" and "IndexError" in bad.error
    assert bad.to_dict()["error"] == bad.error
    # the request decoding beside it either finished or failed with the step; none hangs
    assert results["running"].finish_reason in ("error", "length")
    assert results["later"].finish_reason == "length"
    assert results["later"].token_ids == expected.token_ids
    assert "error" not in results["later"].to_dict()
    assert_all_slots_free(engine)
    failures = [r for r in caplog.records if r.exc_info and r.exc_info[0] is IndexError]
    assert failures and failures[0].levelno == logging.ERROR  # logged with its traceback


def test_a_request_that_finished_in_a_step_that_then_raised_gets_its_end(engine, monkeypatch):
    """A decode step finishes a request (its max tokens) and raises after: the request is
    neither running nor waiting, yet its stream still gets its tokens and end."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    expected = engine.generate(prompt(2), params)

    def failing_observe(*args, **kwargs):
        raise RuntimeError("boom after the commit")

    monkeypatch.setattr(engine.cost, "observe_step", failing_observe)
    events = []

    async def main():
        async with AsyncEngine(engine) as aengine:
            with anyio.fail_after(30):
                async for event in aengine.stream(prompt(2), params):
                    events.append(event)
            await wait_idle(engine)

    anyio.run(main)
    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    assert finish.result.token_ids == expected.token_ids
    assert [t for e in events[:-1] for t in e.token_ids] == expected.token_ids
    assert "".join(e.text for e in events[:-1]) == expected.text
    assert_all_slots_free(engine)


def test_the_engine_is_not_stepped_beside_its_async_engine(engine):
    """Engine.generate (or step) from the loop while an AsyncEngine's thread steps the engine
    would race it: refused, and allowed again once the AsyncEngine is closed."""
    expected = engine.generate(prompt(1), SHORT)

    async def main():
        async with AsyncEngine(engine) as aengine:
            first = await aengine.generate(prompt(1), SHORT)
            with pytest.raises(UserError, match="an AsyncEngine serves this engine"):
                engine.generate(prompt(1), SHORT)
            with pytest.raises(UserError, match="an AsyncEngine serves this engine"):
                engine.step()
            with pytest.raises(UserError, match="another AsyncEngine serves this engine"):
                async with AsyncEngine(engine):
                    pass
            return first

    assert anyio.run(main).token_ids == expected.token_ids
    assert engine.generate(prompt(1), SHORT).token_ids == expected.token_ids
    assert_all_slots_free(engine)


def test_a_stream_from_another_event_loop_is_refused_not_left_waiting(engine):
    """The engine thread hands a request's events to the loop that opened the AsyncEngine: one
    asked for from another loop (Runner.run_sync in a sync tool, on the run's backend) waited
    forever."""
    async def main():
        async with AsyncEngine(engine) as aengine:
            def elsewhere():
                return anyio.run(aengine.generate, prompt(1), SHORT)

            with pytest.raises(UserError, match="opened in another event loop"):
                await anyio.to_thread.run_sync(elsewhere)
            return await aengine.generate(prompt(1), SHORT)  # its own loop: served

    assert len(anyio.run(main).token_ids) == SHORT.max_tokens
    assert_all_slots_free(engine)


def test_a_stream_whose_events_fail_ends_alone(engine, caplog):
    result = engine.result

    def fails_once(req):
        engine.result = result
        raise RuntimeError("injected")

    async def main():
        async with AsyncEngine(engine) as aengine:
            engine.result = fails_once
            with pytest.raises(AssertionError, match="without a FinishEvent"):
                await aengine.generate(prompt(1), SHORT)
            return await aengine.generate(prompt(1), SHORT)

    with caplog.at_level(logging.ERROR, logger="agentflash.engine"):
        later = anyio.run(main)
    del engine.result
    assert later.finish_reason == "length" and "cannot hand its tokens" in caplog.text
    assert_all_slots_free(engine)


def test_every_step_runs_on_the_one_engine_thread(engine):
    threads = []
    step = engine.step

    def recording_step():
        threads.append(threading.current_thread())
        return step()

    async def main():
        async with AsyncEngine(engine) as aengine:

            async def client(n):
                # work in anyio's worker threads beside the streams, as the server's preparing
                await anyio.to_thread.run_sync(time.sleep, 0.002)
                async for event in aengine.stream(prompt(n), SHORT):
                    if isinstance(event, TokenEvent):
                        await anyio.to_thread.run_sync(time.sleep, 0)

            async with anyio.create_task_group() as tg:
                for n in range(6):
                    tg.start_soon(client, n)

    engine.step = recording_step
    try:
        anyio.run(main)
    finally:
        del engine.step
    assert len(threads) > 12 and len(set(threads)) == 1
    assert threads[0].name == "agentflash-engine" and threads[0] is not threading.main_thread()
    assert not threads[0].is_alive()  # joined when the AsyncEngine closed


def test_cancelled_streams_free_their_slots(engine):
    finished = []

    async def main():
        async with AsyncEngine(engine) as aengine:

            async def leaves_early(n):
                async for _ in aengine.stream(prompt(n), LONG):
                    break

            async def times_out(n):
                with anyio.move_on_after(0.05):
                    async for _ in aengine.stream(prompt(n), LONG):
                        pass

            async def finishes(n):
                finished.append(await aengine.generate(prompt(n), SHORT))

            async with anyio.create_task_group() as tg:
                for n in range(3):
                    tg.start_soon(leaves_early, n)
                    tg.start_soon(times_out, n + 3)
                    tg.start_soon(finishes, n + 6)
            await wait_idle(engine)

    import gc
    import warnings

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", ResourceWarning)
        anyio.run(main)
        gc.collect()
    assert [r.finish_reason for r in finished] == ["length"] * 3
    assert_all_slots_free(engine)
    # a stream left early kept its sending end open: one "Unclosed <MemoryObjectSendStream>" each
    assert not [w for w in warned if issubclass(w.category, ResourceWarning)], warned


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_generate_frees_its_stream_as_it_returns(engine, backend):
    # its stream, left inside ``async for``, was closed when the loop finalized it: trio kept
    # the entry past the engine's exit
    async def main():
        async with AsyncEngine(engine) as aengine:
            result = await aengine.generate(prompt(1), SHORT)
            assert aengine._streams == {}
        return result

    assert anyio.run(main, backend=backend).finish_reason == "length"


def test_closing_the_async_engine_fails_the_requests_still_open(engine):
    results, deltas = [], []
    # a stop string every prefix of the reply begins: the stream holds all its text back
    whole = engine.generate(prompt(2), LONG).text
    params = dataclasses.replace(LONG, stop=(whole + "ZZZ",))

    async def main():
        async with anyio.create_task_group() as tg:
            async with AsyncEngine(engine) as aengine:
                decoding = anyio.Event()

                async def reader():
                    async for event in aengine.stream(prompt(2), params):
                        decoding.set()
                        if isinstance(event, FinishEvent):
                            results.append(event.result)
                        else:
                            deltas.append(event.text)

                tg.start_soon(reader)
                await decoding.wait()
        with pytest.raises(UserError, match="not running"):
            await aengine.generate(prompt(2), SHORT)

    anyio.run(main)
    assert results[0].finish_reason == "error" and "stopped" in results[0].error
    assert "".join(deltas) == results[0].text != ""  # the held text is sent before the end
    assert_all_slots_free(engine)


def test_run_in_own_thread_returns_or_raises_and_ends_its_thread():
    def where() -> threading.Thread:
        return threading.current_thread()

    def fails() -> None:
        raise ValueError("no such model")

    async def main():
        thread = await run_in_own_thread(where)
        with pytest.raises(ValueError, match="no such model"):
            await run_in_own_thread(fails)
        return thread

    thread = anyio.run(main)
    assert thread.name == "agentflash-load" and not thread.is_alive()


def test_a_cancelled_load_is_waited_for_when_the_process_exits(tmp_path):
    """A load cannot be stopped: a cancelled wait for it returns, and the process, exiting the
    usual way, waits for it (torch's threads still at work as it finalized aborted it)."""
    script = tmp_path / "cancel_a_load.py"
    script.write_text(
        "import time, anyio, torch\n"
        "from agentflash.engine.async_engine import loading, run_in_own_thread\n"
        "def load():  # torch work for 3 s, as a model's exactness probe does\n"
        "    x, end = torch.randn(256, 256), time.monotonic() + 3\n"
        "    while time.monotonic() < end:\n"
        "        x = torch.tanh(x @ x)\n"
        "async def main():\n"
        "    with anyio.move_on_after(0.3):\n"
        "        await run_in_own_thread(load)\n"
        "    print('cancelled while loading:', loading(), flush=True)\n"
        "anyio.run(main)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "cancelled while loading: True\n"
    assert "terminate called" not in done.stderr


def test_a_process_that_exits_while_its_engine_decodes_exits_cleanly(tmp_path):
    """A script that ends while a run is going, its backend never closed (a notebook's): the
    engine thread, a daemon, was still in a forward as the interpreter finalized, and the
    process aborted ("terminate called without an active exception", exit code 134)."""
    script = tmp_path / "exit_while_decoding.py"
    script.write_text(
        "import asyncio\n"
        "from agentflash.backends.base import Decoding\n"
        "from agentflash.backends.local import LocalBackend\n"
        "from agentflash.runtime import Agent, Runner\n"
        "agent = Agent('p', 'You help.', decoding=Decoding(max_tokens=1500))\n"
        "backend = LocalBackend('demo', max_running=16)\n"
        "async def main():\n"
        "    await backend.__aenter__()  # opened for the session, never closed\n"
        "    for i in range(16):  # steps of 16 rows: the interpreter finalizes within one\n"
        "        asyncio.get_running_loop().create_task(Runner.run(\n"
        "            agent, f'Write a long story about city {i} ' * 40, backend=backend))\n"
        "    await asyncio.sleep(3)  # the script ends while the runs decode\n"
        "asyncio.run(main())\n"
        "print('main done', flush=True)\n")
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr
        assert done.stdout == "main done\n"


def test_the_exit_hook_does_not_wait_on_a_thread_parked_for_a_stopped_loop(tiny_model_dir):
    """The hook waited (30 s) for an engine thread that waits to hand a step's tokens to an
    event loop that was stopped and will not run again (a notebook kernel restarted mid-run):
    that thread does no torch work; only one in a step is waited for."""
    import asyncio

    from agentflash.engine import async_engine

    engine = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_len=512))
    loop = asyncio.new_event_loop()
    aengine = AsyncEngine(engine)

    async def start():
        await aengine.__aenter__()

        async def consume():
            async for _ in aengine.stream([1, 2, 3], SamplingParams(max_tokens=400,
                                                                    ignore_eos=True)):
                pass

        loop.create_task(consume())
        await asyncio.sleep(0.2)

    loop.run_until_complete(start())  # stopped, not closed: the engine thread waits on it
    try:
        hook = threading.Thread(target=async_engine._stop_engines, args=(3600.0,))
        hook.start()
        hook.join(60)
        assert not hook.is_alive()
        assert not aengine._stepping
    finally:
        aengine._stopping = True
        loop.call_soon_threadsafe(loop.stop)
        loop.run_forever()  # let the parked thread hand its tokens over and end
        aengine._thread.join(10)
        async_engine._running.discard(aengine)
        loop.close()
