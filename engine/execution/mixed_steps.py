"""A step of decodes with prompts mixed in, run as two passes: its decodes as a decode step,
its prompts as a prompt step, each a CUDA graph replay.

Under a steady flow of new requests almost every step of a busy engine admits a prompt or
two into a batch of hundreds of decodes. One pass over such a step cannot replay a decode
graph (its sequences' token counts differ) and ran op by op: hundreds of launches from
Python, which for a small model take the host several times what the decode graph's replay
takes the device, so every request's next token and the new prompts' first ones waited on
the host. Split, the step is the decode graph of its decodes (``cuda_graphs.StepGraphs``)
and then the prompt graph of the rest (``prompt_graphs.PromptGraphs``): two launches' worth
of host work. The price is reading the weights twice, once a pass, which a small model's
step hardly feels and a large one's would: so the split is taken where the weights a device
reads in a pass are at most ``SPLIT_MAX_WEIGHT_BYTES`` (``--split-mixed-steps auto``), and
only when both parts replay a graph (a part run op by op would cost the launches it
saves).

The decodes are the step's ``num_leading_decodes`` sequences: each one token, its last,
sampled, so their logits rows are the step's first ones and the rest's follow (its sampled
rows, with speculative decoding their drafts' rows, then its scored prompt positions). The
two parts are views of the step's packed inputs, the prompts' indices into the packed tokens
shifted by the decodes' count; a tensor-parallel worker splits its step alike from the same
shape, and replays the same graphs.

``--split-mixed-steps on`` splits wherever a step mixes, CPU included: there both parts run
op by op, which tests the split against the one pass.
"""

from __future__ import annotations

from dataclasses import replace

from engine.backends.attention import AttentionMetadata
from engine.execution.batch import StepInputs, StepShape
from engine.roofline import ModelCost

# The weights of a pass (a rank's) up to which ``auto`` splits mixed steps. Read again in
# the prompts' pass, 4 GiB cost an H200 (4.8 TB/s) under a millisecond: less than the host
# spends launching one pass op by op (a 0.5B model's eager step of hundreds of launches
# takes it several milliseconds), while an 8B model's 16 GB would cost more than its
# launches, which its device time hides anyway.
SPLIT_MAX_WEIGHT_BYTES = 4 * 1024**3


def splits_mixed_steps(setting: str, graphs_captured: bool, cost: ModelCost) -> bool:
    """Whether mixed steps are split, by ``--split-mixed-steps``: ``auto`` where CUDA graphs
    are captured and the weights a pass reads (``cost``'s, the model's) are small enough.
    (Every rank of a tensor-parallel group comes to the same: their shares of the weights
    are equal.)"""
    if setting != "auto":
        return setting == "on"
    if not graphs_captured:
        return False
    weight_bytes = cost.layer_weight_bytes + cost.head_weight_bytes + cost.expert_weight_bytes
    return weight_bytes <= SPLIT_MAX_WEIGHT_BYTES


def is_mixed(shape: StepShape) -> bool:
    """Whether a step has decodes at its front and other sequences after them."""
    return 0 < shape.num_leading_decodes < shape.num_seqs


def split_mixed_step(inputs: StepInputs) -> tuple[StepInputs, StepInputs]:
    """A mixed step's decodes, as a decode step (``uniform_query_len`` 1), and the rest, as
    a step of its own; their logits, concatenated, are the step's."""
    shape, metadata = inputs.shape, inputs.metadata
    assert is_mixed(shape)
    d = shape.num_leading_decodes
    decode_shape = StepShape(
        num_tokens=d,
        num_seqs=d,
        max_blocks=shape.max_blocks,
        num_logits=d,
        num_targets=0,
        max_query_len=1,
        num_rows=d,
        uniform_query_len=1,
    )
    decodes = StepInputs(
        inputs.input_ids[:d],
        AttentionMetadata(
            positions=metadata.positions[:d],
            slot_mapping=metadata.slot_mapping[:d],
            token_seq_index=metadata.token_seq_index[:d],
            block_tables=metadata.block_tables[:d],
            context_lens=metadata.context_lens[:d],
            query_lens=metadata.query_lens[:d],
            query_starts=metadata.query_starts[:d],
            max_query_len=1,
            uniform_queries=True,
        ),
        inputs.logits_index[:d],
        inputs.rows[:d],
        None,
        decode_shape,
        inputs.packed,
    )
    # The rest's indices into the packed tokens and sequences start after the decodes'.
    prompt_shape = replace(
        shape,
        num_tokens=shape.num_tokens - d,
        num_seqs=shape.num_seqs - d,
        num_logits=shape.num_logits - d,
        num_rows=shape.num_rows - d,
        num_leading_decodes=0,
    )
    prompts = StepInputs(
        inputs.input_ids[d:],
        AttentionMetadata(
            positions=metadata.positions[d:],
            slot_mapping=metadata.slot_mapping[d:],
            token_seq_index=metadata.token_seq_index[d:] - d,
            block_tables=metadata.block_tables[d:],
            context_lens=metadata.context_lens[d:],
            query_lens=metadata.query_lens[d:],
            query_starts=metadata.query_starts[d:] - d,
            max_query_len=shape.max_query_len,
        ),
        inputs.logits_index[d:] - d,
        inputs.rows[d:],
        inputs.scored,
        prompt_shape,
        inputs.packed,
        None if inputs.num_drafts is None else inputs.num_drafts[d:],
    )
    return decodes, prompts
