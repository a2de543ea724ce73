"""Probe vLLM's NixlConnector between two engines of different models on this machine.

A producer engine (the base, prefix caching on) and a consumer engine (a decoder with other
weights, or a LoRA adapter of the base; prefix caching off) each run in their own process with
NixlConnector over ``kv_buffer_device: cpu``. Per prompt: a prefill request on the producer
(``max_tokens=1``, ``do_remote_decode``), then the decoder's request with the returned
``kv_transfer_params`` (shared), and the same decoder request without them (private prefill).
It records per-request wall times, the decoder's ``num_cached_tokens`` (L when it pulled the
prompt: vLLM counts every prompt token and recomputes the last), its greedy tokens against ``prefillshare.app.reference.shared_greedy`` (shipped models) and vLLM's
NIXL counters, under one named transport setting (:data:`SETTINGS`). Each setting starts fresh
engines (UCX reads its variables at start-up). ``--device cuda`` puts both engines on the GPU
(``kv_buffer_device: cuda``, a small share of its memory each, the app's GPU settings unless
``--setting`` names others): bench/gpu_check.py runs it so. ``--models random --shape 8B`` runs
config-only Llama shapes with vLLM's dummy weights (no weights file is written).

    python -m bench.nixl_probe --setting polled --out runs/nixl/polled.json
    python -m bench.nixl_probe --setting polled --models random --lengths 2048,4096

Run it alone on the machine (it starts two engines).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from prefillshare.app.engine.nixl.config import (
    CPU_SETTINGS,
    GPU_SETTINGS,
    NixlSettings,
    lease_for_timeout,
    nixl_transfer_config,
    side_channel_env,
)
from prefillshare.app.engine.nixl.leases import read_vllm_nixl_counters

# Named transport settings: NIXL's UCX threads (vLLM's ``num_threads``) and UCX variables.
SETTINGS: dict[str, NixlSettings] = {
    "default": NixlSettings(),  # vLLM's: NIXL progress thread on, 4 UCX threads, UCX picks transports
    "threads0": NixlSettings(num_threads=0),
    "polled": CPU_SETTINGS,  # the project's CPU setting: progress thread off
    "polled-tcp": NixlSettings(progress_thread=False, ucx_env={"UCX_TLS": "tcp,self"}),
    "gpu": GPU_SETTINGS,  # the project's GPU setting: progress thread off, CUDA IPC reads on
    "gpu-auto": NixlSettings(progress_thread=False),  # the same without the CUDA IPC override
}

# Llama shapes of ``--models random`` (config only; vLLM's dummy weights), ``--shape``
SHAPES: dict[str, dict[str, int]] = {
    "toy": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=512),
    "90M": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                intermediate_size=2816),
    "8B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336),
}


@dataclass(frozen=True)
class ProbeConfig:
    setting: str = "default"
    models: str = "shipped"           # shipped: checkpoints/base + a decoder; random: a dummy Llama of ``shape``
    shape: str = "90M"                # --models random: a key of SHAPES
    kv_cache_memory_bytes: int = 536870912
    decoder: str = "checkpoints/decoders/lookup"
    lora: str | None = None           # a LoRA adapter directory of the base: the consumer serves it
    lengths: tuple[int, ...] = (300, 900)
    repeats: int = 2
    max_tokens: int = 8
    block_size: int = 32
    binds: tuple[str, str] = ("0", "1")  # VLLM_CPU_OMP_THREADS_BIND of producer, consumer
    request_timeout_s: float = 180.0
    ports: tuple[int, int] = (5611, 5612)
    idle_s: float = 5.0
    check_tokens: bool = True
    out: str = "runs/nixl/probe.json"
    seed: int = 0
    device: str = "cpu"               # cpu: UCX over host memory; cuda: both engines on the GPU
    dtype: str = "float32"
    extra_env: dict[str, str] = field(default_factory=dict)


def _engine_child(cfg, env: dict[str, str], conn) -> None:
    """One engine in its own process: runs (id, op, kwargs) messages on ``conn`` concurrently."""
    os.environ.update(env)
    asyncio.run(_serve(cfg, conn))


async def _serve(cfg, conn) -> None:
    from prefillshare.app.engine.async_engine import Engine

    t0 = time.perf_counter()
    try:
        engine = await Engine.start(cfg)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send((0, "error", f"{type(e).__name__}: {e}"))
        return
    conn.send((0, "ok", time.perf_counter() - t0))

    async def run(mid: int, op: str, kw: dict) -> None:
        try:
            if op == "metrics":
                value = read_vllm_nixl_counters()
            elif op in ("complete", "prefill"):
                value = await getattr(engine, op)(**kw)
            else:
                raise ValueError(f"unknown op {op!r}")
            conn.send((mid, "ok", value))
        except Exception as e:  # noqa: BLE001 - reported to the caller, which raises it
            conn.send((mid, "error", f"{type(e).__name__}: {e}"))

    tasks = set()
    try:
        while True:
            mid, op, kw = await asyncio.to_thread(conn.recv)
            if op == "stop":
                break
            task = asyncio.create_task(run(mid, op, kw))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        engine.shutdown()


class EngineProcess:
    """An :class:`prefillshare.app.engine.async_engine.Engine` in a spawned process, with the same async
    ``complete`` / ``prefill``: one engine per process keeps vLLM's per-process metrics apart
    (its stat logger replaces the registry's vLLM metrics when another engine starts)."""

    def __init__(self, name: str, cfg, env: dict[str, str], start_timeout_s: float = 600.0):
        import threading

        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_child, args=(cfg, env, child), name=name)
        self.proc.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"{name}: engine process exited with {self.proc.exitcode}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{name}: engine not ready in {start_timeout_s:.0f}s")
        _, kind, value = self.conn.recv()
        if kind != "ok":
            self.stop()
            raise RuntimeError(f"{name}: engine failed to start: {value}")
        self.start_s = value
        self._send_lock = threading.Lock()
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._next = 1
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                mid, kind, value = self.conn.recv()
            except (EOFError, OSError):
                ended = f"{self.name}: engine process ended"
                for loop, fut in list(self._waiting.values()):
                    loop.call_soon_threadsafe(lambda f=fut, e=ended: f.done() or f.set_exception(RuntimeError(e)))
                return
            loop, fut = self._waiting.pop(mid)
            if kind == "ok":
                loop.call_soon_threadsafe(lambda f=fut, v=value: f.done() or f.set_result(v))
            else:
                loop.call_soon_threadsafe(lambda f=fut, v=value: f.done() or f.set_exception(RuntimeError(v)))

    async def _call(self, op: str, **kw):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._send_lock:
            mid, self._next = self._next, self._next + 1
            self._waiting[mid] = (loop, fut)
            self.conn.send((mid, op, kw))
        return await fut

    async def complete(self, prompt_token_ids, sampling, request_id=None, cache_salt=None,
                       kv_transfer_params=None, lora=None):
        return await self._call("complete", prompt_token_ids=list(prompt_token_ids), sampling=sampling,
                                request_id=request_id, cache_salt=cache_salt,
                                kv_transfer_params=kv_transfer_params, lora=lora)

    async def prefill(self, prompt_token_ids, request_id=None, cache_salt=None, kv_transfer_params=None,
                      lora=None):
        return await self._call("prefill", prompt_token_ids=list(prompt_token_ids), request_id=request_id,
                                cache_salt=cache_salt, kv_transfer_params=kv_transfer_params, lora=lora)

    async def metrics(self) -> dict[str, float]:
        return await self._call("metrics")

    def cpu_seconds(self) -> float:
        """CPU time of the engine's process tree (its EngineCore and worker included)."""
        import psutil

        total = 0.0
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            pass
        return total

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send((0, "stop", {}))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def _dummy_llama(path: Path, shape: str, max_len: int, tokenizer: str = "checkpoints/tokenizer") -> str:
    """A config-only Llama of ``SHAPES[shape]`` with the project's tokenizer (vLLM loads dummy weights)."""
    import shutil

    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=max_len, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **SHAPES[shape])
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    for f in Path(tokenizer).iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    return str(path)


def _models(cfg: ProbeConfig, root: Path) -> tuple[str, str, int]:
    """(base dir, decoder dir, max_model_len)."""
    if cfg.models == "shipped":
        return "checkpoints/base", cfg.decoder, 1024
    max_len = max(cfg.lengths) + cfg.max_tokens + 64
    return _dummy_llama(root / "base", cfg.shape, max_len), _dummy_llama(root / "dec", cfg.shape, max_len), max_len


def _prompts(cfg: ProbeConfig, base: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(base))
    rng = random.Random(cfg.seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in cfg.lengths for _ in range(cfg.repeats)]


def _reference(base: str, decoder: str, lora: str | None, prompts, max_tokens: int) -> list[list[int]]:
    """``prefillshare.app.reference.shared_greedy`` tokens, stopping at EOS as the engine does."""
    from prefillshare.app.models.checkpoint import load_decoder, load_model
    from prefillshare.app.reference import shared_greedy

    b = load_model(base)
    d = load_decoder(lora or decoder, base)
    return [shared_greedy(b, d, p, max_tokens, eos_token_id=b.config.eos_token_id) for p in prompts]


def start_engines(specs: dict) -> dict[str, EngineProcess]:
    """Start engine processes concurrently: name -> (EngineConfig, env). All or none: a failed start
    stops the others and raises."""
    import threading

    out: dict[str, EngineProcess] = {}
    errors: list[BaseException] = []

    def one(name, cfg, env):
        try:
            out[name] = EngineProcess(name, cfg, env)
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(n, c, e)) for n, (c, e) in specs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for e in out.values():
            e.stop()
        raise errors[0]
    return out


def engine_common(cfg: ProbeConfig, max_len: int) -> dict:
    """EngineConfig fields both engines of a probe share, whatever carries their KV."""
    gpu = dict(gpu_memory_utilization=0.05) if cfg.device == "cuda" else {}
    return dict(dtype=cfg.dtype, kv_cache_memory_bytes=cfg.kv_cache_memory_bytes, **gpu, max_model_len=max_len,
                block_size=cfg.block_size, max_num_batched_tokens=2048, request_timeout_s=cfg.request_timeout_s,
                load_format="dummy" if cfg.models == "random" else "auto")


def engine_env(cfg: ProbeConfig, i: int) -> dict[str, str]:
    """Env of the producer (0) or the consumer (1): its core binding."""
    return {**cfg.extra_env, "VLLM_CPU_OMP_THREADS_BIND": cfg.binds[i]}


def engine_configs(cfg: ProbeConfig, base: str, decoder: str, max_len: int):
    """(producer EngineConfig, consumer EngineConfig, lease seconds) of this probe."""
    from prefillshare.app.engine.async_engine import EngineConfig

    settings = SETTINGS[cfg.setting]
    lease = lease_for_timeout(cfg.request_timeout_s)
    common = engine_common(cfg, max_len)
    env = functools.partial(engine_env, cfg)

    prod = EngineConfig(model=base, extra_env=env(0), enable_prefix_caching=True,
                        kv_transfer_config=nixl_transfer_config("producer", lease_s=lease, settings=settings,
                                                                kv_buffer_device=cfg.device),
                        **common)
    cons = EngineConfig(model=base if cfg.lora else decoder, extra_env=env(1),
                        enable_prefix_caching=False,
                        kv_transfer_config=nixl_transfer_config("consumer", lease_s=lease, settings=settings,
                                                                kv_buffer_device=cfg.device),
                        lora_adapters=(("agent", cfg.lora),) if cfg.lora else (), **common)
    return prod, cons, lease


def engine_specs(cfg: ProbeConfig, base: str, decoder: str, max_len: int) -> tuple[dict, int]:
    """What :func:`start_engines` takes for this probe's two engines (each with its own NIXL
    handshake port, ``cfg.ports``), and the lease seconds."""
    prod, cons, lease = engine_configs(cfg, base, decoder, max_len)
    return {"producer": (prod, side_channel_env(cfg.ports[0])),
            "consumer": (cons, side_channel_env(cfg.ports[1]))}, lease


async def lend(handover, engine, prompt_token_ids, n: int, cache_salt: str | None = None) -> list:
    """N leases of one prompt, taken as the Prefill replica takes them (``handover``: the app's
    NixlHandover): the first prefill alone, then N-1 together (they hit the prefix cache it filled)."""
    ids = [int(t) for t in prompt_token_ids]
    sent = time.time()
    first = await engine.prefill(ids, None, cache_salt=cache_salt, kv_transfer_params=handover.prefill_params())
    rest = await asyncio.gather(*(engine.prefill(ids, None, cache_salt=cache_salt,
                                                 kv_transfer_params=handover.prefill_params()) for _ in range(n - 1)))
    return list(handover.handoffs([first, *rest], sent))


async def decode(side, engine, prompt_token_ids, sampling, lease, cache_salt: str | None = None,
                 lora: str | None = None):
    """A decoder request as the Decode replica makes it (``side``: the hand-over's decode side): a
    pull of ``lease`` while it is safely inside the lease, else a private prefill; counted by ``side``."""
    ids = [int(t) for t in prompt_token_ids]
    pull = side.pull(lease)
    out = await engine.complete(ids, sampling, None, cache_salt, pull.params if pull else None, lora)
    if pull is not None:
        side.finished(pull, len(ids), out.num_cached_tokens)
    return out


async def _cases(cfg: ProbeConfig, prod: EngineProcess, cons: EngineProcess, prompts, lease: int) -> dict:
    from prefillshare.app.engine.nixl.handover import NixlHandover
    from prefillshare.app.sampling import Sampling

    lora = "agent" if cfg.lora else None
    handover = NixlHandover(lease)  # the app's classes: the Prefill replica's leases, the Decode replica's pulls
    side = handover.decode_side()
    out: dict = {"cases": []}
    # warm-up: the first pull makes the NIXL handshake and registers the peer
    warm = prompts[0][:128]
    t = time.perf_counter()
    (le,) = await lend(handover, prod, warm, 1)
    w = await decode(handover.decode_side(), cons, warm, Sampling(max_tokens=2), le, lora=lora)
    out["warmup"] = {"seconds": time.perf_counter() - t, "cached": w.num_cached_tokens}
    out["consumer_metrics_after_warmup"] = await cons.metrics()
    # idle: CPU the two engines burn with nothing to do (spinning progress threads show here)
    c0 = prod.cpu_seconds() + cons.cpu_seconds()
    await asyncio.sleep(cfg.idle_s)
    out["idle_cpu_per_s"] = round((prod.cpu_seconds() + cons.cpu_seconds() - c0) / cfg.idle_s, 3)
    c0 = prod.cpu_seconds() + cons.cpu_seconds()
    t_all = time.perf_counter()
    for i, ids in enumerate(prompts):
        salt = f"tenant-{i}"
        case: dict = {"L": len(ids)}
        t = time.perf_counter()
        leases = await lend(handover, prod, ids, 2, cache_salt=salt)
        case["prefills_s"] = time.perf_counter() - t
        case["prefill_computed"] = [le.computed_tokens for le in leases]
        t = time.perf_counter()
        shared = await decode(side, cons, ids, Sampling(max_tokens=cfg.max_tokens), leases[0], salt, lora)
        case["shared_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ttft = await decode(side, cons, ids, Sampling(max_tokens=1), leases[1], salt, lora)
        case["ttft_shared_s"] = time.perf_counter() - t
        t = time.perf_counter()
        private = await decode(side, cons, ids, Sampling(max_tokens=1), None, salt, lora)
        case["ttft_private_s"] = time.perf_counter() - t
        case.update(shared_cached=shared.num_cached_tokens, ttft_shared_cached=ttft.num_cached_tokens,
                    private_cached=private.num_cached_tokens, shared_tokens=shared.token_ids)
        out["cases"].append(case)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in case.items()
                          if k != "shared_tokens"}), flush=True)
    out["cases_s"] = time.perf_counter() - t_all
    out["cases_cpu_s"] = round(prod.cpu_seconds() + cons.cpu_seconds() - c0, 2)
    out["handover_counters"] = side.counters.as_dict()
    out["producer_metrics"] = await prod.metrics()
    out["consumer_metrics"] = await cons.metrics()
    return out


def run_probe(cfg: ProbeConfig) -> dict:
    with tempfile.TemporaryDirectory(prefix="nixl-probe-") as tmp:
        base, decoder, max_len = _models(cfg, Path(tmp))
        prompts = _prompts(cfg, base)
        specs, lease = engine_specs(cfg, base, decoder, max_len)
        result: dict = {"config": asdict(cfg), "settings": asdict(SETTINGS[cfg.setting]), "lease_s": lease,
                        "base": base, "decoder": cfg.lora or decoder}
        t = time.perf_counter()
        engines = start_engines(specs)
        try:
            result["start_s"] = round(time.perf_counter() - t, 1)
            result.update(asyncio.run(_cases(cfg, engines["producer"], engines["consumer"], prompts, lease)))
        finally:
            for e in engines.values():
                e.stop()
        if cfg.check_tokens and cfg.models == "shipped":
            ref = _reference(base, decoder, cfg.lora, prompts, cfg.max_tokens)
            for case, want in zip(result["cases"], ref):
                case["reference_tokens"] = want
                case["tokens_equal"] = case["shared_tokens"] == want
        result["summary"] = summarize(result["cases"])
        result["kv_transfer"] = transfer_rate(result["consumer_metrics"], result["consumer_metrics_after_warmup"])
    return result


def transfer_rate(metrics: dict[str, float], before: dict[str, float] | None = None) -> dict[str, float]:
    """KV bytes the decoder pulled and NIXL's own time for them (vLLM's ``nixl_bytes_transferred``
    and ``nixl_xfer_time_seconds``), with their ratio in GB/s; since ``before`` (the counters after
    the warm-up, whose pull also makes the handshake) when given."""
    def since(key: str) -> float:
        return metrics.get(key, 0.0) - (before or {}).get(key, 0.0)

    nbytes, secs = since("bytes_transferred_sum"), since("xfer_time_seconds_sum")
    return {"mib": round(nbytes / 2**20, 1), "seconds": round(secs, 4), "pulls": since("xfer_time_seconds_count"),
            "gb_s": round(nbytes / secs / 1e9, 3) if secs else 0.0}


def summarize(cases: list[dict]) -> dict:
    by_len: dict[int, list[dict]] = {}
    for c in cases:
        by_len.setdefault(c["L"], []).append(c)
    out = {}
    for n, cs in sorted(by_len.items()):
        def med(key: str, cs=cs) -> float:
            return round(statistics.median(c[key] for c in cs), 4)
        out[str(n)] = {"ttft_shared_s": med("ttft_shared_s"), "ttft_private_s": med("ttft_private_s"),
                       "shared_s": med("shared_s"), "prefills_s": med("prefills_s"),
                       "second_prefill_computed": max(c["prefill_computed"][1] for c in cs),
                       # vLLM counts all L prompt tokens as cached on a pull (it recomputes the last)
                       "all_pulled": all(min(c["shared_cached"], c["ttft_shared_cached"]) >= n - 1 for c in cs),
                       "tokens_equal": all(c.get("tokens_equal", True) for c in cs)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="default")
    ap.add_argument("--models", choices=["shipped", "random"], default="shipped")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=ProbeConfig.shape, help="--models random: its shape")
    ap.add_argument("--kv-bytes", type=int, default=ProbeConfig.kv_cache_memory_bytes,
                    help="each engine's kv_cache_memory_bytes")
    ap.add_argument("--decoder", default=ProbeConfig.decoder)
    ap.add_argument("--lora", default=None, help="a LoRA adapter directory of the base (the consumer serves it)")
    ap.add_argument("--lengths", default="300,900")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--binds", default="0,1")
    ap.add_argument("--timeout", type=float, default=180.0, help="per request (s); the lease follows it")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of idle CPU measured after the warm-up")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for both engines (repeatable)")
    ap.add_argument("--out", default=ProbeConfig.out)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default=ProbeConfig.dtype)
    a = ap.parse_args(argv)
    cfg = ProbeConfig(setting=a.setting, models=a.models, decoder=a.decoder, lora=a.lora,
                      lengths=tuple(int(x) for x in a.lengths.split(",")), repeats=a.repeats,
                      max_tokens=a.max_tokens, binds=tuple(a.binds.split(",")), request_timeout_s=a.timeout,
                      extra_env=dict(kv.split("=", 1) for kv in a.env), out=a.out, idle_s=a.idle,
                      device=a.device, dtype=a.dtype, shape=a.shape, kv_cache_memory_bytes=a.kv_bytes)
    if cfg.models == "random":
        cfg = replace(cfg, check_tokens=False)
    result = run_probe(cfg)
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"summary": result["summary"], "kv_transfer": result["kv_transfer"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
