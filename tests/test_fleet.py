"""deployments/fleet.py: what admission's hold and a cold decoder read from the controller's view,
fed snapshots shaped as Serve's DeploymentDetails dumps them (no cluster)."""
from __future__ import annotations

import asyncio

import pytest

from prefillshare.deployments.fleet import UNMEASURED_START_S, Fleet, ReplicaBounds

FIXED = ReplicaBounds(2, 2, False)
SCALED = ReplicaBounds(1, 4, True)
SLEEPS = ReplicaBounds(0, 2, True)


def _details(target: int, *states: str, start: float = 100.0) -> dict:
    return {"target_num_replicas": target,
            "replicas": [{"replica_id": f"r{i}", "state": st, "start_time_s": start} for i, st in enumerate(states)]}


async def _nothing():
    return {}


def _fleet(**bounds: ReplicaBounds) -> tuple[Fleet, list]:
    seen: list = []
    return Fleet(dict(bounds), _nothing, lambda *a: seen.append(a)), seen


def test_a_crash_is_short_until_its_replacement_runs():
    f, seen = _fleet(D=FIXED)
    f.observe({"D": _details(2, "RUNNING", "RUNNING")})
    assert f.short() == []
    f.observe({"D": _details(2, "RUNNING")})  # one died; the target stays
    assert f.short() == ["D"]
    f.observe({"D": _details(2, "RUNNING", "STARTING")})  # the replacement starts: still short
    assert f.short() == ["D"]
    f.observe({"D": _details(2, "RUNNING", "RUNNING")})
    assert f.short() == [] and seen[-1] == ("D", 2, 2)


def test_a_downscale_and_an_upscale_are_not_short():
    f, _ = _fleet(D=SCALED)
    f.observe({"D": _details(2, "RUNNING", "RUNNING")})
    f.observe({"D": _details(1, "RUNNING", "STOPPING")})  # the autoscaler lowered its target first
    assert f.short() == []
    f.observe({"D": _details(1, "RUNNING")})
    f.observe({"D": _details(3, "RUNNING", "STARTING", "STARTING")})  # upscale: nothing lost
    assert f.short() == []
    f.observe({"D": _details(3, "RUNNING", "RUNNING", "STARTING")})
    f.observe({"D": _details(3, "RUNNING", "STARTING")})  # a replica that had started died
    assert f.short() == ["D"]


def test_a_crash_during_an_upscale_is_short():
    f, _ = _fleet(D=SCALED)
    f.observe({"D": _details(1, "RUNNING")})
    f.observe({"D": _details(2, "RUNNING", "STARTING")})
    f.observe({"D": _details(2, "STARTING", "STARTING")})  # the running one died
    assert f.short() == ["D"]


def test_only_a_decoder_that_may_stop_is_cold_and_its_start_is_measured():
    f, _ = _fleet(S=SLEEPS, D=FIXED)
    assert f.cold("S", None) and not f.cold("D", 0)  # never seen: cold; a fixed deployment is never cold
    assert f.start_estimate_s("S") == UNMEASURED_START_S
    f.observe({"S": _details(1, "STARTING", start=1000.0)}, now=1010.0)
    f.observe({"S": _details(1, "RUNNING", start=1000.0)}, now=1047.0)
    assert not f.cold("S", None) and f.start_estimate_s("S") == pytest.approx(47.0)
    assert f.start_estimate_s("D") == pytest.approx(47.0)  # unmeasured: the longest of the app's others
    assert f.cold("S", 0)  # this process's router count wins: it hears of a replica first
    f.observe({"S": _details(0)})
    assert f.cold("S", None)


def test_a_replica_already_running_when_first_seen_is_not_a_measured_start():
    f, _ = _fleet(S=SLEEPS)
    f.observe({"S": _details(1, "RUNNING", start=0.0)}, now=5000.0)
    assert f.start_estimate_s("S") == UNMEASURED_START_S


def test_the_poll_keeps_its_last_view_when_the_controller_does_not_answer():
    calls = []

    async def fetch():
        calls.append(1)
        if len(calls) > 1:
            raise ConnectionError("controller restarting")
        return {"D": _details(2, "RUNNING")}

    async def run():
        f = Fleet({"D": FIXED}, fetch, poll_s=0.01)
        f.start()
        try:
            await asyncio.sleep(0.1)
        finally:
            f.stop()
        assert len(calls) >= 2 and f.target("D") == 2

    asyncio.run(run())


def test_the_router_and_orchestrator_are_shown_but_their_loss_holds_nothing():
    f, seen = _fleet(Orchestrator=ReplicaBounds(2, 2, False, engine=False))
    f.observe({"Orchestrator": _details(2, "RUNNING", "RUNNING")})
    f.observe({"Orchestrator": _details(2, "RUNNING")})
    assert f.short() == [] and seen[-1] == ("Orchestrator", 1, 2)
