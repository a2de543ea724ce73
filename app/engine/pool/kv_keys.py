"""The one KV key scheme: (prefill module id, tenant salt, block-hash chain).

A block key is ``sha256(prefill_module_id | tenant_salt | parent_key | block tokens)``,
chained over full blocks of ``block_size`` tokens; the trailing partial block gets its own
key over its (fewer) tokens, chained to the last full block. Every field is length-prefixed,
so no two different inputs hash the same bytes. The router, the pool and the connector all
build keys here; a decoder uses the prefill module id from its manifest, never its own name.

Per-adapter KV (a prefill engine that holds the decoders' own LoRA adapters): the salt also
names the request's adapter (:func:`key_salt`), so one adapter never loads KV another computed.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from prefillshare.app.prompt_split import split_prompt

__all__ = ["BlockKey", "block_keys", "shared_block_keys", "key_salt"]


@dataclass(frozen=True)
class BlockKey:
    """One block of a prompt: its key and the token span it covers."""

    key: str  # hex sha256
    index: int  # block index in the prompt
    start: int  # first token position
    num_tokens: int  # tokens in this block (< block_size only for the trailing partial block)
    full: bool


def key_salt(tenant_salt: str | None, adapter: str | None = None) -> str | None:
    """The salt of a request's keys: its tenant's, plus its LoRA adapter's name when KV is per adapter."""
    if adapter is None:
        return tenant_salt
    return f"{tenant_salt or ''}|lora:{adapter}"


def _field(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def block_keys(
    prefill_module_id: str,
    tenant_salt: str | None,
    token_ids: Sequence[int],
    block_size: int,
) -> list[BlockKey]:
    """Keys of every block of ``token_ids``: full blocks, then the partial one if any."""
    if not prefill_module_id:
        raise ValueError("prefill_module_id is required for a KV key")
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    head = _field(prefill_module_id.encode()) + _field((tenant_salt or "").encode())
    keys: list[BlockKey] = []
    parent = b""
    n = len(token_ids)
    for i, start in enumerate(range(0, n, block_size)):
        toks = token_ids[start : start + block_size]
        h = hashlib.sha256(head)
        h.update(_field(parent))
        h.update(_field(struct.pack(f"<{len(toks)}i", *toks)))
        digest = h.digest()
        keys.append(BlockKey(digest.hex(), i, start, len(toks), len(toks) == block_size))
        parent = digest
    return keys


def shared_block_keys(
    prefill_module_id: str,
    tenant_salt: str | None,
    prompt_token_ids: Sequence[int],
    block_size: int,
) -> list[BlockKey]:
    """Keys of the part of a prompt whose KV the prefill module hands over (all but the last token)."""
    shared, _ = split_prompt(prompt_token_ids)
    return block_keys(prefill_module_id, tenant_salt, shared, block_size)
