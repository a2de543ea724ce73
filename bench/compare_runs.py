"""Ratios of `python -m bench serve` runs of two code versions, point by point (bench/compare_commits.sh).

    python bench/compare_runs.py --before R1.json R2.json --after R1.json R2.json [--labels OLD NEW]

The i-th ``--before`` run is paired with the i-th ``--after`` run (the same round, back to back on
the box); each point (system, N, L, R, load) gets AFTER / BEFORE per pair, and the table gives their
mean and range. A range that includes 1.0 reads "no change beyond noise".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# (column, how to read it from a point, whether higher is better)
METRICS = (
    ("sessions/s", lambda p: p["sessions_per_s"], True),
    ("fan-out p50", lambda p: p["fanout_latency"]["p50"], False),
    ("fan-out p95", lambda p: p["fanout_latency"]["p95"], False),
    ("TTFT p50", lambda p: p["ttft"]["p50"], False),
    ("CPU s/session", lambda p: p.get("cpu_s_per_session"), False),
)


def _points(path: str) -> dict[tuple, dict]:
    doc = json.loads(Path(path).read_text())
    return {(p["system"], p["fanout"], p["context_tokens"], p["rounds"], p["load"]): p for p in doc["points"]}


def compare(before: list[str], after: list[str]) -> list[dict]:
    """One row per point found in every run: each metric's after/before ratios over the pairs."""
    if len(before) != len(after) or not before:
        raise ValueError(f"--before and --after need the same number of runs (got {len(before)} and {len(after)})")
    pairs = [(_points(b), _points(a)) for b, a in zip(before, after, strict=True)]
    keys = sorted(set.intersection(*(set(b) & set(a) for b, a in pairs)))
    rows = []
    for key in keys:
        row: dict = {"point": key, "values": {}}
        for name, read, _ in METRICS:
            ratios, olds, news = [], [], []
            for b, a in pairs:
                old, new = read(b[key]), read(a[key])
                if old and new is not None:
                    ratios.append(new / old)
                    olds.append(old)
                    news.append(new)
            row["values"][name] = (ratios, olds, news)
        rows.append(row)
    return rows


def render(rows: list[dict], labels: tuple[str, str]) -> str:
    head = "| point | " + " | ".join(f"{n} {labels[1]} / {labels[0]}" for n, _, _ in METRICS) + " |"
    lines = [head, "|" + "---|" * (len(METRICS) + 1)]
    for row in rows:
        system, n, ctx, r, load = row["point"]
        cells = []
        for name, _, _ in METRICS:
            ratios, olds, news = row["values"][name]
            if not ratios:
                cells.append("-")
                continue
            spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
            cells.append(f"{statistics.fmean(ratios):.2f}x{spread}: {statistics.fmean(olds):.3g} -> "
                         f"{statistics.fmean(news):.3g}")
        lines.append(f"| {system} N={n} L={ctx} R={r} c={load:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", nargs="+", required=True, help="results.json of the old version, one per round")
    ap.add_argument("--after", nargs="+", required=True, help="results.json of the new version, same rounds")
    ap.add_argument("--labels", nargs=2, default=("before", "after"), help="names of the two versions")
    args = ap.parse_args(argv)
    try:
        rows = compare(args.before, args.after)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(rows, tuple(args.labels)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
