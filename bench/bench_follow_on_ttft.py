"""First-token wait of a follow-on completion: the app (LoRA decoders) against stock vLLM.

Both servers run the shipped base (checkpoints/base) and its four chat-format LoRA adapters, and
both are driven by vLLM's own benchmark client (``vllm.benchmarks.serve``) with the
``prefix_repetition`` dataset unshuffled, one request at a time (``--decoders in-engine``: the adapters in the prefill module's own engine, which
reads its prefix cache; else a decode group fed the base's KV): every request after the first
shares its prefix with the one before it, so stock vLLM finds that prefix in its prefix cache and
the app finds it in the prefill module's cache (and the base's KV in the pool). Requests go to the
adapters round-robin. The client sends no ``ignore_eos``.

    bash bench/bench_follow_on.sh [--num-prompts 40] [--out F]

(bench/bench_follow_on.sh runs this file in a loopback-only network namespace.) One run of
each server; prints and writes (``--out``, JSON) the median, p90 and p99 TTFT of each and their
difference. ``--only app`` or ``--only vllm`` runs one side. ``--stock-worker engine-core`` runs
stock vLLM's worker inside its EngineCore, as the app runs its CPU engines (vLLM's default on the
CPU is a process of its own). ``--ingress`` picks how the client reaches the app: through Serve's
HTTP proxy (``proxy``), straight to the Router replica's own port with Serve's direct ingress on
(``direct``, README "Direct ingress"), or both from one deployment, alternating ``--repeats``
times (``both``, the default).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADAPTERS = ("lookup", "tool_call", "reschedule", "route")
ENGINE = {"dtype": "auto", "max_model_len": 1024, "kv_cache_memory_bytes": "256MiB", "block_size": 32, "max_num_seqs": 16,
          "enforce_eager": True, "threads_bind": "nobind"}


def _names() -> list[str]:
    return [f"chat-{a}" for a in ADAPTERS]


def _adapter(a: str) -> Path:
    return ROOT / "checkpoints" / "chat" / "adapters" / a


def app_config(pool: str, decoders: str = "group") -> dict:
    """The app of serve_config.yaml's commented chat group: the base's prefill module and one
    decode group on the base holding the four chat adapters (no full-weight decoders); with
    ``decoders="in-engine"`` the prefill module's own engine serves the four adapters instead."""
    ck = ROOT / "checkpoints"
    if decoders == "in-engine":
        return {
            "tokenizer": str(ck / "tokenizer"),
            "pool": {"path": pool, "capacity_bytes": "512MiB"},
            "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
            "prefill_modules": [{"name": "base", "model": str(ck / "base"), "engine": ENGINE, "max_lora_rank": 8,
                                 "placement": {"num_replicas": 1, "num_cpus": 0.5},
                                 "lora_decoders": [{"name": n, "path": str(_adapter(a)), "rank": 8}
                                                   for n, a in zip(_names(), ADAPTERS)]}],
        }
    return {
        "tokenizer": str(ck / "tokenizer"),
        "pool": {"path": pool, "capacity_bytes": "512MiB"},
        "engine_env": {"VLLM_HOST_IP": "127.0.0.1"},
        "prefill_modules": [{"name": "base", "model": str(ck / "base"), "engine": ENGINE,
                             "placement": {"num_replicas": 1, "num_cpus": 0.5}}],
        "decoders": [{"name": "chat-group", "model": str(ck / "base"), "max_lora_rank": 8, "max_loras": 4,
                      "adapters": [{"name": n, "path": str(_adapter(a)), "rank": 8}
                                   for n, a in zip(_names(), ADAPTERS)],
                      "engine": ENGINE,
                      "placement": {"num_replicas": 1, "num_cpus": 0.25, "placement_group_bundles": [{"CPU": 0.25}]}}],
    }


def client(port: int, args, label: str) -> dict:
    """vLLM's benchmark client against 127.0.0.1:``port``; its result dict."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser
    from vllm.benchmarks.serve import add_cli_args, main

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "openai", "--host", "127.0.0.1", "--port", str(port), "--endpoint", "/v1/completions",
            "--model", str(ROOT / "checkpoints" / "base"), "--tokenizer", str(ROOT / "checkpoints" / "tokenizer"),
            "--dataset-name", "prefix_repetition", "--disable-shuffle",
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", "1", "--prefix-repetition-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", "1", "--request-rate", "inf",
            "--num-warmups", "2", "--lora-modules", *_names(), "--lora-assignment", "round-robin",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99",
            "--label", label, "--seed", "0", "--ready-check-timeout-sec", "0"]
    return main(parser.parse_args(argv))


def _summary(result: dict) -> dict:
    keep = ("completed", "median_ttft_ms", "mean_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "median_e2el_ms")
    return {k: result.get(k) for k in keep}


def _breakdown(url: str) -> dict:
    """The app's own view from /metrics over the run (warm-up requests included): the mean
    first-token wait the Router saw (prefill included, HTTP and proxy not), the prefill
    replica's engine time, and the fallbacks by reason."""
    from bench.serve_bench import METRICS_SETTLE_S

    time.sleep(METRICS_SETTLE_S)  # the replicas' last metrics events of the run reach /metrics
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    sums: dict[str, float] = {}
    fallbacks: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        base = name.split("{", 1)[0]
        sums[base] = sums.get(base, 0.0) + float(value)
        if base == "prefillshare_fallbacks_total":
            fallbacks[name.split('reason="', 1)[1].split('"', 1)[0]] = float(value)

    def mean_ms(metric: str) -> float | None:
        n = sums.get(metric + "_count", 0.0)
        return sums.get(metric + "_sum", 0.0) / n * 1e3 if n else None

    return {"router_ttft_mean_ms": mean_ms("prefillshare_ttft_seconds"),
            "prefill_engine_mean_ms": mean_ms("prefillshare_prefill_seconds"), "fallbacks": fallbacks}


def run_app(args) -> dict:
    """{"proxy": [runs], "direct": [runs], "breakdown": the app's own view}: one deployment, the
    client through each ingress ``--ingress`` names, alternating."""
    from bench.random_models import serve_app  # starts a private cluster, waits for /ready
    from prefillshare.app.config import load_config
    from prefillshare.deployments.ray_internals import direct_ingress_env, direct_ingress_urls

    if args.ingress != "proxy":  # read by the cluster this process starts (README "Direct ingress")
        from bench.local_cluster import free_port

        os.environ.update(direct_ingress_env(free_port()))
    pool = f"/dev/shm/ps-ttft-{os.getpid()}"
    ray_tmp = f"/tmp/ps-ttft-ray-{os.getpid()}"
    cfg = load_config(app_config(pool, args.decoders))
    try:
        with serve_app(cfg, "ttft", ray_tmp, pool) as url:  # stops the app and its cluster, removes the pool
            ports = {"proxy": int(url.rsplit(":", 1)[1])}
            if args.ingress != "proxy":
                ports["direct"] = int(direct_ingress_urls("ttft")[0].rsplit(":", 1)[1])
            order = ("proxy", "direct") if args.ingress == "both" else (args.ingress,)
            runs: dict = {k: [] for k in order}
            for rep in range(args.repeats):
                for way in order if rep % 2 == 0 else order[::-1]:
                    runs[way].append({**_summary(client(ports[way], args, f"prefillshare-{way}")),
                                      "loadavg_1m": os.getloadavg()[0]})
            return {**runs, "breakdown": _breakdown(url)}
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _wait(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"vLLM's server did not answer within {timeout_s} s")


def run_vllm(args) -> list[dict]:
    """Stock vLLM's OpenAI server on the base with prefix caching and the same adapters."""
    from bench.local_cluster import free_port
    from prefillshare.app.engine.compute_dtype import resolve

    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    if args.stock_worker == "engine-core":  # as the app's CPU engines run (prefillshare.app.engine_args.CPU_ENGINE_ENV)
        from prefillshare.app.engine_args import CPU_ENGINE_ENV

        env.update(CPU_ENGINE_ENV)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ROOT / "checkpoints" / "base"),
           "--tokenizer", str(ROOT / "checkpoints" / "tokenizer"), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", resolve(ENGINE["dtype"]),  # what the app's engines run ("auto": float32 without native bf16)
           "--max-model-len", str(ENGINE["max_model_len"]), "--block-size", str(ENGINE["block_size"]),
           "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--enforce-eager", "--enable-prefix-caching",
           "--enable-lora", "--max-lora-rank", "8", "--max-loras", "4",
           "--lora-modules", *(f"{n}={_adapter(a)}" for n, a in zip(_names(), ADAPTERS))]
    log = open(Path(args.out).with_suffix(".vllm.log"), "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(f"http://127.0.0.1:{port}", proc, 600)
        return [client(port, args, "vllm") for _ in range(args.repeats)]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--prefix-len", type=int, default=768)  # the base's context is 1,024 tokens
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--only", choices=("app", "vllm"))
    p.add_argument("--decoders", choices=("group", "in-engine"), default="group",
                   help="the app's adapters: a decode group fed the base's KV, or in the prefill module's engine")
    p.add_argument("--stock-worker", choices=("process", "engine-core"), default="process",
                   help="stock vLLM's worker: in its own process (vLLM's default on the CPU) or inside "
                        "EngineCore, as the app's CPU engines run")
    p.add_argument("--ingress", choices=("proxy", "direct", "both"), default="both",
                   help="how the client reaches the app: Serve's HTTP proxy, the Router replica's own port "
                        "(Serve's direct ingress), or both from one deployment")
    p.add_argument("--repeats", type=int, default=2, help="client runs per ingress (alternating) and of stock vLLM")
    p.add_argument("--out", default="runs/bench/follow_on_ttft.json")
    args = p.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"args": vars(args)}
    if args.only in (None, "app"):
        report["app"] = run_app(args)
    if args.only in (None, "vllm"):
        report["vllm"] = [_summary(r) for r in run_vllm(args)]
    medians = {k: statistics.median(r["median_ttft_ms"] for r in runs)
               for k, runs in [*report.get("app", {}).items(), ("vllm", report.get("vllm", []))]
               if k != "breakdown" and runs}
    report["median_ttft_ms"] = medians
    if "vllm" in medians:
        report["median_ttft_gap_ms"] = {k: v - medians["vllm"] for k, v in medians.items() if k != "vllm"}
    report["loadavg"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
