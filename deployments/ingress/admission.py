"""Ingress admission: a bounded count of generation requests in flight on one Router replica.

Beyond the bound the Router answers 429 with Retry-After at once, so an overloaded app sheds
load with a clear answer instead of letting requests queue until clients time out. A slot is
held from admission until the response (or its stream) ends, whatever way it ends, and how it
ended is counted per route, so that admitted = completed + failed + cancelled + in flight
holds at every moment: no request is lost without a trace, also across a replica restart.

A fixed bound lets accepted requests wait as long as the bound divided by what the app
completes per second: 64 slots at 2 answers/s (a 2-core box at twice its saturation, engines
restarting) is a 30 s wait. With a latency target the bound follows the load instead
(:class:`LatencyLimit`), so accepted requests keep a bounded wait and the rest are shed.
"""
from __future__ import annotations

import math
import time
from typing import Literal

from prefillshare.app.config import LimitsConfig

Outcome = Literal["completed", "failed", "cancelled"]
OUTCOMES: tuple[Outcome, ...] = ("completed", "failed", "cancelled")


# The fraction of the target a window's 95th percentile is steered under. AIMD probes upward until a
# window is past its setpoint, so the windows' percentile hovers at the setpoint; a minute's 95th
# percentile came out over the target in 4 of 10 minutes steered at the target itself, and 0-24% over it
# in 3 of 9 minutes steered at 0.85 of it, past a replica's restart (docs/reliability.md).
STEER_AT = 0.7


class LatencyLimit:
    """AIMD on the time from a request's arrival to its complete answer, as TCP does on loss.

    Samples are judged a window at a time: when the window's 95th percentile (the percentile the
    target promises) exceeds ``steer_at`` of the target the limit shrinks by ``backoff`` (not below
    ``floor``); when it is under that while the limit was binding (a request was turned away) it grows
    by one (not above ``ceiling``); from a ``start`` below the ceiling it grows faster until its first
    shrink (TCP's slow start): by the setpoint over the window's percentile, at most doubling, at
    least one more. A request still unanswered past the setpoint also shrinks it, at
    once (:meth:`overdue`; while one is, the limit does not grow): a window is judged only when its
    last answer ends, and a Router starting at its ceiling under twice the load it can answer admitted
    a burst that took the first minute's 95th percentile past the target before any window was
    judged. While a replica on the request path is missing it does not grow (:meth:`hold`). Each
    change starts an epoch, and only requests admitted in the current epoch are judged:
    those admitted under the old limit would otherwise shrink it again. The whole answer is judged,
    not its first token: on CPUs every decode step slows as the batch grows, so a first token in
    time says little about the rest (measured: a first-output target of 5 s held the p95 of
    complete answers at 10-14 s).
    """

    def __init__(self, ceiling: int, floor: int, target_s: float, window: int = 16, backoff: float = 0.75,
                 steer_at: float = STEER_AT, start: int | None = None):
        if not 1 <= floor <= ceiling:
            raise ValueError(f"LatencyLimit needs 1 <= floor ({floor}) <= ceiling ({ceiling})")
        start = ceiling if start is None else min(max(start, floor), ceiling)
        if target_s <= 0 or window < 1 or not 0 < backoff < 1 or not 0 < steer_at <= 1:
            raise ValueError("LatencyLimit needs target_s > 0, window >= 1, 0 < backoff < 1 and 0 < steer_at <= 1")
        self.ceiling, self.floor, self.target_s = ceiling, floor, target_s
        self.setpoint_s = target_s * steer_at
        self.window, self.backoff = window, backoff
        self.value = float(start)
        self.slow_start = start < ceiling
        self.epoch = 0
        self._waits: list[float] = []
        self._binding = False
        self._held = False
        self._before_loss = 0.0  # the limit when the hold began

    @property
    def limit(self) -> int:
        return int(self.value)

    def turned_away(self) -> None:
        self._binding = True

    def hold(self, short: bool) -> None:
        """Whether a deployment on the request path runs fewer replicas than its autoscaler's target
        (deployments/fleet.py: a crash, not a scale event). When one is lost the limit shrinks once;
        until it is back the limit grows one per window in time, as usual, but not past what it was
        before the loss, and not by slow start: the replacement starting takes CPU on a shared node,
        and answers that are fast just after the loss say little about the next minute (measured:
        grown from 7 to 12 while a replacement imported vLLM, then past the target while its engine
        started). Not growing at all kept the limit at 4-5 with answers at 1.5-3 s while restarts
        overlapped (answers per second at 0.57x saturation over a run with a kill every 100 s,
        docs/reliability.md). Once it is back the limit returns to what it was before the loss, if
        it is lower: the replacement's share of the load comes back as soon as it answers, not one
        request per window; slow answers shrink it again as usual."""
        if short and not self._held:
            self._before_loss = self.value
            self._shrink()
        elif not short and self._held and self._before_loss > self.value:
            self.value = self._before_loss
            self._waits, self._binding = [], False
            self.epoch += 1
        self._held = short

    def overdue(self, oldest_since: float, now: float) -> None:
        """The oldest unanswered request of this epoch arrived at ``oldest_since`` (monotonic): past the
        setpoint it is as a slow window, and shrinks the limit now."""
        if now - oldest_since > self.setpoint_s:
            self._shrink()

    def _shrink(self) -> None:
        old = self.value
        self.value = max(float(self.floor), self.value * self.backoff)
        self._waits, self._binding, self.slow_start = [], False, False
        if int(self.value) != int(old):
            self.epoch += 1

    def observe(self, wait_s: float, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self._waits.append(wait_s)
        if len(self._waits) < self.window:
            return
        p95 = sorted(self._waits)[math.ceil(0.95 * len(self._waits)) - 1]
        if p95 > self.setpoint_s:
            self._shrink()
            return
        old = self.value
        if self._binding and self._held:
            self.value = max(self.value, min(self._before_loss, self.value + 1.0))
        elif self._binding:
            if self.slow_start:
                # a busy box answers in about the time of what is in flight: grow toward the setpoint, at
                # most doubling (doubling blindly, two Routers went from 8 in flight to 44 in 15 s at 2x)
                grow = min(2.0, self.setpoint_s / max(p95, 1e-6))
                self.value = min(float(self.ceiling), max(self.value + 1.0, self.value * grow))
            else:
                self.value = min(float(self.ceiling), self.value + 1.0)
        self._waits, self._binding = [], False
        if int(self.value) != int(old):
            self.epoch += 1


class Admission:
    def __init__(self, limit: int, steer: LatencyLimit | None = None):
        if limit < 1:
            raise ValueError("Admission limit must be >= 1")
        if steer is not None and steer.ceiling != limit:
            raise ValueError(f"the latency limit's ceiling ({steer.ceiling}) must be the admission limit ({limit})")
        self.max_limit = limit
        self.steer = steer
        self.inflight = 0
        self.admitted = 0
        self.rejected = 0
        self.outcomes: dict[str, dict[str, int]] = {}  # route -> outcome -> count
        self._unanswered: dict[int, tuple[float, int]] = {}  # a held Slot's id -> (its arrival, its epoch)

    @property
    def limit(self) -> int:
        return self.steer.limit if self.steer else self.max_limit

    def hold(self, short: bool) -> None:
        """A deployment on the request path is short of replicas (LatencyLimit.hold); no-op when fixed."""
        if self.steer is not None:
            self.steer.hold(short)

    def try_enter(self) -> bool:
        """Take a slot; False (counted as rejected) when every slot is taken. With a latency target,
        the oldest unanswered request of the limit's epoch is judged first (LatencyLimit.overdue)."""
        if self.steer is not None and self._unanswered:
            epoch = self.steer.epoch
            oldest = min((since for since, ep in self._unanswered.values() if ep == epoch), default=None)
            if oldest is not None:
                self.steer.overdue(oldest, time.monotonic())
        if self.inflight >= self.limit:
            self.rejected += 1
            if self.steer:
                self.steer.turned_away()
            return False
        self.inflight += 1
        self.admitted += 1
        return True

    def leave(self, route: str = "", outcome: Outcome = "cancelled", took_s: float | None = None,
              epoch: int = 0) -> None:
        """Free a slot; ``took_s`` (arrival to answer; None: not judged) steers the limit."""
        if self.inflight <= 0:
            raise RuntimeError("Admission.leave without a matching try_enter")
        if outcome not in OUTCOMES:
            raise ValueError(f"Admission outcome {outcome!r} is not one of {OUTCOMES}")
        self.inflight -= 1
        counts = self.outcomes.setdefault(route, dict.fromkeys(OUTCOMES, 0))
        counts[outcome] += 1
        if self.steer is not None and took_s is not None:
            self.steer.observe(took_s, epoch)

    def snapshot(self) -> dict:
        return {"inflight": self.inflight, "limit": self.limit, "max_limit": self.max_limit, "admitted": self.admitted,
                "rejected": self.rejected, "outcomes": {r: dict(c) for r, c in sorted(self.outcomes.items())}}


def admission_for(limits: LimitsConfig) -> Admission:
    """A Router replica's admission from the app's limits: fixed, or steered by a latency target."""
    ceiling = limits.max_inflight_requests
    steer = None
    if limits.admission_target_s is not None:
        steer = LatencyLimit(ceiling, min(limits.min_inflight_requests, ceiling), limits.admission_target_s,
                             start=limits.initial_inflight_requests)
    return Admission(ceiling, steer)


def arrived_at(stamp: str | None, max_wait_s: float) -> float:
    """When a request arrived, on this process's monotonic clock: now, or earlier by what a trusted
    front proxy's stamp says it waited (``t=<epoch seconds>``, ``t=<epoch ms>`` or ``t=<epoch µs>``,
    the forms nginx and Heroku send), at most ``max_wait_s``. A stamp that does not parse or lies in
    the future counts as no wait: the clock is a steering input, not a reason to refuse a request."""
    now = time.monotonic()
    if not stamp:
        return now
    try:
        value = float(stamp.strip().removeprefix("t="))
    except ValueError:
        return now
    if not math.isfinite(value) or value <= 0:
        return now
    while value > 1e11:  # ms or µs since the epoch (1e11 s is the year 5138)
        value /= 1000.0
    return now - min(max(time.time() - value, 0.0), max_wait_s)


class Slot:
    """One admitted request's slot; releasing twice is harmless (stream end and cleanup both
    call it) and the first release's outcome is the one counted. Its clock starts at the request's
    arrival (``since``, monotonic; default: now), which may precede its admission."""

    def __init__(self, admission: Admission, route: str = "", since: float | None = None):
        self._admission = admission
        self._route = route
        self._held = True
        self._since = time.monotonic() if since is None else since
        self._epoch = admission.steer.epoch if admission.steer else 0
        self._late = False
        admission._unanswered[id(self)] = (self._since, self._epoch)

    def late(self) -> None:
        """The request ran out of time, or a queue downstream shed it: past any latency target."""
        self._late = True

    def release(self, outcome: Outcome = "cancelled") -> None:
        """A complete answer's time since arrival (a late one's: infinite) steers the limit; a
        request that failed fast or that its client left says nothing about the load."""
        if self._held:
            self._held = False
            self._admission._unanswered.pop(id(self), None)
            took = math.inf if self._late else time.monotonic() - self._since if outcome == "completed" else None
            self._admission.leave(self._route, outcome, took, self._epoch)

    def __del__(self):
        # A streaming response dropped before its generator ever ran never reaches the
        # generator's `finally`; the slot is freed when the last reference goes (the client left).
        self.release("cancelled")
