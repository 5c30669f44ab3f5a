"""Read a Hugging Face checkpoint directory: config.json, safetensors and tokenizer files.

config.json stays a dict here: each family in ``engine.models`` reads it, with
``hf_config_fields`` for the fields that every family's config.json spells alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from engine.checkpoint.checkpoint import SliceStream
from engine.checkpoint.generation_config import read_sampling_defaults
from engine.checkpoint.hf_config import (
    CONFIG_JSON,
    MAX_LAYERS,
    MAX_POSITIONS,
    ConfigValues,
    read_json_object,
    read_json_object_if_present,
    shown,
)
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

_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> shard map
_TOKENIZER_CONFIG = "tokenizer_config.json"
_GENERATION_CONFIG = "generation_config.json"


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
    """The directory's config and weight files; ``name`` overrides the directory's.

    A safetensors index is checked now, not when the weights stream: a broken one is refused
    before the engine allocates the model."""
    index = path / _INDEX
    if index.is_file():
        _index_shards(index)
    return HFDirectory(
        name=name or path.resolve().name,
        path=path,
        config=read_json_object(path / CONFIG_JSON),
    )


def hf_architecture(config: Mapping[str, Any]) -> str | None:
    """The model class config.json names, e.g. "LlamaForCausalLM"."""
    architectures = config.get("architectures")
    if not architectures:
        return None
    if not isinstance(architectures, list) or not isinstance(architectures[0], str):
        raise ValueError(f"'architectures' is {architectures!r}, not a list of model class names")
    return architectures[0]


def hf_config_fields(
    config: Mapping[str, Any],
    path: Path,
    default_rope_theta: float = 10_000.0,
    default_local_rope_theta: float | None = None,
) -> dict[str, Any]:
    """The ``ModelConfig`` fields that config.json spells alike for every family, in
    transformers' older format or in that of v5; a value missing, mistyped or of an impossible
    size is refused by key (``ConfigValues``).

    ``default_local_rope_theta`` not None: sliding layers have a RoPE base of their own, with
    this default. The defaults are transformers' for the family, where a config leaves them out.
    """
    values = ConfigValues(config, path)
    hidden_size = values.size("hidden_size")
    num_heads = values.size("num_attention_heads")
    head_dim = values.optional_size("head_dim")
    if head_dim is None and hidden_size % num_heads:
        # The heads split the hidden size between them when config.json gives no head size.
        raise ValueError(
            f"{values.file}: 'num_attention_heads' is {num_heads}, which does not divide "
            f"'hidden_size' {hidden_size} (and no 'head_dim' is given)"
        )
    num_kv_heads = values.optional_size("num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        # Grouped-query attention: each KV head serves the same number of query heads.
        raise ValueError(
            f"{values.file}: 'num_key_value_heads' is {num_kv_heads}, which does not divide "
            f"'num_attention_heads' {num_heads}"
        )
    return {
        "architecture": hf_architecture(config),
        "vocab_size": values.size("vocab_size"),
        "hidden_size": hidden_size,
        "intermediate_size": values.size("intermediate_size"),
        "num_hidden_layers": values.size("num_hidden_layers", MAX_LAYERS),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "max_position_embeddings": values.size("max_position_embeddings", MAX_POSITIONS),
        "rms_norm_eps": values.number("rms_norm_eps"),
        "tie_word_embeddings": values.flag("tie_word_embeddings", False),
        "hidden_act": values.name("hidden_act", "silu"),
        "quantization": hf_quantization(config, path),
        **_rope_fields(values, default_rope_theta, default_local_rope_theta),
    }


def hf_quantization(config: Mapping[str, Any], path: Path) -> Quantization | None:
    """The stored format of a pre-quantized checkpoint, from config.json's
    ``quantization_config``, where it is one we load as vLLM does: ``quant_method`` "fp8",
    float8 e4m3 ``*.weight`` with a per-tensor or per-channel ``*.weight_scale`` each.

    Activations are quantized per token as they come, whatever ``activation_scheme`` says (a
    static scheme's ``*.input_scale`` are not read). Anything else is refused by name."""
    if config.get("quantization_config") is None:
        return None
    values = ConfigValues(config, path)
    quantization = values.section("quantization_config")
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{values.file}: quantization_config's quant_method {method!r} is not supported; "
            "pre-quantized checkpoints load only as 'fp8' (float weights can be quantized "
            "at load with --quantization fp8 or int8)"
        )
    if quantization.get("weight_block_size") is not None:
        raise ValueError(
            f"{values.file}: block-wise FP8 (quantization_config's weight_block_size "
            f"{quantization['weight_block_size']}) is not supported, only per-tensor or "
            "per-channel weight scales"
        )
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise ValueError(
            f"{values.file}: quantization_config's fmt {quantization['fmt']!r} is not "
            "supported, only 'e4m3'"
        )
    # Layers left in the model's dtype: the LM head is (it always is here); any other would
    # need a second kind of linear layer.
    ignored = quantization.get("ignored_layers") or quantization.get("modules_to_not_convert")
    if ignored is not None and not isinstance(ignored, list):
        raise ValueError(
            f"{values.file}: quantization_config's ignored_layers {ignored!r} is not a list"
        )
    kept = [name for name in ignored or [] if not str(name).endswith("lm_head")]
    if kept:
        raise ValueError(
            f"{values.file}: FP8 checkpoints whose linear layers are partly unquantized "
            f"(quantization_config's ignored_layers {kept[:3]}) are not supported"
        )
    return Quantization("fp8", checkpoint_scales=True)


def check_layer_types(layer_types: list[str] | None, num_layers: int, path: Path) -> None:
    if layer_types is None:
        return
    known = {FULL_ATTENTION, SLIDING_ATTENTION}
    # Checked as a list of strings first: a number has no len(), a list of objects no set().
    if (
        not isinstance(layer_types, list)
        or not all(isinstance(kind, str) for kind in layer_types)
        or len(layer_types) != num_layers
        or not set(layer_types) <= known
    ):
        raise ValueError(
            f"{path / CONFIG_JSON}: 'layer_types' must name {FULL_ATTENTION!r} or "
            f"{SLIDING_ATTENTION!r} for each of the {num_layers} layers, not "
            f"{shown(layer_types, 200)}"
        )


def _rope_fields(
    values: ConfigValues, full_theta: float, local_theta: float | None
) -> dict[str, Any]:
    """RoPE of the full layers (base, Llama 3 or linear scaling) and of sliding layers that
    have their own (``local_theta`` not None), from the older format or transformers 5's."""
    path = values.path
    parameters = values.section("rope_parameters")
    if FULL_ATTENTION in parameters:  # transformers 5, per layer type (Gemma 3)
        nested = ConfigValues(parameters, path, "rope_parameters")
        full = ConfigValues(
            nested.section(FULL_ATTENTION), path, f"rope_parameters.{FULL_ATTENTION}"
        )
        sliding = ConfigValues(
            nested.section(SLIDING_ATTENTION), path, f"rope_parameters.{SLIDING_ATTENTION}"
        )
        theta = full.optional_number("rope_theta", full_theta)
        sliding_theta = sliding.optional_number("rope_theta", local_theta)
    else:  # transformers 5 for all layers, or older: rope_theta beside rope_scaling
        scaling = values.section("rope_scaling")
        full = ConfigValues(
            scaling or parameters, path, "rope_scaling" if scaling else "rope_parameters"
        )
        theta = full.optional_number("rope_theta") or values.optional_number(
            "rope_theta", full_theta
        )
        sliding = ConfigValues({}, path)
        sliding_theta = values.optional_number("rope_local_base_freq", local_theta)
    fields: dict[str, Any] = {"rope_theta": theta}
    rope_type = full.name("rope_type", full.name("type", "default"))
    if rope_type == "llama3":
        fields["rope_scaling"] = RopeScaling(
            factor=full.number("factor"),
            low_freq_factor=full.number("low_freq_factor"),
            high_freq_factor=full.number("high_freq_factor"),
            original_max_position_embeddings=full.size(
                "original_max_position_embeddings", MAX_POSITIONS
            ),
        )
    elif rope_type == "linear":
        fields["rope_linear_factor"] = full.number("factor")
    elif rope_type == "yarn":
        fields["rope_yarn"] = _yarn(full, values)
    elif rope_type != "default":
        raise ValueError(
            f"{values.file}: RoPE scaling {rope_type!r} ({full.within}'s rope_type) is not "
            "supported, only 'llama3', 'linear' and 'yarn'"
        )
    if local_theta is not None:
        if sliding.name("rope_type", "default") != "default":
            raise ValueError(
                f"{values.file}: RoPE scaling of sliding-window layers ({sliding.within}'s "
                "rope_type) is not supported"
            )
        fields["rope_local_theta"] = sliding_theta
    return fields


def _yarn(parameters: ConfigValues, config: ConfigValues) -> YarnScaling:
    """YaRN's settings, with transformers' defaults for those left out."""
    original = parameters.size("original_max_position_embeddings", MAX_POSITIONS)
    factor = parameters.optional_number("factor") or (
        config.size("max_position_embeddings", MAX_POSITIONS) / original
    )
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=parameters.optional_number("beta_fast") or 32.0,
        beta_slow=parameters.optional_number("beta_slow") or 1.0,
        truncate=parameters.flag("truncate", True),
        attention_factor=parameters.optional_number("attention_factor", positive=False),
        mscale=parameters.optional_number("mscale", positive=False),
        mscale_all_dim=parameters.optional_number("mscale_all_dim", positive=False),
    )


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards an index names, or the single file."""
    index = path / _INDEX
    if index.is_file():
        return [path / shard for shard in _index_shards(index)]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _index_shards(index: Path) -> list[str]:
    """The shard files a model.safetensors.index.json names in its ``weight_map`` (tensor name
    -> file), refused by file and key where there is none or it is no such map."""
    weight_map = read_json_object(index).get("weight_map")
    if weight_map is None:
        raise ValueError(f"{index}: 'weight_map' is missing")
    if not isinstance(weight_map, dict) or not all(
        isinstance(shard, str) for shard in weight_map.values()
    ):
        raise ValueError(
            f"{index}: 'weight_map' is {shown(weight_map)}, not a JSON object of tensor names "
            "to file names"
        )
    return sorted(set(weight_map.values()))


def hf_tokenizer_info(path: Path, config: Mapping[str, Any]) -> TokenizerInfo:
    """The tokenizer, chat template and end-of-generation ids of ``path``'s tokenizer.json,
    tokenizer_config.json, config.json (``config``) and generation_config.json; a value of
    the wrong shape in any of them is refused by file and key."""
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{path}: no tokenizer.json (other tokenizer formats are not supported)")
    tokenizer_json, tokenizer = _read_tokenizer(tokenizer_file)
    tokenizer_config = ConfigValues(
        read_json_object_if_present(path / _TOKENIZER_CONFIG),
        path,
        file_name=_TOKENIZER_CONFIG,
    )
    chat_template = _chat_template(path, tokenizer_config)
    eos_token = _token_content(tokenizer_config, "eos_token")
    # The ids are the model's: config.json's vocab_size bounds them, as the GGUF vocabulary
    # bounds a GGUF file's.
    model_config = ConfigValues(config, path)
    vocab_size = model_config.size("vocab_size")
    generation_config = ConfigValues(
        read_json_object_if_present(path / _GENERATION_CONFIG),
        path,
        file_name=_GENERATION_CONFIG,
    )
    declared_eos = [
        *model_config.token_ids("eos_token_id", vocab_size),
        *generation_config.token_ids("eos_token_id", vocab_size),
        None if eos_token is None else tokenizer.token_to_id(eos_token),
    ]
    return TokenizerInfo(
        tokenizer_json=tokenizer_json,
        chat_template=chat_template,
        bos_token=_token_content(tokenizer_config, "bos_token"),
        eos_token=eos_token,
        eos_token_ids=eos_token_ids(declared_eos, chat_template, tokenizer.token_to_id),
    )


def _read_tokenizer(file: Path) -> tuple[str, Tokenizer]:
    """tokenizer.json's text and the tokenizer it builds; a file that is not UTF-8, not JSON or
    not a tokenizer is refused naming the file, which the tokenizers library's error does not."""
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{file}: not UTF-8 text: {error}") from None
    try:
        return text, Tokenizer.from_str(text)
    except Exception as error:  # tokenizers raises Exception itself, of no narrower class
        raise ValueError(f"{file}: not a tokenizer the tokenizers library reads: {error}") from None


def _chat_template(path: Path, tokenizer_config: ConfigValues) -> str | None:
    # Newer transformers save the template to its own file; like transformers, prefer that file.
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.values.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if not isinstance(template, list):
        raise tokenizer_config.refused(
            "chat_template", template, "not a string or a list of named templates"
        )
    # Named templates, e.g. "default" and "tool_use", each {"name": ..., "template": ...}.
    named: dict[str, str] = {}
    for number, entry in enumerate(template):
        if not isinstance(entry, dict):
            raise tokenizer_config.refused(
                "chat_template", template, f"whose entry {number} is not a JSON object"
            )
        values = ConfigValues(entry, path, f"chat_template[{number}]", _TOKENIZER_CONFIG)
        name = values.text("name")
        named[name] = values.text("template")
    return named.get("default")


def _token_content(tokenizer_config: ConfigValues, key: str) -> str | None:
    # tokenizer_config.json spells a special token as a string or as a serialized AddedToken.
    token = tokenizer_config.values.get(key)
    if token is None or isinstance(token, str):
        return token
    if not isinstance(token, dict):
        raise tokenizer_config.refused(key, token, "not a string or a JSON object with 'content'")
    return ConfigValues(token, tokenizer_config.path, key, _TOKENIZER_CONFIG).text("content")
