"""Users take turns through the whole engine when the KV cache is short: one user's flood of
requests, preempted and recomputed again and again, does not starve another user's few
(engine/scheduling/waiting_queue.py, engine/scheduling/scheduler.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol import SamplingParams, Scheduling

FLOOD = 16
LIGHT = 2
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tiny: tuple[Path, LlamaForCausalLM]) -> Path:
    """The engine tests' tiny Llama (tests/engine/conftest.py)."""
    return tiny[0]


def _finish_order(model_dir: Path, light_user: str) -> tuple[list[str], int]:
    """The order the requests finished in, and the preemptions: ``FLOOD`` requests of user
    "flood", then, once they run, ``LIGHT`` of ``light_user``, on 4 places and a cache of 20
    blocks of 4 tokens, where the 4 running requests (32 tokens each at their end) outgrow it."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), device="cpu", block_size=4, num_kv_blocks=20,
            max_model_len=64, max_num_seqs=4,
        )
    )  # fmt: skip
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for index in range(FLOOD):
        engine.add_request(
            b"s", f"flood-{index}", [5 + index] * 8, sampling, Scheduling(0, "flood")
        )
    finished: list[str] = []
    for _ in range(4):
        finished += [out.request_id for _, out in engine.step() if out.finish_reason]
    for index in range(LIGHT):
        engine.add_request(b"s", f"light-{index}", [7] * 8, sampling, Scheduling(0, light_user))
    while engine.has_work:
        finished += [out.request_id for _, out in engine.step() if out.finish_reason]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return finished, engine.scheduler.num_preemptions


def test_a_flood_under_preemption_does_not_starve_another_user(model_dir: Path) -> None:
    order, preemptions = _finish_order(model_dir, light_user="light")
    assert preemptions > 0  # the cache was short: requests were preempted and recomputed
    # Admitted in turns as places free, the light user's requests end with the first ones
    # admitted after the first wave, far before the flood's last.
    assert max(order.index(f"light-{index}") for index in range(LIGHT)) < len(order) // 2, order


def test_the_same_requests_from_one_user_wait_behind_the_flood(model_dir: Path) -> None:
    """The check above can fail: as the flood's own, the two requests finish last."""
    order, _ = _finish_order(model_dir, light_user="flood")
    assert sorted(order.index(f"light-{index}") for index in range(LIGHT)) == [
        len(order) - 2,
        len(order) - 1,
    ], order
