"""Schedule each MoE layer's sparse collectives into the preceding attention's compute window (§4.2).

The paper issues layer l's SparseAllGather (SpAG) during the forward of the attention layer before it,
and overlaps the SparseReduceScatter (SpRS) of layer l, together with the re-materialization SpAG of
layer l-1, with the backward of attention l (Fig. 1c). This module is that placement, as an FX pass.

Vocabulary (the ``themis::`` ops the pass places; each is one opaque node in any FX graph):

- ``themis::spag_start(layer) -> token``: plan P' (Alg. 1) and start SpAG of MoE layer ``layer``
  (``start_materialization()`` of the runtime; idempotent within an iteration).
- ``themis::spag_wait(token, layer) -> ready``: the end of the SpAG window, just before the MoE block
  (the runtime's forward waits for the SpAG itself, at token dispatch, which is no earlier).
- ``themis::moe_experts(x_TH, ids_TK, weights_TK, ready, layer, keep_graph) -> (out_TH, handle)``: the sharded experts
  of a layer as one opaque node under ``torch.compile`` (the runtime runs eagerly inside; its autograd
  graph is kept for ``themis::moe_experts_backward``).
- ``themis::reduction_fence(x, layer) -> x``: identity in forward on the input of attention l; its
  backward (``themis::reduction_wait``) waits for SpRS of MoE layer l (``wait_reduction()``), i.e. at the
  end of attention l's backward. The runtime itself starts SpRS right after the MoE backward and the
  re-materialization SpAG of layer l-1 when layer l's MoE backward ends, so both run in that window.

Two graph flavours are scheduled by the same core (`schedule_graph`):

(a) eager: `schedule_model` traces the model with ``torch.fx`` keeping attention modules and MoE blocks as
    leaves (``call_module`` nodes), inserts the ops above and installs the scheduled graph as the forward;
(b) compiled: under ``torch.compile`` the MoE experts call becomes ``themis::spag_start`` ->
    ``themis::spag_wait`` -> ``themis::moe_experts`` (adjacent), attention modules are annotated with
    ``node.meta["custom"]["themis_region"] == "attn"``, and the "themis" backend
    (`themis_compile.passes.backend`) moves the start into the attention window on the dynamo graph and
    again on the AOT forward graph.

Contract of `schedule_graph`
    Assumes: ``graph`` is a valid FX graph; MoE sites are given or are ``themis::moe_experts`` nodes
    (layer id = its ``layer`` argument); attention nodes are ``call_module`` nodes of attention modules,
    nodes annotated ``meta["custom"]["themis_region"] == "attn"``, nodes whose ``nn_module_stack``
    names an attention module class, or scaled-dot-product-attention calls.
    Guarantees, for every MoE site of layer l, in graph order:
    - exactly one ``spag_start(l)`` node, immediately before the first node of the attention region that
      precedes the MoE site in data flow and comes after the previous MoE site; without such a region
      (e.g. the first block of a hybrid model) at the earliest legal point: right after the previous MoE
      site, or after the graph's inputs for the first layer (`LayerSchedule.fallback` is True);
    - exactly one ``spag_wait(token, l)`` node, immediately before the MoE site, consuming that start;
    - with ``insert_fences``: a ``reduction_fence(x, l)`` on each activation input of that attention region;
    - node values are unchanged (the ops are identities on data), and ``graph.lint()`` passes.
    Running the pass twice gives the same order (it is idempotent).

Pseudo-code
    sites   = MoE sites in graph order
    regions = attention regions {key: nodes in order}
    for l, site in sites:
        anc = ancestors(site)
        R   = the region with a node in anc and after the previous site, latest such node
        at  = first(R) if R else node after previous site (or after inputs)
        move or create start(l) before at; move or create wait(start, l) before site
        if insert_fences and R: fence R's activation inputs

Legend: T tokens, K top-k, H d_model.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.fx as fx
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "LayerSchedule",
    "ScheduleResult",
    "ThemisTracer",
    "mark_attention",
    "is_attention_module",
    "register_layer",
    "layer_module",
    "install_compile_boundaries",
    "schedule_graph",
    "schedule_model",
    "trace_for_schedule",
    "is_spag_start",
    "is_spag_wait",
    "is_moe_experts",
    "is_reduction_fence",
    "is_reduction_wait",
    "attention_regions",
]

ATTENTION_ATTR = "themis_attention"
REGION_KEY = "themis_region"

# ----------------------------------------------------------------------------------------- layer registry
# The ops carry an integer layer id (a custom op cannot take a module); the registry maps it back to the
# sharded experts module of that layer. Weak references: the registry never keeps a model alive.
_LAYERS: dict[int, weakref.ref] = {}
_LAYER_NAMES: dict[int, str] = {}
_NEXT_LAYER_ID = itertools.count()
_REGISTRY_LOCK = threading.Lock()


def register_layer(experts: nn.Module, name: str = "") -> int:
    """Give a layer's sharded experts module an integer id for the ``themis::`` ops (idempotent)."""
    with _REGISTRY_LOCK:
        layer_id = getattr(experts, "_themis_layer_id", None)
        if layer_id is not None and layer_id in _LAYERS and _LAYERS[layer_id]() is experts:
            return layer_id
        layer_id = next(_NEXT_LAYER_ID)
        _LAYERS[layer_id] = weakref.ref(experts)
        _LAYER_NAMES[layer_id] = name or getattr(experts, "layer", "") or f"layer{layer_id}"
        experts._themis_layer_id = layer_id
        return layer_id


def layer_module(layer_id: int) -> nn.Module:
    """The sharded experts module registered under ``layer_id``; raises ValueError if it is gone."""
    ref = _LAYERS.get(int(layer_id))
    module = ref() if ref is not None else None
    if module is None:
        raise ValueError(f"themis layer id {layer_id} is not registered (was its model freed?)")
    return module


def layer_name(layer_id: int) -> str:
    return _LAYER_NAMES.get(int(layer_id), f"layer{layer_id}")


def _call_runtime(layer_id: int, method: str, range_name: str) -> Any:
    # The runtime methods are optional: the EP runtime has no SpAG, a runtime without wait_reduction
    # waits at the end of its own backward. A missing method is a no-op, not an error.
    fn = getattr(layer_module(layer_id), method, None)
    if fn is None:
        return None
    with torch.profiler.record_function(range_name):
        return fn()


# ----------------------------------------------------------------------------------------- the ops
def _token() -> torch.Tensor:
    return torch.zeros(1)


@torch.library.custom_op("themis::spag_start", mutates_args=())
def spag_start(layer: int) -> torch.Tensor:
    """Start SpAG of MoE layer ``layer`` (plan P' by Alg. 1, then the async collective); returns a token."""
    _call_runtime(layer, "start_materialization", "themis::spag_start")
    return _token()


@spag_start.register_fake
def _(layer: int) -> torch.Tensor:
    return torch.empty(1)


@torch.library.custom_op("themis::spag_wait", mutates_args=())
def spag_wait(token: torch.Tensor, layer: int) -> torch.Tensor:
    """The end of layer ``layer``'s SpAG window; returns a token the MoE node consumes (ordering edge).

    The runtime's forward itself waits for the SpAG just before token dispatch (after the router and the
    token-count exchange, i.e. no earlier than this node), and its ``wait_materialization`` hands the
    replicas over to that forward; so this node only marks the window in the graph and the trace.
    """
    with torch.profiler.record_function("themis::spag_window_end"):
        return _token()


@spag_wait.register_fake
def _(token: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty(1)


@torch.library.custom_op("themis::reduction_fence", mutates_args=())
def reduction_fence(x: torch.Tensor, layer: int) -> torch.Tensor:
    """Identity on the input of attention l (compiled graphs); its backward waits for SpRS of layer l."""
    return x.clone()


@reduction_fence.register_fake
def _(x: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("themis::reduction_wait", mutates_args=())
def reduction_wait(grad: torch.Tensor, layer: int) -> torch.Tensor:
    """Wait for SpRS of MoE layer ``layer`` (end of attention l's backward); identity on ``grad``."""
    _call_runtime(layer, "wait_reduction", "themis::sprs_wait")
    return grad.clone()


@reduction_wait.register_fake
def _(grad: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(grad)


def _setup_fence(ctx, inputs, output) -> None:
    ctx.layer = inputs[1]


def _fence_backward(ctx, grad):
    return torch.ops.themis.reduction_wait(grad, ctx.layer), None


reduction_fence.register_autograd(_fence_backward, setup_context=_setup_fence)


class _ReductionFence(torch.autograd.Function):
    """The eager twin of ``themis::reduction_fence``: a view in forward (no copy), SpRS wait in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: int) -> torch.Tensor:
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _call_runtime(ctx.layer, "wait_reduction", "themis::sprs_wait")
        return grad, None


def eager_reduction_fence(x: torch.Tensor, layer: int) -> torch.Tensor:
    """``reduction_fence`` for eager graphs; returns ``x`` unchanged when no gradient flows."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _ReductionFence.apply(x, layer)


torch.fx.wrap("eager_reduction_fence")

# themis::moe_experts keeps the eager autograd graph of the runtime's forward in a stash, keyed by the
# integer in its ``handle`` output; the backward op replays it and drops the entry. Forwards that never
# see a backward (evaluation with gradients enabled) are bounded by dropping the oldest entries of a layer
# beyond _STASH_CAP (pipeline schedules keep at most a few dozen micro-batches in flight).
_STASH: dict[int, collections.OrderedDict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
_STASH_CAP = 64
_NEXT_KEY = itertools.count(1)
# A custom op's implementation runs below autograd (autograd dispatch keys excluded), and inside compiled
# code more keys are excluded. The eager runtime inside themis::moe_experts must record autograd as in
# plain eager mode, so it runs with the dispatch exclude set of a fresh thread.
_EAGER_EXCLUDE = torch._C._dispatch_tls_local_exclude_set()


def _eager_autograd():
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), _EAGER_EXCLUDE)


@torch.library.custom_op("themis::moe_experts", mutates_args=())
def moe_experts(x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, ready: torch.Tensor,
                layer: int, keep_graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The sharded experts of MoE layer ``layer`` on (x_TH, ids_TK, weights_TK), run eagerly, as one node.

    With ``keep_graph`` (the captured graph is a training graph) the eager autograd graph is kept for
    ``themis::moe_experts_backward``: expert parameter gradients accumulate into the parameters directly
    when it is replayed (the runtime's own hooks, e.g. SpRS, run there), so they are not op outputs.
    """
    experts = layer_module(layer)
    forward = getattr(experts, "_themis_eager_forward", experts.forward)
    if not keep_graph or torch.is_inference_mode_enabled():
        with torch.no_grad():
            return forward(x_TH, ids_TK, weights_TK).detach(), torch.zeros((), dtype=torch.int64)
    with _eager_autograd(), torch.enable_grad():
        x_leaf = x_TH.detach().requires_grad_(x_TH.is_floating_point())
        w_leaf = weights_TK.detach().requires_grad_(weights_TK.is_floating_point())
        out_TH = forward(x_leaf, ids_TK, w_leaf)
    key = next(_NEXT_KEY)
    entries = _STASH.setdefault(layer, collections.OrderedDict())
    entries[key] = (x_leaf, w_leaf, out_TH)
    if len(entries) > _STASH_CAP:
        entries.popitem(last=False)
        logger.warning("themis::moe_experts of layer %s: more than %d forwards without a backward; dropping "
                       "the oldest autograd graph", layer_name(layer), _STASH_CAP)
    return out_TH.detach(), torch.full((), key, dtype=torch.int64)


@moe_experts.register_fake
def _(x_TH, ids_TK, weights_TK, ready, layer, keep_graph):
    return torch.empty_like(x_TH), torch.empty((), dtype=torch.int64)


@torch.library.custom_op("themis::moe_experts_backward", mutates_args=())
def moe_experts_backward(grad_TH: torch.Tensor, handle: torch.Tensor, x_TH: torch.Tensor,
                         weights_TK: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of ``themis::moe_experts``: (grad of x_TH, grad of weights_TK)."""
    entry = _STASH.get(layer, {}).pop(int(handle), None)
    if entry is None:
        raise RuntimeError(f"themis::moe_experts_backward of layer {layer_name(layer)!r}: no forward graph for "
                           f"handle {int(handle)} (backward twice, or more than {_STASH_CAP} forwards in flight)")
    x_leaf, w_leaf, out_TH = entry
    with _eager_autograd(), torch.enable_grad():
        torch.autograd.backward([out_TH], [grad_TH.to(out_TH.dtype)])
    grad_x = x_leaf.grad if x_leaf.grad is not None else torch.zeros_like(x_TH)
    grad_w = w_leaf.grad if w_leaf.grad is not None else torch.zeros_like(weights_TK)
    return grad_x, grad_w


@moe_experts_backward.register_fake
def _(grad_TH, handle, x_TH, weights_TK, layer):
    return torch.empty_like(x_TH), torch.empty_like(weights_TK)


def _setup_moe(ctx, inputs, output) -> None:
    x_TH, ids_TK, weights_TK, ready, layer, keep_graph = inputs
    ctx.layer = layer
    ctx.save_for_backward(output[1], x_TH, weights_TK)


def _moe_backward(ctx, grad_TH, grad_handle):
    handle, x_TH, weights_TK = ctx.saved_tensors
    grad_x, grad_w = torch.ops.themis.moe_experts_backward(grad_TH, handle, x_TH, weights_TK, ctx.layer)
    return grad_x, None, grad_w, None, None, None


moe_experts.register_autograd(_moe_backward, setup_context=_setup_moe)


# ----------------------------------------------------------------------------------------- predicates
def _is_op(node: fx.Node, packet: Any) -> bool:
    return node.op == "call_function" and (node.target is packet or node.target is packet.default)


def is_spag_start(node: fx.Node) -> bool:
    return _is_op(node, torch.ops.themis.spag_start)


def is_spag_wait(node: fx.Node) -> bool:
    return _is_op(node, torch.ops.themis.spag_wait)


def is_moe_experts(node: fx.Node) -> bool:
    return _is_op(node, torch.ops.themis.moe_experts)


def is_reduction_fence(node: fx.Node) -> bool:
    return _is_op(node, torch.ops.themis.reduction_fence) or (
        node.op == "call_function" and node.target is eager_reduction_fence)


def is_reduction_wait(node: fx.Node) -> bool:
    return _is_op(node, torch.ops.themis.reduction_wait)


def _layer_arg(node: fx.Node, position: int) -> int:
    if len(node.args) > position:
        return int(node.args[position])
    return int(node.kwargs["layer"])


_SDPA_TARGETS: tuple[Any, ...] = (torch.nn.functional.scaled_dot_product_attention,)
_SDPA_ATEN_NAMES = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def _is_sdpa(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in _SDPA_TARGETS:
        return True
    name = str(getattr(node.target, "__name__", node.target))
    return any(s in name for s in _SDPA_ATEN_NAMES) and "backward" not in name


# ----------------------------------------------------------------------------------------- attention
def mark_attention(module: nn.Module) -> nn.Module:
    """Mark ``module`` as an attention layer (an overlap window) for the scheduling pass; returns it."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"mark_attention expects an nn.Module, got {type(module).__name__}")
    setattr(module, ATTENTION_ATTR, True)
    return module


@functools.lru_cache(maxsize=None)
def _class_calls_attention(cls: type) -> bool:
    forward = getattr(cls, "forward", None)
    if forward is None or forward is nn.Module.forward:
        return False
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return any(s in source for s in ("scaled_dot_product_attention", "flex_attention", "attention_interface"))


def is_attention_module(module: nn.Module) -> bool:
    """True for modules marked with `mark_attention` (or ``themis_attention = True``) and for modules whose
    ``forward`` calls ``F.scaled_dot_product_attention`` (or flex attention / an HF attention interface)."""
    flag = getattr(module, ATTENTION_ATTR, None)
    if flag is not None:
        return bool(flag)
    return _class_calls_attention(type(module))


def _stack_attention_key(node: fx.Node) -> str | None:
    # Innermost module on the node's nn_module_stack whose class calls attention (dynamo/AOT graphs).
    stack = node.meta.get("nn_module_stack") or {}
    for path, cls in reversed(list(stack.values())):
        if isinstance(cls, type) and _class_calls_attention(cls):
            return f"stack:{path}"
    return None


def _attention_key(node: fx.Node, modules: Mapping[str, nn.Module] | None) -> str | None:
    if node.op in ("placeholder", "output", "get_attr"):
        return None
    custom = node.meta.get("custom") or {}
    if custom.get(REGION_KEY) == "attn":
        return f"custom:{custom.get('themis_attn', '')}"
    if node.op == "call_module" and modules is not None:
        module = modules.get(str(node.target))
        if module is not None and is_attention_module(module):
            return f"module:{node.target}"
        return None
    if node.op == "call_function" and not _is_themis(node):
        key = _stack_attention_key(node)
        if key is not None:
            return key
        if _is_sdpa(node):
            return f"sdpa:{node.name}"
    return None


def _is_themis(node: fx.Node) -> bool:
    return (is_spag_start(node) or is_spag_wait(node) or is_moe_experts(node) or is_reduction_fence(node)
            or is_reduction_wait(node))


def attention_regions(graph: fx.Graph, modules: Mapping[str, nn.Module] | None = None) -> dict[str, list[fx.Node]]:
    """Attention regions of ``graph``: key -> its nodes in graph order (see the Contract for how found)."""
    regions: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        key = _attention_key(node, modules)
        if key is not None:
            regions.setdefault(key, []).append(node)
    return regions


# ----------------------------------------------------------------------------------------- the pass
@dataclass(frozen=True)
class LayerSchedule:
    """Where the pass put one MoE layer's collectives.

    Attributes:
        layer: the layer id (see `register_layer`).
        moe: name of the MoE node.
        attention: key of the attention region whose window SpAG runs in; ``None`` when it fell back.
        start_before: name of the node the SpAG start sits immediately before.
        fallback: True when no preceding attention was found (start at the earliest legal point).
        fences: names of the reduction fences on the attention's inputs (SpRS wait in backward).
    """

    layer: int
    moe: str
    attention: str | None
    start_before: str
    fallback: bool
    fences: tuple[str, ...] = ()


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _first_compute(graph: fx.Graph) -> fx.Node:
    for node in graph.nodes:
        if node.op not in ("placeholder", "get_attr"):
            return node
    raise ValueError("graph has no output node")


def _is_activation(node: fx.Node) -> bool:
    # Fence only computed activations: graph inputs (parameters or user inputs) have no producer whose
    # backward could be the "end of attention backward".
    return node.op not in ("placeholder", "get_attr")


def _fence_inputs(graph: fx.Graph, region: list[fx.Node], layer: int, eager: bool) -> list[fx.Node]:
    members = set(region)
    inputs: list[fx.Node] = []
    for node in region:
        for inp in node.all_input_nodes:
            if inp not in members and inp not in inputs and _is_activation(inp) and not is_reduction_fence(inp):
                val = inp.meta.get("example_value", inp.meta.get("val"))
                if val is not None and not (isinstance(val, torch.Tensor) and val.is_floating_point()):
                    continue
                inputs.append(inp)
    fences = []
    target = eager_reduction_fence if eager else torch.ops.themis.reduction_fence.default
    for inp in inputs:
        with graph.inserting_after(inp):
            fence = graph.call_function(target, (inp, layer))
        fence.meta.update({k: v for k, v in inp.meta.items() if k in ("val", "example_value", "tensor_meta")})
        for node in region:
            node.replace_input_with(inp, fence)
        fences.append(fence)
    return fences


def _existing_fences(region: list[fx.Node]) -> list[fx.Node]:
    return [inp for node in region for inp in node.all_input_nodes if is_reduction_fence(inp)]


def schedule_graph(
    graph: fx.Graph,
    moe_sites: Mapping[fx.Node, int] | None = None,
    *,
    modules: Mapping[str, nn.Module] | None = None,
    insert_fences: bool = False,
    eager: bool = False,
) -> list[LayerSchedule]:
    """Place SpAG start/wait (and optionally SpRS fences) of every MoE site of ``graph``; see the Contract.

    Args:
        graph: the FX graph, modified in place.
        moe_sites: MoE node -> layer id; default: the ``themis::moe_experts`` nodes of the graph.
        modules: qualified name -> module, to recognise attention ``call_module`` nodes (eager graphs).
        insert_fences: insert ``reduction_fence`` on the activation inputs of each window's attention.
        eager: use the eager fence (a view with an autograd backward) instead of the custom op.

    Returns one `LayerSchedule` per MoE site, in graph order.
    """
    # Step 0: MoE sites and the themis nodes already in the graph (compiled graphs carry them).
    if moe_sites is None:
        moe_sites = {n: _layer_arg(n, 4) for n in graph.nodes if is_moe_experts(n)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    sites = sorted(moe_sites.items(), key=lambda kv: order[kv[0]])
    starts: dict[int, list[fx.Node]] = {}
    waits: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        if is_spag_start(node):
            starts.setdefault(_layer_arg(node, 0), []).append(node)
        elif is_spag_wait(node):
            waits.setdefault(_layer_arg(node, 1), []).append(node)

    # Step 1: attention regions.
    regions = attention_regions(graph, modules)
    region_of: dict[fx.Node, str] = {n: key for key, nodes in regions.items() for n in nodes}
    used_regions: set[str] = set()

    results: list[LayerSchedule] = []
    previous_site: fx.Node | None = None
    for site, layer in sites:
        # Step 2: the attention preceding this MoE site in data flow, after the previous MoE site.
        lower = order[previous_site] if previous_site is not None else -1
        best: fx.Node | None = None
        for anc in _ancestors(site):
            key = region_of.get(anc)
            if key is None or key in used_regions or order[anc] <= lower:
                continue
            if best is None or order[anc] > order[best]:
                best = anc
        key = region_of[best] if best is not None else None
        if key is not None and order[regions[key][0]] <= lower:
            key = None  # the region starts before the previous MoE: not this layer's window
        if key is not None:
            used_regions.add(key)
            anchor = regions[key][0]
        elif previous_site is not None:
            anchor = previous_site.next
        else:
            anchor = _first_compute(graph)

        # Step 3: one start, immediately before the anchor.
        layer_starts = starts.get(layer, [])
        start = layer_starts[0] if layer_starts else None
        if start is None:
            with graph.inserting_before(anchor):
                start = graph.call_function(torch.ops.themis.spag_start.default, (layer,))
        elif start is not anchor:
            anchor.prepend(start)
        for extra in layer_starts[1:]:
            extra.replace_all_uses_with(start)
            graph.erase_node(extra)

        # Step 4: one wait, immediately before the MoE site, consuming the start's token.
        layer_waits = waits.get(layer, [])
        wait = layer_waits[0] if layer_waits else None
        if wait is None:
            with graph.inserting_before(site):
                wait = graph.call_function(torch.ops.themis.spag_wait.default, (start, layer))
        else:
            wait.args = (start, *wait.args[1:])
            if wait.next is not site:
                site.prepend(wait)
        for extra in layer_waits[1:]:
            extra.replace_all_uses_with(wait)
            graph.erase_node(extra)

        # Step 5: SpRS fences on the inputs of the window's attention.
        fences: list[fx.Node] = []
        if key is not None:
            fences = _existing_fences(regions[key])
            if insert_fences and not fences:
                fences = _fence_inputs(graph, regions[key], layer, eager)
        order = {n: i for i, n in enumerate(graph.nodes)}
        results.append(LayerSchedule(layer=layer, moe=site.name, attention=key, start_before=start.next.name,
                                     fallback=key is None, fences=tuple(f.name for f in fences)))
        previous_site = site

    graph.lint()
    for r in results:
        logger.debug("themis schedule: layer %s (%s): SpAG start before %s (%s), wait before %s",
                     r.layer, layer_name(r.layer), r.start_before,
                     "fallback" if r.fallback else f"window {r.attention}", r.moe)
    return results


# ----------------------------------------------------------------------------------------- eager path
class ThemisTracer(fx.Tracer):
    """``torch.fx`` tracer keeping attention modules and the given MoE blocks as leaf ``call_module`` nodes."""

    def __init__(self, moe_blocks: Iterable[nn.Module] = ()) -> None:
        super().__init__()
        self._moe_ids = {id(m) for m in moe_blocks}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if id(m) in self._moe_ids or is_attention_module(m):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def trace_for_schedule(module: nn.Module, moe_blocks: Iterable[nn.Module] = ()) -> fx.GraphModule:
    """Symbolic-trace ``module`` with attention modules and ``moe_blocks`` as leaves."""
    tracer = ThemisTracer(moe_blocks)
    graph = tracer.trace(module)
    return fx.GraphModule(tracer.root, graph, module.__class__.__name__)


@dataclass
class ScheduleResult:
    """What `schedule_model` did.

    Attributes:
        graphs: qualified name of each traced module -> its scheduled GraphModule (installed as forward).
        layers: per MoE layer name, its `LayerSchedule`.
        untraced: MoE layer names left to the runtime's own start (no traceable module contains them).
    """

    graphs: dict[str, fx.GraphModule]
    layers: dict[str, LayerSchedule]
    untraced: list[str]


def _moe_blocks(model: nn.Module, layers: Mapping[str, nn.Module]) -> dict[str, tuple[nn.Module, nn.Module]]:
    """layer name -> (MoE block module, its sharded experts). ``layers`` maps block names to experts."""
    named = dict(model.named_modules())
    blocks = {}
    for name, experts in layers.items():
        block = named.get(name)
        if block is None:
            # a name that is not a module path: the experts' parent is the block
            block = next((m for m in named.values() if any(c is experts for c in m.children())), experts)
        blocks[name] = (block, experts)
    return blocks


def install_compile_boundaries(model: nn.Module, layers: Mapping[str, nn.Module]) -> dict[str, int]:
    """Make ``model`` compile as whole graphs: each sharded experts module becomes ``spag_start ->
    spag_wait -> themis::moe_experts`` under ``torch.compile`` (eager calls are unchanged), and each attention
    module is annotated ``themis_region="attn"`` in compiled graphs. Returns layer name -> layer id."""
    ids = {}
    for name, experts in layers.items():
        layer = register_layer(experts, name)
        ids[name] = layer
        if "_themis_eager_forward" not in experts.__dict__:
            eager = experts.forward
            experts._themis_eager_forward = eager
            experts.forward = functools.partial(_boundary_forward, eager, layer)
    for name, module in model.named_modules():
        if is_attention_module(module) and "_themis_attn_forward" not in module.__dict__:
            eager = module.forward
            module._themis_attn_forward = eager
            module.forward = functools.partial(_annotated_forward, eager, name)
    return ids


def _boundary_forward(eager: Callable, layer: int, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                      weights_TK: torch.Tensor) -> torch.Tensor:
    if not torch.compiler.is_compiling():
        return eager(x_TH, ids_TK, weights_TK)
    token = torch.ops.themis.spag_start(layer)
    ready = torch.ops.themis.spag_wait(token, layer)
    out_TH, _handle = torch.ops.themis.moe_experts(x_TH, ids_TK, weights_TK, ready, layer,
                                                   torch.is_grad_enabled())
    return out_TH


def _annotated_forward(eager: Callable, name: str, *args, **kwargs):
    if not torch.compiler.is_compiling():
        return eager(*args, **kwargs)
    with torch.fx.traceback.annotate({REGION_KEY: "attn", "themis_attn": name}):
        return eager(*args, **kwargs)


def _scheduled_forward(original: Callable, gm: fx.GraphModule, *args, **kwargs):
    # Under torch.compile the original forward is traced (the "themis" backend schedules that graph);
    # the eager FX graph is for eager execution only.
    if torch.compiler.is_compiling():
        return original(*args, **kwargs)
    return gm(*args, **kwargs)


def _try_schedule(module: nn.Module, qualname: str, blocks: dict[str, tuple[nn.Module, nn.Module]],
                  ids: Mapping[str, int], result: ScheduleResult) -> bool:
    inside = {name: b for name, b in blocks.items() if any(m is b[0] for m in module.modules())}
    if not inside:
        return True
    if any(b[0] is module for b in inside.values()):
        return False  # a MoE block itself is a leaf, not a graph to schedule
    try:
        gm = trace_for_schedule(module, [b[0] for b in inside.values()])
    except Exception as exc:  # noqa: BLE001 - any tracing failure means: try the children
        logger.debug("themis schedule: cannot trace %s (%s); trying its children", qualname or "<root>", exc)
        ok = True
        for child_name, child in module.named_children():
            ok &= _try_schedule(child, f"{qualname}.{child_name}" if qualname else child_name, blocks, ids, result)
        return ok
    modules = dict(gm.named_modules())
    sites = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            for name, (block, _experts) in inside.items():
                if modules.get(str(node.target)) is block:
                    sites[node] = ids[name]
    by_id = {ids[name]: name for name in inside}
    for sched in schedule_graph(gm.graph, sites, modules=modules, insert_fences=True, eager=True):
        result.layers[by_id[sched.layer]] = sched
    gm.recompile()
    original = module.forward
    # Not registered as a submodule: parameter names and the state dict stay those of the user's model.
    module.__dict__["_themis_scheduled_graph"] = gm
    module.forward = functools.partial(_scheduled_forward, original, gm)
    result.graphs[qualname or "<root>"] = gm
    return True


def schedule_model(model: nn.Module, layers: Mapping[str, nn.Module] | None = None) -> ScheduleResult:
    """Schedule the sparse collectives of an optimized ``model`` (eager and compiled paths).

    Args:
        model: a model returned by ``themis_compile.optimize``.
        layers: MoE block name -> sharded experts; default ``runtime_of(model).layers``.

    Installs the compile boundaries (`install_compile_boundaries`), traces the model — or, where the
    model's own forward does not trace, its smallest traceable submodules that contain MoE blocks — with
    attention modules and MoE blocks as leaves, runs `schedule_graph` with SpRS fences, and makes each
    scheduled graph the forward of its module for eager execution. Idempotent.
    """
    if layers is None:
        from themis_compile.api import runtime_of

        layers = runtime_of(model).layers
    if not layers:
        raise ValueError("schedule_model: the model has no sharded MoE layer (call themis_compile.optimize first)")
    result = ScheduleResult(graphs={}, layers={}, untraced=[])
    ids = install_compile_boundaries(model, layers)
    if getattr(model, "_themis_schedule", None) is not None:
        return model._themis_schedule
    blocks = _moe_blocks(model, layers)
    _try_schedule(model, "", blocks, ids, result)
    result.untraced = [name for name in layers if name not in result.layers]
    for name in result.untraced:
        logger.warning("themis schedule: MoE layer %s is in no traceable module; its SpAG starts at the "
                       "layer's own forward (no overlap with attention)", name)
    model.__dict__["_themis_schedule"] = result
    fallbacks = [n for n, s in result.layers.items() if s.fallback]
    logger.info("themis schedule: %d MoE layers scheduled into attention windows, %d at the earliest legal "
                "point, %d untraced", len(result.layers) - len(fallbacks), len(fallbacks), len(result.untraced))
    return result
