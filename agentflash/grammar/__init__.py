"""Grammar-constrained decoding and verification: sources, compilation, per-request constraints.

    source = json_schema(schema)            # or pydantic_model, regex, lark, assistant_turn(...)
    grammar = compile_grammar(source, tokenizer, vocab_size=model_vocab)   # cached
    constraint = grammar.new_constraint()   # one per request

The engine then masks logits with ``constraint.fill_bitmask`` / ``masks_along_draft`` and
``apply_bitmask_``, drafts with ``constrained_draft``, cuts other drafts with ``mask_prefix``
(where the mask allows them; ``validate_draft`` takes any tokenization of forced text), and
commits with ``advance``. See ``constraint.py``.
"""

from agentflash.grammar.compiler import Backend, cache_info, clear_cache, compile_grammar
from agentflash.grammar.constraint import (
    CompiledGrammar,
    Constraint,
    Draft,
    GrammarError,
    GrammarFailed,
    GrammarViolation,
    allocate_bitmask,
    allowed_token_ids,
    apply_bitmask_,
    bitmask_width,
    constrained_draft,
    greedy_verify,
    masks_along_drafts,
    unpack_bitmask,
)
from agentflash.grammar.sources import (
    GrammarKind,
    GrammarSource,
    JsonStyle,
    close_objects,
    ebnf,
    json_schema,
    json_schema_file,
    json_schema_text,
    lark,
    pydantic_model,
    regex,
)
from agentflash.grammar.tool_calls import (
    ToolChoice,
    ToolChoiceMode,
    ToolSpec,
    assistant_turn,
    tool_call_body,
    tool_call_schema,
    tool_specs,
)

__all__ = [
    "Backend",
    "CompiledGrammar",
    "Constraint",
    "Draft",
    "GrammarError",
    "GrammarFailed",
    "GrammarKind",
    "GrammarSource",
    "GrammarViolation",
    "JsonStyle",
    "ToolChoice",
    "ToolChoiceMode",
    "ToolSpec",
    "allocate_bitmask",
    "allowed_token_ids",
    "apply_bitmask_",
    "assistant_turn",
    "bitmask_width",
    "close_objects",
    "cache_info",
    "clear_cache",
    "compile_grammar",
    "constrained_draft",
    "greedy_verify",
    "ebnf",
    "json_schema",
    "json_schema_file",
    "json_schema_text",
    "lark",
    "masks_along_drafts",
    "pydantic_model",
    "regex",
    "tool_call_body",
    "tool_call_schema",
    "tool_specs",
    "unpack_bitmask",
]
