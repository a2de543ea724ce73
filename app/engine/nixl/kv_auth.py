"""No KV without a key: the cluster's KV secret, which every engine of the ``vllm-nixl``
hand-over needs before its NIXL side channel answers other machines
(:mod:`prefillshare.app.engine.nixl.side_channel_auth`: CURVE keys derived from it).

The secret comes from the environment: ``PREFILLSHARE_KV_SECRET`` (the KubeRay manifests set
it from a Secret, as they set the API keys), or a file named by ``PREFILLSHARE_KV_SECRET_FILE``.
Without one a side channel serves only on a loopback address (one machine: tests, a laptop).
"""
from __future__ import annotations

import ipaddress
import os

from prefillshare.app.errors import PrefillShareLibraryError

__all__ = ["KV_SECRET_ENV", "KV_SECRET_FILE_ENV", "KVAuthError", "load_secret", "is_loopback"]

KV_SECRET_ENV = "PREFILLSHARE_KV_SECRET"
KV_SECRET_FILE_ENV = "PREFILLSHARE_KV_SECRET_FILE"
_MIN_BYTES = 16


class KVAuthError(PrefillShareLibraryError, PermissionError):
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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
