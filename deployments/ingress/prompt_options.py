"""vLLM's request extensions that change a request's prompt or its KV, applied by the Router
before the shared prefill: whatever they change, the base's KV and the decoder see the same ids.

``truncate_prompt_tokens`` cuts the ids, the chat switches (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``) reach the decoder's recorded rendering,
``prompt_logprobs`` (and ``echo`` with logprobs) ask for the decoder's own prompt scores (the
request then prefills privately, see app/sampling.py private_prefill_reason), and ``cache_salt`` joins
the tenant's salt. Every refusal is an ApiError naming the field.
"""
from __future__ import annotations

import hashlib
from typing import Any

from prefillshare.deployments.errors import ApiError
from prefillshare.deployments.ingress.tools import message_text, turns


def cache_salt(tenant_salt: str | None, request_salt: str | None) -> str | None:
    """The salt of a request's KV: the tenant's (an API key's), combined with the request's own
    ``cache_salt`` when both are set, so a request salt never opens another tenant's cache."""
    if tenant_salt is None or request_salt is None:
        return tenant_salt if request_salt is None else request_salt
    return hashlib.sha256(f"{tenant_salt}|{request_salt}".encode()).hexdigest()


def truncated(ids: list[int], body, max_model_len: int, max_tokens: int) -> list[int]:
    """``truncate_prompt_tokens`` applied as vLLM's renderer does: keep the last (``truncation_side``
    "left", the default) or first N tokens; -1: as many as fit beside ``max_tokens``."""
    n = body.truncate_prompt_tokens
    if n is None:
        return ids
    room = max_model_len - max_tokens
    if n == -1:
        n = room
    if n < 1 or n > room:
        raise ApiError.invalid("truncate_prompt_tokens",
                               f"truncate_prompt_tokens must be -1 or in [1, {room}] (max_model_len {max_model_len} "
                               f"- max_tokens {max_tokens}), got {body.truncate_prompt_tokens}")
    if len(ids) <= n:
        return ids
    return ids[:n] if body.truncation_side == "right" else ids[-n:]


def prompt_logprobs_of(body, echo_logprobs: int | None) -> int | None:
    """The prompt log-probabilities a request asks for, as vLLM reads them: ``prompt_logprobs``,
    or with ``echo`` the request's own logprobs count (so an echoed prompt comes back scored)."""
    k = body.prompt_logprobs
    if k is not None:
        if k < 0:
            raise ApiError.invalid("prompt_logprobs", f"prompt_logprobs must be >= 0, got {k}")
        if body.stream and k > 0:
            raise ApiError.invalid("prompt_logprobs", "prompt_logprobs: not available when stream is true")
        return k
    return echo_logprobs if body.echo else None


def chat_turns(body) -> list[tuple[str, str]]:
    """(role, text) turns of a chat request; with ``continue_final_message`` the last one is the
    assistant's partial answer, left open."""
    if not body.continue_final_message:
        return turns(body.messages)
    last = len(body.messages) - 1
    if body.messages[last].role != "assistant" or last == 0:
        raise ApiError.invalid(f"messages[{last}].role", "continue_final_message: the conversation must end in an "
                               "assistant message (the answer to continue) after a user turn")
    return [*turns(body.messages[:last]), ("assistant", message_text(body.messages[last], last))]


def chat_switches(body) -> dict[str, Any]:
    """vLLM's chat-template switches, for Prompter.chat_prompt."""
    if body.continue_final_message and body.add_generation_prompt:
        raise ApiError.invalid("continue_final_message", "continue_final_message: cannot be combined with "
                               "add_generation_prompt (set it to false): the final message is continued, not answered")
    if body.add_special_tokens:
        raise ApiError.invalid("add_special_tokens", "add_special_tokens: a decoder's chat prompt carries the special "
                               "tokens of its recorded rendering, no more")
    return {"add_generation_prompt": body.add_generation_prompt,
            "continue_final_message": body.continue_final_message,
            "template_kwargs": body.chat_template_kwargs}


def chat_echo(body, chat_turns_: list[tuple[str, str]]) -> str | None:
    """vLLM's chat ``echo``: the answer repeats the final message when it is the assistant's."""
    if body.echo and chat_turns_ and chat_turns_[-1][0] == "assistant":
        return chat_turns_[-1][1]
    return None
