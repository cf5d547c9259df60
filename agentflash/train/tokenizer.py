"""The demo tokenizer: byte-level BPE with the Qwen3/Hermes chat tokens and a chat template."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2

EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
MASK = "<|mask|>"  # reserved for the DFlash drafter's block slots
SPECIAL_TOKENS = [EOS, IM_START, IM_END, MASK]
# Added (not special) tokens, as in Qwen3: they stay visible when decoding with skip_special_tokens.
ADDED_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
]

# Qwen3's tool template, with a shorter preamble so that the small demo model spends less context.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Their signatures:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nReturn each call as {\"name\": <function-name>, \"arguments\": <args-json-object>} within <tool_call></tool_call> tags.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if loop.first and not message.content %}{{- '\\n' }}{%- else %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def _tojson(value: Any) -> str:
    # The same serialisation as transformers' chat-template ``tojson`` filter.
    return json.dumps(value, ensure_ascii=False)


@lru_cache(maxsize=1)
def _template() -> jinja2.Template:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    return env.from_string(CHAT_TEMPLATE)


def render(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """Render a conversation with the chat template, without needing a tokenizer."""
    return _template().render(
        messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt
    )


def train_tokenizer(texts: Iterable[str], out_dir: Path, vocab_size: int = 4096) -> None:
    """Train a byte-level BPE on ``texts`` and save it so that ``AutoTokenizer`` loads it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOS,
        additional_special_tokens=[IM_START, MASK],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    save_whole(fast, out_dir)


def save_whole(fast, out_dir: Path) -> None:
    """Save ``fast`` into ``out_dir`` so that a save cut short (a kill, a full disk) leaves no
    ``tokenizer.json``, which says the tokenizer is there: saved beside, then moved in, that
    file last."""
    from agentflash.train.runs import writing

    staging = out_dir / ".tokenizer.partial"  # (hidden: check_out_dir passes it)
    shutil.rmtree(staging, ignore_errors=True)
    with writing(out_dir, "the tokenizer"):
        fast.save_pretrained(staging)
        for name in sorted(os.listdir(staging), key=lambda name: name == "tokenizer.json"):
            os.replace(staging / name, out_dir / name)
        staging.rmdir()
