"""OpenAI response shapes: choices, stream chunks, usage and log-probabilities.

One set of builders for the whole and the streamed answer of both routes, so a field added
to one appears in the other. ``Answer`` reads a request's output as its decoder call
accumulated it (deployments/path/decode_call.py ``Output``: ``n`` sequences).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from prefillshare.app.sampling import TokenLogprob
from prefillshare.deployments.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_json
from prefillshare.deployments.messages import CompletionJob, DecodeChunk
from prefillshare.deployments.path.decode_call import Output


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
    echo: str | None = None  # echo: the prompt text (chat: the final message it continues) before the answer
    logprobs: bool = False
    token_ids: bool = False  # vLLM's return_token_ids: prompt and generated token ids beside the text
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    first_token: str = ""  # the prompt's first token as text (echoed logprobs show it unscored)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The decoder's prompt log-probabilities, when the sampling asked for them."""
        return self.output.prompt_logprobs

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def usage(self) -> dict[str, Any]:
        prompt, completion = len(self.job.prompt_token_ids), self.output.num_generated
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.output.num_cached_tokens}}

    def prefillshare(self) -> dict[str, Any]:
        return {"prefill_module": self.output.prefill_module, "prefill_replica": self.output.prefill_replica}

    def _completion_logprobs(self, items: list[TokenLogprob], start: int, echoed: bool) -> dict[str, Any]:
        """Completions' logprobs; ``echoed``: the prompt's tokens first, scored by the decoder."""
        if echoed:
            return completion_logprobs([*(self.prompt_logprobs or []), *items], 0, self.tokens_as_ids,
                                       f"token_id:{self.job.prompt_token_ids[0]}" if self.tokens_as_ids
                                       else self.first_token)
        return completion_logprobs(items, start, self.tokens_as_ids)

    def _ids(self, out: dict[str, Any], ids: list[int], prompt: bool) -> dict[str, Any]:
        """vLLM's return_token_ids fields on one choice (``prompt``: with the prompt's ids)."""
        if self.token_ids:
            out["token_ids"] = ids
            if prompt and not self.chat:
                out["prompt_token_ids"] = list(self.job.prompt_token_ids)
        return out

    # --- whole answers ---
    def choice(self, index: int, tool_calls: list[ToolCallOut] | None = None) -> dict[str, Any]:
        q = self.output.seq(index)
        prefix = self.echo or ""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": prefix + q.text}
            finish = q.finish_reason
            if tool_calls is not None:
                message = {"role": "assistant", "content": None, "tool_calls": [c.to_json() for c in tool_calls]}
                finish = "tool_calls" if finish == "stop" else finish
            lp = chat_logprobs(q.logprobs, self.tokens_as_ids) if self.logprobs else None
            return self._ids({"index": index, "message": message, "finish_reason": finish, "logprobs": lp},
                             q.token_ids, True)
        lp = self._completion_logprobs(q.logprobs, len(prefix), self.echo is not None) if self.logprobs else None
        out = {"index": index, "text": prefix + q.text, "finish_reason": q.finish_reason, "logprobs": lp}
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs)
        return self._ids(out, q.token_ids, True)

    def response(self, n: int, tool_calls: dict[int, list[ToolCallOut]] | None = None) -> dict[str, Any]:
        tool_calls = tool_calls or {}
        out = {"id": self.job.request_id, "object": self.object, "created": self.created, "model": self.job.model,
               "choices": [self.choice(i, tool_calls.get(i)) for i in range(n)], "usage": self.usage(),
               "prefillshare": self.prefillshare()}
        if self.chat and self.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs_json(self.prompt_logprobs)
        if self.chat and self.token_ids:
            out["prompt_token_ids"] = list(self.job.prompt_token_ids)
        return out

    # --- stream chunks ---
    def _event(self, choices: list[dict[str, Any]], **extra) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.job.request_id, "object": obj, "created": self.created, "model": self.job.model,
                "choices": choices, **extra}
        return "data: " + json.dumps(body) + "\n\n"

    def delta_event(self, chunk: DecodeChunk, first: bool) -> str:
        """One chunk of sequence ``chunk.index``; ``first``: the sequence's first event (which
        carries the echoed prompt, and the prompt's ids with return_token_ids)."""
        lp = None
        echo = (self.echo or "") if first else ""
        if self.logprobs and (chunk.logprobs or (first and self.echo is not None)):
            if self.chat:
                lp = chat_logprobs(chunk.logprobs or [], self.tokens_as_ids)
            else:
                q = self.output.seq(chunk.index)
                start = len(self.echo or "") + q.num_chars - len(chunk.delta_text)
                lp = self._completion_logprobs(chunk.logprobs or [], start, first and self.echo is not None)
        extra: dict[str, Any] = {}
        if self.chat:
            delta: dict[str, Any] = {"content": echo + chunk.delta_text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": chunk.index, "delta": delta, "finish_reason": chunk.finish_reason, "logprobs": lp}
            if first and self.token_ids:
                extra["prompt_token_ids"] = list(self.job.prompt_token_ids)
        else:
            choice = {"index": chunk.index, "text": echo + chunk.delta_text, "finish_reason": chunk.finish_reason,
                      "logprobs": lp}
        return self._event([self._ids(choice, list(chunk.delta_token_ids), first)], **extra)

    def tool_call_event(self, index: int, calls: list[ToolCallOut], finish: str | None) -> str:
        delta = {"role": "assistant", "content": None, "tool_calls": [c.to_json(i) for i, c in enumerate(calls)]}
        return self._event([{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}])

    def usage_event(self) -> str:
        return self._event([], usage=self.usage())
