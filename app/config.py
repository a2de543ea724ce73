"""Typed configuration of the Serve application, validated once at load.

One source of truth for what the app runs: which prefill modules (shared bases) and which
decoders (task models) exist, how each is placed, the KV pool, request limits and routing.
`serve_config.yaml` passes it as the application's `args`; errors name the offending field
so a bad config fails at `serve run`, not on the first request.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from prefillshare.app.errors import PrefillShareLibraryError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# letters of any script (agent names such as "prüf-ágent"), digits, "_", ".", "-"
_NAME = re.compile(r"^[^\W_][\w.\-]{0,62}$")


def _valid_name(v: str) -> str:
    if not _NAME.match(v):
        raise ValueError("use letters, digits, '_', '.', '-' (max 63 chars)")
    return v


# A served or deployed name: prefill modules, decoders, adapters.
Name = Annotated[str, AfterValidator(_valid_name)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # settings renamed to the name of what they become (vLLM's or PoolSpec's): old name -> the new one
    # with an example; a config still using the old name fails naming the new one.
    renamed: ClassVar[dict[str, str]] = {}
    # settings that are gone: name -> what to use instead
    removed: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in cls.renamed.items():
                if old in data:
                    raise ValueError(f"{old}: renamed to {new}")
            for old, instead in cls.removed.items():
                if old in data:
                    raise ValueError(f"{old}: removed; {instead}")
        return data


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(B|KiB|MiB|GiB|TiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _bytes(v: Any) -> Any:
    """A byte count given as a number or with a binary unit ('256MiB', '0.25GiB')."""
    if isinstance(v, str):
        m = _SIZE.match(v)
        if not m:
            raise ValueError(f"{v!r} is not a size (a byte count, or a number with B, KiB, MiB, GiB or TiB)")
        return int(float(m[1]) * _UNITS[m[2]])
    return v


class EngineSettings(_Strict):
    """vLLM knobs shared by every engine of one deployment, under vLLM's engine-argument names
    (``AsyncEngineArgs``); any other engine argument goes in ``engine_kwargs``. app/engine_args.py
    is the one place they are translated (table: docs/serving.md, "Settings and where they go")."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="auto: bfloat16 on GPUs and CPUs with native bf16, else float32 (prefillshare.app.engine.compute_dtype)")
    max_model_len: int = Field(1024, ge=16)
    kv_cache_memory_bytes: Annotated[int, BeforeValidator(_bytes)] = Field(
        1 << 28, gt=0, description="KV cache per engine, CPU or GPU: bytes, or a size such as '256MiB'")
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1,
        description="GPUs only: vLLM starts only if this fraction of the GPU is free (the KV size is "
        "kv_cache_memory_bytes); lower it to put several engines on one GPU")
    block_size: int = Field(32, ge=16, multiple_of=16, description="CPU attention needs a multiple of 32")
    max_num_seqs: int = Field(16, ge=1)
    enforce_eager: bool = True
    threads_bind: str = Field(
        "nobind",
        description="VLLM_CPU_OMP_THREADS_BIND: 'nobind' leaves the engine's threads unpinned, as many as "
        "placement.num_cpus rounded down (at least one: Ray's OMP_NUM_THREADS), "
        "'0' / '1' pins to a core; 'auto' reserves every core per engine (slow with several engines)",
    )
    seed: int = 0
    serving_niceness: int = Field(
        0, ge=0, le=19,
        description="niceness of the engine core's processes once the engine answers: a replica starting "
        "on the same cores (a restart after a crash) then gets the larger CPU share. 0: unchanged")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="any other vLLM engine argument (AsyncEngineArgs field), passed "
        "through as given; checked against vLLM's fields when the app is built")

    renamed: ClassVar[dict[str, str]] = {"kv_cache_gib": "kv_cache_memory_bytes (vLLM's name), e.g. '256MiB'"}

    @field_validator("threads_bind")
    @classmethod
    def _bind(cls, v: str) -> str:
        if v == "all":
            raise ValueError("'all' is rejected by vLLM; use a core list such as '0-1'")
        if v not in ("auto", "nobind") and not re.fullmatch(r"[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*(\|.+)?", v):
            raise ValueError("expected 'auto', 'nobind' or a core list like '0', '0-1', '0,2'")
        return v


def _queue_limit(v: int) -> int:
    if v == 0:
        raise ValueError("use -1 (no limit) or a positive number; Serve rejects 0")
    return v


# Serve's max_queued_requests: -1 (unbounded) or a positive count
QueueLimit = Annotated[int, Field(ge=-1), AfterValidator(_queue_limit)]


ENGINE_LOAD_POLICY = "prefillshare.deployments.autoscaling:EngineLoadPolicy"


class AutoscalingPolicyConfig(_Strict):
    """Serve's ``AutoscalingPolicy``, under its names. The project's policy (``ENGINE_LOAD_POLICY``)
    scales an engine deployment by what its engines report (deployments/autoscaling.py)."""

    policy_function: str = Field(
        ENGINE_LOAD_POLICY, description="import path 'module:callable' of the policy; Serve's default reads ongoing "
        "requests alone (ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy)")
    policy_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="the policy's settings; the project's: first_token_target_s, "
        "inter_token_target_s, max_kv_cache_usage, target_ongoing_requests")

    @model_validator(mode="after")
    def _known_kwargs(self) -> AutoscalingPolicyConfig:
        if self.policy_function == ENGINE_LOAD_POLICY:
            from prefillshare.app.engine_load import EngineLoadTargets

            try:
                EngineLoadTargets(**self.policy_kwargs)
            except (TypeError, ValueError) as e:
                raise ValueError(f"policy_kwargs: {e}") from None
        return self


class Autoscaling(_Strict):
    """Serve's ``autoscaling_config`` of one deployment, under Serve's own field names; what is not
    set keeps Serve's default. Without ``policy``, Serve's ongoing-request policy decides."""

    min_replicas: int = Field(1, ge=0, description="0 lets an idle decoder stop; its first request then waits for "
                              "an engine start (decoders only)")
    initial_replicas: int | None = Field(None, ge=0, description="replicas at deploy; default min_replicas")
    max_replicas: int = Field(ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0, description="ongoing requests per replica the default policy "
                                           "holds (Serve's)")
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    downscale_to_zero_delay_s: float | None = Field(None, ge=0, description="1 -> 0 only; default downscale_delay_s")
    metrics_interval_s: float = Field(10.0, gt=0, description="how often replicas report their load (Serve's)")
    look_back_period_s: float = Field(30.0, gt=0, description="the window the load is averaged over (Serve's)")
    upscaling_factor: float | None = Field(None, gt=0)
    downscaling_factor: float | None = Field(None, gt=0)
    policy: AutoscalingPolicyConfig | None = Field(
        None, description="a policy other than Serve's default; {} picks the project's engine-load policy")

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas: {self.min_replicas} is above max_replicas {self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas: {self.initial_replicas} is outside min_replicas..max_replicas "
                             f"({self.min_replicas}..{self.max_replicas})")
        return self

    def serve_config(self) -> dict[str, Any]:
        """Serve's ``autoscaling_config``: the fields set here, Serve's defaults for the rest (this
        model's defaults are Serve 2.60's); a policy goes whole, so that ``policy: {}`` is the project's."""
        out = self.model_dump(exclude_unset=True, exclude={"policy"})
        if self.policy is not None:
            out["policy"] = self.policy.model_dump()
        return out

    @property
    def initial(self) -> int:
        return self.min_replicas if self.initial_replicas is None else self.initial_replicas


class _Replicas(_Strict):
    """A hand-set ``num_replicas`` or Serve's ``autoscaling`` (not both)."""

    num_replicas: int = Field(1, ge=1, description="replicas, fixed; leave out with autoscaling")
    autoscaling: Autoscaling | None = Field(
        None, description="Serve's autoscaling_config (its field names); replaces num_replicas")

    @model_validator(mode="after")
    def _one_count(self):
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("num_replicas: give num_replicas or autoscaling, not both (autoscaling sets the count "
                             "between min_replicas and max_replicas)")
        return self

    @property
    def max_replicas(self) -> int:
        """The most replicas this deployment may run (what a cluster must have room for)."""
        return self.autoscaling.max_replicas if self.autoscaling else self.num_replicas

    @property
    def min_replicas(self) -> int:
        return self.autoscaling.min_replicas if self.autoscaling else self.num_replicas

    @property
    def start_replicas(self) -> int:
        """The replicas Serve starts at deploy: ``num_replicas``, or autoscaling's initial count."""
        return self.autoscaling.initial if self.autoscaling else self.num_replicas

    def replica_options(self) -> dict[str, Any]:
        """Serve's options for the count: ``num_replicas`` or ``autoscaling_config``."""
        if self.autoscaling is None:
            return {"num_replicas": self.num_replicas}
        return {"autoscaling_config": self.autoscaling.serve_config()}


class Placement(_Replicas):
    """Where a deployment's replicas run; maps onto Serve's replica options."""

    num_cpus: float = Field(0.25, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(32, ge=1)
    max_queued_requests: QueueLimit = Field(
        -1, description="requests a caller may queue for this deployment beyond max_ongoing_requests "
        "on every replica; more are rejected (429). -1: unbounded"
    )
    placement_group_bundles: list[dict[str, float]] | None = Field(
        None, description="one bundle list per replica; the first bundle holds the replica actor"
    )
    placement_group_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    env: dict[str, str] = Field(default_factory=dict, description="extra env vars for the replica")

    @model_validator(mode="after")
    def _bundles_hold_actor(self) -> Placement:
        if self.placement_group_bundles is not None:
            if not self.placement_group_bundles:
                raise ValueError("placement_group_bundles: give at least one bundle or leave it out")
            first = self.placement_group_bundles[0]
            if first.get("CPU", 0.0) < self.num_cpus or first.get("GPU", 0.0) < self.num_gpus:
                raise ValueError(
                    "placement_group_bundles[0] must hold the replica itself "
                    f"(CPU >= num_cpus={self.num_cpus}, GPU >= num_gpus={self.num_gpus})"
                )
            for i, b in enumerate(self.placement_group_bundles):
                for k, v in b.items():
                    if v < 0:
                        raise ValueError(f"placement_group_bundles[{i}].{k} must be >= 0")
        return self


class AdapterConfig(_Strict):
    """One LoRA decoder of a group: served under ``name`` (the OpenAI ``model`` and agent name)."""

    name: Name
    path: str = Field(description="adapter directory: PEFT adapter_config.json + weights + prefillshare.json")
    rank: int = Field(ge=1, description="the adapter's LoRA rank (checked against adapter_config.json's r)")


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


class LoRAGroup(_Strict):
    """LoRA adapters one engine hosts over its ``model`` (a decode group, or a per-adapter prefill)."""

    adapters: list[AdapterConfig] = Field(
        default_factory=list, description="LoRA adapters of `model` this engine serves; empty: the full model")
    max_lora_rank: int = Field(16, description=f"largest adapter rank the engine accepts, one of {LORA_RANKS}")
    max_loras: int | None = Field(
        None, ge=1, description="adapters the group may hold (all run in one batch); default: as many as declared")

    @model_validator(mode="after")
    def _lora_limits(self):
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank: {self.max_lora_rank} is not one of {LORA_RANKS}")
        self._check_adapters("adapters", self.adapters, "group")
        return self

    def _check_adapters(self, field: str, adapters: list[AdapterConfig], owner: str) -> None:
        """Names once each, ranks within max_lora_rank, no more than max_loras; ValueError naming the field."""
        names = [a.name for a in adapters]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"{field}: duplicate name(s) {dup}")
        for j, a in enumerate(adapters):
            if a.rank > self.max_lora_rank:
                raise ValueError(f"{field}[{j}].rank: {a.rank} is above the {owner}'s max_lora_rank "
                                 f"{self.max_lora_rank}")
        if self.max_loras is not None and len(adapters) > self.max_loras:
            raise ValueError(f"{field}: {len(adapters)} declared, the {owner} allows max_loras={self.max_loras}")


class PrefillModuleConfig(LoRAGroup):
    """A shared frozen base: one PrefillServer deployment, N replicas. With ``adapters`` it is
    a per-adapter prefill (each adapter computes its own KV; nothing is shared across them).
    With ``lora_decoders`` its own engine also serves cache-conditioned LoRA decoders of the base:
    the base up to the hand-over point, the adapter from there on, one prefix cache for all."""

    name: Name
    model: str = Field(description="HF checkpoint directory of the base")
    placement: Placement = Field(default_factory=lambda: Placement(num_cpus=0.5))
    engine: EngineSettings = Field(default_factory=EngineSettings)
    lora_decoders: list[AdapterConfig] = Field(
        default_factory=list, description="cache-conditioned LoRA decoders (`prefillshare train --lora`) this "
        "module's engine serves in-engine, each under its name; they read its prefix cache, nothing is handed over")

    @model_validator(mode="after")
    def _in_engine_limits(self):
        if not self.lora_decoders:
            return self
        if self.adapters:
            raise ValueError("lora_decoders: a per-adapter prefill module (adapters) computes each adapter's own "
                             "KV, so it cannot also serve in-engine decoders on the base's KV; use two modules")
        self._check_adapters("lora_decoders", self.lora_decoders, "module")
        return self


class DecoderConfig(LoRAGroup):
    """A task model served under `name` (the OpenAI `model` and the agent name), or, with
    ``adapters``, a decode group: one engine on ``model`` (the base) serving each adapter under
    its own name; ``name`` then names the group's deployment."""

    name: Name
    model: str = Field(description="HF checkpoint directory with a prefillshare.json manifest; for a decode "
                       "group the base checkpoint the adapters apply to")
    prefill_module: str | None = Field(
        "auto",
        description="name of a configured prefill module; 'auto' picks the one whose id the "
        "manifest names; null forces private prefill",
    )
    placement: Placement = Field(
        default_factory=lambda: Placement(num_cpus=0.25, placement_group_bundles=[{"CPU": 0.25}])
    )
    engine: EngineSettings = Field(default_factory=EngineSettings)

    @property
    def served_names(self) -> list[str]:
        """The names requests address: the decoder's own, or its adapters' in a decode group."""
        return [a.name for a in self.adapters] if self.adapters else [self.name]


class PoolConfig(_Strict):
    """The KV pool behind the connector: shared memory on one node (hand-over "pool"). Across nodes
    the KV moves with vLLM's NixlConnector (hand-over "vllm-nixl"); the pool's own NIXL block
    server was retired once vLLM's connector measured as fast across CPU nodes (docs/scaling.md)."""

    renamed: ClassVar[dict[str, str]] = {"capacity_gib": "capacity_bytes (PoolSpec's name), e.g. '512MiB'",
                                         "fan_out_ttl_s": "lease_timeout_s (PoolSpec's name)"}
    removed: ClassVar[dict[str, str]] = dict.fromkeys(
        ("transport", "nixl_peers", "nixl_listen", "nixl_timeout_s", "server_resources", "decode_path"),
        "the pool is one node's; across nodes set handover: vllm-nixl (vLLM's NixlConnector, docs/scaling.md)")

    path: str = Field("/dev/shm/prefillshare", description="pool directory (shared memory on this node)")
    capacity_bytes: Annotated[int, BeforeValidator(_bytes)] = Field(
        1 << 29, gt=0, description="size of the pool's slots: bytes, or a size such as '512MiB'")
    lease_timeout_s: float = Field(30.0, gt=0, description="blocks stay readable this long for late decoders")
    check: Literal["off", "crc32"] = Field(
        "off", description="crc32: checksum every KV slot when saved and loaded (tests, debugging); off: "
        "slot generations alone detect reused or half-written slots")
    persist: bool = Field(False, description="keep the KV pool (slab, index) in /dev/shm when the app stops")


class LimitsConfig(_Strict):
    """Request limits enforced at the ingress (4xx beyond them)."""

    max_tokens_default: int = Field(32, ge=1)
    max_tokens_cap: int = Field(256, ge=1)
    max_n: int = Field(8, ge=1, description="most sequences (OpenAI n) one request may ask for")
    max_logprobs: int = Field(20, ge=0, le=20, description="most alternatives per token (logprobs, "
                              "top_logprobs); vLLM's engines return at most 20")
    max_stop_strings: int = Field(4, ge=0, description="most stop strings per request (OpenAI allows 4)")
    max_stop_chars: int = Field(64, ge=1, description="longest stop string")
    max_agents: int = Field(16, ge=1)
    max_rounds: int = Field(4, ge=1)
    request_timeout_s: float = Field(
        120.0, gt=0, description="a request's whole time from its admission at the Router (then 504 `timeout`): "
        "its engine calls run under it, a decode retry waits for a restarted replica at most what is left of it, "
        "and a vllm-nixl lease outlives it")
    max_inflight_requests: int = Field(
        64, ge=1, description="generation requests one Router replica runs at once; more get 429 + Retry-After "
        "at once instead of queueing (must stay below router.max_ongoing_requests)"
    )
    admission_target_s: float | None = Field(
        None, gt=0, description="the time from a request's arrival at the Router (see request_start_header) to "
        "its complete answer that admission steers to: while the 95th percentile over a window of requests "
        "exceeds it, a Router replica admits fewer at once (down to min_inflight_requests) and sheds the rest "
        "with 429, and more again while it is met; null: a fixed bound of max_inflight_requests. Set it above "
        "the answers' time at a load they meet")
    request_start_header: str | None = Field(
        None, description="a header in which a trusted front proxy stamps when it received the request (e.g. "
        "x-request-start, as nginx's and Heroku's 't=<epoch seconds or ms>'): admission_target_s then judges from "
        "that moment, so the time a request waits before the Router (in Serve's proxy and the Router's event loop) "
        "counts; null: from when the Router's handler starts. Trust it only behind a proxy that overwrites it")
    min_inflight_requests: int = Field(
        2, ge=1, description="the fewest requests admission_target_s may leave a Router replica to run at once "
        "(at most max_inflight_requests)")
    initial_inflight_requests: int | None = Field(
        None, ge=1, description="with admission_target_s: the bound a Router replica starts at (clamped between "
        "min_ and max_inflight_requests); it grows toward the target, up to doubling, while answers meet it "
        "and requests are turned away, until the first window past it (slow start), so a cold replica does not "
        "admit a burst it cannot answer in time, at the price of 429s for a burst larger than it in the first "
        "seconds. null: start at max_inflight_requests")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413")
    max_header_bytes: int = Field(32 << 10, ge=1024, description="larger header blocks get 431")
    retry_after_s: int = Field(1, ge=1, description="Retry-After (seconds) sent with 429 and 503")
    prefill_wait_s: float = Field(
        5.0, gt=0, description="how long a fan-out waits for a replica of its prefill module to take the "
        "call (none running: its node is gone) before the decoders prefill privately")
    decoder_wait_s: float = Field(
        5.0, gt=0, description="how long a decoder call waits for a replica when the decoder's last one died "
        "between its prefill and its decode, before it fails as decoder_unavailable (503 + Retry-After); a "
        "request for a decoder already known to have none fails so before its prefill")


class RoutingConfig(_Strict):
    """Prefix-locality routing of prefill calls; node affinity of decode calls."""

    imbalance_threshold: int = Field(
        4, ge=1, description="leave the preferred replica (prefix locality for prefill, the prefill's node for "
        "decode) when it has this many more ongoing requests than the least loaded (prefill: 4x this when the "
        "router sent it most of the prompt's blocks)"
    )
    max_tracked_prefixes: int = Field(10_000, ge=1)


class SmallDeployment(_Replicas):
    num_cpus: float = Field(0.05, ge=0)
    max_ongoing_requests: int = Field(256, ge=1)
    max_queued_requests: QueueLimit = Field(-1, description="see Placement.max_queued_requests")

class SharingConfig(_Strict):
    """The deploy-time check that a prefill module's decoders share its prefill (app/sharing.py)."""

    require: bool = Field(False, description="fail the deploy when a decoder on a prefill module renders an agent's "
                          "own system prompt before the shared context (trained system-first); off: a warning in the "
                          "deploy log and on GET /sharing")


class AuthConfig(_Strict):
    """API keys at the ingress. Off unless a key source is set; each key names a tenant, and the
    tenant salts every KV key and prefix-cache hash of its requests (app/auth.py)."""

    keys_file: str | None = Field(None, description="YAML/JSON mapping of API key -> tenant name")
    keys_env: str = Field("PREFILLSHARE_API_KEYS", description="env var holding the same mapping (JSON/YAML)")
    required: bool = Field(False, description="refuse to start without keys (set in the KubeRay manifests)")


class AppConfig(_Strict):
    """The whole application."""

    tokenizer: str = Field("checkpoints/tokenizer", description="HF fast tokenizer directory")
    prefill_modules: list[PrefillModuleConfig] = Field(
        min_length=0, description="may be empty: every decoder then prefills privately (a colocated deployment)"
    )
    decoders: list[DecoderConfig] = Field(
        default_factory=list, description="decode deployments: full decoders and LoRA decode groups (an app needs "
        "these or a prefill module's lora_decoders)")
    pool: PoolConfig = Field(default_factory=PoolConfig)
    handover: Literal["pool", "vllm-nixl"] = Field(
        "pool", description="how decoders get the base's KV: the project's pool (CPU nodes) or vLLM's NixlConnector "
        "(app/engine/nixl/config.py; GPUs)")
    kv_lease_duration: int | None = Field(
        None, ge=6, description="handover vllm-nixl: seconds a finished prefill keeps its blocks for a decoder's "
        "pull (vLLM's kv_lease_duration; unpulled leases hold prefill KV space that long); None: "
        "limits.request_timeout_s + 5. A decoder request that waits longer prefills privately")
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    router: SmallDeployment = Field(default_factory=SmallDeployment)
    orchestrator: SmallDeployment = Field(default_factory=SmallDeployment)
    metrics: SmallDeployment = Field(default_factory=SmallDeployment)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    sharing: SharingConfig = Field(default_factory=SharingConfig)
    engine_env: dict[str, str] = Field(
        default_factory=dict, description="env vars for every engine replica (e.g. VLLM_HOST_IP)"
    )
    root: str = Field(
        "", description="relative model paths resolve against this directory (default: the project root)"
    )

    @model_validator(mode="after")
    def _cross_refs(self) -> AppConfig:
        names = [p.name for p in self.prefill_modules]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"prefill_modules: duplicate name(s) {sorted(dup)}")
        dnames = [d.name for d in self.decoders]
        dup = {n for n in dnames if dnames.count(n) > 1}
        if dup:
            raise ValueError(f"decoders: duplicate name(s) {sorted(dup)}")
        served = [n for d in self.decoders for n in d.served_names]
        served += [a.name for p in self.prefill_modules for a in p.lora_decoders]
        if not served:
            raise ValueError("decoders: none configured (give decoders, or prefill_modules[].lora_decoders)")
        dup = {n for n in served if served.count(n) > 1}
        if dup:
            raise ValueError(f"decoders: name(s) {sorted(dup)} served twice (decoder, adapter or "
                             "prefill_modules[].lora_decoders names)")
        for i, d in enumerate(self.decoders):
            if d.prefill_module not in (None, "auto") and d.prefill_module not in names:
                raise ValueError(
                    f"decoders[{i}].prefill_module: {d.prefill_module!r} is not a configured "
                    f"prefill module (have {names})"
                )
        self._check_scaling()
        if self.limits.max_inflight_requests >= self.router.max_ongoing_requests:
            raise ValueError(
                f"limits.max_inflight_requests ({self.limits.max_inflight_requests}) must be below "
                f"router.max_ongoing_requests ({self.router.max_ongoing_requests}); otherwise Serve queues "
                "requests before the Router can answer 429"
            )
        return self

    def _check_scaling(self) -> None:
        """Only a decoder may stop when idle (``min_replicas: 0``): a prefill module at zero would send
        every fan-out to private prefill after limits.prefill_wait_s (and its in-engine decoders live
        in it), and the Router and Orchestrator are the path itself. The Metrics deployment holds
        the app's counters: one replica."""
        at_zero = [f"prefill_modules[{i}].placement" for i, p in enumerate(self.prefill_modules)
                   if p.placement.min_replicas == 0]
        at_zero += [name for name in ("router", "orchestrator") if getattr(self, name).min_replicas == 0]
        if at_zero:
            why = ("a prefill module must answer within limits.prefill_wait_s (and its lora_decoders live in it)"
                   if at_zero[0].startswith("prefill") else "it is on every request's path")
            raise ValueError(f"{at_zero[0]}.autoscaling.min_replicas: 0 is for decoders only; {why}, so it cannot "
                             "start from zero: set min_replicas: 1 or more")
        if self.metrics.autoscaling is not None or self.metrics.num_replicas != 1:
            raise ValueError("metrics: the Metrics deployment holds the app's counters and runs one replica; "
                             "leave out num_replicas and autoscaling")

    def path(self, p: str) -> Path:
        """A model/tokenizer path resolved against `root`."""
        q = Path(p).expanduser()
        base = Path(self.root).expanduser() if self.root else PROJECT_ROOT
        return q if q.is_absolute() else (base / q).resolve()

    def check_paths(self) -> None:
        """Fail with the field name when a checkpoint directory is missing."""
        problems = []
        if not self.path(self.tokenizer).is_dir():
            problems.append(f"tokenizer: no directory {self.path(self.tokenizer)}")
        for i, p in enumerate(self.prefill_modules):
            if not (self.path(p.model) / "config.json").is_file():
                problems.append(f"prefill_modules[{i}].model: no config.json in {self.path(p.model)}")
            for j, a in enumerate(p.lora_decoders):
                if not (self.path(a.path) / "adapter_config.json").is_file():
                    problems.append(f"prefill_modules[{i}].lora_decoders[{j}].path: no adapter_config.json in "
                                    f"{self.path(a.path)}")
        for i, d in enumerate(self.decoders):
            if not (self.path(d.model) / "config.json").is_file():
                problems.append(f"decoders[{i}].model: no config.json in {self.path(d.model)}")
            for j, a in enumerate(d.adapters):
                if not (self.path(a.path) / "adapter_config.json").is_file():
                    problems.append(f"decoders[{i}].adapters[{j}].path: no adapter_config.json in {self.path(a.path)}")
        if self.auth.keys_file and not self.path(self.auth.keys_file).is_file():
            problems.append(f"auth.keys_file: no file {self.path(self.auth.keys_file)}")
        if problems:
            raise ConfigError("; ".join(problems))

    def prefill_module(self, name: str) -> PrefillModuleConfig:
        for p in self.prefill_modules:
            if p.name == name:
                return p
        raise KeyError(name)


class ConfigError(PrefillShareLibraryError, ValueError):
    """A config that cannot run; the message names the field."""


def default(model: type[BaseModel], name: str) -> Any:
    """The default of setting ``name`` of ``model``, for the layers below the config that take the
    same setting without a config (EngineConfig, PoolSpec, the request routers): each default is
    written once, in this module."""
    return model.model_fields[name].get_default(call_default_factory=True)


# a field path at the start of a validator's message: "adapters[0].rank: 32 is above ..."
_MSG_FIELD = re.compile(r"^([A-Za-z_]\w*(?:\[\d+\])*(?:\.[A-Za-z_]\w*(?:\[\d+\])*)*): (.*)$", re.S)


def _format(err: ValidationError) -> str:
    """Every problem as ``field.path[i].name: message``, the same form the build's checks use; a
    model validator's message that names a sub-field extends the path."""
    parts = []
    for e in err.errors():
        loc = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in e["loc"]).lstrip(".")
        msg = e["msg"].removeprefix("Value error, ")
        m = _MSG_FIELD.match(msg) if e["type"] == "value_error" else None
        if m:
            loc, msg = f"{loc}.{m[1]}" if loc else m[1], m[2]
        parts.append(f"{loc or '(root)'}: {msg}")
    return "; ".join(parts)


def load_config(source: dict[str, Any] | str | Path) -> AppConfig:
    """An AppConfig from a dict (Serve `args`) or a YAML file; raises ConfigError naming fields.

    A YAML file may hold the config itself or a Serve config whose first application's
    `args.config` holds it.
    """
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: {e}") from e
        if isinstance(data, dict) and "applications" in data:
            data = data["applications"][0].get("args", {}).get("config", {})
        data = dict(data or {})
    else:
        data = dict(source)
    try:
        return AppConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e)) from None


def config_from_args(args: dict[str, Any]) -> AppConfig:
    """A Serve application's args: ``{"config": {...}}`` (inline) or ``{"config_path": "file.yaml"}``."""
    if "config_path" in args:
        return load_config(args["config_path"])
    if "config" in args:
        return load_config(args["config"])
    raise ConfigError("application args: give 'config' (inline) or 'config_path'")
