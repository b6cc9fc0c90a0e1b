"""Token exchange shared by every expert-parallel policy: dispatch -> expert compute -> combine.

Given each (token, k) pair's expert and the rank that serves it (EP: the expert's owner; Themis: a holder
chosen by Alg. 3), rows are permuted into (destination, expert) order, sent with one uneven
``all_to_all_single``, grouped by expert on the receiver, run, sent back and combined with the gate
weights. Dropless: every pair is served. Autograd flows through all of it.

Every collective here has a deadline (`runtime/deadline.py`): a rank that stops participating makes the
others raise within ``timeout_s``, naming the exchange (count exchange, token dispatch, token combine,
forward or backward), the layer and the missing ranks.

Shape suffixes: T tokens, K top-k, H d_model, E experts, W ranks (world), S source ranks, N rows.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.profiler import record_function

from themis_compile import kernels
from themis_compile.runtime import deadline
from themis_compile.runtime.deadline import DEFAULT_TIMEOUT_S


class _AllToAllRows(torch.autograd.Function):
    """``all_to_all_single`` over rows with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x_NH: torch.Tensor, out_splits: list[int], in_splits: list[int], group, purpose: str,
                layer: str, timeout_s: float) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        ctx.call = (purpose, layer, timeout_s)
        out = x_NH.new_empty((sum(out_splits), *x_NH.shape[1:]))
        deadline.all_to_all_single(out, x_NH.contiguous(), out_splits, in_splits, group=group, timeout_s=timeout_s,
                                   purpose=purpose, layer=layer, async_on_device=True)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        out_splits, in_splits = ctx.splits
        purpose, layer, timeout_s = ctx.call
        grad_in = grad_out.new_empty((sum(in_splits), *grad_out.shape[1:]))
        with record_function("themis::all_to_all_backward"):
            deadline.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group,
                                       timeout_s=timeout_s, purpose=f"{purpose}, backward", layer=layer,
                                       async_on_device=True)
        return grad_in, None, None, None, None, None, None


def all_to_all_rows(x_NH: torch.Tensor, out_splits: list[int], in_splits: list[int], group, *,
                    purpose: str = "token exchange", layer: str = "",
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    return _AllToAllRows.apply(x_NH, out_splits, in_splits, group, purpose, layer, timeout_s)


def exchange_counts(counts_WE: torch.Tensor, group, world_size: int, *, layer: str = "",
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    """Send row W=d of ``counts_WE`` to rank d; return what every source sent to us, ``[S, E]``."""
    if world_size == 1:
        return counts_WE
    out = torch.empty_like(counts_WE)
    with record_function("themis::count_exchange"):
        deadline.all_to_all_single(out, counts_WE.contiguous(), group=group, timeout_s=timeout_s,
                                   purpose="count exchange", layer=layer)
    return out


def exchange_held_counts(send_P: torch.Tensor, send_splits_W: list[int], num_held: int, group, world_size: int, *,
                         layer: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    """Send every rank the counts of the experts it holds; return what every source sent us, ``[S, H]``.

    ``send_P`` lists, destination by destination (``send_splits_W[d]`` entries for rank d), this rank's
    pairs for each expert that d holds, in ascending expert order; ``num_held`` is H, the experts this rank
    holds. Every rank knows who holds what (P'), so only held experts' counts travel: E + |ΔP| entries
    sent and D·H received per rank, where the dense count all-to-all (`exchange_counts`) moves D·E each way.
    """
    if world_size == 1:
        return send_P.view(1, num_held)
    out = send_P.new_empty(world_size * num_held)
    with record_function("themis::count_exchange"):
        deadline.all_to_all_single(out, send_P.contiguous(), [num_held] * world_size, send_splits_W, group=group,
                                   timeout_s=timeout_s, purpose="count exchange", layer=layer)
    return out.view(world_size, num_held)


def expert_major_order(counts_SE: torch.Tensor) -> torch.Tensor:
    """Indices that reorder rows received grouped (source, expert) into (expert, source) order."""
    S, E = counts_SE.shape
    flat = counts_SE.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat                       # start of each (s, e) block
    starts_ES = starts.view(S, E).t().reshape(-1)
    lengths_ES = counts_SE.t().reshape(-1)
    total = int(flat.sum())
    block_id = torch.repeat_interleave(torch.arange(S * E), lengths_ES, output_size=total)
    offset_in_block = torch.arange(total) - (torch.cumsum(lengths_ES, 0) - lengths_ES)[block_id]
    return starts_ES[block_id] + offset_in_block


def invert_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


LocalCompute = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]


def dispatch_compute_combine(
    x_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    dest_TK: torch.Tensor,
    num_experts: int,
    compute: LocalCompute,
    *,
    group=None,
    world_size: int = 1,
    layer: str = "",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    kernels_backend: str | None = None,
    recv_counts_SE: torch.Tensor | None = None,
    recv_experts_H: Sequence[int] | None = None,
) -> torch.Tensor:
    """Serve every (token, k) pair on rank ``dest_TK`` and return the weighted combine ``[T, H]``.

    ``compute(rows_NH, counts_E)`` runs the experts on rows grouped by expert (``counts_E[e]`` rows of
    expert e, in expert order) and returns their outputs in the same order. ``layer`` names the MoE layer
    in errors; every exchange fails after ``timeout_s`` when a rank does not take part.
    ``kernels_backend`` is the dispatch/combine kernels' implementation (``ThemisConfig.kernels``:
    ``"auto"``, ``"torch"``, ``"triton"``; None: the process default, `kernels.set_backend`).
    ``recv_counts_SE``: ``[S, E]`` rows of every expert that every source rank sends to this one, when the
    caller knows them (Themis: every rank computes the same Alg. 3 plan); the count all-to-all is then
    skipped. They must equal what the sources' ``dest_TK`` send, or the exchange fails. With
    ``recv_experts_H`` (ascending) its columns are only those experts, ``[S, H]``: nothing else arrives.
    """
    with record_function("themis::dispatch"):
        counts_WE, dst_row_TK, _ = kernels.routing_metadata(ids_TK, dest_TK, num_experts, world_size,
                                                            backend=kernels_backend)
        send_NH = kernels.permute(x_TH, dst_row_TK, backend=kernels_backend)
        if recv_counts_SE is None:
            recv_counts_SE = exchange_counts(counts_WE, group, world_size, layer=layer, timeout_s=timeout_s)
        else:
            recv_counts_SE = recv_counts_SE.to(counts_WE.device)
        if world_size > 1:
            send_splits = counts_WE.sum(1).tolist()
            recv_splits = recv_counts_SE.sum(1).tolist()
            recv_NH = all_to_all_rows(send_NH, recv_splits, send_splits, group, purpose="token dispatch",
                                      layer=layer, timeout_s=timeout_s)
        else:
            recv_NH = send_NH
        order = expert_major_order(recv_counts_SE)
        rows_NH = recv_NH.index_select(0, order)
    with record_function("themis::experts"):
        counts_E = recv_counts_SE.sum(0).tolist()
        if recv_experts_H is not None:
            counts_H, counts_E = counts_E, [0] * num_experts
            for e, n in zip(recv_experts_H, counts_H):
                counts_E[e] = n
        y_NH = compute(rows_NH, counts_E)
    with record_function("themis::combine"):
        y_recv_NH = y_NH.index_select(0, invert_permutation(order))
        if world_size > 1:
            y_send_NH = all_to_all_rows(y_recv_NH, send_splits, recv_splits, group, purpose="token combine",
                                        layer=layer, timeout_s=timeout_s)
        else:
            y_send_NH = y_recv_NH
        return kernels.unpermute_combine(y_send_NH, dst_row_TK, weights_TK, backend=kernels_backend)
