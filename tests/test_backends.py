"""The backend seam: the incremental Hermes parser, the scripted backend, the embedded engine."""

import json

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentflash.backends import create_backend, is_available
from agentflash.backends.base import (
    BackendKind,
    Decoding,
    ForceTool,
    MalformedToolCall,
    ModelFinish,
    ModelRequest,
    ModelSpec,
    Speculation,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallReady,
    ToolChoice,
)
from agentflash.backends.local import EngineFailed, HermesStreamParser, LocalBackend, turn_grammar
from agentflash.backends.scripted import ScriptedBackend, ScriptedTurn, tool_call_text
from agentflash.errors import UserError
from agentflash.runtime.errors import RunError
from agentflash.tool_format import ParsedToolCall

REPLY = ('Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
         '"note": "a } and a \\" inside", "days": [1, {"x": 2}]}}\n</tool_call>\n'
         '<tool_call>\n{"name": "book_hotel", "arguments": {"guests": 2}}\n</tool_call> Done.')


def parse(text: str, chunk: int, answers: bool = False) -> list:
    parser = HermesStreamParser("c", answers=answers)
    events = []
    for i in range(0, len(text), chunk):
        events += parser.feed(text[i : i + chunk])
    return events + parser.close("stop")


def summary(events: list) -> tuple:
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            args[e.index] = args.get(e.index, "") + e.arguments_delta
    calls = [e.call for e in events if isinstance(e, ToolCallReady)]
    return text, args, calls


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 11, 64, 1000])
def test_parser_gives_the_same_events_whatever_the_chunking(chunk):
    text, args, calls = summary(parse(REPLY, chunk))
    assert text == "Checking both.\n\n Done."
    assert args == {0: '{"city": "Oslo", "note": "a } and a \\" inside", "days": [1, {"x": 2}]}',
                    1: '{"guests": 2}'}
    assert [json.loads(a) for a in args.values()] == [c.arguments for c in calls]
    assert calls == [ToolCall("c_0", "get_weather", {"city": "Oslo", "note": 'a } and a " inside',
                                                     "days": [1, {"x": 2}]}),
                     ToolCall("c_1", "book_hotel", {"guests": 2})]


def test_parser_streams_arguments_before_the_call_closes():
    parser = HermesStreamParser()
    events = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os')
    assert [e for e in events if isinstance(e, ToolCallDelta)][-1].arguments_delta.endswith('"Os')
    assert not any(isinstance(e, ToolCallReady) for e in events)
    events = parser.feed('lo"}}\n</tool_call>')
    assert isinstance(events[-1], ToolCallReady) and events[-1].call.arguments == {"city": "Oslo"}


def test_parser_holds_back_a_partial_tag_and_never_leaks_it_as_text():
    parser = HermesStreamParser()
    assert parser.feed("Hello <tool_") == [TextDelta("Hello ")]
    assert parser.feed("cal") == []
    events = parser.feed('l>{"name": "f", "arguments": {}}</tool_call>')
    assert [type(e) for e in events] == [ToolCallDelta, ToolCallDelta, ToolCallReady]
    assert parser.feed("<tool") == [] and parser.close("stop") == [TextDelta("<tool")]


def test_parser_reports_malformed_and_unclosed_calls():
    events = parse('<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>'
                   '<tool_call>["f"]</tool_call>'
                   '<tool_call>{"name": "g", "arguments": 3}</tool_call>'
                   '<tool_call>{"name": "h", "arguments": {"x"', 4)
    bad = [e.call for e in events if isinstance(e, ToolCallReady)]
    assert all(isinstance(c, MalformedToolCall) for c in bad) and len(bad) == 4
    assert "invalid JSON" in bad[0].error
    assert 'string "name"' in bad[1].error
    assert '"arguments" must be an object' in bad[2].error
    assert "not closed" in bad[3].error and "stop" in bad[3].error
    # a name or arguments given twice: JSON reads the last, the stream showed the first
    from agentflash.tool_format import parse_tool_calls

    for text in ('<tool_call>{"name": "f", "arguments": {"a": 1}, "name": "g"}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {}}</tool_call>'):
        (ready,) = [e.call for e in parse(text, 7) if isinstance(e, ToolCallReady)]
        assert isinstance(ready, MalformedToolCall) and "given twice" in ready.error
        assert parse_tool_calls(text)[1][0].error == ready.error


def test_a_call_cut_after_a_string_holding_its_closing_tag_is_one_call():
    """The tag inside a string ended the call where its quotes did not pair: cut by max_tokens
    after the arguments, the call's JSON ran on as text (and the server sent it twice)."""
    from agentflash.tool_format import parse_tool_calls, text_outside_calls

    body = '{"name": "f", "arguments": {"a": "</tool_call>", "b": 1}}'
    escapes = [body[: body.index(" 1}")] + f' "{e}' for e in ("\\u00", "\\u00e9", "\\ud83d")]
    for cut in (f"<tool_call>\n{body}\n", '<tool_call>{"name": "f", "arguments": {"a": "x'
                '</tool_call> more', *(f"<tool_call>{e}" for e in escapes)):
        for chunk in (1, 5, len(cut)):
            parser = HermesStreamParser("c")
            events = [e for i in range(0, len(cut), chunk) for e in parser.feed(cut[i:i + chunk])]
            events += parser.close("length")
            assert not [e for e in events if isinstance(e, TextDelta)], (cut, chunk)
            (ready,) = [e.call for e in events if isinstance(e, ToolCallReady)]
            assert ready.body == cut.removeprefix("<tool_call>").strip()
            assert "not closed" in ready.error
    assert parse_tool_calls(f"<tool_call>\n{body}\n")[1][0].body == body
    # quotes that do not pair (written without a grammar): the call ends at its first tag
    for text, after in (('{"q": "it"s"}}</tool_call>\nOK.', "\nOK."),
                        ('{"size": "5" screen"}}</tool_call>\nThe 5" one.', '\nThe 5" one.')):
        text = '<tool_call>{"name": "f", "arguments": ' + text
        streamed, args, _ = summary(parse(text, 3))
        assert streamed == after and "</tool_call>" not in args[0]  # not sent as both
        assert parse_tool_calls(text)[1][0].body.endswith('"}}')
    # ... also where a later tag stands outside the strings the unpaired quotes made
    text = ('<tool_call>{"name": "f", "arguments": {"a": "it"s"}}</tool_call> He said "hi'
            '</tool_call>')
    assert summary(parse(text, 4))[0] == ' He said "hi</tool_call>'
    assert text_outside_calls(text) == 'He said "hi</tool_call>'


def test_model_text_python_cannot_load_is_a_malformed_call_for_both_parsers():
    from agentflash.tool_format import parse_tool_calls

    huge = '{"name": "f", "arguments": {"x": 1' + "0" * 5000 + "}}"  # over int's 4300 digits
    deep = '{"name": "f", "arguments": ' + '{"a": ' * 20000 + "1" + "}" * 20001  # (3.13 reads
    # 2,000 levels)
    nan = '{"name": "f", "arguments": {"x": NaN, "y": -Infinity}}'  # Python reads, JSON has not
    for body in (huge, deep, nan):
        text = f"<tool_call>\n{body}\n</tool_call>"
        calls, bad = parse_tool_calls(text)
        assert calls == [] and len(bad) == 1 and bad[0].error.startswith("invalid JSON")
        (ready,) = [e for e in parse(text, 64) if isinstance(e, ToolCallReady)]
        assert isinstance(ready.call, MalformedToolCall)
        assert ready.call.error.startswith("invalid JSON")


# Texts both parsers must read alike: (the reply, its calls by name or None if malformed, the text
# outside its calls).
AGREE = [
    # an argument holding the closing tag (the grammar lets a string hold any text)
    ('Hi <tool_call>\n{"name": "f", "arguments": {"s": "a </tool_call> \\"</tool_call>"}}\n'
     "</tool_call> bye", [("f", {"s": 'a </tool_call> "</tool_call>'})], "Hi  bye"),
    # quotes that do not pair (no grammar): the call ends at its first tag after all
    ('<tool_call>{"name": "f", "arguments": {"s": "it"s"}}</tool_call> then '
     '<tool_call>{"name": "g", "arguments": {}}</tool_call>', [None, ("g", {})], "then"),
    # a call never closed (max tokens) is malformed, and none of it is text
    ('Sure. <tool_call>\n{"name": "f", "arguments": {"s": "ab', [None], "Sure."),
]


@pytest.mark.parametrize("reply,expected,outside", AGREE)
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_both_parsers_end_a_call_at_its_closing_tag_outside_strings(reply, expected, outside,
                                                                    chunk):
    from agentflash.tool_format import parse_tool_calls, text_outside_calls

    def named(call):
        ok = isinstance(call, (ToolCall, ParsedToolCall))
        return (call.name, call.arguments) if ok else None

    calls, bad = parse_tool_calls(reply)
    assert [named(c) for c in calls] == [e for e in expected if e]
    assert len(bad) == expected.count(None) and text_outside_calls(reply) == outside
    text, _, streamed = summary(parse(reply, chunk))
    assert [named(c) for c in streamed] == expected and text.strip() == outside


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_a_reply_that_answers_in_a_schema_may_quote_the_tag(chunk):
    # under an output schema the reply is calls or one answer: an answer's string that spelled
    # <tool_call> was read as a broken call, the answer cut before it
    answer = '{"note": "wrap calls in <tool_call>{\\"name\\": \\"f\\"} tags"}'
    assert summary(parse(answer, chunk, answers=True)) == (answer, {}, [])
    assert isinstance(summary(parse(answer, chunk))[2][0], MalformedToolCall)  # (no schema)
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert summary(parse(call, chunk, answers=True)) == summary(parse(call, chunk))
    assert summary(parse(call, chunk, answers=True))[2] == [ToolCall("c_0", "f", {"a": 1})]
    # a server that binds no grammar may write a call after a blank line or a few words: still
    # a call (it was the answer); an answer after blanks is the answer
    for reply in ("\n" + call, "Let me check. " + call, "  \n" + call):
        assert summary(parse(reply, chunk, answers=True)) == summary(parse(reply, chunk))
    assert summary(parse("\n " + answer, chunk, answers=True)) == ("\n " + answer, {}, [])
    assert summary(parse(" \n", chunk, answers=True)) == (" \n", {}, [])


def test_parser_handles_arguments_written_before_the_name():
    events = parse('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', 3)
    _, args, calls = summary(events)
    assert args == {0: '{"a": 1}'} and calls == [ToolCall("c_0", "f", {"a": 1})]


async def collect(backend, request):
    return [e async for e in backend.stream(request)]


def test_scripted_backend_replays_turns_and_records_requests():
    backend = ScriptedBackend([ScriptedTurn.calls(("f", {"a": 1}), text="Hi. "), "Bye."])
    request = ModelRequest([{"role": "user", "content": "x"}])

    async def main():
        first = await collect(backend, request)
        second = await collect(backend, request)
        with pytest.raises(UserError, match="no reply left"):
            await collect(backend, request)
        return first, second

    first, second = anyio.run(main)
    assert summary(first)[2] == [ToolCall("call_0_0", "f", {"a": 1})]
    assert isinstance(first[-1], ModelFinish) and first[-1].finish_reason == "stop"
    assert summary(second)[0] == "Bye." and len(backend.requests) == 3
    expected = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert tool_call_text("f", {"a": 1}) == expected


def test_decoding_checks_each_field():
    assert Decoding(speculation="off").speculation is Speculation.OFF
    from agentflash.engine.request import Speculation as EngineSpeculation

    assert Decoding(speculation=EngineSpeculation.OFF).speculation is Speculation.OFF
    for bad, field in [(dict(speculation="fast"), "speculation"),
                       (dict(block_size=1), "block_size"),
                       (dict(temperature=-1), "temperature"), (dict(max_tokens=0), "max_tokens"),
                       (dict(seed="x"), "seed"), (dict(max_tokens=True), "max_tokens")]:
        with pytest.raises(UserError, match=f"decoding.{field}"):
            Decoding(**bad)
    import numpy as np

    warm = Decoding(temperature=np.float32(0.5))  # a number; JSON (a server's request) takes it
    assert type(warm.temperature) is float and warm.temperature == 0.5
    sized = Decoding(block_size=np.int64(8), max_tokens=np.int32(64), seed=np.uint64(2**63))
    assert json.dumps(vars(sized) | {"speculation": "auto"}) == (
        '{"speculation": "auto", "block_size": 8, "temperature": 0.0, "max_tokens": 64, '
        '"seed": 9223372036854775808}')


def test_chat_template_kwargs_are_the_template_s_variables(tiny_model_dir):
    """Qwen3's enable_thinking had no way in: a turn's prompt is the template's with them."""
    backend = LocalBackend(tiny_model_dir, chat_template_kwargs={"enable_thinking": False})
    plain = LocalBackend(tiny_model_dir)

    async def prompts():
        out = []
        for each in (backend, plain):
            async with each:
                engine = each._engine
                template = engine.tokenizer.chat_template
                engine.tokenizer.chat_template = (
                    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
                    "{% if enable_thinking is defined and not enable_thinking %} no think"
                    "{% endif %}")
                out.append(await each._prompt_ids(ModelRequest([{"role": "user",
                                                                  "content": "hi"}])))
                engine.tokenizer.chat_template = template
        return out

    thinking_off, default = anyio.run(prompts)
    tok = backend._engine.tokenizer
    assert (tok.decode(thinking_off), tok.decode(default)) == ("hi no think", "hi")
    async def open_bad(bad):
        async with bad:
            pass

    for key in ("tokenize", "messages", "conversations", "self"):  # (the last three: a TypeError)
        bad = LocalBackend(tiny_model_dir, chat_template_kwargs={key: True})
        with pytest.raises(UserError, match=f"chat_template_kwargs.{key}: a parameter of "
                                            f"apply_chat_template"):
            anyio.run(open_bad, bad)


def test_a_long_conversation_is_tokenized_off_the_event_loop(tiny_model_dir, monkeypatch):
    """A tool's huge result held every other run on the loop while it was tokenized."""
    import threading

    from agentflash.backends import local

    monkeypatch.setattr(local, "LONG_PROMPT_CHARS", 1_000)
    threads = []
    backend = LocalBackend(tiny_model_dir, max_len=1024)

    async def main():
        async with backend:
            render = backend._engine.chat_prompt
            monkeypatch.setattr(backend._engine, "chat_prompt", lambda *a: (
                threads.append(threading.current_thread()), render(*a))[1])
            for content in ("short", "word " * 250):
                await collect(backend, ModelRequest([{"role": "user", "content": content}],
                                                    decoding=Decoding(max_tokens=2)))

    anyio.run(main)
    main_thread = threading.main_thread()
    assert threads[0] is main_thread and threads[1] is not main_thread


def test_a_backend_refused_as_its_engine_is_served_stays_closed(tiny_model_dir):
    from agentflash.engine.async_engine import AsyncEngine
    from agentflash.engine.engine import Engine

    engine = Engine.from_pretrained(tiny_model_dir)
    backend = LocalBackend(engine=engine)

    async def main():
        async with AsyncEngine(engine):
            with pytest.raises(UserError, match="another AsyncEngine serves this engine"):
                async with backend:
                    pass
        async with backend:  # once the other is gone, it opens
            return await collect(backend, ModelRequest([{"role": "user", "content": "x"}],
                                                       decoding=Decoding(max_tokens=2)))

    assert isinstance(anyio.run(main)[-1], ModelFinish)


def test_backend_kinds_are_modules_of_the_package(tmp_path, monkeypatch):
    assert all(is_available(kind) for kind in BackendKind)
    assert isinstance(create_backend(ModelSpec(path=str(tmp_path))), LocalBackend)
    # a kind whose module this version lacks
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert not is_available(BackendKind.OPENAI)
    with pytest.raises(UserError, match="'openai' is not available in this version"):
        create_backend(ModelSpec(backend=BackendKind.OPENAI))
    monkeypatch.undo()
    with pytest.raises(UserError, match="drafter directory does not exist"):
        LocalBackend(tmp_path, drafter=str(tmp_path / "nope"))


def test_local_backend_streams_engine_output_as_events(tiny_model_dir):
    request = ModelRequest([{"role": "system", "content": "You are a helpful assistant."},
                            {"role": "user", "content": "Use get_weather with city Oslo."}],
                           decoding=Decoding(max_tokens=6, temperature=0.7, seed=3))

    async def main():
        async with LocalBackend(tiny_model_dir) as backend:
            a = await collect(backend, request)
            b = await collect(backend, request)
            with pytest.raises(UserError, match="'dflash' needs a drafter"):
                await collect(backend, ModelRequest(request.messages,
                                                    decoding=Decoding(speculation="dflash")))
        return a, b

    a, b = anyio.run(main)
    finish = a[-1]
    assert isinstance(finish, ModelFinish) and sum(isinstance(e, ModelFinish) for e in a) == 1
    assert finish.stats["new_tokens"] <= 6 and finish.stats["mode"] == "plain"
    assert {"tau", "target_forwards", "draft_forwards", "segments"} <= set(finish.stats)
    assert summary(a) == summary(b)  # seeded sampling is reproducible through the backend


def test_local_backend_needs_opening(tiny_model_dir):
    async def main():
        request = ModelRequest([{"role": "user", "content": "x"}])
        await collect(LocalBackend(tiny_model_dir), request)

    with pytest.raises(UserError, match="open the LocalBackend first"):
        anyio.run(main)


def test_local_backend_definition_errors_are_raised_when_it_is_made(tiny_model_dir):
    from agentflash.engine.async_engine import AsyncEngine
    from agentflash.engine.engine import Engine

    # drafter=None: a raw TypeError of os.fspath's; it is "none", as Engine.from_pretrained
    # reads it
    assert LocalBackend(tiny_model_dir, drafter=None).drafter == "none"

    class Place:  # a PathLike of the user's: its str() is its repr, opened as a directory
        def __fspath__(self):
            return str(tiny_model_dir)

    assert LocalBackend(Place(), drafter=None).model == str(tiny_model_dir)
    with pytest.raises(UserError, match=r"^drafter must be 'auto', 'demo', 'none' \(or None\) "
                                        r"or a drafter directory, got int$"):
        LocalBackend(tiny_model_dir, drafter=5)
    # a model of None was read as the directory "None" when opened
    with pytest.raises(UserError, match="^model must be 'demo' or a model directory, got "
                                        "NoneType$"):
        LocalBackend(None)
    # an engine that is none: an AttributeError ('str' object has no attribute
    # 'check_template_kwargs') when it was opened
    for bad, kind in (("demo", "str"), (5, "int")):
        with pytest.raises(UserError, match=f"^engine must be an Engine "
                                            rf"\(Engine.from_pretrained\(...\)\), got {kind}$"):
            LocalBackend(engine=bad)
    engine = Engine.from_pretrained(tiny_model_dir, drafter=None)
    with pytest.raises(UserError, match="got AsyncEngine \\(an AsyncEngine: give its .engine\\)"):
        LocalBackend(engine=AsyncEngine(engine))
    assert LocalBackend(engine=engine)._engine is engine


def test_local_backend_shows_tools_under_every_tool_choice(tiny_model_dir):
    """Under ``none`` too (as OpenAI-compatible servers do): the grammar forbids calls."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    backend = LocalBackend(tiny_model_dir)

    async def prompts():
        async with backend:
            engine = backend._engine
            seen = []
            original = engine.chat_prompt
            engine.chat_prompt = lambda m, t, k: seen.append(t) or original(m, t, k)
            for choice in (ToolChoice.AUTO, ToolChoice.NONE):
                await collect(backend, ModelRequest(messages, tools, choice,
                                                    decoding=Decoding(max_tokens=2)))
            return seen

    assert anyio.run(prompts) == [tools, tools]


@pytest.mark.parametrize("name", ["none", "auto", "required"])
def test_a_forced_tool_named_like_a_tool_choice_mode_is_that_tool(name):
    """``ForceTool("none")`` forces the tool named none: not the mode none (no calls), nor auto
    or required (any tool)."""
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in (name, "lookup")]
    grammar = turn_grammar(ModelRequest([{"role": "user", "content": "hi"}], tools,
                                        ForceTool(name)))
    assert grammar.text.startswith("start: calls\n")
    assert f'"const": "{name}"' in grammar.text and '"const": "lookup"' not in grammar.text


def test_local_backend_raises_when_the_engine_fails_a_turn(tiny_model_dir):
    request = ModelRequest([{"role": "user", "content": "hi"}], decoding=Decoding(max_tokens=4))

    async def main():
        async with LocalBackend(tiny_model_dir) as backend:
            runner = backend._engine.runner
            forward = runner.forward

            def fails_once(*args, **kwargs):
                runner.forward = forward
                raise RuntimeError("injected engine failure")

            runner.forward = fails_once  # the turn's prefill raises
            with pytest.raises(EngineFailed, match="injected engine failure") as info:
                await collect(backend, request)
            assert isinstance(info.value, RunError)  # the run stops with it
            return await collect(backend, request)  # the next turn runs as usual

    assert isinstance(anyio.run(main)[-1], ModelFinish)


@pytest.fixture(scope="module")
def tiny_drafter_dir(tmp_path_factory):
    import torch

    from agentflash.dflash.checkpoint import save_drafter
    from agentflash.dflash.drafter import DFlashDrafter, DrafterConfig

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                        num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-6,
                        block_size=8, mask_token_id=3, target_layer_ids=(1, 2),
                        num_target_layers=4, vocab_size=4096)
    return save_drafter(DFlashDrafter(cfg), tmp_path_factory.mktemp("tiny-drafter") / "drafter")


def test_local_backend_speculates_with_a_drafter_losslessly(tiny_model_dir, tiny_drafter_dir):
    messages = [{"role": "user", "content": "Use get_weather with city Oslo, days 3."}]

    async def main():
        async with LocalBackend(tiny_model_dir, drafter=str(tiny_drafter_dir)) as backend:
            replies = {}
            for mode in ("dflash", "off"):
                decoding = Decoding(speculation=mode, max_tokens=12, block_size=4)
                replies[mode] = await collect(backend, ModelRequest(messages, decoding=decoding))
            return replies

    replies = anyio.run(main)
    dflash, plain = replies["dflash"][-1].stats, replies["off"][-1].stats
    assert dflash["draft_forwards"] > 0 and plain["draft_forwards"] == 0
    assert summary(replies["dflash"]) == summary(replies["off"])  # same text, fewer forwards


PIECES = ["<tool_call>", "</tool_call>", '"', "{", "}", "[", "]", "\\", "a", " ", "\n",
          '"name": "f"', ', "arguments": ', '{"x": 1}', "<tool", "_call>", "</tool_c",
          '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>']


@given(st.lists(st.sampled_from(PIECES), max_size=16), st.integers(1, 7))
@settings(max_examples=300, deadline=None)
def test_both_parsers_read_any_text_alike(pieces, chunk):
    from agentflash.tool_format import parse_tool_calls

    text = "".join(pieces)
    calls, bad = parse_tool_calls(text)
    streamed = [e.call for e in parse(text, chunk) if isinstance(e, ToolCallReady)]
    assert [(c.name, c.arguments) for c in streamed if isinstance(c, ToolCall)] == [
        (c.name, c.arguments) for c in calls]
    assert sum(isinstance(c, MalformedToolCall) for c in streamed) == len(bad)
