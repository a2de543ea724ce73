"""The vllm-nixl hand-over: configs, lease rules (fast), and real engines over vLLM's NixlConnector.

The engine test (marked ``engine``) runs the shipped base as the NIXL producer and the shipped
lookup decoder as its consumer, each engine in its own process, ``kv_buffer_device: cpu``: a lease
that ran out must be answered with the private reference's tokens and counted, on our side and by
vLLM (its own ``num_kv_expired_reqs``, here with vLLM's shortest lease, 6 s). Shared-KV tokens of
decoders with other weights and a LoRA group through the NixlConnector: tests/test_serve_vllm_nixl.py.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from bench.nixl_probe import decode, lend
from prefillshare.app.engine.nixl import leases as ho
from prefillshare.app.engine.nixl.config import (
    CPU_SETTINGS,
    GPU_SETTINGS,
    NixlSettings,
    lease_for_timeout,
    nixl_transfer_config,
    settings_for,
    side_channel_env,
)
from prefillshare.app.engine.nixl.handover import NixlHandover
from prefillshare.app.sampling import Sampling

BASE = "checkpoints/base"
DECODER = "checkpoints/decoders/lookup"


# ---------------------------------------------------------------- configs (fast)

def test_producer_and_consumer_configs():
    p = nixl_transfer_config("producer", lease_s=40)
    c = nixl_transfer_config("consumer", lease_s=40, settings=NixlSettings(num_threads=0))
    assert (p["kv_connector"], p["kv_role"], p["kv_buffer_device"]) == ("NixlConnector", "kv_producer", "cpu")
    assert c["kv_role"] == "kv_consumer"
    for cfg in (p, c):
        extra = cfg["kv_connector_extra_config"]
        assert extra["enforce_handshake_compat"] is False and extra["kv_lease_duration"] == 40
        assert cfg["kv_load_failure_policy"] == "recompute"
    assert c["kv_connector_extra_config"]["num_threads"] == 0
    # vLLM's connector class with the project's side-channel guard, whatever the settings
    assert c["kv_connector_module_path"] == "prefillshare.app.engine.nixl.connector"
    polled = nixl_transfer_config("consumer", lease_s=40, settings=CPU_SETTINGS)
    assert polled["kv_connector_module_path"] == "prefillshare.app.engine.nixl.connector"
    assert polled["kv_connector_extra_config"]["progress_thread"] is False
    assert nixl_transfer_config("both", lease_s=6)["kv_role"] == "kv_both"
    from vllm.config import KVTransferConfig

    KVTransferConfig(**p)  # vLLM accepts it as is
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**polled))
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

    assert issubclass(cls, NixlConnector) and cls.__name__ == "NixlConnector"


@pytest.mark.parametrize("bad", [dict(role="decoder", lease_s=30), dict(role="producer", lease_s=0),
                                 dict(role="producer", lease_s=2.5)])
def test_config_rejects(bad):
    role = bad.pop("role")
    with pytest.raises(ValueError):
        nixl_transfer_config(role, **bad)


def test_lease_outlives_the_request_timeout():
    assert lease_for_timeout(60) >= 60 and isinstance(lease_for_timeout(60), int)
    assert lease_for_timeout(0.5) == 6  # vLLM renews at lease // 6: at least one second
    with pytest.raises(ValueError):
        lease_for_timeout(0)


def test_side_channel_env_and_ucx_settings_in_the_connector_config():
    env = side_channel_env(5601)
    assert env == {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}
    assert CPU_SETTINGS.extra_config()["backends"] == ["UCX"]
    tcp = nixl_transfer_config("consumer", lease_s=40, settings=NixlSettings(ucx_env={"UCX_TLS": "tcp,self"}))
    assert tcp["kv_connector_extra_config"]["ucx_env"] == {"UCX_TLS": "tcp,self"}


def test_a_gpu_engine_reads_over_cuda_ipc_and_a_cpu_engine_keeps_ucxs_defaults():
    """GPU engines (kv_buffer_device cuda) get GPU_SETTINGS unless told otherwise: CUDA IPC reads on
    (UCX turns them off without NVLink and a pull then crosses TCP), NIXL's progress thread off."""
    gpu = nixl_transfer_config("producer", lease_s=40, kv_buffer_device="cuda")
    extra = gpu["kv_connector_extra_config"]
    assert gpu["kv_buffer_device"] == "cuda"
    assert extra["ucx_env"] == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"} and extra["progress_thread"] is False
    assert settings_for("cuda") is GPU_SETTINGS and settings_for("cpu") is CPU_SETTINGS
    assert nixl_transfer_config("consumer", lease_s=40)["kv_connector_extra_config"]["ucx_env"] == {}
    with pytest.raises(ValueError):
        settings_for("tpu")
    from vllm.config import KVTransferConfig

    KVTransferConfig(**gpu)  # vLLM accepts the extra keys


def test_the_connector_sets_its_ucx_variables_unless_the_operator_did(monkeypatch):
    from prefillshare.app.engine.nixl.connector import apply_ucx_env

    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    monkeypatch.setenv("UCX_TLS", "rc,cuda_ipc,cuda_copy,tcp")
    now = apply_ucx_env({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "UCX_TLS": "tcp,self"})
    assert now == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "UCX_TLS": "rc,cuda_ipc,cuda_copy,tcp"}
    a, b = side_channel_env()["VLLM_NIXL_SIDE_CHANNEL_PORT"], side_channel_env()["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert int(a) > 0 and int(b) > 0


def test_a_listener_port_is_never_one_an_outgoing_connection_can_take(monkeypatch):
    """Ports come from below the kernel's ephemeral range (where outgoing connections take their
    local ports, and where bind-to-0 picks from) and above Ray's worker ports; a taken one is skipped."""
    import random
    import socket

    from prefillshare.app.engine.nixl import config as vllm_nixl

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = {vllm_nixl.listen_port("127.0.0.1") for _ in range(50)}
    assert all(20000 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 40  # random picks, not one port for every replica
    held = socket.socket()
    for taken in range(20000, low - 1):  # hold one port of the range, as another replica would
        try:
            held.bind(("127.0.0.1", taken))
            break
        except OSError:
            continue
    held.listen()
    try:
        picks = iter([taken, taken, *range(taken + 1, taken + 40)])
        monkeypatch.setattr(random, "randint", lambda a, b: next(picks))
        assert vllm_nixl.listen_port("127.0.0.1") > taken  # the held one was tried twice and skipped
    finally:
        held.close()


# ---------------------------------------------------------------- lease rules with fake engines

@dataclass
class _Out:
    token_ids: list
    num_cached_tokens: int
    num_prompt_tokens: int = 0


@dataclass
class _Prefill:
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    kv_transfer_params: dict


class _FakeEngines:
    """Records calls; a prefill engine with a prefix cache, a decoder that loads what it is given."""

    def __init__(self):
        self.calls = []
        self.seen = set()

    async def prefill(self, ids, request_id=None, cache_salt=None, kv_transfer_params=None, lora=None):
        self.calls.append(("prefill-start", time.monotonic()))
        await asyncio.sleep(0.01)
        key = (tuple(ids), cache_salt)
        computed = 1 if key in self.seen else len(ids)
        self.seen.add(key)
        self.calls.append(("prefill-end", time.monotonic()))
        return _Prefill(request_id or "r", len(ids), computed,
                        {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "p",
                         "remote_prefill_cached_tokens": len(ids) - computed})

    async def complete(self, ids, sampling, request_id=None, cache_salt=None, kv_transfer_params=None, lora=None):
        self.calls.append(("complete", kv_transfer_params))
        loaded = len(ids) - 1 if kv_transfer_params else 0
        return _Out([7], loaded, len(ids))


def test_first_prefill_runs_before_the_others_which_hit_the_prefix_cache():
    eng = _FakeEngines()
    leases = asyncio.run(lend(NixlHandover(30), eng, list(range(100)), 3, cache_salt="t"))
    starts = [t for k, t in eng.calls if k == "prefill-start"]
    first_end = next(t for k, t in eng.calls if k == "prefill-end")
    assert len(leases) == 3 and all(s >= first_end for s in starts[1:])
    assert [le.computed_tokens for le in leases] == [100, 1, 1]


def test_decode_pulls_inside_the_lease_and_reports_its_own_cached_tokens():
    eng, handover = _FakeEngines(), NixlHandover(30)
    side = handover.decode_side()
    ids = list(range(50))
    (lease,) = asyncio.run(lend(handover, eng, ids, 1))
    out = asyncio.run(decode(side, eng, ids, Sampling(max_tokens=1), lease))
    sent = eng.calls[-1][1]
    assert sent["do_remote_prefill"] and "remote_prefill_cached_tokens" not in sent
    assert "remote_prefill_cached_tokens" in lease.params  # the lease itself is left as the producer sent it
    assert out.num_cached_tokens == 49 and side.counters.pulls == 1 and side.counters.pulled_tokens == 49


def test_decode_prefills_privately_when_the_lease_may_run_out():
    eng, side = _FakeEngines(), NixlHandover(30).decode_side()
    ids = list(range(50))
    lease = ho.Lease({"do_remote_prefill": True, "remote_block_ids": [[1]]}, time.time() + side.margin_s - 2,
                     50, 50, "r")
    asyncio.run(decode(side, eng, ids, Sampling(max_tokens=1), lease))
    assert eng.calls[-1] == ("complete", None)
    asyncio.run(decode(side, eng, ids, Sampling(max_tokens=1), None))  # no prefill behind it: not counted
    lease = ho.Lease({"do_remote_prefill": True}, time.time() + 60, 50, 50, "r")  # no blocks kept
    asyncio.run(decode(side, eng, ids, Sampling(max_tokens=1), lease))
    assert eng.calls[-1] == ("complete", None)
    assert side.counters.as_dict()["fallback:lease_expiring"] == 1
    assert side.counters.as_dict()["fallback:no_lease"] == 1 and side.counters.pulls == 0


def test_margin_covers_vllms_heartbeat_interval():
    assert ho.default_margin(185) == 2 * (185 // 6) + 1
    assert ho.default_margin(6) == 3.0  # never more than half the lease


# ---------------------------------------------------------------- real engines


def _start(specs: dict):
    from bench.nixl_probe import start_engines

    return start_engines(specs)


def _prompts(n: int, lengths=(90, 257, 410)):
    import random

    rng = random.Random(7)
    return [[rng.randrange(3, 640) for _ in range(L)] for L in lengths[:n]]


@pytest.mark.engine
def test_nixl_lease_that_ran_out_is_answered_privately_and_counted():
    from prefillshare.app.engine.async_engine import EngineConfig
    from prefillshare.app.models.checkpoint import load_decoder
    from prefillshare.app.reference import private_greedy

    lease = 6  # the smallest lease vLLM renews (every lease // 6 = 1 s)
    common = dict(dtype="float32", kv_cache_memory_bytes=268435456, max_model_len=1024, block_size=32, request_timeout_s=60)
    engines = _start({
        "producer": (EngineConfig(model=BASE, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, enable_prefix_caching=True,
                                  kv_transfer_config=nixl_transfer_config("producer", lease_s=lease), **common),
                     side_channel_env()),
        "dec": (EngineConfig(model=DECODER, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "1"}, enable_prefix_caching=False,
                             kv_transfer_config=nixl_transfer_config("consumer", lease_s=lease), **common),
                side_channel_env()),
    })
    (ids,) = _prompts(1, (300,))
    handover = NixlHandover(lease)
    side = handover.decode_side()
    counters = side.counters
    try:
        async def late():
            (le,) = await lend(handover, engines["producer"], ids, 1)
            await asyncio.sleep(lease + 2)  # a decoder queue longer than the lease
            out = await decode(side, engines["dec"], ids, Sampling(max_tokens=12), le)
            expired = 0.0
            for _ in range(20):  # stats reach the producer's stat logger with its next outputs
                await engines["producer"].complete(ids[:8], Sampling(max_tokens=1))
                expired = (await engines["producer"].metrics())["num_kv_expired_reqs"]
                if expired:
                    break
                await asyncio.sleep(0.5)
            return out, expired

        out, expired = asyncio.run(late())
    finally:
        for e in engines.values():
            e.stop()
    dec = load_decoder(DECODER, BASE)
    assert out.num_cached_tokens == 0
    assert out.token_ids == private_greedy(dec, ids, 12, eos_token_id=dec.config.eos_token_id)
    assert counters.as_dict()["fallback:lease_expiring"] == 1 and counters.pulls == 0
    assert expired >= 1  # vLLM counted the lease it reclaimed


def test_handover_mode_is_one_config_field():
    from prefillshare.app.config import AppConfig

    cfg = {"decoders": [{"name": "lookup", "model": DECODER}], "prefill_modules": []}
    assert AppConfig.model_validate(cfg).handover == "pool"
    assert AppConfig.model_validate({**cfg, "handover": "vllm-nixl"}).handover == "vllm-nixl"
    with pytest.raises(ValueError):
        AppConfig.model_validate({**cfg, "handover": "nixl"})


def test_expiry_counters_reach_the_apps_metrics():
    from prometheus_client import CollectorRegistry, Counter

    from prefillshare.deployments.metrics import AppMetrics

    engine_registry = CollectorRegistry()  # what vLLM's stat logger registers in an engine's process
    expired = Counter("vllm:nixl_num_kv_expired_reqs", "expired", registry=engine_registry)
    deltas, app = ho.CounterDeltas(), AppMetrics(NixlHandover(30))  # the mode declares its counter
    expired.inc(2)
    app.handover_events("base", deltas(ho.read_vllm_nixl_counters(engine_registry)))
    expired.inc(1)
    app.handover_events("base", deltas(ho.read_vllm_nixl_counters(engine_registry)))
    app.handover_events("base", deltas(ho.read_vllm_nixl_counters(engine_registry)))  # nothing new
    text = app.render().decode()
    assert 'prefillshare_vllm_nixl_events_total{event="num_kv_expired_reqs",module="base"} 3.0' in text
