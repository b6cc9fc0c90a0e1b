"""Experts held as stacked ``[E, ...]`` parameters of the block itself, moved into an experts child of their own.

Much MoE code keeps its experts' weights as parameters of the MoE block (or of the whole decoder layer) and
applies them inline, gathered by the selected ids::

    top, ids_TK = self.router(x_TD).topk(k)                                  # the block's routing
    gate = torch.einsum("td,tkdf->tkf", x_TD, self.w_gate[ids_TK])           # } the expert computation:
    up = torch.einsum("td,tkdf->tkf", x_TD, self.w_up[ids_TK])               # } every value computed from
    y_TKD = torch.einsum("tkf,tkfd->tkd", F.silu(gate) * up, self.w_down[ids_TK])   # } the stacked weights
    out_TD = torch.einsum("tkd,tk->td", y_TKD, top.softmax(-1))              # the block's combine

or per row (``torch.bmm(rows_N1D, self.w1[ids_N])``), or on a padded buffer of every expert's rows
(``torch.bmm(buf_ECH, self.w_in)``), stacked 2-D biases added alike (``... + self.b_up[ids_TK]``). No module
is the experts; the code is. This module reads that code off
the block (its FX graph, or a probe where FX cannot trace it) and moves it, with the weights, into a child.

Contract:
    Reading is read-only. :func:`own_weights_region` finds the *expert region* of the FX graph: the values
    computed from the stacked weights up to the first value ``y`` that every later use of them goes through
    (every node depending on a weight is ``y``, an ancestor of ``y`` or computed from ``y``), with the views
    of floating inputs used only there pulled in. The region must take exactly a floating ``x`` and integer
    ``ids`` from the rest of the block, and be one of two call shapes: ``experts(x [T, H], ids [T, K]) ->
    y [T, K, H]`` ("per-slot", gpt-fast's ``cond_ffn``) or ``experts(rows [N, H], ids [N]) -> y [N, (1,) H]``
    ("per-row"); no branch on a traced value, no attribute stored by the forward, no in-place op and no
    tensor of another module inside the region. A block applying the weights once per slot (a loop over the
    k slots, ``self.w1[ids_TK[:, k]]``) has no such ``y``; :func:`slot_regions` reads one per-row region per
    slot (the same code each), which :func:`replace_slot_regions` replaces by one per-row call on every
    slot's rows. Where FX fails, :class:`WeightsRecorder` records the code
    from the weights' first use (on one buffer ``[E, C, H]``) to their last on a probe ("expert-batched").
    :func:`apply_own_weights` moves the weights into ``block.<attr>`` (a :class:`OwnWeightsExperts`, the
    same parameter objects under the same names) and gives the block a forward that runs the graph with the
    region replaced by ``self.<attr>(x, ids)``, or (expert-batched) its own forward with the weights seen as
    :class:`WeightStandIns`; ``passes.shard`` then serves that call with one ``experts(x, ids, weights)``
    call (:class:`PerRowCall`, :class:`BatchedCall`, ``passes.shard.PerSlotCall``), and verifies the whole
    against the original, values and gradients, each expert run alone as the runtime runs it. State-dict
    keys stay the user's (:class:`OwnWeightsKeys`).

Pseudo-code (FX reading):
    W      = get_attr nodes of the block's stacked parameters (>= 3-D, leading dimension E = the router's width;
             with them its 2-D [E, X] ones, the experts' biases, unless the routing computes the ids from them)
    D      = every node computed from W
    y      = the first node of D such that the uses of W are ancestors of y and D \\ ancestors(y) follows y
    region = D ∩ (ancestors(y) ∪ {y}) + views of floating inputs used only by the region
    inputs = the region's arguments from outside it, (x, ids)
    block  = graph with region replaced by call_module(attr, (x, ids))
    (no y: the uses of W grouped by the ids they take, one region per group, each per-row, all the same code;
     block = graph with the regions replaced by split(call_module(attr, (cat(rows), cat(ids)))))

Shape suffixes: T tokens, K top-k, N rows (one per token and slot), H hidden size, E experts, C rows per
expert in a padded buffer.
"""

from __future__ import annotations

import itertools
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from themis_compile.passes.fx_graph import TensorMeta, TracedBlock, ancestors, descendants, is_inplace
from themis_compile.passes.joined import VALUE_READS, KeyHook, in_place_call

__all__ = ["OwnWeightsExperts", "OwnWeightsPlan", "own_stacked_weights", "stacked_biases", "routing_reads",
           "own_weights_region", "apply_own_weights",
           "slot_regions", "replace_slot_regions",
           "PerRowCall", "OwnWeightsKeys", "ServedOwnWeightsExperts",
           "region_module", "replace_region", "WeightUses", "WeightsRecorder",
           "WeightStandIns", "BatchedCall", "padded_rows"]

# Ops that only view a tensor: pulled into the region when they view a floating input used only there.
_VIEWS = {"unsqueeze", "view", "reshape", "squeeze", "flatten", "expand", "transpose", "permute", "contiguous", "t",
          torch.unsqueeze, torch.reshape, torch.squeeze, torch.flatten, torch.transpose, torch.permute, torch.t}


# --- The experts -------------------------------------------------------------------------------------

class OwnWeightsExperts(nn.Module):
    """The stacked weights a block held itself, under their own names, computing the block's own expert
    code (``region``, an FX graph taking this module and ``(x, ids)``). Called as the block called its
    code: ``experts(x [T, H], ids [T, K]) -> [T, K, H]`` (per slot) or ``experts(rows [N, H], ids [N])``
    (per row). ``region`` is not a child (it holds no tensors, only the block's parameter-free modules)."""

    def __init__(self, weights: dict[str, nn.Parameter], region: fx.GraphModule, form: str) -> None:
        super().__init__()
        for name, w in weights.items():
            self.register_parameter(name, w)
        self.__dict__["region"] = region
        self.form = form

    def forward(self, x: torch.Tensor, *ids: torch.Tensor, written: Any = None) -> torch.Tensor:
        return self.region(self, x, *ids)

    def experts_forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """``experts(x, ids, weights)``: the block's expert code per (token, slot), combined with the weights."""
        T, K = ids_TK.shape
        if self.form == "expert-batched":
            E = next(iter(self.parameters())).shape[0]
            buf_ECH, order_N, expert_N, slot_N = padded_rows(x_TH, ids_TK, E)
            y_ECH = self.region(self, buf_ECH)
            y_NH = y_ECH.new_empty(T * K, y_ECH.shape[-1]).index_copy(0, order_N, y_ECH[expert_N, slot_N])
            return torch.einsum("tkh,tk->th", y_NH.view(T, K, y_NH.shape[-1]), weights_TK.to(y_NH.dtype))
        if self.form == "per-slot":
            y_TKH = self.region(self, x_TH, ids_TK)
        else:
            y_NH = self.region(self, x_TH.repeat_interleave(K, dim=0), ids_TK.reshape(-1))
            y_TKH = y_NH.reshape(T, K, y_NH.shape[-1])      # (T may be 0: an expert without rows)
        return torch.einsum("tkh,tk->th", y_TKH, weights_TK.to(y_TKH.dtype))


class ServedOwnWeightsExperts(OwnWeightsExperts):
    """The experts once the block is served: called as ``experts(x_TH, ids_TK, weights_TK)``, the runtime's
    interface (each expert alone is this module with its ``[1, ...]`` slices, every row routed to it)."""

    forward = OwnWeightsExperts.experts_forward


class PerRowCall:
    """``self.<experts>`` as a per-row block sees it: ``experts(rows [N, H], ids [N]) -> y [N, (1,) H]``, each
    row its own token routed to its expert with weight 1: one call of the runtime's interface."""

    def __init__(self, experts: nn.Module, out_middle: tuple[int, ...] = ()) -> None:
        self.experts, self.out_middle = experts, out_middle

    def __call__(self, rows_NH: torch.Tensor, ids_N: torch.Tensor) -> torch.Tensor:
        N = ids_N.shape[0]
        ones_N1 = torch.ones((N, 1), dtype=rows_NH.dtype, device=rows_NH.device)
        out_NH = self.experts(rows_NH.reshape(N, -1), ids_N.reshape(N, 1), ones_N1)
        return out_NH.view(N, *self.out_middle, out_NH.shape[-1])


@dataclass(frozen=True)
class OwnWeightsPlan:
    """How a block's own stacked weights become an experts child: ``block.<attr>`` will hold ``names`` and
    compute ``region`` in call shape ``form``; the block runs ``forwards[training]`` (its graph with the
    region replaced by the call), reading the tensor ``constants`` the tracer lifted out."""

    attr: str
    names: tuple[str, ...]
    form: str                       # "per-slot" | "per-row" | "expert-batched"
    region: fx.GraphModule
    forwards: dict | None           # None: the block's forward runs as written (expert-batched)
    constants: dict
    out_middle: tuple[int, ...]     # per-row: the singleton dimensions between N and H of the region's output
    top_k: int
    order: tuple[str, ...] = ()     # the block's own parameters as the user's block holds them (state-dict order)
    uses: int = 0                   # expert-batched: the torch functions taking a weight per forward
    specs: tuple = ()               # expert-batched: (name, shape, dtype) of every weight

    def experts_of(self, block: nn.Module) -> nn.Module:
        """The experts of ``block``: the child it holds once rewritten, else a new one over its weights
        (which stay where they are)."""
        if self.attr in block._modules:
            return block._modules[self.attr]
        return self.make_experts({n: block._parameters[n] for n in self.names})

    def make_experts(self, weights: dict[str, nn.Parameter]) -> OwnWeightsExperts:
        return OwnWeightsExperts(weights, self.region, self.form)


def own_stacked_weights(module: nn.Module) -> tuple[str, int, int, tuple[str, ...]] | None:
    """(router name, E, H, the stacked weights' names) of a block holding stacked ``[E, ...]`` weights of
    3 or more dimensions itself next to a Linear router of E outputs; None for any other module. The names
    include the block's 2-D ``[E, X]`` parameters (stacked biases, ``b1 [E, F]``) in the user's order: the
    readings keep them where the code applying the stacked weights reads them, indexed by the expert id
    (:func:`stacked_biases`, :func:`routing_reads`)."""
    own = [(n, p) for n, p in module._parameters.items() if p is not None and p.dim() >= 2]
    for rname, router in module.named_children():
        if isinstance(router, nn.Linear) and router.out_features >= 2:
            E = router.out_features
            if any(p.dim() >= 3 and p.shape[0] == E for _, p in own):
                return rname, E, router.in_features, tuple(n for n, p in own if p.shape[0] == E)
    return None


def stacked_biases(module: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """The 2-D ``[E, X]`` parameters among the stacked ``names`` of ``module`` (its experts' biases, when the
    code applying the stacked weights reads them)."""
    return tuple(n for n in names if module._parameters[n].dim() == 2)


class _ComputedFrom(TorchFunctionMode):
    """Follows, on a run, the tensors computed from each of ``weights`` (by identity, whatever else they take)
    and notes the weights from which an integer tensor is computed (selected ids, a sort order)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._from: dict[int, tuple[torch.Tensor, frozenset]] = {id(w): (w, frozenset([n])) for n, w in weights.items()}
        self.to_integers: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        names = frozenset().union(*(entry[1] for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)
                                    and (entry := self._from.get(id(v))) is not None and entry[0] is v))
        if names:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._from[id(t)] = (t, names)
                    if not (t.is_floating_point() or t.is_complex()):
                        self.to_integers |= names
        return out


def routing_reads(module: nn.Module, names: tuple[str, ...], run: Callable[[], Any]) -> tuple[str, ...]:
    """Those of the parameters ``names`` of ``module`` from which the probe ``run()`` computes an integer
    tensor (the selected ids, an order): read by the routing, they are no expert's (a raw router weight
    ``[E, H]``)."""
    if not names:
        return ()
    seen = _ComputedFrom({n: module._parameters[n] for n in names})
    with torch.no_grad(), seen:
        run()
    return tuple(n for n in names if n in seen.to_integers)


# --- Reading the region off the graph ----------------------------------------------------------------

def _meta(traced: TracedBlock, n: Any) -> TensorMeta | None:
    m = traced.meta.get(n) if isinstance(n, fx.Node) else None
    return m if isinstance(m, TensorMeta) else None


def _is_view(n: fx.Node) -> bool:
    return n.op in ("call_method", "call_function") and n.target in _VIEWS


def own_weights_region(traced: TracedBlock, names: tuple[str, ...], hidden: int
                       ) -> tuple[tuple[list[fx.Node], list[fx.Node], fx.Node, str] | None, str]:
    """((region nodes in order, inputs (x, ids), y, form), "") of the block's expert region (see the module
    docstring), or (None, why not)."""
    graph = traced.gm.graph
    W = [n for n in graph.nodes if n.op == "get_attr" and n.target in names]
    if {n.target for n in W} != set(names):
        return None, f"its forward does not read every stacked weight ({', '.join(names)})"
    if traced.branch_nodes:
        return None, "its forward branches on a traced value"
    if traced.attr_stores:
        return None, "its forward stores attributes on the module"
    D = descendants(W)
    uses = {u for w in W for u in w.users}
    order = {n: i for i, n in enumerate(graph.nodes)}
    y = None
    for n in sorted(D - set(W), key=order.get):
        if n.op == "output":
            break
        before = ancestors(n) | {n}
        if uses <= before and D <= before | descendants([n]):
            y = n
            break
    if y is None:
        return None, "no single value carries every use of the stacked weights to the rest of the forward"
    region = D & (ancestors(y) | {y})
    # Views of floating inputs (rows.unsqueeze(1)) used only by the region are part of it.
    changed = True
    while changed:
        changed = False
        for n in list(graph.nodes):
            if (n not in region and _is_view(n) and all(u in region for u in n.users)
                    and any(n in u.all_input_nodes for u in region) and (m := _meta(traced, n)) is not None
                    and m.dtype.is_floating_point):
                region.add(n)
                changed = True
    nodes = sorted(region, key=order.get)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in region))
    for n in nodes:
        if is_inplace(n):
            return None, f"the code applying the stacked weights updates a value in place ({n.format_node()})"
        if n.op == "call_module" and any(True for _ in itertools.chain(
                traced.gm.get_submodule(n.target).parameters(), traced.gm.get_submodule(n.target).buffers())):
            return None, f"the code applying the stacked weights calls module '{n.target}', which holds tensors"
        if n.op == "get_attr" and n.target not in names:
            return None, f"the code applying the stacked weights reads '{n.target}' of the block"
    metas = [_meta(traced, a) for a in inputs]
    out = _meta(traced, y)
    shapes = ", ".join(str(list(m.shape)) if m else "?" for m in metas)
    if len(inputs) != 2 or None in metas or out is None:
        return None, (f"the code applying the stacked weights takes {len(inputs)} values from the rest of the "
                      f"block ({shapes}), not hidden states and the selected ids")
    if metas[0].dtype.is_floating_point < metas[1].dtype.is_floating_point:
        inputs, metas = inputs[::-1], metas[::-1]
    (x, ids) = metas
    ok_types = x.dtype.is_floating_point and not ids.dtype.is_floating_point and x.shape[-1:] == (hidden,)
    if ok_types and len(x.shape) == 2 and len(ids.shape) == 2 and ids.shape[0] == x.shape[0] and (
            out.shape == (*ids.shape, hidden)):
        return (nodes, inputs, y, "per-slot"), ""
    if ok_types and len(x.shape) == 2 and len(ids.shape) == 1 and ids.shape[0] == x.shape[0] and (
            out.shape[0] == x.shape[0] and out.shape[-1] == hidden and all(d == 1 for d in out.shape[1:-1])):
        return (nodes, inputs, y, "per-row"), ""
    return None, (f"the code applying the stacked weights maps ({shapes}) to {list(out.shape)}, not "
                  f"(x [T, {hidden}], ids [T, K]) to [T, K, {hidden}] nor (rows [N, {hidden}], ids [N]) to "
                  f"[N, {hidden}]")


def slot_regions(traced: TracedBlock, names: tuple[str, ...], hidden: int
                 ) -> tuple[list[tuple[list[fx.Node], list[fx.Node], fx.Node]] | None, str]:
    """([(region nodes in order, inputs (rows, ids), y)] of every slot, "") when the block applies its stacked
    weights once per slot, the same per-row code each time (gpt-fast's ``cond_ffn`` in a loop over the k
    slots: ``torch.einsum("ti,toi->to", x, self.w1[ids_TK[:, k]])``), else (None, why not; "" when the uses of
    the weights do not fall into two or more slots).

    The uses of the weights are grouped by the other values they take (a slot's ids); a slot's region is
    what is computed from its uses up to the first value ``y`` computed from all of them. Each region must be
    left only through its ``y``, take the slot's rows ``[N, H]`` and ids ``[N]`` alone (besides the weights)
    and give ``[N, (1,) H]``; the rows and ids of every slot must not be computed from any slot's result,
    every other value computed from the weights must be computed from the slots' results, and the regions
    must be the same code."""
    graph = traced.gm.graph
    W = [n for n in graph.nodes if n.op == "get_attr" and n.target in names]
    if {n.target for n in W} != set(names) or traced.branch_nodes or traced.attr_stores:
        return None, ""
    order = {n: i for i, n in enumerate(graph.nodes)}
    D = descendants(W) - set(W)
    # Step 1: the uses of the weights by slot (the other values they take).
    groups: dict[tuple[fx.Node, ...], list[fx.Node]] = {}
    for u in sorted({u for w in W for u in w.users}, key=order.get):
        groups.setdefault(tuple(a for a in u.all_input_nodes if a not in W), []).append(u)
    if len(groups) < 2:
        return None, ""
    # Step 2: each slot's region, from its uses to the first value computed from all of them.
    regions = []
    for uses in groups.values():
        y = next((n for n in sorted(D, key=order.get) if set(uses) <= ancestors(n) | {n}), None)
        if y is None or y.op == "output":
            return None, "no single value carries the uses of one slot's weights to the rest of the forward"
        region = D & (ancestors(y) | {y})
        if any(u not in region for n in region - {y} for u in n.users):
            return None, (f"a value computed from one slot's weights is used other than through the slot's result "
                          f"({y.format_node()})")
        nodes = sorted(region | (set(W) & ancestors(y)), key=order.get)
        inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in region and a not in W))
        for n in region:
            if is_inplace(n):
                return None, f"the code applying the stacked weights updates a value in place ({n.format_node()})"
            if n.op in ("call_module", "get_attr"):
                return None, f"the code applying the stacked weights reads '{n.target}' of the block"
        metas = [_meta(traced, a) for a in inputs]
        out = _meta(traced, y)
        if len(inputs) != 2 or None in metas or out is None:
            shapes = ", ".join(str(list(m.shape)) if m else "?" for m in metas)
            return None, (f"the code applying one slot's weights takes {len(inputs)} values from the rest of the "
                          f"block ({shapes}), not the slot's rows and ids")
        if metas[0].dtype.is_floating_point < metas[1].dtype.is_floating_point:
            inputs, metas = inputs[::-1], metas[::-1]
        x, ids = metas
        if not (x.dtype.is_floating_point and not ids.dtype.is_floating_point and len(x.shape) == 2
                and x.shape[-1] == hidden and tuple(ids.shape) == tuple(x.shape[:1]) and out.shape[0] == x.shape[0]
                and out.shape[-1] == hidden and all(d == 1 for d in out.shape[1:-1])):
            return None, (f"the code applying one slot's weights maps ({list(x.shape)}, {list(ids.shape)}) to "
                          f"{list(out.shape)}, not (rows [N, {hidden}], ids [N]) to [N, {hidden}]")
        regions.append((nodes, inputs, y))
    # Step 3: one call for all slots: their rows and ids come first, the rest of the forward after.
    ys = [y for _, _, y in regions]
    after = descendants(ys)
    if any(a in after for _, inputs, _ in regions for a in inputs):
        return None, "the rows or ids of one slot are computed from another slot's result"
    if not D <= set().union(*(set(nodes) for nodes, _, _ in regions)) | after:
        return None, "a value computed from the stacked weights is neither in a slot's code nor computed from its result"
    if len({_signature(nodes, inputs) for nodes, inputs, _ in regions}) != 1:
        return None, "the code applying the stacked weights differs between the slots"
    return regions, ""


def _signature(nodes: list[fx.Node], inputs: list[fx.Node]) -> str:
    """A region's code with its nodes numbered: equal for two regions that compute the same."""
    index: dict[fx.Node, Any] = {a: ("input", i) for i, a in enumerate(inputs)}
    index.update({n: ("weight", n.target) for n in nodes if n.op == "get_attr"})
    code = [n for n in nodes if n.op != "get_attr"]
    index.update({n: ("node", i) for i, n in enumerate(code)})
    lines = []
    for n in code:
        args = fx.node.map_aggregate((n.args, n.kwargs), lambda a: index[a] if isinstance(a, fx.Node) else a)
        lines.append(repr((n.op, n.target, args)))
    return "\n".join(lines)


def replace_slot_regions(traced: TracedBlock, regions: list[tuple[list[fx.Node], list[fx.Node], fx.Node]],
                         attr: str) -> fx.GraphModule:
    """The block's graph with its slots' regions (:func:`slot_regions`) replaced by one per-row call
    ``self.<attr>(rows, ids)`` on every slot's rows and ids, concatenated, each slot's result its part of the
    call's (in place on ``traced.gm``)."""
    gm, graph = traced.gm, traced.gm.graph
    gm.add_submodule(attr, nn.Module())    # where the call will find the experts (the block's child, once moved)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((n for nodes, _, _ in regions for n in nodes if n.op != "get_attr"), key=order.get)
    # The slots' rows and ids, and what they are computed from, move before the first slot's code.
    inputs = [a for _, ins, _ in regions for a in ins]
    for n in sorted({m for a in inputs for m in ancestors(a) | {a} if order[m] > order[first]}, key=order.get):
        first.prepend(n)
    with graph.inserting_before(first):
        rows = graph.call_function(torch.cat, ([ins[0] for _, ins, _ in regions],))
        ids = graph.call_function(torch.cat, ([ins[1] for _, ins, _ in regions],))
        call = graph.call_module(attr, (rows, ids))
        sizes = [graph.call_method("size", (ins[1], 0)) for _, ins, _ in regions]
        parts = graph.call_function(torch.split, (call, sizes))
        for i, (_, _, y) in enumerate(regions):
            y.replace_all_uses_with(graph.call_function(operator.getitem, (parts, i)))
    for nodes, _, _ in reversed(regions):
        for n in reversed(nodes):
            if n.op != "get_attr":
                graph.erase_node(n)
    for n in {n for nodes, _, _ in regions for n in nodes if n.op == "get_attr"}:
        if not n.users:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return gm


def region_module(traced: TracedBlock, nodes: list[fx.Node], inputs: list[fx.Node], y: fx.Node) -> fx.GraphModule:
    """The region as a graph of its own: ``region(experts, x, ids) -> y``, the weights read off ``experts``."""
    g = fx.Graph()
    owner = g.placeholder("experts")
    env = {a: g.placeholder(name) for a, name in zip(inputs, ("x", "ids"))}
    for n in nodes:
        if n.op == "get_attr":
            env[n] = g.call_function(getattr, (owner, n.target))
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[y])
    return fx.GraphModule(traced.gm, g, class_name="ExpertRegion")


def replace_region(traced: TracedBlock, nodes: list[fx.Node], inputs: list[fx.Node], y: fx.Node,
                   attr: str) -> fx.GraphModule:
    """The block's graph with the region replaced by ``self.<attr>(x, ids)`` (in place on ``traced.gm``)."""
    gm, graph = traced.gm, traced.gm.graph
    gm.add_submodule(attr, nn.Module())    # where the call will find the experts (the block's child, once moved)
    with graph.inserting_before(y):
        call = graph.call_module(attr, tuple(inputs))
    y.replace_all_uses_with(call)
    for n in reversed(nodes):
        graph.erase_node(n)
    gm.recompile()
    return gm


def block_forward_class(base: type, plan: OwnWeightsPlan) -> type:
    """A subclass of ``base`` whose forward runs ``plan.forwards`` of the current mode (the block's graph
    with the region replaced by the experts call)."""

    def forward(self, *args, **kwargs):
        return plan.forwards[self.training](self, *args, **kwargs)

    forward.__doc__ = f"{base.__name__}.forward with its expert code in '{plan.attr}'."
    return type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                         "_themis_original_class": base, "_themis_own_weights": plan})


class OwnWeightsKeys(KeyHook):
    """A state-dict hook: the experts' keys ``<block>.<attr>.<name>[.<rest>]`` are the user's
    ``<block>.<name>[.<rest>]`` when saving (``loading=False``), in the user's order of the block's own
    parameters (``order``), and back when loading. ``<rest>``: what a flattened optimizer state dict adds
    (``.exp_avg``). Inside ``passes.joined.internal_keys`` the hook leaves the keys as they are."""

    def __init__(self, attr: str, names: tuple[str, ...], loading: bool, order: tuple[str, ...] = ()) -> None:
        self.attr, self.names, self.loading, self.order = attr, names, loading, order
        alt = "|".join(map(re.escape, names))
        self._inner = re.compile(rf"^{re.escape(attr)}\.({alt})((?:\..+)?)$")
        self._outer = re.compile(rf"^({alt})((?:\..+)?)$")

    def inner_key(self, m: Any) -> str:
        return f"{self.attr}.{m[1]}{m[2]}"

    def save(self, state_dict: dict, prefix: str) -> None:
        # The block's own parameters where and in the order the user's block has them (first).
        items = list(state_dict.items())
        own = {}
        for i, (k, _) in enumerate(items):
            rest = k[len(prefix):] if k.startswith(prefix) else None
            if rest is not None and (m := self._inner.match(rest)):
                own[i] = m[1] + m[2]
            elif rest in self.order:
                own[i] = rest
        if not any(name.split(".")[0] in self.names for name in own.values()):
            return
        at = next(i for i, (k, _) in enumerate(items) if k.startswith(prefix))

        def rank(j: int) -> tuple:
            name = own[j].split(".")[0]
            return (self.order.index(name) if name in self.order else len(self.order), j)

        state_dict.clear()
        for i, (k, v) in enumerate(items):
            if i == at:
                for j in sorted(own, key=rank):
                    state_dict[prefix + own[j]] = items[j][1]
            if i not in own:
                state_dict[k] = v


def apply_own_weights(block: nn.Module, plan: OwnWeightsPlan) -> None:
    """Rewrite ``block`` in place: its stacked weights move into ``block.<attr>`` (the same parameter
    objects), its class gets the forward of :func:`block_forward_class`, and its state-dict keys stay the
    user's. ``passes.shard`` then serves the experts call."""
    experts = plan.make_experts({n: block._parameters.pop(n) for n in plan.names})
    block.add_module(plan.attr, experts)
    for name, value in plan.constants.items():
        block.register_buffer(name, value, persistent=False)
    block.__class__ = (batched_block_class if plan.forwards is None else block_forward_class)(type(block), plan)
    block.register_state_dict_post_hook(OwnWeightsKeys(plan.attr, plan.names, loading=False, order=plan.order))
    block.register_load_state_dict_pre_hook(OwnWeightsKeys(plan.attr, plan.names, loading=True))



# --- Forwards FX cannot trace: the expert-batched code recorded on a probe -----------------------------
#
# Padded-buffer code (``buf_ECH`` built from the tokens with C the largest count, ``int(counts.max())``; one
# ``torch.bmm`` per weight) does not trace. Its expert code is read off a probe instead: the torch functions
# applied from the first use of a stacked weight, on the one tensor that use takes beside the weights (the
# buffer, ``[E, C, H]``, expert e's rows at ``[e]``), up to the last use, are recorded as an FX graph
# (``region(experts, buf) -> y [E, C, H]``). The rewritten block runs its forward as written with its weights
# seen as shape-only stand-ins: their first use calls the experts on the buffer (one ``experts(x, ids,
# weights)`` call of the runtime) and answers zeros, on which the block's code between the uses runs to no
# effect; their last use answers the experts' result. A *use* is a torch function taking a weight or a
# value computed from weights alone (``w.transpose(1, 2)``, ``w.t()``, ``w.to(dtype)``: such values stand for
# the weights, `WeightValues`), giving a tensor (a size or a dtype read off a weight is no use).

class WeightValues:
    """The weights a mode follows, by identity, each under a key (the expert it belongs to, or one key for
    all), and the values computed from the weights of one key alone, which stand for them where the code
    applies them (``x @ w.t()``)."""

    def __init__(self, weights: dict[Any, list[torch.Tensor]]) -> None:
        self._held = {id(w): (key, w) for key, ws in weights.items() for w in ws}

    def key(self, v: Any) -> Any:
        """The key of ``v``, None when it is neither a weight nor computed from weights alone."""
        entry = self._held.get(id(v)) if isinstance(v, torch.Tensor) else None
        return entry[0] if entry is not None and entry[1] is v else None

    def split(self, flat: list[torch.Tensor]) -> tuple[set, list[torch.Tensor]]:
        """(the keys of the weights among ``flat``, the other tensors)."""
        keys = {k for v in flat if (k := self.key(v)) is not None}
        return keys, [v for v in flat if self.key(v) is None]

    def follow(self, keys: set, others: list[torch.Tensor], out: Any) -> None:
        """``out`` of a use with ``keys`` and ``others``: computed from the weights of one key alone, it stands
        for them."""
        if len(keys) == 1 and not others and isinstance(out, torch.Tensor):
            self._held[id(out)] = (next(iter(keys)), out)


class WeightUses(TorchFunctionMode):
    """Counts the uses of ``weights`` (by identity) on a run."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._values = WeightValues({0: list(weights.values())})
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        keys, others = self._values.split([v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)])
        if keys and isinstance(out, torch.Tensor):
            self.count += 1
            self._values.follow(keys, others, out)
        return out


class WeightsRecorder(TorchFunctionMode):
    """Records, as an FX graph ``region(experts, x)``, the torch functions applied to ``weights`` (name ->
    parameter), to the tensor ``x`` that the first use taking another tensor takes beside them and to
    everything computed from them, until the last (the ``uses``-th) use; ``reason`` says why the code cannot
    be replayed on other rows (``words``: how it names the weights, ``x`` and what ``x`` must be)."""

    def __init__(self, weights: dict[str, torch.Tensor], uses: int, *, words: tuple[str, str, str] = (
            "the stacked weights", "the buffer", "one floating buffer of every expert's rows")) -> None:
        super().__init__()
        self._words = words
        self.graph = fx.Graph()
        self._owner = self.graph.placeholder("experts")
        self._weights = {id(w): (w, n) for n, w in weights.items()}
        self._values = WeightValues({0: list(weights.values())})
        self._node: dict[int, tuple[torch.Tensor, fx.Node]] = {}
        self._uses_left = uses
        self.reason: str | None = None
        self.x_shape: tuple[int, ...] | None = None
        self.y_shape: tuple[int, ...] | None = None
        self._y: torch.Tensor | None = None

    def _is_weight(self, v: Any) -> bool:
        return isinstance(v, torch.Tensor) and id(v) in self._weights and self._weights[id(v)][0] is v

    def _tracked(self, v: Any) -> fx.Node | None:
        if self._is_weight(v):
            if id(v) not in self._node:
                self._node[id(v)] = (v, self.graph.call_function(getattr, (self._owner, self._weights[id(v)][1])))
            return self._node[id(v)][1]
        entry = self._node.get(id(v)) if isinstance(v, torch.Tensor) else None
        return entry[1] if entry is not None and entry[0] is v else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.reason is not None:
            return out
        flat = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
        keys, others = self._values.split(flat)
        uses = bool(keys)
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        if self._y is not None:
            # After the last use: the block's own code on the result, which must read nothing else computed
            # from the weights.
            if any(self._tracked(v) is not None for v in flat if v is not self._y):
                self.reason = (f"{name} reads, after the last use of {self._words[0]}, a value computed from them "
                               "other than the result")
            return out
        if uses and not isinstance(out, torch.Tensor):
            return out   # a size, a dtype, a flag read off a weight
        if uses and self.x_shape is None and others:
            if len(others) != 1 or not others[0].is_floating_point():
                self.reason = (f"the first use of {self._words[0]} ({name}) takes {len(others)} other tensors, not "
                               f"{self._words[2]}")
                return out
            self.x_shape = tuple(others[0].shape)
            self._node[id(others[0])] = (others[0], self.graph.placeholder("x"))
        if not any(self._tracked(v) is not None for v in flat):
            return out
        if func in VALUE_READS:
            self.reason = f"{name} reads values computed from {self._words[0]} into Python"
        elif any(self._tracked(v) is None for v in flat):
            self.reason = f"{name} uses a tensor that is not computed from {self._words[1]} and {self._words[0]}"
        elif func is torch.Tensor.__setitem__ or in_place_call(func, kwargs):
            self.reason = f"{name} modifies a value computed from {self._words[0]} in place"
        elif not isinstance(out, torch.Tensor):
            if any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
                self.reason = f"{name} returns several tensors from the code on {self._words[0]}"
            return out   # (a size, a dtype: used as constants where the code goes on)
        if self.reason is not None:
            return out
        node = self.graph.call_function(func, *tree_map(lambda v: self._tracked(v) or v, (tuple(args), kwargs)))
        self._node[id(out)] = (out, node)
        if uses:
            self._values.follow(keys, others, out)
            self._uses_left -= 1
            if self._uses_left == 0:
                self._y, self.y_shape = out, tuple(out.shape)
        return out

    def finish(self) -> fx.GraphModule | None:
        """The recorded code as ``region(experts, x) -> y``, y the result of the last use of a weight."""
        if self.reason is None and self._y is None:
            self.reason = f"{self._words[0]} are not used by torch functions on a probe"
        if self.reason is None and self.x_shape is None:
            self.reason = f"no use of {self._words[0]} takes {self._words[2]}"
        if self.reason is not None:
            return None
        self.graph.output(self._node[id(self._y)][1])
        self.graph.eliminate_dead_code()
        self.graph.lint()
        return fx.GraphModule(nn.Module(), self.graph, class_name="ExpertRegion")


class WeightStandIns(TorchFunctionMode):
    """The rewritten block's weights while its forward runs (expert-batched reading): shape-only (meta)
    stand-ins. A use on them alone answers a stand-in too (``w.transpose(1, 2)``); their first use taking
    another tensor calls ``call(x)`` (the experts on the buffer ``x``) and, like every use but the last,
    answers zeros of the use's shape; the last (the ``uses``-th) answers the experts' result."""

    def __init__(self, plan: OwnWeightsPlan, call: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.stand_ins = {n: torch.empty(shape, dtype=dtype, device="meta") for n, shape, dtype in plan.specs}
        self._values = WeightValues({0: list(self.stand_ins.values())})
        self.plan, self.call, self.count = plan, call, 0
        self._kept: torch.Tensor | None = None
        self._written: dict[int, list] = {}    # id(buffer) -> [(buffer, (expert ids, slots))] written into it

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__setitem__ and self._kept is None:
            self._note_rows(*args[:2])
        flat = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.Tensor)]
        keys, real = self._values.split(flat)
        if not keys:
            return func(*args, **kwargs)
        meta = tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, (tuple(args), kwargs))
        out_meta = func(*meta[0], **meta[1])
        if not isinstance(out_meta, torch.Tensor):
            return out_meta      # a size, a dimension, a dtype of a weight
        self.count += 1
        if not real and self.count < self.plan.uses:
            self._values.follow(keys, real, out_meta)
            return out_meta      # computed from the weights alone: a stand-in too
        if self._kept is None:
            if not real:
                raise RuntimeError("the stacked weights' last use takes no tensor but them")
            writes = [w for buf, w in self._written.get(id(real[0]), []) if buf is real[0]]
            self._kept = self.call(real[0], written=writes[0] if len(writes) == 1 else None)
        if self.count == self.plan.uses:
            if self._kept is None or self._kept.shape != out_meta.shape:
                raise RuntimeError(f"the stacked weights' last use gives {list(out_meta.shape)}, the experts "
                                   f"{list(getattr(self._kept, 'shape', []))}")
            return self._kept
        return torch.zeros(out_meta.shape, dtype=out_meta.dtype, device=real[0].device if real else None)

    def _note_rows(self, buf: Any, index: Any) -> None:
        """``buf[expert_N, slot_N] = rows``: the rows of a 3-D buffer the block writes (one write: the rows the
        experts serve; the others are padding whose results the block does not read)."""
        if (isinstance(buf, torch.Tensor) and buf.dim() == 3 and isinstance(index, tuple) and len(index) == 2
                and all(isinstance(i, torch.Tensor) and i.dim() == 1 and not i.is_floating_point() for i in index)
                and index[0].shape == index[1].shape):
            self._written.setdefault(id(buf), []).append((buf, index))


def batched_block_class(base: type, plan: OwnWeightsPlan) -> type:
    """A subclass of ``base`` whose forward is its own with the stacked weights seen as
    :class:`WeightStandIns` over ``self.<attr>`` (inside the forward only)."""

    def forward(self, *args, **kwargs):
        mode = WeightStandIns(plan, getattr(self, plan.attr))
        self.__dict__.update(mode.stand_ins)
        try:
            with mode:
                out = base.forward(self, *args, **kwargs)
        finally:
            for name in plan.names:
                self.__dict__.pop(name, None)
        if mode.count != plan.uses:
            raise RuntimeError(f"{base.__name__}: its stacked weights were used {mode.count} times, on the probe "
                               f"{plan.uses}; the moved code would not be what the block computes")
        return out

    forward.__doc__ = f"{base.__name__}.forward with its expert code on the buffer served by '{plan.attr}'."
    return type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                         "_themis_original_class": base, "_themis_own_weights": plan})


class BatchedCall:
    """``self.<experts>`` as an expert-batched block's code sees it: ``experts(buf [E, C, H]) -> [E, C, H]``,
    expert e on the rows ``buf[e]``: one call of the runtime's interface, every served row a token of its own
    routed to its expert with weight 1. Served are the rows the block wrote (``written``: the expert ids and
    slots of its one ``buf[expert_N, slot_N] = rows``), so that the runtime sees the real load, the others
    (padding) are 0 in the result; without ``written`` every row, padding included."""

    def __init__(self, experts: nn.Module) -> None:
        self.experts = experts

    def __call__(self, buf_ECH: torch.Tensor, written: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        E, C, H = buf_ECH.shape
        if written is None:
            expert_N = torch.arange(E, device=buf_ECH.device).repeat_interleave(C)
            slot_N = torch.arange(C, device=buf_ECH.device).repeat(E)
        else:
            expert_N, slot_N = written
        ones_N1 = torch.ones((expert_N.shape[0], 1), dtype=buf_ECH.dtype, device=buf_ECH.device)
        out_NH = self.experts(buf_ECH[expert_N, slot_N], expert_N.view(-1, 1), ones_N1)
        return out_NH.new_zeros(E, C, out_NH.shape[-1]).index_put((expert_N, slot_N), out_NH)


def padded_rows(x_TH: torch.Tensor, ids_TK: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(buf [E, C, H], order, expert, slot): every (token, slot) pair's row at ``buf[expert, slot]``, the
    pairs in ``order`` (sorted by expert), C the largest count."""
    flat_N = ids_TK.reshape(-1)
    counts_E = torch.bincount(flat_N, minlength=num_experts)
    C = int(counts_E.max()) if flat_N.numel() else 0
    order_N = flat_N.argsort(stable=True)
    expert_N = flat_N[order_N]
    slot_N = torch.arange(flat_N.numel(), device=x_TH.device) - (counts_E.cumsum(0) - counts_E)[expert_N]
    buf_ECH = x_TH.new_zeros(num_experts, C, x_TH.shape[-1])
    buf_ECH[expert_N, slot_N] = x_TH[order_N // ids_TK.shape[1]]
    return buf_ECH, order_N, expert_N, slot_N
