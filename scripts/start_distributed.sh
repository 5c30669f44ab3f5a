#!/usr/bin/env bash
# Start M engine replicas and N HTTP servers over them; stop them all on Ctrl-C or SIGTERM.
#
#   scripts/start_distributed.sh [--model PATH_OR_NAME] [--servers N] [--port P]
#                                [--data-parallel-size M] [--gpus LIST]
#                                [--device cpu|cuda] [--host H] [--engine-address ADDR]
#                                [-- ENGINE_ARGS...]
#
# Server i listens on port P+i and spreads its requests over every replica. Arguments after
# `--` go to each `python -m engine`. With M > 1, replica r runs on GPUs r*T .. r*T+T-1 of LIST
# (default: $CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists), T being the engine's
# --tensor-parallel-size (1 unless given after `--`); a GPU listed twice is shared (then size
# each replica's cache: -- --kv-cache-memory-gb G). Replica r binds ADDR with r added to its
# port (tcp://H:PORT) or "-r" to its path (ipc://PATH); ADDR may also list the M addresses,
# separated by commas. A replica that exits is restarted; a server that exits stops everything.
set -euo pipefail

model=""
servers=1
port=8000
replicas=1
gpus=""
device=""
host=127.0.0.1
engine_address=""
engine_args=()

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --servers) servers="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --data-parallel-size) replicas="$2"; shift 2 ;;
    --gpus) gpus="$2"; shift 2 ;;
    --device) device="$2"; shift 2 ;;
    --host) host="$2"; shift 2 ;;
    --engine-address) engine_address="$2"; shift 2 ;;
    --) shift; engine_args=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
  esac
done
if ! [[ "$replicas" =~ ^[1-9][0-9]*$ ]]; then
  echo "--data-parallel-size must be a positive integer, not '$replicas'" >&2
  exit 2
fi

root=$(cd "$(dirname "$0")/.." && pwd)
if [[ -n "${PYTHON:-}" ]]; then
  python=$PYTHON
elif [[ -z "${VIRTUAL_ENV:-}" && -x "$root/.venv/bin/python" ]]; then
  python=$root/.venv/bin/python
else
  python=python3
fi
cd "$root"

# Each replica's address.
addresses=()
if [[ "$engine_address" == *,* ]]; then
  IFS=, read -r -a addresses <<<"$engine_address"
elif ((replicas == 1)); then
  addresses=("${engine_address:-ipc://${TMPDIR:-/tmp}/tandem-engine-$$.sock}")
else
  for ((r = 0; r < replicas; r++)); do
    if [[ -z "$engine_address" ]]; then
      addresses+=("ipc://${TMPDIR:-/tmp}/tandem-engine-$$-$r.sock")
    elif [[ "$engine_address" =~ ^(tcp://.*):([0-9]+)$ ]]; then
      addresses+=("${BASH_REMATCH[1]}:$((BASH_REMATCH[2] + r))")
    else
      addresses+=("$engine_address-$r")
    fi
  done
fi
if ((${#addresses[@]} != replicas)); then
  echo "--engine-address lists ${#addresses[@]} addresses for $replicas replicas" >&2
  exit 2
fi

# Each replica's GPUs (none: the engine sees what this script sees).
gpu_sets=()
if ((replicas > 1 || ${#gpus} > 0)) && [[ "$device" != cpu ]]; then
  tensor_parallel=1
  for ((i = 0; i < ${#engine_args[@]}; i++)); do
    case "${engine_args[i]}" in
      --tensor-parallel-size) tensor_parallel="${engine_args[i + 1]:-1}" ;;
      --tensor-parallel-size=*) tensor_parallel="${engine_args[i]#*=}" ;;
    esac
  done
  if [[ -z "$gpus" ]]; then
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
      gpus=$CUDA_VISIBLE_DEVICES
    elif command -v nvidia-smi >/dev/null; then
      gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)
    fi
  fi
  if [[ -n "$gpus" ]]; then
    IFS=, read -r -a gpu_list <<<"$gpus"
    needed=$((replicas * tensor_parallel))
    if ((${#gpu_list[@]} < needed)); then
      echo "$replicas replicas of $tensor_parallel GPU(s) need $needed GPUs; there are" \
        "${#gpu_list[@]} ($gpus); --gpus may list one twice to share it" >&2
      exit 2
    fi
    for ((r = 0; r < replicas; r++)); do
      gpu_sets+=("$(IFS=,; echo "${gpu_list[*]:r * tensor_parallel:tensor_parallel}")")
    done
  fi
fi

engine_pids=()
server_pids=()
stop_all() {
  trap - INT TERM EXIT
  echo "stopping..." >&2
  # Servers first, so none is left talking to a stopped engine.
  for pid in "${server_pids[@]}" "${engine_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM
trap stop_all EXIT

start_replica() {  # replica index
  local r=$1 launch=()
  [[ -n "${gpu_sets[r]:-}" ]] && launch=(env "CUDA_VISIBLE_DEVICES=${gpu_sets[r]}")
  local args=(--address "${addresses[r]}")
  [[ -n "$model" ]] && args+=(--model "$model")
  [[ -n "$device" ]] && args+=(--device "$device")
  "${launch[@]}" "$python" -m engine "${args[@]}" "${engine_args[@]}" &
  engine_pids[r]=$!
}

for ((r = 0; r < replicas; r++)); do start_replica "$r"; done
engine_list=$(IFS=,; echo "${addresses[*]}")
for ((i = 0; i < servers; i++)); do
  "$python" -m server --engine "$engine_list" --host "$host" --port $((port + i)) &
  server_pids+=("$!")
done

# Healthy once every server answers /health (a server serves only after every engine's handshake).
for ((i = 0; i < servers; i++)); do
  url="http://$host:$((port + i))"
  until "$python" - "$url/health" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=2)
PY
  do
    for pid in "${engine_pids[@]}" "${server_pids[@]}"; do
      if ! kill -0 "$pid" 2>/dev/null; then
        echo "a process exited during start-up (pid $pid); see its log above" >&2
        exit 1
      fi
    done
    sleep 0.5
  done
done

for ((r = 0; r < replicas; r++)); do
  echo "engine replica $r (pid ${engine_pids[r]}${gpu_sets[r]:+, GPUs ${gpu_sets[r]}}) at ${addresses[r]}"
done
for ((i = 0; i < servers; i++)); do
  echo "server $i: http://$host:$((port + i))  (OpenAI API at http://$host:$((port + i))/v1)"
done
echo "ready; Ctrl-C stops everything"

# Watch: a server's exit stops everything; an engine replica's is restarted, the servers sending
# its requests to the others meanwhile (with one replica there are no others: everything stops).
while true; do
  sleep 1 & wait $! || true  # in the background, so that a signal's trap runs at once
  for pid in "${server_pids[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "a server exited (pid $pid); stopping the rest" >&2
      exit 1
    fi
  done
  for ((r = 0; r < replicas; r++)); do
    if ! kill -0 "${engine_pids[r]}" 2>/dev/null; then
      status=0
      wait "${engine_pids[r]}" || status=$?
      if ((replicas == 1)); then
        echo "the engine exited with status $status; stopping the rest" >&2
        exit 1
      fi
      echo "engine replica $r exited with status $status; restarting it" >&2
      start_replica "$r"
    fi
  done
done
