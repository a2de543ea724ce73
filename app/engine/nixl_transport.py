"""Across nodes: a decoder's node pulls KV blocks from the producer's node through NIXL.

Two sides, one per node:
- :class:`NixlBlockServer` (producer node, ``python -m app.engine.nixl_transport serve``): owns a
  NIXL agent (UCX backend) and a registered staging buffer (DRAM). On ``fetch`` it leases the
  asked run of blocks in the node's :class:`KVPool`, reads them (checksums verified) into the
  staging buffer and answers where they are; the puller reads them with one NIXL READ and
  then says ``done``, which frees the staging space and counts the fan-out load.
- :class:`NixlPool` (decoder node): the consumer connector's pool when ``transport="nixl"``.
  A lookup first tries the node-local pool; when the run is not complete there it fetches the
  missing blocks from a producer node, checks them, stores them in the local pool (so other
  decoders on this node reuse them) and answers from the local pool. Loading into the engine
  then is the node-local path.

The control channel is a small TCP protocol (JSON lines: hello, fetch, done); the bulk bytes
move only through NIXL. On this CPU-only machine UCX moves DRAM to DRAM (CMA or TCP); on GPU
nodes the staging buffers can be VRAM (``mem="VRAM"``), which UCX moves with CUDA IPC /
GPUDirect RDMA. The pull runs inside the consumer's scheduler when the request is first seen
(synchronous): simple, but it holds that engine's scheduler for the transfer time.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import socket
import socketserver
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from app.engine.kv_pool import BlockDamaged, BlockEntry, BlockMissing, KVPool, PutItem

log = logging.getLogger(__name__)

__all__ = ["NixlBlockServer", "NixlPuller", "NixlPool", "parse_addr"]


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"NIXL address {addr!r} is not host:port")
    return host, int(port)


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    # No progress thread: on 2 cores UCX's progress threads spin; we poll transfers ourselves.
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _staging(nbytes: int, mem: str):
    import torch

    dev = "cuda" if mem == "VRAM" else "cpu"
    return torch.zeros(nbytes, dtype=torch.uint8, device=dev)


class _Ranges:
    """First-fit allocator of byte ranges in a staging buffer."""

    def __init__(self, size: int):
        self.free: list[tuple[int, int]] = [(0, size)]

    def alloc(self, n: int) -> int | None:
        for i, (off, ln) in enumerate(self.free):
            if ln >= n:
                self.free[i] = (off + n, ln - n)
                if self.free[i][1] == 0:
                    self.free.pop(i)
                return off
        return None

    def release(self, off: int, n: int) -> None:
        self.free.append((off, n))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for o, ln in self.free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + ln)
            else:
                merged.append((o, ln))
        self.free = merged


@dataclass
class _Ticket:
    offset: int
    nbytes: int
    lease: str | None
    keys: list[str]
    deadline: float


class NixlBlockServer:
    """Serves a node's pool to other nodes: control over TCP, bytes over NIXL."""

    def __init__(self, pool_path: str, listen: str = "127.0.0.1:0", staging_bytes: int = 256 << 20,
                 mem: str = "DRAM", ticket_timeout_s: float = 60.0):
        self.pool = KVPool(pool_path)
        self.name = f"ps-srv-{uuid.uuid4().hex[:8]}"
        self.agent = _agent(self.name)
        self.buf = _staging(staging_bytes, mem)
        self.mem = mem
        self.agent.register_memory([self.buf])
        self.base = self.buf.data_ptr()
        self.ranges = _Ranges(staging_bytes)
        self.tickets: dict[str, _Ticket] = {}
        self.ticket_timeout_s = ticket_timeout_s
        self.lock = threading.Lock()
        host, port = parse_addr(listen)
        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                for line in self.rfile:
                    try:
                        reply = server.dispatch(json.loads(line))
                    except Exception as e:  # noqa: BLE001 - every error goes back as an answer
                        reply = {"error": f"{type(e).__name__}: {e}"}
                    self.wfile.write(json.dumps(reply).encode() + b"\n")
                    self.wfile.flush()

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.tcp = socketserver.ThreadingTCPServer((host, port), Handler)
        self.tcp.daemon_threads = True
        self.address = f"{host}:{self.tcp.server_address[1]}"
        self.thread = threading.Thread(target=self.tcp.serve_forever, daemon=True)
        self._stopping = threading.Event()
        self.progress = threading.Thread(target=self._progress, daemon=True)

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

    def _expire(self) -> None:
        now = time.time()
        for tid in [t for t, tk in self.tickets.items() if tk.deadline < now]:
            tk = self.tickets.pop(tid)
            self.ranges.release(tk.offset, tk.nbytes)
            self.pool.release(tk.lease)

    def dispatch(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "hello":
            return {"agent": self.name, "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                    "base": self.base, "mem": self.mem}
        if op == "fetch":
            return self._fetch(list(msg["keys"]))
        if op == "done":
            with self.lock:
                tk = self.tickets.pop(msg["ticket"], None)
                if tk is not None:
                    self.ranges.release(tk.offset, tk.nbytes)
                    self.pool.release(tk.lease, consumed=tk.keys if msg.get("consumed") else ())
            return {"ok": tk is not None}
        raise ValueError(f"unknown op {op!r}")

    def _fetch(self, keys: list[str]) -> dict:
        entries, lease = self.pool.lookup(keys)
        if not entries:
            return {"entries": []}
        total = sum(e.nbytes for e in entries)
        with self.lock:
            self._expire()
            off = self.ranges.alloc(total)
        if off is None:
            self.pool.release(lease)
            return {"entries": [], "reason": "staging buffer full"}
        pos = off
        try:
            for e in entries:
                data = self.pool.read(e)
                import torch

                self.buf[pos : pos + e.nbytes].copy_(torch.frombuffer(data, dtype=torch.uint8))
                pos += e.nbytes
        except (BlockDamaged, BlockMissing) as ex:
            with self.lock:
                self.ranges.release(off, total)
            self.pool.release(lease)
            return {"entries": [], "reason": f"{type(ex).__name__}: {ex}"}
        tid = uuid.uuid4().hex
        with self.lock:
            self.tickets[tid] = _Ticket(off, total, lease, [e.key for e in entries],
                                        time.time() + self.ticket_timeout_s)
        return {"ticket": tid, "offset": off,
                "entries": [[e.key, e.nbytes, e.ntokens, e.checksum, e.layout] for e in entries]}


class NixlPuller:
    """Client side: fetches runs of blocks from producer nodes with NIXL READs."""

    def __init__(self, staging_bytes: int = 256 << 20, mem: str = "DRAM", timeout_s: float = 30.0):
        self.name = f"ps-cli-{uuid.uuid4().hex[:8]}"
        self.agent = _agent(self.name)
        self.buf = _staging(staging_bytes, mem)
        self.mem = mem
        self.agent.register_memory([self.buf])
        self.timeout_s = timeout_s
        self.peers: dict[str, tuple[socket.socket, object, str, int]] = {}
        self.remotes: set[str] = set()  # remote agents whose metadata this agent holds
        self.lock = threading.Lock()

    def _call(self, addr: str, msg: dict) -> dict:
        """One request/answer on the peer's control channel, bounded by ``timeout_s``. On any
        failure (a stalled peer's timeout included) the connection is dropped: a late answer
        must never be read as the answer to the next request."""
        try:
            sock, rfile, _, _ = self._peer(addr)
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

    def _peer(self, addr: str):
        if addr not in self.peers:
            sock = socket.create_connection(parse_addr(addr), timeout=self.timeout_s)
            self.peers[addr] = (sock, None, None, 0)  # so that a failed hello closes it
            rfile = sock.makefile("rb")
            sock.sendall(b'{"op": "hello"}\n')
            line = rfile.readline()
            if not line:
                raise ConnectionError(f"NIXL peer {addr} closed the connection")
            hello = json.loads(line)
            if hello["agent"] in self.remotes:  # a reconnect: the agent's metadata is loaded already
                remote = hello["agent"]
            else:
                remote = self.agent.add_remote_agent(base64.b64decode(hello["metadata"]))
                self.remotes.add(remote)
            self.peers[addr] = (sock, rfile, remote, int(hello["base"]))
        return self.peers[addr]

    def _drop(self, addr: str) -> None:
        peer = self.peers.pop(addr, None)
        if peer is not None:
            with contextlib.suppress(OSError):
                peer[0].close()

    def pull(self, addr: str, keys: Sequence[str]) -> tuple[list[tuple[BlockEntry, memoryview]], dict]:
        """The longest run of ``keys`` the peer holds, as (entry, bytes); plus transfer figures."""
        with self.lock:
            t0 = time.perf_counter()
            reply = self._call(addr, {"op": "fetch", "keys": list(keys)})
            entries = [BlockEntry(*e) for e in reply.get("entries", [])]
            if not entries:
                return [], {"reason": reply.get("reason", "not held"), "bytes": 0, "seconds": 0.0}
            _, _, remote, base = self.peers[addr]
            total = sum(e.nbytes for e in entries)
            if total > self.buf.numel():
                self._call(addr, {"op": "done", "ticket": reply["ticket"], "consumed": False})
                return [], {"reason": "local staging buffer too small", "bytes": 0, "seconds": 0.0}
            local = self.agent.get_xfer_descs([(self.buf.data_ptr(), total, 0)], self.mem)
            far = self.agent.get_xfer_descs([(base + reply["offset"], total, 0)], self.mem)
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
            xfer_s = time.perf_counter() - t0
            host = self.buf[:total].cpu() if self.mem == "VRAM" else self.buf[:total]
            data = memoryview(host.numpy()).cast("B")
            out, pos = [], 0
            for e in entries:
                out.append((e, data[pos : pos + e.nbytes]))
                pos += e.nbytes
            # copy out before the staging buffer is reused by the next pull
            out = [(e, memoryview(bytes(b))) for e, b in out]
            self._call(addr, {"op": "done", "ticket": reply["ticket"], "consumed": True})
            return out, {"bytes": total, "seconds": xfer_s}


class NixlPool(KVPool):
    """A node-local pool that fills itself from producer nodes through NIXL on a miss."""

    def __init__(self, spec: dict):
        super().__init__(spec["path"], spec.get("capacity_bytes"), spec.get("lease_timeout_s", 60.0))
        peers = spec.get("nixl_peers") or ()
        if not peers:
            raise ValueError("PoolSpec.nixl_peers: a nixl consumer needs at least one producer address")
        for p in peers:
            parse_addr(p)
        self.peers = list(peers)
        # A stalled peer costs at most this per request (the pull holds the engine's scheduler).
        self.timeout_s = float(spec.get("nixl_timeout_s", 30.0))
        if self.timeout_s <= 0:
            raise ValueError("PoolSpec.nixl_timeout_s must be > 0")
        self._puller: NixlPuller | None = None

    def lookup(self, keys: Sequence[str], lease_s: float | None = None):
        entries, lease = super().lookup(keys, lease_s)
        if len(entries) == len(keys):
            return entries, lease
        self.release(lease)
        missing = list(keys[len(entries):])
        for addr in self.peers:
            try:
                if self._puller is None:
                    self._puller = NixlPuller(timeout_s=self.timeout_s)
                got, fig = self._puller.pull(addr, missing)
            except Exception as e:  # noqa: BLE001 - an unreachable peer is a miss, not a failure
                log.warning("PrefillShare NIXL: pull from %s failed: %s", addr, e)
                self.count("", nixl_errors=1)
                continue
            if not got:
                continue
            for e, data in got:
                if zlib.crc32(data) != e.checksum:
                    self.count("", nixl_damaged=1)
                    got = []
                    break
            if not got:
                continue
            first = len(entries)
            self.put_many([PutItem(e.key, d, e.ntokens, e.layout, first + i) for i, (e, d) in enumerate(got)])
            self.count("", nixl_pulls=1, nixl_blocks=len(got), nixl_bytes=fig["bytes"], nixl_seconds=fig["seconds"])
            break
        return super().lookup(keys, lease_s)


def _serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m app.engine.nixl_transport serve",
                                 description="serve this node's KV pool to other nodes over NIXL")
    ap.add_argument("--pool", required=True, help="the node's pool folder (PoolSpec.path)")
    ap.add_argument("--listen", default="127.0.0.1:0", help="host:port of the control channel")
    ap.add_argument("--staging-mib", type=int, default=256)
    ap.add_argument("--mem", choices=["DRAM", "VRAM"], default="DRAM")
    args = ap.parse_args(argv)
    srv = NixlBlockServer(args.pool, args.listen, args.staging_mib << 20, args.mem).start()
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
