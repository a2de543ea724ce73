"""PrefillShare's GPU path in one run: the vllm-nixl hand-over with the app's own settings.

Run through bench/gpu_check.sh on a CUDA box (one H100 or H200, no network: vLLM and NIXL come
from bench/gpu_payload.sh). ``--device cpu`` runs the same steps at toy sizes on the CPU, to check
this script before spending GPU time (CI runs that). Every step has its own time limit (the
default run's add up to :data:`BUDGET_S`), a failed step does not stop the others, and the JSON
of all figures (``--out``/gpu_check.json) is rewritten after every step.

Steps (``--steps``, in this order by default):
- ``env``: nvidia-smi (GPUs, driver, topology) and the versions of torch, CUDA, vLLM, NIXL,
  transformers and Python.
- ``transport`` (torch only): a request's KV blocks copied with the pool's batched slot copies
  beside a plain device copy, host slabs and a second process over CUDA IPC (the figures the
  device can give, without vLLM).
- ``tokens``: ``python -m bench.nixl_probe`` with the app's own NIXL settings
  (``prefillshare.app.engine.nixl.config.settings_for``: progress thread off, CUDA IPC reads on for GPUs): the
  shipped base as producer and the shipped ``lookup`` decoder (other weights) as consumer, two
  engine processes; the decoder's greedy tokens on the pulled KV must equal
  ``prefillshare.app.reference.shared_greedy``, and every pull must bring the whole prompt.
- ``lora``: the same with a LoRA adapter consumer (the base + ``checkpoints/chat/adapters/lookup``).
- ``speed``: a dummy Llama big enough that a private prefill costs more than a hand-over (8B
  shape on a GPU), a 4K prompt: decoder TTFT with the pulled KV vs a private prefill (a ratio,
  not a gate), NIXL's GB/s from vLLM's counters against a device-to-device copy of the same
  bytes, and the transport UCX chose for the reads (its protocol log, ``UCX_PROTO_INFO``).
- ``speed-auto``: the same without the CUDA IPC override (``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` left
  to UCX), to show what the override buys.
- ``in_engine``: ``python -m bench.in_engine_probe``: the shipped chat adapters as in-engine LoRA
  decoders of the base (app/engine/vllm_plugin.py): greedy tokens against transformers, base
  requests in the same engine against the base alone, and a fan-out of the four over one prompt
  computing it once (vLLM's prefix-cache counters).

Correctness fails the check (tokens, whole pulls, bytes); speed is reported as ratios only.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prefillshare.app.engine.cpu_layout import BlockLayout  # noqa: E402  (torch only)

# (layers, kv heads, head size, block size) of the transport step's cache shapes
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


def transport(args, results: dict, failures: list[str]) -> None:
    dev = args.device
    full = dev == "cuda" or args.full
    shapes = {k: v for k, v in (SHAPES if full else TOY).items() if k in args.shapes.split(",")}
    lengths = [4096] if full else [64]
    repeats = 3 if full else 2
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
        reader.join(10)
        if reader.is_alive():
            reader.kill()
        if dev == "cuda":
            torch.cuda.empty_cache()  # the engines of the next steps need this process's cached blocks
    results["transport"] = {"rows": rows}


# ---------------------------------------------------------------- env

def _run(cmd: list[str], timeout: float = 10) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{cmd[0]}: {type(e).__name__}: {e}"


def versions() -> dict[str, str | None]:
    """Versions of what the check runs on (None: not installed)."""
    from importlib import import_module
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": sys.version.split()[0], "torch": torch.__version__,
                                  "cuda": torch.version.cuda}
    for mod in ("vllm", "transformers"):
        try:
            out[mod] = str(import_module(mod).__version__)
        except Exception:  # noqa: BLE001 - absent or broken: reported as None
            out[mod] = None
    for dist in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def environment(args, results: dict, failures: list[str]) -> None:
    env: dict = {"versions": versions()}
    if args.device == "cuda":
        env["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,pci.bus_id",
                                  "--format=csv,noheader"])
        env["nvidia_smi_topo"] = _run(["nvidia-smi", "topo", "-m"])
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    from prefillshare.app.engine.nixl import kv_transport

    env["rdma_devices"] = list(kv_transport.rdma_devices())
    results["environment"] = env
    print(json.dumps(env["versions"]), flush=True)
    if args.device == "cuda":
        print(env["nvidia_smi"], flush=True)


# ---------------------------------------------------------------- the vllm-nixl hand-over

def app_setting(device: str) -> str:
    """The nixl_probe setting that is the app's own for ``device`` (prefillshare.app.engine.nixl.config.settings_for)."""
    from bench.nixl_probe import SETTINGS
    from prefillshare.app.engine.nixl.config import settings_for

    mine = settings_for(device)
    return next(name for name, s in SETTINGS.items() if s == mine)


def _probe(args, name: str, probe_args: list[str], limit: float, module: str = "bench.nixl_probe") -> tuple[dict, str]:
    """One run of a probe module in its own process group (killed whole at ``limit``: its
    engines are child processes): its JSON and its output (UCX's protocol log included)."""
    work = tempfile.mkdtemp(prefix="ps-gpu-probe-")
    out, log = os.path.join(work, f"{name}.json"), os.path.join(work, f"{name}.log")
    cmd = [sys.executable, "-m", module, "--device", args.device, "--out", out, *probe_args]
    print("  $", " ".join(cmd[1:]), flush=True)
    try:
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, start_new_session=True, stdout=f, stderr=subprocess.STDOUT)
            try:
                rc = proc.wait(limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        with open(log, errors="replace") as f:
            text = f.read()
        if args.out:  # the engines' own output (UCX's protocol tables, the connector's transport line)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{name}.log"), "w") as f:
                f.write(text[-4_000_000:])
        if rc != 0:
            print(text[-4000:], flush=True)
            raise TimeoutError(f"{name}: not done in {limit:.0f} s") if rc is None else RuntimeError(
                f"{name}: {module} exit {rc}")
        with open(out) as f:
            return json.load(f), text
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def _common(args, setting: str) -> list[str]:
    env = ["--env", "UCX_PROTO_INFO=y", "--env", "UCX_LOG_LEVEL=info"]
    return ["--setting", setting, "--idle", "0.5", "--timeout", "60", *env]


def _record(name: str, res: dict, log: str, setting: str, device: str) -> dict:
    from prefillshare.app.engine.nixl import kv_transport
    from prefillshare.app.engine.nixl.config import settings_for

    memory = "cuda" if device == "cuda" else "host"
    plan = kv_transport.plan(device, env=dict(res.get("settings", {}).get("ucx_env") or {}))
    return {"setting": setting, "app_setting": res.get("settings") == _asdict(settings_for(device)),
            "summary": res["summary"], "kv_transfer": res["kv_transfer"], "start_s": res.get("start_s"),
            "handover_counters": res.get("handover_counters"),
            "expired": res["producer_metrics"].get("num_kv_expired_reqs", 0.0),
            "transport_planned": kv_transport.describe(plan),
            "transport_logged": [ln.split("PrefillShare vllm-nixl engine, ", 1)[1] for ln in log.splitlines()
                                 if "PrefillShare vllm-nixl engine, " in ln][:2],
            "transport_chosen": kv_transport.read_transport(log, memory),
            "ucx_read_tables": [{"scope": p.scope, "operation": p.operation, "rows": p.rows}
                                for p in kv_transport.read_protocols(log) if p.is_read][:8],
            "ucx_version": next((ln.split("UCX  INFO  ", 1)[1] for ln in log.splitlines()
                                 if "UCX  INFO  Version" in ln), None)}


def _asdict(settings) -> dict:
    from dataclasses import asdict

    d = asdict(settings)
    d["backends"] = list(d["backends"])
    return d


def _check_rows(name: str, rec: dict, failures: list[str]) -> None:
    from bench.nixl_probe import ProbeConfig

    for n, row in rec["summary"].items():
        ratio = row["ttft_private_s"] / row["ttft_shared_s"] if row["ttft_shared_s"] else 0.0
        row["ttft_private_over_shared"] = round(ratio, 3)
        print(f"  {name} L={n}: decoder TTFT shared {row['ttft_shared_s'] * 1e3:.1f} ms, private "
              f"{row['ttft_private_s'] * 1e3:.1f} ms ({ratio:.2f}x); second prefill computed "
              f"{row['second_prefill_computed']} tokens; all pulled: {row['all_pulled']}; "
              f"tokens equal: {row['tokens_equal']}", flush=True)
        if not (row["all_pulled"] and row["tokens_equal"]):
            failures.append(f"{name} L={n}: not every decoder pulled the whole prompt, or tokens differ")
        if row["second_prefill_computed"] > ProbeConfig.block_size:
            failures.append(f"{name} L={n}: the second prefill computed more than one block")
    rate = rec["kv_transfer"]
    print(f"  {name}: NIXL moved {rate['mib']} MiB in {rate['seconds'] * 1e3:.1f} ms ({rate['gb_s']} GB/s, "
          f"vLLM's counters); transport planned: {rec['transport_planned']}; UCX chose: "
          f"{rec['transport_chosen'] or 'not logged'}", flush=True)
    if not rate["mib"]:
        failures.append(f"{name}: vLLM counted no NIXL bytes")


def copy_gb_s(nbytes: int, device: str, repeats: int = 5) -> float:
    """A plain device-to-device copy of ``nbytes`` (host memory on the CPU), best of ``repeats``."""
    a = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return nbytes / _timed(lambda: b.copy_(a), device, repeats) / 1e9


def handover(args, results: dict, failures: list[str], step: str, limit: float) -> None:
    """Steps tokens, lora, speed, speed-auto (module docstring)."""
    gpu = args.device == "cuda"
    setting = app_setting(args.device)
    if step == "tokens":
        probe = ["--models", "shipped", "--lengths", "300,900" if gpu else "300", "--repeats", "1",
                 "--max-tokens", "8"]
    elif step == "lora":
        probe = ["--models", "shipped", "--lora", args.lora, "--lengths", "300", "--repeats", "1", "--max-tokens", "8"]
    else:
        if step == "speed-auto":
            setting = "gpu-auto" if gpu else setting
        shape, length = (args.shape, args.speed_length) if gpu else ("toy", 256)
        probe = ["--models", "random", "--shape", shape, "--lengths", str(length), "--repeats", "2" if gpu else "1",
                 "--max-tokens", "2", "--dtype", "bfloat16" if gpu else "float32",
                 "--kv-bytes", str(args.kv_bytes if gpu else 1 << 28)]
    res, log = _probe(args, step, [*probe, *_common(args, setting)], limit)
    rec = _record(step, res, log, setting, args.device)
    results.setdefault("handover", {})[step] = rec
    _check_rows(step, rec, failures)
    rate = rec["kv_transfer"]
    if step.startswith("speed") and rate["pulls"]:
        per_pull = int(rate["mib"] * 2**20 / rate["pulls"])
        rec["copy_gb_s"] = round(copy_gb_s(per_pull, args.device), 3)
        rec["kv_over_copy"] = round(rate["gb_s"] / rec["copy_gb_s"], 4) if rec["copy_gb_s"] else 0.0
        print(f"  {step}: a plain copy of the same {per_pull / 2**20:.1f} MiB: {rec['copy_gb_s']} GB/s; "
              f"NIXL at {rec['kv_over_copy']:.3f}x of it", flush=True)
    ratios = results.setdefault("ratios", {})  # speed, as ratios only: never a failure
    if step.startswith("speed"):
        ratios[f"{step}: decoder TTFT private / shared"] = {
            n: row["ttft_private_over_shared"] for n, row in rec["summary"].items()}
        ratios[f"{step}: KV GB/s / device copy GB/s"] = rec.get("kv_over_copy")
    if step == "speed-auto" and "speed" in results["handover"]:
        on, off = results["handover"]["speed"]["kv_transfer"]["gb_s"], rate["gb_s"]
        ratios["KV GB/s with the CUDA IPC override / without"] = round(on / off, 3) if off else None


def in_engine(args, results: dict, failures: list[str], limit: float) -> None:
    """Step in_engine: bench.in_engine_probe (the shipped chat adapters in the base's own engine)."""
    work = tempfile.mkdtemp(prefix="ps-gpu-alora-")
    res, _ = _probe(args, "in_engine", ["--work", work], limit, module="bench.in_engine_probe")
    shutil.rmtree(work, ignore_errors=True)
    results["in_engine"] = res
    failures.extend(f"in_engine: {f}"[:300] for f in res["failures"])
    share = res["sharing"]
    print(f"  in_engine: {res['tokens']['compared']} greedy answers compared, {len(res['tokens']['mismatches'])} "
          f"differ; a fan-out of 4 adapters over {share['prompt_tokens']} tokens computed "
          f"{share['computed_over_one_prompt']}x one prompt (vLLM's counters); aLoRA: {res['alora']['compared']} "
          f"answers against PEFT, a fan-out of 2 computed {res['alora']['computed_over_one_prompt']}x one prompt",
          flush=True)
    results.setdefault("ratios", {})["in_engine: fan-out of 4 computed / one prompt"] = share["computed_over_one_prompt"]
    results["ratios"]["in_engine: aLoRA fan-out of 2 computed / one prompt"] = res["alora"]["computed_over_one_prompt"]


# ---------------------------------------------------------------- the run

# step -> (title, time limit in seconds); the default run's limits add up to BUDGET_S
STEPS = {
    "env": ("nvidia-smi and versions", 10),
    "transport": ("KV blocks: batched slot copies vs plain copies (torch only)", 30),
    "tokens": ("vllm-nixl, the app's settings: a full decoder's tokens on the pulled KV", 65),
    "lora": ("vllm-nixl, the app's settings: a LoRA adapter consumer's tokens on the pulled KV", 65),
    "speed": ("vllm-nixl, the app's settings: TTFT shared vs private, KV GB/s vs a copy, UCX's transport", 100),
    "speed-auto": ("vllm-nixl without the CUDA IPC override: KV GB/s and UCX's transport", 70),
    "in_engine": ("in-engine LoRA decoders: tokens vs transformers (aLoRA: vs PEFT), the base's prefix cache shared",
                  60),
}
DEFAULT_STEPS = tuple(STEPS)
BUDGET_S = 400
# --device cpu (the dry run): a 2-core box starts two engines in 20-50 s where a GPU box takes ~10 s
CPU_SLACK = 5


class StepTimeout(Exception):
    """A step ran past its own limit."""


def _write(args, results: dict) -> None:
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(results, f, indent=1)


def _alarm(signum, frame):
    raise StepTimeout("ran past its limit")


def run(args) -> int:
    results: dict = {"device": args.device, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "limits_s": {k: STEPS[k][1] * (1 if args.device == "cuda" else CPU_SLACK) for k in DEFAULT_STEPS}}
    failures: list[str] = []
    results["failures"] = failures
    signal.signal(signal.SIGALRM, _alarm)
    for key in args.steps.split(","):
        if key not in STEPS:
            raise SystemExit(f"--steps: unknown step {key!r} ({', '.join(STEPS)})")
        title, limit = STEPS[key]
        limit *= 1 if args.device == "cuda" else CPU_SLACK
        print(f"== {key}: {title} (limit {limit} s)", flush=True)
        t0 = time.perf_counter()
        try:
            if key in ("env", "transport"):
                signal.alarm(limit)  # in-process steps; the probes are killed at their limit instead
                try:
                    (environment if key == "env" else transport)(args, results, failures)
                finally:
                    signal.alarm(0)
            elif key == "in_engine":
                in_engine(args, results, failures, limit)
            else:
                handover(args, results, failures, key, limit)
        except Exception as e:  # noqa: BLE001 - report and go on to the next step
            traceback.print_exc()
            failures.append(f"step {key}: {type(e).__name__}: {e}"[:300])
        spent = time.perf_counter() - t0
        results.setdefault("step_seconds", {})[key] = round(spent, 1)
        print(f"   ({spent:.0f} s)", flush=True)
        _write(args, results)
    _write(args, results)
    print("== RESULT:", "PASS" if not failures else f"FAIL {failures}", flush=True)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", default=",".join(DEFAULT_STEPS), help=f"comma-separated, in order ({', '.join(STEPS)})")
    ap.add_argument("--shapes", default="8B,100M", help="transport: cache shapes to measure")
    ap.add_argument("--full", action="store_true", help="--device cpu: the transport step at full sizes")
    ap.add_argument("--shape", default="8B", help="speed: the dummy Llama's shape (bench.nixl_probe.SHAPES)")
    ap.add_argument("--speed-length", type=int, default=4096, help="speed: prompt tokens")
    ap.add_argument("--kv-bytes", type=int, default=3 << 30, help="speed: each engine's KV space on the GPU")
    ap.add_argument("--lora", default="checkpoints/chat/adapters/lookup", help="lora: an adapter of the shipped base")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
