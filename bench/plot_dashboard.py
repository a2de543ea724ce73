"""Plot the Grafana dashboard's panels from /metrics scrapes of a running app, where Grafana is
not at hand: each panel's PromQL (k8s/chart/dashboards/prefillshare.json) evaluated on the
scrapes by a small evaluator of the forms the dashboard uses: ``rate``, ``sum by`` / ``max by``,
``histogram_quantile`` over summed bucket rates, and the ratio of two such expressions.

    python -m bench.plot_dashboard --url http://127.0.0.1:8000 --seconds 120 --out docs/img/dashboard.png
"""
from __future__ import annotations

import argparse
import json
import math
import re
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent.parent / "k8s" / "chart" / "dashboards" / "prefillshare.json"
Series = dict[tuple[tuple[str, str], ...], float]  # labels -> value


def parse(text: str) -> dict[str, Series]:
    """Prometheus text -> {sample name: {labels: value}}."""
    out: dict[str, Series] = defaultdict(dict)
    for line in text.splitlines():
        m = re.match(r"([^{ ]+)(?:\{(.*)\})? (\S+)$", line)
        if m and not line.startswith("#"):
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            out[m.group(1)][labels] = float(m.group(3))
    return out


def scrape(url: str) -> tuple[float, dict[str, Series]]:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=30) as r:
        return time.time(), parse(r.read().decode())


def _select(series: Series, selector: str) -> Series:
    want = re.findall(r'(\w+)=~?"([^"]*)"', selector or "")
    return {k: v for k, v in series.items()
            if all(re.fullmatch(pat.replace("$decoder", ".*"), dict(k).get(name, "")) for name, pat in want)}


def _group(series: Series, by: list[str], agg=sum) -> Series:
    groups: dict[tuple, list[float]] = defaultdict(list)
    for k, v in series.items():
        d = dict(k)
        groups[tuple((b, d.get(b, "")) for b in by)].append(v)
    return {g: agg(vs) for g, vs in groups.items()}


def _quantile(q: float, buckets: Series, by: list[str]) -> Series:
    groups: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for k, v in buckets.items():
        d = dict(k)
        groups[tuple((b, d.get(b, "")) for b in by if b != "le")].append((float(d["le"]), v))
    out = {}
    for g, pts in groups.items():
        pts.sort()
        total = pts[-1][1]
        if total <= 0:
            continue
        prev_le, prev_c = 0.0, 0.0
        for le, c in pts:
            if c >= q * total:
                if math.isinf(le):
                    out[g] = prev_le
                else:
                    out[g] = prev_le + (le - prev_le) * ((q * total - prev_c) / (c - prev_c) if c > prev_c else 0)
                break
            prev_le, prev_c = le, c
    return out


def evaluate(expr: str, a: tuple[float, dict], b: tuple[float, dict]) -> Series:
    """``expr`` at scrape ``b``, rates over the window since scrape ``a``."""
    expr = expr.strip()
    if " / " in expr:
        num, den = (evaluate(x, a, b) for x in expr.split(" / ", 1))
        return {k: v / den[k] for k, v in num.items() if den.get(k)}
    m = re.fullmatch(r"histogram_quantile\(([\d.]+), sum by \(([^)]*)\) \((.*)\)\)", expr)
    if m:
        by = [x.strip() for x in m.group(2).split(",")]
        return _quantile(float(m.group(1)), _group(evaluate(m.group(3), a, b), by), by)
    m = re.fullmatch(r"(sum|max) by \(([^)]*)\) \((.*)\)", expr)
    if m:
        return _group(evaluate(m.group(3), a, b), [x.strip() for x in m.group(2).split(",")],
                      sum if m.group(1) == "sum" else max)
    m = re.fullmatch(r"rate\(([^{\[]+)(\{[^}]*\})?\[[^\]]*\]\)", expr)
    if m:
        (ta, sa), (tb, sb) = a, b
        now, then = _select(sb.get(m.group(1), {}), m.group(2)), sa.get(m.group(1), {})
        return {k: max(v - then.get(k, 0.0), 0.0) / (tb - ta) for k, v in now.items()}
    m = re.fullmatch(r"([^{\[ ]+)(\{[^}]*\})?", expr)
    if m:
        return _select(b[1].get(m.group(1), {}), m.group(2))
    raise ValueError(f"not a form this evaluator knows: {expr}")


def _legend(fmt: str, labels: tuple) -> str:
    return re.sub(r"\{\{(\w+)\}\}", lambda m: dict(labels).get(m.group(1), ""), fmt)


def plot(scrapes: list[tuple[float, dict]], out: str, window: int = 3) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    fig, axes = plt.subplots((len(panels) + 1) // 2, 2, figsize=(14, 3.2 * ((len(panels) + 1) // 2)))
    t0 = scrapes[0][0]
    for ax, p in zip(axes.flat, panels):
        for t in p["targets"]:
            lines: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
            for i in range(window, len(scrapes)):
                for labels, v in evaluate(t["expr"], scrapes[i - window], scrapes[i]).items():
                    xs, ys = lines[_legend(t["legendFormat"], labels)]
                    xs.append(scrapes[i][0] - t0)
                    ys.append(v)
            for name, (xs, ys) in sorted(lines.items()):
                ax.plot(xs, ys, label=name, linewidth=1.2)
        ax.set_title(p["title"], fontsize=10)
        ax.set_xlabel("s", fontsize=8)
        ax.set_ylabel(p["fieldConfig"]["defaults"]["unit"], fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("PrefillShare dashboard panels, from /metrics scrapes of a real run", fontsize=12)
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--out", default="docs/img/dashboard.png")
    args = ap.parse_args()
    scrapes = []
    end = time.time() + args.seconds
    while time.time() < end:
        scrapes.append(scrape(args.url))
        time.sleep(args.interval)
    plot(scrapes, args.out)


if __name__ == "__main__":
    main()
