"""Training data in three JSONL formats, for any agent name, rendered into token ids.

- chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``; the loss
  is on the final assistant turn, so a conversation must end with one.
- prompt/completion: ``{"prompt": str, "completion": str}`` (plain text, no template).
- suite: ``{"agent", "context", "instruction", "answer"}`` (the project's task suite).

Each line may name its agent in a field (``agent`` by default, ``--agent-field`` to pick
another); with ``agent=NAME`` only that agent's lines are kept, and lines without the field
belong to it. Every problem raises :class:`DataError` naming ``file:line`` and the field.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prefillshare.app.rendering import Renderer, RenderError
from prefillshare.app.training.batches import Encoded
from prefillshare.app.training.tasks import DataError, jsonl_objects

ROLES = ("system", "user", "assistant")
FORMATS = ("messages", "text", "suite")


@dataclass(frozen=True)
class Record:
    """One training example as read, before rendering."""

    agent: str
    format: str                                  # one of FORMATS
    where: str                                   # "file:line", for errors
    messages: tuple[tuple[str, str], ...] = ()   # messages
    prompt: str = ""                             # text
    completion: str = ""
    context: str = ""                            # suite
    instruction: str = ""
    answer: str = ""


def _format_of(obj: dict) -> str:
    if "messages" in obj:
        return "messages"
    if "prompt" in obj or "completion" in obj:
        return "text"
    return "suite"


def _string(obj: dict, key: str, where: str) -> str:
    if key not in obj:
        raise DataError(f"{where}: missing field {key!r}")
    if not isinstance(obj[key], str):
        raise DataError(f"{where}: field {key!r} must be a string")
    return obj[key]


def _messages(obj: dict, where: str) -> tuple[tuple[str, str], ...]:
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: field 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise DataError(f"{where}: field 'messages[{i}]' must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{where}: field 'messages[{i}].role' must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{where}: field 'messages[{i}].content' must be a string")
        out.append((role, m["content"]))
    if out[-1][0] != "assistant":
        raise DataError(f"{where}: field 'messages[{len(out) - 1}].role': the conversation does not end with an "
                        "assistant turn (the turn the decoder learns)")
    if not any(r == "user" for r, _ in out[:-1]):
        raise DataError(f"{where}: field 'messages': no user turn before the final assistant turn")
    return tuple(out)


def read_records(path: str | Path, agent: str | None = None, agent_field: str = "agent") -> list[Record]:
    """Parse a JSONL file in one of the three formats; keep ``agent``'s lines when given."""
    out: list[Record] = []
    first_format = None
    for where, lineno, obj in jsonl_objects(path):
        fmt = _format_of(obj)
        if first_format is None:
            first_format = (fmt, lineno)
        elif fmt != first_format[0]:
            raise DataError(f"{where}: a {fmt} line in a file whose line {first_format[1]} is {first_format[0]}: "
                            "one format per file")
        name = obj.get(agent_field)
        if name is None:
            if agent is None:
                raise DataError(f"{where}: missing field {agent_field!r} (the agent; or pass --agent NAME)")
            name = agent
        elif not isinstance(name, str) or not name.strip():
            raise DataError(f"{where}: field {agent_field!r} must be a non-empty string")
        if agent is not None and name != agent:
            continue
        if fmt == "messages":
            out.append(Record(name, fmt, where, messages=_messages(obj, where)))
        elif fmt == "text":
            out.append(Record(name, fmt, where, prompt=_string(obj, "prompt", where),
                              completion=_string(obj, "completion", where)))
        else:
            out.append(Record(name, fmt, where, context=_string(obj, "context", where),
                              instruction=_string(obj, "instruction", where), answer=_string(obj, "answer", where)))
    if not out:
        raise DataError(f"{path}: no examples" + (f" for agent {agent!r}" if agent is not None else ""))
    return out


def common_system(records: Sequence[Record]) -> str | None:
    """The system prompt every conversation starts with, if they all share one (agent requests get it)."""
    firsts = {r.messages[0][1] if r.messages and r.messages[0][0] == "system" else None for r in records}
    return firsts.pop() if len(firsts) == 1 else None


def truncate(prompt: list[int], response: list[int], max_length: int | None, bos: int | None,
             where: str) -> list[int]:
    """Drop context from the left so prompt + response fit ``max_length``; prompt[-1] (the decoder's
    own token), the answer and a leading bos always stay."""
    if max_length is None or len(prompt) + len(response) <= max_length:
        return prompt
    keep_bos = bos is not None and bool(prompt) and prompt[0] == bos
    room = max_length - len(response) - int(keep_bos)
    if room < 1:
        raise DataError(f"{where}: the answer ({len(response)} tokens) does not fit --max-length {max_length} "
                        "with the prompt's last token")
    return ([bos] if keep_bos and bos is not None else []) + prompt[-room:]


def render_records(records: Sequence[Record], tok, renderer: Renderer, max_length: int | None = None,
                   invocation: Sequence[int] = ()) -> list[Encoded]:
    """Token ids of each record in ``renderer``'s format, ``invocation`` after each prompt (an
    Activated LoRA adapter's), truncated to ``max_length``."""
    out = []
    for r in records:
        try:
            if r.format == "text":
                p, resp = renderer.text_ids(tok, r.prompt, r.completion)
            elif r.format == "messages":
                p, resp = renderer.training_ids(tok, r.messages)
            else:
                p, resp = renderer.training_ids(tok, [*renderer.agent_messages(r.context, r.instruction),
                                                      ("assistant", r.answer)])
        except RenderError as e:
            raise DataError(f"{r.where}: {e}") from None
        p = [*p, *invocation]
        if len(p) < 1:
            raise DataError(f"{r.where}: the prompt renders to no tokens")
        out.append(Encoded(r.agent, tuple(truncate(p, resp, max_length, tok.bos_token_id, r.where)), tuple(resp)))
    return out


def choose_renderer(records: Sequence[Record], tok, chat_template: str | None, no_template: bool,
                    system: str | None, data_path, layout: str = "shared_first") -> Renderer:
    """The rendering a decoder trains (and is later served) with.

    prompt/completion data: the texts as written. Messages and suite data: the chat template
    file given, else the base tokenizer's own template, else the suite rendering; in ``layout``
    (shared_first: each agent's own text after the shared conversation, app/rendering.py).
    """
    from prefillshare.app.models.manifest import PromptFormat

    fmt = records[0].format
    if fmt == "text":
        if chat_template:
            raise DataError(f"{data_path}: --chat-template applies to messages and suite data, not prompt/completion")
        return Renderer(PromptFormat("text"))
    template = None
    where = str(data_path)
    if chat_template:
        path = Path(chat_template)
        if not path.is_file():
            raise DataError(f"--chat-template: no such file {path}")
        template, where = path.read_text(encoding="utf-8"), str(path)
    elif not no_template and getattr(tok, "chat_template", None):
        template = tok.chat_template
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default") or next(iter(template.values()))
        where = "the base tokenizer's chat_template"
    system = system if system is not None else common_system(records)
    if template is None:
        return Renderer(PromptFormat(system=system, layout=layout))
    renderer = Renderer.chat(template, system, layout)
    renderer.check(tok, f"{where}: the tokenizer cannot render it")
    return renderer
