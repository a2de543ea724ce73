"""Faults for `prefillshare overload`: kill -9 or stall one replica of a running Serve app.

A fault names a deployment (``Decode-lookup``, ``Prefill-base``, ``Orchestrator``). Its
replica processes are found by the title Ray gives every actor process,
``ray::ServeReplica:<app>:<deployment>``, so this works on the machine the app runs on,
without a Ray dashboard. ``kill`` sends SIGKILL to one replica (Serve restarts it; its
engines die with it); ``stall`` stops one with SIGSTOP for a while and resumes it, which is
what a hung peer looks like to its callers (a NIXL block server, an engine in a long GC).
"""
from __future__ import annotations

import os
import re
import signal
import threading
from dataclasses import dataclass
from typing import Literal

import psutil

FaultKind = Literal["kill", "stall"]
FAULT_KINDS: tuple[FaultKind, ...] = ("kill", "stall")


class FaultError(ValueError):
    """A fault spec that cannot be read, or a target with no replica process."""


@dataclass(frozen=True)
class FaultSpec:
    at_s: float  # since the overload phase started
    kind: FaultKind
    deployment: str
    hold_s: float = 0.0  # stall: how long the replica stays stopped

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``AT:kill:DEPLOYMENT`` or ``AT:stall:DEPLOYMENT:SECONDS``."""
        parts = text.strip().split(":")
        try:
            at, kind, dep = float(parts[0]), parts[1], parts[2]
            hold = float(parts[3]) if len(parts) > 3 else 0.0
        except (IndexError, ValueError):
            raise FaultError(f"fault {text!r}: expected AT:kill:DEPLOYMENT or AT:stall:DEPLOYMENT:SECONDS") from None
        if kind not in FAULT_KINDS:
            raise FaultError(f"fault {text!r}: kind must be one of {', '.join(FAULT_KINDS)}")
        if kind == "stall" and hold <= 0:
            raise FaultError(f"fault {text!r}: a stall needs SECONDS > 0")
        if at < 0:
            raise FaultError(f"fault {text!r}: AT must be >= 0")
        return cls(at, kind, dep, hold)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.deployment}" + (f" {self.hold_s:g}s" if self.kind == "stall" else "")


def replica_pids(app: str, deployment: str) -> list[int]:
    """PIDs of the replica processes of ``deployment`` in Serve app ``app`` on this machine."""
    pattern = re.compile(rf"ServeReplica:{re.escape(app)}:{re.escape(deployment)}(?![\w-])")
    pids = []
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            title = " ".join(p.info["cmdline"] or ()) or (p.info["name"] or "")
        except psutil.Error:
            continue
        if pattern.search(title):
            pids.append(p.pid)
    return sorted(pids)


def inject(spec: FaultSpec, app: str) -> int:
    """Apply ``spec`` to the first replica of its deployment; returns that replica's PID."""
    pids = replica_pids(app, spec.deployment)
    if not pids:
        raise FaultError(f"fault {spec.label}: no replica process of {app}:{spec.deployment} on this machine")
    pid = pids[0]
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
