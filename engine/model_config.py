"""The shape of a model and the text facts that travel with it, whatever file it came from."""

from __future__ import annotations

from dataclasses import dataclass, field

# The layer types of ModelConfig.layer_types, named as in config.json.
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass
class RopeScaling:
    """Llama 3 style frequency scaling ("rope_type": "llama3" in config.json)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass
class YarnScaling:
    """YaRN's frequency scaling ("rope_type": "yarn" in config.json; gpt-oss): frequencies
    interpolated by ``factor`` below the band that ``beta_fast`` and ``beta_slow`` rotations
    bound over ``original_max_position_embeddings``, kept above it, ramped between; cos and
    sin scaled by an attention factor (``engine.models.yarn``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the band's ends rounded to whole dimensions
    attention_factor: float | None = None  # None: from factor (and mscale, if given)
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclass(frozen=True)
class Quantization:
    """How the linear layers' weights (QKV, O, gate/up, down) are stored: ``method`` "fp8"
    (float8 e4m3) or "int8", one float32 scale per output channel; or "mxfp4": gpt-oss's
    experts kept in MXFP4 as published, the linear layers in the model's dtype.

    ``checkpoint_scales``: the checkpoint holds the quantized weights and their scales (a
    pre-quantized checkpoint); otherwise its float weights are quantized as they load."""

    method: str
    checkpoint_scales: bool = False


@dataclass
class ModelConfig:
    """A decoder-only transformer's shape, in Hugging Face's terms, as every family has it.

    What a family does differently lives in its module of ``engine.models``, not here; a family
    with settings of its own (Gemma 3's attention scale, say) subclasses this.
    """

    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    rope_linear_factor: float | None = None  # "linear" RoPE scaling of full-attention layers
    rope_yarn: YarnScaling | None = None  # YaRN scaling of every layer's RoPE
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"  # gating the MLP: "silu" or "gelu_pytorch_tanh"
    # Per layer FULL_ATTENTION or SLIDING_ATTENTION; None means all full.
    layer_types: list[str] | None = None
    sliding_window: int | None = None  # tokens a sliding layer sees, its own included
    rope_local_theta: float | None = None  # RoPE base of sliding layers; None: the full layers'
    quantization: Quantization | None = None  # None: the linear layers in the model's dtype


@dataclass
class TokenizerInfo:
    """What a server needs to turn text into token ids and back."""

    tokenizer_json: str  # a Hugging Face tokenizer.json, as text
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    # Every id that ends generation: the config's eos ids and the template's end of turn.
    eos_token_ids: list[int] = field(default_factory=list)
