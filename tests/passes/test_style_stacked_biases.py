"""MoE blocks whose experts are stacked parameters of the block itself with stacked 2-D biases (``b1 [E, F]``,
``b2 [E, H]``: gpt-oss and much hand-written MoE code): the biases are part of the experts. Three blocks, written
here as their authors write them, not after the detector:

- ``BiasedGatherMoE`` gathers its weights and biases by the selected ids (``self.w_in[ids] ... + self.b_in[ids]``)
  and contracts them with ``torch.einsum``, a GLU between: read off the FX graph (``rewrite == "own-weights"``).
- ``BiasedPaddedMoE`` scatters the rows into a padded ``[E, C, H]`` buffer and adds ``self.b_in[:, None, :]``
  after each ``torch.bmm``: recorded on a probe (``rewrite == "own-weights"``, expert-batched); held exact only.
- ``BiasedLoopMoE`` loops over the experts, skipping those without tokens (``if tok.numel() == 0: continue``,
  a branch on a traced value), and applies ``x[tok] @ self.w1[e] + self.b1[e]``: read as E entries
  ``w[e]`` of each stacked parameter (``rewrite == "indexed-weights"``).

Held here: each found as its style with the biases among the weights moved into its experts module (the same
parameter objects, the user's state-dict keys), exact on a probe (values and gradients of the hidden states,
the router, the weights and the biases); the gathered and loop blocks explained, and on 2 gloo ranks and on 4
(2 nodes x 2) under ``themis``, ``themis-rm`` and ``ep`` sharded (each expert on one rank) and trained equal
to one process on the whole batch (one spawned process group per world size for every case, as
``tests/passes/test_outside_styles.py`` does), and through a DCP checkpoint in the user's keys resuming
exactly. Two variants of the gathered block: a 2-D ``[E, H]`` parameter the routing reads is left to the
block; a bias the code reads otherwise than indexed by the expert id is rejected, naming it.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.passes import zoo_models as zoo
from tests.passes.style_training import (POLICIES, check_explained, check_sharded_and_equal,
                                         checkpoint_resumes_in_the_users_keys, reference, train)

H, FFN, E, K = zoo.H, zoo.FFN, zoo.E, zoo.K
LAYERS = ["layers.0.moe", "layers.1.moe"]


class BiasedGatherMoE(nn.Module):
    """gpt-oss-like: a GLU expert with biases on both projections, the weights and biases of the chosen
    experts gathered per (token, slot), the top-k logits softmaxed."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = K
        self.router = nn.Linear(H, E)
        self.w_in = nn.Parameter(torch.randn(E, H, 2 * FFN) * H ** -0.5)
        self.b_in = nn.Parameter(torch.randn(E, 2 * FFN) * 0.1)
        self.w_out = nn.Parameter(torch.randn(E, FFN, H) * FFN ** -0.5)
        self.b_out = nn.Parameter(torch.randn(E, H) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, ids = self.router(x).topk(self.top_k, dim=-1)
        probs = logits.softmax(dim=-1)
        h = torch.einsum("th,tkhf->tkf", x, self.w_in[ids]) + self.b_in[ids]
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
        y = torch.einsum("tkf,tkfh->tkh", h, self.w_out[ids]) + self.b_out[ids]
        return torch.einsum("tkh,tk->th", y, probs).reshape(shape)


class BiasedLoopMoE(nn.Module):
    """A loop over the experts on stacked weights with biases, experts without tokens skipped, each expert's
    rows scattered back with ``index_add_``."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = E, K
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, H, FFN) * H ** -0.5)
        self.b1 = nn.Parameter(torch.randn(E, FFN) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, FFN, H) * FFN ** -0.5)
        self.b2 = nn.Parameter(torch.randn(E, H) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = torch.topk(self.gate(x).softmax(-1), self.top_k)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(ids == e)
            if tok.numel() == 0:
                continue
            h = F.gelu(x[tok] @ self.w1[e] + self.b1[e])
            out.index_add_(0, tok, (h @ self.w2[e] + self.b2[e]) * weights[tok, slot, None])
        return out.reshape(shape)


class BiasedPaddedMoE(nn.Module):
    """GShard-like: every expert's rows scattered into a padded ``[E, C, H]`` buffer (C the largest count, read
    into Python: FX stops there), one ``torch.bmm`` per weight, the biases broadcast over the slots."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = E, K
        self.gate = nn.Linear(H, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, H, FFN) * H ** -0.5)
        self.b_in = nn.Parameter(torch.randn(E, FFN) * 0.1)
        self.w_out = nn.Parameter(torch.randn(E, FFN, H) * FFN ** -0.5)
        self.b_out = nn.Parameter(torch.randn(E, H) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = torch.topk(self.gate(x).softmax(-1), self.top_k)
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        order = flat.argsort(stable=True)
        expert = flat[order]
        slot = torch.arange(flat.numel(), device=x.device) - (counts.cumsum(0) - counts)[expert]
        buf = x.new_zeros(self.num_experts, int(counts.max()), shape[-1])
        buf[expert, slot] = x[order // self.top_k]
        h = F.gelu(torch.bmm(buf, self.w_in) + self.b_in[:, None, :])
        y = torch.bmm(h, self.w_out) + self.b_out.unsqueeze(1)
        out = x.new_empty(flat.numel(), shape[-1])
        out[order] = y[expert, slot]
        return (out.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1)).sum(1).reshape(shape)


class KeyedRouterMoE(BiasedGatherMoE):
    """``BiasedGatherMoE`` whose scores add a learned key per expert (``expert_keys [E, H]``) to the router's:
    a 2-D ``[E, H]`` parameter that the routing reads, no expert's."""

    def __init__(self) -> None:
        super().__init__()
        self.expert_keys = nn.Parameter(torch.randn(E, H) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, ids = (self.router(x) + x @ self.expert_keys.t()).topk(self.top_k, dim=-1)
        h = torch.einsum("th,tkhf->tkf", x, self.w_in[ids]) + self.b_in[ids]
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("tkf,tkfh->tkh", F.silu(gate) * up, self.w_out[ids]) + self.b_out[ids]
        return torch.einsum("tkh,tk->th", y, logits.softmax(dim=-1)).reshape(shape)


class SelectedBiasMoE(BiasedGatherMoE):
    """``BiasedGatherMoE`` reading its first bias with ``index_select`` on the flattened ids: the code applying
    the weights then takes a third value from the block, which no reading serves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, ids = self.router(x).topk(self.top_k, dim=-1)
        b_in = self.b_in.index_select(0, ids.reshape(-1)).view(x.shape[0], self.top_k, -1)
        gate, up = (torch.einsum("th,tkhf->tkf", x, self.w_in[ids]) + b_in).chunk(2, dim=-1)
        y = torch.einsum("tkf,tkfh->tkh", F.silu(gate) * up, self.w_out[ids]) + self.b_out[ids]
        return torch.einsum("tkh,tk->th", y, logits.softmax(dim=-1)).reshape(shape)


BLOCKS = {"gather": BiasedGatherMoE, "loop": BiasedLoopMoE, "padded": BiasedPaddedMoE, "keyed": KeyedRouterMoE,
          "selected": SelectedBiasMoE}
ROUTERS = {"gather": "router", "loop": "gate", "padded": "gate", "keyed": "router", "selected": "router"}
# The trained styles: (the stacked weights moved, biases last, the rewrite).
STYLES = {"gather": (("w_in", "w_out", "b_in", "b_out"), "own-weights"),
          "loop": (("w1", "w2", "b1", "b2"), "indexed-weights")}
# The styles held exact on a probe: the trained ones and the padded buffer (the expert-batched reading).
EXACT = {**STYLES, "padded": (("w_in", "w_out", "b_in", "b_out"), "own-weights")}


def build(style: str, skew: float = 3.0) -> zoo.ZooLM:
    """The style's block in the zoo transformer, seeded, every router skewed towards expert 0."""
    torch.manual_seed(0)
    return zoo.skew_routers(zoo.ZooLM(style, blocks=BLOCKS), ROUTERS[style], skew)


def _is_expert(style: str):
    return lambda name: ".moe." in name and name.rsplit(".", 1)[-1] in EXACT[style][0]


def _prepared(style: str):
    from themis_compile.passes.styles import prepare_moe_layers

    model, original = build(style), build(style)
    keys = list(original.state_dict())
    weights = {n: model.layers[0].moe._parameters[n] for n in EXACT[style][0]}
    infos = prepare_moe_layers(model, strict=True)
    return model, original, keys, weights, infos


@pytest.mark.parametrize("style", sorted(EXACT))
def test_biases_move_with_the_weights_and_the_rewrite_is_exact(style):
    """Found as the style, the biases among the weights moved (the same parameter objects), the user's keys
    both ways, and the block computing what the unmodified one does: values, and the gradients of the hidden
    states, the router, every weight and bias."""
    names, rewrite = EXACT[style]
    model, original, keys, weights, infos = _prepared(style)
    assert [(i.name, i.rewrite, i.num_experts, i.top_k) for i in infos] == [(n, rewrite, E, K) for n in LAYERS]
    assert all(i.rewrite for i in infos)
    block, ref = model.layers[0].moe, original.layers[0].moe
    assert list(block.experts._parameters) == [n for n in ref._parameters if n in names]
    assert all(block.experts._parameters[n] is w for n, w in weights.items())
    assert not set(names) & set(block._parameters)
    assert list(model.state_dict()) == keys
    model.load_state_dict(original.state_dict())
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want, got = ref(x), block(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    router = ROUTERS[style]
    g_want = torch.autograd.grad(want.square().sum(), [x, getattr(ref, router).weight,
                                                       *(getattr(ref, n) for n in names)])
    g_got = torch.autograd.grad(got.square().sum(), [x, getattr(block, router).weight,
                                                     *(getattr(block.experts, n) for n in names)])
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("style,fragments", [
    ("gather", ("layers.0.moe: 4 experts (own-weights, 'experts'), top-2, router 'router' [E=4, H=32]",
                "the block's own code on w_in, b_in, w_out, b_out (x [T, H], ids [T, K]) -> [T, K, H]")),
    ("loop", ("layers.0.moe: 4 experts (indexed-weights, 'experts'), top-2, router 'gate' [E=4, H=32]",
              "w1[e], b1[e], w2[e], b2[e]")),
])
def test_explained(style, fragments):
    check_explained(functools.partial(build, style), 2, *fragments)


def test_a_2d_parameter_the_routing_reads_stays_the_blocks():
    """``expert_keys [E, H]`` scores the experts (the selected ids are computed from it): it stays a parameter
    of the block, trained as a dense one; the biases move."""
    from themis_compile.passes.styles import prepare_moe_layers

    model = build("keyed")
    infos = prepare_moe_layers(model, strict=True)
    assert [(i.name, i.rewrite) for i in infos] == [(n, "own-weights") for n in LAYERS]
    block = model.layers[0].moe
    assert "expert_keys" in block._parameters and "expert_keys" not in block.experts._parameters
    assert list(block.experts._parameters) == ["w_in", "b_in", "w_out", "b_out"]


def test_a_bias_read_otherwise_is_rejected_naming_it():
    from themis_compile.passes.detect import find_moe_layers

    infos, rejected = find_moe_layers(build("selected"))
    assert infos == [] and [n for n, _ in rejected] == LAYERS
    why = rejected[0][1]
    assert "stacked parameters of the block itself (w_in [4, 32, 64], b_in [4, 64], w_out [4, 32, 32]" in why, why
    assert "from the rest of the block ([16], ?, [8, 2], [8, 32]), not hidden states and the selected ids" in why, why
    assert "b_in [4, 64] and b_out [4, 32], [E, X] parameters of the block, were read as the experts' biases" in why, (
        why)
    assert "reads it indexed by the expert id (b_in[ids], b_in[e])" in why, why


def _ranks(rank: int, world_size: int, cases: list[tuple[str, str]]):
    torch.set_num_threads(1)
    return [train(functools.partial(build, style), policy, LAYERS) for style, policy in cases]


@functools.lru_cache(maxsize=None)
def _references() -> dict[str, tuple]:
    return {style: reference(functools.partial(build, style), _is_expert(style)) for style in STYLES}


@pytest.mark.parametrize("world_size,devices_per_node", [(2, None), (4, 2)], ids=["2_ranks", "2_nodes_of_2"])
def test_trains_like_one_process(world_size, devices_per_node):
    from themis_compile.testing.multirank import run_multirank

    cases = [(style, policy) for style in STYLES for policy in POLICIES]
    results = run_multirank(_ranks, world_size, args=(cases,), devices_per_node=devices_per_node, timeout_s=300)
    refs = _references()
    for i, (style, policy) in enumerate(cases):
        check_sharded_and_equal(refs[style], [r[i] for r in results], LAYERS, E,
                                f"{style} under {policy} on {world_size} ranks", replicas=policy != "ep")


@pytest.mark.parametrize("style", sorted(STYLES))
def test_checkpoint_resumes_in_the_users_keys(style, tmp_path):
    """DCP through themis_compile.checkpoint: the weights and biases under the user's keys (``layers.0.moe.b1``,
    one [E, X] tensor), the run resumed exactly."""
    checkpoint_resumes_in_the_users_keys(functools.partial(build, style), tmp_path)
