#!/usr/bin/env bash
# PrefillShare on one CUDA GPU: token equality, decoder speed-up, NIXL VRAM transfer.
# Installs nothing. Needs on the box: python with torch (CUDA), vllm (CUDA build), transformers,
# and for step 3 the nixl wheels. Reports what is missing and exits 2 if it cannot run.
#   bash scripts/gpu_check.sh            # ~3-6 minutes on one GPU
# Steps:
#   1. random Llama A (base) and B (decoder) of the shipped shape, float32; a producer engine on A
#      and a consumer engine on B share a /dev/shm pool through app.engine.connector; B's greedy
#      tokens must equal app.reference.shared_greedy(A, B) for prompts of several lengths;
#   2. ~100M random Llama (dummy weights, bf16): decoder time-to-first-token with A's KV vs
#      private prefill, prompts of 2048 tokens, 4 decoders (printed ratio);
#   3. NIXL: a block server with a VRAM staging buffer in one process, a puller with VRAM staging
#      in this one; 64 MiB pulled, bytes checked, GB/s printed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  || echo "nvidia-smi: not found"
"$PY" - <<'EOF'
import importlib, sys
ok = True
for mod in ("torch", "vllm", "transformers", "nixl._api"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod:14s} {getattr(m, '__version__', 'ok')}")
    except Exception as e:  # noqa: BLE001
        print(f"{mod:14s} MISSING ({type(e).__name__}: {e})")
        ok = ok and mod == "nixl._api"
try:
    import torch
    print("cuda available:", torch.cuda.is_available(), torch.version.cuda)
    ok = ok and torch.cuda.is_available()
    from vllm.platforms import current_platform
    print("vllm platform:", current_platform.device_type)
    ok = ok and current_platform.device_type == "cuda"
except Exception as e:  # noqa: BLE001
    print("cannot query CUDA/vLLM platform:", e); ok = False
sys.exit(0 if ok else 2)
EOF
rc=$?
if [ $rc -ne 0 ]; then
  echo "GPU CHECK NOT RUN: this box lacks a CUDA GPU, torch with CUDA or a CUDA build of vllm (see above)."
  exit 2
fi

timeout 900 "$PY" - <<'EOF'
import asyncio, os, random, shutil, statistics, subprocess, sys, tempfile, time, uuid
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from app.engine.async_engine import Engine, EngineConfig, PoolSpec, Sampling, connector_config
from app.engine.kv_pool import KVPool
from app.reference import shared_greedy

work = tempfile.mkdtemp(prefix="ps-gpu-")
pool_dir = f"/dev/shm/ps-gpu-{uuid.uuid4().hex[:8]}"
failures = []

def small(path, seed):
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
        num_key_value_heads=1, head_dim=64, intermediate_size=512, max_position_embeddings=1024,
        tie_word_embeddings=True, initializer_range=0.1)).save_pretrained(path)

async def step1():
    print("== 1. token equality on CUDA (float32)", flush=True)
    a, b = os.path.join(work, "A"), os.path.join(work, "B")
    small(a, 1); small(b, 2)
    spec = PoolSpec(path=pool_dir, capacity_bytes=1 << 30)
    common = dict(dtype="float32", kv_space_gib=1, max_model_len=1024, block_size=16, max_num_batched_tokens=128,
                  skip_tokenizer_init=True, enforce_eager=True)
    prod = await Engine.start(EngineConfig(model=a, kv_transfer_config=connector_config("producer", "A", spec), **common))
    cons = await Engine.start(EngineConfig(model=b, kv_transfer_config=connector_config("consumer", "A", spec), **common))
    ha = LlamaForCausalLM.from_pretrained(a, dtype=torch.float32).cuda().eval()
    hb = LlamaForCausalLM.from_pretrained(b, dtype=torch.float32).cuda().eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in (77, 150, 333, 701)]
    await asyncio.gather(*[prod.prefill(p, cache_salt="t", kv_transfer_params={"fanout": 1}) for p in prompts])
    outs = await asyncio.gather(*[cons.complete(p, Sampling(max_tokens=12, ignore_eos=True), cache_salt="t") for p in prompts])
    for p, o in zip(prompts, outs):
        ref = shared_greedy(ha, hb, p, 12)
        same = o.token_ids == ref
        print(f"  L={len(p):4d} cached={o.num_cached_tokens:4d}/{len(p)-1} tokens equal: {same}"
              + ("" if same else f"  vllm={o.token_ids} ref={ref}"))
        if not same or o.num_cached_tokens != len(p) - 1:
            failures.append(f"equality L={len(p)}")
    print("  pool:", KVPool(pool_dir).stats().counters)
    prod.shutdown(); cons.shutdown()

async def ttft(engine, ids, salt):
    t0 = time.perf_counter()
    async for o in engine.generate(ids, Sampling(max_tokens=1, ignore_eos=True), None, salt):
        if o.new_token_ids:
            return time.perf_counter() - t0, o.num_cached_tokens

async def step2():
    print("== 2. decoder prompt time, ~100M Llama, bf16, L=2048, N=4", flush=True)
    m = os.path.join(work, "M")
    LlamaConfig(vocab_size=8192, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                intermediate_size=2816, max_position_embeddings=4160, tie_word_embeddings=True).save_pretrained(m)
    spec = PoolSpec(path=pool_dir + "-b", capacity_bytes=4 << 30)
    common = dict(model=m, dtype="bfloat16", kv_space_gib=2, max_model_len=4160, block_size=16,
                  max_num_batched_tokens=2048, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True)
    prod = await Engine.start(EngineConfig(**common, kv_transfer_config=connector_config("producer", "M", spec)))
    cons = await Engine.start(EngineConfig(**common, kv_transfer_config=connector_config("consumer", "M", spec)))
    priv = await Engine.start(EngineConfig(**common, enable_prefix_caching=False))
    rng = random.Random(1)
    for e in (cons, priv):
        await ttft(e, [5] * 64, "warm")
    for trial in range(3):
        ids = [rng.randrange(3, 8192) for _ in range(2048)]
        p = [(await ttft(priv, ids, f"s{trial}"))[0] for _ in range(4)]
        t0 = time.perf_counter(); await prod.prefill(ids, cache_salt=f"s{trial}", kv_transfer_params={"fanout": 4})
        base = time.perf_counter() - t0
        s = [await ttft(cons, ids, f"s{trial}") for _ in range(4)]
        ok = all(c == 2047 for _, c in s)
        ps, ss = statistics.mean(p), statistics.mean(t for t, _ in s)
        print(f"  trial {trial}: private {ps*1e3:.1f} ms, shared {ss*1e3:.1f} ms, ratio {ps/ss:.1f}x, "
              f"base prefill {base*1e3:.1f} ms, cached ok: {ok}")
        if not ok:
            failures.append("speed case: KV not loaded")
    st = KVPool(spec.path).stats()
    print(f"  KV load {st.load_seconds_per_token*1e6:.2f} us/token, {st.get('bytes_moved')/2**20:.0f} MiB moved")
    for e in (prod, cons, priv):
        e.shutdown()

def step3():
    print("== 3. NIXL VRAM pull between two processes", flush=True)
    try:
        from app.engine.kv_keys import block_keys
        from app.engine.kv_pool import PutItem
        from app.engine.nixl_transport import NixlPuller
    except Exception as e:  # noqa: BLE001
        print("  skipped:", e); failures.append("nixl missing"); return
    src = pool_dir + "-nx"
    pool = KVPool(src, 1 << 30)
    keys = block_keys("A", "t", list(range(64 * 16)), 16)
    items = [PutItem(k.key, os.urandom(1 << 20), k.num_tokens, "L", i) for i, k in enumerate(keys)]
    pool.put_many(items)
    srv = subprocess.Popen([sys.executable, "-m", "app.engine.nixl_transport", "serve", "--pool", src,
                            "--mem", "VRAM", "--staging-mib", "128"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    addr = next(l.split()[-1] for l in srv.stdout if "listening on" in l)
    try:
        puller = NixlPuller(staging_bytes=128 << 20, mem="VRAM")
        for i in range(3):
            got, fig = puller.pull(addr, [k.key for k in keys])
            same = len(got) == len(items) and all(bytes(d) == it.data for (_, d), it in zip(got, items))
            print(f"  pull {i}: {fig['bytes']>>20} MiB in {fig['seconds']*1e3:.1f} ms "
                  f"({fig['bytes']/fig['seconds']/1e9:.2f} GB/s incl. server staging), bytes equal: {same}")
            if not same:
                failures.append("nixl bytes")
    finally:
        srv.terminate(); srv.wait(30)
        shutil.rmtree(src, ignore_errors=True)

try:
    asyncio.run(step1())
    asyncio.run(step2())
    step3()
finally:
    for d in (work, pool_dir, pool_dir + "-b"):
        shutil.rmtree(d, ignore_errors=True)
print("== RESULT:", "PASS" if not failures else f"FAIL {failures}")
sys.exit(1 if failures else 0)
EOF
