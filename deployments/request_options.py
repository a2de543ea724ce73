"""From a validated request body to the app's Sampling: defaults, the app's caps, OpenAI
fields the server does not implement, and JSON schemas checked before any engine sees them.

Every refusal is an ApiError naming the field (``prefix`` locates an agent's field inside
/v1/agents/run, e.g. ``agents[1].stop``).
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

import xgrammar  # imported with the Router, not on a request's path (it loads torch when alone)

from app.config import LimitsConfig
from app.sampling import Sampling, SamplingError, StructuredOutput
from deployments.errors import ApiError

# OpenAI fields the server does not implement: name -> (values that mean "off", why not).
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "best_of": ((None, 1), "server-side best-of ranking is not implemented; use n and pick on the client"),
    "suffix": ((None, ""), "insertion (fill-in-the-middle) is not implemented"),
    "audio": ((None,), "the decoders produce text only"),
    "modalities": ((None, ["text"]), "the decoders produce text only"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "reasoning_effort": ((None,), "the decoders are not reasoning models"),
    "verbosity": ((None,), "the decoders have no verbosity control"),
    "web_search_options": ((None,), "web search is not available"),
    "service_tier": ((None, "auto", "default"), "one service tier"),
    "store": ((None, False), "completions are not stored"),
    "functions": ((None,), "deprecated by OpenAI; use tools"),
    "function_call": ((None,), "deprecated by OpenAI; use tool_choice"),
    "prompt_cache_retention": ((None,), "prefix-cache retention is managed by the server"),
}

# vLLM's own request extensions that change the output and are not implemented: refused rather
# than ignored (a client that sends them expects them to act).
VLLM_UNSUPPORTED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                    "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "bad_words",
                    "allowed_token_ids", "prompt_logprobs", "use_beam_search", "length_penalty",
                    "truncate_prompt_tokens", "skip_special_tokens", "add_special_tokens", "logprob_token_ids",
                    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                    "echo_prompt", "min_p_tokens", "priority", "thinking_token_budget")


def check_unsupported(body) -> None:
    """400 for an OpenAI (or vLLM) field the server does not implement, unless it is off."""
    fields = type(body).model_fields
    for name, (off, why) in UNSUPPORTED.items():
        if name in fields:
            value = getattr(body, name)
            if value not in off:
                raise ApiError(400, f"{name}: not supported by this server ({why})", name, "unsupported_parameter")
    for name in VLLM_UNSUPPORTED:
        if name in (body.model_extra or {}):
            raise ApiError(400, f"{name}: vLLM's extension is not supported by this server", name,
                           "unsupported_parameter")


@functools.lru_cache(maxsize=256)
def _checked_schema(text: str) -> str | None:
    """The problem xgrammar (the engines' structured-output backend) finds in a JSON schema."""
    try:
        xgrammar.Grammar.from_json_schema(text)
    except Exception as e:  # noqa: BLE001 - any refusal is the client's schema
        line = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", line)[:300]  # drop xgrammar's time and source line
    return None


def structured(response_format, param: str) -> StructuredOutput | None:
    """response_format -> the engines' constraint (None for text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput(json_object=True)
    spec = response_format.json_schema
    where = f"{param}.json_schema"
    if not isinstance(spec, dict):
        raise ApiError.invalid(where, f"{where}: required for type json_schema ({{name, schema}})")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ApiError.invalid(f"{where}.schema", f"{where}.schema: a JSON schema object is required")
    return schema_constraint(schema, f"{where}.schema")


def schema_constraint(schema: dict[str, Any], param: str) -> StructuredOutput:
    text = json.dumps(schema, sort_keys=True)
    problem = _checked_schema(text)
    if problem is not None:
        raise ApiError.invalid(param, f"{param}: not a usable JSON schema: {problem}")
    return StructuredOutput(json_schema=text)


def sampling_from(body, limits: LimitsConfig, eos_token_id: int | None, vocab_size: int, *, prefix: str = "",
                  max_tokens: int | None = None, max_tokens_param: str = "max_tokens",
                  logprobs: int | None = None, logprobs_param: str = "logprobs",
                  constraint: StructuredOutput | None = None) -> Sampling:
    """The request's Sampling, within the app's caps (limits.*), or ApiError naming the field."""
    p = prefix
    if max_tokens is None:
        max_tokens = body.max_tokens if body.max_tokens is not None else limits.max_tokens_default
    if isinstance(max_tokens, int) and max_tokens > limits.max_tokens_cap:
        raise ApiError.invalid(p + max_tokens_param, f"{p}{max_tokens_param} must be <= {limits.max_tokens_cap}, "
                               f"got {max_tokens}")
    n = 1 if body.n is None else body.n
    if n > limits.max_n:
        raise ApiError.invalid(p + "n", f"{p}n must be <= {limits.max_n}, got {n}")
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise ApiError.invalid(p + logprobs_param, f"{p}{logprobs_param} must be <= {limits.max_logprobs}, "
                               f"got {logprobs}")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > limits.max_stop_strings:
        raise ApiError.invalid(p + "stop", f"{p}stop: at most {limits.max_stop_strings} strings, got {len(stop)}")
    for s in stop:
        if len(s) > limits.max_stop_chars:
            raise ApiError.invalid(p + "stop", f"{p}stop: each string at most {limits.max_stop_chars} characters, "
                                   f"got {len(s)}")
    bias = []
    for k, v in (body.logit_bias or {}).items():
        if not k.isdigit() or int(k) >= vocab_size:
            raise ApiError.invalid(p + "logit_bias", f"{p}logit_bias: keys are token ids in [0, {vocab_size}), "
                                   f"got {k!r}")
        bias.append((int(k), float(v)))
    if constraint is None:
        constraint = structured(body.response_format, p + "response_format")
    defaults = Sampling()
    try:
        return Sampling(
            max_tokens=max_tokens,
            temperature=_num(body.temperature, defaults.temperature),
            top_p=_num(body.top_p, defaults.top_p),
            top_k=body.top_k if body.top_k is not None else defaults.top_k,
            min_p=_num(body.min_p, defaults.min_p),
            seed=body.seed,
            n=n,
            stop=tuple(stop),
            stop_token_ids=() if eos_token_id is None else (eos_token_id,),
            presence_penalty=_num(body.presence_penalty, 0.0),
            frequency_penalty=_num(body.frequency_penalty, 0.0),
            repetition_penalty=_num(body.repetition_penalty, 1.0),
            logit_bias=tuple(bias),
            logprobs=logprobs,
            structured=constraint,
        )
    except SamplingError as e:
        param = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}.get(e.param, e.param)
        raise ApiError.invalid(p + param, f"{p}{param}: {e.detail}") from None


def _num(value, default: float) -> float:
    return default if value is None else value
