"""OpenAI response shapes: choices, stream chunks, usage and log-probabilities.

One set of builders for the whole and the streamed answer of both routes, so a field added
to one appears in the other. ``Answer`` reads a request's output as its decoder call
accumulated it (deployments/decode_call.py ``Output``: ``n`` sequences).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.sampling import TokenLogprob
from deployments.decode_call import Output
from deployments.messages import CompletionJob, DecodeChunk


def completion_logprobs(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """Completions' shape: parallel lists; ``offset`` is the text length before the first token."""
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in items], "text_offset": offsets}


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    """Chat's shape: one entry per token, each with its alternatives."""
    return {"content": [
        {"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token),
         "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": _bytes(a.token)} for a in t.top]}
        for t in items]}


@dataclass
class ToolCallOut:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


@dataclass
class Answer:
    """A completion's response builders, reading the decoder call's accumulated ``output``."""

    job: CompletionJob
    chat: bool
    output: Output
    echo: str | None = None  # completions with echo: the prompt text, before the generated text
    logprobs: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def usage(self) -> dict[str, Any]:
        prompt, completion = len(self.job.prompt_token_ids), self.output.num_generated
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.output.num_cached_tokens}}

    def prefillshare(self) -> dict[str, Any]:
        return {"prefill_module": self.output.prefill_module, "prefill_replica": self.output.prefill_replica}

    # --- whole answers ---
    def choice(self, index: int, tool_calls: list[ToolCallOut] | None = None) -> dict[str, Any]:
        q = self.output.seq(index)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": q.text}
            finish = q.finish_reason
            if tool_calls is not None:
                message = {"role": "assistant", "content": None, "tool_calls": [c.to_json() for c in tool_calls]}
                finish = "tool_calls" if finish == "stop" else finish
            lp = chat_logprobs(q.logprobs) if self.logprobs else None
            return {"index": index, "message": message, "finish_reason": finish, "logprobs": lp}
        prefix = self.echo or ""
        lp = completion_logprobs(q.logprobs, len(prefix)) if self.logprobs else None
        return {"index": index, "text": prefix + q.text, "finish_reason": q.finish_reason, "logprobs": lp}

    def response(self, n: int, tool_calls: dict[int, list[ToolCallOut]] | None = None) -> dict[str, Any]:
        tool_calls = tool_calls or {}
        return {"id": self.job.request_id, "object": self.object, "created": self.created, "model": self.job.model,
                "choices": [self.choice(i, tool_calls.get(i)) for i in range(n)], "usage": self.usage(),
                "prefillshare": self.prefillshare()}

    # --- stream chunks ---
    def _event(self, choices: list[dict[str, Any]], **extra) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.job.request_id, "object": obj, "created": self.created, "model": self.job.model,
                "choices": choices, **extra}
        return "data: " + json.dumps(body) + "\n\n"

    def delta_event(self, chunk: DecodeChunk, first: bool) -> str:
        """One chunk of sequence ``chunk.index``; ``first``: the sequence's first event."""
        lp = None
        if self.logprobs and chunk.logprobs:
            if self.chat:
                lp = chat_logprobs(chunk.logprobs)
            else:
                q = self.output.seq(chunk.index)
                start = len(self.echo or "") + q.num_chars - len(chunk.delta_text)
                lp = completion_logprobs(chunk.logprobs, start)
        if self.chat:
            delta: dict[str, Any] = {"content": chunk.delta_text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": chunk.index, "delta": delta, "finish_reason": chunk.finish_reason, "logprobs": lp}
        else:
            text = (self.echo or "") + chunk.delta_text if first else chunk.delta_text
            choice = {"index": chunk.index, "text": text, "finish_reason": chunk.finish_reason, "logprobs": lp}
        return self._event([choice])

    def tool_call_event(self, index: int, calls: list[ToolCallOut], finish: str | None) -> str:
        delta = {"role": "assistant", "content": None, "tool_calls": [c.to_json(i) for i, c in enumerate(calls)]}
        return self._event([{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}])

    def usage_event(self) -> str:
        return self._event([], usage=self.usage())
