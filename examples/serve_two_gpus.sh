#!/usr/bin/env bash
# Two funaudiochat-serve processes, one per GPU of this host, behind nginx on port 8080 (docs/serving.md).
#
#   MODEL=FunAudioLLM/Fun-Audio-Chat-8B DECODER=/models/Fun-CosyVoice3-0.5B-2512 bash examples/serve_two_gpus.sh
#
# Without MODEL both processes serve the tiny offline model (noise, but every path runs). Without nginx installed,
# point a client at either process (ports 8001 and 8002) or use any other HTTP load balancer.
set -euo pipefail

MODEL_ARGS=()
if [[ -n "${MODEL:-}" ]]; then MODEL_ARGS+=(--model "$MODEL"); fi
if [[ -n "${DECODER:-}" ]]; then MODEL_ARGS+=(--decoder "$DECODER"); fi
KEY_ARGS=()
if [[ -n "${API_KEY:-}" ]]; then KEY_ARGS+=(--api-key "$API_KEY"); fi
BATCH="${MAX_BATCH_SIZE:-16}"
RUN_DIR="$(mktemp -d)"
PIDS=()

cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait || true
}
trap cleanup EXIT INT TERM

for gpu in 0 1; do
  port=$((8001 + gpu))
  CUDA_VISIBLE_DEVICES=$gpu funaudiochat-serve "${MODEL_ARGS[@]}" "${KEY_ARGS[@]}" \
    --host 127.0.0.1 --port "$port" --max-batch-size "$BATCH" >"$RUN_DIR/gpu$gpu.log" 2>&1 &
  PIDS+=($!)
  echo "GPU $gpu: http://127.0.0.1:$port (log $RUN_DIR/gpu$gpu.log)"
done

for port in 8001 8002; do  # loading + warm-up take a while at full size
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 2; done
done
echo "both engines are up"

if command -v nginx >/dev/null; then
  cat >"$RUN_DIR/nginx.conf" <<NGINX
worker_processes 1;
pid $RUN_DIR/nginx.pid;
error_log $RUN_DIR/nginx.error.log;
events { worker_connections 1024; }
http {
  access_log off;
  upstream funaudiochat {
    least_conn;                       # long streams: send new ones where fewer are running
    server 127.0.0.1:8001 max_fails=3 fail_timeout=10s;
    server 127.0.0.1:8002 max_fails=3 fail_timeout=10s;
  }
  server {
    listen 8080;
    client_max_body_size 40m;         # base64 audio in the request body
    location / {
      proxy_pass http://funaudiochat;
      proxy_http_version 1.1;
      proxy_buffering off;            # server-sent events go out as they are made
      proxy_read_timeout 600s;
      proxy_next_upstream error timeout http_429 http_503;  # a full engine: try the other one
    }
  }
}
NGINX
  nginx -c "$RUN_DIR/nginx.conf" -g "daemon off;" &
  PIDS+=($!)
  echo "load balancer: http://127.0.0.1:8080/v1 (try: python scripts/loadgen.py --url http://127.0.0.1:8080)"
else
  echo "nginx not found: use http://127.0.0.1:8001/v1 and http://127.0.0.1:8002/v1 directly"
fi
wait
