"""``themis_compile.clip_grad_norm_`` clips an optimized model like torch's clips one process.

On 2 ranks and on 4 ranks (2 nodes x 2), under themis-rm and ep (themis, and every model and policy:
test_train_matrix.py), with FSDP2 and DDP for the dense parameters: at every step the returned norm
equals, on every rank, the norm torch computes over the whole gradient of one process on the global batch
(2-norm and inf-norm; the model, a generator or a list of its parameters as the argument), and training
with clipping active equals that process clipped with ``torch.nn.utils.clip_grad_norm_``. Re-sharding
every 2 steps moves experts between owners meanwhile. Under DDP the replica check (`runtime/replicas.py`)
runs at every step and finds the replicas equal.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import themis_compile
from themis_compile.testing import run_multirank
from tests.runtime.equivalence import assert_equivalent, make_model, train_distributed, train_reference

STEPS, BATCH, SEQ = 4, 8, 16
LOOP = dict(name="tiny-moe", router_skew=2.0, experts_form="loop", top_k=2, num_experts=6)
STACKED = dict(name="tiny-moe", router_skew=2.0, experts_form="stacked", top_k=1, shared_expert=True)
FSSDP = dict(reshard_interval=2, overlap_degree=8, materialization_budget=2)
# max_norm well below every step's norm, so that clipping is active at every step (checked).
MAX_NORM = {2.0: 0.05, math.inf: 0.005}


def _as_argument(model, form: str):
    if form == "model":
        return model
    if form == "generator":
        return model.parameters()
    return list(model.parameters())


def _train(rank, world_size, model_kwargs, config, norm_type, form):
    norms, checked = [], []

    def clip(model, step):
        norm = themis_compile.clip_grad_norm_(_as_argument(model, form), MAX_NORM[norm_type], norm_type)
        norms.append(norm.item())
        # Under DDP the replica check (on by default) found the replicas equal at this step's forward.
        check = getattr(model, "_themis_replica_check", None)
        checked.append(None if check is None else check.last_equal)

    result = train_distributed(rank, world_size, model_kwargs, config, STEPS, BATCH, SEQ, before_step=clip)
    return result, norms, checked


def _unrelated_parameters(rank):
    """Parameters of no optimized model keep torch's semantics: this rank's own norm, no collective."""
    lin = nn.Linear(3, 2)
    for i, p in enumerate(lin.parameters()):
        p.grad = torch.full_like(p, float(rank + i + 1))
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in lin.parameters()]))
    return themis_compile.clip_grad_norm_(lin.parameters(), 1e9).item(), expected.item()


def _nonfinite_on_one_rank(rank, world_size):
    """An inf in an expert gradient that only rank 0 owns makes every rank raise (the norm is global)."""
    model = themis_compile.optimize(
        make_model(LOOP), themis_compile.ThemisConfig(policy="themis", dense_parallel="ddp", reshard_interval=0))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    if rank == 0:
        next(iter(themis_compile.api.runtime_of(model).layers.values())).local_chunks()[0][0].grad[0, 0] = math.inf
    try:
        themis_compile.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    except RuntimeError as exc:
        return "non-finite" in str(exc)
    return False


def _run(rank, world_size, cases, extras):
    out = [_train(rank, world_size, mk, cfg, p, form) for mk, cfg, p, form in cases]
    if extras:
        out.append((_unrelated_parameters(rank), _nonfinite_on_one_rank(rank, world_size)))
    return out


# The 2-norm under themis / themis-rm / ep with FSDP2 for every model is in test_train_matrix.py; here the
# other norms, argument forms and dense-parallel combinations.
CASES_2 = [
    (LOOP, dict(policy="themis-rm", dense_parallel="ddp", **FSSDP), 2.0, "generator"),
    (STACKED, dict(policy="ep"), math.inf, "list"),
    (LOOP, dict(policy="ep", dense_parallel="ddp"), 2.0, "model"),
]
CASES_4 = [
    (LOOP, dict(policy="themis", dense_parallel="ddp", **FSSDP), 2.0, "model"),
    (LOOP, dict(policy="themis-rm", **FSSDP), math.inf, "generator"),
    # 3 experts on 4 ranks: one rank owns none and must still join the reduction.
    (dict(LOOP, num_experts=3), dict(policy="ep"), 2.0, "list"),
]


@pytest.mark.parametrize("world_size,devices_per_node,cases", [(2, None, CASES_2), (4, 2, CASES_4)])
def test_global_norm_and_clipped_training_match_one_process(world_size, devices_per_node, cases):
    extras = world_size == 2
    results = run_multirank(_run, world_size, args=(cases, extras), devices_per_node=devices_per_node,
                            timeout_s=120)
    for i, (mk, cfg, norm_type, _) in enumerate(cases):
        ref_norms = []

        def clip(model, step):
            ref_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM[norm_type], norm_type).item())

        reference = train_reference(mk, STEPS, BATCH, SEQ, before_step=clip)
        assert min(ref_norms) > 2 * MAX_NORM[norm_type], f"case {i}: clipping is not active ({ref_norms})"
        for rank, r in enumerate(results):
            norms, checked = r[i][1], r[i][2]
            want = list(range(1, STEPS + 1)) if cfg.get("dense_parallel") == "ddp" else [None] * STEPS
            assert checked == want, f"case {i} rank {rank}: replica checks {checked}"
            for step, (a, b) in enumerate(zip(norms, ref_norms, strict=True)):
                assert abs(a - b) <= 1e-5 * b, f"case {i} rank {rank} step {step}: norm {a}, one process {b}"
        assert_equivalent(reference, [r[i][0] for r in results])
    if extras:
        for rank, r in enumerate(results):
            (got, expected), raised = r[-1]
            assert got == pytest.approx(expected, rel=1e-6), f"rank {rank}: unrelated parameters' norm"
            assert raised, f"rank {rank} did not raise on a non-finite norm held by rank 0"


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("form", ["model", "generator", "tensor"])
def test_outside_optimized_models_it_is_torchs(norm_type, form):
    torch.manual_seed(0)
    ours, theirs = nn.Linear(4, 3), nn.Linear(4, 3)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    if form == "tensor":
        got = themis_compile.clip_grad_norm_(ours.weight, 0.1, norm_type)
        want = torch.nn.utils.clip_grad_norm_(theirs.weight, 0.1, norm_type)
    else:
        got = themis_compile.clip_grad_norm_(ours if form == "model" else ours.parameters(), 0.1, norm_type)
        want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1, norm_type)
    torch.testing.assert_close(got, want)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(ValueError, match="norm_type"):
        themis_compile.clip_grad_norm_(ours, 1.0, -1.0)
