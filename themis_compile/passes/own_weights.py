"""Experts held as stacked ``[E, ...]`` parameters of the block itself, moved into an experts child of their own.

Much MoE code keeps its experts' weights as parameters of the MoE block (or of the whole decoder layer) and
applies them inline, gathered by the selected ids::

    top, ids_TK = self.router(x_TD).topk(k)                                  # the block's routing
    gate = torch.einsum("td,tkdf->tkf", x_TD, self.w_gate[ids_TK])           # } the expert computation:
    up = torch.einsum("td,tkdf->tkf", x_TD, self.w_up[ids_TK])               # } every value computed from
    y_TKD = torch.einsum("tkf,tkfd->tkd", F.silu(gate) * up, self.w_down[ids_TK])   # } the stacked weights
    out_TD = torch.einsum("tkd,tk->td", y_TKD, top.softmax(-1))              # the block's combine

or per row (``torch.bmm(rows_N1D, self.w1[ids_N])``). No module is the experts; the code is. This module
reads that code off the block's FX graph and moves it, with the weights, into a child module:

Contract:
    :func:`own_weights_plan` is read-only. It finds the *expert region* of the graph: the values computed
    from the stacked weights up to the first value ``y`` that every later use of them goes through (every
    node depending on a weight is ``y``, an ancestor of ``y`` or computed from ``y``), with the views of
    floating inputs used only there pulled in. The region must take exactly a floating ``x`` and integer
    ``ids`` from the rest of the block, and be one of two call shapes: ``experts(x [T, H], ids [T, K]) ->
    y [T, K, H]`` ("per-slot", gpt-fast's ``cond_ffn``) or ``experts(rows [N, H], ids [N]) -> y [N, (1,) H]``
    ("per-row"). The same region code in train and eval mode, no branch on a traced value, no attribute
    stored by the forward, no in-place op and no parameter of another module inside the region.
    :func:`apply_own_weights` moves the weights into ``block.<attr>`` (a :class:`OwnWeightsExperts`, the
    same parameter objects under the same names) and gives the block a forward that runs the graph with the
    region replaced by ``self.<attr>(x, ids)``; ``passes.shard`` then serves that call as for any per-slot
    (or per-row) experts module, and verifies the whole against the original, values and gradients, each
    expert run alone as the runtime runs it. State-dict keys stay the user's (:class:`OwnWeightsKeys`).

Pseudo-code:
    W      = get_attr nodes of the block's stacked parameters (>= 3-D, leading dimension E = the router's width)
    D      = every node computed from W
    y      = the first node of D such that the uses of W are ancestors of y and D \\ ancestors(y) follows y
    region = D ∩ (ancestors(y) ∪ {y}) + views of floating inputs used only by the region
    inputs = the region's arguments from outside it, (x, ids)
    block  = graph with region replaced by call_module(attr, (x, ids))

Shape suffixes: T tokens, K top-k, N rows (one per token and slot), H hidden size, E experts.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from themis_compile.passes.fx_graph import TensorMeta, TracedBlock, ancestors, descendants, is_inplace

__all__ = ["OwnWeightsExperts", "OwnWeightsPlan", "own_stacked_weights", "own_weights_region", "apply_own_weights",
           "PerRowCall", "OwnWeightsKeys", "ServedOwnWeightsExperts",
           "region_module", "replace_region"]

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

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.region(self, x, ids)

    def experts_forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """``experts(x, ids, weights)``: the block's expert code per (token, slot), combined with the weights."""
        T, K = ids_TK.shape
        if self.form == "per-slot":
            y_TKH = self.region(self, x_TH, ids_TK)
        else:
            y_TKH = self.region(self, x_TH.repeat_interleave(K, dim=0), ids_TK.reshape(-1)).reshape(T, K, -1)
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
    form: str                       # "per-slot" | "per-row"
    region: fx.GraphModule
    forwards: dict
    constants: dict
    out_middle: tuple[int, ...]     # per-row: the singleton dimensions between N and H of the region's output
    top_k: int
    order: tuple[str, ...] = ()     # the block's own parameters as the user's block holds them (state-dict order)

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
    3 or more dimensions itself next to a Linear router of E outputs; None for any other module."""
    own = [(n, p) for n, p in module._parameters.items() if p is not None and p.dim() >= 3]
    for rname, router in module.named_children():
        if isinstance(router, nn.Linear) and router.out_features >= 2:
            names = tuple(n for n, p in own if p.shape[0] == router.out_features)
            if names:
                return rname, router.out_features, router.in_features, names
    return None


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


class OwnWeightsKeys:
    """A state-dict hook: the experts' keys ``<block>.<attr>.<name>`` are the user's ``<block>.<name>`` when
    saving (``loading=False``), in the user's order of the block's own parameters (``order``), and back when
    loading."""

    def __init__(self, attr: str, names: tuple[str, ...], loading: bool, order: tuple[str, ...] = ()) -> None:
        self.attr, self.names, self.loading, self.order = attr, names, loading, order
        alt = "|".join(map(re.escape, names))
        self._inner = re.compile(rf"^{re.escape(attr)}\.({alt})$")
        self._outer = re.compile(rf"^({alt})$")

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        if self.loading:
            for key in [k for k in state_dict if k.startswith(prefix)]:
                if m := self._outer.match(key[len(prefix):]):
                    state_dict[f"{prefix}{self.attr}.{m[1]}"] = state_dict.pop(key)
            return
        # Saving: the block's own parameters where and in the order the user's block has them (first).
        items = list(state_dict.items())
        own = {}
        for i, (k, _) in enumerate(items):
            rest = k[len(prefix):] if k.startswith(prefix) else None
            if rest is not None and (m := self._inner.match(rest)):
                own[i] = m[1]
            elif rest in self.order:
                own[i] = rest
        if not any(name in self.names for name in own.values()):
            return
        at = next(i for i, (k, _) in enumerate(items) if k.startswith(prefix))
        state_dict.clear()
        for i, (k, v) in enumerate(items):
            if i == at:
                for j in sorted(own, key=lambda j: self.order.index(own[j])):
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
    block.__class__ = block_forward_class(type(block), plan)
    block.register_state_dict_post_hook(OwnWeightsKeys(plan.attr, plan.names, loading=False, order=plan.order))
    block.register_load_state_dict_pre_hook(OwnWeightsKeys(plan.attr, plan.names, loading=True))

