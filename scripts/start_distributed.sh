#!/usr/bin/env bash
# Start M engine replicas and N HTTP servers over them, keep them running, stop them all on
# Ctrl-C or SIGTERM.
#
#   scripts/start_distributed.sh [--model PATH_OR_NAME] [--servers N] [--port P]
#                                [--device cpu|cuda] [--host H] [--engine-address ADDR]
#                                [--tensor-parallel-size T] [--data-parallel-size M]
#                                [--gpus LIST] [--drain-timeout S]
#                                [--server-args "ARGS"] [-- ENGINE_ARGS...]
#   scripts/start_distributed.sh --rolling-restart [--port P]   # restart the servers in turn
#   scripts/start_distributed.sh --status [--port P]
#
# Server i listens on port P+i and spreads its requests over every replica (M defaults to 1).
# With --tensor-parallel-size T each engine splits the model over T GPUs (T processes, which
# it starts); replica r runs on GPUs r*T .. r*T+T-1 of LIST (default: $CUDA_VISIBLE_DEVICES,
# else every GPU nvidia-smi lists), and binds ADDR with r added to its TCP port or "-r" to its
# IPC path (or ADDR lists the M addresses, separated by commas). Arguments after `--` go to
# every `python -m engine`. A crashed server or engine replica is started again with backoff;
# a rolling restart (or SIGHUP to the supervisor) restarts the servers one by one while the
# engines keep their weights.
#
# This is `tandem serve` (tandem/supervisor.py, which says more: --help), on the checkout's
# .venv when no environment is active ($PYTHON chooses another interpreter).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
if [[ -n "${PYTHON:-}" ]]; then
  python=$PYTHON
elif [[ -z "${VIRTUAL_ENV:-}" && -x "$root/.venv/bin/python" ]]; then
  python=$root/.venv/bin/python
else
  python=python3
fi
exec "$python" -m tandem serve "$@"
