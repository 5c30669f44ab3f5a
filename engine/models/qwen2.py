"""Qwen2 and Qwen2.5."""

from __future__ import annotations

from engine.models.causal_lm import CausalLM


class Qwen2ForCausalLM(CausalLM):
    """Llama with biases on the Q, K and V projections (``attention_bias``); configs that
    enable ``use_sliding_window`` slide it over the layers from ``max_window_layers`` on."""
