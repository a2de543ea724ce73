"""Messages between deployments: small plain dataclasses, never engine objects.

They cross process boundaries through Ray, so they hold token ids and numbers only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefillshare.app.engine.handover import HandOff
from prefillshare.app.sampling import Sampling, TokenLogprob
from prefillshare.deployments.errors import Failure


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

    prefill_module: str
    replica_id: str
    num_computed_tokens: int  # the prompt tokens this prefill computed (a round's usage counts them)
    node_id: str | None = None  # the Ray node whose pool holds the KV (decoders there read it locally)
    # per prompt, what its decoder needs from this prefill (Handover.handoffs); () when nothing
    handoffs: tuple[HandOff | None, ...] = ()

    def handoff(self, index: int) -> HandOff | None:
        """The hand-off of the call's ``index``-th prompt."""
        return self.handoffs[index] if self.handoffs else None


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    cache_salt: str | None = None
    prefer_node: str | None = None  # the prefill's node: deployments/routing/node_router.py routes there first
    adapter: str | None = None  # the LoRA adapter of a decode group this request runs with
    handoff: HandOff | None = None  # from its prefill (PrefillTicket.handoff); None: nothing, or a private prefill
    # an in-engine LoRA decoder's request goes to its prefill module: the prefix router routes on these
    locality_keys: tuple[str, ...] = ()


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
    error: Failure | None = None
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string (or token id) that ended the sequence
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the decoder's, once (Sampling.prompt_logprobs)
    prefill_module: str | None = None  # set by the caller (decode_call.py): who computed the shared KV
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


@dataclass(frozen=True)
class CompletionJob:
    """One OpenAI completion, already tokenized and validated by the ingress."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    route: str = "completions"
    cache_salt: str | None = None  # the tenant's salt (app/auth.py); None when auth is off


# --- to the Metrics deployment (deployments/metrics.py) ---
@dataclass(frozen=True)
class RequestRecord:
    """One finished decoder request, as the ingress/orchestrator saw it."""

    model: str
    agent: str
    route: str  # "completions" | "chat" | "agents"
    ttft_s: float | None
    e2e_s: float
    prompt_tokens: int
    generated_tokens: int
    shared_tokens_expected: int  # prompt tokens whose KV should come from the prefill module
    shared_tokens_loaded: int  # prompt tokens the decoder did not compute (num_cached_tokens)
    kv_bytes_per_token: int
    ok: bool = True


@dataclass(frozen=True)
class PrefillRecord:
    prefill_module: str
    replica_id: str
    computed_tokens: int
    cached_tokens: int
    seconds: float
    handed_over_tokens: int = 0  # the prompt tokens whose KV the call's decoders needed, summed over them
