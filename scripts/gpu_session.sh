#!/usr/bin/env bash
# One call on the GPU machine: GPU tests and/or benchmarks, logs under $OUT (or /tmp).
#
#   scripts/gpu_session.sh tests|bench-1b|bench-8b|bench-qwen3|bench-dp|bench-dp-smoke|profile-1b|profile-8b ...
#
# bench-dp needs two GPUs (DP=2 against DP=1); bench-dp-smoke runs both replicas on GPU 0.
#
# PEERS=0 leaves out transformers' runs (minutes of device time each); PYTEST_K filters tests.
#
# Expects the wheels the GPU image lacks in .whl/: shared/tools/device-wheels.sh xgrammar
# apache-tvm-ffi httpx2 httpcore2 truststore h11 idna anyio (the engine imports xgrammar; the
# openai client of the tests needs httpx2).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/tandem-gpu}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
peer() {  # the peer flags of a benchmark, unless PEERS=0
  [ "${PEERS:-1}" = 0 ] || echo "--peer $*"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'

checkpoint() {  # shape -> directory, made once per machine
  local dir=/tmp/ckpt-$1
  [ -f "$dir/config.json" ] || python3 scripts/make_random_checkpoint.py --shape "$1" --out "$dir" >&2
  echo "$dir"
}

for stage in "$@"; do
  echo "=== $stage $(date -u +%FT%TZ)"
  case $stage in
    tests)
      python3 -m pytest -q -rs -s tests/gpu tests/engine/test_kernels.py tests/engine/test_model_parity.py \
        -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$out/tests.log" | grep -vE '^\s*$' | tail -40 ;;
    bench-1b)
      m=$(checkpoint llama-3.2-1b)
      timeout 300 python3 scripts/bench_offline.py --model "$m" $(peer --peer-requests 64) 2>&1 | tee "$out/offline-1b.log" | tail -5
      timeout 300 python3 scripts/bench_latency.py --model "$m" $(peer) 2>&1 | tee "$out/latency-1b.log" | tail -6 ;;
    bench-8b)
      m=$(checkpoint llama-3.1-8b)
      timeout 300 python3 scripts/bench_latency.py --model "$m" $(peer) 2>&1 | tee "$out/latency-8b.log" | tail -6
      timeout 300 python3 scripts/bench_offline.py --model "$m" $(peer --peer-requests 64) 2>&1 | tee "$out/offline-8b.log" | tail -5 ;;
    bench-dp|bench-dp-smoke)
      m=$(checkpoint llama-3.2-1b)
      gpus=0,1; [ "$stage" = bench-dp-smoke ] && gpus=0,0
      timeout 540 python3 scripts/bench_data_parallel.py --model "$m" --gpus $gpus 2>&1 | tee "$out/$stage-1b.log" | grep -v '^INFO' | tail -8 ;;
    bench-qwen3)
      m=$(checkpoint qwen3-0.6b)
      timeout 300 python3 scripts/bench_offline.py --model "$m" $(peer --peer-requests 128) 2>&1 | tee "$out/offline-qwen3.log" | tail -5 ;;
    profile-1b)
      m=$(checkpoint llama-3.2-1b)
      timeout 300 python3 scripts/profile_step.py --model "$m" 2>&1 | tee "$out/profile-1b.log" | grep -v USDT ;;
    profile-8b)
      m=$(checkpoint llama-3.1-8b)
      timeout 300 python3 scripts/profile_step.py --model "$m" 2>&1 | tee "$out/profile-8b.log" | grep -v USDT ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
