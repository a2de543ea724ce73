"""One slab: a pre-allocated shared-memory region cut into fixed-size slots, with a header per slot.

Two files per slab under the pool's folder (normally /dev/shm): ``slab-<B>.data`` holds the
slots of ``B``-byte blocks one after another (stride ``B`` rounded up to 64 bytes), and
``slab-<B>.gen`` holds a 16-byte header per slot: the slot's generation (u64, a seqlock: odd
while a writer is at work) and its crc32 (u32, written in the pool's check mode only).

The data file is allocated when the slab is created or grown (``posix_fallocate``: the memory
is taken once, not by page faults on the hot path) and each process maps it on first use with
its page tables populated. Headers are mapped at once (the scheduler reads only them).
Which slot holds what is the index's business (:mod:`prefillshare.app.engine.pool.kv_pool`), not this module's.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import numpy as np

from prefillshare.app.errors import PrefillShareLibraryError

__all__ = ["Slab", "SlotOutOfRange", "HEADER_BYTES", "HEADER_FORMAT"]

HEADER_BYTES = 16
HEADER_FORMAT = "<QI4x"  # generation, crc32, padding (for transports written in other languages)


_UNMAPPED = np.empty((0, 2), dtype=np.uint64)  # the headers before their first mapping

class SlotOutOfRange(PrefillShareLibraryError, LookupError):
    """A slot number beyond the slab (or a slab that does not exist yet)."""


def _stride(slot_bytes: int) -> int:
    return -(-slot_bytes // 64) * 64


class Slab:
    """This process's mapping of one slab."""

    def __init__(self, root: str, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self.stride = _stride(slot_bytes)
        self.data_path = os.path.join(root, f"slab-{slot_bytes}.data")
        self.gen_path = os.path.join(root, f"slab-{slot_bytes}.gen")
        if not os.path.exists(self.gen_path):
            raise SlotOutOfRange(f"no slab of {slot_bytes}-byte slots in {root}")
        self.nslots = 0
        self._data: mmap.mmap | None = None
        self._data_slots = 0
        self._gens: np.ndarray = _UNMAPPED  # numpy u64 [nslots, 2] view of the headers
        self._tensor = None
        self.remap()

    def remap(self) -> None:
        """(Re)map the headers to the files' current size (another process may have grown them)."""
        n = os.path.getsize(self.gen_path) // HEADER_BYTES
        if n == self.nslots and self._gens is not _UNMAPPED:
            return
        with open(self.gen_path, "r+b") as f:
            hdr = mmap.mmap(f.fileno(), n * HEADER_BYTES)
        self._gens = np.frombuffer(hdr, dtype=np.uint64).reshape(n, 2)
        self.nslots = n

    @property
    def data(self) -> mmap.mmap:
        """The slots' bytes, mapped on first use (and again after the slab grew)."""
        if self._data is None or self._data_slots != self.nslots:
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            with open(self.data_path, "r+b") as f:
                self._data = mmap.mmap(f.fileno(), self.nslots * self.stride, flags=flags)
            self._data_slots = self.nslots
            self._tensor = None
        return self._data

    def ensure(self, slot: int) -> None:
        if slot >= self.nslots:
            self.remap()
            if slot >= self.nslots:
                raise SlotOutOfRange(f"slot {slot} beyond slab of {self.nslots} slots")

    @staticmethod
    def create(root: str, slot_bytes: int, nslots: int) -> None:
        """Create or grow the slab's files to ``nslots`` slots (callers serialise: the index's lock)."""
        for name, size, allocate in ((f"slab-{slot_bytes}.data", nslots * _stride(slot_bytes), True),
                                     (f"slab-{slot_bytes}.gen", nslots * HEADER_BYTES, False)):
            fd = os.open(os.path.join(root, name), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                have = os.fstat(fd).st_size
                if have < size:
                    if allocate:
                        try:
                            os.posix_fallocate(fd, have, size - have)
                        except OSError:  # a file system without fallocate: sparse, pages come on first write
                            os.ftruncate(fd, size)
                    else:
                        os.ftruncate(fd, size)
            finally:
                os.close(fd)

    # -- generations (the seqlock) ------------------------------------------------------
    def gen(self, slot: int) -> int:
        return int(self._gens[slot, 0])

    def gens(self, slots: Sequence[int]) -> np.ndarray:
        """Generations of many slots at once."""
        return self._gens[list(slots), 0].copy()

    def set_gen(self, slot: int, gen: int) -> None:
        self._gens[slot, 0] = gen

    def crc(self, slot: int) -> int:
        return int(self._gens[slot, 1]) & 0xFFFFFFFF

    def set_crc(self, slot: int, crc: int) -> None:
        self._gens[slot, 1] = crc

    # -- bytes ----------------------------------------------------------------------------
    def view(self, slot: int, nbytes: int | None = None) -> memoryview:
        off = slot * self.stride
        return memoryview(self.data)[off : off + (nbytes or self.slot_bytes)]

    def tensor(self):
        """The whole slab as a ``[nslots, stride]`` uint8 tensor (zero copy, shared)."""
        data = self.data
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(data, dtype=torch.uint8).view(self.nslots, self.stride)
        return self._tensor
