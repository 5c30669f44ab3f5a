"""The shape of a model and the text facts that travel with it, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RopeScaling:
    """Llama 3 style frequency scaling ("rope_type": "llama3" in config.json)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass
class ModelConfig:
    """A Llama-architecture decoder, in Hugging Face's terms."""

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
    tie_word_embeddings: bool = False


@dataclass
class TokenizerInfo:
    """What a server needs to turn text into token ids and back."""

    tokenizer_json: str  # a Hugging Face tokenizer.json, as text
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    # Every id that ends generation: the config's eos ids and the template's end of turn.
    eos_token_ids: list[int] = field(default_factory=list)
