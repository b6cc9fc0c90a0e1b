"""MoE blocks in styles the rest of the tree does not write (``tests/passes/outside_styles.py``), measured:
each that ``optimize`` recognizes is found (its two layers, E experts, top-k) and, on 2 gloo ranks and on 4
(2 nodes x 2), under ``themis``, ``themis-rm`` and ``ep``, sharded (each expert on one rank) and trained equal
to one process on the whole global batch (``style_training.check_sharded_and_equal``). One spawned process group per world size runs every case. The styles that
stack their experts' weights in the block itself (``STACKED``) are also held exact on a probe with the user's
parameter objects and keys, and one of them through a DCP checkpoint in the user's keys.
"""

from __future__ import annotations

import functools

import pytest
import torch

from themis_compile.passes.detect import find_moe_layers
from themis_compile.testing.multirank import run_multirank
from tests.passes import outside_styles as outside
from tests.passes.style_training import POLICIES, check_sharded_and_equal, checkpoint_resumes_in_the_users_keys, reference, train

LAYERS = ["layers.0.moe", "layers.1.moe"]
RECOGNIZED = ("bincount_index_add", "histc_offsets", "searchsorted_index_put", "argmax_mask_switch",
              "geglu_gate_matrix", "onehot_moduledict", "unique_consecutive", "sigmoid_bias_relu2", "stacked_split",
              "einsum_slots")
# The styles that stack their experts' weights in the block itself (the others' live in its 'experts'): the
# weights, and the rewrite that moves them into an experts module with the code applying them.
STACKED = {"stacked_split": (("w1", "w2"), "indexed-weights"), "einsum_slots": (("w1", "w3", "w2"), "own-weights")}


def _build(style: str):
    return functools.partial(outside.build, style)


def _is_expert(style: str):
    """Which parameter names of the unmodified model are expert weights."""
    if style in STACKED:
        return lambda name: name.rsplit(".", 1)[-1] in STACKED[style][0] and ".moe." in name
    return lambda name: ".experts." in name


def _cases() -> list[tuple[str, str]]:
    return [(style, policy) for style in RECOGNIZED for policy in POLICIES]


def _ranks(rank: int, world_size: int, cases: list[tuple[str, str]]):
    return [train(_build(style), policy, LAYERS) for style, policy in cases]


@functools.lru_cache(maxsize=None)
def _references() -> dict[str, tuple]:
    return {style: reference(_build(style), _is_expert(style)) for style in RECOGNIZED}


def _trains_like_one_process(world_size: int, devices_per_node: int | None = None) -> None:
    cases = _cases()
    results = run_multirank(_ranks, world_size, args=(cases,), devices_per_node=devices_per_node, timeout_s=300)
    refs = _references()
    for i, (style, policy) in enumerate(cases):
        what = f"{style} under {policy} on {world_size} ranks"
        per_rank = [r[i] for r in results]
        check_sharded_and_equal(refs[style], per_rank, LAYERS, outside.E, what, replicas=policy != "ep")


@pytest.mark.parametrize("style", RECOGNIZED)
def test_found(style):
    infos, rejected = find_moe_layers(outside.build(style))
    assert not rejected, rejected
    assert [(i.name, i.num_experts, i.experts_attr) for i in infos] == [(n, outside.E, "experts") for n in LAYERS]


@pytest.mark.parametrize("style", RECOGNIZED)
def test_top_k(style):
    infos, _ = find_moe_layers(outside.build(style))
    assert [i.top_k for i in infos] == [outside.TOP_K[style]] * len(LAYERS)


def test_trains_like_one_process_on_2_ranks():
    _trains_like_one_process(2)


def test_trains_like_one_process_on_2_nodes_of_2():
    _trains_like_one_process(4, devices_per_node=2)


def test_stacked_weights_checkpoint_in_the_users_keys(tmp_path):
    """torch.distributed.checkpoint through themis_compile.checkpoint holds the stacked weights under the user's
    keys (``layers.0.moe.w1``, one [E, ...] tensor) and resumes the run exactly; the full state dict is the
    unmodified model's, equal to one process's training."""
    checkpoint_resumes_in_the_users_keys(_build("stacked_split"), tmp_path)


@pytest.mark.parametrize("style", sorted(STACKED))
def test_stacked_weights_move_with_their_code(style):
    """The blocks holding their stacked weights themselves (``self.w1[e]`` in a loop; ``self.w1[ids[:, k]]``
    per slot): the weights, the same parameter objects, move into the experts module; the state-dict keys stay
    the unmodified model's, both ways; the block computes what the unmodified one does, values and
    gradients."""
    from themis_compile.passes.styles import prepare_moe_layers

    names, rewrite = STACKED[style]
    model, original = outside.build(style), outside.build(style)
    keys = list(original.state_dict())
    block, ref = model.layers[0].moe, original.layers[0].moe
    w = block._parameters[names[0]]
    infos = prepare_moe_layers(model, strict=True)
    assert [(i.name, i.rewrite, i.num_experts, i.top_k) for i in infos] == [
        (n, rewrite, outside.E, outside.K) for n in LAYERS]
    assert block.experts._parameters[names[0]] is w and names[0] not in block._parameters
    assert list(model.state_dict()) == keys
    model.load_state_dict(original.state_dict())
    x = torch.randn(2, 5, outside.H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    want, got = ref(x), block(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    router = outside.ROUTERS[style]
    g_want = torch.autograd.grad(want.square().sum(), [x, getattr(ref, router).weight,
                                                       *(getattr(ref, n) for n in names)])
    g_got = torch.autograd.grad(got.square().sum(), [x, getattr(block, router).weight,
                                                     *(getattr(block.experts, n) for n in names)])
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_slot_regions_become_one_per_row_call():
    """``einsum_slots``' traced graph: one region per slot (the same code, rows and ids of the slot), replaced by
    one per-row call of the experts on every slot's rows; the graph stays well formed."""
    from torch import nn

    from themis_compile.passes.fx_graph import record_meta, trace_block
    from themis_compile.passes.own_weights import replace_slot_regions, slot_regions
    from themis_compile.passes.probe import probe_input

    block = outside.build("einsum_slots").layers[0].moe
    x = probe_input(block, outside.H)
    traced = trace_block(block, nn.Module(), training=True)
    record_meta(traced, block, x)
    regions, why = slot_regions(traced, ("w1", "w3", "w2"), outside.H)
    assert regions is not None, why
    assert len(regions) == outside.K
    assert all(traced.meta[ins[0]].shape == (x.shape[:-1].numel(), outside.H) for _, ins, _ in regions)
    gm = replace_slot_regions(traced, regions, "experts")
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    assert [n.target for n in nodes if n.op == "call_module"] == ["gate", "experts"]
    assert not any(n.op == "get_attr" for n in nodes)
