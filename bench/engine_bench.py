"""`python -m bench engine`: one shared prefill + N decoders loading its KV, vs N private prefills.

Three real vLLM engines on a random-weight Llama (~100M parameters by default, vLLM's
``load_format="dummy"``): the producer (base, connector role producer), a consumer decoder
(connector role consumer) and a private decoder (no connector, no prefix caching). The N
decoders of a fan-out are N sequential requests to the decoder engine: prompt-processing work
per decoder does not depend on its weights, and one engine per decoder would not fit 2 cores.

Per case (prompt length L, fan-out N) it measures, each decoder request alone on its engine:
  private: decoder time-to-first-token = prefill of all L tokens;
  shared:  base prefill once, then per decoder time-to-first-token = load of L-1 tokens' KV
           from the pool + compute of the last prompt token;
plus the KV hand-over itself from the pool counters: load (pool slots -> decoder cache) and save
(producer cache -> pool slots) in GB/s and us/token, each beside a plain memory copy of the same
bytes measured in this process in the same case (one thread, as each engine worker has), per wall
second and per CPU second of the copying thread (the latter holds when other processes share the
cores), and CPU seconds of all engine processes in each phase (psutil). Prints a table, writes JSON.

    python -m bench engine --quick          # smoke test (small model, one case)
    python -m bench engine --out runs/bench/engine.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, replace

from bench.models import SMALL, ModelShape
from prefillshare.app.engine import compute_dtype

__all__ = ["BenchConfig", "CaseResult", "run_bench", "configure", "format_kv_table"]


@dataclass(frozen=True)
class BenchConfig:
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096)
    fanouts: tuple[int, ...] = (2, 4, 8)
    shape: ModelShape = ModelShape()
    vocab: int = 8192
    dtype: str = "auto"
    block_size: int = 32
    max_num_batched_tokens: int = 2048
    kv_space_gib: float = 0.5
    binds: tuple[str, str, str] = ("0", "1", "1")  # producer, consumer, private decoder
    out: str = "runs/bench/engine.json"
    progress: bool = True
    seed: int = 0
    private: bool = True  # False: no private decoder (2 engines): only the shared side and the KV hand-over

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError("--lengths: prompt lengths must be >= 2")
        if not self.fanouts or min(self.fanouts) < 1:
            raise ValueError("--fanouts: fan-outs must be >= 1")

    @property
    def max_model_len(self) -> int:
        return max(self.lengths) + 64

    @property
    def params(self) -> int:
        return self.shape.params(self.vocab)


@dataclass
class CaseResult:
    prompt_tokens: int
    fanout: int
    private_prompt_s: float  # mean decoder prompt-processing time, private prefill
    shared_prompt_s: float  # mean decoder prompt-processing time, loading the base's KV
    ratio: float  # private / shared
    base_prefill_s: float  # the one shared prefill
    private_total_s: float  # N private prefills
    shared_total_s: float  # one base prefill + N loads
    kv_load_s_per_token: float
    kv_bytes_moved: int  # bytes copied from the pool into the decoder, all N decoders
    kv_bytes_per_token: float
    kv_load_gb_s: float  # bytes moved / load seconds (worker copy, seqlock checks, index transaction)
    kv_save_gb_s: float  # bytes saved / save seconds (index transaction, copy, publish), producer
    kv_save_s_per_token: float
    copy_gb_s: float  # plain memory copy of one decoder's KV bytes, same run
    load_vs_copy: float  # kv_load_gb_s / copy_gb_s
    save_vs_copy: float
    # the same per CPU second of the copying thread (robust when other processes share the cores)
    kv_load_gb_cpu_s: float
    kv_save_gb_cpu_s: float
    copy_gb_cpu_s: float
    load_vs_copy_cpu: float
    save_vs_copy_cpu: float
    cpu_s_private: float
    cpu_s_shared: float
    cached_tokens_ok: bool  # every shared decoder reported L-1 cached tokens
    extra: dict = field(default_factory=dict)


def _write_model_config(path: str, cfg: BenchConfig) -> None:
    from transformers import LlamaConfig

    m = cfg.shape
    LlamaConfig(vocab_size=cfg.vocab, hidden_size=m.hidden, num_hidden_layers=m.layers,
                num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                intermediate_size=m.intermediate, max_position_embeddings=cfg.max_model_len,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, dtype="bfloat16").save_pretrained(path)


def _copy_gb_s(nbytes: int, repeats: int = 5) -> tuple[float, float]:
    """Best-of bandwidth of one contiguous copy of ``nbytes`` (the yardstick for load and save),
    per wall second and per CPU second of the copying thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(max(nbytes, 1), dtype=torch.uint8)
        dst = torch.empty_like(src)
        best = best_cpu = float("inf")
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            dst.copy_(src)
            best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.thread_time() - c0)
        return nbytes / best / 1e9, nbytes / max(best_cpu, 1e-9) / 1e9
    finally:
        torch.set_num_threads(threads)


async def _saved(pool, before: float, timeout_s: float = 5.0):
    """The producer's counters once its last save was written (counters are flushed off the hot path)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = pool.stats(scope="bench-producer")
        if st.get("saves") > before or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.05)


def process_tree_cpu_seconds(include_self: bool = False) -> float:
    """User + system CPU seconds of this process's children (engines), and of itself if asked."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in me.children(recursive=True) + ([me] if include_self else []):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


async def _ttft(engine, ids, salt, params=None) -> tuple[float, int]:
    from prefillshare.app.engine.async_engine import Sampling

    t0 = time.perf_counter()
    async for out in engine.generate(ids, Sampling(max_tokens=1, ignore_eos=True), None, salt, params):
        if out.new_token_ids:
            return time.perf_counter() - t0, out.num_cached_tokens
    return time.perf_counter() - t0, 0


def _start_engines(cfg: BenchConfig, model: str, spec) -> list:
    """[producer, consumer, private decoder (or None)]: one engine per role, each on its own core list."""
    from prefillshare.app.engine.async_engine import Engine, EngineConfig
    from prefillshare.app.engine.pool.handover import connector_config

    common = dict(model=model, dtype=cfg.dtype, kv_cache_memory_bytes=int(cfg.kv_space_gib * (1 << 30)),
                  max_model_len=cfg.max_model_len, block_size=cfg.block_size,
                  max_num_batched_tokens=cfg.max_num_batched_tokens, load_format="dummy", skip_tokenizer_init=True,
                  enforce_eager=True, max_num_seqs=8, request_timeout_s=600.0)  # long runs of queued requests

    def bind(i: int) -> dict:
        return {"VLLM_CPU_OMP_THREADS_BIND": cfg.binds[i]}

    t0 = time.perf_counter()
    engines = [Engine(EngineConfig(**common, extra_env=bind(0), kv_transfer_config=connector_config(
        "producer", "bench-base", spec, scope="bench-producer")))]
    try:
        engines.append(Engine(EngineConfig(**common, extra_env=bind(1), kv_transfer_config=connector_config(
            "consumer", "bench-base", spec, scope="bench-decoder"))))
        engines.append(Engine(EngineConfig(**common, extra_env=bind(2), enable_prefix_caching=False))
                       if cfg.private else None)
    except BaseException:
        for e in engines:
            e.shutdown()
        raise
    print(f"engines up in {time.perf_counter() - t0:.0f}s (model ~{cfg.params / 1e6:.0f}M params, "
          f"{compute_dtype.resolve(cfg.dtype)}, block {cfg.block_size})", flush=True)
    return engines


async def _warm(engines: list, cfg: BenchConfig, rng: random.Random) -> None:
    """One request per engine first: first-request costs are not what is measured."""
    prod, cons, priv = engines
    warm = [rng.randrange(3, cfg.vocab) for _ in range(64)]
    await prod.prefill(warm, cache_salt="warm")
    await _ttft(cons, warm, "warm")
    if priv is not None:
        await _ttft(priv, warm, "warm")


def _print_case(r: CaseResult) -> None:
    from tqdm import tqdm

    tqdm.write(f"L={r.prompt_tokens} N={r.fanout}: decoder prompt {r.private_prompt_s * 1e3:.0f} ms private vs "
               f"{r.shared_prompt_s * 1e3:.1f} ms shared ({r.ratio:.1f}x); KV load {r.kv_load_gb_s:.2f} GB/s "
               f"({r.load_vs_copy:.0%} of a copy), save {r.kv_save_gb_s:.2f} GB/s ({r.save_vs_copy:.0%}), "
               f"copy {r.copy_gb_s:.2f} GB/s; per CPU second: load {r.load_vs_copy_cpu:.0%}, "
               f"save {r.save_vs_copy_cpu:.0%} of a copy")


async def _run(cfg: BenchConfig, on_case=None) -> list[CaseResult]:
    from tqdm import tqdm

    from prefillshare.app.engine.pool.kv_pool import KVPool, PoolSpec

    work = tempfile.mkdtemp(prefix="ps-bench-")
    pool_dir = f"/dev/shm/ps-bench-{uuid.uuid4().hex[:8]}"
    model = os.path.join(work, "model")
    _write_model_config(model, cfg)
    spec = PoolSpec(path=pool_dir, capacity_bytes=1 << 30, lease_timeout_s=600)
    engines = []
    results: list[CaseResult] = []
    try:
        engines = _start_engines(cfg, model, spec)
        prod, cons, priv = engines
        pool = KVPool.attach(pool_dir)
        rng = random.Random(cfg.seed)
        await _warm(engines, cfg, rng)
        sp_prev = await _saved(pool, 0)  # the warm-up's save counters are written (off the hot path)
        cases = [(L, n) for L in cfg.lengths for n in cfg.fanouts]
        for i, (L, n) in enumerate(tqdm(cases, desc="bench engine", disable=not cfg.progress)):
            ids = [rng.randrange(3, cfg.vocab) for _ in range(L)]
            salt = f"case-{i}"
            cpu0 = process_tree_cpu_seconds()
            priv_times = [(await _ttft(priv, ids, salt))[0] for _ in range(n)] if priv is not None else [0.0] * n
            cpu1 = process_tree_cpu_seconds()
            st0 = pool.stats(scope="bench-decoder")
            sp0 = sp_prev
            tb = time.perf_counter()
            await prod.prefill(ids, cache_salt=salt, kv_transfer_params={"fanout": n})
            base_s = time.perf_counter() - tb
            shared = [await _ttft(cons, ids, salt) for _ in range(n)]
            cpu2 = process_tree_cpu_seconds()
            st1 = pool.stats(scope="bench-decoder")
            sp1 = sp_prev = await _saved(pool, sp0.get("saves"))
            moved = st1.get("bytes_moved") - st0.get("bytes_moved")
            toks = st1.get("load_tokens") - st0.get("load_tokens")
            load_s = st1.get("load_seconds") - st0.get("load_seconds")
            saved = sp1.get("save_bytes") - sp0.get("save_bytes")
            save_s = sp1.get("save_seconds") - sp0.get("save_seconds")
            copy, copy_cpu = _copy_gb_s(int(moved / n)) if moved else (0.0, 0.0)
            load_gbs = moved / load_s / 1e9 if load_s else 0.0
            save_gbs = saved / save_s / 1e9 if save_s else 0.0
            load_c = st1.get("load_cpu_seconds") - st0.get("load_cpu_seconds")
            save_c = sp1.get("save_cpu_seconds") - sp0.get("save_cpu_seconds")
            load_gbc = moved / load_c / 1e9 if load_c > 0 else 0.0
            save_gbc = saved / save_c / 1e9 if save_c > 0 else 0.0
            p_mean = statistics.mean(priv_times)
            s_mean = statistics.mean(t for t, _ in shared)
            results.append(CaseResult(
                prompt_tokens=L, fanout=n, private_prompt_s=p_mean, shared_prompt_s=s_mean,
                ratio=p_mean / s_mean if s_mean else float("inf"), base_prefill_s=base_s,
                private_total_s=sum(priv_times), shared_total_s=base_s + sum(t for t, _ in shared),
                kv_load_s_per_token=load_s / toks if toks else 0.0, kv_bytes_moved=int(moved),
                kv_bytes_per_token=moved / toks if toks else 0.0,
                kv_load_gb_s=load_gbs, kv_save_gb_s=save_gbs,
                kv_save_s_per_token=save_s / (L - 1), copy_gb_s=copy,
                load_vs_copy=load_gbs / copy if copy else 0.0, save_vs_copy=save_gbs / copy if copy else 0.0,
                kv_load_gb_cpu_s=load_gbc, kv_save_gb_cpu_s=save_gbc, copy_gb_cpu_s=copy_cpu,
                load_vs_copy_cpu=load_gbc / copy_cpu if copy_cpu else 0.0,
                save_vs_copy_cpu=save_gbc / copy_cpu if copy_cpu else 0.0,
                cpu_s_private=cpu1 - cpu0, cpu_s_shared=cpu2 - cpu1,
                cached_tokens_ok=all(c == L - 1 for _, c in shared),
                extra={"fallbacks": pool.stats(scope="bench-decoder").fallbacks}))
            if on_case:
                on_case(results)
            _print_case(results[-1])
    finally:
        for e in engines:
            if e is not None:
                e.shutdown()
        shutil.rmtree(pool_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return results


def format_kv_table(results: list[CaseResult]) -> str:
    """The hand-over's own speed beside a plain copy of the same bytes, measured in the same case."""
    head = (f"{'L':>5} {'N':>2} | {'KV load':>10} {'us/tok':>7} {'of copy':>7} | {'KV save':>10} {'us/tok':>7} "
            f"{'of copy':>7} | {'copy':>10} | per CPU s: {'load':>5} {'save':>5} of copy | loaded L-1")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.prompt_tokens:>5} {r.fanout:>2} | {r.kv_load_gb_s:>5.2f} GB/s {r.kv_load_s_per_token * 1e6:>7.2f}"
            f" {r.load_vs_copy:>7.0%} | {r.kv_save_gb_s:>5.2f} GB/s {r.kv_save_s_per_token * 1e6:>7.2f}"
            f" {r.save_vs_copy:>7.0%} | {r.copy_gb_s:>5.2f} GB/s | {'':>10} {r.load_vs_copy_cpu:>5.0%}"
            f" {r.save_vs_copy_cpu:>5.0%}         | {'yes' if r.cached_tokens_ok else 'NO'}")
    return "\n".join(lines)


def format_table(results: list[CaseResult]) -> str:
    head = (f"{'L':>5} {'N':>2} | {'dec prompt private':>18} {'shared':>8} {'ratio':>6} | {'base prefill':>12} "
            f"| {'total private':>13} {'shared':>8} | {'load/tok':>9} {'KV moved':>9} | {'CPU s priv':>10} "
            f"{'shared':>7} | ok")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.prompt_tokens:>5} {r.fanout:>2} | {r.private_prompt_s * 1e3:>15.1f} ms {r.shared_prompt_s * 1e3:>5.1f} ms"
            f" {r.ratio:>5.1f}x | {r.base_prefill_s * 1e3:>9.1f} ms | {r.private_total_s:>11.2f} s"
            f" {r.shared_total_s:>6.2f} s | {r.kv_load_s_per_token * 1e6:>6.2f} us {r.kv_bytes_moved / 2**20:>5.0f} MiB"
            f" | {r.cpu_s_private:>10.2f} {r.cpu_s_shared:>7.2f} | {'yes' if r.cached_tokens_ok else 'NO'}")
    return "\n".join(lines)


def _write(cfg: BenchConfig, results: list[CaseResult]) -> None:
    """Rewritten after every case, so a run stopped part-way keeps what it measured."""
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    tmp = cfg.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"config": asdict(cfg), "compute_dtype": compute_dtype.resolve(cfg.dtype), "params": cfg.params,
                   "results": [asdict(r) for r in results], "host": {"cpus": os.cpu_count()},
                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, f, indent=2)
    os.replace(tmp, cfg.out)


def run_bench(cfg: BenchConfig) -> list[CaseResult]:
    results = asyncio.run(_run(cfg, on_case=(lambda rs: _write(cfg, rs)) if cfg.out else None))
    print(format_table(results))
    print(format_kv_table(results))
    if cfg.out and results and cfg.private:
        from bench.plots import engine_prompt_time

        png = engine_prompt_time([asdict(r) for r in results], os.path.splitext(cfg.out)[0] + ".png",
                                 f"bench engine: ~{cfg.params / 1e6:.0f}M Llama, {compute_dtype.resolve(cfg.dtype)}")
        print(f"wrote {cfg.out}, {png}")
    return results


QUICK = dict(lengths=(300,), fanouts=(2,), shape=SMALL, vocab=1024, kv_space_gib=0.25, max_num_batched_tokens=256)


def _ints(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of `python -m bench engine`."""
    parser.add_argument("--quick", action="store_true", help="smoke test: small model, one case")
    parser.add_argument("--lengths", type=_ints, help="prompt lengths, e.g. 512,1024,2048,4096")
    parser.add_argument("--fanouts", type=_ints, help="decoders per prefill, e.g. 2,4,8")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"],
                        help="auto (default): bfloat16 where the CPU/GPU computes it natively, else float32")
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--binds", help="VLLM_CPU_OMP_THREADS_BIND for producer,consumer,private (default 0,1,1)")
    parser.add_argument("--out", help="JSON output path (default runs/bench/engine.json)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-private", action="store_true",
                        help="skip the private decoder (2 engines): measure the shared side and the KV hand-over only")
    parser.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    kw: dict = dict(QUICK) if args.quick else {}
    if args.quick:
        kw["out"] = "runs/bench/engine_quick.json"
    for name in ("lengths", "fanouts", "dtype", "block_size", "out"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    over = {k: getattr(args, k) for k in ("hidden", "layers") if getattr(args, k) is not None}
    if args.binds:
        binds = tuple(args.binds.split(","))
        if len(binds) != 3:
            raise SystemExit("--binds: give three values (producer,consumer,private)")
        kw["binds"] = binds
    kw["progress"] = not args.no_progress
    kw["private"] = not args.no_private
    try:
        kw["shape"] = replace(kw.get("shape", ModelShape()), **over)
        cfg = BenchConfig(**kw)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    results = run_bench(cfg)
    return 0 if all(r.cached_tokens_ok for r in results) else 1
