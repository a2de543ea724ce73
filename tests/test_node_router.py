"""The decode router's choice: a replica on the prefill's node first, unless it is overloaded.

Pure: ``rank_by_node`` takes (replica id, node id) pairs and a queue-length lookup, as the
Serve router gives it. The end-to-end check (requests land on the prefill node's replica and
pull nothing over NIXL) is in tests/test_multinode.py.
"""
from __future__ import annotations

from types import SimpleNamespace

from deployments.messages import DecodeRequest, SamplingSpec
from deployments.node_router import preferred_node, rank_by_node

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
    req = DecodeRequest("r", (1, 2), SamplingSpec(max_tokens=1), prefer_node="node-p")
    assert preferred_node(SimpleNamespace(args=[req])) == "node-p"
    assert preferred_node(SimpleNamespace(args=[])) is None
    assert preferred_node(None) is None
