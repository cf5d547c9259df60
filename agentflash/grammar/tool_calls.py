"""Grammars for tool calls in the chat format the model was trained on.

A call is ``<tool_call>\\n{"name": "X", "arguments": {...}}\\n</tool_call>`` (``<tool_call>`` and
``</tool_call>`` are single added tokens; the JSON uses ``json.dumps`` separators), calls are
separated by ``\\n``, text before the calls ends with ``\\n``, and the turn ends with the end token
(``<|im_end|>``), which every constraint adds by itself. See ``agentflash/train/tokenizer.py``.
"""

from __future__ import annotations

import copy
import enum
import json
import re
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urldefrag, urljoin, urlsplit

from agentflash.grammar.checks import (
    MAX_JSON_BODY_DEPTH,
    MAX_SCHEMA_DEPTH,
    check_depth,
    check_schema,
    recursion_room,
    subschemas,
)
from agentflash.grammar.constraint import GrammarError
from agentflash.grammar.llguidance_backend import JSON_STYLE_OPTIONS, check_schema_supported
from agentflash.grammar.sources import (
    GrammarSource,
    JsonStyle,
    check_dated_depth,
    close_objects,
    exact_dates,
    json_schema,
    lark,
    with_subschemas,
    without_date_formats,
)
from agentflash.tool_format import CLOSE, OPEN

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpec:
    """A tool as grammars need it: its name and the JSON Schema of its arguments; ``strict``
    False (a tool's own ``"strict": false``) leaves its objects open where a grammar closes
    the others'."""

    name: str
    parameters: dict[str, Any]
    strict: bool = True


def tool_specs(tools: list[dict[str, Any]]) -> list[ToolSpec]:
    """Read an OpenAI ``tools`` list (``{"type": "function", "function": {...}}`` entries, or
    bare ``{"name", "parameters"}`` ones); each schema is checked, errors name the tool."""
    if not isinstance(tools, list):
        raise GrammarError(f"tools: expected a list, got {type(tools).__name__}")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            raise GrammarError(f"{where}: expected an object with a function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError(f"{where}: the function needs a non-empty string name")
        if any(s.name == name for s in specs):
            raise GrammarError(f"{where}: two tools are named {name!r}")
        params = fn.get("parameters", _EMPTY_PARAMETERS)
        check_parameters(params, f"{where} ({name})")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError(f"{where} ({name}): strict must be true or false, got {strict!r}")
        specs.append(ToolSpec(name, params, strict is not False))
    return specs


# the levels ``tool_call_schema``'s union holds a tool's parameters in: its anyOf, a branch,
# the branch's properties
_UNION_DEPTH = 4
# the deepest parameters' schema that compiles: the union goes to llguidance as a Lark rule's
# %json body (a turn's grammar), read on its own (``tool_call_body``'s, a JSON Schema grammar,
# holds 3 fewer: a deeper one is refused there, saying so)
MAX_TOOL_DEPTH = MAX_JSON_BODY_DEPTH - _UNION_DEPTH
_TOOL_DEPTH_WHY = (f" in a grammar's %json body ({MAX_JSON_BODY_DEPTH}) less the {_UNION_DEPTH} "
                   f"levels of the tools' union around a tool's parameters")


def check_parameters(params: Any, origin: str) -> None:
    """Raise ``GrammarError`` naming ``origin`` unless ``params`` is a valid JSON Schema of type
    object that the grammar can constrain a tool call's arguments to."""
    if isinstance(params, dict):
        check_dated_depth(params, f"{origin} parameters", MAX_TOOL_DEPTH, _TOOL_DEPTH_WHY)
        check_schema(params, f"{origin} parameters", max_depth=None)
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise GrammarError(f"{origin}: parameters must be a JSON Schema of type object")
    check_schema_supported(params, f"{origin} parameters")


def _rebase_refs(node: Any, base: str, anchors: str, own_id: str | None = None,
                 resource: str | None = None) -> Any:
    """The schema ``node`` and its subschemas, embedded at ``base`` of the union: its pointer
    refs (``#``, ``#/...``, and an absolute one to ``own_id``, its root's ``$id``) point there
    (``#`` becomes ``base``), and its anchors' names and the refs to them take the prefix
    ``anchors`` (two tools' ``#num`` are each their own). What a ``const``, an ``enum`` or a
    ``default`` holds is data, left as it is (a ``{"$ref": "#/a"}`` there was rewritten, and the
    call then written with it refused). A subschema with an ``$id`` of its own is a resource of
    its own, where ``#`` is that subschema: its refs and anchors stay, its ``$id`` made absolute
    (``resource``: the ``$id`` of the one that holds ``node``, if any)."""
    if not isinstance(node, dict):
        return node
    if isinstance(node.get("$id"), str):  # (the root's was taken off: this one is nested)
        resource = urljoin(resource or own_id or "", node["$id"])
    out = with_subschemas(node, lambda sub, _: _rebase_refs(sub, base, anchors, own_id,
                                                            resource))
    if resource is not None:
        if isinstance(node.get("$id"), str):
            out["$id"] = resource
        return out
    for keyword in ("$anchor", "$dynamicAnchor"):
        if isinstance(node.get(keyword), str):
            out[keyword] = anchors + node[keyword]
    for keyword in ("$ref", "$dynamicRef"):
        ref = node.get(keyword)
        if not isinstance(ref, str):
            continue
        if own_id is not None and not ref.startswith("#"):  # "s#/$defs/n", or the $id itself
            uri, fragment = urldefrag(urljoin(own_id, ref))
            if uri == urldefrag(own_id)[0]:
                ref = "#" + fragment
            else:  # a nested resource's: as absolute as its $id is made
                out[keyword] = urljoin(own_id, ref)
        if ref == "#" or ref.startswith("#/"):
            out[keyword] = base + ref[1:]
        elif ref.startswith("#"):  # an anchor's name
            out[keyword] = "#" + anchors + ref[1:]
    return out


def _check_resources(arguments: Any, given: Any, tool: str, strict: bool,
                     seen: dict[str, tuple[str, Any, Any, bool]]) -> None:
    """Refuse, naming the tools, a nested ``$id`` that names another subschema elsewhere in the
    union (another tool's, or its own): one URI names one resource, and one tool's arguments
    were checked against the other's; URIs that RFC 3986 says are the same are one
    (``_resource_key``). The same subschema twice, as the user wrote it (``given``: the
    parameters before strict mode closed their objects, which it does not do everywhere), is
    one resource, as it should; twice under tools of other strictness, it is refused saying so."""
    for path, node in subschemas(arguments, []):
        uri = node.get("$id") if isinstance(node, dict) else None
        if not isinstance(uri, str):
            continue
        written = _without_id(_at(given, path))
        other, subschema, other_written, other_strict = seen.setdefault(
            _resource_key(uri), (tool, node, written, strict))
        if subschema is node or subschema == node:
            continue
        if written == other_written and (other == tool or other_strict == strict):
            continue
        where = f"tool {tool!r} holds two subschemas" if other == tool else \
            f"tools {other!r} and {tool!r} both hold a subschema"
        why = "" if written != other_written else \
            " (as written they are one, but one tool is strict, the other not: its objects " \
            "closed, the other's open)"
        raise GrammarError(f"tools: {where} with $id {uri!r}, and they differ{why}: give one "
                           f"of them another $id")


def _at(schema: Any, path: list) -> Any:
    for key in path:
        if isinstance(schema, dict) and key in schema:
            schema = schema[key]
        elif isinstance(schema, list) and isinstance(key, int) and key < len(schema):
            schema = schema[key]
        else:
            return None
    return schema


def _without_id(node: Any) -> Any:
    return {k: v for k, v in node.items() if k != "$id"} if isinstance(node, dict) else node


_UNRESERVED = re.compile(r"[A-Za-z0-9._~-]")


def _resource_key(uri: str) -> str:
    """``uri`` as the resource it names, normalized as RFC 3986's section 6.2.2 says: no empty
    fragment, the scheme and host in lower case, percent-encoding's hex in upper case and the
    unreserved characters it encodes decoded, dot segments removed (``HTTPS://E.X/a/../%70oint#``
    and ``./point`` relative to it are ``https://e.x/point``)."""
    uri = re.sub(r"%[0-9a-fA-F]{2}", lambda m: chr(int(m[0][1:], 16))
                 if _UNRESERVED.fullmatch(chr(int(m[0][1:], 16))) else m[0].upper(),
                 urldefrag(uri)[0])
    parts = urlsplit(uri)
    user, at, host = parts.netloc.rpartition("@")
    key = f"{parts.scheme.lower()}:" if parts.scheme else ""
    if parts.netloc or uri.startswith(f"{key}//"):
        key += f"//{user}{at}{host.lower()}"
    key += _remove_dot_segments(parts.path)
    return key + (f"?{parts.query}" if "?" in uri else "")


def _remove_dot_segments(path: str) -> str:
    segments = path.split("/")
    kept: list[str] = []
    for segment in segments:
        if segment == "..":
            if kept and kept[-1] != "":
                kept.pop()
        elif segment != ".":
            kept.append(segment)
    return "/".join(kept) + ("/" if segments[-1] in (".", "..") and kept else "")


@recursion_room()  # (the walks below recurse by the schemas' depth)
def tool_call_schema(
    tools: list[dict[str, Any]] | list[ToolSpec], strict: bool = True
) -> dict[str, Any]:
    """The JSON Schema of one call's body: ``{"name": <a tool>, "arguments": <its schema>}``,
    an ``anyOf`` whose ``name`` const selects the tool's arguments schema. ``strict`` closes
    the argument objects (see ``close_objects``) of the tools not marked otherwise."""
    specs = _specs(tools)
    if not specs:
        raise GrammarError("tools: the list is empty")
    branches = []
    resources: dict[str, tuple[str, Any, Any, bool]] = {}  # a nested $id: where it is
    for i, spec in enumerate(specs):
        base = f"#/anyOf/{i}/properties/arguments"
        # parameters without a type are an object's (check_parameters): {} let the grammar
        # write '"arguments": 5', a call every parser refuses
        parameters = (spec.parameters if "type" in spec.parameters
                      else {"type": "object", **spec.parameters})
        parameters = exact_dates(close_objects(parameters) if strict and spec.strict
                                 else parameters)
        # (an $id of its own would make its refs its own: they are the union's, rebased)
        own_id = parameters.get("$id") if isinstance(parameters.get("$id"), str) else None
        parameters = {k: v for k, v in parameters.items() if k != "$id"}
        arguments = _rebase_refs(copy.deepcopy(parameters), base, f"tool{i}_", own_id)
        _check_resources(arguments, spec.parameters, spec.name, strict and spec.strict,
                         resources)
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": spec.name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return {"anyOf": branches}


def tool_call_body(
    tools: list[dict[str, Any]] | list[ToolSpec],
    json_style: JsonStyle = JsonStyle.DUMPS,
    strict: bool = True,
) -> GrammarSource:
    """The grammar of one call's JSON body (what goes between the tags)."""
    union = tool_call_schema(tools, strict)
    check_depth(union, "tools", why=f", a tool's parameters {_UNION_DEPTH} levels down in the "
                                    f"tools' union: {MAX_SCHEMA_DEPTH - _UNION_DEPTH} at most "
                                    f"in one call's body, date patterns counted")
    return json_schema(union, origin="tools", json_style=json_style,
                       strict=False)  # (closed as each tool is, not again as a whole)


class ToolChoiceMode(enum.Enum):
    AUTO = "auto"  # text, calls, or text then calls
    NONE = "none"  # text only
    REQUIRED = "required"  # one or more calls, nothing else
    NAMED = "named"  # calls of one given tool


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI's ``tool_choice``; ``name`` is set for ``NAMED``."""

    mode: ToolChoiceMode
    name: str | None = None

    @classmethod
    def parse(cls, value: str | dict[str, Any] | ToolChoice | None) -> ToolChoice:
        """``"auto"`` (also None), ``"none"``, ``"required"``, a tool name, or
        ``{"type": "function", "function": {"name": ...}}``."""
        if isinstance(value, ToolChoice):
            return value
        if value is None:
            return cls(ToolChoiceMode.AUTO)
        if isinstance(value, dict):
            fn = value.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if value.get("type") != "function" or not isinstance(name, str) or not name:
                raise GrammarError(
                    f'tool_choice: expected {{"type": "function", '
                    f'"function": {{"name": ...}}}}, got {value!r}'
                )
            return cls(ToolChoiceMode.NAMED, name)
        if isinstance(value, str) and value:
            modes = {m.value: m for m in ToolChoiceMode if m is not ToolChoiceMode.NAMED}
            return cls(modes[value]) if value in modes else cls(ToolChoiceMode.NAMED, value)
        raise GrammarError(
            f"tool_choice: expected auto, none, required or a tool name, got {value!r}"
        )


def _rx(char: str) -> str:
    """``char`` as a regex atom, in or out of a class, in llguidance's syntax and Python's."""
    return char if char.isalnum() or char == "_" else f"\\x{ord(char):02X}"


def texts_without(tag: str) -> tuple[str, str]:
    """Two regexes (``/.../`` in a Lark grammar) whose ``PIECE* END?`` are the texts that do not
    hold ``tag``: a piece is a character other than ``tag``'s first, or a partial match of
    ``tag`` (its first character, then a prefix of the rest; another first character restarts
    it) that a wrong character ends; the end, a text that ends inside a partial match.
    ``/(?s:.*)/ & ~/(?s:.*)<tag>(?s:.*)/`` is the same language, but llguidance cannot tell
    that a run of text without ``tag``'s first character stays in it, so every free-text mask
    walked the whole vocabulary (2.0 ms at Qwen3's 151k tokens); written out, the slice
    ``FREE_TEXT_SLICE`` sets those tokens at once (0.1-0.2 ms). ``tag`` is ASCII and its first
    character does not recur in it (a restart is then that character alone)."""
    first, rest = tag[:1], tag[1:]
    if len(tag) < 2 or not tag.isascii() or first in rest:
        raise ValueError(f"{tag!r}: expected two or more ASCII characters, the first not again")
    last = len(rest) - 1
    prefix = ""  # a prefix of ``rest`` short of all of it: ``t``, ``to``, ... ``tool_call``
    for char in reversed(rest[:last]):
        prefix = f"(?:{_rx(char)}{prefix})?"
    wrong = f"[^{_rx(rest[last])}{_rx(first)}]"  # the partial match ends: a wrong character
    for char in reversed(rest[:last]):
        wrong = f"(?:[^{_rx(char)}{_rx(first)}]|{_rx(char)}{wrong})"
    started = f"{_rx(first)}(?:{prefix}{_rx(first)})*"  # (restarted by the first character)
    return f"[^{_rx(first)}]|{started}{wrong}", f"{started}{prefix}"


# Free text may not contain the opening tag spelled out in ordinary tokens: the runtime parses
# calls from text, so a spelled tag would be a call that escaped the grammar.
_PIECE, _ENDING = texts_without(OPEN)
_TAGLESS = [f"TAGLESS_PIECE: /{_PIECE}/", f"TAGLESS_END: /{_ENDING}/"]
# A turn's free text, as rules of its own that ``with_reasoning_tokens`` rewrites
_TEXT_RULES = ["text: TEXT", "text_before: TEXT_BEFORE_CALLS",
               "TEXT: TAGLESS_PIECE* TAGLESS_END?",
               'TEXT_BEFORE_CALLS: TAGLESS_PIECE* TAGLESS_END? "\\n"',  # a lone newline is text
               *_TAGLESS]
_FREE_TEXT = "\n".join(["start: text", _TEXT_RULES[0], _TEXT_RULES[2], *_TAGLESS, ""])
# A reasoning model (Qwen3, QwQ, DeepSeek-R1) thinks between these tokens, single added tokens
# of its vocabulary that it decodes as text; llguidance keeps every added token out of a
# terminal's text, so free text takes them as tokens of their own where the tokenizer has them.
REASONING_TOKENS = ("<think>", "</think>")


@recursion_room()
def assistant_turn(
    tools: list[dict[str, Any]] | list[ToolSpec],
    tool_choice: str | dict[str, Any] | ToolChoice | None = "auto",
    parallel_tool_calls: bool = True,
    strict: bool = True,
    output_schema: dict[str, Any] | None = None,
    output_strict: bool | None = None,
) -> GrammarSource:
    """The grammar of a whole assistant reply under ``tool_choice``.

    With ``output_schema``, the reply's text (where ``auto`` or ``none`` allow text) is the final
    answer: one JSON value matching that schema, written as ``json.dumps`` writes it.

    ``required``: one or more calls (one if not ``parallel_tool_calls``), nothing else. A named
    tool: the same, restricted to that tool. ``auto``: free text, or optional text then calls;
    once ``<tool_call>`` is written, the body is constrained to the tools' union. ``none``: free
    text without calls. The end token is legal wherever the reply may end. ``strict`` closes the
    output schema's objects (unless ``output_strict`` says otherwise) and the tools' argument
    objects (but a tool's own ``strict: false``; see ``close_objects``).
    """
    choice = ToolChoice.parse(tool_choice)
    specs = _specs(tools)
    if output_schema is not None:
        closed = strict if output_strict is None else output_strict
        return _answer_turn(specs, choice, parallel_tool_calls, strict, output_schema, closed)
    if choice.mode is ToolChoiceMode.NONE:
        return _free_text(lark(_FREE_TEXT, origin="tool_choice=none"))
    if not specs:
        if choice.mode is ToolChoiceMode.AUTO:
            return _free_text(lark(_FREE_TEXT, origin="tool_choice=auto"))
        raise GrammarError(f"tool_choice={choice.mode.value}: no tools were given")
    if choice.mode is ToolChoiceMode.NAMED:
        chosen = [s for s in specs if s.name == choice.name]
        if not chosen:
            known = ", ".join(s.name for s in specs)
            raise GrammarError(f"tool_choice: no tool is named {choice.name!r} (tools: {known})")
        specs = chosen
    body = {**tool_call_schema(specs, strict), "x-guidance": JSON_STYLE_OPTIONS[JsonStyle.DUMPS]}
    repeat = ' ("\\n" call)*' if parallel_tool_calls else ""
    rules = [
        f"calls: call{repeat}",
        f'call: {OPEN} "\\n" body "\\n" {CLOSE}',
        f"body: %json {_json_body(body)}",
    ]
    origin = f"tool_choice={choice.name if choice.name else choice.mode.value}"
    if choice.mode is ToolChoiceMode.AUTO:
        rules = ["start: text | text_before? calls", *rules, *_TEXT_RULES]
        return _free_text(lark("\n".join(rules) + "\n", origin=origin))
    return lark("\n".join(["start: calls", *rules]) + "\n", origin=origin)


def _json_body(schema: dict[str, Any]) -> str:
    """A ``%json`` rule's schema as llguidance compiles it: without the date formats beside
    their patterns (``without_date_formats``: the same language, compiled faster)."""
    return json.dumps(without_date_formats(schema), ensure_ascii=False)


def _free_text(source: GrammarSource) -> GrammarSource:
    return replace(source, free_text=True)


def with_reasoning_tokens(source: GrammarSource, text_tokens: dict[str, int]) -> GrammarSource:
    """``source`` (a turn's grammar with free text: ``free_text``) whose free text also takes
    those of ``REASONING_TOKENS`` that ``text_tokens`` has (a tokenizer's added tokens that it
    decodes as text, not special: text to id): before, a reasoning model's first token was
    masked and the argmax wrote another one. A special one is left out: decoded as nothing,
    it would join the text around it (``<tool_``, ``call>``) into a call the grammar never saw."""
    present = [t for t in REASONING_TOKENS if t in text_tokens]
    if not source.free_text or not present:
        return source
    tokens = " | ".join(f"<[{text_tokens[t]}]>" for t in present)
    # TEXT matches the empty text: beside the tokens, text runs between them are non-empty;
    # never two runs in a row: llguidance's lexer may end one at any byte and begin the next,
    # and a tag spelled across the two ("<tool_" "call>") was a call that escaped the grammar
    rules = {
        "text: TEXT": "text: TEXT_RUN? (reasoning TEXT_RUN?)*",
        "text_before: TEXT_BEFORE_CALLS": "text_before: (TEXT_RUN? reasoning)* TEXT_BEFORE_CALLS",
    }
    lines = [rules.get(line, line) for line in source.text.split("\n")]
    lines[-1:-1] = [f"reasoning: {tokens}", "TEXT_RUN: TAGLESS_PIECE+ TAGLESS_END? | TAGLESS_END"]
    return replace(source, text="\n".join(lines), free_text=False)


def _answer_turn(specs: list[ToolSpec], choice: ToolChoice, parallel: bool, strict: bool,
                 output_schema: dict[str, Any], output_strict: bool) -> GrammarSource:
    depth = check_depth(output_schema, "output schema")  # before the walks, which recurse
    schema = exact_dates(close_objects(output_schema) if output_strict else output_schema)
    if depth > MAX_SCHEMA_DEPTH - 2:  # a date's pattern beside another: 2 levels down
        check_depth(schema, "output schema", why=" (with the date patterns its formats add)")
    # checked alone first: an error of the turn's grammar names no field of the schema in it
    check_schema_supported(schema, "output schema")
    answer = {**schema, "x-guidance": JSON_STYLE_OPTIONS[JsonStyle.DUMPS]}
    answer_rule = f"answer: %json {_json_body(answer)}"
    if choice.mode is ToolChoiceMode.NONE or (not specs and choice.mode is ToolChoiceMode.AUTO):
        return replace(lark(f"start: answer\n{answer_rule}\n", origin="output schema"),
                       answers_in_schema=True)
    calls = assistant_turn(specs, choice, parallel, strict)
    if choice.mode is not ToolChoiceMode.AUTO:
        return calls
    body = {**tool_call_schema(specs, strict), "x-guidance": JSON_STYLE_OPTIONS[JsonStyle.DUMPS]}
    repeat = ' ("\\n" call)*' if parallel else ""
    rules = [
        "start: answer | calls",
        answer_rule,
        f"calls: call{repeat}",
        f'call: {OPEN} "\\n" body "\\n" {CLOSE}',
        f"body: %json {_json_body(body)}",
    ]
    return replace(lark("\n".join(rules) + "\n", origin="tool_choice=auto with an output schema"),
                   answers_in_schema=True)


def _specs(tools: list[dict[str, Any]] | list[ToolSpec]) -> list[ToolSpec]:
    if all(isinstance(t, ToolSpec) for t in tools):
        return list(tools)  # type: ignore[arg-type]
    return tool_specs(tools)  # type: ignore[arg-type]
