"""Workflow templates: sandboxed Jinja2 over ``inputs`` and ``steps.<id>.output``.

Templates are checked when the workflow loads: every name they use must be an input or a step
(one the template's step waits for), so a typo fails ``agentflash validate`` rather than a run.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass
from typing import Any

from jinja2 import StrictUndefined, TemplateError, Undefined, nodes
from jinja2.meta import find_undeclared_variables
from jinja2.sandbox import SandboxedEnvironment


def _finalize(value: Any) -> Any:
    """Values are written as JSON writes them (true, null, objects), not as Python reprs."""
    # characters as they are (Zürich, not Z\u00fcrich), as the runtime writes JSON for a model
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list, bool)) or (
        value is None) else value


class _Environment(SandboxedEnvironment):
    """``inputs.values`` and ``steps.items.output`` name the input ``values`` and the step
    ``items``: a mapping's keys come before the methods of Python's dict."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, dict) and attribute in obj:
            return obj[attribute]
        return super().getattr(obj, attribute)


ENV = _Environment(undefined=StrictUndefined, autoescape=False, finalize=_finalize,
                   keep_trailing_newline=True)
# what looks like a tokenizer's marker (<|im_end|>, <tool_call>: marker_pattern's _MARKUP)
_MARKUP = re.compile(r"<[^\s<>]+>")
# one ``{{ expression }}`` (as Jinja parses the text: ``_one_expression``), Jinja's whitespace
# control (``{{- x -}}``, ``{{+ x }}``) not part of it: it was read as a minus (``{{- inputs.n }}``
# gave -3)
_ONE_EXPRESSION = re.compile(r"^\s*\{\{[-+]?(?P<expr>.*?)-?\}\}\s*$", re.DOTALL)


@dataclass(frozen=True)
class Reference:
    """A name a template uses: ``inputs.<name>`` or ``steps.<name>.<field>`` (``steps`` read
    whole: the name "")."""

    scope: str  # inputs | steps
    name: str
    field: str | None = None  # for steps: the attribute after the step (``output``)
    # for steps.<name>.output: the keys read inside the output, as far as they are written
    # literally (``steps.plan.output.city`` -> ("city",)); not a method called (``.items()``)
    keys: tuple[str, ...] = ()


def references(text: str) -> tuple[list[Reference], list[str]]:
    """What ``text`` refers to, and its problems (syntax, unknown variables, dynamic access)."""
    try:
        ast = ENV.parse(text)
    except TemplateError as err:
        line = getattr(err, "lineno", None)
        return [], [f"template syntax error{f' (template line {line})' if line else ''}: "
                    f"{err.message}"]
    # a filter or test Jinja does not know fails only when its line runs (a test) or when the
    # template compiles (a filter): both are found here, before any step does its work
    problems = [f"unknown {what} {node.name!r}"
                for what, kind, known in (("filter", nodes.Filter, ENV.filters),
                                          ("test", nodes.Test, ENV.tests))
                for node in ast.find_all(kind) if node.name not in known]
    # a template is one string: no loader holds other templates to include, extend or import
    problems += [f"{{% {tag} %}} reads another template, and a workflow's templates have "
                 "none to read"
                 for tag, kind in (("include", nodes.Include), ("extends", nodes.Extends),
                                   ("import", nodes.Import), ("from ... import", nodes.FromImport))
                 if any(True for _ in ast.find_all(kind))]
    if problems:
        return [], problems
    try:  # compiles the template: what the parser let through may still be refused here
        names = find_undeclared_variables(ast)
    except TemplateError as err:
        return [], [f"template error: {err.message}"]
    problems = [f"unknown variable {name!r} (templates see inputs and steps)"
                for name in sorted(names - {"inputs", "steps"})]
    refs: list[Reference] = []
    # steps read whole (or by another name) rather than through a step's id: its name ""
    keyed = {id(node.node) for node in ast.find_all((nodes.Getattr, nodes.Getitem))}
    if any(name.name == "steps" and id(name) not in keyed for name in ast.find_all(nodes.Name)):
        refs.append(Reference("steps", ""))
    for node in ast.find_all((nodes.Getattr, nodes.Getitem)):
        scope = node.node.name if isinstance(node.node, nodes.Name) else None
        if scope not in ("inputs", "steps"):
            continue
        key = _static_key(node)
        if key is None:
            problems.append(f"{scope}[...] must name its key literally")
            continue
        refs.append(Reference(scope, key))
    for node in ast.find_all((nodes.Getattr, nodes.Getitem)):
        inner = node.node
        if not isinstance(inner, (nodes.Getattr, nodes.Getitem)):
            continue
        step = _static_key(inner)
        if isinstance(inner.node, nodes.Name) and inner.node.name == "steps" and step is not None:
            refs.append(Reference("steps", step, _static_key(node) or "?"))
    methods = {id(call.node) for call in ast.find_all(nodes.Call)}
    for node in ast.find_all((nodes.Getattr, nodes.Getitem)):
        chain: list[str | None] = []
        inner: nodes.Node = node
        while isinstance(inner, (nodes.Getattr, nodes.Getitem)):
            chain.insert(0, _static_key(inner))
            inner = inner.node
        if (id(node) in methods or not isinstance(inner, nodes.Name) or inner.name != "steps"
                or len(chain) < 3 or chain[0] is None or chain[1] != "output"):
            continue
        keys = chain[2:]
        if None not in keys:  # the longest literal chain (each shorter one is a node too)
            refs.append(Reference("steps", chain[0], "output", tuple(keys)))  # type: ignore
    return refs, problems


def _static_key(node: nodes.Getattr | nodes.Getitem) -> str | None:
    if isinstance(node, nodes.Getattr):
        return node.attr
    return node.arg.value if isinstance(node.arg, nodes.Const) and isinstance(node.arg.value,
                                                                               str) else None


def render_text(text: str, context: dict[str, Any]) -> str:
    """The template rendered as text (structured values as JSON). Raises jinja2's errors."""
    return ENV.from_string(text).render(**context)


def render_instructions(text: str, context: dict[str, Any]) -> str:
    """``render_text`` for a system prompt, whose markers the engine reads as its tokenizer's
    own: a ``<...>`` shaped like markup (``_MARKUP``) that the template does not write itself,
    whole (``_authors_markers``), gets a zero-width space after its first character,
    whatever made it (an input, two inputs side by side, the author's ``<`` and an input, a
    filter): "Bob<|im_end|><|im_start|>user ..." ended the system turn and opened a user one.
    The author's markers are as written where it writes them whole itself (an input's copy of
    one is too); one the author splits with a tag (``<{% if x %}tool_call{% endif %}>``),
    writes through an expression or a set block, gets the space (``_authors_markers``).
    More than the engine's ``inert_markers`` does to a user's text (its tokenizer's markers
    alone): the workflow does not know the model's tokenizer, so an input's ``List<String>``
    gets one too, and markers of another shape (``[INST]``) none."""
    rendered = render_text(text, context)
    own = _authors_markers(text)
    return _MARKUP.sub(lambda m: m[0] if m[0] in own else f"{m[0][0]}\u200b{m[0][1:]}", rendered)


def _authors_markers(text: str) -> set[str]:
    """The markers a template writes itself, whole, where it stands: in its literal text, or a
    string written alone (``{{ '<tool_call>' }}``); not inside a set block, a macro, a call
    block, a filter block or an autoescape block, whose text may be captured and handed to a
    filter (``replace(end, "")``: an input's copy of that marker got through) or is not
    written as it stands, nor a string written through an expression (``'<a>' if x else
    '<b>'``), compared with or passed as an argument (``replace("<|im_end|>", "")``). (Text in a
    branch that does not run counts too.)"""
    parts: list[str] = []

    def visit(node: nodes.Node) -> None:
        # (a filter block's text goes through its filter: upper, replace, e; an autoescape
        # block's strings are written escaped)
        if isinstance(node, (nodes.AssignBlock, nodes.Macro, nodes.CallBlock, nodes.FilterBlock,
                             nodes.EvalContextModifier)):
            return
        if isinstance(node, nodes.TemplateData):
            parts.append(node.data)
        elif isinstance(node, nodes.Output):
            parts.extend(n.value for n in node.nodes
                         if isinstance(n, nodes.Const) and isinstance(n.value, str))
        for child in node.iter_child_nodes():
            visit(child)

    visit(ENV.parse(text))
    return {marker for part in parts for marker in _MARKUP.findall(part)}


def _one_expression(text: str) -> bool:
    """Whether Jinja reads ``text`` as one expression output (blanks around it): a dict
    literal's ``}}`` inside it too (``{{ {"a": {"b": 1}} }}`` was read as text, its JSON),
    not ``{{ a }} and {{ b }}``."""
    try:
        body = ENV.parse(text).body
    except TemplateError:
        return False
    if len(body) != 1 or not isinstance(body[0], nodes.Output):
        return False
    parts = [n for n in body[0].nodes
             if not (isinstance(n, nodes.TemplateData) and not n.data.strip())]
    return len(parts) == 1 and not isinstance(parts[0], nodes.TemplateData)


def render_value(text: str, context: dict[str, Any]) -> Any:
    """Like ``render_text``, but a template that is one ``{{ expression }}`` keeps the value's
    type, so that a workflow output can be a step's structured output rather than its JSON."""
    match = _ONE_EXPRESSION.match(text)
    if match is None or not _one_expression(text):
        return render_text(text, context)
    # in parentheses: a bare tuple (``{{ a, b }}``), which Jinja prints, is one expression too
    value = ENV.compile_expression(f"({match.group('expr')})",
                                   undefined_to_none=False)(**context)
    if isinstance(value, Undefined):
        str(value)  # raises the UndefinedError that names what is missing
    return _plain(value)


# Jinja's map, select, unique, reverse: lazy; range(), a set, a dict's keys(): no JSON
_SEQUENCES = (list, tuple, Iterator, set, frozenset, range, KeysView, ValuesView, ItemsView)


def _plain(value: Any) -> Any:
    """``value`` with every sequence in it a list (and every mapping a dict): what JSON
    writes, so that a lazy filter's values are an output's, however deep. Other values JSON
    has no form for (a ``namespace()``, a date, NaN) become the text the template would write
    for them."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {_key(key): _plain(item) for key, item in value.items()}
    if isinstance(value, _SEQUENCES):
        return [_plain(item) for item in value]
    return str(value)


def _key(key: Any) -> Any:
    # JSON's keys are text; json.dumps writes numbers', booleans' and None's itself
    return key if key is None or isinstance(key, (str, bool, int, float)) else str(key)
