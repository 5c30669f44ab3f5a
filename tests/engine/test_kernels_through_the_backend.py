"""Kernels only through the backend, on the CPU: an engine of the torch backend never imports
the Triton backend (``engine.backends.triton``), whatever it runs (unquantized, fp8 and int8
linear layers, greedy and sampled requests, n-gram verify steps), in a fresh process where
Triton's interpreter is on, so that a Triton kernel called by mistake would run (slowly)
rather than fail, and only the import would tell. The same process with the triton backend
does import it: the check sees an import when there is one.

(pyproject's import-linter contract forbids any module of the engine but the registry to
import the Triton backend, lazily or not; tests/gpu/test_backend_kernels.py counts Triton
launches on CUDA, where the kernels would otherwise run.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.testing.processes import REPO_ROOT
from tandem.testing.random_checkpoint import random_prompts, save_tiny_llama

# In a fresh process: an engine of the backend argv[2] for each of the quantizations argv[3]
# (JSON; "" for none), with n-gram speculation, generating a greedy, a sampled and a
# drafting request; then the Triton backend's modules that were imported, as JSON.
GENERATE = """
import json, sys
from engine import LLM, SamplingParams
model, backend, quantizations = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
prompts = json.loads(sys.argv[4])
greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
sampled = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
drafts = tokens = 0
for quantization in quantizations:
    llm = LLM(model, device="cpu", backend=backend, quantization=quantization or None,
              block_size=4, kv_cache_memory_gb=0.01,
              speculative_config={"method": "ngram", "prompt_lookup_min": 1})
    outputs = llm.generate(prompts, [greedy, sampled, greedy], use_tqdm=False)
    tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    drafts += llm.engine.num_draft_tokens
triton = sorted(m for m in sys.modules if m.startswith("engine.backends.triton"))
print(json.dumps({"triton_modules": triton, "tokens": tokens, "drafts": drafts}))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(directory, num_attention_heads=4, num_key_value_heads=2)
    return directory


def generate_in_a_fresh_process(model: Path, backend: str, quantizations: list[str]) -> dict:
    prompts = random_prompts(3)
    prompts[2] = prompts[1][:6] * 4  # repeats itself: n-gram speculation drafts for it
    arguments = [str(model), backend, json.dumps(quantizations), json.dumps(prompts)]
    result = subprocess.run(
        [sys.executable, "-c", GENERATE, *arguments],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_torch_backend_never_imports_the_triton_backend(tiny: Path) -> None:
    ran = generate_in_a_fresh_process(tiny, "torch", ["", "fp8", "int8"])
    assert ran["tokens"] == 3 * 3 * 8 and ran["drafts"] > 0
    assert ran["triton_modules"] == []


def test_the_triton_backend_is_imported_when_chosen(tiny: Path) -> None:
    ran = generate_in_a_fresh_process(tiny, "triton", [""])
    assert ran["tokens"] == 3 * 8
    assert "engine.backends.triton.backend" in ran["triton_modules"]
