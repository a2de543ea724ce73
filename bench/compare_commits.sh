#!/usr/bin/env bash
# A speed check of a change: `python -m bench serve` on two commits, alternating, on this box.
#
#   bash bench/compare_commits.sh OUT BEFORE AFTER ROUNDS -- <bench serve arguments>
#
# Each commit is checked out as a git worktree under OUT and imported from there (links to its app/,
# deployments/ and agents/ at its root, first on the driver's and the Ray workers' PYTHONPATH as
# prefillshare.*; its own bench/), with this checkout's virtualenv. Round k runs BEFORE then AFTER, round k+1 the other way round, so a drift
# of the box's load hits both alike. Then bench/compare_runs.py prints each point's ratios
# (AFTER over BEFORE) with their spread over the rounds. Runs inside a loopback-only network
# namespace when `unshare -n` is allowed (no port of the box is touched).
set -euo pipefail
if [ $# -lt 5 ] || [ "$5" != "--" ]; then
  echo "usage: bash bench/compare_commits.sh OUT BEFORE AFTER ROUNDS -- <bench serve arguments>" >&2
  exit 2
fi
out=$(realpath -m "$1"); before=$2; after=$3; rounds=$4; shift 5
root=$(cd "$(dirname "$0")/.." && pwd)
py="$root/.venv/bin/python"
mkdir -p "$out"

prepare() {  # a worktree of commit $1 at $out/$2, with a prefillshare/ of links at its root
  local ref=$1 name=$2
  if [ ! -d "$out/$name/tree" ]; then
    git -C "$root" worktree add --detach -f "$out/$name/tree" "$ref" >/dev/null
  fi
  # the bench puts its tree's root on the Ray workers' PYTHONPATH: prefillshare.* resolves here first
  mkdir -p "$out/$name/tree/prefillshare"
  for pkg in app deployments agents; do
    ln -sfn "$out/$name/tree/$pkg" "$out/$name/tree/prefillshare/$pkg"
  done
}

run_one() {  # commit name, round, bench serve arguments
  local name=$1 k=$2 tree="$out/$1/tree"
  shift 2
  local cmd="cd '$tree' && PYTHONPATH='$tree' RAY_AUTH_MODE=disabled RAY_TMPDIR=/tmp/ray-cmp-$$ \
    '$py' -m bench serve --driver vllm $* --out '$out/$name/round$k'"
  if unshare -n true 2>/dev/null; then
    unshare -n bash -c "ip link set lo up; $cmd"
  else
    bash -c "$cmd"
  fi
}

prepare "$before" before
prepare "$after" after
cleanup() {
  git -C "$root" worktree remove --force "$out/before/tree" 2>/dev/null || true
  git -C "$root" worktree remove --force "$out/after/tree" 2>/dev/null || true
}
trap cleanup EXIT

for k in $(seq 1 "$rounds"); do
  if [ $((k % 2)) -eq 1 ]; then order="before after"; else order="after before"; fi
  for name in $order; do
    echo "== round $k: $name ($(git -C "$out/$name/tree" rev-parse --short HEAD)) $(date -u +%H:%M:%S)"
    run_one "$name" "$k" "$@" 2>&1 | tail -n 30
  done
done
"$py" "$root/bench/compare_runs.py" --before "$out"/before/round*/results.json --after "$out"/after/round*/results.json \
  --labels "$(git -C "$out/before/tree" rev-parse --short HEAD)" "$(git -C "$out/after/tree" rev-parse --short HEAD)" \
  | tee "$out/comparison.md"
