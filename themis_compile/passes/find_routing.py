"""Recognize an MoE block from its routing code: the FX graph (or, when FX fails, the calls a probe records)
shows a learned router scoring E experts, a top-k selection (or max / argmax for top-1) and the weighted
combine; the experts are called as ``experts(x, ids, weights)`` (style "none") or looped over inline
("inline-loop", or "replay" when the loop cannot be traced). Also the dense-dispatch reading: each
``ModuleList`` expert called once on its capacity slots between ``[T, E, C]`` dispatch and combine
tensors (GShard, fairseq ``Top2Gate``: style "dense-dispatch").

Each ``find_*`` here is one analysis of :data:`themis_compile.passes.detect.ANALYSES`: it returns the layer,
None when it does not see one, or raises :class:`~themis_compile.passes.candidates.Reject`.

Shape suffixes: B batch, S sequence, T tokens, H hidden size, E experts, K top-k, C capacity.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from themis_compile.layer_info import MoELayerInfo
from themis_compile.passes.candidates import (
    NoSelection,
    ProbeFailed,
    Reject,
    auxiliary_losses,
    describe_activation,
    expert_call_path,
    expert_choice_reason,
    expert_hidden_size,
    expert_list,
    experts_call_form,
    experts_children,
    named_activation,
    non_identical_reason,
    router_widths,
    shared_experts_of,
    wrapped_experts_children,
)
from themis_compile.passes.fx_graph import (
    TensorMeta,
    TracedBlock,
    ancestors,
    combine_node,
    descendants,
    describe_selection,
    effective_users,
    expert_index,
    expert_nodes,
    is_inplace,
    is_topk,
    output_node,
    reach_by_expert,
    reachable,
    record_calls,
    record_meta,
    router_of,
    score_kind,
    selection_k,
    selection_outputs,
    selections_of,
    trace_block,
    trace_block_with_method_leaves,
    variable_selection_reason,
)
from themis_compile.passes.probe import (
    PROBE_SEED,
    probe_input,
    run_probe,
)
from themis_compile.passes.replay import (
    replay_mismatch,
)

logger = logging.getLogger(__name__)


def find_by_routing(name: str, module: nn.Module) -> MoELayerInfo | None:
    """The layer found from its routing code: a top-k over a learned router's scores (FX graph, or the
    calls recorded on a probe when FX fails), the experts called as experts(x, ids, weights) or looped
    over inline."""
    # Step 1: an experts-like child, preferably the one a router of its width scores.
    children = experts_children(module)
    if not children:
        return None
    routers_all = {c.attr: router_widths(module, c.module) for c in children}
    child = next((c for c in children if any(w == c.num_experts for _, w, _ in routers_all[c.attr])), children[0])
    routers, E = routers_all[child.attr], child.num_experts
    H = expert_hidden_size(child, routers)

    # Step 2: trace (FX first; when FX fails, record the calls on a probe).
    traced, fx_error = None, None
    try:
        traced = trace_block(module, child.module)
    except Exception as exc:
        fx_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    if traced is not None and traced.branch_nodes and not expert_nodes(traced.gm.graph, child.attr):
        # Every expert call sits under a branch on a traced value (`if mask.any():`), which the trace
        # took as False: the graph holds no expert call to rewrite. Read the layer as untraceable.
        traced, fx_error = None, "the expert calls are guarded by branches on traced values"
    topks = selections_of(traced.gm.graph) if traced else []   # top-k, else top-1 (max / argmax)
    if not topks and not any(w == E for _, w, _ in routers):
        return None   # not MoE-like: no top-k and no router of the experts' width

    # Step 3: checks, cheapest first.
    if child.form == "modulelist" and (why := non_identical_reason(child.module)):
        raise Reject(why)
    if H is None:
        raise Reject(f"no router weight [E, H] next to its {E} experts and no Linear to tell the hidden size; "
                      "give the block its router as an nn.Linear(H, E) or a weight [E, H]")
    router = None
    if traced is not None:
        if not topks and (why := variable_selection_reason(traced.gm, E)) is not None:
            raise Reject(why)
        if not topks:
            raise NoSelection("no top-k selection (torch.topk, or max / argmax for top-1) in the traced forward of the "
                          "block or its router, and its experts are not called once as experts(x, ids, weights); "
                          "select with topk, max or argmax, or "
                          "call the experts that way (integer ids [T, K], weights [T, K])")
        router = router_of(traced.gm, topks[-1])
        if router is None:
            raise Reject("the top-k does not select over scores of a learned router (no Linear or weight [E, H] "
                          "before it)")
        if router[1] != E:
            raise Reject(f"router '{router[0]}' scores {router[1]} experts but '{child.attr}' holds {E}")
        k = selection_k(topks[-1], {})
        if isinstance(k, int) and not 1 <= k <= E:
            # An MoE layer with a broken top-k: reported as found so that sharding it fails loudly,
            # naming the layer (check_layer), rather than leaving it silently unsharded.
            return MoELayerInfo(
                name=name, module=module, num_experts=E, top_k=k, experts_form=child.form,
                router=f"'{router[0]}' [E={router[1]}, H={router[2]}]: top-{k} (FX graph)",
                activation=named_activation(child.module[0] if child.form == "modulelist" else child.module)
                or "unknown", shared_experts=False, experts_attr=child.attr, router_path=router[0], hidden_size=H)
    x, errors = None, []
    for flat in (False, True):
        try:
            x = probe_input(module, H, flat=flat)
            run_probe(module, x)
            break
        except Exception as exc:
            errors.append(f"{list(x.shape)}: {type(exc).__name__}: {exc}".splitlines()[0][:200])
            x = None
    if x is None:
        raise ProbeFailed(f"the forward fails on probe hidden states ({'; '.join(errors)}); detection runs a "
                      "block on hidden states alone: keep the MoE in a module called as moe(hidden_states)")

    if traced is not None:
        try:
            record_meta(traced, module, x)
        except Exception as exc:
            raise Reject(f"the traced forward does not run on a probe: {exc}")
        topk = topks[-1]
        top_k = selection_k(topk, traced.meta)
        scores_meta = traced.meta.get(topk.args[0]) if is_topk(topk) and topk.args else None
        dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
        if isinstance(scores_meta, TensorMeta) and isinstance(dim, int) and scores_meta.shape and (
                why := expert_choice_reason(scores_meta.shape, dim % len(scores_meta.shape), E,
                                            x.numel() // x.shape[-1])):
            raise Reject(why)
        router_path, width, H_router = router
        values, indices = selection_outputs(topk)
        before = {score_kind(n) for n in ancestors(topk)} - {None}
        after = {score_kind(n) for n in descendants(values)} - {None}
        succ = effective_users(traced.gm.graph)
        if not any(n.op == "output" for n in reachable(values + indices, lambda n: succ[n])):
            raise Reject("the top-k weights and ids never reach the output (no weighted combine); the output must "
                          "combine the selected experts' outputs with the top-k weights")
    else:
        rec = record_calls(module, x)
        ks, scores = rec.ks or [1] * rec.top1, rec.scores    # no top-k: each max / argmax selects one expert
        if not ks and (uncut := [kind for kind in rec.uncut_sorts if kind]):
            raise Reject(f"a {uncut[0]} ran on a probe but its output was never cut to a fixed k ([..., :k]) and no "
                          f"topk, max or argmax ran (FX tracing failed: {fx_error}): the number of experts per "
                          "token is not fixed (top-p / threshold routing?); FSSDP routes every token to exactly k "
                          "experts: select them with torch.topk or a sort cut to k")
        if not ks:
            raise NoSelection(f"no top-k selection: FX tracing failed ({fx_error}) and no topk, max or argmax ran on a "
                          "probe; select with torch.topk (max / argmax for top-1), or call the experts once as "
                          "experts(x, ids, weights)")
        top_k = ks[-1]
        if rec.topk_inputs and rec.selections[-1].startswith("topk(") and (
                why := expert_choice_reason(*rec.topk_inputs[-1], E, x.numel() // x.shape[-1])):
            raise Reject(why)
        router_path, width, H_router = next((r for r in routers if r[1] == E), None) or (None, None, H)
        if router_path is None:
            widths = sorted({w for _, w, _ in routers})
            raise Reject(f"no router scores its {E} experts (Linear/weight widths {widths}); FX tracing failed "
                          f"({fx_error})")
        before, after = set(scores[:1]), set(scores[1:])
    if top_k is None or not 1 <= top_k <= E:
        raise Reject(f"top-k of {top_k} is not in [1, {E}]")

    # Step 4: how the experts are called.
    form, detail = experts_call_form(module, child.attr, x, top_k)
    if form == "unsupported":
        raise Reject(detail)
    replay_plan = None
    if form == "inline-loop" and traced is None:
        # Not traceable: the loop stays as written, served by capture and replay (passes.replay).
        # Skipping experts without tokens is allowed: the runtime then leaves their gradients None
        # (skips_empty_experts reads the plan).
        replay_plan, why = replay_mismatch(module, child.attr, x, PROBE_SEED, allow_skipping=True)
        if why is not None:
            raise Reject(f"its forward loops over the experts inline and cannot be traced to rewrite it ({fx_error}); "
                          f"capture and replay cannot serve it either: {why}")
        form = "replay"

    # Step 5: description.
    score = sorted(before)[0] if before else (sorted(after)[0] if after else "none")
    order = f"{score} -> top-{top_k}" if before else f"top-{top_k} -> {score}" if after else f"top-{top_k}"
    if traced is not None:
        by = describe_selection(topk)
    else:    # the selection whose k is the layer's: the last top-k or sort cut recorded
        by = next((sel for sel in reversed(rec.selections) if sel.startswith(("topk(", "sort[", "argsort["))), "")
        by = by if "sort[" in by else ""
    if by:
        order += f" by {by}"
    how = "FX graph" if traced is not None else "recorded on a probe (FX failed)"
    router_text = f"'{router_path}' [E={width}, H={H_router}]: {order} ({how})"
    expert0 = child.module[0] if child.form == "modulelist" else child.module
    combined: list[fx.Node] = []
    if traced is not None:
        combined = [n for n in traced.gm.graph.nodes if n.op == "call_module" and n.target == child.attr]
        if not combined:
            y = combine_node(traced, child.attr)
            combined = [y] if y is not None else []
    shared = shared_experts_of(traced, module, combined, child.attr) if traced is not None else ()
    aux = auxiliary_losses(traced, combined) if traced is not None else ()
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=int(top_k), experts_form=child.form, router=router_text,
        activation=describe_activation(expert0), shared_experts=bool(shared), experts_attr=child.attr,
        rewrite=form, router_path=router_path, score_fn=score, hidden_size=H, shared_expert_names=shared,
        aux_losses=aux, probe_flat=x.dim() == 2, plan=replay_plan,
    )


# --- Dense dispatch tensors (GShard, fairseq Top2Gate) -----------------------------------------------

@dataclass(frozen=True)
class DenseDispatch:
    """Where a dense-dispatch block's parts are in its traced graph: hidden states ``x [T, H]`` dispatched
    into per-expert capacity slots, the combine weights ``[T, E, C]``, the combined output ``y [T, H]``."""

    x: fx.Node
    combine: fx.Node
    y: fx.Node


def _reach_avoiding(starts: list[fx.Node], succ: dict[fx.Node, list[fx.Node]], avoid: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [s for s in starts if s not in avoid]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(u for u in succ[n] if u not in avoid and u not in seen)
    return seen


def dense_dispatch_of(traced: TracedBlock, attr: str, num_experts: int) -> DenseDispatch | None:
    """The dense dispatch of a traced block (needs ``traced.meta``), or None when it has none.

    Every expert is called once (on its capacity slots); ``y`` is the first ``[T, H]`` value all their
    outputs flow through on the way to the output; ``combine`` the nearest ``[T, E, C]`` floating value
    that reaches ``y`` other than through the experts; ``x`` the last ``[T, H]`` floating value that feeds
    every expert and is not computed from ``combine``."""
    graph, meta = traced.gm.graph, traced.meta
    calls = expert_nodes(graph, attr)
    ids = [expert_index(c, attr) for c in calls]
    if (not calls or any(c.op != "call_module" for c in calls) or len(set(ids)) != len(ids)
            or len(ids) != num_experts):
        return None
    succ = effective_users(graph)
    out = output_node(graph)
    reach = reach_by_expert(calls, attr, succ)
    common = set.intersection(*reach.values())
    after_calls = reachable(calls, lambda n: succ[n])

    def floating(n: fx.Node, dims: int) -> TensorMeta | None:
        m = meta.get(n)
        return m if isinstance(m, TensorMeta) and len(m.shape) == dims and m.dtype.is_floating_point else None

    y = next((n for n in graph.nodes if n in common and n not in calls and n is not out and floating(n, 2)
              and not is_inplace(n) and out not in _reach_avoiding(calls, succ, {n})), None)
    if y is None:
        return None
    T, H = meta[y].shape
    combine = [n for n in graph.nodes if n not in after_calls and (m := floating(n, 3)) is not None
               and m.shape[:2] == (T, num_experts) and y in _reach_avoiding([n], succ, set(calls))]
    if not combine:
        return None
    after_combine = reachable([combine[-1]], lambda n: succ[n])
    feeds = [reachable([c], lambda n: n.all_input_nodes) for c in calls]
    xs = [n for n in graph.nodes if n not in after_calls and n not in after_combine
          and (m := floating(n, 2)) is not None and m.shape == (T, H) and all(n in f for f in feeds)]
    return DenseDispatch(x=xs[-1], combine=combine[-1], y=y) if xs else None


def find_dense_dispatch(name: str, module: nn.Module) -> MoELayerInfo | None:
    """A block that dispatches tokens to its ``ModuleList`` experts through dense ``[T, E, C]`` tensors
    (GShard / fairseq ``Top2Gate``: one-hot dispatch mask, experts on ``[E, C, H]`` capacity slots,
    combine ``einsum("sec,ecm->sm", combine, expert_outputs)``), or None when it is not one.

    K is the number of selections its routing makes on a probe (a top-k's k, else one per max / argmax).
    :mod:`themis_compile.passes.shard` rewrites dispatch, experts and combine into one
    ``experts(x, ids, weights)`` call with (ids, weights) read from the combine tensor."""
    children = [c for c in experts_children(module) if c.form == "modulelist"] + wrapped_experts_children(module)
    if not children or non_identical_reason(expert_list(module, children[0].attr)):
        return None
    child = children[0]
    routers = router_widths(module, child.module)
    E, H = child.num_experts, expert_hidden_size(child, routers)
    if H is None:
        return None
    try:
        traced = trace_block_with_method_leaves(module, expert_list(module, child.attr))
    except Exception:
        return None
    for flat in (False, True):
        x = probe_input(module, H, flat=flat)
        try:
            record_meta(traced, module, x)
            break
        except Exception:
            x = None
    if x is None or (found := dense_dispatch_of(traced, expert_call_path(module, child.attr), E)) is None:
        return None
    # From here on the block is a dense-dispatch block: what stops it is said.
    if traced.branch_nodes:
        raise Reject("it dispatches through dense [T, E, C] tensors but its forward branches on a traced value; "
                      "a rewritten forward cannot keep that branch (move it into a method of the block)")
    rec = record_calls(module, x)
    K = rec.ks[-1] if rec.ks else rec.top1
    if not 1 <= K <= E:
        raise Reject(f"it dispatches through dense [T, E, C] tensors but makes {K} selections (topk, max or "
                      f"argmax) on a probe, not 1 to {E}: the number of experts a token is sent to is unknown")
    router_path, width, H_router = next((r for r in routers if r[1] == E), (None, E, H))
    scores = "+".join(dict.fromkeys(rec.scores)) or "none"
    selection = ", ".join(rec.selections) or "none"
    C = traced.meta[found.combine].shape[-1]
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=K, experts_form=child.form,
        router=(f"'{router_path}' [E={width}, H={H_router}]: scores {scores}, selection {selection}; top-{K} read "
                f"from the combine tensor [T, E, C={C}] (FX graph, methods kept)"),
        activation=describe_activation(expert_list(module, child.attr)[0]), shared_experts=False,
        experts_attr=child.attr,
        rewrite="dense-dispatch", router_path=router_path or "", score_fn=rec.scores[0] if rec.scores else "none",
        hidden_size=H, aux_losses=auxiliary_losses(traced, [found.y]), probe_flat=flat)
