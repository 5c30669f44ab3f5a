python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
for shape in llama-3.1-8b qwen3-0.6b; do
  m=/tmp/cfg-$shape; python3 scripts/make_random_checkpoint.py --shape $shape --config-only --out $m >/dev/null 2>&1
  repeat=""; [ $shape = llama-3.1-8b ] && repeat=--repeat-prompts
  for lt in 0 1; do
    echo "== $shape TORCH_BLAS_PREFER_CUBLASLT=$lt"
    TORCH_BLAS_PREFER_CUBLASLT=$lt timeout 110 python3 scripts/bench_offline.py --model $m --load-format dummy --runs 3 $repeat 2>&1 | grep -E "^tandem, (median|range|first)|^decode, batch"
  done
done
