"""Ingress admission: a bounded count of generation requests in flight on one Router replica.

Beyond the bound the Router answers 429 with Retry-After at once, so an overloaded app sheds
load with a clear answer instead of letting requests queue until clients time out. A slot is
held from admission until the response (or its stream) ends, whatever way it ends, and how it
ended is counted per route, so that admitted = completed + failed + cancelled + in flight
holds at every moment: no request is lost without a trace, also across a replica restart.
"""
from __future__ import annotations

from typing import Literal

Outcome = Literal["completed", "failed", "cancelled"]
OUTCOMES: tuple[Outcome, ...] = ("completed", "failed", "cancelled")


class Admission:
    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError("Admission limit must be >= 1")
        self.limit = limit
        self.inflight = 0
        self.admitted = 0
        self.rejected = 0
        self.outcomes: dict[str, dict[str, int]] = {}  # route -> outcome -> count

    def try_enter(self) -> bool:
        """Take a slot; False (counted as rejected) when every slot is taken."""
        if self.inflight >= self.limit:
            self.rejected += 1
            return False
        self.inflight += 1
        self.admitted += 1
        return True

    def leave(self, route: str = "", outcome: Outcome = "cancelled") -> None:
        if self.inflight <= 0:
            raise RuntimeError("Admission.leave without a matching try_enter")
        if outcome not in OUTCOMES:
            raise ValueError(f"Admission outcome {outcome!r} is not one of {OUTCOMES}")
        self.inflight -= 1
        counts = self.outcomes.setdefault(route, dict.fromkeys(OUTCOMES, 0))
        counts[outcome] += 1

    def snapshot(self) -> dict:
        return {"inflight": self.inflight, "limit": self.limit, "admitted": self.admitted,
                "rejected": self.rejected, "outcomes": {r: dict(c) for r, c in sorted(self.outcomes.items())}}


class Slot:
    """One admitted request's slot; releasing twice is harmless (stream end and cleanup both
    call it) and the first release's outcome is the one counted."""

    def __init__(self, admission: Admission, route: str = ""):
        self._admission = admission
        self._route = route
        self._held = True

    def release(self, outcome: Outcome = "cancelled") -> None:
        if self._held:
            self._held = False
            self._admission.leave(self._route, outcome)

    def __del__(self):
        # A streaming response dropped before its generator ever ran never reaches the
        # generator's `finally`; the slot is freed when the last reference goes (the client left).
        self.release("cancelled")
