"""Grammar-constrained decoding in the engine: every finished output is valid, and constrained
DFlash gives exactly the tokens of constrained plain decoding."""

import itertools
import random

import jsonschema
import pytest
from conftest import spy_on_agreements, tiny_dflash_engine

from agentflash.engine.engine import Engine
from agentflash.engine.request import SamplingParams
from agentflash.grammar import assistant_turn, json_schema, lark, regex
from agentflash.tool_format import parse_tool_calls
from agentflash.train import corpus


@pytest.fixture(scope="module")
def demo():
    return Engine.from_pretrained("demo", drafter=None)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_dflash_engine(tiny_model_dir, block_size=8, max_len=768)


def random_tools(seed, n=3):
    rng = random.Random(seed)
    tools = []
    while len(tools) < n:
        tool = corpus.random_tool(rng)
        if tool["function"]["name"] not in {t["function"]["name"] for t in tools}:
            tools.append(tool)
    return tools


def check_calls(text, tools):
    calls, bad = parse_tool_calls(text)
    assert calls and not bad, text
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        jsonschema.validate(call.arguments, schemas[call.name])
    return calls


def test_required_tool_calls_are_valid_for_generated_schemas(demo):
    finished = 0
    for seed in range(8):
        tools = random_tools(seed)
        msgs = [{"role": "user", "content": "Please help with this."}]
        res = demo.generate(
            demo.chat_prompt(msgs, tools),
            SamplingParams(max_tokens=160, grammar=assistant_turn(tools, "required")),
        )
        if res.finish_reason == "stop":
            finished += 1
            check_calls(res.text, tools)
            assert res.text.startswith("<tool_call>")
    assert finished >= 6


def test_named_tool_choice_forces_that_tool(demo):
    tools = random_tools(11)
    name = tools[2]["function"]["name"]
    msgs = [{"role": "user", "content": "Go."}]
    res = demo.generate(
        demo.chat_prompt(msgs, tools),
        SamplingParams(max_tokens=160, grammar=assistant_turn(tools, name)),
    )
    assert [c.name for c in check_calls(res.text, tools)] == [name]
    assert sum(s["forced"] for s in res.stats["segments"]) >= len(name)  # the name was forced


def test_a_stop_string_is_not_matched_inside_a_tool_call(demo):
    """Under ``auto`` a call's body is the grammar's: a stop string met there (in its JSON, in
    its closing tag) does not cut it into arguments that do not parse; before a call it cuts."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                              "days": {"type": "integer"}},
                             "required": ["city"]}}}]
    msgs = [{"role": "system", "content": "You are a helpful assistant with access to tools."},
            {"role": "user", "content": "Use get_weather with city Oslo, days 3."}]
    ids = demo.chat_prompt(msgs, tools)

    def run(*stop):
        return demo.generate(ids, SamplingParams(max_tokens=64, stop=stop,
                                                 grammar=assistant_turn(tools, "auto")))

    free = run()
    assert free.text.startswith("<tool_call>") and free.text.endswith("</tool_call>"), free.text
    check_calls(free.text, tools)
    for stop in ('"days"', "}", "</tool_call>", "\n"):
        assert run(stop).token_ids == free.token_ids, stop
    cut = run("\n", "<tool_call>")
    assert (cut.text, cut.finish_reason) == ("", "stop")


def test_schema_answers_validate_and_are_one_schema_segment(demo):
    import json

    finished = 0
    for seed in range(6):
        schema = corpus.random_object(random.Random(seed), 1)
        msgs = [{"role": "user", "content": "Answer with JSON."}]
        res = demo.generate(
            demo.chat_prompt(msgs), SamplingParams(max_tokens=160, grammar=json_schema(schema))
        )
        if res.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(res.text), schema)
        assert {s["kind"] for s in res.stats["segments"]} == {"schema"}
    assert finished >= 2  # 3 of the 6 answers end within 160 tokens on the demo model


def test_an_agents_answer_in_a_schema_is_a_schema_segment_and_its_calls_tool_calls(demo):
    """An agent's or a response format's schema comes as an assistant turn's grammar (the
    answer, or calls beside it): its answer was counted as prose (and math), and routed so."""
    schema = {"type": "object", "properties": {"days": {"type": "integer"}},
              "required": ["days"]}
    msgs = [{"role": "user", "content": "How many days? Answer with JSON."}]
    res = demo.generate(demo.chat_prompt(msgs), SamplingParams(
        max_tokens=40, grammar=assistant_turn([], "none", output_schema=schema)))
    assert {s["kind"] for s in res.stats["segments"]} == {"schema"}, res.stats["segments"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [{"role": "system", "content": "You are a helpful assistant with access to tools."},
            {"role": "user", "content": "Use get_weather with city Oslo."}]
    res = demo.generate(demo.chat_prompt(msgs, tools), SamplingParams(
        max_tokens=60, grammar=assistant_turn(tools, "auto", output_schema=schema)))
    assert res.text.startswith("<tool_call>"), res.text
    kinds = [s["kind"] for s in res.stats["segments"]]
    assert "tool_call" in kinds and set(kinds) <= {"tool_call", "schema"}, kinds
    # a required call's forced opening is the call's: nothing in the reply is prose
    res = demo.generate(demo.chat_prompt(msgs, tools), SamplingParams(
        max_tokens=60, grammar=assistant_turn(tools, "required")))
    assert [s["kind"] for s in res.stats["segments"]] == ["tool_call"], res.stats["segments"]


def test_regex_constrains_the_reply(demo):
    res = demo.generate(
        demo.chat_prompt([{"role": "user", "content": "A date?"}]),
        SamplingParams(max_tokens=30, grammar=regex(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")),
    )
    import re

    assert (
        re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", res.text) and res.finish_reason == "stop"
    )


@pytest.mark.parametrize("seed", range(4))
def test_constrained_dflash_equals_constrained_plain(tiny, seed):
    tools = random_tools(100 + seed, n=2)
    ids = tiny.chat_prompt([{"role": "user", "content": "x"}], tools)
    for source in (
        assistant_turn(tools, "required"),
        json_schema(corpus.random_object(random.Random(seed), 1)),
    ):
        plain = tiny.generate(ids, SamplingParams(max_tokens=80, grammar=source, speculation="off"))
        spec = tiny.generate(
            ids,
            SamplingParams(
                max_tokens=80, grammar=source, speculation="dflash", block_size=2 + 2 * seed
            ),
        )
        assert spec.token_ids == plain.token_ids
        assert spec.stats["draft_forwards"] > 0


def test_forced_tokens_cost_no_forward(tiny):
    tools = random_tools(7, n=1)
    ids = tiny.chat_prompt([{"role": "user", "content": "x"}], tools)
    name = tools[0]["function"]["name"]
    res = tiny.generate(
        ids, SamplingParams(max_tokens=60, speculation="off", grammar=assistant_turn(tools, name))
    )
    forced = sum(s["forced"] for s in res.stats["segments"])
    assert forced > 5
    assert res.stats["target_forwards"] <= res.stats["new_tokens"] - forced


def test_forced_run_longer_than_the_block_is_verified_in_one_forward(tiny):
    # a 40-character literal is one forced run: with 2-token blocks, dflash verifies it at once
    # (after a digit of the model's own: a run the reply begins with goes in with the prompt)
    literal = "the quick brown fox jumps over the lazy dog"
    ids = tiny.chat_prompt([{"role": "user", "content": "x"}])
    source = regex(f"[0-9]\n{literal} [0-9]")
    plain = tiny.generate(ids, SamplingParams(max_tokens=60, grammar=source, speculation="off"))
    spec = tiny.generate(
        ids, SamplingParams(max_tokens=60, grammar=source, speculation="dflash", block_size=2)
    )
    assert spec.token_ids == plain.token_ids and spec.text[2:].startswith(literal)
    run = len(tiny.tokenizer(literal, add_special_tokens=False)["input_ids"])
    assert run > 4
    # the digit from the prompt's forward, the run in one verify forward, then the last digit
    assert spec.stats["target_forwards"] <= 3
    assert sum(s["forced"] for s in spec.stats["segments"]) >= run - 1


@pytest.mark.parametrize("speculation", ["off", "dflash"])
def test_the_tokens_a_reply_is_forced_to_begin_with_go_in_with_the_prompt(tiny, speculation):
    tools = random_tools(7, n=1)
    name = tools[0]["function"]["name"]
    ids = tiny.chat_prompt([{"role": "user", "content": "x"}], tools)
    source = assistant_turn(tools, name)
    lead = tiny.compile(source).new_constraint().forced_tokens()
    assert len(lead) > len(name) // 4  # the tool call's opening and the name at least
    rows = []
    forward = tiny.runner.forward

    def spy(batch, *args, **kwargs):
        rows.append(list(batch))
        return forward(batch, *args, **kwargs)

    tiny.runner.forward = spy
    try:
        tiny.prefix_cache.clear()
        res = tiny.generate(ids, SamplingParams(max_tokens=60, grammar=source,
                                                speculation=speculation))
        again = tiny.generate(ids, SamplingParams(max_tokens=60, grammar=source,
                                                  speculation=speculation))
        short = tiny.generate(ids, SamplingParams(max_tokens=3, grammar=source,
                                                  speculation=speculation))
    finally:
        del tiny.runner.forward
    # one forward: the prompt and the forced opening, whose logits choose the first free token
    assert rows[0][0].tokens == ids + lead and rows[0][0].last_only
    assert res.token_ids[: len(lead)] == lead and res.stats["first_step_tokens"] == len(lead) + 1
    segments = res.stats["segments"]
    assert sum(s["forced"] for s in segments) >= len(lead)
    assert segments[0]["kind"] == "tool_call"  # the forced opening is the call's
    assert parse_tool_calls(res.text)[0][0].name == name
    # from the prefix cache, the prompt only (the answer begins after it) and the same reply
    assert again.token_ids == res.token_ids and again.stats["cached_prompt_tokens"] > 0
    # within max tokens: the lead is cut to leave the model its token (forced there too)
    assert short.token_ids == lead[:3] and short.finish_reason == "length"
    assert short.stats["first_step_tokens"] == 3
    # room for one token: the grammar's, in the call's segment, not a choice of the model's
    one = tiny.generate(ids, SamplingParams(max_tokens=1, grammar=source, speculation=speculation))
    assert one.token_ids == lead[:1] and one.stats["segments"] == [
        {**one.stats["segments"][0], "kind": "tool_call", "tokens": 1, "forced": 1}]
    free = tiny.generate(ids, SamplingParams(max_tokens=4, speculation=speculation))
    assert free.stats["first_step_tokens"] == 1  # no grammar, no lead


def test_the_drafter_fills_the_slots_after_a_forced_run_shorter_than_its_block(tiny):
    literal = "\nstatus: ok, code "  # forced whole: shorter than the drafter's 7 slots
    ids = tiny.chat_prompt([{"role": "user", "content": "x"}])
    source = regex("[0-9]" + literal + "[0-9]{12}")  # a digit of the model's own first
    params = SamplingParams(max_tokens=40, grammar=source, speculation="dflash", block_size=3)
    rows = []
    forward = tiny.runner.forward

    def spy(batch, *args, **kwargs):
        rows.extend(batch)
        return forward(batch, *args, **kwargs)

    tiny.runner.forward = spy
    try:
        spec = tiny.generate(ids, params)
    finally:
        del tiny.runner.forward
    plain = tiny.generate(ids, SamplingParams(max_tokens=40, grammar=source, speculation="off"))
    assert spec.token_ids == plain.token_ids and spec.text[1:].startswith(literal)
    # the grammar forces the literal but its last space (" 1" is one token): the digit comes
    # from the prompt's forward; the first verify row holds it, then the drafter's 7 slots
    # walked under the grammar: the forced literal, then what the drafter proposes, up to the
    # 2 tokens the request's block counts
    head = tiny.tokenizer(literal.rstrip(" "), add_special_tokens=False)["input_ids"]
    assert 3 < len(head) < 7
    assert rows[1].tokens[1 : 1 + len(head)] == head
    assert len(rows[1].tokens) == 1 + min(len(head) + 2, 7)


@pytest.mark.parametrize("speculation", ["off", "dflash"])
def test_a_greedy_rows_forced_run_goes_into_its_grammar_once(tiny, monkeypatch, speculation):
    # a forced run at the head of a greedy row's draft is committed whole on the request's
    # grammar before the walk (which starts after it) and accepted by the verify without a
    # look: its tokens are consumed twice (the check whether the end follows it, on a copy, and
    # that commit), not again by the walk and, a token at a time where the target's choice is
    # not the forced token, by the verify (a mask and a masked argmax each)
    from agentflash.grammar.llguidance_backend import LLGuidanceConstraint

    literal = "\nstatus: ok, code "
    ids = tiny.chat_prompt([{"role": "user", "content": "x"}])
    source = regex("[0-9]" + literal + "[0-9]{12}")
    head = tiny.tokenizer(literal.rstrip(" "), add_special_tokens=False)["input_ids"]
    consumed = []
    consume = LLGuidanceConstraint._consume

    def spy(self, tokens):
        consumed.append(list(tokens))
        return consume(self, tokens)

    monkeypatch.setattr(LLGuidanceConstraint, "_consume", spy)
    params = SamplingParams(max_tokens=40, grammar=source, speculation=speculation,
                            block_size=3)
    res = tiny.generate(ids, params)
    monkeypatch.undo()
    assert res.text[1:].startswith(literal)
    assert [tokens for tokens in consumed if set(tokens) & set(head)] == [head, head]
    assert sum(s["forced"] for s in res.stats["segments"]) >= len(head)


@pytest.mark.parametrize("speculation", ["off", "dflash"])
def test_a_request_whose_grammar_breaks_fails_alone(tiny, speculation):
    tools = random_tools(3, n=1)
    ids = tiny.chat_prompt([{"role": "user", "content": "x"}], tools)
    params = SamplingParams(max_tokens=30, grammar=assistant_turn(tools, "required"),
                            speculation=speculation, block_size=4)
    alone = tiny.generate(ids, params)
    broken, healthy = tiny.submit(ids, params), tiny.submit(ids, params)

    def corrupt(*_):
        raise RuntimeError("matcher state lost")

    steps = 0
    while not (broken.is_finished and healthy.is_finished):
        tiny.step()
        steps += 1
        if steps == 3:  # mid-generation, as a backend fault would strike
            broken.constraint.forced_tokens = corrupt
            broken.constraint.masks_along_draft = corrupt
            broken.constraint.advance = corrupt
    result = tiny.result(broken)
    assert result.finish_reason == "error" and "matcher state lost" in result.error
    assert tiny.result(healthy).token_ids == alone.token_ids
    assert tiny.cache.num_free == tiny.cache.num_slots


def test_a_request_whose_masks_fail_is_reported_in_that_steps_outputs(tiny):
    tools = random_tools(4, n=1)
    ids = tiny.chat_prompt([{"role": "user", "content": "x"}], tools)
    params = SamplingParams(max_tokens=30, grammar=assistant_turn(tools, "required"),
                            speculation="off")
    broken, healthy = tiny.submit(ids, params), tiny.submit(ids, params)
    tiny.step()  # the prompts

    def corrupt(*_):
        raise RuntimeError("mask state lost")

    for name in ("validate_draft", "masks_along_draft", "_validate", "_consume"):
        setattr(broken.constraint, name, corrupt)  # whichever the step's path asks first
    outputs = tiny.step()
    # the stream of a failed request must hear of its end in the step that ended it
    assert [o.new_ids for o in outputs if o.request is broken] == [[]]
    assert broken.is_finished and tiny.result(broken).finish_reason == "error"
    while not healthy.is_finished:
        tiny.step()
    assert tiny.result(healthy).finish_reason in ("stop", "length")
    assert tiny.cache.num_free == tiny.cache.num_slots


@pytest.mark.parametrize("speculation", ["off", "dflash"])
def test_a_step_whose_only_request_fails_before_the_forward_ends_it_and_serves_on(tiny,
                                                                                 speculation):
    tools = random_tools(5, n=1)
    ids = tiny.chat_prompt([{"role": "user", "content": "x"}], tools)
    params = SamplingParams(max_tokens=30, grammar=assistant_turn(tools, "required"),
                            speculation=speculation, block_size=4)
    alone = tiny.generate(ids, params)
    broken = tiny.submit(ids, params)
    tiny.step()  # the prompt

    def corrupt(*_):
        raise RuntimeError("mask state lost")

    for name in ("forced_tokens", "masks_along_draft", "validate_draft", "_validate"):
        setattr(broken.constraint, name, corrupt)  # every path the step takes before its forward
    assert [(o.request, o.new_ids) for o in tiny.step()] == [(broken, [])]  # no forward to run
    assert tiny.result(broken).finish_reason == "error"
    assert tiny.generate(ids, params).token_ids == alone.token_ids
    assert tiny.cache.num_free == tiny.cache.num_slots


def test_a_grammar_that_gets_stuck_while_decoding_ends_its_request_with_a_one_line_error(tiny):
    # the second term of A can never match (a bound intersection): no compile check sees that
    stuck = lark('start: "x" A\nA: /a+/ & /b+/\n')
    # and one whose every match holds the text <|im_end|>, a special token's, in a way the
    # compile checks do not read (a branch): after the x its mask holds no token at all
    masked = regex(r"x<\|im_e(n|n)d\|>x")
    ids = tiny.chat_prompt([{"role": "user", "content": "x"}])
    for speculation, grammar in itertools.product(("off", "dflash"), (stuck, masked)):
        # sampling drew from the all-masked row's NaNs: "RuntimeError: probability tensor
        # contains either `inf`, `nan` or element < 0"
        for temperature, seed in ((0.0, None), (1.0, 1)):
            result = tiny.generate(ids, SamplingParams(
                max_tokens=8, grammar=grammar, speculation=speculation, temperature=temperature,
                seed=seed))
            assert result.finish_reason == "error", result.text
            assert result.error.startswith("GrammarFailed: no legal token"), result.error
            assert "\n" not in result.error and "<state>" not in result.error


def test_a_negated_lexeme_keeps_the_demo_models_tool_call_out_of_a_reply(demo):
    # the demo model begins its reply to a tool prompt with <tool_call>: llguidance's mask let
    # it through a negation (~/abc/) that then refused it as text, and it went into the reply
    # (or, first in the grammar, every request failed with GrammarViolation)
    from agentflash.bench import held_out_prompts

    source = lark('start: "\\n" A\nA: ~/abc/')
    for item in held_out_prompts("tool_call", 2):
        ids = demo.chat_prompt(item.messages, item.tools)
        result = demo.generate(ids, SamplingParams(max_tokens=12, grammar=source))
        assert result.finish_reason != "error", result.error
        legal = demo.compile(source).new_constraint().validate_draft(result.token_ids)
        assert legal == len(result.token_ids), result.text


def test_demo_constrained_dflash_equals_plain_on_held_out_tool_calls():
    # the shipped model and drafter: drafts walk the grammar ahead many times per request; the
    # live constraint must come out of every walk exactly as it went in (a regression: walks with
    # rollbacks once left llguidance allowing '",' after a tool call's last property)
    from agentflash.bench import held_out_prompts

    engine = Engine.from_pretrained("demo")
    for item in held_out_prompts("tool_call", 4):
        ids = engine.chat_prompt(item.messages, item.tools)
        source = assistant_turn(item.tools, "required")
        plain = engine.generate(
            ids, SamplingParams(max_tokens=64, grammar=source, speculation="off")
        )
        spec = engine.generate(
            ids, SamplingParams(max_tokens=64, grammar=source, speculation="dflash")
        )
        assert spec.finish_reason == plain.finish_reason != "error"
        assert spec.token_ids == plain.token_ids


def test_a_lookup_that_agrees_with_a_constrained_block_is_cut_to_the_grammar_and_verified(
    tiny, monkeypatch
):
    """Under a grammar too, a lookup that begins as the drafter's block does may be verified in
    its place; it is cut at its first token the grammar forbids, and the output is constrained
    plain decoding's."""
    import torch

    import agentflash.engine.engine as engine_mod

    ids = tiny.chat_prompt([{"role": "user", "content": "x"}])
    source = regex("[a-z]{60,150}")
    plain = tiny.generate(ids, SamplingParams(max_tokens=80, grammar=source, speculation="off"))
    free = plain.token_ids
    assert len(free) > 20

    def looked_up(tokens, num, *args):  # the answer itself, then tokens the grammar forbids
        done = len(tokens) - len(ids)
        return (free[done:] + [tiny.tokenizer.convert_tokens_to_ids(",")] * num)[:num]

    def draft_logits(drafter, embed, logits, last_tokens, contexts, block_size, num_slots,
                     pending=None):
        waiting = 0 if pending is None or pending[0] is None else pending[0].shape[0]
        done = contexts[0].length + waiting + 1 - len(ids)  # two slots right, then a wrong one
        out = (free[done : done + 2] + [4000] * num_slots)[:num_slots]
        return torch.nn.functional.one_hot(torch.tensor(out), 4096).float()[None]

    seen = spy_on_agreements(monkeypatch, tiny)  # a fresh router, after the drafter only
    monkeypatch.setattr(engine_mod, "lookup_draft", looked_up)
    monkeypatch.setattr(engine_mod, "draft_logits", draft_logits)
    spec = tiny.generate(ids, SamplingParams(max_tokens=80, grammar=source, speculation="dflash"))
    assert spec.token_ids == free
    lookups = [(n, accepted) for verified_lookup, n, accepted in seen if verified_lookup]
    assert lookups and max(accepted for _, accepted in lookups) > 2
    assert all(n <= len(free) for n, _ in lookups)  # cut where the grammar ends the answer


def test_greedy_constrained_tokens_are_each_allowed_by_the_mask_where_they_stand(demo):
    """Where the grammar forces text ('"]' closing a full array), llguidance's mask allows its
    canonical token only, and its token check any tokenization: the engine took the target's
    '"' (then ']'), which plain constrained decoding (mask, then argmax) never writes."""
    grammar = json_schema({"type": "array", "items": {"enum": ["a", "b", "c"]},
                           "minItems": 2, "maxItems": 12})
    prompt = demo.chat_prompt([{"role": "user", "content": "Repeat after me: a b c a b c a b c"}])
    out = demo.generate(prompt, SamplingParams(max_tokens=60, grammar=grammar)).token_ids
    constraint = demo.compile(grammar).new_constraint()
    for token in out:
        assert constraint.allowed_mask()[token], (token, demo.tokenizer.decode([token]))
        constraint.advance([token])
    assert constraint.is_finished()
    # the token check agrees with the mask there, and a lookup's draft is cut where it would not
    closing = demo.tokenizer.encode('"]', add_special_tokens=False)
    quote, bracket = (demo.tokenizer.encode(t, add_special_tokens=False)[0] for t in ('"', "]"))
    before = demo.compile(grammar).new_constraint()
    before.advance(out[: len(out) - 2])
    assert before.forced_tokens() == [*closing, demo.tokenizer.eos_token_id]
    assert not before.allows(quote) and before.allows(closing[0])
    assert before.validate_draft([quote, bracket]) == 2 and before.mask_prefix([quote]) == 0
    # a lookup's draft (the request's own text) is cut where the mask is: '"' ']' there was
    # kept, and accepted wherever the target chose the same
    req = demo.submit(prompt, SamplingParams(max_tokens=60, grammar=grammar))
    try:
        req.constraint.advance(out[: len(out) - 2])
        assert demo._legal_head(req, [quote, bracket]) == []
        assert demo._legal_head(req, [*closing, demo.tokenizer.eos_token_id]) == [
            *closing, demo.tokenizer.eos_token_id]
    finally:
        demo.cancel(req)


@pytest.mark.parametrize("speculation", ["off", "dflash"])
def test_a_sampled_request_that_ignores_the_end_writes_it_again_past_a_finished_grammar(
        tiny, speculation):
    # once the grammar is complete its mask allows the end token alone: sampling draws it, as
    # greedy decoding takes it, until max_tokens
    ids = tiny.tokenizer("Answer:", add_special_tokens=False)["input_ids"]
    eos = tiny.compile(regex("(yes|no)")).eos_token_id
    for temperature in (0.0, 1.0):
        res = tiny.generate(ids, SamplingParams(
            max_tokens=8, grammar=regex("(yes|no)"), ignore_eos=True, temperature=temperature,
            seed=0, speculation=speculation))
        assert res.finish_reason == "length" and res.error is None
        first = res.token_ids.index(eos)
        assert set(res.token_ids[first:]) == {eos} and len(res.token_ids) == 8
        assert tiny.tokenizer.decode(res.token_ids[:first]) in ("yes", "no")


def test_a_stream_never_hands_out_text_past_a_stop_that_an_open_call_turns_out_to_leave(demo):
    """Stops are not matched inside a call; an open call whose body is JSON so far runs on past
    a "</tool_call>" its string holds, and ends there after all once the body is no JSON. The
    stop written after it was streamed, with the text after it, and then cut off the result."""
    import anyio

    from agentflash.engine.async_engine import AsyncEngine, TokenEvent

    ids = demo.chat_prompt([{"role": "user", "content": "Say something."}])
    grammar = lark(r'start: "Hi " <tool_call> "{\"a\": \"" </tool_call> " STOP" /[a-z ]{6,12}/ '
                   r'"\"}} tail"')
    params = SamplingParams(max_tokens=100, stop=("STOP",), grammar=grammar)

    async def main():
        streamed, result = "", None
        async with AsyncEngine(demo) as aengine:
            async for event in aengine.stream(ids, params):
                if isinstance(event, TokenEvent):
                    streamed += event.text
                else:
                    result = event.result
        return streamed, result

    streamed, result = anyio.run(main)
    assert result.finish_reason == "stop"
    assert streamed == result.text == 'Hi <tool_call>{"a": "</tool_call> '


def test_a_stop_token_that_ends_a_stop_string_cuts_the_text_there(demo):
    ids = demo.chat_prompt([{"role": "user", "content": "Say something."}])
    grammar = lark('start: "BEGIN " body " END"\nbody: /[a-z]+/\n')
    free = demo.generate(ids, SamplingParams(max_tokens=10, grammar=grammar, stop=("BE",)))
    assert free.finish_reason == "stop" and free.text == ""
    last = free.token_ids[-1]  # the token that completed "BE"
    both = demo.generate(ids, SamplingParams(max_tokens=10, grammar=grammar, stop=("BE",),
                                             stop_token_ids=(last,)))
    assert both.token_ids == free.token_ids and both.text == ""


@pytest.mark.parametrize("body", [
    'start: NAME "-hello world, status: done, code " NAME\nNAME: /[a-z]{1,3}/\n',
    'start: "hello world, status: done, code " NAME\nNAME: /[a-z]{1,5}/\n',  # the reply's lead
])
@pytest.mark.parametrize("speculation", ["off", "dflash"])
def test_text_a_grammar_does_not_force_is_the_targets_choice(tiny, tiny_model_dir, body,
                                                            speculation):
    """With forcing off (``no_forcing``), llguidance still names forced tokens ('he', 'l',
    'lo', ...), while its mask lets every tokenization through ('h' or 'he'): the engine
    committed those tokens unlooked, not what the target chose among the allowed ones."""
    import torch
    from transformers import Qwen3ForCausalLM

    from agentflash.grammar import apply_bitmask_

    source = lark('%llguidance {"no_forcing": true}\n' + body)
    hf = Qwen3ForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = tiny.chat_prompt([{"role": "user", "content": "x"}])
    constraint, want = tiny.compile(source).new_constraint(), []
    while len(want) < 40 and not constraint.is_finished():  # mask, argmax, advance
        with torch.no_grad():
            logits = hf(torch.tensor([ids + want])).logits[0, -1:, : constraint.vocab_size]
        apply_bitmask_(logits, constraint.bitmask()[None])
        want.append(int(logits.argmax()))
        constraint.advance(want[-1:])
    got = tiny.generate(ids, SamplingParams(max_tokens=40, grammar=source,
                                            speculation=speculation)).token_ids
    assert got == want, (tiny.tokenizer.decode(got), tiny.tokenizer.decode(want))
