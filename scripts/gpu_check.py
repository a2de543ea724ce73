"""PrefillShare's GPU path in one run: KV transport speed, decoder speed-up, token equality, vLLM NIXL.

Run through scripts/gpu_check.sh on a CUDA box. Step 1 needs only torch; steps 2, 3 and 5 need
the vllm CUDA build and transformers (step 5 also nixl). ``--device cpu`` runs the same steps at toy
sizes on the CPU (step 1 in seconds: CI runs it), to check this script before spending GPU
time. Each step has its own time limit and its failure does not stop the others; a JSON of all
figures goes to ``--out``. The whole default run is bounded to 8 minutes by the shell wrapper.

1. KV transport (torch only), flash-attention layout ``[2, num_blocks, block_size, heads, head]``
   per layer, 8B-shaped caches (32 layers, 8 KV heads, head 128, bf16) and ~100M-shaped ones
   (8 layers, 4 KV heads, head 64), L = 2048 and 4096: the batched slot copies of
   app.engine.cpu_layout (one index_select / index_copy_ per layer) into and out of
   - a device slab in one process, and read by a second process over CUDA IPC (goal >= 1 TB/s),
   - a page-locked host slab (a /dev/shm mapping registered with CUDA; goal >= 35 GB/s),
   beside a plain device copy and a plain pinned copy of the same bytes, and beside the per-block
   path the connector used before (one block and one layer at a time through pageable memory).
   Every copy's bytes are checked against the per-block reference.
2. Decoder time to first token with the base's KV vs private prefill, producer and decoders on
   one GPU, ~100M Llama (dummy weights), per prompt length: shared should be lower; every decoder
   must get L-1 tokens and the fan-out pins must return to 0.
3. Token equality (float32): random Llama A (base) and B (decoder); B's greedy tokens on A's KV
   must equal app.reference.shared_greedy(A, B).
4. (retired with the pool's NIXL block server: across nodes the KV moves with vLLM's connector,
   step 5)
5. The ``vllm-nixl`` hand-over (vLLM's own NixlConnector, the mode meant for GPUs), through
   ``python -m app.bench.nixl_probe --device cuda``: a producer engine (the base) and a consumer
   engine (a model with other weights) in two processes on the GPU, ``kv_buffer_device: cuda``,
   vLLM's transport settings. Shipped models at L = 300, 900: the decoder's greedy tokens on the
   pulled KV equal ``app.reference.shared_greedy`` (float32). A ~90M dummy Llama at ``--lengths``
   (bf16): decoder TTFT with the pulled KV vs a private prefill, the second prefill of a prompt
   computing at most one block (the prefix cache), and NIXL's bytes per second (vLLM's counters).
   On the CPU (``--device cpu``) the shipped models at L = 300 only, over UCX on host memory.

The JSON is rewritten after every step, so a run stopped by its time limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.engine.cpu_layout import BlockLayout  # noqa: E402  (torch only)

# (layers, kv heads, head size, block size) of the two cache shapes of step 1
SHAPES = {"8B": (32, 8, 128, 16), "100M": (8, 4, 64, 32)}
TOY = {"8B": (4, 2, 32, 16), "100M": (2, 2, 16, 16)}


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _timed(fn, dev: str, repeats: int) -> float:
    """Best of ``repeats`` wall times of ``fn`` (after one warm-up), synchronised."""
    fn()
    _sync(dev)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def _caches(shape, nblocks: int, dev: str, seed: int) -> list[torch.Tensor]:
    layers, heads, head, bs = shape
    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(2, nblocks, bs, heads, head, generator=g, device=dev, dtype=torch.float32)
            .to(torch.bfloat16) for _ in range(layers)]


def _layout(caches, shape, nblocks) -> BlockLayout:
    layers, heads, head, bs = shape
    return BlockLayout.from_caches(caches, bs, heads, head, nblocks, device_layout=True)


def _host_slab(nbytes: int, pin: bool):
    """A /dev/shm mapping seen as a uint8 tensor (as the pool maps its slab), page-locked if asked."""
    path = f"/dev/shm/ps-gpu-slab-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)  # the mapping stays valid
    t = torch.frombuffer(mm, dtype=torch.uint8)
    registered = False
    if pin:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        registered = int(err) == 0
    return t, mm, registered


def _ipc_reader(q_in, q_out) -> None:
    """Second process: scatter the producer's device slab (received over CUDA IPC) into its own
    cache, once per task until it gets None."""
    while (task := q_in.get()) is not None:
        slab, shape, nblocks, slots, ids, dev, repeats = task
        if dev == "cpu":
            torch.set_num_threads(1)  # as one engine worker
        caches = _caches(shape, nblocks, dev, 7)
        lay = _layout(caches, shape, nblocks)
        ref = _layout([c.clone() for c in caches], shape, nblocks)
        t = _timed(lambda: lay.load_slots(slab, slots, ids), dev, repeats)  # noqa: B023 - called here
        for b, s in zip(ids, slots):
            ref.scatter(ref.slots_view(slab, s, 1)[0], b, ref.block_size)
        equal = all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(lay.caches, ref.caches))
        del slab
        q_out.put((t, equal))


def transport(args, results: dict, failures: list[str]) -> None:
    dev = args.device
    full = dev == "cuda" or args.full
    shapes = {k: v for k, v in (SHAPES if full else TOY).items() if k in args.shapes.split(",")}
    lengths = [int(x) for x in args.lengths.split(",")] if full else [64]
    repeats = 5 if full else 2
    if dev == "cpu":
        torch.set_num_threads(1)  # as one engine worker; the yardstick copies run with the same
    rows = []
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    reader = ctx.Process(target=_ipc_reader, args=(q_in, q_out), daemon=True)
    reader.start()
    try:
        _transport_cases(dev, shapes, lengths, repeats, rows, failures, q_in, q_out)
    finally:
        q_in.put(None)
        reader.join(30)
    results["transport"] = {"rows": rows, "goals": {"device_gb_s": 1000, "host_pinned_gb_s": 35}}


def _transport_cases(dev, shapes, lengths, repeats, rows, failures, q_in, q_out) -> None:
    for name, shape in shapes.items():
        for L in lengths:
            row = _transport_case(dev, name, shape, L, repeats, q_in, q_out)
            rows.append(row)
            if not row["bytes_equal"]:
                failures.append(f"transport {name} L={L}: bytes differ")


def _transport_case(dev, name, shape, L, repeats, q_in, q_out) -> dict:
    layers, heads, head, bs = shape
    n = L // bs
    nblocks = 2 * n + 8
    src = _layout(_caches(shape, nblocks, dev, 1), shape, nblocks)
    nbytes = n * src.block_nbytes
    rng = random.Random(L)
    ids = rng.sample(range(nblocks), n)
    dst_ids = rng.sample(range(nblocks), n)
    slots = list(range(n))
    row = {"shape": name, "L": L, "bytes": nbytes, "bytes_per_token": src.block_nbytes / bs}

    def gbs(t: float) -> float:
        return nbytes / t / 1e9

    # yardsticks: plain copies of the same bytes
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    row["device_copy_gb_s"] = gbs(_timed(lambda: b.copy_(a), dev, repeats))
    # device slab, one process
    slab = torch.zeros(n, src.block_nbytes, dtype=torch.uint8, device=dev)
    row["device_gather_gb_s"] = gbs(_timed(lambda: src.save_slots(ids, slab, slots), dev, repeats))
    ok = all(torch.equal(src.slots_view(slab, s, 1)[0], src.gather(i)) for i, s in zip(ids, slots))
    dst = _layout(_caches(shape, nblocks, dev, 2), shape, nblocks)
    ref = _layout([c.clone() for c in dst.caches], shape, nblocks)
    row["device_scatter_gb_s"] = gbs(_timed(lambda: dst.load_slots(slab, slots, dst_ids), dev, repeats))
    for i, s in zip(dst_ids, slots):
        ref.scatter(ref.slots_view(slab, s, 1)[0], i, bs)
    ok = ok and all(torch.equal(x.view(torch.int16), y.view(torch.int16))
                    for x, y in zip(dst.caches, ref.caches))
    # the device slab read by another process (CUDA IPC on GPUs, shared memory on the CPU)
    shared = slab if dev == "cuda" else slab.share_memory_()
    q_in.put((shared, shape, nblocks, slots, dst_ids, dev, repeats))
    t_ipc, ipc_equal = q_out.get(timeout=120)
    row["ipc_scatter_gb_s"] = gbs(t_ipc)
    ok = ok and ipc_equal
    # page-locked host slab each way (the pool's /dev/shm mapping, registered with CUDA)
    host, mm, pinned = _host_slab(n * src.block_nbytes, pin=dev == "cuda")
    hslab = host.view(n, src.block_nbytes)
    row["host_pinned"] = pinned
    row["host_save_gb_s"] = gbs(_timed(lambda: src.save_slots(ids, hslab, slots), dev, repeats))
    ok = ok and all(torch.equal(src.slots_view(hslab, s, 1)[0], src.gather(i).cpu())
                    for i, s in zip(ids, slots))
    dst2 = _layout([c.clone() for c in ref.caches], shape, nblocks)
    row["host_load_gb_s"] = gbs(_timed(lambda: dst2.load_slots(hslab, slots, dst_ids), dev, repeats))
    ok = ok and all(torch.equal(x.view(torch.int16), y.view(torch.int16))
                    for x, y in zip(dst2.caches, ref.caches))
    if dev == "cuda":
        pinned_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        row["pinned_copy_d2h_gb_s"] = gbs(_timed(lambda: pinned_buf.copy_(a, non_blocking=True), dev, repeats))
        row["pinned_copy_h2d_gb_s"] = gbs(_timed(lambda: a.copy_(pinned_buf, non_blocking=True), dev, repeats))
        if pinned:
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    # the per-block path of before: one block, one layer at a time, through pageable memory
    page = torch.empty(n, src.block_nbytes, dtype=torch.uint8)

    def per_block_save():
        for i, s in zip(ids, slots):
            page[s].copy_(src.gather(i).cpu().view(-1).view(torch.uint8))

    def per_block_load():
        for i, s in zip(dst_ids, slots):
            dst.scatter(dst.slots_view(page, s, 1)[0], i, bs)

    row["per_block_save_gb_s"] = gbs(_timed(per_block_save, dev, 1))
    row["per_block_load_gb_s"] = gbs(_timed(per_block_load, dev, 1))
    row["bytes_equal"] = ok
    del mm
    print(f"  {name:4s} L={L:5d} ({nbytes / 2**20:6.1f} MiB): device gather {row['device_gather_gb_s']:7.1f} / "
          f"scatter {row['device_scatter_gb_s']:7.1f} / IPC scatter {row['ipc_scatter_gb_s']:7.1f} GB/s "
          f"(plain copy {row['device_copy_gb_s']:7.1f}); host slab save {row['host_save_gb_s']:5.1f} / "
          f"load {row['host_load_gb_s']:5.1f} GB/s (pinned {pinned}); per-block save "
          f"{row['per_block_save_gb_s']:5.2f} / load {row['per_block_load_gb_s']:5.2f} GB/s; bytes equal {ok}",
          flush=True)
    return row


class Engines:
    """Steps 2 and 3: real vLLM engines (imports deferred so that step 1 needs only torch)."""

    def __init__(self, args, results: dict, failures: list[str]):
        self.args = args
        self.dev = args.device
        self.results = results
        self.failures = failures
        self.work = tempfile.mkdtemp(prefix="ps-gpu-")
        self.pool_root = f"/dev/shm/ps-gpu-{uuid.uuid4().hex[:8]}"
        self.gpu_extra = dict(gpu_memory_utilization=0.05) if self.dev == "cuda" else {}

    def cleanup(self) -> None:
        for suffix in ("-eq", "-sp", "-nx", "-nx2"):
            shutil.rmtree(self.pool_root + suffix, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)

    def engine_cfg(self, **kw):
        from app.engine.async_engine import EngineConfig

        return EngineConfig(skip_tokenizer_init=True, enforce_eager=True, **self.gpu_extra, **kw)

    @staticmethod
    def small_llama(path: str, seed: int) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
                                     num_key_value_heads=1, head_dim=64, intermediate_size=512,
                                     max_position_embeddings=1024, tie_word_embeddings=True,
                                     initializer_range=0.1)).save_pretrained(path)

    async def equality(self) -> None:
        from transformers import LlamaForCausalLM

        from app.engine.async_engine import Engine, PoolSpec, Sampling, connector_config
        from app.engine.kv_pool import KVPool
        from app.reference import shared_greedy

        a, b = os.path.join(self.work, "A"), os.path.join(self.work, "B")
        self.small_llama(a, 1)
        self.small_llama(b, 2)
        spec = PoolSpec(path=self.pool_root + "-eq", capacity_bytes=1 << 30)
        common = dict(dtype="float32", kv_cache_memory_bytes=1 << 30, max_model_len=1024, block_size=32,
                      max_num_batched_tokens=128)
        prod = await Engine.start(self.engine_cfg(model=a, kv_transfer_config=connector_config("producer", "A", spec),
                                                  **common))
        cons = await Engine.start(self.engine_cfg(model=b, kv_transfer_config=connector_config("consumer", "A", spec),
                                                  **common))
        try:
            ha = LlamaForCausalLM.from_pretrained(a, dtype=torch.float32).to(self.dev).eval()
            hb = LlamaForCausalLM.from_pretrained(b, dtype=torch.float32).to(self.dev).eval()
            rng = random.Random(0)
            lengths = (77, 150, 333, 701) if self.dev == "cuda" else (77, 150)
            prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in lengths]
            await asyncio.gather(*[prod.prefill(p, cache_salt="t", kv_transfer_params={"fanout": 1}) for p in prompts])
            outs = await asyncio.gather(*[cons.complete(p, Sampling(max_tokens=12, ignore_eos=True), cache_salt="t")
                                          for p in prompts])
            rows = []
            for p, o in zip(prompts, outs):
                ref = shared_greedy(ha, hb, p, 12)
                same = o.token_ids == ref
                rows.append({"L": len(p), "cached": o.num_cached_tokens, "equal": same})
                print(f"  L={len(p):4d} cached={o.num_cached_tokens:4d}/{len(p) - 1} tokens equal: {same}"
                      + ("" if same else f"  vllm={o.token_ids} ref={ref}"), flush=True)
                if not same or o.num_cached_tokens != len(p) - 1:
                    self.failures.append(f"equality L={len(p)}")
            self.results["equality"] = rows
            print("  pool:", KVPool.attach(spec.path).stats().counters, flush=True)
        finally:
            prod.shutdown()
            cons.shutdown()

    async def speed(self) -> None:
        from transformers import LlamaConfig

        from app.engine.async_engine import Engine, PoolSpec, Sampling, connector_config
        from app.engine.kv_keys import shared_block_keys
        from app.engine.kv_pool import KVPool

        m = os.path.join(self.work, "M")
        toy = self.dev == "cpu"
        LlamaConfig(vocab_size=8192, hidden_size=256 if toy else 1024, num_hidden_layers=2 if toy else 8,
                    num_attention_heads=4 if toy else 16, num_key_value_heads=2 if toy else 4,
                    intermediate_size=512 if toy else 2816, max_position_embeddings=8256,
                    tie_word_embeddings=True).save_pretrained(m)
        lengths = [int(x) for x in self.args.lengths.split(",")] if not toy else [256]
        mml = max(lengths) + 64
        spec = PoolSpec(path=self.pool_root + "-sp", capacity_bytes=4 << 30)
        common = dict(model=m, dtype="auto", kv_cache_memory_bytes=2 << 30, max_model_len=mml, block_size=32,
                      max_num_batched_tokens=max(lengths), load_format="dummy")
        prod = await Engine.start(self.engine_cfg(**common, kv_transfer_config=connector_config(
            "producer", "M", spec, scope="gpu-producer")))
        cons = await Engine.start(self.engine_cfg(**common, kv_transfer_config=connector_config(
            "consumer", "M", spec, scope="gpu-decoder")))
        priv = await Engine.start(self.engine_cfg(**common, enable_prefix_caching=False))
        engines = (prod, cons, priv)
        pool = KVPool.attach(spec.path)

        async def ttft(engine, ids, salt):
            t0 = time.perf_counter()
            async for o in engine.generate(ids, Sampling(max_tokens=1, ignore_eos=True), None, salt):
                if o.new_token_ids:
                    return time.perf_counter() - t0, o.num_cached_tokens
            raise RuntimeError("no token")

        try:
            rng = random.Random(1)
            for e in (cons, priv):
                await ttft(e, [5] * 64, "warm")
            await prod.prefill([6] * 64, cache_salt="warm")
            n = self.args.decoders
            rows = []
            for L in lengths:
                for trial in range(self.args.trials):
                    ids = [rng.randrange(3, 8192) for _ in range(L)]
                    salt = f"L{L}t{trial}"
                    p = [(await ttft(priv, ids, salt))[0] for _ in range(n)]
                    t0 = time.perf_counter()
                    await prod.prefill(ids, cache_salt=salt, kv_transfer_params={"fanout": n})
                    base = time.perf_counter() - t0
                    s = [await ttft(cons, ids, salt) for _ in range(n)]
                    ok = all(c == L - 1 for _, c in s)
                    pins = sum(pool.pins(k.key) for k in shared_block_keys("M", salt, ids, 32))
                    ps, ss = statistics.mean(p), statistics.mean(t for t, _ in s)
                    rows.append({"L": L, "trial": trial, "private_ms": ps * 1e3, "shared_ms": ss * 1e3,
                                 "ratio": ps / ss, "base_prefill_ms": base * 1e3, "cached_ok": ok, "pins_left": pins,
                                 "shared_lower": ss < ps, "fanout_private_ms": sum(p) * 1e3,
                                 "fanout_shared_ms": (base + sum(t for t, _ in s)) * 1e3})
                    print(f"  L={L} trial {trial}: decoder TTFT private {ps * 1e3:.1f} ms, shared {ss * 1e3:.1f} ms, "
                          f"ratio {ps / ss:.2f}x; base prefill {base * 1e3:.1f} ms; cached ok: {ok}; pins left {pins}",
                          flush=True)
                    if not ok or pins:
                        self.failures.append(f"speed L={L}: KV not loaded by every decoder or pins left")
            dec, pro = pool.stats("gpu-decoder"), pool.stats("gpu-producer")
            self.results["speed"] = {
                "rows": rows, "load_us_per_token": dec.load_seconds_per_token * 1e6,
                "load_gb_s": dec.get("bytes_moved") / dec.get("load_seconds") / 1e9 if dec.get("load_seconds") else 0,
                "save_gb_s": pro.get("save_bytes") / pro.get("save_seconds") / 1e9 if pro.get("save_seconds") else 0,
                "mib_moved": dec.get("bytes_moved") / 2**20}
            print(f"  KV load {self.results['speed']['load_us_per_token']:.2f} us/token "
                  f"({self.results['speed']['load_gb_s']:.2f} GB/s), save {self.results['speed']['save_gb_s']:.2f} GB/s",
                  flush=True)
        finally:
            for e in engines:
                e.shutdown()


def _probe(args, name: str, probe_args: list[str], limit: float) -> dict:
    """One run of app.bench.nixl_probe in its own process group (killed whole at ``limit``: its
    engines are child processes); its JSON."""
    import signal
    import subprocess

    work = tempfile.mkdtemp(prefix="ps-gpu-probe-")
    out = os.path.join(work, f"{name}.json")
    cmd = [sys.executable, "-m", "app.bench.nixl_probe", "--device", args.device, "--out", out, *probe_args]
    print("  $", " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc = proc.wait(limit)
        if rc != 0:
            raise RuntimeError(f"nixl_probe {name}: exit {rc}")
        with open(out) as f:
            return json.load(f)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise TimeoutError(f"nixl_probe {name}: not done in {limit:.0f} s") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def vllm_nixl(args, results: dict, failures: list[str], limit: float) -> None:
    """Step 5: the vllm-nixl hand-over between two engine processes (module docstring)."""
    from importlib.metadata import PackageNotFoundError, version

    from app.bench.nixl_probe import ProbeConfig

    try:
        vllm_version = version("vllm")
    except PackageNotFoundError:
        vllm_version = "unknown"
    gpu = args.device == "cuda"
    setting = "default" if gpu else "polled"  # vLLM's transport settings on GPUs; the CPU box's own
    t0 = time.perf_counter()
    runs = {"equality": ["--models", "shipped", "--lengths", "300,900" if gpu else "300", "--repeats", "1",
                         "--max-tokens", "8", "--setting", setting, "--idle", "1", "--timeout", "60"]}
    if gpu:
        runs["speed"] = ["--models", "random", "--lengths", args.lengths, "--repeats", str(args.trials),
                         "--max-tokens", "4", "--setting", setting, "--dtype", "bfloat16", "--idle", "1",
                         "--timeout", "60"]
    out: dict = {"vllm": vllm_version, "setting": setting}
    results["vllm_nixl"] = out
    for name, probe_args in runs.items():
        res = _probe(args, name, probe_args, max(30.0, limit - (time.perf_counter() - t0)))
        summary, rate = res["summary"], res["kv_transfer"]
        out[name] = {"summary": summary, "kv_transfer": rate, "start_s": res.get("start_s"),
                     "handover_counters": res.get("handover_counters"),
                     "expired": res["producer_metrics"].get("num_kv_expired_reqs", 0.0)}
        for n, row in summary.items():
            ratio = row["ttft_private_s"] / row["ttft_shared_s"] if row["ttft_shared_s"] else 0.0
            print(f"  {name} L={n}: decoder TTFT shared {row['ttft_shared_s'] * 1e3:.1f} ms, private "
                  f"{row['ttft_private_s'] * 1e3:.1f} ms ({ratio:.1f}x); second prefill computed "
                  f"{row['second_prefill_computed']} tokens; all pulled: {row['all_pulled']}; "
                  f"tokens equal: {row['tokens_equal']}", flush=True)
            if not (row["all_pulled"] and row["tokens_equal"]):
                failures.append(f"vllm_nixl {name} L={n}: not every decoder pulled, or tokens differ")
            if row["second_prefill_computed"] > ProbeConfig.block_size:  # the probe runs with its default
                failures.append(f"vllm_nixl {name} L={n}: the second prefill computed more than one block")
            if name == "speed" and row["ttft_shared_s"] >= row["ttft_private_s"]:
                failures.append(f"vllm_nixl speed L={n}: the pulled KV is not faster than a private prefill")
        print(f"  {name}: NIXL moved {rate['mib']} MiB in {rate['seconds'] * 1e3:.1f} ms of transfers "
              f"({rate['gb_s']} GB/s, vLLM's counters)", flush=True)
        if not rate["mib"]:
            failures.append(f"vllm_nixl {name}: vLLM counted no NIXL bytes")


def _write(args, results: dict) -> None:
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(results, f, indent=1)


def run(args) -> int:
    results: dict = {"device": args.device, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    failures: list[str] = []
    results["failures"] = failures
    eng = None
    steps = {"1": ("KV transport: batched slot copies vs plain copies vs per-block (torch only)", 90),
             "2": (f"decoder TTFT shared vs private, L={args.lengths}", 200),
             "3": ("token equality (float32)", 120),
             "5": ("the vllm-nixl hand-over: vLLM's NixlConnector between two engine processes", 240)}
    try:
        for key in args.steps.split(","):
            if key not in steps:
                raise SystemExit(f"--steps: unknown step {key!r} (1, 2, 3 or 5)")
            title, limit = steps[key]
            print(f"== {key}. {title} (limit {limit} s)", flush=True)
            t0 = time.perf_counter()
            try:
                if key == "1":
                    transport(args, results, failures)
                elif key == "5":
                    vllm_nixl(args, results, failures, limit)
                else:
                    eng = eng or Engines(args, results, failures)
                    fn = {"2": eng.speed, "3": eng.equality}[key]
                    asyncio.run(asyncio.wait_for(fn(), limit))
            except Exception as e:  # noqa: BLE001 - report and go on to the next step
                traceback.print_exc()
                failures.append(f"step {key}: {type(e).__name__}: {e}"[:300])
            spent = time.perf_counter() - t0
            results.setdefault("step_seconds", {})[key] = spent
            print(f"   ({spent:.0f} s)", flush=True)
            _write(args, results)
    finally:
        if eng is not None:
            eng.cleanup()
    _write(args, results)
    print("== RESULT:", "PASS" if not failures else f"FAIL {failures}", flush=True)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", default="1,5,3,2",
                    help="comma-separated steps to run, in that order (1 needs only torch; 5 is the vllm-nixl mode)")
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--shapes", default="8B,100M", help="step 1: cache shapes to measure")
    ap.add_argument("--full", action="store_true", help="--device cpu: step 1 at full sizes instead of toy ones")
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
