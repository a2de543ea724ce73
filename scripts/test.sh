#!/usr/bin/env bash
# Runs the test suite inside a loopback-only network namespace (Ray and vLLM listen on all
# interfaces; the namespace keeps every test server unreachable from outside).
# pytest exit 5 (no tests collected) is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" VLLM_HOST_IP=127.0.0.1
run_pytest() { .venv/bin/python -m pytest "$@"; }
# Lint first (ruff: pyproject's [tool.ruff]); a lint error fails the run before any engine starts.
if [ -z "${PREFILLSHARE_NETNS:-}" ]; then
  .venv/bin/ruff check . || { echo "ruff found problems (fix them or run: .venv/bin/ruff check --fix .)" >&2; exit 1; }
fi
source scripts/netns.sh
run_pytest "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "no tests were collected: failing" >&2; exit 1; fi
exit $rc
