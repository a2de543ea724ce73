"""No NIXL metadata without the KV secret: vLLM's NixlConnector side channel over CurveZMQ.

vLLM's handshake listener (a ZMQ ROUTER on ``VLLM_NIXL_SIDE_CHANNEL_HOST:PORT``) answers any
peer with the engine's NIXL agent metadata, and with that metadata a peer can READ every KV
block the engine registered, whatever the tenant's ``cache_salt``. With the cluster's KV secret
set (``PREFILLSHARE_KV_SECRET``, :mod:`prefillshare.app.engine.nixl.kv_auth`), every engine of the ``vllm-nixl``
hand-over speaks CURVE on that channel instead:

- one key pair for the cluster, derived from the secret (HMAC-SHA256), so the server's public
  key, which a CURVE client must know to say its first word, is itself known only to holders of
  the secret; it never crosses the wire;
- the listener's ZAP handler admits only that key pair's public key, so a client must also hold
  the pair's secret key;
- the metadata travels encrypted.

A refused attempt (a plain ZMQ peer, a CURVE peer with other keys) fails its handshake before
any message is read; it is counted (:data:`REFUSED`, on /metrics as
``prefillshare_nixl_refused_handshakes_total`` through the connector's stats) and logged. Without a
secret the listener may bind only a loopback address (one machine: tests, a laptop), the same rule
as before.

vLLM opens both ends of the channel through one helper, ``zmq_ctx(socket_type, path)``, looked up
as a module global of its scheduler half (the listener) and its worker half (the handshake):
:func:`install` puts :func:`curve_zmq_ctx` in both places, in the engine's process, from the
project's connector (:mod:`prefillshare.app.engine.nixl.connector`). ``tests/test_side_channel_auth.py``
runs vLLM's own listener through it, and breaks if vLLM renames either global.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import threading
from collections.abc import Iterator
from typing import Any

from prefillshare.app.engine.nixl.kv_auth import (
    KV_SECRET_ENV,
    KV_SECRET_FILE_ENV,
    KVAuthError,
    is_loopback,
    load_secret,
)

__all__ = ["CurveKeys", "curve_keys", "curve_zmq_ctx", "install", "REFUSED", "REFUSED_METRIC", "VLLM_HOLDERS"]

log = logging.getLogger(__name__)

_KEY_CONTEXT = b"prefillshare-nixl-side-channel/1"
# vLLM's modules that look ``zmq_ctx`` up at call time: the listener's and the handshake's
VLLM_HOLDERS = ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler",
                "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")


class _Refusals:
    """Handshakes this process's listeners refused, counted thread-safe (each is also logged)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self._reported = 0

    def add(self) -> int:
        with self._lock:
            self.count += 1
            return self.count

    def take(self) -> int:
        """Refusals since the last call: what the engine's next stats report carries to /metrics."""
        with self._lock:
            new, self._reported = self.count - self._reported, self.count
            return new


REFUSED = _Refusals()
# the counter of REFUSED on /metrics (prefillshare.app.engine.nixl.connector), pushed with the engine's vllm:* families
REFUSED_METRIC = "prefillshare_nixl_refused_handshakes"


class CurveKeys:
    """The cluster's CURVE key pair (Z85 bytes, as pyzmq takes them)."""

    def __init__(self, public: bytes, secret: bytes) -> None:
        self.public, self.secret = public, secret


def curve_keys(kv_secret: bytes) -> CurveKeys:
    """The key pair every engine derives from the KV secret: same secret, same pair."""
    import zmq
    from zmq.utils import z85

    secret = z85.encode(hmac.new(kv_secret, _KEY_CONTEXT, hashlib.sha256).digest())
    return CurveKeys(zmq.curve_public(secret), secret)


class _OnlyOurKey:
    """ZAP credentials check: the cluster's public key, nothing else."""

    def __init__(self, public: bytes) -> None:
        self._public = public

    def callback(self, domain: str, key: bytes) -> bool:  # key: Z85, as pyzmq's authenticator passes it
        ok = hmac.compare_digest(bytes(key), self._public)
        if not ok:
            _refused("a CURVE key that is not the cluster's")
        return ok


def _refused(reason: str) -> None:
    log.warning("NIXL side channel: refused a peer (%s); %d refused in this process", reason, REFUSED.add())


def _watch_handshakes(sock) -> threading.Thread:
    """Count and log the listener's failed handshakes (a peer without the secret never gets past
    CURVE's first message), from the socket's monitor, until ``sock.disable_monitor()``. The
    thread owns the monitor socket: ZMQ sockets must not be closed from another thread."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    failed = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    mon = sock.get_monitor_socket(failed | zmq.EVENT_MONITOR_STOPPED)

    def run() -> None:
        try:
            while True:
                event = recv_monitor_message(mon)["event"]
                if event == zmq.EVENT_MONITOR_STOPPED:
                    return
                if event != zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # AUTH is counted by _OnlyOurKey
                    _refused("no CURVE handshake with the cluster's key")
        except zmq.ZMQError:
            pass
        finally:
            mon.close(linger=0)

    t = threading.Thread(target=run, daemon=True, name="nixl_side_channel_monitor")
    t.start()
    return t


def _socket(ctx, socket_type: int, path: str, keys: CurveKeys):
    import zmq

    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    if path.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    if socket_type == zmq.ROUTER:
        sock.curve_server = True
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.bind(path)
    else:
        sock.curve_serverkey = keys.public
        sock.curve_publickey = keys.public
        sock.curve_secretkey = keys.secret
        sock.connect(path)
    return sock


def curve_zmq_ctx(keys: CurveKeys):
    """A stand-in for vLLM's ``zmq_ctx(socket_type, path)`` whose sockets speak CURVE with ``keys``:
    the ROUTER (vLLM's listener) as a CURVE server behind a ZAP handler, the REQ (vLLM's
    handshake) as a CURVE client."""
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    @contextlib.contextmanager
    def zmq_ctx(socket_type: Any, path: str) -> Iterator[Any]:
        if socket_type not in (zmq.ROUTER, zmq.REQ):
            raise ValueError(f"NIXL side channel: unexpected socket type {socket_type}")
        ctx = zmq.Context()
        auth = monitor = sock = None
        try:
            if socket_type == zmq.ROUTER:
                auth = ThreadAuthenticator(ctx, log=log)
                auth.start()
                auth.configure_curve_callback("*", credentials_provider=_OnlyOurKey(keys.public))
            sock = _socket(ctx, socket_type, path, keys)
            if socket_type == zmq.ROUTER:
                monitor = _watch_handshakes(sock)
            yield sock
        finally:
            if monitor is not None and sock is not None:
                sock.disable_monitor()
                monitor.join(5)
            if sock is not None:
                sock.close(linger=0)
            if auth is not None:
                auth.stop()
            ctx.destroy(linger=0)

    return zmq_ctx


def install(side_channel_host: str) -> bool:
    """Guard this process's NIXL side channel: CURVE with the cluster's keys when a KV secret is
    set (True), vLLM's plain channel on a loopback ``side_channel_host`` otherwise (False).
    KVAuthError when the channel would answer other machines without a secret."""
    secret = load_secret()
    if secret is None:
        if not is_loopback(side_channel_host):
            raise KVAuthError(f"NIXL side channel on {side_channel_host}: set {KV_SECRET_ENV} (or "
                              f"{KV_SECRET_FILE_ENV}); without a secret it serves only on loopback")
        return False
    import importlib

    patched = curve_zmq_ctx(curve_keys(secret))
    for name in VLLM_HOLDERS:
        module = importlib.import_module(name)
        if not callable(getattr(module, "zmq_ctx", None)):
            raise KVAuthError(f"{name}.zmq_ctx is gone (a vLLM upgrade?): the NIXL side channel cannot "
                              "be guarded, refusing to run it unguarded")
        setattr(module, "zmq_ctx", patched)  # noqa: B010 - a module attribute the checker cannot see
    return True
