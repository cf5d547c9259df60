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


def llguidance_tokenizer(info: TokenizerInfo, **options: Any) -> Any:
    """llguidance's view of the tokenizer (``llguidance.hf.from_tokenizer``), checked: a decoder
    llguidance cannot read is a ``GrammarError`` naming the tokenizer, and so is one it reads
    otherwise than the tokenizer decodes (a ``Metaspace`` inside a ``Sequence`` of decoders:
    ``▁hello`` read as those bytes, not as " hello"), where every mask would be wrong."""
    import llguidance.hf

    name = type(info.tokenizer).__name__
    try:
        converted = llguidance.hf.from_tokenizer(info.tokenizer, eos_token=info.eos_token_id,
                                                 **options)
    except ValueError as err:  # "can't determine decoder type: Some(Metaspace(...))"
        raise GrammarError(f"{name}: grammars cannot read this tokenizer: {err}") from None
    wrong = _misread_token(info.tokenizer, converted)
    if wrong is not None:
        token, read, decoded = wrong
        raise GrammarError(
            f"{name}: grammars cannot read this tokenizer: its token {token} is the text "
            f"{decoded!r}, which llguidance reads as {read!r} (its decoder: "
            f"{_decoder_name(info.tokenizer)})")
    return converted


def _misread_token(tokenizer: Any, converted: Any, sample: int = 2048
                   ) -> tuple[int, bytes, str] | None:
    """A token, of about ``sample`` spread over the vocabulary, whose bytes llguidance reads
    otherwise than the engine decodes the token as a reply (``OutputDecoder``), or None."""
    from agentflash.engine.detokenizer import OutputDecoder

    decode = OutputDecoder(tokenizer)
    size = len(tokenizer)
    for token in range(0, size, max(1, size // sample)):
        if converted.is_special_token(token):
            continue
        text = decode([token])
        if not text or "\ufffd" in text:  # a part of a character, or a special token
            continue
        read = converted.decode_bytes([token])
        if read != text.encode():
            return token, read, text
    return None


def _decoder_name(tokenizer: Any) -> str:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ if decoder is not None else "none"
