"""An MoE block that scatters its tokens into a padded ``[E, C, D]`` buffer (C the largest count, from
``int(counts.max())``: nothing dropped) and applies its own stacked ``[E, D, F]`` weights with one ``torch.bmm``
each (``tests/passes/style_models.py``: ``PaddedBmmMoE``). FX cannot trace it (the capacity is read into
Python), so ``optimize`` used to leave it data-parallel. Now the code applying the weights is recorded on a
probe (from their first use, on the buffer, to their last) and moved with them into an experts child; the
block's forward runs as written with the weights seen as shape-only stand-ins whose first use calls the
experts on the buffer and whose last use answers their result (``rewrite == "own-weights"``, form
``expert-batched``, docs/detection.md). Every buffer row, padding included, is a row of the runtime's call (the
padding's results are never read: zero gradients). Held here: found and explained, the rewrite exact and
keeping the user's keys, 2 gloo ranks under ``themis``, ``themis-rm`` and ``ep`` and 4 (2 nodes x 2) under
``ep`` equal to one process with each expert on one rank; and a block whose code reads a weight's values
into Python left data-parallel, the warning naming the module and the step that failed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import themis_compile
from tests.passes import zoo_models as zoo
from tests.passes.style_models import D, E, K, PaddedBmmMoE, style_model
from tests.passes.style_training import trains_like_one_process

LAYERS = ["layers.0.moe", "layers.1.moe"]
WEIGHTS = ("w_in", "w_out")
SKEW = 3.0


def build() -> torch.nn.Module:
    """The style's model with its routers skewed towards expert 0 from outside the block."""
    model = style_model("padded_bmm")
    v_D = torch.full((D,), D ** -0.5)
    with torch.no_grad():
        for layer in model.layers:
            layer.norm2.bias.copy_(v_D)
            layer.moe.gate.weight[0] += SKEW * v_D
    return model


def is_expert(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in WEIGHTS


def test_found_and_explained():
    text = themis_compile.explain(build())
    assert text.startswith("2 MoE layer(s) found"), text
    assert "layers.0.moe: 4 experts (own-weights, 'experts'), top-2, router 'gate' [E=4, H=32]" in text, text
    assert "the block's own code on w_in, w_out (buf [E, C, H]) -> [E, C, H]" in text, text


def test_rewrite_is_exact_and_keeps_the_users_keys():
    from themis_compile.passes.shard import prepare_moe_layers

    model, original = build(), build()
    keys, w_in = list(original.state_dict()), model.layers[0].moe.w_in
    infos = prepare_moe_layers(model, strict=True)
    assert [(i.name, i.rewrite, i.num_experts, i.top_k) for i in infos] == [(n, "own-weights", E, K) for n in LAYERS]
    block = model.layers[0].moe
    assert block.experts.w_in is w_in and "w_in" not in block._parameters
    assert list(model.state_dict()) == keys
    model.load_state_dict(original.state_dict())
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want, got = original.layers[0].moe(x), block(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    ref = original.layers[0].moe
    g_want = torch.autograd.grad(want.square().sum(), [x, ref.w_in, ref.w_out, ref.gate.weight])
    g_got = torch.autograd.grad(got.square().sum(), [x, block.experts.w_in, block.experts.w_out, block.gate.weight])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_trains_like_one_process_on_2_ranks():
    trains_like_one_process(build, is_expert, LAYERS, E, 2)


def test_trains_like_one_process_on_2_nodes_of_2():
    trains_like_one_process(build, is_expert, LAYERS, E, 4, ("ep",), devices_per_node=2)


class _CappedMoE(PaddedBmmMoE):
    """Clips its experts' result by a bound read off the weights into Python: not code an expert can be."""

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, ids = self.gate(x).softmax(-1).topk(self.top_k, -1)
        h = torch.einsum("td,edf->tef", x, self.w_in)
        bound = float(h.abs().max())
        y = torch.einsum("tef,efd->ted", F.gelu(h).clamp(max=bound), self.w_out)
        return (y.gather(1, ids[..., None].expand(-1, -1, shape[-1])) * w[..., None]).sum(1).view(shape)


def test_code_that_cannot_be_an_expert_stays_data_parallel_with_the_step_named():
    torch.manual_seed(0)
    model = zoo.ZooLM("capped", blocks={"capped": _CappedMoE})
    with pytest.warns(UserWarning) as caught:
        themis_compile.optimize(model)
    text = " ".join(str(w.message) for w in caught)
    assert "found no MoE layer" in text, text
    assert ("layers.0.moe: its expert weights are stacked parameters of the block itself (w_in [4, 32, 32], "
            "w_out [4, 32, 32], 4 experts scored by 'gate'); step 1 (trace the forward to find the code applying "
            "them) failed") in text, text
    assert ("step 2 (record the code applying them on a probe) failed: TensorBase.__float__ reads values computed "
            "from the stacked weights into Python") in text, text
