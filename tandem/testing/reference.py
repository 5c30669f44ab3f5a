"""Greedy generations side by side: transformers' (the reference) and our in-process engine's."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from engine.llm_engine import LLMEngine
from engine.quantization.linear_methods import quantize_per_channel
from protocol import SamplingParams


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    output = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt)),
    )
    return output[0, len(prompt) :].tolist()


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens (EOS ignored) from ``engine``, all added at once."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(b"test", str(i), prompt, sampling)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for _, output in engine.step():
            outputs[output.request_id].extend(output.new_token_ids)
    return [outputs[str(i)] for i in range(len(prompts))]


def stepwise_agreement(
    hf_model: PreTrainedModel, prompts: list[list[int]], ours: list[list[int]]
) -> float:
    """The share of our tokens that are transformers' greedy choice after the same tokens:
    once a token differs the continuations differ, so whole generations say little."""
    agree = total = 0
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + tokens], device=hf_model.device)).logits[0]
        choices = logits[len(prompt) - 1 : -1].argmax(-1).cpu()
        agree += int((choices == torch.tensor(tokens)).sum())
        total += len(tokens)
    return agree / total


def with_weights_as_fp8_codes(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of ``model`` holding the weights ``--quantization fp8`` multiplies by: each
    decoder layer's projection (experts' stacked ones too; not a MoE router, norms, biases,
    embeddings or the LM head) rounded to float8 e4m3 codes times one scale per output
    channel, as the engine quantizes them on load. The reference for the quantized path's
    arithmetic, apart from what rounding the weights alone does to a model's choices."""
    rounded = copy.deepcopy(model)
    # transformers' gpt-oss experts multiply x @ W: their projections are stored [E, in, out].
    inputs_first = getattr(model.config, "model_type", None) == "gpt_oss"
    with torch.no_grad():
        for name, weight in rounded.named_parameters():
            router = name.endswith("mlp.gate.weight") or ".router." in name
            if ".layers." not in name or weight.dim() < 2 or router:
                continue
            rows = weight.transpose(-1, -2) if inputs_first and ".experts." in name else weight
            codes, scale = quantize_per_channel(
                rows.reshape(-1, rows.shape[-1]), torch.float8_e4m3fn
            )
            rows.copy_((codes.float() * scale[:, None]).reshape(rows.shape))
    return rounded
