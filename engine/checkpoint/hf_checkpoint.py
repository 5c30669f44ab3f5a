"""Read a Hugging Face checkpoint directory: config.json, safetensors and tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open
from tokenizers import Tokenizer

from engine.checkpoint.checkpoint import Checkpoint, WeightStream
from engine.checkpoint.eos import eos_token_ids
from engine.model_config import ModelConfig, RopeScaling, TokenizerInfo

# Mistral's decoder has the same layers and weight names as Llama's.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


def load_hf_directory(path: Path) -> Checkpoint:
    config_json = _read_json(path / "config.json")
    files = safetensors_files(path)
    return Checkpoint(
        name=path.resolve().name,
        config=hf_model_config(config_json, path),
        tokenizer=hf_tokenizer_info(path, config_json),
        weight_source=lambda: _safetensors_weights(files),
    )


def hf_model_config(config: Mapping[str, Any], path: Path) -> ModelConfig:
    architectures = config.get("architectures") or [None]
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: architecture {architectures[0]!r} is not supported, "
            f"only {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    num_heads = config["num_attention_heads"]
    # transformers >= 5 saves rope_theta and the scaling together under rope_parameters.
    rope_parameters = config.get("rope_parameters") or {}
    return ModelConfig(
        architecture=architectures[0],
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        max_position_embeddings=config["max_position_embeddings"],
        rms_norm_eps=float(config["rms_norm_eps"]),
        rope_theta=float(config.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(config.get("rope_scaling") or rope_parameters, path),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )


def _rope_scaling(scaling: Mapping[str, Any], path: Path) -> RopeScaling | None:
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"{path}: RoPE scaling {rope_type!r} is not supported, only 'llama3'")
    return RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=scaling["original_max_position_embeddings"],
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


def _safetensors_weights(files: list[Path]) -> WeightStream:
    for file in files:
        # safe_open memory-maps the file; get_tensor reads one tensor into its own memory.
        with safe_open(file, framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 -- safe_open is no dict
                yield name, shard.get_tensor(name)


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
    with path.open(encoding="utf-8") as file:
        return json.load(file)


def _read_json_if_present(path: Path) -> dict[str, Any]:
    return _read_json(path) if path.is_file() else {}
