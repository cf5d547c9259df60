"""User input files (chat messages, OpenAI tools, request lists), checked with errors that name
the file, line and field. Torch-free: the runtime checks an agent's messages here on any
backend, and a remote one's first step would wait for torch's import."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentflash.errors import UserError, expand_user, missing_file
from agentflash.tool_format import TOOL_NAME, unique_object

if TYPE_CHECKING:
    from agentflash.engine.request import SamplingParams
    from agentflash.grammar import GrammarSource
    from agentflash.grammar.tool_calls import ToolSpec

ROLES = ("system", "developer", "user", "assistant", "tool")


def _sampling_params(**fields: Any) -> SamplingParams:
    from agentflash.engine.request import SamplingParams

    return SamplingParams(**fields)


@dataclass(frozen=True)
class GenerateInput:
    """One generation as the CLI and the bench describe it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    params: SamplingParams = field(default_factory=_sampling_params)
    where: str = "command line"  # what its errors name: a requests file's path and line


class Stdin:
    """Standard input, as a file flag's ``-`` names it (``STDIN``): what reads it reads it whole,
    once; its errors name it ``<stdin>``."""

    parent = Path()  # what a requests line's schema file is found beside: the working directory

    def __str__(self) -> str:
        return "<stdin>"


STDIN = Stdin()


def _read_stdin(what: str) -> str:
    """Standard input's UTF-8 text, its line ends read as a file's are (universal newlines)."""
    if sys.stdin is None:  # the command was started with it closed (``<&-``)
        raise UserError(f"{STDIN}: {what} cannot be read: standard input is closed")
    try:
        data = sys.stdin.buffer.read()
        text = data.decode("utf-8")
    except OSError as err:
        raise UserError(f"{STDIN}: cannot read the {what}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{STDIN}: {what} input is not UTF-8 text (byte {err.start})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_text(path: Path | Stdin, what: str) -> str:
    """The UTF-8 text of ``what`` file ``path`` (or standard input); a one-line ``UserError``
    naming it if it is missing, unreadable (a directory) or not UTF-8."""
    if isinstance(path, Stdin):
        return _read_stdin(what)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: {what} file {missing_file(path)}") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read {what} file: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: {what} file is not UTF-8 text (byte {err.start})") from None


def read_json_file(path: Path | Stdin, what: str) -> Any:
    text = read_text(path, what)
    try:
        return json.loads(text, object_pairs_hook=unique_object)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}:{err.lineno}:{err.colno}: malformed JSON: {err.msg}") from None
    except ValueError as err:  # a key given twice
        raise UserError(f"{path}: malformed JSON: {err}") from None


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """The messages, checked; a content given as OpenAI's text parts (``[{"type": "text",
    "text": ...}]``) is joined into one string, as ``serve`` reads it."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: messages must be a non-empty JSON list")
    messages = [_joined_parts(msg, f"{where}: messages[{i}]") for i, msg in enumerate(messages)]
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise UserError(f"{where}: messages[{i}] must be an object")
        if msg.get("role") not in ROLES:
            raise UserError(
                f"{where}: messages[{i}].role must be one of {', '.join(ROLES)}, "
                f"got {msg.get('role')!r}"
            )
        if "tool_calls" in msg:
            if msg["role"] != "assistant":  # (a system message's read as its text: none)
                raise UserError(f"{where}: messages[{i}].tool_calls: only an assistant message "
                                f"makes tool calls")
            _check_tool_calls(msg["tool_calls"], f"{where}: messages[{i}].tool_calls")
        content = msg.get("content")
        if content is None and msg.get("tool_calls"):
            continue
        if not isinstance(content, str):
            raise UserError(f"{where}: messages[{i}].content must be a string or a list of "
                            f"text parts")
        check_unicode(content, f"{where}: messages[{i}].content")
    return messages


def _joined_parts(msg: Any, where: str) -> Any:
    """``msg`` with a list of text parts as its content joined into one string (a copy)."""
    if not isinstance(msg, dict) or not isinstance(msg.get("content"), list):
        return msg
    parts = msg["content"]
    if not parts:  # as OpenAI's API and serve refuse it
        raise UserError(f"{where}.content must be a string or a non-empty list of text parts")
    for j, part in enumerate(parts):
        if (not isinstance(part, dict) or part.get("type") != "text"
                or not isinstance(part.get("text"), str)):
            raise UserError(f'{where}.content[{j}] must be a text part {{"type": "text", '
                            f'"text": "..."}}')
    return {**msg, "content": "".join(part["text"] for part in parts)}


def leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a chat template reads them: the system and developer messages become
    one leading system message (their texts joined by a blank line), as ``serve`` reads them and
    OpenAI's API takes them (a template such as the demo's shows only a first system message:
    a second one, or one later on, was dropped)."""
    system = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    rest = [m for m in messages if m["role"] not in ("system", "developer")]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def check_unicode(text: str, where: str) -> None:
    """A ``UserError`` naming ``where`` if ``text`` holds a lone surrogate (no character: JSON's
    escape of half a pair, or a byte that was not UTF-8 in a command line or a file name),
    which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise UserError(f"{where} holds {text[err.start]!r} at character {err.start}: half "
                        f"of a surrogate pair or a byte that is not UTF-8, no character") from None


def _check_tool_calls(calls: Any, where: str) -> None:
    """An assistant message's calls, OpenAI's ``{"function": {"name", "arguments"}}`` or bare
    ``{"name", "arguments"}``, the arguments an object or its JSON text (as chat templates read
    them)."""
    if not isinstance(calls, list):
        raise UserError(f"{where} must be a list")
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise UserError(f"{where}[{j}] must be an object with a function's name")
        if "arguments" not in fn:  # as OpenAI's API (and serve) refuse; the template needs them
            raise UserError(f"{where}[{j}] has no arguments (give {{}} for none)")
        arguments = fn["arguments"]
        if isinstance(arguments, str):
            check_unicode(arguments, f"{where}[{j}].arguments")
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as err:
                raise UserError(f"{where}[{j}].arguments is not JSON: {err.msg}") from None
        if not isinstance(arguments, dict):
            raise UserError(f"{where}[{j}].arguments must be an object or its JSON text")


def check_tools(tools: Any, where: str) -> list[dict[str, Any]]:
    """An OpenAI ``tools`` list: ``[{"type": "function", "function": {"name", "parameters"}}]``."""
    if not isinstance(tools, list):
        raise UserError(f"{where}: tools must be a JSON list")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise UserError(
                f'{where}: tools[{i}] must be {{"type": "function", "function": {{...}}}}'
            )
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):  # OpenAI's rule: chat
            # templates write the name into the history unescaped (say "hi" did not parse back)
            raise UserError(f"{where}: tools[{i}].function.name must be 1-64 letters, digits, "
                            f"'_' or '-', got {name!r}")
        if name in names:
            raise UserError(f"{where}: tools[{i}].function.name {name!r} is listed twice")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise UserError(f"{where}: tools[{i}].function.parameters must be a JSON Schema object")
        description = fn.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise UserError(f"{where}: tools[{i}].function.description must be a string")
            check_unicode(description, f"{where}: tools[{i}].function.description")
        check_unicode(json.dumps(params, ensure_ascii=False),
                      f"{where}: tools[{i}].function.parameters")
    # as OpenAI's API (and serve) read a tool: its four fields in their order, nothing else
    # (written as given, another key order or an extra key made another prompt than serve's)
    return [{"type": "function", "function": {key: tool["function"][key] for key in
                                              ("name", "description", "parameters", "strict")
                                              if key in tool["function"]}} for tool in tools]


def _tool_specs(tools: list[dict[str, Any]], where: str) -> list[ToolSpec]:
    """The tools as the grammar of a call to them reads them (each schema checked once; the
    grammar takes these as they are)."""
    from agentflash.grammar import GrammarError
    from agentflash.grammar.tool_calls import tool_specs

    try:
        return tool_specs(tools)
    except GrammarError as err:
        raise UserError(f"{where}: {err}") from None


def load_messages(path: Path | Stdin) -> list[dict[str, Any]]:
    return check_messages(read_json_file(path, "messages"), str(path))


def load_tools(path: Path | Stdin) -> list[dict[str, Any]]:
    tools = check_tools(read_json_file(path, "tools"), str(path))
    _tool_specs(tools, str(path))  # a bad schema names this file, not each request using it
    return tools


def load_stdin_schema() -> GrammarSource:
    """The JSON Schema on standard input (``--schema -``), read once for all the requests that
    answer in it."""
    from agentflash import grammar

    try:
        return grammar.json_schema_text(read_text(STDIN, "schema"), origin=str(STDIN))
    except grammar.GrammarError as err:
        raise UserError(str(err)) from None


PARAM_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "stop", "speculation", "block_size")
GRAMMAR_FIELDS = ("tool_choice", "schema", "regex")
REQUEST_FIELDS = ("prompt", "messages", "tools") + PARAM_FIELDS + GRAMMAR_FIELDS


def make_params(values: dict[str, Any], where: str) -> SamplingParams:
    fields = {k: v for k, v in values.items() if k in PARAM_FIELDS and v is not None}
    if isinstance(fields.get("stop"), str):
        fields["stop"] = (fields["stop"],)
    elif "stop" in fields and not isinstance(fields["stop"], list | tuple):
        raise UserError(f"{where}: stop must be a string or a list of strings, "
                        f"got {fields['stop']!r}")
    try:
        return _sampling_params(**fields)
    except (TypeError, ValueError) as err:
        raise UserError(f"{where}: {err}") from None


def _check_fields(values: dict[str, Any], where: str) -> None:
    unknown = sorted(set(values) - set(REQUEST_FIELDS))
    if unknown:
        raise UserError(
            f"{where}: unknown field {unknown[0]!r} (known: {', '.join(REQUEST_FIELDS)})"
        )


def make_input(values: dict[str, Any], where: str) -> GenerateInput:
    """A request from ``prompt`` or ``messages``, ``tools`` and sampling fields."""
    _check_fields(values, where)
    prompt, messages = values.get("prompt"), values.get("messages")
    if (prompt is None) == (messages is None):
        raise UserError(f"{where}: give exactly one of 'prompt' and 'messages'")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise UserError(f"{where}: prompt must be a non-empty string")
        check_unicode(prompt, f"{where}: prompt")
        messages = [{"role": "user", "content": prompt}]
    messages = leading_system(check_messages(messages, where))
    tools = check_tools(values.get("tools") or [], where)
    specs = _tool_specs(tools, where)
    params = make_params(values, where)
    grammar = make_grammar(values, specs, where)
    if params.stop and whole_reply_bound(values):
        raise UserError(f"{where}: stop cannot cut a reply the grammar binds whole (schema, "
                        f"regex, tool_choice required or a named tool): it would not parse")
    # without tools (or with tool_choice none) a <tool_call> the model writes is text, which a
    # stop string may cut
    params = dataclasses.replace(params, grammar=grammar,
                                 tool_calls=bool(tools) and values.get("tool_choice") != "none")
    return GenerateInput(messages, tools, params, where)


def whole_reply_bound(values: dict[str, Any]) -> bool:
    """Whether the grammar a request asks for binds its whole reply (a schema, a regex, a required
    or named tool call), rather than only the tool calls it may write."""
    choice = values.get("tool_choice")
    return (values.get("schema") is not None or values.get("regex") is not None
            or choice not in (None, "auto", "none"))


def make_grammar(values: dict[str, Any], tools: list[ToolSpec], where: str):
    """The grammar a request asks for: a JSON schema, a regex, or its tools under tool_choice.

    With tools and no other grammar, ``tool_choice`` defaults to ``auto``: free text, but a
    ``<tool_call>`` body is bound to the tools' schemas. With tools and a schema, the reply
    answers in the schema or (``auto``) calls the tools, as an agent with an output schema does.
    """
    from agentflash import grammar

    choice = values.get("tool_choice")
    asked = [k for k in GRAMMAR_FIELDS if values.get(k) is not None]
    if not tools and choice in ("auto", "none") and len(asked) > 1:
        asked.remove("tool_choice")  # without tools it asks nothing of a schema or a regex
    answer_or_call = asked == ["tool_choice", "schema"] and tools and choice in ("auto", "none")
    if len([k for k in asked if k != "tool_choice"]) > 1 or (
        "tool_choice" in asked and len(asked) > 1 and not answer_or_call
    ):
        raise UserError(f"{where}: give one of {', '.join(GRAMMAR_FIELDS)}, not "
                        f"{' and '.join(asked)}")
    if "regex" in asked and tools:
        raise UserError(f"{where}: a regex binds the whole reply, so the tools could not be "
                        f"called: give tools or regex, not both")
    if "schema" in asked:
        schema = values["schema"]
        if isinstance(schema, grammar.GrammarSource):  # standard input's, read and checked
            source = schema
        elif isinstance(schema, (str, Path)):
            try:
                source = grammar.json_schema_file(schema)
            except grammar.GrammarError as err:
                raise UserError(f"{where}: schema {err}") from None
        else:  # its errors name the request already (the origin)
            source = grammar.json_schema(schema, origin=f"{where}: schema")
        if not tools:
            return source
        return _tools_turn(tools, choice, where, output_schema=source.schema)
    if "regex" in asked:
        return grammar.regex(values["regex"], origin=f"{where}: regex")
    if choice in (None, "auto") and not tools:  # free text, as serve and agents leave it
        return None
    if not tools and choice not in ("none", "auto"):
        fn = choice.get("function") if isinstance(choice, dict) else None
        name = fn.get("name", choice) if isinstance(fn, dict) else choice
        raise UserError(f"{where}: tool_choice {name!r} needs tools")
    return _tools_turn(tools, choice, where)


def _tools_turn(tools: list[ToolSpec], choice: Any, where: str,
                output_schema: dict[str, Any] | None = None):
    from agentflash import grammar

    try:
        return grammar.assistant_turn(tools, "auto" if choice is None else choice,
                                      output_schema=output_schema)
    except grammar.GrammarError as err:
        raise UserError(f"{where}: {err}") from None


def flags_input(defaults: dict[str, Any]) -> GenerateInput:
    """The command line's flags on their own, as a request of a placeholder prompt: a
    ``UserError`` naming the command line where they fail without any line's fields."""
    flags = {k: v for k, v in defaults.items() if v is not None and k not in ("prompt",
                                                                             "messages")}
    return make_input({**flags, "prompt": "-"}, "command line")


def _blame_the_flags(defaults: dict[str, Any], problem: str) -> None:
    """The command line's error where a line's ``problem`` is the flags' own (a bad flag, or
    pair of flags, is not the line's fault); where the flags fail only without the lines'
    fields (``--tool-choice required`` with the tools in the lines), the line's error stands:
    it was blamed on the flags, which were fine."""
    try:
        flags_input(defaults)
    except UserError as err:
        if str(err).removeprefix("command line: ") == problem:
            raise


def load_requests(path: Path | Stdin, defaults: dict[str, Any]) -> list[GenerateInput]:
    """One request per JSON line; ``defaults`` fill the fields a line does not set."""
    # JSON lines end at "\n" alone: str.splitlines also broke at U+2028, U+0085 or a form
    # feed, which JSON's strings may hold as they are
    lines = read_text(path, "requests").split("\n")
    requests = []
    for lineno, line in enumerate(lines, start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line, object_pairs_hook=unique_object)
        except json.JSONDecodeError as err:
            raise UserError(f"{where}: malformed JSON: {err.msg}") from None
        except ValueError as err:  # a key given twice
            raise UserError(f"{where}: malformed JSON: {err}") from None
        if not isinstance(obj, dict):
            raise UserError(f"{where}: each line must be a JSON object")
        # a field set to null is left out, and the flags fill it (it dropped the flag's value:
        # "max_tokens": null ran 256 tokens under --max-tokens 3); a field of no name is
        # named first, null or not
        _check_fields(obj, where)
        obj = {k: v for k, v in obj.items() if v is not None}
        if isinstance(obj.get("schema"), str):  # a schema file named beside the requests
            obj["schema"] = str(path.parent / expand_user(obj["schema"]))
        merged = {k: v for k, v in defaults.items() if v is not None and k not in obj}
        for given in (("prompt", "messages"), ("schema", "regex")):  # the line's replaces
            if any(k in obj for k in given):  # the flags' of the other kind
                for k in given:
                    merged.pop(k, None)
        try:
            requests.append(make_input({**merged, **obj}, where))
        except UserError as err:
            _blame_the_flags(defaults, str(err).removeprefix(f"{where}: "))
            raise
    if not requests:
        raise UserError(f"{path}: no requests in the file")
    return requests
