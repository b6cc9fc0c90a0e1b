"""Torch reference implementations of the dispatch/combine kernels (the CPU fast path).

Every function here is plain eager PyTorch (sort, index_select, index_add, scatter) and defines the
semantics that the Triton kernels in ``triton_kernels.py`` must reproduce bit for bit on integer outputs
and up to fp32 accumulation order on floating outputs. They are called from inside the opaque
``themis::*`` custom ops in ``ops.py``; nothing here is traced by torch.compile.

Shape suffix legend:
    T = tokens, K = top-k, H = hidden, E = experts, D = destinations (ranks),
    N = T * K rows of the send buffer (one per (token, expert) pair), G = D * E (destination, expert) groups.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "routing_metadata",
    "assign_destinations",
    "permute",
    "permute_backward",
    "unpermute_combine",
    "unpermute_combine_backward",
]


def routing_metadata(
    expert_ids_TK: Tensor, dest_TK: Tensor, num_experts: int, num_dests: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Counts per (destination, expert), the send-buffer row of every pair, and the inverse map.

    The send buffer is ordered by (destination, expert); inside one group by flattened pair index
    ``t * K + k`` (a stable sort of the group key).
    """
    key_N = (dest_TK.reshape(-1) * num_experts + expert_ids_TK.reshape(-1)).to(torch.int64)
    n = key_N.numel()
    counts_G = torch.zeros(num_dests * num_experts, dtype=torch.int64, device=key_N.device)
    counts_G.scatter_add_(0, key_N, torch.ones_like(key_N))
    _, src_pair_N = torch.sort(key_N, stable=True)
    dst_row_N = torch.empty_like(src_pair_N)
    dst_row_N[src_pair_N] = torch.arange(n, dtype=torch.int64, device=key_N.device)
    return counts_G.view(num_dests, num_experts), dst_row_N.view(dest_TK.shape), src_pair_N


def assign_destinations(expert_ids_TK: Tensor, splits_ED: Tensor, validate: bool = True) -> Tensor:
    """Destination of every (token, expert) pair from this rank's row of the dispatch plan (Alg. 3).

    The pairs routed to expert e, in flattened pair order, go to destination 0 for the first
    ``splits_ED[e, 0]`` of them, then to destination 1 for the next ``splits_ED[e, 1]``, and so on.
    With ``validate`` (CPU tensors only, where it costs no device sync) a ``ValueError`` is raised when
    ``splits_ED[e].sum()`` differs from the number of pairs routed to e.
    """
    num_experts, num_dests = splits_ED.shape
    expert_N = expert_ids_TK.reshape(-1).to(torch.int64)
    splits_ED = splits_ED.to(device=expert_N.device, dtype=torch.int64)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_N.device)
    counts_E.scatter_add_(0, expert_N, torch.ones_like(expert_N))
    if validate and expert_N.device.type == "cpu" and not torch.equal(counts_E, splits_ED.sum(1)):
        bad = (counts_E != splits_ED.sum(1)).nonzero().flatten().tolist()
        raise ValueError(
            f"splits_ED rows must sum to the number of pairs routed to each expert; experts {bad[:8]} "
            f"have {counts_E[bad[:8]].tolist()} pairs but splits summing to {splits_ED.sum(1)[bad[:8]].tolist()}"
        )
    # Position of each pair in the expert-major stable order; the flattened (e, d) split segments
    # tile that order exactly, so one searchsorted finds the segment, hence the destination.
    _, order_N = torch.sort(expert_N, stable=True)
    position_N = torch.empty_like(order_N)
    position_N[order_N] = torch.arange(order_N.numel(), dtype=torch.int64, device=expert_N.device)
    segment_end_G = torch.cumsum(splits_ED.reshape(-1), 0)
    segment_N = torch.searchsorted(segment_end_G, position_N, right=True)
    return (segment_N % num_dests).view(expert_ids_TK.shape)


def permute(x_TH: Tensor, dst_row_TK: Tensor, num_rows: int, out_dtype: torch.dtype | None = None) -> Tensor:
    """``send[dst_row[t, k]] = x[t]`` for every pair, cast to ``out_dtype``; unreferenced rows are zero."""
    num_tokens, top_k = dst_row_TK.shape
    dtype = x_TH.dtype if out_dtype is None else out_dtype
    rows_N = dst_row_TK.reshape(-1)
    token_N = torch.arange(num_tokens, device=x_TH.device).repeat_interleave(top_k)
    if num_rows == rows_N.numel():
        # Dropless: dst_row is a permutation, so invert it and gather each row's token (one pass, no scatter).
        token_of_row_N = torch.empty_like(token_N).scatter_(0, rows_N, token_N)
        return x_TH.to(dtype).index_select(0, token_of_row_N)
    send_NH = torch.zeros((num_rows, x_TH.shape[1]), dtype=dtype, device=x_TH.device)
    send_NH.index_copy_(0, rows_N, x_TH.to(dtype).index_select(0, token_N))
    return send_NH


def permute_backward(grad_send_NH: Tensor, dst_row_TK: Tensor, x_dtype: torch.dtype) -> Tensor:
    """``grad_x[t] = sum_k grad_send[dst_row[t, k]]`` accumulated in fp32 (a gather, no atomics)."""
    num_tokens, top_k = dst_row_TK.shape
    g_TKH = grad_send_NH.index_select(0, dst_row_TK.reshape(-1)).view(num_tokens, top_k, grad_send_NH.shape[1])
    return g_TKH.float().sum(1).to(x_dtype)


def unpermute_combine(y_NH: Tensor, dst_row_TK: Tensor, weights_TK: Tensor) -> Tensor:
    """``out[t] = sum_k weights[t, k] * y[dst_row[t, k]]``, accumulated in fp32, returned in y's dtype."""
    num_tokens, top_k = dst_row_TK.shape
    y_TKH = y_NH.index_select(0, dst_row_TK.reshape(-1)).view(num_tokens, top_k, y_NH.shape[1])
    out_TH = (y_TKH.float() * weights_TK.float().unsqueeze(-1)).sum(1)
    return out_TH.to(y_NH.dtype)


def unpermute_combine_backward(
    grad_out_TH: Tensor, y_NH: Tensor, dst_row_TK: Tensor, weights_TK: Tensor
) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`unpermute_combine` w.r.t. ``y`` and ``weights``.

    ``grad_y[dst_row[t, k]] = weights[t, k] * grad_out[t]`` (rows no pair references get zero) and
    ``grad_weights[t, k] = <y[dst_row[t, k]], grad_out[t]>`` in fp32.
    """
    num_tokens, top_k = dst_row_TK.shape
    rows_N = dst_row_TK.reshape(-1)
    g_TH = grad_out_TH.float()
    y_TKH = y_NH.index_select(0, rows_N).view(num_tokens, top_k, y_NH.shape[1]).float()
    grad_weights_TK = (y_TKH * g_TH.unsqueeze(1)).sum(-1).to(weights_TK.dtype)
    grad_pairs_NH = (weights_TK.float().unsqueeze(-1) * g_TH.unsqueeze(1)).reshape(rows_N.numel(), y_NH.shape[1])
    grad_pairs_NH = grad_pairs_NH.to(y_NH.dtype)
    if y_NH.shape[0] == rows_N.numel():
        # Dropless: dst_row is a permutation; gather by its inverse instead of scattering.
        pair_of_row_N = torch.empty_like(rows_N).scatter_(0, rows_N, torch.arange(rows_N.numel(), device=rows_N.device))
        return grad_pairs_NH.index_select(0, pair_of_row_N), grad_weights_TK
    grad_y_NH = torch.zeros(y_NH.shape, dtype=y_NH.dtype, device=y_NH.device)
    grad_y_NH.index_copy_(0, rows_N, grad_pairs_NH)
    return grad_y_NH, grad_weights_TK
