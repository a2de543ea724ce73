"""Which wire the ``vllm-nixl`` hand-over's KV takes: named before a pull, read back from UCX after.

vLLM's NixlConnector pulls (NIXL READ, UCX ``ucp_get``) the base's blocks into the decoder's
cache. UCX picks the transport per peer:

- **Same node, GPU memory** (``kv_buffer_device: cuda``): CUDA IPC (``cuda_ipc``), the copy
  engines moving the bytes device to device. UCX disables CUDA IPC *reads* on GPUs without
  NVLink (its ``CUDA_IPC_ENABLE_GET_ZCOPY`` defaults to auto), and a pull then falls back to
  TCP through host memory; ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` (:data:`CUDA_IPC_READS`) turns
  them on. The peer GPU must be reachable from the reading process: in one pod, or in pods
  that share the node's IPC namespace and see each other's GPUs.
- **Across nodes**: RDMA (GPUDirect where the NIC and the GPU allow) when the pod sees an RDMA
  device (``/sys/class/infiniband``), else TCP.
- **CPU engines** (``kv_buffer_device: cpu``): host memory, shared memory / CMA on one node
  (measured: ~8 GB/s), TCP across nodes.

:func:`plan` names what a placement should get and :func:`describe` is the line an engine logs
when its connector starts; :func:`read_protocols` parses UCX's own protocol table
(``UCX_PROTO_INFO=y``) to say what it did choose (bench/gpu_check.py records both).
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CUDA_IPC_READS", "TransportPlan", "plan", "describe", "rdma_devices", "Protocol",
           "read_protocols", "read_transport"]

# UCX's switch for CUDA IPC reads (ucp_get over cuda_ipc); "y" on GPU engines (NixlSettings)
CUDA_IPC_READS = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
_ON = {"y", "yes", "on", "1", "true"}


def rdma_devices(root: str = "/sys/class/infiniband") -> tuple[str, ...]:
    """RDMA devices this process sees (InfiniBand / RoCE HCAs); () without any."""
    try:
        return tuple(sorted(os.listdir(root)))
    except OSError:
        return ()


@dataclass(frozen=True)
class TransportPlan:
    """The transport a pull should take: to a peer on the same node, and to one on another node
    (UCX's names: ``cuda_ipc``, ``rdma``, ``tcp``), with the reasons."""

    kv_buffer_device: str
    same_node: str
    other_nodes: str
    why: tuple[str, ...]


def _tls_allows(tls: str | None, name: str) -> bool:
    """Does ``UCX_TLS`` (None: UCX's default, all) let UCX use transport ``name``?"""
    if not tls:
        return True
    items = [t.strip() for t in tls.split(",") if t.strip()]
    if items and items[0].startswith("^"):
        return name not in {items[0][1:], *items[1:]}
    aliases = {"cuda_ipc": {"cuda_ipc", "cuda", "all"}, "rdma": {"rc", "rc_x", "rc_v", "ud", "dc", "ib", "all"},
               "tcp": {"tcp", "all"}}
    return bool(aliases.get(name, {name}) & set(items))


def plan(kv_buffer_device: str, env: Mapping[str, str] | None = None,
         rdma: tuple[str, ...] | None = None) -> TransportPlan:
    """What UCX should choose for this engine's pulls, from its KV device, its UCX variables and
    the RDMA devices it sees (``env`` defaults to this process's, ``rdma`` to :func:`rdma_devices`)."""
    env = os.environ if env is None else env
    rdma = rdma_devices() if rdma is None else rdma
    tls = env.get("UCX_TLS")
    why: list[str] = []
    if rdma and _tls_allows(tls, "rdma"):
        other = "rdma"
        why.append(f"RDMA devices {', '.join(rdma)}")
    else:
        other = "tcp"
        why.append("no RDMA device in /sys/class/infiniband" if not rdma else f"UCX_TLS={tls} excludes RDMA")
    if kv_buffer_device != "cuda":
        return TransportPlan(kv_buffer_device, "host memory (shared memory / CMA)", other, tuple(why))
    reads = env.get(CUDA_IPC_READS, "").strip().lower()
    if not _tls_allows(tls, "cuda_ipc"):
        same = other
        why.append(f"UCX_TLS={tls} excludes cuda_ipc")
    elif reads in _ON:
        same = "cuda_ipc"
        why.append(f"{CUDA_IPC_READS}={env[CUDA_IPC_READS]}")
    else:
        same = "cuda_ipc with NVLink, else " + other
        why.append(f"{CUDA_IPC_READS} unset: UCX turns CUDA IPC reads off without NVLink")
    return TransportPlan(kv_buffer_device, same, other, tuple(why))


def describe(p: TransportPlan) -> str:
    """The line an engine logs when its connector starts."""
    return (f"KV pulls (NIXL/UCX, kv_buffer_device={p.kv_buffer_device}): same node -> {p.same_node}; "
            f"other nodes -> {p.other_nodes} ({'; '.join(p.why)})")


@dataclass(frozen=True)
class Protocol:
    """One table of UCX's protocol log: an operation between two memory types and, per message
    size range, the protocol and the lane (``transport/device``) it uses."""

    scope: str          # "intra-node" / "inter-node" (UCX's words)
    operation: str      # e.g. "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0]"
    rows: tuple[tuple[str, str, str], ...]   # (size range, protocol, lane)

    @property
    def is_read(self) -> bool:
        return "remote memory read" in self.operation

    @property
    def transport(self) -> str:
        """The transport of the largest messages (the last row): what a KV block read uses."""
        if not self.rows:
            return ""
        lane = self.rows[-1][2]
        return lane.split("/", 1)[0].strip()


_CELLS = re.compile(r"\|([^|]*)")
_HEADER = re.compile(r"\b(self|intra-node|inter-node)\s+cfg#\d+")


def read_protocols(text: str) -> list[Protocol]:
    """Every protocol table in UCX's log (``UCX_PROTO_INFO=y``), in order. UCX 1.23 (NIXL 1.5.1's)
    writes a table's endpoint (``<context> intra-node cfg#1``) and its operation on two lines of one
    cell each, then a ``Range | Description | Config`` header and the rows; older UCX wrote the two on
    one line."""
    out: list[Protocol] = []
    scope = op = None
    rows: list[tuple[str, str, str]] = []

    def close() -> None:
        nonlocal scope, op, rows
        if op is not None:
            out.append(Protocol(scope or "", op, tuple(rows)))
        scope, op, rows = None, None, []

    for line in text.splitlines():
        if "|" not in line:
            continue
        cells = [c.strip() for c in _CELLS.findall(line[line.index("|"):])]
        cells = [c for c in cells if c != ""]
        head = _HEADER.search(cells[0]) if cells else None
        if head and len(cells) in (1, 2):
            close()
            scope = head.group(1)
            op = cells[1] if len(cells) == 2 else ""
        elif scope is not None and op == "" and len(cells) == 1:
            op = cells[0]
        elif op and len(cells) == 3 and cells != ["Range", "Description", "Config"]:
            rows.append((cells[0], cells[1], cells[2]))
    close()
    return out


def read_transport(text: str, memory: str = "cuda") -> str | None:
    """The transport UCX chose for the largest KV reads into ``memory`` ("cuda" or "host"), from
    its protocol log; None when the log has no such table (UCX_PROTO_INFO off, or no pull)."""
    reads = [p for p in read_protocols(text) if p.is_read and f"into {memory}" in p.operation]
    return reads[-1].transport if reads else None
