"""Gemma 3, text only (Gemma3ForCausalLM: the 1B model, or a text model split off a larger one)."""

from __future__ import annotations

from engine.models.causal_lm import CausalLM


class Gemma3ForCausalLM(CausalLM):
    """What ``gemma_norms_and_scaling`` and the Gemma 3 config fields turn on in the shared layers.

    Embeddings scaled by sqrt(hidden_size); (1 + weight) RMSNorms in float32, also after
    each sublayer; Q/K norms; GELU-tanh MLP; attention scale query_pre_attn_scalar ** -0.5;
    sliding-window layers with a RoPE base of their own (``rope_local_theta``) between
    global layers (``rope_theta``, optionally linear scaled); optional final logit soft-cap.
    """
