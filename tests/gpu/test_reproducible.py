"""On CUDA: two engine processes of one model, started one after the other, give the same
greedy tokens for the same requests in the same batches, as a restarted server or a second
replica must.

What this guards: kernels whose configurations sum in different orders must not choose them
by timing at start-up. Triton's autotuner did, for the one-row GEMV and the weight-only GEMM's
splits of K, and two replicas of one model gave different tokens where two logits nearly tied
(`docs/history/benchmarks-lab-notebook.md`); now a rule over the shapes chooses
(`one_row_config`, `tiled_config`)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem import REPO_ROOT
from tandem.testing.random_checkpoint import SHAPES

# In a fresh process: each prompt alone (one-row kernels), then all of them at once (one
# prefill step, then decode steps of every prompt together: the weight-only GEMM's split-K
# tiles with fp8 weights, cuBLAS in bf16); the greedy tokens as JSON.
GENERATE = """
import json, sys
from engine import LLM, SamplingParams
model, quantization, prompts = sys.argv[1], sys.argv[2] or None, json.loads(sys.argv[3])
llm = LLM(model, device="cuda", max_model_len=2048, kv_cache_memory_gb=2,
          quantization=quantization)
greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
alone = [llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts]
together = llm.generate(prompts, greedy, use_tqdm=False)
print(json.dumps([[o.outputs[0].token_ids for o in outs] for outs in (alone, together)]))
"""


def greedy_tokens(model: Path, quantization: str, prompts: list[list[int]]) -> list:
    result = subprocess.run(
        [sys.executable, "-c", GENERATE, str(model), quantization, json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("quantization", ["", "fp8"], ids=["bf16", "fp8"])
def test_two_engine_processes_give_the_same_greedy_tokens(
    quantization: str, shape_checkpoint: Callable[[str], Path]
) -> None:
    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 weights need compute capability 8.9")
    shape = "llama-3.2-1b"
    vocab = SHAPES[shape][2]["vocab_size"]
    generator = torch.Generator().manual_seed(11)
    lengths = torch.randint(8, 400, (4,), generator=generator).tolist()
    prompts = [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in lengths]
    model = shape_checkpoint(shape)
    first = greedy_tokens(model, quantization, prompts)
    second = greedy_tokens(model, quantization, prompts)
    assert [len(tokens) for tokens in first[0] + first[1]] == [48] * 8
    assert first == second
