"""A step's decodes come longest context first, whatever order the requests came in
(engine/scheduling/scheduler.py: at a large batch the GPU starts their attention programs in
batch order, and a long one started last would keep the others' SMs waiting); the running
requests keep their age order, which preemption follows."""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import SamplingParams


def test_decodes_are_scheduled_longest_context_first(tiny: tuple[Path, LlamaForCausalLM]) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny[0]), device="cpu", max_num_seqs=8))
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    lengths = {"a": 5, "b": 30, "c": 12, "d": 30, "e": 1}
    for request_id, length in lengths.items():
        engine.add_request(b"t", request_id, [3] * length, sampling)
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    engine.sync()
    batch = engine.scheduler.schedule()
    assert [r.request_id for r in batch] == ["b", "d", "c", "a", "e"]  # ties in age order
    assert [r.request_id for r in engine.scheduler.running] == list(lengths)
    contexts = [r.num_tokens for r in batch]
    assert contexts == sorted(contexts, reverse=True) and all(
        r.num_scheduled_tokens == 1 for r in batch
    )
