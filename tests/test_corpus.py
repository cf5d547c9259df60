"""The synthetic corpus: valid tool calls against random schemas, real stdlib text, determinism."""

import json
import random

import jsonschema

from agentflash.train import corpus


def test_tool_calls_validate_against_their_generated_schemas():
    rng = random.Random(0)
    kinds = set()
    for _ in range(300):
        convo = corpus.tool_call_conversation(rng)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in convo["tools"]}
        for t in convo["tools"]:
            jsonschema.Draft202012Validator.check_schema(t["function"]["parameters"])
            kinds |= {p.get("type") for p in t["function"]["parameters"]["properties"].values()}
        for msg in convo["messages"]:
            for call in msg.get("tool_calls") or []:
                jsonschema.validate(call["arguments"], schemas[call["name"]])
            if msg["role"] == "tool":
                json.loads(msg["content"])
    assert kinds >= {"string", "integer", "number", "boolean", "array", "object"}


def test_corpus_is_deterministic_and_has_every_kind():
    cfg = corpus.CorpusConfig(seed=5, num_tool_call=20, num_code=5, num_math=5, num_prose=5)
    a, b = corpus.generate(cfg), corpus.generate(cfg)
    assert a == b
    assert {c["kind"] for c in a} == {"tool_call", "code", "math", "prose"}


def test_code_and_prose_come_from_real_stdlib_sources():
    assert len(corpus.functions()) > 500 and len(corpus.docstrings()) > 1000
    fn = corpus.functions()[0]
    compile(fn.source, "<stdlib>", "exec")
