"""The one seam between the agent runtime and whatever writes the model's replies.

A ``Backend`` takes a ``ModelRequest`` (OpenAI-format messages and tools, a tool choice, an
optional output schema and decoding settings) and streams normalised ``ModelEvent``s: prose,
tool-call argument deltas as they are written, each complete tool call the moment it closes, and
one ``ModelFinish`` with the engine's stats. The runner never sees a backend's wire format.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentflash.errors import (
    SEED_TEXT,
    TEMPERATURE_TEXT,
    UserError,
    expand_user,
    is_int,
    is_seed,
    is_temperature,
)


class Speculation(str, enum.Enum):
    """How a generation may use DFlash block speculation."""

    AUTO = "auto"  # the router picks per segment
    DFLASH = "dflash"  # speculate on every segment
    OFF = "off"  # plain decoding


@dataclass(frozen=True)
class Decoding:
    """How an agent's replies are decoded. Checked when built; a bad value names its field."""

    speculation: Speculation = Speculation.AUTO
    block_size: int | None = None  # DFlash block: committed token + drafts; None: the drafter's
    temperature: float = 0.0  # 0 means greedy
    max_tokens: int = 512  # per model turn
    seed: int | None = None

    def __post_init__(self) -> None:
        # the engine's own ``Speculation`` (``agentflash.engine.request``) by its value
        given = self.speculation
        value = given.value if isinstance(given, enum.Enum) else given
        try:
            object.__setattr__(self, "speculation", Speculation(value))
        except ValueError:
            raise UserError(f"decoding.speculation must be auto, dflash or off, "
                            f"got {given!r}") from None
        if self.block_size is not None and (not is_int(self.block_size)
                                            or not 2 <= self.block_size <= 64):
            raise UserError(f"decoding.block_size must be an integer in [2, 64], "
                            f"got {self.block_size!r}")
        if not is_temperature(self.temperature):
            raise UserError(f"decoding.temperature must be {TEMPERATURE_TEXT}, got "
                            f"{self.temperature!r}")
        object.__setattr__(self, "temperature", float(self.temperature))  # a numpy float too
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise UserError(f"decoding.max_tokens must be a positive integer, "
                            f"got {self.max_tokens!r}")
        if self.seed is not None and not is_seed(self.seed):
            raise UserError(f"decoding.seed must be {SEED_TEXT}, got {self.seed!r}")
        for name in ("block_size", "max_tokens", "seed"):  # a numpy integer as Python's: JSON
            value = getattr(self, name)  # of a remote request, a span's attributes
            if value is not None:
                object.__setattr__(self, name, int(value))




class ToolChoice(str, enum.Enum):
    """Whether the model may, must or must not call tools on a turn."""

    AUTO = "auto"
    REQUIRED = "required"
    NONE = "none"


@dataclass(frozen=True)
class ForceTool:
    """The model must call this one tool."""

    name: str


ToolChoiceSpec = ToolChoice | ForceTool


@dataclass(frozen=True)
class ModelRequest:
    """One model turn, as every backend receives it."""

    messages: list[dict[str, Any]]  # OpenAI chat format, the system message first
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tools list
    tool_choice: ToolChoiceSpec = ToolChoice.AUTO
    output_schema: dict[str, Any] | None = None  # the final answer's JSON Schema, if structured
    decoding: Decoding = field(default_factory=Decoding)


# --- events -------------------------------------------------------------------------------------


def unclosed_call_error(finish_reason: str) -> str:
    """Why a call the reply left open is malformed: the same words on every backend, so that a
    conversation goes on alike embedded and through a server."""
    from agentflash.tool_format import CLOSE

    return f"the tool call was not closed with {CLOSE} (generation ended: {finish_reason})"


@dataclass(frozen=True)
class TextDelta:
    """Prose the model wrote outside tool calls."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of a tool call's ``arguments`` JSON, as written. The deltas of one call concatenate
    to its arguments text; the first delta of a call may be empty (its name is then known)."""

    index: int  # position of the call within this turn
    name: str
    arguments_delta: str


@dataclass(frozen=True)
class ToolCall:
    """A complete, well-formed tool call."""

    id: str  # unique within the reply (a malformed call's too): each result finds its call by it
    name: str
    arguments: dict[str, Any]
    # the arguments' JSON as the model wrote it ("": not known), which the conversation gives
    # back to it: re-written (json.dumps's \u00fc for ü, 2.5 for 2.50), the next turn's prompt
    # was another than a server's, which replays a call as written
    arguments_text: str = field(default="", compare=False)


@dataclass(frozen=True)
class MalformedToolCall:
    """A closed tool-call block that does not parse; the error goes back to the model."""

    id: str
    body: str
    error: str


@dataclass(frozen=True)
class ToolCallReady:
    """A tool call closed: the runner may dispatch it while the model keeps writing."""

    index: int
    call: ToolCall | MalformedToolCall


@dataclass(frozen=True)
class ModelFinish:
    """The turn is over. ``stats`` is the engine's dict (mode, tau, target_forwards,
    draft_forwards, segments, new_tokens, wall_s, tokens_per_s...)."""

    finish_reason: str  # stop | length | cancelled
    stats: dict[str, Any]


ModelEvent = TextDelta | ToolCallDelta | ToolCallReady | ModelFinish


# --- the seam -----------------------------------------------------------------------------------


class Backend(abc.ABC):
    """Writes model turns. Use as ``async with backend:``; one open backend serves any number of
    concurrent agents and runs."""

    model_name: str = "model"  # shown in traces (``gen_ai.request.model``)
    provider_name: str = "agentflash"  # ... and ``gen_ai.provider.name``: whose API it calls

    @abc.abstractmethod
    def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        """The events of one turn, ending with exactly one ``ModelFinish``. Leaving the
        iteration early (or being cancelled) stops the generation."""

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        return None


class BackendKind(str, enum.Enum):
    """Where a workflow's model runs; each kind is the module ``agentflash.backends.<kind>``."""

    LOCAL = "local"
    OPENAI = "openai"


def template_kwargs(value: Any) -> dict[str, Any] | None:
    """A backend's ``chat_template_kwargs``: None or a dict (its keys the engine checks)."""
    if value is not None and not isinstance(value, dict):
        raise UserError(f"chat_template_kwargs must be a dict, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class ModelSpec:
    """The ``model:`` section of a workflow: which backend and which weights."""

    backend: BackendKind = BackendKind.LOCAL
    path: str = "demo"  # demo | a Hugging Face model directory
    drafter: str = "auto"  # auto | demo | none | a DFlash drafter directory
    base_url: str | None = None  # remote backends
    model: str | None = None  # remote backends: the served model's name
    api_key_env: str | None = None  # remote backends: the variable that holds the key
    base_dir: Path | None = None  # relative paths are resolved against it (the workflow's folder)
    prefix_cache_mb: float = 64.0  # local backend: the engine's prefix cache (0: off)
    # local backend: the engine's limits (``EngineConfig``): requests decoded together, tokens
    # per request, and a KV-memory budget that caps the first (None: no cap)
    max_running: int = 8
    max_len: int = 2048
    kv_budget_mb: float | None = None
    # remote backends: the wait for the reply's start and then for each chunk, and the attempts
    # after the first (``backends.openai.RetryPolicy``)
    timeout_s: float = 120.0
    max_retries: int = 4
    # both: the chat template's variables (Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None

    def resolve(self, path: str) -> str:
        """``path`` with ``~`` expanded, made absolute against ``base_dir``, unless it is a name
        like ``demo``."""
        if path in ("auto", "demo", "none"):
            return path
        path = str(expand_user(path))  # as --model and --drafter take it
        if self.base_dir is None or Path(path).is_absolute():
            return path
        return str(self.base_dir / path)
