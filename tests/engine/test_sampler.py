"""Batched sampling: greedy rows, seeded reproducibility, and top-k/top-p cuts."""

import torch

from engine.backends.penalties import Penalties, penalized
from engine.backends.pytorch import TorchStepOps
from engine.backends.sampling_draw import (
    COLUMN_MULTIPLIER,
    MASK32,
    Cuts,
    kept_by_cuts,
    mix32,
    row_keys,
    uniform_noise,
    unit_interval,
)
from engine.sampling.sampler import SamplingTensors, sample

OPS = TorchStepOps()  # the CPU's argmax (the torch backend's)


def _params(rows: list[tuple[float, float, int, int, int]], cut: bool = True) -> SamplingTensors:
    temperature, top_p, top_k, seed, step = zip(*rows, strict=True)
    return SamplingTensors(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_p=torch.tensor(top_p, dtype=torch.float32),
        top_k=torch.tensor(top_k),
        seed=torch.tensor(seed),
        step=torch.tensor(step),
        any_top_k_or_p=cut,
    )


def test_greedy_rows_take_the_argmax_next_to_sampled_rows() -> None:
    logits = torch.randn(3, 50)
    tokens = sample(logits, _params([(0, 1, 0, 1, 0), (1.0, 1, 0, 2, 0), (0, 0.5, 3, 3, 0)]), OPS)
    assert tokens[0] == logits[0].argmax()
    assert tokens[2] == logits[2].argmax()


def test_an_all_greedy_step_needs_no_parameters() -> None:
    logits = torch.randn(4, 50)
    assert torch.equal(sample(logits, None, OPS), logits.argmax(dim=-1))


def test_same_seed_and_step_give_the_same_token_whatever_the_batch() -> None:
    logits = torch.randn(1, 1000)
    alone = sample(logits, _params([(1.0, 1, 0, 42, 5)]), OPS)
    batch = torch.cat([torch.randn(2, 1000), logits])
    together = sample(
        batch, _params([(1.0, 1, 0, 7, 0), (0.8, 0.9, 0, 8, 3), (1.0, 1, 0, 42, 5)]), OPS
    )
    assert together[2] == alone[0]


def test_noise_depends_on_seed_and_step_and_is_uniform() -> None:
    seed = torch.tensor([1, 1, 2])
    step = torch.tensor([0, 1, 0])
    noise = uniform_noise(seed, step, 100_000)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert noise.min() > 0 and noise.max() < 1
    assert abs(noise.mean().item() - 0.5) < 0.01
    assert torch.equal(noise, uniform_noise(seed, step, 100_000))


def test_noise_on_the_cpu_has_the_bits_of_int64_lanes() -> None:
    """On the CPU the hash runs on numpy's uint32 lanes, whose products wrap: the bits of
    torch's int64 lanes, masked, as the torch backend on a GPU computes them."""
    seed = torch.tensor([0, 1, -1, 2**40 + 3, -(2**62)])
    step = torch.tensor([0, 5, 2**35, 1, 9])
    columns = torch.arange(70_000, dtype=torch.int64)
    keys = row_keys(seed, step).unsqueeze(1)
    bits = mix32(mix32(keys ^ ((columns * COLUMN_MULTIPLIER) & MASK32)))
    assert torch.equal(uniform_noise(seed, step, 70_000), unit_interval(bits))


def test_noise_stays_inside_the_unit_interval_at_its_extreme_hashes() -> None:
    """The smallest and largest 32-bit hashes map strictly inside (0, 1) in float32, so every
    exponential race is positive: a race of 0 made a forbidden token's 0 / 0 a NaN, which
    argmax picked (a structured output's grammar broken about once in 340 rows)."""
    bits = torch.tensor([0, 1, (1 << 31) - 1, (1 << 32) - 2, (1 << 32) - 1])
    noise = unit_interval(bits)
    assert noise.dtype == torch.float32
    assert (noise > 0).all() and (noise < 1).all()
    race = -noise.log()
    assert (race > 0).all()
    probs = torch.tensor([0.0, 0.7, 0.3, 0.0, 0.0])  # the last tokens forbidden
    assert (probs / race).argmax().item() in (1, 2)


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log().expand(20_000, 4)
    rows = [(1.0, 1.0, 0, 1234, step) for step in range(20_000)]
    tokens = sample(logits, _params(rows, cut=False), OPS)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, probs, atol=0.015)


def test_top_k_and_top_p_keep_only_the_head() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(2000, 5)
    top_k_rows = [(1.0, 1.0, 2, 99, step) for step in range(1000)]
    top_p_rows = [(1.0, 0.5, 0, 99, step) for step in range(1000)]
    tokens = sample(logits, _params(top_k_rows + top_p_rows), OPS)
    assert set(tokens[:1000].tolist()) == {0, 1}
    assert set(tokens[1000:].tolist()) == {0}  # token 0 alone holds over half the mass


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token() -> None:
    """A top_p below float32's least (1e-50 is 0 there) keeps the likeliest token, as any top_p
    does: it kept none, and argmax over all zeros took token 0, whatever the logits."""
    logits = torch.tensor([[0.0, 1.0, 4.0, 2.0]]).expand(100, 4)
    rows = [(1.0, 1e-50, 0, 7, step) for step in range(100)]
    assert set(sample(logits, _params(rows), OPS).tolist()) == {2}


def test_penalties_lower_the_tokens_already_generated() -> None:
    logits = torch.zeros(2, 4)
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    presence, frequency = torch.tensor([0.5, 0.0]), torch.tensor([1.0, -1.0])
    penalties = Penalties(counts, presence, frequency)
    expected = torch.tensor([[0.0, -1.5, -3.5, 0.0], [2.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(penalized(logits, penalties), expected)
    params = _params([(0, 1, 0, 1, 0), (0, 1, 0, 1, 0)])
    params.penalties = penalties
    assert sample(logits, params, OPS).tolist() == [0, 0]  # greedy rows see the penalties too


def test_top_k_and_top_p_on_the_cpu_keep_what_the_whole_sort_keeps() -> None:
    """The CPU orders only each row's largest probabilities, as many as hold its cuts
    (torch.topk); a row of a flat distribution cut by top-p 0.999 makes it order the whole
    vocabulary. Both keep the same tokens of the same rows, min-p before them or not: rows
    cut by top-k, top-p alone (a nucleus past the first 64 tokens too), both, and neither."""
    torch.manual_seed(4)
    probs = torch.softmax(torch.randn(6, 3000) * torch.tensor([[3], [3], [3], [3], [3], [1]]), -1)
    top_p = torch.tensor([0.9, 1.0, 0.5, 1.0, 0.3, 0.9])
    top_k = torch.tensor([20, 0, 3, 50, 0, 0])
    flat = torch.full((1, 3000), 1 / 3000)
    for min_p in (None, torch.tensor([0.0, 0.05, 0.1, 0.0, 0.2, 0.0])):
        ordered = kept_by_cuts(probs, Cuts(top_p, top_k, min_p))
        whole = torch.cat([top_p, torch.tensor([0.999])]), torch.cat([top_k, torch.tensor([0])])
        min_p_whole = None if min_p is None else torch.cat([min_p, torch.tensor([0.0])])
        sorted_all = kept_by_cuts(torch.cat([probs, flat]), Cuts(*whole, min_p_whole))
        assert torch.equal(ordered, sorted_all[:6])
        assert ordered[1].all() == (min_p is None)  # uncut: all kept, but for min-p
        assert ordered[3].sum() <= 50 and ordered[5].sum() > 64  # a nucleus past the first 64
