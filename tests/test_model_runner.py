"""Packed forwards: a mixed batch gives every row what it gets alone, for the cost of its tokens."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentflash.engine.kv_cache import KVCache
from agentflash.engine.model_runner import (
    BLOCK_PAD_RATIO,
    EXACT_PRODUCTS,
    ModelRunner,
    Row,
    _linears,
    _probe_forwards,
    exact_products,
    exactness_problem,
    mkl_where_faster,
    with_mkl_for,
)
from agentflash.models.loading import load_model
from agentflash.models.qwen3 import batch_invariant_, padded_rows

CAPTURE = (0, 2)
MAX_LEN = 128


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)[0]


@pytest.fixture(scope="module")
def mha_model(tmp_path_factory, demo_tokenizer_dir):
    """One key head per query head: exact attention's lone query rows are padded."""
    from conftest import save_tiny_qwen3
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(demo_tokenizer_dir))
    path = save_tiny_qwen3(tmp_path_factory.mktemp("mha"), vocab, num_key_value_heads=4)
    return load_model(path)[0]


def skip_unless_exact(model) -> int:
    """The tests of the exact path's bitwise guarantees run where this machine's kernels keep
    them (the runner's probe), and are skipped elsewhere with the probe's finding; the row
    multiple the probe found."""
    products, problem = exact_products(batch_invariant_(model))
    if problem is not None:
        pytest.skip(f"the exact path is off on this machine: {problem}")
    return products.row_multiple


@pytest.fixture(scope="module")
def exact_model(model):
    """The row multiple of the exact path on this machine."""
    return skip_unless_exact(model)


@pytest.fixture(scope="module")
def exact_mha_model(mha_model):
    skip_unless_exact(mha_model)


def runner(model, batch_single_tokens: bool, slots: int = 6, max_len: int = MAX_LEN) -> ModelRunner:
    cache = KVCache(model.cfg, slots, max_len, torch.device("cpu"), torch.float32)
    return ModelRunner(model, cache, batch_single_tokens)


def cached(runner: ModelRunner, slot: int, length: int) -> list[torch.Tensor]:
    """Every layer's keys and values of ``slot`` up to ``length``."""
    return runner.cache.cached(slot, length)


# A row: its cached prefix length, its number of new tokens and whether it wants its last logits
# only. Prefills start at 0, decoding rows and verify blocks after a prefix.
prefill = st.tuples(st.just(0), st.integers(1, 40), st.booleans())
decode = st.tuples(st.integers(1, 60), st.just(1), st.just(False))
block = st.tuples(st.integers(1, 60), st.integers(2, 16), st.just(False))


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.one_of(prefill, decode, decode, block), min_size=1, max_size=6),
    batch_single_tokens=st.booleans(),
    last_only=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_mixed_batch_gives_each_row_what_it_gets_alone(
    model, shapes, batch_single_tokens, last_only, seed
):
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist()

    whole, mixed = runner(model, batch_single_tokens), runner(model, batch_single_tokens)
    slots = torch.randperm(6, generator=gen)[: len(shapes)].tolist()  # rows in any slot order
    prefixes = [tokens(start) for start, _, _ in shapes]
    rows = [Row(slot, start, tokens(n), lo) for slot, (start, n, lo) in zip(slots, shapes)]
    for r, prefix in zip(rows, prefixes):
        if prefix:
            mixed.forward([Row(r.slot, 0, prefix)])
    out = mixed.forward(rows, last_only=last_only, capture_layers=CAPTURE)
    wants_last = [last_only or r.last_only for r in rows]
    num_logits = [1 if last else len(r.tokens) for r, last in zip(rows, wants_last)]
    assert out.logits.shape[:2] == (len(rows), max(num_logits))
    assert [h.shape[0] for h in out.hidden] == [len(r.tokens) for r in rows]
    for i, (r, prefix, last) in enumerate(zip(rows, prefixes, wants_last)):
        # alone: the whole sequence in one causal forward from position 0
        n, end = len(r.tokens), r.start + len(r.tokens)
        expected = whole.forward([Row(r.slot, 0, prefix + r.tokens)], capture_layers=CAPTURE)
        logits = out.logits[i, :1] if last else out.logits[i, :n]
        want = expected.logits[0, end - 1 : end] if last else expected.logits[0, r.start :]
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            out.hidden[i], expected.hidden[0][r.start :], atol=1e-5, rtol=1e-5
        )
        for got, want in zip(cached(mixed, r.slot, end), cached(whole, r.slot, end)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_single_tokens", [True, False])
def test_a_forward_costs_its_real_tokens(model, batch_single_tokens):
    r = runner(model, batch_single_tokens)
    for slot in range(4):
        r.forward([Row(slot, 0, list(range(10, 30)))])
    seen = []
    hooks = [
        model.model.layers[0].mlp.register_forward_hook(
            lambda m, args, out: seen.append(("mlp", args[0].shape[:-1].numel()))
        ),
        model.lm_head.register_forward_hook(
            lambda m, args, out: seen.append(("lm_head", args[0].shape[:-1].numel()))
        ),
    ]
    try:
        block, decoding = Row(0, 20, list(range(16))), [Row(s, 20, [7]) for s in (1, 2, 3)]
        r.forward([decoding[0], block, *decoding[1:]])
        r.forward([decoding[0], block, *decoding[1:]], last_only=True)
        prompt = Row(4, 0, list(range(40)), last_only=True)
        r.forward([prompt, *decoding], last_only=True)
        r.forward([decoding[0], prompt, block])
    finally:
        for h in hooks:
            h.remove()
    verify, verify_last, prefill_and_decode, mixed = seen[0:2], seen[2:4], seen[4:6], seen[6:8]
    assert verify == [("mlp", 19), ("lm_head", 19)]  # 16 + 3 tokens, not 4 x 16
    assert verify_last == [("mlp", 19), ("lm_head", 4)]
    assert prefill_and_decode == [("mlp", 43), ("lm_head", 4)]
    assert mixed == [("mlp", 57), ("lm_head", 18)]  # the prompt's last token, not its 40


@pytest.mark.usefixtures("exact_model")
@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.one_of(prefill, decode, decode, block), min_size=2, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_a_rows_logits_are_bitwise_those_it_has_alone(model, shapes, seed):
    """On the CPU a row's logits do not depend on the rows beside it, to the last bit: greedy
    output then never depends on the requests that share a step (not even at a near tie)."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist()

    alone, mixed = runner(model, False), runner(model, False)
    rows = [Row(slot, start, tokens(n), lo) for slot, (start, n, lo) in enumerate(shapes)]
    for r in rows:
        prefix = tokens(r.start)
        for rn in (alone, mixed):
            if prefix:
                rn.forward([Row(r.slot, 0, prefix)])
    out = mixed.forward(rows)
    for i, r in enumerate(rows):
        own = alone.forward([r]).logits[0]
        n = own.shape[0]
        assert torch.equal(out.logits[i, :n], own)


@pytest.mark.usefixtures("exact_model")
@settings(max_examples=15, deadline=None)
@given(
    starts=st.lists(st.integers(1, 100), min_size=2, max_size=6),
    slot_seed=st.integers(0, 2**16),
)
def test_one_token_rows_attend_together_and_get_bitwise_what_they_get_alone(
    model, starts, slot_seed
):
    """Decoding rows share one batch of exact attention calls (slots with no row in between
    are computed and dropped); each row's logits and cache are still bitwise its own alone."""
    from agentflash.models.qwen3 import ExactTokenRows

    gen = torch.Generator().manual_seed(slot_seed)
    slots = torch.randperm(len(starts) + 1, generator=gen)[: len(starts)].tolist()  # one gap
    alone, mixed = runner(model, False, slots=8), runner(model, False, slots=8)
    rows = []
    for slot, start in zip(slots, starts):
        prefix = torch.randint(0, model.cfg.vocab_size, (start,), generator=gen).tolist()
        for rn in (alone, mixed):
            rn.forward([Row(slot, 0, prefix)])
        rows.append(Row(slot, start, [int(torch.randint(0, 99, (1,), generator=gen))]))
    assert isinstance(mixed._layout(rows, []).single, ExactTokenRows)
    out = mixed.forward(rows, capture_layers=CAPTURE)
    for i, r in enumerate(rows):
        own = alone.forward([r], capture_layers=CAPTURE)
        assert torch.equal(out.logits[i, :1], own.logits[0])
        assert torch.equal(out.hidden[i], own.hidden[0])
        for got, want in zip(mixed.cache.cached(r.slot, r.start + 1),
                             alone.cache.cached(r.slot, r.start + 1)):
            assert torch.equal(got, want)


@settings(max_examples=30, deadline=None)
@given(
    lasts=st.lists(st.one_of(st.integers(0, 63), st.integers(0, 400)), min_size=1, max_size=6),
    free=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_attention_over_slots_skips_the_chunks_no_row_sees_and_gets_the_same_bits(
    exact_model, lasts, free, seed
):
    """``_attend_slots`` computes a slot's 64-key chunk of values only where its row sees a key
    in it, reading the values in place (a pool with more slots than the step's rows): bitwise
    what every chunk of every slot gives in one batched call over a pool of just those slots."""
    from agentflash.models.qwen3 import EXACT_CHUNK, ExactMasks, _attend_slots, chunk_reach

    gen = torch.Generator().manual_seed(seed)
    m = padded_rows(2, exact_model)  # a one-token row's query rows (two heads a key head)
    upto, kv, d, capacity = len(lasts), 2, 16, 7 * EXACT_CHUNK
    keys = torch.randn(upto + free, kv, d, capacity, generator=gen).transpose(2, 3)
    values = torch.randn(capacity // EXACT_CHUNK, upto + free, kv, EXACT_CHUNK, d, generator=gen)
    queries = torch.randn(upto, kv, m, d, generator=gen)
    width = (max(lasts) // EXACT_CHUNK + 1) * EXACT_CHUNK
    bias = ExactMasks(capacity, 1, torch.device("cpu")).up_to(torch.tensor(lasts), width)
    bias = bias[:, None, None].expand(upto, kv, m, width).reshape(upto * kv, m, width)
    reach = chunk_reach(range(upto), lasts, upto)
    assert reach[0] == upto and list(reach) == sorted(reach, reverse=True)
    every = (upto,) * len(reach)  # every chunk of every slot, one call: a pool of upto slots
    whole = _attend_slots(queries, keys[:upto].contiguous(), values[:, :upto].contiguous(), bias,
                          every)
    assert torch.equal(_attend_slots(queries, keys, values, bias, reach), whole)
    # a slot's result does not depend on the others': each alone, in a pool of its own
    for s, last in enumerate(lasts):
        own = slice(s, s + 1)
        n = last // EXACT_CHUNK + 1
        alone = _attend_slots(queries[own], keys[own].contiguous(),
                              values[:, own].contiguous(), bias[s * kv : (s + 1) * kv, :,
                                                                : n * EXACT_CHUNK], (1,) * n)
        assert torch.equal(whole[s], alone[0])


@pytest.mark.usefixtures("exact_model")
@settings(max_examples=20, deadline=None)
@given(start=st.integers(1, 60), n=st.integers(2, 16), seed=st.integers(0, 2**16))
def test_a_verify_block_gives_bitwise_the_logits_of_one_token_decoding(model, start, n, seed):
    """Speculation does not change greedy output even at a near tie: each position of a verify
    block has, to the last bit, the logits (and cache) that feeding its tokens one by one gives."""
    check_verify_against_decoding(model, start, n, seed, MAX_LEN)


@pytest.mark.usefixtures("exact_mha_model")
@settings(max_examples=10, deadline=None)
@given(start=st.integers(1, 80), n=st.integers(2, 16), seed=st.integers(0, 2**16))
def test_verify_is_decoding_bitwise_with_one_key_head_per_query_head(mha_model, start, n, seed):
    # a slot of 100 positions: its cache holds whole chunks of exact attention (128)
    check_verify_against_decoding(mha_model, start, min(n, 100 - start), seed, 100)


def check_verify_against_decoding(model, start: int, n: int, seed: int, max_len: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    prefix, block = (torch.randint(0, model.cfg.vocab_size, (k,), generator=gen).tolist()
                     for k in (start, n))
    verify, decode = runner(model, False, max_len=max_len), runner(model, False, max_len=max_len)
    for rn in (verify, decode):
        rn.forward([Row(0, 0, prefix)])
    out = verify.forward([Row(0, start, block)], capture_layers=CAPTURE)
    for i, token in enumerate(block):
        one = decode.forward([Row(0, start + i, [token])], capture_layers=CAPTURE)
        assert torch.equal(out.logits[0, i], one.logits[0, 0])
        assert torch.equal(out.hidden[0][i], one.hidden[0][0])
    for got, want in zip(cached(verify, 0, start + n), cached(decode, 0, start + n)):
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, demo_tokenizer_dir):
    """A random-weight Llama: no per-head query and key norms."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    vocab = len(AutoTokenizer.from_pretrained(demo_tokenizer_dir))
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )).save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_projections_keep_names_and_share_the_weights(arch, tiny_model_dir, tiny_llama_dir):
    from agentflash.models.qwen3 import batch_invariant_

    model_dir = tiny_model_dir if arch == "qwen3" else tiny_llama_dir
    plain, fast = load_model(model_dir)[0], load_model(model_dir)[0]
    assert plain.cfg.qk_norm == (arch == "qwen3")
    names = list(plain.state_dict())
    batch_invariant_(fast)
    assert list(fast.state_dict()) == names  # nothing added, nothing renamed
    attn = fast.model.layers[0].self_attn
    fused = attn._fused.weight
    assert attn.q_proj.weight.data_ptr() == fused.data_ptr()  # a view, not a copy
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    ids = torch.randint(0, plain.cfg.vocab_size, (1, 12))
    out = {}
    for name, model in (("plain", plain), ("fast", fast)):
        cache = KVCache(model.cfg, 1, MAX_LEN, torch.device("cpu"), torch.float32)
        run = ModelRunner(model, cache, batch_single_tokens=False,
                          batch_invariant=name == "fast")
        out[name] = run.forward([Row(0, 0, ids[0].tolist())]).logits
    torch.testing.assert_close(out["fast"], out["plain"], atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("exact_model")
@settings(max_examples=30, deadline=None)
@given(length=st.integers(2, 300), data=st.data(), seed=st.integers(0, 2**16))
def test_a_prompt_prefilled_after_a_cached_prefix_is_bitwise_the_prompt_prefilled_whole(
    model, length, data, seed
):
    """What lets the engine's prefix cache skip a prompt's cached beginning without changing a
    token: on the CPU every row attends exactly, so the cut does not show (nor where a long
    row's queries are cut into chunks, ``EXACT_QUERY_CHUNK``: 128)."""
    check_prefix_cut(model, length, data.draw(st.integers(1, length - 1)), seed)


@pytest.mark.usefixtures("exact_mha_model")
@settings(max_examples=15, deadline=None)
@given(length=st.integers(130, 300), data=st.data(), seed=st.integers(0, 2**16))
def test_a_prompt_cut_is_bitwise_the_prompt_whole_with_one_key_head_per_query_head(
    mha_model, length, data, seed
):
    """A query chunk of an odd number of rows of 16-number heads: its chunk sums are padded
    (``sum_chunks``), so the masked chunks past its last key add nothing to the last bit."""
    check_prefix_cut(mha_model, length, data.draw(st.integers(1, length - 1)), seed)


def check_prefix_cut(model, length: int, cut: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, 4000, (length,), generator=gen).tolist()
    r = runner(model, batch_single_tokens=False, max_len=320)
    assert r.batch_invariant
    whole = r.forward([Row(0, 0, tokens, last_only=True)], capture_layers=CAPTURE)
    r.forward([Row(1, 0, tokens[:cut])], capture_layers=CAPTURE)
    rest = r.forward([Row(1, cut, tokens[cut:], last_only=True)], capture_layers=CAPTURE)
    assert torch.equal(rest.logits[0, 0], whole.logits[0, 0])
    assert torch.equal(rest.hidden[0], whole.hidden[0][cut:])
    for a, b in zip(cached(r, 1, length), cached(r, 0, length), strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("exact_model")
@settings(max_examples=25, deadline=None)
@given(
    blocks=st.lists(st.tuples(st.integers(1, 100), st.integers(2, 24)), min_size=2, max_size=5),
    extra=st.lists(st.one_of(prefill, decode, block), max_size=2),
    gap=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_verify_blocks_of_about_one_length_attend_together_and_get_what_they_get_alone(
    model, blocks, extra, gap, seed
):
    """Verify blocks of about one length attend in one batch over their slots
    (``exact_attention_blocks``, the shorter ones padded with zero queries): each block's
    logits, captured layers and cache are still bitwise its own alone, beside one-token rows,
    prompts and blocks of other lengths."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist()

    # the blocks in the first slots, the other rows after them (or, with ``gap``, between them)
    step = 2 if gap else 1
    rows = [Row(step * i, start, tokens(t)) for i, (start, t) in enumerate(blocks)]
    rows += [Row(len(blocks) * step + j, start, tokens(n), lo)
             for j, (start, n, lo) in enumerate(extra)]
    alone, mixed = runner(model, False, slots=16, max_len=128), runner(
        model, False, slots=16, max_len=128
    )
    for r in rows:
        if r.start:
            prefix = tokens(r.start)
            for rn in (alone, mixed):
                rn.forward([Row(r.slot, 0, prefix)])
    groups = mixed._block_groups(rows)
    grouped = [i for group in groups for i in group]
    assert len(grouped) == len(set(grouped))

    def padded_cost(group):  # queries computed per real one
        t, upto = max(len(rows[i].tokens) for i in group), 1 + max(rows[i].slot for i in group)
        return t * upto / sum(len(rows[i].tokens) for i in group)

    for group in groups:
        assert len(group) >= 2 and padded_cost(group) <= BLOCK_PAD_RATIO
    verify = [i for i, r in enumerate(rows) if r.start and len(r.tokens) > 1]
    if padded_cost(verify) <= BLOCK_PAD_RATIO:  # about one length, dense: batched, not one by one
        assert groups == [verify]
    if not gap and max(t for _, t in blocks) <= 4 / 3 * min(t for _, t in blocks):
        assert groups and set(range(len(blocks))) <= set(groups[0])
    packed = [rows[i] for i in mixed._packing_order(rows, groups)]
    layout = mixed._layout(packed, [len(g) for g in groups])
    assert len(layout.blocks) == len(groups)
    assert {s.slot for s in layout.spans}.isdisjoint(rows[i].slot for i in grouped)
    out = mixed.forward(rows, capture_layers=CAPTURE)
    for i, r in enumerate(rows):
        own = alone.forward([r], capture_layers=CAPTURE)
        n = own.logits.shape[1]
        assert torch.equal(out.logits[i, :n], own.logits[0])
        assert torch.equal(out.hidden[i], own.hidden[0])
        end = r.start + len(r.tokens)
        for got, want in zip(cached(mixed, r.slot, end), cached(alone, r.slot, end)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("exact", [True, False])
def test_a_pool_that_grows_gives_the_logits_of_a_pool_allocated_whole(model, exact):
    """The pool starts small and grows as rows need more positions (``KVCache.ensure``);
    every forward is what it is over a pool of ``max_len`` positions from the start (bitwise,
    attending exactly), and what was cached before a growth stays."""
    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist()

    steps = [  # (slot, start, tokens) rows of each forward
        [(0, 0, ids(100)), (1, 0, ids(30))],  # 64 positions -> 128
        [(0, 100, ids(16)), (1, 30, ids(1)), (2, 0, ids(200))],  # -> 256
        [(2, 200, ids(10)), (0, 116, ids(1)), (1, 31, ids(16))],
        [(2, 210, ids(60)), (0, 117, ids(16))],  # -> 320
        [(2, 270, ids(200)), (1, 47, ids(1))],  # -> 512
    ]
    outs, caches = {}, {}
    for capacity in (64, 512):
        cache = KVCache(model.cfg, 3, 512, torch.device("cpu"), torch.float32, capacity=capacity)
        run = ModelRunner(model, cache, batch_single_tokens=False, batch_invariant=exact)
        outs[capacity] = []
        for rows in steps:
            out = run.forward([Row(s, start, t) for s, start, t in rows], capture_layers=CAPTURE)
            outs[capacity].append((out.logits, out.hidden))
        caches[capacity] = cache
    assert caches[64].capacity == 512 and caches[512].capacity == 512
    exact = run.batch_invariant  # False where this machine's kernels failed the probe
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5))
    for (logits, hidden), (ref_logits, ref_hidden) in zip(outs[64], outs[512], strict=True):
        assert same(logits, ref_logits)
        assert all(same(h, r) for h, r in zip(hidden, ref_hidden, strict=True))
    for slot, length in ((0, 133), (1, 48), (2, 470)):
        got, ref = caches[64].cached(slot, length), caches[512].cached(slot, length)
        assert all(same(g, r) for g, r in zip(got, ref, strict=True))


def test_a_pool_grows_by_a_quarter_at_least_to_max_len_and_no_further():
    cfg = type("Cfg", (), {"num_kv_heads": 2, "head_dim": 8, "num_layers": 2})()  # the shape
    cache = KVCache(cfg, 2, 1000, torch.device("cpu"), torch.float32, capacity=64)
    cache.lay_out_for_exact_attention_()
    assert (cache.capacity, cache.max_capacity) == (64, 1024)  # whole chunks of 64
    cache.ensure(64)
    assert cache.capacity == 64
    cache.ensure(65)
    assert cache.capacity == 128  # 80, in whole chunks
    cache.ensure(300)  # more than a quarter more: what is asked, in whole chunks
    assert cache.capacity == 320 and cache.v[0].shape[0] == 320 // 64
    cache.ensure(321)
    assert cache.capacity == 448  # 400, in whole chunks
    cache.ensure(1000)
    assert cache.capacity == 1024  # max_len's chunks
    with pytest.raises(AssertionError):
        cache.ensure(1025)


def test_a_growth_that_fails_leaves_the_pool_as_it_was(monkeypatch):
    # an allocation that fails (out of memory) while the values grow: the keys were grown and
    # kept, the capacity (read from them) said grown, and the values were never grown after
    cfg = type("Cfg", (), {"num_kv_heads": 2, "head_dim": 8, "num_layers": 2})()
    cache = KVCache(cfg, 2, 1000, torch.device("cpu"), torch.float32, capacity=64)
    cache.lay_out_for_exact_attention_()
    grow = KVCache._grown_values

    def fails_once(self, v, capacity):
        monkeypatch.setattr(KVCache, "_grown_values", grow)
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(KVCache, "_grown_values", fails_once)
    with pytest.raises(torch.OutOfMemoryError):
        cache.ensure(300)
    assert cache.capacity == 64 and cache.v[0].shape[0] == 1
    cache.ensure(300)  # memory free again
    assert cache.capacity == 320 and all(v.shape[0] == 320 // 64 for v in cache.v)


def test_the_probe_names_a_projection_whose_rows_change_with_their_batch(tiny_model_dir):
    """A projection that rounds a row by the rows beside it (as MKL's AVX2 kernels do: a
    block's last rows their own way) fails the probe at every row multiple; the runner then
    runs the plain path, and its rows agree with the exact path's to rounding."""
    model, ref_model = load_model(tiny_model_dir)[0], load_model(tiny_model_dir)[0]
    batch_invariant_(model)

    def rounding_by_batch(forward):  # the last bit of every row in a batch of over 40 rows
        def rounded(x):
            out = forward(x)
            return torch.nextafter(out, out + 1) if x.numel() > 40 * x.shape[-1] else out
        return rounded

    for layer in model.model.layers:
        layer.mlp.down_proj.forward = rounding_by_batch(layer.mlp.down_proj.forward)
    problem = exactness_problem(model)
    kept = exact_products(batch_invariant_(ref_model))[0]
    if kept is not None:  # this machine's kernels keep it, from that try of the probe's on
        kept = kept._replace(mkl_shapes=frozenset())  # the try, before any shape moved to MKL
        found = "a projection of 128 to 64 features gives row 0 of 41 other bits than the row alone"
        parts = problem.split("; ")  # one for each way the probe tries
        assert len(parts) == len(EXACT_PRODUCTS)
        for i, (products, part) in enumerate(zip(EXACT_PRODUCTS, parts)):
            if i >= EXACT_PRODUCTS.index(kept):
                assert part == (f"{found} ({products})" if i else found)
    else:  # they do not however its projections run
        assert problem is not None
    cache = KVCache(model.cfg, 2, MAX_LEN, torch.device("cpu"), torch.float32)
    run = ModelRunner(model, cache, batch_single_tokens=False)
    assert (run.batch_invariant, run.exactness_problem, cache.exact) == (False, problem, False)
    assert not any(linear.row_multiple for linear in _linears(model))
    ref = runner(ref_model, False, slots=2)
    ids = torch.randint(0, model.cfg.vocab_size, (60,)).tolist()
    for rn in (run, ref):
        rn.forward([Row(0, 0, ids[:50])])
    rows = [Row(0, 50, ids[50:]), Row(1, 0, ids[:7])]
    got, want = run.forward(rows).logits, ref.forward(rows).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_projections_mkl_computes_faster_move_to_mkl_where_the_exact_path_stays_exact(
    tiny_model_dir
):
    """Where the probe keeps oneDNN's kernels, the projection shapes MKL's compute faster run on
    MKL's (``Products.mkl_shapes``, timed at the products' row multiple), oneDNN's reordered
    weights kept only for the others; the mix is probed again and kept only if the exact path
    stays exact with it: a projection that rounds a row by its batch on MKL keeps it on
    oneDNN."""
    model = batch_invariant_(load_model(tiny_model_dir)[0])
    kept = exact_products(model)[0]
    if kept is None or not kept.onednn:
        pytest.skip("the probe keeps no oneDNN kernels on this machine")
    for linear in _linears(model):
        assert linear.onednn == kept.on_onednn(linear)
        assert ("_reordered" in linear.__dict__) <= linear.onednn
    onednn = kept._replace(mkl_shapes=frozenset())
    linears = list(_linears(model, in_forward=True))
    shapes = frozenset(tuple(linear.weight.shape) for linear in linears)
    # a margin oneDNN's kernels cannot make up (MKL at 11 times their time) and one MKL's cannot
    assert mkl_where_faster(linears, 4, rows=(4,), rounds=1, calls=1, margin=-10) == shapes
    assert mkl_where_faster(linears, 4, rows=(4,), rounds=1, calls=1, margin=1) == frozenset()
    # a row count past KERNEL_TIMING_MACS is not timed: nothing to move on
    assert mkl_where_faster(linears, 4, rows=(10**9,), margin=-10) == frozenset()
    assert kept.mkl_shapes <= shapes and all(linear.onednn for linear in linears)
    with torch.inference_mode():
        mixed = with_mkl_for(model, onednn, shapes)
        assert mixed == onednn._replace(mkl_shapes=shapes)
        assert not any(linear.onednn for linear in linears)
        assert str(mixed) == ("oneDNN (MKL for the 64->64, 64->128, 64->256, 64->4096, 128->64 "
                              "projections), rows padded to a multiple of 4")

        def rounding_by_batch_on_mkl(linear):  # MKL's rows of a batch of over 40 rows
            forward = linear.forward

            def rounded(x):
                out = forward(x)
                wide = x.numel() > 40 * x.shape[-1]
                return torch.nextafter(out, out + 1) if wide and not linear.onednn else out
            return rounded

        for layer in model.model.layers:
            layer.mlp.down_proj.forward = rounding_by_batch_on_mkl(layer.mlp.down_proj)
        assert with_mkl_for(model, onednn, shapes) == onednn
        assert all(linear.onednn for linear in _linears(model))


def test_the_probe_names_verify_blocks_that_round_otherwise_padded_together(
    tiny_model_dir, monkeypatch
):
    """Verify blocks of different lengths attend in one batch, the shorter padded with zero
    queries: were a padded batch to round a row otherwise, the probe says so (and the runner
    keeps to the plain path)."""
    import agentflash.models.qwen3 as qwen3

    model = batch_invariant_(load_model(tiny_model_dir)[0])
    kept = exact_products(model)[0]
    if kept is None:
        pytest.skip("this machine's kernels are not exact however the projections run")
    real = qwen3.exact_attention_blocks

    def rounding_when_padded(q, k, v, k_pool, v_pool, rows):
        out = real(q, k, v, k_pool, v_pool, rows)
        return torch.nextafter(out, out + 1) if rows.padded_index is not None else out

    monkeypatch.setattr(qwen3, "exact_attention_blocks", rounding_when_padded)
    with torch.inference_mode():
        problem = _probe_forwards(model, kept)
    assert problem == ("a verify block of 16 tokens batched with one of another length gets "
                       "other logits than decoding")


def test_the_probe_pads_rows_to_a_multiple_of_4_where_other_counts_round_otherwise(
    tiny_model_dir
):
    """Projections that round a product whose row count is not a multiple of 4 their own way
    (as MKL's AVX2 kernels, on an AMD EPYC, do) fail the probe unpadded and pass it with their
    rows padded to 4: the runner keeps the exact path there, and its rows are padded."""
    model = batch_invariant_(load_model(tiny_model_dir)[0])
    kept = exact_products(batch_invariant_(load_model(tiny_model_dir)[0]))[0]
    if kept is None or kept.row_multiple not in (1, 4):
        pytest.skip("this machine's kernels need other padding than the test's")

    def rounding_unless_fours(linear):
        forward = linear.forward

        def rounded(x):
            out = forward(x)  # pads the rows as the probe asks, then cuts them
            rows = padded_rows(x.numel() // x.shape[-1], linear.row_multiple)
            return out if rows % 4 == 0 else torch.nextafter(out, out + 1)
        return rounded

    for linear in _linears(model):
        linear.forward = rounding_unless_fours(linear)
    products, problem = exact_products(model)
    assert (products.row_multiple, problem) == (4, None)
    cache = KVCache(model.cfg, 2, MAX_LEN, torch.device("cpu"), torch.float32)
    run = ModelRunner(model, cache, batch_single_tokens=False)
    assert (run.batch_invariant, run.products, run.row_multiple) == (True, products, 4)
    assert all((linear.onednn, linear.row_multiple) == (products.on_onednn(linear), 4)
               for linear in _linears(model))
    assert run._masks(10, 1).shape[0] == 4  # a one-token row's query rows: 2 heads, padded
    assert run._masks(10, 3).shape[0] == 8  # 2 heads x 3 tokens, padded


def test_exact_masks_pad_rows_that_see_every_key():
    """``ExactMasks`` pads a row's mask to ``padded_rows`` with rows that see every key (a
    one-token row's with its own mask: a view, nothing built), and keeps the real rows as they
    are unpadded."""
    from agentflash.models.qwen3 import ExactMasks

    plain = ExactMasks(256, 2, torch.device("cpu"))
    padded = ExactMasks(256, 2, torch.device("cpu"), row_multiple=4)
    for start, t in ((0, 1), (5, 1), (70, 3), (10, 16), (0, 5)):
        got, want = padded(start, t), plain(start, t)
        assert got.shape == (padded_rows(2 * t, 4), want.shape[1])
        assert torch.equal(got[: want.shape[0]], want)
        pad = got[want.shape[0]:]
        assert torch.equal(pad, want[:1].expand_as(pad)) if t == 1 else not pad.any()
    assert padded_rows(1, 1) == 2 and padded_rows(3, 1) == 3 and padded_rows(5, 4) == 8


PROBE_UNDER_AVX2 = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_model_runner import MAX_LEN, Row, check_verify_against_decoding, runner
from agentflash.models.loading import load_model
torch.set_num_threads(1)
model = load_model({model_dir!r})[0]
run = runner(model, False)
if run.batch_invariant:  # the probe found it exact: it must be, for shapes it did not try
    for seed, (start, n) in enumerate([(5, 16), (60, 7), (33, 12), (1, 2), (100, 16)]):
        check_verify_against_decoding(model, start, n, seed, MAX_LEN)
print("exact" if run.batch_invariant else run.exactness_problem)
"""


def test_the_probe_on_mkls_avx2_kernels_never_claims_what_they_do_not_keep(tiny_model_dir):
    """Under ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (which fails the bitwise tests here as the last
    CI run, on another machine, failed them: rows of 3 and 4 round differently) the runner is
    exact only if verify blocks really are one-token decoding to the last bit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = PROBE_UNDER_AVX2.format(tests=str(Path(__file__).parent),
                                     model_dir=str(tiny_model_dir))
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = done.stdout.strip().splitlines()[-1]
    assert said == "exact" or "projection" in said or "logits" in said, said


FIRST_FORWARD = """
import torch
from agentflash.engine.engine import Engine
torch.set_num_threads(2)
print(repr(Engine.from_pretrained("demo", drafter=None).runner.exactness_problem))
"""


def test_every_fresh_process_finds_the_same_about_the_exact_path():
    """The demo engine loaded in fresh processes at 2 threads: its probe (the process's first
    forwards) finds the same in each. Its first forward's rotary ``cos`` was the process's first
    parallel transcendental op, which in a few percent of processes computed the second thread's
    half with other bits, and the probe then refused the exact path there alone (10 of 110
    processes in one evening); the runner warms the threads up first (``warm_up_threads``: 0 of
    110). Without it this fails about 4 runs in 5."""
    import subprocess
    import sys

    said = []
    for _ in range(8):  # two at once, on the machine's two cores, as in the runs that showed it
        procs = [subprocess.Popen([sys.executable, "-c", FIRST_FORWARD], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
            said.append(out.strip().splitlines()[-1])
    assert said == [said[0]] * len(said), said
