#!/usr/bin/env bash
# Runs bench/bench_follow_on_ttft.py (the app vs stock vLLM, first-token wait of a follow-on
# completion) in a loopback-only network namespace, as scripts/test.sh runs the tests.
# Arguments go to the script (--num-prompts, --only app|vllm, --out).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" VLLM_HOST_IP=127.0.0.1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source scripts/netns.sh
exec .venv/bin/python -m bench.bench_follow_on_ttft "$@"
