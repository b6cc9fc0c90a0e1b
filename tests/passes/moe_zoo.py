"""Small MoE blocks in the styles found in the wild, for the detection and rewrite tests.

Shape suffixes: B batch, S sequence, T tokens, H hidden, F ffn, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

H, FFN, E, K = 32, 64, 4, 2


class SwiGLU(nn.Module):
    def __init__(self, h: int = H, f: int = FFN) -> None:
        super().__init__()
        self.w1 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)
        self.w3 = nn.Linear(h, f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class OldHFBlock(nn.Module):
    """HF Mixtral before transformers 5: the block loops over a ModuleList of experts inline."""

    def __init__(self, num_experts: int = E, top_k: int = K, gate_width: int | None = None,
                 expert_ffns: list[int] | None = None, store_aux: bool = False, jitter_noise: float = 0.0) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.store_aux = num_experts, top_k, store_aux
        self.jitter_noise = jitter_noise
        self.gate = nn.Linear(H, gate_width or num_experts, bias=False)
        ffns = expert_ffns or [FFN] * num_experts
        self.experts = nn.ModuleList(SwiGLU(H, f) for f in ffns)
        self.aux_loss = torch.zeros(())

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        if self.store_aux:
            self.aux_loss = router_logits.float().logsumexp(-1).square().mean()   # z-loss
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype,
                                          device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[expert_idx])
            if top_x.shape[0] == 0:
                continue
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current = self.experts[expert_idx](current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim), router_logits


class SetitemLoopBlock(nn.Module):
    """Inline loop with ``out[idx] += ...`` accumulation, sigmoid scores, a shared expert and [B, S] routing."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.mlps = nn.ModuleList(SwiGLU() for _ in range(E))
        self.shared = SwiGLU()

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        scores_BSE = torch.sigmoid(self.router(x_BSH))
        w_BSK, ids_BSK = scores_BSE.topk(K, dim=-1)
        w_BSK = w_BSK / w_BSK.sum(-1, keepdim=True)
        out_BSH = torch.zeros_like(x_BSH)
        for e, mlp in enumerate(self.mlps):
            b, s, k = torch.where(ids_BSK == e)
            out_BSH[b, s] += mlp(x_BSH[b, s]) * w_BSK[b, s, k].unsqueeze(-1)
        return out_BSH + self.shared(x_BSH)


class TitanRouter(nn.Module):
    """torchtitan TokenChoiceTopKRouter: sigmoid scores, top-k on bias-corrected scores, gathered weights."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)

    def forward(self, x_TH: torch.Tensor, expert_bias_E: torch.Tensor):
        scores_TE = torch.sigmoid(self.gate(x_TH).to(torch.float32))
        _, ids_TK = torch.topk(scores_TE + expert_bias_E, K, dim=1)
        top_TK = scores_TE.gather(1, ids_TK)
        top_TK = top_TK / (top_TK.sum(dim=-1, keepdim=True) + 1e-20)
        tokens_per_expert_E = torch.histc(ids_TK.view(-1).float(), bins=E, min=0, max=E)
        return top_TK, ids_TK, tokens_per_expert_E


class GroupedExperts(nn.Module):
    """Stacked expert weights [E, ...], called as experts(x_TH, ids_TK, weights_TK)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, FFN, H) / H ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, FFN) / FFN ** 0.5)
        self.w3 = nn.Parameter(torch.randn(E, FFN, H) / H ** 0.5)

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        h_TKF = F.silu(torch.einsum("th,tkfh->tkf", x_TH, self.w1[ids_TK]))
        h_TKF = h_TKF * torch.einsum("th,tkfh->tkf", x_TH, self.w3[ids_TK])
        y_TKH = torch.einsum("tkf,tkhf->tkh", h_TKF, self.w2[ids_TK])
        return torch.einsum("tkh,tk->th", y_TKH, weights_TK.to(y_TKH.dtype))


class TitanMoE(nn.Module):
    """torchtitan-like MoE: router module, grouped experts, shared experts, load-balancing buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.router = TitanRouter()
        self.experts = GroupedExperts()
        self.shared_experts = SwiGLU()
        self.register_buffer("expert_bias", torch.zeros(E))
        self.register_buffer("tokens_per_expert", torch.zeros(E))

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x_BSH.shape
        x_TH = x_BSH.view(-1, dim)
        top_TK, ids_TK, counts_E = self.router(x_TH, self.expert_bias)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts_E)
        out_TH = self.experts(x_TH, ids_TK, top_TK)
        out_TH = out_TH + self.shared_experts(x_TH)
        return out_TH.reshape(bs, slen, dim)


class SortedTitanMoE(TitanMoE):
    """torchtitan's sort-based call: experts(x_sorted, num_tokens_per_expert). Not the (x, ids, weights)
    interface, so it is rejected with the call seen."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = SortedGroupedExperts()

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        top_TK, ids_TK, counts_E = self.router(x_TH, self.expert_bias)
        order_N = torch.argsort(ids_TK.view(-1), stable=True)
        rows_NH = x_TH[order_N // K] * top_TK.view(-1)[order_N, None]
        y_NH = self.experts(rows_NH, counts_E.long())
        return torch.zeros_like(x_TH).index_add_(0, order_N // K, y_NH).view_as(x_BSH)


class SortedGroupedExperts(GroupedExperts):
    def forward(self, rows_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, rows in enumerate(torch.split(rows_NH, counts_E.tolist())):
            outs.append((F.silu(rows @ self.w1[e].t()) * (rows @ self.w3[e].t())) @ self.w2[e].t())
        return torch.cat(outs)


class UntraceableBlock(TitanMoE):
    """Iterates over a traced value in its routing code: FX cannot trace it."""

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        top_TK, ids_TK, counts_E = self.router(x_TH, self.expert_bias)
        self.last_load = [int(c) for c in counts_E]   # per-expert token counts for logging
        return self.experts(x_TH, ids_TK, top_TK).view_as(x_BSH)


class CurrentHFLoopBlock(OldHFBlock):
    """Inline loop over the experts that were hit (``for e in hit``): FX cannot trace it."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        T_H = hidden_states.view(-1, hidden_states.shape[-1])
        w_TK, ids_TK = torch.topk(F.softmax(self.gate(T_H), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(T_H)
        mask = F.one_hot(ids_TK, num_classes=self.num_experts).permute(2, 1, 0)
        hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()
        for e in hit:
            idx, top_x = torch.where(mask[e[0]])
            out.index_add_(0, top_x, self.experts[e[0]](T_H[top_x]) * w_TK[top_x, idx, None])
        return out.view_as(hidden_states)


class DenseSoftMoE(nn.Module):
    """Every expert on every token, weighted by the full softmax: a router and experts but no top-k."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(SwiGLU() for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.gate(x), dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + w[..., e:e + 1] * expert(x)
        return out


class BlockWeightsMoE(nn.Module):
    """Grok-1 / Tutel style: top-k gates scattered into a dense [T, E] matrix, every expert applied at once by
    einsum over stacked weights that are parameters of the block itself (no experts child)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, H, 2 * H) * 0.1)
        self.w_out = nn.Parameter(torch.randn(E, H, H) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TH = x.reshape(-1, x.shape[-1])
        probs = self.router(x_TH).softmax(-1)
        vals, idx = probs.topk(2, dim=-1)
        gates_TE = torch.zeros_like(probs).scatter(-1, idx, vals)
        a, b = torch.einsum("th,ehf->etf", x_TH, self.w_in).chunk(2, dim=-1)
        y_ETH = torch.einsum("etf,efh->eth", torch.nn.functional.gelu(a) * b, self.w_out)
        return torch.einsum("te,eth->th", gates_TE, y_ETH).view_as(x)


class DenseModel(nn.Module):
    """A plain MLP stack: not MoE-like, must be neither found nor rejected."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SwiGLU() for _ in range(3))
        self.head = nn.Linear(H, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)
