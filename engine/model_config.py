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
    """A decoder-only transformer, in Hugging Face's terms.

    The fields up to ``tie_word_embeddings`` describe a Llama; the rest are the
    variations of the other supported families, with defaults that mean "as Llama".
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
    tie_word_embeddings: bool = False
    # Qwen2 / Qwen2.5: biases on the Q, K and V projections.
    attention_bias: bool = False
    # Qwen3, Gemma 3: an RMSNorm over each head of Q and K (weights of size head_dim).
    qk_norm: bool = False
    # "silu" (Llama, Qwen) or "gelu_pytorch_tanh" (Gemma), gating the MLP.
    hidden_act: str = "silu"
    # Gemma 3. Per layer "sliding_attention" or "full_attention"; None means all full.
    layer_types: list[str] | None = None
    sliding_window: int | None = None  # tokens a sliding layer sees, its own included
    rope_local_theta: float | None = None  # RoPE base of sliding layers
    rope_linear_factor: float | None = None  # "linear" RoPE scaling of full layers
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5
    final_logit_softcapping: float | None = None
    # Gemma: hidden states are scaled by sqrt(hidden_size) after the embedding, norms
    # multiply by (1 + weight), and each sublayer has a norm after it too.
    gemma_norms_and_scaling: bool = False


@dataclass
class TokenizerInfo:
    """What a server needs to turn text into token ids and back."""

    tokenizer_json: str  # a Hugging Face tokenizer.json, as text
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    # Every id that ends generation: the config's eos ids and the template's end of turn.
    eos_token_ids: list[int] = field(default_factory=list)
