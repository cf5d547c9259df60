"""Tool-call grammars: the union of an agent's tools, and whole assistant turns under tool_choice,
in the exact chat format of the demo template."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from agentflash.grammar import (
    GrammarError,
    ToolChoice,
    ToolChoiceMode,
    allowed_token_ids,
    assistant_turn,
    compile_grammar,
    lark,
    tool_call_body,
    tool_call_schema,
)
from agentflash.grammar.bench import closing_tokens, random_output
from agentflash.tool_format import parse_tool_calls, text_outside_calls
from agentflash.train.tokenizer import render

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "$defs": {"num": {"type": "integer", "minimum": -99, "maximum": 99}},
                "properties": {"a": {"$ref": "#/$defs/num"}, "b": {"$ref": "#/$defs/num"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 10},
                "filters": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "field": {"type": "string", "maxLength": 6},
                            "value": {"type": ["string", "integer", "null"]},
                        },
                        "required": ["field", "value"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    },
]
CALLS = {
    "get_weather": {"city": "Paris", "unit": "celsius"},
    "add": {"a": 2, "b": -40},
    "search": {"query": "llamas", "filters": [{"field": "year", "value": 2024}]},
}


@pytest.fixture(scope="module")
def tok(demo_tokenizer_dir):
    return AutoTokenizer.from_pretrained(demo_tokenizer_dir)


@pytest.fixture(scope="module")
def closers(tok):
    return closing_tokens(tok, len(tok))


def reply_ids(tok, content: str, calls: list[tuple[str, dict]]) -> list[int]:
    """The token ids the chat template gives an assistant reply (after the generation prompt),
    ending with the end token."""
    message = {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in calls],
    }
    text = render([{"role": "user", "content": "hi"}, message], tools=TOOLS)
    reply = text.split("<|im_start|>assistant\n", 1)[1]
    assert reply.endswith("<|im_end|>\n")
    return tok(reply[: -len("\n")], add_special_tokens=False)["input_ids"]


def is_legal(grammar, ids: list[int]) -> bool:
    return grammar.new_constraint().validate_draft(ids) == len(ids)


def schema_of(name: str) -> dict:
    tool = next(t for t in TOOLS if t.get("function", t)["name"] == name)
    return tool.get("function", tool)["parameters"]


# --- the union of the tools --------------------------------------------------------------------


def test_union_accepts_each_tools_call_and_rejects_unknown_names(tok):
    grammar = compile_grammar(tool_call_body(TOOLS), tok)
    eos = tok.eos_token_id
    for name, arguments in CALLS.items():
        body = f'{{"name": "{name}", "arguments": {render_json(arguments)}}}'
        assert is_legal(grammar, tok.encode(body, add_special_tokens=False) + [eos]), body
    unknown = tok.encode('{"name": "delete_everything", "arguments": {}}', add_special_tokens=False)
    cut = grammar.new_constraint().validate_draft(unknown)
    assert tok.decode(unknown[:cut]) in '{"name": "delete_everything"'
    assert len(tok.decode(unknown[:cut])) < len('{"name": "delete_everything"')


def test_union_rejects_arguments_of_the_wrong_shape(tok):
    grammar = compile_grammar(tool_call_body(TOOLS), tok)
    for body in (
        '{"name": "add", "arguments": {"a": "2", "b": 3}}',  # wrong type
        '{"name": "add", "arguments": {"a": 2}}',  # missing required
        '{"name": "add", "arguments": {"a": 200, "b": 3}}',  # out of bounds via $ref
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}',
        '{"name": "get_weather", "arguments": {"a": 2, "b": 3}}',
    ):  # another tool's args
        ids = tok.encode(body, add_special_tokens=False) + [tok.eos_token_id]
        assert not is_legal(grammar, ids), body


def test_parameters_without_a_type_take_an_object_alone(tok):
    # they are an object's (check_parameters), but the grammar embedded them as they were:
    # '"arguments": 5' was written, a call every parser refuses
    for params in ({}, {"properties": {"x": {"type": "string"}}}):
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        grammar = compile_grammar(tool_call_body(tools), tok)
        for args, legal in (("5", False), ('"hi"', False), ("[1]", False), ("null", False),
                            ('{"x": "a"}', True)):
            body = '{"name": "f", "arguments": ' + args + '}'
            ids = tok.encode(body, add_special_tokens=False) + [tok.eos_token_id]
            assert is_legal(grammar, ids) == legal, (params, body)


@pytest.mark.parametrize(("parameters", "legal", "illegal"), [
    # a $ref in a const or an enum is data: it was rewritten as the union's pointer, and the call
    # written with it refused by the tool's own schema
    ({"properties": {"x": {"const": {"$ref": "#/a"}}}, "required": ["x"]},
     {"x": {"$ref": "#/a"}}, {"x": {"$ref": "#/anyOf/0/properties/arguments/a"}}),
    ({"properties": {"x": {"enum": [{"$ref": "#"}]}}, "required": ["x"]},
     {"x": {"$ref": "#"}}, {"x": {"$ref": "#/anyOf/0/properties/arguments"}}),
    # an anchor's ref, and the refs of a schema with an $id: refused as pointers to nothing
    ({"$defs": {"n": {"$anchor": "num", "type": "integer", "maximum": 3}},
      "properties": {"x": {"$ref": "#num"}}, "required": ["x"]}, {"x": 3}, {"x": 4}),
    ({"$id": "https://example.com/s", "$defs": {"a": {"type": "integer", "maximum": 3}},
      "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}, {"x": 3}, {"x": 4}),
    ({"$id": "https://example.com/s", "$defs": {"a": {"type": "integer", "maximum": 3}},
      "properties": {"x": {"$ref": "https://example.com/s#/$defs/a"}}, "required": ["x"]},
     {"x": 3}, {"x": 4}),  # (compiled before the $id was dropped: that must hold on)
    ({"$id": "https://example.com/s", "$defs": {"a": {"type": "integer", "maximum": 3}},
      "properties": {"x": {"$ref": "s#/$defs/a"}, "c": {"$ref": "https://example.com/s"}},
      "required": ["x"]}, {"x": 3, "c": {"x": 1}}, {"x": 3, "c": {"x": 4}}),
    # a subschema with an $id is a resource of its own: "#" there is that subschema (its refs
    # were rebased to the tool's root, and pointed to nothing)
    ({"properties": {"p": {"$id": "https://e.x/point", "type": "object", "required": ["x", "y"],
                           "properties": {"x": {"type": "integer"},
                                          "y": {"$ref": "#/properties/x"}}}},
      "required": ["p"]},
     {"p": {"x": 1, "y": 2}}, {"p": {"x": 1, "y": "s"}}),
    ({"$id": "https://e.x/root", "properties": {
        "p": {"$id": "point", "$defs": {"n": {"$anchor": "num", "type": "integer", "maximum": 3}},
              "type": "object", "properties": {"x": {"$ref": "#num"}}, "required": ["x"]},
        "q": {"$ref": "point#num"}, "r": {"$ref": "https://e.x/point#/$defs/n"}},
      "required": ["p", "q", "r"]},
     {"p": {"x": 3}, "q": 2, "r": 1}, {"p": {"x": 3}, "q": 4, "r": 1}),
    # an allOf's ref to an anchor: the object it names describes the arguments with the other
    # branch, and stays open (closed, no call of the tool was legal, and the union dropped it)
    ({"$defs": {"base": {"$anchor": "base", "properties": {"a": {"type": "integer"}}}},
      "allOf": [{"$ref": "#base"}, {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     {"b": 2}, {"b": "s"}),
])
def test_refs_in_a_tools_parameters_point_where_they_did(tok, parameters, legal, illegal):
    parameters = {"type": "object", **parameters}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    grammar = compile_grammar(tool_call_body(tools), tok)
    for arguments, ok in ((legal, True), (illegal, False)):
        body = json.dumps({"name": "f", "arguments": arguments})
        ids = tok.encode(body, add_special_tokens=False) + [tok.eos_token_id]
        assert is_legal(grammar, ids) == ok, body
        assert jsonschema.Draft202012Validator(parameters).is_valid(arguments) == ok


def test_two_tools_anchors_of_one_name_are_each_their_own(tok):
    def tool(name, anchored):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "$defs": {"n": {"$anchor": "num", **anchored}},
            "properties": {"x": {"$ref": "#num"}}, "required": ["x"]}}}

    grammar = compile_grammar(tool_call_body([tool("f", {"type": "integer"}),
                                              tool("g", {"type": "string"})]), tok)
    for name, arguments, ok in (("f", {"x": 1}, True), ("f", {"x": "s"}, False),
                                ("g", {"x": "s"}, True), ("g", {"x": 1}, False)):
        ids = tok.encode(json.dumps({"name": name, "arguments": arguments}),
                         add_special_tokens=False) + [tok.eos_token_id]
        assert is_legal(grammar, ids) == ok, (name, arguments)


def test_two_tools_nested_resources_of_one_id_are_one_resource_or_refused(tok):
    # a subschema's own $id names one resource in the union: two tools giving it to unlike
    # subschemas had one's arguments checked against the other's ("red" for an integer)
    def tool(name, num, uri="https://e.x/point", **extra):
        return {"type": "function", "function": {"name": name, **extra, "parameters": {
            "type": "object", "required": ["p"], "properties": {"p": {
                "$id": uri, "$defs": {"n": {"$anchor": "num", **num}},
                "type": "object", "properties": {"x": {"$ref": "#num"}}, "required": ["x"]}}}}}

    # (written otherwise, the same URI: an empty fragment, the case of the scheme and host,
    # dot segments)
    for uri in ("https://e.x/point", "https://e.x/point#", "HTTPS://E.X/point",
                "https://e.x/a/../point", "https://e.x/%70oint", "https://%65.x/point"):
        with pytest.raises(GrammarError, match="tools: tools 'f' and 'g' both hold a subschema "
                                               r"with \$id '.*', and they differ"):
            tool_call_body([tool("f", {"type": "integer"}),
                            tool("g", {"enum": ["red", "blue"]}, uri)])
    with pytest.raises(GrammarError, match="they differ .as written they are one, but one "
                                           "tool is strict, the other not"):
        tool_call_body([tool("f", {"type": "object"}), tool("g", {"type": "object"},
                                                           strict=False)])
    within = {"type": "function", "function": {"name": "h", "parameters": {
        "type": "object", "properties": {"a": {"$id": "https://e.x/q", "type": "integer"},
                                         "b": {"$id": "https://e.x/q", "type": "string"}}}}}
    with pytest.raises(GrammarError, match="tool 'h' holds two subschemas with"):
        tool_call_body([within])
    relative = {"type": "function", "function": {"name": "h", "parameters": {
        "type": "object", "properties": {"a": {"$id": "q", "type": "integer"},
                                         "b": {"$id": "./q", "type": "string"}}}}}
    with pytest.raises(GrammarError, match="tool 'h' holds two subschemas with"):
        tool_call_body([relative])
    # one subschema used twice as written (strict mode closes the plain use, not the allOf's)
    address = {"$id": "https://e.x/address", "type": "object",
               "properties": {"city": {"type": "string"}}}
    twice = {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "properties": {"to": address, "billing": {"allOf": [address]}}}}}
    compile_grammar(tool_call_body([twice]), tok)
    grammar = compile_grammar(tool_call_body([tool("f", {"type": "integer"}),
                                              tool("g", {"type": "integer"})]), tok)
    for name, x, ok in (("f", 1, True), ("g", 2, True), ("f", "red", False)):
        ids = tok.encode(json.dumps({"name": name, "arguments": {"p": {"x": x}}}),
                         add_special_tokens=False) + [tok.eos_token_id]
        assert is_legal(grammar, ids) == ok, (name, x)


def test_a_tool_refused_at_compile_time_is_named_not_its_place_in_the_union(tok):
    # "tool_choice=auto: %json #/anyOf/1/properties/arguments/properties holds '</tool_call>'"
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
                 "type": "object", "properties": {"q": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "lookup", "parameters": {
                 "type": "object", "properties": {"x</tool_call>": {"type": "string"}}}}}]
    answer = {"type": "object", "properties": {"a": {"type": "string"}}}
    for source, origin in ((tool_call_body(tools), "tools"),
                           (assistant_turn(tools, "auto"), "tool_choice=auto"),
                           (assistant_turn(tools, "required"), "tool_choice=required"),
                           (assistant_turn(tools, "auto", output_schema=answer),
                            "tool_choice=auto with an output schema")):
        with pytest.raises(GrammarError) as err:
            compile_grammar(source, tok)
        assert str(err.value).startswith(f"{origin}: tool 'lookup' parameters #/properties holds "
                                         f"'</tool_call>', the text of a special token")
    # a schema of the user's in the union's shape, and an answer's beside the calls: as they are
    from agentflash.grammar import json_schema

    union = tool_call_schema(tools[1:])
    for source in (json_schema(union, origin="answer.json"),
                   assistant_turn(tools[:1], "auto", output_schema=union)):
        with pytest.raises(GrammarError, match="#/anyOf/0/properties/arguments/properties holds"):
            compile_grammar(source, tok)


def test_strict_unions_take_no_invented_arguments(tok):
    loose = [
        {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer"},
                    "opts": {"type": "object", "properties": {"x": {"type": "boolean"}}},
                    "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
                },
            },
        }
    ]
    invented = '{"name": "f", "arguments": {"a": 1, "b": 2}}'
    nested = '{"name": "f", "arguments": {"opts": {"x": true, "y": 1}}}'
    open_map = '{"name": "f", "arguments": {"extra": {"k": 1}}}'
    strict = compile_grammar(tool_call_body(loose), tok)
    lenient = compile_grammar(tool_call_body(loose, strict=False), tok)
    eos = [tok.eos_token_id]
    for body, strict_ok in ((invented, False), (nested, False), (open_map, True)):
        ids = tok.encode(body, add_special_tokens=False) + eos
        assert is_legal(strict, ids) is strict_ok, body
        assert is_legal(lenient, ids), body
    assert "additionalProperties" not in loose[0]["parameters"]  # the caller's schema is kept

    # strict mode per tool, as OpenAI's API has it: one tool's "strict": false opens its own
    # arguments, not the others'
    both = [{**loose[0], "strict": False}, {**loose[0], "name": "g", "strict": True}]
    mixed = compile_grammar(tool_call_body(both), tok)
    assert is_legal(mixed, tok.encode(invented, add_special_tokens=False) + eos)
    assert not is_legal(mixed, tok.encode(invented.replace('"f"', '"g"'),
                                          add_special_tokens=False) + eos)
    with pytest.raises(GrammarError, match=r"tools\[0\] \(f\): strict must be true or false"):
        tool_call_body([{**loose[0], "strict": "no"}])


def test_union_schema_validates_like_each_tool(tok):
    union = tool_call_schema(TOOLS)
    for name, arguments in CALLS.items():
        jsonschema.validate({"name": name, "arguments": arguments}, union)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {"a": 1000, "b": 1}}, union)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "nope", "arguments": {}}, union)


def test_random_bodies_are_valid_calls(tok, closers):
    grammar = compile_grammar(tool_call_body(TOOLS), tok)
    union = tool_call_schema(TOOLS)
    names = set()
    for seed in range(12):
        tokens = random_output(grammar.new_constraint(), closers, random.Random(seed))
        assert tokens[-1] == tok.eos_token_id
        text = tok.decode(tokens[:-1])
        calls, bad = parse_tool_calls(f"<tool_call>\n{text}\n</tool_call>")
        assert not bad and len(calls) == 1, text
        jsonschema.validate(calls[0].to_dict(), union)
        assert (
            text == f'{{"name": "{calls[0].name}", "arguments": {render_json(calls[0].arguments)}}}'
        )  # the template's own layout
        names.add(calls[0].name)
    assert len(names) >= 2


def render_json(value) -> str:
    import json

    return json.dumps(value, ensure_ascii=False)


def test_bad_tools_are_named(tok):
    cases = [
        ([{"type": "function", "function": {"parameters": {}}}], "tools[0]: the function needs"),
        ([TOOLS[0], TOOLS[0]], "tools[1]: two tools are named 'get_weather'"),
        ([{"name": "f", "parameters": {"type": "array"}}], "tools[0] (f): parameters must be"),
        (
            [
                {
                    "name": "f",
                    "parameters": {
                        "type": "object",
                        "properties": {"x": {"type": "object", "properties": {"y": {"not": {}}}}},
                    },
                }
            ],
            "tools[0] (f) parameters: #/properties/x/properties/y: Unimplemented keys",
        ),
        (
            [
                {
                    "name": "f",
                    "parameters": {
                        "type": "object",
                        "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 2}},
                    },
                }
            ],
            "tools[0] (f) parameters: #/properties/n: minimum (3)",
        ),
    ]
    for tools, what in cases:
        with pytest.raises(GrammarError) as err:
            compile_grammar(tool_call_body(tools), tok)
        assert what in str(err.value), str(err.value)


def test_a_date_is_a_day_of_the_calendar_in_schemas_tools_and_answers(tok):
    """The grammar's date format allowed February 29 of any year and year 0000, which
    jsonschema's format check (Python's dates) refuses: a date without a pattern of its own
    takes one that bounds them, in a schema, a tool's arguments and an answer beside tools."""
    from agentflash.grammar import json_schema

    day = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                            "t": {"type": "string", "format": "date-time"},
                                            "c": {"type": "string", "format": "time"}},
           "required": ["d", "t", "c"]}
    tools = [{"name": "book", "parameters": day}]
    grammars = {
        "schema": (compile_grammar(json_schema(day), tok), "{}"),
        "loose schema": (compile_grammar(json_schema(day, strict=False), tok), "{}"),
        "call": (compile_grammar(tool_call_body(tools), tok),
                 '{"name": "book", "arguments": %s}'),
        "answer": (compile_grammar(assistant_turn(tools, "none", output_schema=day), tok), "{}"),
    }
    for where, (grammar, frame) in grammars.items():
        for d, t, c, legal in [("2024-02-29", "2000-02-29T10:00:00Z", "10:00:00Z", True),
                               ("2023-02-28", "2024-12-31t23:59:59+01:00", "23:59:59.5-02:00",
                                True),
                               ("2023-02-29", "2024-01-01T10:00:00Z", "10:00:00Z", False),
                               ("1900-02-29", "2024-01-01T10:00:00Z", "10:00:00Z", False),
                               ("0000-01-01", "2024-01-01T10:00:00Z", "10:00:00Z", False),
                               ("2024-01-01", "2023-02-29T10:00:00Z", "10:00:00Z", False),
                               # RFC 3339's time has an offset; no leap second at 21:34 UTC
                               ("2024-01-01", "2024-01-01T10:00:00Z", "10:00:00", False),
                               ("2024-01-01", "2024-01-01T10:00:00Z", "21:34:60z", False)]:
            value = json.dumps({"d": d, "t": t, "c": c})
            text = frame.replace("{}", value) if frame == "{}" else frame % value
            ids = tok.encode(text, add_special_tokens=False)
            assert is_legal(grammar, ids) == legal, (where, d, t, c)
    # a pattern of its own holds beside the calendar's (alone it let 2021-02-29 through)
    leap = json_schema({"type": "string", "format": "date", "pattern": "-02-29$"})
    for text, legal in (('"2021-02-29"', False), ('"2020-02-29"', True), ('"2020-03-01"', False)):
        assert is_legal(compile_grammar(leap, tok), tok.encode(text, add_special_tokens=False)
                        ) == legal, text


def test_an_output_schema_the_grammar_cannot_take_is_named_beside_tools():
    # checked alone: inside the turn's grammar its error named no field and showed the grammar
    schema = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
    for choice in ("auto", "none"):
        with pytest.raises(GrammarError) as err:
            assistant_turn(TOOLS, choice, output_schema=schema)
        message = str(err.value)
        assert message.startswith("output schema: #/properties/a: uniqueItems is not "
                                  "supported"), message
        assert "start:" not in message and "%json" not in message


# --- whole turns under tool_choice -------------------------------------------------------------


def test_required_forces_calls_in_the_template_format(tok, closers):
    grammar = compile_grammar(assistant_turn(TOOLS, "required"), tok)
    assert is_legal(grammar, reply_ids(tok, "", [("add", CALLS["add"])]))
    assert is_legal(grammar, reply_ids(tok, "", list(CALLS.items())))
    assert not is_legal(grammar, reply_ids(tok, "Let me add.", [("add", CALLS["add"])]))
    constraint = grammar.new_constraint()
    assert not constraint.is_accepting()
    forced = tok.decode(constraint.forced_tokens())
    assert forced.startswith('<tool_call>\n{"name": "'), forced
    for seed in range(6):
        tokens = random_output(grammar.new_constraint(), closers, random.Random(seed))
        assert tokens[-1] == tok.eos_token_id
        text = tok.decode(tokens[:-1])
        calls, bad = parse_tool_calls(text)
        assert calls and not bad and text_outside_calls(text) == "", text
        for call in calls:
            jsonschema.validate(call.arguments, schema_of(call.name))


def test_named_choice_calls_only_that_tool(tok, closers):
    grammar = compile_grammar(
        assistant_turn(TOOLS, {"type": "function", "function": {"name": "search"}}), tok
    )
    assert is_legal(grammar, reply_ids(tok, "", [("search", CALLS["search"])]))
    assert not is_legal(grammar, reply_ids(tok, "", [("add", CALLS["add"])]))
    forced = tok.decode(grammar.new_constraint().forced_tokens())
    assert forced.startswith('<tool_call>\n{"name": "search", "arguments": {"query":'), forced
    for seed in range(3):
        text = tok.decode(
            random_output(grammar.new_constraint(), closers, random.Random(seed))[:-1]
        )
        calls, bad = parse_tool_calls(text)
        assert [c.name for c in calls] == ["search"] * len(calls) and calls and not bad


def test_parallel_tool_calls_false_allows_one_call(tok):
    single = compile_grammar(assistant_turn(TOOLS, "required", parallel_tool_calls=False), tok)
    one = reply_ids(tok, "", [("add", CALLS["add"])])
    two = reply_ids(tok, "", [("add", CALLS["add"]), ("add", CALLS["add"])])
    assert is_legal(single, one) and not is_legal(single, two)
    constraint = single.new_constraint()
    constraint.advance(one[:-1])
    assert constraint.forced_tokens() == [tok.eos_token_id]


def test_auto_allows_text_or_calls_and_constrains_opened_calls(tok, closers):
    grammar = compile_grammar(assistant_turn(TOOLS, "auto"), tok)
    assert is_legal(grammar, reply_ids(tok, "It is sunny.", []))
    assert is_legal(grammar, reply_ids(tok, "", [("get_weather", CALLS["get_weather"])]))
    assert is_legal(grammar, reply_ids(tok, "Checking both.\nOne moment.", list(CALLS.items())))
    # a lone newline before the calls is text too (as after a reasoning model's </think>): it
    # was refused, text before calls needing a character and then its newline
    lone = tok.encode("\n", add_special_tokens=False) + reply_ids(
        tok, "", [("get_weather", CALLS["get_weather"])])
    assert is_legal(grammar, lone)
    opened = tok.encode(
        'Sure.\n<tool_call>\n{"name": "launch", "arguments": {}}', add_special_tokens=False
    )
    assert not is_legal(grammar, opened)
    # text after the calls is not the template's format
    after = (
        reply_ids(tok, "", [("add", CALLS["add"])])[:-1]
        + tok.encode("done", add_special_tokens=False)
        + [tok.eos_token_id]
    )
    assert not is_legal(grammar, after)
    # the opening tag spelled out in ordinary tokens would be a call that escaped the grammar
    spelled = tok.encode("See <", add_special_tokens=False) + tok.encode(
        "tool_call>", add_special_tokens=False
    )
    assert grammar.new_constraint().validate_draft(spelled) < len(spelled)
    constraint = grammar.new_constraint()
    tool_call = tok.convert_tokens_to_ids("<tool_call>")
    assert tool_call in allowed_token_ids(constraint.bitmask(), len(tok))
    constraint.advance([tool_call])
    assert tok.decode(constraint.forced_tokens()).startswith('\n{"name": "')
    for seed in range(8):
        text = tok.decode(
            random_output(grammar.new_constraint(), closers, random.Random(seed))[:-1]
        )
        calls, bad = parse_tool_calls(text)
        assert not bad, text
        for call in calls:
            jsonschema.validate(call.arguments, schema_of(call.name))


def test_none_and_no_tools_forbid_calls(tok):
    for grammar in (
        compile_grammar(assistant_turn(TOOLS, "none"), tok),
        compile_grammar(assistant_turn([], "auto"), tok),
    ):
        assert is_legal(grammar, reply_ids(tok, "Just text, no tools.", []))
        constraint = grammar.new_constraint()
        allowed = allowed_token_ids(constraint.bitmask(), len(tok))
        for tag in ("<tool_call>", "</tool_call>", "<|im_start|>"):
            assert tok.convert_tokens_to_ids(tag) not in allowed
        assert tok.eos_token_id in allowed  # an empty reply is a reply


def test_tool_choice_parsing_and_errors():
    assert ToolChoice.parse(None).mode is ToolChoiceMode.AUTO
    assert ToolChoice.parse("required").mode is ToolChoiceMode.REQUIRED
    assert ToolChoice.parse("add") == ToolChoice(ToolChoiceMode.NAMED, "add")
    with pytest.raises(GrammarError, match="no tool is named 'sub'"):
        assistant_turn(TOOLS, "sub")
    with pytest.raises(GrammarError, match="no tools were given"):
        assistant_turn([], "required")
    # with an output schema too (the answer alone was the grammar: a required call never came)
    answer = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for choice in ("required", "add", {"type": "function", "function": {"name": "add"}}):
        with pytest.raises(GrammarError, match="no tools were given"):
            assistant_turn([], choice, output_schema=answer)
    assert assistant_turn([], "auto", output_schema=answer).origin == "output schema"
    with pytest.raises(GrammarError, match="tool_choice: expected"):
        assistant_turn(TOOLS, {"type": "function"})
    with pytest.raises(GrammarError, match="tool_choice: expected"):
        assistant_turn(TOOLS, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize("tag", ["<tool_call>", "<ab>", "[x]"])
def test_texts_without_a_tag_are_the_texts_that_do_not_hold_it(tag):
    from itertools import product

    from agentflash.grammar.tool_calls import texts_without

    piece, ending = texts_without(tag)
    text = re.compile(f"(?:{piece})*(?:{ending})?")
    # every text of up to 7 characters over the tag's own, another and a newline; for a long
    # tag, texts of its fragments (partial tags, restarts, the tag itself)
    alphabet = sorted(set(tag)) + ["x", "\n"]
    texts = ["".join(t) for n in range(8) for t in product(alphabet, repeat=n)
             if len(tag) <= 4 or n <= 4]
    fragments = [tag, tag[:-1], tag[1:], tag[:1], tag[:3], tag[-2:], "x", "\n", "é"]
    rng = random.Random(0)
    texts += ["".join(rng.choice(fragments) for _ in range(rng.randrange(1, 9)))
              for _ in range(20_000)]
    for t in texts:
        assert bool(text.fullmatch(t)) == (tag not in t), t


def test_free_text_masks_are_the_negated_forms(tok):
    """The turns' free text, written out (``texts_without``), masks as the regex it replaces,
    ``/(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/``, at every prefix of texts with partial tags."""
    negated = compile_grammar(
        lark("start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/\n"), tok)
    ours = compile_grammar(assistant_turn(TOOLS, "none"), tok)
    for text in ("Hi <tool_ca<tool_cal <to>ol_call> <<tool_call x", "<", "a\n<tool_call\n\n"):
        ids = tok.encode(text, add_special_tokens=False)
        a, b = negated.new_constraint(), ours.new_constraint()
        for i in range(len(ids) + 1):
            assert allowed_token_ids(a.bitmask(), len(tok)) == allowed_token_ids(
                b.bitmask(), len(tok)), (text, i)
            if i < len(ids):
                legal = a.validate_draft(ids[i:i + 1]) == 1
                assert legal == (b.validate_draft(ids[i:i + 1]) == 1), (text, i)
                if not legal:
                    break
                a.advance(ids[i:i + 1])
                b.advance(ids[i:i + 1])
