"""NIXL transport between two processes over loopback: a decoder node pulls a producer node's slab slots."""
import os
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

pytest.importorskip("nixl._api")

from app.engine.kv_keys import block_keys  # noqa: E402
from app.engine.kv_pool import KVPool, PutItem  # noqa: E402
from app.engine.nixl_transport import NixlPool  # noqa: E402

BLOCK = 256 << 10


def start_server(pool_path: str) -> tuple[subprocess.Popen, str]:
    """`python -m app.engine.nixl_transport serve` in its own process; returns it and its address."""
    proc = subprocess.Popen([sys.executable, "-m", "app.engine.nixl_transport", "serve", "--pool", pool_path,
                             "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.split()[-1]
    raise RuntimeError("NIXL block server did not start")


@pytest.fixture
def nodes():
    tag = uuid.uuid4().hex[:8]
    src, dst = f"/dev/shm/ps-nixl-src-{tag}", f"/dev/shm/ps-nixl-dst-{tag}"
    producer_pool = KVPool(src, capacity_bytes=256 << 20, check="crc32")
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
    return [PutItem(k.key, os.urandom(BLOCK), k.num_tokens, "L", i) for i, k in enumerate(keys)]


def test_pull_moves_exact_bytes_and_counts_the_fanout_load(nodes):
    producer_pool, dst, addr, _ = nodes
    its = blocks(12)
    producer_pool.put_many(its, pins=1)
    pool = NixlPool({"path": dst, "capacity_bytes": 256 << 20, "nixl_peers": [addr]})
    entries, lease = pool.fetch([it.key for it in its])
    assert [e.key for e in entries] == [it.key for it in its]
    assert all(bytes(pool.read(e)) == it.data for e, it in zip(entries, its))
    assert entries[-1].ntokens == 27  # the partial block travels too
    pool.release(lease)
    st = pool.stats()
    assert st.get("nixl_pulls") == 1 and st.get("nixl_bytes") == len(its) * BLOCK
    assert [producer_pool.pins(it.key) for it in its] == [0] * len(its)  # the remote load was counted
    print(f"\nNIXL pull of {len(its) * BLOCK >> 20} MiB: {st.get('nixl_seconds') * 1e3:.1f} ms "
          f"({len(its) * BLOCK / st.get('nixl_seconds') / 1e9:.2f} GB/s incl. staging)")
    # a second fetch is served by the node-local pool: no new pull
    pool.release(pool.fetch([it.key for it in its])[1])
    assert pool.stats().get("nixl_pulls") == 1
    # the producer's slots are served again after a slab grew (new registration, new metadata)
    producer_pool.set_capacity(512 << 20)
    more = blocks(3, salt="grown")
    producer_pool.set_capacity(256 << 20)
    producer_pool.put_many(more)
    got, lease = pool.fetch([it.key for it in more])
    assert [bytes(pool.read(e)) for e in got] == [it.data for it in more]
    pool.release(lease)


def test_damaged_remote_block_is_a_miss_not_an_error(nodes):
    producer_pool, dst, addr, _ = nodes
    its = blocks(4, salt="d")
    producer_pool.put_many(its)
    producer_pool.view(producer_pool.entry(its[2].key))[:64] = b"\x00" * 64
    pool = NixlPool({"path": dst, "nixl_peers": [addr], "check": "crc32"})
    entries, lease = pool.fetch([it.key for it in its])
    assert len(entries) < len(its)
    pool.release(lease)
    assert pool.stats().get("nixl_damaged") == 1


def test_stalled_peer_is_a_bounded_counted_miss_and_the_next_pull_is_not_confused(nodes):
    """The server process is stopped (SIGSTOP): it holds the TCP connection and never answers.
    The lookup gives up after nixl_timeout_s and is a miss; once the server runs again its
    late answer to that fetch must not be taken for the answer to the next one."""
    import time

    producer_pool, dst, addr, proc = nodes
    a, b, c = blocks(2, salt="a"), blocks(2, salt="b"), blocks(3, salt="c")
    for its in (a, b, c):
        producer_pool.put_many(its)
    pool = NixlPool({"path": dst, "nixl_peers": [addr], "nixl_timeout_s": 1.0})
    pool.release(pool.fetch([it.key for it in a])[1])  # the control connection is up
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert pool.fetch([it.key for it in b]) == ([], None)
        stalled_s = time.monotonic() - t0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert pool.stats().get("nixl_errors") == 1
    entries, lease = pool.fetch([it.key for it in c])
    assert [e.key for e in entries] == [it.key for it in c]
    assert all(bytes(pool.read(e)) == it.data for e, it in zip(entries, c))
    pool.release(lease)
    assert pool.stats().get("nixl_pulls") == 2
    print(f"\nstalled NIXL peer: miss after {stalled_s:.1f} s (nixl_timeout_s 1.0)")


def test_unreachable_peer_is_a_counted_miss(tmp_path):
    dst = f"/dev/shm/ps-nixl-none-{uuid.uuid4().hex[:8]}"
    try:
        pool = NixlPool({"path": dst, "nixl_peers": ["127.0.0.1:9"]})
        assert pool.fetch([it.key for it in blocks(2)]) == ([], None)
        assert pool.stats().get("nixl_errors") == 1
    finally:
        shutil.rmtree(dst, ignore_errors=True)


def test_config_errors_are_named():
    with pytest.raises(ValueError, match="nixl_peers"):
        NixlPool({"path": "/dev/shm/ps-nixl-bad", "nixl_peers": []})
    with pytest.raises(ValueError, match="nixl_timeout_s"):
        NixlPool({"path": "/dev/shm/ps-nixl-bad", "nixl_peers": ["127.0.0.1:9"], "nixl_timeout_s": 0})
    with pytest.raises(ValueError, match="host:port"):
        NixlPool({"path": "/dev/shm/ps-nixl-bad", "nixl_peers": ["nohost"]})
    shutil.rmtree("/dev/shm/ps-nixl-bad", ignore_errors=True)
