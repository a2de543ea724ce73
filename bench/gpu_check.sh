#!/usr/bin/env bash
# PrefillShare's GPU path on one CUDA GPU, in one call of at most 7.5 minutes: the vllm-nixl hand-over
# with the app's own NIXL settings and in-engine LoRA decoders (bench/gpu_check.py has the steps). Installs nothing.
#   bash bench/gpu_check.sh --out DIR                        # every step; DIR/gpu_check.json
#   bash bench/gpu_check.sh --steps env,transport --out DIR  # torch only (no vLLM needed)
#   bash bench/gpu_check.sh --device cpu --steps env,tokens,lora,speed   # the CPU dry run (CI)
# On the lent box (torch, no vLLM, no network) the payload of bench/gpu_payload.sh comes first:
# PAYLOAD=/tmp/p (a folder holding its part.* chunks) unpacks it to /tmp/site and puts it on PYTHONPATH.
# Time limits: 45 s to unpack + 405 s for the steps (their own limits add up to 400 s) = 450 s.
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
# The project as prefillshare.* without installing it (the lent box has no pip access to it): a folder of
# links on PYTHONPATH, with the distribution's entry point so vLLM loads the project's plugin
# (app/engine/vllm_plugin.py: in-engine LoRA decoders) in every engine process.
if ! "$PY" -c 'import prefillshare.app' 2>/dev/null; then
  links="$(mktemp -d /tmp/ps-src.XXXX)"
  mkdir -p "$links/prefillshare" "$links/prefillshare-0.1.0.dist-info"
  for d in app deployments agents; do ln -s "$PWD/$d" "$links/prefillshare/$d"; done
  printf 'Metadata-Version: 2.1\nName: prefillshare\nVersion: 0.1.0\n' > "$links/prefillshare-0.1.0.dist-info/METADATA"
  sed -n '/^\[project.entry-points."vllm.general_plugins"\]/,/^$/p' pyproject.toml \
    | sed 's/^\[project.entry-points."vllm.general_plugins"\]/[vllm.general_plugins]/; s/"//g' \
    > "$links/prefillshare-0.1.0.dist-info/entry_points.txt"
  export PYTHONPATH="$links:$PYTHONPATH"
fi
if [[ " $* " != *" --device cpu "* ]]; then
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)'; then
    echo "GPU CHECK NOT RUN: this box lacks a CUDA GPU or torch with CUDA."
    exit 2
  fi
fi
exec timeout 405 "$PY" bench/gpu_check.py "$@"
