"""No KV without a key: a node's KV block server and its pullers prove they hold the cluster's
KV secret before any metadata or block moves.

HMAC-SHA256 challenge-response, both ways, on the control channel's first lines: the server
greets each connection with a random challenge; the puller answers ``HMAC(secret, client |
challenge)`` and its own nonce; the server answers ``HMAC(secret, server | nonce)``. The
secret never crosses the wire, a recorded answer is useless for another connection, and a
puller never takes block addresses from a server that does not hold the secret either.

The secret comes from the environment: ``PREFILLSHARE_KV_SECRET`` (the KubeRay manifests set
it from a Secret, as they set the API keys), or a file named by ``PREFILLSHARE_KV_SECRET_FILE``.
Without one a block server serves only on a loopback address (one machine: tests, a laptop).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets

__all__ = ["KV_SECRET_ENV", "KV_SECRET_FILE_ENV", "KVAuthError", "load_secret", "new_challenge", "answer",
           "check", "is_loopback", "admit", "authenticate"]

KV_SECRET_ENV = "PREFILLSHARE_KV_SECRET"
KV_SECRET_FILE_ENV = "PREFILLSHARE_KV_SECRET_FILE"
_MIN_BYTES = 16
_CONTEXT = "prefillshare-kv/1"


class KVAuthError(PermissionError):
    """A peer without the KV secret, or a secret that is missing where one is required."""


def load_secret() -> bytes | None:
    """The KV secret from the environment (the variable, else the file it names), or None."""
    value = os.environ.get(KV_SECRET_ENV)
    if not value and os.environ.get(KV_SECRET_FILE_ENV):
        with open(os.environ[KV_SECRET_FILE_ENV], "rb") as f:
            value = f.read().strip().decode()
    if not value:
        return None
    if len(value.encode()) < _MIN_BYTES:
        raise KVAuthError(f"{KV_SECRET_ENV}: use at least {_MIN_BYTES} bytes of secret")
    return value.encode()


def new_challenge() -> str:
    return secrets.token_hex(32)


def answer(secret: bytes, side: str, challenge: str) -> str:
    """What ``side`` ("client" or "server") proves it holds the secret with, for ``challenge``."""
    return hmac.new(secret, f"{_CONTEXT}|{side}|{challenge}".encode(), hashlib.sha256).hexdigest()


def check(secret: bytes, side: str, challenge: str, mac: object) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(answer(secret, side, challenge), mac)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _send(wfile, msg: dict) -> None:
    wfile.write(json.dumps(msg).encode() + b"\n")
    wfile.flush()


def admit(secret: bytes | None, rfile, wfile) -> bool:
    """Server side of a connection's first exchange (JSON lines): whether the peer proved it holds
    ``secret``; a refused peer has been told so. Without a secret every peer is admitted."""
    challenge = new_challenge() if secret else None
    _send(wfile, {"challenge": challenge})
    if secret is None:
        return True
    try:
        msg = json.loads(rfile.readline() or b"{}")
    except (ValueError, OSError):
        msg = {}
    if isinstance(msg, dict) and msg.get("op") == "auth" and check(secret, "client", challenge, msg.get("mac")):
        _send(wfile, {"ok": True, "mac": answer(secret, "server", str(msg.get("nonce")))})
        return True
    try:
        _send(wfile, {"error": "unauthorized: no valid KV secret"})
    except OSError:
        pass
    return False


def authenticate(secret: bytes | None, peer: str, rfile, wfile) -> None:
    """Client side: answer the server's challenge and check its proof; KVAuthError if either
    side lacks the secret (a client that holds one trusts no server that does not ask for it)."""
    challenge = json.loads(rfile.readline() or b"{}").get("challenge")
    if challenge is None:  # a server without a secret (loopback only)
        if secret is not None:
            raise KVAuthError(f"KV peer {peer} does not ask for the KV secret")
        return
    if secret is None:
        raise KVAuthError(f"KV peer {peer} asks for the KV secret; set {KV_SECRET_ENV}")
    nonce = new_challenge()
    _send(wfile, {"op": "auth", "mac": answer(secret, "client", challenge), "nonce": nonce})
    reply = json.loads(rfile.readline() or b"{}")
    if not reply.get("ok"):
        raise KVAuthError(f"KV peer {peer} refused this node: {reply.get('error', 'closed')}")
    if not check(secret, "server", nonce, reply.get("mac")):
        raise KVAuthError(f"KV peer {peer} does not hold the KV secret")
