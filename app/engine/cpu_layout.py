"""How one engine's paged KV blocks map to bytes in the pool, and back.

vLLM's CPU attention (CPU_ATTN) keeps one tensor per layer, ``[num_blocks, kv_heads,
block_size, 2*head_size]``; inside each (block, head) the memory holds K transposed
``[head_size, block_size]`` followed by V ``[block_size, head_size]`` ("vec" ISA; checked
against the kernel in tests/test_kv_pool.py). The pool stores a block as the raw bytes of that
block in every layer, ``[layers, kv_heads, block_size, 2*head_size]``, so producer and
consumer must share the layout: :func:`fingerprint` names it and the consumer refuses others.

Partial blocks (the trailing block of the shared prompt part): only its first ``t`` tokens
are written into the decoder's block, as strided per-token copies (K columns, V rows) where
the layout is known; for other layouts (e.g. AMX packing) the whole block is copied, which is
also correct because the decoder writes its own tokens at positions >= t before reading them.
On other devices the block and token dims are found from the tensor's shape (flash
attention ``[2, num_blocks, block_size, heads, head]``, Triton ``[num_blocks, 2, block_size,
heads, head]``, ...): a block is the slice at ``block_dim``, a partial block narrows ``token_dim``.

Two ways to move blocks: :meth:`BlockLayout.gather` / :meth:`BlockLayout.scatter` copy one block
at a time (the reference the tests compare against), :meth:`BlockLayout.save_slots` /
:meth:`BlockLayout.load_slots` move all blocks of a request between the paged cache and slab
slots (``[n, *block_shape]``) with one ``index_select`` / ``index_copy_`` per layer and per run
of consecutive slots, or, where block ids and slots both run consecutively (a fresh cache hands
out consecutive blocks), one plain strided copy per layer and run; with the cache on a GPU and
the slab in host memory, through one device staging buffer and one host<->device copy per run.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["BlockLayout", "fingerprint", "slot_runs", "joint_runs"]


def joint_runs(slots: Sequence[int], block_ids: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """(first index, first slot, first block id, length) of each run where slots and block ids both
    count up by one: such a run is one plain (strided) copy per layer, no index op."""
    runs: list[tuple[int, int, int, int]] = []
    for i, (s, b) in enumerate(zip(slots, block_ids, strict=True)):
        if runs and runs[-1][1] + runs[-1][3] == s and runs[-1][2] + runs[-1][3] == b:
            runs[-1] = (*runs[-1][:3], runs[-1][3] + 1)
        else:
            runs.append((i, s, b, 1))
    return runs


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, s, 1))
    return runs


def _isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return _get_attn_isa(dtype, block_size, head_size)
    except Exception:  # noqa: BLE001 - non-CPU builds lack the backend
        return "unknown"


def request_amx_tiles() -> None:
    """Ask Linux for this process's AMX tile permission, on CPUs that have AMX.

    vLLM's CPU attention runs AMX kernels for bf16 (its "amx" ISA) but leaves the permission to
    oneDNN's matmuls, which ask for it on their first AMX use. A decoder's first forward is one
    token over a cached prompt: the attention kernel runs before any matmul large enough to
    have asked, and the worker dies of SIGILL (measured on an AMX Xeon VM: every decoder of the
    default app died on its first request, bf16). Idempotent and cheap; a no-op elsewhere."""
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


def fingerprint(device: str, dtype: torch.dtype, num_layers: int, num_kv_heads: int,
                head_size: int, block_size: int) -> str:
    """Name of a block layout; two engines can exchange blocks only if theirs are equal."""
    kind = f"cpu_attn-{_isa(dtype, block_size, head_size)}" if device == "cpu" else f"{device}-flash"
    dt = str(dtype).replace("torch.", "")
    return f"{kind}/{dt}/L{num_layers}/H{num_kv_heads}/D{head_size}/B{block_size}"


@dataclass
class BlockLayout:
    """Gather/scatter of whole or partial blocks across all layers of one engine."""

    caches: list[torch.Tensor]  # one per attention layer, model order
    block_size: int
    num_kv_heads: int
    head_size: int
    layout: str
    block_dim: int = 0  # where the block index is, in a cache tensor
    token_dim: int = 1  # where the token index is, in one block's slice (non-CPU layouts)

    @classmethod
    def from_caches(cls, caches: list[torch.Tensor], block_size: int, num_kv_heads: int,
                    head_size: int, num_blocks: int | None = None, device_layout: bool | None = None) -> BlockLayout:
        """``device_layout``: read block/token dims from the shape (GPU layouts); default: on
        any device but the CPU (tests pass True to check GPU layouts with CPU tensors)."""
        if not caches:
            raise ValueError("no KV cache tensors registered")
        t = caches[0]
        dev = "cpu" if t.device.type == "cpu" else t.device.type
        generic = device_layout if device_layout is not None else dev != "cpu"
        name = fingerprint(dev if not generic or dev != "cpu" else "generic", t.dtype, len(caches), num_kv_heads,
                           head_size, block_size)
        if not generic:
            return cls(list(caches), block_size, num_kv_heads, head_size, name)
        shape = list(t.shape)
        nb = num_blocks if num_blocks is not None else max(s for s in shape[:2])
        block_dim = shape.index(nb) if nb in shape[:2] else 0
        rest = shape[:block_dim] + shape[block_dim + 1 :]
        if block_size not in rest:
            raise ValueError(f"cannot find the token dim of KV cache shape {tuple(shape)}")
        token_dim = rest.index(block_size)
        return cls(list(caches), block_size, num_kv_heads, head_size,
                   f"{name}/shape{'x'.join(map(str, rest))}", block_dim, token_dim)

    @property
    def on_cpu(self) -> bool:
        """The CPU attention layout (block dim 0, K transposed per head)."""
        return self.layout.startswith("cpu_attn-")

    @property
    def dtype(self) -> torch.dtype:
        return self.caches[0].dtype

    @property
    def device(self) -> torch.device:
        return self.caches[0].device

    def _block(self, layer: int, block_id: int) -> torch.Tensor:
        c = self.caches[layer]
        return c[block_id] if self.on_cpu else c.select(self.block_dim, block_id)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (len(self.caches), *self._block(0, 0).shape)

    @property
    def block_nbytes(self) -> int:
        n = 1
        for s in self.block_shape:
            n *= s
        return n * self.caches[0].element_size()

    def gather(self, block_id: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """All layers of one block as a contiguous ``block_shape`` tensor (on the cache's device)."""
        if out is None:
            out = torch.empty(self.block_shape, dtype=self.dtype, device=self.caches[0].device)
        for i in range(len(self.caches)):
            out[i].copy_(self._block(i, block_id))
        return out

    def slots_view(self, slab: torch.Tensor, first: int, n: int) -> torch.Tensor:
        """Slots ``first .. first+n`` of a slab tensor (``[nslots, stride]`` uint8) as
        ``[n, *block_shape]`` of the cache dtype (no copy)."""
        return slab[first : first + n, : self.block_nbytes].view(self.dtype).view(n, *self.block_shape)

    def _pairs(self, run: torch.Tensor):
        """(cache part, slots part) pairs whose block dim is 0, so that each index op moves whole
        contiguous blocks (fast on CPU and GPU); a flash cache ``[2, blocks, ...]`` gives its K and
        V halves. Other block dims fall back to one strided op per layer."""
        for i, c in enumerate(self.caches):
            v = run[:, i]
            if self.block_dim == 0:
                yield 0, c, v
            elif self.block_dim == 1:
                for j in range(c.shape[0]):
                    yield 0, c[j], v[:, j]
            else:
                yield self.block_dim, c, v.movedim(0, self.block_dim)

    def save_slots(self, block_ids: Sequence[int], slab: torch.Tensor, slots: Sequence[int]) -> None:
        """Copy whole blocks ``block_ids`` of every layer into ``slots`` of ``slab``, batched.

        Per run of consecutive slots and per layer one ``index_select`` writing straight into
        the slots (same device), or into a device staging buffer followed by one copy to host.
        """
        if len(block_ids) != len(slots):
            raise ValueError("save_slots: one slot per block id")
        dev = self.device
        joint = joint_runs(slots, block_ids)
        if len(joint) * 4 <= len(slots):  # long runs of consecutive blocks: plain copies
            for _, s0, b0, n in joint:
                dst = self.slots_view(slab, s0, n)
                stage = dst if dst.device == dev else torch.empty(dst.shape, dtype=self.dtype, device=dev)
                for dim, c, v in self._pairs(stage):
                    v.copy_(c.narrow(dim, b0, n))
                if stage is not dst:
                    dst.copy_(stage, non_blocking=dst.is_pinned())
        else:
            for first, s0, n in slot_runs(slots):
                ids = torch.tensor(block_ids[first : first + n], dtype=torch.long, device=dev)
                dst = self.slots_view(slab, s0, n)
                stage = dst if dst.device == dev else torch.empty(dst.shape, dtype=self.dtype, device=dev)
                for dim, c, v in self._pairs(stage):
                    torch.index_select(c, dim, ids, out=v)
                if stage is not dst:
                    dst.copy_(stage, non_blocking=dst.is_pinned())
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()  # bytes are in the slab before they are published

    def load_slots(self, slab: torch.Tensor, slots: Sequence[int], block_ids: Sequence[int],
                   last_tokens: int | None = None) -> None:
        """Copy ``slots`` of ``slab`` into blocks ``block_ids``, batched; the last block only up to
        ``last_tokens`` tokens when given (a partial block: as :meth:`scatter` does)."""
        if len(block_ids) != len(slots):
            raise ValueError("load_slots: one slot per block id")
        n_all = len(slots)
        partial = last_tokens is not None and last_tokens < self.block_size and n_all > 0
        whole = n_all - 1 if partial else n_all
        dev = self.device
        joint = joint_runs(list(slots[:whole]), list(block_ids[:whole]))
        if len(joint) * 4 <= whole:  # long runs of consecutive blocks: plain copies
            for _, s0, b0, n in joint:
                src = self.slots_view(slab, s0, n)
                if src.device != dev:
                    src = src.to(dev, non_blocking=src.is_pinned())
                for dim, c, v in self._pairs(src):
                    c.narrow(dim, b0, n).copy_(v)
        else:
            for first, s0, n in slot_runs(list(slots[:whole])):
                ids = torch.tensor(block_ids[first : first + n], dtype=torch.long, device=dev)
                src = self.slots_view(slab, s0, n)
                if src.device != dev:
                    src = src.to(dev, non_blocking=src.is_pinned())
                for dim, c, v in self._pairs(src):
                    c.index_copy_(dim, ids, v)
        if partial and last_tokens is not None:
            self.scatter(self.slots_view(slab, slots[-1], 1)[0], block_ids[-1], last_tokens)
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    def scatter(self, src: torch.Tensor, block_id: int, num_tokens: int) -> None:
        """Write ``src`` (``block_shape``) into block ``block_id``: all of it, or its first tokens."""
        if src.device != self.caches[0].device:
            src = src.to(self.caches[0].device)
        full = num_tokens >= self.block_size
        vec = self.layout.startswith("cpu_attn-vec/") or self.layout.startswith("cpu_attn-vec16/")
        for i in range(len(self.caches)):
            dst = self._block(i, block_id)
            if full:
                dst.copy_(src[i])
            elif self.on_cpu and vec:
                # (heads, bs, 2D) memory = K^T [D, bs] then V [bs, D] per head.
                h, bs, d = self.num_kv_heads, self.block_size, self.head_size
                dflat, sflat = dst.view(h, 2 * bs * d), src[i].reshape(h, 2 * bs * d)
                dk, sk = dflat[:, : d * bs].view(h, d, bs), sflat[:, : d * bs].view(h, d, bs)
                dv, sv = dflat[:, d * bs :].view(h, bs, d), sflat[:, d * bs :].view(h, bs, d)
                dk[:, :, :num_tokens].copy_(sk[:, :, :num_tokens])
                dv[:, :num_tokens, :].copy_(sv[:, :num_tokens, :])
            elif not self.on_cpu:
                dst.narrow(self.token_dim, 0, num_tokens).copy_(src[i].narrow(self.token_dim, 0, num_tokens))
            else:
                dst.copy_(src[i])
