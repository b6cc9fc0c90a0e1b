"""MoE blocks written the way their authors write them, each inside a small transformer.

Each block follows the code of one project (gpt-fast, torchtitan, MegaBlocks, DeepSeek-V3, Switch
Transformer, HF transformers before v5 (Qwen2-MoE, Switch Transformers), fairseq/NLLB, JetMoE), or of
research code that selects its top-k by sorting, reduced to its MoE logic, not shaped after this
project's detector: they measure it.

Shape suffixes: B batch, S sequence, T tokens, H hidden, F ffn, E experts, K top-k, C capacity.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

H, FFN, E, K, VOCAB, HEADS = 32, 32, 4, 2, 64, 4


class GptFastMoE(nn.Module):
    """gpt-fast ``MOEFeedForward``: stacked weights gathered by the selected ids, applied with einsum."""

    class ConditionalFeedForward(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(E, FFN, H) * 0.1)
            self.w2 = nn.Parameter(torch.randn(E, H, FFN) * 0.1)
            self.w3 = nn.Parameter(torch.randn(E, FFN, H) * 0.1)

        def forward(self, x: torch.Tensor, expert_indices: torch.Tensor) -> torch.Tensor:
            w1_weights = self.w1[expert_indices]  # [T, A, D, D]
            w3_weights = self.w3[expert_indices]
            w2_weights = self.w2[expert_indices]
            x1 = F.silu(torch.einsum("ti,taoi -> tao", x, w1_weights))
            x3 = torch.einsum("ti, taoi -> tao", x, w3_weights)
            return torch.einsum("tao, taio -> tai", (x1 * x3), w2_weights)

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.cond_ffn = self.ConditionalFeedForward()
        self.dim = H
        self.num_activated_experts = K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, self.dim)
        scores = self.gate(x)  # [T, E]
        expert_weights = F.softmax(scores, dim=-1)
        expert_weights, expert_indices = torch.topk(expert_weights, self.num_activated_experts, dim=-1)  # [T, A]
        expert_weights /= expert_weights.sum(dim=-1, keepdim=True)
        expert_outs = self.cond_ffn(x, expert_indices)
        return torch.einsum("tai,ta -> ti", expert_outs, expert_weights)


class TitanGroupedMoE(nn.Module):
    """torchtitan ``MoE``: sigmoid router with a load-balancing bias, tokens sorted by expert and the
    grouped experts called on the sorted rows with the per-expert counts."""

    class GroupedExperts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(E, FFN, H) * 0.1)
            self.w2 = nn.Parameter(torch.randn(E, H, FFN) * 0.1)
            self.w3 = nn.Parameter(torch.randn(E, FFN, H) * 0.1)

        def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
            out = []
            for i, x_e in enumerate(torch.split(x, num_tokens_per_expert.tolist(), dim=0)):
                h = F.silu(x_e @ self.w1[i].t()) * (x_e @ self.w3[i].t())
                out.append(h @ self.w2[i].t())
            return torch.cat(out)

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = self.GroupedExperts()
        self.register_buffer("expert_bias", torch.zeros(E), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(E), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = torch.sigmoid(self.gate(x).to(torch.float32))
        _, selected_experts_indices = torch.topk(scores + self.expert_bias, k=K, dim=1)
        top_scores = scores.gather(dim=1, index=selected_experts_indices)
        top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20)
        num_tokens_per_expert = torch.histc(selected_experts_indices.view(-1).float(), bins=E, min=0, max=E)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert)
        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        token_indices_experts_sorted = token_indices_experts_sorted // K
        routed_input = x[token_indices_experts_sorted] * top_scores_experts_sorted.reshape(-1, 1)
        routed_output = self.experts(routed_input, num_tokens_per_expert.long())
        out = torch.zeros_like(x)
        out.scatter_add_(0, token_indices_experts_sorted.reshape(-1, 1).expand(-1, dim), routed_output)
        return out.reshape(bs, slen, dim)


class MegaBlocksMoE(nn.Module):
    """MegaBlocks-style dMoE: experts as one flat [E * F, H] weight pair, tokens sorted by expert,
    bins from a histogram, each expert's rows multiplied by its slice."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E * FFN, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E * FFN, H) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_shape = x.shape
        x = x.view(-1, x.shape[-1])
        scores = self.router(x).softmax(dim=-1)
        expert_weights, top_experts = torch.topk(scores, K, dim=-1)
        expert_weights = expert_weights / expert_weights.norm(p=1, dim=-1, keepdim=True)
        top_experts = top_experts.flatten()
        bin_ids, indices = torch.sort(top_experts)
        tokens_per_expert = torch.histc(top_experts.float(), bins=E, min=0, max=E - 1)
        bins = torch.cumsum(tokens_per_expert, 0).long()
        out = torch.zeros(x.shape[0] * K, x.shape[1], dtype=x.dtype)
        start = 0
        for e in range(E):
            end = int(bins[e])
            rows = indices[start:end]
            h = F.gelu(x[rows // K] @ self.w1[e * FFN:(e + 1) * FFN].t())
            out[rows] = h @ self.w2[e * FFN:(e + 1) * FFN]
            start = end
        out = out.view(-1, K, x.shape[1]) * expert_weights.unsqueeze(-1)
        return out.sum(1).view(in_shape)


class DeepseekV3MoE(nn.Module):
    """DeepSeek-V3 (reference inference code): sigmoid gate with a correction bias, group-limited top-k,
    renormalised and scaled weights, experts run on tokens sorted by expert, a shared expert."""

    class MLP(nn.Module):
        def __init__(self, inter: int = FFN) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(H, inter, bias=False)
            self.up_proj = nn.Linear(H, inter, bias=False)
            self.down_proj = nn.Linear(inter, H, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class MoEGate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.top_k, self.n_group, self.topk_group, self.routed_scaling_factor = K, 2, 1, 2.5
            self.weight = nn.Parameter(torch.randn(E, H) * 0.1)
            self.register_buffer("e_score_correction_bias", torch.zeros(E))

        def forward(self, hidden_states):
            bsz, seq_len, h = hidden_states.shape
            hidden_states = hidden_states.view(-1, h)
            logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32), None)
            scores = logits.sigmoid()
            scores_for_choice = scores.view(bsz * seq_len, -1) + self.e_score_correction_bias.unsqueeze(0)
            group_scores = scores_for_choice.view(bsz * seq_len, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(bsz * seq_len, self.n_group, E // self.n_group)
            score_mask = score_mask.reshape(bsz * seq_len, -1)
            tmp_scores = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
            _, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)
            topk_weight = scores.gather(1, topk_idx)
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
            return topk_idx, topk_weight * self.routed_scaling_factor

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([self.MLP() for _ in range(E)])
        self.gate = self.MoEGate()
        self.shared_experts = self.MLP()

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
        return y + self.shared_experts(identity)

    def moe_infer(self, x, topk_ids, topk_weight):
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(tokens_per_expert.cpu().numpy()):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            outputs.append(self.experts[i](sorted_tokens[start_idx:end_idx]))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return new_x.view(*topk_ids.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(dim=-1)).sum(dim=1)


class SwitchFFN(nn.Module):
    """Switch Transformer (mesh-tensorflow / t5x flavour in PyTorch): top-1 by ``max`` over softmax
    probabilities, each expert fills its masked rows, output scaled by the router probability."""

    def __init__(self) -> None:
        super().__init__()
        self.switch = nn.Linear(H, E)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(H, FFN), nn.ReLU(), nn.Linear(FFN, H))
                                      for _ in range(E)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_len, batch_size, d_model = x.shape
        x = x.reshape(-1, d_model)
        route_prob = torch.softmax(self.switch(x), dim=-1)
        route_prob_max, routes = torch.max(route_prob, dim=-1)
        indexes_list = [torch.eq(routes, i).nonzero(as_tuple=True)[0] for i in range(E)]
        final_output = x.new_zeros(x.shape)
        for i in range(E):
            final_output[indexes_list[i], :] = self.experts[i](x[indexes_list[i], :])
        final_output = final_output * route_prob_max.view(-1, 1)
        return final_output.view(seq_len, batch_size, d_model)


class Qwen2MoeOldBlock(nn.Module):
    """HF Qwen2-MoE before transformers 5: inline loop over a ModuleList, a sigmoid-gated shared expert,
    router logits returned for the auxiliary loss."""

    class MLP(nn.Module):
        def __init__(self, inter: int = FFN) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(H, inter, bias=False)
            self.up_proj = nn.Linear(H, inter, bias=False)
            self.down_proj = nn.Linear(inter, H, bias=False)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = E, K, False
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([self.MLP() for _ in range(E)])
        self.shared_expert = self.MLP(2 * FFN)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        shared_expert_output = self.shared_expert(hidden_states)
        shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output
        final_hidden_states = final_hidden_states + shared_expert_output
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class FairseqTop2MoE(nn.Module):
    """fairseq ``MOELayer`` with ``Top2Gate`` (GShard): dispatch and combine tensors [T, E, C] built from
    one-hot masks and cumulative-sum locations, einsum dispatch, experts on [E, C, H]."""

    def __init__(self, capacity_factor: float = 4.0) -> None:
        super().__init__()
        self.wg = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(H, FFN), nn.ReLU(), nn.Linear(FFN, H))
                                      for _ in range(E)])
        self.capacity_factor = capacity_factor

    def top2gating(self, logits):
        gates = F.softmax(logits, dim=1)
        num_tokens, num_experts = gates.shape
        capacity = 2 * math.ceil(num_tokens / num_experts * self.capacity_factor)
        indices1_s = torch.argmax(gates, dim=1)
        mask1 = F.one_hot(indices1_s, num_classes=num_experts)
        logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
        indices2_s = torch.argmax(logits_except1, dim=1)
        mask2 = F.one_hot(indices2_s, num_classes=num_experts)
        locations1 = torch.cumsum(mask1, dim=0) - 1
        locations2 = torch.cumsum(mask2, dim=0) - 1
        locations2 += torch.sum(mask1, dim=0, keepdim=True)
        mask1 = mask1 * torch.lt(locations1, capacity)
        mask2 = mask2 * torch.lt(locations2, capacity)
        locations1_s = torch.sum(locations1 * mask1, dim=1)
        locations2_s = torch.sum(locations2 * mask2, dim=1)
        gates1_s = (gates * mask1).sum(dim=1)
        gates2_s = (gates * mask2).sum(dim=1)
        denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates.dtype).eps)
        gates1_s, gates2_s = gates1_s / denom_s, gates2_s / denom_s
        gates1 = gates1_s.unsqueeze(-1) * mask1.to(gates1_s.dtype)
        gates2 = gates2_s.unsqueeze(-1) * mask2.to(gates2_s.dtype)
        locations1_sc = F.one_hot(locations1_s, num_classes=capacity)
        locations2_sc = F.one_hot(locations2_s, num_classes=capacity)
        combine1_sec = torch.bmm(gates1.unsqueeze(-1), locations1_sc.to(gates1.dtype).unsqueeze(1))
        combine2_sec = torch.bmm(gates2.unsqueeze(-1), locations2_sc.to(gates2.dtype).unsqueeze(1))
        combine_weights = combine1_sec + combine2_sec
        dispatch_mask = combine_weights.bool()
        return combine_weights, dispatch_mask

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        d_model = input.shape[-1]
        reshaped_input = input.reshape(-1, d_model)
        combine_weights, dispatch_mask = self.top2gating(self.wg(reshaped_input))
        dispatched_input = torch.einsum("sec,sm->ecm", dispatch_mask.to(input.dtype), reshaped_input)
        chunks = dispatched_input.chunk(E, dim=0)
        expert_outputs = torch.cat([expert(chunk) for chunk, expert in zip(chunks, self.experts)], dim=0)
        combined_output = torch.einsum("sec,ecm->sm", combine_weights, expert_outputs)
        return combined_output.reshape(input.shape)


class SwitchSparseMLPv4(nn.Module):
    """HF ``SwitchTransformersSparseMLP`` before transformers 5: a top-1 router returning a one-hot
    ``router_mask`` (argmax, capacity by cumulative sum), experts in a ``ModuleDict`` run only on the
    tokens their mask selects (experts without tokens skipped), dropped tokens passed through, the router
    probability multiplied after."""

    class Top1Router(nn.Module):
        def __init__(self, expert_capacity: int = 64) -> None:
            super().__init__()
            self.num_experts, self.expert_capacity = E, expert_capacity
            self.classifier = nn.Linear(H, E, bias=False)

        def forward(self, hidden_states):
            router_logits = self.classifier(hidden_states)
            router_probs = F.softmax(router_logits, dim=-1)
            expert_index = torch.argmax(router_probs, dim=-1)
            expert_index = F.one_hot(expert_index, num_classes=self.num_experts)
            token_priority = torch.cumsum(expert_index, dim=-2)
            expert_capacity_mask = token_priority <= self.expert_capacity
            expert_index = expert_index * expert_capacity_mask
            router_probs = torch.max(router_probs, dim=-1).values.unsqueeze(-1)
            return expert_index, router_probs, router_logits

    def __init__(self) -> None:
        super().__init__()
        self.router = self.Top1Router()
        self.experts = nn.ModuleDict({f"expert_{idx}": nn.Sequential(nn.Linear(H, FFN), nn.ReLU(),
                                                                     nn.Linear(FFN, H)) for idx in range(E)})

    def forward(self, hidden_states):
        router_mask, router_probs, router_logits = self.router(hidden_states)
        expert_index = torch.argmax(router_mask, dim=-1)
        next_states = hidden_states.clone()
        router_mask = router_mask.bool()
        batch_size, seq_len, num_experts = router_mask.shape
        idx_mask = router_mask.reshape(batch_size * seq_len, num_experts).sum(dim=0)
        idx_mask = torch.nonzero(idx_mask, as_tuple=True)[0].tolist()
        for idx in idx_mask:
            next_states[router_mask[:, :, idx]] = getattr(self.experts, f"expert_{idx}")(
                hidden_states[router_mask[:, :, idx]])
        hidden_states = router_probs * next_states
        return hidden_states, (router_logits, expert_index)


class JetMoeMoE(nn.Module):
    """JetMoE's ``MoE``: a top-k gate, ``ParallelExperts`` holding stacked weights applied to tokens
    sorted by expert and split by the per-expert counts."""

    class ParallelExperts(nn.Module):
        def __init__(self, num_experts: int, input_size: int, output_size: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(num_experts, output_size, input_size) * 0.1)

        def forward(self, inputs, expert_size):
            input_list = inputs.split(expert_size, dim=0)
            return torch.cat([F.linear(input_list[i], self.weight[i]) for i in range(len(input_list))], dim=0)

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.input_linear = self.ParallelExperts(E, H, FFN * 2)
        self.output_linear = self.ParallelExperts(E, FFN, H)
        self.bias = nn.Parameter(torch.zeros(H))

    def forward(self, layer_input):
        bsz, length, emb_size = layer_input.size()
        layer_input = layer_input.reshape(-1, emb_size)
        logits = self.router(layer_input)
        top_k_logits, top_k_indices = logits.topk(K, dim=1)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(layer_input)
        zeros = torch.zeros([top_k_gates.size(0), E], dtype=top_k_gates.dtype)
        gates = zeros.scatter(1, top_k_indices, 1)
        expert_size = gates.long().sum(0).tolist()
        top_k_experts = top_k_indices.flatten()
        _, index_sorted_experts = top_k_experts.sort(0)
        batch_index = index_sorted_experts.div(K, rounding_mode="trunc")
        batch_gates = top_k_gates.flatten()[index_sorted_experts]
        expert_inputs = layer_input[batch_index]
        h = self.input_linear(expert_inputs, expert_size)
        h, gate = h.chunk(2, dim=-1)
        h = F.silu(gate) * h
        expert_outputs = self.output_linear(h, expert_size) * batch_gates[:, None]
        y = torch.zeros((bsz * length, emb_size), dtype=expert_outputs.dtype)
        y = y.index_add(0, batch_index, expert_outputs)
        return y.view(bsz, length, emb_size) + self.bias


class MixtralOldBlock(nn.Module):
    """HF ``MixtralSparseMoeBlock`` of transformers 4.36-4.38: softmax -> top-k -> renormalised weights,
    an inline loop over a ``ModuleList`` of ``w1/w2/w3`` experts that skips experts without tokens
    (``if top_x.shape[0] == 0: continue``) and indexes with Python lists, router logits returned."""

    class BlockSparseTop2MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Linear(H, FFN, bias=False)
            self.w2 = nn.Linear(FFN, H, bias=False)
            self.w3 = nn.Linear(H, FFN, bias=False)
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states):
            current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
            return self.w2(current_hidden_states)

    def __init__(self, jitter_noise: float = 0.0) -> None:
        super().__init__()
        self.hidden_dim, self.ffn_dim, self.num_experts, self.top_k = H, FFN, E, K
        self.gate = nn.Linear(self.hidden_dim, self.num_experts, bias=False)
        self.experts = nn.ModuleList([self.BlockSparseTop2MLP() for _ in range(self.num_experts)])
        self.jitter_noise = jitter_noise

    def forward(self, hidden_states: torch.Tensor):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype,
                                          device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            if top_x.shape[0] == 0:
                continue
            top_x_list = top_x.tolist()
            idx_list = idx.tolist()
            current_state = hidden_states[None, top_x_list].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x_list, idx_list, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class DbrxOldFFN(nn.Module):
    """HF ``DbrxFFN`` before transformers 5: a router module returning (probabilities, p-normalised
    top-k weights, ids), and ``DbrxExperts`` holding every expert fused in flat ``w1/v1/w2`` [E * F, H]
    parameters, viewed as [E, F, H] and chunked per expert inside its forward, which takes the block's
    input and the whole routing and loops over the experts (skipping those without tokens)."""

    class Router(nn.Module):
        def __init__(self, moe_jitter_eps: float | None = None, moe_normalize_expert_weights: float | None = 1.0):
            super().__init__()
            self.hidden_size, self.moe_num_experts, self.moe_top_k = H, E, K
            self.moe_jitter_eps = moe_jitter_eps
            self.moe_normalize_expert_weights = moe_normalize_expert_weights
            self.layer = nn.Linear(self.hidden_size, self.moe_num_experts, bias=False)

        def forward(self, hidden_states: torch.Tensor):
            if self.training and self.moe_jitter_eps is not None:
                hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.moe_jitter_eps,
                                                                          1.0 + self.moe_jitter_eps)
            hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
            weights = self.layer(hidden_states).softmax(dim=-1, dtype=torch.float32)
            top_weights, top_experts = torch.topk(weights, self.moe_top_k, dim=-1)
            top_weights_scale = (
                torch.norm(top_weights, p=self.moe_normalize_expert_weights, dim=-1, keepdim=True)
                if self.moe_normalize_expert_weights is not None
                else 1.0
            )
            top_weights = top_weights / top_weights_scale
            weights = weights.to(hidden_states.dtype)
            top_weights = top_weights.to(hidden_states.dtype)
            return weights, top_weights, top_experts

    class ExpertGLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden_size, self.ffn_hidden_size, self.moe_num_experts = H, FFN, E
            self.w1 = nn.Parameter(torch.randn(E * FFN, H) * 0.1)
            self.v1 = nn.Parameter(torch.randn(E * FFN, H) * 0.1)
            self.w2 = nn.Parameter(torch.randn(E * FFN, H) * 0.1)
            self.activation_fn = nn.SiLU()

        def forward(self, x, expert_w1, expert_v1, expert_w2):
            gate_proj = x.matmul(expert_w1.t())
            up_proj = x.matmul(expert_v1.t())
            gate_proj = self.activation_fn(gate_proj)
            intermediate_states = gate_proj * up_proj
            return intermediate_states.matmul(expert_w2)

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe_num_experts = E
            self.mlp = DbrxOldFFN.ExpertGLU()

        def forward(self, x, weights, top_weights, top_experts):
            bsz, q_len, hidden_size = x.shape
            x = x.view(-1, hidden_size)
            out = torch.zeros_like(x)
            expert_mask = F.one_hot(top_experts, num_classes=self.moe_num_experts).permute(2, 1, 0)
            # Chunk experts at once to avoid storing full parameter multiple times in autograd
            w1_chunked = self.mlp.w1.view(self.mlp.moe_num_experts, self.mlp.ffn_hidden_size,
                                          self.mlp.hidden_size).chunk(self.moe_num_experts, dim=0)
            v1_chunked = self.mlp.v1.view(self.mlp.moe_num_experts, self.mlp.ffn_hidden_size,
                                          self.mlp.hidden_size).chunk(self.moe_num_experts, dim=0)
            w2_chunked = self.mlp.w2.view(self.mlp.moe_num_experts, self.mlp.ffn_hidden_size,
                                          self.mlp.hidden_size).chunk(self.moe_num_experts, dim=0)
            w1_chunked = [w1.squeeze(dim=0) for w1 in w1_chunked]
            v1_chunked = [v1.squeeze(dim=0) for v1 in v1_chunked]
            w2_chunked = [w2.squeeze(dim=0) for w2 in w2_chunked]
            for expert_idx in range(0, self.moe_num_experts):
                topk_idx, token_idx = torch.where(expert_mask[expert_idx])
                if token_idx.shape[0] == 0:
                    continue
                token_list = token_idx
                topk_list = topk_idx
                expert_tokens = x[None, token_list].reshape(-1, hidden_size)
                expert_out = (
                    self.mlp(expert_tokens, w1_chunked[expert_idx], v1_chunked[expert_idx], w2_chunked[expert_idx])
                    * top_weights[token_list, topk_list, None]
                )
                out.index_add_(0, token_idx, expert_out)
            return out.reshape(bsz, q_len, hidden_size)

    def __init__(self) -> None:
        super().__init__()
        self.router = self.Router()
        self.experts = self.Experts()

    def forward(self, x: torch.Tensor):
        weights, top_weights, top_experts = self.router(x)
        out = self.experts(x, weights, top_weights, top_experts)
        return out, weights


class Llama4OldMoe(nn.Module):
    """HF ``Llama4TextMoe`` of transformers 4.51: a top-1 router whose chosen logit goes through a
    sigmoid and every other to ``sigmoid(-inf) = 0``; every expert runs on every token (``bmm`` over
    stacked ``gate_up_proj [E, H, 2F]`` / ``down_proj [E, F, H]``) with the score applied to the
    expert's *input*, and the results ``scatter_add_``-ed onto a shared expert's output."""

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts, self.hidden_size, self.expert_dim = E, H, FFN
            self.gate_up_proj = nn.Parameter(torch.randn(self.num_experts, self.hidden_size, 2 * self.expert_dim) * 0.1)
            self.down_proj = nn.Parameter(torch.randn(self.num_experts, self.expert_dim, self.hidden_size) * 0.1)
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            hidden_states = hidden_states.view(self.num_experts, -1, self.hidden_size)
            gate_up = torch.bmm(hidden_states, self.gate_up_proj)
            gate, up = gate_up.chunk(2, dim=-1)
            next_states = torch.bmm((up * self.act_fn(gate)), self.down_proj)
            return next_states.view(-1, self.hidden_size)

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = nn.Linear(H, FFN, bias=False)
            self.up_proj = nn.Linear(H, FFN, bias=False)
            self.down_proj = nn.Linear(FFN, H, bias=False)
            self.activation_fn = nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.activation_fn(self.gate_proj(x)) * self.up_proj(x))

    def __init__(self) -> None:
        super().__init__()
        self.top_k, self.hidden_dim, self.num_experts = 1, H, E   # Llama 4's num_experts_per_tok = 1
        self.experts = self.Experts()
        self.router = nn.Linear(H, E, bias=False)
        self.shared_expert = self.MLP()

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = self.router(hidden_states)
        tokens_per_expert = hidden_states.shape[0]
        router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=1)
        router_scores = (
            torch.full_like(router_logits, float("-inf")).scatter_(1, router_indices, router_top_value).transpose(0, 1)
        )
        router_indices = (
            torch.arange(tokens_per_expert, device=hidden_states.device).view(1, -1).expand(router_scores.size(0), -1)
        )
        router_scores = torch.sigmoid(router_scores.float()).to(hidden_states.dtype)
        router_indices = router_indices.reshape(-1, 1).expand(-1, self.hidden_dim)
        routed_in = torch.gather(input=hidden_states, dim=0, index=router_indices).to(hidden_states.device)
        routed_in = routed_in * router_scores.reshape(-1, 1)
        routed_out = self.experts(routed_in)
        out = self.shared_expert(hidden_states)
        out.scatter_add_(dim=0, index=router_indices, src=routed_out.view(-1, self.hidden_dim))
        return out, router_scores


class SortedTopKMoE(nn.Module):
    """A top-k MoE as research code often writes it without ``topk``: softmax router, the scores sorted in
    descending order and cut to the first k (``torch.sort`` + ``[:, :k]``), the kept weights renormalised,
    a ``ModuleList`` of SwiGLU experts looped over, each on the (token, slot) pairs that chose it,
    accumulated with ``index_add_``."""

    class SwiGLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_gate = nn.Linear(H, FFN, bias=False)
            self.w_up = nn.Linear(H, FFN, bias=False)
            self.w_down = nn.Linear(FFN, H, bias=False)

        def forward(self, x):
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))

    def __init__(self, num_experts: int = E, k: int = K) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(H, num_experts, bias=False)
        self.experts = nn.ModuleList(self.SwiGLU() for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).softmax(dim=-1)
        sorted_probs, sorted_experts = torch.sort(probs, dim=-1, descending=True)
        weights, chosen = sorted_probs[:, :self.k], sorted_experts[:, :self.k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, weights[token, slot, None] * expert(x[token]))
        return out.view(shape)


class ArgsortBmmMoE(nn.Module):
    """Top-2 by ``argsort`` of the router logits, softmax over the two kept logits (the Mixtral paper's
    ``softmax(top2(x W_g))``); the experts are stacked weights with a fused gate/up projection ``[E, H, 2F]``,
    gathered per (token, slot) by the ids and applied with ``torch.bmm``; the block weighs and sums the
    slots itself."""

    class StackedSwiGLU(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_gate_up = nn.Parameter(torch.randn(E, H, 2 * FFN) * 0.1)
            self.w_down = nn.Parameter(torch.randn(E, FFN, H) * 0.1)

        def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
            (T, k), D = ids_TK.shape, x_TH.shape[-1]
            rows = x_TH.unsqueeze(1).expand(T, k, D).reshape(T * k, 1, D)
            gate, up = torch.bmm(rows, self.w_gate_up[ids_TK.reshape(-1)]).chunk(2, dim=-1)
            out = torch.bmm(F.silu(gate) * up, self.w_down[ids_TK.reshape(-1)])
            return out.view(T, k, D)

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 2
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = self.StackedSwiGLU()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = self.gate(x)
        ids = torch.argsort(logits, dim=-1, descending=True)[..., :self.top_k]
        weights = torch.softmax(logits.gather(-1, ids), dim=-1)
        y = self.experts(x, ids)                                  # [T, K, H]
        return (y * weights.unsqueeze(-1)).sum(dim=1).view(shape)


class SortedNonzeroMoE(nn.Module):
    """Scores sorted once per token (``probs.sort(descending=True)``), the first k kept and renormalised in
    float32; only the experts some token chose are visited (``unique().tolist()``), each finding its
    (token, slot) pairs with ``nonzero`` and adding its weighted output in place (``out[token] += ...``)."""

    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(H, FFN)
            self.fc2 = nn.Linear(FFN, H)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.num_selected = E, K
        self.w_gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(self.Expert() for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.w_gate(x), dim=-1, dtype=torch.float32)
        vals, idx = probs.sort(dim=-1, descending=True)
        vals, idx = vals[:, :self.num_selected], idx[:, :self.num_selected]
        vals = vals / vals.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():
            token, slot = (idx == e).nonzero(as_tuple=True)
            out[token] += vals[token, slot].unsqueeze(-1).to(x.dtype) * self.experts[e](x[token])
        return out.view(shape)


BLOCKS = {
    "gpt_fast": GptFastMoE, "torchtitan": TitanGroupedMoE, "megablocks": MegaBlocksMoE,
    "deepseek_v3": DeepseekV3MoE, "switch": SwitchFFN, "hf_qwen2_moe_v4": Qwen2MoeOldBlock,
    "fairseq_top2": FairseqTop2MoE, "jetmoe": JetMoeMoE, "hf_switch_v4": SwitchSparseMLPv4,
    "hf_mixtral_v4": MixtralOldBlock, "hf_dbrx_v4": DbrxOldFFN, "hf_llama4_v4": Llama4OldMoe,
    "sort_topk_loop": SortedTopKMoE, "argsort_bmm": ArgsortBmmMoE, "sort_nonzero": SortedNonzeroMoE,
}


def _moe_output(out):
    """The hidden states of what a block returns: a tensor, a tuple led by them (``(out, router_logits)``),
    or an output object holding them (a dataclass with ``hidden_states``)."""
    if isinstance(out, tuple):
        return out[0]
    return getattr(out, "hidden_states", out)


class Layer(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.moe = block

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        q, k, v = self.qkv(self.norm1(x_BSH)).view(B, S, 3, HEADS, H // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, H)
        x_BSH = x_BSH + self.proj(a)
        return x_BSH + _moe_output(self.moe(self.norm2(x_BSH))).view_as(x_BSH)


class ZooLM(nn.Module):
    """Embedding, two (attention + MoE block) layers, LM head: a small transformer around a block."""

    def __init__(self, style: str, layers: int = 2, blocks: dict | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(Layer((BLOCKS if blocks is None else blocks)[style]()) for _ in range(layers))
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens_BS)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def loss(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        logits = self(tokens_BS)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens_BS[:, 1:].reshape(-1))


def router_weight(block: nn.Module, router_path: str) -> torch.Tensor:
    """The router's [E, H] weight: ``router_path`` names a Linear or the weight itself."""
    obj = block
    for part in router_path.split("."):
        obj = getattr(obj, part)
    weight = obj.weight if isinstance(obj, nn.Module) else obj
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != H:
        raise AssertionError(f"router {router_path!r} of {type(block).__name__} is not an [E, H] weight")
    return weight


def skew_routers(model: ZooLM, router_paths, skew: float, expert: int = 0) -> ZooLM:
    """``model`` with every layer's router favouring ``expert`` for every token, from outside the block: the
    layer's input norm gets the bias v = 1/sqrt(H), orthogonal to its normalized output, and row ``expert`` of
    the router's weight gets ``skew * v``. ``router_paths``: one path for every layer, or one per layer."""
    paths = [router_paths] * len(model.layers) if isinstance(router_paths, str) else list(router_paths)
    v_H = torch.full((H,), H ** -0.5)
    with torch.no_grad():
        for layer, path in zip(model.layers, paths, strict=True):
            layer.norm2.bias.copy_(v_H)
            router_weight(layer.moe, path)[expert] += skew * v_H
    return model


def dense_params(model: nn.Module, is_expert=lambda name: ".experts." in name) -> dict[str, torch.Tensor]:
    """Every parameter of a ZooLM-like model that ``is_expert`` (by name) does not claim, full (FSDP2 shards
    are gathered: a collective), by name.

    The key third of each attention's ``qkv.bias`` is left out: its gradient is exactly zero (softmax
    over the keys is invariant to adding ``q . b_k`` to every logit of a query), so what it receives is
    rounding noise (~1e-9), which AdamW divides by its own RMS into lr-sized steps of random sign in
    the reference and the distributed run alike. Its query and value thirds are compared.
    """
    out = {}
    for n, p in model.named_parameters():
        if is_expert(n):
            continue
        p = p.detach()
        if hasattr(p, "full_tensor"):   # FSDP2 shards dense parameters as DTensors (collective)
            p = p.full_tensor()
        if n.endswith(".qkv.bias"):
            q_H, _, v_H = p.chunk(3)
            p = torch.cat([q_H, v_H])
        out[n] = p.clone()
    return out


def train_losses(model: nn.Module, steps: int, batch: int, seq: int) -> list[float]:
    """AdamW steps of a ZooLM-like model (``model.loss(tokens)``) on seeded global batches, each rank of
    the process group (if any) taking its contiguous slice: the global loss per step (all-reduced over
    the ranks; `tests.runtime.equivalence.global_losses`)."""
    from tests.runtime.equivalence import global_losses

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(steps)]
    return global_losses(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                         lambda m, tokens: m.loss(tokens))


# --- Experts held in a ModuleList inside a wrapper module (Megatron-Core, DeepSpeed) ----------------------

def megatron_permute(tokens_TH: torch.Tensor, routing_map_TE: torch.Tensor):
    """Megatron-Core ``moe_utils.permute``: the tokens of each expert, expert by expert (token order kept)."""
    num_tokens, _ = tokens_TH.shape
    num_experts = routing_map_TE.shape[1]
    routing_map_ET = routing_map_TE.bool().T.contiguous()
    token_indices = torch.arange(num_tokens, device=routing_map_ET.device).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = token_indices.masked_select(routing_map_ET)
    return tokens_TH.index_select(0, sorted_indices), sorted_indices


def megatron_unpermute(permuted_tokens, sorted_indices, restore_shape, probs_TE, routing_map_TE):
    """Megatron-Core ``moe_utils.unpermute``: weigh each row by its probability, scatter-add it back."""
    _, hidden = restore_shape
    permuted_probs = probs_TE.T.contiguous().masked_select(routing_map_TE.T.contiguous())
    permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output_tokens = torch.zeros(restore_shape, device=permuted_tokens.device, dtype=permuted_tokens.dtype)
    output_tokens.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)
    return output_tokens


class MegatronMLP(nn.Module):
    """Megatron-Core ``MLP`` with ``gated_linear_unit``: linear_fc1 to 2F, SwiGLU, linear_fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(H, 2 * FFN, bias=False)
        self.linear_fc2 = nn.Linear(FFN, H, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(self.linear_fc1(hidden_states), 2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class MegatronTopKRouter(nn.Module):
    """Megatron-Core ``TopKRouter``: logits by a bare [E, H] weight, ``topk_softmax_with_capacity``
    (top-k of the logits, softmax over the k) as dense probs [T, E] and a boolean routing map [T, E]."""

    def __init__(self) -> None:
        super().__init__()
        self.topk = K
        self.weight = nn.Parameter(torch.randn(E, H) * 0.1)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight)

    def routing(self, logits: torch.Tensor):
        scores, top_indices = torch.topk(logits, k=self.topk, dim=1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
        routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
        return routing_probs, routing_map

    def forward(self, input: torch.Tensor):
        logits = self.gating(input).view(-1, E)
        return self.routing(logits)


class MegatronSequentialMLP(nn.Module):
    """Megatron-Core ``SequentialMLP``: ``local_experts`` run one after the other on the splits of the
    permuted rows by ``tokens_per_expert``; returns ``(output, output_bias)``."""

    def __init__(self, num_local_experts: int = E) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.local_experts = nn.ModuleList(MegatronMLP() for _ in range(num_local_experts))

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor):
        tokens_list = torch.split(permuted_local_hidden_states, tokens_per_expert.tolist())
        output_local = torch.cat([expert(tokens) for expert, tokens in zip(self.local_experts, tokens_list)], dim=0)
        return output_local, None       # (output, output_bias): the experts have no bias


class MegatronMoELayer(nn.Module):
    """Megatron-Core ``MoELayer`` with one expert-parallel rank: router, token permutation by the routing
    map, ``SequentialMLP`` on the rows sorted by expert, unpermutation weighted by the probs."""

    def __init__(self) -> None:
        super().__init__()
        self.router = MegatronTopKRouter()
        self.experts = MegatronSequentialMLP()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_shape[-1])
        probs, routing_map = self.router(hidden_states)
        tokens_per_expert = routing_map.sum(dim=0)
        permuted, sorted_indices = megatron_permute(hidden_states, routing_map)
        expert_output, mlp_bias = self.experts(permuted, tokens_per_expert)
        output = megatron_unpermute(expert_output, sorted_indices, hidden_states.shape, probs, routing_map)
        return output.view(hidden_shape), mlp_bias


def deepspeed_capacity(gates: torch.Tensor, capacity_factor: torch.Tensor, min_capacity: torch.Tensor) -> torch.Tensor:
    num_tokens, num_experts = gates.shape[0], gates.shape[1]
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    if capacity < min_capacity:
        capacity = min_capacity.to(torch.int64)
    return capacity


def deepspeed_top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int):
    """DeepSpeed ``sharded_moe.top2gating`` (without the gumbel noise of its second choice)."""
    gates = F.softmax(logits, dim=1)
    capacity = deepspeed_capacity(gates, torch.tensor(capacity_factor * 2), torch.tensor(min_capacity))
    indices1_s = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = F.one_hot(indices2_s, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    mask1 *= torch.lt(locations1, capacity)
    mask2 *= torch.lt(locations2, capacity)
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    mask1_float, mask2_float = mask1.float(), mask2.float()
    gates1_s = torch.einsum("se,se->s", gates, mask1_float)
    gates2_s = torch.einsum("se,se->s", gates, mask2_float)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates1_s.dtype).eps)
    gates1_s = gates1_s / denom_s
    gates2_s = gates2_s / denom_s
    gates1 = torch.einsum("s,se->se", gates1_s, mask1_float)
    gates2 = torch.einsum("s,se->se", gates2_s, mask2_float)
    locations1_sc = F.one_hot(locations1_s, num_classes=int(capacity)).float()
    locations2_sc = F.one_hot(locations2_s, num_classes=int(capacity)).float()
    combine1_sec = torch.einsum("se,sc->sec", gates1, locations1_sc)
    combine2_sec = torch.einsum("se,sc->sec", gates2, locations2_sc)
    combine_weights = combine1_sec + combine2_sec
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


class DeepSpeedTopKGate(nn.Module):
    """DeepSpeed ``TopKGate`` (k = 2). The capacity factor is large enough that no token is dropped: a
    capacity depends on the local batch, so dropping differs between one process and N ranks."""

    def __init__(self, capacity_factor: float = E / 2, min_capacity: int = 4) -> None:
        super().__init__()
        self.wg = nn.Linear(H, E, bias=False)
        self.capacity_factor = capacity_factor
        self.min_capacity = min_capacity

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None):
        logits = self.wg(input)
        return deepspeed_top2gating(logits, self.capacity_factor, self.min_capacity)


class DeepSpeedExperts(nn.Module):
    """DeepSpeed ``Experts``: copies of one expert in ``deepspeed_experts``, each run on its chunk of the
    dispatched input [ep_size, num_local_experts, C, H] along dim 1."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        expert_outputs = []
        for chunk, expert in zip(chunks, self.deepspeed_experts):
            out = expert(chunk)
            if isinstance(out, tuple):
                out = out[0]
            expert_outputs += [out]
        return torch.cat(expert_outputs, dim=1)


class DeepSpeedMOELayer(nn.Module):
    """DeepSpeed ``MOELayer`` with one expert-parallel rank: ``TopKGate`` -> dispatch mask [S, E, C],
    einsum dispatch, ``Experts`` on [1, E, C, H], einsum combine; the gate's l_aux and exp_counts kept."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = DeepSpeedTopKGate()
        expert = nn.Sequential(nn.Linear(H, FFN), nn.GELU(), nn.Linear(FFN, H))
        self.experts = DeepSpeedExperts(expert, num_local_experts=E)
        self.ep_size, self.num_local_experts = 1, E
        for e in self.experts.deepspeed_experts:      # (DeepSpeed's copies start equal; these need not)
            for m in e:
                if isinstance(m, nn.Linear):
                    m.reset_parameters()

    def forward(self, *input: torch.Tensor) -> torch.Tensor:
        d_model = input[0].shape[-1]
        reshaped_input = input[0].reshape(-1, d_model)
        self.l_aux, combine_weights, dispatch_mask, self.exp_counts = self.gate(reshaped_input, None)
        dispatched_input = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(input[0]), reshaped_input)
        dispatched_input = dispatched_input.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_output = self.experts(dispatched_input)
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        combined_output = torch.einsum("sec,ecm->sm", combine_weights.type_as(input[0]), expert_output)
        return combined_output.reshape(input[0].shape)


BLOCKS.update(megatron=MegatronMoELayer, deepspeed=DeepSpeedMOELayer)


class MaskAnyLoop(nn.Module):
    """A hand-written top-k loop: per expert a boolean token mask ``(ids == i).any(-1)``, the expert run
    only ``if mask.any()``, its weight gathered by the mask and added with ``out[mask] +=``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(MegatronMLP() for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        top_logits, ids = self.gate(x).topk(K, dim=-1)
        w = top_logits.softmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            hit = ids == i
            mask = hit.any(-1)
            if mask.any():
                wi = (w * hit).sum(-1, keepdim=True)[mask]
                out[mask] += wi * expert(x[mask])
        return out.view(shape)


BLOCKS.update(mask_any=MaskAnyLoop)
