"""``train target``'s files under the failures users meet: a save cut short, a full disk."""

import subprocess
import sys

import pytest

from agentflash.errors import UserError

# a process whose files may not grow past 100 KB: its writes fail as on a full disk (Python
# ignores SIGXFSZ, so a write past the limit raises EFBIG in whichever library wrote)
LIMITED = """
import resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
from agentflash.errors import UserError
out = Path(sys.argv[1])
try:
{body}
except UserError as err:
    print("UserError:", err)
"""


def run_limited(body: str, out) -> str:
    code = LIMITED.format(body="\n".join("    " + line for line in body.splitlines()))
    done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_tokenizer_save_cut_short_leaves_no_tokenizer_json(tmp_path, demo_tokenizer_dir):
    # transformers writes tokenizer.json last, in place: a cut save left half of one, which the
    # next run took for its tokenizer and failed on, a traceback at every rerun
    out = tmp_path / "out"
    out.mkdir()
    said = run_limited(f"""
from transformers import AutoTokenizer
from agentflash.train.tokenizer import save_whole
save_whole(AutoTokenizer.from_pretrained({str(demo_tokenizer_dir)!r}), out)
""", out)  # the demo's tokenizer.json is 260 KB
    assert said.startswith(f"UserError: {out}: cannot write the tokenizer: ") and "27" in said
    assert not (out / "tokenizer.json").exists()
    from transformers import AutoTokenizer

    from agentflash.train.tokenizer import save_whole

    save_whole(AutoTokenizer.from_pretrained(demo_tokenizer_dir), out)  # the space is back
    assert (out / "tokenizer.json").read_bytes() == (demo_tokenizer_dir
                                                     / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == ["chat_template.jinja", "tokenizer.json",
                                                     "tokenizer_config.json"]


def test_a_tokenizer_an_earlier_run_left_unreadable_is_named_before_the_corpus(
        tmp_path, demo_tokenizer_dir, monkeypatch):
    from agentflash.train import corpus as corpus_mod
    from agentflash.train.target import train_target

    out = tmp_path / "out"
    out.mkdir()
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (out / name).write_bytes((demo_tokenizer_dir / name).read_bytes())
    (out / "tokenizer.json").write_bytes((demo_tokenizer_dir / "tokenizer.json").read_bytes()
                                         [:100_000])

    def no_corpus(*_):
        raise AssertionError("the corpus was generated before the tokenizer was read")

    monkeypatch.setattr(corpus_mod, "generate", no_corpus)
    with pytest.raises(UserError, match=f"{out / 'tokenizer.json'}: cannot load the tokenizer "
                                        f"an earlier run saved .*: remove it to train the "
                                        f"tokenizer again"):
        train_target(out)


@pytest.mark.parametrize(("body", "message"), [
    # torch's RuntimeError ("unexpected pos"), a traceback from train target and drafter
    ("""
import torch
from agentflash.train.target import _save_checkpoint
model = torch.nn.Linear(200, 200)
_save_checkpoint(out / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()), {})
""", "checkpoints/latest.pt.tmp: cannot write the checkpoint: "),
    ("""
from agentflash.train.runs import open_log
log = open_log(out / "train_log.jsonl", 0)
for step in range(20_000):
    log.write('{"step": %d, "loss": 1.0}\\n' % step)
""", "train_log.jsonl: cannot write the log: [Errno 27] File too large"),
])
def test_a_write_that_fails_is_named(tmp_path, body, message):
    said = run_limited(body, tmp_path)
    assert said.startswith(f"UserError: {tmp_path}/") and message in said, said


def test_a_resumed_run_is_refused_other_settings_by_name(tmp_path):
    # the target's shape is its settings' to answer for (a drafter's, its checkpoint's drafter
    # config): another num_layers ended in a state_dict's RuntimeError
    from agentflash.models.loading import DEMO_DIR
    from agentflash.train.drafter import DrafterTrainConfig, drafter_settings
    from agentflash.train.runs import check_settings
    from agentflash.train.target import TargetTrainConfig, target_settings

    path = tmp_path / "latest.pt"
    with pytest.raises(UserError, match="started with --num-layers 2, and 3 is asked"):
        check_settings(path, target_settings(TargetTrainConfig(num_layers=2)),
                       target_settings(TargetTrainConfig(num_layers=3)))
    check_settings(path, target_settings(TargetTrainConfig()), target_settings(
        TargetTrainConfig(save_every=7)))  # how often it saves changes no weight
    # --init demo is the demo drafter's directory however it is named
    demo = drafter_settings(DrafterTrainConfig(init="demo"))
    check_settings(path, demo, drafter_settings(DrafterTrainConfig(init=str(DEMO_DIR / "drafter"))))
    check_settings(path, demo, drafter_settings(DrafterTrainConfig()))  # none: the checkpoint's
    with pytest.raises(UserError, match="--init 'demo', and '/"):
        check_settings(path, demo, drafter_settings(DrafterTrainConfig(init=str(tmp_path))))
