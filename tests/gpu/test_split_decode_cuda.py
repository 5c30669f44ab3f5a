"""Split decode attention on CUDA as a decode step runs it: captured once in a CUDA graph
and replayed on new queries and context lengths, at real models' head shapes, over a bf16
and an fp8 cache, with and without sinks. The Triton kernel's last split program of each
(KV head, sequence) merges the splits and zeroes its count for the next replay
(paged_attention.py); over an fp8 cache without sinks the Gluon kernel and the merge kernel
run instead (fp8_decode.py). Block tables as wide as a graph's (the split count follows
their width), contexts from one key to all of them: most splits empty at the short ones.
"""

from __future__ import annotations

import pytest
import torch

from engine.backends.triton import paged_decode_attention
from engine.backends.triton.paged_attention import decode_split_counts, default_decode_splits
from tandem.testing.kernel_reference import paged_attention_reference
from tests.engine.test_kernels import FP8, assert_rounding_close, paged_batch, randn

# (query heads, KV heads, head_dim)
SHAPES = {
    "qwen3-30b-a3b": (32, 4, 128),
    "llama-3.2-1b": (32, 8, 64),
    "gpt-oss-20b": (64, 8, 64),
    "gemma-3-1b": (4, 1, 256),
}
CAPACITY = 4096  # keys a sequence's block table holds
# Each replay's context lengths (batch 3; batch 1 takes the first): tile and split edges,
# one key, every key.
REPLAYS = [[1, 64, 4096], [4096, 1, 65], [300, 2047, 129], [65, 4000, 1]]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_split_decode_graph_replays(
    shape: str, kv_dtype: torch.dtype, sinks: bool, batch: int
) -> None:
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    if kv_dtype == FP8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("an fp8 cache needs compute capability 8.9")
    cache = paged_batch([CAPACITY] * batch, [1] * batch, num_kv_heads, head_dim, float("nan"))
    key_cache, value_cache = cache.key_cache.to(kv_dtype), cache.value_cache.to(kv_dtype)
    block_tables = cache.metadata.block_tables
    context_lens = cache.metadata.context_lens.clone()
    sink_logits = (torch.rand(num_heads, device="cuda") * 6 - 2).to(torch.bfloat16)
    sink_logits = sink_logits if sinks else None
    q = randn(batch, num_heads, head_dim)
    out = torch.empty_like(q)
    splits = default_decode_splits(q, key_cache, block_tables, 1, sinks)
    assert splits > 1

    def run() -> None:
        args = (q, key_cache, value_cache, block_tables, context_lens)
        paged_decode_attention(*args, head_dim**-0.5, out=out, sinks=sink_logits)

    run()  # compiles, and makes the counts, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in REPLAYS:
        q.copy_(randn(*q.shape))
        context_lens.copy_(torch.tensor(lens[:batch]))
        out.fill_(float("nan"))
        graph.replay()
        expected = paged_attention_reference(
            q,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            torch.ones_like(context_lens),
            head_dim**-0.5,
            None,
            sink_logits,
        )
        assert_rounding_close(out, expected)
    torch.cuda.synchronize()
    assert not decode_split_counts(q.device, batch * num_kv_heads).any()
