"""The pool gives back what it took: its last owner removes it, a crashed owner's pool is
reclaimed by the next start (not a second one beside it), ``persist`` keeps it, and it maps
no semaphore of its own."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from prefillshare.app.engine.pool.kv_keys import block_keys
from prefillshare.app.engine.pool.kv_pool import KVPool, PoolSpec
from tests.kv_blocks import Block, put

BLOCK = 4096

OWNER = """
import os, sys
from prefillshare.app.engine.pool.kv_keys import block_keys
from prefillshare.app.engine.pool.kv_pool import KVPool, PoolSpec
from tests.kv_blocks import Block, put
path, how, persist = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
pool = KVPool(PoolSpec(path, capacity_bytes=8 * 4096, persist=persist))
k = block_keys("base", "t", [1, 2, 3, 4], 4)[0]
put(pool, [Block(k.key, bytes(4096), 4, "L")])
maps = open("/proc/self/maps").read()
assert "/dev/shm/sem." not in maps and "/dev/shm/psm_" not in maps, "the pool mapped a semaphore"
if how == "crash":
    os._exit(0)  # as SIGKILL: nothing runs, the kernel drops the lock
if how == "close":
    pool.close()
    assert not os.path.exists(path) or persist
"""  # how == "exit": the interpreter's exit closes it


@pytest.fixture
def path():
    p = f"/dev/shm/ps-test-life-{uuid.uuid4().hex[:8]}"
    yield p
    shutil.rmtree(p, ignore_errors=True)


def owner(path, how, persist=False):
    subprocess.run([sys.executable, "-c", OWNER, path, how, "1" if persist else "0"], check=True, timeout=120)


def key():
    return block_keys("base", "t", [1, 2, 3, 4], 4)[0].key


@pytest.mark.parametrize("how", ["close", "exit"])
def test_the_last_owner_removes_the_pool(path, how):
    owner(path, how)
    assert not os.path.exists(path)


def test_persist_keeps_the_pool_and_the_next_start_adopts_it(path):
    owner(path, "exit", persist=True)
    assert os.path.exists(os.path.join(path, "slab-index.sqlite"))
    pool = KVPool(PoolSpec(path, capacity_bytes=64 * BLOCK, persist=True))
    assert pool.entry(key()) is not None and pool.capacity_bytes == 8 * BLOCK  # the creator's capacity
    pool.close()
    assert os.path.exists(path)


def test_a_crashed_owners_pool_is_reclaimed_in_place(path):
    owner(path, "crash")
    assert os.path.exists(os.path.join(path, "slab-index.sqlite"))  # nobody ran to remove it
    pool = KVPool(PoolSpec(path, capacity_bytes=4 * BLOCK))
    assert pool.entry(key()) is None and pool.capacity_bytes == 4 * BLOCK  # made afresh, same folder
    assert sorted(n for n in os.listdir(path) if n.startswith("slab-") and n.endswith(".data")) == []
    pool.close()
    assert not os.path.exists(path)


def test_two_owners_share_one_pool_until_the_last_one_closes(path):
    first = KVPool(PoolSpec(path, capacity_bytes=8 * BLOCK))
    second = KVPool(PoolSpec(path, capacity_bytes=8 * BLOCK))
    (k,) = block_keys("base", "t", [1, 2, 3, 4], 4)
    put(first, [Block(k.key, bytes([7]) * BLOCK, 4, "L")])
    assert second.entry(k.key) is not None  # one pool, not two
    owner(path, "exit")  # a third owner comes and goes: the pool stays
    first.close()
    assert second.entry(k.key) is not None and os.path.exists(path)
    reader = KVPool.attach(path)  # readers own nothing
    second.close()
    assert not os.path.exists(path)
    del reader


def test_reclaim_removes_a_pool_whose_owners_were_all_killed_and_keeps_a_live_one(path, tmp_path):
    import yaml

    from prefillshare.app.engine.pool.pool_owner import reclaim

    owner(path, "crash")  # killed: nothing released it
    assert os.path.exists(os.path.join(path, "slab-index.sqlite"))
    assert reclaim(path) and not os.path.exists(path)
    assert not reclaim(path)  # absent: nothing to do
    live = KVPool(PoolSpec(path, capacity_bytes=8 * BLOCK))
    assert not reclaim(path) and os.path.exists(os.path.join(path, "slab-index.sqlite"))  # its owner lives
    live.close()
    assert not os.path.exists(path)
    # the command: the config's pool folder, kept when the config persists it
    owner(path, "crash")
    serve = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "serve_config.yaml")))
    cfg = tmp_path / "serve_config.yaml"
    for persist, kept in ((True, True), (False, False)):
        serve["applications"][0]["args"]["config"]["pool"] = {"path": path, "persist": persist}
        cfg.write_text(yaml.safe_dump(serve))
        r = subprocess.run([sys.executable, "-m", "prefillshare.app.cli", "pool-reclaim", str(cfg)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert os.path.exists(path) == kept, r.stdout
