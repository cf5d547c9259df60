"""Tokenizers of other families than the demo's byte-level BPE, on tiny random-weight models:
SentencePiece-style BPE with byte fallback (Llama 2, Mistral), tool-call tags made special
tokens, and decoders llguidance cannot read."""

import json
import re

import pytest
from typer.testing import CliRunner

from agentflash.cli import app

CORPUS = [
    json.dumps({"name": "get_weather", "arguments": {"city": word, "days": n}})
    + f" the lazy dog {word} jumps over the quick brown fox {n}.\n"
    for n, word in enumerate(["Oslo", "Paris", "hello", "world", "forecast", "value"] * 20)
]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BYTES = [f"<0x{i:02X}>" for i in range(256)]
# Llama 2's decoder: the first token's leading space is stripped
STRIP = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1,
                                                 "stop": 0}]}
# Metaspace inside a Sequence: llguidance reads ▁ as its three bytes, not a space
META_IN_SEQUENCE = {"type": "Sequence", "decoders": [
    {"type": "ByteFallback"},
    {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}]}


def _save(tok, path, eos, special_tags=False, added=(), added_special=False, **names):
    import torch
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in ("<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(s, special=special_tags, normalized=False)
                    for s in ("<tool_call>", "</tool_call>")])
    tok.add_tokens([AddedToken(s, special=added_special, normalized=False) for s in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos,
                                   clean_up_tokenization_spaces=False, **names)
    fast.chat_template = CHAT
    fast.save_pretrained(path)
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(fast) + 8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        eos_token_id=fast.convert_tokens_to_ids(eos), tie_word_embeddings=True,
    )).save_pretrained(path)
    return path


def _sentencepiece(path, decoder):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *BYTES], limit_alphabet=60))
    spec = json.loads(tok.to_str())
    # byte tokens are ordinary vocabulary, as Llama's; a normalizer puts the ▁ in
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] not in BYTES]
    spec["pre_tokenizer"] = None
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    spec["decoder"] = decoder
    return _save(Tokenizer.from_str(json.dumps(spec)), path, "</s>", bos_token="<s>",
                 unk_token="<unk>")


def _byte_level(path, special_tags, added=(), added_special=False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _save(tok, path, "<|im_end|>", special_tags=special_tags, added=added,
                 added_special=added_special)


def _unigram(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<unk>", "</s>"], unk_token="<unk>"))
    return _save(tok, path, "</s>", unk_token="<unk>")


def generate(model, *flags):
    result = CliRunner().invoke(app, ["generate", "--model", str(model), "--prompt", "hi",
                                      "--drafter", "none", *flags])
    return result.exit_code, result.stdout, result.stderr


def test_a_sentencepiece_reply_keeps_the_space_the_grammar_wrote(tmp_path):
    # a Llama 2 decoder strips the first token's space, which the regex counted: " lazy" was
    # returned as "lazy", outside the regex it was bound to
    model = _sentencepiece(tmp_path, STRIP)
    texts = []
    for seed in range(4):
        code, out, err = generate(model, "--regex", " [a-z]{3,8}", "--max-tokens", "12",
                                  "--temperature", "1", "--seed", str(seed), "--json")
        assert code == 0, err
        reply = json.loads(out)
        assert reply["finish_reason"] == "stop"
        texts.append(reply["text"])
    assert all(re.fullmatch(" [a-z]{3,8}", text) for text in texts), texts


def test_tool_call_tags_a_tokenizer_makes_special_are_read_as_the_call(tmp_path):
    (tmp_path / "tools.json").write_text(json.dumps([{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]))
    model = _byte_level(tmp_path / "model", special_tags=True)
    code, out, err = generate(model, "--tools", str(tmp_path / "tools.json"), "--tool-choice",
                              "get_weather", "--max-tokens", "64", "--json")
    assert code == 0, err
    reply = json.loads(out)
    assert reply["finish_reason"] == "stop", reply
    assert [call["name"] for call in reply["tool_calls"]] == ["get_weather"]
    assert reply["text"].startswith("<tool_call>") and reply["text"].endswith("</tool_call>")


def test_a_reasoning_model_s_think_tokens_are_free_text(tmp_path):
    """Qwen3's ``<think>`` and ``</think>`` are added tokens it decodes as text; llguidance
    keeps added tokens out of a text terminal, and every turn with free text (tools under
    auto or none) masked them: the model's first token was taken from it."""
    from transformers import AutoTokenizer

    from agentflash.grammar import assistant_turn
    from agentflash.grammar.compiler import compile_grammar

    tools = [{"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    think = "<think>\nthe weather\n</think>\n\n"
    turns = [("auto", think + call), ("auto", think + "Sunny."), ("auto", "So " + think + call),
             ("none", think + "Sunny."), ("none", "Sunny.</think>"), ("auto", ""),
             ("auto", call)]
    for n, added in enumerate(((), ("<think>", "</think>"), ("</think>",))):
        tok = AutoTokenizer.from_pretrained(_byte_level(tmp_path / f"m{n}", False, added))
        for choice, text in turns:
            tokens = tok(text, add_special_tokens=False)["input_ids"]
            assert all(tok.convert_tokens_to_ids(t) in tokens for t in added if t in text)
            constraint = compile_grammar(assistant_turn(tools, choice), tok).new_constraint()
            taken = [constraint.allows(t) and constraint.advance([t]) is None for t in tokens]
            assert all(taken) and constraint.is_accepting(), (added, choice, text)
        # the opening tag spelled in ordinary tokens: refused in free text, as before (its
        # text split in two runs of text escaped the grammar's check of each run)
        for choice in ("auto", "none"):
            constraint = compile_grammar(assistant_turn(tools, choice), tok).new_constraint()
            for piece in ("Hi\n", "<think>", "<tool_", "call", ">"):
                tokens = tok(piece, add_special_tokens=False)["input_ids"]
                taken = [constraint.allows(t) and constraint.advance([t]) is None
                         for t in tokens]
                if not all(taken):
                    break
            assert piece == ">" and not all(taken), (added, choice, piece)
    # a turn without free text takes none: the call (or the answer) is the whole reply
    think = tok.convert_tokens_to_ids("</think>")
    constraint = compile_grammar(assistant_turn(tools, "required"), tok).new_constraint()
    assert not constraint.allows(think)
    # a special one is decoded as nothing: between "<tool_" and "call>" it would make a call
    # the grammar never saw
    tok = AutoTokenizer.from_pretrained(_byte_level(tmp_path / "special", False,
                                                    ("<think>", "</think>"), True))
    constraint = compile_grammar(assistant_turn(tools, "none"), tok).new_constraint()
    constraint.advance(tok("Hi <tool_", add_special_tokens=False)["input_ids"])
    assert not constraint.allows(tok.convert_tokens_to_ids("<think>"))


@pytest.mark.parametrize("make, message", [
    (_unigram, "can't determine decoder type"),
    (lambda path: _sentencepiece(path, META_IN_SEQUENCE), "which llguidance reads as b'\\xe2"),
])
def test_a_tokenizer_grammars_cannot_read_is_named(tmp_path, make, message):
    model = make(tmp_path)
    code, out, err = generate(model, "--regex", "[a-z]+", "--max-tokens", "4")
    assert code == 2 and out == ""
    assert err.startswith("error: command line: TokenizersBackend: grammars cannot read this "
                          "tokenizer: ") and message in err
    assert len(err.strip().splitlines()) == 1
    code, out, err = generate(model, "--max-tokens", "4")  # without a grammar it generates
    assert code == 0, err


def test_a_byte_fallback_reply_s_step_text_holds_back_a_character_s_bytes(tmp_path):
    # a byte-fallback decoder writes a run of byte tokens that ends inside a character as one
    # U+FFFD a byte, the run's whole characters included: holding back only the last U+FFFD
    # handed out the others as final ("price 5€" fed as "price 5" and three U+FFFD), and a
    # step of several tokens (a draft block) that ended inside a character did so too
    import random

    from transformers import AutoTokenizer

    from agentflash.engine.detokenizer import OutputDecoder, StepText

    tok = AutoTokenizer.from_pretrained(_sentencepiece(tmp_path, STRIP))
    decode = OutputDecoder(tok)
    ids = tok.encode("price 5€ and 😀 ok 天气 × 5€€ ok 😀😀", add_special_tokens=False)
    assert "<0xE2>" in tok.convert_ids_to_tokens(ids)  # € is written a byte a token
    whole = decode(ids)
    rng = random.Random(0)
    for trial in range(30):  # a token a step, then random blocks
        ends = range(1, len(ids) + 1) if trial == 0 else sorted(
            set(rng.sample(range(1, len(ids)), rng.randrange(len(ids) // 2))) | {len(ids)})
        text, out = StepText(decode), ""
        for end in ends:
            out += text.delta(ids, end)
            # the text up to the last token that ended a character
            assert out == next(decode(ids[:k]) for k in range(end, -1, -1)
                               if not decode(ids[:k]).endswith("\ufffd")), (trial, end)
            assert end - text.start <= 4
        assert out == whole, (trial, out)


def test_a_byte_fallback_run_with_an_invalid_byte_is_fed_as_decoded_whole(tmp_path):
    # a byte-fallback decoder reads a run of byte tokens as one: an invalid byte in it makes
    # the whole run U+FFFD; a window cut inside the run decoded its tail alone, valid, and fed
    # the tracker '"€<tool_call>{' that the reply does not hold (it read a call)
    from transformers import AutoTokenizer

    from agentflash.engine.detokenizer import OutputDecoder, StepText
    from agentflash.router.segments import SegmentKind, SegmentTracker

    tok = AutoTokenizer.from_pretrained(_sentencepiece(tmp_path, STRIP))
    decode = OutputDecoder(tok)
    ids = [tok.convert_tokens_to_ids(f"<0x{b:02X}>")
           for b in b'\xff\xff\xff"\xe2\x82\xac<tool_call>{']
    ids += tok.encode(" ok", add_special_tokens=False)
    text, tracker, out = StepText(decode), SegmentTracker(), ""
    for end in range(1, len(ids) + 1):  # a token a step
        piece = text.delta(ids, end)
        out += piece
        tracker.feed(piece)
    assert out == decode(ids) and "<tool_call>" not in out
    assert tracker.kind is SegmentKind.PROSE and not tracker.in_tool_call
