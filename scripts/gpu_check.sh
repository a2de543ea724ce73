#!/usr/bin/env bash
# PrefillShare on one CUDA GPU: KV transport speed, decoder speed-up, token equality, and the
# vllm-nixl hand-over (vLLM's NixlConnector between two engine processes: step 5).
# Installs nothing. Step 1 needs only torch with CUDA; steps 2, 3 and 5 need vllm (CUDA build) and
# transformers, step 5 also the nixl wheels. Without vllm only step 1 runs. Exits 2 without a GPU.
#   bash scripts/gpu_check.sh                 # steps 1,5,3,2, bounded to 8 minutes (per-step limits inside)
#   bash scripts/gpu_check.sh --steps 1       # the torch-only transport microbenchmark (~1 minute)
#   bash scripts/gpu_check.sh --device cpu --steps 1   # the same step at toy sizes on the CPU (CI runs this)
#   bash scripts/gpu_check.sh --device cpu --steps 5   # the vllm-nixl step on the CPU (CI runs this, ~100 s)
# Figures as JSON in $OUT/gpu_check.json when OUT is set (or --out DIR).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== environment"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  || echo "nvidia-smi: not found"
"$PY" - <<'PYEOF'
import importlib, sys
have = {}
for mod in ("torch", "vllm", "transformers", "nixl._api"):
    try:
        m = importlib.import_module(mod)
        have[mod] = True
        print(f"{mod:14s} {getattr(m, '__version__', 'ok')}")
    except Exception as e:  # noqa: BLE001
        have[mod] = False
        print(f"{mod:14s} MISSING ({type(e).__name__}: {e})")
cuda = False
try:
    import torch
    cuda = torch.cuda.is_available()
    print("cuda available:", cuda, torch.version.cuda)
except Exception as e:  # noqa: BLE001
    print("cannot query CUDA:", e)
if not cuda:
    sys.exit(2)
if not (have["vllm"] and have["transformers"]):
    sys.exit(3)  # torch-only box: step 1
try:
    from vllm.platforms import current_platform
    print("vllm platform:", current_platform.device_type)
    sys.exit(0 if current_platform.device_type == "cuda" else 3)
except Exception as e:  # noqa: BLE001
    print("cannot query the vLLM platform:", e); sys.exit(3)
PYEOF
rc=$?
args=("$@")
if [[ " $* " != *" --device cpu "* ]]; then
  if [ $rc -eq 2 ]; then
    echo "GPU CHECK NOT RUN: this box lacks a CUDA GPU or torch with CUDA (see above)."
    exit 2
  fi
  if [ $rc -eq 3 ] && [[ " $* " != *" --steps "* ]]; then
    echo "no CUDA build of vllm here: running step 1 (torch only)"
    args+=(--steps 1)
  fi
fi
exec timeout 480 "$PY" scripts/gpu_check.py "${args[@]}"
