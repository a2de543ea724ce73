#!/usr/bin/env bash
# The multi-node overload run (bench/overload_multinode.py: three raylets on this machine, KV over
# NIXL, a stalled NIXL peer among the faults) in a loopback-only network namespace, as
# bench/overload_run.sh runs the single-node one.
#   bash bench/overload_multinode.sh [OUT_DIR] [DURATION_S]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/netns.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled VLLM_HOST_IP=127.0.0.1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m bench.overload_multinode "${1:-runs/overload_multinode}" "${2:-600}"
