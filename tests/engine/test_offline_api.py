"""The offline API (``from engine import LLM, SamplingParams``) against transformers on the same
random weights: token-id and text prompts, chat through the template, log-probabilities, the
``python -m engine generate`` command."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from engine import LLM, SamplingParams
from tandem import REPO_ROOT
from tandem.testing.random_checkpoint import (
    VOCAB,
    random_prompts,
    save_tiny_llama,
    save_word_tokenizer,
)
from tandem.testing.reference import hf_greedy

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def worded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    """A tiny Llama whose tokenizer spells every id as a word, with a ChatML template."""
    directory = tmp_path_factory.mktemp("worded")
    model = save_tiny_llama(directory)
    save_word_tokenizer(directory, VOCAB)
    return directory, model


@pytest.fixture(scope="module")
def llm(worded: tuple[Path, LlamaForCausalLM]) -> LLM:
    return LLM(model=str(worded[0]), device="cpu", max_num_seqs=4)


def test_token_id_prompts_equal_transformers(
    llm: LLM, worded: tuple[Path, LlamaForCausalLM]
) -> None:
    prompts = random_prompts(4)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.prompt is None and output.prompt_token_ids == prompt
        (completion,) = output.outputs
        assert completion.token_ids == hf_greedy(worded[1], prompt, 8)
        assert completion.finish_reason == "length" and output.finished
        # Decoded after the prompt, as the servers decode: the first word's space is kept.
        assert completion.text == " " + llm.tokenizer.decode(completion.token_ids)


def test_text_prompt_is_tokenized_and_answer_detokenized(
    llm: LLM, worded: tuple[Path, LlamaForCausalLM]
) -> None:
    (output,) = llm.generate("w5 w6 a b", GREEDY, use_tqdm=False)
    ids = llm.tokenizer.encode("w5 w6 a b").ids
    assert output.prompt == "w5 w6 a b" and output.prompt_token_ids == ids
    assert output.outputs[0].token_ids == hf_greedy(worded[1], ids, 8)
    # One word per id, joined by the decoder.
    words = output.outputs[0].text.split()
    assert [llm.tokenizer.token_to_id(w) for w in words] == output.outputs[0].token_ids


def test_chat_renders_the_model_template(llm: LLM, worded: tuple[Path, LlamaForCausalLM]) -> None:
    messages = [{"role": "user", "content": "w7 w8"}]
    (output,) = llm.chat(messages, GREEDY, use_tqdm=False)
    rendered = "<|im_start|>user\nw7 w8<|im_end|>\n<|im_start|>assistant\n"
    assert output.prompt == rendered
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert output.prompt_token_ids == ids
    assert output.outputs[0].token_ids == hf_greedy(worded[1], ids, 8)


def test_logprobs_are_the_models(llm: LLM, worded: tuple[Path, LlamaForCausalLM]) -> None:
    prompt = random_prompts(3)[2]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    (output,) = llm.generate([prompt], sampling, use_tqdm=False)
    completion = output.outputs[0]
    with torch.no_grad():
        logits = worded[1](torch.tensor([prompt + completion.token_ids])).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    for i, (token, logprobs) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        position = len(prompt) - 1 + i
        assert len(logprobs) in (2, 3) and token in logprobs
        for candidate, value in logprobs.items():
            assert value == pytest.approx(expected[position, candidate].item(), abs=1e-4)
    total = sum(lp[t] for t, lp in zip(completion.token_ids, completion.logprobs, strict=True))
    assert completion.cumulative_logprob == pytest.approx(total)
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt)
    for position, (token, logprobs) in enumerate(
        zip(prompt[1:], output.prompt_logprobs[1:], strict=True)
    ):
        assert logprobs is not None
        assert logprobs[token] == pytest.approx(expected[position, token].item(), abs=1e-4)


def test_n_completions_per_prompt(llm: LLM) -> None:
    """A seeded prompt's n completions are those of the seeds seed, seed + 1, ... (as the
    servers' n choices); greedy ones are all alike."""
    sampled = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=7, n=3)
    outputs = llm.generate(
        [[5, 6, 7], [9]], [sampled, dataclasses.replace(GREEDY, n=2)], use_tqdm=False
    )
    assert [len(o.outputs) for o in outputs] == [3, 2]
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2]
    assert outputs[0].finished and outputs[1].finished
    for index, completion in enumerate(outputs[0].outputs):
        one = dataclasses.replace(sampled, n=1, seed=7 + index)
        (alone,) = llm.generate([[5, 6, 7]], one, use_tqdm=False)
        assert completion.token_ids == alone.outputs[0].token_ids
        assert completion.text == alone.outputs[0].text
    assert len({tuple(c.token_ids) for c in outputs[0].outputs}) > 1
    assert outputs[1].outputs[0].token_ids == outputs[1].outputs[1].token_ids


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "draft-model"])
def test_stop_strings_end_the_text_as_the_servers_do(
    llm: LLM, worded: tuple[Path, LlamaForCausalLM], speculative: bool
) -> None:
    """The text ends before the first stop string (after it with include_stop_str_in_output)
    and the tokens at the one that completes it; with drafts verified, several tokens a
    step, the same."""
    if speculative:
        directory = str(worded[0])
        # vLLM's way to ask for a draft model.
        config = {"model": directory, "num_speculative_tokens": 3}
        # At a fixed k: adaptive, a draft that costs a target pass a token is paused.
        llm = LLM(
            model=directory,
            device="cpu",
            speculative_config=config,
            speculative_adaptive=False,
        )
        assert llm.engine.proposer is not None
        with pytest.raises(ValueError, match="unknown keys \\['draft'\\]"):
            LLM(model=directory, device="cpu", speculative_config={"draft": directory})
    long = SamplingParams(max_tokens=24, ignore_eos=True)
    (full,) = llm.generate([[5, 6, 7]], long, use_tqdm=False)
    text, token_ids = full.outputs[0].text, full.outputs[0].token_ids
    stop = text.split()[6]
    at = text.find(stop)
    for include in (False, True):
        sampling = dataclasses.replace(
            long, stop=["never there", stop], include_stop_str_in_output=include
        )
        (output,) = llm.generate([[5, 6, 7]], sampling, use_tqdm=False)
        completion = output.outputs[0]
        assert completion.finish_reason == "stop"
        assert completion.text == text[: at + len(stop) if include else at]
        ids = completion.token_ids
        assert ids == token_ids[: len(ids)]
        assert stop in llm.tokenizer.decode(ids) and stop not in llm.tokenizer.decode(ids[:-1])
    if speculative:
        assert llm.engine.num_accepted_tokens > 0
        assert not llm.engine.has_work  # the stopped request was aborted


def test_a_refused_prompt_raises_and_generates_nothing(llm: LLM) -> None:
    """Refused by the engine (too long) or by the offline API (n = 0), a prompt after one
    already added: the call raises, and nothing of it stays in the engine."""
    too_long = SamplingParams(max_tokens=10_000)
    for refused, reason in ((too_long, "prompt 1"), (SamplingParams(n=0), "n must be")):
        with pytest.raises(ValueError, match=reason):
            llm.generate([[5, 6], [7, 8]], [GREEDY, refused], use_tqdm=False)
        assert not llm.engine.has_work
    (output,) = llm.generate([[5, 6]], GREEDY, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8


def test_embed_is_the_last_hidden_state_normalized(
    llm: LLM, worded: tuple[Path, LlamaForCausalLM]
) -> None:
    """As /v1/embeddings: transformers' last hidden state at the last token, L2-normalized, for
    token-id prompts and a text one (tokenized as generate tokenizes it); a refused prompt
    raises and embeds nothing."""
    prompts: list = [*random_prompts(3), "w3 w4 w5"]
    outputs = llm.embed(prompts, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = prompt if isinstance(prompt, list) else llm.tokenizer.encode(prompt).ids
        assert output.prompt_token_ids == ids and output.finished
        with torch.no_grad():
            hidden = worded[1].model(torch.tensor([ids])).last_hidden_state[0, -1].float()
        expected = torch.nn.functional.normalize(hidden, dim=0)
        torch.testing.assert_close(
            torch.tensor(output.outputs.embedding), expected, rtol=1e-4, atol=1e-5
        )
    with pytest.raises(ValueError, match="prompt 1"):
        llm.embed([[5, 6], []], use_tqdm=False)
    assert not llm.engine.has_work


def test_generate_command_prints_the_answer(
    llm: LLM, worded: tuple[Path, LlamaForCausalLM]
) -> None:
    command = [sys.executable, "-m", "engine", "generate", "--model", str(worded[0])]
    command += ["--device", "cpu", "--prompt", "w5 w6", "--max-tokens", "5", "--temperature", "0"]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=300,
        check=True,
    )
    # The model has a chat template: the prompt is a user message.
    (expected,) = llm.chat([{"role": "user", "content": "w5 w6"}], SamplingParams(max_tokens=5))
    assert result.stdout.strip() == expected.outputs[0].text.strip()
    assert result.stdout.strip()
