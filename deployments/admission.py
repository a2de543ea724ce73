"""Ingress admission: a bounded count of generation requests in flight on one Router replica.

Beyond the bound the Router answers 429 with Retry-After at once, so an overloaded app sheds
load with a clear answer instead of letting requests queue until clients time out. A slot is
held from admission until the response (or its stream) ends, whatever way it ends.
"""
from __future__ import annotations


class Admission:
    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError("Admission limit must be >= 1")
        self.limit = limit
        self.inflight = 0
        self.admitted = 0
        self.rejected = 0

    def try_enter(self) -> bool:
        """Take a slot; False (counted as rejected) when every slot is taken."""
        if self.inflight >= self.limit:
            self.rejected += 1
            return False
        self.inflight += 1
        self.admitted += 1
        return True

    def leave(self) -> None:
        if self.inflight <= 0:
            raise RuntimeError("Admission.leave without a matching try_enter")
        self.inflight -= 1


class Slot:
    """One admitted request's slot; releasing twice is harmless (stream end and cleanup both call it)."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission.leave()

    def __del__(self):
        # A streaming response dropped before its generator ever ran never reaches the
        # generator's `finally`; the slot is freed when the last reference goes.
        self.release()
