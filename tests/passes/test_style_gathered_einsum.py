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

import functools

from tests.passes import style_models
from tests.passes.style_models import E, K
from tests.passes.style_training import (check_explained, check_own_weights_rewrite,
                                         checkpoint_resumes_in_the_users_keys, trains_like_one_process)

STYLE = "gathered_einsum"
LAYERS = style_models.LAYERS[STYLE]
build = functools.partial(style_models.skewed_model, STYLE)
is_expert = style_models.expert_weight(STYLE)


def test_found_and_explained():
    check_explained(build, 2,
                    "layers.0.moe: 4 experts (own-weights, 'experts'), top-2, router 'router' [E=4, H=32]",
                    "the block's own code on w_gate, w_up, w_down (x [T, H], ids [T, K]) -> [T, K, H]")


def test_rewrite_is_exact_and_keeps_the_users_keys():
    check_own_weights_rewrite(build, "layers.0.moe", "w_down", "router.weight", LAYERS, E, K)


def test_trains_like_one_process_on_2_ranks():
    trains_like_one_process(build, is_expert, LAYERS, E, 2)


def test_trains_like_one_process_on_2_nodes_of_2():
    trains_like_one_process(build, is_expert, LAYERS, E, 4, ("themis",), devices_per_node=2)


def test_checkpoint_resumes_in_the_users_keys(tmp_path):
    checkpoint_resumes_in_the_users_keys(build, tmp_path)
