#!/usr/bin/env bash
# 1 engine vs 2 Ray Serve replicas of the bundled pair, measured with `quickdraft bench-serve`
# (the same load, closed-loop concurrency 1 and 8), alternating the order over rounds. Each
# bench-serve result file carries the provenance record (commit, command, machine, load).
#   nice -n 19 benchmarks/replicas.sh [rounds] [out_dir] [num_requests] [max_tokens]
#   benchmarks/replicas.sh 1 /tmp/replicas 2 4     # a smoke test
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -d .venv/bin ]]; then PATH=$PWD/.venv/bin:$PATH; fi
rounds=${1:-2}
out=${2:-benchmarks/results/replicas}
requests=${3:-24}
tokens=${4:-48}
mkdir -p "$out"
run() {  # $1: label, rest: serve flags
  local label=$1; shift
  local port; port=$(python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
  python -m quickdraft.cli serve --port "$port" --log-level warning "$@" > "$out/$label.serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 0.5; done
  uptime >> "$out/load.txt"
  python -m quickdraft.cli bench-serve --url "http://127.0.0.1:$port" --concurrency 1,8 --num-requests "$requests" \
    --max-tokens "$tokens" --out-dir "$out" --name "$label-round$round" --label "$label" > /dev/null
  kill -TERM $pid; wait $pid || true
}
for round in $(seq "$rounds"); do
  if (( round % 2 )); then run one_engine; run two_replicas --replicas 2
  else run two_replicas --replicas 2; run one_engine; fi
done
