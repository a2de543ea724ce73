"""Sampling: the one description of how a request samples, from the ingress to the engine.

The Router builds it from an OpenAI body (after the range checks that need the app's limits),
messages carry it through Ray unchanged, and the engine turns it into vLLM's
``SamplingParams`` in :meth:`Sampling.to_vllm` and nowhere else. Constructing one validates
it, with an error that names the OpenAI field, so a value that vLLM would refuse later (a seed
beyond 64 bits, a negative penalty) never reaches an engine.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from prefillshare.app.bad_words import EXTRA_ARG
from prefillshare.app.errors import PrefillShareLibraryError

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
_GREEDY = 1e-5  # vLLM treats a temperature below this as greedy


class SamplingError(PrefillShareLibraryError, ValueError):
    """A sampling value out of range; ``param`` is the OpenAI field it came from."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
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

    def to_vllm(self):
        from vllm.sampling_params import StructuredOutputsParams

        if self.json_object:
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is not None:
            return StructuredOutputsParams(json=self.json_schema)
        if self.choice is not None:
            return StructuredOutputsParams(choice=list(self.choice))
        return StructuredOutputsParams(regex=self.regex, grammar=self.grammar)


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

    @property
    def private_prefill_reason(self) -> str | None:
        """Why this request must prefill on its decoder (a fallback reason), or None: prompt
        log-probabilities are the decoder's own, and vLLM computes them only for tokens it
        prefills itself (it reads neither its prefix cache nor a KV connector for them)."""
        return "prompt_logprobs" if self.prompt_logprobs is not None else None

    def to_vllm(self):
        """vLLM's SamplingParams (delta outputs: each step carries only what is new)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=self.n,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=list(self.stop) or None,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            bad_words=None if self.bad_word_ids else list(self.bad_words) or None,
            extra_args={EXTRA_ARG: [list(w) for w in self.bad_word_ids]} if self.bad_word_ids else None,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            prompt_logprobs=self.prompt_logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias) or None,
            logprobs=self.logprobs,
            structured_outputs=self.structured.to_vllm() if self.structured is not None else None,
            output_kind=RequestOutputKind.DELTA,
        )


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float
    rank: int | None = None  # 1 for the most likely token


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the ``top`` alternatives the request asked for."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    rank: int | None = None


def token_logprobs(token_ids, logprobs, k: int) -> list[TokenLogprob]:
    """vLLM's per-position ``{token_id: Logprob}`` dicts -> TokenLogprob. vLLM adds the chosen
    token to the top ``k`` when it ranks lower; ``top`` holds only the ``k`` best, by rank."""
    out = []
    for tid, pos in zip(token_ids, logprobs or ()):
        chosen = pos.get(tid)
        top = sorted(((t, lp) for t, lp in pos.items() if lp.rank is not None and lp.rank <= k),
                     key=lambda x: x[1].rank)
        out.append(TokenLogprob(
            int(tid), (chosen.decoded_token or "") if chosen else "", _finite(chosen.logprob if chosen else -math.inf),
            tuple(TopLogprob(int(t), lp.decoded_token or "", _finite(lp.logprob), lp.rank) for t, lp in top),
            chosen.rank if chosen else None))
    return out


def prompt_logprobs(prompt_ids, logprobs, k: int) -> list[TokenLogprob | None]:
    """vLLM's prompt log-probabilities -> one entry per prompt token; the first is None (nothing
    precedes it), as in vLLM's answer."""
    out: list[TokenLogprob | None] = []
    for tid, pos in zip(prompt_ids, logprobs or ()):
        out.append(None if pos is None else token_logprobs([tid], [pos], k)[0])
    return out


def _finite(x: float) -> float:
    """JSON has no -inf: the lowest float stands in for a zero probability, as vLLM's server does."""
    return x if math.isfinite(x) else -9999.0


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
