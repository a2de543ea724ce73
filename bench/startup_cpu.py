"""Where an app start spends its CPU: `serve run` of a small app, every process it starts sampled
until /ready answers 200, then a table of CPU seconds per process (and the wall time to ready).

On a 2-core box an app start is CPU-bound, so CPU seconds are what a start costs; the table says
which process to make cheaper. The app: one prefill module and one decoder of random weights
(bench/random_models.py), or ``--config`` a serve config of your own (its http_options port is
used). Run it inside a loopback-only network namespace as scripts/test.sh does, e.g.

    unshare -n bash -c 'ip link set lo up && .venv/bin/python -m bench.startup_cpu'
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _small_app(root: Path) -> Path:
    from bench.random_models import free_port, make_models, small_serve_config

    paths = make_models(root / "models", {"alpha": (1, {})})
    cfg = root / "serve.yaml"
    cfg.write_text(yaml.safe_dump(small_serve_config(paths, f"/dev/shm/ps-startup-{os.getpid()}", free_port())))
    return cfg


def _sample(since: float, seen: dict[int, tuple[str, float]]) -> None:
    for p in psutil.process_iter():
        try:
            if p.create_time() < since - 1:
                continue
            t = p.cpu_times()
            seen[p.pid] = (Path(f"/proc/{p.pid}/comm").read_text().strip() + " " + " ".join(p.cmdline())[:70],
                           t.user + t.system)
        except (psutil.Error, OSError):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, help="a serve config (default: a 2-engine app of random weights)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ps-startup-"))
    cfg = args.config or _small_app(tmp)
    port = yaml.safe_load(cfg.read_text()).get("http_options", {}).get("port", 8000)
    env = dict(os.environ, RAY_TMPDIR=str(tmp / "ray"))
    t0 = time.time()
    proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "serve"), "run", str(cfg)], cwd=ROOT, env=env,
                            stdout=(tmp / "serve.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[int, tuple[str, float]] = {}
    try:
        while proc.poll() is None:
            _sample(t0, seen)
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5).status == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        ready = time.time() - t0
        _sample(t0, seen)
        print(f"ready after {ready:.1f} s; CPU seconds by process:")
        for pid, (name, cpu) in sorted(seen.items(), key=lambda kv: -kv[1][1]):
            if cpu >= 0.5:
                print(f"{cpu:7.1f}  {pid:>7}  {name}")
        print(f"{sum(c for _, c in seen.values()):7.1f}  total")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)  # Serve's graceful shutdown, as Ctrl-C
            try:
                proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
