"""Figures of the serving benchmark: per-point statistics, the work bound, ratios, Markdown.

Everything here is pure (no Ray, no HTTP) so it is tested on made-up inputs.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass, field

from bench.client import SessionResult
from bench.systems import PAIRS, SYSTEMS
from bench.workload import point_label


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def pcts(xs: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(xs, 50), "p95": percentile(xs, 95), "p99": percentile(xs, 99)}


# --- Prometheus text -----------------------------------------------------------------
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    out: dict[tuple[str, tuple], float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue
    return out


def metric_sum(m: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in m.items() if n == name and all((k, x) in lab for k, x in labels.items()))


def metric_delta(after: dict, before: dict, name: str, **labels) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


# --- one load point ------------------------------------------------------------------
@dataclass
class PointResult:
    system: str
    fanout: int
    context_tokens: int
    rounds: int
    output_tokens: int
    mode: str                    # "rate" (Poisson, sessions/s) or "concurrency"
    load: float
    sent: int
    ok: int
    wall_s: float
    fanout_latency: dict         # p50/p95/p99 (s) of one round's fan-out, all rounds
    session_latency: dict        # p50/p95/p99 (s) of a whole session (all rounds)
    ttft: dict                   # p50/p95/p99 (s) per agent
    sessions_per_s: float
    output_tok_per_s: float
    prefill_tokens_computed_per_session: float
    cache_hit_ratio: float | None     # prompt tokens an engine found in its prefix cache / tokens it was given
    pool_hit_ratio: float | None      # of tokens decoders expected from the pool, found
    pool_peak_bytes: float            # sampled: every block the pool held, cached ones included
    decoder_kv_peak_bytes: float      # modelled: in-flight agents' (prompt + output) tokens x bytes/token
    cpu_s_per_session: float | None
    errors: list[str] = field(default_factory=list)
    repeat: int = 0                   # which repeat of this (system, N, L, R, load) point
    loadavg: float | None = None      # the machine's 1-minute load average when the point ended
    pool_pinned_peak_bytes: float | None = None  # sampled: blocks pinned for fan-out loads still to come (None: a run from before it was)
    # prompt tokens the prefill stage computed (the app's shared base or own-prefill module, stage="prefill";
    # a stock server's engine), per finished session; None: a run from before it was recorded
    base_prompt_tokens_per_session: float | None = None
    request_latency: dict | None = None        # p50/p95/p99 (s) of one agent's request, send to last token
    prompt_tokens_per_request: float | None = None  # mean prompt tokens of one agent's request (its usage)
    fallbacks: dict | None = None              # the app's prefillshare_fallbacks_total by reason over the point
    # mean TTFT per agent request at the client, and as vLLM's engines measured it (from a request's
    # arrival at the engine's frontend; every engine's requests, so a system with a separate prefill
    # engine counts its prefill requests too): the difference is what lies before and after the engine
    ttft_mean_s: float | None = None
    engine_ttft_mean_s: float | None = None
    # vLLM's other per-request means over the point, by histogram (queue, prefill, decode, inter-token)
    engine_means_s: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def key(self) -> tuple[int, int, int]:
        """(N, L, R): the points compared with one another and drawn in one panel."""
        return self.fanout, self.context_tokens, self.rounds

    @property
    def label(self) -> str:
        return point_label(*self.key)

    @property
    def kv_held_peak_bytes(self) -> float | None:
        """KV the fan-outs need at the peak: the pool's pinned blocks plus the decoders' modelled
        resident KV. The pool's other blocks are a cache (LRU, evictable), like the engines'
        prefix caches, which no system counts here."""
        if self.pool_pinned_peak_bytes is None:
            return None
        return self.pool_pinned_peak_bytes + self.decoder_kv_peak_bytes


def summarize(system: str, spec, mode: str, load: float, results: list[SessionResult], t0: float, t_end: float,
              before: dict, after: dict, pool_peak: float, pool_pinned_peak: float, kv_bytes_per_token: int,
              cpu_s: float | None) -> PointResult:
    ok = [r for r in results if r.ok]
    agents = [a for r in ok for a in r.agents]
    wall = max(t_end - t0, 1e-9)
    computed = metric_delta(after, before, "prefillshare_prefill_tokens_computed_total")
    base = metric_delta(after, before, "prefillshare_prefill_tokens_computed_total", stage="prefill")
    saved = metric_delta(after, before, "prefillshare_prefill_tokens_saved_total")
    lookup = metric_delta(after, before, "prefillshare_kv_pool_lookup_tokens_total")
    hit = metric_delta(after, before, "prefillshare_kv_pool_hit_tokens_total")
    # prefix-cache hits only: KV a decoder loaded from the pool is a hand-over, not a cache hit
    cached = max(0.0, saved - hit)
    # modelled decoder-resident KV: sweep over agent intervals
    events = []
    for a in agents:
        if a.e2e_s is None:
            continue
        b = (a.prompt_tokens + a.completion_tokens) * kv_bytes_per_token
        events += [(a.start, b), (a.start + a.e2e_s, -b)]
    peak = cur = 0.0
    for _, b in sorted(events, key=lambda e: (e[0], e[1])):
        cur += b
        peak = max(peak, cur)
    errs = sorted({(r.error or next((a.error for a in r.agents if a.error), "?"))[:160] for r in results if not r.ok})
    return PointResult(
        system=system, fanout=spec.fanout, context_tokens=spec.context_tokens, rounds=spec.rounds,
        output_tokens=spec.output_tokens, mode=mode, load=load, sent=len(results), ok=len(ok), wall_s=wall,
        fanout_latency=pcts([x for r in ok for x in r.rounds_s]),
        session_latency=pcts([r.latency_s for r in ok]),
        ttft=pcts([a.ttft_s for a in agents if a.ttft_s is not None]),
        sessions_per_s=len(ok) / wall,
        output_tok_per_s=sum(a.completion_tokens for a in agents) / wall,
        prefill_tokens_computed_per_session=computed / len(ok) if ok else 0.0,
        cache_hit_ratio=(cached / (cached + computed)) if cached + computed else None,
        pool_hit_ratio=hit / lookup if lookup else None,
        pool_peak_bytes=pool_peak, decoder_kv_peak_bytes=peak, pool_pinned_peak_bytes=pool_pinned_peak,
        cpu_s_per_session=(cpu_s / len(ok)) if (cpu_s is not None and ok) else None,
        errors=errs,
        base_prompt_tokens_per_session=base / len(ok) if ok else None,
        request_latency=pcts([a.e2e_s for a in agents if a.e2e_s is not None]),
        prompt_tokens_per_request=sum(a.prompt_tokens for a in agents) / len(agents) if agents else None,
        ttft_mean_s=statistics.fmean(ttfts) if (ttfts := [a.ttft_s for a in agents if a.ttft_s is not None]) else None,
        engine_ttft_mean_s=_engine_mean(after, before, "time_to_first_token"),
        engine_means_s={h: m for h in ENGINE_HISTOGRAMS if (m := _engine_mean(after, before, h)) is not None} or None,
        fallbacks={reason: n for reason in sorted({dict(lab).get("reason") for (name, lab) in after
                                                   if name == "prefillshare_fallbacks_total"} - {None})
                   if (n := metric_delta(after, before, "prefillshare_fallbacks_total", reason=reason))},
    )


ENGINE_HISTOGRAMS = ("request_queue_time", "request_prefill_time", "request_decode_time", "inter_token_latency")


def _engine_mean(after: dict, before: dict, histogram: str) -> float | None:
    """The mean of vLLM's ``vllm:<histogram>_seconds`` over the point (its sum over its count)."""
    count = metric_delta(after, before, f"vllm:{histogram}_seconds_count")
    return metric_delta(after, before, f"vllm:{histogram}_seconds_sum") / count if count else None


# --- bound from per-phase costs ------------------------------------------------------
@dataclass(frozen=True)
class PhaseCosts:
    """Unloaded costs of one system at one context length, measured one request at a time.

    first_s:    time to first token of one agent over a fresh context (the full prefill path)
    marginal_s: time to first token of one more agent over a context already prefilled
                (system a: prefix-cache hit on the base + KV load; b and c: no cross-model
                sharing, so a fresh prefill again: equals first_s)
    decode_s:   generation time of the O output tokens after the first, one agent alone
    """

    first_s: float
    marginal_s: float
    decode_s: float

    def work(self, n: int) -> float:
        """Serial seconds of one round of an n-agent fan-out, if every phase ran alone."""
        return self.first_s + (n - 1) * self.marginal_s + n * self.decode_s


def throughput_bound(costs: dict[str, PhaseCosts], n: int, baseline: str, subject: str = "a") -> float | None:
    """The phase bound on max-throughput(subject) / max-throughput(baseline): serial work per round
    from the unloaded phase costs. Decode counts once per agent, as if never batched, so a system
    that batches its agents' decodes better than the baseline can exceed it; the CPU-seconds bound
    (``Comparison.cpu_bound``) is measured under load and includes batching."""
    if subject not in costs or baseline not in costs:
        return None
    return costs[baseline].work(n) / costs[subject].work(n)


def spread_verdict(lo: float | None, hi: float | None) -> str:
    """How to read a ratio with its spread over repeats."""
    if lo is None or hi is None:
        return "one run: no spread"
    if lo <= 1.0 <= hi:
        return "no measurable difference"
    return "better" if lo > 1.0 else "worse"


# --- cross-system comparison ---------------------------------------------------------
def max_sustainable(points: list[PointResult], slo_s: float) -> float | None:
    """Largest offered rate (sessions/s) whose p95 fan-out latency meets the SLO and whose
    sessions all finished; for closed-loop points, the achieved rate instead."""
    good = [p for p in points if p.ok == p.sent and p.fanout_latency["p95"] is not None
            and p.fanout_latency["p95"] <= slo_s]
    if not good:
        return None
    return max(p.load if p.mode == "rate" else p.sessions_per_s for p in good)


@dataclass
class Comparison:
    label: str
    baseline: str
    slo_s: float | None
    max_rate: dict                # system -> max sustainable sessions/s (or None), first repeat
    max_throughput: dict          # system -> best achieved sessions/s (median over repeats)
    throughput_ratio: float | None   # subject / baseline of best achieved sessions/s (median over repeats)
    throughput_bound: float | None
    p95_ratios: list              # [(load, p95(baseline)/p95(subject) median over repeats, min, max)]
    p95_at_2x_unloaded: float | None  # median ratio at the first load where baseline p95 >= 2x its unloaded p95
    system: str = "a"
    repeats: int = 1
    throughput_spread: tuple | None = None  # (min, max) of the per-repeat throughput ratios
    finished_sessions: dict = field(default_factory=dict)  # system -> finished sessions over all loads and repeats
    cpu_bound: float | None = None  # CPU s per session at max throughput, baseline / subject: batching included

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def verdict(self) -> str:
        lo, hi = self.throughput_spread or (None, None)
        return spread_verdict(lo, hi)


def _median(xs: list[float]) -> float | None:
    import statistics

    return statistics.median(xs) if xs else None


def compare(points: list[PointResult], costs: dict[str, PhaseCosts], baseline: str, slo_s: float | None,
            subject: str = "a") -> Comparison | None:
    """``subject`` against ``baseline`` on one (N, L, R): ratios per repeat, their median and spread."""
    by = {s: sorted([p for p in points if p.system == s], key=lambda p: (p.load, p.repeat))
          for s in (subject, baseline)}
    if not by[subject] or not by[baseline]:
        return None
    p0 = by[subject][0]
    repeats = sorted({p.repeat for p in by[subject]} & {p.repeat for p in by[baseline]})

    def best(s: str, r: int) -> float | None:
        return max((p.sessions_per_s for p in by[s] if p.repeat == r), default=None)

    per_rep = [best(subject, r) / best(baseline, r) for r in repeats if best(subject, r) and best(baseline, r)]
    maxtp = {s: _median([x for r in repeats if (x := best(s, r)) is not None]) for s in by}
    at = {(p.system, p.load, p.repeat): p.fanout_latency["p95"] for s in by for p in by[s]}
    ratios = []
    for load in sorted({p.load for p in by[baseline]}):
        rs = [at[(baseline, load, r)] / at[(subject, load, r)] for r in repeats
              if at.get((baseline, load, r)) and at.get((subject, load, r))]
        if rs:
            ratios.append((load, _median(rs), min(rs), max(rs)))
    at2 = None
    base_p95 = {load: _median([x for r in repeats if (x := at.get((baseline, load, r)))])
                for load in sorted({p.load for p in by[baseline]})}
    loads = [load for load, v in base_p95.items() if v]
    if loads:
        unloaded = base_p95[loads[0]]
        for load in loads:
            if base_p95[load] >= 2 * unloaded:
                at2 = next((r[1] for r in ratios if r[0] == load), None)
                break
    def max_rate(s: str) -> float | None:  # median over repeats; a repeat with no load under the SLO counts 0
        if not slo_s:
            return None
        per = [max_sustainable([p for p in by[s] if p.repeat == r], slo_s) for r in repeats or [by[s][0].repeat]]
        return None if all(x is None for x in per) else _median([x or 0.0 for x in per])

    def cpu_at_best(s: str) -> float | None:
        """CPU s per session where the system reached its max throughput (median over repeats): at
        lighter loads the cluster's fixed background CPU is shared by fewer sessions."""
        tops = [max((p for p in by[s] if p.repeat == r), key=lambda p: p.sessions_per_s) for r in repeats]
        return _median([p.cpu_s_per_session for p in tops if p.cpu_s_per_session])

    cpu = {s: cpu_at_best(s) for s in by}
    return Comparison(
        label=p0.label, baseline=baseline, slo_s=slo_s,
        max_rate={s: max_rate(s) for s in by},
        max_throughput=maxtp, throughput_ratio=_median(per_rep),
        throughput_bound=throughput_bound(costs, p0.fanout, baseline, subject),
        p95_ratios=ratios, p95_at_2x_unloaded=at2, system=subject, repeats=len(repeats),
        throughput_spread=(min(per_rep), max(per_rep)) if len(per_rep) > 1 else None,
        finished_sessions={s: sum(p.ok for p in by[s]) for s in by},
        cpu_bound=cpu[baseline] / cpu[subject] if cpu[baseline] and cpu[subject] else None)


def compare_all(points: list[PointResult], costs: dict[str, PhaseCosts], slo_s: float | None) -> list[Comparison]:
    """Every (subject, baseline) pair of systems.PAIRS that ran."""
    out = []
    for subject, baseline in PAIRS:
        c = compare(points, costs, baseline, slo_s, subject)
        if c is not None:
            out.append(c)
    return out


# --- Markdown ------------------------------------------------------------------------
def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _table(head: str, rows: list[str]) -> str:
    """A Markdown table: the header row, its rule, the rows."""
    return "\n".join([head, "|" + "---|" * (head.count("|") - 1), *rows])


def points_table(points: list[PointResult]) -> str:
    head = ("| system | N | L | R | load | rep | ok/sent | fan-out p50/p95/p99 s | TTFT p50/p95 s | TTFT mean s client / "
            "engine | sessions/s | "
            "out tok/s | prefill tok/session | cache hit | KV needed peak MiB (pinned pool + decoders) | pool cache MiB | "
            "CPU s/session | "
            "load avg |")
    rows = []
    for p in points:
        fl, tt = p.fanout_latency, p.ttft
        load = f"{p.load:g}/s" if p.mode == "rate" else f"c={p.load:g}"
        rows.append(
            f"| {p.system} {SYSTEMS[p.system]} | {p.fanout} | {p.context_tokens} | {p.rounds} | {load} | {p.repeat} | "
            f"{p.ok}/{p.sent} | {_f(fl['p50'])}/{_f(fl['p95'])}/{_f(fl['p99'])} | {_f(tt['p50'])}/{_f(tt['p95'])} | "
            f"{_f(p.ttft_mean_s)} / {_f(p.engine_ttft_mean_s)} | "
            f"{p.sessions_per_s:.3f} | {p.output_tok_per_s:.1f} | {p.prefill_tokens_computed_per_session:.0f} | "
            f"{_f(p.cache_hit_ratio)} | {_kv_needed(p)} | {p.pool_peak_bytes / 2**20:.1f} | {_f(p.cpu_s_per_session)} | "
            f"{_f(p.loadavg, '{:.1f}')} |")
    return _table(head, rows)


def _kv_needed(p: PointResult) -> str:
    mib = 2**20
    if p.pool_pinned_peak_bytes is None:  # runs from before the pins were sampled
        return f"- (not sampled + {p.decoder_kv_peak_bytes / mib:.1f})"
    return f"{p.kv_held_peak_bytes / mib:.1f} ({p.pool_pinned_peak_bytes / mib:.1f} + {p.decoder_kv_peak_bytes / mib:.1f})"


def _spread(lo, hi) -> str:
    return "" if lo is None else f" [{lo:.2f}-{hi:.2f}]"


def comparison_table(comps: list[Comparison]) -> str:
    head = ("| point | system vs baseline | repeats, finished sessions | max throughput (sessions/s) | "
            "ratio [min-max] | reading | phase bound | ratio / phase bound | CPU-s bound | ratio / CPU-s bound | "
            "p95(base)/p95(system) per load [min-max] | at base 2x unloaded | max rate under SLO |")
    rows = []
    for c in comps:
        a, b = c.max_throughput.get(c.system), c.max_throughput.get(c.baseline)
        fracs = [c.throughput_ratio / x if c.throughput_ratio and x else None for x in (c.throughput_bound, c.cpu_bound)]
        lo, hi = c.throughput_spread or (None, None)
        p95s = ", ".join(f"{r[0]:g}: {r[1]:.2f}x" + (f"{_spread(r[2], r[3])} {_reading(r[2], r[3])}" if c.repeats > 1 else "")
                         for r in c.p95_ratios) or "-"
        fin = c.finished_sessions
        rows.append(
            f"| {c.label} | {c.system} vs {c.baseline} | {c.repeats}, {fin.get(c.system, 0)} / {fin.get(c.baseline, 0)} | "
            f"{_f(a, '{:.3f}')} / {_f(b, '{:.3f}')} | {_f(c.throughput_ratio, '{:.2f}x')}{_spread(lo, hi)} | "
            f"{c.verdict} | {_f(c.throughput_bound, '{:.2f}x')} | {_f(fracs[0], '{:.0%}')} | "
            f"{_f(c.cpu_bound, '{:.2f}x')} | {_f(fracs[1], '{:.0%}')} | {p95s} | "
            f"{_f(c.p95_at_2x_unloaded, '{:.2f}x')} | {_f(c.max_rate.get(c.system), '{:.3g}')} / "
            f"{_f(c.max_rate.get(c.baseline), '{:.3g}')} |")
    return _table(head, rows)


def _reading(lo: float, hi: float) -> str:
    """A p95 ratio's spread in words (p95(base)/p95(system): above 1 the system is faster)."""
    return {"better": "lower", "worse": "higher", "no measurable difference": "no measurable difference"}[
        spread_verdict(lo, hi)]


AGENTS_SUBJECT = "a-sf-lora"  # the agents table's ratios are each system's figure over this one's


def agents_table(points: list[PointResult]) -> str:
    """Agents with their own system prompts (--driver chat): per point, what the prefill stage computed
    per fan-out against one agent's prompt, p95 TTFT and throughput, each beside its ratio to the
    shared-first app's at the same (N, L, load, repeat)."""
    ref = {(p.key, p.load, p.repeat): p for p in points if p.system == AGENTS_SUBJECT}
    head = ("| system | N | L | load | ok/sent | prompt tok/request | base prompt tok/fan-out | ÷ one prompt | "
            "÷ shared-first | TTFT p50/p95 s | p95 ÷ shared-first | request p95 s | fan-out p95 s | sessions/s | "
            "requests/s | throughput ÷ shared-first |")
    rows = []
    for p in points:
        r = ref.get((p.key, p.load, p.repeat))
        base, one = p.base_prompt_tokens_per_session, p.prompt_tokens_per_request
        rows.append(
            f"| {p.system} {SYSTEMS[p.system]} | {p.fanout} | {p.context_tokens} | "
            f"{f'{p.load:g}/s' if p.mode == 'rate' else f'c={p.load:g}'} | {p.ok}/{p.sent} | {_f(one, '{:.0f}')} | "
            f"{_f(base, '{:.0f}')} | {_f(_ratio(base, one), '{:.2f}x')} | "
            f"{_f(_ratio(base, r and r.base_prompt_tokens_per_session), '{:.2f}x')} | "
            f"{_f(p.ttft['p50'])}/{_f(p.ttft['p95'])} | {_f(_ratio(p.ttft['p95'], r and r.ttft['p95']), '{:.2f}x')} | "
            f"{_f((p.request_latency or {}).get('p95'))} | {_f(p.fanout_latency['p95'])} | {p.sessions_per_s:.3f} | "
            f"{p.sessions_per_s * p.fanout:.3f} | {_f(_ratio(p.sessions_per_s, r and r.sessions_per_s), '{:.2f}x')} |")
    return _table(head, rows)


def _ratio(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y else None


def costs_table(costs: dict) -> str:
    """costs: {L: {system: PhaseCosts}}"""
    rows = [f"| {L} | {s} {SYSTEMS[s]} | {c.first_s:.3f} | {c.marginal_s:.3f} | {c.decode_s:.3f} |"
            for L, per in sorted(costs.items()) for s, c in sorted(per.items())]
    return _table("| L | system | first-agent TTFT s | next-agent TTFT s | decode O tokens s |", rows)
