"""The runtime's ``openai`` backend against ``agentflash serve`` on loopback: the example workflows
give the same results as on the embedded engine (greedy), a workflow selects the backend in YAML,
and failures are retried or reported clearly (a real server with injected failures)."""

import importlib.util
import json
import socket
import sys
from dataclasses import replace
from pathlib import Path

import anyio
import httpx
import pytest

from agentflash.backends import create_backend
from agentflash.backends.base import (
    Decoding,
    ForceTool,
    MalformedToolCall,
    ModelFinish,
    ModelRequest,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallReady,
    ToolChoice,
)
from agentflash.backends.local import LocalBackend, load_weights
from agentflash.backends.openai import (
    OpenAIBackend,
    RetryPolicy,
    ServerUnavailable,
    _ChunkReader,
    request_body,
)
from agentflash.engine.engine import Engine, EngineConfig
from agentflash.errors import UserError
from agentflash.runtime import load_workflow
from agentflash.server.app import ServerConfig, create_app, running_in_thread

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
INPUTS = {"travel": {"city": "Oslo", "days": 3}, "handoff": {"city": "Lima"},
          "structured": {"city": "Rome"}}
FAST_RETRY = RetryPolicy(max_retries=2, backoff_s=0.01, max_backoff_s=0.05)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(EXAMPLES))
flights_server = _load("flights_server")


@pytest.fixture(scope="module")
def flights():
    try:
        with flights_server.serving():
            yield
    except OSError:  # another process serves it on its fixed port: use that one
        httpx.get(f"http://127.0.0.1:{flights_server.PORT}/flights", params={"to": "Oslo"},
                  timeout=5).raise_for_status()
        yield


def _chunk(delta=None, finish=None):
    chunk = {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


SSE = b"text/event-stream"
QUIRKS = {
    # a proxy's keep-alive comments while the upstream is stuck: 1 s of them
    "keepalive": (SSE, [_chunk({"content": "he"})] + [b": keep-alive\n\n", None] * 10),
    # the headers at once, then nothing (a server that queues the request after answering 200)
    "silent": (SSE, [None] * 10),
    "broken": (SSE, ["break"]),  # the headers, then the connection breaks
    "event-error": (SSE, [_chunk({"content": "he"}), b"event: error\ndata: "
                          b'{"message": "model overloaded", "code": 503}\n\n']),
    "object-error": (SSE, [b'data: {"object": "error", "message": "KV cache full", '
                           b'"type": "InternalServerError", "code": 500}\n\n']),
    "json-200": (b"application/json", [b'{"error": {"message": "quota exceeded"}}']),
    # named keep-alives while the upstream is stuck: they reset no timeout either
    "pings": (SSE, [_chunk({"content": "he"})] + [b"event: ping\ndata: {}\n\n", None] * 10),
    # a chunk that says it has no error
    "error-null": (SSE, [b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}, '
                         b'"finish_reason": "stop"}], "error": null}\n\n']),
    "abort": (SSE, [_chunk({"content": "The answer"}), _chunk({"content": " is"}, "ABORT"),
                    b"data: [DONE]\n\n"]),
    # the second call closes before the first: the model wrote get_weather first
    "late-first": (SSE, [
        _chunk({"tool_calls": [{"index": 0, "id": "a", "function": {
            "name": "get_weather", "arguments": '{"city": '}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "b", "function": {
            "name": "get_time", "arguments": '{"zone": "UTC"}'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
        _chunk(finish="tool_calls")]),
    # the answer whole, then the connection breaks or falls silent before the usage and [DONE]
    "drop-after-finish": (SSE, [_chunk({"content": "Hi"}), _chunk(finish="stop"), "break"]),
    "silent-after-finish": (SSE, [_chunk({"content": "Hi"}), _chunk(finish="stop")]
                            + [None] * 10),
    "empty": (SSE, []),  # a 200 and no body
    # an event stream under another name (a RAG proxy's text/plain, LitServe's ndjson)
    "sse-as-text": (b"text/plain; charset=utf-8", [_chunk({"content": "Hi"}),
                                                   _chunk(finish="stop")]),
    # a server without a tool-call parser: the model's Hermes call comes as text
    "hermes-text": (SSE, [_chunk({"content": "Let me check.\n<tool_"}),
                          _chunk({"content": 'call>\n{"name": "get_weather", "arguments": '}),
                          _chunk({"content": '{"city": "Oslo", "days": 2}}\n</tool_call>'}),
                          _chunk(finish="stop")]),
    # a proxy's plain text with status 200: read as a stream with no data, asked again, lost
    "text-200": (b"text/plain", [b"upstream request timeout: model worker\noverloaded"]),
    "bad-arguments": (SSE, [_chunk({"tool_calls": [{"index": 0, "id": "c", "function": {
        "name": "f", "arguments": {"x": 1}}}]}), _chunk(finish="tool_calls")]),
    # an output schema's answer that quotes the tag, as serve sends it
    "answer-quoting-the-tag": (SSE, [_chunk({"content": '{"tip": "wrap calls in <tool_'}),
                                     _chunk({"content": 'call> tags"}'}), _chunk(finish="stop")]),
}


class Flaky:
    """An ASGI wrapper that answers the next chat requests with the given failures ("stall":
    no answer for 2 s; "cut": a reply stream that stops short) before passing requests on to
    the real app; it counts the attempts."""

    def __init__(self, app):
        self.app, self.failures, self.attempts, self.query = app, [], 0, b""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
            self.attempts += 1
            self.query = scope["query_string"]
            if self.failures:
                failure = self.failures.pop(0)
                if failure == "cut":  # a stream that ends, cleanly, in the middle of the reply
                    chunk = {"choices": [{"index": 0, "delta": {"content": "he"},
                                          "finish_reason": None}]}
                    await send({"type": "http.response.start", "status": 200,
                                "headers": [(b"content-type", b"text/event-stream")]})
                    await send({"type": "http.response.body",
                                "body": f"data: {json.dumps(chunk)}\n\n".encode()})
                    return
                if failure in QUIRKS:  # a reply as a quirky server or proxy sends it
                    kind, pieces = QUIRKS[failure]
                    await send({"type": "http.response.start", "status": 200,
                                "headers": [(b"content-type", kind)]})
                    for piece in pieces:
                        if piece == "break":  # the connection drops (uvicorn aborts it)
                            raise RuntimeError("injected: the connection breaks")
                        if piece is None:
                            await anyio.sleep(0.1)
                            continue
                        await send({"type": "http.response.body", "body": piece,
                                    "more_body": True})
                    await send({"type": "http.response.body", "body": b""})
                    return
                if failure == "503-cut":  # an error whose body breaks off
                    await send({"type": "http.response.start", "status": 503, "headers": [
                        (b"content-type", b"application/json"), (b"content-length", b"200")]})
                    await send({"type": "http.response.body", "body": b'{"error": ',
                                "more_body": True})
                    raise RuntimeError("injected: the connection breaks")
                if failure == "html-502":  # a proxy's error page: its title, on one line
                    await send({"type": "http.response.start", "status": 502,
                                "headers": [(b"content-type", b"text/html")]})
                    await send({"type": "http.response.body", "body": (
                        b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
                        b"<center><h1>502 Bad Gateway</h1></center>\r\n</body>\r\n</html>\r\n")})
                    return
                if failure == "stall":
                    await anyio.sleep(2.0)
                    failure = 503
                body = json.dumps({"error": {"message": "injected", "type": "server_error",
                                             "param": None, "code": None}}).encode()
                await send({"type": "http.response.start", "status": failure, "headers": [
                    (b"content-type", b"application/json"), (b"retry-after", b"0")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def run(wf, inputs, backend=None):
    async def go():
        if backend is None:
            return await wf.run(inputs)
        async with backend:
            return await wf.run(inputs, backend=backend)
    return anyio.run(go)


def summary(result):
    return {"outputs": result.outputs,
            "steps": {k: (s.agent, [c.to_dict() for c in s.tool_calls])
                      for k, s in result.steps.items()}}


@pytest.fixture(scope="module")
def engine():
    net, tokenizer, model_dir, drafter = load_weights("demo")
    return Engine(net, tokenizer, EngineConfig(max_len=1024), model_dir, drafter)


@pytest.fixture(scope="module")
def embedded(engine, flights):
    """The examples on the embedded engine, run before the server takes the engine over."""
    out = {}
    for name, inputs in INPUTS.items():
        wf = load_workflow(EXAMPLES / f"{name}.yaml")
        try:
            out[name] = summary(run(wf, wf.resolve_inputs(inputs), LocalBackend(engine=engine)))
        except Exception as err:  # a run the demo model fails must fail the same way remotely
            out[name] = f"{type(err).__name__}: {err}"
    return out


@pytest.fixture(scope="module")
def server(engine, embedded):
    app = Flaky(create_app(ServerConfig(port=0, max_tokens=512), engine))
    with running_in_thread(app) as url:
        yield url, app


@pytest.mark.parametrize("name", list(INPUTS))
def test_examples_give_the_embedded_results_through_the_server(name, server, embedded):
    url, _ = server
    wf = load_workflow(EXAMPLES / f"{name}.yaml")
    try:
        remote = summary(run(wf, wf.resolve_inputs(INPUTS[name]), OpenAIBackend(url, "demo")))
    except Exception as err:
        remote = f"{type(err).__name__}: {err}"
    assert isinstance(embedded[name], dict), embedded[name]  # the grammar keeps every run valid
    assert remote == embedded[name]


def test_a_workflow_selects_the_backend_in_yaml(server, embedded, tmp_path, monkeypatch):
    url, _ = server
    text = (EXAMPLES / "handoff.yaml").read_text()
    model = f'model: {{backend: openai, base_url: "{url}", model: demo, api_key_env: AF_KEY}}\n'
    (tmp_path / "handoff.yaml").write_text(text.replace("name: handoff\n",
                                                        f"name: handoff\n{model}"))
    (tmp_path / "weather_tools.py").write_text((EXAMPLES / "weather_tools.py").read_text())
    monkeypatch.setenv("AF_KEY", "any")  # the server takes no key; the header is still sent
    wf = load_workflow(tmp_path / "handoff.yaml")
    assert summary(run(wf, wf.resolve_inputs(INPUTS["handoff"]))) == embedded["handoff"]
    monkeypatch.delenv("AF_KEY")
    with pytest.raises(UserError, match=r"handoff\.yaml:\d+: model\.api_key_env names AF_KEY, "
                                        r"which is not set"):
        run(wf, wf.resolve_inputs(INPUTS["handoff"]))
    (tmp_path / "bad.yaml").write_text(text.replace("name: handoff\n", "name: handoff\nmodel: "
                                                    "{backend: openai, model: demo}\n"))
    with pytest.raises(UserError, match=r"bad\.yaml:\d+.*backend openai needs model\.base_url"):
        load_workflow(tmp_path / "bad.yaml")
    # the wait and the retries: a server that never answers is not waited on for ten minutes
    (tmp_path / "patient.yaml").write_text(text.replace("name: handoff\n", (
        f'name: handoff\nmodel: {{backend: openai, base_url: "{url}", model: demo, '
        f"timeout_s: 0.5, max_retries: 1}}\n")))
    backend = create_backend(load_workflow(tmp_path / "patient.yaml").model)
    assert backend.timeout.read == 0.5 and backend.retry.max_retries == 1
    # the chat template's variables, on either backend
    for section in (f'{{backend: openai, base_url: "{url}", model: demo, ', "{"):
        kwargs = "chat_template_kwargs: {enable_thinking: false}}"
        (tmp_path / "think.yaml").write_text(text.replace("name: handoff\n", (
            f"name: handoff\nmodel: {section}{kwargs}\n")))
        backend = create_backend(load_workflow(tmp_path / "think.yaml").model)
        assert backend.chat_template_kwargs == {"enable_thinking": False}
    # a key the embedded engine sets itself: named when the file loads (validate), not when the
    # engine starts; a server is the judge of its own
    (tmp_path / "think.yaml").write_text(text.replace("name: handoff\n", (
        "name: handoff\nmodel:\n  chat_template_kwargs:\n    tools: []\n")))
    with pytest.raises(UserError, match=r"think\.yaml:8: model\.chat_template_kwargs\.tools: "
                                        r"a parameter of apply_chat_template, which the engine"):
        load_workflow(tmp_path / "think.yaml")
    (tmp_path / "think.yaml").write_text(text.replace("name: handoff\n", (
        f'name: handoff\nmodel: {{backend: openai, base_url: "{url}", model: demo, '
        f"chat_template_kwargs: {{tools: []}}}}\n")))
    assert load_workflow(tmp_path / "think.yaml").model.chat_template_kwargs == {"tools": []}
    (tmp_path / "bad.yaml").write_text(text.replace("name: handoff\n", (
        f'name: handoff\nmodel: {{backend: openai, base_url: "{url}", model: demo, '
        f"timeout_s: 0}}\n")))
    with pytest.raises(UserError, match=r"bad\.yaml:\d+: model\.timeout_s"):
        load_workflow(tmp_path / "bad.yaml")


def stream(backend, request):
    async def go():
        async with backend:
            return [event async for event in backend.stream(request)]
    return anyio.run(go)


def test_streamed_events_carry_calls_as_they_close_and_the_engine_stats(server):
    url, _ = server
    request = ModelRequest([{"role": "user", "content": "Use get_weather with city Oslo, days 3."}],
                           [WEATHER], ForceTool("get_weather"),
                           decoding=Decoding(max_tokens=96, speculation="off"))
    body = request_body("demo", request)
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["agentflash"] == {"speculation": "off"}
    events = stream(OpenAIBackend(url, "demo"), request)
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    ready = [e for e in events if isinstance(e, ToolCallReady)]
    assert len(deltas) >= 2 and len(ready) >= 1 and isinstance(events[-1], ModelFinish)
    call = ready[0].call
    assert isinstance(call, ToolCall) and call.name == "get_weather"
    assert set(call.arguments) == {"city", "days"}
    assert json.loads("".join(d.arguments_delta for d in deltas if d.index == 0)) == call.arguments
    finish = events[-1]
    assert finish.finish_reason == "stop" and finish.stats["mode"] == "plain"
    assert finish.stats["new_tokens"] > 0 and finish.stats["target_forwards"] > 0
    plain = stream(OpenAIBackend(url, "demo"), ModelRequest(
        [{"role": "user", "content": "Hello"}], [WEATHER], ToolChoice.NONE,
        decoding=Decoding(max_tokens=24)))
    body = request_body("demo", ModelRequest([], [WEATHER], ToolChoice.NONE))
    assert body["tools"] == [WEATHER] and body["tool_choice"] == "none"
    assert all(isinstance(e, (TextDelta, ModelFinish)) for e in plain)


def test_a_base_url_with_a_query_keeps_it_after_the_path(server):
    # an Azure-style base URL (".../v1?api-version=..."): "/chat/completions" was appended to
    # the text, so the request went to "/v1" with the path in its query (a 404)
    url, app = server
    before = app.attempts
    backend = OpenAIBackend(f"{url}/?api-version=2024-06-01&next=/", "demo")
    events = stream(backend, ModelRequest([{"role": "user", "content": "Hello"}], [],
                                          ToolChoice.NONE, decoding=Decoding(max_tokens=4)))
    assert isinstance(events[-1], ModelFinish) and app.attempts == before + 1
    assert app.query == b"api-version=2024-06-01&next=/"  # (its "/" the query's, kept)
    assert backend.shown_url == url  # in messages: no query, no trailing "/"


def test_a_call_cut_by_max_tokens_runs_no_tool_as_on_the_embedded_engine(server):
    """The embedded engine runs a call once its </tool_call> is written; through the server,
    a call cut by max_tokens before it was no call either, though its arguments were already a
    whole object (the tool ran), or not begun at all (the tool ran on {})."""
    url, _ = server

    def ready(max_tokens):
        request = ModelRequest([{"role": "user", "content": "Use get_weather with city Oslo, "
                                 "days 3."}], [WEATHER], ForceTool("get_weather"),
                               decoding=Decoding(max_tokens=max_tokens))
        events = stream(OpenAIBackend(url, "demo"), request)
        return [e.call for e in events if isinstance(e, ToolCallReady)], events[-1]

    (whole,), finish = ready(96)
    new = finish.stats["new_tokens"]  # up to its </tool_call>, and the end token
    assert isinstance(whole, ToolCall) and finish.finish_reason == "stop"
    checked = 0
    for max_tokens in range(8, new - 1):  # cut before the </tool_call>
        calls, finish = ready(max_tokens)
        assert finish.finish_reason == "length"
        assert not any(isinstance(c, ToolCall) for c in calls), (max_tokens, calls)
        checked += any("generation ended: length" in c.error for c in calls)
    assert checked >= 2


def test_calls_given_in_the_forms_the_runtime_takes_go_to_the_server_in_openais(server):
    # arguments as an object and bare {"name", "arguments"} calls: the runtime and chat
    # templates take them; the server (OpenAI's API) takes the function form, arguments as text
    url, _ = server
    messages = [
        {"role": "user", "content": "Use get_weather with city Oslo."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "x1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "x2", "name": "get_weather", "arguments": {"city": "Rome"}}]},
        {"role": "tool", "tool_call_id": "x1", "content": '{"status": "ok"}'},
        {"role": "tool", "tool_call_id": "x2", "content": '{"status": "ok"}'},
    ]
    request = ModelRequest(messages, [WEATHER], decoding=Decoding(max_tokens=8))
    calls = request_body("demo", request)["messages"][1]["tool_calls"]
    assert calls == [{"id": "x1", "type": "function", "function": {
                          "name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                     {"id": "x2", "type": "function", "function": {
                          "name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # as given
    events = stream(OpenAIBackend(url, "demo"), request)
    assert isinstance(events[-1], ModelFinish)


def test_429_5xx_and_stalls_are_retried_with_backoff(server):
    url, app = server
    request = ModelRequest([{"role": "user", "content": "Hello"}],
                           decoding=Decoding(max_tokens=8))
    app.failures, app.attempts = [429, 503], 0
    events = stream(OpenAIBackend(url, "demo", retry=FAST_RETRY), request)
    assert isinstance(events[-1], ModelFinish) and app.attempts == 3
    app.failures, app.attempts = [500, 502, 503], 0
    with pytest.raises(ServerUnavailable, match=r"HTTP 503: injected.*after 3 attempts"):
        stream(OpenAIBackend(url, "demo", retry=FAST_RETRY), request)
    app.failures, app.attempts = ["stall", "stall"], 0
    backend = OpenAIBackend(url, "demo", timeout_s=0.3, retry=RetryPolicy(1, 0.01, 0.05))
    with pytest.raises(ServerUnavailable, match=r"ReadTimeout.*after 2 attempts"):
        stream(backend, request)
    app.failures, app.attempts = ["html-502", "html-502", "html-502"], 0
    with pytest.raises(ServerUnavailable) as err:
        stream(OpenAIBackend(url, "demo", retry=FAST_RETRY), request)
    assert str(err.value).endswith("HTTP 502: 502 Bad Gateway (after 3 attempts)"), err.value
    app.failures = ["cut"]
    with pytest.raises(ServerUnavailable, match="the reply stream ended without a finish_reason"):
        stream(OpenAIBackend(url, "demo", retry=FAST_RETRY), request)
    # a 503 whose body breaks off is a 503 (it was httpx's traceback, and not asked again)
    app.failures, app.attempts = ["503-cut", "503-cut", "503-cut"], 0
    with pytest.raises(ServerUnavailable, match=r"HTTP 503: \(its body could not be read: "
                                                r".*after 3 attempts"):
        stream(OpenAIBackend(url, "demo", retry=FAST_RETRY), request)
    assert app.attempts == 3
    for quirk in ("error-null", "sse-as-text"):
        app.failures = [quirk]
        events = stream(OpenAIBackend(url, "demo", retry=FAST_RETRY), request)
        assert [e.text for e in events if isinstance(e, TextDelta)] == ["Hi"], quirk
    app.failures = []


@pytest.mark.parametrize("quirk, message", [
    ("keepalive", r"no data in 0\.3 s \(timeout_s\)"),
    ("pings", r"no data in 0\.3 s \(timeout_s\)"),
    ("event-error", r"the server stopped the reply: model overloaded \(503\)"),
    ("object-error", r"the server stopped the reply: KV cache full \(500\)"),
    ("json-200", r"answered with application/json, not an event stream: quota exceeded"),
    ("text-200", r"answered with text/plain, not an event stream: upstream request timeout: "
                 r"model worker overloaded$"),
    ("abort", r"ended the reply with finish_reason 'ABORT'"),
    ("bad-arguments", r"a chunk this client cannot read \(TypeError: function\.arguments is "
                      r"dict, not text\)"),
])
def test_a_quirky_server_gives_a_clear_error_not_a_hang_or_a_cut_answer(server, quirk, message):
    url, app = server
    app.failures = [quirk]
    request = ModelRequest([{"role": "user", "content": "Hello"}], decoding=Decoding(max_tokens=8))
    backend = OpenAIBackend(url, "demo", timeout_s=0.3, retry=RetryPolicy(0, 0.01, 0.05))
    with pytest.raises(ServerUnavailable, match=message) as err:
        stream(backend, request)
    assert type(err.value) is ServerUnavailable  # (it was the module's private _Silent)
    app.failures = []


def test_a_reply_broken_before_any_data_is_asked_again_a_slow_one_is_not(server):
    """Nothing was handed on when the connection broke: asked again. A server slow to send
    its first data (a long prefill, a queue) is not: asked again, it would queue anew."""
    url, app = server
    request = ModelRequest([{"role": "user", "content": "Hello"}], decoding=Decoding(max_tokens=8))
    backend = OpenAIBackend(url, "demo", timeout_s=0.3, retry=RetryPolicy(1, 0.01, 0.05))
    app.failures, app.attempts = ["broken"], 0
    events = stream(backend, request)
    assert isinstance(events[-1], ModelFinish) and app.attempts == 2
    app.failures, app.attempts = ["silent", "silent"], 0
    with pytest.raises(ServerUnavailable, match=r"no data in 0\.3 s \(timeout_s\)$"):
        stream(backend, request)
    assert app.attempts == 1
    app.failures = []


def test_an_empty_reply_is_asked_again_and_the_retries_share_one_budget(server):
    url, app = server
    request = ModelRequest([{"role": "user", "content": "Hello"}], decoding=Decoding(max_tokens=8))
    app.failures, app.attempts = ["empty"], 0
    events = stream(OpenAIBackend(url, "demo", retry=RetryPolicy(1, 0.01, 0.05)), request)
    assert isinstance(events[-1], ModelFinish) and app.attempts == 2
    app.failures, app.attempts = ["empty", "empty"], 0
    with pytest.raises(ServerUnavailable, match=r"ended before any data \(after 2 attempts\)$"):
        stream(OpenAIBackend(url, "demo", retry=RetryPolicy(1, 0.01, 0.05)), request)
    assert app.attempts == 2
    # a refused request and a broken reply are retried from one budget of 1 + max_retries
    # requests, not one inside the other
    app.failures, app.attempts = ["broken", 503, "broken", "broken"], 0
    with pytest.raises(ServerUnavailable, match=r"the reply stream broke.*after 3 attempts"):
        stream(OpenAIBackend(url, "demo", retry=FAST_RETRY), request)
    assert app.attempts == 3
    app.failures, app.attempts = [503, "broken"], 0
    events = stream(OpenAIBackend(url, "demo", retry=FAST_RETRY), request)
    assert isinstance(events[-1], ModelFinish) and app.attempts == 3
    app.failures = []


@pytest.mark.parametrize("quirk", ["drop-after-finish", "silent-after-finish"])
def test_a_reply_whole_before_the_connection_ends_badly_is_the_answer(server, quirk):
    url, app = server
    request = ModelRequest([{"role": "user", "content": "Hello"}], decoding=Decoding(max_tokens=8))
    app.failures, app.attempts = [quirk], 0
    backend = OpenAIBackend(url, "demo", timeout_s=0.3, retry=RetryPolicy(0, 0.01, 0.05))
    events = stream(backend, request)
    app.failures = []
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["Hi"]
    assert isinstance(events[-1], ModelFinish) and events[-1].finish_reason == "stop"
    assert app.attempts == 1


def test_an_answer_in_its_schema_may_quote_the_tag(server):
    # as the embedded backend reads it: it was a cut answer and a broken call, and the run
    # spent every turn on it
    url, app = server
    schema = {"type": "object", "properties": {"tip": {"type": "string"}}, "required": ["tip"]}
    request = ModelRequest([{"role": "user", "content": "tip?"}], output_schema=schema)
    texts = []
    for given in (request, replace(request, output_schema=None)):
        app.failures = ["answer-quoting-the-tag"]
        events = stream(OpenAIBackend(url, "demo", retry=FAST_RETRY), given)
        texts.append(("".join(e.text for e in events if isinstance(e, TextDelta)),
                      [e.call for e in events if isinstance(e, ToolCallReady)]))
    app.failures = []
    assert texts[0] == ('{"tip": "wrap calls in <tool_call> tags"}', [])
    assert texts[1][0] == '{"tip": "wrap calls in '  # (no schema: a call, as the model's)
    assert isinstance(texts[1][1][0], MalformedToolCall)


def test_calls_go_back_in_the_order_the_model_wrote_them(server):
    from agentflash.runtime import Agent, Runner, tool

    @tool
    def get_weather(city: str) -> str:
        """Weather."""
        return f"sunny in {city}"

    @tool
    def get_time(zone: str) -> str:
        """Time."""
        return f"noon {zone}"

    url, app = server
    app.failures = ["late-first"]  # the next turn goes to the demo model
    agent = Agent("a", tools=[get_weather, get_time], decoding=Decoding(max_tokens=8),
                  max_turns=2)

    async def main():
        async with OpenAIBackend(url, "demo", retry=FAST_RETRY) as backend:
            return await Runner.run(agent, "Weather and time?", backend=backend)

    result = anyio.run(main)
    app.failures = []
    assistant = next(m for m in result.messages if m.get("tool_calls"))
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["get_weather", "get_time"]
    results = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert results[:2] == ["sunny in Oslo", "noon UTC"]


def test_client_errors_are_reported_without_retries(server):
    url, app = server
    app.attempts = 0
    with pytest.raises(UserError, match=r"HTTP 404: model 'gpt-x' is not served here.*"
                                        r"model_not_found"):
        stream(OpenAIBackend(url, "gpt-x", retry=FAST_RETRY),
               ModelRequest([{"role": "user", "content": "hi"}]))
    bad_tool = {"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}
    with pytest.raises(UserError, match="HTTP 400"):
        stream(OpenAIBackend(url, "demo", retry=FAST_RETRY),
               ModelRequest([{"role": "user", "content": "hi"}], [bad_tool]))
    assert app.attempts == 2


def test_chat_template_kwargs_go_with_every_request(server):
    url, _ = server
    ask = ModelRequest([{"role": "user", "content": "Hello"}],
                       decoding=Decoding(max_tokens=8, speculation="off"))
    with pytest.raises(UserError, match="chat_template_kwargs.tokenize: a parameter of "
                                        "apply_chat_template"):  # the server read them
        stream(OpenAIBackend(url, "demo", retry=FAST_RETRY,
                             chat_template_kwargs={"tokenize": True}), ask)
    texts = ["".join(e.text for e in stream(OpenAIBackend(url, "demo", **kwargs), ask)
                     if isinstance(e, TextDelta)) for kwargs in (
        {}, {"chat_template_kwargs": {"enable_thinking": False}})]  # (the demo's has none)
    assert texts[0] and texts[0] == texts[1]


def test_connection_errors_are_retried_then_reported():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = OpenAIBackend(f"http://127.0.0.1:{port}/v1", "demo", retry=FAST_RETRY)
    with pytest.raises(ServerUnavailable, match=r"ConnectError.*after 3 attempts"):
        stream(backend, ModelRequest([{"role": "user", "content": "hi"}]))
    with pytest.raises(UserError, match="base_url"):
        OpenAIBackend("localhost:8000", "demo")
    # found before a request: tracebacks at the first request before (OverflowError, and
    # UnicodeEncodeError for a key with a non-breaking space pasted in)
    for url, problem in (("http://127.0.0.1:99999/v1", "port 99999 is not one of 1 to 65535"),
                         ("http://", "names no host"),
                         # httpx takes these for hosts "%5B" and "a%20b": a failed connect after
                         # every retry before
                         ("http://[", "its host holds a character no host name can"),
                         ("http://my host:8000/v1", "its host holds a character no host name can"),
                         ("http://a|b/v1", "its host holds a character no host name can")):
        with pytest.raises(UserError, match=f"model.base_url .*{problem}"):
            OpenAIBackend(url, "demo")
    for key in ("sk-abc\u00a0", "sk-abc ", "sk-abc\n"):
        with pytest.raises(UserError, match="the api_key holds a character that cannot go in"):
            OpenAIBackend("http://127.0.0.1:8000/v1", "demo", api_key=key)


def _calls(chunks, tools=()) -> list:
    reader = _ChunkReader(tools)
    events = [e for c in chunks for e in reader.read(c)] + reader.close()
    return [e for e in events if isinstance(e, ToolCallReady)]


def _tool_chunk(*entries, finish=None):
    return {"choices": [{"delta": {"tool_calls": list(entries)}, "finish_reason": finish}]}


def test_long_arguments_in_small_pieces_are_not_parsed_at_every_piece(monkeypatch):
    # whether a call is whole was asked at every piece by parsing all its arguments so far:
    # quadratic in their length (400 KB in 4-character pieces took 12 s)
    import agentflash.backends.openai as remote

    parsed = []
    load_body = remote.load_body
    monkeypatch.setattr(remote, "load_body", lambda text: parsed.append(text) or load_body(text))
    arguments = json.dumps({"content": "y" * 4000})
    pieces = [arguments[i : i + 4] for i in range(0, len(arguments), 4)]
    calls = _calls([_tool_chunk({"index": 0, "id": "c1", "function": {"name": "write_file",
                                                                      "arguments": ""}})]
                   + [_tool_chunk({"index": 0, "function": {"arguments": p}}) for p in pieces])
    assert [(c.call.name, c.call.arguments) for c in calls] == [
        ("write_file", {"content": "y" * 4000})]
    assert len(parsed) <= 4, len(parsed)  # once its text ends with a brace, and at its end


def test_chunk_reader_tells_calls_apart_as_quirky_servers_send_them():
    weather = '{"city": "Oslo"}'
    # Ollama-like: no index; every call at index 0 with its own id
    for index in ({}, {"index": 0}):
        calls = _calls([
            _tool_chunk({**index, "id": "a", "function": {"name": "get_weather",
                                                         "arguments": weather}}),
            _tool_chunk({**index, "id": "b", "function": {"name": "get_time",
                                                         "arguments": '{"zone": "UTC"}'}}),
        ])
        assert [(c.index, c.call.id, c.call.name) for c in calls] == [
            (0, "a", "get_weather"), (1, "b", "get_time")]
    # no ids either: a new name once the call is whole
    calls = _calls([_tool_chunk({"function": {"name": "get_weather", "arguments": weather}}),
                    _tool_chunk({"function": {"name": "get_time", "arguments": "{}"}})])
    assert [c.call.name for c in calls] == ["get_weather", "get_time"]
    # DeepSeek-like: one id for two calls; each keeps an id of its own
    calls = _calls([_tool_chunk({"index": 0, "id": "call_0", "function": {
                        "name": "get_weather", "arguments": weather}}),
                    _tool_chunk({"index": 1, "id": "call_0", "function": {
                        "name": "get_time", "arguments": "{}"}})])
    assert [c.call.id for c in calls] == ["call_0", "call_0_2"]
    # NIM-like: the id and the name on every piece of one call
    calls = _calls([_tool_chunk({"index": 0, "id": "x", "function": {
        "name": "get_weather", "arguments": piece}}) for piece in ('{"city": ', '"Oslo"}')])
    assert [(c.call.name, c.call.arguments) for c in calls] == [("get_weather",
                                                                 {"city": "Oslo"})]


def test_chunk_reader_keeps_calls_whole_where_the_rules_could_split_or_merge_them():
    def call(name=None, arguments="", **entry):
        fn = {"arguments": arguments, **({"name": name} if name else {})}
        return _tool_chunk({**entry, "function": fn})

    summary = lambda calls: [(c.call.name, getattr(c.call, "arguments", None)) for c in calls]  # noqa: E731
    # an id that changes within one call (some servers send one per piece)
    assert summary(_calls([call("get_weather", id="A", index=0),
                           call(arguments='{"city": ', id="B", index=0),
                           call(arguments='"Oslo"}', id="C", index=0)])) == [
        ("get_weather", {"city": "Oslo"})]
    # one id for every call, all at index 0
    assert summary(_calls([call("f", '{"a": 1}', id="call_0", index=0),
                           call("g", '{"b": 2}', id="call_0", index=0)])) == [
        ("f", {"a": 1}), ("g", {"b": 2})]
    # no ids, one index, the same tool twice in OpenAI's shape (the name, then the arguments)
    assert summary(_calls([call("f"), call(arguments='{"a": 1}'),
                           call("f"), call(arguments='{"a": 2}')])) == [
        ("f", {"a": 1}), ("f", {"a": 2})]
    # no ids: a call without arguments, then another tool
    assert summary(_calls([call("now"), call("get_weather", '{"city": "Oslo"}')])) == [
        ("now", {}), ("get_weather", {"city": "Oslo"})]
    # a name streamed in pieces, as OpenAI's SDK joins them (it was two calls, "get_" and
    # "weather"): where the pieces join into one of the request's tools
    assert summary(_calls([call("get_", id="a", index=0), call("weather", index=0),
                           call(arguments='{"city": "Oslo"}', index=0)],
                          tools=["get_weather", "now"])) == [("get_weather", {"city": "Oslo"})]
    # a trailing empty piece repeating the id and the name: no second call (a tool whose
    # arguments are all optional ran twice)
    assert summary(_calls([call("ping", '{"host": ', id="c1", index=0),
                           call("ping", '"a"}', id="c1", index=0),
                           call("ping", "", id="c1", index=0)])) == [("ping", {"host": "a"})]
    # a call that never got a name is no call
    (nameless,) = _calls([call(arguments='{"a": 1}', id="x", index=0)])
    assert "names no tool" in nameless.call.error
    # arguments after the call was whole are not dropped without a word
    with pytest.raises(ValueError, match="came after call 'f' was whole"):
        _calls([call("f", '{"a": 1}', id="x", index=0), call(arguments=' "b"', index=0)])


def test_finish_reasons_of_whole_and_of_cut_replies():
    for finish, read in (("stop", "stop"), ("tool_calls", "stop"), ("eos", "stop"),
                         ("STOP", "stop"), ("length", "length"), ("model_length", "length")):
        reader = _ChunkReader()
        reader.read({"choices": [{"delta": {"content": "x"}, "finish_reason": finish}]})
        assert reader.finish_reason == read


def test_chunk_reader_closes_calls_as_their_arguments_complete():
    reader = _ChunkReader()

    def delta(index, arguments, **extra):
        fn = {"arguments": arguments, **({"name": extra["name"]} if "name" in extra else {})}
        entry = {"index": index, "function": fn, **({"id": extra["id"]} if "id" in extra else {})}
        return {"choices": [{"delta": {"tool_calls": [entry]}, "finish_reason": None}]}

    events = reader.read(delta(0, "", id="a", name="f")) + reader.read(delta(0, '{"x": 1'))
    assert not any(isinstance(e, ToolCallReady) for e in events)
    events = reader.read(delta(0, "}"))
    assert events[-1] == ToolCallReady(0, ToolCall("a", "f", {"x": 1}))
    assert events[-1].call.arguments_text == '{"x": 1}'  # as written, given back so
    events = reader.read(delta(1, '{"y": [1', id="b", name="g")) + reader.read(delta(2, "{", id="c",
                                                                                  name="h"))
    # call 1 stays open when call 2 begins: a server may interleave the pieces of the calls
    assert not any(isinstance(e, ToolCallReady) for e in events)
    events = reader.read(delta(1, "]}"))
    assert events[-1] == ToolCallReady(1, ToolCall("b", "g", {"y": [1]}))
    assert [e.arguments_delta for e in events if isinstance(e, ToolCallDelta)] == ["]}"]
    reader.read({"choices": [{"delta": {}, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 5, "completion_tokens": 9,
                           "prompt_tokens_details": {"cached_tokens": 4}}})
    (last,) = reader.close()  # call 2, cut by max tokens
    assert last.index == 2 and last.call.id == "c" and "generation ended: length" in last.call.error
    stats = reader.stats(1.0)
    assert reader.finish_reason == "length" and stats["new_tokens"] == 9
    assert stats["prompt_tokens"] == 5 and stats["cached_prompt_tokens"] == 4
    assert stats["mode"] == "remote"


def test_a_reply_cut_by_length_leaves_its_open_calls_malformed():
    def reply(arguments, finish):
        reader = _ChunkReader()
        entry = {"index": 0, "id": "a", "function": {"name": "f", "arguments": arguments}}
        events = reader.read({"choices": [{"delta": {"tool_calls": [entry]},
                                           "finish_reason": finish}]})
        return [e.call for e in events + reader.close() if isinstance(e, ToolCallReady)]

    assert reply("", "tool_calls") == [ToolCall("a", "f", {})]  # a call without arguments
    assert reply('{"x": 1}', "tool_calls") == [ToolCall("a", "f", {"x": 1})]
    for arguments in ("", '{"x": 1}', '{"x": '):  # cut before its arguments, or after them
        (call,) = reply(arguments, "length")
        assert isinstance(call, MalformedToolCall) and "generation ended: length" in call.error

    def said(content, finish, tools=True):
        reader = _ChunkReader(text_calls=True, parsed_calls=tools)
        events = reader.read({"choices": [{"delta": {"content": content},
                                           "finish_reason": finish}]}) + reader.close()
        return [e.call for e in events if isinstance(e, ToolCallReady)]

    # nothing but a blank, cut, where the request's tools may be called: a call cut before
    # its name, which a server cannot send (the run's output was "")
    for content in ("", "\n"):
        (call,) = said(content, "length")
        assert isinstance(call, MalformedToolCall) and call.body == ""
        assert call.error.endswith("(generation ended: length)")
    assert said("", "stop") == [] and said("Hi", "length") == []
    # no tools: the server sends a call's markup as text, and a reasoning model's cut reply
    # is empty (it was a malformed call, asked again until max_turns)
    assert said("", "length", tools=False) == []


def test_server_sent_events_end_lines_at_cr_and_lf_only():
    """JSON text holds U+2028, U+2029 and U+0085 raw (this server and vLLM write them so):
    httpx's lines ended there too, and the reply broke as invalid JSON. Every split of the
    stream between two reads gives the same events (a CR LF split too)."""
    from agentflash.backends.openai import _sse_events

    async def events(chunks):
        async def body():
            for chunk in chunks:
                yield chunk

        return [event async for event in _sse_events(
            httpx.Response(200, content=body()).aiter_text())]

    data = 'data: {"a": "one\u2028two\u2029three\x85"}\r\n\r\nevent: error\rdata: b\n\n'.encode()
    expected = [("message", '{"a": "one\u2028two\u2029three\x85"}'), ("error", "b")]
    assert anyio.run(events, [data]) == expected
    for cut in range(1, len(data)):
        assert anyio.run(events, [data[:cut], data[cut:]]) == expected, cut


def test_one_backend_serves_more_streams_at_once_than_httpxs_pool_of_100():
    """The 101st concurrent stream waited on httpx's connection pool under the read timeout
    and failed with a PoolTimeout before the server saw it. Each stream lasts longer than the
    timeout (a stream waiting for a pooled connection fails) while its chunks come well within
    it (a busy machine's slow start of 110 connections does not)."""
    import asyncio

    async def reply(reader, writer):
        await reader.readuntil(b"\r\n\r\n")  # the headers; the body is left unread
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"connection: close\r\n\r\n")
        for piece in [_chunk({"content": c}) for c in "abcdef"] + [_chunk(finish="stop")]:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.4)
        writer.close()

    async def main():
        server = await asyncio.start_server(reply, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
        request = ModelRequest([{"role": "user", "content": "hi"}])
        outcomes = []

        async def one(backend):
            try:
                events = [e async for e in backend.stream(request)]
                outcomes.append("".join(e.text for e in events if isinstance(e, TextDelta)))
            except ServerUnavailable as err:
                outcomes.append(str(err))

        async with server, OpenAIBackend(url, "x", timeout_s=1.5,
                                         retry=RetryPolicy(0, 0.01, 0.05)) as backend:
            async with anyio.create_task_group() as tg:
                for _ in range(110):
                    tg.start_soon(one, backend)
        return outcomes

    outcomes = anyio.run(main)
    assert outcomes == ["abcdef"] * 110, sorted(set(outcomes))


def test_an_emoji_sent_as_two_surrogates_in_two_chunks_is_one_character():
    """A server that splits text in UTF-16 units: the run's text held two lone surrogates, and
    `agentflash run` printing it raised UnicodeEncodeError."""
    reader = _ChunkReader()
    texts = [e.text for piece in ("A \ud83d", "\ude00 B", "x\udc00y", "z\ud83d")
             for e in reader.read({"choices": [{"delta": {"content": piece}}]})]
    texts += [e.text for e in reader.close() if isinstance(e, TextDelta)]
    assert texts == ["A ", "\U0001f600 B", "x\ufffdy", "z", "\ufffd"]


def test_a_surrogate_pair_split_across_argument_pieces_is_one_character():
    # the tool read the arguments whole, but the call's record (traces, events, the run's
    # tool_calls) held two lone surrogates, which no UTF-8 encoder takes
    calls = _calls([_tool_chunk({"index": 0, "id": "c", "function": {
                        "name": "f", "arguments": '{"city": "Osl\ud83d'}}),
                    _tool_chunk({"index": 0, "function": {"arguments": '\ude00"}'}}),
                    {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}])
    assert [c.call.arguments for c in calls] == [{"city": "Osl\U0001f600"}]


def test_calls_a_server_sends_as_text_are_read_as_the_embedded_engine_reads_them(server):
    # the reply's text was the agent's answer, <tool_call> markup and all, and no tool ran
    url, app = server
    request = ModelRequest([{"role": "user", "content": "Weather in Oslo?"}], [WEATHER],
                           decoding=Decoding(max_tokens=32))
    app.failures = ["hermes-text"]
    events = stream(OpenAIBackend(url, "demo", retry=FAST_RETRY), request)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Let me check.\n"
    ready = [e.call for e in events if isinstance(e, ToolCallReady)]
    assert [(c.name, c.arguments) for c in ready] == [("get_weather", {"city": "Oslo",
                                                                      "days": 2})]
    # under tool_choice none the server was asked for no calls: its text is text
    app.failures = ["hermes-text"]
    events = stream(OpenAIBackend(url, "demo", retry=FAST_RETRY),
                    replace(request, tool_choice=ToolChoice.NONE))
    assert not any(isinstance(e, ToolCallReady) for e in events)
    assert "</tool_call>" in "".join(e.text for e in events if isinstance(e, TextDelta))
    app.failures = []


def test_a_cut_call_and_a_call_without_tools_read_alike_embedded_and_through_the_server(server):
    """A call cut by max_tokens went back to the model in other words through the server (its
    arguments as a JSON string inside its body), and the next turn went another way; a call's
    markup in a turn without tools was a call embedded (of a tool the agent lacks, which the
    model is told) and the answer through the server."""
    url, _ = server

    def cut(max_tokens):
        return ModelRequest([{"role": "user", "content": "Use get_weather with city Oslo, "
                              "days 3."}], [WEATHER], ForceTool("get_weather"),
                            decoding=Decoding(max_tokens=max_tokens, speculation="off"))

    untooled = ModelRequest([{"role": "system", "content": "You are a helpful assistant with "
                              "access to tools."},
                             {"role": "user", "content": "Call search_files with query report."}],
                            decoding=Decoding(max_tokens=64, speculation="off"))

    async def both(request):
        out = []
        for backend in (local, remote):
            events = [e async for e in backend.stream(request)]
            calls = [e.call for e in events if isinstance(e, ToolCallReady)]
            out.append(("".join(e.text for e in events if isinstance(e, TextDelta)),
                        [(c.body, c.error) if isinstance(c, MalformedToolCall) else c.name
                         for c in calls]))  # (ids are each backend's own)
        return out

    async def go():
        nonlocal local, remote
        async with LocalBackend("demo") as local, OpenAIBackend(url, "demo") as remote:
            # cut inside its arguments (cut before they begin, the server has no call to send;
            # after them, its body's closing brace is not sent: neither is compared)
            return ([await both(cut(n)) for n in (16, 18, 20)], await both(cut(5)),
                    await both(untooled))

    local = remote = None
    cuts, early, (embedded_text, served_text) = anyio.run(go)
    # cut before its name: a malformed call on both (the server sends none of its body)
    ((body, error),), ((served_body, served_error),) = early[0][1], early[1][1]
    assert body.startswith('{"') and served_body == "" and error == served_error
    for embedded, served in cuts:
        assert embedded == served
        ((body, error),) = embedded[1]
        assert body.startswith('{"name": "get_weather", "arguments": {')
        assert error == "the tool call was not closed with </tool_call> (generation ended: length)"
    assert embedded_text == served_text
    assert "<tool_call>" not in embedded_text[0] and len(embedded_text[1]) == 1


def test_an_endless_error_body_is_read_only_as_far_as_its_message_needs():
    # a 400 or a proxy's page of a gigabyte was read whole into memory (2.4x its size)
    from agentflash.backends import openai as remote

    pulled = []

    async def endless():
        while True:
            pulled.append(1)
            yield "x" * 1000

    async def head(limit=None):
        return await remote._head_text(endless(), limit)

    assert anyio.run(head, 2500) == "x" * 2500 and len(pulled) == 3
    pulled.clear()
    assert len(anyio.run(head)) == remote.MAX_ERROR_CHARS
    assert len(pulled) == -(-remote.MAX_ERROR_CHARS // 1000)


def test_a_password_in_base_url_stays_out_of_errors():
    # it was in the error, in run --json's output and in the trace's span
    request = ModelRequest([{"role": "user", "content": "Hello"}], decoding=Decoding(max_tokens=8))
    backend = OpenAIBackend("http://apiuser:TopSecretPw@127.0.0.1:1/v1?key=k2", "demo",
                            retry=RetryPolicy(0, 0.01, 0.05))
    with pytest.raises(ServerUnavailable) as err:
        stream(backend, request)
    assert str(err.value).startswith("http://127.0.0.1:1/v1/chat/completions: ")
    assert "TopSecret" not in str(err.value) and "k2" not in str(err.value)
    with pytest.raises(UserError, match=r"model.base_url 'http://127.0.0.1:70000/v1': port "
                                        r"70000 is not one of 1 to 65535"):  # validate's too
        OpenAIBackend("http://apiuser:TopSecretPw@127.0.0.1:70000/v1", "demo")
    from agentflash.backends.openai import base_url_problem

    assert base_url_problem("u:TopSecret@host:8000/v1") == (  # no scheme
        "must be an http:// or https:// URL, got 'host:8000/v1'")
    assert base_url_problem("HTTP://u:TopSecret@host/v1") is None  # a scheme is any case
    for url in ("u:TopSecret@host/v1?u=http://x", "http:/u:TopSecret@host/v1",
                "http://u:Top/Secret@host/v1", "http://u:TopSecret@[::1/v1#http://y"):
        assert "Secret" not in base_url_problem(url), url  # a raw / in it, a typo, a query
    # brackets that hold no address: a ValueError of urlsplit's, a traceback from validate
    assert base_url_problem("http://u:TopSecret@[::1:8000/v1").startswith(
        "'http://[::1:8000/v1' is not a valid URL")


def test_an_openai_backend_opened_twice_says_so():
    async def main():
        backend = OpenAIBackend("http://127.0.0.1:1/v1", "demo")
        async with backend:
            with pytest.raises(UserError, match="this OpenAIBackend is already open"):
                async with backend:
                    pass
            assert backend._client is not None  # the inner exit closed the outer's client

    anyio.run(main)
