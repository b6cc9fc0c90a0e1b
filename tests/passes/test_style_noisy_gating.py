"""Noisy top-k gating as the widely copied PyTorch port of Shazeer et al. (2017) writes it: the router is a
bare ``w_gate [H, E]`` parameter applied as ``x @ w_gate`` (not an ``nn.Linear``, not a weight ``[E, H]``),
top-(k+1) logits, a softmax over the top k scattered into dense ``gates [T, E]``, and a dispatcher that
sorts the nonzero ``(token, expert)`` pairs, splits the rows by ``(gates > 0).sum(0).tolist()`` and combines
the expert outputs, each weighted by its gate, with ``index_add``; the importance / load balance loss
(``cv_squared``) beside the output. Written here in that style for the test, with the noise off (the noise
draws per rank, so no data-parallel run reproduces one process with it on).

The router ``[H, E]`` was not read as a router (only Linears and ``[E, H]`` weights were), so the block was
not even reported as MoE-like; the top-(k+1) cut to ``[:, :k]`` was read as k + 1 experts per token; the
rows the experts return meet first as one concatenation (the dispatcher's "stitch"), which the inline-loop
rewrite took for the combined value. It is found now as style "inline-loop" (top-k, the combined value the
``[T, H]`` ``index_add``), sharded, and trains like one process on 2 ranks and on 2 nodes of 2.

Shape suffixes: T tokens, H hidden, F ffn, E experts, K top-k.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tests.passes import zoo_models as zoo
from tests.passes.style_training import check_explained, trains_like_one_process

E, K = zoo.E, zoo.K
LAYERS = ["layers.0.moe", "layers.1.moe"]


class _Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class NoisyGatingMoE(nn.Module):
    def __init__(self, dim: int = zoo.H, hidden: int = zoo.FFN, num_experts: int = E, k: int = K,
                 noisy_gating: bool = False) -> None:
        super().__init__()
        self.k, self.noisy_gating, self.num_experts = k, noisy_gating, num_experts
        self.experts = nn.ModuleList(_Expert(dim, hidden) for _ in range(num_experts))
        self.w_gate = nn.Parameter(torch.randn(dim, num_experts) * 0.1)
        self.w_noise = nn.Parameter(torch.zeros(dim, num_experts))
        self.loss_coef = 1e-2
        self.aux_loss = torch.zeros(())

    @staticmethod
    def _cv_squared(v: torch.Tensor) -> torch.Tensor:
        return v.float().var() / (v.float().mean() ** 2 + 1e-10)

    def _gates(self, x_TH: torch.Tensor) -> torch.Tensor:
        clean_TE = x_TH @ self.w_gate
        if self.noisy_gating and self.training:
            logits_TE = clean_TE + torch.randn_like(clean_TE) * F.softplus(x_TH @ self.w_noise)
        else:
            logits_TE = clean_TE
        top_logits, top_indices = logits_TE.topk(min(self.k + 1, self.num_experts), dim=1)
        top_k_gates = F.softmax(top_logits[:, :self.k], dim=1)
        return torch.zeros_like(logits_TE).scatter(1, top_indices[:, :self.k], top_k_gates)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        gates_TE = self._gates(x_TH)
        self.aux_loss = self.loss_coef * (self._cv_squared(gates_TE.sum(0)) + self._cv_squared((gates_TE > 0).sum(0)))
        # The dispatcher: the nonzero (token, expert) pairs sorted by expert, the rows split per expert.
        sorted_experts, index_sorted = torch.nonzero(gates_TE).sort(0)
        _, expert_index = sorted_experts.split(1, dim=1)
        batch_index = torch.nonzero(gates_TE)[index_sorted[:, 1], 0]
        part_sizes = (gates_TE > 0).sum(0).tolist()
        nonzero_gates = torch.gather(gates_TE[batch_index], 1, expert_index)
        expert_inputs = torch.split(x_TH[batch_index], part_sizes, dim=0)
        expert_outputs = [self.experts[i](expert_inputs[i]) for i in range(len(self.experts))]
        stitched = torch.cat(expert_outputs, 0) * nonzero_gates
        out_TH = torch.zeros_like(x_TH).index_add(0, batch_index, stitched)
        return out_TH.reshape(x_BSH.shape)


def build() -> zoo.ZooLM:
    torch.manual_seed(0)
    model = zoo.ZooLM("noisy_gating", blocks={"noisy_gating": NoisyGatingMoE})
    for layer in model.layers:       # skewed towards expert 0 so that themis makes replicas
        with torch.no_grad():
            layer.moe.w_gate[:, 0] += 0.6
    return model


def is_expert(name: str) -> bool:
    return ".experts." in name


def test_found_and_explained():
    check_explained(build, 2, "layers.0.moe: 4 experts (modulelist, 'experts'), top-2, router 'w_gate' [E=4, H=32]",
                    "loops over the experts of 'experts' inline (rewritten to one experts(x, ids, weights) call)")


def test_an_h_by_e_router_is_read_from_the_traced_graph():
    """Where FX traces the block (a top-k over x @ w_gate, experts looped inline), the router is w_gate
    [H, E] read by its use on the right of the matmul: E = 4 experts, H = 32."""
    from themis_compile.passes.detect import find_moe_layers

    class Traceable(NoisyGatingMoE):
        def forward(self, x_BSH):
            x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
            gates_TE = self._gates(x_TH)
            out_TH = torch.zeros_like(x_TH)
            for e, expert in enumerate(self.experts):
                out_TH = out_TH + gates_TE[:, e:e + 1] * expert(x_TH)
            return out_TH.reshape(x_BSH.shape)

    torch.manual_seed(0)
    (info,), rejected = find_moe_layers(zoo.ZooLM("t", layers=1, blocks={"t": Traceable}))
    assert not rejected
    assert (info.router_path, info.num_experts, info.top_k, info.hidden_size) == ("w_gate", E, K, zoo.H)
    assert "'w_gate' [E=4, H=32]" in info.router


def test_trains_like_one_process_on_2_ranks():
    trains_like_one_process(build, is_expert, LAYERS, E, 2)


def test_trains_like_one_process_on_2_nodes_of_2():
    trains_like_one_process(functools.partial(build), is_expert, LAYERS, E, 4, ("themis",), devices_per_node=2)
