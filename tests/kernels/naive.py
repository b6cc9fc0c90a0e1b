"""Naive Python-loop versions of the dispatch/combine kernels: the ground truth of the kernel tests.

Shape suffix legend: T tokens, K top-k, H hidden, E experts, D destinations, N = T * K rows.
"""

from __future__ import annotations

import torch
from torch import Tensor


def routing_metadata(expert_ids_TK: Tensor, dest_TK: Tensor, num_experts: int, num_dests: int):
    num_tokens, top_k = expert_ids_TK.shape
    counts_DE = torch.zeros(num_dests, num_experts, dtype=torch.int64)
    pairs = []
    for t in range(num_tokens):
        for k in range(top_k):
            d, e = int(dest_TK[t, k]), int(expert_ids_TK[t, k])
            counts_DE[d, e] += 1
            pairs.append((d, e, t * top_k + k))
    src_pair_N = torch.tensor([p for _, _, p in sorted(pairs)], dtype=torch.int64)
    dst_row_TK = torch.empty(num_tokens, top_k, dtype=torch.int64)
    for row, pair in enumerate(src_pair_N.tolist()):
        dst_row_TK[pair // top_k, pair % top_k] = row
    return counts_DE, dst_row_TK, src_pair_N


def assign_destinations(expert_ids_TK: Tensor, splits_ED: Tensor) -> Tensor:
    seen = [0] * splits_ED.shape[0]
    dest_TK = torch.empty_like(expert_ids_TK, dtype=torch.int64)
    for t in range(expert_ids_TK.shape[0]):
        for k in range(expert_ids_TK.shape[1]):
            e = int(expert_ids_TK[t, k])
            rank, d = seen[e], 0
            seen[e] += 1
            while rank >= int(splits_ED[e, d]):
                rank -= int(splits_ED[e, d])
                d += 1
            dest_TK[t, k] = d
    return dest_TK


def permute(x_TH: Tensor, dst_row_TK: Tensor, out_dtype=None) -> Tensor:
    send_NH = torch.zeros(dst_row_TK.numel(), x_TH.shape[1], dtype=out_dtype or x_TH.dtype)
    for t in range(dst_row_TK.shape[0]):
        for k in range(dst_row_TK.shape[1]):
            send_NH[int(dst_row_TK[t, k])] = x_TH[t].to(send_NH.dtype)
    return send_NH


def unpermute_combine(y_NH: Tensor, dst_row_TK: Tensor, weights_TK: Tensor) -> Tensor:
    out_TH = torch.zeros(dst_row_TK.shape[0], y_NH.shape[1], dtype=torch.float64)
    for t in range(dst_row_TK.shape[0]):
        for k in range(dst_row_TK.shape[1]):
            out_TH[t] += float(weights_TK[t, k]) * y_NH[int(dst_row_TK[t, k])].double()
    return out_TH


def permute_grad(grad_send_NH: Tensor, dst_row_TK: Tensor) -> Tensor:
    grad_x_TH = torch.zeros(dst_row_TK.shape[0], grad_send_NH.shape[1], dtype=torch.float64)
    for t in range(dst_row_TK.shape[0]):
        for k in range(dst_row_TK.shape[1]):
            grad_x_TH[t] += grad_send_NH[int(dst_row_TK[t, k])].double()
    return grad_x_TH


def combine_grads(grad_out_TH: Tensor, y_NH: Tensor, dst_row_TK: Tensor, weights_TK: Tensor):
    grad_y_NH = torch.zeros(y_NH.shape, dtype=torch.float64)
    grad_w_TK = torch.zeros(weights_TK.shape, dtype=torch.float64)
    for t in range(dst_row_TK.shape[0]):
        for k in range(dst_row_TK.shape[1]):
            row = int(dst_row_TK[t, k])
            grad_y_NH[row] = float(weights_TK[t, k]) * grad_out_TH[t].double()
            grad_w_TK[t, k] = (y_NH[row].double() * grad_out_TH[t].double()).sum()
    return grad_y_NH, grad_w_TK


def random_routing(num_tokens: int, top_k: int, num_experts: int, num_dests: int, generator: torch.Generator,
                   idle_experts: int = 0):
    """Top-k expert ids (distinct per token; the last ``idle_experts`` experts get no token) and a random
    dispatch plan splits_ED that also leaves some destinations empty."""
    live = num_experts - idle_experts
    scores = torch.rand(num_tokens, live, generator=generator)
    expert_ids_TK = scores.topk(min(top_k, live), dim=1).indices.to(torch.int64)
    counts_E = torch.bincount(expert_ids_TK.flatten(), minlength=num_experts)
    splits_ED = torch.zeros(num_experts, num_dests, dtype=torch.int64)
    for e in range(num_experts):
        left = int(counts_E[e])
        for d in range(num_dests - 1):
            take = int(torch.randint(0, left + 1, (), generator=generator)) if d % 2 == 0 else 0
            splits_ED[e, d] = take
            left -= take
        splits_ED[e, num_dests - 1] = left
    return expert_ids_TK, splits_ED
