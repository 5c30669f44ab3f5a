"""The PyTorch backend: runs on any device, and is the reference the Triton kernels are
tested against (tests/engine/test_kernels.py, test_quantization.py,
test_step_input_kernels.py), one PyTorch definition per op.

Simple and exact rather than fast: attention gathers each sequence's whole context every
layer, which a paged-attention kernel avoids. Numerics follow Hugging Face's Llama. It
launches no Triton kernel on any device: ``--backend torch`` on a GPU runs PyTorch's own
kernels (cuBLAS, its elementwise and reduction kernels) only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.backends.attention import AttentionBackend, AttentionMetadata, LayerKVCache, Rotary
from engine.backends.deferred_norm import DeferredNorm, LinearInput, dense
from engine.backends.fp8 import FP8, FP8_MAX, MIN_SCALE, rowwise_scaled_mm
from engine.backends.layer_ops import ClampedSwiGLU
from engine.backends.mxfp4 import BLOCK, dequantize_mxfp4
from engine.backends.penalties import Penalties, penalized
from engine.backends.sampling_draw import Cuts, race_sample
from engine.distributed.parallel import OneKernelAllReduce, TensorParallel
from engine.distributed.symmetric_all_reduce import torch_one_shot


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy key/value [T, num_kv_heads, head_dim] to the caches' flat slots ``slot_mapping``
    (block * block_size + offset), in the caches' dtype (float8 for an fp8 cache), skipping
    tokens whose slot is negative. Reads back whether there are any (a synchronization on
    CUDA)."""
    keep = slot_mapping >= 0
    if not keep.all():  # never in a scheduled step: its every token has a slot
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)  # an fp8 cache
    if key_cache.dtype.itemsize == 1:  # PyTorch copies float8 by index as bytes only
        key, value, key_cache, value_cache = (
            t.view(torch.uint8) for t in (key, value, key_cache, value_cache)
        )
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    key_cache.view(num_slots, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(num_slots, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, head_dim] and k rotated (rotate-half) by the float32 tables' rows at
    ``positions``, in the compute dtype, as Hugging Face rounds."""
    cos = cos[positions].unsqueeze(1).to(q.dtype)
    sin = sin[positions].unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary: Rotary
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k normalized per head (if ``rotary`` has norms) and rotated, as new tensors."""
    if rotary.q_norm is not None and rotary.k_norm is not None:
        if rotary.norm_offset is None:
            q = rms_norm(q, rotary.q_norm, rotary.eps)
            k = rms_norm(k, rotary.k_norm, rotary.eps)
        else:
            q = rms_norm_round_once(q, rotary.q_norm, rotary.eps, rotary.norm_offset)
            k = rms_norm_round_once(k, rotary.k_norm, rotary.eps, rotary.norm_offset)
    return rope(q, k, positions, rotary.cos, rotary.sin)


@dataclass
class _QueryGrid:
    """A step's packed queries laid out as a padded [B, max_query_len] grid, for SDPA."""

    metadata: AttentionMetadata  # the step it was made for
    index: torch.Tensor  # [T] each packed query's row in the flattened grid
    positions: torch.Tensor  # [B, max_query_len, 1] each grid row's position; padding: 0


class TorchPagedAttention(AttentionBackend):
    """Gathers each sequence's cache and runs masked SDPA on a padded batch.

    Not captured in CUDA graphs: skipping negative slots reads them back to the host.
    Zero the cache before its first step: masked garbage past a sequence's end still
    poisons SDPA if it is NaN.
    """

    def __init__(self) -> None:
        self._grid: _QueryGrid | None = None

    def prepare(self, metadata: AttentionMetadata) -> None:
        """The query grid every layer of the step shares."""
        batch = metadata.block_tables.shape[0]
        # A sequence's tokens are packed in order from its query start. (Not its positions:
        # a uniform layout's padding tokens share position 0.)
        packed_index = torch.arange(metadata.positions.shape[0], device=metadata.positions.device)
        column = packed_index - metadata.query_starts[metadata.token_seq_index]
        index = metadata.token_seq_index * metadata.max_query_len + column
        # Grid padding sits at position 0 so its row is never empty (an empty row gives NaN).
        positions = torch.zeros(
            batch * metadata.max_query_len, dtype=torch.int64, device=index.device
        )
        positions[index] = metadata.positions
        self._grid = _QueryGrid(metadata, index, positions.view(batch, -1, 1))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        *,
        rotary: Rotary | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        grid = self._grid
        assert grid is not None and grid.metadata is metadata, "prepare() the step first"
        if rotary is not None:
            q, k = apply_rotary(q, k, metadata.positions, rotary)
        store_kv(k, v, cache.key, cache.value, metadata.slot_mapping)

        _, block_size, num_kv_heads, head_dim = cache.key.shape
        batch, max_blocks = metadata.block_tables.shape
        context = max_blocks * block_size
        # [B, heads, context, head_dim]: each sequence's cache in order, garbage past its length.
        # An fp8 cache is read as the model's dtype.
        keys = cache.key[metadata.block_tables].view(batch, context, num_kv_heads, head_dim)
        values = cache.value[metadata.block_tables].view(batch, context, num_kv_heads, head_dim)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)

        # Scatter the packed queries into the [B, max_query_len] grid.
        num_heads = q.shape[1]
        q_grid = q.new_zeros(batch * metadata.max_query_len, num_heads, head_dim)
        q_grid[grid.index] = q
        q_grid = q_grid.view(batch, metadata.max_query_len, num_heads, head_dim).transpose(1, 2)

        # A query sees the keys at or before its own position.
        key_positions = torch.arange(context, device=q.device).view(1, 1, -1)
        mask = key_positions <= grid.positions
        if sliding_window is not None:
            # The window includes the query's own key, so padding rows still see key 0.
            mask &= key_positions > grid.positions - sliding_window

        mask = mask.unsqueeze(1)
        if sinks is not None:
            keys, values, mask = _with_sink_key(keys, values, mask, sinks)
        out = F.scaled_dot_product_attention(
            q_grid,
            keys,
            values,
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(batch * metadata.max_query_len, num_heads, head_dim)
        return out[grid.index]


def _with_sink_key(
    keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks as one more key every query sees: its key and value zero, and an
    additive mask of each head's sink on its column, so that its score is the sink and it
    adds exp(sink) to the softmax's denominator and nothing to the output. keys and values
    [B, kv_heads, context, head_dim], the boolean mask [B, 1, queries, context] -> the
    same with context + 1, the mask additive [B, heads, queries, context + 1]."""
    batch, kv_heads, _, head_dim = keys.shape
    zero = keys.new_zeros(batch, kv_heads, 1, head_dim)
    additive = torch.zeros(mask.shape, dtype=keys.dtype, device=keys.device)
    additive.masked_fill_(~mask, float("-inf"))
    sink = sinks.to(keys.dtype).view(1, -1, 1, 1).expand(batch, -1, mask.shape[2], 1)
    return (
        torch.cat([keys, zero], dim=2),
        torch.cat([values, zero], dim=2),
        torch.cat([additive.expand(-1, sinks.shape[0], -1, -1), sink], dim=3),
    )


def clamped_swiglu(gate_up: torch.Tensor, activation: ClampedSwiGLU) -> torch.Tensor:
    """gpt-oss's activation of gate_up [T, 2 * I], gate half first, in its dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(-activation.limit, activation.limit)
    return (up + 1) * gate * torch.sigmoid(gate * activation.alpha)


def _row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * _normalized(x, eps).to(x.dtype)


def rms_norm_round_once(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
) -> torch.Tensor:
    return (_normalized(x, eps) * (weight.float() + weight_offset)).to(x.dtype)


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``x`` [T, K] as float8 e4m3 with one float32 scale per token [T, 1]."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_SCALE) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def with_bias(product: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A new product with ``bias`` added in place, if there is one."""
    return product if bias is None else product.add_(bias)


class TorchLayerOps:
    defers_norms = False  # no op here reads a row and normalizes it

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def rms_norm_round_once(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float = 0.0
    ) -> torch.Tensor:
        return rms_norm_round_once(x, weight, eps, weight_offset)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def add_rms_norm_round_once(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        weight_offset: float = 0.0,
        output_norm_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if output_norm_weight is not None:
            x = self.rms_norm_round_once(x, output_norm_weight, eps, weight_offset)
        residual = x + residual
        return self.rms_norm_round_once(residual, weight, eps, weight_offset), residual

    def normalize(self, norm: DeferredNorm) -> torch.Tensor:
        if norm.residual is not None:
            torch.add(norm.x, norm.residual, out=norm.stream)
        return self.rms_norm(norm.stream, norm.weight, norm.eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def linear(
        self, x: LinearInput, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(dense(x), weight, bias)

    def linear_float32(self, x: LinearInput, weight: torch.Tensor) -> torch.Tensor:
        # On CUDA the GEMM's epilogue writes float32 itself: a separate conversion would
        # write the [B, vocab] logits in x's dtype and read them once more. On the CPU a
        # bf16 product is rounded first (CPU models run float32).
        x = dense(x)
        if x.is_cuda and x.dtype != torch.float32:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        return F.linear(x, weight).float()

    def takes_one_row(self, x: LinearInput) -> bool:
        return False  # one row is a matrix like any other here: ``linear``

    def one_row_matmul(
        self,
        x: LinearInput,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
        *,
        gated: bool = False,
        bias: torch.Tensor | None = None,
        add: torch.Tensor | None = None,
        all_reduce: OneKernelAllReduce | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError("the torch backend takes no row as one (takes_one_row)")

    def weight_only_matmul(
        self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, *, gated: bool = False
    ) -> torch.Tensor:
        # PyTorch's int8 weight-only GEMM or, for FP8, the codes widened (exactly) to x's
        # dtype and the scales applied to the product.
        if gated:
            x = self.silu_and_mul(x)
        if codes.dtype == torch.int8:
            return torch._weight_int8pack_mm(x, codes, scale.to(x.dtype))
        return F.linear(x, codes.to(x.dtype)) * scale.to(x.dtype)

    def quantize_fp8(
        self, x: LinearInput, *, gated: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = dense(x)
        return quantize_per_token_fp8(self.silu_and_mul(x) if gated else x)

    def fp8_matmul(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return rowwise_scaled_mm(codes, scale, weight, weight_scale, out_dtype)

    def moe_route(
        self, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers' routers: softmax in float32, then torch.topk (equal probabilities in
        # torch.topk's order, which is not the lowest id first on the CPU).
        probabilities = torch.softmax(router_logits.float(), dim=-1)
        weights, ids = torch.topk(probabilities, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids.to(torch.int32)

    def moe_experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor | None,
        w2_scale: torch.Tensor | None,
        expert_offset: int = 0,
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        activation: ClampedSwiGLU | None = None,
    ) -> torch.Tensor:
        # The (token, choice) pairs routed to the experts held here, grouped by expert: one
        # product of each expert with all its tokens, gathered by index. Reads the experts'
        # counts back to the host (a synchronization on CUDA, as this backend's attention).
        num_tokens, top_k = topk_ids.shape
        local = topk_ids.flatten().long() - expert_offset
        held = (local >= 0) & (local < w13.shape[0])
        experts, order = local[held].sort(stable=True)
        pairs = held.nonzero().squeeze(1)[order]
        tokens, weights = pairs // top_k, topk_weights.flatten()[pairs].float()
        counts = torch.bincount(experts, minlength=w13.shape[0]).tolist()
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:  # no token picked it: its weights are not read
                continue
            rows = slice(start, start + count)
            start += count
            gate_up_weight, down_weight = w13[expert], w2[expert]
            scales = (None, None) if w13_scale is None else (w13_scale[expert], w2_scale[expert])
            if w13.dtype == torch.uint8:  # MXFP4: this expert dequantized, exact in x's dtype
                gate_up_weight = _dequantize_expert(gate_up_weight, scales[0], x.dtype)
                down_weight = _dequantize_expert(down_weight, scales[1], x.dtype)
                scales = (None, None)
            gate_up = self._expert_product(x[tokens[rows]], gate_up_weight, scales[0])
            gate_up = with_bias(gate_up, _row(w13_bias, expert))
            if activation is None:
                hidden = self.silu_and_mul(gate_up)
            else:
                hidden = clamped_swiglu(gate_up, activation)
            down = with_bias(
                self._expert_product(hidden, down_weight, scales[1]), _row(w2_bias, expert)
            )
            out.index_add_(0, tokens[rows], down.float() * weights[rows, None])
        return out.to(x.dtype)

    def one_kernel_all_reduce(
        self, tp: TensorParallel, device: torch.device, dtype: torch.dtype, max_bytes: int
    ) -> OneKernelAllReduce | None:
        return torch_one_shot(tp, device, dtype, max_bytes)

    def _expert_product(
        self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None
    ) -> torch.Tensor:
        """x times one expert's matrix, in x's dtype or FP8 codes with per-channel scales."""
        return (
            self.linear(x, weight) if scale is None else self.weight_only_matmul(x, weight, scale)
        )


def _dequantize_expert(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """One expert's MXFP4 matrix, packed [rows, columns / 2] with scales [rows, columns / 32]
    (``LayerOps.moe_experts``), as [rows, columns] in ``dtype``."""
    return dequantize_mxfp4(packed.unflatten(-1, (-1, BLOCK // 2)), scales, dtype)


class TorchStepOps:
    def argmax_rows(self, values: torch.Tensor) -> torch.Tensor:
        return values.argmax(dim=-1)

    def sample_rows(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        seed: torch.Tensor,
        step: torch.Tensor,
        cuts: Cuts | None,
    ) -> torch.Tensor:
        return race_sample(logits, temperature, seed, step, cuts)

    def apply_penalties(self, logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
        return penalized(logits, penalties)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        # xgrammar's C++ loop on the CPU; on other devices its PyTorch ops (its "auto" would
        # launch its Triton kernel on CUDA).
        import xgrammar as xgr

        kernel = "cpu" if logits.device.type == "cpu" else "torch_native"
        xgr.apply_token_bitmask_inplace(logits, bitmask, backend=kernel)

    def emitted_tokens(
        self,
        sampled: torch.Tensor,
        next_drafts: torch.Tensor,
        row_starts: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        # Each row's positions as a row of [R, width]; those past its end are the next row's
        # (or the last position again), after the mismatch its last position always is.
        offsets = torch.arange(width, device=sampled.device)
        positions = (row_starts[:, None] + offsets).clamp_(max=sampled.shape[0] - 1)
        kept = (sampled[positions] == next_drafts[positions]).cumprod(dim=1).sum(dim=1)
        return torch.stack([kept + 1, sampled[row_starts + kept]])

    def fill_pending_tokens(
        self,
        input_ids: torch.Tensor,
        index: torch.Tensor,
        source: torch.Tensor,
        last_sampled: torch.Tensor,
    ) -> None:
        input_ids.index_copy_(0, index, last_sampled[source])

    def fill_graph_inputs(
        self,
        buffers: Sequence[torch.Tensor],
        num_rows: int,
        query_len: int,
        step: Sequence[torch.Tensor] | None = None,
    ) -> None:
        input_ids, positions, slot_mapping, context_lens, block_tables = buffers
        count = 0
        if step is not None:
            count, width = step[4].shape
            num_tokens = count * query_len
            input_ids[:num_tokens].copy_(step[0])
            positions[:num_tokens].copy_(step[1])
            slot_mapping[:num_tokens].copy_(step[2])
            context_lens[:count].copy_(step[3])
            block_tables[:count, :width].copy_(step[4])
        padding = slice(count * query_len, num_rows * query_len)
        slot_mapping[padding].fill_(-1)
        positions[padding].zero_()
        input_ids[padding].zero_()
        context_lens[count:num_rows].fill_(1)
        block_tables[count:num_rows, 0].zero_()


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in float32, as Hugging Face normalises: bf16 variance loses too much."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)
