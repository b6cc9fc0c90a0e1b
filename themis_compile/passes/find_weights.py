"""Recognize MoE blocks whose experts are not a module: stacked ``[E, ...]`` parameters of the block's own,
applied inline ("own-weights") or indexed by expert id in a loop ``self.w1[e]`` ("indexed-weights"), entry
e of each of several ``nn.ParameterList`` ("param-lists"), or entry e of two parallel ``ModuleList`` of
``nn.Linear`` ("parallel-lists"). The uses of expert e's weights are recorded on a probe and checked
against every expert; the plans and rewrites live in :mod:`themis_compile.passes.own_weights` and
:mod:`themis_compile.passes.parallel_lists`.

Each function here is one analysis of :data:`themis_compile.passes.detect.ANALYSES`.

Shape suffixes: T tokens, H hidden size, E experts, K top-k.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
from typing import Any

import torch
from torch import nn

from themis_compile.layer_info import MoELayerInfo
from themis_compile.passes.candidates import (
    Reject,
    combine_mismatch,
    non_identical_reason,
    outputs_close,
    recorded_routing,
)
from themis_compile.passes.fx_graph import (
    is_mlp_like,
    record_calls,
    record_meta,
    trace_block,
)
from themis_compile.passes.joined import (
    describe_between,
    free_attribute,
)
from themis_compile.passes.own_weights import (
    OwnWeightsPlan,
    ServedOwnWeightsExperts,
    WeightsRecorder,
    WeightUses,
    apply_own_weights,
    own_stacked_weights,
    own_weights_region,
    region_module,
    replace_region,
    replace_slot_regions,
    routing_reads,
    slot_regions,
    stacked_biases,
)
from themis_compile.passes.parallel_lists import (
    apply_parallel_lists,
    apply_param_lists,
    describe_region,
    indexed_weights_plan,
    parallel_lists_plan,
    param_lists_plan,
)
from themis_compile.passes.probe import (
    PROBE_SEED,
    probe_input,
    run_probe,
)
from themis_compile.passes.replay import (
    captured_rows,
    replay_mismatch,
)

logger = logging.getLogger(__name__)


def _selecting_probe(module: nn.Module, hidden: int) -> tuple[torch.Tensor, Any] | None:
    """(probe, the calls its forward made) when ``module`` runs on a probe of hidden states and selects
    experts there (a top-k, a sort cut to k, a max / argmax); None otherwise."""
    try:
        x = probe_input(module, hidden)
        rec = record_calls(module, x)
    except Exception:  # noqa: BLE001 - not a block run on hidden states
        return None
    return (x, rec) if rec.ks or rec.top1 else None


def own_weights_layer(name: str, module: nn.Module) -> MoELayerInfo | None:
    """The layer of a block (an MoE block or a whole decoder layer) that holds its experts as stacked
    ``[E, ...]`` parameters of its own and applies them inline (:mod:`themis_compile.passes.own_weights`):
    the code applying them, read off its FX graph, moves with them into an experts child called per slot or
    per row (``rewrite == "own-weights"``). None when the block holds no such weights or does not run on
    probe hidden states; raises Reject naming the step that failed when it holds them next to a router
    of their width and selects on a probe.

    The block's 2-D ``[E, X]`` parameters (stacked biases, ``b1 [E, F]``) are read as the experts' with the
    stacked weights, except those the routing reads (an integer tensor, the selected ids, computed from
    them); where no reading takes the block so, it is read again without them (they then stay the block's,
    outside the experts' code), and a rejection names them."""
    found = own_stacked_weights(module)
    if found is None:
        return None
    router_name, E, H, names = found
    if (probed := _selecting_probe(module, H)) is None:
        return None
    x, rec = probed
    routing = routing_reads(module, stacked_biases(module, names), lambda: run_probe(module, x, training=True))
    names = tuple(n for n in names if n not in routing)
    biases = stacked_biases(module, names)
    try:
        return _own_weights_reading(name, module, names, router_name, E, H, x, rec)
    except Reject as exc:
        if not biases:
            raise
        with_biases = exc
    try:
        return _own_weights_reading(name, module, tuple(n for n in names if n not in biases), router_name, E, H, x,
                                    rec)
    except Reject:
        pass
    shapes = " and ".join(f"{n} {list(module._parameters[n].shape)}" for n in biases)
    raise Reject(f"{with_biases}; {shapes}, [E, X] parameters of the block, were read as the experts' biases: a "
                 "stacked bias is served where the code applying the stacked weights reads it indexed by the expert "
                 f"id ({biases[0]}[ids], {biases[0]}[e]) between their first use and the experts' result (read "
                 "without the biases, the block is rejected too)") from None


def _own_weights_reading(name: str, module: nn.Module, names: tuple[str, ...], router_name: str, E: int, H: int,
                         x: torch.Tensor, rec: Any) -> MoELayerInfo:
    """:func:`own_weights_layer` with the stacked parameters ``names``: the layer, or Reject naming the step
    that failed."""
    shapes = ", ".join(f"{n} {list(module._parameters[n].shape)}" for n in names)
    head = (f"its expert weights are stacked parameters of the block itself ({shapes}, {E} experts scored by "
            f"'{router_name}')")
    attr = free_attribute(module)
    forwards, constants, parts, slotted = {}, {}, None, False
    for training in (True, False):
        try:
            traced = trace_block(module, nn.Module(), training=training)
            record_meta(traced, module, x)
        except Exception as exc:  # noqa: BLE001 - FX stops at data-dependent code (int(counts.max()))
            traced_why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            plan, why = _recorded_own_weights_plan(module, names, attr, x, H, E, rec)
            if plan is None:
                found, indexed_why = _indexed_weights_layer(name, module, names, attr, x, H, E, rec, router_name,
                                                            head)
                if found is not None:
                    return found
                raise Reject(f"{head}; step 1 (trace the forward to find the code applying them) failed "
                              f"({traced_why}), {why}, and {indexed_why}") from None
            parts = None
            break
        region, why = own_weights_region(traced, names, H)
        if region is not None:
            nodes, inputs, y, form = region
            ids_shape = traced.meta[inputs[1]].shape
        else:
            # Applied once per slot (a loop over the k slots): one per-row call on every slot's rows.
            slots, slots_why = slot_regions(traced, names, H)
            if slots is None:
                # A loop over the experts guarded by a branch (``if tok.numel() == 0: continue``) traces, but
                # its code is the indexed-weights reading's.
                found, indexed_why = _indexed_weights_layer(name, module, names, attr, x, H, E, rec, router_name,
                                                            head)
                if found is not None:
                    return found
                raise Reject(f"{head}; step 2 (find the code applying them, from the selected ids to one value per "
                              f"token and slot) failed: {why}" + (f"; read once per slot: {slots_why}" if slots_why
                                                                  else "") + f", and {indexed_why}")
            (nodes, inputs, y), form, slotted = slots[0], "per-row", True
            ids_shape = (sum(traced.meta[ins[1]].shape[0] for _, ins, _ in slots),)
        region_gm = region_module(traced, nodes, inputs, y)
        if parts is not None and (region_gm.code != parts[0].code or form != parts[1]):
            raise Reject(f"{head}; step 2 failed: the code applying them differs between train and eval mode")
        parts = parts or (region_gm, form, traced.meta[y].shape, ids_shape)
        gm = (replace_region(traced, nodes, inputs, y, attr) if region is not None
              else replace_slot_regions(traced, slots, attr))
        forwards[training] = type(gm).forward
        for n in gm.graph.nodes:
            owner, _, leaf = n.target.rpartition(".") if n.op == "get_attr" else ("", "", "")
            if n.op == "get_attr" and not hasattr(module.get_submodule(owner), leaf):
                constants[n.target] = getattr(gm, n.target)   # a tensor constant the tracer lifted out
    T = x.shape[:-1].numel()
    if parts is not None:
        region_gm, form, y_shape, ids_shape = parts
        K = int(ids_shape[1]) if form == "per-slot" else max(1, int(ids_shape[0]) // T)
        plan = OwnWeightsPlan(attr=attr, names=names, form=form, region=region_gm, forwards=forwards,
                              constants=constants, out_middle=tuple(y_shape[1:-1]) if form == "per-row" else (),
                              top_k=K, order=tuple(module._parameters))
    K, form = plan.top_k, plan.form
    # Step 3: the block with its weights moved equals the original on the probe, and each expert run alone
    # (as the runtime runs it) equals the moved code.
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    trial = copy.deepcopy(module, shared)
    apply_own_weights(trial, plan)
    for training in (True, False):
        if not outputs_close(run_probe(module, x, training=training), run_probe(trial, x, training=training)):
            raise Reject(f"{head}; step 3 (the code moved into an experts module) failed: the block so rewritten "
                          f"differs from the original on a probe ({'train' if training else 'eval'} mode)")
    experts = plan.experts_of(trial)
    experts.__class__ = ServedOwnWeightsExperts
    g = torch.Generator().manual_seed(PROBE_SEED)
    x_TH = torch.randn(T, H, generator=g).to(x)
    ids_TK = torch.randint(0, E, (T, K), generator=g).to(x.device)
    weights_TK = torch.rand(T, K, generator=g).to(x)
    if (why := combine_mismatch(experts, x_TH, ids_TK, weights_TK, E)) is not None:
        raise Reject(f"{head}; step 3 (each expert alone) failed: {why}")
    call = {"per-slot": "(x [T, H], ids [T, K]) -> [T, K, H]",
            "per-row": "(rows [N, H], ids [N]) -> [N, H]" + (", once per slot (one call on every slot's rows)"
                                                             if slotted and plan.forwards else ""),
            "expert-batched": "(buf [E, C, H]) -> [E, C, H], expert e on buf[e], recorded on a probe"}[form]
    return _recorded_layer(name, module, "own-weights", E, K, router_name, H, x, rec, attr, plan,
                           "slot(s) per token seen at the code applying the stacked weights",
                           f"the block's own code on {', '.join(names)} {call}")


def _recorded_own_weights_plan(module: nn.Module, names: tuple[str, ...], attr: str, x: torch.Tensor, H: int,
                               E: int, rec: Any) -> tuple[OwnWeightsPlan | None, str]:
    """The expert-batched reading of a block FX cannot trace (:class:`~themis_compile.passes.own_weights.
    WeightsRecorder`): (plan, "") or (None, why not)."""
    weights = {n: module._parameters[n] for n in names}
    counter = WeightUses(weights)
    with counter:
        run_probe(module, x, training=True)
    recorder = WeightsRecorder(weights, counter.count)
    with recorder:
        run_probe(module, x, training=True)
    region = recorder.finish()
    if region is None:
        return None, f"step 2 (record the code applying them on a probe) failed: {recorder.reason}"
    xs, ys = recorder.x_shape, recorder.y_shape
    if not (len(xs) == 3 and xs[0] == E and xs[-1] == H and ys == xs):
        return None, (f"step 2 (record the code applying them on a probe) failed: it maps {list(xs)} to {list(ys)}, "
                      f"not a buffer [E={E}, C, {H}] of every expert's rows to one of the same shape")
    return OwnWeightsPlan(attr=attr, names=names, form="expert-batched", region=region, forwards=None, constants={},
                          out_middle=(), top_k=min(E, rec.ks[-1] if rec.ks else max(1, rec.top1)),
                          order=tuple(module._parameters),
                          uses=counter.count,
                          specs=tuple((n, tuple(w.shape), w.dtype) for n, w in weights.items())), ""


def _indexed_weights_layer(name: str, module: nn.Module, names: tuple[str, ...], attr: str, x: torch.Tensor,
                           H: int, E: int, rec: Any, router_name: str, head: str) -> tuple[MoELayerInfo | None, str]:
    """The layer of a block that applies its own stacked weights by expert id in a loop (``self.w1[e]``), read
    as E entries ``w[e]`` of each (:func:`~themis_compile.passes.parallel_lists.indexed_weights_plan`): the
    weights move into one stacked experts module computing the code read on expert e's entries, served by
    capture and replay (``rewrite == "indexed-weights"``). (layer, "") or (None, why not); raises Reject
    when the code is read so but capture and replay cannot serve it."""
    step = "step 2 (read them as E entries w[e], the code applying expert e's, on a probe) failed"
    plans = [indexed_weights_plan(module, names, lambda: run_probe(module, x, training=training), H, attr)
             for training in (True, False)]
    (plan, why), (in_eval, eval_why) = plans
    if plan is None or in_eval is None:
        return None, f"{step} ({'train' if plan is None else 'eval'} mode): {why or eval_why}"
    if in_eval.region.code != plan.region.code or in_eval.uses != plan.uses:
        return None, f"{step}: the code applying them differs between train and eval mode"
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    trial = copy.deepcopy(module, shared)
    apply_param_lists(trial, plan)
    # Experts without tokens may be skipped: a stacked weight has its gradient every step all the same
    # (zero rows for them), as the runtime gives it.
    replay_plan, why = replay_mismatch(trial, attr, x, PROBE_SEED, allow_skipping=True, num_experts=E)
    if why is not None:
        raise Reject(f"{head}; step 3 (serve expert e, the code on w[e], through capture and replay) failed: {why}")
    T = x.shape[:-1].numel()
    K = min(E, max(1, -(-captured_rows(trial, attr, x, PROBE_SEED, num_experts=E) // T)))
    plan = dataclasses.replace(plan, replay=replay_plan)
    return _recorded_layer(name, module, "indexed-weights", E, K, router_name, H, x, rec, attr, plan,
                           "row(s) per token seen at the expert code (behaviour)",
                           f"{describe_region(plan.region)} on {', '.join(f'{n}[e]' for n in names)}"), ""


def _parallel_lists(module: nn.Module) -> tuple[list[tuple[str, nn.Module]], int, tuple[str, nn.Module]] | None:
    """(lists, E, router) of a block whose experts may be spread over parallel ModuleLists of single layers
    (``up[e]``, ``down[e]``): two or more such lists of E >= 2 entries next to a Linear router of E outputs;
    None for any other module."""
    lists = [(attr, child) for attr, child in module.named_children()
             if isinstance(child, nn.ModuleList) and len(child) >= 2 and not is_mlp_like(child[0])
             and all(type(c) is type(child[0]) and any(True for _ in c.parameters()) for c in child)]
    return _lists_and_router(module, lists, 2)


def _lists_and_router(module: nn.Module, lists: list[tuple[str, nn.Module]], least: int
                      ) -> tuple[list[tuple[str, nn.Module]], int, tuple[str, nn.Module]] | None:
    """(lists, E, router) when ``module`` holds at least ``least`` of ``lists``, all of E entries, next to a
    Linear router of E outputs; else None."""
    sizes = {len(child) for _, child in lists}
    if len(lists) < least or len(sizes) != 1:
        return None
    E = sizes.pop()
    router = next(((n, c) for n, c in module.named_children() if isinstance(c, nn.Linear) and c.out_features == E),
                  None)
    return None if router is None else (lists, E, router)


def _param_lists(module: nn.Module) -> tuple[list[tuple[str, nn.Module]], int, tuple[str, nn.Module]] | None:
    """(lists, E, router) of a block whose experts may be bare weights in ParameterLists (``w_in[e]``, applied
    with ``F.linear``): one or more ParameterLists of E >= 2 entries next to a Linear router of E outputs;
    None for any other module."""
    lists = [(attr, child) for attr, child in module.named_children()
             if isinstance(child, nn.ParameterList) and len(child) >= 2]
    return _lists_and_router(module, lists, 1)


def parallel_lists_layer(name: str, module: nn.Module) -> MoELayerInfo | None:
    """The layer of a block whose expert e is entry e of each of two parallel ModuleLists, called
    ``second[e](between(first[e](rows)))`` with row-wise code ``between`` of the block's own
    (:mod:`themis_compile.passes.parallel_lists`): joined into one ModuleList of experts and served by
    capture and replay (``rewrite == "parallel-lists"``). None when the block is not of that shape or its
    calls are not read so (:func:`parallel_expert_lists_reason` then says why it stays data-parallel);
    raises Reject when they are read so but capture and replay cannot serve the joined block."""
    found = _parallel_lists(module)
    if found is None:
        return None
    lists, E, (router_name, router) = found
    if len(lists) != 2 or not all(isinstance(child, nn.ModuleList) for _, child in lists):
        return None
    if (why := non_identical_reason(lists[0][1])) or (why := non_identical_reason(lists[1][1])):
        return None
    H = router.in_features
    try:
        x = probe_input(module, H)
        run_probe(module, x)
    except Exception:  # noqa: BLE001 - not a block run on hidden states
        return None
    attr = free_attribute(module)
    plan, reasons = None, []
    for (first, _), (second, _) in (lists, lists[::-1]):
        plan, why = parallel_lists_plan(module, first, second, lambda: run_probe(module, x, training=True), H, attr)
        if plan is not None:
            break
        reasons.append(why)
    if plan is None:
        return None
    # One expert for both modes: the code between the calls must not depend on the block's training mode.
    in_eval, _ = parallel_lists_plan(module, plan.first, plan.second, lambda: run_probe(module, x, training=False),
                                     H, attr)
    if in_eval is None or in_eval.between.code != plan.between.code:
        return None
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    trial = copy.deepcopy(module, shared)
    apply_parallel_lists(trial, plan)
    replay_plan, why = replay_mismatch(trial, attr, x, PROBE_SEED, allow_skipping=True)
    head = (f"its {E} experts (scored by '{router_name}') are spread over parallel ModuleLists '{plan.first}' and "
            f"'{plan.second}' (expert e: {plan.second}[e] after {plan.first}[e], "
            f"{describe_between(plan.between)} between them)")
    if why is not None:
        raise Reject(f"{head}, and capture and replay cannot serve them joined: {why}")
    T = x.shape[:-1].numel()
    K = min(E, max(1, -(-captured_rows(trial, attr, x, PROBE_SEED) // T)))
    plan = dataclasses.replace(plan, replay=replay_plan)
    return _recorded_layer(name, module, "parallel-lists", E, K, router_name, H, x, record_calls(module, x), attr,
                           plan, "row(s) per token seen at the expert calls (behaviour)",
                           f"{plan.first}[e] -> {describe_between(plan.between)} -> {plan.second}[e]")


def param_lists_layer(name: str, module: nn.Module) -> MoELayerInfo | None:
    """The layer of a block whose expert e is entry e of each of its ParameterLists, applied by the block's
    own code (:mod:`themis_compile.passes.parallel_lists`, ``param_lists_plan``): the entries move into one
    ModuleList of experts computing that code, served by capture and replay (``rewrite == "param-lists"``).
    None when the block holds no such lists or does not select on a probe; raises Reject naming the step
    that failed when it does."""
    found = _param_lists(module)
    if found is None:
        return None
    lists, E, (router_name, router) = found
    H = router.in_features
    if (probed := _selecting_probe(module, H)) is None:
        return None
    x, rec = probed
    names = tuple(attr for attr, _ in lists)
    for attr, child in lists:
        if len({(tuple(p.shape), p.dtype) for p in child}) != 1:
            shapes = ", ".join(f"{e}: {list(p.shape)} {str(p.dtype).removeprefix('torch.')}"
                               for e, p in enumerate(child))
            raise Reject(f"its {E} experts (scored by '{router_name}') are entry e of each of the ParameterLists "
                          f"{', '.join(map(repr, names))}: experts are not identical (entries of '{attr}': {shapes})")
    shapes = ", ".join(f"'{attr}' ({E} x Parameter {list(child[0].shape)})" for attr, child in lists)
    head = f"its {E} experts (scored by '{router_name}') are entry e of each of the ParameterLists {shapes}"
    attr = free_attribute(module)
    plans = [param_lists_plan(module, names, lambda: run_probe(module, x, training=training), H, attr)
             for training in (True, False)]
    (plan, why), (in_eval, eval_why) = plans
    if plan is None or in_eval is None:
        raise Reject(f"{head}; step 1 (read the code applying them, per expert, on a probe) failed "
                      f"({'train' if plan is None else 'eval'} mode): {why or eval_why}")
    # One expert for both modes: the code on the weights must not depend on the block's training mode.
    if in_eval.region.code != plan.region.code or in_eval.uses != plan.uses:
        raise Reject(f"{head}; step 1 failed: the code applying them differs between train and eval mode")
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    trial = copy.deepcopy(module, shared)
    apply_param_lists(trial, plan)
    replay_plan, why = replay_mismatch(trial, attr, x, PROBE_SEED, allow_skipping=True)
    if why is not None:
        raise Reject(f"{head}; step 2 (serve the experts so read through capture and replay) failed: {why}")
    T = x.shape[:-1].numel()
    K = min(E, max(1, -(-captured_rows(trial, attr, x, PROBE_SEED) // T)))
    plan = dataclasses.replace(plan, replay=replay_plan)
    return _recorded_layer(name, module, "param-lists", E, K, router_name, H, x, rec, attr, plan,
                           "row(s) per token seen at the expert code (behaviour)",
                           f"{describe_region(plan.region)} on entry e of {', '.join(names)}")


def _recorded_layer(name: str, module: nn.Module, rewrite: str, E: int, K: int, router_name: str, H: int,
                    x: torch.Tensor, rec: Any, attr: str, plan: Any, seen: str, activation: str) -> MoELayerInfo:
    """The layer record of a rewrite whose router is described from the calls ``rec`` recorded on the
    probe ``x`` (``seen``: where the K slots per token were counted)."""
    scores, selection = recorded_routing(rec)
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=K, experts_form=rewrite,
        router=f"'{router_name}' [E={E}, H={H}]: scores {scores}, selection {selection}, {K} {seen}",
        activation=activation, shared_experts=False, experts_attr=attr, rewrite=rewrite, router_path=router_name,
        score_fn=rec.scores[0] if rec.scores else "none", hidden_size=H, probe_flat=x.dim() == 2, plan=plan)


def parallel_expert_lists_reason(module: nn.Module) -> str | None:
    """Why a block whose experts are spread over parallel ModuleLists of single layers (``up[e]``,
    ``down[e]``: expert e is one entry of each) cannot be sharded; None for any other module. It is when
    two or more such lists of E >= 2 entries sit next to a router of E experts and a forward on a probe
    selects (a top-k, a sort cut to k, a top-1 ``max`` / ``argmax``). The runtime shards, gathers and
    runs whole expert modules; here no module is an expert."""
    found = _parallel_lists(module)
    if found is None:
        return None
    lists, E, router = found
    try:
        rec = record_calls(module, probe_input(module, router[1].in_features))
    except Exception:  # noqa: BLE001 - not a block run on hidden states: not this case
        return None
    if not (rec.ks or rec.top1):
        return None
    names = ", ".join(f"'{attr}' ({E} x {type(child[0]).__name__})" for attr, child in lists)
    return (f"its {E} experts (scored by '{router[0]}') are spread over parallel ModuleLists {names}, expert e "
            "being entry e of each: the runtime shards whole expert modules; hold each expert as one module "
            "(an nn.ModuleList of MLPs called as experts[e](rows)) or as stacked [E, ...] weights called as "
            "experts(x, ids, weights)")
