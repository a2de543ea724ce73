"""Prometheus metrics of the app, gathered in one small deployment.

Prefill, decode and routing happen in different replicas; each reports plain events here
(fire-and-forget, batched by :class:`MetricsSender`: one Serve call per replica every
``SEND_EVERY_S``, not several per request) and `GET /metrics` on the ingress renders this one registry, so a scrape
sees the whole app without Ray's metrics agent. Beside the project's ``prefillshare_*`` names
it carries vLLM's own ``vllm:*`` metrics: vLLM's Prometheus stat logger runs inside every engine
replica, which sends its samples here every ``ENGINE_PUSH_S`` (:func:`engine_samples`); they are
exported labelled by ``deployment`` and ``replica``, with vLLM's ``model_name`` set to the served
decoder (or prefill module), as Ray Serve LLM labels them. Every name is documented in
docs/serving.md; k8s/chart/dashboards/prefillshare.json charts them.
"""
from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import Metric
from ray import serve

from prefillshare.app.engine.handover import Family
from prefillshare.app.engine_load import SIGNALS
from prefillshare.deployments.messages import PrefillRecord, RequestRecord

if TYPE_CHECKING:
    from prefillshare.app.engine.handover import Handover, NodeState

log = logging.getLogger("ray.serve")
disable_created_metrics()  # no *_created series: they double every counter's lines for no use here
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


ENGINE_PUSH_S = 2.0  # how often an engine replica sends its vllm:* samples
ENGINE_STALE_S = 30.0  # samples of a replica silent this long are dropped (a replica that is gone)

def engine_samples(model_name: str, registry=None, extra: frozenset[str] = frozenset()) -> list[Family]:
    """The ``vllm:*`` families of this process (vLLM's stat logger registers them in the default
    registry) and the hand-over mode's own (``extra``: Handover.engine_metrics), with vLLM's
    ``model_name`` label set to the served name."""
    from prometheus_client import REGISTRY

    out = []
    for fam in (registry or REGISTRY).collect():
        if not fam.name.startswith("vllm:") and fam.name not in extra:
            continue
        samples = [(x.name, {**x.labels, "model_name": model_name} if "model_name" in x.labels else dict(x.labels),
                    x.value) for x in fam.samples]
        out.append((fam.name, fam.documentation, fam.type, samples))
    return out


class PushedFamilies:
    """Families other processes send as plain data, each sample labelled by its sender (``labels``
    names the key's parts); a sender silent for ENGINE_STALE_S is dropped (a replica or a node
    that is gone)."""

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.senders: dict[tuple[str, ...], tuple[float, list[Family]]] = {}

    def update(self, key: tuple[str, ...], families: list[Family]) -> None:
        self.senders[key] = (time.monotonic(), families)

    def collect(self):
        now = time.monotonic()
        for key in [k for k, (t, _) in self.senders.items() if now - t > ENGINE_STALE_S]:
            del self.senders[key]
        merged: dict[str, Metric] = {}
        for key, (_, families) in sorted(self.senders.items()):
            for name, doc, kind, samples in families:
                m = merged.setdefault(name, Metric(name, doc, kind))
                for sample, labels, value in samples:
                    m.add_sample(sample, {**labels, **dict(zip(self.labels, key))}, value)
        yield from merged.values()


class NodeStateCollector(PushedFamilies):
    """What the hand-over mode keeps on each node (the pool mode: the node's KV pool), labelled by
    its host (``node``) and its source (the mode's label, e.g. ``pool``: its path). The engine
    replicas of each node send their node's (on KubeRay this replica runs on the head, which has
    none); the state on this replica's own host is read at scrape time instead. One state seen by
    several nodes of one host (test clusters of several raylets on one machine) is one series."""

    def __init__(self, local: NodeState, host: str = "local") -> None:
        super().__init__(("node", local.label))
        self.host = host
        self.local = local

    def collect(self):
        try:
            self.update((self.host, self.local.source), self.local.families())
        except Exception:  # noqa: BLE001 - a state not there yields no samples, never a failed scrape
            pass
        yield from super().collect()


class AppMetrics:
    """The registry and its instruments; pure prometheus_client, usable without Ray."""

    def __init__(self, handover: Handover | None = None, host: str = "local") -> None:
        r = self.registry = CollectorRegistry()
        local = handover.node_state() if handover is not None else None
        self.nodes = NodeStateCollector(local, host) if local is not None else None
        if self.nodes is not None:
            r.register(self.nodes)
        self.engines = PushedFamilies(("deployment", "replica"))
        r.register(self.engines)
        ma = ["model", "agent"]
        self.ttft = Histogram("prefillshare_ttft_seconds", "Time to first token seen by the app",
                              ma, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("prefillshare_e2e_seconds", "End-to-end request latency", ma,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("prefillshare_requests", "Decoder requests by route and outcome",
                                ["model", "route", "status"], registry=r)
        self.tokens_in = Counter("prefillshare_prompt_tokens", "Prompt tokens of decoder requests",
                                 ["model"], registry=r)
        self.tokens_out = Counter("prefillshare_generation_tokens", "Generated tokens", ["model"], registry=r)
        self.prefill_computed = Counter(
            "prefillshare_prefill_tokens_computed",
            "Prompt tokens whose KV was computed, by stage (prefill: the shared base; decode: the decoder itself)",
            ["stage", "module"], registry=r)
        self.prefill_saved = Counter(
            "prefillshare_prefill_tokens_saved",
            "Prompt tokens not computed, by stage (prefill: prefix-cache hits; decode: KV loaded from the pool)",
            ["stage", "module"], registry=r)
        self.pool_lookup = Counter("prefillshare_kv_pool_lookup_tokens",
                                   "Prompt tokens decoders looked up in the KV pool", ["model"], registry=r)
        self.pool_hit = Counter("prefillshare_kv_pool_hit_tokens",
                                "Looked-up tokens found in the KV pool", ["model"], registry=r)
        self.pool_hit_ratio = Gauge("prefillshare_kv_pool_hit_ratio",
                                    "kv_pool_hit_tokens / kv_pool_lookup_tokens over the app's life",
                                    registry=r)
        self.bytes_moved = Counter("prefillshare_kv_bytes_moved",
                                   "Bytes of KV decoders loaded from the pool", ["model"], registry=r)
        self.fallbacks = Counter("prefillshare_fallbacks", "Fallbacks by reason", ["reason"], registry=r)
        self.overloaded = Counter(
            "prefillshare_overloaded_requests",
            "Requests answered 429 by where the app shed them (ingress admission, a Serve queue, an engine queue)",
            ["stage"], registry=r)
        for stage in ("ingress", "serve_queue", "engine_queue"):  # zero until the first 429: charts show 0
            self.overloaded.labels(stage)
        self.agent_runs = Counter("prefillshare_agent_runs", "Agent runs (/v1/agents/run) the Orchestrator started "
                                  "(completions never reach it: the Router runs their path)", registry=r)
        self.timed_out = Counter(
            "prefillshare_timed_out_requests",
            "Admitted requests answered with the typed error `timeout` (504, or in-band once streaming) because "
            "they outlived limits.request_timeout_s", ["route"], registry=r)
        for route in ("completions", "chat", "agents"):
            self.timed_out.labels(route)
        self.router_failovers = Counter(
            "prefillshare_router_failovers",
            "Requests a project request router failed on (by exception type) and left to Serve's default choice",
            ["deployment", "error"], registry=r)
        self.admission_limit = Gauge(
            "prefillshare_admission_limit", "Generation requests a Router replica admits at once now "
            "(limits.max_inflight_requests, or less while limits.admission_target_s is missed)", ["replica"],
            registry=r)
        self.queue = Gauge("prefillshare_queue_length", "Requests in flight in a replica",
                           ["deployment", "replica"], registry=r)
        self.replicas = Gauge("prefillshare_deployment_replicas", "Replicas of an engine deployment running now, as "
                              "Serve's controller reports them", ["deployment"], registry=r)
        self.target_replicas = Gauge(
            "prefillshare_deployment_target_replicas", "The replicas Serve's autoscaler wants for an engine deployment "
            "now (its num_replicas when not autoscaled)", ["deployment"], registry=r)
        self.autoscaling_signal = Gauge(
            "prefillshare_autoscaling_signal", "What an engine replica last reported to Serve's autoscaler "
            "(app/engine_load.py SIGNALS: the engine-load policy's inputs)", ["deployment", "replica", "signal"],
            registry=r)
        self.prefill_seconds = Histogram("prefillshare_prefill_seconds", "Prefill call latency per module",
                                         ["module"], buckets=_LATENCY_BUCKETS, registry=r)
        self._register_sharing(r)
        self._module_tokens: dict[str, list[int]] = {}  # module -> [handed over, computed]
        # the hand-over mode's counter of its decode replicas' events (Handover.decode_events)
        spec = handover.decode_events if handover is not None else None
        self.decode_events = Counter(spec.name, spec.help, ["module", "event"], registry=r) if spec else None
        self._lookup_total = 0
        self._hit_total = 0

    def _register_sharing(self, r: CollectorRegistry) -> None:
        """The sharing factor: prompt tokens the decoders needed / prompt tokens the base computed
        (N for a fan-out to N agents whose prompts share all but their last tokens, 1 with nothing shared)."""
        self.handed_over = Counter(
            "prefillshare_prefill_handed_over_tokens",
            "Prompt tokens whose KV a prefill module handed to decoders, summed over the decoders", ["module"],
            registry=r)
        self.sharing_factor = Gauge(
            "prefillshare_prefill_sharing_factor",
            "handed_over_tokens / tokens the module computed, over the app's life (1: nothing shared)", ["module"],
            registry=r)
        self.call_sharing = Histogram(
            "prefillshare_prefill_call_sharing_factor",
            "Per prefill call (one agent-run round or one completion): tokens handed over / tokens computed",
            ["module"], buckets=(1, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)

    def request(self, rec: RequestRecord) -> None:
        self.requests.labels(rec.model, rec.route, "ok" if rec.ok else "error").inc()
        if not rec.ok:
            return
        if rec.ttft_s is not None:
            self.ttft.labels(rec.model, rec.agent).observe(rec.ttft_s)
        self.e2e.labels(rec.model, rec.agent).observe(rec.e2e_s)
        self.tokens_in.labels(rec.model).inc(rec.prompt_tokens)
        self.tokens_out.labels(rec.model).inc(rec.generated_tokens)
        loaded = min(rec.shared_tokens_loaded, rec.prompt_tokens)
        self.prefill_computed.labels("decode", rec.model).inc(rec.prompt_tokens - loaded)
        self.prefill_saved.labels("decode", rec.model).inc(loaded)
        if rec.shared_tokens_expected > 0:
            hit = min(loaded, rec.shared_tokens_expected)
            self.pool_lookup.labels(rec.model).inc(rec.shared_tokens_expected)
            self.pool_hit.labels(rec.model).inc(hit)
            self.bytes_moved.labels(rec.model).inc(hit * rec.kv_bytes_per_token)
            self._lookup_total += rec.shared_tokens_expected
            self._hit_total += hit
            self.pool_hit_ratio.set(self._hit_total / self._lookup_total)

    def router_failover(self, deployment: str, error: str) -> None:
        self.router_failovers.labels(deployment, error).inc()

    def autoscaling_signals(self, deployment: str, replica: str, stats: dict[str, float]) -> None:
        """A replica's latest report; a latency it did not report this time (no request made one) reads 0."""
        for signal in SIGNALS:
            self.autoscaling_signal.labels(deployment, replica, signal).set(float(stats.get(signal, 0.0)))

    def prefill(self, rec: PrefillRecord) -> None:
        self.prefill_computed.labels("prefill", rec.prefill_module).inc(rec.computed_tokens)
        self.prefill_saved.labels("prefill", rec.prefill_module).inc(rec.cached_tokens)
        self.prefill_seconds.labels(rec.prefill_module).observe(rec.seconds)
        if rec.handed_over_tokens > 0:
            self.handed_over.labels(rec.prefill_module).inc(rec.handed_over_tokens)
            self.call_sharing.labels(rec.prefill_module).observe(rec.handed_over_tokens / max(1, rec.computed_tokens))
            totals = self._module_tokens.setdefault(rec.prefill_module, [0, 0])
            totals[0] += rec.handed_over_tokens
            totals[1] += rec.computed_tokens
            self.sharing_factor.labels(rec.prefill_module).set(totals[0] / max(1, totals[1]))

    def handover_events(self, module: str, increments: dict[str, float]) -> None:
        if self.decode_events is None:
            raise ValueError("this app's hand-over mode counts no decode events")
        for event, n in increments.items():
            if n > 0:
                self.decode_events.labels(module, re.sub(r"[^a-zA-Z0-9_:]", "_", event)).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


SEND_EVERY_S = 0.5  # how stale a scrape can be; events arrive in order, gauges carry their last value


class MetricsSender:
    """A replica's events for the Metrics deployment, sent in one call every ``SEND_EVERY_S``.

    Why: a Serve call costs the sender and the Metrics replica a few ms of CPU each, and a
    completion made six (queue gauges as it entered and left two replicas, its prefill record,
    its request record). On 2 cores that sat in the first-token path (docs/benchmarks.md
    "First token of a follow-on completion"). A gauge keeps only its last value per key.
    """

    def __init__(self, handle, every_s: float = SEND_EVERY_S):
        self.handle, self.every_s = handle, every_s
        self._events: list[tuple[str, tuple]] = []
        self._gauges: dict[tuple, tuple[str, tuple]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def send(self, method: str, *args) -> None:
        self._events.append((method, args))
        self._soon()

    def gauge(self, method: str, *args) -> None:
        """``args[:-1]`` name the series, ``args[-1]`` is its value: only the last one is sent."""
        self._gauges[(method, *args[:-1])] = (method, args)
        self._soon()

    def _soon(self) -> None:
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on an event loop: nothing to wait on, send now
            self.flush()
            return
        self._timer = loop.call_later(self.every_s, self.flush)

    def flush(self) -> None:
        self._timer = None
        events = self._events + list(self._gauges.values())
        self._events, self._gauges = [], {}
        if events:
            try:
                self.handle.batch.remote(events)
            except Exception as e:  # noqa: BLE001 - metrics are best effort: no request fails on them
                log.warning("metrics: %d events dropped (%s: %s)", len(events), type(e).__name__, e)


@serve.deployment(name="Metrics", max_ongoing_requests=1000)
class MetricsServer:
    """Holds the app's registry; other deployments send it events."""

    def __init__(self, handover: Handover | None = None) -> None:
        self.m = AppMetrics(handover, socket.gethostname())

    def request(self, rec: RequestRecord) -> None:
        self.m.request(rec)

    def prefill(self, rec: PrefillRecord) -> None:
        self.m.prefill(rec)

    def fallback(self, reason: str, n: int = 1) -> None:
        self.m.fallbacks.labels(reason).inc(n)

    def router_failover(self, deployment: str, error: str) -> None:
        self.m.router_failover(deployment, error)

    def handover_events(self, module: str, increments: dict[str, float]) -> None:
        self.m.handover_events(module, increments)

    def agent_run(self) -> None:
        self.m.agent_runs.inc()

    def overloaded(self, stage: str) -> None:
        self.m.overloaded.labels(stage).inc()

    def timeout(self, route: str) -> None:
        self.m.timed_out.labels(route).inc()

    def admission(self, replica: str, limit: int) -> None:
        self.m.admission_limit.labels(replica).set(limit)

    def queue(self, deployment: str, replica: str, n: int) -> None:
        self.m.queue.labels(deployment, replica).set(n)

    def fleet(self, deployment: str, counts: tuple[int, int]) -> None:
        running, target = counts
        self.m.replicas.labels(deployment).set(running)
        self.m.target_replicas.labels(deployment).set(target)

    def autoscaling_signals(self, deployment: str, replica: str, stats: dict[str, float]) -> None:
        self.m.autoscaling_signals(deployment, replica, stats)

    def engine(self, deployment: str, replica: str, families: list[Family]) -> None:
        self.m.engines.update((deployment, replica), families)

    def node_state(self, host: str, source: str, families: list[Family]) -> None:
        if self.m.nodes is not None:
            self.m.nodes.update((host, source), families)

    def render(self) -> bytes:
        return self.m.render()

    def batch(self, events: list[tuple[str, tuple]]) -> None:
        """A :class:`MetricsSender`'s events, in the order they were sent."""
        for method, args in events:
            if method not in _EVENTS:
                raise ValueError(f"metrics event {method!r} is not one of {sorted(_EVENTS)}")
            getattr(self, method)(*args)


_EVENTS = frozenset({"request", "prefill", "fallback", "router_failover", "handover_events", "agent_run", "overloaded", "timeout",
                     "queue", "engine", "admission", "node_state", "fleet", "autoscaling_signals"})
