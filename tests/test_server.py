"""``agentflash serve`` on loopback, driven by the official ``openai`` client and by raw HTTP:
chat, tool calls under every tool_choice, response formats, streaming deltas, limits, errors,
concurrency and disconnects. The server runs the bundled demo model (it writes Hermes calls)."""

import concurrent.futures
import copy
import gc
import json
import logging
import math
import pickle
import socket
import time

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from agentflash.backends.local import load_weights
from agentflash.engine.engine import Engine, EngineConfig
from agentflash.engine.request import SamplingParams
from agentflash.errors import UserError
from agentflash.server.app import ServerConfig, serving_in_thread

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city to look up."},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"]}}}
HOTEL = {"type": "function", "function": {
    "name": "book_hotel", "description": "Book a hotel room.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "guests": {"type": "integer"},
        "breakfast": {"type": "boolean"}}, "required": ["city", "guests"]}}}
TOOLS = [WEATHER, HOTEL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASKS = ["Use get_weather with city Oslo, days 3.", "Use book_hotel with city Rome, guests 2.",
        "What is the weather in Lima?", "Book a room in Paris for 4 people."]
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def engine():
    net, tokenizer, model_dir, drafter = load_weights("demo")
    return Engine(net, tokenizer, EngineConfig(max_running=8, max_len=1024), model_dir, drafter)


@pytest.fixture(scope="module")
def reference(engine):
    """The in-process engine's greedy reply to a plain prompt, before the server takes over."""
    ids = engine.chat_prompt([{"role": "user", "content": "Hello, who are you?"}])
    return engine.generate(ids, SamplingParams(max_tokens=40, temperature=0.0))


@pytest.fixture(scope="module")
def url(engine, reference):
    config = ServerConfig(port=0, max_tokens=900, max_body_bytes=BODY_LIMIT)
    with serving_in_thread(config, engine) as base_url:
        yield base_url


@pytest.fixture
def client(url):
    return OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def user(text):
    return [{"role": "user", "content": text}]


def assert_valid_calls(message, allowed):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])


def test_plain_chat_equals_the_in_process_engine(client, reference):
    reply = client.chat.completions.create(model="demo", messages=user("Hello, who are you?"),
                                           max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.tool_calls is None
    assert choice.message.content == reference.text.strip()
    assert choice.finish_reason == reference.finish_reason
    assert reply.usage.completion_tokens == len(reference.token_ids)
    assert reply.usage.prompt_tokens == reference.stats["prompt_tokens"]
    # a temperature OpenAI's API takes but too small to sample with is greedy (it was a 400
    # naming no field, with another server's range)
    tiny = client.chat.completions.create(model="demo", messages=user("Hello, who are you?"),
                                          max_tokens=40, temperature=1e-7)
    assert tiny.choices[0].message.content == choice.message.content
    # and so is top_p 0, which OpenAI's API takes (it was a 400: "greater than 0")
    nucleus = client.chat.completions.create(model="demo", messages=user("Hello, who are you?"),
                                             max_tokens=40, temperature=1.5, top_p=0, seed=3)
    assert nucleus.choices[0].message.content == choice.message.content
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    stats = reply.model_extra["agentflash"]
    assert stats["new_tokens"] == len(reference.token_ids) and stats["target_forwards"] >= 1
    assert {"mode", "tau", "draft_forwards", "segments"} <= set(stats)


def test_a_template_refusing_the_messages_is_a_400_that_shows_no_server_path(client, engine):
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') "
        "}}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    try:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="demo", max_tokens=1,
                messages=[{"role": "system", "content": "be brief"}, *user("hi")])
    finally:
        engine.tokenizer.chat_template = template
    assert err.value.body["param"] == "messages"
    assert err.value.body["message"] == ("the model's chat template rejects these messages: "
                                         "System role not supported")


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_same_reply(client):
    ask = user("Please explain, in a few words, what a tool call is, why agents use them and "
               "what goes wrong when the arguments of a call do not parse.")
    first = client.chat.completions.create(model="demo", messages=ask, max_tokens=12,
                                           temperature=0)
    again = client.chat.completions.create(model="demo", messages=ask, max_tokens=12,
                                           temperature=0)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens >= 32
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_named(client, engine):
    """vLLM's field (Qwen3's enable_thinking) was ignored; one that is apply_chat_template's
    own parameter is refused, naming it."""
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                      "{{ suffix | default('') }}")
    try:
        usage = [client.chat.completions.create(
            model="demo", messages=user("hi"), max_tokens=1, temperature=0,
            extra_body={"chat_template_kwargs": kwargs}).usage.prompt_tokens
            for kwargs in ({}, {"suffix": " and more words"})]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="demo", messages=user("hi"), max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"tools": []}})
    finally:
        engine.tokenizer.chat_template = template
    assert usage[1] > usage[0]
    assert err.value.body["param"] == "chat_template_kwargs"
    assert "chat_template_kwargs.tools: a parameter of apply_chat_template" in str(err.value)


def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == ["demo"]
    assert client.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError, match="model 'other/model' is not served here"):
        client.models.retrieve("other/model")
    health = httpx.get(url.removesuffix("/v1") + "/health").json()
    assert health["status"] == "ok" and health["model"] == "demo"


@pytest.mark.parametrize("ask", ASKS)
def test_tool_choice_required_returns_valid_calls(client, ask):
    reply = client.chat.completions.create(model="demo", messages=user(ask), tools=TOOLS,
                                           tool_choice="required", max_tokens=120, temperature=0)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.content is None
    assert_valid_calls(reply.choices[0].message, SCHEMAS)


def test_a_call_cut_by_max_tokens_is_the_same_call_streamed_or_not(client):
    """Cut inside its arguments, a call is a tool call with the arguments written so far
    (finish reason length, as OpenAI's API gives it), in the whole reply as in the stream; cut
    before its name was read, it is neither call nor text (its markup is no answer)."""
    args = dict(model="demo", messages=user("Use get_weather with city Oslo, days 3."),
                tools=TOOLS, tool_choice="required", temperature=0)
    whole = client.chat.completions.create(max_tokens=120, **args)
    (call,) = whole.choices[0].message.tool_calls
    cut = client.chat.completions.create(max_tokens=whole.usage.completion_tokens - 6, **args)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content is None
    (partial,) = cut.choices[0].message.tool_calls
    assert partial.function.name == call.function.name
    assert 0 < len(partial.function.arguments) < len(call.function.arguments)
    assert call.function.arguments.startswith(partial.function.arguments)
    streamed = {"arguments": "", "content": ""}
    for chunk in client.chat.completions.create(max_tokens=whole.usage.completion_tokens - 6,
                                                stream=True, **args):
        for choice in chunk.choices:
            streamed["content"] += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                assert piece.function.name in (None, call.function.name)
                streamed["arguments"] += piece.function.arguments or ""
    assert streamed == {"arguments": partial.function.arguments, "content": ""}
    for n in (1, 3, 5):  # the name is not out yet
        early = client.chat.completions.create(max_tokens=n, **args).choices[0]
        assert early.finish_reason == "length" and early.message.tool_calls is None
        assert early.message.content == ""
        chunks = list(client.chat.completions.create(max_tokens=n, stream=True, **args))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    # cut once its name is whole, before its arguments' first delta: a call too (its body was
    # sent as the reply's text, which the runtime then took for the answer)
    for n in range(4, 16):
        message = client.chat.completions.create(max_tokens=n, **args).choices[0].message
        if message.tool_calls is None:
            assert f'"name": "{call.function.name}",' not in (message.content or ""), n
        else:
            assert message.tool_calls[0].function.name == call.function.name


def test_named_tool_choice_and_sampling_still_give_valid_calls(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model="demo", messages=user("Use get_weather with city Oslo, days 3."), tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "book_hotel"}},
            parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=seed)
        message = reply.choices[0].message
        assert_valid_calls(message, {"book_hotel"})
        assert len(message.tool_calls) == 1


def test_tool_choice_none_writes_text_only(client):
    reply = client.chat.completions.create(
        model="demo", messages=user("Use get_weather with city Oslo, days 3."), tools=TOOLS,
        tool_choice="none", max_tokens=60, temperature=0)
    message = reply.choices[0].message
    assert message.tool_calls is None and "<tool_call>" not in (message.content or "")
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_schema_the_grammar_cannot_take_is_named_without_grammar_internals(client):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="demo", messages=user("hi"), max_tokens=8, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    message = info.value.body["message"]
    assert info.value.body["param"] == "response_format.json_schema.schema"
    assert message.startswith("response_format.json_schema.schema: #/properties/tags: ")
    assert "uniqueItems" in message and "%json" not in message and "start:" not in message


def test_a_pattern_the_grammar_cannot_take_is_named_wherever_it_is(client, url):
    # llguidance builds a pattern's lexer as the masks reach it: past the reply's first step
    # (a later property, a tool's arguments after free text) the limit failed it in mid-reply,
    # a 500
    bad = {"type": "string", "pattern": "^(a{1000}){1000}$"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": bad},
              "required": ["a", "b"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"b": bad}}}}
    for extra, param in (({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema}}}, "response_format"), ({"tools": [tool]}, "tools")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="demo", messages=user("hi"), max_tokens=8,
                                           **extra)
        assert info.value.body["param"] == param
        assert "properties/b/pattern: lexer error" in info.value.body["message"]
    # a pattern whose lexer outgrows the limit only some letters in: the grammar's failure is
    # the request's (a 400 naming it), not the server's
    grows = {"type": "object", "properties": {"a": {"type": "string",
                                                    "pattern": "^([a-z]{1,50}){1,50}$"}},
             "required": ["a"]}
    body = {"model": "demo", "messages": user("give json"), "max_tokens": 150, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                       "schema": grows}}}
    reply = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "grammar_limit" and "GrammarFailed" in error["message"], error
    with httpx.stream("POST", f"{url}/chat/completions", json={**body, "stream": True},
                      timeout=60) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-1][6:])["error"]["code"] == "grammar_limit", events[-1]


def test_json_schema_response_format(client):
    # The demo model was not trained on this task; bounded strings keep its answer short.
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "days": {"type": "integer", "minimum": 1,
                                                        "maximum": 99}},
              "required": ["city", "days"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model="demo", messages=user("Plan a trip to Rome for 3 days."), max_tokens=80,
        temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "plan", "schema": schema, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    reply = client.chat.completions.create(
        model="demo", messages=user("Answer in JSON."), max_tokens=80, temperature=0,
        response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert reply.choices[0].message.content.startswith("{")


def test_tool_choice_none_without_tools_binds_the_reply_to_text(client):
    """As ``generate`` and agents have it: the demo model, asked nothing in particular, writes
    a call; ``none`` says it may not (the server ignored ``none`` where no tools came)."""
    free = client.chat.completions.create(model="demo", messages=user("hi"), max_tokens=24,
                                          temperature=0)
    assert free.choices[0].message.content.startswith("<tool_call>")
    bound = client.chat.completions.create(model="demo", messages=user("hi"), max_tokens=24,
                                           temperature=0, tool_choice="none")
    assert "<tool_call>" not in bound.choices[0].message.content


def test_a_call_cut_by_max_tokens_goes_back_in_the_history(client):
    """OpenAI's API takes a call's arguments as any text; this server refused its own cut call
    (arguments not yet JSON) sent back with the tool's error, as agent loops do."""
    messages = user("Use get_weather with city Oslo, days 3.")
    cut = client.chat.completions.create(model="demo", messages=messages, tools=TOOLS,
                                         tool_choice="required", max_tokens=12, temperature=0)
    assert cut.choices[0].finish_reason == "length"
    call = cut.choices[0].message.tool_calls[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    history = [*messages, cut.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "error: cut off"}]
    again = client.chat.completions.create(model="demo", messages=history, tools=TOOLS,
                                           max_tokens=8, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_strict_mode_is_each_tools_and_the_response_formats_own():
    """One tool's ``"strict": false`` opened every tool's arguments and the response format;
    a format's ``strict: false`` every tool's."""
    from agentflash.server.chat import _answer_schema, _tool_choice, reply_grammar
    from agentflash.server.protocol import parse_request

    params = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    answer = {"type": "object", "properties": {"y": {"type": "string"}}}

    def grammar(loose_tool: bool, loose_format: bool) -> str:
        request = parse_request(json.dumps({
            "model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "loose", "parameters": params,
                                                         "strict": not loose_tool}},
                      {"type": "function", "function": {"name": "tight", "parameters": params,
                                                         "strict": True}}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "schema": answer, "strict": not loose_format}}}).encode())
        tools = [t.model_dump(exclude_unset=True) for t in request.tools]
        return reply_grammar(tools, _tool_choice(request, tools), True, _answer_schema(request),
                             answer_strict=request.response_format.json_schema.strict).text

    closed = '"additionalProperties": false'
    rules = {line.split(":")[0]: line for line in grammar(True, False).splitlines()}
    body = json.loads(rules["body"].split("%json ", 1)[1])
    assert closed not in json.dumps(body["anyOf"][0]["properties"]["arguments"])
    assert closed in json.dumps(body["anyOf"][1]["properties"]["arguments"])
    assert closed in rules["answer"]
    rules = {line.split(":")[0]: line for line in grammar(False, True).splitlines()}
    assert closed not in rules["answer"] and rules["body"].count(closed) == 4


def test_tools_with_a_response_format_answer_or_call(client):
    schema = {"type": "object", "properties": {"status": {"type": "string"}},
              "required": ["status"]}
    messages = [*user("Use book_hotel with city Rome, guests 2."),
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "book_hotel", "arguments": '{"city": "Rome", "guests": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1",
                 "content": '{"status": "ok", "id": 7}'}]
    reply = client.chat.completions.create(
        model="demo", messages=messages, tools=TOOLS, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}})
    message = reply.choices[0].message
    if message.tool_calls:
        assert_valid_calls(message, SCHEMAS)
    else:
        jsonschema.validate(json.loads(message.content), schema)


def collect_stream(client, **kwargs):
    chunks = list(client.chat.completions.create(model="demo", stream=True,
                                                 stream_options={"include_usage": True},
                                                 **kwargs))
    calls, content, finish, stats = {}, "", None, None
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id and delta.function.name and delta.type == "function"
                calls[delta.index] = {"id": delta.id, "name": delta.function.name,
                                      "arguments": "", "pieces": 0}
            else:
                assert delta.id is None and delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
            calls[delta.index]["pieces"] += 1
        if choice.finish_reason:
            finish, stats = choice.finish_reason, chunk.model_extra["agentflash"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    return calls, content, finish, stats, chunks[-1].usage


def test_streamed_tool_call_deltas_add_up_to_the_whole_reply(client):
    args = dict(messages=user("Use get_weather with city Oslo, days 3."), tools=TOOLS,
                tool_choice="required", max_tokens=120, temperature=0)
    calls, content, finish, stats, usage = collect_stream(client, **args)
    whole = client.chat.completions.create(model="demo", **args)
    assert finish == "tool_calls" and content == ""
    assert stats["new_tokens"] == usage.completion_tokens
    expected = whole.choices[0].message.tool_calls
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in expected]
    assert all(c["pieces"] >= 2 for c in calls.values())  # the arguments came as they were written
    assert usage.completion_tokens == whole.usage.completion_tokens
    # the client's own accumulation: content null both ways (the stream said "")
    with client.chat.completions.stream(model="demo", **args) as stream:
        streamed = stream.get_final_completion().choices[0].message
    assert streamed.content is None and whole.choices[0].message.content is None


@pytest.mark.parametrize("args", [
    dict(messages=user("Hello, who are you?"), max_tokens=40, temperature=0),
    # sampled text that begins with a blank (the whole reply was stripped of it)
    dict(messages=user("Use get_weather with city Oslo and also get_time with tz CET."),
         tools=TOOLS, max_tokens=60, temperature=1.0, seed=0),
])
def test_streamed_text_equals_the_whole_reply(client, args):
    calls, content, finish, _, usage = collect_stream(client, **args)
    whole = client.chat.completions.create(model="demo", **args)
    assert content == (whole.choices[0].message.content or "")
    assert finish == whole.choices[0].finish_reason


def test_stop_strings_and_max_tokens(client):
    reply = client.chat.completions.create(model="demo", messages=user("Hello, who are you?"),
                                           max_completion_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    full = client.chat.completions.create(model="demo", messages=user("Hello, who are you?"),
                                          max_tokens=40, temperature=0).choices[0].message.content
    word = full.split()[1]
    cut = client.chat.completions.create(model="demo", messages=user("Hello, who are you?"),
                                         max_tokens=40, temperature=0, stop=[word])
    # the blank before the stop string too (it was held back as if a call might follow)
    assert cut.choices[0].message.content == full[: full.index(word)]


def test_a_stop_string_cuts_a_tool_call_written_without_tools(client):
    # given no tools, the demo model greets with a call of its own: text, which the stop string
    # cut nowhere after its <tool_call> (the content held "name", finish reason length)
    hi = dict(model="demo", messages=user("hi"), max_tokens=20, temperature=0)
    full = client.chat.completions.create(**hi).choices[0].message.content
    assert full.startswith("<tool_call>") and '"name"' in full, full
    cut = client.chat.completions.create(**hi, stop=["name"]).choices[0]
    assert (cut.message.content, cut.finish_reason) == (full[: full.index("name")], "stop")
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in client.chat.completions.create(**hi, stop=["name"],
                                                                   stream=True)
                       if chunk.choices)
    assert streamed == cut.message.content


def test_a_reply_keeps_the_blank_it_ends_with_after_text_not_after_a_call():
    """Whitespace alone in a delta is held back (beside a call it is no content); at the reply's
    end after text it is content, whether a step committed it alone (plain) or with the text
    before it (dflash): the modes' replies differed."""
    from agentflash.backends.base import (
        MalformedToolCall,
        TextDelta,
        ToolCall,
        ToolCallDelta,
        ToolCallReady,
    )
    from agentflash.server.chat import ReplyWriter

    def reply(*events):
        writer = ReplyWriter()
        sent = [delta for event in events for delta in writer.deltas(event)] + writer.close()
        assert "".join(d.get("content", "") for d in sent) == (writer.text() or "")
        return writer.text(), writer.tool_calls()

    assert reply(TextDelta("Done."), TextDelta("\n")) == reply(TextDelta("Done.\n")) == (
        "Done.\n", [])
    assert reply(TextDelta(" \n")) == (" \n", [])
    text, calls = reply(TextDelta("Hi."), TextDelta("\n"), ToolCallDelta(0, "f", "{}"),
                        ToolCallReady(0, ToolCall("c1", "f", {})), TextDelta("\n"))
    assert text == "Hi." and [c["function"]["name"] for c in calls] == ["f"]
    # the blank came with the text before the call in one delta (a block of accepted tokens):
    # it was content then, and not when it came alone
    assert reply(TextDelta("Hi.\n\n"), ToolCallDelta(0, "f", "{}"),
                 ToolCallReady(0, ToolCall("c1", "f", {})))[0] == text
    assert reply(TextDelta("Hi. "), TextDelta("there.")) == ("Hi. there.", [])
    # a call cut before its name is whole: no text of it (its markup is no answer)
    assert reply(TextDelta("Hi.\n"), ToolCallReady(0, MalformedToolCall("c1", '{"na', "x"))
                 ) == ("Hi.\n", [])
    # cut right after its <tool_call>: neither a call nor text (the stream's content was "",
    # or the blank between the calls, where the whole reply's was null)
    text, calls = reply(ToolCallDelta(0, "f", "{}"), ToolCallReady(0, ToolCall("c1", "f", {})),
                        TextDelta("\n"), ToolCallReady(1, MalformedToolCall("c2", "", "cut")))
    assert text is None and len(calls) == 1
    # a call sent as text takes no index: the next call's is 0, as its place in the whole reply
    writer = ReplyWriter()
    writer.deltas(ToolCallReady(0, MalformedToolCall("c1", "not json", "x")))
    (delta,) = writer.deltas(ToolCallDelta(1, "f", "{}"))
    assert delta["tool_calls"][0]["index"] == 0


def test_a_calls_arguments_are_whole_in_the_stream_only_once_the_call_closes():
    """The runtime's backend runs a call once its arguments are a whole object: a call that
    max_tokens then cuts before its </tool_call> ran remotely, never on the embedded engine.
    The arguments' last "}" goes out with the call's close, or, cut, with the finish chunk."""
    from agentflash.backends.base import (
        MalformedToolCall,
        ToolCall,
        ToolCallDelta,
        ToolCallReady,
    )
    from agentflash.server.chat import ReplyWriter

    def sent(deltas):
        return "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", []))

    writer = ReplyWriter()
    assert sent(writer.deltas(ToolCallDelta(0, "f", '{"a": {"b": 1}'))) == '{"a": {"b": 1'
    assert sent(writer.deltas(ToolCallDelta(0, "f", "}"))) == "}"
    assert sent(writer.deltas(ToolCallReady(0, ToolCall("c", "f", {"a": {"b": 1}})))) == "}"
    assert sent(writer.deltas(ToolCallDelta(1, "f", '{"a": 2}'))) == '{"a": 2'
    assert writer.deltas(ToolCallReady(1, MalformedToolCall("d", "...", "cut"))) == []
    assert writer.last_delta() == {"tool_calls": [{"index": 1, "function": {"arguments": "}"}}]}
    assert [c["function"]["arguments"] for c in writer.tool_calls()] == ['{"a": {"b": 1}}',
                                                                         '{"a": 2}']


def test_a_streamed_reply_adds_up_to_the_whole_one_without_text_too(client):
    """A reply of calls alone under tool_choice auto, and an empty one: the stream opened with
    content "" where the whole reply said null, and the whole empty reply said null."""
    full = client.chat.completions.create(model="demo", messages=user("Hello, who are you?"),
                                          max_tokens=20, temperature=0).choices[0].message.content
    for args in (dict(messages=user("Use get_weather with city Oslo, days 3."), tools=TOOLS,
                      max_tokens=120, temperature=0),
                 dict(messages=user("Hello, who are you?"), max_tokens=20, temperature=0,
                      stop=[full[:2]])):
        whole = client.chat.completions.create(model="demo", **args).choices[0].message
        with client.chat.completions.stream(model="demo", **args) as stream:
            streamed = stream.get_final_completion().choices[0].message
        assert streamed.content == whole.content
        assert (whole.content is None) == bool(whole.tool_calls)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("kwargs, status, param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), 400,
     "tool_choice"),
    # jsonschema's meta-schema walk recursed past Python's stack: a 500, the connection closed
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": _nested(180)}}}}]), 400, "tools"),
    (dict(tool_choice="required"), 400, "tool_choice"),
    (dict(temperature="hot"), 400, "temperature"),
    (dict(temperature=0.5, seed=10**23), 400, "seed"),  # beyond what a torch generator takes
    (dict(max_completion_tokens=10**6), 400, "max_completion_tokens"),
    # a stop string would cut a reply that must parse whole
    (dict(tools=TOOLS, tool_choice="required", stop=["city"]), 400, "stop"),
    (dict(response_format={"type": "json_object"}, stop="a"), 400, "stop"),
    (dict(max_tokens=10**6), 400, "max_tokens"),
    (dict(n=2), 400, "n"),
    # silently ignored before: they change the output, or OpenAI's API refuses them
    (dict(logit_bias={"50": 100}), 400, "logit_bias"),
    (dict(functions=[{"name": "f", "parameters": {"type": "object"}}]), 400, "functions"),
    (dict(stream_options={"include_usage": True}), 400, "stream_options"),
    (dict(modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}), 400,
     "modalities"),
    (dict(extra_body={"audio": {"voice": "alloy", "format": "wav"}}), 400, "audio"),
    # vLLM's own fields (extra_body), ignored: top_k 1 sampled, guided_json wrote free text
    (dict(extra_body={"top_k": 1}), 400, "top_k"),
    (dict(extra_body={"min_p": 0.5}), 400, "min_p"),
    (dict(extra_body={"repetition_penalty": 1.2}), 400, "repetition_penalty"),
    (dict(extra_body={"use_beam_search": True}), 400, "use_beam_search"),
    (dict(extra_body={"guided_json": {"type": "object"}}), 400, "guided_json"),
    (dict(extra_body={"guided_choice": ["a", "b"]}), 400, "guided_choice"),
    (dict(extra_body={"regex": "[a-z]+"}), 400, "regex"),  # SGLang's
    (dict(extra_body={"ignore_eos": True}), 400, "ignore_eos"),
    (dict(extra_body={"skip_special_tokens": False}), 400, "skip_special_tokens"),
    (dict(web_search_options={}), 400, "web_search_options"),
    (dict(messages=[{"role": "user", "content": "hi"},
                    {"role": "tool", "tool_call_id": "call_x", "content": "r"}]), 400,
     "messages[1].tool_call_id"),
    (dict(messages=[{"role": "user"}]), 400, "messages[0]"),
    (dict(top_logprobs=2), 400, "top_logprobs"),  # not silently without logprobs
    # the extension's own keys: a misspelt one did nothing
    (dict(extra_body={"agentflash": {"blocksize": 4}}), 400, "agentflash.blocksize"),
    (dict(logprobs=True), 400, "logprobs"),
    (dict(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (dict(tools=[{"type": "function", "function": {"name": "x", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]), 400, "tools"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "response_format.json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}), 400, "response_format.json_schema.schema"),
    (dict(model="gpt-4o"), 404, "model"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "content": "r"}]), 400,
     "messages[1]"),
    (dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant"}]), 400,
     "messages[1]"),
    # a literal the grammar would have to write as text, and the tokenizer reads as a special
    # token: refused when the grammar is built (it was a 500 at the first step)
    (dict(tools=[{"type": "function", "function": {"name": "emit", "parameters": {
        "type": "object", "properties": {"tag": {"type": "string", "enum": ["</tool_call>"]}},
        "required": ["tag"]}}}], tool_choice="required"), 400, "tools"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"const": "<tool_response>"}}}}}), 400,
     "response_format"),
])
def test_bad_requests_get_openai_errors(client, kwargs, status, param):
    kwargs = {"model": "demo", "messages": user("hi"), "max_tokens": 8, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**kwargs)
    err = info.value
    assert err.status_code == status and err.param == param, err.body
    assert isinstance(err.message, str) and err.type in ("invalid_request_error",
                                                         "not_found_error")


def test_an_api_error_survives_a_copy_and_a_pickle():
    from agentflash.server.protocol import APIError

    err = APIError(413, "too large", type="too_large", param="messages", code="big")
    for back in (copy.copy(err), pickle.loads(pickle.dumps(err))):  # __init__ takes a status
        assert (back.status, back.body()) == (413, err.body())


def post(url, content, headers=None):
    return httpx.post(f"{url}/chat/completions", content=content, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_malformed_requests_get_4xx(url):
    good = {"model": "demo", "messages": user("hi"), "max_tokens": 4}
    # a web page's POST that needs no CORS preflight (text/plain, a form) ran as a request
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        error = assert_error(post(url, json.dumps(good), {"content-type": kind}), 415)
        assert error["message"].endswith(f"not {kind}") and error["code"] == \
            "unsupported_media_type"
    for kind in ("application/json; charset=utf-8", "application/vnd.api+json"):
        assert post(url, json.dumps(good), {"content-type": kind}).status_code == 200
    # none said (fetch's body of a Blob without a type, an ArrayBuffer): no preflight either
    unsaid = httpx.post(f"{url}/chat/completions", content=json.dumps(good), timeout=60)
    assert assert_error(unsaid, 415)["message"].endswith("not empty")
    assert assert_error(post(url, b"{not json"), 400)["message"].startswith("the request body "
                                                                           "is not valid JSON")
    assert_error(post(url, b"[1, 2]"), 400)
    assert_error(post(url, b"\xff\xfe"), 400)
    assert assert_error(post(url, json.dumps({**good, "messages": "hi"})), 400)["param"] == \
        "messages"
    error = assert_error(post(url, json.dumps({**good, "messages": [{"role": "robot"}]})), 400)
    assert error["param"] == "messages[0].role"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(post(url, json.dumps({**good, "messages": image})), 400)
    # no parts at all, which OpenAI's API refuses (it was taken as empty text)
    error = assert_error(post(url, json.dumps({**good, "messages": [{"role": "user",
                                                                     "content": []}]})), 400)
    assert error["param"].startswith("messages[0].content"), error
    long = [{"role": "user", "content": "word " * 3000}]
    assert assert_error(post(url, json.dumps({**good, "messages": long})), 400)["code"] == \
        "context_length_exceeded"
    # refused for its length with a schema never seen: nothing compiled (a thousand tools' took
    # seconds and 26 MB of cache, for a request that was refused anyway)
    from agentflash.grammar import cache_info

    fresh = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"never_compiled": {"type": "integer"}}}}}
    misses = cache_info()["misses"]
    assert assert_error(post(url, json.dumps({**good, "messages": long,
                                              "response_format": fresh})), 400)["code"] == \
        "context_length_exceeded"
    assert cache_info()["misses"] == misses
    assert_error(httpx.get(f"{url}/chat/completions"), 405)
    assert_error(httpx.get(f"{url}/nowhere"), 404)
    # JSON's NaN read by Python: "less than or equal to 2", as if it were a number too big
    for name in ("temperature", "top_p"):
        error = assert_error(post(url, json.dumps({**good, name: math.nan})), 400)
        assert error["param"] == name and "finite number" in error["message"], error


def test_oversized_bodies_get_413(url):
    big = json.dumps({"model": "demo", "messages": user("x" * (2 * BODY_LIMIT))})
    assert assert_error(post(url, big), 413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(8):
            yield b" " * BODY_LIMIT
    response = httpx.post(f"{url}/chat/completions", content=chunks(), timeout=60,
                          headers={"content-type": "application/json"})
    assert_error(response, 413)
    with pytest.raises(openai.APIStatusError) as info:
        OpenAI(base_url=url, api_key="x", max_retries=0).chat.completions.create(
            model="demo", messages=user("x" * (2 * BODY_LIMIT)))
    assert info.value.status_code == 413


def test_concurrent_clients_get_their_own_replies(client, url):
    def ask(text):
        reply = client.chat.completions.create(model="demo", messages=user(text), tools=TOOLS,
                                               max_tokens=60, temperature=0)
        message = reply.choices[0].message
        return message.content, [(c.function.name, c.function.arguments)
                                 for c in message.tool_calls or []]

    alone = [ask(text) for text in ASKS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, ASKS * 2))
    assert together == alone * 2
    assert httpx.get(url.removesuffix("/v1") + "/health").json()["requests_in_flight"] == 0


def wait_idle(url, engine, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(url.removesuffix("/v1") + "/health").json()
        if health["requests_in_flight"] == 0 and not engine.has_work:
            return health
        time.sleep(0.05)
    raise AssertionError(f"the server did not become idle: {health}")


def test_a_client_that_disconnects_cancels_its_request(url, engine, client):
    cancelled = []
    original = engine.cancel

    def recording_cancel(req):
        cancelled.append(req)
        original(req)

    engine.cancel = recording_cancel
    endless = {"type": "object", "properties": {"story": {"type": "string", "minLength": 9000}},
               "required": ["story"]}
    body = {"model": "demo", "messages": user("Tell a story."), "max_tokens": 900,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "s", "schema": endless}}}
    try:
        with httpx.Client(timeout=60) as http:  # streaming: leave after the first event
            with http.stream("POST", f"{url}/chat/completions",
                             json={**body, "stream": True}) as response:
                assert next(response.iter_lines()).startswith("data: ")
        wait_idle(url, engine)
        host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
        payload = json.dumps(body).encode()
        with socket.create_connection((host, int(port))) as sock:  # plain: hang up mid-reply
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(payload), payload))
            deadline = time.monotonic() + 30
            while not engine.has_work and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.05)
        wait_idle(url, engine)
        assert len(cancelled) == 2
        for req in cancelled:
            assert req.finish_reason.value == "cancelled" and len(req.output_ids) < 900
    finally:
        engine.cancel = original
    reply = client.chat.completions.create(model="demo", messages=user("hi"), max_tokens=4)
    assert reply.choices[0].message.content is not None


def test_api_key_and_concurrency_limit(tiny_model_dir):
    engine = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_len=1024))
    config = ServerConfig(port=0, api_key="s3cret", max_concurrent=1, served_name="tiny")
    with serving_in_thread(config, engine) as url:
        root = url.removesuffix("/v1")
        assert httpx.get(f"{root}/health").status_code == 200
        assert assert_error(httpx.get(f"{url}/models"), 401)["code"] == "invalid_api_key"
        wrong = {"authorization": "Bearer nope"}
        assert_error(post(url, b"{}", wrong), 401)
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=url, api_key="nope", max_retries=0).models.list()
        client = OpenAI(base_url=url, api_key="s3cret", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        stream = client.chat.completions.create(model="tiny", messages=user("hi"), stream=True,
                                                max_tokens=200, temperature=0)
        next(iter(stream))  # the one allowed request is in flight
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="tiny", messages=user("hi"), max_tokens=2)
        assert info.value.code == "too_many_requests"
        stream.close()
        wait_idle(url, engine)
        reply = client.chat.completions.create(model="tiny", messages=user("hi"), max_tokens=2)
        assert reply.usage.completion_tokens <= 2


def test_a_body_that_never_arrives_whole_is_a_408_and_frees_its_place(tiny_model_dir):
    # a client that sent its headers and then nothing held a place of max_concurrent for ever:
    # 64 of them shut every other client out
    engine = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_len=1024))
    config = ServerConfig(port=0, max_concurrent=1, served_name="tiny", body_timeout_s=1.0)
    with serving_in_thread(config, engine) as url:
        host, port = url.split("//")[1].split("/")[0].split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 500\r\n\r\n{\"model\"")
            time.sleep(0.2)
            assert assert_error(post(url, b"{}"), 429)["code"] == "too_many_requests"
            sock.settimeout(10)
            answer = b""  # to its end: the head and the body may come in two reads
            while chunk := sock.recv(65536):
                answer += chunk
            answer = answer.decode()
        assert answer.startswith("HTTP/1.1 408 "), answer
        assert "did not arrive whole within 1 s (8 bytes came)" in answer
        reply = OpenAI(base_url=url, api_key="unused", max_retries=0).chat.completions.create(
            model="tiny", messages=user("hi"), max_tokens=2)
        assert reply.usage.completion_tokens <= 2
    with pytest.raises(UserError, match="server body_timeout_s must be positive, got 0"):
        ServerConfig(body_timeout_s=0)


def test_responses_do_not_wait_for_delayed_acks(url):
    # Headers and body go out as two writes; without TCP_NODELAY on the accepted sockets the
    # body waits for the client's delayed ACK (40 ms or more on Linux) on every response.
    # Checked on the server's end of the connection (not by timing the responses).
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with httpx.Client(timeout=10) as http:
        http.get(f"{url}/models").raise_for_status()  # the connection stays open, kept alive
        accepted = [s for s in gc.get_objects() if issubclass(type(s), socket.socket)
                    and s.fileno() >= 0 and _ends(s) == port]
        assert accepted
        for sock in accepted:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def _ends(sock: socket.socket) -> int | None:
    """The local port of a connected socket (an accepted one's is the server's), else None."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        sock.getpeername()
    except OSError:
        return None
    return sock.getsockname()[1]


def test_a_failing_engine_step_ends_its_requests_with_500_and_the_server_serves_on(
        tiny_model_dir):
    engine = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_len=1024))
    endless = {"type": "object", "properties": {"s": {"type": "string", "minLength": 9000}},
               "required": ["s"]}
    body = {"model": "tiny", "messages": user("hi"), "max_tokens": 900, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": endless}}}
    replies = {}
    with serving_in_thread(ServerConfig(port=0, max_tokens=900, served_name="tiny"),
                           engine) as url:
        def plain():
            replies["plain"] = httpx.post(f"{url}/chat/completions", json=body, timeout=60)

        def streamed():
            with httpx.stream("POST", f"{url}/chat/completions", json={**body, "stream": True},
                              timeout=60) as response:
                replies["stream"] = [line for line in response.iter_lines() if line]

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = [pool.submit(plain), pool.submit(streamed)]
            deadline = time.monotonic() + 30
            while len(engine.scheduler.running) < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            forward = engine.runner.forward

            def fails_once(*args, **kwargs):
                engine.runner.forward = forward
                raise RuntimeError("injected engine failure")

            engine.runner.forward = fails_once  # the next step raises, with both requests in it
            for future in running:
                future.result(timeout=60)
        error = assert_error(replies["plain"], 500)
        assert error["code"] == "engine_error" and "injected engine failure" in error["message"]
        event = json.loads(replies["stream"][-1].removeprefix("data: "))
        assert event["error"]["code"] == "engine_error"
        health = httpx.get(url.removesuffix("/v1") + "/health")
        assert health.status_code == 200 and health.json()["requests_in_flight"] == 0
        reply = post(url, json.dumps({**body, "max_tokens": 2}))
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_dflash_asked_of_a_server_without_a_drafter_is_a_400(tiny_model_dir):
    plain = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_len=256), drafter=None)
    with serving_in_thread(ServerConfig(port=0), plain) as base_url:
        reply = httpx.post(f"{base_url}/chat/completions", timeout=60, json={
            "model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "agentflash": {"speculation": "dflash"}})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "agentflash.speculation" and "needs a drafter" in error["message"]


def test_a_client_gone_while_sending_its_body_is_no_internal_error(url, caplog):
    host, port = url.split("//")[1].split("/")[0].split(":")
    with caplog.at_level(logging.ERROR), socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 500\r\n\r\n{\"model\"")
        time.sleep(0.2)
    time.sleep(0.5)  # the server reads on, finds the client gone
    assert not [r for r in caplog.records if "internal error" in r.getMessage()]
    assert httpx.get(url.removesuffix("/v1") + "/health").json()["status"] == "ok"


def test_a_participants_name_reaches_the_chat_template(demo_tokenizer_dir):
    # OpenAI's API takes a name per message, for the model to tell participants apart: it was
    # dropped before the template could show it
    from transformers import AutoTokenizer

    from agentflash.server.chat import chat_messages
    from agentflash.server.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate({"model": "demo", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi", "name": "alice"},
        {"role": "assistant", "content": "hello", "name": "bot"},
        {"role": "user", "content": "and me?"}]})
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    tok.chat_template = ("{% for m in messages %}{{ m.get('name', m['role']) }}: {{ m['content'] }}"
                         "\n{% endfor %}")
    text = tok.apply_chat_template(chat_messages(request.messages), tokenize=False)
    assert text == "system: Be brief.\nalice: hi\nbot: hello\nuser: and me?\n"


def test_generate_and_serve_read_one_conversation_alike():
    """The same messages and tools give the same prompt through ``generate`` (its input) and
    ``serve``: a second or later system message was dropped by the demo's template through
    generate (serve merged it), ``developer`` was refused there, text parts too (serve joins
    them), and serve re-wrote a tool in OpenAI's field order, dropping keys, where generate kept
    it as written."""
    from agentflash.engine.engine import Engine
    from agentflash.inputs import make_input
    from agentflash.server.chat import chat_messages
    from agentflash.server.protocol import ChatCompletionRequest

    messages = [{"role": "system", "content": "You are a pirate."},
                {"role": "developer", "content": "Always answer in French."},
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "system", "content": "From now on, briefly."},
                {"role": "user", "content": [{"type": "text", "text": "how "},
                                             {"type": "text", "text": "are you"}]}]
    tools = [{"type": "function", "function": {
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "x-owner": "team-a", "name": "get_weather", "description": "Weather."}}]
    engine = Engine.from_pretrained("demo", drafter=None)
    given = make_input({"messages": messages, "tools": tools}, "command line")
    request = ChatCompletionRequest.model_validate({"model": "demo", "messages": messages,
                                                    "tools": tools})
    served = chat_messages(request.messages)
    assert given.messages == served
    assert served[0] == {"role": "system", "content": "You are a pirate.\n\nAlways answer in "
                                                      "French.\n\nFrom now on, briefly."}
    assert served[-1] == {"role": "user", "content": "how are you"}
    assert messages[-1]["content"][0] == {"type": "text", "text": "how "}  # (not rewritten)
    assert given.tools == [t.model_dump(exclude_unset=True) for t in request.tools]
    assert engine.chat_prompt(given.messages, given.tools) == \
        engine.chat_prompt(served, [t.model_dump(exclude_unset=True) for t in request.tools])


def test_a_tool_message_needs_content(client):
    # OpenAI's API refuses it (an empty <tool_response> went to the model)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": "{}"}}
    with pytest.raises(openai.BadRequestError, match="a tool message needs content"):
        client.chat.completions.create(model="demo", max_tokens=4, messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1"}])


def test_a_called_function_needs_a_name(client):
    # as generate refuses it: a call to no function went into the prompt
    call = {"id": "c1", "type": "function", "function": {"name": "", "arguments": "{}"}}
    with pytest.raises(openai.BadRequestError,
                       match=r"messages\[1\]\.tool_calls\[0\]\.function\.name: String should"):
        client.chat.completions.create(model="demo", max_tokens=4, messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "{}"}])


def test_vllm_fields_that_change_nothing_are_taken(client):
    # vLLM's defaults, as its clients send them: the reply they ask for is this server's
    reply = client.chat.completions.create(
        model="demo", messages=user("hi"), max_tokens=4, temperature=0,
        extra_body={"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0,
                    "best_of": 1, "use_beam_search": False, "ignore_eos": False,
                    "skip_special_tokens": True, "stop_token_ids": []})
    assert reply.choices[0].message.content is not None
