"""The OpenAI chat-completions wire format: what a request may hold, and the objects sent back.

Requests are validated strictly (a string where a number belongs is an error, not a coercion);
fields this server does not know are ignored, as OpenAI-compatible servers do, so that clients
sending newer options keep working. Every failure becomes an ``APIError``, which the app turns
into a 4xx with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from agentflash.tool_format import TOOL_NAME


class APIError(Exception):
    """An error the client caused (or a limit it hit), sent back as an OpenAI error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def __reduce__(self) -> tuple:  # copied or pickled: __init__ takes more than the message
        return type(self), (self.status, self.message), self.__dict__

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


ToolName = Annotated[str, Field(pattern=f"^{TOOL_NAME.pattern}$")]


class FunctionDef(_Wire):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Wire):
    type: Literal["function"]
    function: FunctionDef


class _ChosenFunction(_Wire):
    name: ToolName


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: _ChosenFunction


class TextPart(_Wire):
    type: Literal["text"]
    text: str


Content = str | Annotated[list[TextPart], Field(min_length=1)] | None  # [] as OpenAI: refused


class CalledFunction(_Wire):
    name: Annotated[str, Field(min_length=1)]  # (generate refuses a call to no function too)
    # any text, as OpenAI's API takes it: rendered into the prompt as the model wrote it, which
    # a call cut by max_tokens leaves unfinished (this server's replies too)
    arguments: str


class MessageToolCall(_Wire):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> Message:
        # as OpenAI's API refuses them: a result that answers no call, a turn that says nothing
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        if self.role in ("system", "developer", "user", "tool") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(_Wire):
    name: Annotated[str, Field(pattern=f"^{TOOL_NAME.pattern}$")]  # OpenAI's rule too
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Wire):
    include_usage: bool | None = None


class AgentflashOptions(_Wire):
    """The extension object ``agentflash`` of a request: how the engine may speculate. Its own
    object, so a key it does not know is refused (``blocksize`` did nothing), where OpenAI's
    fields beside it are ignored as other servers ignore them."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    speculation: Literal["auto", "dflash", "off"] = "auto"
    block_size: Annotated[int, Field(ge=2, le=64)] | None = None


class ChatCompletionRequest(_Wire):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None  # a torch seed
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    functions: list[Any] | None = None  # the API's calls before tools
    function_call: Any = None
    # outputs this server does not give: asked for, the reply would not be what the client reads
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None
    # variables of the model's chat template (vLLM's and SGLang's field: Qwen3's
    # {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    agentflash: AgentflashOptions | None = None
    # vLLM's and SGLang's own sampling and decoding fields (openai-python's extra_body), which
    # this server does not implement: read only to refuse any that would change the reply (a
    # client moving from vLLM sent top_k 1, or guided_json, and got a reply of another kind)
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    best_of: Any = None
    use_beam_search: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    regex: Any = None  # SGLang's
    ebnf: Any = None
    json_schema: Any = None
    ignore_eos: Any = None
    stop_token_ids: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    continue_final_message: Any = None
    add_generation_prompt: Any = None
    echo: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None

    def check_supported(self) -> None:
        """Options the schema admits but this server does not implement, named in the error."""
        if self.n not in (None, 1):
            raise APIError(400, "n: only one choice per request is supported", param="n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name}: not supported (use 0 or leave it out)", param=name)
        if self.logprobs:
            raise APIError(400, "logprobs: not supported", param="logprobs")
        if self.top_logprobs not in (None, 0):  # OpenAI's API asks for logprobs with it
            raise APIError(400, "top_logprobs: not supported (logprobs are not)",
                           param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ; give one",
                           param="max_completion_tokens")
        if any(not s for s in self.stop_strings):
            raise APIError(400, "stop: stop strings must not be empty", param="stop")
        if self.logit_bias:
            raise APIError(400, "logit_bias: not supported", param="logit_bias")
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name}: not supported; use tools and tool_choice",
                               param=name)
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise APIError(400, "modalities: only text is supported", param="modalities")
        for name in ("audio", "web_search_options"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name}: not supported", param=name)
        # vLLM's fields, where they would change the reply (their values that do not, taken)
        inert = {"top_k": (-1, 0), "min_p": (0,), "repetition_penalty": (1,), "min_tokens": (0,),
                 "best_of": (1,), "use_beam_search": (False,), "ignore_eos": (False,),
                 "stop_token_ids": ([],), "bad_words": ([],), "continue_final_message": (False,),
                 "add_generation_prompt": (True,), "echo": (False,),
                 "include_stop_str_in_output": (False,), "skip_special_tokens": (True,)}
        for name, values in inert.items():
            value = getattr(self, name)
            flag = isinstance(values[0], bool)
            if value is not None and (isinstance(value, bool) != flag or value not in values):
                raise APIError(400, f"{name}: not supported by this server (vLLM's or SGLang's "
                                    f"field); leave it out", param=name)
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs", "regex", "ebnf", "json_schema", "allowed_token_ids"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name}: not supported; constrain the reply with "
                                    f"response_format (json_schema) or tools", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only with stream true", param="stream_options")
        called: set[str] = set()
        for i, message in enumerate(self.messages):
            called.update(call.id for call in message.tool_calls or [])
            if message.role == "tool" and message.tool_call_id not in called:
                # as OpenAI's API: a result answers a call of an assistant message before it
                raise APIError(400, f"messages[{i}].tool_call_id: {message.tool_call_id!r} "
                                    f"answers no tool call of the messages before it",
                               param=f"messages[{i}].tool_call_id")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def wants_usage_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_FIELD_NAMES = {
    field.alias or name
    for model in (FunctionDef, ToolDef, _ChosenFunction, NamedToolChoice, TextPart, CalledFunction,
                  MessageToolCall, Message, JsonSchemaFormat, ResponseFormat, StreamOptions,
                  AgentflashOptions, ChatCompletionRequest)
    for name, field in model.model_fields.items()
}


def parse_request(body: bytes) -> ChatCompletionRequest:
    """The request in ``body`` (JSON), or an ``APIError`` naming the first bad field."""
    try:
        request = ChatCompletionRequest.model_validate_json(body)
    except ValidationError as err:
        raise _validation_error(err) from None
    request.check_supported()
    return request


def _validation_error(err: ValidationError) -> APIError:
    errors = err.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}")
    if not first["loc"]:
        return APIError(400, "the request body must be a JSON object")
    # A union reports one error per branch: keep the deepest (the branch the client meant),
    # and join the messages of branches that failed at the same depth.
    same_field = [(_path(e["loc"], e["type"] == "extra_forbidden"), e["msg"]) for e in errors
                  if e["loc"][0] == first["loc"][0]]
    deepest = max(len(path) for path, _ in same_field)
    chosen = [(path, msg) for path, msg in same_field if len(path) == deepest]
    param = _param(chosen[0][0])
    messages = list(dict.fromkeys(msg for path, msg in chosen if path == chosen[0][0]))
    return APIError(400, f"{param}: {', or '.join(messages)}", param=param)


def _path(loc: tuple[Any, ...], extra: bool = False) -> tuple[str | int, ...]:
    """The field path of an error location, without the names of union branches (but the key
    refused where it is an ``extra`` one)."""
    path = tuple(p for p in loc[:-1] if isinstance(p, int) or p in _FIELD_NAMES)
    last = loc[-1:] if extra or isinstance(loc[-1], int) or loc[-1] in _FIELD_NAMES else ()
    return path + tuple(last)


def _param(path: tuple[str | int, ...]) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


# --- responses ----------------------------------------------------------------------------------


def completion(id: str, model: str, created: int, content: str | None,
               tool_calls: list[dict[str, Any]], finish_reason: str, usage: dict[str, int],
               stats: dict[str, Any]) -> dict[str, Any]:
    """A ``chat.completion`` object; ``agentflash`` holds the engine's speculation stats."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                         "logprobs": None}],
            "usage": usage, "system_fingerprint": None, "agentflash": stats}


def chunk(id: str, model: str, created: int, delta: dict[str, Any],
          finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
    """A ``chat.completion.chunk`` with one choice."""
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                         "logprobs": None}], **extra}


def usage_chunk(id: str, model: str, created: int, usage: dict[str, int]) -> dict[str, Any]:
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [], "usage": usage}


def sse(obj: dict[str, Any] | str) -> bytes:
    """One server-sent event; ``[DONE]`` ends the stream."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def model_list(names: list[str], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created,
                                        "owned_by": "agentflash"} for n in names]}


def now() -> int:
    return int(time.time())
