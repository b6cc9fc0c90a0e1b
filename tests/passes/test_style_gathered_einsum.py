"""An MoE block whose experts are its own stacked ``[E, D, F]`` parameters, gathered by the selected ids
(``self.w_gate[ids_TK]``) and contracted with ``torch.einsum`` (``tests/passes/style_models.py``:
``GatheredEinsumMoE``). No module is the experts, so ``optimize`` used to leave it data-parallel ("its expert
weights are stacked parameters of the block itself"). Now the code applying the weights is read off the FX
graph and moved with them into an experts child called per slot (``rewrite == "own-weights"``,
docs/detection.md). Held here: found and explained, the rewrite exact on a probe (values, gradients) and keeping
the user's state-dict keys, and on 2 gloo ranks under ``themis``, ``themis-rm`` and ``ep`` and on 4 (2 nodes x 2)
under ``themis`` each expert owned by one rank and the training equal to one process on the whole batch, the
router skewed towards one expert so that replicas are made.
"""

from __future__ import annotations

import pytest
import torch

import themis_compile
from tests.passes.style_models import E, K, D, style_model
from tests.passes.style_training import trains_like_one_process

LAYERS = ["layers.0.moe", "layers.1.moe"]
WEIGHTS = ("w_gate", "w_up", "w_down")
SKEW = 3.0


def build() -> torch.nn.Module:
    """The style's model with its routers skewed towards expert 0 from outside the block."""
    model = style_model("gathered_einsum")
    v_D = torch.full((D,), D ** -0.5)
    with torch.no_grad():
        for layer in model.layers:
            layer.norm2.bias.copy_(v_D)
            layer.moe.router.weight[0] += SKEW * v_D
    return model


def is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in WEIGHTS


def test_found_and_explained():
    text = themis_compile.explain(build())
    assert text.startswith("2 MoE layer(s) found"), text
    assert "layers.0.moe: 4 experts (own-weights, 'experts'), top-2, router 'router' [E=4, H=32]" in text, text
    assert "the block's own code on w_gate, w_up, w_down (x [T, H], ids [T, K]) -> [T, K, H]" in text, text


def test_rewrite_is_exact_and_keeps_the_users_keys():
    from themis_compile.passes.shard import prepare_moe_layers

    model, original = build(), build()
    keys, w_gate = list(original.state_dict()), model.layers[0].moe.w_gate
    infos = prepare_moe_layers(model, strict=True)
    assert [(i.name, i.rewrite, i.num_experts, i.top_k) for i in infos] == [(n, "own-weights", E, K) for n in LAYERS]
    block = model.layers[0].moe
    assert block.experts.w_gate is w_gate    # the same parameter object, now the experts'
    assert "w_gate" not in block._parameters and list(model.state_dict()) == keys
    model.load_state_dict(original.state_dict())
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want, got = original.layers[0].moe(x), block(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    g_want = torch.autograd.grad(want.square().sum(), [x, original.layers[0].moe.w_down, original.layers[0].moe.router.weight])
    g_got = torch.autograd.grad(got.square().sum(), [x, block.experts.w_down, block.router.weight])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_trains_like_one_process_on_2_ranks():
    trains_like_one_process(build, is_expert, LAYERS, E, 2)


def test_trains_like_one_process_on_2_nodes_of_2():
    trains_like_one_process(build, is_expert, LAYERS, E, 4, ("themis",), devices_per_node=2)
