"""Chat messages and tool calls: OpenAI's message list -> the (role, text) turns a decoder's
prompt is rendered from, and tool calls for decoders whose manifest declares a format.

Content parts are joined as vLLM joins them for text-only models (text parts, one per line);
any other part type is refused with the part named. Tool calls use the format a decoder's
manifest declares (``tool_call_format``); the one format implemented is ``"json"``: the tools
are named in the prompt on one line, and the decoder's output is constrained by a JSON schema
to ``{"name": <tool>, "arguments": {...}}`` (or, when the model may also answer in text,
``{"content": "..."}``), which the Router returns in OpenAI's ``tool_calls`` shape.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prefillshare.app.models.manifest import TOOL_CALL_FORMATS
from prefillshare.app.sampling import StructuredOutput
from prefillshare.deployments.errors import ApiError
from prefillshare.deployments.ingress.openai_format import ToolCallOut
from prefillshare.deployments.ingress.request_options import schema_constraint
from prefillshare.deployments.ingress.schemas import ChatBody, ChatMessage


def message_text(m: ChatMessage, i: int) -> str:
    """One message's text: a string, or text parts joined by newlines; tool calls as JSON."""
    if isinstance(m.content, list):
        texts = []
        for j, part in enumerate(m.content):
            if part.type != "text":
                raise ApiError.invalid(f"messages[{i}].content[{j}].type",
                                       f"messages[{i}].content[{j}].type: {part.type!r} parts are not supported "
                                       "(the decoders read text only); send 'text' parts")
            if part.text is None:
                raise ApiError.invalid(f"messages[{i}].content[{j}].text", f"messages[{i}].content[{j}].text is missing")
            texts.append(part.text)
        text = "\n".join(texts)
    else:
        text = m.content or ""
    if m.tool_calls:
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
        text = (text + "\n" if text else "") + json.dumps(calls, separators=(",", ":"))
    return text


def turns(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(role, text) per message; the last turn (the instruction) must come from the user or a tool."""
    last = len(messages) - 1
    if messages[last].role not in ("user", "tool"):
        raise ApiError.invalid(f"messages[{last}].role", "messages: the last message must have role 'user' "
                               "(or 'tool', answering a tool call)")
    out: list[tuple[str, str]] = [(m.role, message_text(m, i)) for i, m in enumerate(messages)]
    if not out[last][1].strip():
        raise ApiError.invalid(f"messages[{last}].content", f"messages[{last}].content is empty")
    return out


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tools are offered and read back."""

    constraint: StructuredOutput
    prompt_line: str  # the tools, rendered as the first (system) turn


def _call_schema(tool) -> dict[str, Any]:
    params = tool.function.parameters or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def plan_tools(body: ChatBody, tool_call_format: str | None, model: str) -> ToolPlan | None:
    """The tool plan of a chat request (None: no tools, or tool_choice 'none'), or a 400 naming
    ``tools`` when the decoder declares no tool-call format."""
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise ApiError.invalid("tool_choice", "tool_choice: give tools to choose from")
        return None
    if tool_call_format is None:
        raise ApiError.invalid("tools", f"tools: decoder {model!r} declares no tool-call format in its manifest "
                               "(tool_call_format), so it cannot call tools")
    if tool_call_format not in TOOL_CALL_FORMATS:
        raise ApiError.invalid("tools", f"tools: decoder {model!r} declares tool-call format "
                               f"{tool_call_format!r}; this server implements {', '.join(TOOL_CALL_FORMATS)}")
    if body.tool_choice == "none":
        return None
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise ApiError.invalid("tools", f"tools: function names repeat: {names}")
    chosen = body.tools
    if body.tool_choice is not None and not isinstance(body.tool_choice, str):
        name = body.tool_choice.function.get("name")
        chosen = [t for t in body.tools if t.function.name == name]
        if not chosen:
            raise ApiError.invalid("tool_choice", f"tool_choice: no tool named {name!r} in tools ({names})")
    options = [_call_schema(t) for t in chosen]
    if body.tool_choice in (None, "auto"):  # the model may answer with {"content": ...} instead
        options.append({"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
                        "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    constraint = schema_constraint(schema, "tools")
    return ToolPlan(constraint, tools_line(body.tools))


def tools_line(tools) -> str:
    """The tools as one short prompt line, ``name(arg, ...): description`` each: the grammar
    carries the full parameter schemas, the prompt only has to name the choices."""
    def one(t) -> str:
        args = ", ".join((t.function.parameters or {}).get("properties") or {})
        desc = f": {t.function.description}" if t.function.description else ""
        return f"{t.function.name}({args}){desc}"

    return "tools: " + "; ".join(one(t) for t in tools)


def read_tool_output(text: str) -> tuple[list[ToolCallOut] | None, str]:
    """The decoder's constrained output -> (tool calls, or None for a text answer; the text)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None, text  # cut off by max_tokens: the partial output as text
    if isinstance(obj, dict) and "name" in obj:
        return [ToolCallOut(str(obj["name"]), json.dumps(obj.get("arguments", {}), separators=(",", ":")))], ""
    if isinstance(obj, dict) and isinstance(obj.get("content"), str):
        return None, obj["content"]
    return None, text
