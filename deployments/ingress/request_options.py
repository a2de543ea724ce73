"""From a validated request body to the app's Sampling: defaults, the app's caps, OpenAI
fields the server does not implement, and JSON schemas checked before any engine sees them.

Every refusal is an ApiError naming the field (``prefix`` locates an agent's field inside
/v1/agents/run, e.g. ``agents[1].stop``).
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

from prefillshare.app.bad_words import word_sequences
from prefillshare.app.config import LimitsConfig
from prefillshare.app.sampling import Sampling, SamplingError, StructuredOutput
from prefillshare.deployments.errors import ApiError

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

# vLLM 0.32's request extensions that cannot mean here what they mean on vLLM's server: name ->
# (values that mean "off", why not). Refused by name rather than ignored (a client that sends
# them expects them to act); docs/serving.md has the table of every extension.
_REMOVED_GUIDED = "removed from vLLM (0.32 ignores it, leaving the output unconstrained); use structured_outputs"
VLLM_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    **{f"guided_{k}": ((None,), _REMOVED_GUIDED)
       for k in ("json", "regex", "choice", "grammar", "decoding_backend", "whitespace_pattern")},
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "length_penalty": ((None, 1, 1.0), "beam search is not implemented"),
    "logprob_token_ids": ((None, []), "log-probabilities of chosen token ids are not implemented; use logprobs"),
    "chat_template": ((None,), "a decoder is rendered the way it was trained (its manifest's prompt format)"),
    "thinking_token_budget": ((None, -1), "the decoders are not reasoning models"),
    "prompt_embeds": ((None,), "the shared prefill works on token ids, not embeddings"),
    "kv_transfer_params": ((None,), "the app moves the KV between its engines itself"),
    "ec_transfer_params": ((None,), "the decoders have no encoders"),
    "vllm_xargs": ((None,), "the engines load no custom extensions"),
    "repetition_detection": ((None,), "repetition detection is not implemented"),
    "watermarking": ((None, False), "watermarking is not implemented"),
    "documents": ((None,), "the decoders' renderings take no documents"),
    "mm_processor_kwargs": ((None,), "the decoders take text only"),
    "media_io_kwargs": ((None,), "the decoders take text only"),
    "echo_prompt": ((None,), "not an option of this server; use echo"),
    "min_p_tokens": ((None,), "not an option of this server"),
}


def check_unsupported(body) -> None:
    """400 for an OpenAI (or vLLM) field the server does not implement, unless it is off."""
    fields = type(body).model_fields
    for name, (off, why) in UNSUPPORTED.items():
        if name in fields:
            value = getattr(body, name)
            if value not in off:
                raise ApiError(400, f"{name}: not supported by this server ({why})", name, "unsupported_parameter")
    extra = body.model_extra or {}
    for name, (off, why) in VLLM_UNSUPPORTED.items():
        if name in extra and extra[name] not in off:
            raise ApiError(400, f"{name}: vLLM's extension is not supported by this server ({why})", name,
                           "unsupported_parameter")


def load_grammar_backend():
    """xgrammar, imported by each Router replica as it starts (it loads torch and transformers: seconds
    of CPU), not at module import: the app builder imports this module too and never checks a schema."""
    import xgrammar

    return xgrammar


@functools.lru_cache(maxsize=256)
def _checked_schema(text: str, kind: str = "json") -> str | None:
    """The problem xgrammar (the engines' structured-output backend) finds in a JSON schema (or a
    regex, or an EBNF grammar: ``kind``)."""
    xgrammar = load_grammar_backend()
    build = {"json": xgrammar.Grammar.from_json_schema, "regex": xgrammar.Grammar.from_regex,
             "grammar": xgrammar.Grammar.from_ebnf}[kind]
    try:
        build(text)
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


def structured_outputs(so, response_format, param: str) -> StructuredOutput | None:
    """vLLM's ``structured_outputs`` (one kind, checked here like a schema) or ``response_format``."""
    if so is None:
        return structured(response_format, param + "response_format")
    if response_format is not None and response_format.type != "text":
        raise ApiError.invalid(param + "structured_outputs", f"{param}structured_outputs: give it or "
                               "response_format, not both")
    where = param + "structured_outputs"
    given = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(so, k) not in (None, False)]
    if len(given) != 1:
        raise ApiError.invalid(where, f"{where}: give exactly one of json, regex, choice, grammar or json_object")
    kind = given[0]
    if kind == "json_":
        schema = so.json_ if isinstance(so.json_, dict) else _json_object(so.json_, where + ".json")
        return schema_constraint(schema, where + ".json")
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "choice":
        return StructuredOutput(choice=tuple(so.choice))
    text = getattr(so, kind)
    problem = _checked_schema(text, kind)
    if problem is not None:
        raise ApiError.invalid(f"{where}.{kind}", f"{where}.{kind}: not a usable {kind}: {problem}")
    return StructuredOutput(**{kind: text})


def _json_object(text: str, param: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError.invalid(param, f"{param}: not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ApiError.invalid(param, f"{param}: a JSON schema object is required")
    return schema


def schema_constraint(schema: dict[str, Any], param: str) -> StructuredOutput:
    text = json.dumps(schema, sort_keys=True)
    problem = _checked_schema(text)
    if problem is not None:
        raise ApiError.invalid(param, f"{param}: not a usable JSON schema: {problem}")
    return StructuredOutput(json_schema=text)


def sampling_from(body, limits: LimitsConfig, eos_token_id: int | None, vocab_size: int, *, prefix: str = "",
                  max_tokens: int | None = None, max_tokens_param: str = "max_tokens",
                  logprobs: int | None = None, logprobs_param: str = "logprobs",
                  constraint: StructuredOutput | None = None, prompt_logprobs: int | None = None,
                  encode: Callable[[str], list[int]] | None = None) -> Sampling:
    """The request's Sampling, within the app's caps (limits.*), or ApiError naming the field.
    ``encode`` (text -> token ids, no special tokens) tokenizes ``bad_words`` once, every form."""
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
        constraint = structured_outputs(body.structured_outputs, body.response_format, p)
    elif body.structured_outputs is not None:
        raise ApiError.invalid(p + "structured_outputs", f"{p}structured_outputs: cannot be combined with tools (the "
                               "tool call is the structured output)")
    if body.priority not in (None, 0):
        raise ApiError.invalid(p + "priority", f"{p}priority: the engines schedule first come, first served; vLLM "
                               "refuses a priority other than 0 too unless started with --scheduling-policy priority")
    for name in ("stop_token_ids", "allowed_token_ids"):
        for t in getattr(body, name) or ():
            if not 0 <= t < vocab_size:
                raise ApiError.invalid(p + name, f"{p}{name}: token ids are in [0, {vocab_size}), got {t}")
    if prompt_logprobs is not None and prompt_logprobs > limits.max_logprobs:
        raise ApiError.invalid(p + "prompt_logprobs", f"{p}prompt_logprobs must be <= {limits.max_logprobs}, "
                               f"got {prompt_logprobs}")
    ignore_eos = bool(body.ignore_eos)
    stop_ids = _stop_ids(body, eos_token_id, ignore_eos)
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
            stop_token_ids=tuple(stop_ids),
            ignore_eos=ignore_eos,
            min_tokens=body.min_tokens or 0,
            include_stop_str_in_output=bool(body.include_stop_str_in_output),
            skip_special_tokens=_flag(body.skip_special_tokens, True),
            spaces_between_special_tokens=_flag(body.spaces_between_special_tokens, True),
            bad_words=tuple(body.bad_words or ()),
            bad_word_ids=word_sequences(encode, body.bad_words) if encode and body.bad_words else (),
            allowed_token_ids=tuple(body.allowed_token_ids) if body.allowed_token_ids is not None else None,
            prompt_logprobs=prompt_logprobs,
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


def _stop_ids(body, eos_token_id: int | None, ignore_eos: bool) -> list[int]:
    """eos ends a sequence through stop_token_ids (the decoders' own generation configs may not name
    it); ignore_eos leaves it out, as vLLM's server leaves out the eos check."""
    stop_ids = [] if ignore_eos or eos_token_id is None else [eos_token_id]
    return stop_ids + [t for t in body.stop_token_ids or () if t not in stop_ids]


def _num(value, default: float) -> float:
    return default if value is None else value


def _flag(value: bool | None, default: bool) -> bool:
    return default if value is None else value
