"""Triton kernels for routing metadata, permute and unpermute+combine (forward and backward).

Same functions and semantics as ``reference.py``; ``ops.py`` picks one of the two per call. Each kernel
is written once as a plain function and built on demand into a compiled ``JITFunction`` for CUDA tensors
or an ``InterpretedFunction`` (Triton's CPU interpreter) for CPU tensors. Building both explicitly means
the ``TRITON_INTERPRET`` environment variable is neither needed nor consulted, so other Triton users in
the same process keep their compiled kernels. The kernels therefore call only Triton builtins plus
``tl.reduce`` / ``tl.associative_scan`` with the combine function below (the standard-library helpers
such as ``tl.sum`` are themselves jitted and would bind to one mode at import time).

Routing metadata is a stable counting sort of the group key ``dest * E + expert`` in three passes and
one tiny cumsum, with no host synchronisation:
    1. ``_block_rank_kernel``: per block of BLOCK pairs, the rank of each pair among equal keys of
       earlier pairs in the block (a BLOCK x BLOCK comparison) and the block's histogram [B, G];
    2. ``_scan_blocks_kernel``: per group, exclusive prefix sum of the histogram over blocks, plus
       the group's total count;
    3. ``torch.cumsum`` of the counts gives each group's first row; ``_scatter_rows_kernel`` writes
       ``dst_row = group_start[key] + block_offset[b, key] + local_rank`` and its inverse.
``assign_destinations`` reuses passes 1-2 on the expert key and then places each pair by its rank
inside its expert against the cumulative splits (``_assign_dest_kernel``).

Permute and combine run one program per (token, hidden chunk) on a [K, BLOCK_H] tile: the token's
row is loaded once and stored to its K destinations (permute), or its K expert rows are gathered and
reduced in fp32 with the gate weights (combine) -- no atomics anywhere. All row * H offsets are int64.

Shape suffix legend:
    T = tokens, K = top-k, H = hidden, E = experts, D = destinations, N = T * K rows,
    G = D * E groups, B = blocks of BLOCK pairs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = [
    "routing_metadata",
    "assign_destinations",
    "permute",
    "permute_backward",
    "unpermute_combine",
    "unpermute_combine_backward",
]

# Pairs per block in the counting sort; the in-block rank costs BLOCK_PAIRS**2 comparisons per block.
BLOCK_PAIRS = 128
# Blocks scanned per step and groups per program in the prefix-sum pass.
SCAN_BLOCKS = 64
SCAN_GROUPS = 64
# Hidden-dimension chunk of one program in the copy kernels (rounded down to H's power of two).
MAX_BLOCK_H = 1024


def _add_fn(a, b):
    return a + b


# The combine function of every sum and prefix sum. Triton's own ``_sum_combine`` (what ``tl.sum`` and
# ``tl.cumsum`` use) is recognised by the interpreter, which then runs numpy's sum/cumsum instead of
# calling the combine function element by element; our own jitted add is the fallback.
_add = getattr(tl.standard, "_sum_combine", None) or JITFunction(_add_fn)


# ----------------------------------------------------------------------------------------------------
# Routing metadata: stable counting sort by group key
# ----------------------------------------------------------------------------------------------------


def _block_rank_kernel(
    key_ptr,  # *int64 [N] group key of each pair
    local_rank_ptr,  # *int64 [N] out: rank among equal keys earlier in the same block
    block_hist_ptr,  # *int64 [B, G] out (zero-initialised): count of each key in each block
    num_pairs,  # N
    num_groups,  # G
    BLOCK: tl.constexpr,
):
    block = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK)
    pair = block * BLOCK + lane
    valid = pair < num_pairs
    key = tl.load(key_ptr + pair, mask=valid, other=-1)
    same = (key[:, None] == key[None, :]) & valid[None, :]
    # int32 tiles keep the BLOCK x BLOCK comparison in registers; counts fit easily.
    rank = tl.reduce((same & (lane[None, :] < lane[:, None])).to(tl.int32), 1, _add).to(tl.int64)
    total = tl.reduce(same.to(tl.int32), 1, _add).to(tl.int64)
    tl.store(local_rank_ptr + pair, rank, mask=valid)
    # The first pair of each key in the block writes the block's count for that key.
    tl.store(block_hist_ptr + block * num_groups + key, total, mask=valid & (rank == 0))


def _scan_blocks_kernel(
    block_hist_ptr,  # *int64 [B, G] in: per-block counts; out: exclusive prefix over blocks
    counts_ptr,  # *int64 [G] out: total count of each group
    num_blocks,  # B
    num_groups,  # G
    SCAN_B: tl.constexpr,
    SCAN_G: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64) * SCAN_G + tl.arange(0, SCAN_G)
    group_ok = group < num_groups
    carry = tl.full((SCAN_G,), 0, tl.int64)
    for start in range(0, num_blocks, SCAN_B):
        block = start + tl.arange(0, SCAN_B).to(tl.int64)
        ptr = block_hist_ptr + block[:, None] * num_groups + group[None, :]
        ok = (block[:, None] < num_blocks) & group_ok[None, :]
        hist = tl.load(ptr, mask=ok, other=0)
        inclusive = tl.associative_scan(hist, 0, _add)
        tl.store(ptr, inclusive - hist + carry[None, :], mask=ok)
        carry += tl.reduce(hist, 0, _add)
    tl.store(counts_ptr + group, carry, mask=group_ok)


def _scatter_rows_kernel(
    key_ptr,  # *int64 [N]
    local_rank_ptr,  # *int64 [N]
    block_offset_ptr,  # *int64 [B, G] pairs of each key in earlier blocks
    group_start_ptr,  # *int64 [G] first send-buffer row of each group
    dst_row_ptr,  # *int64 [N] out
    src_pair_ptr,  # *int64 [N] out
    num_pairs,
    num_groups,
    BLOCK: tl.constexpr,
):
    block = tl.program_id(0).to(tl.int64)
    pair = block * BLOCK + tl.arange(0, BLOCK)
    valid = pair < num_pairs
    key = tl.load(key_ptr + pair, mask=valid, other=0)
    rank = tl.load(local_rank_ptr + pair, mask=valid, other=0)
    before = tl.load(block_offset_ptr + block * num_groups + key, mask=valid, other=0)
    start = tl.load(group_start_ptr + key, mask=valid, other=0)
    row = start + before + rank
    tl.store(dst_row_ptr + pair, row, mask=valid)
    tl.store(src_pair_ptr + row, pair, mask=valid)


def _assign_dest_kernel(
    expert_ptr,  # *int64 [N]
    local_rank_ptr,  # *int64 [N]
    block_offset_ptr,  # *int64 [B, E]
    split_end_ptr,  # *int64 [E, D] inclusive cumsum of splits_ED along D
    dest_ptr,  # *int64 [N] out
    num_pairs,
    num_experts,
    num_dests,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    block = tl.program_id(0).to(tl.int64)
    pair = block * BLOCK + tl.arange(0, BLOCK)
    valid = pair < num_pairs
    expert = tl.load(expert_ptr + pair, mask=valid, other=0)
    rank_in_expert = tl.load(block_offset_ptr + block * num_experts + expert, mask=valid, other=0) + tl.load(
        local_rank_ptr + pair, mask=valid, other=0
    )
    # Alg. 3 plan row: destination = number of split segments of this expert that end at or before the rank.
    dest = tl.full((BLOCK,), 0, tl.int64)
    for d0 in range(0, num_dests, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        ok = valid[:, None] & (d[None, :] < num_dests)
        end = tl.load(split_end_ptr + expert[:, None] * num_dests + d[None, :], mask=ok, other=0)
        dest += tl.reduce((ok & (end <= rank_in_expert[:, None])).to(tl.int64), 1, _add)
    tl.store(dest_ptr + pair, tl.minimum(dest, num_dests - 1), mask=valid)


# ----------------------------------------------------------------------------------------------------
# Permute / combine
# ----------------------------------------------------------------------------------------------------


def _permute_kernel(
    x_ptr,  # *[T, H] tokens
    dst_row_ptr,  # *int64 [T, K]
    send_ptr,  # *[rows, H] out, possibly a narrower dtype
    hidden,  # H
    top_k,  # K
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < hidden
    k = tl.arange(0, BLOCK_K)
    k_ok = k < top_k
    row = tl.load(dst_row_ptr + token * top_k + k, mask=k_ok, other=0)
    x = tl.load(x_ptr + token * hidden + h, mask=h_ok, other=0.0).to(send_ptr.dtype.element_ty)
    tile = tl.broadcast_to(x[None, :], (BLOCK_K, BLOCK_H))
    tl.store(send_ptr + row[:, None] * hidden + h[None, :], tile, mask=k_ok[:, None] & h_ok[None, :])


def _gather_sum_kernel(
    y_ptr,  # *[rows, H] send-buffer-ordered rows
    dst_row_ptr,  # *int64 [T, K]
    weights_ptr,  # *[T, K] gate weights (ignored unless WEIGHTED)
    out_ptr,  # *[T, H] out
    hidden,
    top_k,
    WEIGHTED: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # out[t] = sum_k w[t, k] * y[dst_row[t, k]] in fp32: the combine forward (WEIGHTED) and the permute
    # backward (unweighted) -- the top-k reduction happens in registers, no atomics.
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < hidden
    k = tl.arange(0, BLOCK_K)
    k_ok = k < top_k
    row = tl.load(dst_row_ptr + token * top_k + k, mask=k_ok, other=0)
    y = tl.load(y_ptr + row[:, None] * hidden + h[None, :], mask=k_ok[:, None] & h_ok[None, :], other=0.0)
    y = y.to(tl.float32)
    if WEIGHTED:
        w = tl.load(weights_ptr + token * top_k + k, mask=k_ok, other=0.0).to(tl.float32)
        y = y * w[:, None]
    out = tl.reduce(y, 0, _add)
    tl.store(out_ptr + token * hidden + h, out.to(out_ptr.dtype.element_ty), mask=h_ok)


def _combine_backward_kernel(
    grad_out_ptr,  # *[T, H]
    y_ptr,  # *[rows, H]
    dst_row_ptr,  # *int64 [T, K]
    weights_ptr,  # *[T, K]
    grad_y_ptr,  # *[rows, H] out
    grad_weights_ptr,  # *[T, K] out
    hidden,
    top_k,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program per token walks H: grad_y[row_k] = w_k * g (each row written by exactly one pair) and
    # grad_w_k = <y[row_k], g> accumulated in fp32 registers.
    token = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    k_ok = k < top_k
    row = tl.load(dst_row_ptr + token * top_k + k, mask=k_ok, other=0)
    w = tl.load(weights_ptr + token * top_k + k, mask=k_ok, other=0.0).to(tl.float32)
    dot = tl.full((BLOCK_K,), 0.0, tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
        h_ok = h < hidden
        ok = k_ok[:, None] & h_ok[None, :]
        g = tl.load(grad_out_ptr + token * hidden + h, mask=h_ok, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row[:, None] * hidden + h[None, :], mask=ok, other=0.0).to(tl.float32)
        dot += tl.reduce(y * g[None, :], 1, _add)
        grad_y = (w[:, None] * g[None, :]).to(grad_y_ptr.dtype.element_ty)
        tl.store(grad_y_ptr + row[:, None] * hidden + h[None, :], grad_y, mask=ok)
    tl.store(grad_weights_ptr + token * top_k + k, dot.to(grad_weights_ptr.dtype.element_ty), mask=k_ok)


# ----------------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------------


@functools.cache
def _build(fn, interpreted: bool):
    return InterpretedFunction(fn) if interpreted else JITFunction(fn)


def _launch(fn, grid: tuple[int, ...], device: torch.device, *args, **meta) -> None:
    """Run kernel ``fn`` on ``grid``: compiled on CUDA, interpreted on CPU. Empty grids are a no-op."""
    if any(g == 0 for g in grid):
        return
    kernel = _build(fn, device.type == "cpu")
    if device.type == "cpu":
        kernel[grid](*args, **meta)
    else:
        with torch.cuda.device(device):
            kernel[grid](*args, **meta)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _block_h(hidden: int) -> int:
    return min(_pow2(hidden), MAX_BLOCK_H)


def _stable_group_ranks(key_N: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Passes 1-2 of the counting sort: (local_rank_N, block_offset_BG, counts_G)."""
    num_pairs = key_N.numel()
    num_blocks = triton.cdiv(num_pairs, BLOCK_PAIRS)
    device = key_N.device
    local_rank_N = torch.empty(num_pairs, dtype=torch.int64, device=device)
    block_hist_BG = torch.zeros((num_blocks, num_groups), dtype=torch.int64, device=device)
    counts_G = torch.zeros(num_groups, dtype=torch.int64, device=device)
    _launch(
        _block_rank_kernel, (num_blocks,), device, key_N, local_rank_N, block_hist_BG, num_pairs, num_groups,
        BLOCK=BLOCK_PAIRS,
    )
    _launch(
        _scan_blocks_kernel, (triton.cdiv(num_groups, SCAN_GROUPS),), device, block_hist_BG, counts_G,
        num_blocks, num_groups, SCAN_B=SCAN_BLOCKS, SCAN_G=SCAN_GROUPS,
    )
    return local_rank_N, block_hist_BG, counts_G


def routing_metadata(
    expert_ids_TK: Tensor, dest_TK: Tensor, num_experts: int, num_dests: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Triton version of :func:`themis_compile.kernels.reference.routing_metadata`."""
    key_N = (dest_TK.reshape(-1).to(torch.int64) * num_experts + expert_ids_TK.reshape(-1)).contiguous()
    num_pairs, num_groups = key_N.numel(), num_dests * num_experts
    local_rank_N, block_offset_BG, counts_G = _stable_group_ranks(key_N, num_groups)
    group_start_G = torch.cumsum(counts_G, 0) - counts_G
    dst_row_N = torch.empty(num_pairs, dtype=torch.int64, device=key_N.device)
    src_pair_N = torch.empty(num_pairs, dtype=torch.int64, device=key_N.device)
    _launch(
        _scatter_rows_kernel, (triton.cdiv(num_pairs, BLOCK_PAIRS),), key_N.device, key_N, local_rank_N,
        block_offset_BG, group_start_G, dst_row_N, src_pair_N, num_pairs, num_groups, BLOCK=BLOCK_PAIRS,
    )
    return counts_G.view(num_dests, num_experts), dst_row_N.view(dest_TK.shape), src_pair_N


def assign_destinations(expert_ids_TK: Tensor, splits_ED: Tensor) -> Tensor:
    """Triton version of :func:`themis_compile.kernels.reference.assign_destinations` (no validation)."""
    num_experts, num_dests = splits_ED.shape
    expert_N = expert_ids_TK.reshape(-1).to(torch.int64).contiguous()
    num_pairs = expert_N.numel()
    local_rank_N, block_offset_BE, _ = _stable_group_ranks(expert_N, num_experts)
    split_end_ED = torch.cumsum(splits_ED.to(device=expert_N.device, dtype=torch.int64), 1).contiguous()
    dest_N = torch.empty(num_pairs, dtype=torch.int64, device=expert_N.device)
    _launch(
        _assign_dest_kernel, (triton.cdiv(num_pairs, BLOCK_PAIRS),), expert_N.device, expert_N, local_rank_N,
        block_offset_BE, split_end_ED, dest_N, num_pairs, num_experts, num_dests,
        BLOCK=BLOCK_PAIRS, BLOCK_D=min(_pow2(num_dests), 64),
    )
    return dest_N.view(expert_ids_TK.shape)


def permute(x_TH: Tensor, dst_row_TK: Tensor, num_rows: int, out_dtype: torch.dtype | None = None) -> Tensor:
    """Triton version of :func:`themis_compile.kernels.reference.permute`."""
    num_tokens, top_k = dst_row_TK.shape
    hidden = x_TH.shape[1]
    dtype = x_TH.dtype if out_dtype is None else out_dtype
    alloc = torch.empty if num_rows == dst_row_TK.numel() else torch.zeros
    send_NH = alloc((num_rows, hidden), dtype=dtype, device=x_TH.device)
    block_h = _block_h(hidden)
    _launch(
        _permute_kernel, (num_tokens, triton.cdiv(hidden, block_h)), x_TH.device, x_TH, dst_row_TK, send_NH,
        hidden, top_k, BLOCK_K=_pow2(top_k), BLOCK_H=block_h,
    )
    return send_NH


def permute_backward(grad_send_NH: Tensor, dst_row_TK: Tensor, x_dtype: torch.dtype) -> Tensor:
    """Triton version of :func:`themis_compile.kernels.reference.permute_backward`."""
    num_tokens, top_k = dst_row_TK.shape
    hidden = grad_send_NH.shape[1]
    grad_x_TH = torch.empty((num_tokens, hidden), dtype=x_dtype, device=grad_send_NH.device)
    block_h = _block_h(hidden)
    _launch(
        _gather_sum_kernel, (num_tokens, triton.cdiv(hidden, block_h)), grad_send_NH.device, grad_send_NH,
        dst_row_TK, grad_send_NH, grad_x_TH, hidden, top_k, WEIGHTED=False, BLOCK_K=_pow2(top_k), BLOCK_H=block_h,
    )
    return grad_x_TH


def unpermute_combine(y_NH: Tensor, dst_row_TK: Tensor, weights_TK: Tensor) -> Tensor:
    """Triton version of :func:`themis_compile.kernels.reference.unpermute_combine`."""
    num_tokens, top_k = dst_row_TK.shape
    hidden = y_NH.shape[1]
    out_TH = torch.empty((num_tokens, hidden), dtype=y_NH.dtype, device=y_NH.device)
    block_h = _block_h(hidden)
    _launch(
        _gather_sum_kernel, (num_tokens, triton.cdiv(hidden, block_h)), y_NH.device, y_NH, dst_row_TK,
        weights_TK, out_TH, hidden, top_k, WEIGHTED=True, BLOCK_K=_pow2(top_k), BLOCK_H=block_h,
    )
    return out_TH


def unpermute_combine_backward(
    grad_out_TH: Tensor, y_NH: Tensor, dst_row_TK: Tensor, weights_TK: Tensor
) -> tuple[Tensor, Tensor]:
    """Triton version of :func:`themis_compile.kernels.reference.unpermute_combine_backward`."""
    num_tokens, top_k = dst_row_TK.shape
    hidden = y_NH.shape[1]
    alloc = torch.empty if y_NH.shape[0] == dst_row_TK.numel() else torch.zeros
    grad_y_NH = alloc(y_NH.shape, dtype=y_NH.dtype, device=y_NH.device)
    grad_weights_TK = torch.empty_like(weights_TK)
    _launch(
        _combine_backward_kernel, (num_tokens,), y_NH.device, grad_out_TH, y_NH, dst_row_TK, weights_TK,
        grad_y_NH, grad_weights_TK, hidden, top_k, BLOCK_K=_pow2(top_k), BLOCK_H=_block_h(hidden),
    )
    return grad_y_NH, grad_weights_TK
