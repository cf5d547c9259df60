"""A training run's directory: what may be trained into it, and its loss log on a resume.

``train target`` and ``train drafter`` write a model into ``--out`` and keep their checkpoint in
``--out/checkpoints/latest.pt``, from which a rerun resumes. Before any work, the directory must
be new, empty, or a run of the same kind to resume (the same target, for a drafter, and not past
the steps asked for): training into a model's own directory, or into the other kind of run,
overwrote what was there.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentflash.errors import UserError, expand_user

# files only one kind of run writes (besides the checkpoint, which says its kind itself)
_OWN_FILES = {"target": ("tokenizer.json", "train_config.json"),
              "drafter": ("responses.json", "train_drafter.json")}
# every name a run writes into --out (a target's tokenizer files are transformers' to name)
_RUN_FILES = {
    "target": ("checkpoints", "train_log.jsonl", "train_config.json", "config.json",
               "generation_config.json", "model.safetensors", "chat_template.jinja",
               "special_tokens_map.json", "added_tokens.json"),
    "drafter": ("checkpoints", "train_log.jsonl", "train_drafter.json", "config.json",
                "model.safetensors", "responses.json", "responses.json.tmp"),
}


def make_out_dir(out: Path) -> None:
    """Make ``--out`` (and its parents), or a ``UserError`` saying why it cannot be made."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # read-only, no permission
        raise UserError(f"{out}: --out cannot be made: {err.strerror or err}") from None


def check_out_dir(out: Path, kind: str, steps: int, target: str | None = None,
                  settings: dict[str, Any] | None = None) -> None:
    """Refuse an ``out`` (a directory, or a path to make one at: the CLI's ``_out_dir`` checks
    that) that this run would spoil, naming why; ``target``: the drafter's target as given;
    ``settings``: the run's (``run_settings``), which a run to resume must have been given."""
    if target is not None and target != "demo" and Path(target).resolve() == out.resolve():
        raise UserError(f"{out}: --out is the target's directory: the drafter would overwrite "
                        f"the target; give another --out")
    if not out.is_dir() or not any(out.iterdir()):
        return
    other = "drafter" if kind == "target" else "target"
    found = [name for name in _OWN_FILES[other] if (out / name).exists()]
    if found:
        raise UserError(f"{out}: holds a {other} run ({found[0]}): give another --out")
    strangers = sorted(p.name for p in out.iterdir() if not _run_file(p.name, kind))
    if strangers:  # a run would write among them (read a tokenizer.json that is not its own)
        raise UserError(f"{out}: holds {strangers[0]!r}, which a {kind} run does not write: "
                        f"give a new or empty --out, or a {kind} run to resume")
    path = out / "checkpoints" / "latest.pt"  # where target.py and drafter.py keep it
    if not path.exists():
        if (out / "config.json").exists() or (out / "model.safetensors").exists():
            raise UserError(f"{out}: holds a model and no checkpoint to resume from: give a new "
                            f"or empty --out (training would overwrite the model)")
        return
    state = read_checkpoint(path)
    run_kind = "drafter" if "drafter" in state else "target"
    if run_kind != kind:
        raise UserError(f"{path}: a {run_kind} run's checkpoint: give another --out")
    if settings is not None:
        check_settings(path, state.get("settings"), settings, shape_checked=kind == "drafter")
    done = int(state.get("step", 0))
    if done > steps:
        raise UserError(f"{path}: the run is at step {done}, past --steps {steps}: give --steps "
                        f"{done} or more to go on, or another --out")
    trained_for = state.get("target")
    if trained_for is not None:  # a run of an earlier version kept the demo's directory
        trained_for = target_name(trained_for)
    if target is not None and trained_for is not None and trained_for != target_name(target):
        raise UserError(f"{path}: the drafter was trained for the target {trained_for}, not "
                        f"{target_name(target)}: give that target, or another --out")


def _run_file(name: str, kind: str) -> bool:
    # a hidden file (.DS_Store) is the system's, not the user's work a run would write among
    return (name in _RUN_FILES[kind] or name.startswith(".")
            or (kind == "target" and name.startswith("tokenizer")))


# what a run's own flags are named on the command line (a field that has none is named as is)
_FLAGS = {"steps": "--steps", "lr": "--lr", "num_layers": "--num-layers",
          "block_size": "--block-size", "num_anchors": "--num-anchors", "init": "--init",
          "target_layer_ids": "--target-layer-ids",
          "constrained_tool_calls": "--constrained-tool-calls", "corpus.seed": "--corpus-seed"}
# what does not change the weights a run trains: how often it saves and validates, where
_NOT_SETTINGS = ("save_every", "val_every", "device", "regen_batch")
# a drafter's shape (``check_settings``' shape_checked)
_SHAPE = ("num_layers", "target_layer_ids", "block_size", "mask_token_id")


def run_settings(cfg: Any) -> dict[str, Any]:
    """What of a training config (a dataclass) shapes the weights its run makes: kept in its
    checkpoints, and what a resumed run must be given again (``check_settings``)."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_SETTINGS}
    return json.loads(json.dumps(fields))  # tuples as lists: as a checkpoint's compare


def check_settings(path: Path, saved: dict[str, Any] | None, asked: dict[str, Any],
                   shape_checked: bool = False) -> None:
    """Refuse to resume the run whose checkpoint ``path`` keeps ``saved`` (``run_settings``;
    None: an earlier version's checkpoint, which kept none) with other settings, naming the
    first flag that differs: its steps would have gone on under another learning rate, other
    data or another schedule, and its record say the new flags held throughout.
    ``shape_checked``: a drafter run's, whose shape its checkpoint's drafter config answers for,
    resolved (its default target layers are the ones they stand for, not [])."""
    if saved is None:
        return
    kept = _flat(saved)
    for key, value in _flat(asked).items():
        had = kept.get(key)
        if had == value or (shape_checked and key in _SHAPE) or \
                (key == "init" and _same_init(had, value)):
            continue
        if key.startswith("corpus.num_"):
            flag = "--num-conversations or --mix"
            had, value = _corpus_counts(saved), _corpus_counts(asked)
        else:
            flag = _FLAGS.get(key, key)
        why = " (the learning rate's schedule ends there)" if key == "steps" else ""
        raise UserError(f"{path}: the run was started with {flag} {had!r}{why}, and "
                        f"{value!r} is asked: give the run's own to resume it, or another "
                        f"--out")


def _same_init(had: str | None, asked: str | None) -> bool:
    """Whether ``asked`` starts the run ``had`` started from: the same directory however it is
    written (relative, absolute, ``~``), or none (a resumed run's weights are its checkpoint's:
    its ``--init`` may have gone since)."""
    if asked is None or had == asked:
        return True
    if had is None:
        return False
    return init_dir(had) == init_dir(asked)


def init_dir(init: str) -> str:
    """The directory ``--init`` names: ``demo`` the demo drafter's, a path resolved."""
    from agentflash.models.loading import DEMO_DIR

    return str((DEMO_DIR / "drafter" if init == "demo" else expand_user(init)).resolve())


def _flat(settings: dict[str, Any], head: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{head}{key}."))
        else:
            out[head + key] = value
    return out


def _corpus_counts(settings: dict[str, Any]) -> str:
    corpus = settings.get("corpus", {})
    return ",".join(str(corpus.get(f"num_{kind}")) for kind in ("tool_call", "code", "math",
                                                                 "prose"))


def read_checkpoint(path: Path) -> dict[str, Any]:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # a file cut short, or not a checkpoint
        raise UserError(f"{path}: cannot read the checkpoint: {err}") from None


def target_name(target: str | Path) -> str:
    """How a drafter's checkpoint names its target: ``demo`` (also given as the bundled
    target's directory) or the directory's full path."""
    from agentflash.models.loading import DEMO_DIR

    if str(target) == "demo":
        return "demo"
    path = expand_user(target).resolve()
    return "demo" if path == (DEMO_DIR / "target").resolve() else str(path)


@contextmanager
def writing(path: Path, what: str) -> Iterator[None]:
    """A failure while ``what`` is written at ``path`` (a full disk, a file-size limit: torch,
    safetensors and tokenizers each raise their own kind of error) as a ``UserError`` naming it."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        raise UserError(f"{path}: cannot write {what}: {err}") from err


class RunLog:
    """The run's loss log (``open_log``): each line written through to the disk."""

    def __init__(self, path: Path):
        self.path = path
        with writing(path, "the log"):
            self.file = path.open("a", encoding="utf-8")

    def write(self, line: str) -> None:
        with writing(self.path, "the log"):
            self.file.write(line)
            self.file.flush()

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def open_log(path: Path, start: int) -> RunLog:
    """The run's loss log, for appending from step ``start`` on: lines of later steps (written
    after the checkpoint a resume starts from) are dropped, so that each step has one line."""
    if path.exists():
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                step = json.loads(line).get("step", 0)
            except (ValueError, AttributeError):
                continue  # a line cut short by the interruption
            if isinstance(step, int) and step <= start:
                kept.append(line + "\n")
        with writing(path, "the log"):
            path.write_text("".join(kept), encoding="utf-8")
    return RunLog(path)
