"""Read a Hugging Face checkpoint directory: config.json, safetensors and tokenizer files.

config.json stays a dict here: each family in ``engine.models`` reads it, with
``hf_config_fields`` for the fields that every family's config.json spells alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from engine.checkpoint.checkpoint import SliceStream
from engine.checkpoint.generation_config import read_sampling_defaults
from engine.checkpoint.pooling_config import read_pooling
from engine.model_config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    Quantization,
    RopeScaling,
    TokenizerInfo,
    YarnScaling,
)
from protocol import SamplingDefaults
from protocol.eos import eos_token_ids


@dataclass(frozen=True)
class HFDirectory:
    """A checkpoint directory's config.json, read, and its other files, found."""

    name: str  # the model name shown to users
    path: Path
    config: dict[str, Any] = field(repr=False)  # config.json

    def tokenizer(self) -> TokenizerInfo:
        return hf_tokenizer_info(self.path, self.config)

    def sampling_defaults(self) -> SamplingDefaults:
        """What its generation_config.json recommends for sampling."""
        return read_sampling_defaults(self.path)

    def pooling(self) -> str:
        """How its embeddings pool (engine/checkpoint/pooling_config.py)."""
        return read_pooling(self.path)

    def weights(self) -> SliceStream:
        """(name, tensor not read yet) as stored. The files are found only now: a directory
        without them still serves a model of random weights (``--load-format dummy``)."""
        for file in safetensors_files(self.path):
            # safe_open memory-maps the file; a slice reads only its own rows into memory.
            with _open_safetensors(file) as shard:
                for name in shard.keys():  # noqa: SIM118 -- safe_open is no dict
                    yield name, SafetensorsSlices(shard.get_slice(name))


def _open_safetensors(file: Path) -> Any:
    """``safe_open(file)``; a header it cannot read (truncated, corrupt, offsets or shapes that
    do not fit) is refused naming the file, which safetensors' own error does not."""
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as error:
        raise ValueError(f"{file}: not a readable safetensors file: {error}") from None


class SafetensorsSlices:
    """A tensor of a memory-mapped safetensors file (safetensors' ``PySafeSlice``)."""

    def __init__(self, stored: Any) -> None:
        self.stored = stored

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stored.get_shape())

    def read(self, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        if length is None:
            return self.stored[...]  # 0-dim ones too (an FP8 checkpoint's per-tensor scales)
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self.stored[index]


def read_hf_directory(path: Path, name: str | None = None) -> HFDirectory:
    """The directory's config and weight files; ``name`` overrides the directory's."""
    return HFDirectory(
        name=name or path.resolve().name,
        path=path,
        config=_read_json(path / "config.json"),
    )


def hf_architecture(config: Mapping[str, Any]) -> str | None:
    """The model class config.json names, e.g. "LlamaForCausalLM"."""
    return (config.get("architectures") or [None])[0]


def hf_config_fields(
    config: Mapping[str, Any],
    path: Path,
    default_rope_theta: float = 10_000.0,
    default_local_rope_theta: float | None = None,
) -> dict[str, Any]:
    """The ``ModelConfig`` fields that config.json spells alike for every family, in
    transformers' older format or in that of v5.

    ``default_local_rope_theta`` not None: sliding layers have a RoPE base of their own, with
    this default. The defaults are transformers' for the family, where a config leaves them out.
    """
    num_heads = config["num_attention_heads"]
    return {
        "architecture": hf_architecture(config),
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "num_attention_heads": num_heads,
        "num_key_value_heads": config.get("num_key_value_heads") or num_heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // num_heads,
        "max_position_embeddings": config["max_position_embeddings"],
        "rms_norm_eps": float(config["rms_norm_eps"]),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        "hidden_act": config.get("hidden_act", "silu"),
        "quantization": hf_quantization(config, path),
        **_rope_fields(config, path, default_rope_theta, default_local_rope_theta),
    }


def hf_quantization(config: Mapping[str, Any], path: Path) -> Quantization | None:
    """The stored format of a pre-quantized checkpoint, from config.json's
    ``quantization_config``, where it is one we load as vLLM does: ``quant_method`` "fp8",
    float8 e4m3 ``*.weight`` with a per-tensor or per-channel ``*.weight_scale`` each.

    Activations are quantized per token as they come, whatever ``activation_scheme`` says (a
    static scheme's ``*.input_scale`` are not read). Anything else is refused by name."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{path}: quantization_config's quant_method {method!r} is not supported; "
            "pre-quantized checkpoints load only as 'fp8' (float weights can be quantized "
            "at load with --quantization fp8 or int8)"
        )
    if quantization.get("weight_block_size") is not None:
        raise ValueError(
            f"{path}: block-wise FP8 (weight_block_size "
            f"{quantization['weight_block_size']}) is not supported, only per-tensor or "
            "per-channel weight scales"
        )
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{path}: FP8 format {quantization['fmt']!r}: only e4m3 is supported")
    # Layers left in the model's dtype: the LM head is (it always is here); any other would
    # need a second kind of linear layer.
    ignored = quantization.get("ignored_layers") or quantization.get("modules_to_not_convert")
    kept = [name for name in ignored or [] if not name.endswith("lm_head")]
    if kept:
        raise ValueError(
            f"{path}: FP8 checkpoints whose linear layers are partly unquantized "
            f"(ignored_layers {kept[:3]}) are not supported"
        )
    return Quantization("fp8", checkpoint_scales=True)


def check_layer_types(layer_types: list[str] | None, num_layers: int, path: Path) -> None:
    if layer_types is None:
        return
    known = {FULL_ATTENTION, SLIDING_ATTENTION}
    if len(layer_types) != num_layers or not set(layer_types) <= known:
        raise ValueError(
            f"{path}: layer_types must name {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r} for each "
            f"of the {num_layers} layers, not {layer_types}"
        )


def _rope_fields(
    config: Mapping[str, Any], path: Path, full_theta: float, local_theta: float | None
) -> dict[str, Any]:
    """RoPE of the full layers (base, Llama 3 or linear scaling) and of sliding layers that
    have their own (``local_theta`` not None), from the older format or transformers 5's."""
    parameters = config.get("rope_parameters") or {}
    if FULL_ATTENTION in parameters:  # transformers 5, per layer type (Gemma 3)
        full, sliding = parameters[FULL_ATTENTION], parameters.get(SLIDING_ATTENTION) or {}
    else:  # transformers 5 for all layers, or older: rope_theta beside rope_scaling
        full = {"rope_theta": config.get("rope_theta", full_theta)}
        full |= config.get("rope_scaling") or parameters
        sliding = {"rope_theta": config.get("rope_local_base_freq", local_theta)}
    fields: dict[str, Any] = {"rope_theta": float(full.get("rope_theta", full_theta))}
    rope_type = full.get("rope_type", full.get("type", "default"))
    if rope_type == "llama3":
        fields["rope_scaling"] = RopeScaling(
            factor=float(full["factor"]),
            low_freq_factor=float(full["low_freq_factor"]),
            high_freq_factor=float(full["high_freq_factor"]),
            original_max_position_embeddings=full["original_max_position_embeddings"],
        )
    elif rope_type == "linear":
        fields["rope_linear_factor"] = float(full["factor"])
    elif rope_type == "yarn":
        if "original_max_position_embeddings" not in full:
            raise ValueError(f"{path}: YaRN RoPE scaling needs original_max_position_embeddings")
        fields["rope_yarn"] = _yarn(full, config)
    elif rope_type != "default":
        raise ValueError(
            f"{path}: RoPE scaling {rope_type!r} is not supported, only 'llama3', 'linear' "
            "and 'yarn'"
        )
    if local_theta is not None:
        if sliding.get("rope_type", "default") != "default":
            raise ValueError(f"{path}: RoPE scaling of sliding-window layers is not supported")
        fields["rope_local_theta"] = float(sliding.get("rope_theta", local_theta))
    return fields


def _yarn(parameters: Mapping[str, Any], config: Mapping[str, Any]) -> YarnScaling:
    """YaRN's settings, with transformers' defaults for those left out."""
    original = parameters["original_max_position_embeddings"]
    factor = parameters.get("factor") or config["max_position_embeddings"] / original

    def optional(key: str) -> float | None:
        value = parameters.get(key)
        return None if value is None else float(value)

    return YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(parameters.get("beta_fast") or 32.0),
        beta_slow=float(parameters.get("beta_slow") or 1.0),
        truncate=bool(parameters.get("truncate", True)),
        attention_factor=optional("attention_factor"),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
    )


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards an index names, or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        return [path / shard for shard in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")


def hf_tokenizer_info(path: Path, config: Mapping[str, Any]) -> TokenizerInfo:
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{path}: no tokenizer.json (other tokenizer formats are not supported)")
    tokenizer_json = tokenizer_file.read_text(encoding="utf-8")
    tokenizer_config = _read_json_if_present(path / "tokenizer_config.json")
    chat_template = _chat_template(path, tokenizer_config)
    eos_token = _token_content(tokenizer_config.get("eos_token"))
    tokenizer = Tokenizer.from_str(tokenizer_json)
    declared_eos = [
        *_ids(config.get("eos_token_id")),
        *_ids(_read_json_if_present(path / "generation_config.json").get("eos_token_id")),
        None if eos_token is None else tokenizer.token_to_id(eos_token),
    ]
    return TokenizerInfo(
        tokenizer_json=tokenizer_json,
        chat_template=chat_template,
        bos_token=_token_content(tokenizer_config.get("bos_token")),
        eos_token=eos_token,
        eos_token_ids=eos_token_ids(declared_eos, chat_template, tokenizer.token_to_id),
    )


def _chat_template(path: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    # Newer transformers save the template to its own file; like transformers, prefer that file.
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates, e.g. "default" and "tool_use"
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialized AddedToken.
    return token["content"] if isinstance(token, Mapping) else token


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _read_json(path: Path) -> dict[str, Any]:
    """``path``'s JSON object; a file that is no JSON object is refused by name."""
    try:
        with path.open(encoding="utf-8") as file:
            value = json.load(file)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, not {type(value).__name__}")
    return value


def _read_json_if_present(path: Path) -> dict[str, Any]:
    return _read_json(path) if path.is_file() else {}
