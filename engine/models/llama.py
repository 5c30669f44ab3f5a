"""Llama and Mistral: the plain decoder the other families vary."""

from __future__ import annotations

from engine.models.causal_lm import CausalLM


class LlamaForCausalLM(CausalLM):
    """RMSNorm, RoPE (plain, Llama 3 or linear scaled), grouped-query attention, SiLU MLP."""


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers and weight names; Mistral 7B v0.1 slides a window over every layer."""
