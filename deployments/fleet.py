"""The engine deployments' replicas as Serve's controller sees them: how many run, how many the
autoscaler wants, and how long an engine takes to start.

The Router and the Orchestrator each keep one :class:`Fleet`, refreshed every ``POLL_S`` from the
controller (deployments/ray_internals.py ``deployment_details``). Three things read it:

- admission's hold (deployments/ingress/admission.py): a deployment is *short* when fewer
  replicas run than both the autoscaler's target and the most that ran since that target was
  set. A crash is short until its replacement answers; an upscale (target up, nothing lost) and
  a downscale (target down first) are not.
- a decoder whose autoscaling allows ``min_replicas: 0`` is *cold* while none of its replicas
  runs: its first request starts one and waits for it (deployments/path/fanout.py), or is
  answered 503 with a Retry-After of the measured engine start.
- /metrics: ``prefillshare_deployment_replicas`` and ``prefillshare_deployment_target_replicas``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("ray.serve")

POLL_S = 2.0
# An engine start not yet measured in this app (a decoder deployed at zero): a replica of the
# shipped models starts in 40-90 s on 2 cores with its neighbours busy (docs/serving.md "Autoscaling").
UNMEASURED_START_S = 120.0


@dataclass(frozen=True)
class ReplicaBounds:
    """What the build set for one engine deployment's count."""

    min_replicas: int
    max_replicas: int
    autoscaled: bool
    engine: bool = True  # an engine deployment: its loss holds admission (the Router and Orchestrator are only shown)

    @property
    def can_sleep(self) -> bool:
        """Its autoscaler may stop the last replica (``min_replicas: 0``)."""
        return self.autoscaled and self.min_replicas == 0


@dataclass
class _View:
    target: int
    running: int
    peak: int  # most replicas running since ``target`` was set


class Fleet:
    """Replica counts of the engine deployments named in ``bounds`` ({Serve deployment: bounds})."""

    def __init__(self, bounds: dict[str, ReplicaBounds], fetch: Callable[[], Awaitable[dict[str, dict[str, Any]]]],
                 report: Callable[[str, int, int], None] | None = None, poll_s: float = POLL_S) -> None:
        self.bounds, self.poll_s = bounds, poll_s
        self._fetch, self._report = fetch, report
        self._views: dict[str, _View] = {}
        self._starting: dict[str, float] = {}  # replica id -> its start time, while seen STARTING
        self._start_s: dict[str, float] = {}  # deployment -> its latest measured engine start
        self._task: asyncio.Task | None = None

    # --- what the controller says ---
    def observe(self, details: dict[str, dict[str, Any]], now: float | None = None) -> None:
        """Take one snapshot of the controller's deployment details."""
        now = time.time() if now is None else now
        seen: set[str] = set()
        for name in self.bounds:
            d = details.get(name)
            if d is None:
                continue
            replicas = d.get("replicas") or []
            target = int(d.get("target_num_replicas", 0))
            running = 0
            for r in replicas:
                rid, state = r.get("replica_id"), r.get("state")
                seen.add(rid)
                if state == "RUNNING":
                    running += 1
                    started = self._starting.pop(rid, None)
                    if started is not None:  # seen starting, now answers: one measured start (to POLL_S)
                        self._start_s[name] = max(0.0, now - started)
                elif state in ("STARTING", "PENDING_MIGRATION", "UPDATING", "RECOVERING") and rid:
                    self._starting.setdefault(rid, float(r.get("start_time_s") or now))
            view = self._views.get(name)
            if view is None or view.target != target:
                self._views[name] = _View(target, running, running)
            else:
                view.running, view.peak = running, max(view.peak, running)
            if self._report is not None:
                self._report(name, running, target)
        # a replica that died while starting is no start to measure
        self._starting = {rid: t for rid, t in self._starting.items() if rid in seen}

    def short(self) -> list[str]:
        """Deployments that lost a replica the autoscaler still wants (a crash, not a scale event)."""
        return [n for n, v in self._views.items()
                if v.running < min(v.target, v.peak) and self.bounds[n].engine]

    def target(self, deployment: str) -> int | None:
        view = self._views.get(deployment)
        return None if view is None else view.target

    def can_sleep(self, deployment: str) -> bool:
        b = self.bounds.get(deployment)
        return b is not None and b.can_sleep

    def cold(self, deployment: str, running_here: int | None) -> bool:
        """A deployment allowed to stop when idle runs no replica now. ``running_here``: this
        process's router count (None: unknown), which hears of a new replica first."""
        if not self.can_sleep(deployment):
            return False
        if running_here is not None:
            return running_here == 0
        view = self._views.get(deployment)
        return view is None or view.running == 0

    def start_estimate_s(self, deployment: str) -> float:
        """How long a replica of ``deployment`` is expected to take to start: its own latest
        measured start, else the longest of the app's other engines, else UNMEASURED_START_S."""
        if deployment in self._start_s:
            return self._start_s[deployment]
        return max(self._start_s.values(), default=UNMEASURED_START_S)

    # --- the poll ---
    def start(self) -> None:
        """Poll from now on; a no-op when polling already, or outside an event loop (a replica's
        constructor may run outside one: its first request starts it then)."""
        if self._task is not None or not self.bounds:
            return
        try:
            self._task = asyncio.get_running_loop().create_task(self._poll())
        except RuntimeError:
            pass

    async def refresh(self) -> None:
        self.observe(await self._fetch())

    async def _poll(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - a missed poll keeps the last view; the next one retries
                log.debug("fleet: controller poll failed (%s: %s)", type(e).__name__, e)
            await asyncio.sleep(self.poll_s)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def serve_fleet(bounds: dict[str, ReplicaBounds], events=None) -> Fleet:
    """The fleet of this replica's application, polled from Serve's controller; with ``events`` (a
    MetricsSender) each poll's counts go to /metrics."""
    from ray import serve

    from prefillshare.deployments.ray_internals import deployment_details

    app = serve.get_replica_context().app_name
    report = None
    if events is not None:
        def report(name: str, running: int, target: int) -> None:
            events.gauge("fleet", name, (running, target))
    return Fleet(bounds, lambda: deployment_details(app), report)
