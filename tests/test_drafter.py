"""The DFlash drafter network: weight names, attention semantics, batching and the context cache."""

import math

import pytest
import torch
import torch.nn.functional as F

from agentflash.dflash.drafter import DFlashDrafter, DraftContext, DrafterConfig


def small_config(**overrides) -> DrafterConfig:
    fields = dict(
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        block_size=5,
        mask_token_id=99,
        target_layer_ids=(0, 2, 3),
        num_target_layers=4,
        vocab_size=100,
    )
    fields.update(overrides)
    return DrafterConfig(**fields)


def random_drafter(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            # norms away from 1 so that a skipped or misplaced norm shows
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return drafter.eval()


def context_of(drafter: DFlashDrafter, hidden: torch.Tensor):
    ctx = drafter.new_context()
    drafter.extend([ctx], [hidden])
    return ctx


def test_weight_names_are_the_reference_keys():
    cfg = small_config(num_layers=3)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(3):
        expected |= {
            f"layers.{i}.input_layernorm.weight",
            f"layers.{i}.post_attention_layernorm.weight",
        }
        expected |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        expected |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    state = DFlashDrafter(cfg).state_dict()
    assert set(state) == expected
    assert state["fc.weight"].shape == (32, 3 * 32)
    assert state["layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 32)
    assert state["layers.0.self_attn.q_norm.weight"].shape == (8,)


def naive_draft(drafter: DFlashDrafter, target_hidden, block_embeds, start):
    """The DFlash forward written out head by head, from the weights alone.

    target_hidden [S, K*H] at positions 0..S-1; block_embeds [T, H] at positions start..start+T-1.
    """
    cfg = drafter.cfg
    sd = {k: v.double() for k, v in drafter.state_dict().items()}
    eps, d = cfg.rms_norm_eps, cfg.head_dim

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    def rope(x, pos):  # x [L, D], pos [L]
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = pos.double()[:, None] * inv[None]
        cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
        rot = torch.cat((-x[:, d // 2 :], x[:, : d // 2]), dim=-1)
        return x * cos + rot * sin

    ctx = rms(target_hidden.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    s, t = ctx.shape[0], block_embeds.shape[0]
    pos = torch.cat((torch.arange(s), start + torch.arange(t)))
    x = block_embeds.double()
    group = cfg.num_heads // cfg.num_kv_heads
    for i in range(cfg.num_layers):
        w = {k[len(f"layers.{i}.") :]: v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])
        kv_in = torch.cat((ctx, h))  # context is not passed through input_layernorm
        heads = []
        for head in range(cfg.num_heads):
            kvh = head // group
            wq = w["self_attn.q_proj.weight"][head * d : (head + 1) * d]
            wk = w["self_attn.k_proj.weight"][kvh * d : (kvh + 1) * d]
            wv = w["self_attn.v_proj.weight"][kvh * d : (kvh + 1) * d]
            q = rope(rms(h @ wq.T, w["self_attn.q_norm.weight"]), pos[s:])
            k = rope(rms(kv_in @ wk.T, w["self_attn.k_norm.weight"]), pos)
            v = kv_in @ wv.T
            attn = torch.softmax(q @ k.T / math.sqrt(d), dim=-1)  # no mask at all
            heads.append(attn @ v)
        x = x + torch.cat(heads, dim=-1) @ w["self_attn.o_proj.weight"].T
        m = rms(x, w["post_attention_layernorm.weight"])
        gate, up = m @ w["mlp.gate_proj.weight"].T, m @ w["mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"])


@pytest.mark.parametrize("fused", [False, True])
def test_draft_forward_matches_the_architecture_written_out(fused):
    drafter = random_drafter(small_config())
    if fused:  # as the engine drafts: one projection for q, k, v and one for gate, up
        names = list(drafter.state_dict())
        drafter.fuse_()
        assert list(drafter.state_dict()) == names
    hidden = torch.randn(9, 3 * 32)
    block = torch.randn(5, 32)
    got = drafter.draft_forward(
        block[None], (9 + torch.arange(5))[None], [context_of(drafter, hidden)]
    )[0]
    expected = naive_draft(drafter, hidden, block, start=9)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)


def test_block_output_depends_on_context_and_positions():
    drafter = random_drafter(small_config())
    hidden = torch.randn(6, 3 * 32)
    block = torch.randn(1, 5, 32)
    base = drafter.draft_forward(block, (6 + torch.arange(5))[None], [context_of(drafter, hidden)])
    other_ctx = drafter.draft_forward(
        block, (6 + torch.arange(5))[None], [context_of(drafter, hidden.flip(0))]
    )
    shifted = drafter.draft_forward(
        block, (9 + torch.arange(5))[None], [context_of(drafter, hidden)]
    )
    assert not torch.allclose(base, other_ctx, atol=1e-3)
    assert not torch.allclose(base, shifted, atol=1e-3)


def test_batched_draft_forward_equals_per_row():
    drafter = random_drafter(small_config())
    lengths = (7, 1, 13)
    contexts = [context_of(drafter, torch.randn(n, 3 * 32)) for n in lengths]
    blocks = torch.randn(3, 5, 32)
    positions = torch.stack([n + torch.arange(5) for n in lengths])
    batched = drafter.draft_forward(blocks, positions, contexts)
    for i in range(3):
        alone = drafter.draft_forward(blocks[i : i + 1], positions[i : i + 1], [contexts[i]])
        torch.testing.assert_close(batched[i], alone[0], atol=1e-5, rtol=1e-5)


def test_a_draft_forward_that_takes_in_pending_positions_equals_extend_then_draft():
    drafter = random_drafter(small_config()).fuse_()
    lengths, waiting = (7, 1, 63), (3, 0, 2)  # the last row's storage grows (64 positions)
    hidden = [torch.randn(n + w, 3 * 32) for n, w in zip(lengths, waiting)]
    first = [context_of(drafter, h[:n]) for h, n in zip(hidden, lengths)]
    second = [context_of(drafter, h[:n]) for h, n in zip(hidden, lengths)]
    pending = [h[n:] if w else None for h, n, w in zip(hidden, lengths, waiting)]
    blocks = torch.randn(3, 5, 32)
    positions = torch.stack([n + w + torch.arange(5) for n, w in zip(lengths, waiting)])
    taken_in = drafter.draft_forward(blocks, positions, first, pending)
    drafter.extend([c for c, w in zip(second, waiting) if w], [p for p in pending if p is not None])
    extended = drafter.draft_forward(blocks, positions, second)
    torch.testing.assert_close(taken_in, extended, atol=1e-5, rtol=1e-5)
    for a, b in zip(first, second):
        assert a.length == b.length
        for layer in range(2):
            torch.testing.assert_close(a.keys(layer), b.keys(layer), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.values(layer), b.values(layer), atol=1e-5, rtol=1e-5)
    # many pending positions (a prompt's) go through ``extend``: the same again
    many = torch.randn(200, 3 * 32)
    a, b = drafter.new_context(), drafter.new_context()
    got = drafter.draft_forward(blocks[:1], 200 + torch.arange(5)[None], [a], [many])
    drafter.extend([b], [many])
    torch.testing.assert_close(got, drafter.draft_forward(blocks[:1], 200 + torch.arange(5)[None],
                                                          [b]), atol=1e-5, rtol=1e-5)
    assert a.length == b.length == 200


def test_context_extended_in_pieces_equals_one_extend():
    drafter = random_drafter(small_config())
    hidden = torch.randn(300, 3 * 32)
    whole = context_of(drafter, hidden)
    pieces, other = drafter.new_context(), drafter.new_context()
    drafter.extend([pieces, other], [hidden[:4], hidden[:2]])
    drafter.extend([pieces], [hidden[4:5]])
    assert pieces.capacity == DraftContext.CHUNK  # 5 positions and a quarter, in whole chunks
    drafter.extend([other, pieces], [hidden[2:70], hidden[5:70]])
    assert pieces.capacity == 2 * DraftContext.CHUNK  # grown: 70 and a quarter, in chunks
    assert pieces.num_bytes == 2 * 2 * pieces.capacity * 2 * 8 * 4  # layers, k/v, positions...
    drafter.extend([other, pieces], [hidden[70:], hidden[70:]])
    assert whole.length == pieces.length == other.length == 300
    # storage a quarter beyond what is held, in whole chunks: 375 -> 384 positions
    assert pieces.capacity == other.capacity == whole.capacity == 6 * DraftContext.CHUNK
    for layer in range(2):
        for ctx in (pieces, other):
            torch.testing.assert_close(ctx.keys(layer), whole.keys(layer), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ctx.values(layer), whole.values(layer), atol=1e-5, rtol=1e-5)
    assert whole.keys(0).shape == (2, 300, 8)


def test_crop_and_reset_forget_positions():
    drafter = random_drafter(small_config())
    hidden = torch.randn(10, 3 * 32)
    ctx = context_of(drafter, hidden)
    ctx.crop(6)
    drafter.extend([ctx], [hidden[6:]])  # re-adding the same positions restores the same context
    torch.testing.assert_close(ctx.keys(1), context_of(drafter, hidden).keys(1))
    ctx.reset()
    assert ctx.length == 0 and ctx.keys(0).shape == (2, 0, 8)
    with pytest.raises(AssertionError):
        ctx.crop(3)


def test_block_parallel_training_forward_equals_drafting_each_block():
    cfg = small_config()
    drafter = random_drafter(cfg)
    seq_len, anchors = 16, torch.tensor([[3, 8, 11]])
    hidden = torch.randn(1, seq_len, 3 * 32)
    blocks = torch.randn(1, 3, 5, 32)
    positions = anchors[..., None] + torch.arange(5)  # [1, N, T]
    visible = torch.arange(seq_len)[None, None] < anchors[..., None]  # context strictly before
    context = drafter.context_kv(hidden, torch.arange(seq_len)[None])
    with torch.no_grad():
        together = drafter(blocks, positions, context, visible)[0]
    for n, a in enumerate(anchors[0].tolist()):
        alone = drafter.draft_forward(
            blocks[:, n], positions[:, n], [context_of(drafter, hidden[0, :a])]
        )[0]
        torch.testing.assert_close(together[n], alone, atol=1e-5, rtol=1e-5)


def test_block_parallel_gradients_equal_per_block_gradients():
    drafter = random_drafter(small_config()).train()
    seq_len, anchors = 16, torch.tensor([[3, 8, 11]])
    hidden = torch.randn(1, seq_len, 3 * 32)
    blocks, weights = torch.randn(1, 3, 5, 32), torch.randn(1, 3, 5, 32)
    positions = anchors[..., None] + torch.arange(5)
    visible = torch.arange(seq_len)[None, None] < anchors[..., None]
    out = drafter(
        blocks, positions, drafter.context_kv(hidden, torch.arange(seq_len)[None]), visible
    )
    (out * weights).sum().backward()
    together = {name: p.grad.clone() for name, p in drafter.named_parameters()}
    drafter.zero_grad()
    total = torch.zeros(())
    for n, a in enumerate(anchors[0].tolist()):
        context = drafter.context_kv(hidden[:, :a], torch.arange(a)[None])
        alone = drafter(blocks[:, n : n + 1], positions[:, n : n + 1], context)
        total = total + (alone * weights[:, n : n + 1]).sum()
    total.backward()
    for name, p in drafter.named_parameters():
        torch.testing.assert_close(together[name], p.grad, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("fused", [False, True])
def test_gradients_reach_every_parameter(fused):
    drafter = random_drafter(small_config()).train()
    if fused:  # fused for drafting, the drafter still trains through its own parameters
        drafter.fuse_()
    hidden = torch.randn(2, 10, 3 * 32)
    blocks = torch.randn(2, 2, 5, 32)
    anchors = torch.tensor([[2, 6], [4, 9]])
    out = drafter(
        blocks,
        anchors[..., None] + torch.arange(5),
        drafter.context_kv(hidden, torch.arange(10).expand(2, 10)),
        torch.arange(10)[None, None] < anchors[..., None],
    )
    out.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("target_layer_ids", (3, 1), "increasing"),
        ("target_layer_ids", (), "at least one"),
        ("target_layer_ids", (1, 4), "num_target_layers"),
        ("num_kv_heads", 3, "multiple"),
        ("block_size", 1, "block_size"),
        ("mask_token_id", 100, "vocabulary"),
        ("hidden_size", 0, "hidden_size"),
    ],
)
def test_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        small_config(**{field: value})
