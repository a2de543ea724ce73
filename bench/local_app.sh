# Sourced by bench/overload_run.sh and bench/burst_run.sh (after their netns re-exec): serve the
# app of $CONFIG on loopback port 8000 until /ready, and stop it again leaving nothing behind.
# Uses $PY, $CONFIG and $OUT; sets SERVE_PID and SHM_BEFORE.

local_app_start() {
  SHM_BEFORE=$(ls /dev/shm | sort)
  # serve run in its own process group with SIGINT restored (a background job ignores it), so
  # the stop is Serve's graceful shutdown, as in scripts/serve.sh
  set -m
  "$PY" -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])' \
    .venv/bin/serve run "$CONFIG" >"$OUT/serve.log" 2>&1 &
  SERVE_PID=$!
  set +m
  for _ in $(seq 1 300); do
    "$PY" -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=10).status == 200 else 1)" 2>/dev/null && break
    sleep 2
  done
  echo "app ready at $(date -u +%T); load average: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/run.log"
}

# Serve's graceful stop (as Ctrl-C; an engine replica may take limits.request_timeout_s to drain),
# then the pool folder of owners that were all killed (as scripts/serve.sh), then what is left.
local_app_stop() {
  kill -INT "$SERVE_PID" 2>/dev/null
  for _ in $(seq 1 150); do kill -0 "$SERVE_PID" 2>/dev/null || break; sleep 1; done
  kill -0 "$SERVE_PID" 2>/dev/null && echo "serve run did not stop in 150 s: SIGKILL" | tee -a "$OUT/run.log"
  kill -KILL -- "-$SERVE_PID" 2>/dev/null
  wait "$SERVE_PID" 2>/dev/null
  sleep 5
  local left
  left=$(comm -13 <(echo "$SHM_BEFORE") <(ls /dev/shm | sort))
  echo "/dev/shm entries left after the stop: ${left:-none}" | tee -a "$OUT/run.log"
  "$PY" -m prefillshare.app.cli pool-reclaim "$CONFIG" 2>&1 | tee -a "$OUT/run.log"
  left=$(comm -13 <(echo "$SHM_BEFORE") <(ls /dev/shm | sort))
  echo "/dev/shm entries left after pool-reclaim: ${left:-none}" | tee -a "$OUT/run.log"
  rm -rf "$RAY_TMPDIR"
}
