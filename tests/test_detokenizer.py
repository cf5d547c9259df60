"""A reply's text read a step at a time (``ReplyText``, ``StopCheck``, ``Detokenizer``) against
the whole text decoded and read again at every step, as the engine did: the same stop position
and the same streamed deltas, over random texts, tokens and steps."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agentflash.engine.detokenizer import (
    Detokenizer,
    OutputDecoder,
    ReplyText,
    StopCheck,
    settled,
)
from agentflash.tool_format import CLOSE, OPEN, StopFinder, stop_at, unsettled_from

# calls (JSON or not, closed or not, a tag inside a string), stop strings, U+FFFD
FRAGMENTS = ["a", "b", " ", "\n", '"', "\\", "{", "}", "[", "]", ":", ",", "<", "</", ">",
             "tool_call>", OPEN, CLOSE, f"\n{OPEN}\n", f"\n{CLOSE}\n",
             '{"name": "f", "arguments": {"a": "', '"}}', '{"name": "f", "arguments": {}}',
             "STOP", "\ufffd", "1", "tru", "e", "null", "é€"]
STOPS = ["STOP", "<", "}", 'a"', CLOSE, OPEN, "l>", "\n\n", "\ufffd", "b<tool", '"}}\n</tool_call>',
         "a b", '"']
stops = st.lists(st.sampled_from(STOPS), min_size=1, max_size=3, unique=True)


def reference_deltas(decode, stop, tool_calls, token_ids, ends, cut):
    """The streamed deltas as ``Detokenizer.delta`` made them from the whole text each step."""
    emitted, out = 0, []
    for k, end in enumerate(ends):
        text = decode(token_ids[:end])
        if k == len(ends) - 1:
            text = text if cut is None else text[:cut]
        else:
            text = settled(text)
            held = max((n for s in stop for n in range(1, min(len(s) - 1, len(text)) + 1)
                        if s.startswith(text[-n:])), default=0)
            text = text[: len(text) - held]
            if stop and tool_calls and CLOSE in text:
                unsettled = unsettled_from(text)
                text = text if unsettled is None else text[:unsettled]
        out.append(text[emitted:])
        emitted = max(emitted, len(text))
    return out


PROSE = ["a", "b", " ", "\n", "é", "\ufffd", "<", "</", ">", "tool_call>", "STOP", "a b"]
BODY = ['{"name": "f", "arguments": {"a": "', '"', '"', "STOP", CLOSE, "x", "\\", '"}}', "}",
        "{", "[", "1", " ", "\n", 'it"s', ":", ",", "<", "\ufffd"]


@st.composite
def texts(draw):
    """Prose and calls: JSON or not (quotes that do not pair), a tag or a stop string in a
    string, closed or not."""
    parts = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.integers(0, 2)) == 0:
            parts += draw(st.lists(st.sampled_from(PROSE), max_size=6))
        else:
            parts += [OPEN, *draw(st.lists(st.sampled_from(BODY), max_size=10)),
                      draw(st.sampled_from([CLOSE, f"\n{CLOSE}\n", "", "</tool_c"]))]
    return "".join(parts)


@settings(max_examples=600, deadline=None)
@given(final=texts(),
       steps=st.lists(st.tuples(st.integers(0, 40), st.lists(st.sampled_from(PROSE + BODY),
                                                              max_size=2),
                                st.integers(0, 20)), max_size=30),
       stop=stops, tool_calls=st.booleans())
# a stop string in a call that holds its tag in a string: outside once the body is no JSON
@example(final=f'a{OPEN}{{"name": "f", "arguments": {{"a": "{CLOSE}STOP"x STOP',
         steps=[(1, [], 0)] * 70, stop=["STOP"], tool_calls=True)
@example(final=f'{OPEN}{{"a": "{CLOSE}}}STOP', steps=[(1, ['"'], 0)] * 30, stop=["}"],
         tool_calls=True)
# a whole call in one step: a stop at its tag's ``<`` is outside it
@example(final=f"a{OPEN}{{}}{CLOSE}b", steps=[(40, [], 0)], stop=["<"], tool_calls=True)
def test_stop_finder_is_stop_at_of_each_text(final, steps, stop, tool_calls):
    """Texts that grow, each with a tail that the next may change (a character still coming)
    and stable up to a point before it: the first stop found is where ``stop_at`` finds it."""
    finder, n = StopFinder(stop, tool_calls), 0
    for grow, junk, unstable in [*steps, (len(final), [], 0)]:
        n = min(len(final), n + grow)
        text = settled(final[:n] + "".join(junk))
        stable = max(0, min(n, len(text)) - unstable)
        expected = stop_at(text, stop, tool_calls)
        assert finder.find(text, stable) == expected, (text, stable)
        if expected is not None:
            break


def _byte_fallback_tokenizer(hole: int = 0):
    """A SentencePiece-style vocabulary (Llama 2's decoder): byte-fallback tokens for every
    character it has not, decoded a run at a time; the tags ordinary added tokens; ``hole``
    ids left without a token after the bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for i, piece in enumerate(["▁", "a", "▁a", "b", "é", "€", "<", "/", ">", "{", "}", '"',
                               ":", "STOP", "▁x", "x", "\n", "tool_call", "l>"]):
        vocab[piece] = len(vocab) + (hole if i else 0)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True, normalized=False)])
    tok.add_tokens([AddedToken(s, normalized=False) for s in (OPEN, CLOSE)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   eos_token="</s>")


@pytest.fixture(scope="module", params=["demo", "byte_fallback"])
def decoder(request, demo_tokenizer_dir):
    """The output decoder of a tokenizer, and token runs to draw replies from: each fragment's
    tokens and single tokens (pieces of characters, byte tokens, special tokens)."""
    if request.param == "demo":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    else:
        tokenizer = _byte_fallback_tokenizer()
    decode = OutputDecoder(tokenizer)
    runs = [tokenizer.encode(f, add_special_tokens=False) for f in FRAGMENTS + ["×😀", "中文"]]
    singles = sorted({t for run in runs for t in run} | set(tokenizer.all_special_ids)
                     | set(tokenizer.encode("é€×😀中", add_special_tokens=False))
                     | set(range(0, len(tokenizer), max(1, len(tokenizer) // 300)))
                     | {len(tokenizer), len(tokenizer) + 1})  # a model's rows past its tokens
    return decode, runs, singles


@st.composite
def replies(draw, runs, singles):
    ids = []
    for _ in range(draw(st.integers(0, 30))):
        ids += draw(st.sampled_from(runs)) if draw(st.booleans()) else [draw(st.sampled_from(
            singles))]
    return ids


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.data_too_large])
@given(data=st.data(), stop=stops, tool_calls=st.booleans())
def test_reply_text_and_stop_check_read_as_the_whole_text(decoder, data, stop, tool_calls):
    decode, runs, singles = decoder
    ids = data.draw(replies(runs, singles))
    reply, check = ReplyText(decode), StopCheck(decode, tuple(stop), tool_calls)
    stable: list[str] = []  # what each text said every later one begins with
    for end in range(1, len(ids) + 1):
        whole = decode(ids[:end])
        text = reply.update(ids, end)
        assert text == settled(whole)
        assert all(text.startswith(head) for head in stable), (text, stable)
        stable.append(text[: reply.stable])
        at = check(ids[:end])
        assert at == stop_at(whole, stop, tool_calls), whole
        if at is not None:
            break


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.data_too_large])
@given(data=st.data(), stop=st.one_of(st.just(()), stops), tool_calls=st.booleans())
def test_streamed_deltas_are_those_of_the_whole_text(decoder, data, stop, tool_calls):
    """Steps of one to eight tokens (DFlash commits several), the request stopping where the
    stop check says, or at its last token: the same deltas, held text and cut."""
    decode, runs, singles = decoder
    ids = data.draw(replies(runs, singles))
    stop = tuple(stop)
    cut, n = None, len(ids)
    for end in range(1, len(ids) + 1):
        if stop and (at := stop_at(decode(ids[:end]), stop, tool_calls)) is not None:
            cut, n = at, end
            break
    ends, end = [], 0
    while end < n:
        end = min(n, end + data.draw(st.integers(1, 8)))
        ends.append(end)
    detok = Detokenizer(decode, stop, tool_calls)
    got = [detok.delta(ids[:e], final=k == len(ends) - 1, cut=cut if k == len(ends) - 1
                       else None) for k, e in enumerate(ends)]
    assert got == reference_deltas(decode, stop, tool_calls, ids, ends, cut)


def test_an_id_past_the_tokenizer_joins_the_byte_runs_beside_it():
    # decoded as nothing, it left "é" (C3 A9) kept as whole, and a lone A9 after it made the
    # run C3 A9 A9 three U+FFFD: the stop was found a character early, the deltas differed
    tokenizer = _byte_fallback_tokenizer()
    decode = OutputDecoder(tokenizer)
    c3, a9 = tokenizer.convert_tokens_to_ids(["<0xC3>", "<0xA9>"])
    a = tokenizer.convert_tokens_to_ids("a")
    ids = [c3, a9, len(tokenizer), a9, a, a]
    _reads_as_the_whole(decode, ids)
    # one in a hole of the tokenizer's ids (below its length): the same
    tokenizer = _byte_fallback_tokenizer(hole=3)
    decode = OutputDecoder(tokenizer)
    c3, a9, a = tokenizer.convert_tokens_to_ids(["<0xC3>", "<0xA9>", "a"])
    hole = next(i for i in range(len(tokenizer)) if tokenizer.convert_ids_to_tokens(i) is None)
    _reads_as_the_whole(decode, [c3, a9, hole, a9, a, a])


def _reads_as_the_whole(decode, ids):
    text = ReplyText(decode)
    for end in range(1, len(ids) + 1):
        assert text.update(ids, end) == settled(decode(ids[:end])), end
    check = StopCheck(decode, ("a",))
    at = next(found for end in range(1, len(ids) + 1)
              if (found := check(ids[:end])) is not None)
    assert at == stop_at(decode(ids), ("a",)) == 3
    ends = [2, 3, 4, 5, 6]
    detok = Detokenizer(decode, (), True)
    assert [detok.delta(ids[:e], final=e == 6) for e in ends] == reference_deltas(
        decode, (), True, ids, ends, None)
