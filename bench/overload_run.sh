#!/usr/bin/env bash
# The 10-minute overload run of docs/reliability.md "Overload and faults", in one command:
# serves a variant of the default app that fits this 2-core box (the base prefill module with
# its in-engine chat adapters, decoders lookup and route, and a LoRA decode group of two chat
# adapters), REPLICAS replicas of every deployment on the request path, on a private
# loopback-only Ray cluster; runs `python -m bench overload` at 2x the searched saturation rate
# with the faults below, judged against the app's admission target; then stops the app and
# checks that nothing it started is left (processes, /dev/shm).
#   bash bench/overload_run.sh [OUT_DIR] [DURATION_S] [REPLICAS] [RATE]
# (REPLICAS: 2 by default; RATE: arrivals/s, skipping the saturation search, e.g. to compare two
# commits at one load: the search's reading varies by ~30% between runs on this box)
# Needs root for the network namespace (as scripts/test.sh); ~17 minutes on 2 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/overload}"
DURATION="${2:-600}"
REPLICAS="${3:-2}"
RATE="${4:-}"
source scripts/netns.sh
source bench/local_app.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled VLLM_HOST_IP=127.0.0.1
export RAY_TMPDIR="/tmp/ps-overload-$$"
PY=.venv/bin/python
mkdir -p "$OUT"
CONFIG="$OUT/serve_config.yaml"
POOL=/dev/shm/prefillshare-overload-$$
"$PY" - "$CONFIG" "$POOL" "$REPLICAS" <<'EOF'
import sys, yaml
cfg = yaml.safe_load(open("serve_config.yaml"))
app = cfg["applications"][0]
c = app["args"]["config"]
c["pool"]["path"] = sys.argv[2]
replicas = int(sys.argv[3])
keep = ("lookup", "route")  # 2 of the 4 full decoders: 8 engines at 2 replicas fit 24 GiB
c["decoders"] = [d for d in c["decoders"] if d["name"] in keep]
engine, placement = c["decoders"][0]["engine"], dict(c["decoders"][0]["placement"])
c["decoders"].append({"name": "chat-group", "model": "checkpoints/base", "max_lora_rank": 8, "max_loras": 2,
                      "adapters": [{"name": f"group-{n}", "path": f"checkpoints/chat/adapters/{n}", "rank": 8}
                                   for n in ("tool_call", "reschedule")],
                      "placement": placement, "engine": engine})
# Ray's CPU bookkeeping of the 2 cores: 2 prefill + 6 decode replicas, the small deployments and
# Serve's proxy must fit (their engines share the real cores whatever they are given)
for d in c["prefill_modules"]:
    d["placement"] = {**d["placement"], "num_replicas": replicas, "num_cpus": 0.5 / replicas}
for d in c["decoders"]:  # a fixed fleet: the faults, not the autoscaler, change it
    d["placement"] = {**{k: v for k, v in d["placement"].items() if k != "autoscaling"}, "num_replicas": replicas,
                      "num_cpus": 0.25 / replicas, "placement_group_bundles": [{"CPU": 0.25 / replicas}]}
# the load generator stamps X-Request-Start as a front proxy would: admission judges from the send
c["limits"]["request_start_header"] = "x-request-start"
# a Router starts admitting 4 at once and doubles while answers are in time (slow start): at twice
# saturation, starting at the bound (64), or at 16, admitted a burst whose first minute was past the
# target (the bound settles at 3-6 per Router here)
c["limits"]["initial_inflight_requests"] = 4
for small in ("router", "orchestrator"):
    c[small] = {**c.get(small, {}), "num_replicas": replicas}
yaml.safe_dump(cfg, open(sys.argv[1], "w"), sort_keys=False)
EOF
APP=$("$PY" -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['applications'][0]['name'])" "$CONFIG")
local_app_start
t=$((DURATION / 6))
TARGET=$("$PY" -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['applications'][0]['args']['config']['limits']['admission_target_s'])" "$CONFIG")
echo "replicas per deployment: $REPLICAS; admission target: $TARGET s" | tee -a "$OUT/run.log"
.venv/bin/python -m bench overload --url http://127.0.0.1:8000 --app "$APP" --duration "$DURATION" --out "$OUT" \
  --target "$TARGET" ${RATE:+--rate "$RATE"} \
  --fault "$((t * 1)):kill:Prefill-base" --fault "$((t * 2)):kill:Decode-lookup" \
  --fault "$((t * 3)):kill:Decode-chat-group" --fault "$((t * 4)):kill:Orchestrator" \
  --fault "$((t * 5)):fill-pool:$POOL:30" 2>&1 | tee -a "$OUT/run.log"
rc=${PIPESTATUS[0]}
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/run.log"
local_app_stop
exit "$rc"
