"""The keys a prefill module's prefix router routes on: one per full block of a prompt.

A chain of hashes, each block's over its parent's, the module and the tenant's cache salt: two
prompts share a key exactly when they share every token up to that block's end, for one module
and one tenant. The keys serve routing only (a replica that served a prefix is likely to hold it in
vLLM's prefix cache); no engine or hand-over mode reads them, so any mode routes on the same keys.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def locality_keys(prefill_module_id: str, token_ids: Sequence[int], block_size: int,
                  cache_salt: str | None = None) -> tuple[str, ...]:
    """Keys of the full blocks of ``token_ids``. A trailing partial block is left out: its key
    changes with every suffix, so it carries no locality."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    head = hashlib.blake2b(digest_size=16)
    for part in (prefill_module_id.encode(), (cache_salt or "").encode()):
        head.update(struct.pack("<I", len(part)) + part)  # length-prefixed: ("ab", "c") != ("a", "bc")
    keys, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = head.copy()
        h.update(parent)
        h.update(struct.pack(f"<{block_size}q", *token_ids[start:start + block_size]))
        parent = h.digest()
        keys.append(parent.hex())
    return tuple(keys)
