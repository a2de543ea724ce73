"""`python -m bench overload`: the classification and the report's arithmetic (no app). The short run
against a real app, at twice its saturation with the Orchestrator killed (-9) under it, is
tests/shared_app/test_serve_faults.py's last test."""
from __future__ import annotations

import json

import pytest

from bench.faults import FaultError, FaultSpec, replica_pids
from bench.overload import Mix, OverloadSpec, Sample, classify_events, classify_response, completed_rate
from bench.overload_report import render, summarize


def test_fault_specs_parse_and_bad_ones_are_named():
    assert FaultSpec.parse("120:kill:Decode-lookup") == FaultSpec(120, "kill", "Decode-lookup")
    assert FaultSpec.parse("30:stall:Prefill-base:5").hold_s == 5
    assert FaultSpec.parse("60:fill-pool:/dev/shm/p:30") == FaultSpec(60, "fill-pool", "/dev/shm/p", 30)
    for bad, match in (("x:kill:D", "expected"), ("1:boom:D", "kind"), ("1:stall:D", "SECONDS"), ("-1:kill:D", ">= 0"),
                       ("1:fill-pool:/p", "SECONDS")):
        with pytest.raises(FaultError, match=match):
            FaultSpec.parse(bad)
    with pytest.raises(ValueError, match="after the run's end"):
        OverloadSpec(url="http://x", duration_s=60, faults=(FaultSpec(60, "kill", "D"),))
    with pytest.raises(ValueError, match="bad_share"):
        Mix(bad_share=2)


def test_no_replica_of_an_unknown_deployment():
    assert replica_pids("no-such-app", "Decode-x") == []


def test_a_stall_of_another_applications_deployment_stops_then_resumes_its_replica():
    """``APP/DEPLOYMENT`` names a replica of another Serve application (a sidecar app beside the
    overloaded one); found by the process title Ray gives it, here worn by a sleeping child."""
    import subprocess
    import sys
    import time

    import psutil

    from bench.faults import inject

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "ray::ServeReplica:side:Sidecar"])
    try:
        with pytest.raises(FaultError, match="prefillshare:Sidecar"):  # not in the overloaded app itself
            inject(FaultSpec(0, "stall", "Sidecar", 0.5), "prefillshare")
        assert inject(FaultSpec(0, "stall", "side/Sidecar", 1.0), "prefillshare") == child.pid
        states = []
        for _ in range(30):  # the stop lands once the child is back from the kernel; the resume 1 s later
            states.append(psutil.Process(child.pid).status())
            time.sleep(0.1)
        assert psutil.STATUS_STOPPED in states, states
        assert states[-1] != psutil.STATUS_STOPPED, states
    finally:
        child.kill()
        child.wait()


def test_a_stall_of_a_replicas_engine_stops_its_engine_core_not_the_replica():
    """``DEPLOYMENT#engine``: the replica's ``VLLM::EngineCore`` child (a NIXL peer in hand-over
    vllm-nixl) is stopped and resumed; the replica process keeps running. Here a sleeping parent
    wears the replica's title and its child the engine core's."""
    import subprocess
    import sys
    import time

    import psutil

    from bench.faults import inject

    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', 'VLLM::EngineCore']); "
            "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code, "ray::ServeReplica:prefillshare:Prefill-base"])
    try:
        for _ in range(50):  # the child starts
            kids = psutil.Process(parent.pid).children()
            if kids:
                break
            time.sleep(0.1)
        (core,) = kids
        lone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                 "ray::ServeReplica:prefillshare:Router"])
        try:
            with pytest.raises(FaultError, match="no engine core"):  # a replica without an engine
                inject(FaultSpec(0, "stall", "Router#engine", 0.5), "prefillshare")
        finally:
            lone.kill()
            lone.wait()
        assert inject(FaultSpec(0, "stall", "Prefill-base#engine", 1.0), "prefillshare") == core.pid
        states = {"core": [], "replica": []}
        for _ in range(30):
            states["core"].append(core.status())
            states["replica"].append(psutil.Process(parent.pid).status())
            time.sleep(0.1)
        assert psutil.STATUS_STOPPED in states["core"], states
        assert states["core"][-1] != psutil.STATUS_STOPPED, states
        assert psutil.STATUS_STOPPED not in states["replica"], states
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait()


def test_fill_pool_pins_every_free_slot_until_the_deadline(tmp_path):
    from bench.faults import fill_pool
    from prefillshare.app.engine.pool.kv_pool import KVPool, PoolSpec

    owner = KVPool(PoolSpec(path=str(tmp_path / "pool"), capacity_bytes=1 << 20))
    pinned = fill_pool(owner.path, hold_s=30, block_bytes=1 << 16)
    assert pinned == 16  # 1 MiB of 64 KiB blocks
    stats = owner.stats()
    assert stats.pinned_blocks == 16
    res = owner.reserve(["ab" * 16], 1 << 16, [1], "x")  # nothing more fits while the pins hold
    assert res.stored == [False]
    with pytest.raises(FaultError, match="no KV pool"):
        fill_pool(str(tmp_path / "none"), hold_s=1)


def test_answers_are_classified_typed_or_lost():
    body = b'{"error": {"message": "m", "type": "rate_limit_error", "param": null, "code": "overloaded"}}'
    assert classify_response("completion", 429, {"retry-after": "1"}, body, 1) == "shed"
    assert classify_response("completion", 429, {}, body, 1) == "lost 429 without Retry-After"
    restarting = json.dumps({"error": {"message": "decoder x: no replica", "type": "server_error", "param": None,
                                       "code": "decoder_unavailable"}}).encode()
    assert classify_response("fanout", 503, {"retry-after": "1"}, restarting, 2) == "shed"  # before admission
    assert classify_response("fanout", 503, {}, restarting, 2) == "lost 503 without Retry-After"
    assert classify_response("completion", 503, {}, body.replace(b"overloaded", b"unavailable"), 1) == "error unavailable"
    assert classify_response("completion", 500, {}, b"Internal Server Error", 1).startswith("lost")
    assert classify_response("completion", 200, {}, b'{"choices": [{"text": "x"}]}', 1) == "ok"
    run = b'{"results": [{"agent": "a", "text": "x"}, {"agent": "b", "error": "decoder_unavailable: gone"}]}'
    assert classify_response("fanout", 200, {}, run, 2) == "error decoder_unavailable"
    assert classify_response("fanout", 200, {}, b'{"results": [{"agent": "a", "text": "x"}]}', 2) == "lost agent missing"
    assert classify_response("bad", 400, {}, body, 0) == "bad_input_ok"
    assert classify_response("bad", 200, {}, b"{}", 0) == "bad_input_wrong 200"
    assert classify_events("completion", [{"choices": []}], done=True) == "ok"
    assert classify_events("completion", [{"choices": []}], done=False).startswith("lost")
    assert classify_events("completion", [{"error": {"code": "engine_error"}}], done=True) == "error engine_error"


def test_the_saturation_search_counts_answers_that_came_back_within_its_step():
    """A step's throughput is what came back while it lasted; answers that drain from a queue
    after it are not (they made the search read 2.8x what the app then completed under load)."""
    def sample(sent, latency, outcome="ok"):
        return Sample("completion", False, sent, latency, outcome)

    samples = [sample(1.0, 2.0), sample(5.0, 4.9), sample(6.0, 30.0), sample(2.0, 0.1, "shed"),
               sample(3.0, 0.0, "not_sent")]
    assert completed_rate(samples, 10.0) == pytest.approx(0.2)  # 2 of the 3 answers, in 10 s


def _raw(samples, faults=(), memory=(), duration=120.0, before=None, after=None):
    return {"spec": {"duration_s": duration, "window_s": 10.0}, "samples": samples, "faults": list(faults),
            "memory": list(memory), "server_before": before, "server_after": after,
            "saturation_per_s": 1.0, "rate_per_s": 2.0}


def _s(sent, lat, outcome="ok"):
    return {"kind": "completion", "stream": False, "sent_s": sent, "latency_s": lat, "outcome": outcome}


def test_report_measures_recovery_drift_leaks_and_accounting():
    fast = [_s(t, 1.0) for t in range(0, 50)]
    slow = [_s(t + 0.5, 5.0) for t in range(50, 70)]  # the fault at 50 s slows answers for 20 s
    back = [_s(t, 1.1) for t in range(70, 120)]
    mem = [{"t_s": t, "replica_rss_bytes": 100, "engine_rss_bytes": 200, "dev_shm_used_bytes": 50,
            "pinned_blocks": 0} for t in range(0, 120, 2)]
    fault = {"at_s": 50.0, "label": "kill Decode-x"}
    before = {"admitted": 0, "rejected": 0, "outcomes": {}}
    after = {"admitted": 120, "rejected": 3, "inflight": 0, "outcomes": {"completion": {"completed": 120,
                                                                                         "failed": 0, "cancelled": 0}}}
    rep = summarize(_raw(fast + slow + back, [fault], mem, before=before, after=after))
    f = rep["faults"][0]
    assert f["p95_before_s"] == 1.0 and 15 <= f["recovery_s"] <= 25
    assert rep["promises"] == {"nothing_lost": True, "shed_with_retry_after": True, "bad_input_refused": True,
                               "recovered": True, "no_drift": True, "no_leaks": True, "server_accounted": True,
                               "errors_within_budget": True, "capacity_recovered": True, "capacity_held": True}
    # no target given: p95 not judged against one; the fault is no kill of a sampled replica: its end is its start
    assert "kill Decode-x" in render(rep)
    assert rep["fallbacks"] is None and "retried where safe" not in render(rep)  # /metrics not read
    counted = summarize({**_raw(fast, [fault], mem, before=before, after=after),
                         "fallbacks_before": {"decoder_retry": 2.0, "incompatible": 5.0},
                         "fallbacks_after": {"decoder_retry": 5.0, "incompatible": 5.0, "prefill_error": 1.0}})
    assert counted["fallbacks"] == {"decoder_retry": 3.0, "prefill_error": 1.0}  # the run's increments only
    assert "retried where safe: decoder_retry 3, router_retry 0" in render(counted)

    # a p95 before the fault that admission held low: back within the admission target is recovered,
    # but only where the run has a target
    held = [_s(t, 0.5) for t in range(0, 50)] + [_s(t + 0.5, 3.0) for t in range(50, 120)]
    assert summarize(_raw(held, [fault], mem))["faults"][0]["recovery_s"] is None
    targeted = _raw(held, [fault], mem)
    targeted["spec"]["admission_target_s"] = 5.0
    f = summarize(targeted)["faults"][0]
    assert (f["recovery_s"], f["recovered_under_s"]) == (0.0, 5.0)
    targeted["spec"]["admission_target_s"] = 2.0  # 3 s answers stay past a 2 s target
    assert summarize(targeted)["faults"][0]["recovery_s"] is None

    lost = summarize(_raw(fast + [_s(60, 0.1, "lost RemoteProtocolError")], [fault], mem))
    assert not lost["promises"]["nothing_lost"] and not lost["promises"]["server_accounted"]
    assert lost["faults"][0]["recovery_s"] is None and not lost["promises"]["recovered"]
    grow = [dict(m, engine_rss_bytes=200 + 10 * m["t_s"]) for m in mem]
    assert not summarize(_raw(fast + back, [], grow))["promises"]["no_leaks"]
    # the pool's slab fills /dev/shm as its cache fills: judged without it; anything else growing there is a leak
    cache = [dict(m, held_bytes=10 + 4 * m["t_s"], dev_shm_used_bytes=50 + 4 * m["t_s"]) for m in mem]
    assert summarize(_raw(fast + back, [], cache))["promises"]["no_leaks"]
    shm = [dict(m, dev_shm_used_bytes=m["dev_shm_used_bytes"] + 2 * m["t_s"]) for m in cache]
    assert not summarize(_raw(fast + back, [], shm))["promises"]["no_leaks"]


def test_report_counts_admitted_errors_by_cause_and_fault_and_judges_each_minute_against_the_target():
    kill = {"at_s": 60.0, "label": "kill Prefill-base", "kind": "kill"}
    ok = [_s(t, 2.0) for t in range(0, 180)]
    slow_after_kill = [_s(60 + t / 2, 30.0) for t in range(20)]  # the 30 s after the kill: left out
    shed = [_s(t, 0.01, "shed") for t in range(0, 180, 3)]  # not admitted: never an error
    failed = [_s(10, 1.0, "error overloaded"), _s(70, 1.0, "error decoder_unavailable"),
              _s(75, 1.0, "error decoder_unavailable")]
    raw = _raw(ok + slow_after_kill + shed + failed, [kill], duration=180.0)
    raw["spec"]["admission_target_s"] = 5.0
    rep = summarize(raw)
    e = rep["errors"]
    assert (e["admitted"], e["errors"]) == (180 + 20 + 3, 3)
    assert e["by_cause"] == {"decoder_unavailable": 2, "overloaded": 1}
    assert e["by_fault"] == {"before any fault": {"overloaded": 1}, "kill Prefill-base": {"decoder_unavailable": 2}}
    assert rep["promises"]["errors_within_budget"] is (3 / 203 < 0.02)
    assert [m["within_target"] for m in rep["minutes"]] == [True, True, True]
    assert rep["promises"]["p95_within_target"] is True
    text = render(rep)
    assert "3 of 203" in text and "| kill Prefill-base | 2 | 0 |" in text and "target 5 s" in text

    late = _raw(ok + [_s(100 + t / 4, 9.0) for t in range(40)], [kill], duration=180.0)  # minute 1 past the target
    late["spec"]["admission_target_s"] = 5.0
    rep = summarize(late)
    assert [m["within_target"] for m in rep["minutes"]] == [True, False, True]
    assert rep["promises"]["p95_within_target"] is False
    many = summarize(_raw(ok + [_s(t, 1.0, "error engine_error") for t in range(10)], duration=180.0))
    assert not many["promises"]["errors_within_budget"]  # 10 of 190 is over 2%

    # the generator's lag and CPU are its own, apart from the app's
    lagged = _raw([dict(_s(t, 1.0), lag_s=0.5 if t % 2 else 0.0) for t in range(100)] + [_s(5, 0.0, "not_sent")],
                  duration=120.0)
    lagged["client"] = {"cpu_s": 30.0, "machine_busy_cpu_s": 200.0, "wall_s": 120.0, "cores": 2}
    c = summarize(lagged)["client"]
    assert (c["lag_max_s"], c["not_sent"], c["client_share_of_busy"], c["app_and_rest_cpu_s"]) == (0.5, 1, 0.15, 170.0)
    assert "load generator: sent arrivals late" in render(summarize(lagged))


def test_the_multinode_runs_config_loads_and_places_engines_on_both_nodes():
    """bench/overload_multinode.py's app: serve_config.yaml's on hand-over vllm-nixl, its engines
    split over the nodes."""

    from bench import overload_multinode as mod
    from prefillshare.app.config import load_config
    from prefillshare.app.plan import plan_app

    cfg = load_config(mod.app_config("t"))
    assert cfg.handover == "vllm-nixl" and cfg.pool.path == "/dev/shm/ps-ovmn-t"
    nodes = {d.name: next(iter(d.placement.placement_group_bundles[0])) for d in cfg.decoders}
    assert nodes == {"lookup": "decode_node", "tool_call": "decode_node", "reschedule": "prefill_node",
                     "route": "prefill_node"}
    assert [next(iter(m.placement.placement_group_bundles[0])) for m in cfg.prefill_modules] == ["prefill_node"]
    plan = plan_app(cfg)
    in_engine = [a.name for p in cfg.prefill_modules for a in p.lora_decoders]  # serve_config's chat adapters
    assert {d.name: d.prefill_module for d in plan.decoders} == dict.fromkeys([*nodes, *in_engine], "base")
    assert {d.name for d in plan.decoders if d.in_engine} == set(in_engine)


def test_the_restart_runs_arms_differ_only_in_every_engines_serving_niceness(monkeypatch):
    """bench/restart_under_load.py: each arm is the multi-node run's app with ``serving_niceness``
    set on every engine, down to the EngineConfig the engines start from."""

    from bench import restart_under_load
    from prefillshare.app.config import load_config
    from prefillshare.app.engine_args import engine_config

    arms = {n: load_config(restart_under_load.arm_config("t", n)) for n in (19, 0)}
    for n, cfg in arms.items():
        deps = [*cfg.prefill_modules, *cfg.decoders]
        assert {engine_config(cfg, d.model, d.engine, d.placement, None).serving_niceness for d in deps} == {n}
    strip = [{**d, "engine": {k: v for k, v in d["engine"].items() if k != "serving_niceness"}}
             for d in restart_under_load.arm_config("t", 19)["decoders"]]
    assert strip == [{**d, "engine": {k: v for k, v in d["engine"].items() if k != "serving_niceness"}}
                     for d in restart_under_load.arm_config("t", 0)["decoders"]]


def test_processes_are_told_apart_by_role():
    from bench.overload import role_of

    app = "prefillshare"
    assert role_of("ray::ServeReplica:prefillshare:Router", app, None) == "Router"
    assert role_of("ray::ServeReplica:prefillshare:Prefill-base", app, None) == "Prefill-base"
    # an engine is charged to the deployment of the replica that started it
    assert role_of("VLLM::EngineCore", app, "ray::ServeReplica:prefillshare:Decode-lookup") == "engine:Decode-lookup"
    spawned = "/v/bin/python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)"
    assert role_of(spawned, app, "ray::ServeReplica:prefillshare:Prefill-base") == "engine:Prefill-base"
    assert role_of("ray::ProxyActor", app, None) == "proxy"
    assert role_of("/x/site-packages/ray/core/src/ray/raylet/raylet --foo", app, None) == "ray:raylet"
    assert role_of("/v/bin/python -u /v/site-packages/ray/dashboard/agent.py --x=1", app, None) == "ray:agent.py"
    assert role_of("/v/bin/python /v/bin/serve run cfg.yaml", app, None) == "ray:serve"
    assert role_of("ray::IDLE", app, None) == "ray:IDLE"
    assert role_of("ray::ServeReplica:other-app:Router", app, None) == "ray:ServeReplica"  # another app's replica
    assert role_of("bash -c sleep", app, None) == "other:bash"


def test_cpu_by_role_counts_each_process_once_and_a_new_one_from_zero(monkeypatch):
    import types

    from bench import overload

    procs = {1: ("ray::ServeReplica:a:Router", 0, 10.0), 2: ("VLLM::EngineCore", 1, 50.0)}

    def fake_iter(_attrs):
        for pid, (title, ppid, cpu) in procs.items():
            yield types.SimpleNamespace(info={"pid": pid, "ppid": ppid, "cmdline": title.split(), "name": title,
                                              "create_time": 1.0, "cpu_times": types.SimpleNamespace(user=cpu, system=0.0),
                                              "memory_info": types.SimpleNamespace(rss=1 << 20)})

    import psutil
    monkeypatch.setattr(psutil, "process_iter", fake_iter)
    cpu = overload.CpuByRole("a")
    assert cpu.sample() == {"Router": 0.0, "engine:Router": 0.0}  # what was spent before the run is not counted
    procs[1] = ("ray::ServeReplica:a:Router", 0, 12.5)
    procs[3] = ("ray::ProxyActor", 0, 4.0)  # started between samples: all of its CPU is the run's
    del procs[2]  # ended: keeps what it was seen to spend
    procs = overload.processes()
    assert cpu.sample(procs) == {"Router": 2.5, "engine:Router": 0.0, "proxy": 4.0}
    # the same scan gives the memory figures: one replica, no engine left
    assert overload.memory_now("a", procs)["replica_rss_bytes"] == 1 << 20
    assert overload.memory_now("a", procs)["engine_rss_bytes"] == 0


def test_the_report_shows_cpu_by_role_per_minute():
    mem = [{"t_s": 0.0, "cpu_s": {"Router": 0.0, "proxy": 0.0}}, {"t_s": 30.0, "cpu_s": {"Router": 20.0, "proxy": 5.0}},
           {"t_s": 60.0, "cpu_s": {"Router": 40.0, "proxy": 10.0}}, {"t_s": 120.0, "cpu_s": {"Router": 45.0, "proxy": 70.0}}]
    rep = summarize(_raw([_s(t, 1.0) for t in range(100)], memory=mem, duration=120.0))
    assert [r["cpu_s"] for r in rep["cpu_by_minute"]] == [{"Router": 40.0, "proxy": 10.0}, {"Router": 5.0, "proxy": 60.0}]
    text = render(rep)
    assert "| minute | proxy | Router | rest | all |" in text and "| 1 | 60 | 5 | 0 | 65 |" in text


def test_the_report_judges_capacity_after_a_kill_from_the_replacements_readiness():
    """Answers per second must be back to 0.8x the minute before a kill within 60 s of its replacement
    answering (the replica count on /metrics back to what it was), and the run's mean at 0.7x saturation."""
    from bench.overload_report import capacity, ready_after

    kill = {"at_s": 60.0, "label": "kill Decode-x", "kind": "kill", "deployment": "Decode-x"}
    mem = [{"t_s": t, "replicas": {"Decode-x": 2.0 if t < 60 or t >= 90 else 1.0}} for t in range(0, 240, 2)]
    assert ready_after(mem, kill) == 90
    before = [_s(t / 4, 0.5) for t in range(0, 240)]  # 4 answers/s in the minute before
    trickle = [_s(60 + t, 0.5) for t in range(0, 60)]  # 1/s until 120 s
    fast_back = [_s(120 + t / 4, 0.5) for t in range(0, 400)]  # 4/s again from 120 s: 30 s after the replacement
    c = capacity(before + trickle + fast_back, mem, kill, 240.0)
    assert c["answers_per_s_before"] == pytest.approx(4.0, rel=0.05) and 25 <= c["back_after_s"] <= 35
    slow_back = [_s(180 + t / 4, 0.5) for t in range(0, 200)]  # 4/s only from 180 s: 90 s after it
    late = capacity(before + trickle + [_s(120 + t, 0.5) for t in range(60)] + slow_back, mem, kill, 240.0)
    assert late["back_after_s"] is None
    raw = _raw(before + trickle + [_s(120 + t, 0.5) for t in range(60)] + slow_back, [kill], mem, duration=240.0)
    raw["saturation_per_s"] = 4.0
    rep = summarize(raw)
    assert rep["promises"]["capacity_recovered"] is False
    assert rep["promises"]["capacity_held"] is False  # (240+60+60+200)/240 = 2.3/s < 0.7 x 4
    assert "answers per second after each fault" in render(rep)
