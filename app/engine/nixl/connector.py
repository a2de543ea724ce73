"""vLLM's NixlConnector, its side channel guarded by the KV secret, its progress thread optional.

Guard (always): :func:`prefillshare.app.engine.nixl.side_channel_auth.install` before vLLM opens its handshake
listener: CURVE with keys derived from ``PREFILLSHARE_KV_SECRET`` when the secret is set; without
one, an engine whose side channel is not on loopback refuses to start.

Progress thread (``progress_thread: false``):
vLLM creates its NIXL agent with the progress thread on and no delay between polls
(``nixl_agent_config(num_threads=..., capture_telemetry=True)``, ``pthrDelay=0``): that thread
spins whenever the agent exists. Measured here (docs/engine.md, "vLLM NixlConnector hand-over on
the CPU"): an idle agent burns about one core with it, nothing without it. A connector engine does
not need it: the connector already drives UCX from its own calls every engine step (it polls
transfer states and notifications in ``get_finished``), and a prefill engine keeps stepping while
it holds blocks for a decoder (vLLM counts those requests as unfinished work).

Refusals on /metrics: the side channel's listener runs in the scheduler half, whose stats vLLM
merges into the worker half's each engine step (``Scheduler.update_from_output``).
:class:`GuardedNixlStats` is vLLM's NIXL stats plus ``num_refused_handshakes``, used by both halves
(so that the merge knows the key), and :class:`GuardedNixlPromMetrics` adds the counter
``prefillshare_nixl_refused_handshakes`` beside vLLM's NIXL metrics in the engine's frontend (the
replica, which pushes it to the Metrics deployment with its ``vllm:*`` families). A refusal is
counted on the engine's next step.

Transport (``kv_connector_extra_config.ucx_env``): UCX variables set in the worker process before
NIXL creates its UCX context (CUDA IPC reads on GPUs: :data:`prefillshare.app.engine.nixl.config.GPU_SETTINGS`);
the worker half then logs the transport its pulls should take (:mod:`prefillshare.app.engine.nixl.kv_transport`)
and the engine's vLLM.

One vLLM (:mod:`prefillshare.app.engine.nixl.vllm_pairing`): a finished prefill's ``kv_transfer_params`` name the
producer's vLLM, and a consumer of another version refuses them (logged, naming both; the
request is then computed privately, never read from blocks another vLLM laid out).

This class is vLLM's ``NixlConnector`` itself; only its side channel differs, and the agent it
creates when ``kv_connector_extra_config.progress_thread`` is false. It keeps vLLM's class name so that vLLM's
own checks for "NixlConnector" still apply to it; vLLM loads it from this module
(``kv_connector_module_path``).
"""
from __future__ import annotations

import functools
import logging
import os

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector as _VllmNixlConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics

from prefillshare.app.engine.cpu_layout import request_amx_tiles
from prefillshare.app.engine.nixl import kv_transport, side_channel_auth, vllm_pairing

__all__ = ["NixlConnector", "MODULE", "GuardedNixlStats", "GuardedNixlPromMetrics", "REFUSED_KEY"]

MODULE = __name__
REFUSED_KEY = "num_refused_handshakes"
log = logging.getLogger(__name__)
# under vLLM's logger, whose handler prints INFO in the engine's processes (this module's own does not)
engine_log = logging.getLogger(f"vllm.{__name__}")


def apply_ucx_env(ucx_env: dict | None) -> dict[str, str]:
    """Set the connector's UCX variables in this process (before NIXL reads them); one already set
    stays (an operator's override). The variables now in force."""
    for k, v in (ucx_env or {}).items():
        os.environ.setdefault(str(k), str(v))
    return {k: os.environ[k] for k in (ucx_env or {})}


class GuardedNixlStats(NixlKVConnectorStats):
    """vLLM's NIXL transfer stats and the side channel's refused handshakes (a count per report)."""

    def reset(self):
        super().reset()
        self.data[REFUSED_KEY] = []

    def record_refused_handshakes(self, n: int) -> None:
        self.data.setdefault(REFUSED_KEY, []).append(n)

    def is_empty(self) -> bool:
        return super().is_empty() and not self.data.get(REFUSED_KEY)

    def aggregate(self, other):
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict:
        return {**super().reduce(), "Num refused handshakes": sum(self.data.get(REFUSED_KEY, ()))}


class GuardedNixlPromMetrics(NixlPromMetrics):
    """vLLM's NIXL metrics and ``prefillshare_nixl_refused_handshakes`` (per engine, as vLLM labels)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from vllm.v1.metrics.utils import create_metric_per_engine

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls(
            name=side_channel_auth.REFUSED_METRIC, labelnames=labelnames,
            documentation="Peers the NIXL side channel refused: no CURVE handshake with the KV secret's key")
        self.counter_refused_handshakes = create_metric_per_engine(counter, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
        super().observe(transfer_stats_data, engine_idx)
        for n in transfer_stats_data.get(REFUSED_KEY, ()):
            self.counter_refused_handshakes[engine_idx].inc(n)


class NixlConnector(_VllmNixlConnector):
    """vLLM's pull-mode NixlConnector; its side channel behind the KV secret;
    ``progress_thread: false`` makes its NIXL agent without a progress thread."""

    def __init__(self, vllm_config, role, kv_cache_config):
        from vllm import envs

        side_channel_auth.install(envs.VLLM_NIXL_SIDE_CHANNEL_HOST)
        # a decoder's first forward is attention over pulled KV, as with the pool, where that died of
        # SIGILL (cpu_layout); this path's bf16 tests did not die without it here: a guard, not a fix
        request_amx_tiles()
        ktc = vllm_config.kv_transfer_config
        apply_ucx_env(ktc.get_from_extra_config("ucx_env", {}))
        progress_thread = bool(ktc.get_from_extra_config("progress_thread", True))
        make_config = base_worker.nixl_agent_config
        if progress_thread or make_config is None:
            super().__init__(vllm_config, role, kv_cache_config)
        else:
            # the worker half builds its agent config from this module global while it is constructed
            base_worker.nixl_agent_config = functools.partial(make_config, enable_prog_thread=False)
            try:
                super().__init__(vllm_config, role, kv_cache_config)
            finally:
                base_worker.nixl_agent_config = make_config
        worker = self.connector_worker
        if worker is not None:  # its stats take the scheduler half's refusals when vLLM merges them
            if not isinstance(getattr(worker, "xfer_stats", None), NixlKVConnectorStats):
                raise RuntimeError("vLLM's NIXL worker has no xfer_stats (a vLLM upgrade?): cannot report "
                                   "the side channel's refusals")
            worker.xfer_stats = GuardedNixlStats()
            engine_log.info("PrefillShare vllm-nixl engine, vLLM %s: %s", vllm_pairing.vllm_version(),
                            kv_transport.describe(kv_transport.plan(str(ktc.kv_buffer_device))))

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params
        mismatch = vllm_pairing.refusal(params) if params and params.get("do_remote_prefill") else None
        if mismatch is not None:  # never pair with another vLLM: compute the prompt here
            log.error("request %s: %s", request.request_id, mismatch)
            params["do_remote_prefill"] = False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(self, request, block_ids):
        delay, params = super().request_finished(request, block_ids)
        return delay, vllm_pairing.stamp(params)

    def request_finished_all_groups(self, request, block_ids):
        delay, params = super().request_finished_all_groups(request, block_ids)
        return delay, vllm_pairing.stamp(params)

    def get_kv_connector_stats(self):
        stats = super().get_kv_connector_stats()
        if self.connector_worker is None:  # the scheduler half, where the listener runs
            refused = side_channel_auth.REFUSED.take()
            if refused:
                stats = GuardedNixlStats()
                stats.record_refused_handshakes(refused)
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return GuardedNixlStats(data=data) if data is not None else GuardedNixlStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return GuardedNixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
