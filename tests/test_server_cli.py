"""The command line of the server: ``agentflash serve`` as a real process (API key from the
environment), and ``agentflash bench-server``'s report on a tiny model."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
from typer.testing import CliRunner

from agentflash.cli import app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_up(proc: subprocess.Popen, root: str) -> None:
    """Until the served process answers /health (it loads its model first)."""
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(f"{root}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> str:
    """Ctrl-C the served process (killed if it will not end); its stderr."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[1]


def test_serve_runs_on_loopback_with_the_key_from_the_environment(tiny_model_dir):
    port = free_port()
    env = {**os.environ, "AGENTFLASH_API_KEY": "from-env"}
    proc = subprocess.Popen([sys.executable, "-m", "agentflash.cli", "serve", "--model",
                             str(tiny_model_dir), "--port", str(port), "--max-tokens", "16"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, root)
        assert httpx.get(f"{root}/v1/models").status_code == 401
        models = httpx.get(f"{root}/v1/models", headers={"authorization": "Bearer from-env"})
        assert [m["id"] for m in models.json()["data"]] == [tiny_model_dir.name]
        body = {"model": tiny_model_dir.name, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 32}
        reply = httpx.post(f"{root}/v1/chat/completions", json=body, timeout=60,
                           headers={"authorization": "Bearer from-env"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
    finally:
        err = stop(proc)
    assert f"on http://127.0.0.1:{port}/v1 (API key required)" in err


def test_serve_on_port_0_says_the_port_it_picked(tiny_model_dir):
    """It said "to serve on http://127.0.0.1:0/v1", and the port it bound was nowhere."""
    import re

    proc = subprocess.Popen([sys.executable, "-m", "agentflash.cli", "serve", "--model",
                             str(tiny_model_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or "serving" not in lines[-1]:
            lines.append(proc.stderr.readline())
            assert lines[-1], lines  # (the process ended)
        assert lines[0].startswith("agentflash serve: loading ") and "a free port" in lines[0]
        # (and --max-len's 2048, cut to the model's 1024 positions without a word)
        port = re.fullmatch(r"agentflash serve: serving \S+ on http://127\.0\.0\.1:(\d+)/v1 "
                            r"\(requests of at most 1024 tokens\)\n", lines[-1]).group(1)
        # listening once it says so (a client that connected at once was refused: uvicorn
        # listened only in its startup, after the line)
        socket.create_connection(("127.0.0.1", int(port)), timeout=10).close()
        wait_until_up(proc, f"http://127.0.0.1:{port}")
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    # uvicorn's access log went to stdout, alone of the command's lines
    assert out == "" and '"GET /health HTTP/1.1" 200' in err, (out, err)


def test_serve_names_a_bad_flag(tiny_model_dir):
    result = CliRunner().invoke(app, ["serve", "--model", "demo", "--max-tokens", "0"])
    assert result.exit_code == 2 and "--max-tokens must be a positive integer" in result.stderr
    result = CliRunner().invoke(app, ["serve", "--model", "demo", "--prefix-cache-mb", "-1"])
    assert result.exit_code == 2 and "--prefix-cache-mb must be 0 or more" in result.stderr
    result = CliRunner().invoke(app, ["serve", "--model", "demo", "--max-running", "0"])
    assert result.exit_code == 2 and "--max-running must be a positive integer" in result.stderr
    result = CliRunner().invoke(app, ["serve", "--model", "demo", "--kv-budget-mb", "0"])
    assert result.exit_code == 2 and "--kv-budget-mb must be positive" in result.stderr
    # an unset variable's value: "" bound every interface, and an empty name served the
    # model's (as an empty --api-key is refused)
    result = CliRunner().invoke(app, ["serve", "--model", "demo", "--host", ""])
    assert result.exit_code == 2 and "--host is empty" in result.stderr, result.stderr
    result = CliRunner().invoke(app, ["serve", "--model", "demo", "--served-model-name", " "])
    assert result.exit_code == 2 and "--served-model-name is empty" in result.stderr
    # the engine's own limit, before the model loads (it was said after "loading")
    result = CliRunner().invoke(app, ["serve", "--model", "demo", "--max-len", "1"])
    assert result.exit_code == 2 and "loading" not in result.stderr
    assert "--max-len must be an integer of at least 2, got 1" in result.stderr
    # a budget too small for one request of --max-len tokens: said before anything is served
    # (tiny model: 128 KiB of keys and values for 128 tokens)
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model_dir), "--port", "0",
                                      "--max-len", "128", "--kv-budget-mb", "0.05"])
    assert result.exit_code == 2
    assert "error: --kv-budget-mb 0.05 holds no request of 128 tokens" in result.stderr


def test_the_engine_limits_reach_the_engine(tiny_model_dir):
    from agentflash.server.app import ServerConfig, load_engine

    engine = load_engine(ServerConfig(model=str(tiny_model_dir), max_running=5, max_len=128,
                                      kv_budget_mb=0.4))
    assert engine.cache.num_slots == 3 and engine.scheduler.cfg.max_len == 128  # 128 KiB each
    engine = load_engine(ServerConfig(model=str(tiny_model_dir), max_running=5, max_len=256))
    assert engine.cache.num_slots == 5 and engine.scheduler.cfg.max_len == 256


def test_bench_server_reports_every_path_with_identical_tokens(tiny_model_dir):
    result = CliRunner().invoke(app, ["bench-server", "--model", str(tiny_model_dir),
                                      "--suites", "prose", "--num-prompts", "2",
                                      "--max-tokens", "8", "--concurrency", "1,2",
                                      "--rounds", "2", "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["config"]["num_requests"] == 2 and report["config"]["rounds"] == 2
    rows = {(r["path"], r["concurrency"]): r for r in report["rows"]}
    assert set(rows) == {(p, c) for p in ("engine", "http", "http-stream") for c in (1, 2)}
    for (path, _), row in rows.items():
        assert row["requests"] == 2 and row["rounds"] == 2 and row["same_tokens"]
        assert 0 < row["completion_tokens"][0] <= 8 and row["latency_mean_ms"] > 0
        assert (row["first_token_mean_ms"] is None) == (path == "http")
        if path == "engine":
            assert row["overhead_ms_per_request"] == 0 and row["overhead_pct"] == 0


def test_bench_server_refuses_more_in_flight_than_it_has_requests(tiny_model_dir):
    result = CliRunner().invoke(app, ["bench-server", "--model", str(tiny_model_dir),
                                      "--suites", "prose", "--num-prompts", "1",
                                      "--concurrency", "1,4"])
    assert result.exit_code == 2
    assert "--concurrency 4: at most 1 requests could be in flight" in result.stderr


def test_serve_loads_the_engine_off_the_main_thread(monkeypatch):
    # torch keeps an OpenMP team for every thread that ran it: a model loaded on the main
    # thread, which lives on, left two teams on 2 cores and the engine's steps ran 1.6x slower
    import threading

    import agentflash.server.app as server_app
    from agentflash.errors import UserError

    threads = []

    def load(config):
        threads.append(threading.current_thread())
        raise UserError("stop here")

    monkeypatch.setattr(server_app, "load_engine", load)
    result = CliRunner().invoke(app, ["serve", "--model", "demo", "--port", "0"])
    assert result.exit_code == 2 and "stop here" in result.stderr
    assert len(threads) == 1 and threads[0] is not threading.main_thread()
    assert not threads[0].is_alive()  # the loading thread ended with the loading


def test_serve_refuses_an_api_key_variable_set_and_empty(tiny_model_dir, monkeypatch):
    # a key meant and none given must not start a server without one
    monkeypatch.setenv("AGENTFLASH_API_KEY", "")
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model_dir), "--port", "0"])
    assert result.exit_code == 2 and "AGENTFLASH_API_KEY is set and empty" in result.stderr


def test_a_signal_ends_the_replies_in_flight_with_the_engine_stopped_error(tiny_model_dir):
    """On SIGTERM uvicorn waited out its 5 s grace with the replies going on, then cancelled
    them: a stream cut mid-chunk, a plain-text 500, a CancelledError traceback each."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentflash.cli", "serve", "--model",
                             str(tiny_model_dir), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = f"http://127.0.0.1:{port}"
    body = {"model": tiny_model_dir.name, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1024, "stream": True, "temperature": 1.0, "seed": 1}
    try:
        wait_until_up(proc, root)
        lines = []
        with httpx.stream("POST", f"{root}/v1/chat/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line and not lines:  # the first chunk: the reply is under way
                    proc.send_signal(signal.SIGTERM)
                lines.append(line)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "engine_stopped", lines[-3:]
    assert "Traceback" not in err and "CancelledError" not in err, err


def _ctrl_c_as_a_terminal_sends_it() -> None:
    """In the child before it runs: SIGINT neither blocked nor ignored, whatever the test
    process inherited or set (a mask and an ignored signal pass on to a child; the test timed
    out in full CI runs only, where a Ctrl-C never arrived)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_masks(pid: int) -> str:
    """The process's blocked, ignored and caught signals, as Linux shows them."""
    try:
        status = open(f"/proc/{pid}/status").read().splitlines()
    except OSError:
        return ""
    return " ".join(line for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def test_ctrl_c_while_the_model_loads_ends_the_command_at_once(tmp_path):
    """The load cannot be stopped (it runs in a thread of its own); the process waited for it
    after saying "interrupted" (or, left to finalize beside it, torch's threads aborted it)."""
    script = tmp_path / "serve_a_load_that_never_ends.py"
    script.write_text(
        "import sys, torch\n"
        "import agentflash.server.app as app\n"
        "def load(config):  # torch work that goes on, as a model's exactness probe does\n"
        "    print('loading', file=sys.stderr, flush=True)\n"
        "    x = torch.randn(256, 256)\n"
        "    while True:\n"
        "        x = torch.tanh(x @ x)\n"
        "app.load_engine = load\n"
        "from agentflash.cli import main\n"
        f"sys.argv = ['agentflash', 'serve', '--port', '{free_port()}']\n"
        "main()\n")
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ctrl_c_as_a_terminal_sends_it)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line == "loading\n":
                break
        signals = _signal_masks(proc.pid)
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[1]  # before: forever
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, lines + [rest, signals]
    assert rest.strip().endswith("error: interrupted"), rest


def test_an_error_past_the_commands_own_handling_while_a_model_loads_exits(tmp_path):
    """A load that never ends (its thread no daemon) held the exit of a process whose command
    ended in anything but SystemExit (a Ctrl-C re-raised as a cancelled wait, a bug): a hang."""
    script = tmp_path / "an_error_beside_a_load.py"
    script.write_text(
        "import sys, threading, time\n"
        "import agentflash.server.app as app\n"
        "from agentflash.engine.async_engine import LOAD_THREAD\n"
        "def serve(*args, **kwargs):\n"
        "    threading.Thread(target=time.sleep, args=(3600,), name=LOAD_THREAD).start()\n"
        "    raise RuntimeError('boom')\n"
        "app.serve = serve\n"
        "from agentflash.cli import main\n"
        f"sys.argv = ['agentflash', 'serve', '--port', '{free_port()}']\n"
        "main()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stderr.endswith("RuntimeError: boom\n"), done.stderr


def test_bench_server_compares_the_tokens_of_every_round_and_shows_a_middle_one():
    """A round that stopped early is the fastest and never the median round: "same tokens"
    compared that round alone and said yes. Of two rounds the faster is shown (the slower was)."""
    from agentflash.server.bench import _add_overheads, _median_rounds

    def row(path, latency, tokens):
        return {"path": path, "concurrency": 1, "latency_mean_ms": latency,
                "completion_tokens": tokens}

    measured = []
    for engine, http, tokens in ((100, 110, [32, 32]), (101, 60, [32, 7]), (99, 109, [32, 32])):
        measured += [row("engine", engine, [32, 32]), row("http", http, tokens),
                     row("http-stream", 112, [32, 32])]
    rows = _median_rounds(measured)
    _add_overheads(rows)
    assert [(r["path"], r["latency_mean_ms"], r["same_tokens"]) for r in rows] == [
        ("engine", 100, True), ("http", 109, False), ("http-stream", 112, True)]
    assert all("every_round_tokens" not in r for r in rows)
    two = _median_rounds([row("engine", 100, [1]), row("engine", 200, [1])])
    assert two[0]["latency_mean_ms"] == 100 and two[0]["rounds"] == 2
