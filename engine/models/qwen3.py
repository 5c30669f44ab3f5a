"""Qwen3 (dense)."""

from __future__ import annotations

from engine.models.causal_lm import CausalLM


class Qwen3ForCausalLM(CausalLM):
    """Llama with an RMSNorm over each head of Q and K before RoPE (``qk_norm``), no
    biases, and a head_dim that need not be hidden_size / heads."""
