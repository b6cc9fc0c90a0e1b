"""The ``torch.compile`` backend "themis": the scheduling pass inside torch.compile, then inductor.

    model = themis_compile.optimize(model)
    compiled = torch.compile(model, backend="themis", fullgraph=True)

What it does with each graph dynamo captures:

1. Checks that the graph contains themis MoE layers (``themis::moe_experts`` nodes, which an optimized
   model produces under compile). A graph without any is compiled by plain inductor with a loud
   ``RuntimeWarning`` that names the likely cause (the model was not optimized, or the MoE layers sit in
   another graph); ``make_themis_backend(strict=True)`` raises instead. Either way, never silently nothing.
2. Runs `themis_compile.passes.schedule.schedule_graph` on the dynamo graph: each layer's SpAG start moves
   before the preceding attention (found by the ``themis_region`` annotations), and SpRS fences go on the
   attention inputs, whose backward waits for SpRS at the end of attention l's backward.
3. Hands the graph to inductor through ``compile_fx(..., inner_compile=...)``: the pass runs again on the
   AOT forward graph (the same logic on the custom-op nodes; idempotent) and the backward graph is checked,
   with inductor settings that keep the FX order (``reorder_for_peak_memory=False`` — its default hoists
   waits next to their starts —, ``reorder_for_locality=False``, no compute/comm reordering).

The backend is registered under the name "themis" when this module is imported and through the
``torch_dynamo_backends`` entry point of the package (``torch._dynamo.list_backends()`` lists it).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

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
    """A "themis" backend; with ``strict=True`` a graph without themis MoE layers raises ValueError."""

    def backend(gm: fx.GraphModule, example_inputs, **kwargs):
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        if not _has_moe(gm):
            _REPORT.graphs_without_moe += 1
            msg = ("torch.compile(backend='themis'): this graph contains no themis MoE layer, so there is "
                   "nothing to schedule; was the model passed through themis_compile.optimize(model) before "
                   "torch.compile? Compiling it with plain inductor.")
            if strict:
                raise ValueError(msg)
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


def _register() -> None:
    from torch._dynamo.backends import registry

    # When dynamo resolves "themis" through the package's entry point it imports this module and then
    # registers the loaded function itself; registering here too would be a duplicate. Register only when
    # the name is neither registered nor pending as a discovered entry point.
    if "themis" in registry._COMPILER_FNS or registry._BACKENDS.get("themis") is not None:
        return
    registry.register_backend(compiler_fn=themis_backend, name="themis")


_register()
