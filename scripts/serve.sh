#!/usr/bin/env bash
# Brings the default PrefillShare app (serve_config.yaml) up on this machine and says how to
# reach it. What `make serve` runs. Ctrl-C (or SIGTERM to this script) stops the app gracefully and
# the local Ray cluster it started.
#
# Auth: Ray's ports listen on every interface, so the local cluster keeps Ray's token auth
# (RAY_AUTH_MODE=token; Ray writes the token to ~/.ray/auth_token). Other shells need the same
# `export RAY_AUTH_MODE=token` before `serve status` / `serve deploy serve_config.yaml`.
# The HTTP endpoint itself is bound to 127.0.0.1 (serve_config.yaml: http_options.host).
#
# RAY_SERVE_ENABLE_DIRECT_INGRESS=1 (Serve's direct ingress) also serves the Router replica on
# its own port, http_options.port + 1, which skips Serve's proxy (README "Direct ingress").
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
CONFIG="${PREFILLSHARE_SERVE_CONFIG:-serve_config.yaml}"
PY=.venv/bin/python
SERVE=.venv/bin/serve
[ -x "$SERVE" ] || { echo "no .venv: run 'make setup' (or bash scripts/setup.sh) first" >&2; exit 1; }

# Check the config and the shipped checkpoints before starting anything.
if ! "$PY" - "$CONFIG" <<'EOF'
import sys
from prefillshare.app.config import ConfigError, load_config
try:
    load_config(sys.argv[1]).check_paths()
except ConfigError as e:
    print(f"{sys.argv[1]}: {e}", file=sys.stderr)
    print("The shipped models live in checkpoints/ (see README: how to rebuild them).", file=sys.stderr)
    sys.exit(1)
EOF
then exit 1; fi

PORT=$("$PY" -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['http_options'].get('port', 8000))" "$CONFIG")
URL="http://127.0.0.1:${PORT}"
DIRECT=""
if [ "${RAY_SERVE_ENABLE_DIRECT_INGRESS:-0}" = 1 ]; then
  DIRECT_ENV=$("$PY" -m prefillshare.deployments.ray_internals direct-ingress-env "$((PORT + 1))") || exit 1
  eval "$DIRECT_ENV"
  DIRECT="http://127.0.0.1:$((PORT + 1))"
fi

# serve run in its own process group with SIGINT restored (bash ignores SIGINT in background
# jobs), so that a stop is one SIGINT from the trap below: serve run turns it into Serve's
# graceful shutdown, where each replica stops its engine (on SIGTERM serve run only exits, and
# Ray then kills the replicas without it). A stop that hangs ends with SIGKILL after 90 s: the Ray
# daemons serve run started die with it, and each engine core with its replica.
set -m
"$PY" -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])' \
  "$SERVE" run "$CONFIG" &
SERVE_PID=$!
set +m
stop() {
  kill -INT "$SERVE_PID" 2>/dev/null
  for _ in $(seq 1 90); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL "$SERVE_PID" 2>/dev/null
  wait "$SERVE_PID" 2>/dev/null
  # a replica Serve had to kill never released the KV pool: remove its folder if nothing owns it
  "$PY" -m prefillshare.app.cli pool-reclaim "$CONFIG" >&2
}
trap 'stop; exit 130' INT TERM HUP  # serve run is in its own process group: stop it on any of these

echo "starting the app (engines take 1-3 minutes on 2 cores); waiting for ${URL}/ready ..." >&2
for _ in $(seq 1 300); do
  if ! kill -0 "$SERVE_PID" 2>/dev/null; then echo "serve run exited before the app was ready" >&2; exit 1; fi
  if curl -fsS "${URL}/ready" >/dev/null 2>&1 && { [ -z "$DIRECT" ] || curl -fsS "${DIRECT}/ready" >/dev/null 2>&1; }; then
    cat <<EOM

PrefillShare is ready at ${URL}
  models:   curl ${URL}/v1/models
  complete: curl ${URL}/v1/completions -H 'Content-Type: application/json' \\
              -d '{"model": "lookup", "prompt": "order\\ncity: porto\\nday: wed\\nQ: what is the\\ncity", "max_tokens": 8}'
  fan-out:  curl ${URL}/v1/agents/run -H 'Content-Type: application/json' \\
              -d '{"context": "order\\ncity: porto\\nday: wed\\nqty: 4\\nitem: lamp", "agents": [
                   {"model": "lookup", "instruction": "Q: what is the\\ncity"},
                   {"model": "tool_call", "instruction": "Q: call the shipping tool.\\ntool"},
                   {"model": "reschedule", "instruction": "Q: move the delivery one day later. which\\nday"}]}'
  metrics:  curl ${URL}/metrics      status: RAY_AUTH_MODE=token .venv/bin/serve status
  OpenAI SDK: OpenAI(base_url="${URL}/v1", api_key="unused")
EOM
    [ -n "$DIRECT" ] && echo "  direct:   ${DIRECT} (the same routes on the Router's own port: no proxy hop)"
    cat <<EOM
Ctrl-C stops it. See docs/serving.md.
EOM
    wait "$SERVE_PID"
    exit $?
  fi
  sleep 2
done
echo "the app did not become ready in 10 minutes; see the log above" >&2
stop
exit 1
