"""PNG plots of a serving-benchmark run (matplotlib, Agg: no display needed)."""
from __future__ import annotations

import statistics
from pathlib import Path

from bench.report import PointResult
from bench.systems import SYSTEMS

_STYLE = {"a": ("tab:green", "o"), "b": ("tab:red", "s"), "c": ("tab:blue", "^"),
          "a-lora": ("darkgreen", "P"), "b-lora": ("darkred", "X"), "c-lora": ("navy", "v"),
          "a-sf-lora": ("limegreen", "h"), "a-sys-lora": ("olive", "p"),
          "i-lora": ("magenta", "d"), "v-lora": ("darkorange", "D"), "v-one": ("grey", "*")}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: str | Path, title: str, panels: int) -> Path:
    if title:
        import textwrap

        fig.suptitle("\n".join(textwrap.wrap(title, 48 * panels)), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(ax, xlabel: str, ylabel: str, title: str) -> None:
    """One panel's axes, title, grid and legend, the same in every serve plot."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _median_with_range(ax, xs: list[float], ys: list[list[float]], system: str) -> None:
    """One system's line: the median over repeats at each x, the min-max as an error bar."""
    mid = [statistics.median(y) for y in ys]
    c, m = _STYLE[system]
    ax.errorbar(xs, mid, yerr=[[a - min(y) for a, y in zip(mid, ys)], [max(y) - a for a, y in zip(mid, ys)]],
                marker=m, color=c, capsize=3, label=f"{system} {SYSTEMS[system]}")


def _load_axis(mode: str) -> str:
    return "offered load (sessions/s)" if mode == "rate" else "concurrent sessions"


def p95_vs_load(points: list[PointResult], path: str | Path, title: str = "") -> Path:
    """One panel per (N, L, R): p95 fan-out latency against offered load, a line per system."""
    plt = _plt()
    groups = sorted({p.key for p in points})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, key in zip(axes[0], groups):
        here = [p for p in points if p.key == key]
        for s in SYSTEMS:
            ps = [p for p in here if p.system == s and p.fanout_latency["p95"] is not None]
            if ps:
                loads = sorted({p.load for p in ps})
                _median_with_range(ax, loads, [[p.fanout_latency["p95"] for p in ps if p.load == x] for x in loads], s)
        _label(ax, _load_axis(here[0].mode), "p95 fan-out latency (s)", here[0].label)
    return _save(plt, fig, path, title, len(groups))


def throughput_vs_n(points: list[PointResult], path: str | Path, title: str = "") -> Path:
    """Best achieved output tokens/s against fan-out N, one panel per (L, R), a line per system."""
    plt = _plt()
    groups = sorted({(p.context_tokens, p.rounds) for p in points})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, (L, R) in zip(axes[0], groups):
        for s in SYSTEMS:
            ns = sorted({p.fanout for p in points if (p.system, p.context_tokens, p.rounds) == (s, L, R)})
            best = [max(p.output_tok_per_s for p in points
                        if (p.system, p.fanout, p.context_tokens, p.rounds) == (s, n, L, R)) for n in ns]
            if ns:
                c, m = _STYLE[s]
                ax.plot(ns, best, marker=m, color=c, label=f"{s} {SYSTEMS[s]}")
        _label(ax, "fan-out N (decoders per round)", "best output tokens/s", f"L={L} R={R}")
    return _save(plt, fig, path, title, len(groups))


def throughput_vs_load(points: list[PointResult], path: str | Path, title: str = "") -> Path:
    """Achieved sessions/s against offered load, one panel per (N, L, R), a line per system.

    Where a system's line leaves the dashed "offered" diagonal (Poisson rates) or flattens
    (concurrency), it has saturated; the median over repeats is drawn, the min-max as a bar."""
    plt = _plt()
    groups = sorted({p.key for p in points})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, key in zip(axes[0], groups):
        here = [p for p in points if p.key == key]
        if here[0].mode == "rate":
            loads = sorted({p.load for p in here})
            ax.plot(loads, loads, linestyle="--", color="grey", linewidth=1, label="offered")
        for s in SYSTEMS:
            xs = sorted({p.load for p in here if p.system == s})
            if xs:
                _median_with_range(ax, xs, [[p.sessions_per_s for p in here if p.system == s and p.load == x]
                                            for x in xs], s)
        _label(ax, _load_axis(here[0].mode), "achieved sessions/s", here[0].label)
    return _save(plt, fig, path, title, len(groups))


def agents_bars(points: list[PointResult], path: str | Path, title: str = "") -> Path:
    """--driver chat: per point (system, load, repeat), bars of the prefill stage's prompt tokens per
    fan-out, p95 TTFT beside p95 request latency, and requests/s."""
    plt = _plt()
    pts = [p for p in points if p.base_prompt_tokens_per_session is not None]
    names = [f"{p.system}\n{p.load:g}{'/s' if p.mode == 'rate' else ' sess.'}" for p in pts]
    colors = [_STYLE[p.system][0] for p in pts]
    x = list(range(len(pts)))
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(12, 3.8))
    a1.bar(x, [p.base_prompt_tokens_per_session for p in pts], color=colors)
    a2.bar([i - 0.2 for i in x], [p.ttft["p95"] or 0 for p in pts], width=0.4, color=colors, label="TTFT p95")
    a2.bar([i + 0.2 for i in x], [(p.request_latency or {}).get("p95") or 0 for p in pts], width=0.4, color=colors,
           alpha=0.45, hatch="//", label="request p95")
    a3.bar(x, [p.sessions_per_s * p.fanout for p in pts], color=colors)
    for ax, ylabel in ((a1, "base prompt tokens per fan-out"), (a2, "seconds"), (a3, "requests/s")):
        ax.set_xticks(x, names, fontsize=7)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
    a2.legend(fontsize=7)
    return _save(plt, fig, path, title, 3)


def engine_prompt_time(results: list[dict], path: str | Path, title: str = "") -> Path:
    """`bench engine`: a decoder's prompt time against L, private prefill vs the base's KV, per N;
    and the fan-out's total CPU seconds both ways."""
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for n in sorted({r["fanout"] for r in results}):
        rs = sorted((r for r in results if r["fanout"] == n), key=lambda r: r["prompt_tokens"])
        L = [r["prompt_tokens"] for r in rs]
        ax.plot(L, [r["private_prompt_s"] * 1e3 for r in rs], marker="s", color="tab:red", alpha=0.4 + 0.075 * n,
                label=f"private prefill, N={n}")
        ax.plot(L, [r["shared_prompt_s"] * 1e3 for r in rs], marker="o", color="tab:green", alpha=0.4 + 0.075 * n,
                label=f"base KV loaded, N={n}")
        ax2.plot(L, [r["cpu_s_private"] / max(r["cpu_s_shared"], 1e-9) for r in rs], marker="o", label=f"N={n}")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens L")
    ax.set_ylabel("decoder prompt time (ms, log)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    ax2.set_xlabel("prompt tokens L")
    ax2.set_ylabel("fan-out CPU s: private / shared")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    return _save(plt, fig, path, title, 2)
