"""The rewrites' machinery: what makes a detected MoE layer call its experts through the one interface the
runtime swaps. Which rewrite a layer gets is its style's (:data:`themis_compile.passes.styles.STYLES`,
which also runs the pass: ``prepare_moe_layers``).

The FSSDP runtime (paper §3.1, Fig. 5) replaces a layer's experts with a module holding only this rank's
experts and computing ``experts(x_TH, ids_TK, weights_TK) -> out_TH``. Blocks that already call their
experts that way (HF transformers >= 5, torchtitan-like blocks, both forms of the reference model) need
nothing. Blocks that loop over an ``nn.ModuleList`` of experts inline in their forward (old HF style) get
a generated forward: the user's routing code is kept node for node and the expert loop plus the weighted
combine become one call ``self.experts(x, ids, weights)``, where ``self.experts`` is an
:class:`ExpertLoop` over the same expert modules (the same loop, numerically; same parameter names).

Blocks that dispatch through dense ``[T, E, C]`` tensors (GShard, fairseq ``Top2Gate``) get a generated
forward too (:func:`replace_dense_dispatch`): dispatch, the experts on their capacity slots and the
combine become one ``self.experts(x, ids, weights)`` with (ids, weights) read from the combine tensor.

Blocks whose experts module is called per slot (``experts(x, ids) -> [T, K, H]``, gpt-fast), on rows
sorted by expert (``experts(rows, counts)``, torchtitan), with a one-hot dispatch mask (HF Switch), on
unflattened hidden states (DBRX), on every row with the routing folded into the input
(``experts(x [E*T, H])``, Llama 4) or with the router's dense scores besides the top-k (DBRX before v5)
keep their forward: while it runs, the experts attribute is seen as an adapter (:class:`PerSlotCall`,
:class:`SortedRowsCall`, :class:`DispatchMaskCall`, :class:`FlattenCall`, :class:`AllRowsCall`,
:class:`ScoresCall`) serving that call with one ``experts(x, ids, weights)`` call, and the experts
module's class gets that interface. Blocks whose experts stack Z zero (identity) experts after the E real
ones (LongCat-Flash, ids in ``[0, E + Z)``) keep their forward with the experts seen as
:class:`ZeroExpertsCall`: the ids ``< E`` go to the experts, the others add ``weight * x`` in the block.

Blocks whose forward calls ``experts[i](rows)`` in code FX cannot trace keep their forward too; it runs
twice around one ``experts(x, ids, weights)`` call (capture and replay, :mod:`themis_compile.passes.replay`).

Contract:
    A rewrite changes only the layer's class (a subclass of the user's whose forward is the rewritten
    graph, traced once per train/eval mode, or its own forward with the experts attribute seen through
    an adapter) and its experts attribute (an ``ExpertLoop`` holding the very same expert modules, or
    the experts module's class given the interface): parameters, buffers, state-dict keys and the
    routing computation are unchanged. :func:`verify_rewrite` (and :func:`verify_rewrite_gradients`)
    compare a rewritten copy with the original on a probe.

Pseudo-code of the graph rewrite (``replace_expert_loop``):
    C = calls into the experts                                  # Step 1
    Y = nearest node all of C's outputs flow through (in-place updates followed as versions)
    x, ids, weights = last [T, H] input, [T, K] top-k ids and [T, K] weights feeding every expert
    out = self.experts(x, ids, weights); uses of Y after it read out   # Step 2
    erase every node that only served Y                         # Step 3

Shape suffixes: T tokens, H hidden size, E experts, K top-k.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from themis_compile.layer_info import MoELayerInfo
from themis_compile.passes.candidates import expert_call_path, expert_list
from themis_compile.passes.find_behaviour import (AllRowsPlan, ScoresCallPlan, all_rows_experts_class,
                                                  flat_call_experts_class, mask_call_experts_class, mask_slots,
                                                  scores_call_experts_class, serve_all_rows)
from themis_compile.passes.find_routing import dense_dispatch_of
from themis_compile.passes.fx_graph import (
    TensorMeta,
    TracedBlock,
    combine_node,
    combine_nodes,
    effective_users,
    expert_nodes,
    is_inplace,
    is_topk,
    reach_by_expert,
    reachable,
    record_meta,
    selection_outputs,
    selection_tokens,
    selections_of,
    trace_block,
    trace_block_with_method_leaves,
)
from themis_compile.passes.probe import PROBE_SEED, preserved_state, probe_input, run_probe
from themis_compile.passes.replay import output_tensors
from themis_compile.runtime.experts import loop_combine, with_zero_rows_gradient, wrapped_expert_list

logger = logging.getLogger(__name__)

SELF_PLACEHOLDER = "_themis_self"


class ExpertLoop(nn.ModuleList):
    """The experts of a rewritten layer: the user's expert modules (same names ``0 .. E-1``) called as
    ``experts(x_TH, ids_TK, weights_TK) -> out_TH``. Still a ModuleList, so the runtime's ExpertBank
    reads it as per-expert modules and can replace it with sharded experts."""

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return loop_combine(self, x_TH, ids_TK, weights_TK)


def wrapped_loop_class(wrapper_cls: type) -> type:
    """A subclass of a class that wraps its experts' ModuleList (Megatron-Core ``SequentialMLP``,
    DeepSpeed ``Experts``) called as ``experts(x_TH, ids_TK, weights_TK) -> out_TH``: the loop of
    :class:`ExpertLoop` over the list it holds, the list and its parameter names unchanged."""

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return loop_combine(wrapped_expert_list(self)[1], x_TH, ids_TK, weights_TK)

    forward.__doc__ = f"sum_k weights * {wrapper_cls.__name__}'s expert ids[t, k] on x[t]."
    return type(wrapper_cls.__name__, (wrapper_cls,), {"forward": forward, "__module__": wrapper_cls.__module__,
                                                       "_themis_original_class": wrapper_cls})


def _store_attribute(owner: nn.Module, path: str, name: str, value: Any) -> None:
    """What ``self.<path>.<name> = value`` in the user's forward did (e.g. an auxiliary loss)."""
    setattr(owner.get_submodule(path) if path else owner, name, value)


# --- Step 1: the expert computation in the graph ------------------------------------------------------

def _base(node: fx.Node) -> fx.Node:
    while is_inplace(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _remove_dead_branches(graph: fx.Graph, branch_nodes: list[fx.Node]) -> list[set[fx.Node]]:
    """Erase the dead conditions the tracer evaluated (taken as False); return their inputs' ancestry."""
    ancestries = []
    for b in branch_nodes:
        ancestries.append(reachable([b], lambda n: n.all_input_nodes) - {b})
        todo = [b]
        while todo:
            n = todo.pop()
            if n.users or n.op not in ("call_function", "call_method", "get_attr") or is_inplace(n):
                continue
            inputs = n.all_input_nodes
            graph.erase_node(n)
            todo.extend(inputs)
    return ancestries


class RewriteError(ValueError):
    pass


_UNWEIGHTED = object()   # the loop combines its experts' outputs unweighted (see _slots_of)


def _slots_of(graph: fx.Graph, meta: dict, x: fx.Node, ids: fx.Node, weights: Any, slots: tuple[int, ...]
              ) -> tuple[fx.Node, fx.Node]:
    """(ids, weights) shaped ``slots`` (tokens + (K,)) for the experts call, inserted at the graph's
    insertion point. A top-1 selection's ``[T]`` ids / values get their slot dimension back; a loop
    whose experts' outputs are combined unweighted (Switch: the router probability multiplies the
    combined output after the loop, as written, or no weight at all) is served with weights 1."""
    if meta[ids].shape != slots:
        ids = graph.call_method("unsqueeze", (ids, -1))
    if weights is _UNWEIGHTED:
        return ids, graph.call_method("new_ones", (x, graph.call_method("size", (ids,))))
    if meta[weights].shape != slots:
        weights = graph.call_method("unsqueeze", (weights, -1))
    return ids, weights


def _per_expert_weights(graph: fx.Graph, meta: dict, ids: fx.Node, weights_TE: fx.Node | None) -> fx.Node | None:
    """The selected experts' weights [T, K] of a loop that weighs expert e's rows by column e of a dense
    ``[T, E]`` weight (zero where not selected, e.g. ``probs * mask`` with the mask scattered from the
    selected ids): ``weights_TE.gather(-1, ids)``, inserted right after the later of the two. None when
    there is no such tensor. The probe check of the rewrite holds it to the loop's own combine."""
    if weights_TE is None:
        return None
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_after(max(ids, weights_TE, key=order.__getitem__)):
        gathered = graph.call_method("gather", (weights_TE, -1, ids))
    meta[gathered] = TensorMeta(meta[ids].shape, meta[weights_TE].dtype)
    return gathered


def masked_weight_slots(weights_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_TK, weights_TK) of per-expert weights ``[T, E]`` that are zero outside each token's selected
    experts (a loop over ``where(mask[:, e])`` with ``mask = probs >= probs.topk(k).values[..., -1:]``):
    the experts with a weight first (in expert order), then others with weight 0, cut to k. A token
    with more than k weighted experts (scores tied at the threshold: the user's block runs them all)
    fails here (``torch._assert_async``) instead of being cut to k."""
    selected_TE = weights_TE != 0
    torch._assert_async(selected_TE.sum(dim=-1).max() <= k,
                        "a token is weighted by more experts than the block's top-k (scores tied at the threshold)")
    ids_TK = torch.argsort((~selected_TE).to(torch.int8), dim=-1, stable=True)[:, :k]
    return ids_TK, weights_TE.gather(1, ids_TK)


def _masked_weight_slots(graph: fx.Graph, meta: dict, weights_TE: fx.Node, k: int) -> tuple[fx.Node, fx.Node]:
    """:func:`masked_weight_slots` of ``weights_TE`` in the graph, right after it: (ids, weights) nodes."""
    with graph.inserting_after(weights_TE):
        slots = graph.call_function(masked_weight_slots, (weights_TE, k))
    with graph.inserting_after(slots):
        ids = graph.call_function(operator.getitem, (slots, 0))
    with graph.inserting_after(ids):
        weights = graph.call_function(operator.getitem, (slots, 1))
    T = meta[weights_TE].shape[0]
    meta[ids], meta[weights] = TensorMeta((T, k), torch.int64), TensorMeta((T, k), meta[weights_TE].dtype)
    return ids, weights


def _meta_of(meta: dict, n: fx.Node) -> Any:
    """The probe's record of ``n``, or of the tensor it updated in place."""
    return meta.get(_base(n)) if meta.get(n) is None else meta.get(n)


def _shape_of(meta: dict, n: fx.Node) -> tuple | None:
    m = _meta_of(meta, n)
    return tuple(m.shape) if isinstance(m, TensorMeta) else None


def replace_expert_loop(traced: TracedBlock, info: MoELayerInfo) -> fx.GraphModule:
    """Replace the inline expert loop + weighted combine of a traced block with one
    ``self.<experts_attr>(x, ids, weights)`` call; needs ``traced.meta`` (shapes from a probe)."""
    gm, meta, attr, layer = traced.gm, traced.meta, info.experts_attr, info.name
    graph = gm.graph
    branch_ancestries = _remove_dead_branches(graph, traced.branch_nodes)

    # Step 1: the expert calls C, the combined value Y, and the inputs x, ids, weights feeding every expert.
    calls = expert_nodes(graph, attr)
    y = combine_node(traced, attr)
    if y is None:
        raise RewriteError(f"MoE layer {layer!r}: the experts' outputs do not merge into one combined value")
    succ = effective_users(graph)
    pred: dict[fx.Node, list[fx.Node]] = {n: [] for n in graph.nodes}
    for n, us in succ.items():
        for u in us:
            pred[u].append(n)
    after_calls = reachable(calls, lambda n: succ[n])
    before_y = reachable([y], lambda n: pred[n])
    before_calls = reachable(calls, lambda n: pred[n])
    # Nodes only one expert's output reaches: a weights/ids/x candidate must feed all of them.
    times_reached: dict[fx.Node, int] = {}
    reach = reach_by_expert(calls, attr, succ)
    for nodes in reach.values():
        for n in nodes:
            times_reached[n] = times_reached.get(n, 0) + 1
    private = [{n for n in nodes if times_reached[n] == 1} for nodes in reach.values()]

    def feeds_every_expert(n: fx.Node) -> bool:
        downstream = reachable([n], lambda m: succ[m])
        return all(downstream & p for p in private)

    pos = {n: i for i, n in enumerate(graph.nodes)}

    def last(cands: list[fx.Node]) -> fx.Node | None:
        for n in sorted(cands, key=pos.__getitem__, reverse=True):
            if feeds_every_expert(n):
                return n
        return None

    topks = [t for t in selections_of(graph) if set(selection_outputs(t)[1]) & before_y]
    # A loop fed by a mask from the top-k's values alone (probs >= topk.values[..., -1:]): ids from weights.
    topks = topks or [t for t in selections_of(graph) if set(selection_outputs(t)[0]) & before_y]
    if not topks:
        raise RewriteError(f"MoE layer {layer!r}: no top-k ids feed the expert loop")
    topk = topks[-1]
    (tok, K), H = selection_tokens(topk, meta), info.hidden_size
    if _shape_of(meta, y) not in (tok + (H,), (math.prod(tok), H)):
        # The experts' outputs meet as rows first (concatenated in expert order, weighted per row: a
        # dispatcher's "stitch"), then are combined into [T, H]: Y is the first such value they all reach.
        combined = (tok + (H,), (math.prod(tok), H))
        y = next((n for n in combine_nodes(traced, attr) if _shape_of(meta, n) in combined), y)
        before_y = reachable([y], lambda n: pred[n])
    after_topk = reachable([topk], lambda n: succ[n])
    after_ids = reachable(selection_outputs(topk)[1], lambda n: succ[n])

    def tensor(n: fx.Node, shape: tuple, floating: bool) -> bool:
        m = meta.get(n)
        return (isinstance(m, TensorMeta) and m.shape == shape and m.dtype.is_floating_point == floating
                and m.dtype != torch.bool)

    region_in = [n for n in before_y if n not in after_calls]
    # A top-1 selection's ids and values may keep the token shape alone ([T], not [T, 1]).
    slot_shapes = (tok + (K,),) + ((tok,) if not is_topk(topk) else ())
    ids = last([n for n in region_in if n in after_ids and any(tensor(n, s, False) for s in slot_shapes)])
    weights = last([n for n in region_in if n in after_topk and any(tensor(n, s, True) for s in slot_shapes)])
    weights_TE = last([n for n in region_in if n in after_topk and tensor(n, tok + (info.num_experts,), True)])
    if weights is None and ids is not None and meta[ids].shape == tok + (K,):
        weights = _per_expert_weights(graph, meta, ids, weights_TE)
    elif ids is None and weights_TE is not None and len(tok) == 1:   # (a [T, K] value here fed the mask)
        ids, weights = _masked_weight_slots(graph, meta, weights_TE, K)
    if weights is None and not set(selection_outputs(topk)[0]) & before_y:
        weights = _UNWEIGHTED   # no selected weight reaches the combine (applied after it, or none): ones
    x = last([n for n in before_calls if n not in after_calls and n not in after_topk
              and tensor(n, tok + (H,), True)])
    for what, node in (("hidden states [T, H]", x), ("top-k ids [T, K]", ids), ("top-k weights [T, K]", weights)):
        if node is None:
            raise RewriteError(f"MoE layer {layer!r}: cannot find the {what} that feed every expert")

    # Step 2: one experts call in place of Y; later reads of Y (or of the tensor it updated) read it.
    y_meta = _meta_of(meta, y)
    if not isinstance(y_meta, TensorMeta) or y_meta.shape not in (tok + (H,), (math.prod(tok), H)):
        raise RewriteError(f"MoE layer {layer!r}: the combined value has shape {getattr(y_meta, 'shape', None)}, "
                           f"not {tok + (H,)}")
    with graph.inserting_before(y):
        ids, weights = _slots_of(graph, meta, x, ids, weights, tok + (K,))
        args = (x, ids, weights)
        if len(tok) != 1:
            args = (graph.call_method("reshape", (x, -1, H)), graph.call_method("reshape", (ids, -1, K)),
                    graph.call_method("reshape", (weights, -1, K)))
        out = graph.call_module(attr, args)
        if len(tok) != 1 and y_meta.shape == tok + (H,):
            out = graph.call_method("view_as", (out, x))
        if y_meta.dtype != meta[x].dtype:
            out = graph.call_method("to", (out, y_meta.dtype))
    aliases = {n for n in graph.nodes if _base(n) is _base(y)} | {y}
    for u in list(graph.nodes)[list(graph.nodes).index(y) + 1:]:
        for a in aliases & set(u.all_input_nodes):
            u.replace_input_with(a, out)

    # Step 3: erase what only served Y: the loop, its masks, the accumulator.
    succ = effective_users(graph)
    keep = {out, x, ids, weights} | set(out.all_input_nodes)
    region: set[fx.Node] = set()
    for n in reversed(graph.nodes):
        if n in keep or n.op in ("placeholder", "output"):
            continue
        if n in aliases or (succ[n] and all(u in region for u in succ[n])):
            region.add(n)
    if not set(calls) <= region:
        used = sorted(c.name for c in calls if c not in region)
        raise RewriteError(f"MoE layer {layer!r}: expert outputs ({', '.join(used)}) are used besides the combine")
    for ancestry in branch_ancestries:
        if ancestry and not ancestry & region:
            raise RewriteError(f"MoE layer {layer!r}: the forward branches on a traced value outside the expert "
                               "loop; a generated forward cannot keep that branch")
    stored = {key: node for key, node in traced.attr_stores.items()}
    for (path, name), node in stored.items():
        if node in region:
            raise RewriteError(f"MoE layer {layer!r}: the forward stores {name!r} computed inside the expert loop")
    for n in reversed(graph.nodes):
        if n in region:
            if any(u not in region for u in n.users):
                raise RewriteError(f"MoE layer {layer!r}: {n.name} of the expert loop is still used")
            graph.erase_node(n)

    # The generated forward takes the block as an explicit first input to replay attribute stores.
    first = next(iter(graph.nodes))
    with graph.inserting_before(first):
        owner = graph.placeholder(SELF_PLACEHOLDER)
    for (path, name), node in stored.items():
        with graph.inserting_after(node):
            graph.call_function(_store_attribute, (owner, path, name, node))
    graph.lint()
    gm.recompile()
    return gm


# --- Dense dispatch tensors (GShard): dispatch, experts and combine become one experts call -----------

def dense_dispatch_slots(combine_TEC: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_TK, weights_TK) that combine like a GShard combine tensor ``combine_TEC`` (token t's weight
    for expert e's capacity slot c; zero where t is not in that slot).

    A slot holds one token, so ``sum_{e,c} combine[t, e, c] * expert_e(slot_{e,c})`` is
    ``sum_e w[t, e] * expert_e(x[t])`` with ``w = combine.sum(-1)``: the experts token t has a weight for
    come first (in expert order), then any others with weight 0, cut to k. A token capacity dropped has
    weight 0 in that slot and adds nothing, as in the block's own combine. More than k experts with a
    weight for one token would be cut: that fails here (``torch._assert_async``) instead."""
    w_TE = combine_TEC.sum(dim=-1)
    nonzero_TE = w_TE != 0
    torch._assert_async(nonzero_TE.sum(dim=-1).max() <= k,
                        "a token has combine weights for more experts than the block selects")
    ids_TK = torch.argsort((~nonzero_TE).to(torch.int8), dim=-1, stable=True)[:, :k]
    return ids_TK, w_TE.gather(1, ids_TK)


def replace_dense_dispatch(traced: TracedBlock, info: MoELayerInfo) -> fx.GraphModule:
    """Replace a dense-dispatch block's dispatch, per-expert calls and combine with one
    ``self.<experts_attr>(x, ids, weights)`` call, (ids, weights) read from its combine tensor
    (:func:`dense_dispatch_slots`); needs ``traced.meta``. The routing (its methods included) runs as
    written, so capacity, auxiliary losses and statistics see the real routing.

    Pseudo-code:
        x [T, H], combine [T, E, C], y [T, H] = dense_dispatch_of(graph)     # Step 1
        out = self.experts(x, *dense_dispatch_slots(combine, K)); reads of y read out   # Step 2
        erase what only served y: dispatch einsum, capacity slots, expert calls, cat   # Step 3
    """
    gm, attr, layer = traced.gm, info.experts_attr, info.name
    graph = gm.graph
    # Step 1: the parts, from the probe's shapes (the experts' calls are under the list a wrapper holds).
    found = dense_dispatch_of(traced, expert_call_path(info.module, attr), info.num_experts)
    if found is None:
        raise RewriteError(f"MoE layer {layer!r}: no dense [T, E, C] dispatch and combine around its experts")
    calls = expert_nodes(graph, expert_call_path(info.module, attr))
    served = reachable([found.y], lambda n: n.all_input_nodes)

    # Step 2: one experts call in place of y.
    with graph.inserting_before(found.y):
        slots = graph.call_function(dense_dispatch_slots, (found.combine, info.top_k))
        ids = graph.call_function(operator.getitem, (slots, 0))
        weights = graph.call_function(operator.getitem, (slots, 1))
        out = graph.call_module(attr, (found.x, ids, weights))
        if traced.meta[found.y].dtype != traced.meta[found.x].dtype:
            out = graph.call_method("to", (out, traced.meta[found.y].dtype))
    found.y.replace_all_uses_with(out)

    # Step 3: erase what only served y (pure values; the block's method calls, other modules' calls and
    # in-place updates stay).
    def pure(n: fx.Node) -> bool:
        if n.op == "call_module":
            return n in calls
        on_block = n.op == "call_method" and n.args and getattr(n.args[0], "op", None) == "placeholder"
        return n.op in ("call_function", "call_method", "get_attr") and not is_inplace(n) and not on_block

    for n in reversed(list(graph.nodes)):
        if n in served and not n.users and pure(n):
            graph.erase_node(n)
    if any(c in graph.nodes for c in calls):
        raise RewriteError(f"MoE layer {layer!r}: expert outputs are used besides the combine")
    for (path, name), node in traced.attr_stores.items():
        if node not in graph.nodes:
            raise RewriteError(f"MoE layer {layer!r}: the forward stores {name!r} computed from the experts")
    owner = next(n for n in graph.nodes if n.op == "placeholder")
    for (path, name), node in traced.attr_stores.items():
        with graph.inserting_after(node):
            graph.call_function(_store_attribute, (owner, path, name, node))
    graph.lint()
    gm.recompile()
    return gm


# How each graph rewrite traces its block and rewrites the graph.
GRAPH_REWRITES: dict[str, tuple[Callable, Callable]] = {
    "inline-loop": (trace_block, replace_expert_loop),
    "dense-dispatch": (trace_block_with_method_leaves, replace_dense_dispatch),
}


# --- Applying and verifying a rewrite -----------------------------------------------------------------

def _rewritten_class(base: type, forwards: dict[bool, Callable], placeholders: list[fx.Node]) -> type:
    """A subclass of ``base`` whose forward runs the rewritten graph of the current mode.

    The forward is generated with the user's own parameter names and defaults (the graph's
    placeholders), so that the rewritten block can itself be FX-traced like the original."""
    params, names, defaults = [], [], {}
    for i, ph in enumerate(placeholders):
        name = ph.target
        if name.startswith("*"):
            params.append(name)
            names.append(name)
            continue
        if ph.args:
            defaults[f"_default_{i}"] = ph.args[0]
            params.append(f"{name}=_default_{i}")
        else:
            params.append(name)
        names.append(name)
    src = (f"def forward(self, {', '.join(params)}):\n"
           f"    return _forwards[self.training](self, self, {', '.join(names)})\n")
    scope = {"_forwards": forwards, **defaults}
    exec(compile(src, f"<themis rewritten {base.__name__}.forward>", "exec"), scope)
    forward = scope["forward"]
    # Traced once per mode: branches on self.training in the user's forward stay as written.
    forward.__doc__ = f"{base.__name__}.forward with its expert loop replaced by one experts(x, ids, weights) call."
    return type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                         "_themis_original_class": base})


@dataclasses.dataclass(frozen=True)
class RewritePlan:
    """How to rewrite one layer: the class to give it and tensor constants its graphs read. Depends only
    on the layer's code and structure, so a plan made on a module applies to a copy of it too."""

    cls: type
    constants: dict[str, torch.Tensor]


def _has_path(module: nn.Module, target: str) -> bool:
    owner_path, _, name = target.rpartition(".")
    try:
        owner = module.get_submodule(owner_path)
    except AttributeError:
        return False
    return hasattr(owner, name)


def plan_rewrite(info: MoELayerInfo) -> RewritePlan:
    """Trace ``info.module`` in train and in eval mode and rewrite each graph (:func:`replace_expert_loop`,
    or :func:`replace_dense_dispatch` for a dense-dispatch block)."""
    module, experts = info.module, info.experts
    if not isinstance(experts, nn.ModuleList) and wrapped_expert_list(experts) is None:
        raise ValueError(f"MoE layer {info.name!r}: an inline expert loop needs an nn.ModuleList of experts")
    forwards, constants = {}, {}
    x = probe_input(module, info.hidden_size, flat=info.probe_flat)
    trace, replace = GRAPH_REWRITES[info.rewrite]
    for training in (True, False):
        # A wrapper of the experts' list is traced through: its forward is part of the expert computation.
        traced = trace(module, expert_list(module, info.experts_attr), training=training)
        record_meta(traced, module, x)
        gm = replace(traced, info)
        forwards[training] = type(gm).forward
        for n in gm.graph.nodes:
            if n.op == "get_attr" and not _has_path(module, n.target):
                constants[n.target] = getattr(gm, n.target)   # a tensor constant the tracer lifted out
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and n.target != SELF_PLACEHOLDER]
    return RewritePlan(_rewritten_class(type(module), forwards, placeholders), constants)


class PerSlotCall:
    """``self.<experts>`` as a per-slot block's forward sees it: ``experts(x_TH, ids_TK) -> y_TKH``, each
    selected expert's output left for the block to combine (gpt-fast ``cond_ffn``). Computed with one call
    of the runtime's interface: every (token, slot) pair is a row of its own, routed to its expert with
    weight 1."""

    def __init__(self, experts: nn.Module) -> None:
        self.experts = experts

    def __call__(self, x_TH: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        T, K = ids_TK.shape
        x_NH = x_TH.repeat_interleave(K, dim=0)                 # row t * K + k
        ones_N1 = torch.ones((T * K, 1), dtype=x_TH.dtype, device=x_TH.device)
        return self.experts(x_NH, ids_TK.reshape(-1, 1), ones_N1).view(T, K, -1)


class SortedRowsCall:
    """``self.<experts>`` as a sorted-rows block's forward sees it: ``experts(rows_NH, counts_E) -> y_NH``
    with the rows sorted by expert, ``counts_E[e]`` of them for expert e (torchtitan ``GroupedExperts``).
    Computed with one call of the runtime's interface: every row is a token of its own, routed to its
    expert with weight 1. ``counts_E`` as the block passes it: an integer tensor or a list."""

    def __init__(self, experts: nn.Module) -> None:
        self.experts = experts

    def __call__(self, rows_NH: torch.Tensor, counts_E) -> torch.Tensor:
        counts = torch.as_tensor(counts_E, device=rows_NH.device).long()
        ids_N1 = torch.repeat_interleave(torch.arange(len(counts), device=rows_NH.device), counts).view(-1, 1)
        ones_N1 = torch.ones(ids_N1.shape, dtype=rows_NH.dtype, device=rows_NH.device)
        return self.experts(rows_NH, ids_N1, ones_N1)


class DispatchMaskCall:
    """``self.<experts>`` as a dispatch-mask block's forward sees it: ``experts(x_TH, mask_TKE, weights_TK)``
    with a one-hot mask in place of ids (HF Switch Transformers). Computed with one call of the runtime's
    interface on the ids and weights the mask means (:func:`~themis_compile.passes.find_behaviour.mask_slots`:
    a slot with an empty mask, a token dropped by capacity, has weight 0)."""

    def __init__(self, experts: nn.Module) -> None:
        self.experts = experts

    def __call__(self, x_TH: torch.Tensor, mask_TKE: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return self.experts(x_TH, *mask_slots(mask_TKE, weights_TK))


class FlattenCall:
    """``self.<experts>`` as a block calling it on unflattened hidden states sees it:
    ``experts(x_BSH, ids_TK, weights_TK) -> y_BSH`` (DBRX). Computed with one call of the runtime's
    interface on ``x`` flattened to ``[T, H]``, the result reshaped back."""

    def __init__(self, experts: nn.Module) -> None:
        self.experts = experts

    def __call__(self, x_BSH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return self.experts(x_BSH.reshape(-1, x_BSH.shape[-1]), ids_TK, weights_TK).view(x_BSH.shape)


class AllRowsCall:
    """``self.<experts>`` as an all-rows block's forward sees it: ``experts(x_NH) -> y_NH`` with ``N = E * T``
    rows, expert-major (row ``e * T + t`` is token t's copy for expert e, scaled by the routing), every
    expert on every row (Llama 4). Computed with one call of the runtime's interface
    (:func:`~themis_compile.passes.find_behaviour.serve_all_rows`): every served row a token of its own, routed to
    its expert; the plan says which rows are served (every row, or the nonzero ones)."""

    def __init__(self, experts: nn.Module, plan: AllRowsPlan) -> None:
        self.experts = experts
        self.plan = plan

    def __call__(self, x_NH: torch.Tensor) -> torch.Tensor:
        return serve_all_rows(self.experts, x_NH, self.plan)


def all_rows_rewrite_classes(block_cls: type, experts_cls: type, attr: str, plan: AllRowsPlan
                              ) -> tuple[type, type]:
    """(block class, experts class) of an all-rows rewrite: the block's forward runs unchanged with
    ``self.<attr>`` seen as an :class:`AllRowsCall`; the experts module is called as
    ``experts(x_TH, ids_TK, weights_TK)`` (:func:`~themis_compile.passes.find_behaviour.all_rows_experts_class`)."""
    new_block = served_block_class(block_cls, attr, lambda experts: AllRowsCall(experts, plan))
    return new_block, all_rows_experts_class(experts_cls)


def served_block_class(block_cls: type, attr: str, view: Callable[[nn.Module], Callable]) -> type:
    """A subclass of ``block_cls`` whose forward is its own with ``self.<attr>`` seen as ``view(experts)``:
    the adapter shadows the experts submodule (an instance attribute before ``nn.Module.__getattr__``)
    inside the forward only, so that ``named_modules``, state dicts and hooks see the experts module."""

    def block_forward(self, *args, **kwargs):
        self.__dict__[attr] = view(self._modules[attr])
        try:
            return block_cls.forward(self, *args, **kwargs)
        finally:
            self.__dict__.pop(attr, None)

    block_forward.__doc__ = f"{block_cls.__name__}.forward with {attr} served by one experts(x, ids, weights) call."
    return type(block_cls.__name__, (block_cls,), {"forward": block_forward, "__module__": block_cls.__module__,
                                                   "_themis_original_class": block_cls})


class ZeroExpertsCall:
    """``self.<experts>`` as a block whose experts stack Z zero (identity) experts after the E real ones
    sees it (HF LongCat-Flash: ``experts(x_TH, ids_TK, weights_TK)`` with ids in ``[0, E + Z)``, an id
    ``>= E`` adding ``weight * x``). Served as the user's code serves it, the slots split by id:

        real_N         = the (token, slot) pairs with id < E
        out_TH         = index_add over real_N of experts(x[token_N], ids[real_N, None], weights[real_N, None])
        out_TH        += x_TH * (sum of the weights of the slots with id >= E)     # identity experts, locally

    so that ids ``>= E`` never reach the runtime (one row per real slot, routed with its weight). The
    zero-expert rows the sharded experts hold on this rank (``runtime.experts.ZeroExpertRows``) get their
    zero gradient here, every call, as in one process."""

    def __init__(self, experts: nn.Module, num_experts: int) -> None:
        self.experts, self.num_experts = experts, num_experts

    def __call__(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        real_TK = ids_TK < self.num_experts
        token_N, slot_N = torch.nonzero(real_TK, as_tuple=True)
        y_NH = self.experts(x_TH[token_N], ids_TK[token_N, slot_N].unsqueeze(1),
                            weights_TK[token_N, slot_N].unsqueeze(1))
        out_TH = torch.zeros_like(x_TH).index_add(0, token_N, y_NH.to(x_TH.dtype))
        identity_T1 = torch.where(real_TK, 0, weights_TK).sum(-1, keepdim=True)
        out_TH = out_TH + (x_TH * identity_T1).to(x_TH.dtype)
        return with_zero_rows_gradient(out_TH, self.experts)


class ScoresCall:
    """``self.<experts>`` as a block calling it with the router's dense scores besides the top-k sees it:
    ``experts(x, scores_TE, weights_TK, ids_TK)`` in the order of its :class:`~themis_compile.passes.
    find_behaviour.ScoresCallPlan` (HF DBRX before v5), ``x`` as ``[T, H]`` or ``[B, S, H]``. Computed with one
    call of the runtime's interface on ``x`` flattened, the ids and the weights (detection proved on a
    probe that the scores of experts a token is not routed to change nothing), the result in ``x``'s
    shape."""

    def __init__(self, experts: nn.Module, plan: ScoresCallPlan) -> None:
        self.experts, self.plan = experts, plan

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        args = args + tuple(kwargs.values())       # the order detection recorded the call in
        x, ids_TK, weights_TK = args[0], args[self.plan.ids], args[self.plan.weights]
        return self.experts(x.reshape(-1, x.shape[-1]), ids_TK, weights_TK).view(x.shape)


# The rewrites that keep the block's forward and serve its experts call through an adapter.
CALL_REWRITES = ("per-slot", "sorted-rows", "dispatch-mask", "flatten", "scores-call")


def _sorted_rows_experts_forward(experts_cls: type):
    def experts_forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        T, K = ids_TK.shape
        # E from the module itself (ExpertBank runs one expert as this module with E = 1 slices): a
        # wrapper's list length, else the stacked weights' leading dimension, read on a weight of 3 or more
        # dimensions where there is one (a parameter every expert uses, a scale [H], may come first).
        wrapped = wrapped_expert_list(self)
        params = list(self.parameters())
        E = len(wrapped[1]) if wrapped is not None else next(
            (p.shape[0] for p in params if p.dim() >= 3), params[0].shape[0])
        flat_N = ids_TK.reshape(-1)
        order_N = torch.argsort(flat_N, stable=True)
        counts_E = torch.zeros(E, dtype=torch.long, device=flat_N.device).scatter_add_(
            0, flat_N, torch.ones_like(flat_N))
        y_NH = experts_cls.forward(self, x_TH[order_N // K], counts_E)
        if isinstance(y_NH, tuple):
            y_NH = y_NH[0]     # (rows, None, ...): Megatron-Core's (output, output_bias) without bias
        # view(T, K, H), not (T, K, -1): an expert with no rows (T = 0) runs too, and -1 is ambiguous there.
        y_TKH = torch.empty_like(y_NH).index_copy_(0, order_N, y_NH).view(T, K, y_NH.shape[-1])
        return torch.einsum("tkh,tk->th", y_TKH, weights_TK.to(y_TKH.dtype))

    experts_forward.__doc__ = f"{experts_cls.__name__}.forward on rows sorted by expert, combined with the weights."
    return experts_forward


class NoneTail:
    """An adapter whose result is returned followed by ``n`` Nones, as the user's experts module returns
    it (Megatron-Core ``SequentialMLP``: ``(output, output_bias)``, the bias None without biases)."""

    def __init__(self, call: Callable, n: int) -> None:
        self.call, self.n = call, n

    def __call__(self, *args: Any) -> tuple:
        return (self.call(*args),) + (None,) * self.n


def call_rewrite_classes(block_cls: type, experts_cls: type, attr: str, form: str, num_experts: int = 0,
                          plan: Any = None, call_tail: int = 0) -> tuple[type, type]:
    """(block class, experts class) of a per-slot, sorted-rows or dispatch-mask rewrite: the block's forward
    runs unchanged with ``self.<attr>`` seen as a :class:`PerSlotCall` / :class:`SortedRowsCall` /
    :class:`DispatchMaskCall`; the experts module is called as ``experts(x_TH, ids_TK, weights_TK)``."""
    call = {"per-slot": PerSlotCall, "sorted-rows": SortedRowsCall, "dispatch-mask": DispatchMaskCall,
            "flatten": FlattenCall, "scores-call": lambda experts: ScoresCall(experts, plan)}[form]

    new_block = served_block_class(block_cls, attr, (lambda experts: NoneTail(call(experts), call_tail))
                                    if call_tail else call)
    experts_forward = (_per_slot_experts_forward(experts_cls) if form == "per-slot"
                       else mask_call_experts_class(experts_cls, num_experts).forward if form == "dispatch-mask"
                       else flat_call_experts_class(experts_cls).forward if form == "flatten"
                       else scores_call_experts_class(experts_cls, plan).forward if form == "scores-call"
                       else _sorted_rows_experts_forward(experts_cls))
    new_experts = type(experts_cls.__name__, (experts_cls,), {"forward": experts_forward,
                                                              "__module__": experts_cls.__module__,
                                                              "_themis_original_class": experts_cls})
    return new_block, new_experts


def _per_slot_experts_forward(experts_cls: type):
    """``experts(x_TH, ids_TK, weights_TK)`` of a per-slot experts module: its own per-slot forward
    ``experts(x_TH, ids_TK) -> y_TKH``, combined with the top-k weights."""

    def experts_forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        y_TKH = experts_cls.forward(self, x_TH, ids_TK)
        return torch.einsum("tkh,tk->th", y_TKH, weights_TK.to(y_TKH.dtype))

    experts_forward.__doc__ = f"{experts_cls.__name__}.forward combined with the top-k weights."
    return experts_forward


def _mismatch(a: Any, b: Any, rtol: float = 1e-4, atol: float = 1e-5) -> str | None:
    """Why two outputs (tensors in nested tuples, dicts, dataclasses) differ beyond fp32 tolerance, or None when they agree."""
    flat_a, flat_b = output_tensors(a), output_tensors(b)
    if len(flat_a) != len(flat_b):
        return f"{len(flat_a)} tensor outputs vs {len(flat_b)}"
    for u, v in zip(flat_a, flat_b):
        if u.shape != v.shape:
            return f"shapes {list(u.shape)} vs {list(v.shape)}"
        if not torch.allclose(u.double(), v.double(), rtol=rtol, atol=atol, equal_nan=True):
            return f"values differ by up to {float((u.double() - v.double()).abs().max()):.3g}"
    return None


def verify_rewrite(original: nn.Module, rewritten: nn.Module, probe: torch.Tensor, *, layer: str = "") -> None:
    """Run ``probe`` through both modules (seeded, no grad, in train and in eval mode) and raise
    ``ValueError`` naming ``layer`` unless the outputs agree within fp32 tolerance."""
    for training in (True, False):
        expected = run_probe(original, probe, training=training)
        try:
            got = run_probe(rewritten, probe, training=training)
        except Exception as exc:
            raise ValueError(f"MoE layer {layer!r}: the rewritten layer fails on a probe input: {exc}") from exc
        why = _mismatch(expected, got)
        if why is not None:
            raise ValueError(f"MoE layer {layer!r}: the rewritten layer does not match the original on a probe "
                             f"input ({'train' if training else 'eval'} mode: {why}); the model was left unchanged")


def verify_rewrite_gradients(original: nn.Module, rewritten: nn.Module, probe: torch.Tensor, *, layer: str = ""
                             ) -> None:
    """Like :func:`verify_rewrite` for the gradients: the parameters' and the probe's gradients of a seeded
    random projection of the output, in train mode, must agree within fp32 tolerance. For rewrites whose
    forward equality does not imply it by construction (a dense-dispatch rewrite drops the combine
    tensor's entries outside each token's slots, which the user's code could still differentiate)."""
    params = [p for p in original.parameters() if p.requires_grad]
    grads = []
    for module in (original, rewritten):
        x = probe.detach().clone().requires_grad_(probe.is_floating_point())
        with preserved_state(module):
            modes = [(m, m.training) for m in module.modules()]
            module.train(True)
            try:
                torch.manual_seed(PROBE_SEED)
                flat = [v for v in output_tensors(module(x)) if v.requires_grad]
                if not flat:
                    return   # nothing differentiable comes out (a frozen block)
                gen = torch.Generator().manual_seed(PROBE_SEED)
                loss = sum((v * torch.randn(v.shape, generator=gen).to(v)).sum() for v in flat)
                grads.append(torch.autograd.grad(loss, params + [x], allow_unused=True))
            finally:
                for m, mode in modes:
                    m.training = mode
    for (name, _), a, b in zip(list(((n, p) for n, p in original.named_parameters() if p.requires_grad))
                               + [("hidden states", None)], *grads):
        if (a is None) != (b is None) or (a is not None and not torch.allclose(
                a.double(), b.double(), rtol=1e-4, atol=1e-5)):
            raise ValueError(f"MoE layer {layer!r}: the rewritten layer's gradient of {name} does not match the "
                             "original's on a probe input; the model was left unchanged")
