"""The Serve application under faults: clients that hang up, overload, full queues, killed
prefill and decoder replicas. Real vLLM engines on the package's app (tests/serve_test_app.py,
tests/shared_app/conftest.py), shared with the functional tests (test_serve_app.py). No test
depends on another having run: the module starts once every engine answers, and a test that kills
a replica waits until Serve has replaced it and the app answers again before it ends. Run through scripts/test.sh (loopback-only network namespace).
"""
from __future__ import annotations

import json
import socket
import time

import pytest
from serve_test_app import (
    CONTEXT,
    KEY_A,
    LONG_NEW,
    MAX_INFLIGHT,
    MAX_NEW,
    _auth,
    _expected,
    _get,
    _ingress_state,
    _metric,
    _metrics,
    _post,
)

pytestmark = [pytest.mark.serve, pytest.mark.engine]


def _stream_then_hang_up(app, body: dict) -> str:
    """Open a streamed completion, read its first event, drop the connection."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", app["port"], timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", **_auth(KEY_A)})
    r = conn.getresponse()
    assert r.status == 200
    first = r.readline().decode()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    return first


def _cancelled(admission: dict) -> int:
    """The Router's count of requests that ended cancelled (every route)."""
    return sum(c["cancelled"] for c in admission["outcomes"].values())


def _engine_tokens(app, deployment: str) -> float:
    """The tokens ``deployment``'s engines generated, from their vllm:* metrics. Replicas push
    them every 2 s: read until two reads 3 s apart agree (bounded)."""
    def read():
        return _metric(_metrics(app["url"]), "vllm:generation_tokens_total", deployment=deployment)

    last = read()
    for _ in range(10):
        time.sleep(3)
        now = read()
        if now == last:
            break
        last = now
    return last


def test_client_that_disconnects_mid_stream_is_cancelled_and_its_generation_stops(app):
    """A client hangs up after the first event of a stream asking for LONG_NEW tokens, ignoring
    EOS: the Router counts that request cancelled (not completed), nothing stays in flight, and
    alpha's engine stops generating well short of max_tokens."""
    tokens0 = _engine_tokens(app, "Decode-alpha")
    cancelled0 = _cancelled(_ingress_state(app))
    first = _stream_then_hang_up(app, {"model": "alpha", "prompt": "hi", "max_tokens": LONG_NEW, "ignore_eos": True,
                                       "stream": True, "temperature": 0.7, "seed": 1})
    assert first.startswith("data: ")
    for _ in range(60):  # the cancellation travels proxy -> router -> decoder -> engine
        queues = _metric(_metrics(app["url"]), "prefillshare_queue_length")
        state = _ingress_state(app)
        if state["inflight"] == 0 and queues == 0 and _cancelled(state) > cancelled0:
            break
        time.sleep(1)
    assert _cancelled(state) == cancelled0 + 1, state  # the hang-up, seen as a cancellation
    assert state["inflight"] == 0, state
    assert queues == 0  # no engine still works on the abandoned request
    generated = _engine_tokens(app, "Decode-alpha") - tokens0
    assert 1 <= generated < LONG_NEW, f"alpha's engine generated {generated:.0f} tokens of max_tokens={LONG_NEW}"
    print(f"\ndisconnect: cancelled at the Router; alpha's engine generated {generated:.0f} of {LONG_NEW} tokens")



# --- overload ------------------------------------------------------------------------------
def test_overload_gets_429_with_retry_after_and_every_accepted_request_completes(app):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": "alpha", "prompt": CONTEXT + "\nQ: what is the color?\nA:", "max_tokens": 32, "temperature": 0}
    status, ref = _post(app["url"] + "/v1/completions", body)
    assert status == 200, ref
    sent = 4 * MAX_INFLIGHT  # 4x what the ingress admits at once
    barrier = threading.Barrier(sent)

    def one(_):
        barrier.wait()
        return _post(app["url"] + "/v1/completions", body, timeout=600, with_headers=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(sent) as pool:
        answers = list(pool.map(one, range(sent)))  # a hung request would raise a timeout here
    wall = time.perf_counter() - t0
    ok = [out for status, out, _ in answers if status == 200]
    shed = [(out, h) for status, out, h in answers if status == 429]
    assert len(ok) + len(shed) == sent, [a[:2] for a in answers if a[0] not in (200, 429)]
    assert ok and shed
    for out, headers in shed:
        assert int(headers["Retry-After"]) >= 1
        assert out["error"]["code"] == "overloaded" and out["error"]["param"] is None
        assert out["error"]["type"] == "rate_limit_error"
    for out in ok:  # complete, and the same answer as when the app was idle
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]
        assert out["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
        assert out["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"]
    state = _ingress_state(app)
    assert state["inflight"] == 0
    print(f"\noverload: sent {sent} at once (admission limit {MAX_INFLIGHT}): {len(ok)} completed, "
          f"{len(shed)} got 429, wall {wall:.1f}s; router totals {state}")


def test_a_full_decoder_queue_sheds_agents_with_overloaded_not_a_hang(app):
    """beta runs 1 request and queues 1 (Serve's max_queued_requests): a 3-agent fan-out on beta
    gets at least one agent shed with an 'overloaded' error while the others complete."""
    agents = [{"name": f"b{i}", "model": "beta", "instruction": "what is the city?", "max_tokens": 8} for i in range(3)]
    status, out = _post(app["url"] + "/v1/agents/run", {"context": CONTEXT, "agents": agents})
    assert status == 200, out
    errors = [r["error"] for r in out["results"]]
    done = [r for r in out["results"] if r["error"] is None]
    assert len(out["results"]) == 3
    assert done and all(r["usage"]["completion_tokens"] >= 1 for r in done)
    shed = [e for e in errors if e is not None]
    assert shed and all(e.startswith("overloaded") for e in shed), errors


# --- killed replicas: each test waits for the replacement before it ends -----------------------
def _admission(app) -> dict:
    """The Router's accounting, also while /ready answers 503 (a replica restarting)."""
    return json.loads(_get(app["url"] + "/ready")[1])["admission"]


def _finished(adm: dict) -> int:
    return sum(sum(c.values()) for c in adm["outcomes"].values())


def _replica_actor(deployment: str, replica_id: str | None = None):
    import ray

    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{deployment}#" in a["name"]
             and (replica_id is None or a["name"].endswith(replica_id))]
    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in named]


def _check_agents(reference, ctx: str, out: dict) -> int:
    """Every agent answered; its tokens are the shared reference when it loaded the base's KV,
    the private one when it prefilled itself. Returns how many prefilled privately."""
    from prefillshare.app.training.tasks import render_prompt

    tok, _ = reference
    private = 0
    for r in out["results"]:
        assert r["error"] is None, r
        ids = tok(render_prompt(ctx, r["instruction"]))["input_ids"]
        shared = r["usage"]["cached_tokens"] == len(ids) - 1
        assert shared or r["usage"]["cached_tokens"] == 0, r
        assert r["token_ids"] == _expected(reference, r["model"], ids, private=not shared), r
        private += not shared
    return private


def test_killing_a_prefill_replica_mid_fan_out_retries_on_the_survivor_and_every_request_is_accounted(
        app, reference):
    """A fan-out is in flight on one of the two prefill replicas (its engine is stopped so the
    call cannot finish first) when the replica is killed: its prefill call, which had not handed
    over, is repeated on the surviving replica (fallback prefill_retry) and its agents load the
    base's KV from there, with the shared reference tokens; fan-outs sent while Serve restarts the
    replica complete too; the Router's accounting adds up (admitted = completed + failed); then
    Serve replaces the replica and fan-outs share the base's KV again."""
    import signal
    import threading

    import psutil
    import ray

    ctx = "fault probe\nname:omar\nitem:desk\nqty:7\ncity:rome\nday:fri\ncolor:plum\nnote:ring twice"
    agents = lambda *qs: [{"name": f"x{i}", "model": m, "instruction": q, "max_tokens": MAX_NEW}  # noqa: E731
                          for i, (m, q) in enumerate(qs)]
    status, warm = _post(app["url"] + "/v1/agents/run", {"context": ctx, "agents": agents(
        ("alpha", "what is the item?"), ("alpha", "what is the qty?"))})
    assert status == 200, warm
    replica = warm["results"][0]["prefill"]["replica"]  # this context's replica (prefix locality)
    (actor,) = _replica_actor("Prefill-base", replica)
    proc = psutil.Process(ray._private.state.actors(actor_id=actor._actor_id.hex())["Pid"])
    engine_procs = proc.children(recursive=True)  # EngineCore + worker of this replica
    assert engine_procs
    adm0 = _admission(app)
    fb0 = _metric(_metrics(app["url"]), "prefillshare_fallbacks_total", reason="prefill_retry")

    inflight = agents(("alpha", "what is the city?"), ("beta", "what is the day?"))
    answers: dict[str, tuple] = {}
    for p in engine_procs:
        p.send_signal(signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: answers.setdefault("inflight", _post(
            app["url"] + "/v1/agents/run", {"context": ctx, "agents": inflight}, timeout=600)))
        t.start()
        for _ in range(120):  # until the prefill call is in that replica (sequencing, not timing)
            if _metric(_metrics(app["url"]), "prefillshare_queue_length", replica=replica) >= 1:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the fan-out's prefill call never reached the stopped replica")
        ray.kill(actor, no_restart=True)
    finally:
        for p in engine_procs:  # the killed replica's engine processes: reaped by PID
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    t.join(600)
    status, out = answers["inflight"]
    assert status == 200, out
    for r, a in zip(out["results"], inflight):
        r["instruction"] = a["instruction"]
        # the repeat's ticket, from the other replica (no retry: no ticket, the decoders prefill privately)
        assert r["prefill"] is not None and r["prefill"]["replica"] != replica, r
    assert _check_agents(reference, ctx, out) == 0  # both loaded the survivor's KV

    during: list[tuple] = []  # while Serve replaces the replica: the other one, or a fallback

    def one(i: int) -> None:
        c = ctx.replace("omar", f"user{i}")
        a = agents(("alpha", "what is the note?"), ("alpha", "what is the color?"))
        status, out = _post(app["url"] + "/v1/agents/run", {"context": c, "agents": a}, timeout=600)
        for r, x in zip(out.get("results", []), a):
            r["instruction"] = x["instruction"]
        during.append((c, status, out))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    private = 0
    for c, status, out in during:
        assert status == 200, out
        private += _check_agents(reference, c, out)
    adm1 = _admission(app)
    assert adm1["inflight"] == 0
    assert adm1["admitted"] - adm0["admitted"] == 4 == _finished(adm1) - _finished(adm0)
    assert sum(c["completed"] for c in adm1["outcomes"].values()) - \
        sum(c["completed"] for c in adm0["outcomes"].values()) == 4
    for _ in range(30):  # metrics are fire-and-forget
        fb1 = _metric(_metrics(app["url"]), "prefillshare_fallbacks_total", reason="prefill_retry")
        if fb1 > fb0:
            break
        time.sleep(1)
    assert fb1 >= fb0 + 1
    _replaced_and_sharing_again(app, reference, replica)  # leaves the app as it found it
    print(f"\nprefill fault: the in-flight fan-out's prefill was repeated on the survivor (2 agents shared); "
          f"3 fan-outs during the restart: {len(during)} completed, {private} of 6 agents prefilled privately; "
          f"fallbacks prefill_retry +{fb1 - fb0:.0f}; router: admitted +4, completed +4")


def _read_events(r) -> list[str]:
    events = []
    for line in r:
        line = line.decode().strip()
        if line.startswith("data: "):
            events.append(line[6:])
    return events


def test_killing_a_decoder_replica_mid_stream_fails_clearly_and_the_app_recovers(app, baseline):
    """ray.kill alpha's replica while it streams (LONG_NEW tokens ignoring EOS: the stream cannot
    finish first): that stream ends with an error event, then [DONE]; requests sent meanwhile
    complete or get 503 + Retry-After, none waits for the restart (limits.decoder_wait_s bounds the
    wait for a replica while none is running), Serve starts a new replica and alpha's greedy answer
    is the same as before."""
    import http.client
    import threading

    import psutil
    import ray

    (named,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#Decode-alpha#" in a["name"]]
    actor = ray.get_actor(named["name"], namespace=named["namespace"])
    # this cluster's replica process (other apps on the machine may use the same names)
    proc = psutil.Process(ray._private.state.actors(actor_id=actor._actor_id.hex())["Pid"])
    assert any("Decode-alpha" in c for c in proc.cmdline()), proc.cmdline()
    engine_procs = proc.children(recursive=True)  # vLLM EngineCore + worker, started by this test's app

    conn = http.client.HTTPConnection("127.0.0.1", app["port"], timeout=600)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": "alpha", "prompt": "hi", "max_tokens": LONG_NEW, "ignore_eos": True, "temperature": 1.0, "seed": 3,
         "stream": True}),
        headers={"Content-Type": "application/json", **_auth(KEY_A)})
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline().decode().startswith("data: ")
    ray.kill(actor, no_restart=True)
    rest = _read_events(r)  # a hang here would fail the test on the 600 s socket timeout
    conn.close()
    assert rest[-1] == "[DONE]"
    events = [json.loads(e) for e in rest[:-1]]
    errors = [e["error"] for e in events if "error" in e]
    finished = [c.get("finish_reason") for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert errors and not finished, (errors, finished)  # cut by the kill, told in-band: never a whole answer
    assert errors[-1]["type"] == "server_error" and "decoder" in errors[-1]["message"], errors
    streamed = sum(bool(c.get("text")) for e in events for c in e.get("choices", []))

    results: list[tuple] = []

    answered: list[float] = []
    ready_at: list[float] = []  # when /ready first answered 200 again, seen by a poller of its own

    def poll_ready():
        for _ in range(300):  # Serve starts a new alpha replica (an engine start: minutes on 2 busy cores)
            if _get(app["url"] + "/ready")[0] == 200:
                ready_at.append(time.monotonic())
                return
            time.sleep(1)

    def one():
        results.append(_post(app["url"] + "/v1/completions", {"model": "alpha", "prompt": "hi", "max_tokens": 4},
                             timeout=600, with_headers=True))
        answered.append(time.monotonic())

    poller = threading.Thread(target=poll_ready)
    poller.start()
    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [out for status, out, _ in results if status == 200]
    failed = [(out, h) for status, out, h in results if status == 503]
    assert len(ok) + len(failed) == 3, [x[:2] for x in results]
    for out, headers in failed:
        # shed before admission (the Router's own router knows alpha has no replica), or failed
        # fast after it (the fan-out's check, when the Router learned of the death in between)
        assert out["error"]["code"] in ("decoder_unavailable", "engine_error"), out
        assert int(headers["Retry-After"]) >= 1
    for p in engine_procs:  # reap the killed replica's engine processes if they outlived it
        try:
            p.wait(timeout=30)
        except psutil.TimeoutExpired:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    poller.join()
    assert ready_at, "alpha's replacement never became ready"
    ready = ready_at[0]
    # answered before the replacement was up (the poller saw it, independently of the requests):
    # none held its admission slot through the restart
    assert max(answered) < ready, (max(answered) - ready, [x[:2] for x in results])
    status, out = _post(app["url"] + "/v1/completions", {"model": "alpha", "prompt": CONTEXT + "\nQ: what is the item?\nA:",
                                                         "max_tokens": MAX_NEW, "temperature": 0})
    assert status == 200 and out["choices"][0]["text"] == baseline["alpha"], out
    print(f"\nfault: the stream ended with an error event after {streamed} of {LONG_NEW} tokens; "
          f"3 requests during the restart: {len(ok)} completed, {len(failed)} got 503; "
          f"the replacement was ready {ready - max(answered):.0f} s after the last answer")


def _replaced_and_sharing_again(app, reference, killed: str) -> None:
    """After a prefill replica was killed: two live prefill replicas, none of them the killed one,
    and a fan-out loads the base's KV again (no restart of the app)."""
    for _ in range(300):  # Serve starts the replacement (an engine start: minutes on a busy 2-core box);
        status, body = _get(app["url"] + "/ready")  # /ready is 200 with one prefill replica already
        live = _replica_actor("Prefill-base")
        if status == 200 and len(live) == 2:
            break
        time.sleep(2)
    assert status == 200, body
    assert len(live) == 2 and not _replica_actor("Prefill-base", killed)
    ctx = "after the fault\nname:ivan\nitem:cup\nqty:2\ncity:kyiv\nday:mon\ncolor:gold\nnote:leave at door"
    agents = [{"name": "p", "model": "alpha", "instruction": "what is the item?", "max_tokens": MAX_NEW},
              {"name": "q", "model": "beta", "instruction": "what is the city?", "max_tokens": MAX_NEW}]
    status, out = _post(app["url"] + "/v1/agents/run", {"context": ctx, "agents": agents})
    assert status == 200, out
    for r, a in zip(out["results"], agents):
        r["instruction"] = a["instruction"]
        assert r["prefill"] is not None, r
    assert _check_agents(reference, ctx, out) == 0  # both loaded the base's KV


def test_twice_saturation_with_the_orchestrator_killed_loses_nothing(app, tmp_path):
    """`python -m bench overload`, the CI version: a short search (3 x 8 s), 45 s of open-loop arrivals
    at twice the saturation rate on alpha (fan-outs and completions, streamed or not, some clients
    hanging up, some bad input), the Orchestrator killed (-9) at 15 s. The settle outlasts the
    pool's 30 s lease. The 10-minute run is bench/overload_run.sh (docs/reliability.md)."""
    from bench import overload
    from bench.faults import FaultSpec
    from bench.overload import Mix, OverloadSpec
    from bench.overload_report import summarize, write

    spec = OverloadSpec(url=app["url"], app="ps", api_key=KEY_A, models=("alpha",), duration_s=45, search_start=1.0,
                        search_step_s=8, search_max_steps=3, drain_s=30, settle_s=32, timeout_s=120,
                        faults=(FaultSpec(15, "kill", "Orchestrator"),),
                        mix=Mix(max_tokens=8, bad_share=0.1, disconnect_share=0.2))
    raw = overload.run(spec, log=print)
    report = summarize(raw)
    print(write(raw, report, tmp_path / "out"))
    assert (tmp_path / "out" / "overload.png").stat().st_size > 0
    fired = raw["faults"][0]
    assert fired["pid"] is not None and fired["error"] is None, fired  # the replica was found and killed
    assert raw["saturation_per_s"] > 0 and raw["rate_per_s"] == pytest.approx(2 * raw["saturation_per_s"])
    lost = {k: v for k, v in report["outcomes"].items() if k.startswith("lost")}
    assert not lost, report["outcomes"]
    assert "error internal" not in report["outcomes"], report["outcomes"]  # a dead replica is a typed 503, never a 500
    p = report["promises"]
    assert p["shed_with_retry_after"] and p["bad_input_refused"], report["outcomes"]
    assert p["server_accounted"], report["server"]
    assert report["outcomes"].get("ok", 0) > 0 and report["outcomes"].get("bad_input_ok", 0) > 0
    assert report["fallbacks"] is not None  # /metrics read before and after: the retries are counted
    for _ in range(150):  # the replacement Orchestrator answers before the test ends
        if _get(app["url"] + "/ready")[0] == 200:
            break
        time.sleep(2)
    status, out = _post(app["url"] + "/v1/agents/run", {"context": CONTEXT, "agents": [
        {"name": "a", "model": "alpha", "instruction": "what is the city?", "max_tokens": MAX_NEW}]})
    assert status == 200 and out["results"][0]["error"] is None, out
