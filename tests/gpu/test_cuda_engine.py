"""The engine on CUDA in bfloat16, at real shapes with random weights, against transformers."""

from __future__ import annotations

import json
import re
import subprocess
from itertools import pairwise
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.execution.prompt_graphs import LARGE_PROMPT_GRAPH_SEQS
from engine.llm_engine import LLMEngine
from protocol import RequestOutput, SamplingParams, StructuredOutput, StructuredOutputKind
from tandem.testing.processes import free_port, start_engine, start_server
from tandem.testing.random_checkpoint import save_random_model
from tandem.testing.reference import run_engine
from tests.engine.test_logprobs import generate
from tests.engine.test_prompt_logprobs import prompt_logprobs_of

# One shape per family; Gemma 3's prompts run past its 512-token sliding window.
FAMILY_SHAPES = ["llama-3.2-1b", "qwen3-0.6b", "qwen2.5-0.5b", "gemma3-1b"]


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama-1b")
    save_random_model(directory, "llama-3.2-1b", torch.bfloat16)
    return directory


def _prompts(count: int, max_len: int = 300) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(5, max_len, (count,), generator=generator).tolist()
    return [torch.randint(2, 128000, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("shape", FAMILY_SHAPES)
def test_last_token_logits_match_transformers_in_bf16(shape: str, tmp_path: Path) -> None:
    """Our bf16 logits are as close to a float32 reference as transformers' own bf16 ones."""
    save_random_model(tmp_path, shape, torch.bfloat16)
    # Both loaded from the files: a model cast with .to() would carry a bf16-rounded RoPE
    # inv_freq buffer into the float32 reference.
    hf_fp32 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    hf_bf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    engine = LLMEngine(  # eager: the test runs the model itself, never a decode step
        EngineConfig(
            model=str(tmp_path),
            device="cuda",
            max_model_len=4096,
            kv_cache_memory_gb=4,
            enforce_eager=True,
        )
    )
    ours_errors, theirs_errors = [], []
    for prompt in _prompts(4, max_len=1200):
        with torch.no_grad():
            ids = torch.tensor([prompt], device="cuda")
            reference = hf_fp32(ids).logits[0, -1]
            theirs = hf_bf16(ids).logits[0, -1].float()
        engine.add_request(b"gpu", "logits", prompt, SamplingParams(max_tokens=1))
        batch = engine.scheduler.schedule()
        inputs = engine.runner.step_inputs(batch)
        with torch.inference_mode():
            ours = engine.runner.forward_eager(inputs)[0]
        engine.abort(b"gpu", "logits")
        ours_errors.append(_relative_error(ours, reference))
        theirs_errors.append(_relative_error(theirs, reference))
    print(
        f"\n{shape} shape, bf16 last-token logits, relative error to float32 transformers:"
        f"\n  tandem       {[round(e, 4) for e in ours_errors]}"
        f"\n  transformers {[round(e, 4) for e in theirs_errors]}"
    )
    assert sum(ours_errors) < 1.5 * sum(theirs_errors)


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value - reference).norm() / reference.norm()).item()


@pytest.fixture(scope="module")
def engine_fp32(llama_1b: Path) -> LLMEngine:
    directory = llama_1b
    return LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cuda",
            dtype="float32",
            max_model_len=4096,
            kv_cache_memory_gb=4,
        )
    )


def test_batched_greedy_equals_one_at_a_time(engine_fp32: LLMEngine) -> None:
    """In float32, so the check is of batching and the paged cache, not of bf16 rounding:
    random weights give near-flat logits whose argmax any rounding difference flips."""
    engine = engine_fp32
    prompts = _prompts(8)
    alone = [run_engine(engine, [p], max_tokens=32)[0] for p in prompts]
    together = run_engine(engine, prompts, max_tokens=32)
    matches = sum(a == b for a, b in zip(alone, together, strict=True))
    print(f"\nbatched vs alone, exact greedy matches: {matches}/8")
    assert matches == 8


def test_constrained_requests_in_overlapped_graph_steps(engine_fp32: LLMEngine) -> None:
    """Decode steps replayed from CUDA graphs and overlapped, the grammar masks moved by a
    pinned copy and applied by xgrammar's kernel: each constrained request spells its regex
    and gets the tokens it gets alone, as does each free request sharing its batches."""
    engine = engine_fp32
    assert engine.overlap_steps and engine.runner.decode_graphs is not None
    tokenizer = Tokenizer.from_str(engine.tokenizer.tokenizer_json)
    regex = r"[0-9]{3}-[a-z]{2,5}"
    constraint = StructuredOutput(StructuredOutputKind.REGEX, regex)
    constrained = SamplingParams(max_tokens=16, structured_output=constraint)
    free = SamplingParams(max_tokens=16, ignore_eos=True)
    requests = {
        (f"constrained{i}" if i % 2 else f"free{i}"): (prompt, constrained if i % 2 else free)
        for i, prompt in enumerate(_prompts(8))
    }
    together = generate(engine, requests)
    for name, request in requests.items():
        tokens = [t for output in together[name] for t in output.new_token_ids]
        alone = generate(engine, {name: request})[name]
        assert tokens == [t for output in alone for t in output.new_token_ids], name
        if name.startswith("constrained"):
            assert together[name][-1].finish_reason == "stop"
            assert re.fullmatch(regex, "".join(tokenizer.id_to_token(t) for t in tokens))
    assert not engine.requests and engine.num_constrained == 0


def _graph_and_eager_decode(
    engine: LLMEngine, prompts: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one decode step after ``prompts``' prefills: replayed from a CUDA graph
    (batch padded to a captured size, block tables as wide as max_model_len), and op by op."""
    assert engine.runner.decode_graphs is not None
    for i, prompt in enumerate(prompts):
        engine.add_request(b"gpu", f"graph{i}", prompt, SamplingParams(max_tokens=4))
    # Until every prompt is computed (a request has its first token), chunks and all.
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    engine.sync()  # no step left in flight
    batch = engine.scheduler.schedule()
    inputs = engine.runner.step_inputs(batch)
    assert inputs.metadata.max_query_len == 1 and len(batch) == len(prompts)
    with torch.inference_mode():
        eager = engine.runner.forward_eager(inputs)
        graphed = engine.runner.decode_graphs.run(inputs).clone()
    for i in range(len(prompts)):
        engine.abort(b"gpu", f"graph{i}")
    return graphed, eager


def test_graph_decode_equals_eager_decode(engine_fp32: LLMEngine) -> None:
    graphed, eager = _graph_and_eager_decode(engine_fp32, _prompts(5))
    torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-3)


def _graph_and_eager_prompt(engine: LLMEngine, *prompts: list[int]) -> tuple[torch.Tensor, ...]:
    """Logits of ``prompts``' step together (after whatever prefix the cache holds):
    replayed from a prompt graph (tokens padded to a captured count, sequences to the
    graph's), and op by op."""
    assert engine.runner.prompt_graphs is not None
    engine.sync()
    for i, prompt in enumerate(prompts):
        engine.add_request(b"gpu", f"prompt{i}", prompt, SamplingParams(max_tokens=4))
    batch = engine.scheduler.schedule()
    inputs = engine.runner.step_inputs(batch)
    assert len(batch) == len(prompts) and engine.runner.prompt_graphs.fits(inputs.shape)
    with torch.inference_mode():
        eager = engine.runner.forward_eager(inputs).clone()
        replays = engine.runner.prompt_graphs.num_replays
        graphed = engine.runner.prompt_graphs.run(inputs).clone()
        assert engine.runner.prompt_graphs.num_replays == replays + 1
    for i in range(len(prompts)):
        engine.abort(b"gpu", f"prompt{i}")
    return graphed, eager, inputs.metadata.context_lens, inputs.metadata.query_lens


def test_prompt_graph_equals_eager_prompt(engine_fp32: LLMEngine) -> None:
    """A prompt step replayed from a graph of 16 to 4,096 tokens (a 1B model's ladder)
    gives the eager step's logits: whole prompts of several lengths (one exactly a captured
    length, the others padded; past 512 tokens too), several prompts in one step (sequences
    padded to the graph's; twenty of them, 2,000 tokens; twelve of 30 tokens, in a graph of
    1,024 for their count), and the new tokens after a cached prefix (context longer than the
    step)."""
    engine = engine_fp32
    assert engine.runner.prompt_graphs is not None
    assert engine.runner.prompt_graphs.lengths[-1] == 4096
    long_prompt = [3 + i % 1000 for i in range(1500)]
    prompts = [*_prompts(4), [7] * 16, [9] * 45, long_prompt, long_prompt[:1024]]
    for prompt in prompts:
        graphed, eager, context_lens, query_lens = _graph_and_eager_prompt(engine, prompt)
        assert graphed.shape == eager.shape == (1, engine.vocab_size)
        torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-3)
        assert context_lens.tolist() == query_lens.tolist() == [len(prompt)]
    several = [[11] * 30, [12] * 77, [13] * 5]
    graphed, eager, context_lens, _ = _graph_and_eager_prompt(engine, *several)
    assert graphed.shape == eager.shape == (3, engine.vocab_size)
    torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-3)
    assert context_lens.tolist() == [30, 77, 5]
    # Twenty prompts: 2,000 tokens; twelve short ones, more than the graphs of up to 512
    # tokens take, in the graph of 1,024.
    for count, length in ((20, 100), (12, 30)):
        prompts = [[20 + i] * length for i in range(count)]
        graphed, eager, context_lens, _ = _graph_and_eager_prompt(engine, *prompts)
        assert graphed.shape == eager.shape == (count, engine.vocab_size)
        torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-3)
    prefix = list(range(100, 164))
    run_engine(engine, [prefix], max_tokens=2)  # leaves its full blocks in the prefix cache
    graphed, eager, context_lens, query_lens = _graph_and_eager_prompt(engine, prefix + [5] * 20)
    torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-3)
    assert context_lens.item() == 84 and query_lens.item() < 84  # after the cached prefix


@pytest.fixture(scope="module")
def engine_split(llama_1b: Path) -> LLMEngine:
    """engine_fp32's model with every mixed step split (its 5 GB of float32 weights are past
    ``auto``'s limit): the decode graph and a prompt graph replayed for each."""
    return LLMEngine(
        EngineConfig(
            model=str(llama_1b),
            device="cuda",
            dtype="float32",
            max_model_len=4096,
            kv_cache_memory_gb=4,
            split_mixed_steps="on",
        )
    )


def test_split_mixed_step_equals_eager_mixed_step(engine_split: LLMEngine) -> None:
    """More decodes than any prompt graph takes sequences (33, padded to the decode graph of
    48), then two prompts: replayed as the decode graph and a prompt graph, the step's
    logits are the eager pass's."""
    engine, runner = engine_split, engine_split.runner
    assert runner.decode_graphs is not None and runner.prompt_graphs is not None
    engine.sync()
    num_decodes = LARGE_PROMPT_GRAPH_SEQS + 1
    for i, prompt in enumerate(_prompts(num_decodes)):
        engine.add_request(b"gpu", f"decode{i}", prompt, SamplingParams(max_tokens=8))
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    engine.sync()
    engine.add_request(b"gpu", "new0", [21] * 40, SamplingParams(max_tokens=2))
    engine.add_request(b"gpu", "new1", [22] * 130, SamplingParams(max_tokens=2))
    batch = engine.scheduler.schedule()
    inputs = runner.step_inputs(batch)
    assert inputs.shape.num_leading_decodes == num_decodes
    assert inputs.shape.num_seqs == num_decodes + 2
    graphs = (runner.decode_graphs, runner.prompt_graphs)
    before = [runner.num_split_steps, *(g.num_replays for g in graphs)]
    with torch.inference_mode():
        eager = runner.forward_eager(inputs).clone()
        split = runner.run_model(inputs).clone()
    assert [runner.num_split_steps, *(g.num_replays for g in graphs)] == [n + 1 for n in before]
    assert split.shape == eager.shape == (num_decodes + 2, engine.vocab_size)
    torch.testing.assert_close(split, eager, rtol=1e-3, atol=1e-3)
    for client, request_id in list(engine.requests):  # keyed by (client, request id)
        engine.abort(client, request_id)


def _arriving(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, the prompts arriving one or two a step while the earlier
    ones decode (overlapped steps: almost every step mixes a prompt into decodes)."""
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        outputs[str(i)] = []
        engine.add_request(b"gpu", str(i), prompt, sampling)
        if i % 3 != 2:
            for _, output in engine.step():
                outputs[output.request_id].extend(output.new_token_ids)
    while engine.has_work:
        for _, output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
    return outputs


def test_split_mixed_steps_generate_what_eager_ones_do(
    engine_split: LLMEngine, engine_fp32: LLMEngine
) -> None:
    """Greedy tokens in float32 with mixed steps split and replayed equal those with them
    run op by op (engine_fp32's model is past ``auto``'s limit: it does not split). Enough
    prompts that the steps come to mix more sequences than a prompt graph takes, which then
    split (fewer replay one prompt graph)."""
    assert not engine_fp32.runner.split_mixed_steps
    prompts = _prompts(2 * LARGE_PROMPT_GRAPH_SEQS, max_len=200)
    split_steps = engine_split.runner.num_split_steps
    split = _arriving(engine_split, prompts)
    assert engine_split.runner.num_split_steps > split_steps + 10
    assert split == _arriving(engine_fp32, prompts)


def test_sampling_parameters_batched_and_overlapped_equal_one_at_a_time(
    engine_fp32: LLMEngine, llama_1b: Path
) -> None:
    """vLLM's parameters on CUDA, overlapped steps and decode graphs on, in one batch: each
    request gets the tokens it gets alone (float32, as above), prompt log-probabilities are
    transformers', and launching a step of them never synchronizes with the device."""
    engine = engine_fp32
    assert engine.overlap_steps and engine.runner.decode_graphs is not None
    prompts = _prompts(7)
    plain = run_engine(engine, prompts[2:3], max_tokens=24)[0]
    sampled = {"max_tokens": 24, "ignore_eos": True}
    params = [
        SamplingParams(**sampled, repetition_penalty=1.3),
        SamplingParams(**sampled, presence_penalty=0.5, frequency_penalty=0.7),
        SamplingParams(**sampled, bad_words_token_ids=[[plain[3], plain[4]], [plain[8]]]),
        SamplingParams(**sampled, allowed_token_ids=list(range(1000, 1100))),
        SamplingParams(**sampled, temperature=0.9, top_p=0.9, min_p=0.2, seed=3),
        SamplingParams(max_tokens=24, min_tokens=20, stop_token_ids=[plain[1]]),
        SamplingParams(**sampled, prompt_logprobs=5),
    ]
    requests = {str(i): (p, s) for i, (p, s) in enumerate(zip(prompts, params, strict=True))}
    alone = {i: generate(engine, {i: request})[i] for i, request in requests.items()}
    engine.add_request(b"gpu", "sync", prompts[0], params[0])
    for request_id, request in requests.items():
        engine.add_request(b"gpu", f"sync{request_id}", *request)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            runner = engine.runner
            runner.sample(runner.forward(engine.scheduler.schedule()), None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for request in list(engine.requests.values()):
        engine.abort(request.client, request.request_id)
    engine.sync()
    together = generate(engine, requests)

    def tokens(outputs: list[RequestOutput]) -> list[int]:
        return [t for output in outputs for t in output.new_token_ids]

    for request_id in requests:
        assert tokens(together[request_id]) == tokens(alone[request_id]), request_id
    banned = tokens(together["2"])
    assert (plain[3], plain[4]) not in pairwise(banned) and plain[8] not in banned
    assert set(tokens(together["3"])) <= set(range(1000, 1100))
    assert len(tokens(together["5"])) >= 20
    scored = prompt_logprobs_of(together["6"])  # each step's piece, joined
    assert len(scored) == len(prompts[6]) - 1
    hf = AutoModelForCausalLM.from_pretrained(llama_1b, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[6]], device="cuda")).logits[0, :-1].float()
    reference = torch.log_softmax(logits, dim=-1).cpu()
    targets = torch.tensor(prompts[6][1:])
    torch.testing.assert_close(
        torch.tensor([entry.logprob for entry in scored]),
        reference[torch.arange(len(targets)), targets],
        rtol=1e-3,
        atol=1e-3,
    )


@pytest.mark.parametrize("shape", [s for s in FAMILY_SHAPES if s != "llama-3.2-1b"])
def test_graph_decode_equals_eager_decode_per_family(shape: str, tmp_path: Path) -> None:
    """Qwen's Q/K norms and biases, Gemma's head_dim 256 and sliding windows (prompts past
    its 512-token window) inside the captured graphs. In float32, as for Llama above: in
    bf16 the two paths' different context splits and GEMM tilings differ by about as much
    as bf16 differs from float32 (1-2% after the random layers), which would hide a bug."""
    save_random_model(tmp_path, shape, torch.float32)
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path),
            device="cuda",
            dtype="float32",
            max_model_len=2048,
            kv_cache_memory_gb=2,
            max_num_seqs=8,
        )
    )
    graphed, eager = _graph_and_eager_decode(engine, _prompts(5, max_len=1200))
    torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-3)


def test_http_end_to_end_on_cuda(
    llama_1b: Path, tmp_path: Path, subprocess_cleanup: list[subprocess.Popen]
) -> None:
    directory = llama_1b
    address = f"ipc://{tmp_path}/engine.sock"
    engine_process = start_engine(
        address,
        tmp_path / "engine.log",
        "--model",
        str(directory),
        "--device",
        "cuda",
        "--max-model-len",
        "4096",
    )
    subprocess_cleanup.append(engine_process)
    port = free_port()
    subprocess_cleanup.append(start_server(address, port, tmp_path / "server.log"))
    body = {
        "messages": [{"role": "user", "content": "w5 w6 w7"}],
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    plain = httpx.post(url, json=body, timeout=120).json()
    assert plain["usage"]["completion_tokens"] == 40
    streamed = ""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    streamed += chunk["choices"][0]["delta"].get("content") or ""
    assert streamed == plain["choices"][0]["message"]["content"]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_projections_adding_the_stream_change_no_bit(
    llama_1b: Path, quantization: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At batch 1 the o and down projections add the residual stream in the one-row kernel's
    epilogue (RowParallelLinear.into_stream), and the norm after them has none to add: the
    same tokens and log-probabilities, bit for bit, as with the stream left to the norm."""
    if quantization == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")
    from engine.models.parallel_layers import RowParallelLinear
    from engine.quantization.linear_methods import LinearMethod

    added: list[int] = []  # the products that added the stream
    into_stream = LinearMethod.one_row_into_stream

    def recorded(self: LinearMethod, *args: object, **kwargs: object) -> torch.Tensor:
        added.append(1)
        return into_stream(self, *args, **kwargs)

    monkeypatch.setattr(LinearMethod, "one_row_into_stream", recorded)
    prompts = _prompts(4, max_len=80)

    def each_alone() -> list[dict]:
        config = EngineConfig(
            model=str(llama_1b), device="cuda", quantization=quantization, kv_cache_memory_gb=2
        )
        engine = LLMEngine(config)
        sampling = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=4)
        outputs = [generate(engine, {"r": (prompt, sampling)}) for prompt in prompts]
        engine.close()
        return outputs

    in_epilogue = each_alone()
    assert added  # batch-1 steps took the epilogue (in the graphs captured at start, too)

    def left_to_the_norm(
        self: RowParallelLinear,
        x: torch.Tensor,
        stream: torch.Tensor | None,
        *,
        gated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not gated:
            return self(x), stream
        return self.forward_silu_gated(x), stream

    monkeypatch.setattr(RowParallelLinear, "into_stream", left_to_the_norm)
    assert each_alone() == in_epilogue


def test_fp8_layers_computing_their_norms_change_no_token(
    llama_1b: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With FP8 weights, the norm before Q/K/V and gate/up is computed by the kernel that
    quantizes its rows for the W8A8 product (engine.backends.deferred_norm), bit for bit as the
    norm's own kernel computes it: the same greedy tokens as with the norm's kernel, through prompts
    and decode batches past the 16 rows that take the W8A8 product."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9")
    from engine.backends.deferred_norm import DeferredNorm
    from engine.quantization.linear_methods import Fp8Linear

    prompts = _prompts(24, max_len=120)
    deferred_rows: list[int] = []  # the rows of each norm left to the layer after it
    post_init = DeferredNorm.__post_init__

    def recorded(self: DeferredNorm) -> None:
        deferred_rows.append(self.x.shape[0])
        post_init(self)

    monkeypatch.setattr(DeferredNorm, "__post_init__", recorded)

    def greedy() -> list[list[int]]:
        config = EngineConfig(
            model=str(llama_1b), device="cuda", quantization="fp8", kv_cache_memory_gb=2
        )
        engine = LLMEngine(config)
        tokens = run_engine(engine, prompts, max_tokens=24)
        engine.close()
        return tokens

    fused = greedy()
    assert max(deferred_rows) > 16  # the W8A8 rows' norms were left to the quantization
    monkeypatch.setattr(Fp8Linear, "takes_deferred_norm", lambda self, num_rows: False)
    deferred_rows.clear()
    assert greedy() == fused
    assert set(deferred_rows) <= {1}  # only batch-1 steps' norms, as before
