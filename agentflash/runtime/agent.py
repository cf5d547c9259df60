"""An agent: instructions, tools, the agents it may hand over to, and what its answer must be."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import unicodedata
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentflash.backends.base import Decoding, ForceTool, ToolChoice, ToolChoiceSpec
from agentflash.errors import UserError
from agentflash.runtime.tools import (
    SCHEMA_ERRORS,
    FunctionTool,
    GrammarJsonSchema,
    HttpTool,
    Tool,
    function_tool,
    schema_problem,
    strict_schema,
    undeclared_key,
)
from agentflash.tool_format import load_body

GuardrailCheck = Callable[[Any], str | None | Awaitable[str | None]]


@dataclass(frozen=True)
class Guardrail:
    """A check on a run's input (before the first turn) or on its final output.

    ``check`` (sync or async) receives the input (a string or a list of messages) or the final
    output, and returns ``None`` to let the run go on, or the reason to stop it.
    """

    check: GuardrailCheck
    name: str = ""

    def __post_init__(self) -> None:
        if not callable(self.check):
            raise UserError(f"a guardrail needs a function, got {type(self.check).__name__}")
        if self.name is not None and not isinstance(self.name, str):  # None: the default's
            raise UserError(f"guardrail name must be a string, got {type(self.name).__name__}")
        if not self.name:
            object.__setattr__(self, "name", getattr(self.check, "__name__", "guardrail"))

    async def __call__(self, value: Any, where: str = "") -> str | None:
        """The check's verdict on ``value``; ``where`` (whose guardrail it is) begins the
        error a verdict of another type gets."""
        verdict = self.check(value)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        if verdict is not None and not isinstance(verdict, str):
            raise UserError(f"{where}guardrail {self.name!r} must return None or a reason "
                            f"(str), got {type(verdict).__name__}")
        if verdict is not None and not verdict.strip():
            raise UserError(f"{where}guardrail {self.name!r} returned an empty reason: return "
                            f"None to let the run go on, or the reason it stops")
        return verdict


class OutputValidationError(ValueError):
    """A reply that is not the agent's output type."""


@dataclass(frozen=True)
class OutputSpec:
    """The final answer's JSON Schema and the function that parses a reply into it."""

    name: str
    schema: dict[str, Any]
    parse: Callable[[str], Any]  # raises OutputValidationError


def output_spec(output_type: type | dict[str, Any] | None) -> OutputSpec | None:
    """The spec of a pydantic-describable type, or of a JSON Schema given as a dict."""
    if output_type is None:
        return None
    if isinstance(output_type, dict):
        return _schema_spec(output_type)
    import pydantic

    name = getattr(output_type, "__name__", repr(output_type))
    if output_type is pydantic.BaseModel:
        raise UserError("output_type BaseModel: give a model of your own (class Answer(BaseModel): "
                        "...), not pydantic's base class")
    try:
        adapter = pydantic.TypeAdapter(output_type)
        schema = strict_schema(adapter.json_schema(schema_generator=GrammarJsonSchema))
    except SCHEMA_ERRORS as err:
        raise UserError(f"output_type {name}: pydantic cannot describe it: "
                        f"{schema_problem(err)}") from None
    _check_supported(schema)

    def parse(text: str) -> Any:
        value = _reply_json(text)  # JSON, as the grammar writes it: no NaN, which pydantic reads
        try:  # strict: what the schema refuses, lax validation converts ("2" or true to 2)
            parsed = adapter.validate_json(text, strict=True)
        except pydantic.ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'reply'}: {e['msg']}"
                                 for e in err.errors(include_url=False))
            raise OutputValidationError(problems) from None
        extra = undeclared_key(value, schema)  # a key the schema shown refuses, pydantic drops
        if extra is not None:
            raise OutputValidationError(f"{'.'.join(map(str, extra))}: Extra inputs are not "
                                        f"permitted")
        return parsed

    return OutputSpec(name, schema, parse)


def _check_supported(schema: dict[str, Any]) -> None:
    """The answer's grammar can be built from ``schema`` (raises ``GrammarError`` naming where
    not): found when the agent is built, not at its first turn."""
    from agentflash.grammar.checks import check_schema
    from agentflash.grammar.llguidance_backend import check_schema_supported
    from agentflash.grammar.sources import check_dated_depth

    check_dated_depth(schema, "output schema")  # (its grammar has the date patterns)
    check_schema(schema, "output schema", max_depth=None)
    check_schema_supported(schema, "output schema")


def _schema_spec(schema: dict[str, Any]) -> OutputSpec:
    from agentflash.grammar.checks import check_depth, recursion_room

    check_depth(schema, "output schema")  # before jsonschema's walk, which recurses
    with recursion_room():
        return _checked_schema_spec(schema)


def _checked_schema_spec(schema: dict[str, Any]) -> OutputSpec:
    from jsonschema import Draft202012Validator, SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as err:
        raise UserError(f"output schema is not a valid JSON Schema: {err.message}") from None
    from agentflash.grammar.sources import exact_dates
    from agentflash.json_formats import error_message, value_validator

    _check_supported(schema)
    # formats checked as the grammar writes them (a date a day of the calendar), patterns as
    # it reads them (no "2024-02-29\n" of a date): a reply written without it (a remote
    # server's) that is no date is refused
    validator = value_validator(exact_dates(schema))

    def parse(text: str) -> Any:
        value = _reply_json(text)
        errors = sorted(validator.iter_errors(value), key=str)
        if errors:
            raise OutputValidationError("; ".join(
                f"{'.'.join(map(str, e.absolute_path)) or 'reply'}: {error_message(e)}"
                for e in errors))
        return value

    return OutputSpec(schema.get("title", "its output schema"), schema, parse)


def _reply_json(text: str) -> Any:
    """An answer's JSON (as a tool call's body is read: no NaN, nor past Python's digit and
    nesting limits), or ``OutputValidationError`` saying why it is none."""
    value, problem = load_body(text)
    if problem is not None:
        raise OutputValidationError(f"reply: not JSON ({problem.removeprefix('invalid JSON: ')})")
    return value


def _named(where: str, field_name: str, make: Callable[[Any], Any], value: Any) -> Any:
    """``make(value)``, its ``UserError`` naming the agent and the field it was given in."""
    try:
        return make(value)
    except UserError as err:
        raise UserError(f"{where}: {field_name}: {err}") from None


def handoff_tool_name(agent: Agent) -> str:
    """``transfer_to_<name>`` in the letters a tool name takes: an accent dropped (é: e),
    another letter as its code point (天: u5929: two agents named in Chinese were both
    ``transfer_to___``), punctuation and spaces as ``_``; past 52 letters, the first 43 and a
    hash of the whole name (names that begin alike stay apart)."""
    spelled = []
    for ch in unicodedata.normalize("NFKD", agent.name):
        if unicodedata.combining(ch):
            continue
        spelled.append(ch if re.fullmatch(r"[A-Za-z0-9_-]", ch) else "_" if ch.isascii()
                       else f"u{ord(ch):x}")
    name = "".join(spelled).lower()
    if len(name) > 52:
        name = name[:43] + "_" + hashlib.sha256(agent.name.encode()).hexdigest()[:8]
    return "transfer_to_" + name


def handoff_tool_spec(agent: Agent) -> dict[str, Any]:
    about = f" {agent.handoff_description}" if agent.handoff_description else ""
    return {"type": "function", "function": {
        "name": handoff_tool_name(agent),
        "description": f"Hand the conversation over to the {agent.name} agent.{about}",
        "parameters": {"type": "object", "additionalProperties": False, "properties": {
            "reason": {"type": "string", "description": "Why the conversation is handed over."}}},
    }}


_CHECKED_FIELDS = frozenset({"name", "instructions", "tools", "handoffs", "output_type",
                             "tool_choice", "decoding", "max_turns", "input_guardrails",
                             "output_guardrails"})


@dataclass
class Agent:
    """A model with instructions, tools and handoffs. Checked when built, and again at its next
    turn once a field changed (set, or a list changed in place); mistakes raise ``UserError``
    naming the field."""

    name: str
    """Names the agent in events, traces and its handoff tool (``transfer_to_<name>``)."""

    instructions: str = "You are a helpful assistant."
    """The system prompt."""

    tools: list[Tool] = field(default_factory=list)
    """Tools the model may call: ``@tool`` functions (plain functions are wrapped) and HTTP
    tools. Calls are dispatched as each one closes, concurrently."""

    handoffs: list[Agent] = field(default_factory=list)
    """Agents this one may hand the conversation to; each appears to the model as a
    ``transfer_to_<name>`` tool. The target continues with the whole conversation."""

    handoff_description: str = ""
    """What this agent is for, shown to agents that may hand over to it."""

    output_type: type | dict[str, Any] | None = None
    """The final answer's type: a pydantic model (or any type pydantic can describe), or a JSON
    Schema dict. ``None`` means free text. A reply that does not match stops the run with
    ``ModelBehaviorError``; it is never retried silently."""

    tool_choice: ToolChoiceSpec | str = ToolChoice.AUTO
    """``auto``, ``required``, ``none`` or ``ForceTool(name)``. ``required`` and a forced tool
    apply until the agent has called a tool in the run, then ``auto`` (so that it can answer),
    or ``none`` where it has an output type: its next reply is its answer in the schema."""

    decoding: Decoding = field(default_factory=Decoding)
    """Speculation, block size, temperature, max_tokens per turn and seed."""

    max_turns: int = 10
    """The run stops with ``MaxTurnsExceeded`` once this agent has taken more model turns than
    this in the run (its turns whenever it held the conversation: handoffs in a cycle end)."""

    input_guardrails: list[Guardrail | GuardrailCheck] = field(default_factory=list)
    """Checks on the run's input, before the first turn (when this agent starts the run)."""

    output_guardrails: list[Guardrail | GuardrailCheck] = field(default_factory=list)
    """Checks on the final output (when this agent gives it)."""

    def __post_init__(self) -> None:
        self._check()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        # a field changed after the agent was built is checked as the constructor checks it,
        # at its next turn (not at once: fields that must agree, a forced tool and the tools,
        # are changed one at a time)
        if name in _CHECKED_FIELDS and self.__dict__.get("_built") \
                and not self.__dict__.get("_checking"):
            self.__dict__["_changed"] = True

    def _check(self) -> None:
        self.__dict__["_checking"], self.__dict__["_changed"] = True, False
        try:
            self._check_fields()
        except BaseException:
            self.__dict__["_changed"] = self.__dict__.get("_built", False)  # still to check
            raise
        finally:
            self.__dict__["_checking"] = False
        self.__dict__["_built"] = True
        self.__dict__["_seen_lists"] = self._lists()

    def _lists(self) -> tuple:
        """What the list fields hold, to see a list changed in place (``tools.append``)."""
        return tuple(tuple(map(id, items)) for items in (
            self.tools, self.handoffs, self.input_guardrails, self.output_guardrails))

    def _check_fields(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise UserError(f"Agent.name must be a non-empty string, got {self.name!r}")
        where = f"agent {self.name!r}"
        if not isinstance(self.instructions, str):
            raise UserError(f"{where}: instructions must be a string")
        if not isinstance(self.handoff_description, str):
            raise UserError(f"{where}: handoff_description must be a string, got "
                            f"{type(self.handoff_description).__name__}")
        for field_name in ("tools", "handoffs", "input_guardrails", "output_guardrails"):
            value = getattr(self, field_name)
            if not isinstance(value, (list, tuple)):
                raise UserError(f"{where}: {field_name} must be a list, got "
                                f"{type(value).__name__}")
            setattr(self, field_name, list(value))
        self.tools = [t if isinstance(t, (FunctionTool, HttpTool))
                      else _named(where, f"tools[{i}]", function_tool, t)
                      for i, t in enumerate(self.tools)]
        names = [t.name for t in self.tools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise UserError(f"{where}: tool {twice[0]!r} is listed twice")
        self.tool_choice = self.check_tool_choice(self.tool_choice)
        if not isinstance(self.decoding, Decoding):
            raise UserError(f"{where}: decoding must be a Decoding, "
                            f"got {type(self.decoding).__name__}")
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) \
                or self.max_turns < 1:
            raise UserError(f"{where}: max_turns must be a positive integer, "
                            f"got {self.max_turns!r}")
        try:
            self.output = output_spec(self.output_type)
        except UserError as err:  # which agent's output type it is
            raise UserError(f"{where}: {err}") from None
        for kind in ("input_guardrails", "output_guardrails"):
            setattr(self, kind, [g if isinstance(g, Guardrail)
                                 else _named(where, f"{kind}[{i}]", Guardrail, g)
                                 for i, g in enumerate(getattr(self, kind))])
        self.turn_tools()  # handoffs given now are Agents whose tools clash with nothing

    def check_tool_choice(self, choice: Any) -> ToolChoiceSpec:
        """``choice`` as a tool choice of this agent's, checked against its tools and handoffs
        (a handoff is a tool the model calls: ``required`` or ``ForceTool`` may mean one)."""
        where = f"agent {self.name!r}"
        names = {t.name for t in self.tools}
        names |= {handoff_tool_name(h) for h in self.handoffs if isinstance(h, Agent)}
        if isinstance(choice, str) and not isinstance(choice, ToolChoice):
            try:
                choice = ToolChoice(choice)
            except ValueError:
                raise UserError(f"{where}: tool_choice must be auto, required, none or "
                                f"ForceTool(name), got {choice!r}") from None
        if isinstance(choice, ForceTool) and choice.name not in names:
            raise UserError(f"{where}: tool_choice names {choice.name!r}, which is not one of "
                            f"its tools or handoffs ({', '.join(sorted(names)) or 'none'})")
        if choice is ToolChoice.REQUIRED and not names:
            raise UserError(f"{where}: tool_choice is required but the agent has no tools "
                            f"or handoffs")
        if not isinstance(choice, (ToolChoice, ForceTool)):
            raise UserError(f"{where}: tool_choice must be auto, required, none or ForceTool(name)")
        handing = {handoff_tool_name(h) for h in self.handoffs if isinstance(h, Agent)}
        if type(self.max_turns) is int and self.max_turns == 1 and (
                choice is ToolChoice.REQUIRED and not handing
                or isinstance(choice, ForceTool) and choice.name not in handing):
            shown = "required" if choice is ToolChoice.REQUIRED else repr(choice.name)
            raise UserError(f"{where}: tool_choice {shown} makes the first turn a tool call and "
                            f"the answer comes in a later one: max_turns must be at least 2, "
                            f"got 1")
        return choice

    def turn_tools(self) -> tuple[dict[str, Tool], dict[str, Agent]]:
        """The tools and handoff targets of a turn, by the name the model calls them."""
        if not self.__dict__.get("_checking") and (
                self.__dict__.get("_changed") or self.__dict__.get("_seen_lists") != self._lists()):
            self._check()  # changed since it was built: checked as the constructor checks it
        tools = {t.name: t for t in self.tools}
        handoffs: dict[str, Agent] = {}
        for target in self.handoffs:
            if not isinstance(target, Agent):
                raise UserError(f"agent {self.name!r}: handoffs must be Agents, "
                                f"got {type(target).__name__}")
            if not isinstance(target.name, str) or not target.name.strip():  # renamed since
                raise UserError(f"agent {self.name!r}: a handoff target's Agent.name must be a "
                                f"non-empty string, got {target.name!r}")
            name = handoff_tool_name(target)
            if name in tools or name in handoffs:
                raise UserError(f"agent {self.name!r}: the handoff tool {name!r} clashes with "
                                f"another tool or handoff of the same name")
            handoffs[name] = target
        return tools, handoffs

    def system_prompt(self) -> str:
        if self.output is None:
            return self.instructions
        return (f"{self.instructions}\n\nAnswer with only a JSON object that matches this JSON "
                f"Schema:\n{json.dumps(self.output.schema)}")
