"""Reading a block's forward as an FX graph: the tracers, and the node predicates detection and the
rewrite share.

``trace_block`` traces a block with its experts, each expert and MLP-like children kept as leaves
(``leaf_modules``), branches on traced values recorded; ``trace_block_with_method_leaves`` keeps the
block's own methods as calls too (dense dispatch). Both return a ``TracedBlock``; ``record_meta`` adds each
node's (shape, dtype) from a probe. The predicates name what a node does (``is_topk``, ``is_top1``,
``is_sort`` and its cuts to k, ``is_inplace``) and where values flow (``effective_users``, ``reachable``,
``selections_of`` / ``selection_outputs`` / ``selection_k``, ``expert_nodes``, ``combine_node``).
``record_calls`` reads the same selections and score functions off a probe run, for forwards FX cannot
trace, over the same tables of torch functions.

Contract:
    Tracing and recording leave the block as they found it (``passes.probe.preserved_state``); nothing
    here decides whether a block is an MoE layer (``passes.detect`` does) or rewrites a graph
    (``passes.shard`` does).

Shape suffixes: T tokens, H hidden size, E experts, K top-k.
"""

from __future__ import annotations

import functools
import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from themis_compile.passes.probe import PROBE_SEED, preserved_state, probe_arguments

__all__ = ["is_mlp_like", "TracedBlock", "leaf_modules", "trace_block", "TensorMeta", "record_meta", "is_fn", "is_topk",
           "is_inplace", "score_kind", "topk_outputs", "effective_users", "reachable", "ancestors", "descendants",
           "router_of", "is_top1", "topk_cut", "selections_of", "selection_outputs", "selection_k", "selection_tokens",
           "is_sort",
           "cut_length", "is_sort_selection", "sort_cuts", "sort_cut_k", "index_text", "describe_selection",
           "variable_selection_reason", "record_sort_cut", "record_calls", "expert_index", "expert_nodes",
           "output_node", "reach_by_expert", "combine_node", "combine_nodes", "OWNER_INPUT",
           "trace_block_with_method_leaves"]


# --- Tracing -----------------------------------------------------------------------------------------

def is_mlp_like(m: nn.Module) -> bool:
    """A small dense module: at least two weight matrices, no parameter above 2-D, no nested module lists."""
    params = list(m.parameters())
    if sum(p.dim() == 2 for p in params) < 2 or any(p.dim() > 2 for p in params):
        return False
    subs = list(m.modules())
    return len(subs) <= 16 and not any(isinstance(s, (nn.ModuleList, nn.ModuleDict)) for s in subs)


class _MutableProxy(fx.Proxy):
    """A Proxy that also records ``proxy[index] = value`` (``out[idx] += y`` in expert loops)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class _LeafTracer(fx.Tracer):
    """Keeps the given modules (and torch.nn's own) as call_module leaves; records branches on traced
    values (taken as False) so that a rewrite can check they only guarded the expert loop."""

    def __init__(self, leaves: set[int]) -> None:
        super().__init__()
        self._leaves = leaves
        self.branch_nodes: list[fx.Node] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self._leaves or super().is_leaf_module(m, module_qualified_name)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _MutableProxy(node, self)

    def to_bool(self, obj: fx.Proxy) -> bool:
        self.branch_nodes.append(obj.node)
        return False


@dataclass
class TracedBlock:
    """The FX graph of one block's forward, traced in one mode (``training``)."""

    gm: fx.GraphModule
    training: bool
    branch_nodes: list[fx.Node]
    attr_stores: dict[tuple[str, str], Any]      # (submodule path, attribute) -> Node / constant set by forward
    meta: dict[fx.Node, Any] = field(default_factory=dict)   # node -> (shape, dtype) per tensor, from a probe
    owner_input: bool = False    # the graph's first input is the block itself (methods traced as leaves)


def leaf_modules(module: nn.Module, experts: nn.Module) -> set[int]:
    leaves = {id(experts)}
    if isinstance(experts, nn.ModuleList):
        leaves |= {id(e) for e in experts}
    leaves |= {id(c) for c in module.children() if c is not experts and is_mlp_like(c)}
    return leaves


def trace_block(module: nn.Module, experts: nn.Module, *, training: bool | None = None) -> TracedBlock:
    """FX-trace ``module.forward`` with experts, each expert and MLP-like children as leaves.

    Raises whatever FX raises when the forward is not symbolically traceable."""
    return _trace(module, _LeafTracer(leaf_modules(module, experts)), training)


def _trace(module: nn.Module, tracer: _LeafTracer, training: bool | None, methods: tuple[str, ...] = (),
           owner_input: bool = False) -> TracedBlock:
    """Trace ``module`` with ``tracer`` in mode ``training`` (None: its own), each of its ``methods``
    recorded as a call on the block; the module's state (modes, attributes) restored afterwards."""
    mode = module.training if training is None else training
    with preserved_state(module):
        modes = [(m, m.training) for m in module.modules()]
        module.train(mode)
        for name in methods:
            module.__dict__[name] = functools.partial(tracer.call_own_method, name)
        try:
            graph = tracer.trace(module)
            stores = _attribute_stores(module)
            # Built before the state is restored: tensor constants the tracer put on the module go with it.
            gm = fx.GraphModule(module, graph, class_name=type(module).__name__)
        finally:
            for m, old in modes:
                m.training = old
    return TracedBlock(gm=gm, training=mode, branch_nodes=tracer.branch_nodes, attr_stores=stores,
                       owner_input=owner_input)


def _attribute_stores(module: nn.Module) -> dict[tuple[str, str], Any]:
    """Attributes whose current value holds a Proxy: the forward stored a traced value there."""
    stores = {}
    for path, m in module.named_modules():
        for key, value in m.__dict__.items():
            if isinstance(value, fx.Proxy):
                stores[(path, key)] = value.node
    return stores


class TensorMeta(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


class _MetaRecorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.meta: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.meta[n] = tree_map(
            lambda v: TensorMeta(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None, out)
        return out


def record_meta(traced: TracedBlock, module: nn.Module, x: torch.Tensor) -> None:
    """Run the traced graph on a probe and keep each node's (shape, dtype)."""
    rec = _MetaRecorder(traced.gm)
    with preserved_state(module), torch.no_grad():
        torch.manual_seed(PROBE_SEED)
        rec.run(*((module,) if traced.owner_input else ()), *probe_arguments(module, x.clone()))
    traced.meta = rec.meta


# Node predicates.
_TOPK = {torch.topk, torch.Tensor.topk}
_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax}
_SIGMOID = {torch.sigmoid, F.sigmoid, torch.Tensor.sigmoid, torch.special.expit}
_INPLACE_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}


def is_fn(node: fx.Node, fns: set, method: str) -> bool:
    return ((node.op == "call_function" and node.target in fns)
            or (node.op == "call_method" and node.target == method))


def is_topk(node: fx.Node) -> bool:
    return is_fn(node, _TOPK, "topk")


def is_inplace(node: fx.Node) -> bool:
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target.endswith("_") and not node.target.startswith("_")
    return node.op == "call_function" and node.target in _INPLACE_FUNCTIONS


def score_kind(node: fx.Node) -> str | None:
    if is_fn(node, _SOFTMAX, "softmax"):
        return "softmax"
    if is_fn(node, _SIGMOID, "sigmoid"):
        return "sigmoid"
    return None


def topk_outputs(topk: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(values nodes, indices nodes) taken from a topk node by index or by name."""
    values, indices = [], []
    for u in topk.users:
        if u.op == "call_function" and u.target is operator.getitem:
            (values if u.args[1] == 0 else indices).append(u)
        elif u.op == "call_function" and u.target is getattr:
            (values if u.args[1] == "values" else indices).append(u)
    return values, indices


def effective_users(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Data-flow successors with in-place mutation taken into account: a node that reads a tensor after
    an in-place op on it (``out.index_add_(...)``, ``out[i] = v``) depends on that op, not on the
    tensor's allocation, so that a chain of in-place updates reads as the value flowing through it."""
    base: dict[fx.Node, fx.Node] = {}
    version: dict[fx.Node, fx.Node] = {}
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in graph.nodes}
    for n in graph.nodes:
        for a in dict.fromkeys(n.all_input_nodes):
            src = version.get(base.get(a, a), a)
            if n not in users[src]:
                users[src].append(n)
        if is_inplace(n) and n.args and isinstance(n.args[0], fx.Node):
            b = base.get(n.args[0], n.args[0])
            base[n] = b
            version[b] = n
    return users


def reachable(starts: list[fx.Node], succ: Callable[[fx.Node], list[fx.Node]], *, avoid: fx.Node | None = None
              ) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [s for s in starts if s is not avoid]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(u for u in succ(n) if u is not avoid and u not in seen)
    return seen


def ancestors(node: fx.Node) -> set[fx.Node]:
    return reachable([node], lambda n: n.all_input_nodes) - {node}


def descendants(nodes: list[fx.Node]) -> set[fx.Node]:
    return reachable(nodes, lambda n: list(n.users))


_MATMULS = {operator.matmul, torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm, "matmul", "mm",
            "__matmul__"}


def router_of(gm: fx.GraphModule, topk: fx.Node) -> tuple[str, int, int] | None:
    """(path, E, H) of the learned weight nearest before the top-k: a Linear leaf or a 2-D weight."""
    best = None
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in ancestors(topk) | {topk}:
        hit = None
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            if isinstance(mod, nn.Linear):
                hit = (n.target, mod.out_features, mod.in_features)
            elif linears := [(name, m) for name, m in mod.named_modules() if isinstance(m, nn.Linear)]:
                # A router that is a small MLP kept as a leaf (Linear -> tanh -> Linear(E)): its last Linear
                # scores the experts, its first reads the hidden states.
                hit = (f"{n.target}.{linears[-1][0]}", linears[-1][1].out_features, linears[0][1].in_features)
        elif n.op == "get_attr":
            try:
                t = gm.get_parameter(n.target)
            except AttributeError:
                t = None
            if t is not None and t.dim() == 2:
                # x @ w scores w's columns ([H, E], as noisy top-k gating writes it); F.linear(x, w),
                # x @ w.t() and w @ x score its rows ([E, H]).
                right = any(u.target in _MATMULS and len(u.args) > 1 and u.args[1] is n for u in n.users)
                hit = (n.target, t.shape[1], t.shape[0]) if right else (n.target, t.shape[0], t.shape[1])
        if hit is not None and (best is None or order[n] > best[0]):
            best = (order[n], hit)
    return None if best is None else best[1]


def _topk_k(node: fx.Node, meta: dict) -> int | None:
    k = node.args[1] if len(node.args) > 1 else node.kwargs.get("k")
    if isinstance(k, int):
        return k
    m = meta.get(node)
    return m[0].shape[-1] if m else None


# A top-1 selection: ``torch.max(scores, dim)`` (values and ids) or ``torch.argmax(scores, dim)`` (ids), the
# Switch / GShard routers. It counts as a selection wherever a top-k does, with k = 1.
_TOP1 = {torch.max, torch.Tensor.max, torch.argmax, torch.Tensor.argmax}


def _has_dim(args: tuple, kwargs: dict) -> bool:
    """A reduction along one dimension (``max(x, -1)``, ``max(x, dim=1)``), not ``max(a, b)`` or ``max(x)``."""
    return (len(args) > 1 and isinstance(args[1], int) and not isinstance(args[1], bool)) or "dim" in kwargs


def is_top1(node: fx.Node) -> bool:
    """``torch.max`` / ``torch.argmax`` along one dimension (a top-1 selection)."""
    named = ((node.op == "call_function" and node.target in (torch.max, torch.argmax))
             or (node.op == "call_method" and node.target in ("max", "argmax")))
    return named and _has_dim(node.args, node.kwargs)


def selections_of(graph: fx.Graph) -> list[fx.Node]:
    """The selections of a traced forward, in graph order: its top-k nodes and its sorts cut to a fixed K
    (:func:`is_sort_selection`), else (neither) its top-1 selections. A block with a top-k that also takes
    a max (statistics, capacity) selects by the top-k."""
    topks = [n for n in graph.nodes if is_topk(n) or is_sort_selection(n)]
    return topks or [n for n in graph.nodes if is_top1(n)]


def topk_cut(node: fx.Node) -> tuple[int, list[fx.Node], list[fx.Node]] | None:
    """(K, values cuts, ids cuts) of a top-k whose ids are used only cut to their first K entries along its
    dimension, K below its k: noisy top-k gating takes the top k + 1 (the (k+1)-th logit is a threshold for
    its load statistic) and routes by ``[:, :k]``. None for a top-k used whole."""
    if not is_topk(node):
        return None
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    values, ids = topk_outputs(node)
    if not ids or not isinstance(dim, int) or isinstance(dim, bool):
        return None
    id_cuts = []
    for out in ids:
        for u in out.users:
            length = (cut_length(u.args[1], dim) if u.op == "call_function" and u.target is operator.getitem
                      and u.args[0] is out else None)
            if length is None or not length[1]:
                return None
            id_cuts.append((u, length[0]))
    lengths = {k for _, k in id_cuts}
    k = next(iter(lengths)) if len(lengths) == 1 else None
    whole = node.args[1] if len(node.args) > 1 else node.kwargs.get("k")
    if k is None or (isinstance(whole, int) and k >= whole):
        return None
    value_cuts = [u for out in values for u in out.users if u.op == "call_function" and u.target is operator.getitem
                  and u.args[0] is out and cut_length(u.args[1], dim) == (k, True)]
    return k, value_cuts, [u for u, _ in id_cuts]


def selection_outputs(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(values nodes, ids nodes) of a selection: a top-k's or max's outputs (a top-k's cuts where its ids
    are used only cut, :func:`topk_cut`), an argmax itself (no values), a sort's cuts to K (an argsort's:
    ids only)."""
    if is_sort(node):
        return sort_cuts(node)
    if node.target in (torch.argmax, "argmax"):
        return [], [node]
    if (cut := topk_cut(node)) is not None:
        return cut[1], cut[2]
    return topk_outputs(node)


def selection_k(node: fx.Node, meta: dict) -> int | None:
    """k of a selection: a top-k's k (its cut's, :func:`topk_cut`), a sort's cut length (None when the
    probe's shapes, if given, show the cut is not along the last dimension), 1 for max / argmax."""
    if is_sort(node):
        tokens = selection_tokens(node, meta) if meta else None
        return sort_cut_k(node) if not meta or tokens is not None else None
    if (cut := topk_cut(node)) is not None:
        return cut[0]
    return _topk_k(node, meta) if is_topk(node) else 1


def selection_tokens(node: fx.Node, meta: dict) -> tuple[tuple[int, ...], int] | None:
    """(token shape, k) of a selection from the probe's shapes: ``[T, K]`` values of a top-k (or a sort's
    cut ids) give ``((T,), K)``; a top-1's ``[T]`` ids (or a sort's ids at position 0) give ``((T,), 1)``.
    None when the probe did not record it."""
    if is_sort(node):
        values, ids = sort_cuts(node)
        cut, k = next(iter(ids or values), None), sort_cut_k(node)
        m, scores = meta.get(cut), meta.get(node.args[0]) if node.args else None
        if not (isinstance(m, TensorMeta) and isinstance(scores, TensorMeta) and k is not None and scores.shape):
            return None
        if _sort_dim(node.args, node.kwargs) % len(scores.shape) != len(scores.shape) - 1:
            return None            # sorted along another dimension than the experts'
        if _cut_keeps_dim(cut):
            return (m.shape[:-1], k) if m.shape == scores.shape[:-1] + (k,) else None
        return (m.shape, 1) if m.shape == scores.shape[:-1] else None
    m = meta.get(node)
    if m is None:
        return None
    if is_topk(node):
        cut = topk_cut(node)
        return m[0].shape[:-1], m[0].shape[-1] if cut is None else cut[0]
    ids = m if isinstance(m, TensorMeta) else m[1]
    return ids.shape, 1


# A top-K selection by sorting (``scores.sort(dim=-1, descending=True)``, ``torch.sort``, ``argsort``), cut
# to K entries along the sorted dimension: ``[..., :K]`` / ``[:, :K]`` (descending), ``[..., -K:]``
# (ascending), or one entry, ``[:, 0]`` / ``[:, -1]`` (top-1). The cut is the selection: its values and
# ids are what a top-k's would be, up to the order of ties. A sort that is not cut (tokens sorted by
# expert, torchtitan / MegaBlocks; a top-p cumulative threshold) selects nothing.
_SORTS = {torch.sort: "sort", torch.Tensor.sort: "sort", torch.argsort: "argsort", torch.Tensor.argsort: "argsort"}


def is_sort(node: fx.Node) -> bool:
    """``torch.sort`` / ``Tensor.sort`` / ``torch.argsort`` / ``Tensor.argsort``."""
    return ((node.op == "call_function" and node.target in _SORTS)
            or (node.op == "call_method" and node.target in ("sort", "argsort")))


def _sort_dim(args: tuple, kwargs: dict) -> Any:
    """The dimension a sort runs along (``sort(x, dim=-1, descending=False)``; default -1)."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
    return dim if isinstance(dim, int) and not isinstance(dim, bool) else None


def cut_length(index: Any, dim: int) -> tuple[int, bool] | None:
    """(K, keeps the dimension) when ``t[index]`` cuts dimension ``dim`` of ``t`` to its first or last K
    entries and keeps every other dimension whole: ``[..., :K]``, ``[:, :K]``, ``[..., -K:]``, ``[:, 0]``
    (K = 1, dimension dropped). None for any other index (a gather, a mask, an unknown position)."""
    entries = index if isinstance(index, tuple) else (index,)
    if dim < 0:
        if Ellipsis not in entries and dim != -1:
            return None
        pos = len(entries) + dim if Ellipsis in entries else len(entries) - 1
        if Ellipsis in entries[pos + 1:]:
            return None
    else:
        if Ellipsis in entries[:dim + 1]:
            return None
        pos = dim
    if not 0 <= pos < len(entries):
        return None
    if any(not (e is Ellipsis or (isinstance(e, slice) and e == slice(None))) for i, e in enumerate(entries)
           if i != pos):
        return None
    cut = entries[pos]
    if isinstance(cut, int) and not isinstance(cut, bool):
        return (1, False) if cut in (0, -1) else None
    if not isinstance(cut, slice) or cut.step not in (None, 1):
        return None
    start, stop = cut.start, cut.stop
    if start in (None, 0) and isinstance(stop, int) and stop > 0:
        return stop, True
    if isinstance(start, int) and start < 0 and stop is None:
        return -start, True
    return None


def _cuts_of(sort: fx.Node) -> list[tuple[fx.Node, str, tuple[int, bool]]]:
    """(cut node, "values" | "ids", (K, keeps dim)) of every fixed-length cut of a sort's outputs along the
    sorted dimension."""
    dim = _sort_dim(sort.args, sort.kwargs)
    if dim is None:
        return []
    if sort.target in (torch.argsort, torch.Tensor.argsort, "argsort"):
        outputs = [(sort, "ids")]
    else:
        values, ids = topk_outputs(sort)
        outputs = [(v, "values") for v in values] + [(i, "ids") for i in ids]
    cuts = []
    for out, kind in outputs:
        for u in out.users:
            if u.op == "call_function" and u.target is operator.getitem and u.args[0] is out:
                if (length := cut_length(u.args[1], dim)) is not None:
                    cuts.append((u, kind, length))
    return cuts


def is_sort_selection(node: fx.Node) -> bool:
    """A sort whose values or ids are cut to one fixed K along the sorted dimension (a top-K)."""
    return is_sort(node) and len({length[0] for _, _, length in _cuts_of(node)}) == 1


def sort_cuts(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(values cuts, ids cuts) of a sort selection: the nodes that hold its top-K values and ids."""
    cuts = _cuts_of(node)
    return [c for c, kind, _ in cuts if kind == "values"], [c for c, kind, _ in cuts if kind == "ids"]


def sort_cut_k(node: fx.Node) -> int | None:
    """K of a sort selection (None when its cuts disagree or there is none)."""
    lengths = {length[0] for _, _, length in _cuts_of(node)}
    return next(iter(lengths)) if len(lengths) == 1 else None


def _cut_keeps_dim(cut: fx.Node) -> bool:
    sort = cut.args[0] if is_sort(cut.args[0]) else cut.args[0].args[0]
    length = cut_length(cut.args[1], _sort_dim(sort.args, sort.kwargs))
    return bool(length and length[1])


def index_text(index: Any) -> str:
    """An index as written: ``[:, :2]``, ``[..., -1]``."""
    def entry(e: Any) -> str:
        if e is Ellipsis:
            return "..."
        if isinstance(e, slice):
            return "".join(("" if e.start is None else str(e.start), ":", "" if e.stop is None else str(e.stop)))
        return str(e)
    return "[" + ", ".join(entry(e) for e in (index if isinstance(index, tuple) else (index,))) + "]"


def describe_selection(node: fx.Node) -> str:
    """How a selection node selects, for the router's description: the sort and its cut as written
    (``sort[:, :2]``, ``argsort[..., :2]``), or "" (a top-k or a max / argmax, which the top-k already says)."""
    cuts = _cuts_of(node) if is_sort(node) else []
    if not cuts:
        return ""
    return f"{_SORTS.get(node.target, node.target)}{index_text(cuts[0][0].args[1])}"


_COMPARISONS = {operator.gt: ">", operator.ge: ">=", operator.lt: "<", operator.le: "<=", torch.gt: ">",
                torch.ge: ">=", torch.lt: "<", torch.le: "<=", torch.greater: ">", torch.greater_equal: ">=",
                torch.less: "<", torch.less_equal: "<="}
_COMPARISON_METHODS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "greater": ">", "greater_equal": ">=",
                       "less": "<", "less_equal": "<="}


def variable_selection_reason(gm: fx.GraphModule, num_experts: int) -> str | None:
    """Why a block without a fixed-k selection cannot be sharded, when it selects experts another way:
    a threshold on its router's scores (``probs > 0.2``, Top-Any / dynamic routing) or a sort of them
    that is never cut to a fixed k (a top-p cumulative threshold). Either gives each token a number of
    experts that varies with its scores, where FSSDP's dispatch routes exactly k per token. None when
    the graph has neither (the block is then not told apart from a dense one here)."""
    for n in gm.graph.nodes:
        op = (_COMPARISONS.get(n.target) if n.op == "call_function" else
              _COMPARISON_METHODS.get(n.target) if n.op == "call_method" else None)
        sort = is_sort(n) and not is_sort_selection(n) and _sort_dim(n.args, n.kwargs) is not None
        if not (op or sort) or (router := router_of(gm, n)) is None or router[1] != num_experts:
            continue
        if sort:
            kind = _SORTS.get(n.target, n.target)
            what = f"sorts the scores of router '{router[0]}' ({kind}) but never cuts them to a fixed k"
        else:
            what = f"selects experts by comparing the scores of router '{router[0]}' with a threshold ({op})"
        return (f"{what}: the number of experts per token varies with the scores (top-p / threshold routing), "
                "and FSSDP routes every token to exactly k experts; select a fixed k with torch.topk or a sort cut "
                "to k (scores.sort(dim=-1, descending=True) then [..., :k])")
    return None


# --- The same selections recorded on a probe run, where FX cannot trace ------------------------------

_SELECTIONS = {torch.max: "max", torch.Tensor.max: "max", torch.argmax: "argmax", torch.Tensor.argmax: "argmax"}


class _CallRecorder(TorchFunctionMode):
    """Records, in order, the top-k, other selections (max, argmax, sorts and their cuts) and score
    functions a forward calls (at the torch-function level)."""

    def __init__(self) -> None:
        super().__init__()
        self.ks: list[int] = []       # k of every top-k and of every sort cut to k (record_sort_cut)
        self.topk_inputs: list[tuple[tuple[int, ...], int]] = []   # (input shape, dim) of every top-k
        self.scores: list[str] = []
        self.selections: list[str] = []
        self.top1 = 0                 # top-1 selections (max / argmax along a dimension)
        self.sorted: dict[int, tuple[torch.Tensor, str, int, int]] = {}   # id(output) -> (output, kind, dim, call)
        self.uncut_sorts: list[str] = []    # sorts along a dimension whose outputs were never cut to a fixed k
        self._cut: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SORTS or func is torch.Tensor.__getitem__:
            return record_sort_cut(self, func, args, kwargs)
        if func in _TOPK:
            k = args[1] if len(args) > 1 else kwargs.get("k")
            self.ks.append(int(k))
            scores = args[0] if args else kwargs.get("input")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if isinstance(scores, torch.Tensor) and isinstance(dim, int) and scores.dim():
                self.topk_inputs.append((tuple(scores.shape), dim % scores.dim()))
            self.selections.append(f"topk(k={int(k)})")
        elif func in _SOFTMAX:
            self.scores.append("softmax")
        elif func in _SIGMOID:
            self.scores.append("sigmoid")
        elif func in _SELECTIONS and (len(args) > 1 or "dim" in kwargs):
            self.selections.append(_SELECTIONS[func])
            if func in _TOP1 and _has_dim(args, kwargs):
                self.top1 += 1
        return func(*args, **kwargs)


def record_sort_cut(rec: _CallRecorder, func: Callable, args: tuple, kwargs: dict) -> Any:
    """Run a sort or an indexing under ``rec``: a sort's outputs are remembered, and the first cut of one
    of them to k entries along the sorted dimension (:func:`cut_length`) counts as a top-k with that k,
    the selection recorded with its cut (``sort[:, :2]``, ``argsort[..., :2]``). Only a sort of scores
    (floating point) can select: a sort of integer ids groups tokens by expert, and a slice of it
    (``order[start:end]``, one expert's rows) is no top-k. A sort never cut stays in ``uncut_sorts``
    (tokens sorted by expert, or a variable-k cumulative threshold)."""
    out = func(*args, **kwargs)
    if func in _SORTS:
        dim = _sort_dim(args, kwargs)
        if dim is not None:
            call = len(rec.uncut_sorts)
            rec.uncut_sorts.append(_SORTS[func])
            if not (args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()):
                return out
            outputs = [("ids", out)] if _SORTS[func] == "argsort" else [("values", out[0]), ("ids", out[1])]
            for kind, t in outputs:
                rec.sorted[id(t)] = (t, _SORTS[func], dim % max(t.dim(), 1), call)
        return out
    source = rec.sorted.get(id(args[0])) if args else None
    if source is not None and source[0] is args[0] and source[3] not in rec._cut:
        t, kind, dim, call = source
        length = cut_length(args[1], dim - t.dim()) if dim == t.dim() - 1 else None
        if length is not None and tuple(out.shape) == tuple(t.shape[:-1]) + ((length[0],) if length[1] else ()):
            rec._cut.add(call)
            rec.ks.append(length[0])
            rec.selections.append(f"{kind}{index_text(args[1])}")
            rec.uncut_sorts[call] = ""
    return out


def record_calls(module: nn.Module, x: torch.Tensor) -> _CallRecorder:
    """The selections and score functions ``module(x)`` calls on a probe, in call order."""
    rec = _CallRecorder()
    with preserved_state(module), torch.no_grad(), rec:
        torch.manual_seed(PROBE_SEED)
        module(x.clone())
    return rec


def _recorded_topk(module: nn.Module, x: torch.Tensor) -> tuple[list[int], list[str]]:
    """When FX cannot trace the forward (``len(proxy)``, iterating a traced tensor ...): record it while it
    runs on a probe. ``make_fx`` is no help there: it stops at the same data-dependent code (``one_hot``,
    ``nonzero`` loops). Returns the k of every top-k and sort cut to k (1 for each max / argmax when
    there is neither) and the score functions seen, in call order."""
    rec = _CallRecorder()
    with preserved_state(module), torch.no_grad(), rec:
        torch.manual_seed(PROBE_SEED)
        module(x.clone())
    return rec.ks or [1] * rec.top1, rec.scores   # no top-k: each max / argmax selects one expert


# --- The combined value of inline expert calls (used by the description and by passes.shard) -----------

def expert_index(node: fx.Node, attr: str) -> str | None:
    """The expert a node belongs to (``experts.3`` or ``experts.3.w1.weight`` -> "3"), else None."""
    if node.op in ("call_module", "get_attr") and isinstance(node.target, str) and node.target.startswith(attr + "."):
        return node.target[len(attr) + 1:].split(".")[0]
    return None


def expert_nodes(graph: fx.Graph, attr: str) -> list[fx.Node]:
    return [n for n in graph.nodes if expert_index(n, attr) is not None]


def output_node(graph: fx.Graph) -> fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def reach_by_expert(calls: list[fx.Node], attr: str, succ: dict[fx.Node, list[fx.Node]]
                     ) -> dict[str, set[fx.Node]]:
    groups: dict[str, list[fx.Node]] = {}
    for c in calls:
        groups.setdefault(expert_index(c, attr), []).append(c)
    return {e: reachable(cs, lambda n: succ[n]) for e, cs in groups.items()}


def combine_nodes(traced: TracedBlock, attr: str) -> list[fx.Node]:
    """The nodes every expert's output flows through on its way to the output, nearest first (following
    in-place updates as versions), the output itself left out."""
    graph = traced.gm.graph
    calls = expert_nodes(graph, attr)
    if not calls:
        return []
    succ = effective_users(graph)
    out = output_node(graph)
    reach = reach_by_expert(calls, attr, succ)
    common = set.intersection(*reach.values())
    if out not in common:
        return []
    return [y for y in graph.nodes   # topological order: the first post-dominator is the nearest
            if y in common and y not in calls and y is not out
            and out not in reachable(calls, lambda n: succ[n], avoid=y)]


def combine_node(traced: TracedBlock, attr: str) -> fx.Node | None:
    """Y: the nearest node every expert's output flows through on its way to the output (the combined
    value), following in-place updates as versions. None when there is none besides the output."""
    return next(iter(combine_nodes(traced, attr)), None)


# --- Tracing with the block's methods kept as calls (dense dispatch: GShard, Top2Gate) ---------------

OWNER_INPUT = "_themis_self"   # the block itself, first input of a graph traced with its methods as leaves


def _own_methods(module: nn.Module) -> list[str]:
    """Names of the plain methods the block's own classes define (not ``forward``, not torch's)."""
    names: list[str] = []
    for cls in type(module).__mro__:
        if cls is nn.Module or cls.__module__.startswith("torch."):
            break
        names += [k for k, v in vars(cls).items() if inspect.isfunction(v) and not k.startswith("__")
                  and k != "forward" and k not in names]
    return names


class _MethodLeafTracer(_LeafTracer):
    """A :class:`_LeafTracer` for blocks whose routing helper holds Python-level shape code that FX cannot
    trace (``math.ceil`` of a shape, ``torch.finfo(x.dtype)``, ``one_hot(num_classes=capacity)``): the
    block's own methods are recorded as calls on the block, which becomes the graph's first input (so a
    rewritten forward runs them as written), its child modules that hold no experts (a DeepSpeed
    ``TopKGate``) are kept as calls too, and ``x.chunk(n)`` with a constant ``n`` can be iterated
    (``zip(x.chunk(E), self.experts)``)."""

    def __init__(self, leaves: set[int]) -> None:
        super().__init__(leaves)
        self.owner: fx.Proxy | None = None

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        self.owner = self.create_proxy("placeholder", OWNER_INPUT, (), {})
        return super().create_args_for_root(root_fn, is_module, concrete_args)

    def call_own_method(self, name: str, *args: Any, **kwargs: Any) -> fx.Proxy:
        return self.create_proxy("call_method", name, (self.owner, *args), kwargs)

    def iter(self, obj: fx.Proxy) -> Iterator:
        n = obj.node
        count = None
        if (n.op == "call_method" and n.target == "chunk") or (n.op == "call_function" and n.target is torch.chunk):
            count = n.args[1] if len(n.args) > 1 else n.kwargs.get("chunks")
        if isinstance(count, int):
            return iter([obj[i] for i in range(count)])
        return super().iter(obj)


def trace_block_with_method_leaves(module: nn.Module, experts: nn.Module, *, training: bool | None = None
                                   ) -> TracedBlock:
    """:func:`trace_block` with the block's own methods kept as calls (see :class:`_MethodLeafTracer`);
    the graph takes the block as its first input (``traced.owner_input``)."""
    routing_children = {id(c) for c in module.children() if not any(m is experts for m in c.modules())}
    tracer = _MethodLeafTracer(leaf_modules(module, experts) | routing_children)
    return _trace(module, tracer, training, tuple(_own_methods(module)), owner_input=True)
