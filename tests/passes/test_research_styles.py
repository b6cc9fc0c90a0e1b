"""MoE blocks in styles the zoo (tests/passes/zoo_models.py) does not have, written as their projects write
them, each found (or rejected with its reason) and trained like one process:

- ``ResearchMoE``: counts through ``.tolist()`` and a Python loop over them, experts with biases and
  dropout, the router and optionally the experts under ``torch.autocast(bfloat16)`` inside the block, and
  a dataclass output ``MoEOutput(hidden_states, aux_loss)`` (the probe checks compare the tensors inside
  the dataclass; the runtime's experts call runs under the block's autocast);
- ``ExpertChoiceMoE`` (Zhou et al. 2022, experts pick their top-C tokens): not token-choice routing, so
  rejected with the reason and left data-parallel;
- ``ParallelListsMoE`` (each expert entry e of parallel ModuleLists ``up`` / ``down``): entry e of each
  list joined into expert e (style "parallel-lists", tests/passes/test_style_parallel_lists.py);
- ``GShardMoE`` (top-2 by argmax with a capacity and token dropping by position, stacked ``wi`` / ``wo``
  of the block itself, einsum dispatch / combine): its weights and the code applying them on the capacity
  buffer moved into an experts child (style "own-weights", docs/detection.md);
- ``TitanGroupedMMMoE`` (torchtitan's ``MoE`` as it is now: ``torch.histc`` counts, a float vector,
  handed to ``GroupedExperts`` running ``torch._grouped_mm`` with cumulative offsets; a shared expert):
  the float counts read as counts (style "sorted-rows").

Shape suffixes: T tokens, H hidden, F ffn, E experts, K top-k, C capacity, S tokens (GShard).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import themis_compile
from tests.passes import zoo_models as zoo
from tests.runtime.equivalence import assert_equivalent

H, FFN, E, K, VOCAB = zoo.H, zoo.FFN, zoo.E, zoo.K, zoo.VOCAB     # the zoo's small transformer
STEPS, BATCH, SEQ, LR = 5, 8, 8, 1e-2
CONFIG = dict(overlap_degree=8, materialization_budget=2)


@dataclasses.dataclass
class MoEOutput:
    hidden_states: torch.Tensor
    aux_loss: torch.Tensor


class ResearchMoE(nn.Module):
    """Research-code style: sort by expert, ``.tolist()`` counts, a loop over them, bf16 autocast regions."""

    def __init__(self, autocast: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(H, E)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(H, FFN), nn.SiLU(), nn.Dropout(0.0), nn.Linear(FFN, H)) for _ in range(E))
        self.autocast = autocast

    def forward(self, x: torch.Tensor) -> MoEOutput:
        shape = x.shape
        x = x.reshape(-1, H)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.router(x).float()
        probs = logits.softmax(-1)
        w, ids = probs.topk(K, -1)
        w = w / w.sum(-1, keepdim=True)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=E).tolist()
        xs = x[order // K]
        outs, start = [], 0
        for e, n in enumerate(counts):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                outs.append(self.experts[e](xs[start:start + n]).float())
            start += n
        y = torch.zeros(flat.numel(), H, dtype=x.dtype).index_copy(0, order, torch.cat(outs))
        y = (y.view(-1, K, H) * w.unsqueeze(-1)).sum(1)
        f = torch.bincount(flat, minlength=E).float() / flat.numel()
        return MoEOutput(y.view(shape), E * (f * probs.mean(0)).sum())


class ExpertChoiceMoE(nn.Module):
    """Expert-choice routing: each expert takes its top-``capacity`` tokens by softmax score."""

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, FFN), nn.GELU(), nn.Linear(FFN, H)) for _ in range(E))
        self.capacity = capacity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, H)
        # A capacity from the token count (int() of a shape: FX cannot trace it) or a fixed one (traceable).
        cap = self.capacity if self.capacity is not None else max(1, int(x.shape[0] * K / E))
        scores_TE = F.softmax(self.gate(x), dim=-1)
        gates_EC, idx_EC = torch.topk(scores_TE.t(), cap, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out.index_add_(0, idx_EC[e], gates_EC[e, :, None] * expert(x[idx_EC[e]]))
        return out.view(shape)


class GShardMoE(nn.Module):
    """GShard top-2: argmax twice, positions in each expert by cumsum, tokens past capacity dropped."""

    def __init__(self, capacity_factor: float = 2.0) -> None:
        super().__init__()
        self.wg = nn.Linear(H, E, bias=False)
        self.wi = nn.Parameter(torch.randn(E, H, FFN) * 0.1)
        self.wo = nn.Parameter(torch.randn(E, FFN, H) * 0.1)
        self.capacity_factor = capacity_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, H)
        C = int(math.ceil(2 * x.shape[0] * self.capacity_factor / E))
        gates_SE = F.softmax(self.wg(x), dim=-1)
        mask_1 = F.one_hot(torch.argmax(gates_SE, dim=1), E).to(x.dtype)
        gate_1 = (gates_SE * mask_1).sum(-1)
        gates_wo_1 = gates_SE * (1.0 - mask_1)
        mask_2 = F.one_hot(torch.argmax(gates_wo_1, dim=1), E).to(x.dtype)
        gate_2 = (gates_wo_1 * mask_2).sum(-1)
        denom = gate_1 + gate_2 + 1e-9
        gate_1, gate_2 = gate_1 / denom, gate_2 / denom
        pos_1 = (torch.cumsum(mask_1, dim=0) - 1.0) * mask_1
        mask_1 = mask_1 * (pos_1 < C).to(x.dtype)
        pos_2 = (torch.cumsum(mask_2, dim=0) - 1.0 + mask_1.sum(0, keepdim=True)) * mask_2
        mask_2 = mask_2 * (pos_2 < C).to(x.dtype)
        gate_1, gate_2 = gate_1 * mask_1.sum(-1), gate_2 * mask_2.sum(-1)
        b_1 = F.one_hot(pos_1.sum(-1).long(), C).to(x.dtype)
        b_2 = F.one_hot(pos_2.sum(-1).long(), C).to(x.dtype)
        combine_SEC = (gate_1[:, None, None] * mask_1[:, :, None] * b_1[:, None, :]
                       + gate_2[:, None, None] * mask_2[:, :, None] * b_2[:, None, :])
        dispatch_SEC = (combine_SEC > 0).to(x.dtype)
        h_ECF = F.relu(torch.einsum("ecm,emh->ech", torch.einsum("sec,sm->ecm", dispatch_SEC, x), self.wi))
        return torch.einsum("sec,ecm->sm", combine_SEC, torch.einsum("ech,ehm->ecm", h_ECF, self.wo)).view(shape)


class ParallelListsMoE(nn.Module):
    """Step / Hunyuan-like: each expert is entry e of parallel ModuleLists of single Linears (with biases),
    dropout between them, a loop over the experts with ``nonzero`` and ``index_add_``."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.up = nn.ModuleList(nn.Linear(H, FFN) for _ in range(E))
        self.down = nn.ModuleList(nn.Linear(FFN, H) for _ in range(E))
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, H)
        w_TK, ids_TK = self.router(x).softmax(-1).topk(K, dim=-1)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = (ids_TK == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            h = self.dropout(F.gelu(self.up[e](x[tok])))
            out.index_add_(0, tok, w_TK[tok, slot, None] * self.down[e](h))
        return out.view(shape)


class TitanGroupedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, FFN, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, FFN) * 0.1)
        self.w3 = nn.Parameter(torch.randn(E, FFN, H) * 0.1)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets).type_as(x)


class TitanGroupedMMMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = TitanGroupedExperts()
        self.shared_expert = nn.Sequential(nn.Linear(H, FFN, bias=False), nn.SiLU(), nn.Linear(FFN, H, bias=False))
        self.register_buffer("expert_bias", torch.zeros(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = torch.sigmoid(self.router(x).to(torch.float32))
        _, selected_experts_indices = torch.topk(scores + self.expert_bias, k=K, dim=1)
        top_scores = scores.gather(dim=1, index=selected_experts_indices)
        num_tokens_per_expert = torch.histc(selected_experts_indices.view(-1).float(), bins=E, min=0, max=E)
        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        token_indices_experts_sorted = token_indices_experts_sorted // K
        token_indices_experts_sorted = token_indices_experts_sorted.reshape(-1, 1).expand(-1, dim)
        routed_input = torch.gather(x, dim=0, index=token_indices_experts_sorted)
        routed_input = (routed_input.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        out = self.shared_expert(x)
        out = out.scatter_add(dim=0, index=token_indices_experts_sorted, src=routed_output)
        return out.reshape(bs, slen, dim)


BLOCKS = {
    "parallel_lists": ParallelListsMoE,
    "research_dataclass": ResearchMoE,
    "research_autocast": lambda: ResearchMoE(autocast=True),
    "expert_choice": ExpertChoiceMoE,
    "expert_choice_fixed": lambda: ExpertChoiceMoE(capacity=4),
    "gshard": GShardMoE,
    "titan_grouped_mm": TitanGroupedMMMoE,
}


def _model(style: str) -> zoo.ZooLM:
    """The block of ``style`` in the zoo's small transformer (two attention + MoE layers), seeded."""
    torch.manual_seed(0)
    return zoo.ZooLM(style, blocks=BLOCKS)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _reference(style: str):
    from themis_compile.passes.detect import find_moe_layers
    from themis_compile.runtime.experts import ExpertBank

    model = _model(style)
    infos, _ = find_moe_layers(model)
    losses = zoo.train_losses(model, STEPS, BATCH, SEQ)
    experts = {}
    for info in infos:
        module = info.experts     # (parallel lists joined: built from the lists, which the model holds)
        bank = ExpertBank(module)
        for e in range(bank.num_experts):
            experts[(info.name, e)] = [t.detach().clone() for t in bank.chunk(module, e)]
    # Expert parameters of the unmodified model: the lists' entries, the block's own stacked weights, or the experts'.
    prefixes = tuple(p for i in infos for p in (
        (f"{i.name}.{i.plan.first}.", f"{i.name}.{i.plan.second}.") if i.rewrite == "parallel-lists"
        else tuple(f"{i.name}.{w}" for w in i.plan.names) if i.rewrite == "own-weights"
        else (f"{i.name}.{i.experts_attr}.",)))
    return losses, zoo.dense_params(model, lambda n: n.startswith(prefixes)), experts


def _train(rank: int, world_size: int, style: str, policy: str):
    """(global losses, dense params, owned experts, sharded layer names) of STEPS AdamW steps."""
    model = themis_compile.optimize(_model(style), themis_compile.ThemisConfig(policy=policy, **CONFIG))
    runtime = themis_compile.api.runtime_of(model)
    losses = zoo.train_losses(model, STEPS, BATCH, SEQ)
    layers = runtime.layers if runtime is not None else {}
    owned = {(name, e): [t.detach().clone() for t in chunk]
             for name, experts in layers.items() for e, chunk in experts.local_chunks().items()}
    infos = runtime.layer_infos if runtime is not None else {}
    prefixes = tuple(f"{n}.{i.experts_attr}." for n, i in infos.items())
    return losses, zoo.dense_params(model, lambda n: n.startswith(prefixes)), owned, sorted(layers)


def _in_sync(rank: int, world_size: int, style: str) -> tuple[list[str], bool]:
    """A batch-dependent block left data-parallel: after two steps on different batches per rank every
    parameter is the same on all ranks (the gradients were averaged). (sharded layers, in sync)"""
    model = themis_compile.optimize(_model(style), themis_compile.ThemisConfig(policy="themis", **CONFIG))
    runtime = themis_compile.api.runtime_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for tokens in _batches()[:2]:
        model.loss(tokens[rank::world_size]).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
                      for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return sorted(runtime.layers if runtime is not None else {}), all(torch.equal(g, flat) for g in gathered)


TRAINED = [("research_dataclass", "themis"), ("research_dataclass", "ep"), ("gshard", "themis"),
           ("parallel_lists", "themis"), ("titan_grouped_mm", "themis")]
DATA_PARALLEL = ()     # blocks rejected, trained data-parallel (none left)


def _ranks(rank: int, world_size: int):
    trained = [_train(rank, world_size, style, policy) for style, policy in TRAINED]
    return trained, _in_sync(rank, world_size, "expert_choice")


def test_output_tensors_sees_inside_dataclasses():
    from themis_compile.passes.replay import output_tensors

    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    assert [t.shape for t in output_tensors((MoEOutput(a, b), {"x": [c]}, None))] == [a.shape, b.shape, c.shape]


@pytest.mark.parametrize("style", ["research_dataclass", "research_autocast"])
def test_research_block_is_found_and_rewritten_exactly(style):
    """Found, and the rewrite (capture and replay) passes its probe checks: before, the dataclass output
    crashed the gradient check and autocast failed the forward check by ~2e-3."""
    from themis_compile.passes.styles import prepare_moe_layers

    model = _model(style)
    infos = prepare_moe_layers(model, strict=True)
    assert [i.name for i in infos] == ["layers.0.moe", "layers.1.moe"]
    assert all(i.top_k == K and i.num_experts == E for i in infos)
    # The rewritten block computes what the original does, in its own dtypes (bf16 experts under autocast).
    original = _model(style).layers[0].moe
    x = torch.randn(2, 4, H, generator=torch.Generator().manual_seed(1))
    want, got = original(x), model.layers[0].moe(x)
    torch.testing.assert_close(got.hidden_states, want.hidden_states, rtol=0, atol=0)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=0, atol=0)


@pytest.mark.parametrize("style", ["expert_choice", "expert_choice_fixed"])
def test_expert_choice_routing_is_rejected_with_the_reason(style):
    text = themis_compile.explain(_model(style))
    assert text.startswith("0 MoE layer(s) found"), text
    for name in ("layers.0.moe", "layers.1.moe"):
        assert f"rejected {name}: expert-choice routing" in text, text
    assert "exactly k experts" in text


def test_gshard_inline_stacked_weights_are_found():
    """Once rejected ("stacked parameters of the block itself"): its capacity buffer [E, C, H] (the dispatch
    einsum's result) is what its weights are applied to, expert e on buf[e]: the own-weights rewrite, read on a
    probe (``int(math.ceil(...))`` of the token count stops FX)."""
    text = themis_compile.explain(_model("gshard"))
    assert text.startswith("2 MoE layer(s) found"), text
    assert "layers.0.moe: 4 experts (own-weights, 'experts'), top-2" in text, text
    assert "the block's own code on wi, wo (buf [E, C, H]) -> [E, C, H]" in text, text


def test_parallel_expert_lists_are_found():
    """Once rejected ("spread over parallel ModuleLists"), now joined: expert e is down[e] after up[e]."""
    text = themis_compile.explain(_model("parallel_lists"))
    assert text.startswith("2 MoE layer(s) found"), text
    assert "4 experts (parallel-lists, 'experts'), top-2" in text, text
    assert "activation up[e] -> gelu -> down[e]" in text, text


def test_grouped_mm_experts_with_histc_counts_are_found():
    text = themis_compile.explain(_model("titan_grouped_mm"))
    assert text.startswith("2 MoE layer(s) found"), text
    assert "rows sorted by expert with counts at the experts call" in text, text


def test_research_blocks_train_like_one_process_on_2_ranks():
    """One process group: the dataclass, GShard (own weights), parallel-lists and torchtitan grouped-mm blocks
    sharded (themis, ep) train like one process on the whole batch; the expert-choice block is left
    data-parallel (its routing depends on the whole batch, so only that is checked: the ranks stay in sync)."""
    from themis_compile.testing.multirank import run_multirank

    references = {style: _reference(style) for style, _ in TRAINED}
    results = run_multirank(_ranks, 2, timeout_s=120)
    for i, (style, policy) in enumerate(TRAINED):
        per_rank = [r[0][i] for r in results]
        expected_layers = [] if style in DATA_PARALLEL else ["layers.0.moe", "layers.1.moe"]
        assert all(r[3] == expected_layers for r in per_rank), (style, policy, per_rank[0][3])
        try:
            assert_equivalent(references[style], per_rank)
        except AssertionError as err:
            raise AssertionError(f"{style} under {policy}: {err}") from err
    for layers, in_sync in (r[1] for r in results):
        assert layers == [] and in_sync
