#!/usr/bin/env bash
# A killed decoder's restart under load, with and without engine.serving_niceness, side by side
# (scripts/restart_under_load.py), in a loopback-only network namespace as the overload runs.
#   bash scripts/restart_under_load.sh [OUT_DIR] [--rate 20] [--repeats 1] [--arms 19,0]
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PREFILLSHARE_NETNS:-}" ] && [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then
  PREFILLSHARE_NETNS=1 exec unshare -n bash -c 'ip link set lo up && exec "$0" "$@"' "$0" "$@"
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled VLLM_HOST_IP=127.0.0.1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python scripts/restart_under_load.py "$@"
