"""vLLM's extra endpoints beside the OpenAI routes: /tokenize, /detokenize, /version, /health.

Request and response shapes are vLLM 0.32's (``vllm.entrypoints.serve``). A named model is
tokenized with that decoder's own rendering: a chat body gives exactly the ids the chat route
would send for it (the Router builds both the same way), a prompt the ids of the completion
route. Like vLLM's server, these routes need no API key.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from prefillshare.deployments.ingress.schemas import ChatBody, parse


class TokenizeCompletionBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatBody(ChatBody):
    model: StrictStr | None = None  # type: ignore[assignment]  # vLLM: the served model when omitted
    return_token_strs: StrictBool | None = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(min_length=0)


def tokenize_body(raw: bytes) -> TokenizeCompletionBody | TokenizeChatBody:
    """A /tokenize body: vLLM's chat form when it has ``messages``, its prompt form otherwise."""
    try:
        chat = "messages" in json.loads(raw)
    except (ValueError, TypeError, RecursionError):
        chat = False  # parse() names the problem
    if chat:
        return parse(raw, TokenizeChatBody)
    return parse(raw, TokenizeCompletionBody)


def tokenize_answer(tok, ids: list[int], max_model_len: int, token_strs: bool | None) -> dict:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if token_strs else None}


@functools.cache
def version() -> dict:
    """/version as vLLM answers it: the vLLM release the engines run (read from vLLM's
    ``_version.py``; importing the ``vllm`` package itself takes seconds)."""
    spec = importlib.util.find_spec("vllm")
    names: dict = {}
    with contextlib.suppress(Exception):
        exec(Path(spec.origin if spec and spec.origin else "").with_name("_version.py").read_text(), names)  # noqa: S102 - vLLM's own file
    if "__version__" not in names:
        from vllm.version import __version__

        names["__version__"] = __version__
    return {"version": names["__version__"]}
