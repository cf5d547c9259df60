"""Drafter training on a tiny random target: blocks, a short run, resuming, and tau as decoding."""

import dataclasses
import json
import random
import shutil

import pytest
import torch

from agentflash.dflash.checkpoint import load_drafter, validate_against_target
from agentflash.dflash.speculate import draft_block, greedy_accept
from agentflash.errors import UserError
from agentflash.models.loading import load_model
from agentflash.train import corpus as corpus_mod
from agentflash.train import drafter as train_mod
from agentflash.train.drafter import (
    IGNORE,
    DrafterTrainConfig,
    Sample,
    make_blocks,
    slot_weights,
    train_drafter,
    validation_tau,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def conversations(n: int) -> list[dict]:
    """A small hand-written corpus: ``n`` conversations of each kind (stands in for the
    stdlib-based corpus, which takes long to index)."""
    out = []
    for i in range(n):
        city = ["Paris", "Oslo", "Lima", "Rome"][i % 4]
        out.append(
            {
                "kind": "tool_call",
                "tools": [WEATHER],
                "messages": [
                    {"role": "user", "content": f"What is the weather in {city}?"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"name": "get_weather", "arguments": {"city": city}}],
                    },
                    {
                        "role": "tool",
                        "name": "get_weather",
                        "content": json.dumps({"temp": 20 + i}),
                    },
                    {"role": "assistant", "content": f"It is {20 + i} degrees in {city}."},
                ],
            }
        )
        out.append(
            {
                "kind": "code",
                "tools": [],
                "messages": [
                    {"role": "user", "content": f"Write a function that adds {i}."},
                    {
                        "role": "assistant",
                        "content": f"```python\ndef add(x):\n    return x + {i}\n```",
                    },
                ],
            }
        )
        out.append(
            {
                "kind": "math",
                "tools": [],
                "messages": [
                    {"role": "user", "content": f"Compute {i} + 7."},
                    {"role": "assistant", "content": f"{i} + 7 = {i + 7}.\nThe answer is {i + 7}."},
                ],
            }
        )
        out.append(
            {
                "kind": "prose",
                "tools": [],
                "messages": [
                    {"role": "user", "content": f"Explain list number {i}."},
                    {"role": "assistant", "content": "A list holds items in order."},
                ],
            }
        )
    return out


def tiny_config(**overrides) -> DrafterTrainConfig:
    fields = dict(
        num_layers=1,
        block_size=4,
        num_anchors=8,
        steps=30,
        batch_size=2,
        lr=3e-3,
        max_response_tokens=16,
        max_seq_len=512,
        regen_batch=8,
        num_val_per_kind=1,
        val_every=15,
        save_every=10,
    )
    fields.update(overrides)
    return DrafterTrainConfig(**fields)


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter-run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus_mod, "generate", lambda cfg: conversations(3))
        train_drafter(tiny_model_dir, out, tiny_config())
    return out


def read_log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_make_blocks_labels_and_positions():
    sample = Sample(ids=[10, 11, 12, 13, 14, 15, 16], prompt_len=3, kind="code")
    short = Sample(ids=[20, 21, 22, 23], prompt_len=2, kind="math")
    blocks = make_blocks(
        [sample, short], block_size=4, num_anchors=8, mask_token_id=99, rng=random.Random(0)
    )
    # every position of the answer that has a next token is an anchor: 3, 4, 5 and 2
    assert blocks.anchors.tolist() == [[3, 4, 5], [2, 0, 0]]
    assert blocks.ids[0].tolist() == [[13, 99, 99, 99], [14, 99, 99, 99], [15, 99, 99, 99]]
    assert blocks.positions[0, 1].tolist() == [4, 5, 6, 7]
    assert blocks.labels[0].tolist() == [
        [IGNORE, 14, 15, 16],
        [IGNORE, 15, 16, IGNORE],
        [IGNORE, 16, IGNORE, IGNORE],
    ]
    assert blocks.labels[1].tolist() == [[IGNORE, 23, IGNORE, IGNORE]] + [[IGNORE] * 4] * 2
    few = make_blocks([sample], block_size=4, num_anchors=2, mask_token_id=99, rng=random.Random(0))
    assert few.anchors.shape == (1, 2) and set(few.anchors[0].tolist()) <= {3, 4, 5}


def test_slot_weights_decay_from_slot_one():
    w = slot_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    assert torch.allclose(w[7], torch.tensor(float(torch.exp(torch.tensor(-1.0)))))


def test_training_reduces_loss_and_writes_a_loadable_drafter(run, tiny_model_dir):
    log = read_log(run)
    losses = [e["loss"] for e in log if "loss" in e]
    assert len(losses) == 30
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    vals = [e for e in log if "val_tau" in e]
    assert [e["step"] for e in vals] == [15, 30]
    assert set(vals[-1]["val_tau"]) == {"tool_call", "code", "math", "prose", "all"}
    assert all(1.0 <= tau <= 4.0 for tau in vals[-1]["val_tau"].values())
    drafter = load_drafter(run)
    target, _, _ = load_model(tiny_model_dir)
    validate_against_target(drafter.cfg, target.cfg)
    assert drafter.cfg.block_size == 4 and drafter.cfg.target_layer_ids == (2,)
    summary = json.loads((run / "train_drafter.json").read_text())
    assert summary["val_tau"] == vals[-1]["val_tau"]
    assert summary["drafter"]["target_layer_ids"] == [2]  # the default ones, not []
    state = torch.load(run / "checkpoints" / "latest.pt", weights_only=False)
    assert state["step"] == 30 and state["target"] == str(tiny_model_dir.resolve())
    # (the summary says it to a tenth of a second: 0.7065 is 0.7 there)
    assert 0 < round(state["train_seconds"], 1) <= summary["train_seconds"]


def test_a_rerun_resumes_without_regenerating(run, tiny_model_dir):
    def no_regeneration(*args, **kwargs):
        raise AssertionError("the cached answers should have been reused")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_mod, "regenerate", no_regeneration)
        seconds = torch.load(run / "checkpoints" / "latest.pt",
                             weights_only=False)["train_seconds"]
        train_drafter(tiny_model_dir, run, tiny_config(steps=30))
        steps = [e["step"] for e in read_log(run) if "loss" in e]
        assert steps == list(range(1, 31))  # resumed at its end: nothing more to train
        # its training time is its steps' (it was the last segment's alone: here, none); the
        # summary says it to a tenth of a second (0.6008 is 0.6 there)
        assert json.loads((run / "train_drafter.json").read_text())["train_seconds"] >= round(
            seconds, 1)
        # other flags than the run's: refused, naming the flag (a schedule spliced at step 30,
        # answers to another corpus, another learning rate, recorded as if they held throughout)
        for changed, flag in ((dict(steps=33), "--steps 30 .the learning rate's schedule ends "
                               "there., and 33 is asked"), (dict(lr=1e-2), "--lr 0.003"),
                              (dict(num_anchors=4), "--num-anchors 8"),
                              (dict(init=str(run)), "--init None"),
                              (dict(loss_gamma=3.0), "loss_gamma 7.0"),
                              (dict(corpus=dataclasses.replace(tiny_config().corpus, seed=9)),
                               "--corpus-seed")):
            with pytest.raises(UserError, match=f"the run was started with {flag}"):
                train_drafter(tiny_model_dir, run, tiny_config(**changed))
        with pytest.raises(UserError, match="different drafter .*num_layers 1 there, 2 asked"):
            train_drafter(tiny_model_dir, run, tiny_config(steps=40, num_layers=2))
        # with answers to other settings too: refused before the target answers (minutes),
        # and before the run's cached answers are rewritten for them
        cached = (run / "responses.json").read_bytes()
        with pytest.raises(UserError, match="different drafter .*num_layers 1 there, 2 asked"):
            train_drafter(tiny_model_dir, run, tiny_config(steps=40, num_layers=2,
                                                           max_response_tokens=12))
        assert (run / "responses.json").read_bytes() == cached


def test_a_run_checkpointed_on_a_gpu_resumes_on_the_cpu(run, tiny_model_dir, tmp_path):
    # torch.save records a CUDA tensor's device: the load had no map_location, and a machine
    # without one raised "Attempting to deserialize object on a CUDA device"
    import torch.serialization as serialization

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    checkpoint = copy / "checkpoints" / "latest.pt"
    state = torch.load(checkpoint, weights_only=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(state, checkpoint)
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(checkpoint, weights_only=False)  # (what a CUDA run leaves)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_mod, "regenerate", lambda *args: pytest.fail("answers made again"))
        train_drafter(tiny_model_dir, copy, tiny_config(steps=30))
    assert [e["step"] for e in read_log(copy) if "loss" in e] == list(range(1, 31))


def test_cached_answers_of_another_target_are_regenerated(run, tiny_model_dir):
    from agentflash.models.loading import load_tokenizer
    from agentflash.models.qwen3 import Qwen3Model

    target, _, _ = load_model(tiny_model_dir)
    other = Qwen3Model(target.cfg).eval()  # same shape, other weights
    calls = []

    def fake_regenerate(engine, prompts, max_tokens, label):
        calls.append(label)
        return []

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus_mod, "generate", lambda cfg: conversations(3))
        mp.setattr(train_mod, "regenerate", fake_regenerate)
        cache = run / "responses.json"
        kept = cache.read_text()
        try:
            train_mod.build_samples(target, load_tokenizer(tiny_model_dir), tiny_config(), cache)
            assert calls == []
            train_mod.build_samples(other, load_tokenizer(tiny_model_dir), tiny_config(), cache)
            assert calls == ["train", "val"]
            # a fine-tune of the same base, its embeddings, final norm and lm_head untouched
            # (LoRA's): the base's answers were reused
            cache.write_text(kept)
            tuned, _, _ = load_model(tiny_model_dir)
            with torch.no_grad():
                tuned.model.layers[0].mlp.down_proj.weight.mul_(1.01)  # (a layer only)
            train_mod.build_samples(tuned, load_tokenizer(tiny_model_dir), tiny_config(), cache)
            assert calls == ["train", "val"] * 2
            # a cache cut short (its write interrupted) is made again, not an error each rerun
            cache.write_text(kept[:100])
            train_mod.build_samples(target, load_tokenizer(tiny_model_dir), tiny_config(), cache)
            assert calls == ["train", "val"] * 3
            assert json.loads(cache.read_text())["train"] == []
        finally:
            cache.write_text(kept)


def test_a_drafter_the_target_cannot_have_leaves_no_out_behind(tiny_model_dir, tmp_path):
    # the --out was made once the target had loaded, before the drafter's shape was checked
    with pytest.raises(ValueError, match="reach past num_target_layers"):
        train_drafter(tiny_model_dir, tmp_path / "out", tiny_config(target_layer_ids=(0, 99)))
    assert not (tmp_path / "out").exists()


def test_validation_tau_is_what_draft_and_verify_decoding_achieves(run, tiny_model_dir):
    # Decode with the target verifying every block (full forwards, no cache) and compare with
    # plain greedy decoding and with validation_tau's count of the same sequence.
    target, _, _ = load_model(tiny_model_dir)
    drafter = load_drafter(run)
    responses = json.loads((run / "responses.json").read_text())["train"]
    prompt = next(s for s in responses if s["kind"] == "tool_call")
    prompt = prompt["ids"][: prompt["prompt_len"]]
    layers = drafter.cfg.target_layer_ids

    def forward(ids):
        n = len(ids)
        hidden, captured = target(
            torch.tensor([ids]),
            torch.arange(n)[None],
            [NoCache()] * target.cfg.num_layers,
            None,
            layers,
        )
        return target.logits(hidden)[0], torch.cat(captured, -1)[0]  # [n, V], [n, K*H]

    n_new = 16
    plain = list(prompt)
    with torch.no_grad():
        while len(plain) < len(prompt) + n_new:
            plain.append(int(forward(plain)[0][-1].argmax()))
        logits, hidden = forward(prompt)
        seq, steps = prompt + [int(logits[-1].argmax())], []
        ctx = drafter.new_context()
        drafter.extend([ctx], [hidden])
        while len(seq) < len(prompt) + n_new:
            draft = draft_block(
                drafter, target.embed, target.logits, torch.tensor([seq[-1]]), [ctx]
            )[0]
            logits, hidden = forward(seq + draft.tolist())
            accepted, bonus = greedy_accept(draft, logits[len(seq) - 1 :])
            produced = min(accepted + 1, len(prompt) + n_new - len(seq))
            drafter.extend([ctx], [hidden[len(seq) - 1 : len(seq) - 1 + produced]])
            seq += (draft[:accepted].tolist() + [bonus])[:produced]
            steps.append(produced)
    assert seq == plain
    assert sum(steps) / len(steps) > 1.5  # the trained drafter gets whole runs accepted
    tau = validation_tau(drafter, target, [Sample(plain, len(prompt), "tool_call")])
    assert tau == {
        "tool_call": pytest.approx(sum(steps) / len(steps)),
        "all": pytest.approx(sum(steps) / len(steps)),
    }


class NoCache:
    def write(self, k, v):
        return k, v


def test_no_training_conversation_begins_as_a_validation_one():
    # the code generator draws from ~1,000 functions: held out by position only, 8 of 16 code
    # validation prompts were training prompts too (their greedy answers the same)
    convos = corpus_mod.generate(corpus_mod.CorpusConfig(seed=6, num_tool_call=0, num_code=1200,
                                                 num_math=0, num_prose=0))
    train, val = train_mod.split_corpus(convos, 16)
    assert len(val) == 16 and val == convos[-16:]
    openings = {train_mod._opening(c) for c in val}
    assert not openings & {train_mod._opening(c) for c in train}
    assert len(train) + len(val) < len(convos)  # there were some: now left out of training
    # nor one that asks for a validation one's function in another wording, whose answer is
    # the same ("Show code that does this: X" held out, "Implement this in Python: X" trained)
    answers = {train_mod._first_answer(c) for c in val}
    assert not answers & {train_mod._first_answer(c) for c in train}
    dropped = [c for c in convos[:-16] if train_mod._opening(c) in openings
               or train_mod._first_answer(c) in answers]
    assert len(dropped) > len([c for c in convos[:-16] if train_mod._opening(c) in openings])
    assert len(train) == len(convos) - 16 - len(dropped)


@pytest.mark.parametrize("share", [0.0, 0.01, 0.5, 0.6, 1.0])
def test_the_constrained_share_is_spread_over_the_tool_calls_of_each_split(share):
    # the first of every hundred conversations of any kind: a split of 64 (16 tool calls) had
    # 14 of 16 constrained for 0.6
    convos = corpus_mod.generate(corpus_mod.CorpusConfig(seed=1, num_tool_call=16, num_code=16,
                                                 num_math=16, num_prose=16))
    grammars = train_mod._served_grammars(convos, share)
    calls = [g for c, g in zip(convos, grammars, strict=True) if c["kind"] == "tool_call"]
    assert all(g is None for c, g in zip(convos, grammars) if c["kind"] != "tool_call")
    assert sum(g is not None for g in calls) == int(16 * share)


def test_init_takes_a_directory_under_the_home_directory(tmp_path, monkeypatch):
    # "--init=~/d" (which a shell leaves as it is) was "not a drafter directory"
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "d").mkdir()
    assert tiny_config(init="~/d").init == "~/d"
    with pytest.raises(ValueError, match="init: ~/none is not a drafter directory"):
        tiny_config(init="~/none")


def test_init_starts_a_new_run_from_a_trained_drafter(run, tiny_model_dir, tmp_path,
                                                       monkeypatch):
    shutil.copy(run / "responses.json", tmp_path / "responses.json")  # the same answers
    trained_loss = [e["loss"] for e in read_log(run) if "loss" in e][-1]
    fresh_loss = [e["loss"] for e in read_log(run) if "loss" in e][0]
    train_drafter(tiny_model_dir, tmp_path, tiny_config(steps=1, init=str(run), val_every=100))
    first = [e["loss"] for e in read_log(tmp_path) if "loss" in e]
    assert len(first) == 1 and abs(first[0] - trained_loss) < abs(first[0] - fresh_loss)
    # resumed: its --init however written, or none (its weights are the checkpoint's), and the
    # default target layers by their numbers; another --init is refused
    monkeypatch.chdir(run.parent)
    for init in (run.name, f"./{run.name}", None):
        train_drafter(tiny_model_dir, tmp_path, tiny_config(steps=1, init=init, val_every=100,
                                                            target_layer_ids=(2,)))
        # (the directory, however it was written: "runs/x" read from elsewhere names nothing)
        assert json.loads((tmp_path / "train_drafter.json").read_text())["drafter"]["init"] \
            == str(run.resolve())
    elsewhere = shutil.copytree(run, tmp_path.parent / f"{tmp_path.name}_copy")
    with pytest.raises(UserError, match="the run was started with --init"):
        train_drafter(tiny_model_dir, tmp_path, tiny_config(steps=1, init=str(elsewhere)))
    other = tmp_path / "other"
    with pytest.raises(UserError, match=f"{run}.*block_size"):
        train_drafter(tiny_model_dir, other, tiny_config(steps=1, init=str(run), block_size=8))
    # refused before the target answered the corpus (minutes, at the default size)
    assert not (other / "responses.json").exists()


def test_a_drafter_deepened_to_more_layers_drafts_as_before(run, tiny_model_dir, tmp_path):
    """``deepen``: the new layers' output projections are zero, so they add nothing to the
    residual stream and the deeper drafter's draft logits are the shallow one's, bitwise;
    ``--init`` deepens a shallower drafter."""
    shallow = load_drafter(run, dtype=torch.float32)
    deep = train_mod.deepen(shallow, 3)
    assert deep.cfg.num_layers == 3 and len(deep.layers) == 3
    assert torch.equal(deep.layers[2].self_attn.q_proj.weight,
                       shallow.layers[-1].self_attn.q_proj.weight)
    target, _, _ = load_model(tiny_model_dir)
    ids = list(range(5, 25))
    layers = shallow.cfg.target_layer_ids
    _, captured = target(torch.tensor([ids]), torch.arange(len(ids))[None],
                         [NoCache()] * target.cfg.num_layers, None, layers)
    hidden = torch.cat(captured, -1)
    block = target.embed(torch.tensor([[ids[-1]] + [shallow.cfg.mask_token_id] * 3]))
    positions = torch.arange(len(ids), len(ids) + 4)[None, None]
    logits = []
    for drafter in (shallow, deep):
        with torch.no_grad():
            kv = drafter.context_kv(hidden, torch.arange(len(ids))[None])
            logits.append(target.logits(drafter(block[:, None], positions, kv)))
    assert torch.equal(logits[0], logits[1])
    shutil.copy(run / "responses.json", tmp_path / "responses.json")
    trained_loss = [e["loss"] for e in read_log(run) if "loss" in e][-1]
    fresh_loss = [e["loss"] for e in read_log(run) if "loss" in e][0]
    train_drafter(tiny_model_dir, tmp_path, tiny_config(steps=1, init=str(run), val_every=100,
                                                        num_layers=2, target_layer_ids=layers))
    first = [e["loss"] for e in read_log(tmp_path) if "loss" in e]
    assert abs(first[0] - trained_loss) < abs(first[0] - fresh_loss)
    assert load_drafter(tmp_path).cfg.num_layers == 2


def test_a_drafter_widened_to_more_target_layers_drafts_as_before(run, tiny_model_dir, tmp_path):
    """``widen_context``: the new layers' fc columns are zero, so the widened drafter's draft
    logits from the wider context are the narrow one's; ``--init`` widens a drafter that reads a
    subset of the run's layers, and refuses one that does not."""
    narrow = load_drafter(run, dtype=torch.float32)
    wide = train_mod.widen_context(narrow, (0, 2, 3))
    assert wide.cfg.target_layer_ids == (0, 2, 3)
    h = narrow.cfg.hidden_size
    assert wide.fc.weight.shape == (h, 3 * h)
    assert torch.equal(wide.fc.weight[:, h : 2 * h], narrow.fc.weight)
    target, _, _ = load_model(tiny_model_dir)
    ids = list(range(5, 25))
    _, captured = target(torch.tensor([ids]), torch.arange(len(ids))[None],
                         [NoCache()] * target.cfg.num_layers, None, (0, 2, 3))
    hidden = torch.cat(captured, -1)  # [1, n, 3H]: layers 0, 2 and 3 side by side
    block = target.embed(torch.tensor([[ids[-1]] + [narrow.cfg.mask_token_id] * 3]))
    positions = torch.arange(len(ids), len(ids) + 4)[None, None]
    logits = []
    for drafter, context in ((narrow, hidden[..., h : 2 * h]), (wide, hidden)):
        with torch.no_grad():
            kv = drafter.context_kv(context, torch.arange(len(ids))[None])
            logits.append(target.logits(drafter(block[:, None], positions, kv)))
    assert torch.allclose(logits[0], logits[1], atol=1e-5)
    assert not torch.equal(hidden[..., :h], torch.zeros_like(hidden[..., :h]))  # real inputs

    shutil.copy(run / "responses.json", tmp_path / "responses.json")
    trained_loss = [e["loss"] for e in read_log(run) if "loss" in e][-1]
    fresh_loss = [e["loss"] for e in read_log(run) if "loss" in e][0]
    train_drafter(tiny_model_dir, tmp_path, tiny_config(steps=1, init=str(run), val_every=100,
                                                        target_layer_ids=(0, 2)))
    first = [e["loss"] for e in read_log(tmp_path) if "loss" in e]
    assert abs(first[0] - trained_loss) < abs(first[0] - fresh_loss)
    assert load_drafter(tmp_path).cfg.target_layer_ids == (0, 2)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(run / "responses.json", other / "responses.json")
    with pytest.raises(UserError, match=f"{run}.*target_layer_ids"):
        train_drafter(tiny_model_dir, other, tiny_config(steps=1, init=str(run),
                                                         target_layer_ids=(0, 1)))


def test_tool_call_answers_can_be_regenerated_as_served_under_the_tools_grammar(
    tiny_model_dir, tmp_path
):
    """With ``constrained_tool_calls=1`` every tool-call turn is answered under tool_choice
    auto's grammar (what the engine serves when tools are given); the rest stay free."""
    from agentflash.grammar import assistant_turn, compile_grammar
    from agentflash.models.loading import load_tokenizer

    target, _, _ = load_model(tiny_model_dir)
    tok = load_tokenizer(tiny_model_dir)
    seen = []
    real = train_mod.regenerate

    def spy(engine, prompts, max_tokens, label):
        seen.extend(prompts)
        return real(engine, prompts, max_tokens, label)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus_mod, "generate", lambda cfg: conversations(2))
        mp.setattr(train_mod, "regenerate", spy)
        train, val = train_mod.build_samples(
            target, tok, tiny_config(constrained_tool_calls=1.0, max_response_tokens=40),
            tmp_path / "responses.json",
        )
    grammars = [(kind, g) for _, kind, g in seen]
    assert {kind for kind, g in grammars if g is not None} == {"tool_call"}
    assert all(g is not None for kind, g in grammars if kind == "tool_call")
    grammar = compile_grammar(assistant_turn([WEATHER], "auto"), tok,
                              vocab_size=target.cfg.vocab_size, eos_token_id=tok.eos_token_id)
    for sample in train + val:
        if sample.kind == "tool_call":
            answer = sample.ids[sample.prompt_len:]
            assert grammar.new_constraint().validate_draft(answer) == len(answer)
    with pytest.raises(ValueError, match="constrained_tool_calls"):
        tiny_config(constrained_tool_calls=1.5)


def test_training_prompts_are_the_target_s_own_chat_template_s(tiny_model_dir):
    from agentflash.engine.engine import Engine
    from agentflash.train import tokenizer as tokenizer_mod

    engine = Engine.from_pretrained(str(tiny_model_dir))
    convos = corpus_mod.generate(corpus_mod.CorpusConfig(seed=3, num_tool_call=6, num_code=2,
                                                         num_math=2, num_prose=2))
    # the demo's template: the prompts its drafter was trained on, to the token
    for convo in convos:
        built_in = [engine.tokenizer(tokenizer_mod.render(convo["messages"][:j], convo["tools"],
                                                          add_generation_prompt=True),
                                     add_special_tokens=False)["input_ids"]
                    for j, m in enumerate(convo["messages"]) if m["role"] == "assistant"]
        assert train_mod.turn_prompts(convo, engine.chat_prompt) == built_in
    # another model's: the target answered prompts laid out in the demo's format, which it is
    # never served
    engine.tokenizer.chat_template = (
        "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}"
        "{% for c in m.get('tool_calls') or [] %}[{{ c.function.name }} "
        "{{ c.function.arguments }} {{ c.id }}]{% endfor %}"
        "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<<assistant>>{% endif %}")
    convo = next(c for c in convos if c["kind"] == "tool_call" and len(c["messages"]) > 3)
    first, second = train_mod.turn_prompts(convo, engine.chat_prompt)[:2]
    assert engine.tokenizer.decode(first).startswith("<<system>>")
    call = convo["messages"][2]["tool_calls"][0]
    said = engine.tokenizer.decode(second)
    assert f"[{call['name']} {json.dumps(call['arguments'])} call_2_0]" in said
    assert "(call_2_0)" in said and said.endswith("<<assistant>>")


def test_answers_are_made_again_for_another_chat_template(tiny_model_dir, tmp_path):
    # the answers' cache knew the weights, not the template: a run resumed after the template
    # changed (or begun before prompts followed it) trained on prompts of the old layout
    from agentflash.models.loading import load_tokenizer

    target, _, _ = load_model(str(tiny_model_dir))
    tokenizer = load_tokenizer(tiny_model_dir)
    cfg = train_mod.DrafterTrainConfig(
        max_response_tokens=4, max_seq_len=512, regen_batch=8, num_val_per_kind=1,
        corpus=corpus_mod.CorpusConfig(seed=5, num_tool_call=3, num_code=1, num_math=1,
                                       num_prose=1))
    cache = tmp_path / "responses.json"
    first, _ = train_mod.build_samples(target, tokenizer, cfg, cache)
    tokenizer.chat_template = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}"
                               "{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}")
    again, _ = train_mod.build_samples(target, tokenizer, cfg, cache)
    fresh, _ = train_mod.build_samples(target, tokenizer, cfg, tmp_path / "fresh.json")
    assert [s.ids for s in again] == [s.ids for s in fresh] != [s.ids for s in first]
    assert tokenizer.decode(again[0].ids).startswith("<<system>>")


def test_a_target_without_a_chat_template_is_named_before_any_work(tiny_model_dir, tmp_path):
    # it was "None: the tokenizer has no chat template", a minute in, an empty --out left
    target = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=f"{target}: the tokenizer has no chat template"):
        train_drafter(target, tmp_path / "out", train_mod.DrafterTrainConfig(
            steps=1, max_response_tokens=4, corpus=corpus_mod.CorpusConfig(
                seed=5, num_tool_call=2, num_code=1, num_math=1, num_prose=1)))
    assert not (tmp_path / "out").exists()


def test_a_run_trains_alike_whether_the_answers_were_cached_or_not(run, tiny_model_dir, tmp_path):
    # the engine that answered the corpus laid the target's weights out for inference in place,
    # and training on them gave other gradients (1e-7): a rerun of cached answers, or a resumed
    # run, ended with other weights than the run that answered
    from safetensors.torch import load_file

    cached = tmp_path / "cached"
    cached.mkdir()
    shutil.copy(run / "responses.json", cached / "responses.json")
    train_mod.train_drafter(tiny_model_dir, cached, tiny_config())
    ours, theirs = load_file(cached / "model.safetensors"), load_file(run / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
