"""Find the MoE layers of an arbitrary model by what its blocks compute, never by class name.

A module is an MoE layer (the unit FSSDP shards, paper §3.1) when it routes each token to K of E experts
by a learned router's scores and combines the experts' outputs weighted by the router: found by one of the
analyses of :data:`ANALYSES`, each in a module of its own —

- :mod:`~themis_compile.passes.find_routing`: the routing code itself (FX graph with the experts, each
  expert and MLP-like children as leaves; the calls a probe records where FX cannot trace): a router
  scoring E experts, a top-k (``torch.topk``, or ``max`` / ``argmax`` for top-1, a sort cut to k) and the
  weighted combine, the experts called as ``experts(x, ids, weights)`` or looped over inline; or each
  expert run once on capacity slots between dense ``[T, E, C]`` dispatch and combine tensors (GShard);
- :mod:`~themis_compile.passes.find_behaviour`: whatever the routing code (masks, group limits, bias
  corrections), the experts child swapped for a stand-in on a probe and its one call read by the matchers
  of ``CALL_STYLES`` (per slot, sorted rows, a one-hot mask, unflattened, every row, dense scores, two
  halves joined); a whole-module call is accepted only when it computes what the sharded runtime computes
  (:func:`~themis_compile.passes.candidates.combine_mismatch`);
- :mod:`~themis_compile.passes.find_weights`: experts that are not a module (stacked weights of the
  block's own, ParameterLists, parallel ModuleLists), their uses recorded on a probe.

Each layer found records its style (``MoELayerInfo.rewrite``): the row of
:data:`themis_compile.passes.styles.STYLES` that rewrites it to the runtime's one call. What a candidate
block holds and the checks the analyses share live in :mod:`themis_compile.passes.candidates`; the probes
in :mod:`themis_compile.passes.probe`, the tracers and node predicates in
:mod:`themis_compile.passes.fx_graph`.

Contract:
    ``find_moe_layers(model, example_inputs)`` is read-only: probes run under ``torch.no_grad`` with the
    RNG forked and every module attribute and buffer restored afterwards. A candidate whose forward
    fails on hidden states alone is probed again with the arguments recorded in one forward of the
    model (``example_inputs``, or synthesized token ids for an HF model), the hidden states replaced by
    the probe's (:func:`record_inputs`, :func:`recorded_inputs`); no such forward runs otherwise.
    Modules that look MoE-like but fail a check are returned as ``(name, reason)``, the reason saying
    what was seen and what would make the layer work. A layer whose experts are an earlier found layer's
    (the same parameters: tied weights) records it in ``tied_to``, and the runtime serves both with one
    sharded experts module; layers whose experts share only some parameters with another's are rejected
    (:func:`_tied_experts`). Experts stacking zero (identity) experts after the real ones become the
    zero-experts style (:func:`zero_experts_layer`).

Pseudo-code:
    for module in model.named_modules():
        if inside the experts of a layer found: skip
        for analysis in ANALYSES (in order, when it runs):                  # the rule: see ANALYSES
            layer, or None, or Reject(reason) = analysis.find(module)
            the first layer wins unless a later analysis supersedes its style
        no layer: the most telling rejection is the module's reason
        layer: zero experts? skips experts without tokens? (skips_empty_experts)
    if a candidate's forward fails on probe hidden states: record the (args, kwargs) it gets in one
    forward of the model on example_inputs (or synthesized token ids) and inspect it again, each
    probe's hidden states in place of the recorded ones                              # recorded inputs
    experts the same parameters as an earlier layer's: tied_to it; some shared: reject  # tied experts

Shape suffixes: B batch, S sequence, T tokens, H hidden size, E experts, K top-k.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

from torch import nn

from themis_compile.layer_info import MoELayerInfo
from themis_compile.passes.candidates import (CallReject, NoSelection, ProbeFailed, Reject, router_widths,
                                              shared_experts_by_probe, skipped_expert_gradient,
                                              wrapped_experts_children)
from themis_compile.passes.find_behaviour import find_by_behaviour
from themis_compile.passes.find_routing import find_by_routing, find_dense_dispatch
from themis_compile.passes.find_weights import (own_weights_layer, parallel_expert_lists_reason, parallel_lists_layer,
                                                param_lists_layer)
from themis_compile.passes.probe import (NOT_CALLED, ExampleInputs, ExpertsStandIn, probe_input, record_inputs,
                                         recorded_call, recorded_inputs, run_probe)
from themis_compile.passes.replay import inline_expert_weights_reason
from themis_compile.runtime.experts import ExpertBank, expert_modules, zero_expert_rows

logger = logging.getLogger(__name__)


def zero_experts_layer(info: MoELayerInfo | None) -> MoELayerInfo | None:
    """``info`` for the zero-experts rewrite when its experts stack zero (identity) experts after the real
    ones (:func:`~themis_compile.runtime.experts.zero_expert_rows`; :func:`combine_mismatch` proved the
    call on a probe): E the real experts, Z the zero ones, the router's width E + Z. Such experts are
    served only when called as ``experts(x, ids, weights)``; any other call of them is rejected."""
    if info is None or zero_expert_rows(info.experts) is None:
        return info
    bank = ExpertBank(info.experts, layer=info.name)
    if info.rewrite != "none":
        raise Reject(f"'{info.experts_attr}' holds {bank.num_zero_experts} zero-expert rows after its "
                      f"{bank.num_experts} experts ({', '.join(bank.zero_rows)}) and is served only when called as "
                      f"{info.experts_attr}(x, ids, weights) (its call: {info.rewrite})")
    E, Z = bank.num_experts, bank.num_zero_experts
    router = info.router
    path, width, H = next((r for r in router_widths(info.module, info.experts) if r[1] == E + Z),
                          (info.router_path or None, E + Z, info.hidden_size))
    if "]: " in router:
        router = f"'{path}' [E={width}, H={H}]: " + router.split("]: ", 1)[1]
    return dataclasses.replace(info, num_experts=E, zero_experts=Z, rewrite="zero-experts", router=router,
                               router_path=path or "")


def skips_empty_experts(info: MoELayerInfo) -> bool:
    """Whether the layer's own code runs only the experts that receive tokens (NLLB's and Switch's
    ``ModuleDict`` loops, DeepSeek-V3's ``if num_tokens == 0: continue``), decided on a probe.

    In one process such an expert gets no gradient on a step where no token reached it (``.grad`` stays
    None, and AdamW skips it: no momentum step, no weight decay), where an expert run on empty rows gets a
    zero gradient. The runtime reproduces whichever the user's code does (``ShardedExperts.
    skips_empty_experts``). Stacked ``[E, ...]`` weights are one tensor whose gradient one process always
    has: False.

    Pseudo-code:
        if the experts are stacked: False
        experts(x, ids, weights) of a module with a forward: call it with no id routed to expert 0;
            skips = expert 0 got no .grad
        a loop of the block's own, or a wrapper's on rows sorted by expert: one probe token reaches k < E
            experts; skips = some expert was never called
        capture and replay: what its probe found (ReplayPlan.skips_empty)
    """
    module, experts, attr = info.module, info.experts, info.experts_attr
    if expert_modules(experts) is None:       # (a ModuleDict found by behaviour is per-expert modules too)
        return False
    x = probe_input(module, info.hidden_size, flat=info.probe_flat)
    if info.rewrite == "none" and type(experts).forward is not nn.Module.forward:
        stand_in = ExpertsStandIn(experts)
        setattr(module, attr, stand_in)
        try:
            run_probe(module, x)
        finally:
            setattr(module, attr, experts)
        x_TH, ids_TK, weights_TK = stand_in.calls[0]
        return skipped_expert_gradient(experts, x_TH, ids_TK, weights_TK, info.num_experts)
    if info.rewrite in ("replay", "parallel-lists", "param-lists"):
        return bool(getattr(info.plan, "skips_empty", False))     # decided by capture and replay's probe
    if info.rewrite not in ("none", "inline-loop", "sorted-rows") or info.top_k >= info.num_experts:
        return False
    # A loop of the block's own (inline, or through a helper over a container without a forward), or of
    # a wrapper called on rows sorted by expert (Megatron-Core SequentialMLP; one that skips a split
    # without rows leaves that expert without gradient in one process).
    if recorded_call(module) is not None:
        raise ValueError("its forward needs the arguments recorded in a forward of the model and loops over its "
                         "experts itself, so no one-token probe can tell whether it skips experts without tokens; "
                         f"call its experts once as {attr}(x, ids, weights)")
    calls = [0] * info.num_experts
    hooks = [m.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, m in enumerate(expert_modules(experts))]
    try:
        run_probe(module, x[:1] if info.probe_flat else x[:1, :1])
    finally:
        for h in hooks:
            h.remove()
    return any(calls) and not all(calls)


@dataclass(frozen=True)
class Analysis:
    """One way of reading a candidate block: ``find(name, module)`` returns the layer it sees (its
    ``rewrite`` names the style, :data:`themis_compile.passes.styles.STYLES`), None when it sees none, or
    raises :class:`~themis_compile.passes.candidates.Reject` with what stops the block from being served."""

    name: str
    find: Callable[[str, nn.Module], MoELayerInfo | None]
    # Whether it reads the block, given the rejections of the analyses before it.
    runs: Callable[[nn.Module, list[Reject]], bool] = lambda module, rejected: True
    final: bool = False                 # its rejection ends the search: it recognized the block for sure
    supersedes: tuple[str, ...] = ()    # styles an earlier analysis found that it replaces when it finds one


def _or_reason(find: Callable[[str, nn.Module], MoELayerInfo | None], reason: Callable[[nn.Module], str | None]
               ) -> Callable[[str, nn.Module], MoELayerInfo | None]:
    """``find``, rejecting with ``reason(module)`` where it sees no layer and a reason is given."""
    def find_or_reject(name: str, module: nn.Module) -> MoELayerInfo | None:
        if (info := find(name, module)) is not None:
            return info
        if (why := reason(module)) is not None:
            raise Reject(why)
        return None

    return find_or_reject


def _unrejected(module: nn.Module, rejected: list[Reject]) -> bool:
    return not rejected


# The analyses, in priority order. The rule, once: each analysis that runs reads the block in turn; the
# first that finds the layer wins, unless a later one supersedes the style it found (then that one runs
# too, and wins if it finds the layer). Where none finds it, the reason given is the first rejection's,
# unless it says only that no selection was found (NoSelection) or a later analysis read the experts call
# (CallReject): each of those gives way to the next rejection. A final analysis's rejection is the reason.
ANALYSES: tuple[Analysis, ...] = (
    # A top-k over a learned router's scores in the FX graph (or the calls a probe records): describes the
    # router best. Styles "none", "inline-loop", "replay".
    Analysis("routing", find_by_routing),
    # Experts one by one on capacity slots of dense [T, E, C] tensors (GShard, traced or not): fits those
    # better than the loop rewrite or capture and replay, which would route every capacity slot, empty
    # ones included, as a row of its own.
    Analysis("dense-dispatch", find_dense_dispatch, final=True, supersedes=("inline-loop", "replay"),
             runs=lambda module, rejected: bool(rejected) or bool(wrapped_experts_children(module))),
    # The experts child swapped for a stand-in on a probe: the shape of its one call says the style
    # (passes.find_behaviour.CALL_STYLES).
    Analysis("behaviour", find_by_behaviour),
    # Experts that are not a module (passes.find_weights), tried on blocks no analysis above rejected.
    Analysis("own-weights", _or_reason(own_weights_layer, inline_expert_weights_reason), runs=_unrejected),
    Analysis("parallel-lists", parallel_lists_layer, runs=_unrejected),
    Analysis("param-lists", _or_reason(param_lists_layer, parallel_expert_lists_reason), runs=_unrejected),
)


def _most_telling(rejected: list[Reject]) -> Reject:
    """The reason :data:`ANALYSES`' rule gives among the rejections, in the order the analyses made them."""
    best = rejected[0]
    for why in rejected[1:]:
        if isinstance(best, NoSelection) or isinstance(why, CallReject):
            best = why
    return best


def _inspect(name: str, module: nn.Module) -> MoELayerInfo | None:
    """The layer ``module`` is, by :data:`ANALYSES` and their rule; None when it does not look MoE-like;
    raises Reject with the reason when it looks MoE-like but cannot be served."""
    if type(module).forward is nn.Module.forward:
        return None   # a container without a forward of its own (a ModuleDict of experts) is never called
    found: MoELayerInfo | None = None
    rejected: list[Reject] = []
    for i, analysis in enumerate(ANALYSES):
        if found is not None and found.rewrite not in analysis.supersedes:
            continue
        if found is None and not analysis.runs(module, rejected):
            continue
        try:
            info = analysis.find(name, module)
        except Reject as why:
            if analysis.final:
                raise
            rejected.append(why)
            continue
        if info is None:
            continue
        if found is not None or not any(info.rewrite in later.supersedes for later in ANALYSES[i + 1:]):
            return info
        found = info
    if found is not None:
        return found
    if rejected:
        raise _most_telling(rejected)
    return None


def check_layer(info: MoELayerInfo) -> None:
    """Raise ValueError naming the layer when it cannot be sharded as found (a top-k outside [1, E])."""
    if info.top_k < 1:
        raise ValueError(f"MoE layer {info.name!r}: top_k={info.top_k} must be >= 1")
    if info.top_k > info.num_experts:
        raise ValueError(f"MoE layer {info.name!r}: top_k={info.top_k} exceeds its {info.num_experts} experts")


def find_moe_layers(model: nn.Module, example_inputs: ExampleInputs | None = None
                    ) -> tuple[list[MoELayerInfo], list[tuple[str, str]]]:
    """Return (MoE layers found, [(name, reason)] for MoE-like modules that were rejected).

    A candidate whose forward does not run on probe hidden states alone (it needs position embeddings,
    masks or token ids) is probed again with the arguments it gets in one forward of the whole model on
    ``example_inputs`` (see :func:`record_inputs`; synthesized token ids for an HF ``PreTrainedModel``
    when not given); a layer found so keeps its recording in ``probe_call``. No such forward runs when
    every candidate probes on hidden states alone."""
    found, rejected = _find_in(model)
    needy = [name for name, why in rejected if isinstance(why, ProbeFailed)]
    rejected = [(name, str(why)) for name, why in rejected]
    if not needy:
        return _tied_experts(found, rejected)
    modules = dict(model.named_modules())
    targets = {name: modules["" if name == "<root>" else name] for name in needy}
    calls, failure = record_inputs(model, list(targets.values()), example_inputs)
    recorded = {name: calls[m] for name, m in targets.items() if m in calls}
    with recorded_inputs({targets[name]: call for name, call in recorded.items()}):
        again, again_rejected = _find_in(model, names=set(recorded), outside=found)   # sets probe_call
    again_why = {name: str(why) for name, why in again_rejected}
    first_why = dict(rejected)
    reasons = {}
    for name in needy:
        if name in again_why:
            reasons[name] = f"{again_why[name]} (probed with the arguments recorded in a forward of the model)"
        elif name not in recorded:
            reasons[name] = f"{first_why[name]}; {failure or NOT_CALLED}"
    found_names = {info.name for info in again}
    rejected = [(name, reasons.get(name, why)) for name, why in rejected if name not in found_names]
    order = {name or "<root>": i for i, name in enumerate(modules)}
    found = sorted(found + again, key=lambda info: order.get(info.name, 0))
    return _tied_experts(found, _outside_found_experts(found, rejected))


def _tied_experts(found: list[MoELayerInfo], rejected: list[tuple[str, str]]
                  ) -> tuple[list[MoELayerInfo], list[tuple[str, str]]]:
    """Tied weights among the found layers' experts (DiffusionGemma's encoder and decoder layer i share
    theirs). A layer whose experts hold exactly the parameters of an earlier layer's (and are of its
    type) gets ``tied_to`` that layer: one sharded experts module serves both, so their gradients
    accumulate into one owner's chunk as they do into one parameter in one process. Layers whose experts
    share only some parameters with another's cannot be served so (each sharded layer holds its own copy
    of its experts, which would train apart): they are rejected and stay data-parallel."""
    first: dict[tuple, str] = {}        # (experts type, parameter ids) -> the first layer holding them
    owners: dict[int, set[str]] = {}    # parameter id -> first layers of the experts holding it
    for info in found:
        experts = info.experts      # a joined layer's experts are built from its two halves
        key = (type(experts), tuple(id(p) for p in experts.parameters()))
        info.tied_to = "" if first.setdefault(key, info.name) == info.name else first[key]
        for p in experts.parameters():
            owners.setdefault(id(p), set()).add(first[key])
    partial: dict[str, str] = {}
    for names in owners.values():
        for name in names:
            partial.update({name: other for other in sorted(names - {name})})
    if not partial:
        return found, rejected
    kept, reasons = [], []
    for info in found:
        root = info.tied_to or info.name
        if root not in partial:
            kept.append(info)
            continue
        reasons.append((info.name, f"its experts share some parameters with those of MoE layer "
                                   f"{partial[root]!r} (tied weights): a sharded layer holds its own copy of its "
                                   "experts, so the two would train apart; tie all of the experts' parameters "
                                   "(one experts module serves both layers) or none"))
    return kept, rejected + reasons


def _find_in(model: nn.Module, names: set[str] | None = None, outside: list[MoELayerInfo] = ()
             ) -> tuple[list[MoELayerInfo], list[tuple[str, Reject | str]]]:
    """:func:`find_moe_layers` on the probes as they run now (the modules ``names`` only, when given;
    none inside the experts of the layers ``outside``); a rejection is its exception when it is one."""
    found: list[MoELayerInfo] = []
    rejected: list[tuple[str, Reject | str]] = []
    for name, module in model.named_modules():
        name = name or "<root>"
        if names is not None and name not in names:
            continue
        if any(name == f"{f.name}.{f.experts_attr}" or name.startswith(f"{f.name}.{f.experts_attr}.")
               for f in outside):
            continue
        if any(name == f"{f.name}.{f.experts_attr}" or name.startswith(f"{f.name}.{f.experts_attr}.") for f in found):
            continue     # the experts of a layer found: sharded with it, not a candidate of their own
        try:
            info = zero_experts_layer(_inspect(name, module))
        except Reject as why:
            rejected.append((name, why))
            logger.debug("rejected %s: %s", name, why)
            continue
        except Exception as exc:  # detection must never break on a model it does not understand
            rejected.append((name, f"could not be analysed: {type(exc).__name__}: {exc}".splitlines()[0]))
            continue
        if info is not None:
            try:
                info.skips_empty_experts = skips_empty_experts(info)
            except Exception as exc:
                rejected.append((name, "could not tell whether it runs experts without tokens: "
                                       f"{type(exc).__name__}: {exc}".splitlines()[0]))
                continue
            if not info.shared_expert_names and (shared := shared_experts_by_probe(info)):
                info.shared_expert_names, info.shared_experts = shared, True
            info.probe_call = recorded_call(module)
            found.append(info)
            logger.debug("MoE layer %s: %s experts, top-%d, style %s", name, info.num_experts, info.top_k, info.rewrite)
    return found, _outside_found_experts(found, rejected)


def _outside_found_experts(found: list[MoELayerInfo], rejected: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The rejected modules that are not part of a found layer's experts: an experts module called with
    more than hidden states (a dispatch mask, ids) fails a probe of its own, but it is sharded with its
    layer, not left unsharded."""
    inside = [info.experts_attr if info.name == "<root>" else f"{info.name}.{info.experts_attr}" for info in found]
    return [(n, why) for n, why in rejected if not any(n == p or n.startswith(p + ".") for p in inside)]


SEARCHED = ("modules with a child holding E experts (an nn.ModuleList of identical MLPs or stacked [E, ...] "
            "weights), a router scoring E experts (Linear with E outputs or weight [E, H]), a torch.topk "
            "selection and a weighted combine")
