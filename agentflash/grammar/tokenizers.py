"""The tokenizer as grammars see it: its identity (for the compile cache), the model's vocabulary
size (often larger than the tokenizer's) and the end-of-turn token."""

from __future__ import annotations

import hashlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from agentflash.grammar.constraint import GrammarError

_fingerprints: weakref.WeakKeyDictionary[Any, tuple[Any, str]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A content hash of a fast Hugging Face tokenizer (vocabulary, merges, added tokens).

    Two tokenizer objects loaded from the same files share it; a retrained tokenizer does not.
    Memoised per object (and re-computed if tokens were added or made special since).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError(
            f"{type(tokenizer).__name__}: grammars need a fast (Rust-backed) Hugging Face tokenizer"
        )
    # its size and its added tokens, whether special or not: an existing token made special
    # keeps the size, and an added one made special the count
    size = (len(tokenizer), tuple((i, t.content, t.special)
                                  for i, t in backend.get_added_tokens_decoder().items()))
    with _lock:
        memo = _fingerprints.get(tokenizer)
    if memo is not None and memo[0] == size:
        return memo[1]
    digest = hashlib.sha256(backend.to_str().encode()).hexdigest()[:32]
    with _lock:
        _fingerprints[tokenizer] = (size, digest)
    return digest


def chat_end_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's eos and the chat end markers it has (``<|im_end|>``, ``<|endoftext|>``,
    Llama's ``<|eot_id|>``...): where the engine ends an assistant turn, and so what no grammar
    may write."""
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else []
    to_id = getattr(tokenizer, "convert_tokens_to_ids", None)
    for marker in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>"):
        token = to_id(marker) if to_id is not None else None
        if isinstance(token, int) and token != getattr(tokenizer, "unk_token_id", None):
            ids.append(token)
    return list(dict.fromkeys(ids))


@dataclass(frozen=True)
class TokenizerInfo:
    """What a compiled grammar depends on besides its source. Equal infos share compilations."""

    fingerprint: str
    vocab_size: int  # rows of the model's embedding; masks cover this many tokens
    eos_token_id: int  # ends the output; legal once the grammar is complete
    tokenizer: Any = field(compare=False, repr=False)


def tokenizer_info(
    tokenizer: Any, vocab_size: int | None = None, eos_token_id: int | None = None
) -> TokenizerInfo:
    """Describe ``tokenizer`` for a model with ``vocab_size`` logits (default: the tokenizer's
    size); the end token defaults to the tokenizer's eos (``<|im_end|>`` for chat models)."""
    size = len(tokenizer)
    vocab_size = size if vocab_size is None else vocab_size
    if vocab_size < size:
        raise GrammarError(
            f"the model's vocabulary ({vocab_size} logits) is smaller than the "
            f"tokenizer's ({size} tokens)"
        )
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise GrammarError("the tokenizer has no eos token; pass eos_token_id")
    if not 0 <= eos < size:
        raise GrammarError(f"eos_token_id {eos} is outside the tokenizer's {size} tokens")
    return TokenizerInfo(tokenizer_fingerprint(tokenizer), vocab_size, eos, tokenizer)
