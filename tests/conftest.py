"""Shared fixtures: tiny random-weight models built from real configs, saved as HF directories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agentflash.models.loading import DEMO_DIR

# The models under test are tiny: one thread is as fast, and it leaves the other core free.
torch.set_num_threads(1)


def save_tiny_qwen3(path: Path, vocab_size: int, seed: int = 0, **overrides) -> Path:
    """A random-weight Qwen3 with the demo tokenizer's vocabulary, in Hugging Face format."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    fields.update(overrides)
    model = Qwen3ForCausalLM(Qwen3Config(**fields))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def demo_tokenizer_dir() -> Path:
    return DEMO_DIR / "target"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_tokenizer_dir) -> Path:
    """A tiny random Qwen3 directory that carries the demo tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-qwen3")
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    save_tiny_qwen3(path, vocab_size=len(tok))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo_tokenizer_dir / name).exists():
            shutil.copy(demo_tokenizer_dir / name, path / name)
    return path
