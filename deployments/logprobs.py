"""OpenAI's log-probability shapes: the Router's completions and chats, and the Orchestrator's
agent results, show the engines' TokenLogprob the same way."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefillshare.app.sampling import TokenLogprob


def _token(t, as_ids: bool) -> str:
    """A token as an answer shows it: its text, or ``token_id:<id>`` (vLLM's
    ``return_tokens_as_token_ids``, for tokens whose text is not valid on its own)."""
    return f"token_id:{t.token_id}" if as_ids else t.token


def completion_logprobs(items: Sequence[TokenLogprob | None], offset: int, as_ids: bool = False,
                        unscored: str = "") -> dict[str, Any]:
    """Completions' shape: parallel lists; ``offset`` is the text length before the first token.
    A None item is a token without a log-probability (an echoed prompt's first token, shown as
    ``unscored``), null in every list as in vLLM's answer."""
    tokens, lps, tops, offsets = [], [], [], []
    for t in items:
        offsets.append(offset)
        token = unscored if t is None else _token(t, as_ids)
        tokens.append(token)
        lps.append(None if t is None else t.logprob)
        tops.append(None if t is None else {_token(a, as_ids): a.logprob for a in t.top})
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(items: list[TokenLogprob], as_ids: bool = False) -> dict[str, Any]:
    """Chat's shape: one entry per token, each with its alternatives."""
    return {"content": [
        {"token": _token(t, as_ids), "logprob": t.logprob, "bytes": _bytes(t.token),
         "top_logprobs": [{"token": _token(a, as_ids), "logprob": a.logprob, "bytes": _bytes(a.token)}
                          for a in t.top]}
        for t in items]}


def prompt_logprobs_json(items: list[TokenLogprob | None]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, {token id: {logprob, rank, decoded_token}} for
    the prompt's token and the requested alternatives; null for the first token."""
    out: list[dict[str, Any] | None] = []
    for t in items:
        if t is None:
            out.append(None)
            continue
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.token}}
        for a in t.top:
            entry.setdefault(str(a.token_id), {"logprob": a.logprob, "rank": a.rank, "decoded_token": a.token})
        out.append(entry)
    return out
