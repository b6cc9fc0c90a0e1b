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

import functools

from tests.passes import style_models
from tests.passes.style_models import E, K
from tests.passes.style_training import check_explained, check_own_weights_rewrite, trains_like_one_process

STYLE = "inline_decoder"
LAYERS = style_models.LAYERS[STYLE]
build = functools.partial(style_models.skewed_model, STYLE)
is_expert = style_models.expert_weight(STYLE)


def test_found_and_explained():
    check_explained(build, 2,
                    "layers.0: 4 experts (own-weights, 'experts'), top-2, router 'router' [E=4, H=32]: scores sigmoid",
                    "the block's own code on w1, w2 (rows [N, H], ids [N]) -> [N, H]")


def test_rewrite_is_exact_and_keeps_the_users_keys():
    check_own_weights_rewrite(build, "layers.0", "w1", "wqkv.weight", LAYERS, E, K)


def test_trains_like_one_process_on_2_ranks():
    trains_like_one_process(build, is_expert, LAYERS, E, 2)


def test_trains_like_one_process_on_2_nodes_of_2():
    trains_like_one_process(build, is_expert, LAYERS, E, 4, ("themis-rm",), devices_per_node=2)
