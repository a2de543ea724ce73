"""KV across CPU nodes, side by side: the pool's own NIXL block server against vLLM's NixlConnector.

Both hand-overs that move a prompt's KV from a prefill node to a decode node, in one run, on
the same model, prompts and core binding (producer on core 0, a consumer with other weights on
core 1, each engine in its own process, float32):

- ``pool-nixl`` (``pool.transport: nixl``): the producer writes its node's pool; a block server
  process (``python -m app.engine.nixl_transport serve``) serves it; the consumer's pool is another
  folder ("another node"), which pulls the missing blocks through NIXL, then loads them.
- ``vllm-nixl`` (``handover: vllm-nixl``): one prefill lease per prompt; the decoder pulls it with
  vLLM's NixlConnector (progress thread off, the project's CPU setting).

Per prompt and mode: the prefill, the decoder's time to first token on the handed-over KV (its
first read, the NIXL pull included) and a private prefill of the same prompt on the same decoder
(another cache salt: nothing to find). The decoders of the two modes must report the same cached
tokens. ``--fanout N`` hands each prompt to N decoders of the decode node, one after another (the
one consumer engine reads N times): the pool prefills once and pulls once per node (later reads
find the blocks in the node's pool), vLLM's connector takes one prefill request (a lease) and one
pull per decoder; the fan-out time is the prefill plus the N reads. Prints a table with the ratios
and writes JSON:

    python -m app.bench.cross_node --lengths 2048,4096 --repeats 2 [--fanout 4] --out runs/cross_node/cpu.json

Run it alone on the machine (it starts four engines, two at a time).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

from app.bench import nixl_probe
from app.bench.nixl_probe import ProbeConfig

MODES = ("pool-nixl", "vllm-nixl")


def _pool_engines(cfg: ProbeConfig, base: str, decoder: str, max_len: int, work: str):
    """Producer and consumer specs of ``pool-nixl``, and the block server (to stop after)."""
    from app.engine.async_engine import EngineConfig, connector_config
    from app.engine.kv_pool import PoolSpec
    from app.engine.nixl_transport import serve_process

    prod_pool = PoolSpec(path=f"{work}-prefill-node", capacity_bytes=2 << 30)
    srv, addr = serve_process(prod_pool.path)
    dec_pool = PoolSpec(path=f"{work}-decode-node", capacity_bytes=2 << 30, transport="nixl", nixl_peers=(addr,),
                        nixl_timeout_s=cfg.request_timeout_s)
    common = nixl_probe.engine_common(cfg, max_len)
    prod = EngineConfig(model=base, extra_env=nixl_probe.engine_env(cfg, 0), enable_prefix_caching=True,
                        kv_transfer_config=connector_config("producer", "base", prod_pool), **common)
    cons = EngineConfig(model=decoder, extra_env=nixl_probe.engine_env(cfg, 1), enable_prefix_caching=False,
                        kv_transfer_config=connector_config("consumer", "base", dec_pool), **common)
    return {"producer": (prod, {}), "consumer": (cons, {})}, srv


async def _ttft(engine, ids, salt, params=None):
    from app.sampling import Sampling

    t = time.perf_counter()
    out = await engine.complete(ids, Sampling(max_tokens=1, ignore_eos=True), None, salt, params)
    return time.perf_counter() - t, out.num_cached_tokens


async def _cases(mode: str, cfg: ProbeConfig, prod, cons, prompts, lease: int, fanout: int) -> list[dict]:
    from app.engine import vllm_nixl_handover as ho

    rows = []
    warm = prompts[0][:128]  # the first read makes the NIXL connection / handshake
    if mode == "vllm-nixl":
        (le,) = await ho.prefill_leases(prod, warm, 1, lease_s=lease)
        await _ttft(cons, warm, None, ho.pull_params(le, ho.default_margin(lease))[0])
    else:
        await prod.prefill(warm, cache_salt="warm", kv_transfer_params={"fanout": 1})
        await _ttft(cons, warm, "warm")
    for i, ids in enumerate(prompts):
        salt = f"{mode}-{i}"
        t = time.perf_counter()
        if mode == "vllm-nixl":
            leases = await ho.prefill_leases(prod, ids, fanout, lease_s=lease, cache_salt=salt)
            params = []
            for le in leases:
                p, reason = ho.pull_params(le, ho.default_margin(lease))
                if reason:
                    raise RuntimeError(f"{mode}: lease unusable ({reason})")
                params.append(p)
        else:
            await prod.prefill(ids, cache_salt=salt, kv_transfer_params={"fanout": fanout})
            params = [None] * fanout
        prefill_s = time.perf_counter() - t
        reads = [await _ttft(cons, ids, salt, p) for p in params]
        private_s, private_cached = await _ttft(cons, ids, f"private-{salt}")
        row = {"mode": mode, "L": len(ids), "fanout": fanout, "prefill_s": round(prefill_s, 4),
               "ttft_shared_s": round(reads[0][0], 4), "reads_s": [round(r, 4) for r, _ in reads],
               "fanout_s": round(prefill_s + sum(r for r, _ in reads), 4),
               "ttft_private_s": round(private_s, 4), "cached": min(c for _, c in reads),
               "private_cached": private_cached}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run(cfg: ProbeConfig, modes=MODES, fanout: int = 1) -> dict:
    work = f"/dev/shm/ps-cross-node-{uuid.uuid4().hex[:8]}"
    result: dict = {"config": {"lengths": cfg.lengths, "repeats": cfg.repeats, "binds": cfg.binds,
                               "block_size": cfg.block_size, "dtype": cfg.dtype, "fanout": fanout}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="cross-node-") as tmp:
        base, decoder, max_len = nixl_probe._models(cfg, Path(tmp))
        prompts = nixl_probe._prompts(cfg, base)
        for mode in modes:
            srv = None
            try:
                if mode == "pool-nixl":
                    specs, srv = _pool_engines(cfg, base, decoder, max_len, work)
                    lease = 0
                else:
                    specs, lease = nixl_probe.engine_specs(cfg, base, decoder, max_len)
                t = time.perf_counter()
                engines = nixl_probe.start_engines(specs)
                result.setdefault("start_s", {})[mode] = round(time.perf_counter() - t, 1)
                try:
                    result["rows"] += asyncio.run(_cases(mode, cfg, engines["producer"], engines["consumer"],
                                                         prompts, lease, fanout))
                    if mode == "vllm-nixl":
                        result["vllm_nixl_transfer"] = nixl_probe.transfer_rate(
                            asyncio.run(engines["consumer"].metrics()))
                finally:
                    for e in engines.values():
                        e.stop()
            finally:
                if srv is not None:
                    srv.terminate()
                    srv.wait(30)
                for suffix in ("-prefill-node", "-decode-node"):
                    shutil.rmtree(work + suffix, ignore_errors=True)
    result["summary"] = summarize(result["rows"])
    return result


def summarize(rows: list[dict]) -> dict:
    """Per L: each mode's median shared and private TTFT, and vllm-nixl's shared over pool-nixl's."""
    out: dict = {}
    for n in sorted({r["L"] for r in rows}):
        cell: dict = {}
        for mode in MODES:
            rs = [r for r in rows if r["L"] == n and r["mode"] == mode]
            if rs:
                cell[mode] = {k: round(statistics.median(r[k] for r in rs), 4)
                              for k in ("prefill_s", "ttft_shared_s", "ttft_private_s", "fanout_s")}
                cell[mode]["all_read"] = all(r["cached"] >= n - 1 for r in rs)
        if all(m in cell for m in MODES):
            v, p = cell["vllm-nixl"], cell["pool-nixl"]
            cell["vllm_over_pool_shared"] = round(v["ttft_shared_s"] / p["ttft_shared_s"], 2)
            cell["vllm_over_pool_fanout"] = round(v["fanout_s"] / p["fanout_s"], 2)
        out[str(n)] = cell
    return out


def table(summary: dict) -> str:
    lines = ["| L | pool-nixl shared | vllm-nixl shared | vllm / pool | private (pool run) | private (vllm run) "
             "| prefill pool / vllm | fan-out pool / vllm | vllm / pool |", "|---|---|---|---|---|---|---|---|---|"]
    for n, c in summary.items():
        p, v = c.get("pool-nixl", {}), c.get("vllm-nixl", {})
        ms = lambda d, k: f"{d[k] * 1e3:.0f} ms" if k in d else "-"  # noqa: E731
        lines.append(f"| {n} | {ms(p, 'ttft_shared_s')} | {ms(v, 'ttft_shared_s')} | {c.get('vllm_over_pool_shared', '-')}x "
                     f"| {ms(p, 'ttft_private_s')} | {ms(v, 'ttft_private_s')} | {ms(p, 'prefill_s')} / {ms(v, 'prefill_s')} "
                     f"| {ms(p, 'fanout_s')} / {ms(v, 'fanout_s')} | {c.get('vllm_over_pool_fanout', '-')}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,4096")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", choices=["random", "shipped"], default="random")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--fanout", type=int, default=1, help="decoders each prompt is handed to (one after another)")
    ap.add_argument("--timeout", type=float, default=180.0, help="per request (s); the lease follows it")
    ap.add_argument("--out", default="runs/cross_node/cpu.json")
    a = ap.parse_args(argv)
    modes = tuple(a.modes.split(","))
    if not set(modes) <= set(MODES):
        ap.error(f"--modes: each of {', '.join(MODES)}")
    cfg = replace(ProbeConfig(), setting="polled", models=a.models, lengths=tuple(int(x) for x in a.lengths.split(",")),
                  repeats=a.repeats, request_timeout_s=a.timeout, check_tokens=False)
    if a.fanout < 1:
        ap.error("--fanout: at least 1")
    result = run(cfg, modes, a.fanout)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(table(result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
