"""The soak report's arithmetic (no app): windows by send time, percentiles, drift, error codes."""
from __future__ import annotations

import pytest

from bench.soak import Sample, SoakSpec, percentile, render, summarize


def test_percentile_is_nearest_rank():
    assert percentile([], 95) is None
    assert percentile([3.0], 50) == 3.0
    values = [float(v) for v in range(1, 21)]
    assert percentile(values, 50) == 10.0 and percentile(values, 95) == 19.0 and percentile(values, 100) == 20.0


def test_windows_errors_and_p95_drift():
    samples = [Sample("fanout", 1, 0.5, None), Sample("fanout", 2, 0.7, None), Sample("completion", 3, 0.2, None),
               Sample("fanout", 11, 1.4, None), Sample("completion", 12, 0.1, "429 overloaded"),
               Sample("completion", 19.9, 0.3, None), Sample("fanout", 25, 9.0, "timeout")]
    rep = summarize(samples, duration_s=20, window_s=10, wall_s=31.0, server={"admitted": 7})
    assert rep.sent == 7 and rep.ok == 5 and rep.errors == {"429 overloaded": 1, "timeout": 1}
    assert [(w.requests, w.errors) for w in rep.windows] == [(3, 0), (4, 2)]  # sent after the end: last window
    assert rep.windows[0].p95_s == {"fanout": 0.7, "completion": 0.2}
    assert rep.windows[1].p50_s == {"fanout": 1.4, "completion": 0.3}  # errors carry no latency
    assert rep.p95_drift == {"fanout": pytest.approx(2.0), "completion": pytest.approx(1.5)}
    text = render(rep)
    assert "429 overloaded: 1" in text and "fanout 2.00x" in text and "admitted 7" in text


def test_one_window_has_no_drift_and_bad_specs_are_named():
    rep = summarize([Sample("fanout", 1, 0.5, None)], duration_s=20, window_s=60, wall_s=21)
    assert len(rep.windows) == 1 and rep.p95_drift == {"fanout": None, "completion": None}
    with pytest.raises(ValueError, match="concurrency"):
        SoakSpec(url="http://x", concurrency=0)
    with pytest.raises(ValueError, match="fanout_share"):
        SoakSpec(url="http://x", fanout_share=1.5)
