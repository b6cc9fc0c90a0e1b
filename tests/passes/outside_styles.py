"""MoE blocks in styles the rest of the test tree does not write, each imitating a kind of public code (the
docstring names which): counts from ``torch.bincount`` / ``torch.histc`` / ``torch.searchsorted`` /
``torch.unique_consecutive``, combines by ``index_add_`` / ``index_put_`` / ``scatter_reduce_`` / a dense
gate matrix, top-k over a softmax or over a sigmoid with a selection bias, experts with biases, GEGLU or
squared-ReLU activations, experts in a ``ModuleDict`` or stacked in the block itself. They are written as
their authors write MoE code, not after this project's detector: the tests measure the detector on them.

``build(style)`` puts a block in the zoo's small transformer (``tests/passes/zoo_models.py``) with every
router skewed towards expert 0 from outside the block (the zoo way: a norm bias along the router's row 0).

Shape suffixes: B batch, S sequence, T tokens, H hidden, F ffn, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.passes import zoo_models as zoo

H, FFN, E, K = zoo.H, zoo.FFN, zoo.E, zoo.K


class _GeluMLP(nn.Module):
    """The expert most tutorials write: two biased Linears around a GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(H, FFN)
        self.fc2 = nn.Linear(FFN, H)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(H, FFN, bias=False)
        self.up_proj = nn.Linear(H, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BincountIndexAddMoE(nn.Module):
    """DeepSeek's ``moe_infer`` (the (token, slot) pairs sorted by expert, each expert on its run of rows)
    as training forks write it: softmax over all experts, top-k, renormalised; the counts from
    ``torch.bincount`` split the sorted rows, each chunk through its biased GELU expert, the weighted
    results ``index_add_``-ed back."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = E, K
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(_GeluMLP() for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        x = x.view(-1, D)
        probs = F.softmax(self.router(x), dim=-1)
        topk_probs, topk_ids = probs.topk(self.top_k, dim=-1)
        topk_probs = topk_probs / topk_probs.sum(dim=-1, keepdim=True)
        flat_ids = topk_ids.view(-1)
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        order = flat_ids.argsort(stable=True)
        token_idx = order // self.top_k
        chunks = x[token_idx].split(counts.tolist(), dim=0)
        expert_out = torch.cat([expert(chunk) for expert, chunk in zip(self.experts, chunks)], dim=0)
        expert_out = expert_out * topk_probs.view(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(x)
        out.index_add_(0, token_idx, expert_out)
        return out.view(B, S, D)


class HistcOffsetsMoE(nn.Module):
    """MegaBlocks' host bookkeeping (``torch.sort`` of the flat ids, ``torch.histc`` counts, ``cumsum``
    bins) over a ``ModuleList`` of SwiGLU experts: each expert on its slice ``[start, end)`` of the sorted
    rows, the rows written back to their (token, slot) places, the slots summed with the router weights."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = E, K
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(_SwiGLU() for _ in range(E))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        in_shape = hidden_states.shape
        x = hidden_states.reshape(-1, in_shape[-1])
        scores = self.gate(x).softmax(dim=-1)
        weights, top_experts = torch.topk(scores, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        top_experts = top_experts.flatten()
        bin_ids, indices = torch.sort(top_experts)
        tokens_per_expert = torch.histc(top_experts.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        ends = torch.cumsum(tokens_per_expert, dim=0).long().tolist()
        rows = x[indices // self.top_k]
        out = torch.empty_like(rows)
        start = 0
        for e, end in enumerate(ends):
            if end > start:
                out[indices[start:end]] = self.experts[e](rows[start:end])
            start = end
        out = out.view(-1, self.top_k, in_shape[-1]) * weights.unsqueeze(-1)
        return out.sum(dim=1).view(in_shape)


class SearchsortedIndexPutMoE(nn.Module):
    """CSR pointers found by binary search, as segment code builds a ``ptr`` from a sorted index: the flat
    ids sorted, ``torch.searchsorted(sorted_ids, arange(E + 1))`` the start of every expert's rows, top-k
    over the logits with a softmax over the k kept, each expert on its rows, the weighted results combined
    with ``index_put_(..., accumulate=True)``."""

    def __init__(self) -> None:
        super().__init__()
        self.n_experts, self.k = E, K
        self.w_router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(_GeluMLP() for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_TH = x.reshape(-1, shape[-1])
        logits_TE = self.w_router(x_TH)
        top_logits_TK, ids_TK = logits_TE.topk(self.k, dim=-1)
        gates_TK = top_logits_TK.softmax(dim=-1)
        sorted_ids, perm = ids_TK.flatten().sort(stable=True)
        bounds = torch.searchsorted(sorted_ids, torch.arange(self.n_experts + 1, device=x.device)).tolist()
        token_of = perm // self.k
        gate_of = gates_TK.flatten()[perm]
        out_TH = torch.zeros_like(x_TH)
        for e in range(self.n_experts):
            lo, hi = bounds[e], bounds[e + 1]
            if lo == hi:
                continue
            tokens = token_of[lo:hi]
            y = self.experts[e](x_TH[tokens]) * gate_of[lo:hi, None]
            out_TH.index_put_((tokens,), y, accumulate=True)
        return out_TH.view(shape)


class ArgmaxMaskSwitchMoE(nn.Module):
    """Switch Transformer as its PyTorch ports write it (labml.ai's annotated ``SwitchFeedForward``, HF's
    ``SwitchTransformersTop1Router``), here on ``[B, S, H]`` without flattening: top-1 by ``argmax`` of the
    router probabilities, a boolean ``[B, S]`` mask per expert, ``out[mask] = expert(x[mask])``, the output
    scaled by the chosen probability. Experts are biased ReLU MLPs."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, FFN), nn.ReLU(), nn.Linear(FFN, H))
                                     for _ in range(E))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_probs = torch.softmax(self.router(hidden_states), dim=-1)       # [B, S, E]
        expert_index = torch.argmax(router_probs, dim=-1)                      # [B, S]
        max_prob = router_probs.gather(-1, expert_index.unsqueeze(-1))         # [B, S, 1]
        next_states = torch.zeros_like(hidden_states)
        for idx, expert in enumerate(self.experts):
            token_mask = expert_index == idx
            next_states[token_mask] = expert(hidden_states[token_mask]).to(next_states.dtype)
        return next_states * max_prob


class GegluGateMatrixMoE(nn.Module):
    """The sparsely-gated MoE reference code (davidmrau/mixture-of-experts after Shazeer et al. 2017): a
    dense ``[T, E]`` gate matrix, zeros with the top-k renormalised probabilities ``scatter``-ed in, each
    expert on the tokens its column selects (``nonzero``), ``gates[:, e] * expert(x)`` added in; the
    experts are GEGLU FFNs with biases (Shazeer 2020, "GLU Variants Improve Transformer")."""

    class GEGLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj_in = nn.Linear(H, 2 * FFN)
            self.proj_out = nn.Linear(FFN, H)

        def forward(self, x):
            x, gate = self.proj_in(x).chunk(2, dim=-1)
            return self.proj_out(x * F.gelu(gate))

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = E, K
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(self.GEGLU() for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        x = x.reshape(b * n, d)
        probs = self.gate(x).softmax(dim=-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(1, top_i, top_p)                # [T, E]
        y = torch.zeros_like(x)
        for e in range(self.num_experts):
            token_idx = torch.nonzero(gates[:, e] > 0, as_tuple=True)[0]
            y[token_idx] += gates[token_idx, e].unsqueeze(1) * self.experts[e](x[token_idx])
        return y.view(b, n, d)


class OneHotModuleDictMoE(nn.Module):
    """HF Mixtral's ``one_hot`` expert-mask loop (transformers 4.x) with the experts in an ``nn.ModuleDict``
    keyed ``"0"`` .. ``"E-1"`` (as code that loads experts by name keeps them): a ``[T, K, E]`` mask, each
    expert's (token, slot) pairs from ``torch.where`` on its column, the weighted results added with the
    out-of-place ``index_add``."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = E, K
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleDict({str(i): _SwiGLU() for i in range(E)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        flat = x.view(-1, dim)
        weights = F.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weights, selected = weights.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        dispatch = F.one_hot(selected, num_classes=self.num_experts)          # [T, K, E]
        out = torch.zeros_like(flat)
        for key, expert in self.experts.items():
            token, slot = torch.where(dispatch[..., int(key)])
            out = out.index_add(0, token, expert(flat[token]) * weights[token, slot].unsqueeze(-1))
        return out.view(bsz, seq, dim)


class UniqueConsecutiveMoE(nn.Module):
    """The group-by-key idiom of data-processing code, ``torch.unique_consecutive(sorted_keys,
    return_counts=True)``: only the experts present run, each on its contiguous run of sorted rows; the
    results go back to their (token, slot) places through the inverse permutation (``argsort(order)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = K
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(_GeluMLP() for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.gate(x).softmax(-1)
        w, ids = probs.topk(self.top_k, -1)
        w = w / w.sum(-1, keepdim=True)
        sorted_ids, order = ids.flatten().sort(stable=True)
        experts_present, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        rows = x[order // self.top_k]
        outs = []
        for e, chunk in zip(experts_present.tolist(), rows.split(counts.tolist())):
            outs.append(self.experts[e](chunk))
        y = torch.cat(outs)[torch.argsort(order)]
        return (y.view(-1, self.top_k, shape[-1]) * w.unsqueeze(-1)).sum(1).view(shape)


class SigmoidBiasRelu2MoE(nn.Module):
    """DeepSeek-V3's auxiliary-loss-free routing (sigmoid scores, a selection bias added only for the
    choice, the chosen unbiased scores renormalised and scaled), squared-ReLU experts (Primer / nanoGPT
    speedrun), the weighted (token, slot) results combined with ``scatter_reduce(..., "sum")``."""

    class Relu2MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(H, FFN, bias=False)
            self.down = nn.Linear(FFN, H, bias=False)

        def forward(self, x):
            return self.down(F.relu(self.up(x)).square())

    def __init__(self) -> None:
        super().__init__()
        self.n_routed_experts, self.top_k, self.route_scale = E, K, 1.5
        self.router = nn.Linear(H, E, bias=False)
        self.register_buffer("selection_bias", torch.zeros(E))
        self.experts = nn.ModuleList(self.Relu2MLP() for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, shape[-1])
        scores = self.router(x).sigmoid()
        indices = torch.topk(scores + self.selection_bias, self.top_k, dim=-1)[1]
        weights = scores.gather(1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.route_scale
        y = torch.zeros_like(x)
        for i in range(self.n_routed_experts):
            idx, top = torch.where(indices == i)
            out = self.experts[i](x[idx]) * weights[idx, top, None]
            y = y.scatter_reduce(0, idx[:, None].expand_as(out), out, reduce="sum")
        return y.view(shape)


class StackedSplitMoE(nn.Module):
    """torchtitan's for-loop fallback of its grouped experts (``_run_experts_for_loop``: the sorted rows
    split by the per-expert counts, each chunk multiplied by ``w1[e]`` / ``w2[e]``), written on stacked
    ``[E, H, F]`` weights held by the block itself, the counts from ``torch.bincount``."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = E, K
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, FFN) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, FFN, H) * FFN ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.router(x).softmax(-1).topk(self.top_k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        chunks = x[order // self.top_k].split(counts)
        y_sorted = torch.cat([F.gelu(c @ self.w1[e]) @ self.w2[e] for e, c in enumerate(chunks)])
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        return (y.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1)).sum(1).view(shape)


class EinsumSlotsMoE(nn.Module):
    """gpt-fast's ``ConditionalFeedForward`` turned into a loop over the k slots: for each slot, the stacked
    weights of the experts that slot chose gathered (``self.w1[ids[:, k]]``) and applied with ``einsum``,
    the slot's result weighted and accumulated."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = K
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, FFN, H) * H ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, FFN, H) * H ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, FFN) * FFN ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, shape[-1])
        expert_weights, expert_indices = torch.topk(F.softmax(self.gate(x), dim=-1), self.top_k, dim=-1)
        expert_weights = expert_weights / expert_weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for k in range(self.top_k):
            idx = expert_indices[:, k]
            x1 = F.silu(torch.einsum("ti,toi->to", x, self.w1[idx]))
            x3 = torch.einsum("ti,toi->to", x, self.w3[idx])
            out = out + expert_weights[:, k, None] * torch.einsum("to,tio->ti", x1 * x3, self.w2[idx])
        return out.view(shape)


BLOCKS = {
    "bincount_index_add": BincountIndexAddMoE, "histc_offsets": HistcOffsetsMoE,
    "searchsorted_index_put": SearchsortedIndexPutMoE, "argmax_mask_switch": ArgmaxMaskSwitchMoE,
    "geglu_gate_matrix": GegluGateMatrixMoE, "onehot_moduledict": OneHotModuleDictMoE,
    "unique_consecutive": UniqueConsecutiveMoE, "sigmoid_bias_relu2": SigmoidBiasRelu2MoE,
    "stacked_split": StackedSplitMoE, "einsum_slots": EinsumSlotsMoE,
}
ROUTERS = {"bincount_index_add": "router", "histc_offsets": "gate", "searchsorted_index_put": "w_router",
           "argmax_mask_switch": "router", "geglu_gate_matrix": "gate", "onehot_moduledict": "router",
           "unique_consecutive": "gate", "sigmoid_bias_relu2": "router", "stacked_split": "router",
           "einsum_slots": "gate"}
TOP_K = {style: 1 if style == "argmax_mask_switch" else K for style in BLOCKS}


def build(style: str, skew: float = 3.0) -> zoo.ZooLM:
    """The style's block in the zoo transformer, seeded, every router's row 0 raised by ``skew`` for every
    token (the block's input norm gets the bias ``v = 1/sqrt(H)``, orthogonal to its normalized output, and
    the router's row 0 gets ``skew * v``)."""
    torch.manual_seed(0)
    return zoo.skew_routers(zoo.ZooLM(style, blocks=BLOCKS), ROUTERS[style], skew)
