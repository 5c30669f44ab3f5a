"""N-gram and draft-model speculation on CUDA (decode and verify steps replayed from CUDA
graphs, overlapped steps, the Triton decode kernel with 1 + k queries a sequence for verify
steps, the draft's passes), in float32 at the Llama-3.2-1B shape: the same tokens as without
it, greedy and seeded, adaptive (the default) and at a fixed k, with the verify graphs
replayed; the target as its own draft has (nearly) every draft accepted, an unrelated random
draft nearly none, both with the draft's passes replayed from its own graphs, and adaptive the
target as its own draft is paused (a draft that costs a target pass does not pay); a verify
graph's logits equal the eager step's."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import SamplingParams
from tandem.testing.random_checkpoint import save_random_model, save_tiny_llama, save_word_tokenizer
from tests.engine.test_logprobs import generate
from tests.gpu.test_cuda_engine import _prompts


def float32_engine(directory: Path, **options: Any) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(directory),
            device="cuda",
            dtype="float32",
            max_model_len=2048,
            kv_cache_memory_gb=2,
            max_num_seqs=16,  # graphs up to batch 16: a quicker start
            **options,
        )
    )


def test_speculation_equals_plain_decoding_on_cuda(tmp_path: Path) -> None:
    save_random_model(tmp_path, "llama-3.2-1b", torch.bfloat16)
    other = tmp_path / "other-draft"  # a small random model of the same vocabulary
    vocab_size = 128256
    save_tiny_llama(  # heads of 16 dimensions: the Triton kernels' smallest
        other,
        vocab_size=vocab_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=None,
        max_position_embeddings=2048,
    )
    save_word_tokenizer(other, vocab_size)
    prompts = _prompts(6)
    repetitive = prompts[0][:20] * 8
    requests = {
        **{
            f"greedy-{i}": (p, SamplingParams(max_tokens=48, ignore_eos=True))
            for i, p in enumerate([*prompts, repetitive])
        },
        "seeded": (repetitive, SamplingParams(max_tokens=48, temperature=0.8, seed=5)),
        "logprobs": (repetitive, SamplingParams(max_tokens=32, ignore_eos=True, logprobs=2)),
    }
    # Adaptive (the default) and, for the mechanism at work every step, fixed k never paused.
    never_paused = {"speculative_adaptive": False, "speculative_pause_acceptance": 0}
    methods = {
        "plain": {},
        "ngram": {"speculative_method": "ngram", "prompt_lookup_min": 1},
        "ngram fixed": {
            "speculative_method": "ngram",
            "prompt_lookup_min": 1,
            "num_speculative_tokens": 4,
            **never_paused,
        },
        "draft=self": {"speculative_model": str(tmp_path), **never_paused},
        # Every draft accepted, but each costs a whole target pass: it does not pay.
        "draft=self adaptive": {"speculative_model": str(tmp_path)},
        "draft=other": {"speculative_model": str(other), **never_paused},
    }
    results = {}
    counts = {}
    for method, speculative in methods.items():
        engine = float32_engine(tmp_path, **speculative)
        assert engine.overlap_steps and engine.runner.decode_graphs is not None
        # The greedy requests first, alone: their drafts are what the counts below weigh
        # (a sampled request's self-drafts are rejected as often as its samples differ from
        # the greedy draft, and at a fixed k of 16 never paused they outnumbered the rest).
        greedy = {key: value for key, value in requests.items() if key.startswith("greedy")}
        results[method] = generate(engine, greedy)
        counts[method] = (engine.num_draft_tokens, engine.num_accepted_tokens)
        results[method] |= generate(engine, {k: v for k, v in requests.items() if k not in greedy})
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert engine.runner.decode_graphs.num_replays > 0
        verify_graphs = engine.runner.verify_graphs
        if speculative:  # verify steps, where any ran, ran as graphs
            assert verify_graphs is not None
            assert (verify_graphs.num_replays > 0) == (engine.num_draft_tokens > 0)
            print(f"\n{method}: verify steps replayed {verify_graphs.num_replays} times")
        else:
            assert verify_graphs is None
        draft = (
            getattr(engine.proposer, "catch_up_graphs", None),
            getattr(engine.proposer, "decode_graphs", None),
        )
        if "speculative_model" in speculative:
            assert all(graphs is not None for graphs in draft)
            print(f"{method}: draft graphs replayed {[g.num_replays for g in draft]} times")
        if "speculative_model" in speculative and "speculative_adaptive" in speculative:
            # At a fixed k the draft's passes ran as graphs: its catch-up and its k-1 decode
            # passes. (Adaptive, a draft that does not pay only probes now and then, with one
            # draft and, after a long pause, a catch-up longer than a graph's: eagerly.)
            assert all(graphs.num_replays > 0 for graphs in draft)
        drafts, accepted = counts[method]
        print(f"\n{method}: the greedy requests' drafts {drafts}, accepted {accepted}")
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    # Prompt lookup drafts only where the output repeats its context, which a random model's
    # may not: its drafts are not counted on.
    drafts, accepted = counts["draft=self"]
    # The greedy requests accept all but near-ties (float32).
    assert drafts > 0 and accepted >= 0.8 * drafts
    # Adaptive, the policy measures that and pauses it: a probe now and then.
    assert counts["draft=self adaptive"][0] < 0.25 * counts["draft=self"][0]
    drafts, accepted = counts["draft=other"]
    assert drafts > 0 and accepted < 0.2 * drafts
    plain = results["plain"]
    for method in ("ngram", "ngram fixed", "draft=self", "draft=self adaptive", "draft=other"):
        for request_id in requests:
            ours = [t for o in results[method][request_id] for t in o.new_token_ids]
            theirs = [t for o in plain[request_id] for t in o.new_token_ids]
            assert ours == theirs, (method, request_id)


def test_verify_graph_equals_eager_verify(tmp_path: Path) -> None:
    """One verify step of five requests with 0 to 4 drafts (batch padded to the captured 8,
    rows padded to 5 tokens): its logits replayed from the verify graph and op by op."""
    save_random_model(tmp_path, "llama-3.2-1b", torch.bfloat16)
    engine = float32_engine(tmp_path, speculative_method="ngram", num_speculative_tokens=4)
    graphs = engine.runner.verify_graphs
    assert graphs is not None and graphs.query_len == 5
    prompts = _prompts(5)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1)
    for i, prompt in enumerate(prompts):  # one sampled row: the verify sampler's longer path
        sampling = seeded if i == 3 else SamplingParams(max_tokens=16)
        engine.add_request(b"gpu", f"verify{i}", prompt, sampling)
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    engine.sync()  # no step left in flight
    for drafts, request in enumerate(engine.scheduler.running):
        request.draft_token_ids = [7 + d for d in range(drafts)]
    batch = engine.scheduler.schedule()
    inputs = engine.runner.step_inputs(batch)
    # The step orders its rows longest context first, not as the running list holds them.
    assert inputs.uniform_query_len == 5 and sorted(inputs.num_drafts) == [0, 1, 2, 3, 4]
    with torch.inference_mode():
        eager = engine.runner.forward_eager(inputs)
        graphed = graphs.run(inputs).clone()
    assert graphed.shape == eager.shape == (15, engine.vocab_size)
    torch.testing.assert_close(graphed, eager, rtol=1e-3, atol=1e-3)
    # Launching the verify step (the graph, the sampler, the acceptance) never waits for the
    # device; reading it is the step's one synchronization.
    replays = graphs.num_replays
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = engine.runner.sample(engine.runner.forward(batch), None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert graphs.num_replays == replays + 1
    tokens = launched.result().token_ids
    assert all(1 <= len(t) <= 1 + d for d, t in zip(inputs.num_drafts, tokens, strict=True))
    for request in list(engine.requests.values()):
        engine.abort(request.client, request.request_id)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
