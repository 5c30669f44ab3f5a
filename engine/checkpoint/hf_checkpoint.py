"""Read a Hugging Face checkpoint directory: config.json, safetensors and tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open
from tokenizers import Tokenizer

from engine.checkpoint.checkpoint import Checkpoint, WeightStream
from engine.checkpoint.eos import eos_token_ids
from engine.checkpoint.generation_config import read_sampling_defaults
from engine.model_config import ModelConfig, RopeScaling, TokenizerInfo
from engine.models import model_class
from engine.models.layers import FULL_ATTENTION as FULL
from engine.models.layers import SLIDING_ATTENTION as SLIDING


def load_hf_directory(path: Path) -> Checkpoint:
    config_json = _read_json(path / "config.json")
    files = safetensors_files(path)
    return Checkpoint(
        name=path.resolve().name,
        config=hf_model_config(config_json, path),
        tokenizer=hf_tokenizer_info(path, config_json),
        weight_source=lambda: _safetensors_weights(files),
        sampling_defaults=read_sampling_defaults(path),
    )


def hf_model_config(config: Mapping[str, Any], path: Path) -> ModelConfig:
    """config.json as ``ModelConfig``, in transformers' older format or in that of v5."""
    architecture = (config.get("architectures") or [None])[0]
    if architecture == "Gemma3ForConditionalGeneration":
        raise ValueError(
            f"{path}: Gemma3ForConditionalGeneration (text and images) is not supported; "
            "text-only Gemma 3 checkpoints (Gemma3ForCausalLM, e.g. gemma-3-1b-it) are"
        )
    try:
        model_class(architecture)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    num_heads = config["num_attention_heads"]
    full_theta, local_theta = _ROPE_THETA_DEFAULTS.get(architecture, (10_000.0, None))
    fields: dict[str, Any] = {
        "architecture": architecture,
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
        **_rope_fields(config, path, full_theta, local_theta),
        **_FAMILY_FIELDS[architecture](config, path),
    }
    _check_layer_types(fields.get("layer_types"), config["num_hidden_layers"], path)
    return ModelConfig(**fields)


def _llama_fields(config: Mapping[str, Any], path: Path) -> dict[str, Any]:
    # Llama's and Qwen3's attention_bias also puts a bias on o_proj, which no model here has.
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{path}: attention_bias and mlp_bias are not supported")
    return {}


def _mistral_fields(config: Mapping[str, Any], path: Path) -> dict[str, Any]:
    # Mistral 7B v0.1 slides a window over every layer; later versions set it to null.
    window = config.get("sliding_window")
    if window is None:
        return {}
    return {"sliding_window": window, "layer_types": [SLIDING] * config["num_hidden_layers"]}


def _qwen_sliding_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    # Qwen configs name a window that applies only with use_sliding_window, and then (unless
    # layer_types says otherwise) to the layers from max_window_layers on.
    window = config.get("sliding_window")
    if not config.get("use_sliding_window") or window is None:
        return {}
    layer_types = config.get("layer_types") or [
        SLIDING if i >= config["max_window_layers"] else FULL
        for i in range(config["num_hidden_layers"])
    ]
    return {"sliding_window": window, "layer_types": layer_types}


def _qwen2_fields(config: Mapping[str, Any], path: Path) -> dict[str, Any]:
    return {"attention_bias": True, **_qwen_sliding_fields(config)}


def _qwen3_fields(config: Mapping[str, Any], path: Path) -> dict[str, Any]:
    return {"qk_norm": True, **_llama_fields(config, path), **_qwen_sliding_fields(config)}


def _gemma3_fields(config: Mapping[str, Any], path: Path) -> dict[str, Any]:
    for unsupported in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if config.get(unsupported):
            raise ValueError(f"{path}: Gemma 3 with {unsupported} is not supported")
    # Configs before transformers 5 give the pattern instead: every Nth layer is global.
    pattern = config.get("sliding_window_pattern", 6)
    layer_types = config.get("layer_types") or [
        FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config["num_hidden_layers"])
    ]
    softcap = config.get("final_logit_softcapping")
    return {
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
        "hidden_act": config.get("hidden_activation", "gelu_pytorch_tanh"),
        "qk_norm": True,
        "gemma_norms_and_scaling": True,
        "layer_types": layer_types,
        "sliding_window": config["sliding_window"],
        "query_pre_attn_scalar": float(config["query_pre_attn_scalar"]),
        "final_logit_softcapping": None if softcap is None else float(softcap),
    }


# How each architecture's config.json differs from Llama's; keyed like engine.models' registry.
_FAMILY_FIELDS: dict[str, Callable[[Mapping[str, Any], Path], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama_fields,
    "MistralForCausalLM": _mistral_fields,
    "Qwen2ForCausalLM": _qwen2_fields,
    "Qwen3ForCausalLM": _qwen3_fields,
    "Gemma3ForCausalLM": _gemma3_fields,
}

# transformers' RoPE bases where a config leaves them out: (full layers, sliding layers, or None
# when those use the full layers' RoPE).
_ROPE_THETA_DEFAULTS = {"Gemma3ForCausalLM": (1_000_000.0, 10_000.0)}


def _check_layer_types(layer_types: list[str] | None, num_layers: int, path: Path) -> None:
    if layer_types is None:
        return
    if len(layer_types) != num_layers or not set(layer_types) <= {FULL, SLIDING}:
        raise ValueError(
            f"{path}: layer_types must name {FULL!r} or {SLIDING!r} for each of the "
            f"{num_layers} layers, not {layer_types}"
        )


def _rope_fields(
    config: Mapping[str, Any], path: Path, full_theta: float, local_theta: float | None
) -> dict[str, Any]:
    """RoPE of the full layers (base, Llama 3 or linear scaling) and of sliding layers that
    have their own (``local_theta`` not None), from the older format or transformers 5's."""
    parameters = config.get("rope_parameters") or {}
    if FULL in parameters:  # transformers 5, per layer type (Gemma 3)
        full, sliding = parameters[FULL], parameters.get(SLIDING) or {}
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
    elif rope_type != "default":
        raise ValueError(
            f"{path}: RoPE scaling {rope_type!r} is not supported, only 'llama3' and 'linear'"
        )
    if local_theta is not None:
        if sliding.get("rope_type", "default") != "default":
            raise ValueError(f"{path}: RoPE scaling of sliding-window layers is not supported")
        fields["rope_local_theta"] = float(sliding.get("rope_theta", local_theta))
    return fields


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
