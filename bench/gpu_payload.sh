#!/usr/bin/env bash
# Builds what a bare CUDA box (torch 2.11+cu130, python 3.12, no vLLM, no network) needs to run
# bench/gpu_check.sh: vllm 0.26.0 (the CUDA build that pins torch 2.11; the pinned 0.32 needs torch
# 2.13), stripped of kernels the check never loads, its missing pure-Python dependencies, and
# nixl-cu13. Needs PyPI.
#   bash bench/gpu_payload.sh [OUTDIR] [CHUNK_MIB]       # default .gpu, chunk: what fits (below)
# Writes OUTDIR/payload.tar.xz split into OUTDIR0, OUTDIR1, ... (one chunk per folder). A device call
# carries the working tree (tracked and untracked files git does not ignore) plus what it is told to
# carry, at most 64 MiB in all; so the default chunk is 60 MiB less the tree, and the script refuses a
# chunk that would not fit. One call per folder copies its part.* to /tmp/p on the box; the last one runs
#   PAYLOAD=/tmp/p bash bench/gpu_check.sh --out $OUT
# (calls must follow each other within the box's idle window, or /tmp is lost with the machine).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.gpu}"
tree_mib=$(( ( $( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null \
             | awk '$2 == "total" {s += $1} END {print s + 0}') + 1048575 ) / 1048576 ))
room=$(( 60 - tree_mib ))
chunk="${2:-$room}"
if [ "$chunk" -lt 1 ] || [ "$chunk" -gt "$room" ]; then
  echo "chunk ${chunk} MiB does not fit beside the ${tree_mib} MiB working tree under the 64 MiB carry limit" >&2
  exit 1
fi
echo "working tree ${tree_mib} MiB: chunks of ${chunk} MiB"
work="$(mktemp -d /tmp/gpu-payload.XXXX)"; site="$work/site"; mkdir -p "$site" "$work/whl"
pip=(.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp -d "$work/whl" --platform any --platform manylinux1_x86_64
     --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64
     --platform manylinux_2_31_x86_64)
# vLLM 0.26's requirements that the box's image lacks and that the engine path imports
# (found by running it there; flashinfer is left out on purpose: without it vLLM samples natively
# instead of JIT-compiling kernels at start).
deps=(vllm==0.26.0 nixl==1.5.1 nixl-cu13==1.5.1 blake3 cachetools "fastapi<0.137" "starlette>=1.0.1"
      openai httpx2 httpcore2 truststore pydantic pydantic-core annotated-types typing-inspection msgspec
      pyzmq cbor2 partial-json-parser setproctitle pybase64 ijson python-json-logger watchfiles
      compressed-tensors==0.17.0 depyf==0.20.0 astor dill lark==1.2.2 outlines_core==0.2.14
      "llguidance<1.8,>=1.7" "xgrammar<1.0" apache-tvm-ffi==0.1.11 lm-format-enforcer==0.11.3 interegular
      jsonschema jsonschema-specifications referencing rpds-py prometheus-fastapi-instrumentator distro
      jiter sniffio gguf diskcache openai-harmony "mistral_common>=1.11.5" pydantic-extra-types pycountry
      anthropic docstring-parser mcp mcp-types httpx-sse sse-starlette pydantic-settings python-multipart
      python-dotenv uvicorn model-hosting-container-standards opentelemetry-api opentelemetry-sdk
      opentelemetry-semantic-conventions opentelemetry-semantic-conventions-ai importlib-metadata
      email-validator dnspython websockets httptools pyjwt tzdata lazy-importer jmespath supervisor loguru)
echo "downloading ${#deps[@]} wheels ..."
"${pip[@]}" "${deps[@]}"
# pydantic pins its core exactly: fetch the matching one if the newest differs
core=$(unzip -p "$work"/whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==//p')
rm -f "$work"/whl/pydantic_core-*.whl && "${pip[@]}" "pydantic-core==$core"
for w in "$work"/whl/*.whl; do .venv/bin/python -m zipfile -e "$w" "$site"; done
# kernels the check never loads on a Hopper GPU (FA3 is used), each 30-290 MiB
rm -rf "$site"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$site"/vllm/_moe_C_stable_libtorch.abi3.so \
       "$site"/vllm/vllm-rs "$site"/vllm/third_party/fmha_sm100 "$site"/nixl_ep*
find "$site"/vllm/third_party/deep_gemm -name '_C.cpython-3*' ! -name '*-312-*' -delete
echo "packing $(du -sh "$site" | cut -f1) ..."
mkdir -p "$out"
tar -cf - -C "$site" . | xz -T0 -6 > "$out/payload.tar.xz"
(cd "$out" && split -b "${chunk}M" -d -a 2 payload.tar.xz part.)
for p in "$out"/part.*; do i="${p##*.}"; mkdir -p "$out$i"; mv "$p" "$out$i/"; done
rm -f "$out/payload.tar.xz"; rmdir "$out" 2>/dev/null || true; rm -rf "$work"
ls -d "$out"?* | sed 's/^/chunk folder: /'
