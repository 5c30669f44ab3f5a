"""Speculative decoding through real processes: an engine with a draft model (the tiny target
as its own draft) serves completions over HTTP, and the servers' /metrics count its drafted
and accepted tokens."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tandem.testing.processes import SMALL_KV_CACHE, free_port, start_engine, start_server
from tandem.testing.random_checkpoint import save_tiny_word_model


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_draft_model_serves_and_its_acceptance_is_in_the_metrics(
    tmp_path: Path, subprocess_cleanup: list[subprocess.Popen]
) -> None:
    model = tmp_path / "model"
    save_tiny_word_model(model)
    address = f"ipc://{tmp_path}/engine.sock"
    log_path = tmp_path / "log.txt"
    # At a fixed k: adaptive, a draft that costs a target pass a token is paused.
    engine_args = [
        "--model",
        str(model),
        "--speculative-model",
        str(model),
        "--no-speculative-adaptive",
    ]
    subprocess_cleanup.append(start_engine(address, log_path, *engine_args, *SMALL_KV_CACHE))
    port = free_port()
    subprocess_cleanup.append(start_server(address, port, log_path))
    url = f"http://127.0.0.1:{port}"
    before = scrape(url)
    assert before["tandem_spec_decode_num_draft_tokens_total"] == 0
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(
        model=client.models.list().data[0].id,
        prompt="w3 w4 w5",
        max_tokens=16,
        temperature=0,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.finish_reason for c in completion.choices] == ["length", "length"]
    assert completion.choices[0].text == completion.choices[1].text  # greedy
    after = scrape(url)
    drafted = after["tandem_spec_decode_num_draft_tokens_total"]
    assert drafted > 0
    # The target drafting for itself: every draft is its greedy token.
    assert after["tandem_spec_decode_num_accepted_tokens_total"] == drafted
