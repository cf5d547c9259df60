"""YAML workflows: agents, their tools and a DAG of steps, checked when loaded and run on one
shared backend.

Loading validates the file against ``schemas/workflow.schema.json`` and then checks what a schema
cannot: names that must exist (agents, tools, steps, inputs), cycles in ``needs``, templates, and
python tools that must import. Every problem is reported as ``file:line: key: message``.

A ``python:`` tool imports ``module:function`` from the workflow's folder or the Python path, so
loading a workflow runs code its author named: load only workflows you trust. An ``http:`` tool
calls only the URL it declares.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import numbers
import re
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import anyio
from jinja2 import TemplateError

from agentflash.backends import create_backend, is_available
from agentflash.backends.base import (
    Backend,
    BackendKind,
    Decoding,
    ForceTool,
    ModelSpec,
    Speculation,
)
from agentflash.engine.limits import limit_problems
from agentflash.errors import UserError, UserErrors, described
from agentflash.json_formats import ecma_validator_class, error_message, value_validator
from agentflash.runtime import events as ev
from agentflash.runtime.agent import Agent, output_spec
from agentflash.runtime.errors import OutputsFailed, StepFailed
from agentflash.runtime.runner import Runner, Streamed, ToolCallRecord, single_errors, streaming
from agentflash.runtime.templates import (
    references,
    render_instructions,
    render_text,
    render_value,
)
from agentflash.runtime.tools import FunctionTool, HttpTool, Tool, function_tool, no_parameters
from agentflash.runtime.tracing import Span, SpanKind, Tracer
from agentflash.runtime.yaml_source import Keys, YamlDoc, load_yaml
from agentflash.tool_format import RepeatedKey, unique_object

# in the package, so that an installed copy has it (the repository's schemas/ links to it)
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "schemas" / "workflow.schema.json"


@lru_cache(maxsize=1)
def workflow_schema() -> dict[str, Any]:
    """The published JSON Schema of the workflow format."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Step:
    """One node of the DAG: an agent run on a templated input, after the steps it needs."""

    id: str
    agent: str
    input: str  # a template over inputs and steps.<id>.output
    needs: tuple[str, ...] = ()
    index: int = 0  # position in the file's steps list (for error locations)


@dataclass
class Workflow:
    """A loaded, checked workflow."""

    path: Path
    name: str
    model: ModelSpec
    decoding: Decoding
    inputs: dict[str, dict[str, Any]]  # input name -> its JSON Schema
    tools: dict[str, Tool]
    agents: dict[str, Agent]
    steps: list[Step]
    outputs: dict[str, str]  # output name -> template
    doc: YamlDoc = field(repr=False)
    model_given: str | None = None  # run --model DIR: the model it runs on instead of the section's

    def resolve_inputs(self, given: dict[str, Any] | None = None) -> dict[str, Any]:
        """Inputs from ``given`` (strings from the command line are converted to the declared
        type), defaults for the rest, each checked against its schema."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.inputs))
        if unknown:
            declared = ", ".join(self.inputs) or "none"
            raise UserError(f"{self.path}: unknown input {unknown[0]!r} (declared: {declared})")
        values = {}
        for name, schema in self.inputs.items():
            if name in given:
                value = given[name]
                if isinstance(value, str):
                    try:
                        value = _convert(name, value, schema)
                    except UserError as err:
                        raise UserError(f"{self.path}: {err}") from None
            elif "default" in schema:
                value = schema["default"]
            else:
                raise UserError(f"{self.path}: input {name!r} is required: give "
                                f"--input {name}=VALUE")
            if not _finite_json(value):  # a default of .nan or [.inf], a value given in Python
                raise UserError(f"{self.path}: input {name!r} holds NaN or an infinity, which "
                                f"JSON has no number for")
            errors = list(_input_validator(schema).iter_errors(value))
            if errors:
                raise UserError(f"{self.path}: input {name!r}: {error_message(errors[0])}")
            values[name] = value
        return values

    async def run(self, inputs: dict[str, Any] | None = None, *,
                  backend: Backend | None = None) -> WorkflowResult:
        """Run every step (concurrently where ``needs`` allow) and render the outputs: the
        streamed run's events, collected."""
        async with self.run_streamed(inputs, backend=backend) as run:
            async for _ in run:
                pass
        return run.result

    @asynccontextmanager
    async def run_streamed(self, inputs: dict[str, Any] | None = None, *,
                           backend: Backend | None = None
                           ) -> AsyncIterator[Streamed[WorkflowEvent, WorkflowResult]]:
        """``async with wf.run_streamed(inputs) as run: async for event in run: ...``

        ``backend`` defaults to the one the ``model:`` section names, opened for the run.
        """
        values = self.resolve_inputs(inputs)
        with single_errors():
            async with AsyncExitStack() as stack:
                if backend is None:
                    made = self._open_backend()
                    try:  # what it refuses as it opens (loads) names the section too
                        backend = await stack.enter_async_context(made)
                    except UserError as err:
                        raise self._at_model(err) from None
                chosen, tracer = backend, Tracer()

                async def work(emit: Callable[[WorkflowEvent], None]) -> WorkflowResult:
                    return await _WorkflowRun(self, values, chosen, emit, tracer).run()

                async with streaming(work) as run:
                    run.trace = tracer  # a run cancelled keeps it too (its RunCancelled's)
                    yield run


    def _open_backend(self):
        """The backend the ``model:`` section names; what it refuses as it is made (an unset
        ``api_key_env``) or opened (a budget too small for one request) names the file and the
        section's line."""
        try:
            return create_backend(self.model)
        except UserError as err:
            raise self._at_model(err) from None

    def _at_model(self, err: UserError) -> UserError:
        if self.model_given is not None:  # not the section's path, though its other settings
            return UserError(f"{self.doc.path}: run --model {self.model_given}: {err}")
        return UserError(f"{self.doc.path}:{self.doc.line(('model',))}: {err}")


# --- events and results -------------------------------------------------------------------------


@dataclass(frozen=True)
class StepStarted:
    step: str
    agent: str
    input: str


@dataclass(frozen=True)
class StepEvent:
    """An event of a step's run."""

    step: str
    event: ev.RunEvent


@dataclass(frozen=True)
class StepFinished:
    step: str
    result: StepResult


WorkflowEvent = StepStarted | StepEvent | StepFinished


@dataclass
class StepResult:
    output: Any  # text, or the structured answer as JSON-ready data
    agent: str  # the agent that gave the output (after any handoffs)
    tool_calls: list[ToolCallRecord]
    stats: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.output, "tool_calls": [c.to_dict() for c in self.tool_calls],
                "stats": self.stats}


@dataclass
class WorkflowResult:
    outputs: dict[str, Any]
    steps: dict[str, StepResult]
    stats: dict[str, Any]
    tracer: Tracer

    def to_dict(self) -> dict[str, Any]:
        """The ``agentflash run --json`` document."""
        return {"outputs": self.outputs,
                "steps": {sid: r.to_dict() for sid, r in self.steps.items()},
                "stats": self.stats}


class _WorkflowRun:
    def __init__(self, wf: Workflow, inputs: dict[str, Any], backend: Backend,
                 emit: Callable[[WorkflowEvent], None], tracer: Tracer):
        self.wf, self.inputs, self.backend, self.emit = wf, inputs, backend, emit
        self.tracer = tracer
        self.results: dict[str, StepResult] = {}
        self.failure: StepFailed | None = None
        self._agents: dict[str, Agent] | None = None

    def agents(self) -> dict[str, Agent]:
        """The workflow's agents with their instructions rendered over the run's inputs (and
        the handoffs among them pointing at these copies), or the agents themselves where no
        instructions are a template; made at the run's first step, so that a template that
        fails there (``1 // 0``) fails that step."""
        if self._agents is not None:
            return self._agents
        agents = self.wf.agents
        if any(_templated(a.instructions) for a in agents.values()):
            copies = {name: dataclasses.replace(agent, instructions=self.render(
                ("agents", name, "instructions"), agent.instructions, render_instructions)
                if _templated(agent.instructions) else agent.instructions)
                for name, agent in agents.items()}
            by_id = {id(agent): copies[name] for name, agent in agents.items()}
            for name, agent in agents.items():  # (an agent added in Python stays itself)
                copies[name].handoffs = [by_id.get(id(h), h) for h in agent.handoffs]
            agents = copies
        self._agents = agents
        return agents

    def context(self) -> dict[str, Any]:
        return {"inputs": self.inputs,
                "steps": {sid: {"output": r.output} for sid, r in self.results.items()}}

    async def run(self) -> WorkflowResult:
        attrs = {"gen_ai.operation.name": "invoke_workflow", "gen_ai.workflow.name": self.wf.name}
        with self.tracer.span(SpanKind.RUN, f"invoke_workflow {self.wf.name}", None,
                              attrs) as span:
            done = {step.id: anyio.Event() for step in self.wf.steps}
            async with anyio.create_task_group() as tg:
                for step in self.wf.steps:
                    tg.start_soon(self.run_step, step, done, span, tg.cancel_scope)
            if self.failure is not None:
                self.failure.tracer = self.tracer  # the workflow's, not the step's run's
                self.failure.steps = dict(self.results)  # the work done is not lost
                raise self.failure from self.failure.cause
            try:  # a template that fails on the steps' results (1 / 0): the run failed
                outputs = {name: self.render(("outputs", name), text, render_value)
                           for name, text in self.wf.outputs.items()}
            except UserError as err:
                failed = OutputsFailed(str(err))
                failed.tracer, failed.steps = self.tracer, dict(self.results)
                raise failed from None
        return WorkflowResult(outputs, self.results, self.stats(span), self.tracer)

    async def run_step(self, step: Step, done: dict[str, anyio.Event], span: Span,
                       group: anyio.CancelScope) -> None:
        for need in step.needs:
            await done[need].wait()
        try:
            self.results[step.id] = await self.step(step, span)
        except Exception as err:  # a run's error, or one a backend or guardrail of the user's
            # raised: a StepFailed naming the step either way, the other steps cancelled
            if self.failure is None:
                self.failure = StepFailed(step.id, step.agent, err)
                group.cancel()
            return
        done[step.id].set()

    async def step(self, step: Step, span: Span) -> StepResult:
        agent = self.agents()[step.agent]
        text = self.render(("steps", step.index, "input"), step.input, render_text)
        self.emit(StepStarted(step.id, agent.name, text))
        attrs = {"agentflash.step.id": step.id, "gen_ai.agent.name": agent.name}
        with self.tracer.span(SpanKind.RUN, f"step {step.id}", span, attrs) as step_span:
            async with Runner.run_streamed(agent, text, backend=self.backend, tracer=self.tracer,
                                           trace_parent=step_span) as run:
                async for event in run:
                    self.emit(StepEvent(step.id, event))
        result = run.result
        step_result = StepResult(_jsonable(result.final_output), result.last_agent,
                                 result.tool_calls,
                                 {**result.stats(), "finish_reason": result.finish_reason})
        self.emit(StepFinished(step.id, step_result))
        return step_result

    def render(self, keys: Keys, text: str, how: Callable[[str, dict[str, Any]], Any]) -> Any:
        try:
            return how(text, self.context())
        except TemplateError as err:
            raise UserError(f"{self.wf.doc.where(keys)}: template error: {err}") from None
        except Exception as err:  # the template's own arithmetic: 1 // 0, a range too big
            raise UserError(f"{self.wf.doc.where(keys)}: template error: "
                            f"{type(err).__name__}: {err}") from None

    def stats(self, span: Span) -> dict[str, Any]:
        wall = span.duration_s
        new = sum(r.stats["new_tokens"] for r in self.results.values())
        return {"steps": len(self.results),
                "turns": sum(r.stats["turns"] for r in self.results.values()),
                "tool_calls": sum(len(r.tool_calls) for r in self.results.values()),
                "new_tokens": new, "wall_s": round(wall, 4),
                "tokens_per_s": round(new / wall, 2) if wall > 0 else 0.0}


_OPENAI_KEYS = ("base_url", "model", "api_key_env", "timeout_s", "max_retries")
_BACKEND_KEYS = {
    BackendKind.OPENAI: _OPENAI_KEYS,
    BackendKind.LOCAL: ("path", "drafter", "prefix_cache_mb", "max_running", "max_len",
                        "kv_budget_mb"),
}


def _jsonable(value: Any) -> Any:
    import pydantic_core

    return value if isinstance(value, str) else pydantic_core.to_jsonable_python(value)


_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only, as JSON: not int("١٢")'s
_NUMBER = re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


_KINDS = ("null", "boolean", "integer", "number", "array", "object", "string")  # tried in order


def _convert(name: str, text: str, schema: dict[str, Any]) -> Any:
    """A command-line string as the input's declared type: one type, a list of types, an enum's
    or a const's values' types, those of the branches of an ``anyOf`` / ``oneOf`` (pydantic's
    ``Optional[int]``), of an ``allOf``, or of what a local ``$ref`` points at. Of the types
    that read the text (in the order of ``_KINDS``), the first whose value the schema takes and
    of which the text is JSON (``"01234"`` stays a string where a string may be one, not 1234;
    ``"1"`` is 1, not true, where both may be); else the first the schema takes; else the first
    (whose error the check then reports)."""
    kinds = list(dict.fromkeys(_kinds(schema, schema) or ["string"]))
    readings, twice = [], ""
    for kind in sorted(set(kinds) & set(_KINDS), key=_KINDS.index):
        try:
            readings.append(_convert_one(kind, text))
        except RepeatedKey as err:  # JSON, but of a key given twice: say which
            twice = f" ({err})"
        except (ValueError, json.JSONDecodeError):
            pass
    if not readings or twice:  # (JSON of a key given twice is no text meant as a string)
        raise UserError(f"input {name!r} must be of type {' or '.join(kinds)}, got "
                        f"{text!r}{twice}")
    validator = _input_validator(schema)
    taken = [value for value in readings if validator.is_valid(value)]
    kept = [value for value in taken if isinstance(value, str | list | dict)
            or _is_json_of(text, value)]
    return (kept or taken or readings)[0]


def _input_validator(schema: dict[str, Any]) -> Any:
    """The check of an input's value (given or its default) against its schema, formats
    included as a tool's arguments and an agent's answer are checked: a ``date`` one of the
    calendar's days, an ``email`` an address; patterns' "$" as JSON Schema reads it: no date
    "2024-02-29\\n")."""
    from agentflash.grammar.sources import exact_dates

    return value_validator(exact_dates(schema))


def _is_json_of(text: str, value: Any) -> bool:
    """Whether ``text`` is JSON's spelling of ``value`` (``1.50`` of 1.5; not ``01234`` of
    1234, nor ``1`` of true)."""
    try:
        read = json.loads(text)
    except ValueError:
        return False
    return type(read) is type(value) and read == value


def _kinds(schema: Any, root: Any, seen: frozenset[str] = frozenset()) -> list[str] | None:
    """The JSON types ``schema`` names (see ``_convert``); None where it names none."""
    from agentflash.grammar.checks import resolve_ref

    if not isinstance(schema, dict):
        return None
    kinds = schema.get("type")
    if isinstance(kinds, (str, list)):
        return [kinds] if isinstance(kinds, str) else list(kinds)
    if isinstance(schema.get("enum"), list):
        return [_json_kind(v) for v in schema["enum"]]
    if "const" in schema:
        return [_json_kind(schema["const"])]
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref not in seen:
        return _kinds(resolve_ref(root, ref), root, seen | {ref})
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches:  # a branch that names none: a string
        return [kind for branch in branches for kind in _kinds(branch, root, seen) or ["string"]]
    parts = [_kinds(part, root, seen) for part in schema.get("allOf") or []
             if isinstance(schema.get("allOf"), list)]
    named = [set(part) for part in parts if part is not None]
    if not named:
        return None
    met = []  # the types every part that names some allows
    for kind in next(part for part in parts if part is not None):
        if all(kind in part for part in named):
            met.append(kind)
        elif kind in ("integer", "number") and all(part & {"integer", "number"}
                                                   for part in named):
            met.append("integer")  # an integer is a number: the parts meet in the integers
    return met


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {list: "array", dict: "object"}.get(type(value), "string")


def _finite_json(value: Any) -> bool:
    """Whether every number in ``value`` (its keys too) is finite: numpy's and Decimal's
    NaN as well as Python's."""
    if isinstance(value, numbers.Number) and not isinstance(value, numbers.Integral):
        try:
            return math.isfinite(float(value))  # type: ignore[arg-type]
        except (TypeError, ValueError):  # a complex number, Decimal's signalling NaN
            return False
    if isinstance(value, dict):
        return all(_finite_json(k) and _finite_json(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_finite_json(v) for v in value)
    return True


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past a float's range")
    return value


def _convert_one(kind: str, text: str) -> Any:
    """``text`` as one JSON type (``ValueError`` if it is not one)."""
    if kind in ("integer", "number"):  # as JSON writes numbers: no 1_0, nan or inf
        number = _INTEGER if kind == "integer" else _NUMBER
        if not number.fullmatch(text.strip()):
            raise ValueError
        # a number without a point or exponent stays an integer, as JSON (and YAML) read it
        value = int(text) if _INTEGER.fullmatch(text.strip()) else float(text)
        if not math.isfinite(value):  # 1e999
            raise ValueError
        return value
    if kind == "boolean":
        lowered = text.lower()
        if lowered in ("true", "yes", "1", "on"):
            return True
        if lowered in ("false", "no", "0", "off"):
            return False
        raise ValueError
    if kind == "null":
        if text.strip() != "null":
            raise ValueError
        return None
    if kind in ("array", "object"):
        # JSON's numbers: no NaN or Infinity, nor 1e999 (Python's json reads them as floats)
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite,
                           object_pairs_hook=unique_object)  # a key given twice: refused
        if not isinstance(value, list if kind == "array" else dict):
            raise ValueError
        return value
    return text


def parse_input_pairs(pairs: list[str]) -> dict[str, str]:
    """``["city=Oslo", "days=3"]`` from ``--input`` flags."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--input expects KEY=VALUE, got {pair!r}")
        if key.strip() in out:
            raise UserError(f"--input {key.strip()} is given twice")
        out[key.strip()] = value
    return out


# --- loading ------------------------------------------------------------------------------------


class _Problems:
    """Problems found in a file, reported together, in line order."""

    def __init__(self, doc: YamlDoc):
        self.doc = doc
        self.items: list[tuple[int, str]] = []

    def add(self, keys: Keys, message: str) -> None:
        self.items.append((self.doc.line(keys), f"{self.doc.where(keys)}: {message}"))

    def raise_if_any(self) -> None:
        if self.items:
            lines = dict.fromkeys(m for _, m in sorted(self.items, key=lambda item: item[0]))
            raise UserErrors(list(lines))


def load_workflow(path: str | Path, model: str | None = None) -> Workflow:
    """Read, validate and build a workflow; every problem is a ``UserError`` naming the file,
    line and key. Python tools are imported here (see the module's note). ``model``: run it on
    the embedded engine with this model (``demo`` or a directory) instead of its model section
    (``agentflash run --model``)."""
    doc = load_yaml(path)
    problems = _Problems(doc)
    _schema_problems(doc, problems)
    problems.raise_if_any()
    return _Builder(doc, problems, model).build()


def _schema_problems(doc: YamlDoc, problems: _Problems) -> None:
    for err in ecma_validator_class()(workflow_schema()).iter_errors(doc.data):
        keys: Keys = tuple(err.absolute_path)
        kind, value, instance = err.validator, err.validator_value, err.instance
        if kind == "additionalProperties":
            allowed = sorted(err.schema.get("properties", {}))
            for key in sorted(set(instance) - set(allowed)):
                hint = f" (allowed: {', '.join(allowed)})" if allowed else ""
                problems.add((*keys, key), f"unknown key {key!r}{hint}")
        elif kind == "required":
            for key in value:
                if key not in instance:
                    problems.add(keys, f"missing required key {key!r}")
        elif kind == "oneOf" and keys[:1] == ("tools",):
            problems.add(keys, "a tool needs exactly one of 'python' or 'http'")
        elif kind == "enum":
            problems.add(keys, f"must be one of {', '.join(map(str, value))}, got {instance!r}")
        elif kind == "const":
            problems.add(keys, f"must be {value!r}, got {instance!r}")
        elif kind == "type":
            problems.add(keys, f"must be of type {value}, got {_type_name(instance)}")
        elif kind in ("anyOf", "minimum", "maximum") and _is_decoding_field(keys):
            problems.add(keys, _decoding_refusal(keys[-1], instance) or err.message)
        elif kind == "pattern" and isinstance(instance, str) and _is_key(doc.data, keys, instance):
            problems.add((*keys, instance), f"the name {instance!r} is not allowed "
                                            f"(it must match {value})")
        else:
            problems.add(keys, err.message)


def _is_decoding_field(keys: Keys) -> bool:
    """Whether ``keys`` name a field of a decoding section (the workflow's or an agent's)."""
    return (len(keys) == 2 and keys[0] == "decoding") or (
        len(keys) == 4 and keys[0] == "agents" and keys[2] == "decoding")


def _decoding_refusal(field: str, value: Any) -> str | None:
    """Why ``Decoding`` refuses ``value`` for ``field``, in its words: a value out of the
    schema's range is said as the loader says it, whichever check meets it first."""
    try:
        Decoding(**{field: value})
    except UserError as err:
        return str(err).removeprefix(f"decoding.{field} ")
    return None


def _type_name(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
             int: "an integer", float: "a number", type(None): "nothing (null)"}
    return names.get(type(value), type(value).__name__)


def _is_key(data: Any, keys: Keys, name: str) -> bool:
    for key in keys:
        data = data[key]
    return isinstance(data, dict) and name in data


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file, or hold the same bytes."""
    try:
        return a.resolve() == b.resolve() or a.read_bytes() == b.read_bytes()
    except OSError:
        return False


class _Builder:
    """Turns a schema-valid document into a ``Workflow``, collecting every semantic problem."""

    def __init__(self, doc: YamlDoc, problems: _Problems, model: str | None = None):
        self.doc, self.problems, self.data = doc, problems, doc.data
        self.base_dir = doc.path.resolve().parent
        self.model_override = model

    def build(self) -> Workflow:
        model = self.model()
        if self.model_override is not None:  # checked below as the model it runs on
            model = dataclasses.replace(model, backend=BackendKind.LOCAL,
                                        path=self.model_override, drafter="auto", base_dir=None)
        decoding = self.decoding(("decoding",), self.data.get("decoding", {}), {})
        inputs = self.inputs()
        tools = self.tools()
        # a bad top-level decoding is named there alone, not again at every agent it reaches
        agents = self.agents(tools, self.data.get("decoding", {}) if decoding else {})
        self.check_drafter(model, agents)
        steps = self.steps(agents, inputs)
        self.check_instructions(inputs)
        outputs = self.outputs(steps, inputs)
        self.problems.raise_if_any()
        assert decoding is not None
        return Workflow(self.doc.path, self.data["name"], model, decoding, inputs, tools, agents,
                        steps, outputs, self.doc, self.model_override)

    def check_drafter(self, model: ModelSpec, agents: dict[str, Agent]) -> None:
        """An agent that asks for DFlash on an embedded engine without a drafter (none, or auto
        on another model than the demo) is named now, not when its step runs."""
        if model.backend is not BackendKind.LOCAL or not (
                model.drafter == "none" or (model.drafter == "auto" and model.path != "demo")):
            return
        for name, agent in agents.items():
            if agent.decoding.speculation is not Speculation.DFLASH:
                continue
            own = "speculation" in self.data["agents"][name].get("decoding", {})
            keys = ("agents", name, "decoding", "speculation") if own else ("decoding",
                                                                            "speculation")
            if self.model_override is not None:  # run --model: only demo brings a drafter
                why = (f"run --model {self.model_override} brings none (the demo model's "
                       f"drafter comes with --model demo; or speculation auto or off)")
            else:
                why = (f"model.drafter is {model.drafter} (give demo or a drafter directory, "
                       f"or speculation auto or off)")
            self.problems.add(keys, f"dflash needs a drafter, and {why}")

    def model(self) -> ModelSpec:
        raw = self.data.get("model", {})
        spec = ModelSpec(BackendKind(raw.get("backend", "local")), raw.get("path", "demo"),
                         raw.get("drafter", "auto"), raw.get("base_url"), raw.get("model"),
                         raw.get("api_key_env"), self.base_dir,
                         raw.get("prefix_cache_mb", ModelSpec.prefix_cache_mb),
                         raw.get("max_running", ModelSpec.max_running),
                         raw.get("max_len", ModelSpec.max_len), raw.get("kv_budget_mb"),
                         timeout_s=raw.get("timeout_s", ModelSpec.timeout_s),
                         max_retries=raw.get("max_retries", ModelSpec.max_retries),
                         chat_template_kwargs=raw.get("chat_template_kwargs"))
        if not is_available(spec.backend):
            self.problems.add(("model", "backend"), f"backend {spec.backend.value!r} is not "
                                                    f"available in this version of agentflash")
        # a key of the other backend is a mistake (a section that forgot backend: openai ran
        # on the demo model), not a setting to ignore
        for key in _BACKEND_KEYS[BackendKind.OPENAI if spec.backend is BackendKind.LOCAL
                                 else BackendKind.LOCAL]:
            if key in raw:
                self.problems.add(("model", key), f"is a setting of the "
                                                  f"{'openai' if key in _OPENAI_KEYS else 'local'}"
                                                  f" backend, and this model section's backend "
                                                  f"is {spec.backend.value}")
        if spec.backend is BackendKind.LOCAL:  # the engine's limits, as it will check them
            for key, problem in limit_problems(spec.max_running, spec.max_len,
                                               spec.prefix_cache_mb, spec.kv_budget_mb):
                self.problems.add(("model", key), problem.removeprefix(f"{key} "))
        if isinstance(spec.chat_template_kwargs, dict) and (
                spec.backend is BackendKind.LOCAL or self.model_override is not None):
            self.check_template_kwargs(spec.chat_template_kwargs)
        if self.model_override is not None:  # run --model: the section's model is not used
            return spec
        if spec.backend is BackendKind.LOCAL:
            for key in ("path", "drafter"):
                value = getattr(spec, key)
                if value not in ("auto", "demo", "none") and not Path(spec.resolve(value)).is_dir():
                    self.problems.add(("model", key), f"directory {spec.resolve(value)!r} "
                                                      f"does not exist")
        if spec.backend is BackendKind.OPENAI:
            for key in ("base_url", "model"):
                if not getattr(spec, key):
                    self.problems.add(("model",), f"backend openai needs model.{key}")
            from agentflash.backends.openai import base_url_problem

            problem = base_url_problem(spec.base_url) if spec.base_url else None
            if problem:
                self.problems.add(("model", "base_url"), problem)
        return spec

    def check_template_kwargs(self, template_kwargs: dict[str, Any]) -> None:
        """The embedded engine's check of ``model.chat_template_kwargs`` (a key it sets itself,
        such as ``tools``), made now rather than when the engine starts."""
        from agentflash.engine.engine import template_kwargs_problems

        for key, why in template_kwargs_problems(template_kwargs)[:1]:  # the first, as run's
            self.problems.add(("model", "chat_template_kwargs")
                              + (() if key is None else (key,)), why)

    def decoding(self, keys: Keys, raw: dict[str, Any], defaults: dict[str, Any]
                 ) -> Decoding | None:
        try:
            return Decoding(**{**defaults, **raw})
        except UserError as err:
            self.field_problem(keys, raw, str(err).removeprefix("decoding."))
            return None

    def field_problem(self, keys: Keys, raw: dict[str, Any], message: str) -> None:
        """A problem whose message begins with the field it is about ("max_turns must be
        ..."), named at that field's line where ``raw`` (the section at ``keys``) has it."""
        field, _, why = message.partition(" ")
        if field in raw:
            self.problems.add((*keys, field), why)
        else:
            self.problems.add(keys, message)

    def inputs(self) -> dict[str, dict[str, Any]]:
        from jsonschema import Draft202012Validator, SchemaError

        from agentflash.grammar.checks import ref_loop, unresolved_ref

        inputs = self.data.get("inputs", {})
        for name, schema in inputs.items():
            try:
                Draft202012Validator.check_schema(schema)
            except SchemaError as err:
                self.problems.add(("inputs", name), f"not a valid JSON Schema: {err.message}")
                continue
            unresolved = unresolved_ref(schema)
            if unresolved is not None:  # jsonschema would fetch a URL, or fail with a traceback
                where, ref = unresolved
                keyword = where.rsplit("/", 1)[-1]  # $ref or $dynamicRef
                self.problems.add(("inputs", name), f"{keyword} {ref!r} (at {where}) does not "
                                  "point inside the input's schema (only local refs are read)")
                continue
            loop = ref_loop(schema)  # jsonschema recursed there until Python's limit
            if loop is not None:
                self.problems.add(("inputs", name), f"its $refs lead back to {loop} without "
                                  f"reading into the value (a value reaching it cannot be "
                                  f"checked)")
                continue
            if "default" in schema:
                if not _finite_json(schema["default"]):  # YAML's .nan, .inf: JSON has none
                    self.problems.add(("inputs", name, "default"), "holds NaN or an infinity, "
                                      "which JSON has no number for")
                    continue
                for err in _input_validator(schema).iter_errors(schema["default"]):
                    self.problems.add(("inputs", name, "default"), error_message(err))
        return inputs

    def tools(self) -> dict[str, Tool]:
        tools: dict[str, Tool] = {}
        for i, raw in enumerate(self.data.get("tools", [])):
            name = raw["name"]
            if name in tools:
                self.problems.add(("tools", i, "name"), f"tool {name!r} is declared twice")
                continue
            built = self.python_tool(i, raw) if "python" in raw else self.http_tool(i, raw)
            if built is not None:
                tools[name] = built
        return tools

    def python_tool(self, i: int, raw: dict[str, Any]) -> Tool | None:
        if "parameters" in raw:
            self.problems.add(("tools", i, "parameters"), "only http tools take parameters; a "
                                                         "python tool's schema comes from its "
                                                         "signature")
            return None
        fn = self.import_function(("tools", i, "python"), raw["python"])
        if fn is None:
            return None
        try:
            if isinstance(fn, FunctionTool):
                return dataclasses.replace(
                    fn, name=raw["name"], description=raw.get("description", fn.description),
                    timeout_s=raw.get("timeout_s", fn.timeout_s))
            return function_tool(fn, name=raw["name"], description=raw.get("description"),
                                 timeout_s=raw.get("timeout_s"))
        except UserError as err:
            self.problems.add(("tools", i, "python"), str(err))
            return None

    def import_function(self, keys: Keys, target: str) -> Any:
        module_name, _, attr = target.partition(":")
        # the workflow's folder stays importable: a tool may import its neighbours when it runs
        if str(self.base_dir) not in sys.path:
            sys.path.insert(0, str(self.base_dir))
        try:
            module = importlib.import_module(module_name)
        except (Exception, SystemExit) as err:  # whatever the module raises while importing
            self.problems.add(keys, f"cannot import {module_name!r}: {described(err)}")
            return None
        # a module of that name imported before (another workflow's, loaded in this process)
        # is what Python gives: not this folder's, whose function would silently be another
        # (the same file copied is the same code); the package, and the module itself (a
        # folder without __init__.py is a namespace package of no file of its own)
        top = module_name.partition(".")[0]
        for name, imported in ((top, sys.modules.get(top)), (module_name, module)):
            spot = self.base_dir.joinpath(*name.split("."))
            here = [p for p in (Path(f"{spot}.py"), spot / "__init__.py") if p.is_file()]
            loaded = getattr(imported, "__file__", None)
            if here and loaded is not None and not _same_file(Path(loaded), here[0]):
                self.problems.add(keys, f"module {name!r} was imported from {loaded} before "
                                        f"this workflow was loaded, so its {here[0]} cannot "
                                        f"be: give one of them another name")
                return None
        fn = getattr(module, attr, None)
        if fn is None:
            self.problems.add(keys, f"module {module_name!r} has no function {attr!r}")
            return None
        if not callable(fn):
            self.problems.add(keys, f"{module_name}:{attr} is not a function (a value of type "
                                    f"{type(fn).__name__})")
            return None
        return fn

    def http_tool(self, i: int, raw: dict[str, Any]) -> Tool | None:
        http = raw["http"]
        try:
            return HttpTool(raw["name"], raw.get("description", ""), http.get("method", "GET"),
                            http["url"], raw.get("parameters", no_parameters()),
                            raw.get("timeout_s", 10.0))
        except UserError as err:  # named at its field's line (HttpTool's key)
            self.problems.add(("tools", i, *getattr(err, "key", ())), str(err))
            return None

    def agents(self, tools: dict[str, Tool], defaults: dict[str, Any]) -> dict[str, Agent]:
        agents: dict[str, Agent] = {}
        declared = [t["name"] for t in self.data.get("tools", [])]
        for name, raw in self.data["agents"].items():
            keys: Keys = ("agents", name)
            own = []
            for j, tool_name in enumerate(raw.get("tools", [])):
                if tool_name in tools:
                    own.append(tools[tool_name])
                elif tool_name not in declared:  # a declared tool that failed is reported
                    known = ", ".join(declared) or "none declared"
                    self.problems.add((*keys, "tools", j), f"unknown tool {tool_name!r} "
                                                           f"(tools: {known})")
            decoding = self.decoding((*keys, "decoding"), raw.get("decoding", {}), defaults)
            try:
                output_spec(raw.get("output_schema"))
            except UserError as err:
                self.problems.add((*keys, "output_schema"), str(err))
                continue
            try:
                agents[name] = Agent(name, raw["instructions"], own, [],
                                     raw.get("description", ""), raw.get("output_schema"),
                                     "auto", decoding or Decoding(), raw.get("max_turns", 10))
            except UserError as err:
                self.field_problem(keys, raw, str(err).removeprefix(f"agent {name!r}: "))
        for name, raw in self.data["agents"].items():
            for j, target in enumerate(raw.get("handoffs", [])):
                if target == name:
                    self.problems.add(("agents", name, "handoffs", j), "an agent cannot hand "
                                                                       "over to itself")
                elif target not in self.data["agents"]:
                    self.problems.add(("agents", name, "handoffs", j),
                                      f"unknown agent {target!r} (agents: "
                                      f"{', '.join(self.data['agents'])})")
                elif name in agents and target in agents:
                    agents[name].handoffs.append(agents[target])
            if name in agents:
                try:
                    tools_now, handoffs = agents[name].turn_tools()
                except UserError as err:
                    self.problems.add(("agents", name, "handoffs"), str(err))
                    continue
                # checked once the handoffs are wired: a handoff is a tool the choice may name
                choice = raw.get("tool_choice", "auto")
                if any(t not in tools for t in raw.get("tools", [])) or any(
                        t == name or t not in agents for t in raw.get("handoffs", [])):
                    continue  # a tool or handoff it lists failed or is unknown (reported): no
                    # follow-on error ("required but the agent has no tools") at another line
                if choice not in ("auto", "required", "none"):
                    if choice not in tools_now and choice not in handoffs:
                        known = ", ".join([*tools_now, *handoffs]) or "none"
                        self.problems.add(("agents", name, "tool_choice"),
                                          f"must be auto, required, none or one of the agent's "
                                          f"tools or handoffs ({known}), got {choice!r}")
                        continue
                    choice = ForceTool(choice)
                try:
                    agents[name].tool_choice = agents[name].check_tool_choice(choice)
                except UserError as err:
                    self.problems.add(("agents", name, "tool_choice"),
                                      str(err).removeprefix(f"agent {name!r}: "))
        return agents

    def steps(self, agents: dict[str, Agent], inputs: dict[str, Any]) -> list[Step]:
        steps: list[Step] = []
        ids: set[str] = set()
        for i, raw in enumerate(self.data["steps"]):
            if raw["id"] in ids:
                self.problems.add(("steps", i, "id"), f"step {raw['id']!r} is declared twice")
                continue
            ids.add(raw["id"])
            if raw["agent"] not in self.data["agents"]:
                known = ", ".join(self.data["agents"])
                self.problems.add(("steps", i, "agent"), f"unknown agent {raw['agent']!r} "
                                                         f"(agents: {known})")
            needs = tuple(raw.get("needs", []))
            steps.append(Step(raw["id"], raw["agent"], raw["input"], needs, i))
        by_id = {s.id: s for s in steps}
        for step in steps:
            for j, need in enumerate(step.needs):
                if need not in by_id:
                    self.problems.add(("steps", step.index, "needs", j),
                                      f"unknown step {need!r} (steps: {', '.join(by_id)})")
        self.check_cycles(steps, by_id)
        for step in steps:
            before = _ancestors(step, by_id)
            if isinstance(step.input, str) and not step.input.strip():  # the run refuses it
                self.problems.add(("steps", step.index, "input"), "the input is blank")
                continue
            self.check_template(("steps", step.index, "input"), step.input, inputs, by_id,
                                allowed=before, owner=step.id)
        return steps

    def check_cycles(self, steps: list[Step], by_id: dict[str, Step]) -> None:
        state: dict[str, int] = {}  # 1: on the current path, 2: done
        reported: set[frozenset[str]] = set()

        def visit(step: Step, path: list[str]) -> None:
            state[step.id] = 1
            for j, need in enumerate(step.needs):
                if need not in by_id:
                    continue
                if state.get(need) == 1:
                    cycle = path[path.index(need):] + [need]
                    if frozenset(cycle) not in reported:
                        reported.add(frozenset(cycle))
                        self.problems.add(("steps", step.index, "needs", j),
                                          f"cycle in needs: {' -> '.join(reversed(cycle))}")
                elif need not in state:
                    visit(by_id[need], [*path, need])
            state[step.id] = 2

        for step in steps:
            if step.id not in state:
                visit(step, [step.id])

    def check_template(self, keys: Keys, text: str, inputs: dict[str, Any],
                       by_id: dict[str, Step], allowed: set[str] | None, owner: str | None) -> None:
        refs, template_problems = references(text)
        for problem in template_problems:
            self.problems.add(keys, problem)
        for ref in refs:
            if ref.scope == "steps" and ref.name == "":
                if allowed is not None:  # a step's input: what it reads depends on what ran
                    self.problems.add(keys, "a step reads steps through their ids, as in "
                                            "{{ steps.ID.output }}, and those in its needs")
            elif ref.scope == "inputs" and ref.name not in inputs:
                self.problems.add(keys, f"the template uses inputs.{ref.name}, which is not "
                                        f"declared (inputs: {', '.join(inputs) or 'none'})")
            elif ref.scope == "steps" and ref.field is None and ref.name not in by_id:
                self.problems.add(keys, f"the template uses steps.{ref.name}, which is not a "
                                        f"step (steps: {', '.join(by_id)})")
            elif ref.scope == "steps" and ref.field is None and ref.name == owner:
                self.problems.add(keys, f"the template uses steps.{ref.name}, the step's own "
                                        f"output, which it does not have before it ends")
            elif ref.scope == "steps" and ref.field is None and allowed is not None \
                    and ref.name not in allowed:
                self.problems.add(keys, f"the template uses steps.{ref.name}, but step "
                                        f"{owner!r} does not wait for it (add it to needs)")
            elif ref.scope == "steps" and ref.field is not None and ref.field != "output":
                self.problems.add(keys, f"steps.{ref.name}.{ref.field}: a step has only .output")
            elif ref.keys and ref.name in by_id:
                problem = self.output_field_problem(ref.name, by_id[ref.name].agent, ref.keys)
                if problem is not None:
                    self.problems.add(keys, problem)

    def output_field_problem(self, step: str, agent: str, keys: tuple[str, ...]) -> str | None:
        """Why ``steps.<step>.output.<keys>`` cannot be there, by the step's agent's output
        schema (closed as its grammar closes it), or None where it may be. An agent that may
        hand off is not judged: another agent's answer may end the step."""
        raw = self.data["agents"].get(agent)
        if not isinstance(raw, dict) or raw.get("handoffs"):
            return None
        where = f"steps.{step}.output"
        if raw.get("output_schema") is None:
            return (f"{where} is text (agent {agent!r} has no output_schema): it has no field "
                    f"{keys[0]!r}")
        from agentflash.grammar.sources import close_objects  # (output_spec imported it)

        node = close_objects(raw["output_schema"])  # closed as the grammar closes it
        for key in keys:
            if not isinstance(node, dict) or any(k in node for k in _COMBINED):
                return None
            kind = node.get("type")
            if "properties" in node or kind == "object":
                fields = node.get("properties") or {}
                if key in fields:
                    node, where = fields[key], f"{where}.{key}"
                    continue
                if node.get("additionalProperties") is False:
                    listed = ", ".join(fields) or "none"
                    return (f"{where} has no field {key!r} (the output_schema of agent "
                            f"{agent!r} lists {listed})")
                return None
            if kind in ("string", "integer", "number", "boolean", "array", "null"):
                return (f"{where} is of type {kind} (the output_schema of agent {agent!r}): "
                        f"it has no field {key!r}")
            return None
        return None

    def check_instructions(self, inputs: dict[str, Any]) -> None:
        """An agent's instructions may be a template over the inputs (rendered as a run
        starts); not over steps, which an agent of several steps would read at each."""
        for name, raw in self.data["agents"].items():
            text = raw.get("instructions")
            if not isinstance(text, str) or not _templated(text):
                continue
            keys: Keys = ("agents", name, "instructions")
            refs, problems = references(text)
            for problem in problems:  # braces written as text before instructions were templates
                problem = problem.replace("(templates see inputs and steps)",
                                          "(instructions see inputs)")
                if problem.startswith(("template syntax error", "unknown variable")):
                    problem += (" (an agent's instructions are a template over the inputs: "
                                "write braces meant as text inside {% raw %}...{% endraw %})")
                self.problems.add(keys, problem)
            if any(ref.scope == "steps" for ref in refs):
                self.problems.add(keys, "an agent's instructions may use inputs "
                                        "({{ inputs.NAME }}), not steps: they are rendered as "
                                        "the run starts; pass a step's output in its input")
            for ref in refs:
                if ref.scope == "inputs" and ref.name not in inputs:
                    self.problems.add(keys, f"the template uses inputs.{ref.name}, which is "
                                            f"not declared (inputs: {', '.join(inputs) or 'none'})")

    def outputs(self, steps: list[Step], inputs: dict[str, Any]) -> dict[str, str]:
        outputs = self.data.get("outputs", {})
        by_id = {s.id: s for s in steps}
        for name, text in outputs.items():
            self.check_template(("outputs", name), text, inputs, by_id, allowed=None, owner=None)
        return outputs


_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "if", "not")  # output fields not judged


def _templated(text: str) -> bool:
    """Whether ``text`` holds Jinja's syntax (an expression, a statement or a comment)."""
    return any(mark in text for mark in ("{{", "{%", "{#"))


def _ancestors(step: Step, by_id: dict[str, Step]) -> set[str]:
    """Every step that ``step`` waits for, directly or not."""
    seen: set[str] = set()
    todo = list(step.needs)
    while todo:
        sid = todo.pop()
        if sid in seen or sid not in by_id:
            continue
        seen.add(sid)
        todo.extend(by_id[sid].needs)
    return seen
