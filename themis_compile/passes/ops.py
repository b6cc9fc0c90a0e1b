"""The ``themis::`` ops and their bridge to the runtime: what the scheduling pass places in a graph.

Each op is one opaque node in any FX graph (dynamo, AOT forward/backward, eager trace) and carries an
integer layer id; the layer registry maps it back to that layer's sharded experts module (the runtime),
whose optional methods the ops call:

- ``themis::spag_start(layer) -> token``: plan P' (Alg. 1) and start SpAG of MoE layer ``layer``
  (``start_materialization()``; idempotent within an iteration; skipped in a forward that activation
  checkpointing replays inside backward, see `start_spag`).
- ``themis::spag_wait(token, layer) -> ready``: the end of the SpAG window, just before the MoE block
  (the runtime's forward waits for the SpAG itself, at token dispatch, which is no earlier).
- ``themis::moe_experts(x_TH, ids_TK, weights_TK, ready, layer, keep_graph) -> (out_TH, handle)``: the
  sharded experts of a layer as one opaque node under ``torch.compile`` (the runtime runs eagerly inside;
  its autograd graph is kept for ``themis::moe_experts_backward``).
- ``themis::reduction_fence(x, layer) -> x``: identity in forward on the input of attention l; its
  backward (``themis::reduction_wait``) waits for SpRS of MoE layer l (``wait_reduction()``), i.e. at the
  end of attention l's backward. `eager_reduction_fence` is its eager twin (a view, no copy).

The runtime itself starts SpRS of layer l right after the MoE backward, and the re-materialization SpAG
of layer l-1 when layer l's MoE backward ends, so both run in attention l's backward window.

`install_compile_boundaries` is the other half of the bridge: it makes a sharded experts call compile to
``spag_start -> spag_wait -> moe_experts`` and annotates attention forwards, so that an optimized model
compiles as whole graphs the "themis" backend can schedule. The node predicates (`is_spag_start`, ...)
are how the passes recognise these ops. This module imports neither the passes nor the public API.

Legend: T tokens, K top-k, H d_model.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading
import weakref
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch import nn

from themis_compile.attention import REGION_KEY, is_attention_module

logger = logging.getLogger(__name__)

__all__ = [
    "register_layer",
    "layer_module",
    "layer_name",
    "in_backward",
    "start_spag",
    "wait_sprs",
    "eager_reduction_fence",
    "install_compile_boundaries",
    "is_boundary_forward",
    "is_spag_start",
    "is_spag_wait",
    "is_moe_experts",
    "is_reduction_fence",
    "is_reduction_wait",
    "is_themis_op",
    "layer_arg",
]

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


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def start_spag(layer_id: int) -> None:
    """Start SpAG of layer ``layer_id`` now (``start_materialization``): the start of its overlap window.

    Skipped inside a backward pass: a forward that activation checkpointing replays there is a
    recomputation under the plan of the original forward, which the runtime keeps; starting a new
    iteration's SpAG from it would plan again and issue a collective no other rank expects.
    """
    if not in_backward():
        _call_runtime(layer_id, "start_materialization", "themis::spag_start")


def wait_sprs(layer_id: int) -> None:
    """Wait for the pending SpRS of layer ``layer_id`` (``wait_reduction``): the end of its window."""
    _call_runtime(layer_id, "wait_reduction", "themis::sprs_wait")


# ----------------------------------------------------------------------------------------- the ops
def _token() -> torch.Tensor:
    return torch.zeros(1)


@torch.library.custom_op("themis::spag_start", mutates_args=())
def spag_start(layer: int) -> torch.Tensor:
    """Start SpAG of MoE layer ``layer`` (plan P' by Alg. 1, then the async collective); returns a token."""
    start_spag(layer)
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
    wait_sprs(layer)
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
        wait_sprs(ctx.layer)
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


def layer_arg(node: fx.Node, position: int) -> int:
    """The integer layer id a themis node carries at ``position`` (or as ``layer=``)."""
    if len(node.args) > position:
        return int(node.args[position])
    return int(node.kwargs["layer"])


def is_themis_op(node: fx.Node) -> bool:
    return (is_spag_start(node) or is_spag_wait(node) or is_moe_experts(node) or is_reduction_fence(node)
            or is_reduction_wait(node))


# ----------------------------------------------------------------------------------------- compile boundaries
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


def is_boundary_forward(forward: Any) -> bool:
    """True for a forward `install_compile_boundaries` set on a module (it adds nothing in eager mode)."""
    return isinstance(forward, functools.partial) and forward.func in (_boundary_forward, _annotated_forward)


def _annotated_forward(eager: Callable, name: str, *args, **kwargs):
    if not torch.compiler.is_compiling():
        return eager(*args, **kwargs)
    with torch.fx.traceback.annotate({REGION_KEY: "attn", "themis_attn": name}):
        return eager(*args, **kwargs)
