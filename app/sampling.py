"""The app's side of sampling: vLLM's ``SamplingParams`` from the one sampling value, and
log-probabilities back.

The value itself (``Sampling``, ``StructuredOutput``, ``SamplingError``) is the SDK's
(agents/sampling.py): the Router builds it from an OpenAI body, messages carry it through Ray
unchanged, and the engine turns it into ``SamplingParams`` here and nowhere else.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from prefillshare.agents.sampling import Sampling, SamplingError, StructuredOutput
from prefillshare.app.bad_words import EXTRA_ARG

__all__ = ["Sampling", "SamplingError", "StructuredOutput", "TokenLogprob", "TopLogprob", "private_prefill_reason",
           "prompt_logprobs", "to_sampling_params", "token_logprobs"]


def private_prefill_reason(sampling: Sampling) -> str | None:
    """Why this request must prefill on its decoder (a fallback reason), or None: prompt
    log-probabilities are the decoder's own, and vLLM computes them only for tokens it
    prefills itself (it reads neither its prefix cache nor a KV connector for them)."""
    return "prompt_logprobs" if sampling.prompt_logprobs is not None else None


def structured_outputs_params(structured: StructuredOutput):
    """vLLM's StructuredOutputsParams for one constraint."""
    from vllm.sampling_params import StructuredOutputsParams

    if structured.json_object:
        return StructuredOutputsParams(json_object=True)
    if structured.json_schema is not None:
        return StructuredOutputsParams(json=structured.json_schema)
    if structured.choice is not None:
        return StructuredOutputsParams(choice=list(structured.choice))
    return StructuredOutputsParams(regex=structured.regex, grammar=structured.grammar)


def to_sampling_params(s: Sampling):
    """vLLM's SamplingParams (delta outputs: each step carries only what is new)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=s.n,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output,
        skip_special_tokens=s.skip_special_tokens,
        spaces_between_special_tokens=s.spaces_between_special_tokens,
        bad_words=None if s.bad_word_ids else list(s.bad_words) or None,
        extra_args={EXTRA_ARG: [list(w) for w in s.bad_word_ids]} if s.bad_word_ids else None,
        allowed_token_ids=list(s.allowed_token_ids) if s.allowed_token_ids is not None else None,
        prompt_logprobs=s.prompt_logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=dict(s.logit_bias) or None,
        logprobs=s.logprobs,
        structured_outputs=structured_outputs_params(s.structured) if s.structured is not None else None,
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
