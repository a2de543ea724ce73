"""Hand-over "vllm-nixl" in the app, without a cluster: which engine gets which connector config,
the leases in the fan-out's decoder requests, and the replica's lease check (no Ray, no vLLM
engine; the Serve path runs in tests/test_serve_vllm_nixl.py)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from prefillshare.app.config import load_config
from prefillshare.app.engine.handover import HandOff
from prefillshare.app.engine.nixl import leases as ho
from prefillshare.app.engine.nixl.config import lease_for_timeout
from prefillshare.app.engine.nixl.handover import NixlHandover
from prefillshare.app.engine.pool.handover import PoolHandover
from prefillshare.app.prompt_split import shared_length
from prefillshare.deployments.messages import PrefillTicket
from prefillshare.deployments.path.fanout import FanOut

ROOT = Path(__file__).resolve().parent.parent


def _engine_configs(handover: str, gpus: bool = False, **update):
    """({"prefill:<module>" / "decode:<served name>": its EngineConfig}, the AppConfig) of the shipped
    app bound in ``handover`` mode (``gpus``: every engine placed on one GPU, as the GPU variant does)."""
    from prefillshare.deployments.application import build

    cfg = load_config(ROOT / "serve_config.yaml")
    cfg = cfg.model_copy(update={"handover": handover, **update})
    if gpus:
        def on_gpu(item):
            pl = item.placement.model_copy(update={"num_gpus": 1, "placement_group_bundles": None})
            return item.model_copy(update={"placement": pl})

        cfg = cfg.model_copy(update={"prefill_modules": [on_gpu(p) for p in cfg.prefill_modules],
                                     "decoders": [on_gpu(d) for d in cfg.decoders]})
    router = build(cfg)._bound_deployment
    prefill, decoders = router.init_args[2], router.init_args[3]
    out = {f"prefill:{k}": a._bound_deployment.init_args[1] for k, a in prefill.items()}
    # an in-engine LoRA decoder streams from its prefill module's deployment: that engine is the producer
    in_engine = {k for k, a in decoders.items() if any(a is p for p in prefill.values())}
    assert in_engine == {a.name for p in cfg.prefill_modules for a in p.lora_decoders}
    out.update({f"decode:{k}": a._bound_deployment.init_args[1] for k, a in decoders.items() if k not in in_engine})
    # every engine replica is given the plan's one hand-over
    handovers = {a._bound_deployment.init_args[2] for a in [*prefill.values(), *decoders.values()]}
    assert len(handovers) == 1, handovers
    return out, cfg, handovers.pop()


def _lease_s(ktc: dict) -> int:
    return ktc["kv_connector_extra_config"]["kv_lease_duration"]


def test_vllm_nixl_mode_gives_producers_and_consumers_nixl_configs_tied_to_the_timeout():
    configs, cfg, handover = _engine_configs("vllm-nixl")
    lease = lease_for_timeout(cfg.limits.request_timeout_s)
    assert handover == NixlHandover(lease)
    assert any(k.startswith("prefill:") for k in configs) and any(k.startswith("decode:") for k in configs)
    for name, ec in configs.items():
        ktc = ec.kv_transfer_config
        assert ktc["kv_connector"] == "NixlConnector", name
        assert ktc["kv_role"] == ("kv_producer" if name.startswith("prefill:") else "kv_consumer"), name
        assert _lease_s(ktc) == lease
        assert ec.prefix_caching is name.startswith("prefill:"), name  # decoders: off, explicitly
        assert ktc["kv_buffer_device"] == "cpu"  # the shipped config has no GPUs


def test_gpu_engines_of_the_app_pull_over_cuda_ipc():
    """The app's GPU engines carry the CUDA IPC read setting in their connector config (their
    NixlConnector sets it before NIXL creates its UCX context); its CPU engines do not."""
    configs, _, _ = _engine_configs("vllm-nixl", gpus=True)
    for name, ec in configs.items():
        ktc = ec.kv_transfer_config
        assert ktc["kv_buffer_device"] == "cuda", name
        assert ktc["kv_connector_extra_config"]["ucx_env"] == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}, name
        assert ktc["kv_connector_extra_config"]["progress_thread"] is False, name
    cpu, _, _ = _engine_configs("vllm-nixl")
    assert all(ec.kv_transfer_config["kv_connector_extra_config"]["ucx_env"] == {} for ec in cpu.values())


def test_kv_lease_duration_sets_every_engines_lease():
    """kv_lease_duration (the GPU variant's 60 s) replaces the lease tied to the request timeout on
    producers and consumers alike (a Decode replica's lease margin follows its own config)."""
    configs, _, handover = _engine_configs("vllm-nixl", gpus=True, kv_lease_duration=60)
    assert {_lease_s(ec.kv_transfer_config) for ec in configs.values()} == {60}
    assert handover.lease_s == 60 and handover.decode_side().margin_s == ho.default_margin(60)


def test_pool_mode_engines_keep_the_projects_connector():
    configs, cfg, handover = _engine_configs("pool")
    assert isinstance(handover, PoolHandover) and handover.node_state().source == cfg.pool.path
    for name, ec in configs.items():
        assert ec.kv_transfer_config["kv_connector"] == "PrefillShareConnector", name
        assert "kv_lease_duration" not in ec.kv_transfer_config["kv_connector_extra_config"]
        assert ec.prefix_caching is name.startswith("prefill:"), name
        assert handover.on_node(ec, "10.0.0.7") is ec  # nothing to listen for
    assert handover.prefill_params() == {"fanout": 1} and handover.handoffs([object()], 0.0) == ()
    assert handover.decode_side().pull(None) is None  # the consumer's connector finds the KV itself


def test_each_engine_started_in_vllm_nixl_mode_gets_its_own_handshake_port():
    configs, _, handover = _engine_configs("vllm-nixl")
    ec = next(iter(configs.values()))
    a, b = handover.on_node(ec, "127.0.0.1"), handover.on_node(ec, "127.0.0.1")
    assert a.extra_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert a.extra_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != b.extra_env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert {k: v for k, v in a.extra_env.items() if not k.startswith("VLLM_NIXL_")} == ec.extra_env


def _lease(i: int, expires_at: float) -> ho.Lease:
    return ho.Lease({"do_remote_prefill": True, "remote_block_ids": [i], "remote_prefill_cached_tokens": 5},
                    expires_at, 10, 10, f"p{i}")


class _LeasingEngines:
    """A prefill module that answers with one lease per prompt (what PrefillServer does in vllm-nixl)."""

    def __init__(self):
        self.decodes = []

    async def prefill(self, module, req, wait_s):
        leases = tuple(_lease(i, time.time() + 60) for i in range(len(req.prompts)))
        return PrefillTicket(module, "replica-1", num_computed_tokens=11, node_id="node-a",
                             handoffs=leases)

    def decoder_down(self, model):
        return False  # every decoder has a replica up

    def decoder_cold(self, model):
        return False

    def fallback(self, reason):
        raise AssertionError(f"no fallback expected, got {reason}")


def test_a_fan_out_gives_each_decoder_its_own_lease():
    from test_fanout import PLAN, _leg

    shared = list(range(10, 22))
    legs = [_leg("alpha", shared + [1, 2], "d-a"), _leg("ad0", shared + [3], "d-b")]
    plans = asyncio.run(FanOut(PLAN, _LeasingEngines()).prepare(legs, "run", "agents", "salt"))
    assert [p.request.handoff.params["remote_block_ids"] for p in plans] == [[0], [1]]
    assert all(p.request.cache_salt == "salt" for p in plans)


def test_the_replicas_lease_check_pulls_or_counts_the_fallback():
    counters = ho.HandoverCounters()
    params, reason = ho.pull_params(_lease(0, time.time() + 60), margin_s=3)
    assert reason is None and params["remote_block_ids"] == [0]
    assert "remote_prefill_cached_tokens" not in params  # the decoder reports its own pull
    assert ho.count_decode(counters, reason, 10, 9) == "pull"
    assert ho.pull_params(_lease(0, time.time() + 1), margin_s=3) == (None, "lease_expiring")
    assert ho.count_decode(counters, "lease_expiring", 10, 0) == "fallback:lease_expiring"
    assert ho.count_decode(counters, None, 10, 0) == "fallback:pull_incomplete"  # vLLM recomputed
    assert counters.as_dict()["pulls"] == 1 and counters.as_dict()["fallback:pull_incomplete"] == 1


def test_the_nixl_hand_over_lends_each_prompt_and_its_decode_side_keeps_the_lease_rule():
    """What the Prefill and Decode replicas ask the plan's NixlHandover: a lease per prompt (none
    for a one-token prompt), then per decoder request a pull or a counted private prefill."""
    from types import SimpleNamespace as NS

    from prefillshare.app.engine.handover import Pull

    handover = NixlHandover(30)
    assert handover.prefill_params() == {"do_remote_decode": True} and handover.node_state() is None
    assert handover.decode_events.name == "prefillshare_vllm_nixl_events"
    done = NS(kv_transfer_params={"remote_block_ids": [4]}, num_prompt_tokens=9, num_computed_tokens=9,
              request_id="r-0")
    lease, nothing = handover.handoffs([done, None], sent=1000.0)
    assert lease.expires_at == 1030.0 and lease.params == {"remote_block_ids": [4]} and nothing is None
    side = handover.decode_side()
    assert side.pull(None) is None  # no prefill behind the request: nothing to pass or count
    with pytest.raises(TypeError, match="not a Lease"):  # another mode's hand-off is refused, not misread
        side.pull(HandOff())
    pull = side.pull(_lease(0, time.time() + 60))
    assert pull.reason is None and pull.params["remote_block_ids"] == [0]
    late = side.pull(_lease(1, time.time() + side.margin_s - 1))
    assert late == Pull(None, "lease_expiring")
    # vLLM counts the pulled last prompt token as cached; the base's part is L-1. A private prefill
    # (a fallback) reports the engine's own count: its prefix-cache hits
    assert side.cached_tokens(pull, 10, 10) == 9 == shared_length(10) and side.cached_tokens(pull, 10, 4) == 4
    assert side.cached_tokens(late, 10, 10) == 10
    assert PoolHandover("/dev/shm/x").decode_side().cached_tokens(pull, 10, 9) == 9
    assert side.finished(pull, 10, 9)["pull"] == 1
    assert side.finished(late, 10, 0)["fallback:lease_expiring"] == 1
    assert side.counters.pulls == 1 and side.counters.fallbacks["lease_expiring"] == 1
