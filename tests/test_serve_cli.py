"""`make serve`'s script and the Serve CLI: scripts/serve.sh (-> `serve run CONFIG`) brings an
app up and prints how to reach it, `serve status` sees it, `serve deploy` updates it in the
running cluster. A small app (one prefill module, two decoders) on random-weight models of the
shipped shape; run through scripts/test.sh (loopback-only network namespace).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from test_serve_app import CONTEXT, _free_port, _get, _make_models, _post

pytestmark = [pytest.mark.serve, pytest.mark.engine]

ROOT = Path(__file__).resolve().parent.parent
SERVE = str(ROOT / ".venv" / "bin" / "serve")


def _serve_config(paths: dict, port: int, pool: str, metrics_cpus: float = 0.05) -> dict:
    engine = {"dtype": "bfloat16", "max_model_len": 256, "kv_cache_gib": 0.125, "block_size": 32,
              "threads_bind": "nobind"}
    dec = lambda n: {"name": n, "model": str(paths[n]), "engine": engine,  # noqa: E731
                     "placement": {"num_cpus": 0.25, "placement_group_bundles": [{"CPU": 0.25}]}}
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{
            "name": "prefillshare", "route_prefix": "/", "import_path": "app.serve_app:build_app",
            "args": {"config": {
                "tokenizer": str(paths["tokenizer"]),
                "pool": {"path": pool, "capacity_gib": 0.125},
                "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
                "prefill_modules": [{"name": "base", "model": str(paths["base"]), "engine": engine}],
                "decoders": [dec("alpha"), dec("beta")],
                "metrics": {"num_cpus": metrics_cpus},
            }},
        }],
    }


def _kill_tree_by_marker(marker: str) -> None:
    """Kill leftovers of this test's cluster only: processes whose command line names its temp dir."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    paths = _make_models(tmp / "models")
    port = _free_port()
    pool = f"/dev/shm/ps-cli-{os.getpid()}"
    cfg_path = tmp / "serve.yaml"
    cfg_path.write_text(yaml.safe_dump(_serve_config(paths, port, pool)))
    ray_tmp = f"/tmp/rc{os.getpid()}"
    env = dict(os.environ, PREFILLSHARE_SERVE_CONFIG=str(cfg_path), RAY_TMPDIR=ray_tmp)
    proc = subprocess.Popen(["bash", "scripts/serve.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
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
                pytest.fail("serve.sh exited before ready:\n" + "".join(lines[-60:]))
        yield {"url": f"http://127.0.0.1:{port}", "env": env, "cfg_path": cfg_path, "paths": paths, "port": port,
               "pool": pool, "lines": lines, "proc": proc}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_tree_by_marker(ray_tmp)
        subprocess.run(["rm", "-rf", ray_tmp, pool], check=False)


def _fan_out(url: str) -> dict:
    status, out = _post(url + "/v1/agents/run", {"context": CONTEXT, "agents": [
        {"name": "a", "model": "alpha", "instruction": "what is the city?", "max_tokens": 4},
        {"name": "b", "model": "beta", "instruction": "what is the day?", "max_tokens": 4}]})
    assert status == 200, out
    return out


def _status(env: dict) -> dict:
    out = subprocess.run([SERVE, "status"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_serve_sh_prints_how_to_reach_the_app_and_it_serves_a_fan_out(served):
    text = "".join(served["lines"])
    assert f"http://127.0.0.1:{served['port']}/v1/models" in text
    assert "OpenAI(base_url=" in text
    out = _fan_out(served["url"])
    for r in out["results"]:
        assert r["error"] is None and r["usage"]["completion_tokens"] >= 1
        assert r["usage"]["cached_tokens"] == r["usage"]["prompt_tokens"] - 1


def test_serve_status_and_serve_deploy_on_the_running_cluster(served):
    st = _status(served["env"])
    app = st["applications"]["prefillshare"]
    assert app["status"] == "RUNNING"
    assert {"Router", "Orchestrator", "Metrics", "Prefill-base", "Decode-alpha", "Decode-beta"} <= set(app["deployments"])
    # serve deploy: a changed config goes to the running cluster (the Metrics deployment's CPUs)
    new = _serve_config(served["paths"], served["port"], served["pool"], metrics_cpus=0.06)
    path = served["cfg_path"].with_name("serve2.yaml")
    path.write_text(yaml.safe_dump(new))
    dep = subprocess.run([SERVE, "deploy", str(path)], env=served["env"], capture_output=True, text=True, timeout=120)
    assert dep.returncode == 0, dep.stderr
    deadline_polls = 150
    for _ in range(deadline_polls):  # waiting for the update to roll out
        st = _status(served["env"])
        app = st["applications"]["prefillshare"]
        cpus = None
        cfg = subprocess.run([SERVE, "config"], env=served["env"], capture_output=True, text=True, timeout=120)
        if cfg.returncode == 0:
            cpus = yaml.safe_load(cfg.stdout)["args"]["config"]["metrics"]["num_cpus"]
        if app["status"] == "RUNNING" and cpus == 0.06:
            break
        time.sleep(2)
    else:
        pytest.fail(f"serve deploy did not roll out: {app}")
    status, body = _get(served["url"] + "/ready")
    assert status == 200, body
    assert json.loads(body)["ready"] is True
    _fan_out(served["url"])
