"""vLLM's sampling parameters (min_p, repetition_penalty, min_tokens, bad_words,
allowed_token_ids) against transformers' own logits processors on the same logits, and
through the whole engine against transformers' generation, with and without overlapped
steps (where the last token is still on the device when the next step's parameters are
built)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama
from transformers import (
    LogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from engine.backends.penalties import Penalties
from engine.backends.pytorch import TorchStepOps
from engine.backends.sampling_draw import Cuts, kept_by_cuts
from engine.execution.batch import sampling_tensors
from engine.execution.seen_tokens import SeenTokens
from engine.llm_engine import RequestRejected
from engine.sampling.sampler import (
    AllowedTokens,
    SamplingTensors,
    process_logits,
    sample,
)
from engine.scheduling.request import Request
from protocol import FinishReason, SamplingParams
from tandem.testing.random_checkpoint import VOCAB, random_prompts
from tandem.testing.reference import hf_greedy
from tests.engine.test_logprobs import generate
from tests.engine.test_overlap_steps import make_engine, tokens

EOS = VOCAB - 1  # the tiny checkpoints'
OPS = TorchStepOps()  # the CPU's argmax (the torch backend's)
CPU = torch.device("cpu")


def greedy_params(batch: int) -> SamplingTensors:
    def zeros(dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(batch, dtype=dtype)

    return SamplingTensors(
        temperature=zeros(torch.float32),
        top_p=torch.ones(batch),
        top_k=zeros(torch.int64),
        seed=zeros(torch.int64),
        step=zeros(torch.int64),
        any_top_k_or_p=False,
    )


def processed_greedy(
    model: HFLlama,
    prompt: list[int],
    steps: int,
    processors: list[LogitsProcessor],
    stop_token_ids: tuple[int, ...] = (),
) -> list[int]:
    """Greedy tokens, each the argmax of transformers' logits after ``processors`` (called
    on prompt and output so far, as generate() does), until a stop token."""
    output: list[int] = []
    for _ in range(steps):
        input_ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = model(input_ids).logits[:, -1].float()
        for processor in processors:
            logits = processor(input_ids, logits)
        token = int(logits.argmax())
        if token in stop_token_ids:
            break
        output.append(token)
    return output


# The sampler's operations against transformers' processors, on the same logits


def test_min_p_keeps_what_transformers_keeps() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    for temperature in (0.5, 1.0, 1.7):
        probs = torch.softmax(logits / temperature, dim=-1)
        ours = kept_by_cuts(probs, Cuts(None, None, min_p))
        for row, value in enumerate(min_p.tolist()):
            theirs = MinPLogitsWarper(value)(None, logits[row : row + 1] / temperature)[0]
            assert torch.equal(ours[row], theirs > float("-inf"))


def test_repetition_penalty_is_transformers() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 50)
    prompts = torch.tensor([[3, 7, 7, 20], [0, 1, 2, 3]])
    outputs = [[4, 20], [49]]
    penalty = torch.tensor([1.5, 0.7])
    counts = torch.zeros(2, 50)
    for row, output in enumerate(outputs):
        counts[row, output] += 1
    prompt_tokens = torch.zeros(2, 50, dtype=torch.bool)
    prompt_tokens[[[0] * 4, [1] * 4], prompts] = True
    params = greedy_params(2)
    params.penalties = Penalties(counts, torch.zeros(2), torch.zeros(2), penalty, prompt_tokens)
    ours = process_logits(logits, params, OPS)
    for row, output in enumerate(outputs):
        seen = torch.cat([prompts[row], torch.tensor(output)]).unsqueeze(0)
        theirs = RepetitionPenaltyLogitsProcessor(penalty[row].item())(seen, logits[row : row + 1])
        torch.testing.assert_close(ours[row], theirs[0])


def test_bans_are_transformers_bad_words_and_min_new_tokens() -> None:
    """Rows' last output tokens against bad words' prefixes, and stop tokens banned outright
    (min_tokens), as transformers' NoBadWords and MinNewTokensLength do."""
    torch.manual_seed(2)
    logits = torch.randn(2, 30)
    words = [[7], [5, 6, 11], [6, 12], [8, 9, 13], [9, 14]]
    # Row 1 has generated one token and is before its min_tokens: tokens 0 and 29 stop it.
    rows = [
        Request(
            b"t", "0", [1], SamplingParams(bad_words_token_ids=words), 0, output_token_ids=[5, 6]
        ),
        Request(
            b"t",
            "1",
            [1],
            SamplingParams(min_tokens=2, stop_token_ids=[0], bad_words_token_ids=words),
            0,
            output_token_ids=[9],
        ),
    ]
    no_pending = torch.zeros(0, dtype=torch.int64)
    params = sampling_tensors(rows, CPU, no_pending, [29], SeenTokens(len(rows), 30, CPU))
    assert params is not None
    ours = process_logits(logits, params, OPS)
    bad_words = NoBadWordsLogitsProcessor(words)
    theirs = bad_words(torch.tensor([[5, 6]]), logits[:1])
    assert torch.equal(ours[0], theirs[0])
    theirs = bad_words(torch.tensor([[9]]), logits[1:])
    theirs = MinNewTokensLengthLogitsProcessor(0, 2, [0, 29])(torch.tensor([[9]]), theirs)
    assert torch.equal(ours[1], theirs[0])
    assert (ours == float("-inf")).sum() == 4 + 3  # 7, 11, 12; then 7, 14, 0, 29


def test_allowed_tokens_are_the_only_ones_left() -> None:
    logits = torch.randn(3, 20)
    params = greedy_params(3)
    params.allowed = AllowedTokens(
        torch.tensor([True, False, True]), torch.tensor([0, 0, 2]), torch.tensor([4, 9, 17])
    )
    ours = process_logits(logits, params, OPS)
    assert set(torch.nonzero(ours[0] > float("-inf")).flatten().tolist()) == {4, 9}
    assert torch.equal(ours[1], logits[1])
    assert set(torch.nonzero(ours[2] > float("-inf")).flatten().tolist()) == {17}
    first = [4, 9][int(logits[0, [4, 9]].argmax())]
    assert sample(logits, params, OPS).tolist() == [first, int(logits[1].argmax()), 17]


def test_a_steps_token_lists_hold_each_id_once() -> None:
    """A request body may repeat an id a million times: the step's tensors hold each allowed
    token once, and a token repeated in the logit bias once with the sum of its values. The
    request converts its lists when it arrives; every step packs the arrays it made."""
    sampling = SamplingParams(
        temperature=1.0,
        allowed_token_ids=[5, 3] * 500_000,
        logit_bias_token_ids=[7, 9, 7],
        logit_bias_values=[1.0, -1.0, 2.0],
    )
    request = Request(b"t", "r", [1], sampling, seed=0)
    no_pending = torch.zeros(0, dtype=torch.int64)
    params = sampling_tensors([request], CPU, no_pending, [EOS], SeenTokens(1, VOCAB, CPU))
    assert params is not None and params.allowed is not None and params.logit_bias is not None
    assert params.allowed.token_ids.tolist() == [3, 5]
    assert params.logit_bias.token_ids.tolist() == [7, 9]
    assert params.logit_bias.values.tolist() == [3.0, -1.0]


def test_bans_cost_the_words_length_not_their_number_times_the_longest() -> None:
    """A step's bans hold each bad word's prefix tokens once, and none for the stop tokens
    that min_tokens bans: not, for every entry, a row as wide as the batch's longest word
    (a vocabulary of stop tokens, or another request's 128 short words, beside a word of
    1,000 tokens made hundreds of MB to GB a step)."""
    long_word = list(range(1, 101))
    short_words = [[1, token] for token in range(2, 130)]
    stopping = SamplingParams(
        max_tokens=200,
        min_tokens=200,
        stop_token_ids=list(range(VOCAB - 1)),
        bad_words_token_ids=[long_word],
    )
    rows = [
        Request(b"t", "long", [1], stopping, 0, output_token_ids=long_word[:-1]),
        Request(
            b"t",
            "short",
            [1],
            SamplingParams(bad_words_token_ids=short_words),
            0,
            output_token_ids=[1],
        ),
    ]
    no_pending = torch.zeros(0, dtype=torch.int64)
    params = sampling_tensors(rows, CPU, no_pending, [EOS], SeenTokens(len(rows), VOCAB, CPU))
    assert params is not None and params.banned is not None
    assert params.banned.prefix_tokens.numel() == len(long_word) - 1 + len(short_words)
    logits = process_logits(torch.zeros(2, VOCAB), params, OPS)
    assert (logits[0] == float("-inf")).all()  # every token stops: min_tokens bans them all
    assert torch.nonzero(logits[1] == float("-inf")).flatten().tolist() == list(range(2, 130))


# Through the engine, against transformers' generation


@pytest.mark.parametrize("overlap", [False, True], ids=["one-step-at-a-time", "overlapped"])
def test_repetition_penalty_matches_transformers_generate(
    tiny: tuple[Path, HFLlama], overlap: bool
) -> None:
    directory, hf_model = tiny
    prompts = random_prompts(5)[1:]
    penalties = [1.3, 2.0, 0.8, 1.0]
    requests = {
        str(i): (prompt, SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=p))
        for i, (prompt, p) in enumerate(zip(prompts, penalties, strict=True))
    }
    engine = make_engine(directory, overlap, max_num_batched_tokens=16, max_num_seqs=8)
    outputs = generate(engine, requests)
    for i, (prompt, penalty) in enumerate(zip(prompts, penalties, strict=True)):
        expected = hf_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=penalty,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt)),
        )[0, len(prompt) :].tolist()
        assert tokens(outputs[str(i)]) == expected
        if penalty > 1:
            assert expected != hf_greedy(hf_model, prompt, 16)  # the penalty changed something


@pytest.mark.parametrize("overlap", [False, True], ids=["one-step-at-a-time", "overlapped"])
def test_bad_words_match_transformers(tiny: tuple[Path, HFLlama], overlap: bool) -> None:
    directory, hf_model = tiny
    prompt = random_prompts(5)[4]
    plain = hf_greedy(hf_model, prompt, 16)
    # A two-token word the plain answer says at its third token, and a one-token word.
    words = [[plain[2], plain[3]], [plain[6]]]
    assert prompt[-1] != plain[2]  # vLLM matches the output only; transformers the prompt too
    sampling = SamplingParams(max_tokens=16, ignore_eos=True, bad_words_token_ids=words)
    outputs = generate(make_engine(directory, overlap), {"r": (prompt, sampling)})
    expected = processed_greedy(hf_model, prompt, 16, [NoBadWordsLogitsProcessor(words)])
    assert tokens(outputs["r"]) == expected
    assert expected[:3] == plain[:3] and expected[3] != plain[3]
    assert plain[6] not in expected


@pytest.mark.parametrize("overlap", [False, True], ids=["one-step-at-a-time", "overlapped"])
def test_min_tokens_keeps_eos_and_stop_tokens_out(
    tiny: tuple[Path, HFLlama], overlap: bool
) -> None:
    directory, hf_model = tiny
    prompt = random_prompts(5)[4]
    plain = hf_greedy(hf_model, prompt, 12)
    stop = plain[1]  # plain generation stops after one token
    # EOS made the likeliest token: without min_tokens, generation would end at once.
    eager_eos = {"logit_bias_token_ids": [EOS], "logit_bias_values": [50.0]}
    requests = {
        "stop": (prompt, SamplingParams(max_tokens=12, stop_token_ids=[stop], min_tokens=6)),
        "eos": (prompt, SamplingParams(max_tokens=12, min_tokens=4, **eager_eos)),
        "eos-at-once": (prompt, SamplingParams(max_tokens=12, **eager_eos)),
    }
    outputs = generate(make_engine(directory, overlap), requests)
    expected = processed_greedy(
        hf_model,
        prompt,
        12,
        [MinNewTokensLengthLogitsProcessor(len(prompt), 6, [stop, EOS])],
        stop_token_ids=(stop, EOS),
    )
    assert tokens(outputs["stop"]) == expected and len(expected) >= 6
    assert tokens(outputs["eos"]) == processed_greedy(
        hf_model, prompt, 4, [MinNewTokensLengthLogitsProcessor(len(prompt), 4, [EOS])]
    )
    assert outputs["eos"][-1].finish_reason == FinishReason.STOP
    assert outputs["eos"][-1].num_output_tokens == 4
    assert tokens(outputs["eos-at-once"]) == []


@pytest.mark.parametrize("overlap", [False, True], ids=["one-step-at-a-time", "overlapped"])
def test_allowed_token_ids_restrict_greedy_and_sampled_rows(
    tiny: tuple[Path, HFLlama], overlap: bool
) -> None:
    directory, hf_model = tiny
    prompt = random_prompts(4)[3]
    allowed = [3, 17, 80, 81, 200]
    requests = {
        "greedy": (prompt, SamplingParams(max_tokens=10, allowed_token_ids=allowed)),
        "sampled": (
            prompt,
            SamplingParams(max_tokens=10, temperature=1.5, seed=5, allowed_token_ids=allowed),
        ),
    }
    outputs = generate(make_engine(directory, overlap), requests)
    mask = torch.full((VOCAB,), float("-inf"))
    mask[allowed] = 0

    class Allowed(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return scores + mask

    assert tokens(outputs["greedy"]) == processed_greedy(hf_model, prompt, 10, [Allowed()])
    assert len(tokens(outputs["sampled"])) == 10 and set(tokens(outputs["sampled"])) <= set(allowed)


def test_min_p_one_samples_the_greedy_tokens(tiny: tuple[Path, HFLlama]) -> None:
    """min_p 1 keeps only the likeliest token; a lower one keeps what transformers keeps."""
    directory, hf_model = tiny
    prompt = random_prompts(4)[3]
    requests = {
        "one": (prompt, SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, min_p=1.0)),
        "half": (
            prompt,
            SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.3, seed=1, min_p=0.5),
        ),
    }
    outputs = generate(make_engine(directory, overlap=True), requests)
    assert tokens(outputs["one"]) == hf_greedy(hf_model, prompt, 10)
    sampled = tokens(outputs["half"])
    for step, token in enumerate(sampled):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + sampled[:step]])).logits[:, -1].float()
        kept = MinPLogitsWarper(0.5)(None, logits / 1.3)[0] > float("-inf")
        assert kept[token]


def test_bad_parameters_are_refused(tiny: tuple[Path, HFLlama]) -> None:
    directory, _ = tiny
    engine = make_engine(directory, overlap=False)
    refusals = {
        "min_p must be in [0, 1]": SamplingParams(min_p=1.5),
        # Past float32's reach, where the sampler's logits overflowed and its tokens were
        # garbage (a banned token, a grammar broken): refused, the server's way being greedy
        # below 1e-5.
        "repetition_penalty must be in [1e-06, 1000000.0]": SamplingParams(
            repetition_penalty=1e-300
        ),
        "temperature must be 0 (greedy) or a finite number of at least 1e-05": SamplingParams(
            temperature=1e-40
        ),
        "min_tokens must be in [0, max_tokens]": SamplingParams(max_tokens=4, min_tokens=5),
        "allowed_token_ids must not be empty": SamplingParams(allowed_token_ids=[]),
        "bad words may be 128 token sequences at most, none empty": SamplingParams(
            bad_words_token_ids=[[1], []]
        ),
        "prompt_logprobs must be in [0, 20]": SamplingParams(prompt_logprobs=21),
        r"token ids must be in [0, 256)": SamplingParams(allowed_token_ids=[VOCAB]),
    }
    for message, sampling in refusals.items():
        with pytest.raises(RequestRejected) as refused:
            engine.add_request(b"t", "r", [1, 2, 3], sampling)
        assert refused.value.message == message
    with pytest.raises(RequestRejected, match="token ids"):
        engine.add_request(b"t", "r", [1], SamplingParams(bad_words_token_ids=[[2, VOCAB]]))
    assert not engine.has_work
