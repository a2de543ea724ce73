"""The decode router's choice, and the project's routers inside Serve's routing loop.

``rank_by_node`` is pure: it takes (replica id, node id) pairs and a queue-length lookup, as the
Serve router gives it. The routers are then run in Serve's own RequestRouter loop, in-process
(see below). An end-to-end check (requests landing on the prefill node's replica, reading that
node's pool) ran on the retired pool-over-NIXL bed (tests/test_multinode.py, git history up to
4d0f005); the vllm-nixl bed (tests/test_serve_vllm_nixl.py) does not assert where beta's
requests land.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from prefillshare.deployments.messages import DecodeRequest, PrefillRequest
from prefillshare.deployments.routing import node_router
from prefillshare.deployments.routing.locality import locality_keys
from prefillshare.deployments.routing.node_router import preferred_node, rank_by_node
from prefillshare.deployments.routing.prefix_router import PrefixLocalityRouter, rendezvous_rank


def _decode_arg(node: str | None = "node-p") -> DecodeRequest:
    """A decode request as the router sees it (it reads only ``prefer_node``; no sampling needed)."""
    return DecodeRequest("r", (1, 2), None, prefer_node=node)


REPLICAS = [("d1", "node-d"), ("p1", "node-p"), ("d2", "node-d")]


def queues(**q: int):
    return lambda rid: q.get(rid, 0)


def test_a_replica_on_the_prefill_node_comes_first_even_when_busier():
    tiers = rank_by_node(REPLICAS, "node-p", queues(p1=3), imbalance_threshold=4)
    assert tiers[0] == ["p1"]
    assert sorted(tiers[1]) == ["d1", "d2"]


def test_same_node_replicas_are_ordered_by_load():
    replicas = [("p1", "node-p"), ("p2", "node-p"), ("d1", "node-d")]
    assert rank_by_node(replicas, "node-p", queues(p1=2, p2=1), 4) == [["p2", "p1"], ["d1"]]


def test_an_overloaded_same_node_replica_gives_way_to_load():
    tiers = rank_by_node(REPLICAS, "node-p", queues(p1=5, d1=1, d2=2), imbalance_threshold=4)
    assert tiers == [["d1", "d2", "p1"]]


def test_no_preference_or_no_replica_on_that_node_ranks_by_load():
    assert rank_by_node(REPLICAS, None, queues(d1=2, p1=1, d2=0), 4) == [["d2", "p1", "d1"]]
    assert rank_by_node(REPLICAS, "node-x", queues(d1=2, p1=1, d2=0), 4) == [["d2", "p1", "d1"]]
    assert rank_by_node([], "node-p", queues(), 4) == []


def test_the_node_comes_from_the_decode_request():
    req = _decode_arg("node-p")
    assert preferred_node(SimpleNamespace(args=[req])) == "node-p"
    assert preferred_node(SimpleNamespace(args=[])) is None
    assert preferred_node(None) is None


# --- the routers inside Serve's routing loop ---------------------------------------------------
# Serve's RequestRouter runs in the caller's process: it queues PendingRequests, runs the
# router's choose_replicas in routing tasks and probes replicas for their queue length. Here the
# real loop runs in-process over replicas that answer the probe; every wait is bounded, so a
# request the loop loses fails the test instead of hanging CI.

DEPLOYMENT = DeploymentID(name="Decode-x", app_name="t")
ROUTE_TIMEOUT_S = 10


class _Replica:
    """What the routing loop reads of a running replica: id, node, capacity, a queue-length probe."""

    def __init__(self, uid: str, node: str):
        self.replica_id = ReplicaID(unique_id=uid, deployment_id=DEPLOYMENT)
        self.node_id, self.availability_zone = node, None
        self.multiplexed_model_ids: set[str] = set()
        self.max_ongoing_requests = 8

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _router(cls, **kwargs):
    r = cls(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA, use_replica_queue_len_cache=True)
    r.initialize_state(**kwargs)
    r.update_replicas([_Replica("p1", "node-p"), _Replica("d1", "node-d")])
    return r


def _pending(arg, internal_id: str) -> PendingRequest:
    return PendingRequest(args=[arg], kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id=internal_id))




async def _route(router, pendings) -> list[str]:
    chosen = await asyncio.wait_for(asyncio.gather(*[router._choose_replica_for_request(p) for p in pendings]),
                                    ROUTE_TIMEOUT_S)
    return [c.replica_id.unique_id for c in chosen]


@pytest.mark.parametrize("cls,arg", [
    (node_router.NodeAffinityRouter, _decode_arg()),
    (PrefixLocalityRouter, PrefillRequest("r", ((1, 2, 3),), locality_keys=("k1",))),
])
def test_calls_made_while_serving_one_request_all_get_a_replica(cls, arg):
    """Serve gives every handle call a replica makes while serving one request that request's
    internal id: an agent run with several agents on one decoder sends such calls at once. All
    must be routed (Serve's base router fulfils only the request indexed under that id)."""
    async def run():
        router = _router(cls)
        chosen = await _route(router, [_pending(arg, "one-request") for _ in range(3)])
        assert len(chosen) == 3
        if cls is node_router.NodeAffinityRouter:
            assert chosen == ["p1"] * 3  # all on the prefill's node

    asyncio.run(run())


def test_an_exception_in_the_node_ranking_fails_over_to_serves_default_choice(monkeypatch):
    def broken(*_a, **_k):
        raise RuntimeError("ranking broke")

    async def run():
        router = _router(node_router.NodeAffinityRouter)
        failovers: list[tuple[str, str]] = []
        router.report_failover = lambda error: failovers.append((router._deployment_id.name, error))
        monkeypatch.setattr(node_router, "rank_by_node", broken)
        chosen = await _route(router, [_pending(_decode_arg(), "a"), _pending(_decode_arg(), "b")])
        assert set(chosen) <= {"p1", "d1"} and len(chosen) == 2
        assert failovers == [("Decode-x", "RuntimeError")] * 2

    asyncio.run(run())


def test_a_malformed_prefill_request_is_routed_by_default_and_counted():
    bad = PrefillRequest("r", ((1, 2, 3),), locality_keys=5)  # not a sequence of keys

    async def run():
        router = _router(PrefixLocalityRouter)
        failovers: list[str] = []
        router.report_failover = failovers.append
        pending = _pending(bad, "a")
        (chosen,) = await _route(router, [pending])
        assert chosen in {"p1", "d1"} and failovers == ["TypeError"]
        router.on_request_routed(pending, router._replicas_list[0].replica_id, None)  # must not raise either
        assert failovers == ["TypeError", "TypeError"]

    asyncio.run(run())


def test_router_failovers_are_rendered_in_metrics():
    from prefillshare.deployments.metrics import AppMetrics

    m = AppMetrics()
    m.router_failover("Decode-x", "RuntimeError")
    m.router_failover("Decode-x", "RuntimeError")
    assert 'prefillshare_router_failovers_total{deployment="Decode-x",error="RuntimeError"} 2.0' in m.render().decode()


def test_a_router_as_serve_ships_it_tells_the_request_path_how_many_replicas_are_up():
    """Serve pickles a router's module by value (RequestRouterConfig): that must work (no registry in
    the module's globals), and the router must register where deployments/path/serve_engines.py reads
    (deployments/routing/safe_router.py)."""
    from ray import cloudpickle
    from ray.serve.config import RequestRouterConfig

    from prefillshare.deployments.routing import safe_router

    shipped = cloudpickle.loads(RequestRouterConfig(
        request_router_class=node_router.NodeAffinityRouter).get_serialized_request_router_cls())

    async def run():
        router = shipped(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA)
        router.initialize_state()
        assert safe_router.running_replicas("Decode-x") is None  # no replica heard of yet: the app starts
        router.update_replicas([_Replica("p1", "node-p"), _Replica("d1", "node-d")])
        assert safe_router.running_replicas("Decode-x") == 2
        router.update_replicas([_Replica("p1", "node-p")])  # one died
        assert safe_router.running_replicas("Decode-x") == 1
        router.update_replicas([])  # the replicas died: none to route to while they restart
        assert safe_router.running_replicas("Decode-x") == 0

    try:
        asyncio.run(run())
    finally:
        safe_router._ROUTERS.pop("Decode-x", None)


def test_a_fan_outs_calls_ranked_before_any_lands_stay_on_the_replica_taking_the_context():
    """The N calls of a fan-out over one fresh context (an in-engine decoder's: one per agent) reach
    the router together. Each is ranked while the ones before it are in flight on the preferred
    replica; they stay there up to the cached tolerance (4x the threshold), not the bare threshold,
    which would send the fifth to compute the whole context again on the idle replica."""
    async def run():
        router = _router(PrefixLocalityRouter, imbalance_threshold=4)
        candidates = list(router.curr_replicas.values())
        keys = tuple(locality_keys("pm-1", list(range(256)), 32))
        preferred = rendezvous_rank(keys[0], [r.replica_id.unique_id for r in candidates])[0]
        other = next(r.replica_id.unique_id for r in candidates if r.replica_id.unique_id != preferred)
        firsts = []
        for i in range(8):  # each ranked with the ones before it in flight, none landed yet
            pending = _pending(PrefillRequest(f"r{i}", ((1,),), locality_keys=keys), f"r{i}")
            tiers = router.rank(candidates, pending, {preferred: i, other: 0})
            firsts.append(tiers[0][0].replica_id.unique_id)
        return firsts, preferred

    firsts, preferred = asyncio.run(run())
    assert firsts == [preferred] * 8
