"""The benchmark's held-out suites and its side-by-side rows (behaviour only, never timings)."""

import pytest
import torch

from agentflash import bench
from agentflash.engine.model_runner import exactness_problem
from agentflash.engine.request import SamplingParams
from agentflash.models.loading import load_model
from agentflash.models.qwen3 import batch_invariant_
from agentflash.server import bench as server_bench
from agentflash.train import corpus


def test_held_out_prompts_end_before_the_reply_and_differ_from_training():
    train = corpus.generate(
        corpus.CorpusConfig(num_tool_call=200, num_code=0, num_math=0, num_prose=0)
    )
    train_requests = {c["messages"][1]["content"] for c in train}
    for suite in bench.SUITES:
        prompts = bench.held_out_prompts(suite, 5)
        assert len(prompts) == 5 and all(p.messages[-1]["role"] == "user" for p in prompts)
    tool_prompts = bench.held_out_prompts("tool_call", 20)
    assert all(p.expected for p in tool_prompts)
    assert not {p.messages[-1]["content"] for p in tool_prompts} & train_requests


def test_rows_are_side_by_side_and_peers_match_plain_greedy(tiny_model_dir):
    # (10 tokens: a tool call's forced opening, 6 tokens here, goes in with the prompt, and the
    # body's tau needs a forward after it)
    report = bench.run(
        str(tiny_model_dir), ["tool_call", "math", "json"], num_prompts=1, max_tokens=10
    )
    modes = [(r["suite"], r["mode"]) for r in report["rows"]]
    peers = ("plain", "transformers", "prompt_lookup")
    # outlines' row, unless its own mask kernel is wrong on this machine (and then said why)
    skipped = bench.outlines_masks_wrong()
    assert report["config"]["outlines_skipped"] == skipped
    assert modes == (
        [("tool_call", m) for m in peers]
        + [("tool_call", "plain+grammar"), ("tool_call", "outlines")]
        + [("math", m) for m in peers]
        + [("json", "plain+grammar")] + [("json", "outlines")] * (skipped is None)
    )
    for row in report["rows"]:
        if row["suite"] != "json" or row["mode"] != "outlines":  # its JSON may differ in layout
            assert row["identical_to_plain"], row
        assert row["tokens_per_s"] > 0
    assert all(r["ratio_to_plain"] == 1.0 for r in report["rows"]
               if r["mode"] in ("plain", "plain+grammar"))  # constrained rows: x constrained
    for row in report["rows"]:  # plain (tool_call's were x plain unconstrained, json's not)
        constrained = row["mode"].endswith("+grammar") or row["mode"] == "outlines"
        assert row["ratio_base"] == ("plain+grammar" if constrained else "plain")
    assert all("outputs" not in r for r in report["rows"])
    engine_rows = [r for r in report["rows"] if r["mode"].startswith(("plain", "dflash", "auto"))]
    assert all(r["decode_tokens_per_s"] > 0 for r in engine_rows)
    assert all("decode_tokens_per_s" not in r for r in report["rows"] if r not in engine_rows)
    constrained = [r for r in engine_rows if r["mode"].endswith("+grammar")]
    assert constrained and all(0 < r["grammar_share"] < r["grammar_share_of_decoding"] < 1
                               for r in constrained)
    calls = next(r for r in constrained if r["suite"] == "tool_call")
    assert calls["tool_call_body_tau"] >= 1.0  # tau inside the call bodies
    assert "tool_call_body_tau" not in next(r for r in constrained if r["suite"] == "json")
    for row in constrained + [r for r in report["rows"] if r["mode"] == "outlines"]:
        assert 0 <= row["valid"] <= row["finished"] <= 1, row
    # memory: the weights read and what the requests held beyond them
    weights = report["config"]["weights_mb"]
    assert weights["drafter"] == 0 and weights["target"] > 0 and report["config"]["kv_pool_mb"] > 0
    assert report["config"]["peak_rss_mb"] > weights["target"] + report["config"]["kv_pool_mb"]
    # whether the rows ran the exact path: the probe's finding on the same weights, if any
    same_weights = batch_invariant_(load_model(tiny_model_dir)[0])
    assert report["config"]["exact_path_off"] == exactness_problem(same_weights)
    # the parameters, apart from oneDNN's reordered copies (their size is the kernels' choice,
    # timed as the process starts: it changed the weights from one run to the next)
    params = load_model(tiny_model_dir)[0].parameters()
    assert weights["target"] == round(sum(p.numel() * p.element_size() for p in params) / 2**20, 3)
    copies = report["config"]["weights_reordered_mb"]
    for row in engine_rows:
        parts = row["memory_parts_mb"]
        assert parts["weights"] == weights["target"] and parts["draft_context"] == 0
        assert parts["weights_reordered"] == copies["target"]
        assert parts["kv"] > 0
        assert parts["weights"] + parts["kv"] <= row["memory_mb"] + 0.002
        assert row["memory_mb"] <= sum(parts.values()) + 0.004
    assert all("memory_mb" not in r for r in report["rows"] if r not in engine_rows)


def test_outlines_reads_the_engines_prompt_and_writes_its_greedy_answer(tiny_model_dir):
    """outlines' generator is given the engine's rendered prompt as it is (it wrapped it in a
    user turn and applied the chat template again: 8 tokens more, another conversation), and
    under the same tools' grammar it writes what constrained plain decoding writes."""
    pytest.importorskip("outlines")
    from transformers import AutoModelForCausalLM

    from agentflash.engine.engine import Engine

    engine = Engine.from_pretrained(str(tiny_model_dir), drafter=None)
    hf_model = AutoModelForCausalLM.from_pretrained(engine.model_dir,
                                                    dtype=torch.float32).eval()
    items = bench.held_out_prompts("tool_call", 2)
    grammars = bench._grammars("tool_call", items)
    peer = bench._outlines_peer(engine, hf_model, "tool_call", items, grammars, 12)
    for i, item in enumerate(items):
        ids = engine.chat_prompt(item.messages, item.tools)
        out, seconds = peer(i, ids)
        plain = engine.generate(ids, SamplingParams(max_tokens=12, grammar=grammars[i]))
        assert out == plain.token_ids and seconds > 0
    letters = engine.tokenizer.convert_tokens_to_ids(list("hello"))  # ("hello" is one token
    assert len(engine.tokenizer.encode("hello", add_special_tokens=False)) < 5  # written whole)
    with pytest.raises(RuntimeError, match="outlines read another prompt than the engine's"):
        peer(0, ids + letters)


def test_the_peers_take_turns_with_the_engines_modes(tiny_model_dir, monkeypatch):
    """Prompt by prompt, each mode and then each peer (they ran after all the engine's rows,
    minutes apart on a machine whose speed drifts); their rows compare with plain's tokens."""
    from agentflash.engine.engine import Engine

    engine = Engine.from_pretrained(str(tiny_model_dir), drafter=None)
    items = bench.held_out_prompts("math", 2)
    prompts = [engine.chat_prompt(p.messages, p.tools) for p in items]
    order = []
    timed = bench._time_engine
    monkeypatch.setattr(bench, "_time_engine", lambda engine, ids, n, speculation, *rest:
                        order.append((prompts.index(ids), n, speculation))
                        or timed(engine, ids, n, speculation, *rest))

    def peer(name, wrong):
        def run(i, ids):
            order.append((i, name))
            out = engine.generate(ids, SamplingParams(max_tokens=6)).token_ids
            return out[:-1] + [out[-1] + 1] if wrong else out, 0.5
        return run

    rows = bench._engine_rows(engine, "math", prompts, 6, [None, None], "",
                              {"a": peer("a", False), "b": peer("b", True)})
    assert order == [(0, 8, "off"), (0, 6, "off"), (0, "a"), (0, "b"),
                     (1, 6, "off"), (1, "a"), (1, "b")]
    assert [(r["mode"], r["identical_to_plain"]) for r in rows] == [
        ("plain", True), ("a", True), ("b", False)]


def test_one_token_answers_have_no_decoding_to_compare(tiny_model_dir):
    """max_tokens 1: every answer is its prompt's step; the ratio of decoding tokens/s divided
    by plain's 0 after every row had run."""
    report = bench.run(str(tiny_model_dir), ["prose"], num_prompts=1, max_tokens=1)
    engine_rows = [r for r in report["rows"] if "decode_tokens_per_s" in r]
    assert engine_rows and all(r["decode_ratio_to_plain"] is None for r in engine_rows)
    bench.print_table(report)


def test_the_grammar_bench_percentiles_are_a_median_and_a_nearest_rank():
    from agentflash.grammar.bench import _ms

    assert _ms([k / 1000 for k in range(1, 11)]) == {"mean": 5.5, "p50": 5.5, "p90": 9.0}
    assert _ms([0.001, 0.003])["p50"] == 2.0  # (the slower of two was its "median")


def test_constrained_rows_count_valid_answers_among_the_finished(demo_tokenizer_dir):
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)

    class _Engine:  # what _validity reads of an engine: its tokenizer and end-of-turn ids
        tokenizer = tok
        eos_ids = {tok.convert_tokens_to_ids("<|im_end|>")}

    call = bench.held_out_prompts("tool_call", 1)[0]
    name, args = call.expected[0]["name"], call.expected[0]["arguments"]

    def reply(body: dict) -> list[int]:
        text = f"<tool_call>\n{json.dumps(body)}\n</tool_call><|im_end|>"
        return tok(text, add_special_tokens=False)["input_ids"]

    good = reply({"name": name, "arguments": args})
    unknown = reply({"name": name + "_x", "arguments": args})
    cut = good[:-3]
    got = bench._validity(_Engine(), "tool_call", [call] * 3, [good, unknown, cut])
    assert got == {"finished": 2, "valid": 1}
    answer = bench.held_out_prompts("json", 1)[0]
    wrong = dict.fromkeys(answer.schema.get("required") or ["x"], [[]])  # arrays of arrays
    texts = [json.dumps(wrong) + "<|im_end|>", "{" + "<|im_end|>"]
    outs = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert bench._validity(_Engine(), "json", [answer] * 2, outs) == {"finished": 2, "valid": 0}


def test_concurrency_rows_match_outputs_run_alone(tiny_model_dir, tmp_path, monkeypatch):
    import torch

    from agentflash.dflash.checkpoint import save_drafter
    from agentflash.dflash.drafter import DFlashDrafter, DrafterConfig

    torch.manual_seed(0)
    drafter = DFlashDrafter(
        DrafterConfig(
            hidden_size=64,
            intermediate_size=128,
            num_layers=1,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=1e4,
            rms_norm_eps=1e-6,
            block_size=8,
            mask_token_id=3,
            target_layer_ids=(1, 2),
            num_target_layers=4,
            vocab_size=4096,
        )
    )
    save_drafter(drafter, tmp_path / "drafter")
    turns = []  # the modes' runs of every prompt, in the order they ran
    run_at = bench._run_at

    def recorded(engine, convos, level, max_tokens, speculation, grammars=None):
        if len(convos) == 5:  # not the allocator's warm-up
            turns.append(speculation)
        return run_at(engine, convos, level, max_tokens, speculation, grammars)

    monkeypatch.setattr(bench, "_run_at", recorded)
    report = bench.run_concurrency(
        str(tiny_model_dir), ["mixed"], [1, 3], max_tokens=6, drafter=str(tmp_path / "drafter"),
        num_prompts=5, rounds=2,
    )
    # each round the modes take turns in a rotated order
    assert turns == ["off", "dflash", "auto", "dflash", "auto", "off"] * 2
    assert [(r["concurrency"], r["mode"]) for r in report["rows"]] == [
        (c, m) for c in (1, 3) for m in ("plain", "dflash", "auto")
    ]
    # every level decodes the same five prompts, a few at a time
    assert len({r["new_tokens"] for r in report["rows"]}) == 1
    assert all(r["new_tokens"] > 5 and r["rounds"] == 2 for r in report["rows"])
    for r in report["rows"]:  # the median of the rounds (not the faster), every round beside
        assert len(r["tokens_per_s_rounds"]) == 2
        assert r["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s_rounds"]) / 2, abs=0.01)
    for level in (1, 3):  # the router against the better fixed mode, round by round
        plain, dflash, auto = (r for r in report["rows"] if r["concurrency"] == level)
        rounds = zip(plain["tokens_per_s_rounds"], dflash["tokens_per_s_rounds"],
                     auto["tokens_per_s_rounds"])
        paired = sorted(round(a / max(p, d), 3) for p, d, a in rounds)
        assert auto["vs_better_rounds"] == paired
        assert auto["vs_better_median"] == pytest.approx(sum(paired) / 2, abs=0.001)
        assert "vs_better_median" not in plain and "vs_better_median" not in dflash
    assert all(r["identical_to_alone"] for r in report["rows"])
    assert all(r["latency_p95_s"] >= r["latency_median_s"] > 0 for r in report["rows"])
    weights = report["config"]["weights_mb"]
    for r in report["rows"]:  # modes that may draft read the drafter; drafting holds contexts
        parts = r["memory_parts_mb"]
        drafts = r["mode"] != "plain"
        assert parts["weights"] == pytest.approx(weights["target"] + drafts * weights["drafter"],
                                                 abs=0.002)
        assert parts["kv"] > 0
        if r["mode"] != "auto":  # (the router may not draft at all)
            assert (parts["draft_context"] > 0) == drafts
            assert (parts["kept_hidden"] > 0) == drafts  # for their sequences' cache entries
    one, three = ([r for r in report["rows"] if r["concurrency"] == c and r["mode"] == "plain"][0]
                  for c in (1, 3))
    assert three["memory_parts_mb"]["kv"] > one["memory_parts_mb"]["kv"]  # more requests at once
    # agents: a conversation's second turn follows its first, on the same engine
    report = bench.run_concurrency(
        str(tiny_model_dir), ["agent"], [2], max_tokens=4, drafter=str(tmp_path / "drafter"),
        num_prompts=3, rounds=1,
    )
    # six outputs (checked one by one, strictly, against the six turns run alone)
    assert all(r["identical_to_alone"] for r in report["rows"])
    assert all(6 <= r["new_tokens"] <= 6 * 4 for r in report["rows"])



def test_a_concurrency_row_is_identical_only_if_every_round_is(monkeypatch):
    # a row shows its median round: a round whose outputs differed and stopped early (the
    # fastest) was never it, and the row said identical
    run_at, seen = bench._run_at, {}

    def one_round_differs(engine, convos, level, max_tokens, speculation, grammars=None):
        outs, wall, latencies, forwards = run_at(engine, convos, level, max_tokens, speculation,
                                                 grammars)
        if max_tokens == 6:  # (not the allocator's warm-up)
            seen[speculation] = seen.get(speculation, -1) + 1
            if seen[speculation] == 0:  # a token short, and the fastest
                outs, wall = [outs[0][:-1], *outs[1:]], wall / 3
        return outs, wall, latencies, forwards

    monkeypatch.setattr(bench, "_run_at", one_round_differs)
    report = bench.run_concurrency("demo", ["prose"], [1], 6, "auto", num_prompts=1, rounds=3)
    assert seen == {"off": 2, "dflash": 2, "auto": 2}
    assert not any(r["identical_to_alone"] for r in report["rows"])


def test_each_mode_keeps_its_own_router_state(tiny_model_dir):
    from conftest import tiny_dflash_engine

    engine = tiny_dflash_engine(tiny_model_dir, block_size=8)
    ids = list(range(50, 70))
    bench._time_engine(engine, ids, 12, "auto")
    auto = engine.cost
    steps = auto._steps
    assert steps > 0 and auto.is_measured
    bench._time_engine(engine, ids, 12, "off")  # the plain row's steps...
    bench._time_engine(engine, ids, 12, "dflash")  # ...and always-dflash's...
    assert engine.cost is not auto
    bench._time_engine(engine, ids, 1, "auto")
    assert engine.cost is auto and auto._steps == steps + 1  # ...are not the router's
    # a new engine starts from nothing, with the drafter's priors
    other = tiny_dflash_engine(tiny_model_dir, block_size=8)
    bench._as_mode(other, "auto")
    assert other.cost is not auto and not other.cost.is_measured


def test_the_answer_turn_sends_the_models_reply_back_as_the_runtime_does():
    from agentflash.engine.engine import Engine
    from agentflash.engine.request import SamplingParams
    from agentflash.grammar import assistant_turn

    engine = Engine.from_pretrained("demo", drafter=None)
    prompt = bench.held_out_prompts("agent", 1)[0]
    first = engine.chat_prompt(prompt.messages, prompt.tools)
    # under the tools' grammar, as the runtime decodes a turn with tools: a call that parses
    grammar = assistant_turn(prompt.tools, "required")
    reply = engine.generate(first, SamplingParams(max_tokens=96, grammar=grammar))
    messages = bench.answer_turn(prompt, reply.text)
    assert messages[: len(prompt.messages)] == prompt.messages
    sent = messages[len(prompt.messages)]
    assert sent["role"] == "assistant" and len(sent["tool_calls"]) >= 1
    assert [m["role"] for m in messages[len(prompt.messages) + 1 :]] == ["tool"] * (
        len(messages) - len(prompt.messages) - 1) and len(messages) > len(prompt.messages) + 1
    # the chat template renders the reply back as the model wrote it: the next turn's prompt
    # begins with the first prompt and the reply, which the prefix cache then serves whole
    second = engine.chat_prompt(messages, prompt.tools)
    assert second[: len(first) + len(reply.token_ids)] == first + reply.token_ids


def test_agent_rows_reuse_the_first_turn_and_match_without_the_cache(tiny_model_dir):
    prompts = bench.held_out_prompts("agent", 2)
    assert all(p.next_turn[: len(p.messages)] == p.messages for p in prompts)
    assert all(p.next_turn[-1]["role"] == "tool" for p in prompts)
    report = bench.run(str(tiny_model_dir), ["agent"], num_prompts=1, max_tokens=6)
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["plain", "plain, no prefix cache"]  # no drafter for the tiny model
    assert rows["plain"]["cached_prompt_tokens"] > 0  # the second turn's first prompt
    assert rows["plain, no prefix cache"]["cached_prompt_tokens"] == 0
    assert all(r["identical_to_plain"] and r["ttft_ms"] > 0 for r in rows.values())
    # both turns under the tools' grammar (tool_choice auto), as the runtime decodes them
    from agentflash.grammar import assistant_turn

    assert bench._grammars("agent", prompts) == [assistant_turn(p.tools, "auto") for p in prompts]
    assert all(r["grammar_share"] > 0 for r in rows.values())


def test_tables_print_whole_in_a_narrow_terminal(monkeypatch, capsys):
    # rich fits a table to the terminal (80 columns in a pipe) by cutting cells to "…"
    monkeypatch.setenv("COLUMNS", "60")
    row = dict(suite="tool_call", mode="dflash+grammar", new_tokens=226, tokens_per_s=578.7,
               ratio_to_plain=2.47, decode_tokens_per_s=870.1, decode_ratio_to_plain=2.93,
               ttft_ms=31.1, tau=7.53, tool_call_body_tau=7.4, grammar_share=0.039,
               grammar_share_of_decoding=0.0592, valid=3,
               finished=3, identical_to_plain=True)
    bench.print_table({"config": {"model": "demo", "num_prompts": 4}, "rows": [row]})
    row = dict(suite="mixed", concurrency=32, mode="auto", tokens_per_s=1234.5,
               tokens_per_s_rounds=[1200.0, 1234.5, 1300.0], ratio_to_plain=1.21,
               latency_median_s=1.5, latency_p95_s=2.25, tau=4.2, memory_mb=345.6,
               identical_to_alone=True,
               vs_better_median=1.04, vs_better_rounds=[0.99, 1.04, 1.06])
    bench.print_concurrency_table(
        {"config": {"model": "demo", "num_prompts": 8, "rounds": 3}, "rows": [row]}
    )
    row = dict(path="openai client -> agentflash serve", concurrency=8, requests_per_s=3.21,
               tokens_per_s=411.2, latency_mean_ms=2490.5, latency_p50_ms=2400.1,
               latency_p95_ms=3100.9, first_token_mean_ms=None, overhead_ms_per_request=12.5,
               overhead_pct=0.5, same_tokens=True)
    server_bench.print_table(
        {"config": {"model": "demo", "num_requests": 16, "max_tokens": 64}, "rows": [row]}
    )
    out = capsys.readouterr().out
    assert "…" not in out
    for cell in ("dflash+grammar", "578.7", "body tau", "grammar % of decoding", "5.9", "3/3",
                 "mixed", "1200-1300", "1.040 (0.99-1.06)", "auto / better, paired", "345.6",
                 "openai client -> agentflash serve", "overhead %", "same tokens", "+12.5"):
        assert cell in out, cell


def test_concurrency_row_latencies_are_the_median_and_the_nearest_rank_p95():
    from agentflash.bench import _concurrency_row

    row = _concurrency_row("prose", 2, "plain", [[1], [2]], [[1], [2]], 1.0, [3.0, 1.0], 2)
    assert (row["latency_median_s"], row["latency_p95_s"]) == (2.0, 3.0)
    lat = [float(n) for n in range(1, 21)]
    row = _concurrency_row("prose", 4, "plain", [[1]] * 20, [[1]] * 20, 1.0, lat, 20)
    assert (row["latency_median_s"], row["latency_p95_s"]) == (10.5, 19.0)


def test_a_reply_to_a_tool_call_prompt_is_scored_as_its_labels_say():
    """"valid json" is every body JSON (a call's arguments given as a string is JSON, and was
    counted out), "exact match" a valid call whose values JSON holds equal (0 matched false)."""
    import json

    prompt = bench.held_out_prompts("tool_call", 1)[0]
    (expected,) = prompt.expected

    def text(body):
        return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"

    scored = bench.scored_call(text(expected), prompt)
    assert all(scored.values()), scored
    as_string = {"name": expected["name"], "arguments": json.dumps(expected["arguments"])}
    assert bench.scored_call(text(as_string), prompt) == {
        "wrote_call": True, "valid_json": True, "known_name": False, "arguments_valid": False,
        "exact_match": False}
    cut = "<tool_call>\n{\"name\": \n</tool_call>"
    assert bench.scored_call(cut, prompt)["valid_json"] is False
    assert not any(bench.scored_call("no call", prompt).values())
    # an argument given twice, a wrong value first (JSON took the last: an exact match), as the
    # demo model writes unconstrained
    key = next(iter(expected["arguments"]))
    body = json.dumps(expected)
    twice = body.replace(f'{json.dumps(key)}: ', f'{json.dumps(key)}: [[]], {json.dumps(key)}: ', 1)
    assert json.loads(twice) == expected
    scored = bench.scored_call(f"<tool_call>\n{twice}\n</tool_call>", prompt)
    assert scored["known_name"] and not scored["arguments_valid"] and not scored["exact_match"]
    assert bench._valid_answer("tool_call", prompt, text(expected))  # (the bench's "valid")
    assert not bench._valid_answer("tool_call", prompt, f"<tool_call>\n{twice}\n</tool_call>")
    # and a JSON answer's key given twice
    json_prompt = bench.Prompt("json", [], [], schema={
        "type": "object", "properties": {"unit": {"type": "array"}}, "required": ["unit"]})
    assert bench._valid_answer("json", json_prompt, '{"unit": [1]}')
    assert not bench._valid_answer("json", json_prompt, '{"unit": "no", "unit": [1]}')
    # a boolean written as its number (Python's == took them as equal): the schema refuses it
    prompt, flag = next((p, k) for p in bench.held_out_prompts("tool_call", 50)
                        for k, v in p.expected[0]["arguments"].items() if isinstance(v, bool))
    (expected,) = prompt.expected[:1]
    number = {**expected, "arguments": {**expected["arguments"],
                                        flag: int(expected["arguments"][flag])}}
    calls = [number] + prompt.expected[1:]
    scored = bench.scored_call("".join(text(c) for c in calls), prompt)
    assert scored["known_name"] and not scored["arguments_valid"] and not scored["exact_match"]
    assert bench.same_json([{"a": 1, "b": [True]}], [{"a": 1.0, "b": [True]}])
    assert not bench.same_json({"a": False}, {"a": 0}) and not bench.same_json([1], [True])
    assert not bench.same_json({"a": 1}, {"a": 1, "b": 2}) and not bench.same_json([1], 1)
