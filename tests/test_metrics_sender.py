"""A replica's metrics events are batched into one Serve call per window (prefillshare.deployments.metrics.
MetricsSender), in order, gauges coalesced to their last value; the Metrics deployment replays a
batch onto its registry. Without Ray: a fake handle records the calls."""
from __future__ import annotations

import asyncio

import pytest

from prefillshare.deployments.messages import RequestRecord
from prefillshare.deployments.metrics import MetricsSender, MetricsServer


class _Handle:
    """Records ``handle.batch.remote(events)`` calls as a Serve handle would receive them."""

    def __init__(self):
        self.calls: list[list] = []
        self.batch = self

    def remote(self, events):
        self.calls.append(list(events))


def test_events_of_one_window_go_in_one_call_in_order_with_each_gauges_last_value():
    h = _Handle()

    async def run():
        s = MetricsSender(h, every_s=0.05)
        s.gauge("queue", "Decode-a", "r1", 1)
        s.send("fallback", "missing", 1)
        s.gauge("queue", "Decode-a", "r2", 1)
        s.gauge("queue", "Decode-a", "r1", 0)  # replaces r1's 1
        s.send("overloaded", "ingress")
        assert h.calls == []  # nothing sent before the window ends
        await asyncio.sleep(0.2)
        s.send("fallback", "private", 1)  # a later event opens the next window
        await asyncio.sleep(0.2)

    asyncio.run(run())
    assert h.calls == [
        [("fallback", ("missing", 1)), ("overloaded", ("ingress",)),
         ("queue", ("Decode-a", "r1", 0)), ("queue", ("Decode-a", "r2", 1))],
        [("fallback", ("private", 1))],
    ]


def test_without_an_event_loop_an_event_is_sent_at_once():
    h = _Handle()
    MetricsSender(h).send("fallback", "missing", 1)
    assert h.calls == [[("fallback", ("missing", 1))]]


def test_the_metrics_deployment_replays_a_batch_and_refuses_an_unknown_event():
    server = MetricsServer.func_or_class()
    rec = RequestRecord(model="alpha", agent="", route="completions", ttft_s=0.01, e2e_s=0.1, prompt_tokens=5,
                        generated_tokens=2, shared_tokens_expected=4, shared_tokens_loaded=4, kv_bytes_per_token=64)
    server.batch([("request", (rec,)), ("fallback", ("missing", 2)), ("queue", ("Decode-alpha", "r1", 3))])
    text = server.render().decode()
    assert 'prefillshare_fallbacks_total{reason="missing"} 2.0' in text
    assert 'prefillshare_queue_length{deployment="Decode-alpha",replica="r1"} 3.0' in text
    assert 'prefillshare_requests_total{model="alpha",route="completions",status="ok"} 1.0' in text
    with pytest.raises(ValueError, match="render"):
        server.batch([("render", ())])


def test_a_metrics_call_that_fails_drops_its_events_and_raises_nothing(caplog):
    class Gone:
        def __init__(self):
            self.batch = self

        def remote(self, events):
            raise RuntimeError("Metrics deployment is not running")

    MetricsSender(Gone()).send("fallback", "missing", 1)  # outside a loop: sent (and dropped) at once
    assert "1 events dropped (RuntimeError: Metrics deployment is not running)" in caplog.text
