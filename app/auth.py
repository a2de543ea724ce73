"""API keys -> tenants, and the tenant's cache salt.

The ingress checks `Authorization: Bearer <key>` against a key ring loaded once from a file or
an env var (a YAML/JSON mapping key -> tenant). A tenant's requests carry a salt derived from
the tenant *name* (never the key) as vLLM's `cache_salt` and into every KV block key
(app/engine/pool/kv_keys.py), so one tenant's cached prefix is invisible to another's requests.
Keys are compared with `hmac.compare_digest` against every entry (no early exit on a match),
and nothing here logs or returns a key.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from prefillshare.app.errors import PrefillShareLibraryError

_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$")
MIN_KEY_CHARS = 16


class AuthError(PrefillShareLibraryError, ValueError):
    """A key source that cannot be used; the message names the source, never a key."""


def tenant_salt(tenant: str) -> str:
    """The cache salt of a tenant: stable across replicas and restarts, reveals no key."""
    return hashlib.sha256(b"prefillshare-tenant\x00" + tenant.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Tenant:
    name: str
    salt: str


class KeyRing:
    """Key -> tenant lookup; keys are held as bytes and only ever compared."""

    def __init__(self, keys: dict[str, str], source: str):
        if not keys:
            raise AuthError(f"{source}: no API keys")
        self._entries: list[tuple[bytes, Tenant]] = []
        for i, (key, tenant) in enumerate(keys.items()):
            if not isinstance(key, str) or len(key) < MIN_KEY_CHARS:
                raise AuthError(f"{source}: entry {i}: keys must be strings of at least {MIN_KEY_CHARS} characters")
            if not isinstance(tenant, str) or not _TENANT.match(tenant):
                raise AuthError(f"{source}: entry {i}: tenant must be a name of letters, digits, '_', '.', '-'")
            self._entries.append((key.encode(), Tenant(tenant, tenant_salt(tenant))))
        self.source = source

    @property
    def tenants(self) -> set[str]:
        return {t.name for _, t in self._entries}

    def lookup(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer <key>` header, or None."""
        if not authorization:
            return None
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        given = key.strip().encode()
        found = None
        for stored, tenant in self._entries:  # every entry is compared: timing says nothing about which
            if hmac.compare_digest(stored, given):
                found = tenant
        return found

    def __repr__(self) -> str:  # never print keys
        return f"KeyRing({len(self._entries)} keys, tenants={sorted(self.tenants)}, source={self.source})"


def _parse(text: str, source: str) -> dict[str, str]:
    try:
        data = yaml.safe_load(text)  # YAML is a superset of JSON
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise AuthError(f"{source}: not a YAML/JSON mapping of key -> tenant{where}") from None
    if not isinstance(data, dict):
        raise AuthError(f"{source}: expected a mapping of API key -> tenant name")
    return data


def load_keyring(keys_file: str | Path | None, keys_env: str | None, required: bool = False,
                 environ: dict[str, str] | None = None) -> KeyRing | None:
    """The key ring from ``keys_file`` and/or the env var ``keys_env``; None means auth is off.

    Both sources merge (a key in both must name the same tenant). ``required`` turns a missing
    source into an error, so a production deployment cannot start open by accident.
    """
    env = os.environ if environ is None else environ
    keys: dict[str, str] = {}
    sources = []
    if keys_file:
        path = Path(keys_file)
        try:
            text = path.read_text()
        except OSError as e:
            raise AuthError(f"auth.keys_file: cannot read {path}: {e.strerror}") from None
        keys.update(_parse(text, f"auth.keys_file {path}"))
        sources.append(str(path))
    if keys_env and env.get(keys_env, "").strip():
        for k, t in _parse(env[keys_env], f"env {keys_env}").items():
            if k in keys and keys[k] != t:
                raise AuthError(f"env {keys_env}: a key also in auth.keys_file names another tenant")
            keys[k] = t
        sources.append(f"env {keys_env}")
    if not sources:
        if required:
            raise AuthError(f"auth.required is set but neither auth.keys_file nor env {keys_env} holds keys")
        return None
    return KeyRing(keys, " + ".join(sources))
