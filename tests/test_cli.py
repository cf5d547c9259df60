"""The command line's JSON contract and its one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentflash.cli import app

STATS_KEYS = {
    "mode",
    "prompt_tokens",
    "cached_prompt_tokens",
    "new_tokens",
    "target_forwards",
    "draft_forwards",
    "lookup_drafts",
    "tau",
    "wall_s",
    "ttft_s",
    "first_step_tokens",
    "grammar_s",
    "tokens_per_s",
    "segments",
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def run(*args):
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_generate_json_contract(tiny_model_dir, tmp_path):
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    code, out, _ = run(
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "weather in Oslo?",
        "--tools",
        str(tmp_path / "tools.json"),
        "--max-tokens",
        "7",
        "--json",
    )
    assert code == 0
    obj = json.loads(out)
    assert set(obj) == {"text", "token_ids", "tool_calls", "finish_reason", "stats"}
    assert set(obj["stats"]) == STATS_KEYS
    assert len(obj["token_ids"]) == obj["stats"]["new_tokens"] <= 7
    assert obj["stats"]["mode"] == "plain"
    segments = obj["stats"]["segments"]
    assert {s["kind"] for s in segments} <= {"prose", "tool_call", "code", "math", "schema"}
    assert sum(s["tokens"] for s in segments) == obj["stats"]["new_tokens"]
    assert sum(s["target_forwards"] for s in segments) == obj["stats"]["target_forwards"]
    if obj["finish_reason"] == "length":
        assert obj["stats"]["target_forwards"] == 6


def test_requests_file_writes_one_result_per_line(tiny_model_dir, tmp_path):
    lines = [
        {"prompt": "a"},
        {"messages": [{"role": "user", "content": "b"}], "max_tokens": 3},
        {"prompt": "c", "temperature": 0.9, "seed": 1},
    ]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    code, out, _ = run(
        "generate",
        "--model",
        str(tiny_model_dir),
        "--requests",
        str(tmp_path / "r.jsonl"),
        "--max-tokens",
        "5",
        "--json",
    )
    assert code == 0
    results = [json.loads(x) for x in out.splitlines()]
    assert len(results) == 3
    assert results[0]["stats"]["new_tokens"] <= 5 and results[1]["stats"]["new_tokens"] <= 3
    # a field set to null is left out, and the flag fills it (the flag's value was dropped)
    (tmp_path / "n.jsonl").write_text('{"prompt": "a", "max_tokens": null}\n')
    code, out, _ = run("generate", "--model", str(tiny_model_dir), "--requests",
                       str(tmp_path / "n.jsonl"), "--max-tokens", "2", "--json")
    assert code == 0 and json.loads(out)["stats"]["new_tokens"] <= 2
    (tmp_path / "n.jsonl").write_text('{"prompt": "a", "max_tokns": null}\n')  # (a typo)
    code, _, err = run("generate", "--model", str(tiny_model_dir), "--requests",
                       str(tmp_path / "n.jsonl"))
    assert code == 2 and "n.jsonl:1: unknown field 'max_tokns'" in err


@pytest.mark.parametrize(
    "content, message",
    [
        ('[{"role": "user"}]', "messages[0].content must be a string"),
        # text parts are joined, as serve joins them; another part is named
        ('[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]',
         'messages[0].content[0] must be a text part {"type": "text", "text": "..."}'),
        ('[{"role": "user", "content": [{"type": "text", "text": 3}]}]',
         "messages[0].content[0] must be a text part"),
        ('[{"role": "user", "content": []}]',
         "messages[0].content must be a string or a non-empty list of text parts"),
        ('[{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]',
         "messages[0].content holds '\\ud800'"),
        ('[{"role": "robot", "content": "x"}]', "messages[0].role must be one of"),
        ('{"role": "user"}', "must be a non-empty JSON list"),
        ('[{"role": "user",\n "content": }]', ":2:13: malformed JSON"),
        ('[{"role": "user", "content": "a", "content": "b"}]',
         "malformed JSON: the key 'content' is given twice in one object"),
        ('[{"role": "user", "content": "x"}, {"role": "assistant", "content": null, '
         '"tool_calls": "f"}]', "messages[1].tool_calls must be a list"),
        ('[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [5]}]',
         "messages[1].tool_calls[0] must be an object with a function's name"),
        ('[{"role": "developer", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}, '
         '{"role": "user", "content": "hi"}]',
         "messages[0].tool_calls: only an assistant message makes tool calls"),  # (a traceback)
        # half a surrogate pair: named by its field (it was "the chat prompt ... at character 98")
        ('[{"role": "user", "content": "x"}, {"role": "assistant", "content": null, '
         '"tool_calls": [{"function": {"name": "f", "arguments": "{\\"a\\": \\"\\ud800\\"}"}}]}]',
         "messages[1].tool_calls[0].arguments holds '\\ud800'"),
        ('[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": '
         '[{"function": {"name": "f", "arguments": 3}}]}]',
         "messages[1].tool_calls[0].arguments must be an object or its JSON text"),
        ('[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": '
         '[{"function": {"name": "f", "arguments": "{no"}}]}]',
         "messages[1].tool_calls[0].arguments is not JSON"),
        # the chat template's tojson met Undefined: a TypeError traceback
        ('[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": '
         '[{"type": "function", "function": {"name": "f"}}]}]',
         "messages[1].tool_calls[0] has no arguments (give {} for none)"),
        # half a surrogate pair (JSON's escape): the tokenizer raised a TypeError traceback
        ('[{"role": "user", "content": "hi \\ud800 x"}]',
         "messages[0].content holds '\\ud800' at character 3"),
    ],
)
def test_bad_messages_file(tiny_model_dir, tmp_path, content, message):
    (tmp_path / "m.json").write_text(content)
    code, out, err = run(
        "generate", "--model", str(tiny_model_dir), "--messages", str(tmp_path / "m.json")
    )
    assert code == 2 and out == ""
    assert err.startswith(f"error: {tmp_path / 'm.json'}") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"type": "function"}', "tools must be a JSON list"),
        ('[{"type": "function", "function": {"description": "x"}}]', "tools[0].function.name"),
        # a chat template writes the name into the history as it is: it would not parse back
        ('[{"type": "function", "function": {"name": "say \\"hi\\""}}]',
         "tools[0].function.name must be 1-64 letters, digits, '_' or '-', got 'say \"hi\"'"),
        ('[{"name": "f"}]', 'tools[0] must be {"type": "function"'),
        ('[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
         '"properties": {"a": {"type": "strin"}}}}}]', "not a valid JSON Schema"),
        ('[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]',
         "parameters must be a JSON Schema of type object"),
    ],
)
def test_bad_tools_file(tiny_model_dir, tmp_path, content, message):
    (tmp_path / "t.json").write_text(content)
    code, _, err = run(
        "generate",
        "--model",
        str(tiny_model_dir),
        "--prompt",
        "x",
        "--tools",
        str(tmp_path / "t.json"),
    )
    assert code == 2 and message in err and str(tmp_path / "t.json") in err


def test_bad_requests_line_is_named(tiny_model_dir, tmp_path):
    (tmp_path / "r.jsonl").write_text('{"prompt": "ok"}\n{"prompt": "x", "max_tokens": -1}\n')
    code, _, err = run(
        "generate", "--model", str(tiny_model_dir), "--requests", str(tmp_path / "r.jsonl")
    )
    assert code == 2 and f"{tmp_path / 'r.jsonl'}:2" in err and "max_tokens" in err
    (tmp_path / "r.jsonl").write_text('{"prompt": "ok", "colour": 1}\n')
    code, _, err = run(
        "generate", "--model", str(tiny_model_dir), "--requests", str(tmp_path / "r.jsonl")
    )
    assert code == 2 and "unknown field 'colour'" in err


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "x", "stop": 5}', "stop must be a string or a list of strings, got 5"),
        ('{"prompt": "x", "stop": {"a": 1}}',
         "stop must be a string or a list of strings, got {'a': 1}"),
        ('{"prompt": "x", "seed": "abc", "temperature": 0.5}', "seed must be an integer"),
        ('{"prompt": "x", "seed": 1.5, "temperature": 0.5}', "seed must be an integer"),
        ('{"prompt": "x", "seed": 100000000000000000000000}', "seed must be an integer in"),
        ('{"prompt": "x", "speculation": 5}', "speculation must be auto, dflash or off"),
        ('{"prompt": "x", "temperature": "hot"}', "temperature must be 0 (greedy) or a number"),
        ('{"prompt": "x", "tool_choice": 5, "tools": ' + json.dumps(TOOLS) + "}",
         "tool_choice: expected auto, none, required or a tool name"),
        ('{"prompt": "x", "tool_choice": "", "tools": ' + json.dumps(TOOLS) + "}",
         "tool_choice: expected auto, none, required or a tool name"),
        ('{"prompt": "x", "regex": "([a-"}', "unclosed character class"),
        ('{"prompt": "x", "tool_choice": {"type": "function", "function": "x"}}',
         "tool_choice {'type': 'function', 'function': 'x'} needs tools"),
        ('{"prompt": "x", "regex": "a+", "stop": "a"}',
         "stop cannot cut a reply the grammar binds whole"),
        ('{"prompt": "x", "schema": {"type": "nonsense"}}', "schema: #/type: not a valid"),
        # Python's json keeps the last: the first was lost without a word
        ('{"prompt": "x", "max_tokens": 3, "max_tokens": 400}',
         "malformed JSON: the key 'max_tokens' is given twice in one object"),
    ],
)
def test_bad_request_fields_are_named_on_one_line(tiny_model_dir, tmp_path, line, message):
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    code, out, err = run("generate", "--model", str(tiny_model_dir), "--requests", str(path))
    assert code == 2 and out == ""  # the good line above it is not answered either
    assert err.startswith(f"error: {path}:2: ") and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.count(str(path)) == 1  # named once, not once more by each layer it passed


def test_requests_grammars_compile_before_any_answer_and_schema_files_sit_beside(
    tiny_model_dir, tmp_path, monkeypatch
):
    (tmp_path / "int.json").write_text('{"type": "integer"}')
    (tmp_path / "unique.json").write_text('{"type": "array", "uniqueItems": true}')
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "x", "schema": "int.json", "max_tokens": 4}\n'
                    '{"prompt": "x", "schema": "unique.json", "max_tokens": 4}\n')
    monkeypatch.chdir("/")  # a schema file is found beside the requests, not in the cwd
    code, out, err = run("generate", "--model", str(tiny_model_dir), "--requests", str(path))
    assert code == 2 and out == "" and err.startswith(f"error: {path}:2: ")
    assert "uniqueItems" in err
    path.write_text('{"prompt": "x", "schema": "int.json", "max_tokens": 4}\n')
    code, out, _ = run("generate", "--model", str(tiny_model_dir), "--requests", str(path))
    assert code == 0 and out.strip().lstrip("-").isdigit()
    # a line asking for dflash of a model without a drafter fails before any line is answered
    path.write_text('{"prompt": "x", "max_tokens": 4}\n'
                    '{"prompt": "x", "max_tokens": 4, "speculation": "dflash"}\n')
    code, out, err = run("generate", "--model", str(tiny_model_dir), "--requests", str(path))
    assert code == 2 and out == "" and err.startswith(f"error: {path}:2: speculation dflash "
                                                      f"needs a drafter")


def test_a_prompt_too_long_is_named_before_any_answer(tiny_model_dir, tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"prompt": "x", "max_tokens": 2}) + "\n"
                    + json.dumps({"prompt": "word " * 1200, "max_tokens": 2}) + "\n")
    code, out, err = run("generate", "--model", str(tiny_model_dir), "--requests", str(path))
    assert code == 2 and out == ""
    assert err.startswith(f"error: {path}:2: the prompt has ") and "holds 1024" in err
    messages = tmp_path / "m.json"
    messages.write_text(json.dumps([{"role": "user", "content": "word " * 1200}]))
    code, out, err = run("generate", "--model", str(tiny_model_dir), "--messages", str(messages))
    assert code == 2 and err.startswith(f"error: {messages}: the prompt has ")
    # past the tokenizer's own model_max_length (2048) transformers warned on stderr too,
    # through a handler the test runner's stderr does not see: a process of its own
    messages.write_text(json.dumps([{"role": "user", "content": "word " * 3000}]))
    done = subprocess.run([sys.executable, "-m", "agentflash.cli", "generate", "--model",
                           str(tiny_model_dir), "--messages", str(messages)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr


def test_unreadable_input_files_get_an_error_line(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b'\xff{"prompt": "x"}\n')
    for flag, what in (("--requests", "requests"), ("--messages", "messages"),
                       ("--tools", "tools")):
        args = ["generate", flag, str(bad)] + ([] if flag != "--tools" else ["--prompt", "x"])
        code, out, err = run(*args)
        assert (code, out) == (2, "")
        assert err == f"error: {bad}: {what} file is not UTF-8 text (byte 0)\n"
        code, _, err = run(*args[:2], str(tmp_path), *args[3:])
        assert code == 2 and err == f"error: {tmp_path}: cannot read {what} file: Is a directory\n"


def test_a_bad_flag_is_not_blamed_on_a_requests_line(tiny_model_dir, tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "x"}\n')
    code, _, err = run("generate", "--model", str(tiny_model_dir), "--requests", str(path),
                       "--max-tokens", "0")
    assert code == 2 and err.startswith("error: --max-tokens must be a positive")
    messages = tmp_path / "m.json"
    messages.write_text('[{"role": "user", "content": "x"}]')
    for flags in (["--max-tokens", "0"], ["--regex", "("], ["--tool-choice", "foo"]):
        code, _, err = run("generate", "--model", str(tiny_model_dir), "--messages",
                           str(messages), *flags)
        assert code == 2 and err.startswith(f"error: {flags[0]}"), (flags, err)
    assert "--tool-choice 'foo' needs tools" in err  # its name, not OpenAI's form of it
    # the grammar flags, alone or together, were blamed on the requests file's first line
    (tmp_path / "s.json").write_text('{"type": "object"}')
    tools = tmp_path / "t.json"
    tools.write_text(json.dumps(TOOLS))
    for flags, message in ((["--tools", str(tools), "--tool-choice", "nosuch"],
                            "--tool-choice: no tool is named 'nosuch'"),
                           (["--schema", str(tmp_path / "s.json"), "--stop", "x"],
                            "--stop cannot cut a reply the grammar binds whole"),
                           (["--tool-choice", "required"], "--tool-choice 'required' needs tools"),
                           (["--regex", "(["], "--regex: invalid regex")):
        code, _, err = run("generate", "--model", str(tiny_model_dir), "--requests", str(path),
                           *flags)
        assert code == 2 and err.startswith(f"error: {message}"), (flags, err)
    # flags that hold only with the lines' fields (the tools in each line): a line's own
    # error is the line's (it was "command line: tool_choice 'required' needs tools")
    path.write_text("".join(json.dumps({"prompt": "x", "tools": TOOLS, **extra}) + "\n"
                            for extra in ({}, {"max_tokens": 0})))
    code, _, err = run("generate", "--model", str(tiny_model_dir), "--requests", str(path),
                       "--tool-choice", "required")
    assert code == 2 and err.startswith(f"error: {path}:2: max_tokens must be a positive"), err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-tokens", "0"], "--max-tokens must be a positive integer, got 0"),
        (["--temperature", "-1"], "--temperature must be 0 (greedy) or a number from 1e-06"),
        (["--top-p", "0"], "--top-p must be a number in (0, 1], got 0.0"),
        (["--temperature", "0.5", "--seed", str(10**30)], "--seed must be an integer in"),
        (["--stop", ""], "--stop must hold non-empty strings"),
        (["--tool-choice", "nope"], "--tool-choice 'nope' needs tools"),
    ],
)
def test_a_bad_flag_value_names_the_flag_and_a_lines_its_field(tmp_path, flags, message):
    # "command line: max_tokens must be..." named a field the user never typed
    code, out, err = run("generate", "--prompt", "x", *flags)
    assert (code, out) == (2, "") and err.startswith(f"error: {message}"), err
    code, _, err = run("generate", "--prompt", "", *flags[:-2])
    assert err == "error: --prompt must be a non-empty string\n"
    field = message.split()[0].removeprefix("--").replace("-", "_")
    value = json.loads(flags[-1]) if field not in ("stop", "tool_choice") else flags[-1]
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"prompt": "x", **dict(zip(["temperature", field],
                                                          [0.5, value]))}) + "\n")
    code, _, err = run("generate", "--requests", str(path))
    assert code == 2 and err.startswith(f"error: {path}:1: {field} "), err


def test_two_grammars_are_named_as_flags_and_auto_without_tools_is_free_text(tmp_path):
    from agentflash import inputs

    # it said "command line: give one of tool_choice, schema, regex, not ['schema', 'regex']"
    (tmp_path / "s.json").write_text('{"type": "integer"}')
    code, _, err = run("generate", "--prompt", "x", "--schema", str(tmp_path / "s.json"),
                       "--regex", "a")
    assert (code, err) == (2, "error: command line: give one of --tool-choice, --schema, "
                              "--regex, not --schema and --regex\n")
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "x", "schema": {"type": "integer"}, "regex": "a"}\n')
    code, _, err = run("generate", "--requests", str(path))
    assert err == (f"error: {path}:1: give one of tool_choice, schema, regex, not schema and "
                   f"regex\n")
    # auto, the default, leaves a reply without tools free, as serve and agents do (it was
    # held to text without a call, masked at every token); none keeps calls out
    assert inputs.make_input({"prompt": "x", "tool_choice": "auto"}, "x").params.grammar is None
    assert inputs.make_input({"prompt": "x", "tool_choice": "none"}, "x").params.grammar


def test_requests_lines_end_at_newlines_alone(tiny_model_dir, tmp_path):
    # a line separator JSON's strings may hold as it is split the line (malformed JSON), and
    # a form feed numbered the lines after it one too far
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"prompt": "one\u2028two\x85three"}, ensure_ascii=False)
                    + '\r\n{"prompt": "x", "colour": 1}\n', encoding="utf-8")
    code, _, err = run("generate", "--model", str(tiny_model_dir), "--requests", str(path))
    assert code == 2 and err.startswith(f"error: {path}:2: unknown field 'colour'"), err


def test_a_requests_lines_grammar_replaces_the_flags_and_a_choice_without_tools_is_none(
    tiny_model_dir, tmp_path
):
    (tmp_path / "int.json").write_text('{"type": "integer"}')
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "x", "regex": "[ab]{3}"}\n{"prompt": "x"}\n')
    code, out, err = run("generate", "--model", str(tiny_model_dir), "--requests", str(path),
                         "--schema", str(tmp_path / "int.json"), "--max-tokens", "8",
                         "--tool-choice", "none", "--json")
    assert code == 0, err  # schema and regex were two grammars of the line, said its error
    first, second = (json.loads(line) for line in out.splitlines())
    assert len(first["text"]) == 3 and set(first["text"]) <= {"a", "b"}
    assert second["text"].lstrip("-").isdigit() or second["finish_reason"] == "length"


def test_boolean_schemas_and_a_huge_seed(tiny_model_dir, tmp_path):
    (tmp_path / "any.json").write_text("true")
    code, out, _ = run("generate", "--model", str(tiny_model_dir), "--prompt", "x",
                       "--schema", str(tmp_path / "any.json"), "--max-tokens", "8", "--json")
    assert code == 0 and json.loads(out)["finish_reason"] in ("stop", "length")
    code, _, err = run("generate", "--model", str(tiny_model_dir), "--prompt", "x",
                       "--temperature", "0.5", "--seed", str(10**23))
    assert code == 2 and err.startswith("error: --seed must be an integer in")


def test_missing_model_and_missing_files(tmp_path):
    code, _, err = run("generate", "--model", str(tmp_path / "none"), "--prompt", "x")
    assert code == 2 and "model directory does not exist" in err
    for flag in ("--model", "--drafter"):  # no such user's home: a traceback
        code, _, err = run("generate", flag, "~nosuchuser_af/m", "--prompt", "x")
        assert code == 2 and "~nosuchuser_af/m: " in err and "directory does not exist" in err
    code, _, err = run("generate", "--prompt", "x", "--tools", str(tmp_path / "none.json"))
    assert code == 2 and "tools file does not exist" in err
    code, _, err = run("generate", "--prompt", "x", "--messages", str(tmp_path / "m.json"))
    assert code == 2 and "exactly one of" in err


def test_path_flags_expand_the_home_directory(tiny_model_dir, tmp_path, monkeypatch):
    # a shell leaves "--messages=~/m.json" as it is; the flags take "~" as --model does
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m.json").write_text(json.dumps([{"role": "user", "content": "hi"}]))
    (tmp_path / "s.json").write_text(json.dumps({"type": "integer"}))
    (tmp_path / "t.json").write_text(json.dumps(TOOLS))
    (tmp_path / "r.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    # a line's schema too (read beside the requests file, "~" and all: it did not exist)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "r.jsonl").write_text(json.dumps({"prompt": "x", "schema": "~/s.json"})
                                              + "\n")
    code, out, err = run("generate", "--model", str(tiny_model_dir), "--max-tokens", "4",
                         "--json", "--requests", str(tmp_path / "sub" / "r.jsonl"))
    assert code == 0, err
    model = ["--model", str(tiny_model_dir), "--max-tokens", "4", "--json"]
    for flags in (["--messages=~/m.json", "--schema=~/s.json"],
                  ["--prompt", "x", "--tools=~/t.json"], ["--requests=~/r.jsonl"]):
        code, out, err = run("generate", *model, *flags)
        assert code == 0, (flags, err)
        assert json.loads(out.splitlines()[0])["finish_reason"] in ("stop", "length")
    (tmp_path / "w.yaml").write_text("name: w\nagents: {}\n")
    code, _, err = run("validate", "~/w.yaml")
    assert code == 2 and str(tmp_path / "w.yaml") in err
    code, _, err = run("train", "target", "--out=~/t.json")
    assert code == 2 and f"{tmp_path / 't.json'}: --out must be a directory" in err


def test_a_closed_standard_input_is_named_as_closed(tmp_path):
    # "/dev/stdin: messages file does not exist" sent its user looking for a file
    for args, what in ((["--messages", "/dev/stdin"], "messages file"),
                       (["--prompt", "x", "--schema", "/dev/stdin"], "schema file")):
        done = subprocess.run([sys.executable, "-m", "agentflash.cli", "generate", *args],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=120, preexec_fn=lambda: os.close(0))
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
        assert done.stderr.endswith(f"/dev/stdin: {what} cannot be read: standard input is "
                                    "closed\n")
    done = subprocess.run([sys.executable, "-m", "agentflash.cli", "validate", "/dev/stdin"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: os.close(0))
    assert done.stderr == "error: /dev/stdin: file cannot be read: standard input is closed\n"
    done = subprocess.run([sys.executable, "-m", "agentflash.cli", "generate", "--messages",
                           str(tmp_path / "m.json")], capture_output=True, text=True, timeout=120)
    assert done.stderr == f"error: {tmp_path / 'm.json'}: messages file does not exist\n"


def test_a_dash_reads_standard_input(tiny_model_dir, tmp_path, monkeypatch):
    # "--messages -" read a file named "-": "-: messages file does not exist"
    model = ["generate", "--model", str(tiny_model_dir), "--max-tokens", "4", "--json"]
    messages = json.dumps([{"role": "user", "content": "hi"}])

    def answers(out):
        return [{k: v for k, v in json.loads(line).items() if k != "stats"}
                for line in out.splitlines()]

    for flag, content, rest in (("--messages", messages, []),
                                ("--tools", json.dumps(TOOLS), ["--prompt", "x"]),
                                ("--schema", '{"type": "integer"}', ["--prompt", "x"]),
                                ("--requests", '{"prompt": "x"}\n{"prompt": "y"}\n', [])):
        (tmp_path / "file").write_text(content)
        code, out, err = run(*model, *rest, flag, str(tmp_path / "file"))
        assert code == 0, err
        result = CliRunner().invoke(app, [*model, *rest, flag, "-"], input=content)
        assert result.exit_code == 0, result.stderr
        assert answers(result.stdout) == answers(out)
    assert json.loads(out.splitlines()[1])["finish_reason"] in ("stop", "length")
    # errors name it; it is read once, by one flag
    result = CliRunner().invoke(app, [*model, "--requests", "-"],
                                input='{"prompt": "x"}\n{"prompt": "x", "max_tokens": 0}\n')
    assert result.exit_code == 2
    assert result.stderr == "error: <stdin>:2: max_tokens must be a positive integer, got 0\n"
    result = CliRunner().invoke(app, [*model, "--prompt", "x", "--schema", "-"], input="{")
    assert result.stderr.startswith("error: <stdin>:1:2: invalid JSON")
    result = CliRunner().invoke(app, [*model, "--messages", "-", "--tools", "-"], input=messages)
    assert result.exit_code == 2 and result.stderr == (
        "error: only one file flag can read standard input ('-'), not --messages and --tools\n")
    monkeypatch.chdir(tmp_path)  # "./-" is a file of that name
    (tmp_path / "-").write_text(messages)
    code, out, _ = run(*model, "--messages", "./-")
    assert code == 0 and answers(out) == answers(
        CliRunner().invoke(app, [*model, "--messages", "-"], input=messages).stdout)
    done = subprocess.run([sys.executable, "-m", "agentflash.cli", "generate", "--messages", "-"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: os.close(0))
    assert done.stderr == "error: <stdin>: messages cannot be read: standard input is closed\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "--suites", "nope"], "--suites: unknown suite 'nope' (known: tool_call, code"),
        (["bench", "--suites", ","], "--suites names none"),
        (["bench", "--num-prompts", "0"], "--num-prompts must be at least 1, got 0"),
        (["bench", "--max-tokens", "0", "--concurrency", "1"], "--max-tokens must be at least 1"),
        (["bench", "--rounds", "0"], "--rounds must be at least 1"),
        (["bench", "--concurrency", "1,4", "--num-prompts", "2"],
         "--concurrency 4 is more than --num-prompts 2"),
        # empty items were dropped, an empty list ran the one-stream bench, a repeated level
        # or suite ran twice, bench-server named no flag, and a concurrency bench without a
        # drafter was refused only once the model had loaded
        (["bench", "--concurrency", "1,,4"],
         "--concurrency takes comma-separated integers, got '1,,4'"),
        (["bench", "--concurrency", ""], "--concurrency takes comma-separated integers, got ''"),
        (["bench", "--concurrency", "4,1,1"], "--concurrency names 1 twice"),
        (["bench", "--suites", "code,code"], "--suites names 'code' twice"),
        (["bench", "--drafter", "none", "--concurrency", "1"], "compares dflash rows"),
        (["bench-server", "--rounds", "0"], "--rounds must be at least 1, got 0"),
        (["bench", "--rounds", "5"], "--rounds is for --concurrency runs"),  # (dropped)
        (["bench-server", "--concurrency", "1,4,"], "--concurrency takes comma-separated"),
        (["bench-server", "--suites", "json"], "--suites: unknown suite 'json'"),
        (["eval-tool-calls", "--num", "0"], "--num must be at least 1, got 0"),
        (["train", "target", "--out", "FILE"], "--out must be a directory, and this is a file"),
        (["train", "target", "--out", "DIR", "--steps", "0"], "--steps must be at least 1"),
        # (where no directory can be made, for root too: a traceback)
        (["train", "target", "--out", "/proc/agentflash/out"],
         "/proc/agentflash/out: --out cannot be made: No such file or directory"),
        (["train", "drafter", "--target", "demo", "--out", "DIR", "--lr", "nan"],
         "--lr must be a positive number, got nan"),
        (["train", "drafter", "--target", "demo", "--out", "DIR", "--num-anchors", "0"],
         "--num-anchors must be at least 1"),
        (["train", "drafter", "--target", "demo", "--out", "DIR", "--block-size", "1"],
         "--block-size must be at least 2"),
        (["train", "drafter", "--target", "demo", "--out", "DIR", "--target-layer-ids", "3,1"],
         "--target-layer-ids must be increasing, got '3,1'"),
        (["train", "drafter", "--target", "demo", "--out", "DIR", "--target-layer-ids", ""],
         "--target-layer-ids takes comma-separated integers, got ''"),  # (the default ones)
        (["train", "drafter", "--target", "demo", "--out", "DIR", "--init", "DIR/none"],
         "is not a drafter directory"),
        (["train", "drafter", "--target", "demo", "--out", "DIR", "--num-conversations", "0"],
         "--num-conversations must be at least 1"),
        (["train", "drafter", "--target", "demo", "--out", "DIR", "--num-conversations", "8"],
         "leaves nothing to train on: the last 16 of each kind are held out"),
    ],
)
def test_heavy_commands_name_a_bad_argument_before_any_work(tmp_path, monkeypatch, args,
                                                              message):
    import agentflash.engine.engine as engine_mod

    def no_loading(*_, **__):
        raise AssertionError("a model was loaded before the bad argument was named")

    monkeypatch.setattr(engine_mod.Engine, "from_pretrained", no_loading)
    (tmp_path / "FILE").write_text("x")
    args = [a.replace("FILE", str(tmp_path / "FILE")).replace("DIR", str(tmp_path / "out"))
            for a in args]
    code, out, err = run(*args)
    assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists()  # nothing written either


@pytest.mark.parametrize(
    ("n", "shares", "counts"),
    [(2500, [60, 12, 16, 12], [1500, 300, 400, 300]),  # the default: exact
     (72, [60, 12, 16, 12], [43, 9, 11, 9]),  # 43.2, 8.64, 11.52, 8.64: not 70 conversations
     (7, [1, 1, 1], [3, 2, 2]),  # a tie goes to the earlier kind
     (5, [0, 1, 0, 1], [0, 3, 0, 2])],
)
def test_train_drafter_splits_every_conversation_among_the_kinds(n, shares, counts):
    from agentflash.cli import split_shares

    assert split_shares(n, shares) == counts and sum(counts) == n


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mix", "1,2,3"], "--mix needs four shares"),
        (["--target-layer-ids", "1,x"], "--target-layer-ids takes comma-separated integers"),
        (["--target-layer-ids", "-1,2"], "--target-layer-ids takes integers from 0"),
    ],
)
def test_train_drafter_names_a_bad_flag_before_any_work(tmp_path, flags, message):
    code, _, err = run("train", "drafter", "--target", str(tmp_path), "--out",
                       str(tmp_path / "out"), *flags)
    assert code == 2 and message in err
    assert not (tmp_path / "out").exists()


def test_eval_tool_calls_prints_a_table_or_json(tiny_model_dir):
    code, table, _ = run("eval-tool-calls", "--model", str(tiny_model_dir), "--num", "2")
    assert code == 0 and "2 held-out tool-call prompts" in table
    code, as_json, _ = run("eval-tool-calls", "--model", str(tiny_model_dir), "--num", "2",
                           "--json")
    report = json.loads(as_json)
    assert report["counts"]["prompts"] == 2 and set(report["rates"]) <= set(report["counts"])
    for key, rate in report["rates"].items():
        assert f"{key.replace('_', ' '):<16} {report['counts'][key]:>5}  {rate:7.1%}" in table


def test_tools_with_a_schema_answer_in_it_or_call_them(tmp_path):
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    schema = {"type": "integer", "minimum": 100, "maximum": 105}
    (tmp_path / "answer.json").write_text(json.dumps(schema))
    both = ("--tools", str(tmp_path / "tools.json"), "--schema", str(tmp_path / "answer.json"))
    code, out, _ = run("generate", "--prompt", "Use get_weather with city Oslo, days 3.", *both,
                       "--max-tokens", "60", "--json")
    assert code == 0 and [c["name"] for c in json.loads(out)["tool_calls"]] == ["get_weather"]
    code, out, _ = run("generate", "--prompt", "Use get_weather with city Oslo, days 3.", *both,
                       "--tool-choice", "none", "--max-tokens", "60")
    assert code == 0 and 100 <= json.loads(out) <= 105
    code, _, err = run("generate", "--prompt", "x", "--tools", str(tmp_path / "tools.json"),
                       "--regex", "a+")
    assert code == 2 and "a regex binds the whole reply" in err


def _checkpoint(out, **state):
    import torch

    (out / "checkpoints").mkdir(parents=True)
    torch.save(state, out / "checkpoints" / "latest.pt")


@pytest.mark.parametrize(
    ("kind", "setup", "steps", "message"),
    [
        ("drafter", "the target itself", 10, "--out is the target's directory"),
        ("target", "a model", 10, "holds a model and no checkpoint to resume from"),
        ("drafter", "a model", 10, "holds a target run (tokenizer.json)"),
        ("target", "a drafter run", 10, "holds a drafter run (responses.json)"),
        ("target", "a drafter checkpoint", 10, "a drafter run's checkpoint"),
        ("target", "a target checkpoint at 12", 5, "the run is at step 12, past --steps 5"),
        # its learning rate's schedule ends at the run's own --steps: one spliced on was recorded
        # as one schedule of the steps asked
        ("target", "a target checkpoint of --steps 7", 10, "latest.pt: the run was started with "
         "--steps 7 (the learning rate's schedule ends there), and 10 is asked"),
        ("drafter", "a drafter checkpoint of another target", 10,
         "the drafter was trained for the target /elsewhere"),
        # taken before: the run wrote among them (into assets/demo, the demo's own folder)
        ("target", "a folder of notes", 10, "holds 'notes.txt', which a target run does not "
                                            "write: give a new or empty --out"),
        ("drafter", "a folder of notes", 10, "holds 'notes.txt', which a drafter run does not"),
    ],
)
def test_training_refuses_an_out_it_would_spoil_before_any_work(tmp_path, tiny_model_dir,
                                                                monkeypatch, kind, setup, steps,
                                                                message):
    import shutil

    import agentflash.models.loading as loading
    import agentflash.train.corpus as corpus

    def no_work(*_, **__):
        raise AssertionError("work began before the --out was refused")

    monkeypatch.setattr(loading, "load_model", no_work)
    monkeypatch.setattr(corpus, "generate", no_work)
    target = tmp_path / "target"
    shutil.copytree(tiny_model_dir, target)
    out = target if setup == "the target itself" else tmp_path / "out"
    if setup == "a model":
        shutil.copytree(tiny_model_dir, out)
    elif setup == "a drafter run":
        out.mkdir()
        (out / "responses.json").write_text("[]")
    elif setup.startswith("a drafter checkpoint"):
        trained_for = "/elsewhere" if "another" in setup else str(target.resolve())
        _checkpoint(out, step=2, drafter={}, target=trained_for)
    elif setup == "a target checkpoint at 12":
        _checkpoint(out, step=12, model={})
    elif setup == "a target checkpoint of --steps 7":
        from agentflash.train.target import TargetTrainConfig, target_settings

        _checkpoint(out, step=2, model={}, settings=target_settings(TargetTrainConfig(steps=7)))
    elif setup == "a folder of notes":
        out.mkdir()
        (out / "train_log.jsonl").write_text("")  # a run's own file...
        (out / "notes.txt").write_text("mine")  # ...beside one that is not
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*"))
    command = (["train", "target"] if kind == "target"
               else ["train", "drafter", "--target", str(target)])
    code, _, err = run(*command, "--out", str(out), "--steps", str(steps))
    assert code == 2 and message in err, err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*")) == before


def test_the_demo_target_is_one_target_however_it_is_given(tmp_path):
    # a drafter run of --target demo was refused on a rerun naming the demo's directory
    from agentflash.models.loading import DEMO_DIR
    from agentflash.train.runs import check_out_dir, target_name

    assert target_name("demo") == target_name(DEMO_DIR / "target") == "demo"
    assert target_name(DEMO_DIR / "target" / "..") == str(DEMO_DIR.resolve())
    # a checkpoint that kept the directory (written before) resumes as --target demo, and the
    # system's hidden files beside a run are no user's work
    _checkpoint(tmp_path, step=2, drafter={}, target=str(DEMO_DIR / "target"))
    (tmp_path / ".DS_Store").write_bytes(b"")
    check_out_dir(tmp_path, "drafter", 10, "demo")


def test_a_resumed_run_keeps_one_log_line_a_step(tmp_path):
    from agentflash.train.runs import open_log

    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": n, "loss": 1.0 / n}) + "\n" for n in range(1, 8))
                   + '{"step": 8, "lo')  # cut short by the interruption
    with open_log(log, 5) as f:  # the checkpoint was at step 5
        f.write(json.dumps({"step": 6, "loss": 0.1}) + "\n")
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4,
                                                                                   5, 6]


def test_output_that_cannot_be_written_is_an_error_line():
    # a full disk under standard output was a traceback of thirty lines
    with open("/dev/full", "w") as full:
        workflow = Path(__file__).parents[1] / "examples" / "structured.yaml"
        done = subprocess.run([sys.executable, "-m", "agentflash.cli", "validate", workflow],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr == "error: cannot write: No space left on device\n"
