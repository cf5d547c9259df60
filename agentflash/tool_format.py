"""The Qwen3/Hermes tool-call format:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class MalformedToolCall:
    body: str
    error: str


def parse_tool_calls(text: str) -> tuple[list[ParsedToolCall], list[MalformedToolCall]]:
    """Every closed ``<tool_call>`` block of ``text``: the well-formed calls and the malformed ones."""  # noqa: E501
    calls, bad = [], []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        obj, error = load_body(body)
        if error is not None:
            bad.append(MalformedToolCall(body, error))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            bad.append(MalformedToolCall(body, 'expected an object with a string "name"'))
            continue
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            bad.append(MalformedToolCall(body, '"arguments" must be an object'))
            continue
        calls.append(ParsedToolCall(obj["name"], args))
    return calls, bad


def load_body(body: str) -> tuple[Any, str | None]:
    """A call's body as JSON, or why it is not: whatever the model wrote, never an exception
    (an integer of more digits than Python converts, nesting deeper than it recurses)."""
    try:
        return json.loads(body), None
    except json.JSONDecodeError as err:
        return None, f"invalid JSON: {err.msg}"
    except (ValueError, RecursionError) as err:
        return None, f"invalid JSON: {str(err) or type(err).__name__}"


def text_outside_calls(text: str) -> str:
    """The text of a reply with its tool-call blocks removed."""
    return _CALL.sub("", text).strip()
