"""Incremental detokenization and stop strings, on real tokenizers trained here."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from protocol.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Héllo wörld! Ça va très bien, merci. Naïve café crème brûlée.",
    "你好，世界。今天天气很好。",
    "Emoji party 🎉🎊😀👍🏽 and flags 🇫🇷🇯🇵",
    "The quick brown fox jumps over the lazy dog.",
] * 10

TEXTS = [
    "Héllo wörld! 你好世界 🎉 The quick brown fox.",
    "🇯🇵🇫🇷 👍🏽 naïve brûlée — «ça» 今天",
    "plain ascii only",
    "日本語のテキスト，还有中文。😀😀😀",
]


def byte_level_bpe() -> Tokenizer:
    """GPT-2 / Llama 3 style: bytes as symbols; few merges, so characters span tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def metaspace_byte_fallback_bpe() -> Tokenizer:
    """Llama 2 / Mistral style: "▁" for spaces, <0xNN> tokens for rare characters, and a
    decoder that strips the leading space of the whole text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(vocab_size=200, limit_alphabet=25, special_tokens=["<s>", "</s>"])
    tokenizer.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return Tokenizer.from_str(json.dumps(spec))


TOKENIZERS = {
    "byte_level": byte_level_bpe(),
    "metaspace_byte_fallback": metaspace_byte_fallback_bpe(),
}


@pytest.fixture(params=sorted(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return TOKENIZERS[request.param]


def stream(detokenizer: IncrementalDetokenizer, steps: list[list[int]]) -> list[str]:
    pieces = [detokenizer.push(step) for step in steps]
    pieces.append(detokenizer.finish())
    return pieces


def one_by_one(ids: list[int]) -> list[list[int]]:
    return [[token_id] for token_id in ids]


def test_characters_really_span_tokens(tokenizer: Tokenizer) -> None:
    # Without this the tests below would prove nothing about partial characters.
    ids = tokenizer.encode(TEXTS[0]).ids
    assert any("\ufffd" in tokenizer.decode([token_id]) for token_id in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_decoding_all(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text).ids
    pieces = stream(IncrementalDetokenizer(tokenizer, []), one_by_one(ids))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("seed", range(5))
def test_several_tokens_per_step_equals_decoding_all(tokenizer: Tokenizer, seed: int) -> None:
    ids = tokenizer.encode(" ".join(TEXTS)).ids
    rng = random.Random(seed)
    steps, start = [], 0
    while start < len(ids):
        size = rng.randint(1, 4)
        steps.append(ids[start : start + size])
        start += size
    pieces = stream(IncrementalDetokenizer(tokenizer, []), steps)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("step_size", [2, 3, 5])
def test_steps_that_each_end_inside_a_character(tokenizer: Tokenizer, step_size: int) -> None:
    """A run of emoji in steps of several tokens (verified drafts, or outputs merged while a
    server falls behind) ends step after step inside a character. The characters completed
    within a step go out with it, the incomplete one waits: held whole, such steps reached
    the bound on held steps and a U+FFFD went out mid-stream."""
    ids = tokenizer.encode("😀🎉👍🏽🇯🇵" * 40).ids
    pieces = stream(IncrementalDetokenizer(tokenizer, []), steps_of(ids, str(step_size)))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


class CountingTokenizer:
    """A tokenizer that counts the ids it decodes: the detokenizer's work."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_tokens_that_never_complete_a_character_cost_a_bounded_window(
    tokenizer: Tokenizer,
) -> None:
    """A request that may sample only one token ending inside a character (a UTF-8 lead
    byte) never completes one; nor do special tokens that decode to nothing. Each step
    decodes the held window, so held for ever it made detokenizing quadratic in the output's
    length (a server's event loop blocked for seconds); held for a few steps, the work stays
    linear, and the text is what decoding them all says."""
    lead_bytes = [
        token_id
        for token_id in range(tokenizer.get_vocab_size())
        if tokenizer.decode([token_id]) == "\ufffd"
        and tokenizer.decode([token_id] * 2) == "\ufffd" * 2
    ]
    special = tokenizer.token_to_id("<|im_end|>") or tokenizer.token_to_id("</s>")
    for ids in ([lead_bytes[0]] * 4000, [special] * 4000):
        counting = CountingTokenizer(tokenizer)
        pieces = stream(IncrementalDetokenizer(counting, []), one_by_one(ids))  # type: ignore[arg-type]
        assert "".join(pieces) == tokenizer.decode(ids)
        assert counting.decoded < 64 * len(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_emitted_text_is_final(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text).ids
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    emitted = ""
    for token_id in ids:
        emitted += detokenizer.push([token_id])
        assert tokenizer.decode(ids).startswith(emitted)  # never retracted or changed


def test_complete_text_is_not_held_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.").ids
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    emitted = ""
    for count, token_id in enumerate(ids, start=1):
        emitted += detokenizer.push([token_id])
        assert emitted == tokenizer.decode(ids[:count])


def test_output_after_a_prompt_decodes_as_in_the_full_text(tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("The quick brown").ids
    output_ids = tokenizer.encode(" fox jumps, très bien 🎉").ids
    if tokenizer is TOKENIZERS["metaspace_byte_fallback"]:
        output_ids = output_ids[1:]  # the prepended "▁" already stands for the space
    pieces = stream(IncrementalDetokenizer(tokenizer, prompt_ids), one_by_one(output_ids))
    full = tokenizer.decode(prompt_ids + output_ids)
    prompt = tokenizer.decode(prompt_ids)
    # The first output token keeps its leading space, which decoding it alone would drop
    # for SentencePiece-style decoders.
    assert "".join(pieces) == full[len(prompt) :]
    assert pieces[0].startswith(" ")


def test_special_tokens_are_skipped() -> None:
    tokenizer = TOKENIZERS["byte_level"]
    special = tokenizer.token_to_id("<|im_end|>")
    assert special is not None
    ids = [*tokenizer.encode("Héllo").ids, special, *tokenizer.encode(" wörld").ids]
    pieces = stream(IncrementalDetokenizer(tokenizer, []), one_by_one(ids))
    assert "".join(pieces) == "Héllo wörld"


def test_incomplete_character_at_the_end_is_flushed_as_decode_does() -> None:
    tokenizer = TOKENIZERS["byte_level"]
    ids = tokenizer.encode("ok 🎉").ids[:-1]  # cut inside the emoji (a length limit)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    held = [detokenizer.push([token_id]) for token_id in ids]
    assert "\ufffd" not in "".join(held)
    assert "".join(held) + detokenizer.finish() == tokenizer.decode(ids)


# Stop strings


def run_with_stop(
    tokenizer: Tokenizer, text: str, stop: list[str], include_stop: bool = False
) -> tuple[list[str], IncrementalDetokenizer, int]:
    """Pieces emitted token by token until a stop string; and the tokens consumed."""
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop, include_stop)
    pieces, consumed = [], 0
    for token_id in tokenizer.encode(text).ids:
        pieces.append(detokenizer.push([token_id]))
        consumed += 1
        if detokenizer.stopped:
            return pieces, detokenizer, consumed
    pieces.append(detokenizer.finish())
    return pieces, detokenizer, consumed


def test_output_is_cut_before_the_stop_string(tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    pieces, detokenizer, consumed = run_with_stop(tokenizer, text, ["jumps"])
    assert detokenizer.stopped
    assert "".join(pieces) == "The quick brown fox "
    assert consumed < len(tokenizer.encode(text).ids)  # the caller can abort early
    assert detokenizer.push(tokenizer.encode(" more").ids) == ""
    assert detokenizer.finish() == ""


def test_stop_string_across_token_boundaries(tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps."
    assert len(tokenizer.encode("n fox j").ids) > 1
    pieces, detokenizer, _ = run_with_stop(tokenizer, text, ["n fox j"])
    assert detokenizer.stopped
    assert "".join(pieces) == "The quick brow"


def test_multi_byte_stop_string_split_inside_characters(tokenizer: Tokenizer) -> None:
    text = "Héllo 你好世界 🎉 bye"
    pieces, detokenizer, _ = run_with_stop(tokenizer, text, ["世界 🎉"])
    assert detokenizer.stopped
    assert "".join(pieces) == "Héllo 你好"
    assert not any("\ufffd" in piece for piece in pieces)


def test_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    pieces, _, _ = run_with_stop(tokenizer, text, ["lazy", "fox", "over"])
    assert "".join(pieces) == "The quick brown "


def test_stop_string_included_ends_the_text(tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    pieces, detokenizer, _ = run_with_stop(tokenizer, text, ["lazy", "n fox j"], True)
    assert detokenizer.stopped
    assert "".join(pieces) == "The quick brown fox j"
    # A step of several tokens is read as steps of one: of two stop strings that start
    # together, the one that ends in an earlier token ends the text, whichever is listed first.
    detokenizer = IncrementalDetokenizer(tokenizer, [], ["fox jumps", "fox"], include_stop=True)
    assert detokenizer.push(tokenizer.encode(text).ids) == "The quick brown fox"


def test_possible_stop_string_is_held_then_released(tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    stop = ["fox jumps under"]
    pieces, detokenizer, _ = run_with_stop(tokenizer, text, stop)
    assert not detokenizer.stopped
    assert "".join(pieces) == tokenizer.decode(tokenizer.encode(text).ids)
    # While "fox jumps " could still become the stop string, it was held back.
    emitted = ""
    for piece in pieces:
        emitted += piece
        if emitted.endswith("brown "):
            break
    assert emitted == "The quick brown "
    later = "".join(pieces)[len(emitted) :]
    assert later.startswith("fox jumps over")


def test_partial_stop_string_at_the_end_is_released_on_finish() -> None:
    tokenizer = TOKENIZERS["byte_level"]
    detokenizer = IncrementalDetokenizer(tokenizer, [], ["dog house"])
    text = "".join(detokenizer.push([i]) for i in tokenizer.encode("the lazy dog").ids)
    assert text == "the lazy "
    assert detokenizer.finish() == "dog"
    assert not detokenizer.stopped


def test_stop_string_in_the_first_step() -> None:
    tokenizer = TOKENIZERS["byte_level"]
    detokenizer = IncrementalDetokenizer(tokenizer, [], ["Hé"])
    assert detokenizer.push(tokenizer.encode("Héllo").ids) == ""
    assert detokenizer.stopped


def test_special_tokens_kept_but_the_hidden_ones() -> None:
    """With a parser reading markers, special tokens' text stays, but not the end of turn."""
    tokenizer = byte_level_bpe()
    marker, end = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    ids = [marker, *tokenizer.encode("plain ascii").ids, end]
    kept = IncrementalDetokenizer(tokenizer, [], hidden_ids=frozenset([end]))
    assert "".join(stream(kept, one_by_one(ids))) == "<|endoftext|>plain ascii"
    skipped = IncrementalDetokenizer(tokenizer, [])
    assert "".join(stream(skipped, one_by_one(ids))) == "plain ascii"


def vllm_stop_cut(tokenizer: Tokenizer, ids: list[int], stops: list[str], min_tokens: int) -> str:
    """The text before the stop, as vLLM finds it: after each token past the first
    ``min_tokens``, a stop string that ends in that token's text."""
    for count in range(min_tokens + 1, len(ids) + 1):
        text = tokenizer.decode(ids[:count])
        new = len(text) - len(tokenizer.decode(ids[: count - 1]))
        found = [text.find(stop, max(len(text) - new - len(stop) + 1, 0)) for stop in stops]
        if any(i >= 0 for i in found):
            return text[: min(i for i in found if i >= 0)]
    raise AssertionError("no stop")


@pytest.mark.parametrize("min_tokens", range(12))
def test_stop_strings_count_after_min_tokens(tokenizer: Tokenizer, min_tokens: int) -> None:
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog.").ids
    stops = ["o", "own fox j"]  # the longer one is held while the shorter one is in it
    detokenizer = IncrementalDetokenizer(tokenizer, [], stops, min_tokens=min_tokens)
    pieces = []
    for token_id in ids:
        pieces.append(detokenizer.push([token_id]))
        if detokenizer.stopped:
            break
    assert detokenizer.stopped
    assert "".join(pieces) == vllm_stop_cut(tokenizer, ids, stops, min_tokens)


def steps_of(ids: list[int], sizes: str) -> list[list[int]]:
    """``ids`` cut into steps of ``sizes`` tokens each ("2", "3", ...), or of 1 to 5 at
    random ("random")."""
    rng = random.Random(len(ids))
    steps, start = [], 0
    while start < len(ids):
        size = rng.randint(1, 5) if sizes == "random" else int(sizes)
        steps.append(ids[start : start + size])
        start += size
    return steps


def stopped_stream(detokenizer: IncrementalDetokenizer, steps: list[list[int]]) -> tuple[str, int]:
    """The text up to the stop string and the number of tokens it took."""
    pieces, taken = [], 0
    for step in steps:
        pieces.append(detokenizer.push(step))
        taken += detokenizer.tokens_taken
        if detokenizer.stopped:
            return "".join(pieces), taken
    raise AssertionError("no stop")


@pytest.mark.parametrize("sizes", ["2", "3", "5", "random"])
@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("stop", ["o", "own fox j", "世界", "😀", ". 你"])
def test_stop_strings_in_steps_of_several_tokens_as_in_steps_of_one(
    tokenizer: Tokenizer, stop: str, include_stop: bool, sizes: str
) -> None:
    """A step of verified drafts holds several tokens. The text it cuts at a stop string, and
    the tokens that text took (the answer's usage and log-probabilities), are those of one
    token per step, ``min_tokens`` included: a stop string that ends in the text of one of
    the first ``min_tokens`` tokens did not count when a later token of the step passed them."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. 你好世界 🎉😀 end").ids
    for min_tokens in range(14):
        options = {"stop": [stop], "include_stop": include_stop, "min_tokens": min_tokens}
        expected = stopped_stream(IncrementalDetokenizer(tokenizer, [], **options), one_by_one(ids))
        got = stopped_stream(IncrementalDetokenizer(tokenizer, [], **options), steps_of(ids, sizes))
        assert got == expected, min_tokens
