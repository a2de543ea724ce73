"""Probe vLLM's NixlConnector between two engines of different models on this machine.

A producer engine (the base, prefix caching on) and a consumer engine (a decoder with other
weights, or a LoRA adapter of the base; prefix caching off) each run in their own process with
NixlConnector over ``kv_buffer_device: cpu``. Per prompt: a prefill request on the producer
(``max_tokens=1``, ``do_remote_decode``), then the decoder's request with the returned
``kv_transfer_params`` (shared), and the same decoder request without them (private prefill).
It records per-request wall times, the decoder's ``num_cached_tokens`` (L-1 when it pulled the
prompt), its greedy tokens against ``app.reference.shared_greedy`` (shipped models) and vLLM's
NIXL counters, under one named transport setting (:data:`SETTINGS`). Each setting starts fresh
engines (UCX reads its variables at start-up).

    python -m app.bench.nixl_probe --setting default --out runs/nixl/default.json
    python -m app.bench.nixl_probe --setting tuned --models random --lengths 2048,4096

Run it alone on the machine (it starts two engines).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from app.engine.vllm_nixl import NixlSettings, lease_for_timeout, nixl_transfer_config, side_channel_env

# Named transport settings: NIXL's UCX threads (vLLM's ``num_threads``) and UCX variables.
SETTINGS: dict[str, NixlSettings] = {
    "default": NixlSettings(),  # vLLM's defaults: 4 UCX threads, UCX picks transports
    "threads0": NixlSettings(num_threads=0),
    "threads1": NixlSettings(num_threads=1),
    "tcp": NixlSettings(num_threads=0, env={"UCX_TLS": "tcp,self"}),
    "cma": NixlSettings(num_threads=0, env={"UCX_TLS": "cma,tcp,self"}),
}


@dataclass(frozen=True)
class ProbeConfig:
    setting: str = "default"
    models: str = "shipped"           # shipped: checkpoints/base + a decoder; random: ~90M dummy Llama
    decoder: str = "checkpoints/decoders/lookup"
    lora: str | None = None           # a LoRA adapter directory of the base: the consumer serves it
    lengths: tuple[int, ...] = (300, 900)
    repeats: int = 2
    max_tokens: int = 8
    block_size: int = 32
    binds: tuple[str, str] = ("0", "1")  # VLLM_CPU_OMP_THREADS_BIND of producer, consumer
    request_timeout_s: float = 180.0
    ports: tuple[int, int] = (5611, 5612)
    check_tokens: bool = True
    out: str = "runs/nixl/probe.json"
    seed: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)


def _engine_child(cfg, env: dict[str, str], conn) -> None:
    """One engine in its own process: answers (op, args) messages on ``conn`` until "stop"."""
    os.environ.update(env)
    asyncio.run(_serve(cfg, conn))


async def _serve(cfg, conn) -> None:
    from app.engine.async_engine import Engine, Sampling

    t0 = time.perf_counter()
    engine = await Engine.start(cfg)
    conn.send(("ready", time.perf_counter() - t0))
    try:
        while True:
            op, args = await asyncio.to_thread(conn.recv)
            if op == "stop":
                break
            try:
                if op == "generate":
                    t = time.perf_counter()
                    out = await engine.complete(args["ids"], Sampling(max_tokens=args["max_tokens"]),
                                                cache_salt=args.get("salt"),
                                                kv_transfer_params=args.get("kv_transfer_params"),
                                                lora=args.get("lora"))
                    conn.send(("ok", {"seconds": time.perf_counter() - t, "token_ids": out.token_ids,
                                      "num_prompt_tokens": out.num_prompt_tokens,
                                      "num_cached_tokens": out.num_cached_tokens,
                                      "kv_transfer_params": out.kv_transfer_params}))
                elif op == "metrics":
                    conn.send(("ok", nixl_metrics()))
                else:
                    conn.send(("error", f"unknown op {op!r}"))
            except Exception as e:  # noqa: BLE001 - reported to the probe, which records it
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        engine.shutdown()


def nixl_metrics() -> dict[str, float]:
    """vLLM's NIXL counters in this process (Prometheus registry of its stat logger)."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if not metric.name.startswith("vllm:nixl"):
            continue
        for s in metric.samples:
            if s.name.endswith(("_total", "_sum", "_count")):
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


class EngineProcess:
    """An engine child and its pipe; calls block until it answers or ``timeout_s`` passes."""

    def __init__(self, name: str, cfg, env: dict[str, str], start_timeout_s: float = 600.0):
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_child, args=(cfg, env, child), name=name)
        self.proc.start()
        kind, self.start_s = self._recv(start_timeout_s)
        if kind != "ready":
            raise RuntimeError(f"{name}: engine failed to start: {self.start_s}")

    def _recv(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"{self.name}: engine process exited with {self.proc.exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no answer in {timeout_s:.0f}s")
        return self.conn.recv()

    def call(self, op: str, timeout_s: float, **args):
        self.conn.send((op, args))
        kind, value = self._recv(timeout_s)
        if kind != "ok":
            raise RuntimeError(f"{self.name}: {op}: {value}")
        return value

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", {}))
                self.proc.join(60)
            except (BrokenPipeError, OSError):
                pass
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def _models(cfg: ProbeConfig, root: Path) -> tuple[str, str, int]:
    """(base dir, decoder dir, max_model_len)."""
    if cfg.models == "shipped":
        return "checkpoints/base", cfg.decoder, 1024
    from app.bench.models import ModelShape, random_models

    ms = random_models(root, 1, ModelShape(), "checkpoints/tokenizer", dtype="float32")
    return ms.base, ms.shared[0], max(cfg.lengths) + cfg.max_tokens + 64


def _prompts(cfg: ProbeConfig, base: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(base))
    rng = random.Random(cfg.seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in cfg.lengths for _ in range(cfg.repeats)]


def _reference(base: str, decoder: str, lora: str | None, prompts, max_tokens: int) -> list[list[int]]:
    from app.models.checkpoint import load_decoder, load_model
    from app.reference import shared_greedy

    b = load_model(base)
    d = load_decoder(lora or decoder, base)
    return [shared_greedy(b, d, p, max_tokens) for p in prompts]


def run_probe(cfg: ProbeConfig) -> dict:
    from app.engine.async_engine import EngineConfig

    settings = SETTINGS[cfg.setting]
    lease = lease_for_timeout(cfg.request_timeout_s)
    with tempfile.TemporaryDirectory(prefix="nixl-probe-") as tmp:
        base, decoder, max_len = _models(cfg, Path(tmp))
        prompts = _prompts(cfg, base)
        common = dict(dtype="float32", kv_space_gib=0.5, max_model_len=max_len, block_size=cfg.block_size,
                      max_num_batched_tokens=2048, request_timeout_s=cfg.request_timeout_s,
                      load_format="dummy" if cfg.models == "random" else "auto",
                      extra_env=dict(cfg.extra_env))
        prod_cfg = EngineConfig(model=base, omp_threads_bind=cfg.binds[0], enable_prefix_caching=True,
                                kv_transfer_config=nixl_transfer_config("producer", lease_s=lease, settings=settings),
                                **common)
        cons_model = base if cfg.lora else decoder
        cons_cfg = EngineConfig(model=cons_model, omp_threads_bind=cfg.binds[1], enable_prefix_caching=False,
                                kv_transfer_config=nixl_transfer_config("consumer", lease_s=lease, settings=settings),
                                lora_adapters=(("agent", cfg.lora),) if cfg.lora else (), **common)
        result: dict = {"config": asdict(cfg), "settings": asdict(settings), "lease_s": lease,
                        "base": base, "decoder": cfg.lora or decoder, "cases": []}
        t = time.perf_counter()
        prod = EngineProcess("producer", prod_cfg, side_channel_env(cfg.ports[0], settings=settings))
        cons = None
        try:
            cons = EngineProcess("consumer", cons_cfg, side_channel_env(cfg.ports[1], settings=settings))
            result["start_s"] = round(time.perf_counter() - t, 1)
            lora = "agent" if cfg.lora else None
            to = cfg.request_timeout_s + 30
            # warm-up: one pull of a short prompt (handshake, first registration)
            warm = prompts[0][:100]
            p = prod.call("generate", to, ids=warm, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            w = cons.call("generate", to, ids=warm, max_tokens=cfg.max_tokens, lora=lora,
                          kv_transfer_params=p["kv_transfer_params"])
            result["warmup"] = {"prefill_s": p["seconds"], "decode_s": w["seconds"],
                                "cached": w["num_cached_tokens"]}
            for i, ids in enumerate(prompts):
                salt = f"tenant-{i}"
                case = {"L": len(ids)}
                p1 = prod.call("generate", to, ids=ids, max_tokens=1, salt=salt,
                               kv_transfer_params={"do_remote_decode": True})
                shared = cons.call("generate", to, ids=ids, max_tokens=cfg.max_tokens, lora=lora,
                                   kv_transfer_params=p1["kv_transfer_params"])
                # a second prefill of the same prompt and salt: the producer's prefix cache
                p2 = prod.call("generate", to, ids=ids, max_tokens=1, salt=salt,
                               kv_transfer_params={"do_remote_decode": True})
                shared2 = cons.call("generate", to, ids=ids, max_tokens=cfg.max_tokens, lora=lora,
                                    kv_transfer_params=p2["kv_transfer_params"])
                private = cons.call("generate", to, ids=ids, max_tokens=cfg.max_tokens, lora=lora)
                ttft_shared = cons.call("generate", to, ids=ids, max_tokens=1, lora=lora,
                                        kv_transfer_params=prod.call(
                                            "generate", to, ids=ids, max_tokens=1, salt=salt,
                                            kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"])
                ttft_private = cons.call("generate", to, ids=ids, max_tokens=1, lora=lora)
                case.update(prefill_s=p1["seconds"], prefill_cached=p1["num_cached_tokens"],
                            second_prefill_s=p2["seconds"],
                            second_prefill_computed=len(ids) - p2["num_cached_tokens"],
                            shared_s=shared["seconds"], shared_cached=shared["num_cached_tokens"],
                            second_shared_s=shared2["seconds"], second_shared_cached=shared2["num_cached_tokens"],
                            private_s=private["seconds"], private_cached=private["num_cached_tokens"],
                            ttft_shared_s=ttft_shared["seconds"], ttft_shared_cached=ttft_shared["num_cached_tokens"],
                            ttft_private_s=ttft_private["seconds"],
                            shared_tokens=shared["token_ids"], second_shared_tokens=shared2["token_ids"],
                            private_tokens=private["token_ids"])
                result["cases"].append(case)
                print(json.dumps({k: v for k, v in case.items() if not k.endswith("tokens")}), flush=True)
            result["producer_metrics"] = prod.call("metrics", 30)
            result["consumer_metrics"] = cons.call("metrics", 30)
        finally:
            if cons is not None:
                cons.stop()
            prod.stop()
        if cfg.check_tokens and cfg.models == "shipped":
            ref = _reference(base, decoder, cfg.lora, prompts, cfg.max_tokens)
            for case, want in zip(result["cases"], ref):
                case["reference_tokens"] = want
                case["tokens_equal"] = case["shared_tokens"] == want and case["second_shared_tokens"] == want
        result["summary"] = summarize(result["cases"])
    return result


def summarize(cases: list[dict]) -> dict:
    by_len: dict[int, list[dict]] = {}
    for c in cases:
        by_len.setdefault(c["L"], []).append(c)
    out = {}
    for n, cs in sorted(by_len.items()):
        def med(key: str, cs=cs) -> float:
            return round(statistics.median(c[key] for c in cs), 4)
        out[str(n)] = {"ttft_shared_s": med("ttft_shared_s"), "ttft_private_s": med("ttft_private_s"),
                       "shared_s": med("shared_s"), "private_s": med("private_s"), "prefill_s": med("prefill_s"),
                       "second_prefill_s": med("second_prefill_s"),
                       "second_prefill_computed": max(c["second_prefill_computed"] for c in cs),
                       "all_pulled": all(c["shared_cached"] == n - 1 and c["second_shared_cached"] == n - 1
                                         and c["ttft_shared_cached"] == n - 1 for c in cs),
                       "tokens_equal": all(c.get("tokens_equal", True) for c in cs)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="default")
    ap.add_argument("--models", choices=["shipped", "random"], default="shipped")
    ap.add_argument("--decoder", default=ProbeConfig.decoder)
    ap.add_argument("--lora", default=None, help="a LoRA adapter directory of the base (the consumer serves it)")
    ap.add_argument("--lengths", default="300,900")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--binds", default="0,1")
    ap.add_argument("--timeout", type=float, default=180.0, help="per request (s); the lease follows it")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for both engines (repeatable)")
    ap.add_argument("--out", default=ProbeConfig.out)
    a = ap.parse_args(argv)
    cfg = ProbeConfig(setting=a.setting, models=a.models, decoder=a.decoder, lora=a.lora,
                      lengths=tuple(int(x) for x in a.lengths.split(",")), repeats=a.repeats,
                      max_tokens=a.max_tokens, binds=tuple(a.binds.split(",")), request_timeout_s=a.timeout,
                      extra_env=dict(kv.split("=", 1) for kv in a.env), out=a.out)
    if cfg.models == "random":
        cfg = replace(cfg, check_tokens=False)
    result = run_probe(cfg)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
