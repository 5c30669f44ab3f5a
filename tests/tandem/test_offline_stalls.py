"""The offline benchmark's stall counters (tandem/bench/offline.py ``counted_stalls``): the
garbage collector's full collections while the block runs, timed, and none after it; the
CUDA allocator's retries, none off CUDA."""

from __future__ import annotations

import gc

import torch

from tandem.bench.offline import counted_stalls


def test_full_collections_in_the_block_are_counted_and_timed() -> None:
    with counted_stalls(torch.device("cpu")) as stalls:
        gc.collect(0)  # a young generation's: not a full collection
        gc.collect()
        gc.collect()
    assert stalls.collections == 2 and stalls.collection_s > 0
    assert stalls.allocator_retries == 0
    gc.collect()  # after the block: its callback is gone
    assert stalls.collections == 2
    assert str(stalls).startswith("0 allocator retries, 2 full collections (")
