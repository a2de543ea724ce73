"""How many replicas an engine deployment needs, from what its engines report.

An ongoing-request count misleads for this app's engines: a prefill call is short, a prefill
module with in-engine LoRA decoders also decodes, and a fan-out is N requests that arrive
together. Each engine replica therefore reports its engine's own state
(:data:`SIGNALS`, deployments/replicas/engine_host.py), and :func:`desired_replicas` sizes the
deployment against the targets the operator set, as a proportional controller (Serve's own
policy is one too, on ongoing requests): each signal's mean over the replicas divided by its
target is a load ratio, and the deployment wants ``ceil(replicas x the largest ratio)``. The
first-token target sizes prefill modules, the inter-token target decoders; a module that also
decodes (in-engine LoRA decoders) reads both. Serve applies the bounds and delays afterwards.

Pure Python: the Serve policy (deployments/autoscaling.py) and the Metrics deployment, which
shows the same ratios on /metrics, both call it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# What an engine replica reports each metrics interval (EngineHost.record_autoscaling_stats).
SIGNALS = (
    "waiting",  # vLLM's waiting requests (vllm:num_requests_waiting)
    "running",  # vLLM's running requests (vllm:num_requests_running)
    "kv_cache_usage",  # vLLM's KV-cache usage, 0..1 (vllm:kv_cache_usage_perc)
    "queued_prompt_tokens",  # prompt tokens of requests that have no first token yet
    "first_token_s",  # mean time to first token since the last report (vllm:time_to_first_token_seconds)
    "inter_token_s",  # mean inter-token time since the last report (vllm:inter_token_latency_seconds)
    "prefill_tokens_per_s",  # prompt tokens the engine computes per second (running estimate)
)


@dataclass(frozen=True)
class EngineLoadTargets:
    """What one engine deployment promises; None: that signal does not size it."""

    first_token_target_s: float | None = None
    inter_token_target_s: float | None = None
    max_kv_cache_usage: float | None = 0.9
    target_ongoing_requests: float | None = None  # per replica, as Serve's default policy (optional here)

    def __post_init__(self) -> None:
        for name in ("first_token_target_s", "inter_token_target_s", "target_ongoing_requests"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name}: {v} must be above 0")
        if self.max_kv_cache_usage is not None and not 0 < self.max_kv_cache_usage <= 1:
            raise ValueError(f"max_kv_cache_usage: {self.max_kv_cache_usage} must be in (0, 1]")
        if all(getattr(self, n) is None for n in ("first_token_target_s", "inter_token_target_s",
                                                   "max_kv_cache_usage", "target_ongoing_requests")):
            raise ValueError("set at least one of first_token_target_s, inter_token_target_s, max_kv_cache_usage, "
                             "target_ongoing_requests")


def _mean(per_replica: Mapping[str, float] | None) -> float | None:
    if not per_replica:
        return None
    return sum(per_replica.values()) / len(per_replica)


def load_ratios(stats: Mapping[str, Mapping[str, float]], targets: EngineLoadTargets,
                ongoing_requests: float | None = None, replicas: int = 1) -> dict[str, float]:
    """{signal: its load against its target (1.0 = at the target)} for the signals that have a
    target and a report. ``stats``: {signal: {replica: value}} (Serve's aggregated metrics);
    ``ongoing_requests``: the deployment's total, for ``target_ongoing_requests``.

    The first-token load is the larger of the time measured and the time the queue predicts (its
    prompt tokens at the engine's prefill rate): a burst shows in the queue before any of its
    first tokens is out."""
    out: dict[str, float] = {}
    if targets.first_token_target_s is not None:
        seen = _mean(stats.get("first_token_s")) or 0.0
        queued, rate = stats.get("queued_prompt_tokens") or {}, stats.get("prefill_tokens_per_s") or {}
        predicted = max((queued[r] / rate[r] for r in queued if rate.get(r, 0) > 0), default=0.0)
        if stats.get("first_token_s") or queued:
            out["first_token_s"] = max(seen, predicted) / targets.first_token_target_s
    if targets.inter_token_target_s is not None and stats.get("inter_token_s"):
        out["inter_token_s"] = (_mean(stats["inter_token_s"]) or 0.0) / targets.inter_token_target_s
    if targets.max_kv_cache_usage is not None and stats.get("kv_cache_usage"):
        out["kv_cache_usage"] = (_mean(stats["kv_cache_usage"]) or 0.0) / targets.max_kv_cache_usage
    if targets.target_ongoing_requests is not None and ongoing_requests is not None:
        out["ongoing_requests"] = ongoing_requests / (targets.target_ongoing_requests * max(1, replicas))
    return out


def desired_replicas(replicas: int, ratios: Mapping[str, float]) -> tuple[int, str | None]:
    """(replicas wanted, the signal that decided) before Serve's bounds and delays; with no signal
    reported (no traffic since the last report) the deployment wants none beyond its minimum."""
    if not ratios:
        return 0, None
    signal = max(ratios, key=lambda k: ratios[k])
    return math.ceil(max(1, replicas) * ratios[signal] - 1e-9), signal


class EngineLoadMeter:
    """An engine replica's :data:`SIGNALS`, read from vLLM's own metrics in this process's
    Prometheus registry (vLLM's stat logger keeps one engine's series per process). Histograms
    are read as the change since the previous :meth:`sample`: the mean of what happened in
    between, not of the engine's whole life."""

    _HISTOGRAMS = {"first_token_s": "vllm:time_to_first_token_seconds",
                   "inter_token_s": "vllm:inter_token_latency_seconds"}
    _GAUGES = {"waiting": "vllm:num_requests_waiting", "running": "vllm:num_requests_running",
               "kv_cache_usage": "vllm:kv_cache_usage_perc"}
    # prefill rate: tokens computed in prefill over the time requests spent in it
    _PREFILL = ("vllm:request_prefill_kv_computed_tokens", "vllm:request_prefill_time_seconds")

    def __init__(self, registry=None) -> None:
        self._registry = registry
        self._last: dict[str, tuple[float, float]] = {}  # histogram -> (sum, count) at the last sample
        self.prefill_tokens_per_s = 0.0

    def _read(self) -> dict[str, float]:
        from prometheus_client import REGISTRY

        wanted = set(self._GAUGES.values()) | set(self._HISTOGRAMS.values()) | set(self._PREFILL)
        out: dict[str, float] = {}
        for fam in (self._registry or REGISTRY).collect():
            if fam.name not in wanted:
                continue
            for s in fam.samples:  # summed over label sets (one engine: one model, maybe several engine ids)
                if s.name == fam.name or s.name in (f"{fam.name}_sum", f"{fam.name}_count"):
                    out[s.name] = out.get(s.name, 0.0) + float(s.value)
        return out

    def _delta_mean(self, values: dict[str, float], name: str) -> float | None:
        total, count = values.get(f"{name}_sum"), values.get(f"{name}_count")
        if total is None or count is None:
            return None
        last_sum, last_count = self._last.get(name, (0.0, 0.0))
        self._last[name] = (total, count)
        if count <= last_count:
            return None
        return (total - last_sum) / (count - last_count)

    def sample(self, queued_prompt_tokens: int) -> dict[str, float]:
        """This interval's signals; a latency signal is left out when no request produced one."""
        values = self._read()
        out = {k: values.get(name, 0.0) for k, name in self._GAUGES.items()}
        out["queued_prompt_tokens"] = float(queued_prompt_tokens)
        for key, name in self._HISTOGRAMS.items():
            mean = self._delta_mean(values, name)
            if mean is not None:
                out[key] = mean
        tokens, seconds = (values.get(f"{n}_sum") for n in self._PREFILL)
        if tokens is not None and seconds is not None:
            t0, s0 = self._last.get("prefill", (0.0, 0.0))
            self._last["prefill"] = (tokens, seconds)
            if seconds > s0 and tokens > t0:
                rate = (tokens - t0) / (seconds - s0)
                self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else \
                    0.5 * self.prefill_tokens_per_s + 0.5 * rate
        if self.prefill_tokens_per_s:
            out["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        return out
