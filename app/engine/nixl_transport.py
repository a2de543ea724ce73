"""Across nodes: a decoder's node pulls KV blocks from the producer's node through NIXL.

Two sides, one per node:
- :class:`NixlBlockServer` (producer node, ``python -m app.engine.nixl_transport serve``): owns a
  NIXL agent (UCX backend) with the node's slab registered once (DRAM). On ``fetch`` it leases
  the asked run of blocks in the node's :class:`KVPool` and answers where their slots are; the
  puller reads them with one NIXL READ straight out of the slab and then says ``done``: the
  server checks the slots' generations (not reused while read), ends the lease and counts the
  fan-out load.
- :class:`NixlStore` (decoder node): the consumer connector's store when ``transport="nixl"``.
  :meth:`NixlStore.fetch` (called from the connector's worker thread, asynchronously to the
  scheduler) tries the node-local pool first; for the rest of the run it reserves slots in
  this node's slab, READs the producer's slots into them (one copy), checks them and publishes
  them, so other decoders on this node reuse them. Loading into the engine is then the
  node-local batched path.

The control channel is a small TCP protocol (JSON lines: a challenge-response over the
cluster's KV secret (:mod:`app.engine.kv_auth`), then hello, fetch, done); the bulk bytes move
only through NIXL. A peer that fails the challenge gets no agent metadata and no block
address; the server counts it (``nixl_auth_refused``) and logs it. On this CPU-only machine
UCX moves DRAM to DRAM (CMA or TCP).
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import socket
import socketserver
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from app.engine import kv_auth
from app.engine.kv_pool import MISSING, BlockEntry, KVPool, PoolSpec

log = logging.getLogger(__name__)

__all__ = ["NixlBlockServer", "NixlPuller", "NixlStore", "parse_addr", "serve_process"]


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"NIXL address {addr!r} is not host:port")
    return host, int(port)


def _send(wfile, msg: dict) -> None:
    wfile.write(json.dumps(msg).encode() + b"\n")
    wfile.flush()


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    # No progress thread: on 2 cores UCX's progress threads spin; we poll transfers ourselves.
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


class _Registrations:
    """Slabs registered with one NIXL agent, one per (pool, slot size); a slab that grew (remapped)
    is registered again."""

    def __init__(self, agent):
        self.agent = agent
        # (pool path, slot bytes) -> (nslots, base address, tensor)
        self.by_slab: dict[tuple[str, int], tuple[int, int, object]] = {}
        self.version = 0

    def base(self, pool: KVPool, slot_bytes: int, upto_slot: int) -> tuple[int, int]:
        """(base address, stride) of the slab, registered; raises SlotOutOfRange if it has no such slot."""
        slab = pool.slab(slot_bytes)
        slab.ensure(upto_slot)
        key = (pool.path, slot_bytes)
        have = self.by_slab.get(key)
        if have is None or have[0] != slab.nslots:
            t = slab.tensor()
            self.agent.register_memory([t])
            self.by_slab[key] = (slab.nslots, t.data_ptr(), t)
            self.version += 1
        return self.by_slab[key][1], slab.stride


@dataclass
class _Ticket:
    lease: str | None
    entries: list[BlockEntry]
    deadline: float


class NixlBlockServer:
    """Serves a node's pool to other nodes: control over TCP, bytes over NIXL from the slab."""

    def __init__(self, spec: PoolSpec, listen: str = "127.0.0.1:0", ticket_timeout_s: float = 60.0):
        host, port = parse_addr(listen)
        self.secret = kv_auth.load_secret()
        if self.secret is None and not kv_auth.is_loopback(host):
            raise kv_auth.KVAuthError(f"NIXL block server on {listen}: set {kv_auth.KV_SECRET_ENV} (or "
                                      f"{kv_auth.KV_SECRET_FILE_ENV}); without a secret it serves only on loopback")
        self.refused = 0  # peers turned away for want of the secret
        self.pool = KVPool(spec)
        self.name = f"ps-srv-{uuid.uuid4().hex[:8]}"
        self.agent = _agent(self.name)
        self.regs = _Registrations(self.agent)
        self.tickets: dict[str, _Ticket] = {}
        self.ticket_timeout_s = ticket_timeout_s
        self.lock = threading.Lock()
        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                self.connection.settimeout(10.0)  # a peer that never answers the challenge
                if not server.admit(self.rfile, self.wfile, f"{self.client_address[0]}:{self.client_address[1]}"):
                    return
                self.connection.settimeout(None)
                for line in self.rfile:
                    try:
                        reply = server.dispatch(json.loads(line))
                    except Exception as e:  # noqa: BLE001 - every error goes back as an answer
                        reply = {"error": f"{type(e).__name__}: {e}"}
                    _send(self.wfile, reply)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.tcp = socketserver.ThreadingTCPServer((host, port), Handler)
        self.tcp.daemon_threads = True
        self.address = f"{host}:{self.tcp.server_address[1]}"
        self.thread = threading.Thread(target=self.tcp.serve_forever, daemon=True)
        self._stopping = threading.Event()
        self.progress = threading.Thread(target=self._progress, daemon=True)

    def admit(self, rfile, wfile, peer: str) -> bool:
        """The connection's first exchange (:func:`app.engine.kv_auth.admit`); a refused peer is
        counted and logged."""
        if kv_auth.admit(self.secret, rfile, wfile):
            return True
        with self.lock:
            self.refused += 1
        self.pool.add("", {"nixl_auth_refused": 1})
        self.pool.flush()
        log.warning("NIXL block server: refused %s (no valid KV secret)", peer)
        return False

    def _progress(self) -> None:
        """Drive UCX (connection set-up, one-sided reads) without a spinning progress thread:
        poll every millisecond while a ticket is out, every 20 ms otherwise."""
        while not self._stopping.is_set():
            with contextlib.suppress(Exception):
                self.agent.get_new_notifs()
            time.sleep(0.001 if self.tickets else 0.02)

    def start(self) -> NixlBlockServer:
        self.thread.start()
        self.progress.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.tcp.shutdown()
        self.tcp.server_close()
        self.pool.close()

    def _expire(self) -> None:
        now = time.time()
        for tid in [t for t, tk in self.tickets.items() if tk.deadline < now]:
            tk = self.tickets.pop(tid)
            self.pool.release(tk.lease)

    def dispatch(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "hello":
            with self.lock:
                return {"agent": self.name, "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                        "version": self.regs.version}
        if op == "fetch":
            return self._fetch(list(msg["keys"]))
        if op == "done":
            with self.lock:
                tk = self.tickets.pop(msg["ticket"], None)
            if tk is None:
                return {"ok": False}
            try:
                self.pool.check_entries(tk.entries)  # nothing was reused while the peer read
                ok = True
            except MISSING:
                ok = False
            self.pool.release(tk.lease, consumed=[e.key for e in tk.entries] if ok and msg.get("consumed") else ())
            return {"ok": ok}
        raise ValueError(f"unknown op {op!r}")

    def _fetch(self, keys: list[str]) -> dict:
        entries = self.pool.find(keys)
        if entries:  # one slot size per answer (the run of the first block's size)
            n = next((i for i, e in enumerate(entries) if e.slab != entries[0].slab), len(entries))
            entries = entries[:n]
        if not entries:
            return {"entries": []}
        lease = self.pool.lease(entries)
        slab = self.pool.slab(entries[0].slab)
        with self.lock:
            self._expire()
            base, stride = self.regs.base(self.pool, entries[0].slab, max(e.slot for e in entries))
            tid = uuid.uuid4().hex
            self.tickets[tid] = _Ticket(lease, entries, time.time() + self.ticket_timeout_s)
            version = self.regs.version
        return {"ticket": tid, "version": version,
                "entries": [[e.key, e.nbytes, e.ntokens, e.layout, base + e.slot * stride, slab.crc(e.slot)]
                            for e in entries]}


class NixlPuller:
    """Client side: reads runs of blocks from producer nodes' slabs into a local pool's slab."""

    def __init__(self, timeout_s: float = 30.0):
        self.name = f"ps-cli-{uuid.uuid4().hex[:8]}"
        self.agent = _agent(self.name)
        self.regs = _Registrations(self.agent)
        self.timeout_s = timeout_s
        self.secret = kv_auth.load_secret()
        self.peers: dict[str, tuple[socket.socket, object, str]] = {}
        self.versions: dict[str, int] = {}  # remote agent -> version of its metadata loaded here
        self.lock = threading.Lock()

    def _call(self, addr: str, msg: dict) -> dict:
        """One request/answer on the peer's control channel, bounded by ``timeout_s``. On any
        failure (a stalled peer's timeout included) the connection is dropped: a late answer
        must never be read as the answer to the next request."""
        try:
            sock, rfile, _ = self._peer(addr)
            sock.sendall(json.dumps(msg).encode() + b"\n")
            line = rfile.readline()
            if not line:
                raise ConnectionError(f"NIXL peer {addr} closed the connection")
        except BaseException:
            self._drop(addr)
            raise
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"NIXL peer {addr}: {reply['error']}")
        return reply

    def _hello(self, addr: str, sock, rfile) -> str:
        sock.sendall(b'{"op": "hello"}\n')
        line = rfile.readline()
        if not line:
            raise ConnectionError(f"NIXL peer {addr} closed the connection")
        hello = json.loads(line)
        name = hello["agent"]
        if self.versions.get(name) != hello["version"]:  # new agent, or it registered more memory
            if name in self.versions:
                self.agent.remove_remote_agent(name)
            self.agent.add_remote_agent(base64.b64decode(hello["metadata"]))
            self.versions[name] = hello["version"]
        return name

    def _peer(self, addr: str):
        if addr not in self.peers:
            sock = socket.create_connection(parse_addr(addr), timeout=self.timeout_s)
            self.peers[addr] = (sock, None, "")  # so that a failed hello closes it
            rfile = sock.makefile("rb")
            kv_auth.authenticate(self.secret, addr, rfile, sock.makefile("wb"))
            self.peers[addr] = (sock, rfile, self._hello(addr, sock, rfile))
        return self.peers[addr]

    def _drop(self, addr: str) -> None:
        peer = self.peers.pop(addr, None)
        if peer is not None:
            with contextlib.suppress(OSError):
                peer[0].close()

    def pull_into(self, addr: str, keys: Sequence[str], pool: KVPool, depth0: int = 0) -> dict:
        """Copy the longest run of ``keys`` the peer holds into ``pool``'s slab; returns figures
        (``blocks`` stored, ``bytes`` read, ``seconds``, and ``reason`` when nothing came)."""
        with self.lock:
            t0 = time.perf_counter()
            reply = self._call(addr, {"op": "fetch", "keys": list(keys)})
            rows = reply.get("entries", [])
            if not rows:
                return {"blocks": 0, "bytes": 0, "seconds": 0.0, "reason": reply.get("reason", "not held")}
            sock, rfile, remote = self.peers[addr]
            if self.versions.get(remote) != reply["version"]:  # the server registered a new slab
                try:
                    self._hello(addr, sock, rfile)
                except BaseException:
                    self._drop(addr)
                    raise
            nbytes = rows[0][1]
            res = pool.reserve([r[0] for r in rows], nbytes, [r[2] for r in rows], rows[0][3], depth0=depth0)
            new = [(e, r) for e, r in zip(res.entries, rows) if e is not None]
            ok = False
            try:
                if new:
                    base, stride = self.regs.base(pool, nbytes, max(e.slot for e, _ in new))
                    local = self.agent.get_xfer_descs([(base + e.slot * stride, nbytes, 0) for e, _ in new], "DRAM")
                    far = self.agent.get_xfer_descs([(r[4], nbytes, 0) for _, r in new], "DRAM")
                    self._read(addr, local, far, remote)
                ok = bool(self._call(addr, {"op": "done", "ticket": reply["ticket"], "consumed": True}).get("ok"))
                if ok and pool.check == "crc32":
                    slab = pool.slab(nbytes) if new else None
                    for e, r in new:
                        if zlib.crc32(slab.view(e.slot, nbytes)) != r[5]:
                            ok = False
                            pool.add("", {"nixl_damaged": 1})
                            break
            finally:
                if ok:
                    pool.publish(res)
                else:
                    pool.discard([e.key for e, _ in new])
            if not ok:
                return {"blocks": 0, "bytes": 0, "seconds": 0.0, "reason": "slots changed or damaged while read"}
            return {"blocks": sum(res.stored), "bytes": len(new) * nbytes, "seconds": time.perf_counter() - t0}

    def _read(self, addr: str, local, far, remote: str) -> None:
        handle = self.agent.initialize_xfer("READ", local, far, remote)
        try:
            state = self.agent.transfer(handle)
            deadline = time.time() + self.timeout_s
            while state == "PROC":
                if time.time() > deadline:
                    raise TimeoutError(f"NIXL READ from {addr} timed out")
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL READ from {addr} failed")
        finally:
            with contextlib.suppress(Exception):
                self.agent.release_xfer_handle(handle)


class NixlStore:
    """A node's pool that fills itself from producer nodes through NIXL: the store protocol
    (:mod:`app.engine.kv_store`) over a local :class:`KVPool`, whose ``fetch`` pulls first."""

    remote = True

    def __init__(self, spec: PoolSpec):
        if not spec.nixl_peers:
            raise ValueError("PoolSpec.nixl_peers: a nixl consumer needs at least one producer address")
        for p in spec.nixl_peers:
            parse_addr(p)
        self.local = KVPool(spec)
        self.peers = list(spec.nixl_peers)
        # A stalled peer costs at most this per pull (in a worker thread, never the scheduler).
        self.timeout_s = spec.nixl_timeout_s
        self._puller: NixlPuller | None = None
        self._pull_lock = threading.Lock()
        local = self.local
        self.find, self.lease, self.release = local.find, local.lease, local.release
        self.reserve, self.publish, self.slab = local.reserve, local.publish, local.slab
        self.check_entries, self.verify, self.discard = local.check_entries, local.verify, local.discard
        self.add, self.flush, self.flush_soon = local.add, local.flush, local.flush_soon

    def fetch(self, keys: Sequence[str], lease_s: float | None = None) -> tuple[list[BlockEntry], str | None]:
        """Longest leading run of ``keys``, pulling what this node lacks; leased like :meth:`KVPool.fetch`."""
        pool = self.local
        if len(pool.find(keys)) < len(keys):
            with self._pull_lock:
                have = pool.find(keys)  # again: a pull that held the lock may have brought them
                missing = list(keys[len(have):])
                for addr in ([] if not missing else self.peers):
                    try:
                        if self._puller is None:
                            self._puller = NixlPuller(timeout_s=self.timeout_s)
                        fig = self._puller.pull_into(addr, missing, pool, depth0=len(have))
                    except Exception as e:  # noqa: BLE001 - an unreachable peer is a miss, not a failure
                        log.warning("PrefillShare NIXL: pull from %s failed: %s", addr, e)
                        pool.add("", {"nixl_errors": 1})
                        continue
                    if fig["blocks"]:
                        pool.add("", {"nixl_pulls": 1, "nixl_blocks": fig["blocks"], "nixl_bytes": fig["bytes"],
                                      "nixl_seconds": fig["seconds"]})
                        break
        return pool.fetch(keys, lease_s)

    def close(self) -> None:
        self.local.close()


def serve_process(pool_dir: str, listen: str = "127.0.0.1:0",
                  env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """``python -m app.engine.nixl_transport serve`` in its own process (benchmarks, the GPU check,
    tests): the process and the address it listens on. The caller stops it."""
    proc = subprocess.Popen([sys.executable, "-m", "app.engine.nixl_transport", "serve", "--pool", pool_dir,
                             "--listen", listen], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.split()[-1]
    proc.wait(10)
    raise RuntimeError(f"NIXL block server exited with {proc.returncode} before listening")


def _serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.engine.nixl_transport serve",
                                 description="serve this node's KV pool to other nodes over NIXL")
    ap.add_argument("--pool", required=True, help="the node's pool folder (PoolSpec.path)")
    ap.add_argument("--listen", default="127.0.0.1:0", help="host:port of the control channel")
    args = ap.parse_args(argv)
    srv = NixlBlockServer(PoolSpec(path=args.pool), args.listen).start()
    print(f"NIXL block server {srv.name} listening on {srv.address}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        sys.exit(_serve(sys.argv[2:]))
    print("usage: python -m app.engine.nixl_transport serve --pool PATH [--listen HOST:PORT]", file=sys.stderr)
    sys.exit(2)
