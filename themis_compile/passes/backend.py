"""The ``torch.compile`` backend "themis": the scheduling pass inside torch.compile, then inductor.

    model = themis_compile.optimize(model)
    compiled = torch.compile(model, backend="themis", fullgraph=True)

What it does with each graph dynamo captures:

1. Checks that the graph contains themis MoE layers (``themis::moe_experts`` nodes, which a model
   optimized under themis / themis-rm produces under compile). A graph without any is compiled by plain
   inductor. That is normal for a model ``optimize`` prepared (its other graphs after a graph break, every
   graph under policy ep, which has no collective to schedule); when no optimized module is being run
   (none on the Python stack of the compilation: the model was not passed through ``optimize``), the
   backend says so once, with a ``RuntimeWarning`` and a log line (``make_themis_backend(strict=True)``
   raises instead), never silently nothing.
2. Runs `themis_compile.passes.schedule.schedule_graph` on the dynamo graph: each layer's SpAG start moves
   before the preceding attention (found by the ``themis_region`` annotations), and SpRS fences go on the
   attention inputs, whose backward waits for SpRS at the end of attention l's backward.
3. Hands the graph to inductor through ``compile_fx(..., inner_compile=...)``: the pass runs again on the
   AOT forward graph (the same logic on the custom-op nodes; idempotent) and the backward graph is checked,
   with inductor settings that keep the FX order (``reorder_for_peak_memory=False`` — its default hoists
   waits next to their starts —, ``reorder_for_locality=False``, no compute/comm reordering).

The backend is found under the name "themis" through the ``torch_dynamo_backends`` entry point of the
installed package (``torch._dynamo.list_backends()`` lists it). Importing this module registers nothing;
`register_backend` registers the name for a source tree that is not installed, and ``optimize`` calls it.
"""

from __future__ import annotations

import logging
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from themis_compile.passes import schedule as _schedule

logger = logging.getLogger(__name__)

__all__ = ["themis_backend", "make_themis_backend", "INDUCTOR_SETTINGS", "CompileReport", "last_report"]

# inductor settings that keep the FX order the pass chose (verified on torch 2.13, see docs/compiler.md).
INDUCTOR_SETTINGS: dict[str, Any] = {
    "reorder_for_peak_memory": False,
    "reorder_for_locality": False,
    "reorder_for_compute_comm_overlap": False,
}


@dataclass
class CompileReport:
    """What the backend did to the graphs of the last compilation (for tests and inspection)."""

    dynamo: list[list[_schedule.LayerSchedule]] = field(default_factory=list)
    forward: list[list[_schedule.LayerSchedule]] = field(default_factory=list)
    backward_fences: list[int] = field(default_factory=list)    # SpRS waits found per backward graph
    graphs_without_moe: int = 0
    unoptimized_warnings: int = 0                                # "not optimized" warnings given (at most 1)
    forward_order: list[list[str]] = field(default_factory=list)  # node names of each AOT forward graph


_REPORT = CompileReport()


def last_report() -> CompileReport:
    """The `CompileReport` accumulated since the last `reset_report` (process-wide)."""
    return _REPORT


def reset_report() -> None:
    global _REPORT
    _REPORT = CompileReport()


def _has_moe(gm: fx.GraphModule) -> bool:
    return any(_schedule.is_moe_experts(n) for n in gm.graph.nodes)


def _is_optimized(module: nn.Module) -> bool:
    # The root optimize() prepared carries its runtime (torch.compile's wrapper holds the root as
    # _orig_mod); a part of an optimized model compiled on its own may hold sharded experts, which carry
    # their owner table.
    root = getattr(module, "_orig_mod", module)
    return getattr(root, "_themis_runtime", None) is not None or any(hasattr(m, "owner_E") for m in root.modules())


def _optimized_module_running() -> bool:
    """Whether a module ``optimize`` prepared is being run by the Python frames that led to this compilation.

    The graph alone cannot tell: after a graph break dynamo compiles whatever frame comes next (a router
    helper, the token exchange), and under policy ep no graph has a themis node. The module whose call
    started it all is on the stack, though (its ``__call__``, or the ``torch.compile`` wrapper).
    """
    frame, seen = sys._getframe(1), set()
    while frame is not None:
        for value in frame.f_locals.values():
            # A module, or one passed on in an argument tuple (torch.compile(step)(model, batch)).
            for candidate in (value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(candidate, nn.Module) and id(candidate) not in seen:
                    seen.add(id(candidate))
                    if _is_optimized(candidate):
                        return True
        frame = frame.f_back
    return False


def _inner_compile(gm: fx.GraphModule, example_inputs, **kwargs):
    from torch._inductor.compile_fx import compile_fx_inner

    if kwargs.get("is_backward", False):
        _REPORT.backward_fences.append(sum(_schedule.is_reduction_wait(n) for n in gm.graph.nodes))
    elif _has_moe(gm):
        _REPORT.forward.append(_schedule.schedule_graph(gm.graph))
        _REPORT.forward_order.append([n.name for n in gm.graph.nodes])
        gm.recompile()
    return compile_fx_inner(gm, example_inputs, **kwargs)


def make_themis_backend(strict: bool = False) -> Callable:
    """A "themis" backend; with ``strict=True`` compiling a model that ``optimize`` did not prepare raises
    ValueError (instead of one warning)."""

    def backend(gm: fx.GraphModule, example_inputs, **kwargs):
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        if not _has_moe(gm):
            _REPORT.graphs_without_moe += 1
            if (strict or not _REPORT.unoptimized_warnings) and not _optimized_module_running():
                msg = ("torch.compile(backend='themis'): the model being compiled was not passed through "
                       "themis_compile.optimize(model), so there is nothing to schedule; compiling it with "
                       "plain inductor.")
                if strict:
                    raise ValueError(msg)
                _REPORT.unoptimized_warnings += 1
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
                logger.warning(msg)
            return compile_fx(gm, example_inputs)
        _REPORT.dynamo.append(_schedule.schedule_graph(gm.graph, insert_fences=True))
        gm.recompile()
        with inductor_config.patch(INDUCTOR_SETTINGS):
            return compile_fx(gm, example_inputs, inner_compile=_inner_compile)

    backend.__name__ = "themis_backend_strict" if strict else "themis_backend"
    return backend


themis_backend = make_themis_backend()
"""The "themis" backend (``torch.compile(model, backend="themis")``)."""


def register_backend() -> None:
    """Make ``torch.compile(backend="themis")`` resolve to :data:`themis_backend` (idempotent)."""
    from torch._dynamo.backends import registry

    # When dynamo resolves "themis" through the package's entry point it imports this module and then
    # registers the loaded function itself; registering here too would be a duplicate. Register only when
    # the name is neither registered nor pending as a discovered entry point.
    if "themis" in registry._COMPILER_FNS or registry._BACKENDS.get("themis") is not None:
        return
    registry.register_backend(compiler_fn=themis_backend, name="themis")
