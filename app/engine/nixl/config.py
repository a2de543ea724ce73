"""The ``vllm-nixl`` hand-over: vLLM's own NixlConnector between the base and other models.

The pool (``prefillshare.app.engine.pool.connector``) is the hand-over on CPU nodes. This mode hands the base's KV
to decoders with vLLM's ``NixlConnector`` instead (device to device on GPUs, UCX over host memory
on the CPU). What this module knows:

- :func:`nixl_transfer_config`: the ``kv_transfer_config`` of a prefill engine (producer, prefix
  caching on) or a decoder / LoRA decode group (consumer, prefix caching off,
  ``enforce_handshake_compat`` off: the decoder has other weights than the base; the project's
  own gate, ``prefillshare.app.models.compat.check``, decides who may consume which base, at build time).
- :class:`NixlSettings`: the UCX / NIXL knobs, one set per kind of node: :data:`CPU_SETTINGS`
  (docs/engine.md, "vLLM NixlConnector hand-over on the CPU", has the measurements) and
  :data:`GPU_SETTINGS` (CUDA IPC reads on: :mod:`prefillshare.app.engine.nixl.kv_transport`).
- The lease: a prefill request finishes holding its blocks for ``kv_lease_duration`` seconds
  (renewed by the decoder's heartbeats once the decoder's scheduler has the request). A read
  after the lease ran out is only logged by vLLM and decodes from released blocks, so the
  orchestration (:mod:`prefillshare.app.engine.nixl.leases`) never sends a decoder request whose pull
  could start after the lease: it prefills privately instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from prefillshare.app.engine.handover import KV_ROLE

__all__ = ["NIXL_CONNECTOR", "NixlSettings", "CPU_SETTINGS", "GPU_SETTINGS", "settings_for", "nixl_transfer_config",
           "lease_for_timeout", "side_channel_env", "listen_port"]

NIXL_CONNECTOR = "NixlConnector"

Role = Literal["producer", "consumer", "both"]
_KV_ROLE = {**KV_ROLE, "both": "kv_both"}  # "both": one engine produces and consumes


@dataclass(frozen=True)
class NixlSettings:
    """Transport knobs, one name each from the config down to the engine.

    ``progress_thread``: NIXL's progress thread, which vLLM always starts and which spins
    (:mod:`prefillshare.app.engine.nixl.connector`: off, the connector's own per-step calls drive UCX).
    ``num_threads``: NIXL's UCX worker threads (vLLM's ``kv_connector_extra_config.num_threads``,
    4 by default in vLLM; 0 lets NIXL's UCX backend run without a thread pool).
    ``backends``: NIXL backends (vLLM's ``backends``). ``ucx_env``: UCX variables
    (``UCX_CUDA_IPC_ENABLE_GET_ZCOPY``, ``UCX_TLS``, ...) carried in ``kv_connector_extra_config``
    and set by the project's connector in the worker process before NIXL creates its UCX context
    (a variable already in that process's environment wins: an operator's override).
    """

    progress_thread: bool = True
    num_threads: int = 4
    backends: tuple[str, ...] = ("UCX",)
    ucx_env: dict[str, str] = field(default_factory=dict)

    def extra_config(self) -> dict[str, Any]:
        return {"progress_thread": self.progress_thread, "num_threads": self.num_threads,
                "backends": list(self.backends), "ucx_env": dict(self.ucx_env)}


# vLLM's defaults are NixlSettings(); measured on this project's 2-core CPU box (docs/engine.md):
# the progress thread off.
CPU_SETTINGS = NixlSettings(progress_thread=False)
# GPU engines: a pull between GPUs of one node over CUDA IPC, which UCX turns off for reads when
# it finds no NVLink (a pull then crossed TCP at ~0.5 GB/s where a push ran at ~49 GB/s: vLLM
# issue 52607; NIXL's later UCX plugin turns it on itself). Pull, not vLLM's push connector: the
# lease protocol (prefillshare.app.engine.nixl.leases) is pull's, and RDMA reads across nodes cost what
# writes do. Progress thread off as on the CPU: the connector's per-step calls drive UCX.
GPU_SETTINGS = NixlSettings(progress_thread=False, ucx_env={"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"})
_BY_DEVICE = {"cpu": CPU_SETTINGS, "cuda": GPU_SETTINGS}


def settings_for(kv_buffer_device: str) -> NixlSettings:
    """The transport settings of an engine whose KV lives on ``kv_buffer_device`` ("cpu", "cuda")."""
    try:
        return _BY_DEVICE[kv_buffer_device]
    except KeyError:
        raise ValueError(f"kv_buffer_device {kv_buffer_device!r} is not one of {sorted(_BY_DEVICE)}") from None
# prefillshare.app.engine.nixl.connector (not imported here: configs are built where vLLM is not installed)
CONNECTOR_MODULE = "prefillshare.app.engine.nixl.connector"


def lease_for_timeout(request_timeout_s: float, margin_s: float = 5.0) -> int:
    """The producer's ``kv_lease_duration``: at least a request timeout, so a lease never runs out
    while the request that reads it may still be waiting; a whole number (vLLM's type)."""
    if request_timeout_s <= 0:
        raise ValueError("request_timeout_s must be > 0")
    return max(6, int(request_timeout_s + margin_s + 0.999))


def nixl_transfer_config(role: Role, *, lease_s: int, settings: NixlSettings | None = None,
                         kv_buffer_device: str = "cpu") -> dict[str, Any]:
    """``kv_transfer_config`` (a dict for vLLM's ``KVTransferConfig``) of one engine in this mode.

    ``role``: "producer" on prefill engines, "consumer" on decoders and LoRA decode groups,
    "both" where one engine does both. ``lease_s``: how long a finished prefill keeps its blocks
    for the decoder's pull (:func:`lease_for_timeout`). ``kv_buffer_device``: "cpu" on CPU nodes,
    "cuda" to register the device cache on GPUs. ``settings``: :func:`settings_for` the device
    unless given.
    """
    settings = settings or settings_for(kv_buffer_device)
    if role not in _KV_ROLE:
        raise ValueError(f"nixl_transfer_config role: {role!r} is not one of {sorted(_KV_ROLE)}")
    if int(lease_s) != lease_s or lease_s < 1:
        raise ValueError("nixl_transfer_config lease_s must be a whole number of seconds >= 1")
    extra = {
        # The decoder's weights differ from the base's: vLLM's handshake hash covers the model path.
        # Layers, block length per layer, KV layout and TP sizes are still checked by vLLM.
        "enforce_handshake_compat": False,
        "kv_lease_duration": int(lease_s),
        **settings.extra_config(),
    }
    out = {
        "kv_connector": NIXL_CONNECTOR,
        "kv_role": _KV_ROLE[role],
        "kv_buffer_device": kv_buffer_device,
        "kv_connector_extra_config": extra,
        # A failed pull recomputes the prompt (a private prefill), never a failed request.
        "kv_load_failure_policy": "recompute",
    }
    # vLLM's connector, its side channel behind the KV secret (and its agent polled: progress_thread)
    out["kv_connector_module_path"] = CONNECTOR_MODULE
    return out


def side_channel_env(port: int | None = None, host: str = "127.0.0.1") -> dict[str, str]:
    """Env of one engine in this mode: its NIXL handshake listener (one port per engine on a host;
    None: a free one, for a replica that starts its engine on a shared node). ``host``: the address
    decoders reach this engine at (the node's IP). UCX variables travel in the connector's config
    (``NixlSettings.ucx_env``)."""
    if port is None:
        port = listen_port(host)
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(int(port))}


# Ray's own ports sit below 20000 (worker ports 10002-19999 by default); the kernel's ephemeral
# range (outgoing connections' local ports) starts at ip_local_port_range's low end.
_LISTEN_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def listen_port(host: str, tries: int = 64) -> int:
    """A free port for an engine's handshake listener, chosen below the kernel's ephemeral range.

    A port found free by binding port 0 comes from the ephemeral range, so between this check
    and the engine's bind an outgoing connection (Ray opens many) can take it as its local port,
    and vLLM's listener thread then dies on EADDRINUSE while its engine waits for it forever (seen
    once in tests/test_serve_vllm_nixl.py). Outgoing connections never take a port below that
    range; a random pick there, checked by binding, collides with another replica's only by chance.
    """
    import random
    import socket

    low = _ephemeral_low()
    if low - 1 <= _LISTEN_PORTS_FROM:
        raise RuntimeError(f"no port range for the NIXL side channel below the ephemeral range ({low})")
    for _ in range(tries):
        port = random.randint(_LISTEN_PORTS_FROM, low - 1)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port for the NIXL side channel on {host} in {_LISTEN_PORTS_FROM}-{low - 1}")
