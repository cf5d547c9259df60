"""Grammar layer: outputs valid under generated schemas, draft masks, rollback, forced tokens,
errors, the compile cache. Outputs come from a random "model" (random legal tokens, biased to
close structures) on the demo tokenizer, so no trained model is needed."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import hypothesis
import jsonschema
import pytest
import torch
from hypothesis import strategies as st
from transformers import AutoTokenizer

from agentflash.grammar import (
    Backend,
    GrammarError,
    GrammarFailed,
    GrammarViolation,
    JsonStyle,
    allocate_bitmask,
    allowed_token_ids,
    apply_bitmask_,
    assistant_turn,
    cache_info,
    close_objects,
    compile_grammar,
    constrained_draft,
    ebnf,
    json_schema,
    json_schema_file,
    lark,
    masks_along_drafts,
    pydantic_model,
    regex,
    tool_call_body,
    unpack_bitmask,
)
from agentflash.grammar.bench import closing_tokens, random_output
from agentflash.grammar.checks import may_write_special_bytes
from agentflash.grammar.constraint import first_allowed_token

BACKENDS = [Backend.LLGUIDANCE, Backend.OUTLINES]
KINDS = [
    "object",
    "array",
    "string",
    "integer",
    "number",
    "boolean",
    "null",
    "enum",
    "const",
    "anyOf",
]
WORDS = ["id", "name", "city", "tags", "count", "price", "ok", "note", "items", "meta", "kind"]


@pytest.fixture(scope="module")
def tok(demo_tokenizer_dir):
    return AutoTokenizer.from_pretrained(demo_tokenizer_dir)


@pytest.fixture(scope="module")
def closers(tok):
    return closing_tokens(tok, len(tok) + 40)


def random_schema(
    rng: random.Random, depth: int = 0, kind: str | None = None, number_bounds: bool = True
) -> dict:
    """A satisfiable schema over every JSON type, with nesting, enums, bounds, required sets
    (``number_bounds=False`` leaves out minimum/maximum, which outlines-core ignores)."""
    if kind is None:
        kinds = KINDS if depth < 3 else KINDS[2:-1]
        kind = rng.choice(kinds)
    if kind == "string":
        schema: dict = {"type": "string"}
        roll = rng.random()
        if roll < 0.3:
            low = rng.randint(0, 3)
            schema.update(minLength=low, maxLength=low + rng.randint(0, 6))
        elif roll < 0.45:
            schema["pattern"] = "^[a-z]{1,6}$"
        elif roll < 0.55:
            schema["format"] = "date"
        return schema
    if kind in ("integer", "number"):
        schema = {"type": kind}
        if number_bounds and rng.random() < 0.6:
            low = rng.randint(-50, 50)
            schema.update(minimum=low, maximum=low + rng.randint(0, 200))
        return schema
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "a b", 3, -7, None, True], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["fixed", 42, False, None])}
    if kind == "array":
        schema = {"type": "array", "items": random_schema(rng, depth + 1, None, number_bounds)}
        low = rng.randint(0, 2)
        schema["minItems"] = low
        if rng.random() < 0.7:
            schema["maxItems"] = low + rng.randint(0, 3)
        return schema
    if kind == "object":
        names = rng.sample(WORDS, rng.randint(1, 4))
        properties = {n: random_schema(rng, depth + 1, None, number_bounds) for n in names}
        schema = {
            "type": "object",
            "properties": properties,
            "required": [n for n in names if rng.random() < 0.6],
        }
        if rng.random() < 0.8:
            schema["additionalProperties"] = False
        return schema
    assert kind == "anyOf"
    first, second = rng.sample(["string", "integer", "null", "boolean", "array"], 2)
    return {
        "anyOf": [
            random_schema(rng, depth + 1, first, number_bounds),
            random_schema(rng, depth + 1, second, number_bounds),
        ]
    }


def dumps_layout_ok(text: str) -> bool:
    """json.dumps layout: outside strings, ", " and ": " and no other whitespace."""
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            escaped = not escaped and ch == "\\"
            in_string = escaped or ch != '"'
            continue
        if ch == '"':
            in_string = True
        elif ch in ",:" and text[i + 1 : i + 2] != " ":
            return False
        elif ch.isspace() and text[i - 1 : i] not in (",", ":"):
            return False
    return True


def decoded(tok, tokens: list[int]) -> str:
    assert tokens and tokens[-1] == tok.eos_token_id, "the output did not finish"
    return tok.decode(tokens[:-1])


# --- every output is valid ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_random_outputs_validate_against_generated_schemas(tok, closers, seed):
    rng = random.Random(seed)
    schema = random_schema(rng, kind=KINDS[seed % len(KINDS)])
    grammar = compile_grammar(json_schema(schema), tok, vocab_size=len(tok) + 40)
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    for _ in range(2):
        text = decoded(tok, random_output(grammar.new_constraint(), closers, rng))
        validator.validate(json.loads(text))
        assert dumps_layout_ok(text), text


@pytest.mark.parametrize("seed", range(12))
def test_outlines_outputs_validate_against_generated_schemas(tok, closers, seed):
    pytest.importorskip("outlines_core")
    rng = random.Random(100 + seed)
    schema = random_schema(rng, kind=KINDS[seed % len(KINDS)], number_bounds=False)
    if schema.get("type") == "number":  # outlines-core ends it after its whole part: refused
        with pytest.raises(GrammarError, match="outlines-core ends the output after"):
            compile_grammar(json_schema(schema), tok, backend=Backend.OUTLINES)
        return
    grammar = compile_grammar(
        json_schema(schema), tok, backend=Backend.OUTLINES, vocab_size=len(tok) + 40
    )
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    text = decoded(tok, random_output(grammar.new_constraint(), closers, rng))
    validator.validate(json.loads(text))


@pytest.mark.parametrize("style", list(JsonStyle))
def test_json_style_sets_the_layout(tok, closers, style):
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
            "b": {"type": "boolean"},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    grammar = compile_grammar(json_schema(schema, json_style=style), tok)
    compact = tok.encode('{"a":[1,2],"b":true}', add_special_tokens=False) + [tok.eos_token_id]
    spaced = tok.encode('{"a": [1, 2], "b": true}', add_special_tokens=False) + [tok.eos_token_id]
    loose = tok.encode('{ "a" : [1 ,2], "b":true }', add_special_tokens=False) + [tok.eos_token_id]
    legal = {
        name: grammar.new_constraint().validate_draft(ids) == len(ids)
        for name, ids in (("compact", compact), ("spaced", spaced), ("loose", loose))
    }
    expected = {
        JsonStyle.COMPACT: {"compact"},
        JsonStyle.DUMPS: {"spaced"},
        JsonStyle.FLEXIBLE: {"compact", "spaced", "loose"},
    }[style]
    assert {name for name, ok in legal.items() if ok} == expected


def test_pydantic_model_outputs_parse_as_the_model(tok, closers):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Address(BaseModel):
        street: str = Field(max_length=12)
        zip: int = Field(ge=10000, le=99999)

    class Person(BaseModel):
        name: str = Field(max_length=10)
        role: Literal["admin", "user"]
        addresses: list[Address] = Field(max_length=2)

    grammar = compile_grammar(pydantic_model(Person), tok)
    for seed in range(3):
        text = decoded(tok, random_output(grammar.new_constraint(), closers, random.Random(seed)))
        Person.model_validate_json(text)

    # the schema of what pydantic reads, as tools' (a naive datetime has no offset)
    import decimal
    from typing import Annotated

    from pydantic import NaiveDatetime

    class Entry(BaseModel):
        when: NaiveDatetime
        price: Annotated[decimal.Decimal, Field(max_digits=5, decimal_places=2)]

    grammar = compile_grammar(pydantic_model(Entry), tok)
    for text, valid in (('{"when": "2024-01-01T10:00:00", "price": "123.45"}', True),
                        ('{"when": "2024-01-01T10:00:00Z", "price": "123.45"}', False),
                        ('{"when": "2024-01-01T10:00:00", "price": 123456.789}', False)):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert (grammar.new_constraint().validate_draft(ids) == len(ids)) == valid, text
        assert valid == (not _refused(Entry, text))


def _refused(model, text: str) -> bool:
    from pydantic import ValidationError

    try:
        model.model_validate_json(text)
    except ValidationError:
        return True
    return False


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_outputs_match(tok, closers, backend):
    import re

    pytest.importorskip("outlines_core")
    # (outlines-core drops a match's continuations: "( items)?" after the digits is refused)
    pattern = r"(yes|no), [0-9]{2,4} (items|boxes)"
    grammar = compile_grammar(regex(pattern), tok, backend=backend)
    for seed in range(4):
        text = decoded(tok, random_output(grammar.new_constraint(), closers, random.Random(seed)))
        assert re.fullmatch(pattern, text), text


def test_ebnf_unicode_escapes_with_leading_zeros_are_read(tok):
    """llguidance's converter stripped their zeros (\\u00e9 became \\ue9, which Lark refuses)."""
    for text, good, bad in ((r'root ::= "caf\u00e9"', "café", "cafe"),
                            (r'root ::= "\U0001F600!"', "\U0001f600!", "!"),
                            (r"root ::= [\u00e0-\u00ff]+", "àÿ", "a"),
                            (r'root ::= "\\u00e9"', "\\u00e9", "é")):  # an escaped backslash
        grammar = compile_grammar(ebnf(text), tok)
        for output, legal in ((good, True), (bad, False)):
            ids = tok.encode(output, add_special_tokens=False) + [tok.eos_token_id]
            assert (grammar.new_constraint().validate_draft(ids) == len(ids)) == legal, (
                text, output)
    with pytest.raises(GrammarError, match="a rule named 'start' cannot be converted"):
        ebnf('root ::= start "!"\nstart ::= "hi"')  # it was read as Lark


def test_lark_and_ebnf_outputs_match(tok, closers):
    nested = 'start: "[" item ("," item)* "]"\nitem: "a" | "bb" | start'
    grammar = compile_grammar(lark(nested), tok)
    gbnf = compile_grammar(ebnf('root ::= "say " ("yes" | "no")'), tok)
    for seed in range(4):
        text = decoded(tok, random_output(grammar.new_constraint(), closers, random.Random(seed)))
        assert text.startswith("[") and text.endswith("]") and set(text) <= set("[],abb"), text
        said = decoded(tok, random_output(gbnf.new_constraint(), closers, random.Random(seed)))
        assert said in ("say yes", "say no")


# --- masks along a draft, rollback, the end token ----------------------------------------------


def walk(tok, closers, grammar, seed: int) -> list[int]:
    return random_output(grammar.new_constraint(), closers, random.Random(seed))


def snapshot(constraint) -> tuple:
    return (
        constraint.num_tokens,
        constraint.is_accepting(),
        constraint.is_finished(),
        constraint.bitmask().tolist(),
        constraint.forced_tokens(),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_masks_along_draft_equal_token_by_token_masks(tok, closers, backend, seed):
    pytest.importorskip("outlines_core")
    schema = random_schema(
        random.Random(seed), kind="object", number_bounds=backend is Backend.LLGUIDANCE
    )
    grammar = compile_grammar(json_schema(schema), tok, backend=backend, vocab_size=len(tok) + 40)
    output = walk(tok, closers, grammar, seed)
    constraint = grammar.new_constraint()
    for pos in range(0, len(output), 3):
        draft = output[pos : pos + 16]
        before = snapshot(constraint)
        masks = constraint.masks_along_draft(draft)
        assert snapshot(constraint) == before
        for i, token in enumerate(draft):
            assert torch.equal(masks[i], constraint.bitmask()), f"row {i} at {pos}"
            constraint.advance([token])
        assert torch.equal(masks[len(draft)], constraint.bitmask())
        constraint.rollback(len(draft))
        assert snapshot(constraint) == before
        constraint.advance(output[pos : pos + 3])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(3))
def test_greedy_verify_equals_greedy_acceptance_on_logits_masked_everywhere(
    tok, closers, backend, seed
):
    from agentflash.dflash.speculate import greedy_accept
    from agentflash.grammar import greedy_verify

    pytest.importorskip("outlines_core")
    rng = random.Random(seed)
    schema = random_schema(rng, kind="object", number_bounds=backend is Backend.LLGUIDANCE)
    grammar = compile_grammar(json_schema(schema), tok, backend=backend, vocab_size=len(tok) + 40)
    output = walk(tok, closers, grammar, seed)
    constraint = grammar.new_constraint()
    gen = torch.Generator().manual_seed(seed)
    outcomes = set()
    for pos in range(0, len(output), 2):
        draft = output[pos : pos + rng.randint(0, 8)]
        logits = torch.randn(len(draft) + 1, len(tok) + 40, generator=gen)
        masks = constraint.masks_along_draft(draft)
        for j, token in enumerate(draft):
            roll = rng.random()
            if roll < 0.6:  # the target agrees with the draft
                logits[j, token] = 10.0
            elif roll < 0.8:  # it prefers another token (mostly illegal: the draft stands)
                logits[j, token] = 9.0
                logits[j, rng.randrange(logits.shape[1])] = 11.0
            else:  # it prefers another legal token, where there is one: the draft is cut
                legal = [t for t in allowed_token_ids(masks[j], logits.shape[1]) if t != token]
                logits[j, rng.choice(legal or [token])] = 11.0
        masked = apply_bitmask_(logits.clone(), masks)
        before = snapshot(constraint)
        expected = greedy_accept(torch.tensor(draft, dtype=torch.long), masked)
        assert greedy_verify(constraint, draft, logits) == expected
        assert greedy_verify(constraint, draft, logits, masks) == expected  # the walk's masks
        assert snapshot(constraint) == before
        # commit: the same answer, and the constraint as if it had advanced over it
        for given in (None, masks):
            live, replay = grammar.new_constraint(), grammar.new_constraint()
            live.advance(output[:pos])
            assert greedy_verify(live, draft, logits, given, commit=True) == expected
            replay.advance([*output[:pos], *draft[: expected[0]], expected[1]][: len(output)])
            assert snapshot(live) == snapshot(replay)
        outcomes.add(expected[0] == len(draft))
        constraint.advance(output[pos : pos + 2])
    assert outcomes == {True, False}  # whole drafts and cut ones both checked


def test_a_mask_is_made_only_for_a_token_the_grammar_refuses(tok, closers):
    grammar = compile_grammar(json_schema(random_schema(random.Random(7), kind="object")), tok)
    output = walk(tok, closers, grammar, 7)
    constraint = grammar.new_constraint()
    rng = random.Random(0)
    for cut in range(0, len(output), 2):
        before = snapshot(constraint)
        mask = constraint.mask_after(output[:cut])
        for token in [output[cut]] + rng.sample(range(len(tok)), 5):
            got = constraint.mask_unless_allowed(output[:cut], token)
            allowed = token in allowed_token_ids(mask, len(tok) + 40)
            assert (got is None) == allowed
            assert got is None or torch.equal(got, mask)
        assert snapshot(constraint) == before


@pytest.mark.parametrize("backend", BACKENDS)
def test_allows_is_a_one_token_validate(tok, closers, backend):
    pytest.importorskip("outlines_core")
    schema = random_schema(random.Random(3), kind="object", number_bounds=False)
    grammar = compile_grammar(json_schema(schema), tok, backend=backend, vocab_size=len(tok) + 40)
    constraint = grammar.new_constraint()
    rng = random.Random(1)
    checked = set()
    for token in walk(tok, closers, grammar, 3) + [None]:
        candidates = [grammar.eos_token_id, -1, len(tok) + 39] + rng.sample(range(len(tok)), 8)
        for t in candidates + ([token] if token is not None else []):
            assert constraint.allows(t) == (constraint.validate_draft([t]) == 1)
            checked.add(constraint.allows(t))
        if token is not None:
            constraint.advance([token])
    assert checked == {True, False}


def test_allows_is_the_mask_bit_of_every_token_where_bytes_are_forced(tok, closers):
    # llguidance's allows reads forced states without a mask (its first forced token alone, or
    # a one-token validate where no whole token takes the forced bytes yet): over canonical
    # states and states one non-canonical token into forced text ('"' where '",' is canonical),
    # every token's answer is the mask's bit, where validate takes more than the mask
    from agentflash.grammar.tool_calls import assistant_turn

    rng = random.Random(0)
    seen = set()
    for seed in range(3):
        schema = random_schema(random.Random(seed), kind="object")
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        for source in (json_schema(schema), assistant_turn(tools, "required")):
            grammar = compile_grammar(source, tok, vocab_size=len(tok) + 40)
            constraint = grammar.new_constraint()
            for token in walk(tok, closers, grammar, seed)[:-1]:
                states = [constraint]
                if constraint._m.compute_ff_bytes():
                    mask = allowed_token_ids(constraint.bitmask(), grammar.vocab_size)
                    odd = [t for t in rng.sample(range(len(tok)), 400) if t not in mask
                           and constraint.validate_draft([t]) == 1]
                    if odd:
                        states.append(_advanced(constraint, rng.choice(odd)))
                for state in states:
                    if not state._m.compute_ff_bytes():
                        continue
                    fresh = state._copy()
                    fresh._ff = None  # asked afresh, not from the mask's walk
                    answers = [fresh.allows(t) for t in range(grammar.vocab_size)]
                    mask = unpack_bitmask(state.bitmask(), grammar.vocab_size).tolist()
                    assert answers == mask
                    forced = bool(state._m.compute_ff_tokens())
                    seen.add(("forced tokens" if forced else "forced bytes only", state is not
                              constraint))
                    wider = any(state.validate_draft([t]) == 1 and not mask[t]
                                for t in range(len(tok)))
                    seen.add(("validate takes more", wider))
                constraint.advance([token])
    assert {("forced tokens", False), ("forced tokens", True), ("forced bytes only", False),
            ("validate takes more", True)} <= seen, seen


def test_allows_is_the_mask_bit_where_a_grammar_turns_forcing_off(tok):
    # a Lark grammar's %llguidance options are JSON: no_forcing spelled with an escape turns
    # forcing off too, and the mask then takes every prefix of the forced bytes ('h', 'he')
    body = 'start: "hello world" NAME\nNAME: /[a-z]{1,5}/'
    for options in ('{"no_forcing": true}', '{"no\\u005fforcing": true}'):
        grammar = compile_grammar(lark(f"%llguidance {options}\n{body}"), tok)
        constraint = grammar.new_constraint()
        mask = unpack_bitmask(constraint.bitmask(), grammar.vocab_size).tolist()
        assert sum(mask) > 1, options
        assert [constraint.allows(t) for t in range(grammar.vocab_size)] == mask, options
        h = tok.encode("h", add_special_tokens=False)
        assert constraint.mask_prefix(h) == 1, options
    # a \u elsewhere (a Windows path in an enum, a regex's class) leaves the mask-free answer on
    schema = {"type": "object", "properties": {"folder": {"enum": ["C:\\users\\me", "x"]},
              "mode": {"pattern": "^[\\u0061-\\u007a]+$", "type": "string"}}}
    grammar = compile_grammar(json_schema(schema), tok)
    assert "\\u" in grammar._text and grammar.masks_forced_canonically


def _advanced(constraint, token: int):
    """A copy of ``constraint`` after ``token``."""
    copy = constraint._copy()
    copy.advance([token])
    return copy


def test_the_legal_argmax_is_the_first_best_allowed_token():
    from agentflash.grammar.constraint import _masked_argmax

    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        row = torch.randint(-(2**31), 2**31 - 1, (128,), dtype=torch.int32, generator=gen)
        if trial % 3 == 0:  # a single legal token
            row = torch.zeros(128, dtype=torch.int32)
            row[trial] = 1 << (trial % 31)
        logits = torch.randn(4096, generator=gen)
        if trial % 4 == 0:
            logits = logits.round()  # ties: the lowest id of the best wins, as argmax does
        if trial % 5 == 0:
            logits[:] = float("-inf")  # nothing to choose by score: the first legal token
        legal = allowed_token_ids(row, 4096)
        best = max(logits[legal].tolist())
        expected = next(t for t in legal if logits[t] == best)
        assert _masked_argmax(row, logits, 4096) == expected
        assert _masked_argmax(row, logits.double(), 4096) == expected
        assert _masked_argmax(row, logits.bfloat16(), 4096) in legal  # the tensor path


def test_batched_masks_equal_single_masks(tok, closers):
    grammars = [
        compile_grammar(json_schema(random_schema(random.Random(s), kind="object")), tok)
        for s in range(3)
    ]
    outputs = [walk(tok, closers, g, s) for s, g in enumerate(grammars)]
    constraints = [g.new_constraint() for g in grammars]
    for c, out in zip(constraints, outputs, strict=True):
        c.advance(out[:2])
    drafts = [out[2:18] for out in outputs]
    batched = masks_along_drafts(constraints, drafts)
    for c, draft, masks in zip(constraints, drafts, batched, strict=True):
        assert torch.equal(masks, c._masks_one_by_one(draft))
        assert c.num_tokens == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_restores_the_exact_state(tok, closers, backend):
    pytest.importorskip("outlines_core")
    schema = random_schema(
        random.Random(7), kind="object", number_bounds=backend is Backend.LLGUIDANCE
    )
    grammar = compile_grammar(json_schema(schema), tok, backend=backend)
    output = walk(tok, closers, grammar, 7)
    constraint = grammar.new_constraint()
    states = [snapshot(constraint)]
    for token in output:
        constraint.advance([token])
        states.append(snapshot(constraint))
    assert constraint.is_finished()
    rng = random.Random(0)
    while constraint.num_tokens:
        back = rng.randint(1, min(5, constraint.num_tokens))
        constraint.rollback(back)
        assert snapshot(constraint) == states[constraint.num_tokens]
    constraint.advance(output)
    assert snapshot(constraint) == states[-1]
    constraint.reset()
    assert snapshot(constraint) == states[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rollback_past_a_thousand_tokens(tok, backend):
    # outlines-core's Guide keeps 1,024 states: reset after a longer output raised
    pytest.importorskip("outlines_core")
    grammar = compile_grammar(regex("(ab )+x"), tok, backend=backend)
    ids = tok.encode("ab " * 1500 + "x", add_special_tokens=False)
    assert len(ids) > 1100
    constraint = grammar.new_constraint()
    constraint.advance(ids)
    states = {n: None for n in (0, len(ids) - 1100, len(ids))}
    for n in states:
        probe = grammar.new_constraint()
        probe.advance(ids[:n])
        states[n] = snapshot(probe)
    assert snapshot(constraint) == states[len(ids)]
    constraint.rollback(1100)
    assert constraint.num_tokens == len(ids) - 1100
    assert snapshot(constraint) == states[len(ids) - 1100]
    constraint.advance(ids[-1100:])
    assert snapshot(constraint) == states[len(ids)]
    constraint.reset()
    assert constraint.num_tokens == 0 and snapshot(constraint) == states[0]
    constraint.advance(ids)  # (a Guide that goes on as the first)
    assert snapshot(constraint) == states[len(ids)]
    # rollbacks in a row: the second past what the Guide keeps after the first (it compared
    # with 1,024, not with the states left: "only 424 states stored")
    for back in (600, 600, len(ids) - 1200):
        constraint.rollback(back)
        probe = grammar.new_constraint()
        probe.advance(ids[: constraint.num_tokens])
        assert snapshot(constraint) == snapshot(probe)
    assert constraint.num_tokens == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_draft_cuts_at_the_first_illegal_token(tok, closers, backend):
    pytest.importorskip("outlines_core")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    grammar = compile_grammar(json_schema(schema), tok, backend=backend, vocab_size=len(tok) + 40)
    good = tok.encode('{"n": 12}', add_special_tokens=False)
    eos = tok.eos_token_id
    constraint = grammar.new_constraint()
    assert constraint.validate_draft(good + [eos]) == len(good) + 1
    assert constraint.validate_draft(good + [eos, eos]) == len(good) + 1  # nothing after the end
    assert constraint.validate_draft(good[:-1] + [eos]) == len(good) - 1  # not complete yet
    bad = tok.encode('{"n": "x"}', add_special_tokens=False)
    first_bad = next(i for i, (a, b) in enumerate(zip(good, bad, strict=False)) if a != b)
    assert constraint.validate_draft(bad) == first_bad
    assert constraint.validate_draft([len(tok) + 5]) == 0  # a padding row of the model vocab
    assert constraint.validate_draft([10**9]) == 0
    before = snapshot(constraint)
    with pytest.raises(GrammarViolation):
        constraint.advance(bad)
    assert snapshot(constraint) == before
    with pytest.raises(GrammarViolation):
        constraint.masks_along_draft(bad)
    with pytest.raises(GrammarViolation):  # something after the end
        constraint.advance(good + [eos, good[0]])
    assert snapshot(constraint) == before
    constraint.advance(good + [eos, eos])  # the end again: all the mask allows, nothing more
    assert constraint.is_finished() and constraint.num_tokens == len(good) + 1
    constraint.advance([eos])
    assert constraint.num_tokens == len(good) + 1
    with pytest.raises(GrammarViolation):
        constraint.advance([eos, good[0]])


def test_mask_agrees_with_validate(tok, closers):
    grammar = compile_grammar(json_schema(random_schema(random.Random(3), kind="object")), tok)
    output = walk(tok, closers, grammar, 3)
    constraint = grammar.new_constraint()
    rng = random.Random(1)
    for token in output[:-1]:
        allowed = set(allowed_token_ids(constraint.bitmask(), constraint.vocab_size))
        for candidate in rng.sample(range(len(tok)), 60) + list(allowed)[:20]:
            assert constraint.validate_draft([candidate]) == (candidate in allowed), candidate
        constraint.advance([token])


def test_end_token_rules(tok):
    eos = tok.eos_token_id
    grammar = compile_grammar(regex("ab?"), tok, vocab_size=len(tok) + 40)
    constraint = grammar.new_constraint()
    assert not constraint.is_accepting() and eos not in allowed_token_ids(
        constraint.bitmask(), len(tok)
    )
    constraint.advance(tok.encode("a", add_special_tokens=False))
    assert constraint.is_accepting()
    allowed = allowed_token_ids(constraint.bitmask(), len(tok) + 40)
    assert eos in allowed and max(allowed) < len(tok)
    constraint.advance([eos])
    assert constraint.is_finished() and not constraint.is_accepting()
    assert allowed_token_ids(constraint.bitmask(), len(tok) + 40) == [eos]
    assert constraint.forced_tokens() == [] and constraint.validate_draft([eos]) == 0
    constraint.rollback(1)
    assert constraint.is_accepting() and not constraint.is_finished()


# --- forced tokens and constrained drafting ----------------------------------------------------


def test_forced_tokens_fill_keys_and_literals(tok):
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "n": {"type": "integer"}},
        "required": ["unit", "n"],
        "additionalProperties": False,
    }
    constraint = compile_grammar(json_schema(schema), tok).new_constraint()
    forced = constraint.forced_tokens()
    assert '{"unit": "'.startswith(tok.decode(forced)) and len(tok.decode(forced)) >= 8
    constraint.advance(forced)
    typed = '{"unit": "fa'[len(tok.decode(forced)) :]
    constraint.advance(tok.encode(typed, add_special_tokens=False))
    rest = tok.decode(constraint.forced_tokens())
    assert len(rest) >= len("hrenheit") and 'hrenheit", "n":'.startswith(rest), rest
    constraint.advance(tok.encode('hrenheit", "n": 5}', add_special_tokens=False))
    assert constraint.forced_tokens() == [tok.eos_token_id]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_continuation_starts_with_the_forced_tokens(tok, closers, backend):
    pytest.importorskip("outlines_core")
    schema = random_schema(
        random.Random(11), kind="object", number_bounds=backend is Backend.LLGUIDANCE
    )
    grammar = compile_grammar(json_schema(schema), tok, backend=backend)
    output = walk(tok, closers, grammar, 11)
    constraint = grammar.new_constraint()
    num_forced = 0
    for pos, token in enumerate(output):
        forced = constraint.forced_tokens()
        num_forced += bool(forced)
        assert constraint.validate_draft(forced) == len(forced)
        if forced and forced[-1] == tok.eos_token_id:  # only the end may follow the run
            after = constraint.mask_after(forced[:-1])
            assert allowed_token_ids(after, len(tok)) == [tok.eos_token_id]
        for seed in range(2 if pos % 3 == 0 else 0):  # other continuations agree with them too
            probe = grammar.new_constraint()
            probe.advance(output[:pos])
            rest = random_output(probe, closers, random.Random(seed), max_tokens=120)
            body = [t for t in forced if t != tok.eos_token_id]
            assert tok.decode(rest).startswith(tok.decode(body))
        constraint.advance([token])
    assert num_forced > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_constrained_draft_is_legal_and_leaves_the_state(tok, closers, backend):
    pytest.importorskip("outlines_core")
    schema = random_schema(
        random.Random(5), kind="object", number_bounds=backend is Backend.LLGUIDANCE
    )
    grammar = compile_grammar(json_schema(schema), tok, backend=backend, vocab_size=len(tok) + 40)
    output = walk(tok, closers, grammar, 5)
    constraint = grammar.new_constraint()
    generator = torch.Generator().manual_seed(0)
    for pos in range(0, len(output) - 1, 4):
        constraint.reset()
        constraint.advance(output[:pos])
        logits = torch.randn(16, len(tok) + 40, generator=generator)
        logits[:, len(tok) :] = 100.0  # padding rows would win an unmasked argmax
        before = snapshot(constraint)
        draft = constrained_draft(constraint, logits)
        assert snapshot(constraint) == before
        assert constraint.validate_draft(draft.tokens) == len(draft.tokens) > 0
        # the masks made on the way are the verify masks along the draft
        assert torch.equal(draft.masks, constraint.masks_along_draft(draft.tokens))
        # a walk without masks (greedy verification) drafts the same tokens, also where the
        # draft's cap cuts a forced run (it commits forced runs whole, the end token checked
        # after them)
        for cap in (None, 1, 2, 3, 5, 8, 24):
            masked = constrained_draft(constraint, logits, max_tokens=cap)
            bare = constrained_draft(constraint, logits, with_masks=False, max_tokens=cap)
            assert (bare.tokens, bare.num_forced, bare.masks) == (
                masked.tokens, masked.num_forced, None)
            assert snapshot(constraint) == before
        plain = constrained_draft(constraint, logits, use_forced=False)
        assert plain.num_forced == 0
        assert torch.equal(plain.masks, constraint.masks_along_draft(plain.tokens))
        # without forcing, each slot is the argmax of its masked logits
        for slot, token in enumerate(plain.tokens):
            masked = apply_bitmask_(logits[slot].clone(), constraint.bitmask())
            assert token == int(masked.argmax())
            constraint.advance([token])
        constraint.rollback(len(plain.tokens))


def test_no_forced_bytes_means_no_forced_tokens(tok, closers):
    # LLGuidanceConstraint._forced asks for forced tokens only after forced bytes (far cheaper)
    seen = set()
    for seed in range(6):
        grammar = compile_grammar(json_schema(random_schema(random.Random(seed))), tok)
        constraint = grammar.new_constraint()
        for token in walk(tok, closers, grammar, seed):
            matcher = constraint._m
            seen.add((bool(matcher.compute_ff_bytes()), bool(matcher.compute_ff_tokens())))
            constraint.advance([token])
    assert (False, True) not in seen
    assert {(False, False), (True, True)} <= seen


CITY_DAYS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


def test_constrained_draft_follows_the_drafter_where_it_is_legal(tok):
    text = '{"city": "Paris", "days": 3}'
    constraint = compile_grammar(json_schema(CITY_DAYS), tok).new_constraint()
    target = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    logits = torch.zeros(len(target) + 3, len(tok))
    for slot, token in enumerate(target):
        logits[slot, token] = 5.0
    draft = constrained_draft(constraint, logits)
    assert draft.tokens == target and draft.num_forced >= 3


def test_constrained_draft_stops_at_its_max_fixes_th_fixed_slot(tok):
    constraint = compile_grammar(json_schema(CITY_DAYS), tok).new_constraint()
    logits = torch.randn(12, len(tok), generator=torch.Generator().manual_seed(1))
    full = constrained_draft(constraint, logits, use_forced=False)
    # the slots whose drafted token (the slot's argmax) was illegal: the walk fixed them
    fixed = [i for i, t in enumerate(full.tokens) if t != int(logits[i].argmax())]
    assert len(fixed) >= 3 and fixed[2] < len(full.tokens) - 1
    for max_fixes in (1, 2, 3):
        cut = full.tokens[: fixed[max_fixes - 1] + 1]  # the fixed token the draft's last
        for with_masks in (True, False):
            draft = constrained_draft(constraint, logits, use_forced=False,
                                      with_masks=with_masks, max_fixes=max_fixes)
            assert draft.tokens == cut
            if with_masks:
                assert torch.equal(draft.masks, constraint.masks_along_draft(cut))
    assert constrained_draft(constraint, logits, use_forced=False, max_fixes=None).tokens == (
        full.tokens)


def test_constrained_draft_counts_drafted_tokens_and_runs_on_while_forced(tok):
    schema = {
        "type": "object",
        "properties": {
            "unit": {"enum": ["celsius_degrees_scale", "fahrenheit_degrees_scale"]},
            "days": {"type": "integer"},
        },
        "required": ["unit", "days"],
        "additionalProperties": False,
    }
    constraint = compile_grammar(json_schema(schema), tok).new_constraint()
    slots = 8
    logits = torch.randn(slots, len(tok), generator=torch.Generator().manual_seed(3))
    draft = constrained_draft(constraint, logits, max_drafted=1, max_tokens=60)
    assert torch.equal(draft.masks, constraint.masks_along_draft(draft.tokens))
    # replay: which tokens the grammar forced, which the drafter chose
    chosen = []
    for i, token in enumerate(draft.tokens):
        forced = constraint.forced_tokens()
        if not forced or forced[0] != token:
            chosen.append(i)
        constraint.advance([token])
    constraint.rollback(len(draft.tokens))
    assert len(chosen) == 1 == len(draft.tokens) - draft.num_forced  # one pick: the enum value
    assert chosen[0] < slots < len(draft.tokens)  # the forced rest of the literal runs past them
    assert tok.decode(draft.tokens).endswith('_degrees_scale", "days":')
    # the slots' cap still holds without max_tokens, and the drafted cap with it
    assert len(constrained_draft(constraint, logits).tokens) <= slots
    capped = constrained_draft(constraint, logits, max_drafted=0, max_tokens=60)
    assert capped.num_forced == len(capped.tokens) and tok.decode(capped.tokens).endswith('"')


# --- bitmask helpers ---------------------------------------------------------------------------


def test_apply_bitmask_masks_exactly_the_disallowed_tokens():
    vocab = 100
    allowed = [0, 5, 31, 32, 63, 64, 99]
    bitmask = allocate_bitmask(2, vocab)
    for token in allowed:
        value = int(bitmask[1, token // 32]) | (1 << token % 32)
        bitmask[1, token // 32] = value - (1 << 32) if value >= 1 << 31 else value
    assert allowed_token_ids(bitmask[1], vocab) == allowed
    assert unpack_bitmask(bitmask, vocab).shape == (2, vocab)
    logits = torch.randn(2, vocab)
    masked = apply_bitmask_(logits.clone(), bitmask)
    assert torch.isinf(masked[0]).all()
    assert torch.equal(masked[1, allowed], logits[1, allowed])
    assert torch.isinf(masked[1]).sum() == vocab - len(allowed)


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "where", "what"),
    [
        (
            {
                "type": "object",
                "properties": {
                    "a": {"type": "object", "properties": {"b": {"not": {"type": "string"}}}}
                },
            },
            "#/properties/a/properties/b",
            "not",
        ),
        (
            {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
            "#/properties/tags",
            "uniqueItems",
        ),
        (
            {"type": "object", "properties": {"x": {"type": "strin"}}},
            "#/properties/x/type",
            "strin",
        ),
        (
            {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}},
            },
            "#/properties/x",
            "minimum",
        ),
        (
            {"type": "object", "properties": {"x": {"type": "string", "format": "colour"}}},
            "#/properties/x",
            "colour",
        ),
        (
            {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}},
            "#/properties/x",
            "missing",
        ),
        (
            {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)b"}}},
            "#/properties/x",
            "look-around",
        ),
        (
            {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
            "#/properties/next",
            "no finite JSON value",
        ),
        (
            {
                "$defs": {
                    "node": {
                        "type": "object",
                        "properties": {
                            "kids": {
                                "type": "array",
                                "items": {"$ref": "#/$defs/node"},
                                "minItems": 1,
                            }
                        },
                        "required": ["kids"],
                    }
                },
                "$ref": "#/$defs/node",
            },
            "#/$defs/node/properties/kids/items",
            "no finite JSON value",
        ),
        (  # an optional property no value can fill is a mistake, not a field to drop
            {"type": "object", "properties": {"x": {"type": "integer", "minimum": 1.2,
                                                    "exclusiveMaximum": 2}}},
            "#/properties/x",
            "no integer lies between minimum (1.2) and exclusiveMaximum (2)",
        ),
        (
            {"type": "object", "properties": {"x": {"type": ["integer", "null"],
                                                    "enum": ["a", 1.5]}}},
            "#/properties/x",
            "no value of enum is of type integer or null",
        ),
        (  # required by an allOf of the same object
            {"type": "object", "properties": {"b": {"$ref": "#"}}, "allOf": [{"required": ["b"]}]},
            "#/properties/b",
            "no finite JSON value",
        ),
        (  # a property that minProperties asks for, and every property recurses
            {"type": "object", "additionalProperties": {"$ref": "#"}, "minProperties": 1},
            "#/additionalProperties",
            "no finite JSON value",
        ),
        (  # JSON's escape of half a surrogate pair: a TypeError out of outlines-core
            {"type": "object", "properties": {"a": {"enum": ["x", "\udc00"]}}},
            "#/properties/a/enum/1",
            "half of a surrogate pair",
        ),
        (
            {"type": "object", "properties": {"a\ud800": {"type": "string"}}},
            "#/properties, the key 'a\\ud800'",
            "half of a surrogate pair",
        ),
        (  # the productivity check counted to minItems: it never ended
            {"type": "object", "properties": {"x": {"type": "array", "minItems": 10**23}},
             "required": ["x"]},
            "#/properties/x",
            "minItems",
        ),
        (  # a $schema that is no URI: jsonschema's validator_for raised a TypeError
            {"$schema": [], "type": "object"}, "#/$schema", "[] is not of type 'string'"),
        ({"$schema": 1, "type": "object"}, "#/$schema", "1 is not of type 'string'"),
        (  # 2.0, which the meta-schema takes for an integer: a TypeError in the checks
            {"type": "object", "properties": {"x": {"type": "array", "minItems": 2.0,
                                                    "prefixItems": [{}, {}, {}]}},
             "required": ["x"]},
            "#/properties/x",
            "Expected positive integer for 'minItems', got 2.0",
        ),
        (  # past the first step: its lexer failed the request in mid-reply
            {"type": "object", "properties": {"a": {"type": "integer"}, "b": {
                "type": "array", "items": {"type": "string", "pattern": "^(a{1000}){1000}$"}}},
             "required": ["a", "b"]},
            "#/properties/b/items/pattern",
            "lexer error: too many expressions constructed",
        ),
        (  # without llguidance's advice to turn on an option that writes what it refuses
            {"oneOf": [{"type": "integer"}, {"type": "number"}]},
            "#",
            "oneOf constraints are not supported.",
        ),
        (  # the root's keyword fails; a property failing for another keyword was named
            {"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 1}}},
             "propertyNames": {"maxLength": 3}},
            "#",
            'Unimplemented keys: ["propertyNames"]',
        ),
        (
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
             "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]},
             "else": {"not": {"required": ["b"]}}},
            "#",
            'Unimplemented keys: ["else", "if", "then"]',
        ),
    ],
)
def test_bad_schemas_name_the_field(tok, schema, where, what):
    with pytest.raises(GrammarError) as err:
        compile_grammar(json_schema(schema, origin="answer.json"), tok)
    message = str(err.value)
    assert message.startswith(f"answer.json: {where}:") and what in message, message
    assert "coerce_one_of" not in message


def test_recursive_schemas_that_can_end_compile(tok, closers):
    tree = {
        "type": "object",
        "properties": {
            "v": {"type": "integer"},
            "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
        },
        "required": ["v"],
        "additionalProperties": False,
    }
    grammar = compile_grammar(json_schema(tree), tok)
    text = decoded(tok, random_output(grammar.new_constraint(), closers, random.Random(0)))
    jsonschema.validate(json.loads(text), tree)


@pytest.mark.parametrize(
    "schema",
    [  # required keys that a pattern, or another branch of the object, lets finish

        {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "required": ["xa"],
         "additionalProperties": False},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "minProperties": 1,
         "required": ["b"]},
        {"type": "object", "properties": {"n": {"$ref": "#"}, "v": {"type": "integer"}},
         "allOf": [{"required": ["v"]}]},
    ],
)
def test_schemas_whose_required_values_can_finish_compile(tok, closers, schema):
    grammar = compile_grammar(json_schema(schema), tok)
    text = decoded(tok, random_output(grammar.new_constraint(), closers, random.Random(0)))
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema", [
    # a pattern Python's re cannot read: what a name must match is not known, so no refusal
    {"type": "object", "patternProperties": {"^\\p{Lu}": False}, "required": ["a"]},
    {"type": "integer", "minimum": 0, "maximum": 2**53},  # a float's integers, all of them
    {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},  # int64's, which llguidance holds
    {"type": "integer", "maximum": 10**17},  # past 2^53, and a float's
    # an exclusive edge an inclusive bound keeps out already (a Decimal's gt=0 with 2 places)
    {"type": "number", "exclusiveMinimum": 0, "minimum": 0.01, "maximum": 0.5},
    {"type": "integer", "enum": [10**400, 1]},
])
def test_the_schema_checks_refuse_nothing_they_cannot_tell(schema):
    assert json_schema(schema).schema == json.loads(json.dumps(schema))


def test_schema_files_name_the_file_and_line(tok, tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "type": "object",\n  "properties": {,}\n}\n')
    with pytest.raises(GrammarError, match=r"bad\.json:3:\d+: invalid JSON"):
        json_schema_file(bad)
    with pytest.raises(GrammarError, match="missing.json: schema file does not exist"):
        json_schema_file(tmp_path / "missing.json")
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 2}))
    assert compile_grammar(json_schema_file(good), tok).new_constraint().forced_tokens()


def test_a_schema_that_passed_its_checks_is_not_checked_again(monkeypatch):
    """The tools sent with every request are checked once (the meta-schema's validation takes
    5-10 ms a tool); a schema that failed is checked, and refused, every time."""
    from agentflash.grammar import checks

    calls = []
    check = checks._check_schema
    monkeypatch.setattr(checks, "_check_schema", lambda *a: calls.append(a) or check(*a))
    good = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 17}}}
    bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": "17"}}}
    for _ in range(3):
        checks.check_schema(dict(reversed(good.items())), "tool")  # the same schema, keys apart
        with pytest.raises(GrammarError, match="not a valid JSON Schema"):
            checks.check_schema(bad, "tool")
    assert [schema for schema, _ in calls].count(bad) == 3 and len(calls) == 4
    # look-alikes of a schema that passed are checked on their own: two halves of a surrogate
    # pair (JSON's escape of the whole character), a tuple (JSON writes it as a list)
    checks.check_schema({"enum": ["\U0001f600"]}, "tool")
    with pytest.raises(GrammarError, match="half of a surrogate pair"):
        checks.check_schema({"enum": ["\ud83d\ude00"]}, "tool")
    checks.check_schema({"enum": ["a", "b"]}, "tool")
    with pytest.raises(GrammarError, match="is not of type 'array'"):
        checks.check_schema({"enum": ("a", "b")}, "tool")


_META_WORDS = ["type", "properties", "required", "items", "prefixItems", "additionalProperties",
               "enum", "const", "minimum", "exclusiveMinimum", "multipleOf", "minLength",
               "pattern", "format", "anyOf", "allOf", "not", "$ref", "$id", "$anchor",
               "$dynamicRef", "$defs", "definitions", "dependencies", "dependentRequired",
               "propertyNames", "patternProperties", "minItems", "uniqueItems", "$vocabulary",
               "$comment", "title", "default", "deprecated", "examples", "contentSchema",
               "$recursiveAnchor", "x-other", "a"]
_META_TYPES = ["array", "boolean", "integer", "null", "number", "object", "string", "str"]
_meta_scalars = st.sampled_from([None, True, False, 0, -1, 3, 1.5, 2.0, "", "a#b", "#/x", "_a-1",
                                 "a b", "http://x/y", *_META_TYPES])
_meta_values = st.recursive(
    _meta_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_META_WORDS),
                                                                 inner, max_size=4),
    max_leaves=12)


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(_meta_values)
def test_the_meta_schema_walk_passes_only_what_jsonschema_passes(value):
    """``meets_meta_schema`` (the fast walk that spares a new tool jsonschema's 5-15 ms) answers
    True only where jsonschema finds no fault: a fault is always jsonschema's to name."""
    from agentflash.grammar.checks import meets_meta_schema

    validator = jsonschema.Draft202012Validator(jsonschema.Draft202012Validator.META_SCHEMA)
    fine = jsonschema.exceptions.best_match(validator.iter_errors(value)) is None
    assert fine or not meets_meta_schema(value)


def test_the_meta_schema_walk_passes_tools_and_leaves_each_fault_to_jsonschema():
    from agentflash.grammar import checks
    from agentflash.grammar.bench import EVENT_TOOL_ARGS, FOUR_TOOLS

    for schema in [EVENT_TOOL_ARGS, *(t["parameters"] for t in FOUR_TOOLS), {}, {"$id": "x#"},
                   {"type": ["string", "null"], "$defs": {"a": True}, "$anchor": "_a-1.b"},
                   {"dependencies": {"a": ["b"], "c": {"type": "string"}}}]:
        assert checks.meets_meta_schema(schema), schema
    for schema, where in [
            ({"type": "strin"}, "#/type"), ({"type": ["string", "string"]}, "#/type"),
            ({"type": []}, "#/type"), ({"required": ["a", "a"]}, "#/required"),
            ({"required": [1]}, "#/required/0"), ({"minLength": -1}, "#/minLength"),
            ({"minLength": 1.5}, "#/minLength"), ({"minItems": True}, "#/minItems"),
            ({"multipleOf": 0}, "#/multipleOf"), ({"pattern": 3}, "#/pattern"),
            ({"$id": "a#b"}, "#/$id"), ({"$anchor": "1a"}, "#/$anchor"),
            ({"anyOf": []}, "#/anyOf"), ({"properties": {"a": 3}}, "#/properties/a"),
            ({"items": {"enum": 3}}, "#/items/enum"),
            ({"$vocabulary": {"x": 1}}, "#/$vocabulary/x"),
            ({"dependencies": {"a": [1]}}, "#/dependencies/a"), ({"format": 1}, "#/format"),
            ({"properties": {"a": {"$defs": {"b": 1}}}}, "#/properties/a/$defs/b"),
            ({"title": None}, "#/title"), ({"contentSchema": []}, "#/contentSchema"),
            ({"enum": ("a",)}, "#/enum")]:
        assert not checks.meets_meta_schema(schema), schema
        with pytest.raises(GrammarError, match=re.escape(where) + ".*not a valid JSON Schema"):
            checks.check_schema(schema, "tool")
    # values whose reading the walk leaves to jsonschema, which passes them
    validator = jsonschema.Draft202012Validator(jsonschema.Draft202012Validator.META_SCHEMA)
    for schema in [{"minimum": float("nan")}, {1: {}}]:
        assert not checks.meets_meta_schema(schema) and validator.is_valid(schema), schema


@pytest.mark.parametrize(
    ("source", "what"),
    [
        (lambda: lark('start: "a" b\nb: "x" b'), "can never finish: rule 'start'"),
        (lambda: lark('start: item+\nitem: "(" item ")"'), "can never finish"),
        (lambda: lark("start: foo"), "unknown name"),
        (lambda: lark('start: "x" | %json {"type": "object", "properties": {"a": {"$ref": "#"}}, '
                      '"required": ["a"]}'),
         "%json in rule 'start': #/properties/a: no finite JSON value satisfies this schema"),
        (lambda: ebnf('root ::= item\nitem ::= "a" item\n'), "rule 'root' has no finite"),
        # a rule but start that never finishes: the requests that entered it failed in llguidance
        # ("Too many items"); a %json body's bounds as json_schema's; nested past Python's stack
        (lambda: lark('start: "x" | y\ny: "a" y'),
         "rule 'y' has no finite expansion: a reply that enters it never ends"),
        (lambda: lark('start: %json {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}'),
         "%json in rule 'start': #: exclusiveMinimum (0) with the range within one unit"),
        (lambda: lark("start: " + "(" * 200 + '"a"' + ")" * 200), "too deeply nested"),
        # llguidance's options under which it writes what the schema refuses
        (lambda: json_schema({"type": "integer", "not": {"const": 0},
                              "x-guidance": {"lenient": True}}),
         "#/x-guidance/lenient: refused: llguidance then drops the keywords it cannot hold"),
        (lambda: lark('start: %json {"oneOf": [{"type": "integer"}, {"type": "number"}], '
                      '"x-guidance": {"coerce_one_of": true}}'),
         "%json in rule 'start': #/x-guidance/coerce_one_of: refused"),
        (lambda: lark('start: "hi" <|im_end|>'), "writes the end token <|im_end|>: leave it out"),
        # another end of a turn: the engine stopped there, "stop", the grammar unfinished
        (lambda: lark('start: "a" <|endoftext|> "b"'), "writes the end token <|endoftext|>"),
        (lambda: lark('start: "hi <tools>"'), "holds '<tools>', the text of a special token"),
        # after text of its own, where the first step's probe passed: every request failed there
        (lambda: lark('start: ("yes" | "no") " " /<tool_call>/'),
         "the regex /<tool_call>/: its literal '<tool_call>' holds '<tool_call>'"),
        # beside a repetition (item ~ 2) or a negation of another terminal: no negation of it
        (lambda: lark('start: ("yes" | "no") " " /<tool_call>/ D ~ 2\nD: /[0-9]/'),
         "the regex /<tool_call>/: its literal '<tool_call>'"),
        (lambda: lark('start: X " " Y\nX: /[a-z]+/ & ~/.*q.*/\nY: /<tool_call>/'),
         "the regex /<tool_call>/: its literal '<tool_call>'"),
        # defined after a negated terminal: no part of its definition
        (lambda: lark('start: W " " B\nW: /[a-z]+/ & ~Q\nQ: /.*q.*/\nB: /<tool_call>/'),
         "the regex /<tool_call>/: its literal '<tool_call>'"),
        (lambda: regex("(yes|no) <tool_cal{1}[l]>"),
         "the literal ' <tool_call>' holds '<tool_call>', the text of a special token"),
        (lambda: lark('start: "<" "tool_call>" "x"'),  # strings in a row are one text
         "the strings \"<\" \"tool_call>\" \"x\" holds '<tool_call>'"),
        (lambda: json_schema({"enum": ["a", "</tool_call>"]}),
         "#/enum holds '</tool_call>', the text of a special token"),
        (lambda: json_schema({"type": "object", "properties": {"<tools>": {"type": "integer"}}}),
         "#/properties holds '<tools>'"),
        # bounds llguidance turns into ranges that let a value past them through
        (lambda: json_schema({"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}),
         "exclusiveMinimum (0) with the range within one unit of it (0.5): llguidance lets 0"),
        (lambda: json_schema({"type": "number", "minimum": -2.5, "exclusiveMaximum": -2}),
         "(e.g. maximum -2.000001)"),
        (lambda: json_schema({"type": "integer", "minimum": 0, "maximum": 12345678901234567}),
         "maximum (12345678901234567) is past 2^53"),
        (lambda: json_schema({"type": "integer", "maximum": 10**400}), "is past 2^53"),
        (lambda: json_schema({"type": "integer", "maximum": 2**53 + 1}), "is past 2^53"),
        # every request failed at the forced text (the tokenizer reads it as the special token)
        (lambda: regex("<tool_call>[a-z]{1,5}"),
         "the literal '<tool_call>' holds '<tool_call>', the text of a special token"),
        (lambda: regex("(ok|x</tool_call>)"), "the literal 'x</tool_call>' holds"),
        (lambda: regex("(<)tool_call>[a-z]+"), "the literal '<tool_call>' holds"),  # one run
        # a schema's pattern likewise: it compiled, then every request failed at the text
        # ("no legal token"; with <tool_call> llguidance's "token ... doesn't satisfy")
        (lambda: json_schema({"type": "string", "pattern": r"^<\|im_end\|>x$"}),
         "#/pattern: its literal '<|im_end|>x' holds '<|im_end|>', the text of a special token"),
        (lambda: json_schema({"type": "object", "properties": {"a": {"anyOf": [
            {"type": "integer"}, {"type": "string", "pattern": "^<tool_call>"}]}}}),
         "#/properties/a/anyOf/1/pattern: its literal '<tool_call>' holds '<tool_call>'"),
        (lambda: json_schema({"type": "object", "patternProperties": {"^<tool_call>$": {}},
                              "additionalProperties": False, "minProperties": 1}),
         "#/patternProperties/^<tool_call>$: its literal '<tool_call>' holds"),
        (lambda: lark('start: %json {"type": "string", "pattern": "^x</tool_call>$"}'),
         "%json #/pattern: its literal 'x</tool_call>' holds '</tool_call>'"),
        # a pattern Python's parser cannot read (Rust's \p{..}, \z, \x{..}) was not read
        # at all: it compiled, then every request failed
        (lambda: json_schema({"type": "string", "pattern": r"^\p{Lu}<tool_call>$"}),
         "#/pattern: its literal '<tool_call>' holds '<tool_call>'"),
        (lambda: json_schema({"type": "string", "pattern": r"^[A-Z]<tool_call>\z"}),
         "#/pattern: its literal '<tool_call>' holds '<tool_call>'"),
        (lambda: json_schema({"type": "string", "pattern": r"^a\x{3c}tool_call>$"}),
         "#/pattern: its literal '^a<tool_call>$' holds '<tool_call>'"),
        (lambda: assistant_turn([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"q": {"type": "string", "pattern": "^<tools>$"}},
            "required": ["q"]}}}], "required"), "its literal '<tools>' holds '<tools>'"),
        (lambda: lark("start: /[/"), "unclosed character class"),
        (lambda: regex("a[b"), "invalid regex"),
        (lambda: regex("[a&&b]"), "no output matches"),
        (lambda: json_schema({"anyOf": []}), "anyOf"),
        (lambda: json_schema(False), "false"),
        (lambda: json_schema("not a schema"), "must be an object"),
        (lambda: json_schema({"type": "string", "format": {}}),
         "#/format: not a valid JSON Schema"),
        (lambda: pydantic_model(type("Opaque", (), {})), "Opaque: pydantic cannot"),
    ],
)
def test_bad_grammars_raise_clear_errors(tok, source, what):
    with pytest.raises(GrammarError) as err:
        compile_grammar(source(), tok)
    assert what in str(err.value), str(err.value)


def test_an_added_token_that_is_text_may_be_written(demo_tokenizer_dir):
    # every added token's text was refused, an added one llguidance reads as text ("zzqq") too
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    tok.add_tokens(["zzqq"])
    grammar = compile_grammar(regex("a zzqq b"), tok, vocab_size=len(tok))
    ids = tok.encode("a zzqq b", add_special_tokens=False) + [tok.eos_token_id]
    assert tok.convert_tokens_to_ids("zzqq") in ids
    assert grammar.new_constraint().validate_draft(ids) == len(ids)
    with pytest.raises(GrammarError, match="holds '<tools>', the text of a special token"):
        compile_grammar(regex("hi <tools>"), tok, vocab_size=len(tok))


@pytest.mark.parametrize("text", [
    "start: X\nX: /[a-z<>_]+/ & ~/.*<tool_call>.*/\n",
    # negated through a terminal or a group: refused as a writing of it
    "start: X\nX: /[a-z<>_]+/ & ~CALLISH\nCALLISH: /(?s:.*)<tool_call>(?s:.*)/\n",
    "start: X\nX: /[a-z<>_]+/ & ~(/(?s:.*)<tool_call>(?s:.*)/)\n",
])
def test_a_regex_that_keeps_a_special_tokens_text_out_is_no_writing_of_it(tok, text):
    grammar = compile_grammar(lark(text), tok)
    ids = tok.encode("a<b>_c", add_special_tokens=False) + [tok.eos_token_id]
    assert grammar.new_constraint().validate_draft(ids) == len(ids)


@pytest.mark.parametrize("text, named", [
    ('start: "q" A\nA: ~/abc/', []),
    ('start: "q" A\nA: ~/abc/ & ~/x/', []),
    ('start: "q" A "z"\nA: ~("ab" | "cd")', []),
    ('start: "q" ~/abc/', []),
    ('start: "q" a\na: ~/abc/ | <|im_start|>', [1]),  # the one it names stays
    ('start: "q" a\na: ~/abc/ | <[4100]>', [4100]),
])
def test_a_negated_lexemes_masks_let_through_no_special_token_it_refuses(tok, text, named):
    # llguidance (1.9.1) matched a negation against the special tokens' bytes (0xFF and their
    # names) in the mask and refused them when consumed: a model choosing one (<tool_call>,
    # which the demo model writes first) failed the request, or the grammar's compile
    grammar = compile_grammar(lark(text), tok, vocab_size=len(tok) + 40)
    constraint = grammar.new_constraint()
    constraint.advance(tok.encode("q", add_special_tokens=False))
    allowed = allowed_token_ids(constraint.bitmask(), grammar.vocab_size)
    assert {0, 1, 3, 4090, 4100} & set(allowed) == set(named)
    assert [t for t in allowed if not constraint.allows(t)] == []
    constraint.advance([allowed[0]])


def test_a_grammar_that_begins_with_a_negated_lexeme_compiles(tok):
    grammar = compile_grammar(lark("start: A\nA: ~/abc/"), tok)  # a raw GrammarViolation
    constraint = grammar.new_constraint()
    constraint.advance([first_allowed_token(constraint.bitmask(), grammar.vocab_size)])


def test_a_first_mask_that_lets_through_a_refused_token_is_the_grammars_error(tok, monkeypatch):
    # the mask's fault, as llguidance's without the fix above: named at compile, not raised
    # as GrammarViolation (an engine bug, a 500 in serve)
    from agentflash.grammar import llguidance_backend

    monkeypatch.setattr(llguidance_backend, "may_write_special_bytes", lambda text: False)
    with pytest.raises(GrammarError, match="^grammar: the grammar's first mask allows a token "
                                           "that it then refuses"):
        compile_grammar(lark("start: A\nA: ~/abc/"), tok, use_cache=False)


@pytest.mark.parametrize("text, holds", [
    ("start: A\nA: ~/abc/", True),
    ('start: "q" ~/abc/', True),
    ("start: A\nA: /x/ (~/a/)+", True),
    ("start: A\nA: ~/a/ & ~/b/", True),
    ('start: A\n%ignore ~/a/\nA: "x"', True),
    ('start: "a" ~ 2 ~/b/', True),
    ("start: A\nA: /(?s:.)*/ & ~/abc/", True),  # (holds no 0xFF, but counted: a cheap check)
    ('start: a ~ 2..3 "~"\na: "x" // ~ a comment', False),  # a repetition, a string, a comment
    ('start: %json {"type": "string", "description": "~x"}', False),
    ('start: /a~b/', False),
])
def test_may_write_special_bytes_reads_negations(text, holds):
    assert may_write_special_bytes(text) is holds


def test_the_tool_call_grammars_pay_no_special_token_check(tok):
    # their free text is written without a negation (texts_without): no check added to their
    # masks
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    for choice in ("auto", "none", "required"):
        source = assistant_turn(tools, choice)
        assert not may_write_special_bytes(source.text)
        assert compile_grammar(source, tok).special_ids is None


def test_productive_lark_grammars_pass_the_finish_check(tok):
    ok = 'start: expr\nexpr: term ("+" term)*\nterm: NUM | "(" expr ")"\nNUM: /[0-9]+/\n'
    constraint = compile_grammar(lark(ok), tok).new_constraint()
    ids = tok.encode("(1+2)+3", add_special_tokens=False) + [tok.eos_token_id]
    assert constraint.validate_draft(ids) == len(ids)


def test_outlines_refuses_what_it_cannot_do(tok):
    pytest.importorskip("outlines_core")
    cases = [
        (lark('start: "a"'), "JSON Schema and regex only"),
        (
            json_schema(
                {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
                }
            ),
            "recursive schemas are not supported",
        ),
        (
            json_schema({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}),
            "#/properties/a",
        ),
        (regex("a[b"), "unclosed character class"),
        # compiled before, then writing what the schema refuses, or ending early: a bound in
        # $defs, allOf's objects one after the other, oneOf read as anyOf, a raw quote in an
        # email, and "12" ended where "12.5" goes on
        (json_schema({"$defs": {"n": {"type": "integer", "minimum": 5}},
                      "properties": {"a": {"$ref": "#/$defs/n"}}}),
         "#/$defs/n: outlines-core ignores 'minimum'"),
        (json_schema({"allOf": [{"properties": {"a": {"type": "integer"}}},
                                {"properties": {"b": {"type": "integer"}}}]}),
         "#: outlines-core writes allOf's branches one after the other"),
        (json_schema({"properties": {"n": {"oneOf": [{"type": "integer"},
                                                     {"type": "number"}]}}}),
         "#/properties/n: outlines-core reads oneOf as anyOf"),
        (json_schema({"properties": {"e": {"type": "string", "format": "email"}}}),
         "#/properties/e: format 'email' is not supported by outlines-core"),
        (json_schema({"type": "string", "format": "uri"}),
         "#: format 'uri' is not supported by outlines-core"),
        (json_schema({"type": "string", "enum": ["a", 1, None]}),
         "#: outlines-core ignores 'type' beside 'enum': it would write 1"),
        (json_schema({"type": "object", "properties": {"k": {"type": "integer"}},
                      "required": ["k"], "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}),
         "#: outlines-core ignores anyOf beside properties"),
        (json_schema({"type": "number"}), "outlines-core ends the output after"),
        (regex(r"[0-9]+(\.[0-9]+)?"), "outlines-core ends the output after"),
        (regex("ab|abcd"), "outlines-core ends the output after"),
        (regex(r"€[0-9]+(\.[0-9]{2})?"), "ends the output after '€"),  # no ASCII match
        # going on with a character the tokenizer splits into bytes
        (regex("中|中文字"), "after '中', where it may go on ('中' and a character the"),
        (regex("x|x中y"), "after 'x', where it may go on ('x' and a character the"),
        (regex("[^\n]+"), "where it may go on ('u' and a character the"),  # ué: u alone
        # its error quoted the whole schema's regex and named no field
        (json_schema({"properties": {"code": {"type": "string", "pattern": "(?=a)b"}}}),
         "#/properties/code: outlines-core cannot compile this schema"),
        # it wrote {} for a key required and not listed, and '{"a": }' for an enum of none
        (json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                      "required": ["b"]}),
         "#: outlines-core ignores required 'b', which properties does not list"),
        (json_schema({"type": "object", "properties": {"o": {"type": "object",
                                                           "required": ["a"]}}}),
         "#/properties/o: outlines-core ignores required 'a', which properties does not list"),
        (json_schema({"type": "object", "properties": {"a": {"enum": []},
                                                       "b": {"type": "integer"}}}),
         "#/properties/a: outlines-core writes no value for an enum of none"),
        # a format it knows beside a length, which it writes by: the format was dropped as if
        # a date's ("ab" a uuid); one it does not know beside a pattern: a raw ValueError
        (json_schema({"type": "string", "format": "uuid", "minLength": 1}),
         "#: outlines-core ignores 'format'"),
        (json_schema({"properties": {"h": {"type": "string", "format": "hostname",
                                           "pattern": "^[a-z]{1,5}$"}}}),
         "#/properties/h: outlines-core ignores 'format'"),
        # a type beside anyOf, which it ignores: '"Oslo"' for an object (a tool's parameters
        # without a type are an object's)
        (json_schema({"type": "object", "anyOf": [{"type": "string"}, {"type": "object"}]}),
         "#: outlines-core ignores 'type' beside 'anyOf': anyOf[0] may write a value of"),
        (tool_call_body([{"name": "f", "parameters": {"anyOf": [{"enum": ["Oslo"]},
                                                                {"type": "object"}]}}]),
         "outlines-core ignores 'type' beside 'anyOf': anyOf[0] may write"),
        # a subschema that does not compile alone, judged in the whole: its maxLength dropped
        (json_schema({"properties": {"a": {"type": "string"},
                                     "b": {"$ref": "#/properties/a", "maxLength": 2}},
                      "required": ["b"]}),
         "#/properties/b: outlines-core ignores 'maxLength'"),
    ]
    for source, what in cases:
        with pytest.raises(GrammarError) as err:
            compile_grammar(source, tok, backend=Backend.OUTLINES)
        assert what in str(err.value), str(err.value)
    # a type beside anyOf whose branches keep to it by their keywords, refs or values: compiled
    for source in (
            tool_call_body([{"name": "f", "parameters": {"anyOf": [
                {"properties": {"city": {"type": "string"}}, "required": ["city"]},
                {"properties": {"lat": {"type": "number"}}, "required": ["lat"]}]}}]),
            json_schema({"type": "string", "anyOf": [{"const": "a"}, {"const": "b"}]}),
            json_schema({"type": "object", "anyOf": [{"$ref": "#/$defs/A"}],
                         "$defs": {"A": {"type": "object", "properties": {
                             "x": {"type": "integer"}}, "required": ["x"]}}})):
        compile_grammar(source, tok, backend=Backend.OUTLINES)
    # a subschema that does not compile alone whose bounds the whole keeps: compiled
    kept = compile_grammar(json_schema({
        "type": "object", "properties": {"a": {"type": "string"}, "b": {
            "type": "array", "items": {"$ref": "#/properties/a"}, "minItems": 1,
            "maxItems": 2}}, "required": ["b"]}), tok, backend=Backend.OUTLINES)
    for text, legal in (('{"b":[]}', False), ('{"b":["x"]}', True), ('{"b":["x","y"]}', True),
                        ('{"b":["x","y","z"]}', False)):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        assert (kept.new_constraint().validate_draft(ids) == len(ids)) == legal, text
    # a date's format is the whole of the pattern exact_dates puts beside it: kept, not refused
    for schema in ({"type": "string", "format": "date"}, {"type": "string", "format": "time"},
                   {"properties": {"at": {"type": "string", "format": "date-time"}}}):
        compile_grammar(json_schema(schema), tok, backend=Backend.OUTLINES)
    for source in (json_schema({"type": "integer"}), json_schema({"enum": ["a", "ab"]}),
                   # required on a string says nothing: not refused as a key not listed
                   json_schema({"type": "object", "properties": {"s": {
                       "type": "string", "required": ["a"]}}}),
                   regex("[a-z]+"), regex("(yes|no)!"),  # a match that goes on is kept
                   regex("€[0-9]+")):
        compile_grammar(source, tok, backend=Backend.OUTLINES)



@pytest.mark.parametrize("fmt", ["date", "date-time", "time"])
def test_llguidance_compiles_a_date_by_its_pattern_alone_the_same_language(tok, closers, fmt):
    """exact_dates puts a pattern beside each date format; llguidance is given the pattern
    alone (its format's regex, intersected with it, cost compile time and changed nothing):
    the masks of the pair and of the pattern alone agree along random outputs of both."""
    import llguidance

    from agentflash.grammar import llguidance_backend
    from agentflash.grammar.compiler import _build
    from agentflash.grammar.tokenizers import tokenizer_info
    from agentflash.json_formats import DATE_PATTERNS

    schema = {"type": "object", "properties": {"at": {"type": "string", "format": fmt}},
              "required": ["at"]}
    source = json_schema(schema)
    assert '"format"' in source.text  # kept in the source (outlines, jsonschema read it)
    text = llguidance_backend.grammar_text(source)
    assert json.dumps(DATE_PATTERNS[fmt]) in text and '"format"' not in text
    info = tokenizer_info(tok, None, None)
    alone = _build(Backend.LLGUIDANCE, source, info)
    paired = llguidance.LLMatcher.grammar_from_json_schema(
        source.text, defaults=llguidance_backend.JSON_STYLE_OPTIONS[JsonStyle.DUMPS])
    both = llguidance_backend.LLGuidanceGrammar(source, alone._tokenizer, alone.vocab_size,
                                                alone.eos_token_id)
    both._matcher = llguidance.LLMatcher(alone._tokenizer, paired, log_level=0)
    assert not both._matcher.is_error()
    for seed in range(12):
        walker = (alone if seed % 2 else both).new_constraint()
        output = random_output(walker, closers, random.Random(seed))
        a, b = alone.new_constraint(), both.new_constraint()
        for token in output:
            assert torch.equal(a.bitmask(), b.bitmask()), tok.decode(output)
            a.advance([token])
            b.advance([token])
        assert a.is_finished() and b.is_finished()



def test_the_date_patterns_pass_their_probe(tok, monkeypatch):
    """The patterns exact_dates puts beside every date format are not probed (a new tool with
    a date paid 0.6-1 ms a pattern at Qwen3's vocabulary): finite languages, whose first masks
    llguidance computes with a hundredth of its lexer's limits."""
    import llguidance

    from agentflash.grammar import compiler, llguidance_backend
    from agentflash.grammar.tokenizers import tokenizer_info
    from agentflash.json_formats import DATE_PATTERNS

    info = tokenizer_info(tok, None, None)
    tight = llguidance.LLParserLimits(step_lexer_fuel=2000, max_lexer_states=2500)
    for pattern in DATE_PATTERNS.values():
        assert compiler._pattern_problem(pattern, info) == ""
        grammar = compiler._build(Backend.LLGUIDANCE, json_schema(
            {"type": "string", "pattern": pattern}, strict=False), info)
        grammar._matcher = llguidance.LLMatcher(
            grammar._tokenizer, llguidance_backend.grammar_text(grammar.source), log_level=0,
            limits=tight)
        assert compiler._first_masks(grammar)[0] is None, pattern
    probed: list[str] = []
    monkeypatch.setattr(compiler, "_patterns", compiler.LRU(16))  # (its verdicts are made up)
    monkeypatch.setattr(compiler, "_pattern_problem",
                        lambda pattern, info: probed.append(pattern) or "")
    compile_grammar(json_schema({"type": "object", "properties": {
        "day": {"type": "string", "format": "date"},
        "at": {"type": "string", "format": "date-time"},
        "code": {"type": "string", "pattern": "^[A-Z]{3,}$"}}}), tok, use_cache=False)
    assert probed == ["^[A-Z]{3,}$"]  # the user's pattern is probed, the dates' are not


_TIGHT = {"step_lexer_fuel": 2000, "max_lexer_states": 2500}  # a hundredth of the defaults


@pytest.mark.parametrize("pattern, value", [
    ("^[A-Z]{3}$", "SFO"),
    ("^#[0-9a-f]{6}$", "#a0b1c2"),
    (r"^\+\d{2} \d{3}-\d{4}$", "+41 555-0199"),
    ("^[A-Za-z0-9_]{64}$", "the_quick_brown_fox_jumps_over_the_lazy_dog_0123456789_ABCDEFGHI"),
    ("^" + "[A-Za-z0-9_]" * 64 + "$", "x" * 64),
    (r"^[\dA-Z_]{32}[a-z\d]{32}$", "A1_" * 10 + "BC" + "z9" * 16),
])
def test_fixed_width_patterns_are_far_from_the_lexer_limits(tok, pattern, value):
    """A fixed-width pattern is not probed (1.3 ms at Qwen3's vocabulary for an airport code):
    its regex's derivatives are its suffixes, so its lexer's states are few whatever the
    tokenizer; a whole string of the widest of them is written with a hundredth of llguidance's
    lexer limits."""
    import llguidance

    from agentflash.grammar import compiler, llguidance_backend
    from agentflash.grammar.tokenizers import tokenizer_info

    assert compiler.fixed_width(pattern) and re.fullmatch(pattern, value)
    info = tokenizer_info(tok, None, None)
    assert compiler._pattern_problem(pattern, info) == ""
    grammar = compiler._build(Backend.LLGUIDANCE, json_schema(
        {"type": "string", "pattern": pattern}, strict=False), info)
    grammar._matcher = llguidance.LLMatcher(
        grammar._tokenizer, llguidance_backend.grammar_text(grammar.source), log_level=0,
        limits=llguidance.LLParserLimits(**_TIGHT))
    constraint = grammar.new_constraint()
    for token in tok.encode(json.dumps(value), add_special_tokens=False):
        constraint.bitmask()
        constraint.advance([token])
    assert constraint.is_accepting()


@pytest.mark.parametrize("pattern", [
    "^(a{1000}){1000}$", "^a{1000}{1000}$", "^x([a-z]{1,50}){1,50}$", "^([a-z]{1,50}){1,50}$",
    "^[a-z]{65}$", "^[a-z]{40}[0-9]{25}$", "^a{99}$", "^[A-Z]{3}", "[A-Z]{3}$", "^[A-Z]{3,}$",
    "^[A-Z]{1,3}$", "^[A-z]{3}$", "^[ -~]{3}$", "^.{3}$", "^\\w{3}$", "^[^a]{3}$", '^"{3}$',
    "^(?:[A-Z]{3})$", "^[A-Z]|[0-9]$", "^a\\$", "^$", "^[A-Z]{0}$", "^[A-Z]{03}$",
])
def test_other_patterns_are_probed(tok, monkeypatch, pattern):
    """What is not a fixed-width pattern of at most MAX_FIXED_WIDTH positions is probed: the
    patterns that meet llguidance's lexer limits among them, refused when compiled
    (test_a_grammar_whose_masks_llguidance_cannot_compute_is_refused_when_compiled)."""
    from agentflash.grammar import compiler

    assert not compiler.fixed_width(pattern)
    probed: list[str] = []
    monkeypatch.setattr(compiler, "_patterns", compiler.LRU(16))
    monkeypatch.setattr(compiler, "_pattern_problem",
                        lambda pattern, info: probed.append(pattern) or "")
    compile_grammar(json_schema({"type": "object", "properties": {
        "a": {"type": "integer"}, "code": {"type": "string", "pattern": pattern}}},
        strict=False), tok, use_cache=False)
    assert probed == [pattern]


def _accepts(grammar, tok, text: str) -> bool:
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return grammar.new_constraint().validate_draft(ids) == len(ids)


def test_outlines_writes_property_names_as_json_spells_them(tok, closers):
    """outlines-core 0.2.14 puts a property name into its regex as it is, not as JSON spells
    it: it wrote {"size "in"": 5}, and a raw backslash or newline inside the key."""
    pytest.importorskip("outlines_core")
    rng = random.Random(3)
    for name in ['size "in"', "a\\b", "a\nb", "x\x01"]:
        schema = {"type": "object", "properties": {name: {"type": "integer"},
                                                   "n": {"type": "integer"}},
                  "required": [name]}
        grammar = compile_grammar(json_schema(schema), tok, backend=Backend.OUTLINES)
        assert _accepts(grammar, tok, json.dumps({name: 5}))
        assert not _accepts(grammar, tok, '{"' + name + '": 5}')
        for _ in range(3):
            text = decoded(tok, random_output(grammar.new_constraint(), closers, rng))
            jsonschema.validate(json.loads(text), schema)
    # a $ref through such a name still finds its property (in $defs too)
    schema = {"$defs": {"d": {"type": "object", "properties": {'a"b': {"type": "boolean"}},
                              "required": ['a"b']}},
              "type": "object", "properties": {'q"': {"$ref": '#/$defs/d/properties/a"b'},
                                               "d": {"$ref": "#/$defs/d"}},
              "required": ['q"', "d"]}
    grammar = compile_grammar(json_schema(schema), tok, backend=Backend.OUTLINES)
    assert _accepts(grammar, tok, json.dumps({'q"': True, "d": {'a"b': False}}))


def test_outlines_writes_the_keys_of_const_and_enum_objects_as_they_are(tok):
    """outlines-core 0.2.14 put the keys of a const's or an enum's objects into its regex as
    they are, escaped neither for the regex nor for JSON: {"a.b": 1} let {"axb": 1} through,
    and {"a\\"b": 1} was written with a raw quote."""
    pytest.importorskip("outlines_core")
    for value, wrong in [({"a.b": 1}, '{"axb": 1}'), ({"n+": [{'q"': 2}]}, '{"nn": [{"q"": 2}]}'),
                         ({"a\\b": {"x\ny": None}}, '{"a\\b": {"x\ny": null}}')]:
        for schema in ({"const": value}, {"enum": [value, 5]}):
            grammar = compile_grammar(json_schema(schema), tok, backend=Backend.OUTLINES)
            assert _accepts(grammar, tok, json.dumps(value)), schema
            assert not _accepts(grammar, tok, wrong), schema
    grammar = compile_grammar(json_schema({"const": [{"(": 1}]}), tok, backend=Backend.OUTLINES)
    assert _accepts(grammar, tok, '[{"(": 1}]')  # (a regex outlines-core could not build)


@pytest.mark.parametrize("backend", [Backend.LLGUIDANCE, Backend.OUTLINES])
def test_an_enum_or_const_number_is_written_as_that_number_or_refused(tok, closers, backend):
    """llguidance wrote an integer const past 2^53 as its float (9007199254740993 as ...992,
    18446744073709551615 as 18446744073709552000) and 1.5e300 as '15' and 299 zeros, which
    reads back as an integer; outlines-core an integer past 64 bits as a float
    (1.2345678901234568e+29): the output failed its schema. Each is refused naming the field,
    on the backend that would write it wrong; what compiles writes the very number."""
    if backend is Backend.OUTLINES:
        pytest.importorskip("outlines_core")
    name = backend.name.lower()
    wrong = {"llguidance": [
        ({"const": 2**53 + 1}, "#/const: 9007199254740993 would be written as another number"),
        ({"type": "object", "properties": {"id": {"anyOf": [
            {"type": "string"}, {"const": 2**64 - 1}]}}}, "#/properties/id/anyOf/1/const"),
        ({"enum": ["x", [{"n": 123456789012345678901234567890}]]}, "#/enum: 1234567890123456"),
        ({"enum": [1.5e300]}, "#/enum: 1.5e+300 would be written as another number"),
    ], "outlines": [
        ({"const": 123456789012345678901234567890}, "#/const: 123456789012345678901234567890"),
        ({"type": "object", "properties": {"id": {"enum": [-2**64, 1]}}}, "#/properties/id/enum"),
    ]}[name]
    for schema, what in wrong:
        with pytest.raises(GrammarError, match=re.escape(what)):
            compile_grammar(json_schema(schema), tok, backend=backend)
    right = [2**53, -2**53, 0.1, 1e-7, -0.0, 2.5, 1e22, 1e16, -273.15, 2**60]
    right += [2**53 + 1, 2**64 - 1, -2**63 + 2**11] if backend is Backend.OUTLINES else []
    for value in right:
        grammar = compile_grammar(json_schema({"const": value}), tok, backend=backend)
        text = decoded(tok, random_output(grammar.new_constraint(), closers, random.Random(0)))
        assert json.loads(text) == value, (value, text)
    if backend is Backend.LLGUIDANCE:  # in a Lark grammar's %json and a tool's parameters
        with pytest.raises(GrammarError, match=re.escape("%json in rule 'start': #/const")):
            compile_grammar(lark('start: %json {"const": 9007199254740993}'), tok)
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"enum": [2**63 + 1]}}, "required": ["n"]}}}]
        with pytest.raises(GrammarError, match="#/properties/n/enum: 9223372036854775809"):
            compile_grammar(assistant_turn(tools, "required"), tok)
        # a property named const or enum is a subschema, not the keyword: its default (1e30,
        # read as a const's number) was refused; a const inside it is named where it stands
        named = {"type": "object", "properties": {"const": {"type": "number", "default": 1e30},
                                                  "enum": {"type": "integer"}}}
        compile_grammar(json_schema(named), tok)
        named["properties"]["enum"] = {"const": 2**65 + 1}
        with pytest.raises(GrammarError, match="#/properties/enum/const: 36893488147419103233"):
            compile_grammar(json_schema(named), tok)


def test_outlines_refuses_a_pattern_whose_text_is_no_json_string(tok):
    """outlines-core 0.2.14 matches a string's pattern against its JSON text, between quotes it
    writes around it as it is: ^a.b$ wrote "a"b" and a raw control character, [^x] a raw
    newline, ^a\\\\b$ a lone backslash (the string a<backslash>b is "a\\\\b" in JSON), a|b the
    text "a or b" alone, a"|"b the text "a (its quotes make the JSON string), ^a$|^b$ nothing
    it could finish. A pattern that cannot write such a character is kept."""
    pytest.importorskip("outlines_core")
    for pattern, text in [("^a.b$", '"a\x00'), ('^a"b$', '"a"b'), ("[^x]", '"\x00'),
                          (r"^\W+$", '"\x00'), (r"\S", '"\x00'), ("^a\\\\b$", '"a\\'),
                          ("a|b", "b"), ("^.{0,1000}$", '"\x00'),
                          ('a"|"b', '"b'), ('^a"|"b$', '"b')]:
        schema = {"type": "object", "properties": {"k": {"type": "string", "pattern": pattern}},
                  "required": ["k"]}
        with pytest.raises(GrammarError) as err:
            compile_grammar(json_schema(schema), tok, backend=Backend.OUTLINES)
        assert "#/properties/k/pattern: outlines-core matches a pattern against the JSON" in str(
            err.value), str(err.value)
        assert f"could write {text!r}" in str(err.value), str(err.value)
    # in $defs, beside another type, and one that reads across the quotes ("x")|("y")
    for schema, where in [({"$defs": {"s": {"type": ["string", "null"], "pattern": "[^a]"}},
                            "type": "object", "properties": {"k": {"$ref": "#/$defs/s"}}},
                           "#/$defs/s/pattern: outlines-core matches"),
                          ({"type": "string", "pattern": 'x")|("y'},
                           "#/pattern: outlines-core writes a pattern between quotes as it is")]:
        with pytest.raises(GrammarError, match=re.escape(where)):
            compile_grammar(json_schema(schema), tok, backend=Backend.OUTLINES)
    # an anchor inside (^a$|^b$), or a '$' alone at the end (\d+$: written before the closing
    # quote): outlines-core compiled them, and their index never finished
    for pattern in ["^[a-z]+$|^[0-9]+$", r"\d+$", "[A-Z][a-z]*$"]:
        schema = {"type": "object", "properties": {"k": {"type": "string",
                                                         "pattern": pattern}}}
        with pytest.raises(GrammarError, match=re.escape(
                "#/properties/k/pattern: outlines-core takes '^' and '$' only around the whole "
                f"pattern, and in {pattern!r} an anchor elsewhere")):
            compile_grammar(json_schema(schema), tok, backend=Backend.OUTLINES)
    for pattern, text in [("^[a-z]+$", '"abc"'), (r"^\d{3}-\d{4}$", '"555-1234"'),
                          (r"^\w+$", '"h_llo9"'), ('^[^"\\\\\\x00-\\x1f]*$', '"a b!"')]:
        grammar = compile_grammar(json_schema({"type": "string", "pattern": pattern}), tok,
                                  backend=Backend.OUTLINES)
        assert _accepts(grammar, tok, text), pattern


def test_outlines_says_it_ignores_a_pattern_beside_enum_const_or_a_length(tok):
    """Beside enum, const, minLength or maxLength outlines-core writes no pattern at all: the
    pattern's check said it would write a raw character by it, which it does not."""
    pytest.importorskip("outlines_core")
    for keyword, value in [("enum", ["ab", "cd"]), ("const", "ab"), ("minLength", 1),
                           ("maxLength", 4)]:
        schema = {"type": "string", keyword: value, "pattern": "^[^x]+$"}
        with pytest.raises(GrammarError, match="#: outlines-core ignores 'pattern'"):
            compile_grammar(json_schema(schema), tok, backend=Backend.OUTLINES)


def test_outlines_refuses_a_count_it_keeps_only_in_part(tok):
    """outlines-core 0.2.14 builds the same regex for minProperties 1, 2 and 3 (one key, then
    any more): minProperties 2 wrote '{"a": 1}'. Compared with and without the keyword, the
    regex differed; with the count one step looser it does not. The counts it keeps (an
    array's, a string's, minProperties 1, maxProperties 0) compile and hold."""
    pytest.importorskip("outlines_core")
    extra = {"type": "object", "additionalProperties": {"type": "integer"}}
    for schema, what in [
            ({**extra, "minProperties": 2},
             "#: outlines-core does not keep 'minProperties' 2: it writes the same as for "
             "'minProperties' 1"),
            ({"properties": {"m": {**extra, "minProperties": 3}}},
             "#/properties/m: outlines-core does not keep 'minProperties' 3"),
            ({"properties": {"m": {"$ref": "#/$defs/M"}}, "$defs": {
                "M": {**extra, "minProperties": 2}}},
             "#/$defs/M: outlines-core does not keep 'minProperties' 2"),
            ({**extra, "maxProperties": 1}, "#: outlines-core ignores 'maxProperties'")]:
        with pytest.raises(GrammarError) as err:
            compile_grammar(json_schema(schema), tok, backend=Backend.OUTLINES)
        assert what in str(err.value), str(err.value)
    for schema, texts in [
            ({**extra, "minProperties": 1}, {'{"a":1}': True, "{}": False}),
            ({**extra, "maxProperties": 0}, {"{}": True, '{"a":1}': False}),
            ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
             {"[1]": False, "[1,2]": True, "[1,2,3]": True, "[1,2,3,4]": False}),
            ({"type": "string", "minLength": 2, "maxLength": 2},
             {'"a"': False, '"ab"': True, '"abc"': False})]:
        grammar = compile_grammar(json_schema(schema), tok, backend=Backend.OUTLINES)
        for text, legal in texts.items():
            assert _accepts(grammar, tok, text) == legal, (schema, text)


def test_outlines_reads_a_patterns_classes_as_ascii_as_llguidance_does(tok):
    """A schema's pattern is ECMA-262's, whose \\d and \\w are ASCII (llguidance's reading);
    outlines-core's Rust regex read them as Unicode's: '^[a-z]\\d$' wrote 'x۸'. Inside a class
    too; an escaped backslash before a 'd' stays a backslash and a 'd'. A regex source is Rust's
    regex on both backends: its \\d is Unicode's."""
    pytest.importorskip("outlines_core")
    for pattern, texts in [
            (r"^[a-z]\d$", {"x7": True, "x۸": False, "x٣": False}),
            (r"^\w+$", {"a_9Z": True, "é": False, "ａ": False}),
            (r"^[\d_]+$", {"1_2": True, "١": False}),
            (r"^[\w.]+$", {"a.b": True, "ß": False})]:
        for backend in (Backend.OUTLINES, Backend.LLGUIDANCE):
            grammar = compile_grammar(json_schema({"type": "string", "pattern": pattern}), tok,
                                      backend=backend)
            for text, legal in texts.items():
                assert _accepts(grammar, tok, json.dumps(text, ensure_ascii=False)) == legal, (
                    backend, pattern, text)
    for backend in (Backend.OUTLINES, Backend.LLGUIDANCE):
        assert _accepts(compile_grammar(regex(r"[a-z]\d"), tok, backend=backend), tok, "x٣")
    from agentflash.grammar.outlines_backend import _ascii_classes

    # (a backslash in the pattern is refused: its rewrite is seen here)
    assert _ascii_classes(r"a\\d\.\d[^\W]") == r"a\\d\.[0-9][^[^0-9A-Za-z_]]"


def test_a_set_is_refused_in_our_words_on_both_backends(tok):
    """uniqueItems (pydantic's set[...] and frozenset[...]) is refused, naming the field and
    saying to use a list: llguidance said 'Unimplemented keys: ["uniqueItems"]', outlines-core
    'ignores' it and sent the user to llguidance. Other keys llguidance names stay named."""
    pytest.importorskip("outlines_core")
    import pydantic

    from agentflash.grammar.llguidance_backend import check_schema_supported

    class Answer(pydantic.BaseModel):
        tags: frozenset[str]

    said = ("#/properties/tags: uniqueItems is not supported (a set's or frozenset's schema; "
            "a false one asks nothing: leave it out): the grammar cannot keep an array's items "
            "apart; use a list")
    for backend in (Backend.LLGUIDANCE, Backend.OUTLINES):
        with pytest.raises(GrammarError, match=re.escape(said)):
            compile_grammar(pydantic_model(Answer), tok, backend=backend)
    with pytest.raises(GrammarError, match=re.escape(said)):
        check_schema_supported(Answer.model_json_schema(), "output schema")
    with pytest.raises(GrammarError) as err:
        check_schema_supported({"type": "array", "uniqueItems": True, "contains": {}}, "s")
    assert "uniqueItems is not supported" in str(err.value)
    assert 'Unimplemented keys: ["contains"]' in str(err.value), str(err.value)


def test_a_number_llguidance_crashes_on_is_refused_where_a_tool_is_declared_too():
    """check_schema_supported (a tool's parameters, an output type, a response_format, checked
    without a tokenizer) handed {"const": -2**63} to llguidance first: a segmentation fault."""
    import subprocess
    import sys

    script = ("from agentflash.grammar.llguidance_backend import check_schema_supported\n"
              "from agentflash.grammar import GrammarError\n"
              "for schema in ({'const': -2**63}, {'type': 'object', 'properties': {'x': "
              "{'enum': [1, -2**63 + 1]}}}, {'type': 'object', 'properties': {'a': "
              "{'$ref': '#/foo'}}, 'foo': {'const': -2**63}}, {'type': 'object', "
              "'properties': {'default': {'const': -2**63}}}, {'type': 'object', 'properties': "
              "{'a': {'$ref': '#/default'}}, 'default': {'const': -2**63}}):\n"
              "    try:\n"
              "        check_schema_supported(schema, 'tool f parameters')\n"
              "    except GrammarError as err:\n"
              "        print(err)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])
    said = done.stdout.splitlines()
    assert said[0].startswith("tool f parameters: #/const: -9223372036854775808 would be "
                              "written as another number (llguidance crashes"), said
    assert said[1].startswith("tool f parameters: #/properties/x/enum: -9223372036854775807 "
                              "would be written"), said
    # a $ref reaches an object beside the schema's keywords, which the walk passed by
    assert said[2].startswith("tool f parameters: #/foo/const: -9223372036854775808 would be "
                              "written"), said
    # and a property named default, and a $ref to an object named so
    assert said[3].startswith("tool f parameters: #/properties/default/const: "), said
    assert said[4].startswith("tool f parameters: #/default/const: "), said


def test_outlines_checks_a_pattern_once_however_many_fields_share_it(tok):
    """The pattern check builds two byte automata (seconds for ^\\w{1,100}$): eight properties
    of one pattern paid it eight times."""
    pytest.importorskip("outlines_core")
    from agentflash.grammar.outlines_backend import _pattern_fault

    pattern = r"^\d{1,20}$"
    schema = {"type": "object",
              "properties": {f"p{i}": {"type": "string", "pattern": pattern} for i in range(8)}}
    _pattern_fault.cache_clear()
    compile_grammar(json_schema(schema), tok, backend=Backend.OUTLINES, use_cache=False)
    assert _pattern_fault.cache_info().misses == 1


def test_outlines_takes_a_regex_anchored_at_its_ends_as_llguidance_does(tok):
    """outlines-core 0.2.14 failed on a regex that starts with ^ or \\A ("anchored universal
    start state doesn't exist"): the output is matched whole, so there they say nothing, and
    the language is llguidance's (^a|b$ is a or b, not ab). After inline flags ((?i)^abc$) too:
    one there was refused as not at the very start, as a quantified one (^+a) was."""
    pytest.importorskip("outlines_core")
    cases = [("^abc$", ["abc"], ["ab", "abcc"]), (r"\A(?:a|b)\z", ["a", "b"], ["ab"]),
             ("^a|b$", ["a", "b"], ["ab", "a|b"]), ("^$", [""], ["a"]),
             (r"^a\$", ["a$"], ["a"]), (r"^[0-9]+\\z", ["1\\z"], ["1"]),
             ("(?i)^abc$", ["abc", "AbC"], ["abcd", "x"]), ("(?i)(?-u)\\Aab\\z", ["aB"], ["b"])]
    for pattern, taken, refused in cases:
        grammars = [compile_grammar(regex(pattern), tok, backend=backend) for backend in BACKENDS]
        for text in taken + refused:
            assert [_accepts(g, tok, text) for g in grammars] == [text in taken] * 2, (
                pattern, text)
    for pattern in ["(^a)|b", "^+a", "^{1}a"]:  # (llguidance takes ^+ and ^{1})
        with pytest.raises(GrammarError, match=r"takes '\^' or '\\A' only at the very start, "
                           r"after inline flags alone \(where they are dropped\), not quantified"):
            compile_grammar(regex(pattern), tok, backend=Backend.OUTLINES)


def test_a_grammar_whose_masks_llguidance_cannot_compute_is_refused_when_compiled(tok):
    """llguidance computed the first mask of a^1000000, then failed every later one (a lexer
    limit): compiling passed, and every request failed at its first step."""
    with pytest.raises(GrammarError, match="regex: .*too many expressions constructed"):
        compile_grammar(regex("a{1000}{1000}"), tok)
    schema = {"type": "object", "properties": {"a": {"type": "string",
                                                     "pattern": "^a{1000}{1000}$"}},
              "required": ["a"]}
    with pytest.raises(GrammarError,
                       match="answer.json: #/properties/a/pattern: .*too many expressions"):
        compile_grammar(json_schema(schema, origin="answer.json"), tok)


def test_a_request_that_reaches_a_lexer_limit_fails_alone(tok):
    """The requests of a cached grammar share its lexer: one that wrote into a field whose
    pattern reaches llguidance's limit made every other request of that grammar fail, those
    running and those to come, until the grammar left the cache."""
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "code": {"type": "string",
                                           "pattern": "^x([a-z]{1,50}){1,50}$"}}}
    grammar = compile_grammar(json_schema(schema), tok)  # its first steps reach no limit

    def write(constraint, text):
        for token in tok(text, add_special_tokens=False)["input_ids"]:
            constraint.bitmask()
            constraint.advance([token])
        return constraint.is_accepting()

    running = grammar.new_constraint()
    write(running, '{"n": ')
    with pytest.raises(GrammarFailed, match="too many expressions") as failed:
        write(grammar.new_constraint(), '{"code": "x' + "abcdefghij" * 6)  # ~30 letters in
    assert failed.value.limit  # the schema's, which a server answers with a 400
    # a token the matcher refuses is no limit: a fault (a 500), not the request's schema
    refused = grammar.new_constraint()
    with pytest.raises(GrammarFailed) as failed:
        refused._consume(tok("}", add_special_tokens=False)["input_ids"])
    assert not failed.value.limit
    assert write(running, "12}")
    assert write(grammar.new_constraint(), '{"n": 1}')
    assert write(compile_grammar(json_schema(schema), tok).new_constraint(), '{"n": 2}')


def test_a_lexer_limit_met_while_validating_is_a_limit_not_a_refused_token(tok):
    # llguidance's validate_tokens says "0 valid", no error, where its lexer meets the limit:
    # the token was refused (GrammarViolation; a 500 in serve), and the retry on a lexer of
    # the request's own never ran
    schema = {"type": "object", "properties": {"a": {"type": "string",
                                                      "pattern": "^([a-z]{1,50}){1,50}$"}},
              "required": ["a"]}
    grammar = compile_grammar(json_schema(schema), tok)
    constraint = grammar.new_constraint()
    constraint.advance(tok.encode('{"a": "', add_special_tokens=False))
    name = tok.encode("name", add_special_tokens=False)
    written = 0
    with pytest.raises(GrammarFailed, match="too many expressions") as failed:
        while written < 200:
            constraint.advance(name)
            written += 1
    assert failed.value.limit and written > 20  # (the shared lexer's limit came at 15)


def test_a_shared_matcher_that_refuses_what_the_grammar_allows_is_left_for_one_of_its_own(tok):
    # where another path's limit (a walk's validation, which says only "fewer valid") left the
    # shared lexer refusing, the consume failed as "doesn't satisfy the grammar": a fault, a
    # 500 in serve (seen under load). Here the shared matcher is made to fail by a bad token
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    grammar = compile_grammar(json_schema(schema), tok)
    constraint = grammar.new_constraint()
    start = tok.encode('{"n": ', add_special_tokens=False)
    constraint.advance(start)
    assert not constraint._matcher.consume_tokens(tok.encode("}}", add_special_tokens=False))
    # the engine commits what verification found legal (``greedy_verify``): on one of its own
    constraint._commit(tok.encode("12}", add_special_tokens=False))
    assert constraint.is_accepting() and constraint._generation is None
    truly = grammar.new_constraint()  # a token no matcher takes: still the request's fault
    truly.advance(start)
    with pytest.raises(GrammarFailed) as failed:
        truly._consume(tok.encode("x", add_special_tokens=False))
    assert not failed.value.limit


def test_threads_compiling_one_new_grammar_at_once_compile_it_once(tok, monkeypatch):
    """The server prepares requests in worker threads: a burst of first requests with the same
    tools compiled them (and converted a 151k-token tokenizer) once per thread."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from agentflash.grammar import compiler

    built, build = [], compiler._build

    def slow_build(*args):
        built.append(args[1])
        time.sleep(0.2)  # the others ask meanwhile
        return build(*args)

    monkeypatch.setattr(compiler, "_build", slow_build)
    source = regex("[0-9]{3}-once")
    with ThreadPoolExecutor(6) as pool:
        grammars = list(pool.map(lambda _: compile_grammar(source, tok), range(6)))
    assert built == [source] and all(g is grammars[0] for g in grammars)
    with ThreadPoolExecutor(3) as pool:  # a source that fails is kept by none
        errors = list(pool.map(lambda _: pytest.raises(GrammarError, compile_grammar,
                                                       regex("a[b"), tok), range(3)))
    assert len(errors) == 3 and built.count(regex("a[b")) == 3


def test_a_token_made_special_is_a_new_tokenizer_to_the_cache(demo_tokenizer_dir):
    """The fingerprint was remembered by the tokenizer's size, which making an existing token
    special keeps: a grammar compiled before, that writes the token as text, was reused."""
    from agentflash.grammar.tokenizers import tokenizer_fingerprint

    mine = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    word = next(w for w in mine.get_vocab() if w.isascii() and w.isalpha() and len(w) >= 3)
    source = json_schema({"type": "string", "enum": [word]}, origin="enum")
    compile_grammar(source, mine)
    before = tokenizer_fingerprint(mine)
    mine.add_special_tokens({"additional_special_tokens": [word]})
    assert tokenizer_fingerprint(mine) != before
    with pytest.raises(GrammarError, match="the text of a special token"):
        compile_grammar(source, mine)
    # an added token made special keeps the count of added tokens too
    mine.add_tokens(["zzqq"])
    source = json_schema({"type": "string", "enum": ["zzqq"]}, origin="enum")
    compile_grammar(source, mine)
    mine.add_special_tokens({"additional_special_tokens": ["zzqq"]})
    with pytest.raises(GrammarError, match="the text of a special token"):
        compile_grammar(source, mine)


def test_model_vocab_smaller_than_the_tokenizer_is_an_error(tok):
    with pytest.raises(GrammarError, match="smaller than the tokenizer"):
        compile_grammar(regex("a"), tok, vocab_size=len(tok) - 1)


# --- the compile cache -------------------------------------------------------------------------


def test_the_compile_cache_holds_a_bounded_weight_of_sources():
    from agentflash.grammar.compiler import LRU

    cache = LRU(3, max_weight=10, weigh=len)
    for key in ("aaaa", "bbbb", "cccc"):  # 12 > 10: the oldest goes
        cache.put(key, key.upper())
    assert (cache.get("aaaa"), cache.get("bbbb"), cache.weight) == (None, "BBBB", 8)
    cache.put("x" * 50, "big")  # kept alone, whatever its weight
    assert (len(cache), cache.weight, cache.get("cccc")) == (1, 50, None)
    for key in "abcd":  # and the count still bounds it
        cache.put(key, key)
    assert (len(cache), cache.weight) == (3, 3)
    with pytest.raises(ValueError):  # a make that raises keeps nothing, weighs nothing
        cache.get_or_make("zzzzzzzz", lambda: int("z"))
    assert (len(cache), cache.weight) == (3, 3)


def test_compile_cache_keys_on_source_and_tokenizer(tok, demo_tokenizer_dir):
    schema = {"type": "object", "properties": {"cached": {"type": "boolean"}}}
    first = compile_grammar(json_schema(schema), tok)
    hits = cache_info()["hits"]
    assert compile_grammar(json_schema(dict(schema)), tok) is first
    assert cache_info()["hits"] == hits + 1
    same_files = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    assert compile_grammar(json_schema(schema), same_files) is first
    assert compile_grammar(json_schema(schema), tok, vocab_size=len(tok) + 8) is not first
    assert compile_grammar(json_schema(schema, json_style=JsonStyle.COMPACT), tok) is not first
    probes = cache_info()["patterns"]  # a pattern is probed once per tokenizer, and counted
    compile_grammar(json_schema({"type": "string", "pattern": "^[a-c]{2,9}z$"}), tok)
    assert cache_info()["patterns"] == probes + 1
    other = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    other.add_tokens(["<extra_token>"])
    assert compile_grammar(json_schema(schema), other) is not first
    assert compile_grammar(json_schema(schema), tok, use_cache=False) is not first


# --- the pieces compose into lossless constrained speculation ----------------------------------

FINITE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "unit", "days"],
    "additionalProperties": False,
}


def toy_logits(prefix: list[int], vocab: int) -> torch.Tensor:
    """A deterministic stand-in for the target: logits depend on the last three tokens."""
    seed = hash(tuple(prefix[-3:])) % (2**31)
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def plain_constrained_greedy(grammar, vocab: int) -> list[int]:
    constraint, out = grammar.new_constraint(), []
    while not constraint.is_finished():
        logits = apply_bitmask_(toy_logits(out, vocab), constraint.bitmask())
        out.append(int(logits.argmax()))
        constraint.advance(out[-1:])
    return out


def speculative_constrained_greedy(
    grammar, vocab: int, rng: random.Random, constrained: bool, reference: list[int]
):
    """Draft, cut at the first illegal token, mask every verify position along the draft, accept
    the longest agreeing prefix plus the target's token, advance over committed tokens only.
    The drafter proposes the reference continuation 60% of the time and noise otherwise."""
    constraint, out, steps = grammar.new_constraint(), [], 0
    while not constraint.is_finished():
        generator = torch.Generator().manual_seed(steps)
        guess, draft_logits = [], torch.randn(8, vocab, generator=generator)
        for slot in range(8):
            right = reference[len(out) + slot] if len(out) + slot < len(reference) else 0
            guess.append(right if rng.random() < 0.6 else rng.randrange(vocab))
            draft_logits[slot, guess[-1]] = 50.0
        if constrained:
            draft = constrained_draft(constraint, draft_logits).tokens
        else:
            draft = guess[: constraint.validate_draft(guess)]
        masks = constraint.masks_along_draft(draft)  # [len(draft) + 1, W]
        target = torch.stack([toy_logits(out + draft[:i], vocab) for i in range(len(draft) + 1)])
        choices = apply_bitmask_(target, masks).argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == choices[accepted]:
            accepted += 1
        committed = draft[:accepted] + [choices[accepted]]
        if draft[:accepted][-1:] == [constraint.eos_token_id]:
            committed = draft[:accepted]
        constraint.advance(committed)
        out += committed
        steps += 1
    return out, steps


@pytest.mark.parametrize("constrained", [False, True])
def test_speculative_verify_equals_plain_constrained_decoding(tok, constrained):
    vocab = len(tok) + 40
    grammar = compile_grammar(json_schema(FINITE), tok, vocab_size=vocab)
    plain = plain_constrained_greedy(grammar, vocab)
    jsonschema.validate(json.loads(decoded(tok, plain)), FINITE)
    for seed in range(3):
        fast, steps = speculative_constrained_greedy(
            grammar, vocab, random.Random(seed), constrained, plain
        )
        assert fast == plain
        assert steps < len(plain)


def test_schemas_take_no_keys_they_do_not_list_unless_they_say_so(tok):
    """Generation closes objects (OpenAI's strict mode; outlines' and xgrammar's default): JSON
    Schema alone would let the model add any key, and the demo model does until max tokens."""
    listed = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = tok.encode('{"a": 1, "b": 2}', add_special_tokens=False)
    closed_at = len(tok.encode('{"a": 1', add_special_tokens=False))
    cases = [
        (json_schema(listed), closed_at),
        (json_schema({**listed, "additionalProperties": True}), len(extra)),
        (json_schema(listed, strict=False), len(extra)),
    ]
    for source, legal in cases:
        constraint = compile_grammar(source, tok).new_constraint()
        assert constraint.validate_draft(extra) == legal, source.text
    # left open: the branches of an allOf (each closed would forbid the other's key), and an
    # object that requires a key it does not list
    both = {"allOf": [listed, {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert close_objects(both) == both
    unlisted = {"type": "object", "properties": {"a": {}}, "required": ["b"]}
    assert close_objects(unlisted) == unlisted
    nested = {"type": "array", "items": listed}
    assert close_objects(nested)["items"]["additionalProperties"] is False
    # nor one whose const or enum lists the objects it may be: closed, a const with a key its
    # properties do not list was refused ("required property 'b' is unsatisfiable")
    const = {"type": "object", "properties": {"a": {"type": "integer"}}, "const": {"a": 1, "b": 2}}
    assert close_objects(const) == const
    only = compile_grammar(json_schema(const), tok).new_constraint()
    assert only.validate_draft(extra) == len(extra)
    # nor the schemas that describe one object together: $defs an allOf names, a $ref beside
    # properties, anyOf branches beside properties of their own (each was refused: "required
    # property 'x' is unsatisfiable"); a $defs object used alone is still closed
    x = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    y = {"type": "object", "properties": {"y": {"type": "string"}}, "required": ["y"]}
    composed = [
        ({"$defs": {"a": x, "b": y}, "allOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]},
         '{"x": 1, "y": "a"}'),
        ({"$defs": {"a": x}, "$ref": "#/$defs/a", "properties": {"y": {"type": "string"}},
          "required": ["y"]}, '{"x": 1, "y": "a"}'),
        ({"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
          "anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
         '{"kind": "k", "b": 2}'),
    ]
    # however the allOf's ref reaches the object: an anchor, an escaped pointer, a ref to a ref,
    # a pointer into properties (each was closed, and refused as unsatisfiable)
    b = {"properties": {"b": {"type": "integer"}}, "required": ["b"]}
    composed += [
        ({"$defs": {"base": {**x, "$anchor": "base"}}, "allOf": [{"$ref": "#base"}, b]},
         '{"x": 1, "b": 2}'),
        ({"$defs": {"ba/se": x}, "allOf": [{"$ref": "#/$defs/ba~1se"}, b]}, '{"x": 1, "b": 2}'),
        ({"$defs": {"base": x, "alias": {"$ref": "#/$defs/base"}},
          "allOf": [{"$ref": "#/$defs/alias"}, b]}, '{"x": 1, "b": 2}'),
        ({"type": "object", "properties": {"p": x, "q": {"allOf": [{"$ref": "#/properties/p"},
                                                                    b]}}},
         '{"q": {"x": 1, "b": 2}}'),
        # an anyOf in an allOf's branch, there or where its ref points (closed, refused)
        ({"allOf": [{"anyOf": [x]}, b]}, '{"x": 1, "b": 2}'),
        ({"$defs": {"base": x, "alias": {"anyOf": [{"$ref": "#/$defs/base"}]}},
          "allOf": [{"$ref": "#/$defs/alias"}, b]}, '{"x": 1, "b": 2}'),
        # a ref or an anyOf beside an allOf, and a ref by the root's own $id
        ({"$defs": {"base": x}, "$ref": "#/$defs/base", "allOf": [b]}, '{"x": 1, "b": 2}'),
        ({"anyOf": [x], "allOf": [b]}, '{"x": 1, "b": 2}'),
        ({"$id": "https://e.x/s", "$defs": {"base": x},
          "allOf": [{"$ref": "https://e.x/s#/$defs/base"}, b]}, '{"x": 1, "b": 2}'),
        ({"$id": "https://e.x/s", "$defs": {"base": x}, "allOf": [{"$ref": "s#/$defs/base"}, b]},
         '{"x": 1, "b": 2}'),
    ]
    for schema, text in composed:
        jsonschema.validate(json.loads(text), schema)
        ids = tok.encode(text, add_special_tokens=False)
        assert compile_grammar(json_schema(schema), tok).new_constraint().validate_draft(
            ids) == len(ids), schema
    alone = close_objects({"$defs": {"a": x}, "properties": {"p": {"$ref": "#/$defs/a"}}})
    assert alone["$defs"]["a"]["additionalProperties"] is False
    # "a or b" beside a ref adds no keys: the object it names stays closed (it was left open,
    # and took invented keys, as any anyOf beside a ref counted as describing the object)
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    for either in ({"anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
                   {"allOf": [{"required": ["a"]}]},
                   {"$defs": {"ra": {"required": ["a"]}},
                    "anyOf": [{"$ref": "#/$defs/ra"}, {"required": ["b"]}]},
                   # what says nothing of keys (OpenAPI's nullable, an extension, a title,
                   # a minProperties within its keys) kept it open, and took invented keys
                   {"nullable": True, "x-order": 1, "title": "T", "minProperties": 1}):
        either_closed = close_objects({"$defs": {"m": ab, **either.pop("$defs", {})},
                                       "$ref": "#/$defs/m", **either})
        assert either_closed["$defs"]["m"]["additionalProperties"] is False, either
    # a chain of 20 compositions to "required a": read through, whatever met it first (a
    # verdict cut at a depth was kept, and the order of two properties opened the object)
    chain = {"m": ab, "r20": {"required": ["a"]}} | {
        f"r{i}": {"allOf": [{"$ref": f"#/$defs/r{i + 1}"}]} for i in range(20)}
    short = {"$ref": "#/$defs/m", "allOf": [{"$ref": "#/$defs/r15"}]}
    deep = {"$ref": "#/$defs/m", "allOf": [{"$ref": "#/$defs/r0"}]}
    for props in ({"s": short, "d": deep}, {"d": deep, "s": short}):
        ordered = close_objects({"$defs": chain, "type": "object", "properties": props})
        assert ordered["$defs"]["m"]["additionalProperties"] is False, list(props)
    # past Python's recursion a chain leaves its ref's object open, and no other's: a shorter
    # chain into its middle is read through whichever property comes first
    n = 150  # (about 8 frames a link: past the limit set below at about 125 links)
    long = {f"r{n}": {"required": ["a"]}} | {
        f"r{i}": {"allOf": [{"$ref": f"#/$defs/r{i + 1}"}]} for i in range(n)}
    deep = {"$ref": "#/$defs/m1", "allOf": [{"$ref": "#/$defs/r0"}]}
    mid = {"$ref": "#/$defs/m2", "allOf": [{"$ref": f"#/$defs/r{n - 60}"}]}
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    limit = sys.getrecursionlimit()
    for props in ({"d": deep, "s": mid}, {"s": mid, "d": deep}):
        sys.setrecursionlimit(depth + 1000)  # 150 links past it, 60 within it
        try:
            ordered = close_objects({"$defs": {"m1": ab, "m2": dict(ab)} | long,
                                     "type": "object", "properties": props})
        finally:
            sys.setrecursionlimit(limit)
        assert ordered["$defs"]["m2"]["additionalProperties"] is False, list(props)
    # "a or b" written inline closes its object too (any composition kept it open: invented
    # keys were taken), and each of a and b still may be written
    for inline in ({"anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
                   {"allOf": [{"required": ["a"]}]}):
        grammar = compile_grammar(json_schema({**ab, **inline}), tok)
        invented = tok.encode('{"a": 1, "zz": 2}', add_special_tokens=False)
        assert grammar.new_constraint().validate_draft(invented) < len(invented), inline
        written = tok.encode('{"a": 1}', add_special_tokens=False) + [tok.eos_token_id]
        assert grammar.new_constraint().validate_draft(written) == len(written), inline
    alias = close_objects({"$defs": {"m": ab, "alias": {"$ref": "#/$defs/m"}},
                           "$ref": "#/$defs/alias", "required": ["a"]})  # (keys through refs)
    assert alias["$defs"]["m"]["additionalProperties"] is False
    with pytest.raises(GrammarError, match=r"#/required/0: not a valid JSON Schema"):
        json_schema({"$defs": {"m": ab}, "$ref": "#/$defs/m", "required": [["a"]]})
    # but beside a ref, a key it does not list, other keys allowed, or objects enumerated leave
    # its object open (closed, each was refused as unsatisfiable, a tool dropped from a union)
    for beside, text in (({"required": ["c"]}, '{"c": 1}'),
                         ({"anyOf": [{"required": ["c"]}]}, '{"c": 1}'),
                         ({"allOf": [{"additionalProperties": True}]}, '{"z": 1}'),
                         ({"anyOf": [{"const": {"c": 1}}]}, '{"c": 1}'),
                         ({"patternProperties": {"^x-": {"type": "integer"}}}, '{"x-y": 1}')):
        schema = {"$defs": {"m": ab}, "$ref": "#/$defs/m", **beside}
        jsonschema.validate(json.loads(text), schema)
        ids = tok.encode(text, add_special_tokens=False)
        assert compile_grammar(json_schema(schema), tok).new_constraint().validate_draft(
            ids) == len(ids), beside
    # a ref no URI can be (the schema's checks name it: it was "not JSON-serialisable")
    with pytest.raises(GrammarError, match=r"#/allOf/0: Invalid URI reference 'http://\[/x'"):
        compile_grammar(json_schema({"$id": "https://e.x/s", "properties": {"a": {}},
                                     "allOf": [{"$ref": "http://[/x"}]}), tok)
    # one dict at two places (a Python schema's, YAML's alias): where no ref composes it, it is
    # closed (it was left open at both places, as the objects were told apart by id)
    shared = close_objects({"$defs": {"a": x}, "properties": {
        "p": x, "q": {"allOf": [{"$ref": "#/$defs/a"}, b]}}})
    assert shared["properties"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in shared["$defs"]["a"]


def test_what_composes_an_object_is_found_in_one_walk(monkeypatch):
    # a chain of $defs each an anyOf of the next, reached from an allOf: each link found walked
    # the whole schema again (2,000 links: 45 s of CPU in a request's close_objects)
    from agentflash.grammar import sources

    n = 200
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]}
            for i in reversed(range(n - 1))}
    defs[f"d{n - 1}"] = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"type": "object", "$defs": defs,
              "allOf": [{"$ref": "#/$defs/d0"}, {"properties": {"b": {"type": "integer"}}}]}
    calls = []
    with_subschemas = sources.with_subschemas
    monkeypatch.setattr(sources, "with_subschemas",
                        lambda node, each: calls.append(1) or with_subschemas(node, each))
    closed = close_objects(schema)
    assert "additionalProperties" not in closed["$defs"][f"d{n - 1}"]  # composed: left open
    assert len(calls) < 20 * n  # each node walked at most twice, then closed once


def test_a_ref_to_an_anchor_is_followed(tok):
    # it was refused as a recursion without end: "#num" was read as the root
    schema = {"$defs": {"n": {"$anchor": "num", "type": "integer", "maximum": 3}},
              "type": "object", "properties": {"x": {"$ref": "#num"}}, "required": ["x"]}
    grammar = compile_grammar(json_schema(schema), tok)
    for text, legal in (('{"x": 3}', True), ('{"x": 4}', False)):
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        assert (grammar.new_constraint().validate_draft(ids) == len(ids)) == legal, text


def test_a_schemas_anchors_are_found_in_one_walk_whatever_their_number(monkeypatch):
    # each "#name" walked the whole schema: an input schema of 5,000 of them took 70 s to check
    from agentflash.grammar import checks

    n = 300
    schema = {"type": "object", "properties": {f"p{i}": {"$ref": f"#a{i}"} for i in range(n)},
              "$defs": {f"d{i}": {"$anchor": f"a{i}", "type": "integer"} for i in range(n)}}
    schema["$defs"]["d0"]["$dynamicAnchor"] = "a1"  # the first subschema declaring a name wins
    walks = []
    subschemas = checks.subschemas
    monkeypatch.setattr(checks, "subschemas",
                        lambda node, path: walks.append(path) or subschemas(node, path))
    for check in (checks.unresolved_ref, checks.ref_loop, checks.recursive_ref,
                  checks._unfinishable):
        walks.clear()
        assert check(schema) is None
        assert len([path for path in walks if path == []]) <= 2, check  # from the root
    assert checks.resolve_ref(schema, "#a1") is schema["$defs"]["d0"]
    assert checks.resolve_ref(schema, "#a7") is schema["$defs"]["d7"]
    assert checks.resolve_ref(schema, "#none") is None


@pytest.mark.parametrize("content, message", [
    (None, "schema file does not exist"),
    ('{"type": ', ":1:10: invalid JSON"),
    ('{"type": "objec"}', "#/type: not a valid JSON Schema"),
])
def test_grammar_bench_names_a_bad_schema_file_on_one_line(tmp_path, capsys, content, message):
    from agentflash.grammar.bench import main

    path = tmp_path / "s.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["--schema", str(path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith(f"error: {path}") and message in err
    assert len(err.strip().splitlines()) == 1


def _nested(depth: int, key: str) -> dict:
    """A schema whose JSON nests ``depth`` objects and arrays deep, by ``key`` (an ``items``
    is one level, a ``properties``, ``allOf`` or ``anyOf`` two: one ``items`` evens it)."""
    schema: dict = {"type": "string"}
    levels, step = 1, 1 if key == "items" else 2
    while levels + step <= depth:
        schema = {"type": "array", "items": schema} if key == "items" else \
            {"type": "object", "properties": {"a": schema}} if key == "properties" else \
            {key: [schema, {"type": "null"}]}
        levels += step
    return schema if levels == depth else {"type": "array", "items": schema}


def _deep_in_stack(frames: int, call):
    return call() if frames == 0 else _deep_in_stack(frames - 1, call)


def test_a_schema_nested_past_llguidance_reader_is_refused_by_its_depth(tok):
    import llguidance

    from agentflash.grammar.checks import MAX_JSON_BODY_DEPTH, MAX_SCHEMA_DEPTH, json_depth
    from agentflash.grammar.tool_calls import (
        MAX_TOOL_DEPTH,
        assistant_turn,
        tool_call_body,
        tool_specs,
    )
    from agentflash.runtime.agent import output_spec

    # the limit is llguidance's: its JSON reader takes a schema 124 deep and no deeper
    assert MAX_SCHEMA_DEPTH == 124
    for depth in (MAX_SCHEMA_DEPTH, MAX_SCHEMA_DEPTH + 1):
        text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_nested(depth, "items")))
        error = llguidance.LLMatcher.validate_grammar(text)
        assert ("recursion limit exceeded" in error) == (depth > MAX_SCHEMA_DEPTH), error
    assert json_depth({"a": [[], {}]}, 10) == 3 and json_depth("a", 10) == 0
    cycle: dict = {}
    cycle["a"] = [cycle]
    assert json_depth(cycle, 10) == 11  # (stops past the limit)
    with pytest.raises(GrammarError, match="not JSON-serialisable: Circular reference"):
        json_schema(cycle)
    # at the limit it compiles, one past it is refused saying why, before llguidance's
    # "recursion limit exceeded" (a build that passed or not by Python's stack: 125-160 items
    # and 85-95 allOf were accepted and failed at compile); and so 700 frames deep
    past = f"schema: the schema is nested too deeply: more than {MAX_SCHEMA_DEPTH} levels"
    for key in ("items", "properties", "allOf", "anyOf"):
        at, over = _nested(MAX_SCHEMA_DEPTH, key), _nested(MAX_SCHEMA_DEPTH + 1, key)
        assert json_depth(at, 200) == MAX_SCHEMA_DEPTH == json_depth(over, 200) - 1
        for frames in (0, 700):
            compile_grammar(_deep_in_stack(frames, lambda s=at: json_schema(s)), tok)
            with pytest.raises(GrammarError, match=past):
                _deep_in_stack(frames, lambda s=over: json_schema(s))
    with pytest.raises(GrammarError, match=past):  # (where jsonschema's walk ran out of stack)
        json_schema(_nested(160, "items"))
    # jsonschema's walk of a schema at the limit (8 frames a level) has its room: the verdict
    # names the fault, not the depth
    wrong = _nested(MAX_SCHEMA_DEPTH, "items")
    node = wrong
    while "items" in node:
        node = node["items"]
    node["type"] = "strin"
    with pytest.raises(GrammarError, match=r"schema: #(/items)+/type: not a valid JSON Schema"):
        json_schema(wrong)
    # a response format / an agent's output schema: the same verdict
    with pytest.raises(GrammarError, match=past.replace("schema:", "output schema:")):
        assistant_turn([], "auto", output_schema=_nested(MAX_SCHEMA_DEPTH + 1, "allOf"))
    compile_grammar(assistant_turn([], "auto", output_schema=_nested(MAX_SCHEMA_DEPTH, "allOf")),
                    tok)
    with pytest.raises(GrammarError, match=past.replace("schema:", "output schema:")):
        output_spec(_nested(MAX_SCHEMA_DEPTH + 1, "properties"))
    # a date's pattern beside another goes 2 levels down (an allOf): within the limit with it,
    # it compiles; past it, it is refused when the agent is built and at its turn, saying so
    # (the first turn met llguidance's "recursion limit exceeded")
    dated = {"type": "string", "format": "date", "pattern": "^2"}
    for depth in (MAX_SCHEMA_DEPTH - 2, MAX_SCHEMA_DEPTH - 1):
        schema = dict(dated)
        for _ in range(depth - 1):
            schema = {"type": "array", "items": schema}
        if depth == MAX_SCHEMA_DEPTH - 2:
            output_spec(schema)
            compile_grammar(assistant_turn([], "auto", output_schema=schema), tok)
            continue
        for build in (output_spec, lambda s: assistant_turn([], "auto", output_schema=s)):
            with pytest.raises(GrammarError, match=past.replace("schema:", "output schema:")
                               + r".* \(with the date patterns its formats add\)"):
                build(schema)
    # a tool's parameters sit 4 levels down in the tools' union, which a turn's grammar holds
    # in a Lark rule's %json body, read on its own (127 levels): at their own limit they
    # compile there, one past it they are refused when the tool is declared (121-123 were
    # refused, at a limit of 124 less 4); a date's pattern beside another, 2 levels down in an
    # allOf, counts (past the limit it met llguidance's "recursion limit exceeded")
    for depth in (MAX_JSON_BODY_DEPTH, MAX_JSON_BODY_DEPTH + 1):
        text = llguidance.LLMatcher.grammar_from_lark(
            f"start: %json {json.dumps(_nested(depth, 'items'))}\n")
        error = llguidance.LLMatcher.validate_grammar(text)
        assert ("recursion limit exceeded" in error) == (depth > MAX_JSON_BODY_DEPTH), error

    def tools(depth: int, key: str = "anyOf", leaf: dict | None = None) -> list[dict]:
        chain = _nested(depth - 2, key)
        node = chain
        while "items" in node or key in node:
            node = node["items"] if "items" in node else node[key][0]
        node.update(leaf or {})
        params = {"type": "object", "properties": {"a": chain}}
        assert json_depth(params, 200) == depth
        return [{"type": "function", "function": {"name": "f", "parameters": params}}]

    assert MAX_TOOL_DEPTH == MAX_JSON_BODY_DEPTH - 4 == 123
    too_deep = r"tools\[0\] \(f\) parameters: the schema is nested too deeply: more than 123 levels"
    date = {"format": "date", "pattern": "^2"}
    for key in ("anyOf", "items"):
        for choice in ("required", "auto"):
            compile_grammar(assistant_turn(tool_specs(tools(MAX_TOOL_DEPTH, key)), choice), tok)
        compile_grammar(assistant_turn(tool_specs(tools(MAX_TOOL_DEPTH - 2, key, date)), "auto"),
                        tok)
        with pytest.raises(GrammarError, match=too_deep + r".*%json body \(127\) less the 4"):
            tool_specs(tools(MAX_TOOL_DEPTH + 1, key))
        with pytest.raises(GrammarError, match=too_deep + r".* \(with the date patterns"):
            tool_specs(tools(MAX_TOOL_DEPTH - 1, key, date))
    # one call's body alone is a JSON Schema grammar (124): deeper parameters refused, saying so
    compile_grammar(tool_call_body(tool_specs(tools(MAX_SCHEMA_DEPTH - 4, "items"))), tok)
    with pytest.raises(GrammarError, match=r"tools: the schema is nested too deeply: more than "
                                           r"124 levels.*parameters 4 levels down.*120 at most"):
        tool_call_body(tool_specs(tools(MAX_SCHEMA_DEPTH - 3, "items")))


def test_recursion_room_keeps_a_limit_set_while_it_is_held():
    """A recursion limit something else sets while a ``recursion_room`` block runs (torch's
    compile raises it to 2000) stays when the blocks end, though another block raised it
    meanwhile (the last block to end put back the limit from before the first)."""
    from agentflash.grammar.checks import recursion_room

    before = sys.getrecursionlimit()
    try:
        with recursion_room():
            assert sys.getrecursionlimit() > before  # (12 frames a level of 124, above ours)
            with recursion_room():  # within room already: nothing to raise
                pass
            assert sys.getrecursionlimit() > before
        assert sys.getrecursionlimit() == before
        with recursion_room():
            theirs = sys.getrecursionlimit() + 500
            sys.setrecursionlimit(theirs)
            with recursion_room(frames=theirs + 1000):  # (a request's block, deeper down)
                assert sys.getrecursionlimit() > theirs
            assert sys.getrecursionlimit() > theirs
        assert sys.getrecursionlimit() == theirs
        with recursion_room():
            sys.setrecursionlimit(theirs + 1)
        assert sys.getrecursionlimit() == theirs + 1
    finally:
        sys.setrecursionlimit(before)


def test_schemas_python_or_llguidance_cannot_take_are_grammar_errors(tok, tmp_path):
    # an unsupported keyword beside listed properties: strict mode adds a boolean subschema
    # (additionalProperties false), which the search for the failing field must step over
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "not": {"required": []}}
    for strict in (True, False):
        with pytest.raises(GrammarError, match=r'schema: #: Unimplemented keys: \["not"\]'):
            compile_grammar(json_schema(schema, strict=strict), tok)
    deep: dict = {"type": "integer"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(GrammarError, match="nested too deeply"):
        json_schema(deep)
    (tmp_path / "twice.json").write_text('{"properties": {"a": {}}, "properties": {"b": {}}}')
    with pytest.raises(GrammarError, match="the key 'properties' is given twice in one object"):
        json_schema_file(tmp_path / "twice.json")  # (the first was dropped without a word)
    (tmp_path / "nan.json").write_text('{"const": NaN}')
    with pytest.raises(GrammarError, match="NaN is not a JSON number"):
        json_schema_file(tmp_path / "nan.json")
    (tmp_path / "latin1.json").write_bytes('{"enum": ["caf\u00e9"]}'.encode("latin-1"))
    with pytest.raises(GrammarError, match="not UTF-8 text"):
        json_schema_file(tmp_path / "latin1.json")


def test_first_allowed_token_is_the_least_allowed_id():
    """``first_allowed_token`` (the compile's probe of a first step) is ``allowed_token_ids``'s
    first, bits past the vocabulary in the last word ignored."""
    from agentflash.grammar.constraint import first_allowed_token

    rng = random.Random(0)
    for vocab in (1, 31, 32, 33, 100, 151_936):
        for allowed in ([], [0], [vocab - 1], sorted(rng.sample(range(vocab), min(vocab, 5))),
                        list(range(vocab))):
            mask = allocate_bitmask(1, vocab)[0]
            words = mask.numpy().view("uint32")
            for token in allowed:
                words[token // 32] |= 1 << (token % 32)
            expected = allowed_token_ids(mask, vocab)[:1]
            assert [first_allowed_token(mask, vocab)] == (expected or [None])
            words[-1] |= 1 << 31 if vocab % 32 else 0  # a bit past the vocabulary
            assert [first_allowed_token(mask, vocab)] == (expected or [None])


def test_take_commits_exactly_the_tokens_allows_lets_through(tok, closers):
    # take (a walk's check and commit in one; llguidance's try_consume_tokens where no token is
    # forced) answers as allows does, and leaves the state advance leaves
    rng = random.Random(3)
    schema = random_schema(random.Random(3), kind="object")
    grammar = compile_grammar(json_schema(schema), tok, vocab_size=len(tok) + 40)
    constraint = grammar.new_constraint()
    answers = set()
    for token in walk(tok, closers, grammar, 3)[:-1]:
        for probe in [token, *rng.sample(range(grammar.vocab_size), 6)]:
            ahead = constraint._copy()
            allowed = ahead.allows(probe)
            answers.add(allowed)
            assert ahead.take(probe) == allowed
            assert ahead.num_tokens == constraint.num_tokens + allowed
            if allowed and probe != grammar.eos_token_id:
                assert ahead._fed == constraint._fed + [probe]
                assert torch.equal(ahead.bitmask(), constraint.mask_after([probe]))
        constraint.advance([token])
    assert answers == {True, False}
