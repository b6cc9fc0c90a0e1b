"""Activation checkpointing trains exactly like one process with the same checkpointing, under every policy.

The ways users checkpoint: ``torch.utils.checkpoint`` (non-reentrant) around each block's forward, wrapped
before ``optimize`` and after it; torch's ``apply_activation_checkpointing`` (before and after); HF
``gradient_checkpointing_enable()`` on tiny Mixtral (every HF family under every policy:
test_train_matrix.py). Each runs 3 AdamW steps on 2 gloo
ranks (one case on 4 ranks, 2 nodes x 2) under themis, themis-rm and ep, also with gradient accumulation
(2 micro-batches per step, and 2 forwards before one backward), and must match one process on the whole
global batch with the same checkpointing. Each case also checks that the recomputation really ran inside
backward (once per layer and micro-batch) and that it fed neither the load predictor nor the statistics.
A reentrant checkpoint, which cannot replay the forward's plan, fails on every rank with an error naming
it. ``schedule=False`` cases keep the user's wrapping whatever the scheduling pass does; under the default
schedule a wrapper installed after ``optimize`` recomputes the scheduled graph, SpAG start included.
"""

from __future__ import annotations

import functools
import gc
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import themis_compile
from themis_compile.models.gpt_moe import Block
from themis_compile.testing import run_multirank
from tests.runtime.equivalence import (
    LR,
    MODELS,
    _batches,
    _dense_params,
    _expert_chunks_reference,
    assert_equivalent,
    make_model,
    model_loss,
)

STEPS, BATCH, SEQ = 3, 8, 8
# (model, policy, how the model is checkpointed, micro-batches per step, ThemisConfig.schedule).
# micro-batches: 1, 2 (gradient accumulation: a backward per micro-batch) or "joint" (2 forwards, then one
# backward of the summed loss: the recomputations must pair with the right forward). One step of HF
# checkpointing per family and policy, and the reference models wrapped before optimize under the default
# schedule, are in test_train_matrix.py (with clipping, a frozen expert, re-sharding and a resume).
CASES = [
    ("ref-loop", "themis", "wrap-before", 1, False),
    ("ref-loop", "themis-rm", "wrap-before", 1, False),
    ("ref-loop", "ep", "wrap-before", 1, False),
    ("ref-stacked", "themis", "wrap-after", 1, False),
    ("ref-stacked", "themis-rm", "wrap-after", 1, False),
    ("ref-loop", "themis", "apply-ac-before", 1, False),
    ("ref-loop", "themis-rm", "apply-ac-after", 1, False),
    ("ref-loop", "themis-rm", "wrap-before", 2, False),
    ("mixtral", "themis", "hf", 2, True),
    ("ref-loop", "themis-rm", "wrap-before", "joint", False),
    ("ref-loop", "themis-rm", "model-before", 1, False),     # one checkpoint around the whole model: two layers
    ("ref-loop", "themis-rm", "wrap-after", 1, True),
]
CONFIG = dict(reshard_interval=0, overlap_degree=8, materialization_budget=2, check_plans=True,
              cost_benefit=False)   # replicas even where the tiny experts cannot pay for them


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: threads only contend on the shared CPUs (the ranks run with one thread each too).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _checkpoint_forwards(model: torch.nn.Module) -> None:
    """torch.utils.checkpoint (non-reentrant) around the forward of every block of the reference model."""
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def _apply_checkpointing(model: torch.nn.Module, how: str, stage: str) -> None:
    """Checkpoint ``model`` the way ``how`` says, if ``stage`` ("before" / "after" optimize) is its time."""
    if how == "hf":
        if stage == "before":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)     # the v5 alias of activation_checkpointing_enable
                model.gradient_checkpointing_enable()
        return
    kind, when = how.rsplit("-", 1)
    if when != stage:
        return
    if kind == "wrap":
        _checkpoint_forwards(model)
    elif kind == "model":
        model.forward = functools.partial(checkpoint, model.forward, use_reentrant=False)
    else:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


def _micro_batches(tokens: torch.Tensor, micro: int | str) -> list[torch.Tensor]:
    return list(tokens.chunk(1 if micro == 1 else 2))


def _step(model, opt, tokens: torch.Tensor, micro: int | str) -> torch.Tensor:
    """One optimizer step over the micro-batches of ``tokens``; returns the step's (local) loss."""
    parts = _micro_batches(tokens, micro)
    losses = [model_loss(model, part) / len(parts) for part in parts]
    if micro == "joint":
        sum(losses).backward()
    else:
        for loss in losses:
            loss.backward()
    opt.step()
    opt.zero_grad()
    return sum(loss.detach() for loss in losses)


def _reference(name: str, how: str, micro: int | str):
    model = make_model(MODELS[name])
    _apply_checkpointing(model, how, "before")
    _apply_checkpointing(model, how, "after")
    opt = torch.optim.AdamW(model.parameters(), lr=MODELS[name].get("lr", LR))
    losses = [_step(model, opt, tokens, micro).item()
              for tokens in _batches(STEPS, BATCH, SEQ, model.config.vocab_size)]
    return losses, _dense_params(model), _expert_chunks_reference(model)


def _count_recomputations(runtime) -> list[int]:
    """[calls of each layer's sharded experts inside a backward pass] (a recomputation)."""
    counts = [0] * len(runtime.layers)
    for i, experts in enumerate(runtime.layers.values()):
        def hook(module, args, i=i):
            if torch._C._current_graph_task_id() != -1:
                counts[i] += 1
        experts.register_forward_pre_hook(hook)
    return counts


def _train(rank: int, world_size: int, name: str, policy: str, how: str, micro: int | str, schedule: bool):
    model = make_model(MODELS[name])
    _apply_checkpointing(model, how, "before")
    model = themis_compile.optimize(model, themis_compile.ThemisConfig(policy=policy, schedule=schedule, **CONFIG))
    _apply_checkpointing(model, how, "after")
    runtime = themis_compile.api.runtime_of(model)
    recomputed = _count_recomputations(runtime)
    opt = torch.optim.AdamW(model.parameters(), lr=MODELS[name].get("lr", LR))
    losses = []
    for tokens in _batches(STEPS, BATCH, SEQ, model.config.vocab_size):
        # Each global micro-batch is split over the ranks, as one process sees it whole.
        parts = [p[rank * (p.shape[0] // world_size):(rank + 1) * (p.shape[0] // world_size)]
                 for p in _micro_batches(tokens, micro)]
        loss = _step(model, opt, torch.cat(parts), micro)
        if world_size > 1:
            dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
    owned = {}
    for li, experts in enumerate(runtime.layers.values()):
        for e, chunk in experts.local_chunks().items():
            owned[(li, e)] = [t.detach().clone() for t in chunk]
    fssdp = runtime.fssdp is not None
    del opt, loss
    gc.collect()
    extra = dict(
        # Replay records live as long as their checkpoint's autograd graph: none may outlive the backward.
        records_left=sum(len(getattr(experts, "_checkpointed", ())) for experts in runtime.layers.values()),
        recomputed=recomputed,
        stats=len(runtime.stats),
        iterations=[experts.iteration for experts in runtime.layers.values()] if fssdp else None,
        delta_p=[sum(s.delta_p for s in runtime.stats if s.layer == layer) for layer in runtime.layers],
        layers=len(runtime.layers),
    )
    return losses, _dense_params(model), owned, extra


def _run(rank: int, world_size: int, cases):
    out = [_train(rank, world_size, *case) for case in cases]
    out.append(_reentrant_error(rank, world_size))
    return out


def _reentrant_error(rank: int, world_size: int) -> str:
    """A reentrant checkpoint under themis: every rank raises at the same forward (no rank left waiting)."""
    model = make_model(MODELS["ref-loop"])
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=True)
    model = themis_compile.optimize(model, themis_compile.ThemisConfig(policy="themis", schedule=False, **CONFIG))
    tokens = _batches(1, BATCH, SEQ, model.config.vocab_size)[0]
    local = BATCH // world_size
    try:
        model_loss(model, tokens[rank * local:(rank + 1) * local]).backward()
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = ""
    # Every rank is still in step: one more collective completes.
    t = torch.ones(1)
    dist.all_reduce(t)
    return message if t.item() == world_size else ""


def _check(case, reference, per_rank) -> None:
    name, policy, how, micro, schedule = case
    label = f"{name}/{policy}/{how}/micro={micro}/schedule={schedule}"
    try:
        assert_equivalent(reference, [r[:3] + (None,) for r in per_rank])
    except AssertionError as exc:
        raise AssertionError(f"{label}: {exc}") from exc
    forwards = STEPS * (1 if micro == 1 else 2)
    for rank, (_, _, _, extra) in enumerate(per_rank):
        if not (schedule and how == "wrap-before"):
            # (The scheduling pass still traces through a checkpoint wrapper installed before optimize.)
            assert extra["recomputed"] == [forwards] * extra["layers"], \
                f"{label} rank {rank}: recomputations per layer {extra['recomputed']}, expected {forwards}"
        assert extra["records_left"] == 0, f"{label} rank {rank}: {extra['records_left']} replay records leaked"
        if extra["iterations"] is not None:
            assert extra["stats"] == forwards * extra["layers"], f"{label}: {extra['stats']} statistics records"
            assert extra["iterations"] == [forwards] * extra["layers"], f"{label}: iterations {extra['iterations']}"
            assert sum(extra["delta_p"]) > 0, f"{label}: no replica was materialized"
            if policy == "themis-rm" and name.startswith("ref"):
                # Skewed routing: the first layer (not the last) releases replicas, which the recomputation
                # must gather again.
                assert extra["delta_p"][0] > 0, f"{label}: the first layer materialized no replica"


def test_activation_checkpointing_matches_single_process():
    results = run_multirank(_run, 2, args=(CASES,), timeout_s=120)
    for i, case in enumerate(CASES):
        name, _, how, micro, _ = case
        _check(case, _reference(name, how, micro), [r[i] for r in results])
    for rank, r in enumerate(results):
        message = r[-1]
        assert "themis_compile" in message and "use_reentrant=True" in message, f"rank {rank}: {message!r}"


@pytest.mark.parametrize("case", [("ref-loop", "themis-rm", "wrap-before", 2, False)])
def test_activation_checkpointing_four_ranks_two_nodes(case):
    results = run_multirank(_run_one, 4, args=(case,), devices_per_node=2, timeout_s=120)
    _check(case, _reference(case[0], case[2], case[3]), results)


def _run_one(rank: int, world_size: int, case):
    return _train(rank, world_size, *case)


def test_activation_checkpointing_world_size_one():
    # Without a process group every policy runs the experts unsharded (one code path for all three).
    case = ("ref-loop", "themis", "wrap-before", 2, False)
    result = _train(0, 1, *case)
    assert result[3]["recomputed"] == [2 * STEPS] * result[3]["layers"]
    assert_equivalent(_reference("ref-loop", "wrap-before", 2), [result[:3] + (None,)])
