"""The capacity model (app/scaling.py) moves the way the costs say it must."""
from dataclasses import replace

import pytest

from prefillshare.app.cli import main
from prefillshare.app.scaling import CPU_MEASURED, H200_PAPER, PROFILES, Workload, size, work_ratio


@pytest.mark.parametrize("profile", list(PROFILES.values()), ids=list(PROFILES))
def test_more_fanout_needs_more_decode_replicas_but_not_more_shared_prefill(profile):
    loads = []
    for n in (2, 8, 32):
        s = size(profile, Workload(n, 2048, 64, rate=10.0), "prefillshare")
        loads.append((s.decode_load, s.decode_replicas, s.prefill_load, s.prefill_replicas))
    assert loads[0][0] < loads[1][0] < loads[2][0]
    assert loads[0][1] <= loads[1][1] < loads[2][1]
    assert loads[0][2] == loads[1][2] == loads[2][2]  # one prefill per context whatever N
    assert loads[0][3] == loads[2][3]


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_sharing_needs_about_n_times_fewer_prefill_replicas(n):
    w = Workload(n, 4096, 32, rate=5.0, utilization=1.0)
    a, b = size(H200_PAPER, w, "prefillshare"), size(H200_PAPER, w, "disagg")
    assert b.prefill_load == pytest.approx(n * a.prefill_load)
    assert n * a.prefill_replicas - n < b.prefill_replicas <= n * a.prefill_replicas
    assert a.decode_load == pytest.approx(b.decode_load)  # decoders do the same work either way
    assert work_ratio(H200_PAPER, w, "disagg") > 1


def test_bottleneck_moves_to_kv_transfer_when_the_link_is_thin():
    w = Workload(8, 4096, 32, rate=1.0)
    assert size(CPU_MEASURED, w, "prefillshare").bottleneck in ("prefill", "decode")
    thin = replace(CPU_MEASURED, link_bytes_per_s=1e6)
    s = size(thin, w, "prefillshare")
    assert s.bottleneck == "kv_transfer"
    assert s.link_utilization <= w.utilization + 1e-9  # nodes were added until the links carry it
    assert s.decode_nodes > size(CPU_MEASURED, w, "prefillshare").decode_nodes
    assert size(thin, w, "colocated").bottleneck == "decode"  # nothing crosses nodes there


def test_prefill_dominates_without_sharing_and_decode_with_it_at_large_fanout():
    w = Workload(16, 2048, 128, rate=20.0)
    assert size(H200_PAPER, w, "disagg").bottleneck == "prefill"
    assert size(H200_PAPER, w, "prefillshare").bottleneck == "decode"


def test_kv_bytes_follow_the_model_shape():
    # Llama-3.1-8B: 2 (K,V) * 32 layers * 8 KV heads * 128 dims * 2 bytes
    assert H200_PAPER.kv_bytes_per_token == 131072
    s = size(H200_PAPER, Workload(4, 1001, 8, rate=1.0), "prefillshare")
    assert s.kv_bytes_per_request == 1000 * 131072  # every prompt token but the last
    # a decode node pulls a context once: pulls are capped by the decode nodes, not by N
    assert s.kv_pulls_per_session == min(4, s.decode_nodes)
    assert size(H200_PAPER, Workload(4, 1001, 8, rate=1.0), "disagg").kv_pulls_per_session == 4


def test_bad_workload_names_the_field():
    with pytest.raises(ValueError, match="fanout"):
        Workload(0, 10, 10, 1.0)
    with pytest.raises(ValueError, match="rate"):
        Workload(2, 10, 10, 0)
    with pytest.raises(ValueError, match="system"):
        size(CPU_MEASURED, Workload(2, 10, 10, 1.0), "nope")


def test_cli_prints_a_row_per_system(capsys):
    assert main(["capacity", "--fanout", "2,8", "--context", "1024", "--output", "32", "--rate", "0.2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 2 ") or line.startswith("| 8 ")]
    assert len(rows) == 8
    assert {r.split("|")[5].strip() for r in rows} == {"prefillshare", "in-engine", "disagg", "colocated"}
    with pytest.raises(SystemExit, match="fanout"):
        main(["capacity", "--fanout", "0"])


def test_in_engine_decoders_move_no_kv_and_run_both_stages_on_the_modules_replicas():
    w = Workload(8, 4096, 64, rate=2.0)
    ie, ps = size(H200_PAPER, w, "in-engine"), size(H200_PAPER, w, "prefillshare")
    assert ie.kv_bytes_per_s == 0 and ie.kv_pulls_per_session == 0 and ie.decode_replicas == 0
    # the same work as the shared prefill + decoders, less the KV loads, on one group of replicas
    assert ie.prefill_load == pytest.approx(ps.prefill_load + ps.decode_load
                                            - w.rate * w.fanout * ps.kv_bytes_per_request / H200_PAPER.kv_load_bytes_per_s)


def test_packing_a_sessions_agents_cuts_the_kv_pulls():
    w = Workload(16, 8192, 64, rate=20.0)
    spread, packed = size(H200_PAPER, w, "prefillshare"), size(H200_PAPER, w, "prefillshare", pack=True)
    assert packed.kv_pulls_per_session == 2 < spread.kv_pulls_per_session  # 16 agents on 8-GPU nodes
    assert packed.kv_bytes_per_s < spread.kv_bytes_per_s
    assert size(H200_PAPER, w, "disagg", pack=True).kv_pulls_per_session == 16  # nothing to share there


def test_the_config_check_plans_for_max_replicas():
    """`prefillshare capacity --config`: the autoscaler cannot go past max_replicas, so that is what
    must hold the replicas a workload needs."""
    from prefillshare.app.config import load_config
    from prefillshare.app.scaling import PROFILES, Workload, fleet_check

    base = {"prefill_modules": [{"name": "base", "model": "checkpoints/base"}],
            "decoders": [{"name": "lookup", "model": "checkpoints/decoders/lookup",
                          "placement": {"autoscaling": {"max_replicas": 2}}}]}
    profile, heavy = PROFILES["cpu-measured"], Workload(8, 2048, 64, 3.0, 0.7)
    [line] = fleet_check(load_config(base), profile, [heavy])
    assert "decode needs" in line and "allow 2" in line and "raise max_replicas" in line
    base["decoders"][0]["placement"]["autoscaling"]["max_replicas"] = 64
    base["prefill_modules"][0]["placement"] = {"autoscaling": {"max_replicas": 64}}
    [line] = fleet_check(load_config(base), profile, [heavy])
    assert line.endswith(")") and "fits" in line
