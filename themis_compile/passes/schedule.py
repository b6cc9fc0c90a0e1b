"""Schedule each MoE layer's sparse collectives into the preceding attention's compute window (§4.2).

The paper issues layer l's SparseAllGather (SpAG) during the forward of the attention layer before it,
and overlaps the SparseReduceScatter (SpRS) of layer l, together with the re-materialization SpAG of
layer l-1, with the backward of attention l (Fig. 1c). This module is that placement: `schedule_graph`,
an FX pass over the ``themis::`` ops of `themis_compile.passes.ops`, and `schedule_model`, which applies
it to an optimized model (FX where the model traces, module hooks where it does not).

Three ways one placement reaches a model:

(a) eager, traceable: `schedule_model` traces the smallest modules containing MoE blocks with ``torch.fx``
    (attention modules and MoE blocks as leaves), runs `schedule_graph` with SpRS fences and installs the
    scheduled graph as the module's forward;
(b) eager, not traceable (HF decoder layers, data-dependent Python, activation checkpointing inside the
    forward): `themis_compile.passes.windows.WindowHooks` learns each layer's attention from the order in
    which modules run in the first forward and places the same start and fence with module hooks;
(c) compiled: under ``torch.compile`` the MoE experts call becomes ``themis::spag_start`` ->
    ``themis::spag_wait`` -> ``themis::moe_experts`` (adjacent, `install_compile_boundaries`), attention
    modules are annotated with ``node.meta["custom"]["themis_region"] == "attn"``, and the "themis" backend
    (`themis_compile.passes.backend`) runs `schedule_graph` on the dynamo graph and on the AOT forward graph.

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

Contract of `schedule_model`
    Assumes: ``model`` went through ``themis_compile.optimize`` (its MoE experts are sharded runtime
    modules, or ``layers`` names them).
    Guarantees: every MoE layer is scheduled by exactly one of (a) and (b), (a) where it finds the layer's
    attention window; the user's parameters, state dict and forward wrappers (activation checkpointing,
    FSDP2, DDP) are kept: a module is traced only if its forward is its class's and tracing it sees no
    checkpointing, saved-tensor hooks or grad-mode change; idempotent.

Pseudo-code
    install_compile_boundaries(model)                                          # (c)
    for each smallest traceable module M containing MoE blocks:               # (a)
        gm = trace(M); schedule_graph(gm, fences); M.forward = gm
    WindowHooks(model, layers not in a graph or whose graph found no window)   # (b)

Legend: T tokens, K top-k, H d_model.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.fx as fx
from torch import nn

from themis_compile.attention import REGION_KEY, class_calls_attention, is_attention_module, mark_attention
from themis_compile.passes.ops import (
    eager_reduction_fence,
    install_compile_boundaries,
    is_boundary_forward,
    is_moe_experts,
    is_reduction_fence,
    is_reduction_wait,
    is_spag_start,
    is_spag_wait,
    is_themis_op,
    layer_arg,
    layer_module,
    layer_name,
    register_layer,
)
from themis_compile.passes.windows import LayerWindow, WindowHooks
from themis_compile.runtime.ep import ShardedExperts

logger = logging.getLogger(__name__)

_RESULT_ATTR = "_themis_schedule"      # where a model keeps its ScheduleResult (not a submodule or parameter)

__all__ = [
    "LayerSchedule",
    "ScheduleResult",
    "ThemisTracer",
    "UntraceableForward",
    "attention_regions",
    "schedule_graph",
    "schedule_model",
    "schedule_of",
    "sharded_layers",
    "trace_for_schedule",
    # re-exported from passes.attention and passes.ops, where they live
    "mark_attention",
    "is_attention_module",
    "register_layer",
    "layer_module",
    "install_compile_boundaries",
    "is_spag_start",
    "is_spag_wait",
    "is_moe_experts",
    "is_reduction_fence",
    "is_reduction_wait",
]


# ----------------------------------------------------------------------------------------- attention regions
_SDPA_TARGETS: tuple[Any, ...] = (torch.nn.functional.scaled_dot_product_attention,)
_SDPA_ATEN_NAMES = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


def _is_sdpa(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in _SDPA_TARGETS:
        return True
    name = str(getattr(node.target, "__name__", node.target))
    return any(s in name for s in _SDPA_ATEN_NAMES) and "backward" not in name


def _stack_attention_key(node: fx.Node) -> str | None:
    # Innermost module on the node's nn_module_stack whose class calls attention (dynamo/AOT graphs).
    stack = node.meta.get("nn_module_stack") or {}
    for path, cls in reversed(list(stack.values())):
        if isinstance(cls, type) and class_calls_attention(cls):
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
    if node.op == "call_function" and not is_themis_op(node):
        key = _stack_attention_key(node)
        if key is not None:
            return key
        if _is_sdpa(node):
            return f"sdpa:{node.name}"
    return None


def attention_regions(graph: fx.Graph, modules: Mapping[str, nn.Module] | None = None) -> dict[str, list[fx.Node]]:
    """Attention regions of ``graph``: key -> its nodes in graph order (see the Contract for how found)."""
    regions: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        key = _attention_key(node, modules)
        if key is not None:
            regions.setdefault(key, []).append(node)
    return regions


# ----------------------------------------------------------------------------------------- the graph pass
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
        moe_sites = {n: layer_arg(n, 4) for n in graph.nodes if is_moe_experts(n)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    sites = sorted(moe_sites.items(), key=lambda kv: order[kv[0]])
    starts: dict[int, list[fx.Node]] = {}
    waits: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        if is_spag_start(node):
            starts.setdefault(layer_arg(node, 0), []).append(node)
        elif is_spag_wait(node):
            waits.setdefault(layer_arg(node, 1), []).append(node)

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


# ----------------------------------------------------------------------------------------- (a) eager, FX
class UntraceableForward(RuntimeError):
    """Tracing would not record what the forward does (activation checkpointing, saved-tensor hooks, a
    grad-mode change): the traced graph would silently drop it."""


def _autograd_context() -> tuple[bool, Any]:
    # (grad mode, innermost saved-tensor hooks): what activation checkpointing and offloading change
    return torch.is_grad_enabled(), torch._C._autograd._top_saved_tensors_default_hooks(False)


class ThemisTracer(fx.Tracer):
    """``torch.fx`` tracer keeping attention modules and the given MoE blocks as leaf ``call_module`` nodes.

    It raises `UntraceableForward` when a node is recorded under another autograd context than the trace
    began in: ``torch.utils.checkpoint`` (non-reentrant: saved-tensor hooks; reentrant: no grad), its
    ``checkpoint_wrapper``/``apply_activation_checkpointing`` and HF ``gradient_checkpointing_enable()``
    forms, ``save_on_cpu``, ``torch.no_grad()`` blocks — none of which an FX graph records.
    """

    def __init__(self, moe_blocks: Iterable[nn.Module] = ()) -> None:
        super().__init__()
        self._moe_ids = {id(m) for m in moe_blocks}
        self._context = _autograd_context()

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if id(m) in self._moe_ids or is_attention_module(m):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def create_node(self, *args, **kwargs) -> fx.Node:
        if _autograd_context() != self._context:
            raise UntraceableForward("the forward runs code under activation checkpointing, saved-tensor hooks "
                                     "or another grad mode, which an FX graph does not record")
        return super().create_node(*args, **kwargs)


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
        layers: per MoE layer name scheduled in a graph, its `LayerSchedule`.
        untraced: MoE layer names in no traceable module; `hooks` schedules them.
        hooks: the `WindowHooks` of the layers in ``untraced`` and of graph layers without a window there
            (None when every layer has a window in a graph); its ``windows`` are known after the first forward.
    """

    graphs: dict[str, fx.GraphModule]
    layers: dict[str, LayerSchedule]
    untraced: list[str]
    hooks: WindowHooks | None = None

    @property
    def windows(self) -> dict[str, LayerWindow]:
        """Per MoE layer scheduled by hooks, its `LayerWindow` (empty before the first forward)."""
        return {} if self.hooks is None or self.hooks.windows is None else dict(self.hooks.windows)


def sharded_layers(model: nn.Module) -> dict[str, nn.Module]:
    """MoE block name -> its sharded experts module (what ``optimize`` put into ``model``)."""
    return {name.rpartition(".")[0]: m for name, m in model.named_modules() if isinstance(m, ShardedExperts)}


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


def _scheduled_forward(original: Callable, gm: fx.GraphModule, *args, **kwargs):
    # Under torch.compile the original forward is traced (the "themis" backend schedules that graph);
    # the eager FX graph is for eager execution only.
    if torch.compiler.is_compiling():
        return original(*args, **kwargs)
    return gm(*args, **kwargs)


def _own_forward(module: nn.Module) -> bool:
    # A forward set on the instance (a user's checkpoint wrapper, a hook library) is not what a trace of
    # the class forward would record, and installing the graph in its place would drop the wrapper.
    forward = module.__dict__.get("forward")
    return forward is None or is_boundary_forward(forward)


def optional_parameters(module: nn.Module) -> list[str]:
    """The parameters of ``module``'s forward a caller may leave out (a default, ``*args``, ``**kwargs``).

    A symbolic trace sees each as a proxy, so the forward's Python branches on them (``if labels is None``,
    ``num_items_in_batch`` or not, HF's ``return_dict``) are taken one way for good, and a graph installed
    in its place would compute that branch whatever the caller passes (and return a plain dict for a
    ``ModelOutput``): such a forward is not replaced; its children are scheduled instead."""
    try:
        sig = inspect.signature(type(module).forward)
    except (TypeError, ValueError):
        return ["<unknown signature>"]
    return [name for name, p in list(sig.parameters.items())[1:]
            if p.default is not inspect.Parameter.empty
            or p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def _try_schedule(module: nn.Module, qualname: str, blocks: dict[str, tuple[nn.Module, nn.Module]],
                  ids: Mapping[str, int], result: ScheduleResult) -> None:
    inside = {name: b for name, b in blocks.items() if any(m is b[0] for m in module.modules())}
    if not inside or any(b[0] is module for b in inside.values()):
        return  # nothing to schedule here, or a MoE block itself (a leaf, not a graph)
    gm = None
    if _own_forward(module) and (optional := optional_parameters(module)):
        logger.debug("themis schedule: %s's forward takes optional %s; scheduling its children",
                     qualname or "<root>", ", ".join(optional))
    elif _own_forward(module):
        try:
            gm = trace_for_schedule(module, [b[0] for b in inside.values()])
        except Exception as exc:  # noqa: BLE001 - any tracing failure means: try the children
            logger.debug("themis schedule: cannot trace %s (%s); trying its children", qualname or "<root>", exc)
    if gm is None:
        for child_name, child in module.named_children():
            _try_schedule(child, f"{qualname}.{child_name}" if qualname else child_name, blocks, ids, result)
        return
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


# ----------------------------------------------------------------------------------------- the model
def schedule_of(model: nn.Module) -> ScheduleResult | None:
    """The `ScheduleResult` of `schedule_model` on ``model``, or None if it was not scheduled."""
    return model.__dict__.get(_RESULT_ATTR)


def schedule_model(model: nn.Module, layers: Mapping[str, nn.Module] | None = None) -> ScheduleResult:
    """Schedule the sparse collectives of an optimized ``model`` (eager and compiled paths); see the Contract.

    Args:
        model: a model returned by ``themis_compile.optimize`` (the module the user calls).
        layers: MoE block name -> sharded experts; default `sharded_layers(model)`.

    Returns the `ScheduleResult`, also kept on the model (a second call returns it unchanged).
    """
    done = schedule_of(model)
    if done is not None:
        return done
    layers = sharded_layers(model) if layers is None else dict(layers)
    if not layers:
        raise ValueError("schedule_model: the model has no sharded MoE layer (call themis_compile.optimize first)")
    # Step 1: compile boundaries (c).
    ids = install_compile_boundaries(model, layers)
    blocks = _moe_blocks(model, layers)
    # Step 2: FX graphs of the smallest traceable modules containing MoE blocks (a).
    result = ScheduleResult(graphs={}, layers={}, untraced=[])
    _try_schedule(model, "", blocks, ids, result)
    result.untraced = [name for name in layers if name not in result.layers]
    # Step 3: module hooks for the rest, from the order modules run in the first forward (b).
    fallbacks = [name for name, s in result.layers.items() if s.fallback]
    hooked = result.untraced + fallbacks
    if hooked:
        result.hooks = WindowHooks(model, {name: (blocks[name][0], ids[name]) for name in hooked},
                                   upgrade_only=fallbacks)
    model.__dict__[_RESULT_ATTR] = result
    logger.info("themis schedule: %d MoE layers scheduled into attention windows in FX graphs, %d at the "
                "earliest legal point there, %d by module hooks from the first forward's order",
                len(result.layers) - len(fallbacks), len(fallbacks), len(result.untraced))
    return result
