#!/usr/bin/env bash
# Start one engine and N HTTP servers on it, keep them running, stop them all on Ctrl-C or SIGTERM.
#
#   scripts/start_distributed.sh [--model PATH_OR_NAME] [--servers N] [--port P]
#                                [--device cpu|cuda] [--host H] [--engine-address ADDR]
#                                [--tensor-parallel-size N] [--drain-timeout S]
#                                [--server-args "ARGS"] [-- ENGINE_ARGS...]
#   scripts/start_distributed.sh --rolling-restart [--port P]   # restart the servers in turn
#   scripts/start_distributed.sh --status [--port P]
#
# Server i listens on port P+i. With --tensor-parallel-size N the engine splits the model
# over N GPUs (N processes, which it starts). Arguments after `--` go to `python -m engine`.
# A crashed server (or engine) is started again with backoff; a rolling restart (or SIGHUP
# to the supervisor) restarts the servers one by one while the engine keeps its weights. The
# work is done by scripts/supervisor.py, which says more.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
if [[ -n "${PYTHON:-}" ]]; then
  python=$PYTHON
elif [[ -z "${VIRTUAL_ENV:-}" && -x "$root/.venv/bin/python" ]]; then
  python=$root/.venv/bin/python
else
  python=python3
fi
exec "$python" "$root/scripts/supervisor.py" "$@"
