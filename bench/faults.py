"""Faults for `python -m bench overload`: kill -9 or stall one replica of a running Serve app.

A fault names a deployment (``Decode-lookup``, ``Prefill-base``, ``Orchestrator``; one of another
Serve application as ``APP/DEPLOYMENT``, e.g. ``side/Sidecar``). Its
replica processes are found by the title Ray gives every actor process,
``ray::ServeReplica:<app>:<deployment>``, so this works on the machine the app runs on,
without a Ray dashboard. ``kill`` sends SIGKILL to one replica (Serve restarts it; its
engines die with it); ``stall`` stops one with SIGSTOP for a while and resumes it, which is
what a hung peer looks like to its callers (an engine in a long GC, a NIXL peer that holds
its connections and never answers). ``DEPLOYMENT#engine`` names the replica's engine core
process instead (``VLLM::EngineCore``, a child of the replica): stalling a prefill replica's
engine stalls the NIXL peer that decoders pull from in hand-over "vllm-nixl", while the
replica itself keeps taking requests.
``fill-pool`` names a KV pool directory instead of a deployment: it pins blocks until the pool
has no free space for ``SECONDS`` (the pins' deadline), so producers cannot store a prompt's KV
and decoders must fall back to private prefill until the pins expire.
"""
from __future__ import annotations

import os
import re
import signal
import threading
from dataclasses import dataclass
from typing import Literal

import psutil

from prefillshare.app.errors import PrefillShareLibraryError

FaultKind = Literal["kill", "stall", "fill-pool"]
FAULT_KINDS: tuple[FaultKind, ...] = ("kill", "stall", "fill-pool")
HELD = ("stall", "fill-pool")  # kinds that last SECONDS


class FaultError(PrefillShareLibraryError, ValueError):
    """A fault spec that cannot be read, or a target with no replica process."""


@dataclass(frozen=True)
class FaultSpec:
    at_s: float  # since the overload phase started
    kind: FaultKind
    deployment: str  # fill-pool: the pool's directory
    hold_s: float = 0.0  # stall: how long the replica stays stopped; fill-pool: how long the pins hold

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``AT:kill:DEPLOYMENT``, ``AT:stall:DEPLOYMENT:SECONDS`` or ``AT:fill-pool:POOL_DIR:SECONDS``."""
        parts = text.strip().split(":")
        try:
            at, kind, dep = float(parts[0]), parts[1], parts[2]
            hold = float(parts[3]) if len(parts) > 3 else 0.0
        except (IndexError, ValueError):
            raise FaultError(f"fault {text!r}: expected AT:kill:DEPLOYMENT or AT:stall:DEPLOYMENT:SECONDS") from None
        if kind not in FAULT_KINDS:
            raise FaultError(f"fault {text!r}: kind must be one of {', '.join(FAULT_KINDS)}")
        if kind in HELD and hold <= 0:
            raise FaultError(f"fault {text!r}: {kind} needs SECONDS > 0")
        if at < 0:
            raise FaultError(f"fault {text!r}: AT must be >= 0")
        return cls(at, kind, dep, hold)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.deployment}" + (f" {self.hold_s:g}s" if self.kind in HELD else "")


def _title(p: psutil.Process) -> str | None:
    """A process's title as Ray and vLLM set it (its command line, else its name); None if gone."""
    try:
        return " ".join(p.cmdline() or ()) or p.name()
    except psutil.Error:
        return None


def replica_pids(app: str, deployment: str) -> list[int]:
    """PIDs of the replica processes of ``deployment`` in Serve app ``app`` on this machine."""
    pattern = re.compile(rf"ServeReplica:{re.escape(app)}:{re.escape(deployment)}(?![\w-])")
    return sorted(p.pid for p in psutil.process_iter() if pattern.search(_title(p) or ""))


ENGINE_SUFFIX = "#engine"


def engine_core_pids(replica_pid: int) -> list[int]:
    """The ``VLLM::EngineCore`` processes under one replica process (vLLM renames its core)."""
    try:
        children = psutil.Process(replica_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return sorted(c.pid for c in children if "EngineCore" in (_title(c) or ""))


def fill_pool(path: str, hold_s: float, block_bytes: int = 1 << 16) -> int:
    """Pin blocks of ``block_bytes`` in the pool at ``path`` until none fits; returns how many.
    The pins expire after ``hold_s`` (the pool's own deadline), so the pool recovers by itself."""
    import secrets

    from prefillshare.app.engine.pool.kv_pool import KVPool, PoolMissing

    try:
        pool = KVPool.attach(path)
    except PoolMissing as e:
        raise FaultError(f"fault fill-pool: {e}") from None
    pool.lease_timeout_s = hold_s
    pinned = 0
    while True:
        keys = [secrets.token_hex(16) for _ in range(64)]
        res = pool.reserve(keys, block_bytes, [1] * len(keys), "fill-pool", pins=1, scope="fault")
        pinned += sum(res.stored)
        if not all(res.stored):
            return pinned


def inject(spec: FaultSpec, app: str) -> int:
    """Apply ``spec`` to the first replica of its deployment; returns that replica's PID (for
    fill-pool: the number of blocks pinned)."""
    if spec.kind == "fill-pool":
        return fill_pool(spec.deployment, spec.hold_s)
    target = spec.deployment.removesuffix(ENGINE_SUFFIX)
    app, deployment = target.split("/", 1) if "/" in target else (app, target)
    pids = replica_pids(app, deployment)
    if not pids:
        raise FaultError(f"fault {spec.label}: no replica process of {app}:{deployment} on this machine")
    pid = pids[0]
    if spec.deployment.endswith(ENGINE_SUFFIX):
        cores = engine_core_pids(pid)
        if not cores:
            raise FaultError(f"fault {spec.label}: replica {pid} of {app}:{deployment} has no engine core process")
        pid = cores[0]
    if spec.kind == "kill":
        os.kill(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Timer(spec.hold_s, _resume, args=(pid,))
        resume.daemon = False  # a stopped replica must never stay stopped because the soak ended
        resume.start()
    return pid


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
