"""Top-1 selection (max / argmax), dense dispatch tensors, one-hot dispatch masks and unflattened hidden
states: what detection reads from each and that each rewrite computes, forward and backward, what the
user's block computes (capacity drops included), then 2 gloo ranks training like one process."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import themis_compile
from themis_compile.passes import fx_graph, probe, shard
from themis_compile.passes.detect import find_moe_layers
from themis_compile.passes.shard import ExpertLoop, dense_dispatch_slots
from themis_compile.passes.styles import prepare_moe_layers
from tests.passes import zoo_models as zoo

H, FFN, E = zoo.H, zoo.FFN, zoo.E


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(H, FFN), nn.ReLU(), nn.Linear(FFN, H))


class ArgmaxOneHotTop1(nn.Module):
    """Top-1 by argmax over the logits, a one-hot mask per expert, the probability weighed inside the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(_mlp() for _ in range(E))

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, H)
        probs_TE = self.router(x_TH).softmax(dim=-1)
        expert_T = probs_TE.argmax(dim=-1)
        prob_T = probs_TE.gather(1, expert_T[:, None]).squeeze(1)
        mask_ET = F.one_hot(expert_T, E).t()
        out_TH = torch.zeros_like(x_TH)
        for e in range(E):
            (rows,) = torch.where(mask_ET[e])
            out_TH.index_add_(0, rows, self.experts[e](x_TH[rows]) * prob_T[rows, None])
        return out_TH.view_as(x_BSH)


class TraceableGShard(nn.Module):
    """A top-2 GShard gate with a fixed capacity and the experts indexed per slot block (no ``chunk``, no
    helper method): plain FX traces it, and its experts are still called one by one on capacity slots."""

    def __init__(self, capacity: int = 64) -> None:
        super().__init__()
        self.wg = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(_mlp() for _ in range(E))
        self.capacity = capacity

    def forward(self, x):
        x_TH = x.reshape(-1, H)
        logits_TE = self.wg(x_TH)
        gates_TE = F.softmax(logits_TE, dim=1)
        mask1_TE = F.one_hot(torch.argmax(gates_TE, dim=1), num_classes=E)
        mask2_TE = F.one_hot(torch.argmax(logits_TE.masked_fill(mask1_TE.bool(), float("-inf")), dim=1), E)
        loc1_TE = torch.cumsum(mask1_TE, dim=0) - 1
        loc2_TE = torch.cumsum(mask2_TE, dim=0) - 1 + mask1_TE.sum(dim=0, keepdim=True)
        mask1_TE = mask1_TE * torch.lt(loc1_TE, self.capacity)
        mask2_TE = mask2_TE * torch.lt(loc2_TE, self.capacity)
        combine_TEC = sum((gates_TE * m).sum(1)[:, None, None] * m[:, :, None]
                          * F.one_hot((loc * m).sum(1), self.capacity)[:, None, :]
                          for m, loc in ((mask1_TE, loc1_TE), (mask2_TE, loc2_TE)))
        dispatched_ECH = torch.einsum("sec,sm->ecm", combine_TEC.bool().to(x.dtype), x_TH)
        out_ECH = torch.stack([expert(dispatched_ECH[e]) for e, expert in enumerate(self.experts)])
        return torch.einsum("sec,ecm->sm", combine_TEC, out_ECH).reshape(x.shape)


class MaskExperts(nn.ModuleDict):
    """Experts called with a one-hot dispatch mask (HF Switch Transformers' call), running every expert."""

    def __init__(self) -> None:
        super().__init__({f"expert_{e}": _mlp() for e in range(E)})
        self.num_experts = E

    def forward(self, x_TH, mask_TKE, weights_TK):
        out_TH = torch.zeros_like(x_TH)
        for e in range(self.num_experts):
            token_N, k_N = torch.where(mask_TKE[:, :, e])
            y_NH = self[f"expert_{e}"](x_TH[token_N]) * weights_TK[token_N, k_N, None]
            out_TH.index_add_(0, token_N, y_NH)
        return out_TH


class MaskCallTop1(nn.Module):
    """Switch-style router with capacity (cumsum priority) handing the experts a one-hot mask [T, 1, E]."""

    def __init__(self, capacity: int = 64) -> None:
        super().__init__()
        self.classifier = nn.Linear(H, E, bias=False)
        self.experts = MaskExperts()
        self.capacity = capacity

    def forward(self, x_BSH):
        B, S, _ = x_BSH.shape
        probs_BSE = self.classifier(x_BSH).softmax(dim=-1)
        mask_BSE = F.one_hot(torch.argmax(probs_BSE, dim=-1), E)
        mask_BSE = mask_BSE * (torch.cumsum(mask_BSE, dim=-2) <= self.capacity)
        prob_BS1 = torch.max(probs_BSE, dim=-1).values.unsqueeze(-1)
        out_TH = self.experts(x_BSH.view(-1, H), mask_BSE.view(-1, 1, E), prob_BS1.view(-1, 1))
        return out_TH.view(B, S, H)


class UnflatExperts(nn.Module):
    """Stacked experts called on unflattened hidden states, returning them in that shape (DBRX's call)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.w1 = nn.Parameter(torch.randn(E, FFN, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, FFN) * 0.1)

    def forward(self, x, ids_TK, weights_TK):
        x_TH = x.reshape(-1, x.shape[-1])
        out_TH = torch.zeros_like(x_TH)
        for e in range(self.num_experts):
            token_N, k_N = torch.where(ids_TK == e)
            y_NH = F.gelu(x_TH[token_N] @ self.w1[e].t()) @ self.w2[e].t()
            out_TH.index_add_(0, token_N, y_NH * weights_TK[token_N, k_N, None])
        return out_TH.view(x.shape[0], -1, x.shape[-1])


class UnflatCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = UnflatExperts()

    def forward(self, x_BSH):
        weights_TK, ids_TK = torch.topk(self.router(x_BSH.view(-1, H)).softmax(-1), 2, dim=-1)
        return self.experts(x_BSH, ids_TK, weights_TK)


# --- detection ---------------------------------------------------------------------------------------

def test_top1_predicates_read_max_and_argmax_along_a_dimension_only():
    def f(s, t):
        a = torch.max(s, dim=-1)
        b = s.max(-1)
        c = torch.argmax(s, dim=1)
        d = torch.max(s, t)        # elementwise
        e = s.max()                # a full reduction
        f_ = s.argmax()
        return a, b, c, d, e, f_

    nodes = [n for n in fx.symbolic_trace(f).graph.nodes if n.op in ("call_function", "call_method")]
    assert [fx_graph.is_top1(n) for n in nodes] == [True, True, True, False, False, False]
    assert [fx_graph.selection_k(n, {}) for n in nodes[:3]] == [1, 1, 1]
    assert fx_graph.selection_outputs(nodes[2]) == ([], [nodes[2]])


@pytest.mark.parametrize("make, rewrite, k", [
    (zoo.SwitchFFN, "inline-loop", 1), (ArgmaxOneHotTop1, "inline-loop", 1),
    (zoo.FairseqTop2MoE, "dense-dispatch", 2), (TraceableGShard, "dense-dispatch", 2),
    (MaskCallTop1, "dispatch-mask", 1), (UnflatCall, "flatten", 2)])
def test_each_call_shape_is_found_with_its_top_k(make, rewrite, k):
    torch.manual_seed(0)
    infos, rejected = find_moe_layers(make())
    assert [(i.name, i.rewrite, i.top_k, i.num_experts) for i in infos] == [("<root>", rewrite, k, E)], rejected


def test_a_top1_found_from_recorded_calls_when_fx_fails():
    class NoTrace(ArgmaxOneHotTop1):
        def forward(self, x_BSH):
            assert int(x_BSH.shape[-1]) == H     # int() of a traced shape: FX fails here
            return super().forward(x_BSH)

    ks, _ = fx_graph._recorded_topk(NoTrace(), torch.randn(2, 4, H))
    assert ks == [1]
    # Untraceable, so its loop is served by capture and replay, with the top-1 read from the recorded calls.
    infos, rejected = find_moe_layers(NoTrace())
    assert [(i.rewrite, i.top_k) for i in infos] == [("replay", 1)], rejected


def test_dbrx_style_flat_weights_are_found_and_rows_not_in_equal_chunks_rejected():
    class FlatRows(UnflatExperts):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(E * FFN, H) * 0.1)
            self.w2 = nn.Parameter(torch.randn(E * FFN, H) * 0.1)

        def forward(self, x, ids_TK, weights_TK):
            x_TH = x.reshape(-1, x.shape[-1])
            out_TH = torch.zeros_like(x_TH)
            for e in range(self.num_experts):
                token_N, k_N = torch.where(ids_TK == e)
                w1, w2 = self.w1.view(self.num_experts, FFN, H)[e], self.w2.view(self.num_experts, FFN, H)[e]
                out_TH.index_add_(0, token_N, (F.gelu(x_TH[token_N] @ w1.t()) @ w2) * weights_TK[token_N, k_N, None])
            return out_TH.view(x.shape[0], -1, x.shape[-1])

    block = UnflatCall()
    block.experts = FlatRows()
    infos, rejected = find_moe_layers(block)
    assert [(i.rewrite, i.experts_form, i.num_experts) for i in infos] == [("flatten", "flat", E)], rejected
    # (Training and checkpoints of flat weights: tests/runtime/test_flat_experts.py.)

    class FixedE(FlatRows):
        """Views its weights with a constant E: no copy of it runs one expert alone."""

        def forward(self, x, ids_TK, weights_TK):
            self.num_experts = E
            return super().forward(x, ids_TK, weights_TK)

    block.experts = FixedE()
    infos, rejected = find_moe_layers(block)
    assert not infos and "one expert run alone fails" in rejected[0][1], rejected

    block.experts = FlatRows()
    block.experts.w3 = nn.Parameter(torch.zeros(E - 1, H))   # rows not a multiple of E
    infos, rejected = find_moe_layers(block)
    assert not infos and "all flat [E * F, ...] (every leading dimension a multiple of E)" in rejected[0][1], rejected


# --- rewrites ----------------------------------------------------------------------------------------

def _check_equal(block: nn.Module, x: torch.Tensor) -> list:
    """Rewrite a copy of ``block``; its outputs and gradients (input and every parameter) equal the user's."""
    reference = copy.deepcopy(block)
    infos = prepare_moe_layers(block, strict=True)
    assert block.state_dict().keys() == reference.state_dict().keys()
    for training in (True, False):
        block.train(training)
        reference.train(training)
        x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out, ref = block(x1), reference(x2)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * g).sum().backward()
        (ref * g).sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(block.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
            p.grad = q.grad = None
    return infos


def test_switch_rewrite_calls_the_experts_unweighted_and_keeps_the_post_multiplication():
    torch.manual_seed(0)
    block = zoo.SwitchFFN()
    info = find_moe_layers(block)[0][0]
    traced = fx_graph.trace_block(block, block.experts)
    fx_graph.record_meta(traced, block, probe.probe_input(block, H))
    gm = shard.replace_expert_loop(traced, info)
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "experts"]
    assert len(calls) == 1 and not shard.expert_nodes(gm.graph, "experts")
    x, ids, weights = calls[0].args
    assert ids.target == "unsqueeze" and fx_graph.is_top1(ids.args[0].args[0])      # routes [T] -> [T, 1]
    assert weights.target == "new_ones"
    (mul,) = calls[0].users
    assert mul.target is operator.mul    # final_output * route_prob_max, as written
    infos = _check_equal(block, torch.randn(3, 5, H))
    assert isinstance(block.experts, ExpertLoop) and infos[0].rewritten


def test_top1_weighed_inside_the_loop_is_rewritten_with_its_weights():
    torch.manual_seed(0)
    _check_equal(ArgmaxOneHotTop1(), torch.randn(2, 6, H))


def test_dense_dispatch_slots_read_the_combine_tensor():
    combine_TEC = torch.zeros(3, 4, 2)
    combine_TEC[0, 1, 0], combine_TEC[0, 3, 1] = 0.7, 0.3      # two slots
    combine_TEC[1, 2, 1] = 0.9                                 # second choice dropped by capacity
    ids, weights = dense_dispatch_slots(combine_TEC, 2)         # token 2: both dropped
    assert ids[0].tolist() == [1, 3] and weights[0].tolist() == pytest.approx([0.7, 0.3])
    assert ids[1, 0] == 2 and weights[1].tolist() == pytest.approx([0.9, 0.0])
    assert weights[2].tolist() == [0.0, 0.0]
    with pytest.raises(RuntimeError):
        dense_dispatch_slots(combine_TEC, 1)                    # token 0 has two experts: never cut silently


@pytest.mark.parametrize("capacity_factor", [4.0, 0.25])
def test_dense_dispatch_rewrite_is_exact_with_and_without_capacity_drops(capacity_factor):
    torch.manual_seed(0)
    block = zoo.FairseqTop2MoE(capacity_factor=capacity_factor)
    x = torch.randn(3, 8, H)
    with torch.no_grad():
        combine_TEC, _ = block.top2gating(block.wg(x.reshape(-1, H)))
    kept = (combine_TEC.sum(-1) != 0).sum(-1)
    assert (kept == 2).all() if capacity_factor == 4.0 else (kept < 2).any()     # drops happen at 0.25
    infos = _check_equal(block, x)
    assert infos[0].rewrite == "dense-dispatch" and isinstance(block.experts, ExpertLoop)


def test_dense_dispatch_traced_by_plain_fx_is_not_taken_for_an_expert_loop():
    torch.manual_seed(0)
    infos = _check_equal(TraceableGShard(capacity=2), torch.randn(2, 8, H))   # 16 tokens, 8 slots: drops
    assert infos[0].rewrite == "dense-dispatch"


@pytest.mark.parametrize("capacity", [64, 2])
def test_dispatch_mask_rewrite_is_exact_with_and_without_capacity_drops(capacity):
    torch.manual_seed(0)
    infos = _check_equal(MaskCallTop1(capacity=capacity), torch.randn(2, 8, H))
    assert infos[0].rewrite == "dispatch-mask"


def test_flatten_rewrite_is_exact():
    torch.manual_seed(0)
    infos = _check_equal(UnflatCall(), torch.randn(2, 5, H))
    assert infos[0].rewrite == "flatten"


def test_a_gradient_the_rewrite_would_change_is_refused():
    class CombineGradient(zoo.FairseqTop2MoE):
        """Same forward, but a parameter differentiates the combine tensor's zero entries."""

        def __init__(self) -> None:
            super().__init__()
            self.leak = nn.Parameter(torch.ones(()))

        def top2gating(self, logits):
            combine, dispatch = super().top2gating(logits)
            return combine + (self.leak - self.leak.detach()), dispatch

    torch.manual_seed(0)
    block = CombineGradient()
    with pytest.raises(ValueError, match="gradient of leak does not match"):
        prepare_moe_layers(block, strict=True)
    assert type(block) is CombineGradient


# --- two ranks ---------------------------------------------------------------------------------------

STEPS, BATCH, SEQ = 3, 4, 8
BLOCKS = {"dispatch_mask": MaskCallTop1, "flatten": UnflatCall}


class _LM(zoo.ZooLM):
    def __init__(self, style: str) -> None:
        nn.Module.__init__(self)
        self.embed = nn.Embedding(zoo.VOCAB, H)
        self.layers = nn.ModuleList(zoo.Layer(BLOCKS[style]()) for _ in range(2))
        self.head = nn.Linear(H, zoo.VOCAB, bias=False)


def _model(style: str) -> _LM:
    torch.manual_seed(0)
    return _LM(style)


def _ranks(rank: int, world_size: int) -> dict[str, list[float]]:
    out = {}
    for style in BLOCKS:
        model = themis_compile.optimize(_model(style), themis_compile.ThemisConfig(policy="themis"), strict=True)
        out[style] = zoo.train_losses(model, STEPS, BATCH, SEQ)
    return out


def test_mask_and_flatten_blocks_train_like_one_process_on_two_ranks():
    from themis_compile.testing.multirank import run_multirank

    results = run_multirank(_ranks, 2, timeout_s=120)
    for style in BLOCKS:
        reference = zoo.train_losses(_model(style), STEPS, BATCH, SEQ)
        for step, (a, b) in enumerate(zip(results[0][style], reference)):
            assert abs(a - b) <= 1e-5 * abs(b), f"{style} step {step}: {a} vs {b}"


# --- selection by sort / argsort cut to k --------------------------------------------------------------

class ScatterMaskLoop(nn.Module):
    """Top-k by ``argsort`` cut to k, a ``[T, E]`` mask scattered from the ids, the weights renormalised over
    that mask, a loop taking each expert's rows with ``where(mask[:, e])`` and its column of weights."""

    def __init__(self, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(_mlp() for _ in range(E))

    def forward(self, x_BSH):
        x_TH = x_BSH.reshape(-1, H)
        probs_TE = self.router(x_TH).softmax(-1)
        ids_TK = probs_TE.argsort(dim=-1, descending=True)[:, :self.k]
        mask_TE = torch.zeros_like(probs_TE).scatter(1, ids_TK, 1.0)
        weights_TE = probs_TE * mask_TE
        weights_TE = weights_TE / weights_TE.sum(-1, keepdim=True)
        out_TH = torch.zeros_like(x_TH)
        for e in range(E):
            (rows,) = torch.where(mask_TE[:, e] > 0)
            out_TH.index_add_(0, rows, self.experts[e](x_TH[rows]) * weights_TE[rows, e:e + 1])
        return out_TH.view_as(x_BSH)


class AscendingSortTop1(nn.Module):
    """Top-1 as the last entry of an ascending ``torch.sort`` (``[:, -1]``), the weight after the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E)
        self.experts = nn.ModuleList(_mlp() for _ in range(E))

    def forward(self, x_BSH):
        x_TH = x_BSH.reshape(-1, H)
        probs_TE = torch.softmax(self.router(x_TH), dim=-1)
        values_TE, order_TE = probs_TE.sort(dim=-1)
        best_T, prob_T = order_TE[:, -1], values_TE[:, -1]
        out_TH = torch.zeros_like(x_TH)
        for e in range(E):
            rows = (best_T == e).nonzero().squeeze(-1)
            out_TH[rows] = self.experts[e](x_TH[rows])
        return (out_TH * prob_T[:, None]).view_as(x_BSH)


class SortedGShard(TraceableGShard):
    """:class:`TraceableGShard` with its two choices taken by one ``argsort`` cut to 2 instead of two argmax."""

    def forward(self, x):
        x_TH = x.reshape(-1, H)
        gates_TE = F.softmax(self.wg(x_TH), dim=1)
        top2_T2 = torch.argsort(gates_TE, dim=1, descending=True)[:, :2]
        mask1_TE, mask2_TE = F.one_hot(top2_T2[:, 0], E), F.one_hot(top2_T2[:, 1], E)
        loc1_TE = torch.cumsum(mask1_TE, dim=0) - 1
        loc2_TE = torch.cumsum(mask2_TE, dim=0) - 1 + mask1_TE.sum(dim=0, keepdim=True)
        mask1_TE = mask1_TE * torch.lt(loc1_TE, self.capacity)
        mask2_TE = mask2_TE * torch.lt(loc2_TE, self.capacity)
        combine_TEC = sum((gates_TE * m).sum(1)[:, None, None] * m[:, :, None]
                          * F.one_hot((loc * m).sum(1), self.capacity)[:, None, :]
                          for m, loc in ((mask1_TE, loc1_TE), (mask2_TE, loc2_TE)))
        dispatched_ECH = torch.einsum("sec,sm->ecm", combine_TEC.bool().to(x.dtype), x_TH)
        out_ECH = torch.stack([expert(dispatched_ECH[e]) for e, expert in enumerate(self.experts)])
        return torch.einsum("sec,ecm->sm", combine_TEC, out_ECH).reshape(x.shape)


class TopkThresholdMask(nn.Module):
    """A ``[T, E]`` mask of the scores at or above the k-th largest (the top-k's values alone), the loop
    over ``where(mask[:, e])`` weighted by the masked, renormalised probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(_mlp() for _ in range(E))

    def forward(self, x_BSH):
        x_TH = x_BSH.reshape(-1, H)
        probs_TE = self.router(x_TH).softmax(-1)
        mask_TE = probs_TE >= probs_TE.topk(2, dim=-1).values[..., -1:]
        weights_TE = probs_TE * mask_TE
        weights_TE = weights_TE / weights_TE.sum(-1, keepdim=True)
        out_TH = torch.zeros_like(x_TH)
        for e in range(E):
            (rows,) = torch.where(mask_TE[:, e])
            out_TH.index_add_(0, rows, self.experts[e](x_TH[rows]) * weights_TE[rows, e, None])
        return out_TH.view_as(x_BSH)


class ThresholdRouter(nn.Module):
    """Every expert whose probability exceeds a threshold (a variable number per token)."""

    def __init__(self, threshold: float = 0.2) -> None:
        super().__init__()
        self.threshold = threshold
        self.router = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(_mlp() for _ in range(E))

    def forward(self, x_BSH):
        x_TH = x_BSH.reshape(-1, H)
        probs_TE = self.router(x_TH).softmax(-1)
        mask_TE = probs_TE > self.threshold
        out_TH = torch.zeros_like(x_TH)
        for e in range(E):
            (rows,) = torch.where(mask_TE[:, e])
            out_TH.index_add_(0, rows, self.experts[e](x_TH[rows]) * probs_TE[rows, e:e + 1])
        return out_TH.view_as(x_BSH)


class TopPRouter(ThresholdRouter):
    """Top-p routing: the experts of highest probability until their sum reaches p (sorted, never cut to k)."""

    def forward(self, x_BSH):
        x_TH = x_BSH.reshape(-1, H)
        probs_TE = self.router(x_TH).softmax(-1)
        sorted_TE, order_TE = probs_TE.sort(dim=-1, descending=True)
        keep_TE = (sorted_TE.cumsum(-1) - sorted_TE) < 0.6
        weights_TE = torch.zeros_like(probs_TE).scatter(1, order_TE, sorted_TE * keep_TE)
        out_TH = torch.zeros_like(x_TH)
        for e in range(E):
            (rows,) = torch.where(weights_TE[:, e] > 0)
            out_TH.index_add_(0, rows, self.experts[e](x_TH[rows]) * weights_TE[rows, e:e + 1])
        return out_TH.view_as(x_BSH)


class UntraceableTopP(TopPRouter):
    def forward(self, x_BSH):
        assert int(x_BSH.shape[-1]) == H     # int() of a traced shape: FX fails here
        return super().forward(x_BSH)


def test_sort_cuts_are_read_along_the_sorted_dimension():
    cut = fx_graph.cut_length
    whole, e = slice(None), Ellipsis
    assert cut((whole, slice(None, 2)), -1) == (2, True)
    assert cut((e, slice(None, 3)), -1) == (3, True)
    assert cut((e, slice(0, 2)), 1) is None                  # a positive dim after an Ellipsis: position unknown
    assert cut((whole, slice(None, 2)), 1) == (2, True)
    assert cut((e, slice(-2, None)), -1) == (2, True)        # the last k of an ascending sort
    assert cut((whole, 0), -1) == (1, False) and cut((e, -1), -1) == (1, False)
    assert cut((whole, 1), -1) is None                       # the second choice alone is no top-k
    assert cut((slice(None, 2), whole), -1) is None          # cuts the tokens, not the experts
    assert cut((whole, slice(1, 3)), -1) is None and cut((whole, slice(None, 4, 2)), -1) is None
    assert cut((torch.tensor([0, 1]), slice(None, 2)), -1) is None


def test_sort_selection_predicates_on_a_traced_graph():
    def f(s):
        a_v, a_i = torch.sort(s, dim=-1, descending=True)
        a = (a_v[:, :2], a_i[:, :2])                             # a top-2
        b = torch.argsort(s, dim=-1, descending=True)[..., :3]   # a top-3 (ids only)
        c = s.sort(-1).indices[:, -1]                            # a top-1 (ascending, last)
        d = torch.argsort(s.view(-1))                            # tokens sorted by expert: no selection
        e_v, e_i = s.sort(dim=-1, descending=True)
        e = (e_v[:, :2], e_i[:, :3])                             # cuts that disagree: no fixed k
        return a, b, c, d, e

    sorts = [n for n in fx.symbolic_trace(f).graph.nodes if fx_graph.is_sort(n)]
    assert [fx_graph.is_sort_selection(n) for n in sorts] == [True, True, True, False, False]
    assert [fx_graph.selection_k(n, {}) for n in sorts[:3]] == [2, 3, 1]
    values, ids = fx_graph.selection_outputs(sorts[0])
    assert len(values) == len(ids) == 1 and values[0].args[0].args == (sorts[0], 0)
    assert fx_graph.selection_outputs(sorts[1]) == ([], list(sorts[1].users))
    assert [fx_graph.describe_selection(n) for n in sorts[:2]] == ["sort[:, :2]", "argsort[..., :3]"]
    assert fx_graph.selections_of(fx.symbolic_trace(f).graph) and all(
        fx_graph.is_sort_selection(n) for n in fx_graph.selections_of(fx.symbolic_trace(f).graph))


@pytest.mark.parametrize("make, rewrite, k, by", [
    (zoo.SortedTopKMoE, "inline-loop", 2, "by sort[:, :2] (FX graph)"),
    (lambda: zoo.SortedTopKMoE(k=3), "inline-loop", 3, "by sort[:, :3] (FX graph)"),
    (zoo.ArgsortBmmMoE, "per-slot", 2, "selection argsort[..., :2]"),
    (zoo.SortedNonzeroMoE, "replay", 2, "by sort[:, :2] (recorded on a probe"),
    (ScatterMaskLoop, "inline-loop", 2, "by argsort[:, :2] (FX graph)"),
    (lambda: ScatterMaskLoop(k=3), "inline-loop", 3, "by argsort[:, :3] (FX graph)"),
    (AscendingSortTop1, "inline-loop", 1, "by sort[:, -1] (FX graph)"),
    (SortedGShard, "dense-dispatch", 2, "selection argsort[:, :2]"),
    (TopkThresholdMask, "inline-loop", 2, "softmax -> top-2 (FX graph)")])
def test_each_sort_selection_is_found_with_its_k_and_rewritten_exactly(make, rewrite, k, by):
    torch.manual_seed(0)
    block = make()
    infos, rejected = find_moe_layers(block)
    assert [(i.name, i.rewrite, i.top_k, i.num_experts) for i in infos] == [("<root>", rewrite, k, E)], rejected
    assert by in infos[0].router, infos[0].router
    infos = _check_equal(block, torch.randn(2, 6, H))
    assert infos[0].rewritten


def test_recorded_calls_count_a_sort_cut_as_a_top_k_and_an_uncut_sort_as_none():
    x = torch.randn(2, 4, H)
    rec = fx_graph.record_calls(zoo.SortedNonzeroMoE(), x)
    assert rec.ks == [2] and "sort[:, :2]" in rec.selections
    titan = fx_graph.record_calls(zoo.TitanGroupedMoE(), x)        # topk, then argsort of ids by expert
    assert titan.ks == [2] and not any("[" in s for s in titan.selections)
    assert fx_graph.record_calls(SortedGShard(), x).ks == [2]      # the dense-dispatch K
    assert fx_graph._recorded_topk(AscendingSortTop1(), x)[0] == [1]


@pytest.mark.parametrize("make, why", [
    (ThresholdRouter, "selects experts by comparing the scores of router 'router' with a threshold (>)"),
    (TopPRouter, "sorts the scores of router 'router' (sort) but never cuts them to a fixed k"),
    (UntraceableTopP, "a sort ran on a probe but its output was never cut to a fixed k")])
def test_a_variable_k_router_is_rejected_with_the_reason(make, why):
    torch.manual_seed(0)
    report = themis_compile.explain(make())
    assert report.startswith("0 MoE layer(s) found\n  rejected <root>: ") and report.count("rejected") == 1, report
    assert why in report and "exactly k experts" in report, report


def test_masked_weight_slots_read_the_weighted_experts_and_refuse_more_than_k():
    weights_TE = torch.tensor([[0.0, 0.7, 0.0, 0.3], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ids, weights = shard.masked_weight_slots(weights_TE, 2)
    assert ids[0].tolist() == [1, 3] and weights[0].tolist() == pytest.approx([0.7, 0.3])
    assert ids[1, 0] == 2 and weights[1].tolist() == pytest.approx([1.0, 0.0])
    assert weights[2].tolist() == [0.0, 0.0]
    with pytest.raises(RuntimeError, match="more experts than the block's top-k"):
        shard.masked_weight_slots(weights_TE, 1)


def test_a_threshold_mask_tied_beyond_k_fails_instead_of_being_cut():
    torch.manual_seed(0)
    block = TopkThresholdMask()
    prepare_moe_layers(block, strict=True)
    with torch.no_grad():
        block.router.weight.zero_()           # every score ties: the user's block would run all E experts
    with pytest.raises(RuntimeError, match="more experts than the block's top-k"):
        block(torch.randn(1, 3, H))
