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

import functools

import pytest
import torch
import torch.nn.functional as F

import themis_compile
from tests.passes import style_models, zoo_models as zoo
from tests.passes.style_models import E, K, PaddedBmmMoE
from tests.passes.style_training import (check_explained, check_own_weights_rewrite,
                                         checkpoint_resumes_in_the_users_keys, trains_like_one_process)

STYLE = "padded_bmm"
LAYERS = style_models.LAYERS[STYLE]
build = functools.partial(style_models.skewed_model, STYLE)
is_expert = style_models.expert_weight(STYLE)


def test_found_and_explained():
    check_explained(build, 2,
                    "layers.0.moe: 4 experts (own-weights, 'experts'), top-2, router 'gate' [E=4, H=32]",
                    "the block's own code on w_in, w_out (buf [E, C, H]) -> [E, C, H]")


def test_rewrite_is_exact_and_keeps_the_users_keys():
    check_own_weights_rewrite(build, "layers.0.moe", "w_in", "gate.weight", LAYERS, E, K)


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


def test_checkpoint_resumes_in_the_users_keys(tmp_path):
    checkpoint_resumes_in_the_users_keys(build, tmp_path)


@pytest.mark.parametrize("style", ["padded_bmm", "inline_decoder", "gathered_einsum"])
def test_an_expert_without_rows_runs_on_none(style):
    """The runtime runs an expert of a block that calls every expert on no rows where none reached it: the
    own-weights experts' code takes zero rows (it reshaped them to [0, K, -1], which torch cannot) and gives
    every weight of the expert a zero gradient."""
    from themis_compile.passes.styles import prepare_moe_layers
    from themis_compile.runtime.experts import ExpertBank

    info = prepare_moe_layers(style_models.skewed_model(style), strict=True)[0]
    experts = getattr(info.module, info.experts_attr)
    bank = ExpertBank(experts, num_experts=info.num_experts)
    params = [p.detach().requires_grad_() for p in bank.chunk(experts, 0)]
    y = bank.run(params, torch.zeros(0, info.hidden_size), bank.shared_tensors(experts))
    assert tuple(y.shape) == (0, info.hidden_size)
    grads = torch.autograd.grad(y.sum(), params, allow_unused=True)
    assert all(g is not None and not g.any() for g in grads), grads
