"""A decoder layer that holds its MoE inline: attention, norms, a sigmoid router with a selection bias and
stacked ``[E, D, F]`` expert weights in one module and one forward, every (token, slot) pair a row whose
expert's weights are gathered per row and applied with ``torch.bmm`` (``tests/passes/style_models.py``:
``InlineMoEDecoderLayer``; no MoE submodule at all). ``optimize`` used to leave it data-parallel; now the
layer itself is the MoE layer: the code applying its stacked weights is moved with them into an experts child
called per row (``rewrite == "own-weights"``, docs/detection.md), attention and routing running as written.
Held here: found and explained, the rewrite exact and keeping the user's keys, and on 2 gloo ranks under
``themis``, ``themis-rm`` and ``ep`` and on 4 (2 nodes x 2) under ``themis-rm`` each expert owned by one rank
and the training equal to one process, the selection bias favouring one expert so that replicas are made.
"""

from __future__ import annotations

import torch

import themis_compile
from tests.passes.style_models import D, E, K, style_model
from tests.passes.style_training import trains_like_one_process

LAYERS = ["layers.0", "layers.1"]
WEIGHTS = ("w1", "w2")


def build() -> torch.nn.Module:
    """The style's model with expert 0 favoured by every layer's selection bias."""
    model = style_model("inline_decoder")
    with torch.no_grad():
        for layer in model.layers:
            layer.router_bias[0] = 0.3
    return model


def is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in WEIGHTS


def test_found_and_explained():
    text = themis_compile.explain(build())
    assert text.startswith("2 MoE layer(s) found"), text
    assert "layers.0: 4 experts (own-weights, 'experts'), top-2, router 'router' [E=4, H=32]: scores sigmoid" in text
    assert "the block's own code on w1, w2 (rows [N, H], ids [N]) -> [N, H]" in text, text


def test_rewrite_is_exact_and_keeps_the_users_keys():
    from themis_compile.passes.shard import prepare_moe_layers

    model, original = build(), build()
    keys, w1 = list(original.state_dict()), model.layers[0].w1
    infos = prepare_moe_layers(model, strict=True)
    assert [(i.name, i.rewrite, i.num_experts, i.top_k) for i in infos] == [(n, "own-weights", E, K) for n in LAYERS]
    layer = model.layers[0]
    assert layer.experts.w1 is w1 and "w1" not in layer._parameters
    assert list(model.state_dict()) == keys
    model.load_state_dict(original.state_dict())
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want, got = original.layers[0](x), layer(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    ref = original.layers[0]
    g_want = torch.autograd.grad(want.square().sum(), [x, ref.w1, ref.router.weight, ref.wqkv.weight])
    g_got = torch.autograd.grad(got.square().sum(), [x, layer.experts.w1, layer.router.weight, layer.wqkv.weight])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_trains_like_one_process_on_2_ranks():
    trains_like_one_process(build, is_expert, LAYERS, E, 2)


def test_trains_like_one_process_on_2_nodes_of_2():
    trains_like_one_process(build, is_expert, LAYERS, E, 4, ("themis-rm",), devices_per_node=2)
