#!/usr/bin/env bash
# PrefillShare's GPU path on one CUDA GPU, in one call of at most 7 minutes: the vllm-nixl hand-over
# with the app's own NIXL settings (bench/gpu_check.py has the steps). Installs nothing.
#   bash bench/gpu_check.sh --out DIR                        # every step; DIR/gpu_check.json
#   bash bench/gpu_check.sh --steps env,transport --out DIR  # torch only (no vLLM needed)
#   bash bench/gpu_check.sh --device cpu --steps env,tokens,lora,speed   # the CPU dry run (CI)
# On the lent box (torch, no vLLM, no network) the payload of bench/gpu_payload.sh comes first:
# PAYLOAD=/tmp/p (a folder holding its part.* chunks) unpacks it to /tmp/site and puts it on PYTHONPATH.
# Time limits: 45 s to unpack + 370 s for the steps (their own limits add up to 360 s) = 415 s.
# Exit: 0 pass, 1 a check failed, 2 no CUDA GPU (nothing run).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${PAYLOAD:-}" ]; then
  site=/tmp/site
  if [ ! -d "$site/vllm" ]; then
    echo "== unpacking the payload from $PAYLOAD"
    mkdir -p "$site"
    cat "$PAYLOAD"/part.* | timeout 45 tar -xJf - -C "$site" || { echo "payload: unpack failed"; exit 1; }
  fi
  export PYTHONPATH="$PYTHONPATH:$site"
  # without flashinfer (not carried) vLLM samples natively instead of JIT-compiling kernels
  export VLLM_USE_FLASHINFER_SAMPLER=0
fi
if [[ " $* " != *" --device cpu "* ]]; then
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)'; then
    echo "GPU CHECK NOT RUN: this box lacks a CUDA GPU or torch with CUDA."
    exit 2
  fi
fi
exec timeout 370 "$PY" bench/gpu_check.py "$@"
