"""vLLM's own NIXL handshake listener behind the KV secret (prefillshare.app.engine.nixl.side_channel_auth).

The listener is vLLM's (``NixlBaseConnectorScheduler._nixl_handshake_listener``), run in a thread
as the engine runs it, on loopback, with the project's CURVE ``zmq_ctx`` installed where vLLM looks
it up. Peers: the project's CURVE client with the secret (vLLM's handshake request as vLLM's
worker sends it), a plain ZMQ peer, and a CURVE peer with another secret.
"""
from __future__ import annotations

import importlib
import threading
import time

import pytest
import zmq
from side_channel_peer import ask, peer

from prefillshare.app.engine.nixl import kv_auth
from prefillshare.app.engine.nixl import side_channel_auth as sca
from prefillshare.app.engine.nixl.kv_auth import KV_SECRET_ENV, KVAuthError

SECRET = "k" * 32
METADATA = b"agent metadata of rank 0"


@pytest.fixture
def restore_vllm(monkeypatch):
    """install() patches vLLM's modules for the process; the test gets them back as they were."""
    for name in sca.VLLM_HOLDERS:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "zmq_ctx", module.zmq_ctx)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def listener(monkeypatch, restore_vllm):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler

    monkeypatch.setenv(KV_SECRET_ENV, SECRET)
    assert sca.install("127.0.0.1") is True
    port, ready, stop = _free_port(), threading.Event(), threading.Event()
    t = threading.Thread(target=NixlBaseConnectorScheduler._nixl_handshake_listener,
                         args=({(0, 0): METADATA}, ready, stop, "127.0.0.1", port), daemon=True)
    t.start()
    assert ready.wait(10)
    yield port
    stop.set()
    t.join(10)
    assert not t.is_alive()


def _refused_after(before: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while sca.REFUSED.count == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return sca.REFUSED.count - before


def test_a_peer_with_the_secret_gets_the_metadata_over_curve(listener):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    before = sca.REFUSED.count
    with base_worker.zmq_ctx(zmq.REQ, f"tcp://127.0.0.1:{listener}") as sock:  # what vLLM's handshake opens
        assert sock.mechanism == zmq.CURVE
        assert ask(sock, 1500) == METADATA
    assert sca.REFUSED.count == before


def test_a_plain_zmq_peer_gets_nothing_and_is_counted_and_logged(listener, caplog):
    before = sca.REFUSED.count
    with peer(f"tcp://127.0.0.1:{listener}") as sock, caplog.at_level("WARNING", logger=sca.__name__):
        assert ask(sock, 1500) is None
        assert _refused_after(before) >= 1
    assert "refused a peer" in caplog.text


def test_a_curve_peer_with_another_secret_gets_nothing_and_is_counted(listener):
    before = sca.REFUSED.count
    with sca.curve_zmq_ctx(sca.curve_keys(b"o" * 32))(zmq.REQ, f"tcp://127.0.0.1:{listener}") as sock:
        assert ask(sock, 1500) is None
    assert _refused_after(before) >= 1


def test_a_curve_peer_that_knows_the_servers_public_key_but_not_its_secret_is_refused(listener):
    """The ZAP handler admits the cluster's key only: a peer that learnt the public key (it is not
    sent, but say a log showed it) and brings its own key pair is refused, and counted."""
    public = sca.curve_keys(SECRET.encode()).public
    own_public, own_secret = zmq.curve_keypair()
    before = sca.REFUSED.count
    with peer(f"tcp://127.0.0.1:{listener}", curve=(public, own_public, own_secret)) as sock:
        assert ask(sock, 1500) is None
    assert _refused_after(before) >= 1


def test_without_a_secret_the_channel_stays_vllms_and_only_on_loopback(monkeypatch, restore_vllm):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker, utils

    monkeypatch.delenv(KV_SECRET_ENV, raising=False)
    assert sca.install("127.0.0.1") is False
    assert base_worker.zmq_ctx is utils.zmq_ctx
    with pytest.raises(KVAuthError, match=KV_SECRET_ENV):
        sca.install("10.1.2.3")


def test_the_key_pair_follows_the_secret():
    a, b, c = sca.curve_keys(b"s" * 32), sca.curve_keys(b"s" * 32), sca.curve_keys(b"t" * 32)
    assert (a.public, a.secret) == (b.public, b.secret) and a.public != c.public
    assert zmq.curve_public(a.secret) == a.public


def test_the_secret_comes_from_the_environment_or_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv(kv_auth.KV_SECRET_ENV, raising=False)
    monkeypatch.delenv(kv_auth.KV_SECRET_FILE_ENV, raising=False)
    assert kv_auth.load_secret() is None
    f = tmp_path / "kv"
    f.write_text("from-a-file-0123456789\n")
    monkeypatch.setenv(kv_auth.KV_SECRET_FILE_ENV, str(f))
    assert kv_auth.load_secret() == b"from-a-file-0123456789"
    monkeypatch.setenv(kv_auth.KV_SECRET_ENV, "from-the-env-0123456789")
    assert kv_auth.load_secret() == b"from-the-env-0123456789"
    monkeypatch.setenv(kv_auth.KV_SECRET_ENV, "short")
    with pytest.raises(kv_auth.KVAuthError, match="16 bytes"):
        kv_auth.load_secret()
    assert kv_auth.is_loopback("127.0.0.1") and kv_auth.is_loopback("::1") and kv_auth.is_loopback("localhost")
    assert not kv_auth.is_loopback("0.0.0.0") and not kv_auth.is_loopback("10.0.0.5")


def _prom_metrics():
    """The connector's Prometheus metrics on a private registry, as vLLM's frontend builds them."""
    import functools
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from prefillshare.app.engine.nixl.connector import NixlConnector

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = NixlConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types,
                                            ["model_name", "engine"], {0: ["base", "0"]})
    return prom, reg


def test_refusals_reach_the_engines_prometheus_counter_through_vllms_stats_merge(monkeypatch):
    """The scheduler half reports the refusals since its last report; vLLM merges that into the
    worker half's stats (Scheduler.update_from_output) and hands the dict to the frontend's metrics."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    from prefillshare.app.engine.nixl.connector import GuardedNixlStats, NixlConnector

    monkeypatch.setattr(sca, "REFUSED", sca._Refusals())
    scheduler_half = object.__new__(NixlConnector)  # its worker half lives elsewhere (None here)
    scheduler_half.connector_worker = None
    assert scheduler_half.get_kv_connector_stats() is None  # nothing refused: nothing to report
    sca._refused("a test peer")
    sca._refused("a test peer")
    report = scheduler_half.get_kv_connector_stats()
    assert report is not None and not report.is_empty()
    assert scheduler_half.get_kv_connector_stats() is None  # reported once

    worker_stats = GuardedNixlStats()
    worker_stats.record_failed_transfer()
    merged = worker_stats.aggregate(report)
    assert merged.reduce()["Num refused handshakes"] == 2
    with pytest.raises(KeyError):  # why the worker half's stats are replaced by the project's class
        NixlKVConnectorStats().aggregate(report)

    prom, reg = _prom_metrics()
    prom.observe(merged.to_dict(), engine_idx=0)  # the payload vLLM sends to its frontend
    labels = {"model_name": "base", "engine": "0"}
    assert reg.get_sample_value(f"{sca.REFUSED_METRIC}_total", labels) == 2
    assert reg.get_sample_value("vllm:nixl_num_failed_transfers_total", labels) == 1


def test_a_report_without_refusals_leaves_the_counter_alone():
    """vLLM's own stats (a worker half's transfer, no refusal key) observe as before."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    prom, reg = _prom_metrics()
    stats = NixlKVConnectorStats()
    stats.record_kv_expired_req()
    prom.observe(stats.data, engine_idx=0)
    labels = {"model_name": "base", "engine": "0"}
    assert reg.get_sample_value(f"{sca.REFUSED_METRIC}_total", labels) == 0
    assert reg.get_sample_value("vllm:nixl_num_kv_expired_reqs_total", labels) == 1
