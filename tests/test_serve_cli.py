"""`make serve`'s script and the Serve CLI, on the default application: scripts/serve.sh
(-> `serve run`) brings up serve_config.yaml itself (the shipped base and its four decoders,
only the port and the pool path changed), prints how to reach it, and the shipped decoders
answer the held-out task suite through an HTTP fan-out. Started with Serve's direct ingress on
(``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``), it also serves the same routes on the Router replica's own
port, without the proxy. `serve status` sees the app under
Ray's token auth, and `serve deploy` updates it in the running cluster. Stopped as Ctrl-C of
`make serve` stops it (Serve's graceful shutdown), it leaves no process and no /dev/shm file,
its KV pool included. Run through
scripts/test.sh (loopback-only network namespace).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest
import yaml
from process_tracking import ProcessTracker, kill_all, title
from serve_test_app import _get, _post
from shm_tracking import residues

from bench.random_models import free_port
from prefillshare.app.training import tasks

pytestmark = [pytest.mark.serve, pytest.mark.engine]

ROOT = Path(__file__).resolve().parent.parent
SERVE = str(ROOT / ".venv" / "bin" / "serve")
SHIPPED = ROOT / "checkpoints"
NUM_CONTEXTS = 6
MARKER = "PREFILLSHARE_CLI_TEST"


def _serve_config(port: int, pool: str) -> dict:
    """serve_config.yaml as shipped, on a free port and a private pool path."""
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    cfg["http_options"]["port"] = port
    app_cfg = cfg["applications"][0]["args"]["config"]
    app_cfg["pool"]["path"] = pool
    return cfg


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    port = free_port()
    pool = f"/dev/shm/ps-cli-{os.getpid()}"
    cfg_path = tmp / "serve.yaml"
    cfg_path.write_text(yaml.safe_dump(_serve_config(port, pool)))
    ray_tmp = f"/tmp/rc{os.getpid()}"
    # serve.sh's default: Ray's token auth on (the token given here instead of ~/.ray/auth_token)
    marker = secrets.token_hex(8)  # inherited by every process of the app (see process_tracking)
    env = dict(os.environ, PREFILLSHARE_SERVE_CONFIG=str(cfg_path), RAY_TMPDIR=ray_tmp,
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_SERVE_ENABLE_DIRECT_INGRESS="1",
               **{MARKER: marker})
    proc = subprocess.Popen(["bash", "scripts/serve.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tracked = ProcessTracker(psutil.Process(proc.pid), (MARKER, marker))
    shm_before = set(os.listdir("/dev/shm"))
    lines: list[str] = []
    ready = threading.Event()

    def reader():
        for line in proc.stdout:
            lines.append(line)
            if "PrefillShare is ready at" in line:
                ready.set()

    threading.Thread(target=reader, daemon=True).start()
    try:
        # waiting for startup, not asserting on time: the script polls /ready itself
        while not ready.wait(5):
            if proc.poll() is not None:
                errors = [ln for ln in lines if any(w in ln for w in ("Error", "Traceback", "failed", "DEPLOY_FAILED"))]
                pytest.fail("serve.sh exited before ready; its error lines:\n" + "".join(errors[:40])
                            + "\n... its last lines:\n" + "".join(lines[-30:]))
        yield {"url": f"http://127.0.0.1:{port}", "env": env, "cfg_path": cfg_path, "port": port,
               "pool": pool, "lines": lines, "proc": proc}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # what Ctrl-C of `make serve` sends its process group
        try:
            proc.wait(timeout=120)  # serve.sh waits up to 90 s for a graceful stop
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        # waiting for the app's processes to exit, not a timing assertion
        psutil.wait_procs(tracked.running(), timeout=60)
        left = tracked.stop()
        kill_all(left)  # by pid: vLLM's renamed engine cores carry no marker in their command line
        # the clean stop gives back its /dev/shm: the KV pool (pool.persist is off), and no
        # multiprocessing semaphore (sem.mp-*) or shared-memory segment (psm_*) of an engine
        # /dev/shm is the machine's: of what appeared meanwhile, the app's are its pool and any
        # semaphore or segment that no live process maps (every process of the app is gone)
        pool_left = os.path.exists(pool)
        shm_left = residues(sorted(set(os.listdir("/dev/shm")) - shm_before))
        subprocess.run(["rm", "-rf", ray_tmp, pool], check=False)
        assert not left, f"make serve, stopped, left processes running: {[title(p) for p in left]}"
        assert not pool_left and shm_left == [], f"make serve, stopped, left in /dev/shm: pool {pool_left}, {shm_left}"


def _fan_out(url: str, context: str, agents: list[tuple[str, str, str]]) -> dict:
    """One agent run: (agent name, decoder, instruction) each, bounded by the client timeout."""
    status, out = _post(url + "/v1/agents/run", {"context": context, "agents": [
        {"name": name, "model": model, "instruction": instruction, "max_tokens": 24}
        for name, model, instruction in agents]}, timeout=120)
    assert status == 200, out
    return out


def _held_out() -> dict[str, dict[str, tasks.Example]]:
    """The first contexts of the shipped test split, each with every agent's question."""
    by_context: dict[str, dict[str, tasks.Example]] = defaultdict(dict)
    for e in tasks.read_jsonl(SHIPPED / "data" / "test.jsonl"):
        by_context[e.context][e.agent] = e
    return dict(list(by_context.items())[:NUM_CONTEXTS])


def _status(env: dict) -> dict:
    out = subprocess.run([SERVE, "status"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


@pytest.fixture(scope="module")
def status_at_start(served) -> dict:
    """`serve status` (with the token) once the app is up; each CLI call costs seconds here."""
    return _status(served["env"])


def test_serve_sh_prints_how_to_reach_the_app_and_the_shipped_decoders_answer(served):
    """Each context goes to every shipped decoder at once, and to lookup twice: two calls of one
    request to one decoder deployment, which Serve routes with the same internal request id
    (the node-affinity router once lost the second of them, and the run hung)."""
    text = "".join(served["lines"])
    assert f"http://127.0.0.1:{served['port']}/v1/models" in text
    assert "OpenAI(base_url=" in text
    right: dict[str, int] = defaultdict(int)
    for context, examples in _held_out().items():
        agents = [(a, a, e.instruction) for a, e in examples.items()]
        agents.append(("lookup_again", "lookup", examples["lookup"].instruction))
        out = _fan_out(served["url"], context, agents)
        assert len(out["results"]) == len(agents)
        for r in out["results"]:
            assert r["error"] is None, r
            # every decoder loaded the base's KV for all but the last prompt token
            assert r["usage"]["cached_tokens"] == r["usage"]["prompt_tokens"] - 1, r
            right[r["name"]] += tasks.parse_response(r["text"]) == examples[r["model"]].answer
    # the eval table (checkpoints/eval/results.md) has tool_call, reschedule and route at 100% EM,
    # lookup at ~93%
    assert right["tool_call"] >= NUM_CONTEXTS - 1, right
    assert right["reschedule"] >= NUM_CONTEXTS - 1, right
    assert right["route"] >= NUM_CONTEXTS - 1, right
    assert right["lookup"] >= NUM_CONTEXTS - 2, right
    assert right["lookup_again"] >= NUM_CONTEXTS - 2, right


def test_a_system_first_chat_to_a_shared_first_decoder_is_rearranged_and_answered(served):
    """A framework's chat shape (the agent's system prompt and question as the system turn, the
    shared record as the user turn) reaches each shipped shared-first decoder rearranged into the
    format it was trained on (the record first): the same prompt as the agent run's, so the same
    greedy answer, right on the held-out records, with the base's KV loaded for all but the last token."""
    from prefillshare.app.training.recipe import AGENT_SYSTEMS

    right: dict[str, int] = defaultdict(int)
    for context, examples in _held_out().items():
        run = _fan_out(served["url"], context, [(a, a, e.instruction) for a, e in examples.items()])
        by_agent = {r["name"]: r for r in run["results"]}
        for agent, e in examples.items():
            status, out = _post(served["url"] + "/v1/chat/completions", {
                "model": agent, "max_tokens": 24, "temperature": 0, "messages": [
                    {"role": "system", "content": f"{AGENT_SYSTEMS[agent]}\n{e.instruction}"},
                    {"role": "user", "content": context}]}, timeout=120)
            assert status == 200, out
            text, usage = out["choices"][0]["message"]["content"], out["usage"]
            assert usage["prompt_tokens"] == by_agent[agent]["usage"]["prompt_tokens"], (usage, by_agent[agent])
            assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage
            assert text == by_agent[agent]["text"], (agent, text, by_agent[agent]["text"])
            right[agent] += tasks.parse_response(text) == e.answer
    assert all(right[a] >= NUM_CONTEXTS - 2 for a in AGENT_SYSTEMS), right


def test_direct_ingress_serves_the_same_routes_on_the_routers_own_port(served):
    """The Router replica listens on http_options.port + 1 as serve.sh prints; a greedy completion
    and a refused body read the same there as through Serve's proxy."""
    direct = f"http://127.0.0.1:{served['port'] + 1}"
    assert f"direct:   {direct} " in "".join(served["lines"])
    context, examples = next(iter(_held_out().items()))
    body = {"model": "lookup", "prompt": context + "\n" + examples["lookup"].instruction, "max_tokens": 12,
            "temperature": 0}
    (s1, via_proxy), (s2, via_router) = (_post(u + "/v1/completions", body) for u in (served["url"], direct))
    assert s1 == s2 == 200, (via_proxy, via_router)
    assert via_router["choices"][0]["text"] == via_proxy["choices"][0]["text"]
    counts = ("prompt_tokens", "completion_tokens")
    assert [via_router["usage"][k] for k in counts] == [via_proxy["usage"][k] for k in counts]
    bad = {**body, "max_tokens": "many"}
    (s1, e1), (s2, e2) = (_post(u + "/v1/completions", bad) for u in (served["url"], direct))
    assert s1 == s2 == 400 and e1["error"]["param"] == e2["error"]["param"] == "max_tokens", (e1, e2)


def test_ray_token_auth_guards_the_cluster(served, status_at_start):
    no_token = {k: v for k, v in served["env"].items() if k != "RAY_AUTH_TOKEN"}
    no_token["RAY_AUTH_TOKEN_PATH"] = str(served["cfg_path"].with_name("absent-token"))
    out = subprocess.run([SERVE, "status"], env=no_token, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert status_at_start["applications"]["prefillshare"]["status"] == "RUNNING"  # the same call with the token


def test_serve_status_and_serve_deploy_on_the_running_cluster(served, status_at_start):
    app = status_at_start["applications"]["prefillshare"]
    assert app["status"] == "RUNNING"
    assert {"Router", "Orchestrator", "Metrics", "Prefill-base", "Decode-lookup", "Decode-tool_call",
            "Decode-reschedule", "Decode-route"} <= set(app["deployments"])
    # serve deploy: a changed config goes to the running cluster. The change is a deployment
    # option (the Metrics deployment's CPUs), which Serve applies to that deployment alone; a
    # changed application arg would give every deployment a new code version and restart all
    # five engines (170-330 s measured on this 2-core machine) for the same check.
    new = _serve_config(served["port"], served["pool"])
    new["applications"][0]["deployments"] = [{"name": "Metrics", "ray_actor_options": {"num_cpus": 0.06}}]
    path = served["cfg_path"].with_name("serve2.yaml")
    path.write_text(yaml.safe_dump(new))
    deployments_before = app["deployments"]
    dep = subprocess.run([SERVE, "deploy", str(path)], env=served["env"], capture_output=True, text=True, timeout=120)
    assert dep.returncode == 0, dep.stderr
    for _ in range(150):  # waiting for the update to roll out
        cpus = None
        cfg = subprocess.run([SERVE, "config"], env=served["env"], capture_output=True, text=True, timeout=120)
        if cfg.returncode == 0:
            over = {d["name"]: d for d in yaml.safe_load(cfg.stdout).get("deployments") or []}
            cpus = over.get("Metrics", {}).get("ray_actor_options", {}).get("num_cpus")
        app = _status(served["env"])["applications"]["prefillshare"]  # read after the config
        if cpus == 0.06 and app["status"] == "RUNNING" and app["deployments"]["Metrics"]["status"] == "HEALTHY":
            break
        time.sleep(1)
    else:
        pytest.fail(f"serve deploy did not roll out: {app}")
    assert set(app["deployments"]) == set(deployments_before)
    status, body = _get(served["url"] + "/ready")
    assert status == 200, body
    assert json.loads(body)["ready"] is True
    context, examples = next(iter(_held_out().items()))
    out = _fan_out(served["url"], context, [("tool_call", "tool_call", examples["tool_call"].instruction)])
    assert tasks.parse_response(out["results"][0]["text"]) == examples["tool_call"].answer
