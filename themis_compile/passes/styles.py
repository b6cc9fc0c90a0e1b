"""The styles of MoE block ``optimize`` serves, one row each, and the pass that applies them.

A style is one way people write an MoE block: how its forward reaches its experts (a ``ModuleList``
looped over inline, a torchtitan-like ``experts(rows sorted by expert, counts)``, stacked weights of the
block's own indexed by expert id, ...). The runtime swaps one interface only, ``experts(x_TH, ids_TK,
weights_TK) -> out_TH`` over a module holding the experts; each style is what it takes to bring a block
written that way to it. One :class:`Style` row says, for its style:

- how a block of it is found: ``found_by``, the analyses of :data:`themis_compile.passes.detect.ANALYSES`
  that return it (for the styles read off one experts call, the matcher of
  :data:`themis_compile.passes.find_behaviour.CALL_STYLES` named as the style);
- how the block calls its experts (``call``: the sentence the logs, :func:`describe_layer` and
  ``explain`` give);
- how it is rewritten so that it makes the runtime's call (``plan``, made on the original before the
  check; ``apply``, in place on a module);
- what the rewrite is checked against on a probe before any layer of the model changes (``reference``:
  the trial's experts run as the sharded runtime runs them, each expert alone; ``gradients``: the
  gradient check beside the output check).

Priority is the detection's, written once with its analyses (:data:`~themis_compile.passes.detect.
ANALYSES`: the first analysis that finds a layer wins unless a later one supersedes its style) and its
call styles (:data:`~themis_compile.passes.find_behaviour.CALL_STYLES`: the first matcher of the call
wins); :data:`STYLES` lists the rows in that order, and a test holds the two to each other.

A new style is a matcher (an analysis of its own, or a row of ``CALL_STYLES``), its row here and a test
of its own; ``tests/passes/test_styles.py`` runs every row's example through the contract.

Contract:
    ``prepare_moe_layers(model)`` detects the MoE layers, rewrites a copy of each layer that needs it
    (sharing parameters and buffers) with its style's ``apply``, checks it against the original on a
    probe (outputs in train and eval mode; gradients where the style says), and only when every check
    passes rewrites the layers themselves. A check that fails raises ``ValueError`` naming the layer and
    the style, and the model is left unchanged.

Shape suffixes: T tokens, H hidden size, E experts, K top-k.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from themis_compile.layer_info import MoELayerInfo
from themis_compile.passes.candidates import RuntimeReference
from themis_compile.passes.detect import SEARCHED, check_layer, find_moe_layers
from themis_compile.passes.joined import apply_joined
from themis_compile.passes.own_weights import BatchedCall, PerRowCall, ServedOwnWeightsExperts, apply_own_weights
from themis_compile.passes.parallel_lists import apply_param_lists, apply_parallel_lists
from themis_compile.passes.probe import PROBE_SEED, probe_input, probing_as_recorded
from themis_compile.passes.replay import ReplayPlan, apply_replay, gradient_mismatch
from themis_compile.passes.shard import (CALL_REWRITES, ExpertLoop, PerSlotCall, ZeroExpertsCall,
                                         all_rows_rewrite_classes, call_rewrite_classes, plan_rewrite,
                                         served_block_class, verify_rewrite, verify_rewrite_gradients,
                                         wrapped_loop_class)
from themis_compile.runtime.experts import wrapped_expert_list

logger = logging.getLogger(__name__)

__all__ = ["Style", "STYLES", "style_of", "describe_layer", "rewrite_moe_layer", "prepare_moe_layers", "prepare_found",
           "left_as_they_are"]


# --- The rewrites, one per style ----------------------------------------------------------------------

def _apply_call(info: MoELayerInfo) -> None:
    """A call style (per-slot, sorted-rows, dispatch-mask, flatten, scores-call): the block's forward runs
    unchanged with its experts attribute seen as an adapter making the runtime's call."""
    experts = info.experts
    block_cls, experts_cls = call_rewrite_classes(type(info.module), type(experts), info.experts_attr,
                                                   info.rewrite, info.num_experts, info.plan, info.call_tail)
    info.module.__class__ = block_cls
    experts.__class__ = experts_cls
    logger.info("MoE layer %s: %s(x, ids) served by one %s(x, ids, weights) call", info.name,
                info.experts_attr, info.experts_attr)


def _apply_zero_experts(info: MoELayerInfo) -> None:
    info.module.__class__ = served_block_class(type(info.module), info.experts_attr,
                                                lambda experts: ZeroExpertsCall(experts, info.num_experts))
    logger.info("MoE layer %s: the %d zero (identity) experts of %s served by the block, the %d others by one "
                "%s(x, ids, weights) call", info.name, info.zero_experts, info.experts_attr, info.num_experts,
                info.experts_attr)


def _apply_all_rows(info: MoELayerInfo) -> None:
    experts = info.experts
    block_cls, experts_cls = all_rows_rewrite_classes(type(info.module), type(experts), info.experts_attr,
                                                       info.plan)
    info.module.__class__ = block_cls
    experts.__class__ = experts_cls
    logger.info("MoE layer %s: %s(x [E*T, H]) served by one %s(x, ids, weights) call on %s", info.name,
                info.experts_attr, info.experts_attr,
                f"the nonzero rows (top-{info.plan.slots})" if info.plan.sparse else "every row")


def _apply_joined(info: MoELayerInfo) -> None:
    apply_joined(info.module, info.plan, layer=info.name)
    logger.info("MoE layer %s: %s and %s joined into %s, served by one %s(x, ids, weights) call", info.name,
                info.plan.first, info.plan.second, info.experts_attr, info.experts_attr)


def _apply_own_weights(info: MoELayerInfo) -> None:
    plan = info.plan
    apply_own_weights(info.module, plan)
    info.module._modules[info.experts_attr].__class__ = ServedOwnWeightsExperts
    call = {"per-slot": PerSlotCall, "per-row": lambda experts: PerRowCall(experts, plan.out_middle),
            "expert-batched": BatchedCall}[plan.form]
    info.module.__class__ = served_block_class(type(info.module), info.experts_attr, call)
    logger.info("MoE layer %s: its stacked weights %s and the code applying them moved into %s, served by one "
                "%s(x, ids, weights) call", info.name, ", ".join(plan.names), info.experts_attr, info.experts_attr)


def _apply_parallel_lists(info: MoELayerInfo) -> None:
    apply_parallel_lists(info.module, info.plan)
    apply_replay(info.module, info.experts_attr, info.plan.replay, layer=info.name)
    logger.info("MoE layer %s: entry e of %s and of %s joined into %s[e], served by one %s(x, ids, weights) "
                "call (capture and replay)", info.name, info.plan.first, info.plan.second, info.experts_attr,
                info.experts_attr)


def _apply_entries(what: str) -> Callable[[MoELayerInfo], None]:
    """The param-lists and indexed-weights rewrites: the same reading, entry e of each list (of a
    ParameterList, or of the stacked weights' leading dimension) moved into expert e."""
    def apply(info: MoELayerInfo) -> None:
        apply_param_lists(info.module, info.plan)
        apply_replay(info.module, info.experts_attr, info.plan.replay, layer=info.name)
        logger.info("MoE layer %s: " + what + ", served by one %s(x, ids, weights) call (capture and replay)",
                    info.name, ", ".join(info.plan.lists), info.experts_attr, info.experts_attr)

    return apply


def _apply_replay(info: MoELayerInfo) -> None:
    plan = info.plan if isinstance(info.plan, ReplayPlan) else ReplayPlan(num_experts=info.num_experts)
    apply_replay(info.module, info.experts_attr, plan, layer=info.name)
    logger.info("MoE layer %s: expert calls served by one %s(x, ids, weights) call (capture and replay)",
                info.name, info.experts_attr)


def _apply_graph(info: MoELayerInfo) -> None:
    """A graph rewrite (inline-loop, dense-dispatch): the block's class becomes a subclass whose forward is
    its traced graph with the experts part replaced by one call (``info.plan``, :func:`plan_rewrite`)."""
    plan = info.plan if info.plan is not None else plan_rewrite(info)
    module = info.module
    for name, value in plan.constants.items():
        module.register_buffer(name, value, persistent=False)
    module.__class__ = plan.cls
    if wrapped_expert_list(info.experts) is not None:
        # A wrapper keeps its list (and so its parameter names), called as experts(x, ids, weights).
        info.experts.__class__ = wrapped_loop_class(type(info.experts))
    else:
        setattr(module, info.experts_attr, ExpertLoop(list(info.experts)))
    logger.info("MoE layer %s: expert loop rewritten to one %s(x, ids, weights) call", info.name, info.experts_attr)


# --- The checks beyond equal outputs ------------------------------------------------------------------

def _graph_gradients(info: MoELayerInfo, trial: nn.Module, probe: torch.Tensor) -> None:
    verify_rewrite_gradients(info.module, trial, probe, layer=info.name)


def _probe_gradients(info: MoELayerInfo, trial: nn.Module, probe: torch.Tensor) -> None:
    if (why := gradient_mismatch(info.module, trial, probe, PROBE_SEED)) is not None:
        raise ValueError(f"MoE layer {info.name!r}: the {info.rewrite} rewrite does not reproduce the gradients of "
                         f"the original on a probe input ({why}); the model was left unchanged")


# --- The table ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Style:
    """One style of MoE block: how it is found, how it calls its experts, how it is rewritten to the
    runtime's ``experts(x, ids, weights)`` call and what the rewrite is checked against."""

    name: str                                              # MoELayerInfo.rewrite
    found_by: tuple[str, ...]                              # the analyses of passes.detect.ANALYSES returning it
    written_by: str                                        # who writes MoE blocks so
    call: Callable[[MoELayerInfo], str]                    # how the block calls its experts, one sentence
    apply: Callable[[MoELayerInfo], None] | None = None    # the rewrite, in place (None: nothing to rewrite)
    plan: Callable[[MoELayerInfo], Any] | None = None      # made on the original before the check
    reference: bool = True       # the check runs the trial's experts as the runtime will, each expert alone
    gradients: Callable[[MoELayerInfo, nn.Module, torch.Tensor], None] | None = None   # beside equal outputs


_ONE_CALL = "(rewritten to one experts(x, ids, weights) call)"
_REPLAY = "(capture and replay: one experts(x, ids, weights) call between two passes of the forward)"

# In detection's priority order (passes.detect.ANALYSES, then passes.find_behaviour.CALL_STYLES).
STYLES: tuple[Style, ...] = (
    Style("none", ("routing", "behaviour"), "HF transformers >= 5, torchtitan-like blocks",
          lambda i: f"calls {i.experts_attr}(x, ids, weights), the runtime's own interface", reference=False),
    Style("zero-experts", ("routing", "behaviour"), "HF LongCat-Flash",
          lambda i: f"calls {i.experts_attr}(x, ids, weights) with ids in [0, E + Z): the {i.zero_experts} ids >= E "
                    "add weight * x (served by the rewrite), the others go to the runtime",
          apply=_apply_zero_experts, gradients=_probe_gradients),
    Style("inline-loop", ("routing",), "HF transformers < 5 (Mixtral, Qwen2-MoE), fairseq, DeepSeek",
          lambda i: f"loops over the experts of '{i.experts_attr}' inline {_ONE_CALL}", apply=_apply_graph,
          plan=plan_rewrite, reference=False),
    Style("replay", ("routing", "behaviour"), "loops FX cannot trace; HF Switch's ModuleDict before v5",
          lambda i: f"calls the experts of '{i.experts_attr}' one by one in a forward FX cannot trace {_REPLAY}",
          apply=_apply_replay, gradients=_probe_gradients),
    Style("dense-dispatch", ("dense-dispatch",), "GShard, fairseq Top2Gate, Tutel",
          lambda i: f"runs each expert of '{i.experts_attr}' on its [C, H] capacity slots between [T, E, C] "
                    f"dispatch and combine tensors {_ONE_CALL}",
          apply=_apply_graph, plan=plan_rewrite, reference=False, gradients=_graph_gradients),
    Style("joined", ("behaviour",), "JetMoE (ParallelExperts halves)",
          lambda i: f"calls two halves of its experts on rows sorted by expert, row-wise code between them (joined "
                    f"into '{i.experts_attr}') {_ONE_CALL}",
          apply=_apply_joined, gradients=_probe_gradients),
    Style("dispatch-mask", ("behaviour",), "HF Switch Transformers >= 5",
          lambda i: f"calls {i.experts_attr}(x, one-hot mask [T, K, E], weights) {_ONE_CALL}", apply=_apply_call),
    Style("scores-call", ("behaviour",), "HF DBRX before v5",
          lambda i: f"calls {i.experts_attr}(x, scores [T, E], weights, ids) in some order {_ONE_CALL}",
          apply=_apply_call),
    Style("sorted-rows", ("behaviour",), "torchtitan GroupedExperts, Megatron-Core SequentialMLP",
          lambda i: f"calls {i.experts_attr}(rows sorted by expert, counts) {_ONE_CALL}", apply=_apply_call),
    Style("per-slot", ("behaviour",), "gpt-fast ConditionalFeedForward",
          lambda i: f"calls {i.experts_attr}(x, ids) -> [T, K, H] {_ONE_CALL}", apply=_apply_call),
    Style("all-rows", ("behaviour",), "HF Llama 4",
          lambda i: f"calls {i.experts_attr}(x [E*T, H]), every expert on every row {_ONE_CALL}",
          apply=_apply_all_rows, gradients=_probe_gradients),
    Style("flatten", ("behaviour",), "HF DBRX",
          lambda i: f"calls {i.experts_attr}(x [B, S, H], ids, weights) (rewritten to one call on flat x [T, H])",
          apply=_apply_call),
    Style("own-weights", ("own-weights",), "blocks gathering their own stacked [E, ...] weights by id (einsum, bmm)",
          lambda i: f"applies stacked [E, ...] parameters of its own inline (moved into '{i.experts_attr}') "
                    f"{_ONE_CALL}",
          apply=_apply_own_weights, gradients=_probe_gradients),
    Style("indexed-weights", ("own-weights",), "loops over experts indexing stacked weights, self.w1[e]",
          lambda i: f"applies stacked [E, ...] parameters of its own indexed by expert id, w[e], per expert (moved "
                    f"into '{i.experts_attr}') {_REPLAY}",
          apply=_apply_entries("its stacked weights %s, indexed by expert id, and the code applying them moved "
                               "into %s"), gradients=_probe_gradients),
    Style("parallel-lists", ("parallel-lists",), "two ModuleLists of nn.Linear, up and down projections",
          lambda i: f"calls entry e of each of two parallel ModuleLists per expert (joined into "
                    f"'{i.experts_attr}') {_REPLAY}",
          apply=_apply_parallel_lists, gradients=_probe_gradients),
    Style("param-lists", ("param-lists",), "experts as nn.ParameterLists applied with F.linear",
          lambda i: f"applies entry e of each of its ParameterLists per expert (moved into '{i.experts_attr}') "
                    f"{_REPLAY}",
          apply=_apply_entries("entry e of %s and the code applying them moved into %s[e]"),
          gradients=_probe_gradients),
)

_BY_NAME = {style.name: style for style in STYLES}
assert set(CALL_REWRITES) <= set(_BY_NAME)


def style_of(info: MoELayerInfo) -> Style:
    """The row of ``info``'s style; ValueError naming the layer for a style no row serves."""
    try:
        return _BY_NAME[info.rewrite]
    except KeyError:
        raise ValueError(f"MoE layer {info.name!r}: unknown style {info.rewrite!r} (known: "
                         f"{', '.join(_BY_NAME)})") from None


def describe_layer(info: MoELayerInfo) -> str:
    """One line about a layer found: its experts, router, activation, shared experts and how it calls its
    experts (its style's ``call``), as the logs and ``explain`` say it."""
    shared = ", ".join(info.shared_expert_names) if info.shared_expert_names else "no"
    zero = f" + {info.zero_experts} zero (identity) experts" if info.zero_experts else ""
    text = (f"{info.num_experts} experts{zero} ({info.experts_form}, '{info.experts_attr}'), top-{info.top_k}, "
            f"router {info.router}, activation {info.activation}, shared experts: {shared}; "
            f"{style_of(info).call(info)}")
    if info.aux_losses:
        text += f"; auxiliary: {'; '.join(info.aux_losses)}"
    if info.tied_to:
        text += f"; experts tied to {info.tied_to!r}'s (served by its sharded experts)"
    return text


# --- The pass -----------------------------------------------------------------------------------------

def rewrite_moe_layer(info: MoELayerInfo) -> None:
    """Make ``info.module`` call its experts as ``experts(x_TH, ids_TK, weights_TK)``, in place, with its
    style's ``apply`` (nothing to do for style "none" or a layer already rewritten). ``info.plan``, when
    set, is used instead of planning again."""
    style = style_of(info)
    if style.apply is None or info.rewritten:
        return
    style.apply(info)
    info.rewritten = True


def _probe_for(info: MoELayerInfo) -> torch.Tensor:
    return probe_input(info.module, info.hidden_size, flat=info.probe_flat)


def prepare_moe_layers(model: nn.Module, strict: bool = False, *, example_inputs=None) -> list[MoELayerInfo]:
    """Detect the MoE layers of ``model``, rewrite those whose style needs it, check each rewrite on a
    probe, and return the layers ready for sharding (``getattr(info.module, info.experts_attr)`` is what
    the runtime replaces).

    No MoE layer found: warn naming what was searched and what was rejected and return ``[]`` (the model
    is unchanged), or raise ``ValueError`` when ``strict``. A layer whose rewrite cannot be made or does
    not reproduce the original on the probe is left as it is with a warning naming it and why (its
    experts stay dense: data-parallel under ``optimize``); with ``strict`` it raises ``ValueError``
    naming the layer, and no layer of the model is changed then. A layer found with recorded inputs
    (``example_inputs``, see ``find_moe_layers``) is checked with them.
    """
    infos, rejected = find_moe_layers(model, example_inputs)
    with probing_as_recorded(infos):
        prepared, left = prepare_found(infos, rejected, strict)
    if left:
        warnings.warn(left_as_they_are(left), UserWarning, stacklevel=2)
    return prepared


def left_as_they_are(left: list[tuple[str, str]], who: str = "themis_compile", fate: str = "data-parallel") -> str:
    """The warning for MoE layers whose rewrite failed its check (:func:`prepare_found`'s second result)."""
    return "\n".join([f"{who}: {len(left)} MoE layer(s) left as they are (their rewrite failed its check on a "
                       f"probe): their experts stay dense parameters, {fate}; strict=True raises instead"]
                      + [f"  {name}: {why}" for name, why in left])


def _check_on_a_copy(info: MoELayerInfo) -> None:
    """Rewrite a copy of ``info.module`` (sharing its parameters and buffers) with its style and compare it
    with the original on a probe; ValueError naming the layer when the rewrite cannot be made or differs."""
    style = style_of(info)
    if style.plan is not None:
        info.plan = style.plan(info)
    shared = {id(t): t for t in itertools.chain(info.module.parameters(), info.module.buffers())}
    # Tensors a forward stored on the modules (DeepSpeed's self.l_aux, with its autograd history) are
    # shared too: a non-leaf tensor cannot be deep-copied, and the probes restore attributes anyway.
    shared.update({id(v): v for m in info.module.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)})
    trial = copy.deepcopy(info.module, shared)
    rewrite_moe_layer(dataclasses.replace(info, module=trial))
    if style.reference:
        # The trial computes its experts exactly as the sharded runtime will (each expert alone).
        trial._modules[info.experts_attr] = RuntimeReference(trial._modules[info.experts_attr],
                                                             info.num_experts, info.skips_empty_experts)
    verify_rewrite(info.module, trial, _probe_for(info), layer=info.name)
    if style.gradients is not None:
        style.gradients(info, trial, _probe_for(info))


def prepare_found(infos: list[MoELayerInfo], rejected: list[tuple[str, str]], strict: bool = False
                  ) -> tuple[list[MoELayerInfo], list[tuple[str, str]]]:
    """:func:`prepare_moe_layers` on what ``find_moe_layers`` returned (``optimize`` detects once, reports
    what it will not shard, then prepares the layers it found; layers found with recorded inputs are
    probed so inside ``probing_as_recorded(infos)``): (the layers ready for sharding, [(name, why)] of the
    layers left as they are because their rewrite failed its check, and of the layers tied to those)."""
    if not infos:
        msg = f"themis_compile found no MoE layer (searched for {SEARCHED})"
        if rejected:
            msg += "; rejected: " + "; ".join(f"{n}: {why}" for n, why in rejected)
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=3)
        return [], []
    for info in infos:
        check_layer(info)
    for name, why in rejected:
        logger.warning("MoE-like module %s left as it is: %s", name, why)

    # Check every rewrite on a copy before touching any layer.
    left: dict[str, str] = {}
    for info in infos:
        if style_of(info).apply is None or info.rewritten:
            continue
        try:
            _check_on_a_copy(info)
        except ValueError as why:
            if strict:
                raise
            left[info.name] = str(why)
    for info in infos:           # one sharded module serves tied layers: they follow the layer they are tied to
        if info.tied_to in left:
            left[info.name] = f"its experts are tied to those of {info.tied_to!r}, which is left as it is"
    prepared = [info for info in infos if info.name not in left]
    for info in prepared:
        rewrite_moe_layer(info)
    return prepared, list(left.items())
