"""NIXL transport between two processes over loopback: a decoder node pulls a producer node's slab slots."""
import os
import shutil
import signal
import subprocess
import uuid

import pytest

pytest.importorskip("nixl._api")

from app.engine.kv_auth import KV_SECRET_ENV, KVAuthError  # noqa: E402
from app.engine.kv_keys import block_keys  # noqa: E402
from app.engine.kv_pool import KVPool, PoolSpec  # noqa: E402
from app.engine.nixl_transport import NixlStore, serve_process  # noqa: E402
from tests.kv_blocks import Block, put, read  # noqa: E402

BLOCK = 256 << 10


def start_server(pool_path: str, secret: str | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m app.engine.nixl_transport serve` in its own process; returns it and its address."""
    env = {k: v for k, v in os.environ.items() if k != KV_SECRET_ENV}
    if secret:
        env[KV_SECRET_ENV] = secret
    return serve_process(pool_path, env=env)


@pytest.fixture
def nodes():
    tag = uuid.uuid4().hex[:8]
    src, dst = f"/dev/shm/ps-nixl-src-{tag}", f"/dev/shm/ps-nixl-dst-{tag}"
    producer_pool = KVPool(PoolSpec(src, capacity_bytes=256 << 20, check="crc32"))
    proc, addr = start_server(src)
    try:
        yield producer_pool, dst, addr, proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)  # a test may have stalled it
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)


def blocks(n, salt="t"):
    keys = block_keys("base", salt, list(range(n * 32 - 5)), 32)
    return [Block(k.key, os.urandom(BLOCK), k.num_tokens, "L", i) for i, k in enumerate(keys)]


def test_one_puller_fills_each_local_pool_it_is_given_with_the_right_bytes(nodes):
    """A puller's slab registrations are per pool: a second local pool with the same slot size
    gets its own bytes, not a write into the first pool's slab."""
    from app.engine.nixl_transport import NixlPuller

    producer_pool, dst, addr, _ = nodes
    its = blocks(4)
    put(producer_pool, its)
    keys = [it.key for it in its]
    puller = NixlPuller(timeout_s=10)
    for i in range(2):
        local = KVPool(PoolSpec(f"{dst}-{i}", capacity_bytes=64 << 20))
        try:
            assert puller.pull_into(addr, keys, local)["blocks"] == len(its)
            assert [bytes(read(local, e)) for e in local.find(keys)] == [it.data for it in its], i
        finally:
            local.close()


def test_pull_moves_exact_bytes_and_counts_the_fanout_load(nodes):
    producer_pool, dst, addr, _ = nodes
    its = blocks(12)
    put(producer_pool, its, pins=1)
    pool = NixlStore(PoolSpec(path=dst, capacity_bytes=256 << 20, nixl_peers=[addr], transport="nixl"))
    entries, lease = pool.fetch([it.key for it in its])
    assert [e.key for e in entries] == [it.key for it in its]
    assert all(bytes(read(pool.local, e)) == it.data for e, it in zip(entries, its))
    assert entries[-1].ntokens == 27  # the partial block travels too
    pool.release(lease)
    st = pool.local.stats()
    assert st.get("nixl_pulls") == 1 and st.get("nixl_bytes") == len(its) * BLOCK
    assert [producer_pool.pins(it.key) for it in its] == [0] * len(its)  # the remote load was counted
    print(f"\nNIXL pull of {len(its) * BLOCK >> 20} MiB: {st.get('nixl_seconds') * 1e3:.1f} ms "
          f"({len(its) * BLOCK / st.get('nixl_seconds') / 1e9:.2f} GB/s incl. staging)")
    # a second fetch is served by the node-local pool: no new pull
    pool.release(pool.fetch([it.key for it in its])[1])
    assert pool.local.stats().get("nixl_pulls") == 1
    # the producer's slots are served again after a slab grew (new registration, new metadata)
    producer_pool.set_capacity(512 << 20)
    more = blocks(3, salt="grown")
    producer_pool.set_capacity(256 << 20)
    put(producer_pool, more)
    got, lease = pool.fetch([it.key for it in more])
    assert [bytes(read(pool.local, e)) for e in got] == [it.data for it in more]
    pool.release(lease)


def test_damaged_remote_block_is_a_miss_not_an_error(nodes):
    producer_pool, dst, addr, _ = nodes
    its = blocks(4, salt="d")
    put(producer_pool, its)
    producer_pool.view(producer_pool.entry(its[2].key))[:64] = b"\x00" * 64
    pool = NixlStore(PoolSpec(path=dst, nixl_peers=[addr], check="crc32", transport="nixl"))
    entries, lease = pool.fetch([it.key for it in its])
    assert len(entries) < len(its)
    pool.release(lease)
    assert pool.local.stats().get("nixl_damaged") == 1


def test_stalled_peer_is_a_bounded_counted_miss_and_the_next_pull_is_not_confused(nodes):
    """The server process is stopped (SIGSTOP): it holds the TCP connection and never answers.
    The lookup gives up after nixl_timeout_s and is a miss; once the server runs again its
    late answer to that fetch must not be taken for the answer to the next one."""
    import time

    producer_pool, dst, addr, proc = nodes
    a, b, c = blocks(2, salt="a"), blocks(2, salt="b"), blocks(3, salt="c")
    for its in (a, b, c):
        put(producer_pool, its)
    pool = NixlStore(PoolSpec(path=dst, nixl_peers=[addr], nixl_timeout_s=1.0, transport="nixl"))

    def fetch_held(its, tries=5):
        """A 1 s budget can miss on a loaded machine (UCX wire-up): a miss is retried, never wrong data."""
        for _ in range(tries):
            entries, lease = pool.fetch([it.key for it in its])
            if entries:
                return entries, lease
        pytest.fail(f"no pull succeeded in {tries} tries")

    pool.release(fetch_held(a)[1])  # the control connection is up
    errors, pulls = (pool.local.stats().get(k) for k in ("nixl_errors", "nixl_pulls"))
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert pool.fetch([it.key for it in b]) == ([], None)
        stalled_s = time.monotonic() - t0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert pool.local.stats().get("nixl_errors") == errors + 1
    entries, lease = fetch_held(c)
    assert [e.key for e in entries] == [it.key for it in c]
    assert all(bytes(read(pool.local, e)) == it.data for e, it in zip(entries, c))
    pool.release(lease)
    assert pool.local.stats().get("nixl_pulls") == pulls + 1
    print(f"\nstalled NIXL peer: miss after {stalled_s:.1f} s (nixl_timeout_s 1.0)")


def test_unreachable_peer_is_a_counted_miss(tmp_path):
    dst = f"/dev/shm/ps-nixl-none-{uuid.uuid4().hex[:8]}"
    try:
        pool = NixlStore(PoolSpec(path=dst, nixl_peers=["127.0.0.1:9"], transport="nixl"))
        assert pool.fetch([it.key for it in blocks(2)]) == ([], None)
        assert pool.local.stats().get("nixl_errors") == 1
    finally:
        shutil.rmtree(dst, ignore_errors=True)


def test_config_errors_are_named():
    with pytest.raises(ValueError, match="nixl_peers"):
        NixlStore(PoolSpec(path="/dev/shm/ps-nixl-bad", nixl_peers=[], transport="nixl"))
    with pytest.raises(ValueError, match="nixl_timeout_s"):
        NixlStore(PoolSpec(path="/dev/shm/ps-nixl-bad", nixl_peers=["127.0.0.1:9"], nixl_timeout_s=0, transport="nixl"))
    with pytest.raises(ValueError, match="host:port"):
        NixlStore(PoolSpec(path="/dev/shm/ps-nixl-bad", nixl_peers=["nohost"], transport="nixl"))
    shutil.rmtree("/dev/shm/ps-nixl-bad", ignore_errors=True)


SECRET = "kv-secret-for-the-test-cluster-0123456789"


@pytest.fixture
def guarded():
    """A producer node whose block server requires the KV secret."""
    tag = uuid.uuid4().hex[:8]
    src, dst = f"/dev/shm/ps-nixl-gsrc-{tag}", f"/dev/shm/ps-nixl-gdst-{tag}"
    producer_pool = KVPool(PoolSpec(src, capacity_bytes=64 << 20))
    proc, addr = start_server(src, secret=SECRET)
    try:
        yield producer_pool, dst, addr
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dst, ignore_errors=True)


def _raw_session(addr, first_line: bytes) -> list[dict]:
    """What a peer that speaks the protocol but lacks the secret gets back (every line until close)."""
    import json
    import socket

    from app.engine.nixl_transport import parse_addr

    with socket.create_connection(parse_addr(addr), timeout=10) as sock:
        f = sock.makefile("rb")
        got = [json.loads(f.readline())]
        sock.sendall(first_line)
        got += [json.loads(line) for line in f]  # until the server closes the connection
    return got


def test_a_puller_without_the_secret_gets_no_metadata_and_no_blocks_and_is_counted(guarded, monkeypatch):
    producer_pool, dst, addr = guarded
    its = blocks(3, salt="guarded")
    put(producer_pool, its)
    keys = [it.key for it in its]
    hello = _raw_session(addr, b'{"op": "hello"}\n')
    assert hello[0]["challenge"] and hello[1:] == [{"error": "unauthorized: no valid KV secret"}]
    forged = _raw_session(addr, b'{"op": "auth", "mac": "00", "nonce": "x"}\n')
    assert len(forged) == 2 and "metadata" not in forged[1] and "entries" not in forged[1]
    monkeypatch.setenv(KV_SECRET_ENV, "a-different-secret-of-enough-bytes")
    from app.engine.nixl_transport import NixlPuller

    local = KVPool(PoolSpec(dst, capacity_bytes=64 << 20))
    with pytest.raises(KVAuthError, match="refused"):
        NixlPuller(timeout_s=5).pull_into(addr, keys, local)
    assert producer_pool.stats().get("nixl_auth_refused") == 3  # the raw hello, the forged answer, the wrong secret
    monkeypatch.delenv(KV_SECRET_ENV, raising=False)
    store = NixlStore(PoolSpec(path=dst, nixl_peers=[addr], transport="nixl"))  # no secret at all
    assert store.fetch(keys) == ([], None) and store.local.stats().get("nixl_errors") == 1
    assert local.find(keys) == []


def test_a_puller_with_the_secret_gets_exactly_the_blocks_it_asked_for(guarded, monkeypatch):
    producer_pool, dst, addr = guarded
    mine, other = blocks(6, salt="tenant-a"), blocks(4, salt="tenant-b")
    put(producer_pool, mine)
    put(producer_pool, other)
    monkeypatch.setenv(KV_SECRET_ENV, SECRET)
    from app.engine.nixl_transport import NixlPuller

    puller = NixlPuller(timeout_s=10)
    asked = [it.key for it in mine[:3]]
    reply = puller._call(addr, {"op": "fetch", "keys": asked})
    assert [r[0] for r in reply["entries"]] == asked  # the answer names the asked blocks, in order ...
    slots, stride = [producer_pool.entry(k).slot for k in asked], producer_pool.slab(BLOCK).stride
    addrs = [r[4] for r in reply["entries"]]  # ... and the addresses of their slots, nothing else
    assert [a - addrs[0] for a in addrs] == [(s - slots[0]) * stride for s in slots]
    puller._call(addr, {"op": "done", "ticket": reply["ticket"]})
    local = KVPool(PoolSpec(dst, capacity_bytes=64 << 20))
    fig = puller.pull_into(addr, asked, local)
    assert fig["blocks"] == 3
    held = {k for (k,) in local._db().execute("SELECT key FROM blocks")}
    assert held == set(asked)  # nothing else came
    assert [read(local, local.entry(k)) for k in asked] == [it.data for it in mine[:3]]
    assert producer_pool.stats().get("nixl_auth_refused") == 0


def test_a_block_server_off_loopback_needs_a_secret(tmp_path, monkeypatch):
    from app.engine.nixl_transport import NixlBlockServer

    monkeypatch.delenv(KV_SECRET_ENV, raising=False)
    with pytest.raises(KVAuthError, match=KV_SECRET_ENV):
        NixlBlockServer(PoolSpec(str(tmp_path / "pool")), "0.0.0.0:0")
