"""Capacity model: how many prefill vs decode replicas a fan-out workload needs, and what limits it.

A session is one context of ``L`` tokens read by ``N`` agents (decoders), each generating ``O``
tokens; sessions arrive at ``R`` per second. Three systems are sized side by side:

- ``prefillshare``: one prefill of the context on the shared prefill group; every decode node
  that hosts one of the session's agents pulls the KV once (the NIXL pool caches it per node),
  each decoder loads it and computes its last prompt token plus the output.
- ``disagg``: per-model prefill/decode disaggregation without sharing: N prefills of the same
  context (one per decoder's own base), N KV transfers.
- ``colocated``: every decoder prefills its own prompt; no KV moves.
- ``in-engine``: the decoders are LoRA adapters served in the prefill module's own engines
  (``lora_decoders``): one prefill of the context in the prefix cache of the replica the fan-out
  lands on, every agent's last prompt token and output on the same replica; no KV moves, and the
  module's replicas do both stages (counted as prefill replicas, no decode group).

Costs are replica-seconds (a replica is one core on the CPU profile, one GPU on the GPU
profile). Replicas = ceil(load / utilization). Prefill and decode groups live on separate
nodes (as the KubeRay worker groups do); KV bytes cross between them. If the per-node link
would exceed ``utilization`` of its bandwidth, nodes are added to carry it and the bottleneck
is the KV transfer; otherwise it is the stage that takes most replicas. Every number in a
profile is either measured here (source named) or an assumption (stated as one).
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace

from prefillshare.app.prompt_split import shared_length

SYSTEMS = ("prefillshare", "in-engine", "disagg", "colocated")


@dataclass(frozen=True)
class Profile:
    """Per-replica costs of one hardware + model combination."""

    name: str
    note: str
    unit: str  # what one replica is: "core" or "GPU"
    replicas_per_node: int
    kv_bytes_per_token: float  # 2 * layers * kv_heads * head_dim * dtype bytes
    prefill_s_per_token: float  # linear part of prefill time (weights)
    prefill_s_per_token2: float  # quadratic part (attention over the prompt), seconds per token^2
    decode_step_s: float  # one decode step's context-free cost (weights), shared by the batch
    decode_s_per_ctx_token: float  # per sequence per step, per token of context (attention reads)
    max_batch: int  # decode sequences per replica at most
    kv_memory_bytes: float  # room for KV in one decode replica (caps the batch at long contexts)
    kv_load_bytes_per_s: float  # decoder-side copy of loaded KV into its cache (charged to the decoder)
    link_bytes_per_s: float  # node-to-node KV bandwidth per node

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_s_per_token * tokens + self.prefill_s_per_token2 * tokens * tokens

    def batch(self, ctx: int) -> int:
        fit = int(self.kv_memory_bytes // max(ctx * self.kv_bytes_per_token, 1.0))
        return max(1, min(self.max_batch, fit))

    def decode_s_per_token(self, ctx: int) -> float:
        """Replica-seconds one sequence costs per generated token at context ``ctx``."""
        return self.decode_step_s / self.batch(ctx) + self.decode_s_per_ctx_token * ctx


# --- CPU profile: measured on this project's 2-core box, one pinned thread per engine --------------
# Model: random-weight Llama ~94M (hidden 1024, 8 layers, 16 heads, 4 KV heads, head_dim 64), bf16.
_CPU_KV_BYTES = 2 * 8 * 4 * 64 * 2  # = 8 KiB/token
# Prefill 0.55 s (1K), 1.35 s (2K), 3.48 s (4K) tokens, cold (docs/platform.md "Measured per-core costs").
# Fit t = a*L + b*L^2 through 1K and 4K: a = 4.33e-4 s/token, b = 1.017e-7 s/token^2 (gives 1.31 s at 2K).
_CPU_PREFILL_A, _CPU_PREFILL_B = 4.33e-4, 1.017e-7
# Decode per sequence per token at batch 16: 1.0 ms (16-token context), 2.5 / 3.8 / 6.2 ms (1K/2K/4K)
# (docs/platform.md). Line through 16 and 4096 tokens: 1.27 us per context token; the rest (0.98 ms x 16
# sequences) is the step's weight cost shared by the batch.
_CPU_DEC_CTX = (6.2e-3 - 1.0e-3) / (4096 - 16)
_CPU_DEC_STEP = (1.0e-3 - 16 * _CPU_DEC_CTX) * 16
# KV load into the decoder's cache: 10.2 us/token for the ~100M model (8 KiB/token) at L=2048,
# N=4 (CHANGELOG.md "Superseded measurements", `bench engine --lengths 2048 --fanouts 4`, load
# average 8-20) = 0.80 GB/s.
# The 1 KiB/token quick model gave 3.4 us/token (0.30 GB/s): per-block overheads dominate there.
_CPU_KV_LOAD_BPS = _CPU_KV_BYTES / 10.2e-6
# Node to node: NIXL pull of 64 MiB over loopback UCX in 0.17-0.29 s including the server's
# staging and checksums (the retired block server: CHANGELOG.md "Superseded measurements"); the
# slower end, 0.23 GB/s.
_CPU_LINK_BPS = (64 << 20) / 0.29

CPU_MEASURED = Profile(
    name="cpu-measured",
    note="94M Llama bf16, one core per replica, 2 cores per node; costs measured on this 2-core box "
         "(docs/platform.md, docs/engine.md), node link = NIXL over loopback",
    unit="core", replicas_per_node=2, kv_bytes_per_token=_CPU_KV_BYTES,
    prefill_s_per_token=_CPU_PREFILL_A, prefill_s_per_token2=_CPU_PREFILL_B,
    decode_step_s=_CPU_DEC_STEP, decode_s_per_ctx_token=_CPU_DEC_CTX, max_batch=16,
    kv_memory_bytes=2 * (1 << 30),  # kv_cache_memory_bytes = 2 GiB per engine (assumption)
    kv_load_bytes_per_s=_CPU_KV_LOAD_BPS, link_bytes_per_s=_CPU_LINK_BPS,
)

# --- GPU projection: Llama-3.1-8B on H200 nodes; every figure below is an ASSUMPTION ----------------
_L8B_LAYERS, _L8B_HIDDEN, _L8B_KV_HEADS, _L8B_HEAD_DIM, _L8B_PARAMS = 32, 4096, 8, 128, 8.03e9
_L8B_KV_BYTES = 2 * _L8B_LAYERS * _L8B_KV_HEADS * _L8B_HEAD_DIM * 2  # bf16: 128 KiB/token
_H200_BF16_FLOPS = 989e12  # dense bf16 peak (vendor figure)
_PREFILL_MFU = 0.5  # assumption: prefill reaches half of peak (=> ~31k prompt tokens/s at short L)
_H200_HBM_BPS = 4.8e12  # vendor figure
_DECODE_HBM_EFF = 0.7  # assumption: decode steps reach 70% of HBM bandwidth
_H200_KV_MEMORY = (141e9 - 2 * _L8B_PARAMS) * 0.9  # assumption: 90% of what the weights leave
_H2D_BPS = 40e9  # assumption: KV staged in host memory copied to the GPU over PCIe Gen5 at 40 GB/s
_NODE_LINK_BPS = 8 * 400e9 / 8 * 0.8  # assumption: 8 x 400 Gb/s NICs per 8-GPU node at 80% = 320 GB/s

H200_PAPER = Profile(
    name="h200-paper",
    note="PROJECTION, not measured: Llama-3.1-8B bf16 on 8-GPU H200 nodes; prefill at 50% MFU, "
         "decode at 70% of HBM bandwidth, KV over 8x400 Gb/s per node at 80%, host->GPU copy 40 GB/s",
    unit="GPU", replicas_per_node=8, kv_bytes_per_token=_L8B_KV_BYTES,
    prefill_s_per_token=2 * _L8B_PARAMS / (_H200_BF16_FLOPS * _PREFILL_MFU),
    prefill_s_per_token2=2 * _L8B_LAYERS * _L8B_HIDDEN / (_H200_BF16_FLOPS * _PREFILL_MFU),
    decode_step_s=2 * _L8B_PARAMS / (_H200_HBM_BPS * _DECODE_HBM_EFF),
    decode_s_per_ctx_token=_L8B_KV_BYTES / (_H200_HBM_BPS * _DECODE_HBM_EFF),
    max_batch=128,  # assumption: scheduler cap
    kv_memory_bytes=_H200_KV_MEMORY, kv_load_bytes_per_s=_H2D_BPS, link_bytes_per_s=_NODE_LINK_BPS,
)

PROFILES = {p.name: p for p in (CPU_MEASURED, H200_PAPER)}


@dataclass(frozen=True)
class Workload:
    fanout: int  # N agents per context
    context: int  # L shared prompt tokens
    output: int  # O generated tokens per agent
    rate: float  # R sessions per second
    utilization: float = 0.7  # size every resource to run at most this busy

    def __post_init__(self) -> None:
        for name in ("fanout", "context", "output"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.rate <= 0:
            raise ValueError(f"rate: must be > 0, got {self.rate}")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"utilization: must be in (0, 1], got {self.utilization}")


@dataclass(frozen=True)
class Sizing:
    """One system sized for one workload on one profile."""

    system: str
    prefill_load: float  # replica-seconds of prefill per second
    decode_load: float
    prefill_replicas: int
    decode_replicas: int
    prefill_nodes: int
    decode_nodes: int
    kv_bytes_per_request: float  # KV a decoder receives for one agent request
    kv_pulls_per_session: int
    kv_bytes_per_s: float  # across nodes, whole cluster
    kv_egress_per_prefill_node: float  # bytes/s
    kv_ingress_per_decode_node: float
    link_utilization: float
    transfer_s_per_request: float  # added latency of moving one request's KV over the link
    bottleneck: str  # "prefill", "decode" or "kv_transfer"

    @property
    def replicas(self) -> int:
        return self.prefill_replicas + self.decode_replicas


def _replicas(load: float, util: float) -> int:
    return math.ceil(load / util - 1e-9) if load > 0 else 0


def size(profile: Profile, w: Workload, system: str, pack: bool = False) -> Sizing:
    """Replicas, nodes and KV traffic for ``system`` at ``w``'s rate.

    ``pack``: the router puts a session's agents on as few decode nodes as it can (every node
    serving every decoder); otherwise (the worst case) they spread over up to N nodes, each
    pulling the context once.
    """
    if system not in SYSTEMS:
        raise ValueError(f"system: {system!r} is not one of {SYSTEMS}")
    n, ctx, out, u = w.fanout, w.context, w.output, w.utilization
    shared = shared_length(ctx)  # the decoder computes the last prompt token itself
    kv_req = shared * profile.kv_bytes_per_token
    dec_per_agent = out * profile.decode_s_per_token(ctx + out // 2)
    if system == "colocated":
        p_load, d_load = 0.0, w.rate * n * (profile.prefill_s(ctx) + dec_per_agent)
        kv_req = 0.0
    elif system == "in-engine":  # one group of replicas: the context once, then every agent's decode
        p_load, d_load = w.rate * (profile.prefill_s(shared) + n * dec_per_agent), 0.0
        kv_req = 0.0
    else:
        prefills = 1 if system == "prefillshare" else n
        p_load = w.rate * prefills * profile.prefill_s(shared)
        d_load = w.rate * n * (kv_req / profile.kv_load_bytes_per_s + dec_per_agent)
    p_rep, d_rep = _replicas(p_load, u), _replicas(d_load, u)
    per = profile.replicas_per_node
    p_nodes, d_nodes = math.ceil(p_rep / per), math.ceil(d_rep / per)
    link_cap = profile.link_bytes_per_s * u
    forced = False
    pulls, total = 0, 0.0
    for _ in range(10_000):  # add nodes until the links carry the KV (pulls grow with decode nodes)
        spread = math.ceil(n / profile.replicas_per_node) if pack else n
        pulls = 0 if system in ("colocated", "in-engine") else (min(spread, d_nodes) if system == "prefillshare" else n)
        total = w.rate * pulls * kv_req
        need_p = math.ceil(total / link_cap - 1e-9) if total else 0
        need_d = math.ceil(total / link_cap - 1e-9) if total else 0
        if need_p <= p_nodes and need_d <= d_nodes:
            break
        forced = True
        p_nodes, d_nodes = max(p_nodes, need_p), max(d_nodes, need_d)
    egress = total / p_nodes if p_nodes else 0.0
    ingress = total / d_nodes if d_nodes else 0.0
    link_util = max(egress, ingress) / profile.link_bytes_per_s
    if forced:
        bottleneck = "kv_transfer"
    else:
        bottleneck = "prefill" if p_load > d_load else "decode"
    return Sizing(system, p_load, d_load, p_rep, d_rep, p_nodes, d_nodes, kv_req, pulls, total, egress, ingress,
                  link_util, kv_req / profile.link_bytes_per_s, bottleneck)


def work_ratio(profile: Profile, w: Workload, baseline: str) -> float:
    """Replica-seconds per session of ``baseline`` over PrefillShare's: the throughput bound at saturation."""
    a, b = size(profile, w, "prefillshare"), size(profile, w, baseline)
    return (b.prefill_load + b.decode_load) / (a.prefill_load + a.decode_load)


# --- command line ----------------------------------------------------------------------------------
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _fmt_bytes(b: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= k:
            return f"{b / k:.1f} {unit}"
    return f"{b:.0f} B"


def table(profile: Profile, workloads: list[Workload], pack: bool = False) -> str:
    """Markdown table: one row per (workload, system)."""
    u = profile.unit
    head = (f"| N | L | O | R/s | system | prefill {u}s | decode {u}s | total | nodes P+D | KV/request | "
            f"KV/s per prefill node | KV/s per decode node | link util | transfer/request | bottleneck | "
            f"work ratio vs it |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for w in workloads:
        for system in SYSTEMS:
            s = size(profile, w, system, pack)
            ratio = "-" if system == "prefillshare" else f"{work_ratio(profile, w, system):.2f}x"
            rows.append(
                f"| {w.fanout} | {w.context} | {w.output} | {w.rate:g} | {system} | {s.prefill_replicas} "
                f"({s.prefill_load:.2f}) | {s.decode_replicas} ({s.decode_load:.2f}) | {s.replicas} | "
                f"{s.prefill_nodes}+{s.decode_nodes} | {_fmt_bytes(s.kv_bytes_per_request)} | "
                f"{_fmt_bytes(s.kv_egress_per_prefill_node)}/s | {_fmt_bytes(s.kv_ingress_per_decode_node)}/s | "
                f"{s.link_utilization:.0%} | {s.transfer_s_per_request * 1e3:.1f} ms | {s.bottleneck} | {ratio} |")
    return "\n".join(rows)


def configure(parser: argparse.ArgumentParser) -> None:
    """Hook for app/cli.py's COMMANDS table."""
    parser.add_argument("--fanout", default="8", help="agents per context, N (comma list for several rows)")
    parser.add_argument("--context", default="2048", help="shared context tokens, L (comma list)")
    parser.add_argument("--output", default="64", help="generated tokens per agent, O (comma list)")
    parser.add_argument("--rate", type=float, default=1.0, help="sessions (contexts) per second")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu-measured")
    parser.add_argument("--utilization", type=float, default=0.7, help="size every resource to this busy")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="override the per-node KV link bandwidth (GB/s)")
    parser.add_argument("--pack", action="store_true",
                        help="a session's agents share decode nodes (fewer KV pulls); default: spread over N nodes")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--config", default=None,
                        help="a serve_config.yaml: check its replica bounds (max_replicas, or num_replicas) against "
                             "what each workload needs")
    parser.set_defaults(func=run)


def fleet_check(config, profile: Profile, workloads: list[Workload], pack: bool = False) -> list[str]:
    """One line per workload: whether the config's prefill modules and decoders, at their
    ``max_replicas``, hold the replicas PrefillShare needs for it (the autoscaler cannot go past them)."""
    prefill_max = sum(p.placement.max_replicas for p in config.prefill_modules)
    decode_max = sum(d.placement.max_replicas for d in config.decoders)
    lines = []
    for w in workloads:
        s = size(profile, w, "prefillshare", pack)
        short = [f"{what} needs {need}, max_replicas allow {have}" for what, need, have in
                 (("prefill", s.prefill_replicas, prefill_max), ("decode", s.decode_replicas, decode_max))
                 if need > have]
        lines.append(f"N={w.fanout} L={w.context} O={w.output} R={w.rate:g}/s: "
                     + ("; ".join(short) + ": raise max_replicas" if short else
                        f"fits (prefill {s.prefill_replicas} of {prefill_max}, decode {s.decode_replicas} of {decode_max})"))
    return lines


def run(args: argparse.Namespace) -> int:
    profile = PROFILES[args.profile]
    if args.link_gbps is not None:
        if args.link_gbps <= 0:
            raise SystemExit("--link-gbps: must be > 0")
        profile = replace(profile, link_bytes_per_s=args.link_gbps * 1e9)
    try:
        workloads = [Workload(n, ctx, o, args.rate, args.utilization)
                     for n in _ints(args.fanout) for ctx in _ints(args.context) for o in _ints(args.output)]
    except ValueError as e:
        raise SystemExit(f"prefillshare capacity: {e}") from None
    if args.json:
        print(json.dumps([{"workload": asdict(w), **{s: asdict(size(profile, w, s, args.pack)) for s in SYSTEMS}}
                          for w in workloads], indent=1))
        return 0
    print(f"profile {profile.name}: {profile.note}")
    print(table(profile, workloads, args.pack))
    print("(x.xx) = replica-seconds per second of work; replicas = ceil(load / utilization); "
          "work ratio = baseline replica-seconds per session / PrefillShare's")
    if args.config:
        from prefillshare.app.config import ConfigError, load_config

        try:
            config = load_config(args.config)
        except ConfigError as e:
            raise SystemExit(f"prefillshare capacity: --config: {e}") from None
        print(f"\n{args.config} at its maximum replicas:")
        print("\n".join(fleet_check(config, profile, workloads, args.pack)))
    return 0
