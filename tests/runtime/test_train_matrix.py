"""A user's ordinary training loop on an optimized model, for every model and policy, against one process.

For world sizes 2 and 4 (4 as 2 nodes x 2), one spawned process group each, every model of
``equivalence.MODELS`` (the reference model with ModuleList and with stacked experts, tiny HF Mixtral,
Qwen3-MoE and DeepSeek-V3) under themis, themis-rm and ep (on 4 ranks each model once, the policies in
rotation, so that every model and every policy runs there) trains the way a user writes it:

- AdamW, with ``themis_compile.clip_grad_norm_`` active at every step (the model, a generator or a list
  of its parameters as the argument); the returned norm is, on every rank, one process's;
- activation checkpointing: HF ``gradient_checkpointing_enable()`` for the HF models, non-reentrant
  ``torch.utils.checkpoint`` around every block's forward for the reference models; the recomputation
  runs inside backward, once per MoE layer and step;
- one expert frozen (``requires_grad_(False)`` after ``optimize``, by name): it never has a ``.grad``
  and ends where it started;
- re-sharding every 2 steps (themis, themis-rm: experts have moved when the checkpoint is taken);
- dense parameters through FSDP2 (the default);
- a DCP checkpoint through ``themis_compile.checkpoint`` before step SAVE_AT; a fresh optimized model
  (frozen and checkpointed the same way) loads it and continues to step STEPS.

The resumed run equals the uninterrupted one bit for bit (losses, clip norms, final parameters and
placement, iteration counters, load predictions and re-sharding schedule), and both equal one process on
the whole global batch with the same clipping, checkpointing and frozen expert (losses within 1e-5
relative, parameters allclose). ``explain`` on the optimized model lists its sharded layers. On 2 ranks, each HF family also has a collective that one rank skips: the other
fails within ``collective_timeout_s`` naming the collective, the layer and the missing rank.
"""

from __future__ import annotations

import copy
import datetime
import functools
import gc
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.utils.checkpoint import checkpoint

import themis_compile
from themis_compile.checkpoint import get_state_dict, set_state_dict
from themis_compile.passes.detect import find_moe_layers
from themis_compile.runtime import exchange
from themis_compile.runtime.deadline import CollectiveTimeoutError
from themis_compile.runtime.experts import ExpertBank
from themis_compile.runtime.fssdp import FSSDPExperts
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
from tests.runtime.test_deadlines import SLACK_S, _Skip, _skip
from tests.runtime.test_deadlines import TIMEOUT_S as DEADLINE_TIMEOUT_S

pytestmark = pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")

STEPS, SAVE_AT, BATCH, SEQ = 4, 2, 8, 8
POLICIES = ("themis", "themis-rm", "ep")
CASES = [(name, policy) for name in MODELS for policy in POLICIES]
# On 4 ranks every model and every policy, in rotation (each model once): the full product at both world
# sizes would cost the suite as much again, and what 4 ranks add (two nodes, cross-node placement and
# re-sharding) does not depend on the pairing.
CASES_4 = [(name, POLICIES[i % len(POLICIES)]) for i, name in enumerate(MODELS)]
FROZEN = 1                 # the expert frozen in the first MoE layer
MAX_NORM = 0.05            # below every step's norm: clipping is active (checked)
FLAT, NESTED = StateDictOptions(flatten_optimizer_state_dict=True), StateDictOptions()


def _config(policy: str, **overrides) -> themis_compile.ThemisConfig:
    # t and m fixed: profiled budgets would make the plans depend on timing. Dense parameters: FSDP2 (the
    # default). (Under DDP on 4 ranks a resumed run's dense parameters differ from the uninterrupted run's
    # by rounding: torch's DDP re-buckets after its first iteration, which changes gloo's summation order.)
    # cost_benefit off: the replica paths are exercised even where the tiny experts cannot pay for them.
    return themis_compile.ThemisConfig(**{"policy": policy, "reshard_interval": 2, "overlap_degree": 8,
                                          "materialization_budget": 2, "cost_benefit": False, **overrides})


def _options(name: str) -> StateDictOptions:
    return FLAT if list(MODELS).index(name) % 2 == 0 else NESTED


def _clip_argument(model, policy: str):
    return {"themis": model, "themis-rm": model.parameters(), "ep": list(model.parameters())}[policy]


def _checkpoint_activations(model) -> None:
    """HF: the model's own switch; the reference model: non-reentrant checkpoint around each block."""
    if hasattr(model, "gradient_checkpointing_enable"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)      # the v5 alias of activation_checkpointing_enable
            model.gradient_checkpointing_enable()
        return
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def _frozen_prefix(layer: str) -> str:
    return f"{layer}.experts.{FROZEN}."


# ---------------------------------------------------------------------------------- one process
def _reference(name: str):
    """One process on the whole global batch, clipped by torch and checkpointed the same way, with
    expert FROZEN of the first MoE layer frozen: its own parameters for ModuleList experts; for stacked
    [E, ...] weights (which torch can only freeze whole) its slice gets no gradient, and so no AdamW
    moment, and is put back after each step (AdamW's decoupled weight decay touches the whole tensor)."""
    spec = MODELS[name]
    model = make_model(spec)
    infos = find_moe_layers(model)[0]
    layers, info = [i.name for i in infos], infos[0]
    layer = info.name
    experts = getattr(info.module, info.experts_attr)
    stacked = not ExpertBank(experts).per_expert_modules
    if stacked:
        sliced = [p for p in experts.parameters()]
        initial = [p.detach()[FROZEN].clone() for p in sliced]
    else:
        for n, p in model.named_parameters():
            if n.startswith(_frozen_prefix(layer)):
                p.requires_grad_(False)
    _checkpoint_activations(model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.get("lr", LR))
    losses, norms = [], []
    for tokens in _batches(STEPS, BATCH, SEQ, model.config.vocab_size):
        loss = model_loss(model, tokens)
        loss.backward()
        if stacked:
            for p in sliced:
                p.grad[FROZEN] = 0
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        if stacked:
            with torch.no_grad():
                for p, p0 in zip(sliced, initial):
                    p[FROZEN] = p0
        losses.append(loss.item())
    return (losses, _dense_params(model), _expert_chunks_reference(model)), norms, layers


# ---------------------------------------------------------------------------------- distributed
def _build(name: str, policy: str):
    model = make_model(MODELS[name])
    _checkpoint_activations(model)
    model = themis_compile.optimize(model, _config(policy))
    runtime = themis_compile.api.runtime_of(model)
    prefix = _frozen_prefix(next(iter(runtime.layers)))
    for n, p in model.named_parameters():
        if n.startswith(prefix):
            p.requires_grad_(False)
    return model, torch.optim.AdamW(model.parameters(), lr=MODELS[name].get("lr", LR))


def _count_recomputations(runtime) -> list[int]:
    """[calls of each layer's sharded experts inside a backward pass] (a recomputation)."""
    counts = [0] * len(runtime.layers)
    for i, experts in enumerate(runtime.layers.values()):
        def hook(module, args, i=i):
            if torch._C._current_graph_task_id() != -1:
                counts[i] += 1
        experts.register_forward_pre_hook(hook)
    return counts


def _train(model, opt, policy: str, start: int, save=None) -> dict:
    """Steps [start, STEPS) of the user's loop; ``save(model, opt)`` runs before step SAVE_AT."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = BATCH // world
    runtime = themis_compile.api.runtime_of(model)
    prefix = _frozen_prefix(next(iter(runtime.layers)))
    recomputed = _count_recomputations(runtime)
    losses, norms, frozen_grads = [], [], []
    for step, tokens in enumerate(_batches(STEPS, BATCH, SEQ, model.config.vocab_size)):
        if step < start:
            continue
        if step == SAVE_AT and save is not None:
            save(model, opt)
        loss = model_loss(model, tokens[rank * local:(rank + 1) * local])
        loss.backward()
        frozen_grads += [n for n, p in model.named_parameters() if n.startswith(prefix) and p.grad is not None]
        norms.append(themis_compile.clip_grad_norm_(_clip_argument(model, policy), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    owned = {(li, e): [t.detach().clone() for t in chunk]
             for li, layer in enumerate(runtime.layers.values()) for e, chunk in layer.local_chunks().items()}
    scheduler = runtime.reshard_scheduler
    # What the runtime carries over a checkpoint: iteration counters, predictions, re-sharding schedule.
    view = dict(iterations=[getattr(layer, "iteration", None) for layer in runtime.layers.values()],
                predictions=[layer.predictor.predict(0).tolist() for layer in runtime.layers.values()
                             if hasattr(layer, "predictor")],
                schedule=None if scheduler is None else scheduler.state_dict())
    del loss
    gc.collect()
    return dict(losses=losses, norms=norms, frozen_grads=frozen_grads, recomputed=recomputed,
                dense=_dense_params(model), owned=owned, placements=_placements(model), runtime=view,
                # Replay records live as long as their checkpoint's autograd graph: none may outlive backward.
                records_left=sum(len(getattr(layer, "_checkpointed", ())) for layer in runtime.layers.values()),
                # The recomputation fed neither the statistics nor the predictor (one record per forward).
                stats=len(runtime.stats), delta_p=sum(s.delta_p for s in runtime.stats))


def _placements(model) -> dict[str, list[int]]:
    layers = themis_compile.api.runtime_of(model).layers
    return {n: layer.shard_placement.owners().tolist() for n, layer in layers.items()}


def _case(name: str, policy: str, path: str) -> dict:
    options = _options(name)
    saved: dict = {}

    def save(model, opt):
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        scheduler = themis_compile.api.runtime_of(model).reshard_scheduler
        saved.update(placements=_placements(model), moved=0 if scheduler is None else scheduler.moved)

    model, opt = _build(name, policy)
    initial = _placements(model)
    explain = themis_compile.explain(model)
    full = _train(model, opt, policy, 0, save=save)
    del model, opt
    model, opt = _build(name, policy)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    adopted = _placements(model)
    resumed = _train(model, opt, policy, SAVE_AT)
    return dict(full=full, resumed=resumed, initial=initial, adopted=adopted, explain=explain, **saved)


# ---------------------------------------------------------------------------------- deadlines (2 ranks)
# family: (policy, what rank 1 skips, what rank 0's error must say)
DEADLINE_CASES = {
    "mixtral": ("ep", "exchange_counts", "all_to_all (count exchange) of MoE layer 'model.layers.0.mlp'"),
    "qwen3-moe": ("themis-rm", "backward", "all_to_all (token combine, backward) of MoE layer 'model.layers.1.mlp'"),
    "deepseek-v3": ("themis", "_global_tokens",
                    "all_reduce (tokens per expert and router flags) of MoE layer 'model.layers.1.mlp'"),
}


def _deadline_case(name: str):
    """Rank 1 stops participating at the site (it caught an exception and went on); rank 0 must raise."""
    policy, where, _ = DEADLINE_CASES[name]
    rank = dist.get_rank()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=DEADLINE_TIMEOUT_S + 6))
    model = themis_compile.optimize(make_model(MODELS[name]), _config(
        policy, reshard_interval=0, dense_parallel="ddp", collective_timeout_s=DEADLINE_TIMEOUT_S), group=group)
    patched = []
    if rank == 1 and where == "exchange_counts":
        patched.append((exchange, where, getattr(exchange, where)))
    elif rank == 1 and where == "_global_tokens":
        patched.append((FSSDPExperts, where, getattr(FSSDPExperts, where)))
    for owner, attr, _ in patched:
        setattr(owner, attr, _skip)
    tokens = _batches(1, BATCH, SEQ, model.config.vocab_size)[0][rank * 4:(rank + 1) * 4]
    dist.barrier(group)
    start = time.monotonic()
    try:
        loss = model_loss(model, tokens)
        if rank == 1 and where == "backward":
            raise _Skip
        loss.backward()
        return "no error"
    except _Skip:
        return "skipped"
    except CollectiveTimeoutError as exc:
        return {"message": str(exc), "elapsed": time.monotonic() - start, "missing": exc.missing_ranks}
    finally:
        for owner, attr, original in patched:
            setattr(owner, attr, original)
        dist.barrier()          # the default group: the skipping rank waits here, alive


# ---------------------------------------------------------------------------------- the runs
def _run(rank: int, world_size: int, cases: list[tuple[str, str]], root: str, deadlines: list[str]) -> dict:
    out = {case: _case(*case, os.path.join(root, "-".join(case))) for case in cases}
    out["deadlines"] = {name: _deadline_case(name) for name in deadlines}
    return out


@pytest.fixture(scope="module")
def references():
    n = torch.get_num_threads()
    torch.set_num_threads(1)      # tiny tensors: threads only contend on shared CPUs
    try:
        return {name: _reference(name) for name in MODELS}
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("world_size,devices_per_node", [(2, None), (4, 2)])
def test_user_training_loop_matches_one_process(references, tmp_path, world_size, devices_per_node):
    deadlines = list(DEADLINE_CASES) if world_size == 2 else []
    cases = CASES if world_size == 2 else CASES_4
    results = run_multirank(_run, world_size, args=(cases, str(tmp_path), deadlines),
                            devices_per_node=devices_per_node, timeout_s=300)
    for name, policy in cases:
        label = f"{name}/{policy} on {world_size} ranks"
        reference, ref_norms, layers = references[name]
        assert min(ref_norms) > 2 * MAX_NORM, f"{name}: clipping is not active ({ref_norms})"
        per_rank = [r[(name, policy)] for r in results]
        fsdp = policy != "ep"
        for rank, res in enumerate(per_rank):
            full, resumed = res["full"], res["resumed"]
            # Resume is exact: the uninterrupted run's losses, norms, parameters and placement.
            assert resumed["losses"] == full["losses"][SAVE_AT:], label
            assert resumed["norms"] == full["norms"][SAVE_AT:], label
            assert resumed["placements"] == full["placements"], label
            assert resumed["runtime"] == full["runtime"], f"{label}: {resumed['runtime']} vs {full['runtime']}"
            assert resumed["owned"].keys() == full["owned"].keys(), label
            for key, chunk in resumed["owned"].items():
                for a, b in zip(chunk, full["owned"][key], strict=True):
                    assert torch.equal(a, b), f"{label}: expert {key} after resume"
            for n, p in resumed["dense"].items():
                assert torch.equal(p, full["dense"][n]), f"{label}: {n} after resume"
            # The clip norm is one process's, the same on every rank.
            for step, (a, b) in enumerate(zip(full["norms"], ref_norms, strict=True)):
                assert abs(a - b) <= 1e-5 * b, f"{label} rank {rank} step {step}: norm {a}, one process {b}"
            assert full["norms"] == per_rank[0]["full"]["norms"], label
            # Activation checkpointing recomputed every MoE layer once per step, inside backward.
            assert full["recomputed"] == [STEPS] * len(layers), f"{label}: recomputations {full['recomputed']}"
            assert resumed["recomputed"] == [STEPS - SAVE_AT] * len(layers), label
            assert full["frozen_grads"] == resumed["frozen_grads"] == [], f"{label}: frozen expert got .grad"
            assert full["records_left"] == resumed["records_left"] == 0, f"{label}: replay records leaked"
            if fsdp:
                assert full["stats"] == STEPS * len(layers), f"{label}: {full['stats']} statistics records"
                assert full["runtime"]["iterations"] == [STEPS] * len(layers), label
                assert full["delta_p"] > 0, f"{label}: no replica was materialized"
            # Re-sharding moved experts before the save, and the resumed model adopted the saved placement.
            assert res["adopted"] == res["placements"], label
            if fsdp:
                assert res["moved"] > 0 and res["placements"] != res["initial"], f"{label}: no expert moved"
            text = res["explain"]
            assert f"policy {policy}, rank {rank} of {world_size}): {len(layers)} MoE layer(s) sharded" in text, text
            for layer in layers:
                assert f"  {layer}: {policy}, " in text, text
        # Both runs equal one process on the whole global batch.
        for run in ("full", "resumed"):
            got = [(r[run]["losses"] if run == "full" else r["full"]["losses"][:SAVE_AT] + r[run]["losses"],
                    r[run]["dense"], r[run]["owned"], None) for r in per_rank]
            try:
                assert_equivalent(reference, got)
            except AssertionError as exc:
                raise AssertionError(f"{label} ({run}): {exc}") from exc
        # The frozen expert is where it started, on its owner.
        initial = _expert_chunks_reference(make_model(MODELS[name]))
        owner = [res["resumed"]["owned"][(0, FROZEN)] for res in per_rank if (0, FROZEN) in res["resumed"]["owned"]]
        assert len(owner) == 1, label
        for a, b in zip(owner[0], initial[(0, FROZEN)], strict=True):
            assert torch.equal(a, b), f"{label}: the frozen expert moved"
    for name in deadlines:
            expected = DEADLINE_CASES[name][2]
            waiting, skipping = (r["deadlines"][name] for r in results)
            assert skipping == "skipped", (name, skipping)
            assert isinstance(waiting, dict), (name, waiting)
            msg = waiting["message"]
            assert expected in msg and "rank 1 did not participate" in msg, (name, msg)
            assert waiting["missing"] == (1,), (name, msg)
            assert waiting["elapsed"] <= DEADLINE_TIMEOUT_S + SLACK_S, (name, waiting["elapsed"])


# ---------------------------------------------------------------------------------- one process
def test_stacked_weight_with_a_frozen_expert_checkpoints():
    """A stacked weight one of whose experts is frozen has no optimizer state for that expert: its chunk of
    each state tensor is saved as zeros (the trained experts' ``step``), and loading gives it no state back,
    so that the resumed run is the uninterrupted one. (``get_state_dict`` used to refuse such a weight:
    "experts [1] have no optimizer state while experts [0, 2, ...] have".)"""
    def build():
        model = themis_compile.optimize(make_model(MODELS["ref-stacked"]), _config("themis"))
        frozen = [p for n, p in model.named_parameters() if n.startswith(_frozen_prefix("blocks.0.moe"))]
        for p in frozen:
            p.requires_grad_(False)
        return model, torch.optim.AdamW(model.parameters(), lr=LR), frozen

    def train(model, opt, batches):
        losses = []
        for tokens in batches:
            loss = model_loss(model, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    batches = _batches(4, 2, SEQ, 256)
    model, opt, frozen = build()
    train(model, opt, batches[:2])
    model_sd, optim_sd = (copy.deepcopy(sd) for sd in get_state_dict(model, opt, options=FLAT))
    exp_avg = optim_sd["state.blocks.0.moe.experts.w1_EFH.exp_avg"]
    assert exp_avg.shape[0] == 8 and not exp_avg[FROZEN].any() and exp_avg[FROZEN + 1:].any()
    assert torch.equal(optim_sd["state.blocks.0.moe.experts.w1_EFH.step"], torch.tensor(2.0))
    expected = train(model, opt, batches[2:])

    model, opt, frozen = build()
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=FLAT)
    assert frozen and all(p not in opt.state for p in frozen)
    assert train(model, opt, batches[2:]) == expected
