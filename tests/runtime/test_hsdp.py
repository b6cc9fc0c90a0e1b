"""``optimize(model, group=mesh)`` with a 2-D ``(replicate, shard)`` DeviceMesh: the experts sharded over all
ranks, the dense parameters by FSDP2's HSDP (sharded within a "node", replicated across), on 4 gloo ranks as
2 nodes x 2; it trains like one process on the global batch, clipping included. A mesh of other shapes is
refused with an error that says what to give."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import themis_compile
from themis_compile.api import runtime_of
from themis_compile.testing import run_multirank
from tests.runtime.equivalence import (_batches, _dense_params, assert_equivalent, global_losses, make_model,
                                       make_optimizer, model_loss, train_reference)

pytestmark = pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")

STEPS, BATCH, SEQ, MAX_NORM = 4, 8, 16, 0.5
SPEC = dict(name="tiny-moe", router_skew=2.0, experts_form="loop", top_k=2, num_experts=8)


def _clip(model, step):
    themis_compile.clip_grad_norm_(model.parameters(), MAX_NORM)


def _train_hsdp(rank: int, world_size: int, policy: str):
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    model = themis_compile.optimize(make_model(SPEC), themis_compile.ThemisConfig(policy=policy, reshard_interval=2),
                                    group=mesh)
    placements = {tuple(p.placements) for p in model.parameters() if isinstance(p, DTensor)}
    opt = make_optimizer(model.parameters(), "adamw")
    losses = global_losses(model, opt, _batches(STEPS, BATCH, SEQ, model.config.vocab_size), model_loss,
                           before_step=_clip)
    owned = {(li, e): [t.detach().clone() for t in chunk]
             for li, layer in enumerate(runtime_of(model).layers.values()) for e, chunk in layer.local_chunks().items()}
    return (losses, _dense_params(model), owned, None), placements, runtime_of(model).world_size


def test_two_dimensional_mesh_is_hsdp_for_dense_and_trains_like_one_process():
    reference = train_reference(SPEC, STEPS, BATCH, SEQ, before_step=lambda m, s: torch.nn.utils.clip_grad_norm_(
        m.parameters(), MAX_NORM))
    for policy in ("themis", "ep"):
        results = run_multirank(_train_hsdp, 4, args=(policy,), devices_per_node=2, timeout_s=120)
        for _, placements, world in results:
            assert placements == {(Replicate(), Shard(0))} and world == 4    # HSDP dense, experts over all 4
        assert_equivalent(reference, [r for r, _, _ in results])


def _three_d(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (2, 1, 1))
    try:
        themis_compile.optimize(make_model(SPEC), group=mesh)
    except ValueError as err:
        return str(err)
    return "no error"


def test_other_meshes_are_refused():
    assert all("3-D DeviceMesh" in r and "2-D (replicate, shard)" in r for r in run_multirank(_three_d, 2))
