"""Messages between deployments: small plain dataclasses, never engine objects.

They cross process boundaries through Ray, so they hold token ids and numbers only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.sampling import Sampling, TokenLogprob
from deployments.errors import Failure


@dataclass(frozen=True)
class PrefillRequest:
    """Compute the base KV of ``prompts`` (each a full prompt; the hand-over split is applied
    by the server). ``shared_prefix`` is computed first when given, so the prompts reuse it
    through prefix caching. ``locality_keys`` are the block keys the prefix router routes on."""

    request_id: str
    prompts: tuple[tuple[int, ...], ...]
    shared_prefix: tuple[int, ...] = ()
    locality_keys: tuple[str, ...] = ()
    cache_salt: str | None = None
    adapters: tuple[str | None, ...] = ()  # per prompt: the LoRA adapter computing its KV (per-adapter prefill)


@dataclass(frozen=True)
class PrefillTicket:
    """What a prefill did; a decoder needs nothing else than its prompt to find the KV."""

    request_id: str
    prefill_module: str
    replica_id: str
    num_prompt_tokens: tuple[int, ...]
    num_computed_tokens: int
    num_cached_tokens: int
    seconds: float
    node_id: str | None = None  # the Ray node whose pool holds the KV (decoders there read it locally)


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    cache_salt: str | None = None
    prefer_node: str | None = None  # the prefill's node: deployments/node_router.py routes there first
    adapter: str | None = None  # the LoRA adapter of a decode group this request runs with


@dataclass(frozen=True)
class DecodePlan:
    """One decoder request made ready by the Orchestrator (routing, shared prefill or the
    private fallback done), and what the caller of the decoder needs besides: the chunks'
    prefill fields and the request's metrics record. Whoever streams the decoder (the Router
    for a completion, the Orchestrator for an agent) runs it through deployments/decode_call.py.
    ``error`` is set, and nothing is to be decoded, when the request failed before its decoder
    (a prefill module that sheds load)."""

    request: DecodeRequest
    model: str  # the served decoder name: the key of the decode deployment handles
    agent: str  # "" for an OpenAI completion
    route: str  # "completions" | "chat" | "agents"
    shared_tokens_expected: int = 0  # prompt tokens whose KV the prefill module published
    kv_bytes_per_token: int = 0
    prefill_module: str | None = None
    prefill_replica: str | None = None
    error: Failure | None = None


@dataclass
class DecodeChunk:
    """One streamed step of one of a request's ``n`` sequences (``index``): the text, tokens
    and log-probabilities new since that sequence's previous chunk. ``finish_reason`` is set on
    a sequence's last chunk, ``finished`` on the request's last chunk."""

    request_id: str
    model: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    ttft_s: float | None = None
    error: Failure | None = None
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string (or token id) that ended the sequence
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the decoder's, once (Sampling.prompt_logprobs)
    prefill_module: str | None = None  # set by the orchestrator: who computed the shared KV
    prefill_replica: str | None = None


@dataclass(frozen=True)
class AgentSpec:
    """One agent of a fan-out: a decoder, its instruction and its sampling."""

    name: str
    model: str
    instruction: str
    sampling: Sampling
    prompt_token_ids: tuple[int, ...] = ()  # first round: the Router's tokenization (done once)


@dataclass(frozen=True)
class AgentRunRequest:
    request_id: str
    context: str
    rounds: tuple[tuple[AgentSpec, ...], ...]
    join_outputs: bool = True
    cache_salt: str | None = None  # the tenant's salt (app/auth.py); None when auth is off


@dataclass
class AgentEvent:
    """A streamed event of an agent run: a text delta, an agent's end, or the run's end."""

    kind: str  # "delta" | "agent_done" | "round_done" | "done"
    round: int = 0
    agent: str = ""
    model: str = ""
    delta_text: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    error: Failure | None = None  # agent_done of a failed agent


@dataclass(frozen=True)
class ModulePlan:
    """A prefill module as the app resolved it at build time."""

    name: str
    module_id: str
    block_size: int


@dataclass(frozen=True)
class DecoderPlan:
    """A decoder as resolved at build time: which prefill module feeds it, or why none does."""

    name: str
    prefill_module: str | None
    private_reason: str | None  # short code for metrics, e.g. "incompatible"
    private_detail: str | None  # readable reason
    kv_bytes_per_token: int
    max_model_len: int
    group: str | None = None  # decode group (config decoder name) whose engine serves this LoRA decoder
    adapter: str | None = None  # LoRA adapter name in that engine (None: a full-weight decoder)
    prefill_adapter: str | None = None  # the prefill module computes this decoder's KV with this adapter
    tool_call_format: str | None = None  # from the decoder's manifest: how it calls tools (deployments/tools.py)


@dataclass(frozen=True)
class AppPlan:
    tokenizer: str
    modules: tuple[ModulePlan, ...]
    decoders: tuple[DecoderPlan, ...]
    max_tokens_default: int
    max_tokens_cap: int
    max_agents: int
    max_rounds: int
    request_timeout_s: float
    prefill_wait_s: float = 5.0  # limits.prefill_wait_s
    renderers: dict[str, Any] | None = None  # decoder name -> its Renderer (deployments/prompts.py decoder_renderers)

    def decoder(self, name: str) -> DecoderPlan | None:
        return next((d for d in self.decoders if d.name == name), None)

    def module(self, name: str) -> ModulePlan | None:
        return next((m for m in self.modules if m.name == name), None)


@dataclass(frozen=True)
class CompletionJob:
    """One OpenAI completion, already tokenized and validated by the ingress."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    route: str = "completions"
    cache_salt: str | None = None  # the tenant's salt (app/auth.py); None when auth is off
