"""Request bodies of the HTTP routes, validated at the edge (pydantic, strict types).

The OpenAI routes declare every field OpenAI defines for them: the ones the server
implements, and the ones it does not (checked by deployments/ingress/request_options.py, which
rejects them with a 400 naming the field unless they carry their "off" value). Fields
OpenAI does not define are ignored (clients send extras); docs/serving.md lists both.
``/v1/agents/run`` is the project's own schema: unknown fields are rejected there.
"""
from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from prefillshare.deployments.errors import ApiError

Number = StrictFloat | StrictInt


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint kind (json, regex, choice, grammar,
    json_object). vLLM's other keys (structural_tag, whitespace options) are refused by name."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(None, min_length=1)
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None  # OpenAI's padding of stream events: nothing to pad here


class _SamplingFields(BaseModel):
    """Sampling fields shared by both OpenAI routes and agents."""

    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = None
    n: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's sampling extensions (not OpenAI's), honoured as vLLM's own server does (docs/serving.md)
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    bad_words: list[StrictStr] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    structured_outputs: StructuredOutputs | None = None
    priority: StrictInt | None = None


class _OpenAIFields(_SamplingFields):
    model_config = ConfigDict(extra="allow")  # fields OpenAI does not define are ignored

    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None  # an end-user id for abuse monitoring: accepted, no effect
    # vLLM's request extensions of both OpenAI routes
    prompt_logprobs: StrictInt | None = None
    truncate_prompt_tokens: StrictInt | None = None
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=1024)
    add_special_tokens: StrictBool | None = None


class CompletionBody(_OpenAIFields):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    # OpenAI fields this server does not implement (request_options.UNSUPPORTED)
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class TextPart(BaseModel):
    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(BaseModel):
    name: StrictStr
    arguments: StrictStr


class ToolCall(BaseModel):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    refusal: StrictStr | None = None


class FunctionDef(BaseModel):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[str, StrictStr]


class ChatBody(_OpenAIFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # accepted without effect: identifiers and labels that do not change the output
    metadata: dict[str, StrictStr] | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    # vLLM's chat-template switches (the decoder's recorded rendering applies them)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    echo: StrictBool = False  # vLLM's: the answer repeats the final message it continues
    # OpenAI fields this server does not implement (request_options.UNSUPPORTED)
    audio: dict[str, Any] | None = None
    modalities: list[StrictStr] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: StrictStr | None = None
    verbosity: StrictStr | None = None
    web_search_options: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    store: StrictBool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: StrictStr | dict[str, Any] | None = None
    prompt_cache_retention: StrictStr | None = None


class AgentBody(_SamplingFields):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr | None = None
    model: StrictStr
    instruction: StrictStr
    logprobs: StrictInt | None = None  # alternatives per token, results in OpenAI's chat shape


class AgentRunBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    context: StrictStr
    agents: list[AgentBody] | None = None
    rounds: StrictInt | list[list[AgentBody]] | None = None
    join_outputs: StrictBool = True
    stream: StrictBool = False
    # vLLM's cache_salt, for the run's one shared context: every agent's prompt shares it, so
    # it is the run's, not an agent's (joined with the tenant's salt, as on the OpenAI routes)
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=1024)


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "int", "float", "bool", "list[int]", "list[str]", "list[list[AgentBody]]") or \
                str(part).startswith(("list[", "function-", "literal[", "TextPart", "NamedToolChoice")):
            continue  # union-member labels pydantic adds to the location
        else:
            out += ("." if out else "") + str(part)
    return out


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, or 413 past ``max_bytes`` (checked on Content-Length first, then on what came)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"request body has {declared} bytes; the limit is {max_bytes}", None,
                       "request_too_large")
    raw = await request.body()
    if len(raw) > max_bytes:
        raise ApiError(413, f"request body has {len(raw)} bytes; the limit is {max_bytes}", None,
                       "request_too_large")
    return raw


Body = TypeVar("Body", bound=BaseModel)


def parse(raw: bytes, schema: type[Body]) -> Body:
    """Body -> schema, or ApiError naming the bad field."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {e.start})", None, "invalid_encoding") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", None, "invalid_json") from None
    except RecursionError:  # the parser recurses once per nesting level
        raise ApiError(400, "request body nests JSON arrays/objects too deeply", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", None, "invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = _loc(err["loc"])
        raise ApiError(400, f"{field or 'body'}: {err['msg']}", field or None, "invalid_value") from None
