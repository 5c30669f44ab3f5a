"""Overlapped steps (each step launched before the last one's tokens are read, as on CUDA),
run on the CPU: the same tokens, stops, log-probabilities and freed blocks as one step at a
time, through chunked prefill, prefix caching, preemption, penalties and aborts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from transformers import LlamaForCausalLM as HFLlama

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import FinishReason, RequestOutput, SamplingParams
from tandem.testing.random_checkpoint import random_prompts, save_tiny_word_model
from tandem.testing.reference import hf_greedy, run_engine
from tests.engine.test_logprobs import generate
from tests.engine.test_penalties import penalized_greedy


def make_engine(directory: Path, overlap: bool = True, **overrides: int) -> LLMEngine:
    settings = {"block_size": 4, "kv_cache_memory_gb": 0.01, **overrides}
    return LLMEngine(
        EngineConfig(model=str(directory), device="cpu", overlap_steps=overlap, **settings)
    )


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for output in outputs for t in output.new_token_ids]


def untimed(outputs: dict[str, list[RequestOutput]]) -> dict[str, list[RequestOutput]]:
    """Each request's outputs without the times they report (the queue's, the prefill's)."""
    return {
        request: [dataclasses.replace(o, queue_time=None, prefill_time=None) for o in outs]
        for request, outs in outputs.items()
    }


def assert_all_blocks_free(engine: LLMEngine) -> None:
    assert engine.in_flight is None and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_request_that_fills_the_context_gets_its_last_token(tmp_path: Path) -> None:
    """A request whose prompt and max_tokens fill the context exactly (what a server asks for
    a request without max_tokens) gets every token, as one step at a time does: with steps
    overlapped, the context's end was checked with the token of the step in flight counted,
    and the last token was dropped."""
    save_tiny_word_model(tmp_path)
    counts = []
    for overlap in (False, True):
        config = EngineConfig(
            model=str(tmp_path), device="cpu", max_model_len=32, overlap_steps=overlap
        )
        counts.append(len(run_engine(LLMEngine(config), [[5, 6, 7, 8, 9, 10]], 26)[0]))
    assert counts == [26, 26]


def test_greedy_tokens_match_transformers_with_chunks_and_cached_prefixes(
    tiny: tuple[Path, HFLlama],
) -> None:
    directory, hf_model = tiny
    engine = make_engine(directory, max_num_seqs=8, max_num_batched_tokens=8)
    prompts = random_prompts(6)
    # Then prompts that start with one of the first ones, whose blocks are cached by then.
    followups = [prompts[4][:40] + p for p in random_prompts(2, seed=3)]
    for batch in (prompts, followups):
        assert run_engine(engine, batch, max_tokens=12) == [
            hf_greedy(hf_model, p, 12) for p in batch
        ]
    assert engine.block_manager.num_hit_tokens > 0
    assert_all_blocks_free(engine)


def test_preemption_keeps_outputs_exact(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    engine = make_engine(directory, num_kv_blocks=40, max_model_len=160)
    prompts = random_prompts(8)
    assert run_engine(engine, prompts, max_tokens=24) == [
        hf_greedy(hf_model, p, 24) for p in prompts
    ]
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_a_stop_token_ends_the_request_as_without_overlap(tiny: tuple[Path, HFLlama]) -> None:
    """The step after the stop is already launched when the stop is read: its token is
    dropped, and the request's blocks are freed once."""
    directory, hf_model = tiny
    prompt = random_prompts(4)[3]
    greedy = hf_greedy(hf_model, prompt, 8)
    sampling = SamplingParams(max_tokens=8, stop_token_ids=[greedy[4]])
    requests = {"stops": (prompt, sampling), "runs": (random_prompts(3)[2], SamplingParams())}
    overlapped = generate(make_engine(directory), requests)
    one_at_a_time = generate(make_engine(directory, overlap=False), requests)
    assert untimed(overlapped) == untimed(one_at_a_time)
    assert tokens(overlapped["stops"]) == greedy[: greedy.index(greedy[4])]
    assert overlapped["stops"][-1].finish_reason == FinishReason.STOP


def test_penalties_logprobs_and_seeded_sampling_as_without_overlap(
    tiny: tuple[Path, HFLlama],
) -> None:
    directory, hf_model = tiny
    prompts = random_prompts(5)[2:]
    requests = {
        "penalized": (
            prompts[0],
            SamplingParams(
                max_tokens=16, ignore_eos=True, presence_penalty=0.5, frequency_penalty=1
            ),
        ),
        "logprobs": (prompts[1], SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3)),
        "sampled": (
            prompts[2],
            SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7),
        ),
    }
    engine = make_engine(directory)
    overlapped = generate(engine, requests)
    assert untimed(overlapped) == untimed(generate(make_engine(directory, overlap=False), requests))
    assert tokens(overlapped["penalized"]) == penalized_greedy(hf_model, prompts[0], 16, 0.5, 1)
    assert_all_blocks_free(engine)


def test_abort_with_a_step_in_flight(tiny: tuple[Path, HFLlama]) -> None:
    directory, hf_model = tiny
    engine = make_engine(directory)
    prompts = random_prompts(4)[2:]
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    engine.add_request(b"t", "aborted", prompts[0], sampling)
    engine.add_request(b"t", "kept", prompts[1], sampling)
    kept: list[int] = []
    for _ in range(3):
        kept += [t for _, o in engine.step() if o.request_id == "kept" for t in o.new_token_ids]
    assert engine.in_flight is not None
    final = engine.abort(b"t", "aborted")
    assert final is not None and final.finish_reason == FinishReason.ABORT
    while engine.has_work:
        for _, output in engine.step():
            assert output.request_id == "kept"
            kept += output.new_token_ids
    assert kept == hf_greedy(hf_model, prompts[1], 10)
    assert_all_blocks_free(engine)


def test_token_counts_stay_the_sum_of_their_parts(tiny: tuple[Path, HFLlama]) -> None:
    """A request's num_tokens, kept as tokens are sampled and read (not summed when asked),
    is its prompt, output and pending tokens after every step, through preemption."""
    directory, _ = tiny
    engine = make_engine(directory, num_kv_blocks=40, max_model_len=160)
    for index, prompt in enumerate(random_prompts(8)):
        engine.add_request(b"c", str(index), prompt, SamplingParams(max_tokens=24))
    num_steps = 0
    while engine.has_work:
        engine.step()
        num_steps += 1
        assert num_steps < 1000, "the requests never finished"
        for r in engine.requests.values():
            parts = len(r.prompt_token_ids) + len(r.output_token_ids) + r.num_pending_tokens
            assert r.num_tokens == parts, r.request_id
            assert r.num_output_tokens == len(r.output_token_ids) + r.num_pending_tokens
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)
