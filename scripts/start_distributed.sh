#!/usr/bin/env bash
# Start one engine and N HTTP servers on it; stop them all on Ctrl-C or SIGTERM.
#
#   scripts/start_distributed.sh [--model PATH_OR_NAME] [--servers N] [--port P]
#                                [--device cpu|cuda] [--host H] [--engine-address ADDR]
#                                [--tensor-parallel-size N] [-- ENGINE_ARGS...]
#
# Server i listens on port P+i. With --tensor-parallel-size N the engine splits the model
# over N GPUs (N processes, which it starts). Arguments after `--` go to `python -m engine`.
set -euo pipefail

model=""
servers=1
port=8000
device=""
host=127.0.0.1
engine_address=""
tensor_parallel_size=""
engine_args=()

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --servers) servers="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    --host) host="$2"; shift 2 ;;
    --engine-address) engine_address="$2"; shift 2 ;;
    --tensor-parallel-size) tensor_parallel_size="$2"; shift 2 ;;
    --) shift; engine_args=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
if [[ -n "${PYTHON:-}" ]]; then
  python=$PYTHON
elif [[ -z "${VIRTUAL_ENV:-}" && -x "$root/.venv/bin/python" ]]; then
  python=$root/.venv/bin/python
else
  python=python3
fi
cd "$root"

: "${engine_address:=ipc://${TMPDIR:-/tmp}/tandem-engine-$$.sock}"
args=(--address "$engine_address")
[[ -n "$model" ]] && args+=(--model "$model")
[[ -n "$device" ]] && args+=(--device "$device")
[[ -n "$tensor_parallel_size" ]] && args+=(--tensor-parallel-size "$tensor_parallel_size")

pids=()
stop_all() {
  trap - INT TERM EXIT
  echo "stopping..." >&2
  # Servers first, so none is left talking to a stopped engine.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap stop_all EXIT

"$python" -m engine "${args[@]}" "${engine_args[@]}" &
engine_pid=$!
pids+=("$engine_pid")

for ((i = 0; i < servers; i++)); do
  "$python" -m server --engine "$engine_address" --host "$host" --port $((port + i)) &
  pids+=("$!")
done

# Healthy once every server answers /health (a server serves only after its engine handshake).
for ((i = 0; i < servers; i++)); do
  url="http://$host:$((port + i))"
  until "$python" - "$url/health" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=2)
PY
  do
    for pid in "${pids[@]}"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        echo "a process exited during start-up (pid $pid); see its log above" >&2
        exit 1
      fi
    done
    sleep 0.5
  done
done

echo "engine (pid $engine_pid) at $engine_address"
for ((i = 0; i < servers; i++)); do
  echo "server $i: http://$host:$((port + i))  (OpenAI API at http://$host:$((port + i))/v1)"
done
echo "ready; Ctrl-C stops everything"
wait -n "${pids[@]}" || true
echo "a process exited; stopping the rest" >&2
exit 1
