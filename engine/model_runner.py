"""Owns the model and its KV cache on one device; turns a scheduled batch into next tokens."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata, LayerKVCache, TorchPagedAttention
from engine.checkpoint import Checkpoint
from engine.model import build_model
from engine.request import Request
from engine.sampler import SamplingTensors, sample

logger = logging.getLogger(__name__)


@dataclass
class CacheConfig:
    block_size: int
    num_blocks: int


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 on CPU, where bf16 matmuls are slow."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def select_attention_backend(device: torch.device) -> AttentionBackend:
    """The attention implementation for a device; the only place that chooses one."""
    return TorchPagedAttention()


class ModelRunner:
    def __init__(
        self,
        checkpoint: Checkpoint,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.config = checkpoint.config
        started = time.perf_counter()
        model = build_model(
            checkpoint.config, select_attention_backend(device), max_model_len, device, dtype
        )
        model.load_weights(checkpoint.weights())
        self.model = model.eval()
        logger.info(
            "loaded %s on %s (%s) in %.1f s",
            checkpoint.name,
            device,
            str(dtype).removeprefix("torch."),
            time.perf_counter() - started,
        )
        self.block_size = 0

    def kv_bytes_per_token(self) -> int:
        c = self.config
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    def allocate_kv_cache(self, cache: CacheConfig) -> None:
        c = self.config
        shape = (cache.num_blocks, cache.block_size, c.num_key_value_heads, c.head_dim)
        # Zeroed, not empty: the reference attention reads whole blocks and masks what lies
        # past a sequence's end, and a masked NaN from uninitialized memory still poisons it.
        layers = [
            LayerKVCache(
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(c.num_hidden_layers)
        ]
        self.model.bind_kv_cache(layers)
        self.block_size = cache.block_size

    @torch.inference_mode()
    def step(self, batch: list[Request]) -> list[int]:
        """Run one forward pass over ``batch`` and return each request's next token."""
        input_ids, metadata, logits_index = self._prepare_inputs(batch)
        logits = self.model(input_ids, metadata, logits_index)
        next_tokens = sample(logits, self._prepare_sampling(batch))
        return next_tokens.tolist()  # the step's one host-device synchronization

    def _prepare_inputs(
        self, batch: list[Request]
    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Pack the batch's new tokens and cache layout, and move them in one copy."""
        starts = [r.num_cached_tokens for r in batch]
        ends = [r.num_tokens for r in batch]
        query_lens = np.subtract(ends, starts)
        num_tokens = int(query_lens.sum())
        max_blocks = max(len(r.block_ids) for r in batch)
        token_ids = [t for r, s in zip(batch, starts, strict=True) for t in r.token_ids_from(s)]
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        token_seq_index = np.repeat(np.arange(len(batch)), query_lens)
        block_tables = np.zeros((len(batch), max_blocks), dtype=np.int64)
        for row, request in enumerate(batch):
            block_tables[row, : len(request.block_ids)] = request.block_ids
        host = np.concatenate(
            [token_ids, positions, token_seq_index, ends, query_lens, block_tables.ravel()]
        ).astype(np.int64)
        device = torch.from_numpy(host).to(self.device, non_blocking=True)
        input_ids, positions_t, seq_index_t, context_lens, query_lens_t, tables = device.split(
            [num_tokens, num_tokens, num_tokens, len(batch), len(batch), block_tables.size]
        )
        tables = tables.view(len(batch), max_blocks)
        block_of_token = tables[seq_index_t, positions_t // self.block_size]
        metadata = AttentionMetadata(
            positions=positions_t,
            slot_mapping=block_of_token * self.block_size + positions_t % self.block_size,
            token_seq_index=seq_index_t,
            block_tables=tables,
            context_lens=context_lens,
            query_lens=query_lens_t,
            max_query_len=int(query_lens.max()),
        )
        logits_index = torch.cumsum(query_lens_t, dim=0) - 1
        for request in batch:
            request.num_cached_tokens = request.num_tokens
        return input_ids, metadata, logits_index

    def _prepare_sampling(self, batch: list[Request]) -> SamplingTensors:
        params = [r.sampling for r in batch]
        floats = torch.tensor([(p.temperature, p.top_p) for p in params], dtype=torch.float32).to(
            self.device, non_blocking=True
        )
        ints = torch.tensor(
            [
                (p.top_k, r.seed, len(r.output_token_ids))
                for p, r in zip(params, batch, strict=True)
            ],
            dtype=torch.int64,
        ).to(self.device, non_blocking=True)
        return SamplingTensors(
            temperature=floats[:, 0],
            top_p=floats[:, 1],
            top_k=ints[:, 0],
            seed=ints[:, 1],
            step=ints[:, 2],
            all_greedy=all(p.temperature == 0 for p in params),
            any_top_k_or_p=any(p.top_k > 0 or p.top_p < 1 for p in params),
        )
