"""The demo tokenizer: round trips, chat tokens and the chat template with tools."""

import random

from transformers import AutoTokenizer

from agentflash.train import corpus, tokenizer


def load(demo_tokenizer_dir):
    return AutoTokenizer.from_pretrained(demo_tokenizer_dir)


def test_round_trip_of_corpus_text(demo_tokenizer_dir):
    tok = load(demo_tokenizer_dir)
    rng = random.Random(3)
    for kind in corpus.KINDS.values():
        convo = kind(rng)
        text = tokenizer.render(convo["messages"], convo["tools"])
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text


def test_chat_tokens_are_single_ids_and_tool_tags_survive_decoding(demo_tokenizer_dir):
    tok = load(demo_tokenizer_dir)
    for t in tokenizer.SPECIAL_TOKENS + tokenizer.ADDED_TOKENS:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == t
    ids = tok('<tool_call>\n{"name": "f"}\n</tool_call><|im_end|>', add_special_tokens=False)[
        "input_ids"
    ]
    assert tok.decode(ids, skip_special_tokens=True) == '<tool_call>\n{"name": "f"}\n</tool_call>'
    assert tok.eos_token == tokenizer.IM_END


def test_chat_template_renders_tools_like_the_training_renderer(demo_tokenizer_dir):
    tok = load(demo_tokenizer_dir)
    rng = random.Random(11)
    for _ in range(5):
        convo = corpus.tool_call_conversation(rng)
        ours = tokenizer.render(convo["messages"], convo["tools"], add_generation_prompt=False)
        theirs = tok.apply_chat_template(convo["messages"], tools=convo["tools"], tokenize=False)
        assert ours == theirs
        assert "<tools>\n" in theirs and convo["tools"][0]["function"]["name"] in theirs
    msgs = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_openai_style_tool_calls_render_in_the_hermes_format(demo_tokenizer_dir):
    tok = load(demo_tokenizer_dir)
    msgs = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "content": '{"ok": true}'},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>' in text
    assert '<tool_response>\n{"ok": true}\n</tool_response>' in text
