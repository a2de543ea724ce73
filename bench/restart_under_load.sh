#!/usr/bin/env bash
# A killed decoder's restart under load, with and without engine.serving_niceness, side by side
# (bench/restart_under_load.py), in a loopback-only network namespace as the overload runs.
#   bash bench/restart_under_load.sh [OUT_DIR] [--rate 20] [--repeats 1] [--arms 19,0]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/netns.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled VLLM_HOST_IP=127.0.0.1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m bench.restart_under_load "$@"
