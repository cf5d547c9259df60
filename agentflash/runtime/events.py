"""What a streamed run reports, in the order it happens. ``Runner.run`` collects the same events.

Every event names the agent it belongs to; a workflow wraps them with the step they belong to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AgentTurnStarted:
    """A model turn begins (``turn`` counts the run's turns from 1)."""

    agent: str
    turn: int


@dataclass(frozen=True)
class TextDelta:
    """Prose the model is writing (outside tool calls)."""

    agent: str
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of a tool call's arguments JSON, as the model writes it."""

    agent: str
    index: int  # the call's position within its turn
    name: str
    arguments_delta: str


@dataclass(frozen=True)
class ToolStarted:
    """A tool call closed and was dispatched (the model may still be writing); its arguments
    are validated as it runs (invalid ones, an unknown tool or a malformed call end in an error
    ``ToolResult``, the tool never called)."""

    agent: str
    call_id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """A tool call's result as the model will read it; ``is_error`` when it failed, timed out or
    was not a valid call."""

    agent: str
    call_id: str
    name: str
    arguments: dict[str, Any]
    output: str
    is_error: bool
    duration_s: float


@dataclass(frozen=True)
class HandoffOccurred:
    """The conversation passes to another agent."""

    from_agent: str
    to_agent: str
    reason: str


@dataclass(frozen=True)
class GenerationStats:
    """Speed of one model turn: the engine's stats (mode, tau, target_forwards, draft_forwards,
    new_tokens, tokens_per_s, and per-segment figures under ``segments``)."""

    agent: str
    turn: int
    finish_reason: str
    stats: dict[str, Any]


@dataclass(frozen=True)
class FinalOutput:
    """The run's answer: text, or an instance of the agent's output type."""

    agent: str
    output: Any


RunEvent = (AgentTurnStarted | TextDelta | ToolCallDelta | ToolStarted | ToolResult
            | HandoffOccurred | GenerationStats | FinalOutput)
