"""The sampling of one request or agent: the value the SDK sends and the app validates.

Both sides use this one type, so a value the app would refuse (a seed beyond 64 bits, a negative
penalty) fails in the client before anything is sent, with an error naming the OpenAI field. It
depends on nothing outside the standard library: an agent application installs the SDK without
the server (docs/sdk.md). The app turns it into vLLM's ``SamplingParams`` in app/sampling.py.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .errors import WorkflowError

__all__ = ["Sampling", "SamplingError", "StructuredOutput"]

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
_GREEDY = 1e-5  # vLLM treats a temperature below this as greedy


class SamplingError(WorkflowError):
    """A sampling value out of range; ``param`` is the OpenAI field it came from (the app answers
    it with a 400 naming that field)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"sampling.{param}: {message}")
        self.param = param
        self.detail = message


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, enforced by vLLM's structured-output backend from
    the first generated token: any JSON object, JSON valid against ``json_schema`` (JSON text,
    so the message stays hashable and cheap to send), text matching ``regex``, one of
    ``choice``, or text of an EBNF ``grammar`` (vLLM's ``structured_outputs`` kinds)."""

    json_object: bool = False
    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [self.json_object, self.json_schema is not None, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        if sum(kinds) != 1:
            raise SamplingError("structured_outputs", "give exactly one of json_object, json, regex, choice or "
                                "grammar")

    @classmethod
    def for_schema(cls, schema: dict[str, Any]) -> StructuredOutput:
        return cls(json_schema=json.dumps(schema, sort_keys=True))


@dataclass(frozen=True)
class Sampling:
    """What vLLM's SamplingParams supports and the OpenAI API exposes (see docs/serving.md)."""

    max_tokens: int | None = None  # None: the Router fills limits.max_tokens_default; an engine runs to its context
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()  # the text ends before the first stop string (not included, as in OpenAI)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # neither eos nor stop_token_ids end a sequence before this many tokens
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: tuple[str, ...] = ()  # never generated, in any form
    # the words' token sequences, both forms (app/bad_words.py: the ingress tokenizes them once);
    # empty with bad_words given: vLLM's own tokenization of them, which may miss a form
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # the only tokens that may be sampled
    prompt_logprobs: int | None = None  # alternatives per prompt token: needs the decoder's own prefill
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    logprobs: int | None = None  # alternatives per generated token (0: the chosen token's only)
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # lists and dicts from callers become tuples: the type is frozen and crosses Ray as is
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "bad_word_ids", tuple(tuple(w) for w in self.bad_word_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
            if not self.allowed_token_ids:
                raise SamplingError("allowed_token_ids", "must not be empty")
        for t in self.stop_token_ids:
            _int_range("stop_token_ids", t, 0, INT64_MAX)
        for t in self.allowed_token_ids or ():
            _int_range("allowed_token_ids", t, 0, INT64_MAX)
        for i, w in enumerate(self.bad_words):
            if not isinstance(w, str) or not w:
                raise SamplingError("bad_words", f"bad_words[{i}] must be a non-empty string")
        if self.max_tokens is not None:
            _int_range("max_tokens", self.max_tokens, 1, INT64_MAX)
        _float_range("temperature", self.temperature, 0.0, 2.0)
        _float_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int_range("top_k", self.top_k, -1, INT64_MAX)
        _float_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _int_range("seed", self.seed, INT64_MIN, INT64_MAX)
        _int_range("n", self.n, 1, INT64_MAX)
        if self.n > 1 and self.temperature < _GREEDY:
            raise SamplingError("n", f"n={self.n} needs temperature > 0 (greedy decoding gives one sequence)")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise SamplingError("stop", f"stop[{i}] must be a non-empty string")
        _float_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float_range("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        for tok, bias in self.logit_bias:
            _int_range("logit_bias", tok, 0, INT64_MAX)
            _float_range("logit_bias", bias, -100.0, 100.0)
        if self.logprobs is not None:
            _int_range("logprobs", self.logprobs, 0, INT64_MAX)
        if self.prompt_logprobs is not None:
            _int_range("prompt_logprobs", self.prompt_logprobs, 0, INT64_MAX)
        _int_range("min_tokens", self.min_tokens, 0, INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingError("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

    def to_json(self) -> dict[str, Any]:
        """The agent-body fields of /v1/agents/run that differ from the server's defaults."""
        body: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        defaults = Sampling()
        for name in ("seed", "top_k", "min_p", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "logprobs"):
            if getattr(self, name) != getattr(defaults, name):
                body[name] = getattr(self, name)
        if self.stop:
            body["stop"] = list(self.stop)
        if self.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        if self.structured is not None:
            body["response_format"] = (
                {"type": "json_object"} if self.structured.json_object else
                {"type": "json_schema", "json_schema": {"name": "output",
                                                        "schema": json.loads(self.structured.json_schema or "{}")}})
        return body


def _int_range(param: str, value, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise SamplingError(param, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise SamplingError(param, f"must be in [{low}, {high}], got {value}")


def _float_range(param: str, value, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SamplingError(param, f"must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        lo = "(" if low_open else "["
        raise SamplingError(param, f"must be in {lo}{low}, {high}], got {value}")
