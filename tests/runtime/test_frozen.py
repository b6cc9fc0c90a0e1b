"""Frozen experts stay frozen under every policy, whether frozen before or after ``optimize``.

A frozen expert tensor (``requires_grad=False``) gets no ``.grad``, never moves under the optimizer, keeps
its flag when re-sharding moves it to another owner, and (under themis / themis-rm) takes no part in the
SparseReduceScatter: an expert frozen whole has no replica there, a partly frozen one sends only its
trainable tensors. Training equals one process on the whole global batch with the same tensors frozen at
the same steps: a whole layer, single experts and single tensors of an expert, frozen before
``optimize`` or after it, and unfrozen again mid-run.
"""

from __future__ import annotations

import weakref

import pytest
import torch

import themis_compile
from themis_compile.passes.detect import find_moe_layers
from themis_compile.runtime import fssdp
from themis_compile.runtime.experts import ExpertBank
from themis_compile.testing import run_multirank
from tests.runtime.equivalence import (
    _expert_chunks_reference,
    assert_equivalent,
    make_model,
    train_distributed,
    train_reference,
)

STEPS, BATCH, SEQ = 4, 8, 16
LOOP = dict(name="tiny-moe", router_skew=2.0, experts_form="loop", top_k=2, num_experts=6)
STACKED = dict(name="tiny-moe", router_skew=2.0, experts_form="stacked", top_k=2, num_experts=4)
FSSDP = dict(reshard_interval=2, overlap_degree=8, materialization_budget=2, check_plans=True)

# An entry is (layer, expert, tensor index), index None = every tensor of the expert.
WHOLE_LAYER_0 = tuple((0, e, None) for e in range(6))
PARTS_OF_LAYER_1 = ((1, 1, None), (1, 3, 0))


def _schedule(steps: int, before=(), later=(), frozen_from: int = 0, frozen_until: int = 0,
              before_until: int | None = None) -> tuple[frozenset, ...]:
    """The entries frozen during each step: ``before`` from the start (set before ``optimize``) until
    ``before_until`` (exclusive), ``later`` during steps [frozen_from, frozen_until)."""
    return tuple(frozenset(before if before_until is None or s < before_until else ())
                 | frozenset(later if frozen_from <= s < frozen_until else ()) for s in range(steps))


SCHEDULES = {
    "before": _schedule(STEPS, before=WHOLE_LAYER_0 + PARTS_OF_LAYER_1),
    # Frozen before optimize and unfrozen after step 1; others frozen after step 0, unfrozen after step 2
    # (re-sharding runs after steps 1 and 3).
    "after": _schedule(STEPS, before=((0, 2, None), (1, 4, 1)), before_until=2,
                       later=((1, 0, None), (1, 2, 0), (0, 5, None)), frozen_from=1, frozen_until=3),
    # A frozen stacked weight: the second tensor of every expert of layer 1, before optimize.
    "stacked": _schedule(STEPS, before=tuple((1, e, 1) for e in range(4))),
}


_UNMODIFIED_CHUNKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _chunks(model) -> dict[tuple[int, int], list[torch.Tensor]]:
    """(layer, expert) -> the expert's parameters in this process: after ``optimize`` the owned ones; on
    the unmodified model all of them (stacked weights: the stacked parameters, shared by every expert),
    found once per model (detection probes the layers; freezing changes no module or parameter)."""
    if getattr(model, "_themis_runtime", None) is not None:
        layers = themis_compile.api.runtime_of(model).layers.values()
        return {(li, e): c for li, layer in enumerate(layers) for e, c in layer.local_chunks().items()}
    if model not in _UNMODIFIED_CHUNKS:
        _UNMODIFIED_CHUNKS[model] = _unmodified_chunks(model)
    return _UNMODIFIED_CHUNKS[model]


def _unmodified_chunks(model) -> dict[tuple[int, int], list[torch.Tensor]]:
    out = {}
    for li, info in enumerate(find_moe_layers(model)[0]):
        experts = getattr(info.module, info.experts_attr)
        bank = ExpertBank(experts)
        for e in range(bank.num_experts):
            out[(li, e)] = list(experts[e].parameters()) if bank.per_expert_modules else list(experts.parameters())
    return out


def _covered(entries, li: int, e: int, j: int) -> bool:
    return (li, e, None) in entries or (li, e, j) in entries


def _apply(model, frozen: frozenset, schedule) -> None:
    """Set requires_grad of every tensor the schedule ever names to match ``frozen``."""
    named = frozenset().union(*schedule)
    for (li, e), chunk in _chunks(model).items():
        for j, p in enumerate(chunk):
            if _covered(named, li, e, j):
                p.requires_grad_(not _covered(frozen, li, e, j))


def _frozen_tensors(model, frozen: frozenset) -> list[torch.Tensor]:
    return [p for (li, e), c in _chunks(model).items() for j, p in enumerate(c) if _covered(frozen, li, e, j)]


def _train(rank, world_size, model_kwargs, config, schedule, optimizer):
    """Train under ``schedule``; record whether every frozen tensor held here had no .grad before each
    optimizer step, the requires_grad flags of every held expert after each step (after re-sharding),
    every SpRS (layer, P', P, chunk layouts) and the realized plans P'."""
    sprs = []
    real = fssdp.sparse_reduce_scatter

    def recording(grads, placement, shard, *args, **kwargs):
        sprs.append((kwargs["layer"], placement.mask.copy(), shard.mask.copy(), kwargs["spec"]))
        return real(grads, placement, shard, *args, **kwargs)

    fssdp.sparse_reduce_scatter = recording
    grads_none, runtime = [], []

    def before_step(model, step):
        grads_none.append(all(p.grad is None for p in _frozen_tensors(model, schedule[step])))

    def step_callback(model, opt, step):
        if step + 1 < len(schedule):
            _apply(model, schedule[step + 1], schedule)
        runtime[:] = [themis_compile.api.runtime_of(model)]
        flags = {key: [p.requires_grad for p in c] for key, c in _chunks(model).items()}
        return runtime[0].reshard_scheduler.moved if runtime[0].reshard_scheduler else 0, flags

    try:
        result = train_distributed(rank, world_size, model_kwargs, config, STEPS, BATCH, SEQ,
                                   step_callback=step_callback, optimizer=optimizer,
                                   prepare=lambda m: _apply(m, schedule[0], schedule), before_step=before_step)
    finally:
        fssdp.sparse_reduce_scatter = real
    names = list(runtime[0].layers)
    plans = [(names.index(s.layer), s.placement) for s in runtime[0].stats]
    sprs = [(names.index(name), p, s, spec) for name, p, s, spec in sprs]
    return result, grads_none, sprs, plans


def _check(model_kwargs, schedule, results, optimizer: str, fssdp_policy: bool) -> None:
    grads_none = []
    ref = train_reference(
        model_kwargs, STEPS, BATCH, SEQ, optimizer, prepare=lambda m: _apply(m, schedule[0], schedule),
        before_step=lambda m, s: grads_none.append(all(p.grad is None for p in _frozen_tensors(m, schedule[s]))),
        step_callback=lambda m, o, s: _apply(m, schedule[s + 1], schedule) if s + 1 < len(schedule) else None)
    assert all(grads_none)
    assert_equivalent(ref, [r[0] for r in results])

    initial = _expert_chunks_reference(make_model(model_kwargs))
    always = frozenset.intersection(*schedule)
    frozen_whole = {(li, e) for li, e, i in always if i is None}
    replicated_frozen = False
    for rank, ((_, _, owned, extra), no_grads, sprs, plans) in enumerate(results):
        assert all(no_grads), f"rank {rank}: a frozen expert tensor got a .grad"
        for (li, e), chunk in owned.items():
            for j, t in enumerate(chunk):
                if _covered(always, li, e, j):
                    assert torch.equal(t, initial[(li, e)][j]), f"rank {rank}: frozen tensor {(li, e, j)} moved"
        for step, (_, flags) in enumerate(extra[:-1]):
            for (li, e), rg in flags.items():
                want = [not _covered(schedule[step + 1], li, e, j) for j in range(len(rg))]
                assert rg == want, f"rank {rank} after step {step}: expert {(li, e)} requires_grad {rg}, not {want}"
        for li, placement, shard, spec in sprs:
            for (fl, e) in frozen_whole:
                if fl == li:
                    assert (placement[e] == shard[e]).all(), f"rank {rank}: an SpRS reduces frozen expert {(li, e)}"
            for fl, e, j in always:
                if fl == li and j is not None:
                    assert len(spec[e]) == len(initial[(li, e)]) - 1, f"an SpRS carries frozen tensor {(li, e, j)}"
        replicated_frozen |= any(p[e].count(True) > 1 for li, p in plans for (fl, e) in frozen_whole if fl == li)
    if fssdp_policy:
        assert max(extra[-1][0] for (_, _, _, extra), *_ in results) > 0, "re-sharding never moved an expert"
        if frozen_whole:
            assert replicated_frozen, "no plan replicated a frozen expert: the SpRS check is vacuous"


CASES_2 = [
    (LOOP, dict(policy="themis", **FSSDP), "before", "adamw"),
    (LOOP, dict(policy="themis-rm", **FSSDP), "after", "adamw"),
    (STACKED, dict(policy="themis", dense_parallel="ddp", **FSSDP), "stacked", "adamw"),
    # Frozen before optimize (a grad hook on a frozen parameter would raise), unfrozen after: SGD, since
    # the unfrozen expert must get the 1/world-size gradient scale, which AdamW hides.
    (LOOP, dict(policy="ep", dense_parallel="ddp"), "after", "sgd"),
]
# 2 nodes x 2: the SpRS combines per node first, with per-expert chunk layouts.
CASES_4 = [(LOOP, dict(policy="themis-rm", **FSSDP), "before", "adamw")]


def _run(rank, world_size, cases):
    return [_train(rank, world_size, mk, cfg, SCHEDULES[name], opt) for mk, cfg, name, opt in cases]


@pytest.mark.parametrize("world_size,devices_per_node,cases", [(2, None, CASES_2), (4, 2, CASES_4)])
def test_frozen_experts_stay_frozen(world_size, devices_per_node, cases):
    results = run_multirank(_run, world_size, args=(cases,), devices_per_node=devices_per_node, timeout_s=120)
    for i, (mk, cfg, name, opt) in enumerate(cases):
        _check(mk, SCHEDULES[name], [r[i] for r in results], opt, cfg["policy"] != "ep")
