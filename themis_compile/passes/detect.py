"""Find the MoE layers of an arbitrary model by structure and by tracing its forward, never by class name.

A module is an MoE layer (the unit FSSDP shards, paper §3.1) when

- one child holds E experts: an ``nn.ModuleList`` of identical MLPs, or one module whose parameters are
  stacked ``[E, ...]`` (found by behaviour or by dense dispatch also a parameter-free module wrapping one
  such list, Megatron-Core ``SequentialMLP`` / DeepSpeed ``Experts``);
- its forward (FX-traced with the experts, each expert and MLP-like children kept as leaves, the router
  traced through) scores E experts with a learned router (an ``nn.Linear`` with E outputs or a weight
  ``[E, H]``), optionally through softmax or sigmoid, and selects the top-k with ``torch.topk`` (or the
  top-1 with ``torch.max`` / ``torch.argmax`` along a dimension); when FX cannot trace the forward, the
  selections and score functions a probe run calls are recorded instead;
- the top-k weights reach the output (the weighted combine);

or its ``ModuleList`` experts are each called once on capacity slots between dense ``[T, E, C]`` dispatch
and combine tensors (GShard; traced with the block's methods kept as calls);

or, whatever the routing code (``max``, sorts, masks, group limits, a router module returning ids), when
its behaviour on a probe shows it: its experts child, swapped for a stand-in, is called once as
``experts(x_TH, ids_TK, weights_TK)``, ``experts(x_TH, ids_TK) -> y_TKH`` (per slot),
``experts(rows_NH sorted by expert, counts_E)``, ``experts(x_TH, one-hot mask_TKE, weights_TK)``,
``experts(x_BSH, ids_TK, weights_TK)`` (unflattened), ``experts(x [E*T, H])`` (every expert on every
row, Llama 4: :class:`AllRowsPlan`) or ``experts(x, scores_TE, weights_TK, ids_TK)`` (the router's dense
scores beside the top-k, any order) and the output is unchanged; a sorted-rows call that changes the
rows' width is half of every expert, joined with the second half and the block's row-wise code between
the two calls (JetMoE, :mod:`themis_compile.passes.joined`). A whole-module call is accepted only
when it computes what the sharded runtime computes (:func:`combine_mismatch`).

The tools it reads blocks with live beside it: the probes in :mod:`themis_compile.passes.probe`, the
tracers and node predicates in :mod:`themis_compile.passes.fx_graph`; the record it returns is
:class:`themis_compile.layer_info.MoELayerInfo`.

Contract:
    ``find_moe_layers(model, example_inputs)`` is read-only: probes run under ``torch.no_grad`` with the
    RNG forked and every module attribute and buffer restored afterwards. A candidate whose forward
    fails on hidden states alone is probed again with the arguments recorded in one forward of the
    model (``example_inputs``, or synthesized token ids for an HF model), the hidden states replaced by
    the probe's (:func:`record_inputs`, :func:`recorded_inputs`); no such forward runs otherwise.
    Each layer found records *how* its experts are called (``rewrite``): ``"none"`` when swapping the
    experts child for any module with the interface ``experts(x_TH, ids_TK, weights_TK) -> out_TH``
    reproduces the forward on a probe (HF transformers >= 5, torchtitan-like blocks, the reference
    model in both forms); ``"inline-loop"`` when the forward loops over a ``ModuleList`` of experts
    itself, which :mod:`themis_compile.passes.shard` rewrites.
    ``"per-slot"`` / ``"sorted-rows"`` / ``"dispatch-mask"`` / ``"flatten"`` / ``"all-rows"`` /
    ``"scores-call"`` when the experts are called per slot, on sorted rows, with a one-hot mask, on
    unflattened hidden states, on every row or with the router's dense scores (found by behaviour;
    :mod:`themis_compile.passes.shard` rewrites the call, not the forward); ``"joined"`` for two halves
    of every expert called on the same sorted rows (``experts_attr`` names the joined module the rewrite
    adds, :class:`~themis_compile.passes.joined.JoinedPlan`); ``"dense-dispatch"`` for
    dense ``[T, E, C]`` dispatch and combine tensors (the forward is rewritten).
    ``"replay"`` when the forward loops over a ``ModuleList`` of experts in code FX cannot trace, or
    over a ``ModuleDict`` of experts (found by behaviour: ``getattr(self.experts, key)``, HF Switch
    before v5) (the loop stays as written, served by :mod:`themis_compile.passes.replay`).
    Modules that look MoE-like (an experts-like child next to a router of that width, or a top-k in
    their forward, or an experts child called otherwise) but fail a check are returned as
    ``(name, reason)``, the reason saying what would make the layer work. A layer whose experts are
    an earlier found layer's (the same parameters: tied weights) records it in ``tied_to``, and the
    runtime serves both with one sharded experts module; layers whose experts share only some
    parameters with another's are rejected (:func:`_tied_experts`).

Pseudo-code:
    for module in model.named_modules():
        experts = child that is a ModuleList of MLPs or has stacked [E, ...] weights      # Step 1
        graph = fx_trace(module) or make_fx(module)(probe)                                  # Step 2
        if no router of width E and no top-k (else max / argmax) in graph: skip (not MoE-like)
        check identical experts, top-k, router width == E, weighted combine              # Step 3
        rewrite = "none" if a stand-in experts(x, ids, weights) reproduces the forward     # Step 4
                  else "inline-loop" if every expert is called one by one
        describe router, scores, activation, shared experts, auxiliary losses              # Step 5
        if rejected: trace with the block's methods as calls; dense [T, E, C] dispatch?    # dense dispatch
        if none of that finds it: swap each experts child for a stand-in on a probe and read
        the call (x, ids, weights) / (x, ids) / (sorted rows, counts) / (x, mask, weights) /
        (x_BSH, ids, weights) / (x [E*T, H]) / (x, scores, weights, ids); check combine_mismatch  # behaviour
    if a candidate's forward fails on probe hidden states: record the (args, kwargs) it gets in one
    forward of the model on example_inputs (or synthesized token ids) and inspect it again, each
    probe's hidden states in place of the recorded ones                              # recorded inputs
    experts the same parameters as an earlier layer's: tied_to it; some shared: reject  # tied experts

Shape suffixes: B batch, S sequence, T tokens, H hidden size, E experts, K top-k.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from themis_compile.layer_info import MoELayerInfo
from themis_compile.passes.fx_graph import (TensorMeta, TracedBlock, ancestors, combine_node, descendants,
                                            describe_selection, effective_users, expert_index, expert_nodes, is_fn,
                                            is_inplace, is_mlp_like, is_topk, output_node, reach_by_expert, reachable,
                                            record_calls, record_meta, router_of, score_kind, selection_k,
                                            selection_outputs, selections_of, trace_block,
                                            trace_block_with_method_leaves, variable_selection_reason)
from themis_compile.passes.joined import (JoinedPlan, describe_between, free_attribute, record_between,
                                          row_mixing_reason)
from themis_compile.passes.own_weights import (OwnWeightsPlan, ServedOwnWeightsExperts, WeightsRecorder,
                                               WeightUses, apply_own_weights, own_stacked_weights,
                                               own_weights_region, region_module, replace_region,
                                               replace_slot_regions, slot_regions)
from themis_compile.passes.parallel_lists import (apply_param_lists, apply_parallel_lists, describe_region,
                                                  indexed_weights_plan, param_lists_plan, parallel_lists_plan)
from themis_compile.passes.probe import (ExampleInputs, ExpertsStandIn, NOT_CALLED, PROBE_SEED, preserved_state,
                                         probe_input, record_inputs, recorded_call, recorded_inputs, run_probe)
from themis_compile.passes.replay import (captured_rows, gradient_mismatch, inline_expert_weights_reason,
                                          output_tensors, replay_mismatch)
from themis_compile.runtime.experts import (ExpertBank, declared_num_experts, expert_modules, stacked_layout,
                                            wrapped_expert_list, zero_expert_rows)

logger = logging.getLogger(__name__)

__all__ = ["MoELayerInfo", "SEARCHED", "find_moe_layers", "explain_moe_layers", "check_layer", "shared_parameter_names",
           "skips_empty_experts", "combine_mismatch", "expert_call_path", "expert_list", "RuntimeReference",
           "AllRowsPlan", "serve_all_rows", "all_rows_experts_class", "ScoresCallPlan", "scores_call_experts_class",
           "mask_slots", "mask_call_experts_class", "flat_call_experts_class", "dense_dispatch_of"]


def shared_parameter_names(info: MoELayerInfo) -> tuple[str, ...]:
    """The parameters of the layer's experts module that every expert uses (``ExpertBank.shared_names``:
    dense, data parallel, in no expert's chunk); () when there are none or the experts are not cut into
    chunks."""
    try:
        return ExpertBank(info.experts, layer=info.name, num_experts=info.num_experts).shared_names
    except ValueError:
        return ()


# --- Step 1: structure -------------------------------------------------------------------------------

def _stacked_width(m: nn.Module) -> int | None:
    """E when every parameter of ``m`` is stacked along a common leading dimension E >= 2."""
    params = list(m.parameters())
    if not params or isinstance(m, (nn.ModuleList, nn.ModuleDict)):
        return None
    if any(p.dim() < 2 for p in params) or not any(p.dim() >= 3 for p in params):
        return None
    widths = {p.shape[0] for p in params}
    return widths.pop() if len(widths) == 1 and params[0].shape[0] >= 2 else None


def _is_sharded(m: nn.Module) -> bool:
    """Experts already replaced by a themis_compile runtime (they carry the owner table)."""
    return hasattr(m, "owner_E")


@dataclass(frozen=True)
class _ExpertsChild:
    attr: str
    module: nn.Module
    num_experts: int
    form: str


def _experts_children(module: nn.Module) -> list[_ExpertsChild]:
    found = []
    for attr, child in module.named_children():
        if _is_sharded(child):
            continue
        if isinstance(child, nn.ModuleList) and len(child) >= 2 and all(is_mlp_like(c) for c in child):
            found.append(_ExpertsChild(attr, child, len(child), "modulelist"))
        elif (E := _stacked_width(child) or _stacked_width_with_shared(child)) is not None \
                and not _holds_stacked_experts(child, E):
            found.append(_ExpertsChild(attr, child, E, "stacked"))
    return found


def _holds_stacked_experts(child: nn.Module, num_experts: int) -> bool:
    """Whether a module below ``child`` holds E stacked experts itself: then ``child`` is an MoE block (its
    router's width and the hidden size may both be E: ``Linear(16 -> 16)`` beside ``[16, 16, 16]`` experts),
    inspected as a candidate of its own, not the experts of its parent."""
    return any(_stacked_width(m) == num_experts for _, m in child.named_modules() if m is not child)


def _stacked_width_with_shared(m: nn.Module) -> int | None:
    """E when ``m`` holds stacked ``[E, ...]`` weights next to parameters every expert uses (a norm applied
    to each expert's output, MuseSpark's ``post_expert_norm``): ``runtime.experts.stacked_layout``."""
    layout = stacked_layout(m)
    return layout[0] if layout is not None and layout[1] else None


def _wrapped_experts_children(module: nn.Module) -> list[_ExpertsChild]:
    """Children that wrap their experts' ModuleList (:func:`~themis_compile.runtime.experts.wrapped_expert_list`:
    Megatron-Core ``SequentialMLP``, DeepSpeed ``Experts``) and hold MLP-like experts."""
    found = []
    for attr, child in module.named_children():
        wrapped = None if _is_sharded(child) else wrapped_expert_list(child)
        if wrapped is not None and len(wrapped[1]) >= 2 and all(is_mlp_like(c) for c in wrapped[1]):
            found.append(_ExpertsChild(attr, child, len(wrapped[1]), "wrapped"))
    return found


def expert_call_path(module: nn.Module, attr: str) -> str:
    """Where the per-expert modules of ``module.<attr>`` are, as FX call targets name them: ``attr`` for a
    ModuleList of experts, ``attr.<list>`` for a wrapper holding one (whose forward is traced through)."""
    wrapped = wrapped_expert_list(getattr(module, attr))
    return f"{attr}.{wrapped[0]}" if wrapped is not None else attr


def expert_list(module: nn.Module, attr: str) -> nn.Module:
    """The ModuleList of experts of ``module.<attr>``: the child itself, or the list a wrapper holds."""
    return module.get_submodule(expert_call_path(module, attr))


def _expert_signature(m: nn.Module) -> tuple:
    return (type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()))


def _non_identical_reason(experts: nn.ModuleList) -> str | None:
    sig0 = _expert_signature(experts[0])
    for e, expert in enumerate(experts):
        sig = _expert_signature(expert)
        if sig != sig0:
            shapes = lambda s: ", ".join(f"{n} {list(shape)}" for n, shape, _ in s[1])  # noqa: E731
            return (f"experts are not identical: expert {e} is {sig[0].__name__}({shapes(sig)}) but expert 0 is "
                    f"{sig0[0].__name__}({shapes(sig0)}); FSSDP needs equal-sized expert chunks")
    return None


def _router_widths(module: nn.Module, experts: nn.Module) -> list[tuple[str, int, int]]:
    """(path, scored width, input width) of every Linear or bare 2-D weight outside the experts."""
    inside = {id(p) for p in experts.parameters()}
    out = []
    for path, sub in module.named_modules():
        if sub is experts:
            continue
        if isinstance(sub, nn.Linear):
            if id(sub.weight) not in inside:
                out.append((path, sub.out_features, sub.in_features))
            continue
        for pname, p in sub.named_parameters(recurse=False):
            if p.dim() == 2 and id(p) not in inside:
                out.append((f"{path}.{pname}" if path else pname, p.shape[0], p.shape[1]))
    return out


def _hidden_size(child: _ExpertsChild, routers: list[tuple[str, int, int]]) -> int | None:
    for _, width, h in routers:
        if width == child.num_experts:
            return h
    if child.form == "modulelist":
        for sub in child.module[0].modules():
            if isinstance(sub, nn.Linear):
                return sub.in_features
        for p in child.module[0].parameters():
            if p.dim() == 2:
                return p.shape[1]
    return routers[0][2] if routers else None


def expert_choice_reason(scores_shape: tuple[int, ...], dim: int, num_experts: int, num_tokens: int) -> str | None:
    """Why a top-k over ``scores_shape`` along ``dim`` is experts choosing tokens (expert-choice routing,
    Zhou et al. 2022: ``topk(scores_TE.t(), capacity)``), not tokens choosing experts; None otherwise.
    It is when the selected dimension holds the tokens and the others hold the experts (on a probe whose
    token count differs from the number of experts)."""
    if num_tokens == num_experts or scores_shape[dim] != num_tokens:
        return None
    rest = math.prod(n for i, n in enumerate(scores_shape) if i != dim)
    if rest != num_experts:
        return None
    return (f"expert-choice routing: its top-k selects along the {num_tokens} tokens of a probe for each of its "
            f"{num_experts} experts (scores {list(scores_shape)}, dim {dim}), so the number of experts per token "
            "varies and depends on the whole batch; FSSDP needs every token routed to exactly k experts: select "
            "with a top-k over the experts dimension of [T, E] scores to shard it (left data-parallel)")


# Step 2 (tracing) and the graph reading of step 3 are in passes.fx_graph, the probes in passes.probe.

# --- Step 4: how the experts are called --------------------------------------------------------------

class RuntimeReference(nn.Module):
    """What the sharded runtime computes for ``experts(x_TH, ids_TK, weights_TK)``, in one process:
    ``out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` with each expert run alone by the
    :class:`~themis_compile.runtime.experts.ExpertBank` of ``experts`` (held, not registered; ``num_experts``
    as the router scores them, which tells flat ``[E * F, H]`` weights apart). An expert module without
    rows is not run (no gradient) when ``skips_empty``, as the runtime does for a block that skips it;
    otherwise it runs on no rows (a zero gradient), as the runtime runs it for a block whose loop calls
    every expert. (Stacked weights are one tensor: skipping an expert leaves no gradient None.)"""

    def __init__(self, experts: nn.Module, num_experts: int | None = None, skips_empty: bool = True) -> None:
        super().__init__()
        self.bank = ExpertBank(experts, num_experts=num_experts or None)
        self.runs_empty = not skips_empty and self.bank.per_expert_modules
        self.__dict__["experts"] = experts

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        out_TH = torch.zeros(x_TH.shape, dtype=torch.float64, device=x_TH.device)
        for e in range(self.bank.num_experts):
            token_N, k_N = torch.where(ids_TK == e)
            if token_N.numel() or self.runs_empty:
                y_NH = self.bank.run(self.bank.chunk(self.experts, e), x_TH[token_N],
                                     self.bank.shared_tensors(self.experts))
                out_TH = out_TH.index_add(0, token_N, y_NH.double() * weights_TK[token_N, k_N, None].double())
        return out_TH.to(x_TH.dtype)


def _outputs_close(a: Any, b: Any) -> bool:
    flat_a, flat_b = output_tensors(a), output_tensors(b)
    if len(flat_a) != len(flat_b):
        return False
    for u, v in zip(flat_a, flat_b):
        if u.shape != v.shape or not torch.allclose(u.float(), v.float(), rtol=1e-4, atol=1e-5):
            return False
    return True


def zero_experts_mismatch(experts: nn.Module, bank: ExpertBank, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                          weights_TK: torch.Tensor) -> str | None:
    """Why a stacked experts module with zero-expert rows (``bank.zero_rows``, HF LongCat-Flash) does not
    compute what the zero-experts rewrite computes, or None when it does: ``out[t] = sum over slots with
    id < E of weights * expert_id(x[t])`` (each expert alone, as the runtime runs it) ``+ sum over slots
    with id in [E, E + Z) of weights * x[t]`` (identity experts), and rows ``[E, E + Z)`` of its weights
    never read (their gradient on the probe exactly 0; in one process they are then stepped on a zero
    gradient, as the sharded experts step them)."""
    E, Z = bank.num_experts, bank.num_zero_experts
    if ids_TK.numel() and (int(ids_TK.min()) < 0 or int(ids_TK.max()) >= E + Z):
        return (f"it routes tokens to ids outside [0, {E + Z}) ({E} experts and {Z} zero experts; ids "
                f"{int(ids_TK.min())}..{int(ids_TK.max())})")
    real_TK = ids_TK < E
    with torch.enable_grad():
        weights = {name: experts.get_parameter(name) for name in bank.zero_rows}
        expected = experts(x_TH, ids_TK, weights_TK)
        if not isinstance(expected, torch.Tensor) or expected.shape != x_TH.shape:
            return (f"{type(experts).__name__}(x, ids, weights) returns "
                    f"{getattr(expected, 'shape', type(expected).__name__)}, not [T, H]")
        upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(PROBE_SEED)).to(expected)
        grads = torch.autograd.grad((expected * upstream).sum(), list(weights.values()), allow_unused=True)
    for (name, w), g in zip(weights.items(), grads):
        if g is not None and bool(g[E:].ne(0).any()):
            return (f"its forward reads rows [{E}, {E + Z}) of {name} {list(w.shape)} (their gradient is not 0 on a "
                    f"probe), which belong to none of its {E} experts")
    out = RuntimeReference(experts, E)(x_TH, torch.where(real_TK, ids_TK, 0),
                                       torch.where(real_TK, weights_TK, 0)).double()
    out = out + x_TH.double() * torch.where(real_TK, 0, weights_TK).double().sum(-1, keepdim=True)
    if not torch.allclose(expected.detach().double(), out, rtol=1e-4, atol=1e-5):
        err = float((expected.detach().double() - out).abs().max())
        return (f"{type(experts).__name__}(x, ids, weights) holds {Z} zero-expert rows after its {E} experts in "
                f"{', '.join(bank.zero_rows)}, but is not sum_k weights * expert_ids(x) over ids < {E} plus "
                f"weights * x over ids >= {E} (identity experts; differs by {err:.3g})")
    return None


def zero_experts_layer(info: MoELayerInfo | None) -> MoELayerInfo | None:
    """``info`` for the zero-experts rewrite when its experts stack zero (identity) experts after the real
    ones (:func:`~themis_compile.runtime.experts.zero_expert_rows`; :func:`combine_mismatch` proved the
    call on a probe): E the real experts, Z the zero ones, the router's width E + Z. Such experts are
    served only when called as ``experts(x, ids, weights)``; any other call of them is rejected."""
    if info is None or zero_expert_rows(info.experts) is None:
        return info
    bank = ExpertBank(info.experts, layer=info.name)
    if info.rewrite != "none":
        raise _Reject(f"'{info.experts_attr}' holds {bank.num_zero_experts} zero-expert rows after its "
                      f"{bank.num_experts} experts ({', '.join(bank.zero_rows)}) and is served only when called as "
                      f"{info.experts_attr}(x, ids, weights) (its call: {info.rewrite})")
    E, Z = bank.num_experts, bank.num_zero_experts
    router = info.router
    path, width, H = next((r for r in _router_widths(info.module, info.experts) if r[1] == E + Z),
                          (info.router_path or None, E + Z, info.hidden_size))
    if "]: " in router:
        router = f"'{path}' [E={width}, H={H}]: " + router.split("]: ", 1)[1]
    return dataclasses.replace(info, num_experts=E, zero_experts=Z, rewrite="zero-experts", router=router,
                               router_path=path or "")


def combine_mismatch(experts: nn.Module, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                     num_experts: int | None = None) -> str | None:
    """Why the sharded runtime would not compute what ``experts(x_TH, ids_TK, weights_TK)`` computes, or
    None when it does. The runtime computes ``out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``
    with each expert run alone (:class:`~themis_compile.runtime.experts.ExpertBank`); a module that
    gives some ids another meaning (zero or identity experts, dropped tokens) or weighs inside the
    expert differs, and is rejected instead of trained differently. ``num_experts``: E as the router
    scores them, where known (it tells flat ``[E * F, H]`` weights apart, :func:`~themis_compile.runtime.
    experts.flat_layout`); the probe then proves that layout."""
    with torch.no_grad():
        try:
            bank = ExpertBank(experts, num_experts=num_experts or None)
        except ValueError as exc:
            return (f"its experts cannot be cut into equal per-expert chunks ({str(exc).split(': ', 1)[-1]}); "
                    "hold them as a ModuleList of identical modules or as parameters stacked [E, ...] (but for "
                    "parameters every expert uses)")
        E = bank.num_experts
        if bank.zero_rows:
            return zero_experts_mismatch(experts, bank, x_TH, ids_TK, weights_TK)
        if ids_TK.numel() and (int(ids_TK.min()) < 0 or int(ids_TK.max()) >= E):
            return (f"it routes tokens to ids outside [0, {E}) (ids {int(ids_TK.min())}..{int(ids_TK.max())}: "
                    f"zero/identity experts or dropped tokens); make every routed id name one of the {E} "
                    "experts, or run the extra ids outside the experts module")
        expected = experts(x_TH, ids_TK, weights_TK) if not isinstance(experts, nn.ModuleList) else None
        if expected is None:
            return None   # a ModuleList's combine is the runtime's loop by construction
        try:
            out = RuntimeReference(experts, E)(x_TH, ids_TK, weights_TK).double()
        except Exception as exc:   # the module's code cannot run one expert alone on its chunk
            if not bank.flat:
                raise
            return (f"its weights read flat ({bank.num_experts} experts of rows {list(bank.flat_rows)}), one expert "
                    f"run alone fails ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); store them "
                    "stacked [E, ...] or give the module expert_forward(params, x)")
        if not isinstance(expected, torch.Tensor) or expected.shape != x_TH.shape:
            return (f"{type(experts).__name__}(x, ids, weights) returns "
                    f"{getattr(expected, 'shape', type(expected).__name__)}, not [T, H]")
        if not torch.allclose(expected.double(), out, rtol=1e-4, atol=1e-5):
            err = float((expected.double() - out).abs().max())
            return (f"{type(experts).__name__}(x, ids, weights) is not sum_k weights * expert_ids(x) with each "
                    f"expert run alone (differs by {err:.3g}); the sharded runtime would train a different "
                    "model. Make its forward that sum, or give the module expert_forward(params, x)")
    return None


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
        return _skipped_expert_gradient(experts, x_TH, ids_TK, weights_TK, info.num_experts)
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


def _skipped_expert_gradient(experts: nn.Module, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                             weights_TK: torch.Tensor, E: int) -> bool:
    """Whether ``experts(x, ids, weights)`` leaves expert 0 without gradient when no id names it (it
    runs only the experts that receive tokens)."""
    ids_TK = torch.where(ids_TK == 0, torch.ones_like(ids_TK), ids_TK) if E > 1 else ids_TK
    params = [p for p in expert_modules(experts)[0].parameters() if p.requires_grad]
    if not params:
        return False      # frozen: no gradient either way
    with torch.enable_grad(), preserved_state(experts):
        out = experts(x_TH.detach(), ids_TK, weights_TK.detach())
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            return True
        # torch.autograd.grad, not backward: no .grad of the model is touched.
        grads = torch.autograd.grad(out.sum(), params, allow_unused=True)
    return any(g is None for g in grads)


def experts_call_form(module: nn.Module, attr: str, x: torch.Tensor, top_k: int | None = None
                      ) -> tuple[str, str]:
    """("none" | "inline-loop" | "unsupported", detail): can the experts child be swapped for a module
    with the interface experts(x_TH, ids_TK, weights_TK)? Decided on a probe, not by reading code; with
    that interface, the module must also compute what the runtime computes (:func:`combine_mismatch`)."""
    experts = getattr(module, attr)
    expected = run_probe(module, x)
    stand_in = ExpertsStandIn(experts)
    error = None
    setattr(module, attr, stand_in)
    try:
        got = run_probe(module, x)
    except Exception as exc:  # the forward relies on the experts' own type (iterates, indexes ...)
        got, error = None, exc
    finally:
        setattr(module, attr, experts)
    calls = stand_in.calls
    if error is None and len(calls) == 1 and len(calls[0]) == 3:
        x_TH, ids_TK, weights_TK = calls[0]
        ok = (isinstance(x_TH, torch.Tensor) and x_TH.dim() == 2
              and isinstance(ids_TK, torch.Tensor) and not ids_TK.is_floating_point() and ids_TK.dim() == 2
              and isinstance(weights_TK, torch.Tensor) and weights_TK.is_floating_point()
              and ids_TK.shape == weights_TK.shape and ids_TK.shape[0] == x_TH.shape[0]
              and (top_k is None or ids_TK.shape[1] == top_k))
        if ok and _outputs_close(expected, got):
            if (why := combine_mismatch(experts, x_TH, ids_TK, weights_TK)) is not None:
                return "unsupported", why
            return "none", f"calls {attr}(x_TH, ids_TK, weights_TK)"
    if isinstance(experts, nn.ModuleList):
        counts = [0] * len(experts)
        hooks = [e.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts[i] + 1))
                 for i, e in enumerate(experts)]
        try:
            run_probe(module, x)
        finally:
            for h in hooks:
                h.remove()
        if sum(counts) > 0:
            return "inline-loop", f"calls its {len(experts)} experts one by one ({sum(counts)} calls on the probe)"
        return "unsupported", "the forward never calls its experts on the probe"
    if error is not None:
        return "unsupported", f"swapping '{attr}' for an experts(x, ids, weights) module fails: {error}"
    shapes = ", ".join(f"{type(a).__name__}{list(a.shape) if isinstance(a, torch.Tensor) else ''}"
                       for a in (calls[0] if calls else ()))
    return "unsupported", (f"stacked experts '{attr}' are called as {attr}({shapes}), not as "
                           f"{attr}(x_TH, ids_TK, weights_TK); call them once that way (x [T, H], integer "
                           "top-k ids and floating weights [T, K]) and let them return the weighted sum")


# --- Step 5: description -----------------------------------------------------------------------------

_ACTIVATIONS = {F.silu: "silu", F.gelu: "gelu", F.relu: "relu", torch.relu: "relu", torch.tanh: "tanh",
                torch.sigmoid: "sigmoid", F.mish: "mish", F.elu: "elu", F.leaky_relu: "leaky_relu"}
_ACTIVATION_MODULES = (nn.SiLU, nn.GELU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.ELU, nn.LeakyReLU)


def _named_activation(m: nn.Module) -> str | None:
    for attr in ("activation", "act_fn", "act", "activation_fn", "hidden_act"):
        v = getattr(m, attr, None)
        if isinstance(v, str):
            return v
        if isinstance(v, nn.Module):
            return type(v).__name__.lower().replace("activation", "") or None
        if callable(v):
            return getattr(v, "__name__", None)
    return None


def describe_activation(expert: nn.Module) -> str:
    """The expert MLP's activation: its own name for it, else what its traced forward calls."""
    named = _named_activation(expert)
    if named:
        return named
    try:
        gm = fx.symbolic_trace(expert)
    except Exception:
        return "unknown"
    acts, gated = [], False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _ACTIVATIONS:
            acts.append(_ACTIVATIONS[n.target])
        elif n.op == "call_module" and isinstance(gm.get_submodule(n.target), _ACTIVATION_MODULES):
            acts.append(type(gm.get_submodule(n.target)).__name__.lower())
        elif n.op == "call_method" and n.target in ("relu", "sigmoid", "tanh"):
            acts.append(n.target)
    for n in gm.graph.nodes:
        if is_fn(n, {operator.mul, torch.mul}, "mul") and len(n.all_input_nodes) == 2:
            a, b = n.all_input_nodes
            if (ancestors(a) | {a}) & {m for m in gm.graph.nodes if m.op == "call_module"} and \
                    (ancestors(b) | {b}) & {m for m in gm.graph.nodes if m.op == "call_module"}:
                gated = True
    if not acts:
        return "unknown"
    return f"{acts[0]} (gated)" if gated else acts[0]


_ADDS = {operator.add, torch.add, operator.iadd}


def _shared_experts(traced: TracedBlock, module: nn.Module, combined: list[fx.Node], experts_attr: str
                    ) -> tuple[str, ...]:
    """MLP-like children called in the forward whose output is added to the experts' combined output."""
    if not combined:
        return ()
    succ = effective_users(traced.gm.graph)
    after_experts = reachable(combined, lambda n: succ[n])
    names = []
    for n in traced.gm.graph.nodes:
        if n.op != "call_module" or "." in n.target or n.target == experts_attr:
            continue
        if not is_mlp_like(module.get_submodule(n.target)):
            continue
        mine = reachable([n], lambda m: succ[m])
        for add in mine & after_experts:
            if is_fn(add, _ADDS, "add") or is_fn(add, _ADDS, "add_"):
                inputs = [p for p, us in succ.items() if add in us]
                from_shared = any(i in mine and i not in after_experts for i in inputs)
                if from_shared and any(i in after_experts for i in inputs):
                    names.append(n.target)
                    break
    return tuple(names)


def _auxiliary(traced: TracedBlock, combined: list[fx.Node]) -> tuple[str, ...]:
    """What the forward produces besides the combined output: attributes it stores (auxiliary losses,
    statistics), buffers it updates in place, extra outputs computed from the router alone."""
    graph = traced.gm.graph
    aux = [f"stores self.{p + '.' if p else ''}{a}" for p, a in traced.attr_stores]
    for n in graph.nodes:
        if is_inplace(n) and n.args and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr":
            aux.append(f"updates buffer {n.args[0].target} in place")
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = out.args[0]
    if isinstance(results, (tuple, list)) and len(results) > 1 and combined:
        succ = effective_users(graph)
        after_experts = reachable(combined, lambda n: succ[n])
        for i, r in enumerate(results):
            if isinstance(r, fx.Node) and r not in after_experts:
                aux.append(f"returns output {i} from the router alone (e.g. logits for an auxiliary loss)")
    return tuple(aux)


# --- The detector ------------------------------------------------------------------------------------

class _Reject(Exception):
    pass


class _CallReject(_Reject):
    """A rejection by behaviour that read the experts call and says best what stops it (over what the
    routing analysis, which did not understand the call, says)."""


class _ProbeFailed(_Reject):
    """The block's forward does not run on probe hidden states alone: it needs the other arguments it
    gets in the model (position embeddings, masks, token ids), which :func:`find_moe_layers` records."""


def _inspect(name: str, module: nn.Module) -> MoELayerInfo | None:
    """The layer ``module`` is, None when it does not look MoE-like; raises _Reject with the reason.

    The routing analysis (FX graph or recorded top-k) comes first, as it describes the router best;
    when it does not find a layer, the behaviour decides (:func:`_inspect_by_behaviour`)."""
    if type(module).forward is nn.Module.forward:
        return None   # a container without a forward of its own (a ModuleDict of experts) is never called
    try:
        info = _inspect_routing(name, module)
    except _Reject as why:
        info, reject = None, why
    else:
        reject = None
    if info is not None and info.rewrite in ("inline-loop", "replay"):
        # Experts called one by one may be on capacity slots of dense [T, E, C] tensors (GShard, traced
        # or not): the dense-dispatch rewrite fits those better than the loop rewrite or capture and
        # replay, which would route every capacity slot, empty ones included, as a row of its own.
        return _inspect_dense_dispatch(name, module) or info
    if info is not None:
        return info
    if ((reject is not None or _wrapped_experts_children(module))
            and (dense := _inspect_dense_dispatch(name, module)) is not None):
        return dense
    try:
        found = _inspect_by_behaviour(name, module)
    except _Reject as behaviour:
        # The routing analysis saw the layer first and says best what it found, unless all it says is
        # that it found no top-k: then what the experts call (or the probe) showed is the reason.
        if reject is not None and not str(reject).startswith("no top-k selection") and not isinstance(
                behaviour, _CallReject):
            raise reject
        raise behaviour
    if found is not None:
        return found
    if reject is not None:
        raise reject
    if (found := _own_weights_layer(name, module)) is not None:
        return found
    if (why := inline_expert_weights_reason(module)) is not None:
        raise _Reject(why)
    if (found := _parallel_lists_layer(name, module)) is not None:
        return found
    if (found := _param_lists_layer(name, module)) is not None:
        return found
    if (why := parallel_expert_lists_reason(module)) is not None:
        raise _Reject(why)
    return None


def _recorded_routing(rec: Any) -> tuple[str, str]:
    """(score functions, selections) of the calls recorded on a probe, as a router description says them."""
    return ("+".join(dict.fromkeys(rec.scores)) or "none",
            ", ".join(dict.fromkeys(rec.selections)) or "no top-k/max/sort call (masks)")


def _selecting_probe(module: nn.Module, hidden: int) -> tuple[torch.Tensor, Any] | None:
    """(probe, the calls its forward made) when ``module`` runs on a probe of hidden states and selects
    experts there (a top-k, a sort cut to k, a max / argmax); None otherwise."""
    try:
        x = probe_input(module, hidden)
        rec = record_calls(module, x)
    except Exception:  # noqa: BLE001 - not a block run on hidden states
        return None
    return (x, rec) if rec.ks or rec.top1 else None


def _own_weights_layer(name: str, module: nn.Module) -> MoELayerInfo | None:
    """The layer of a block (an MoE block or a whole decoder layer) that holds its experts as stacked
    ``[E, ...]`` parameters of its own and applies them inline (:mod:`themis_compile.passes.own_weights`):
    the code applying them, read off its FX graph, moves with them into an experts child called per slot or
    per row (``rewrite == "own-weights"``). None when the block holds no such weights or does not run on
    probe hidden states; raises _Reject naming the step that failed when it holds them next to a router
    of their width and selects on a probe."""
    found = own_stacked_weights(module)
    if found is None:
        return None
    router_name, E, H, names = found
    if (probed := _selecting_probe(module, H)) is None:
        return None
    x, rec = probed
    shapes = ", ".join(f"{n} {list(module._parameters[n].shape)}" for n in names)
    head = (f"its expert weights are stacked parameters of the block itself ({shapes}, {E} experts scored by "
            f"'{router_name}')")
    attr = free_attribute(module)
    forwards, constants, parts, slotted = {}, {}, None, False
    for training in (True, False):
        try:
            traced = trace_block(module, nn.Module(), training=training)
            record_meta(traced, module, x)
        except Exception as exc:  # noqa: BLE001 - FX stops at data-dependent code (int(counts.max()))
            traced_why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            plan, why = _recorded_own_weights_plan(module, names, attr, x, H, E, rec)
            if plan is None:
                found, indexed_why = _indexed_weights_layer(name, module, names, attr, x, H, E, rec, router_name,
                                                            head)
                if found is not None:
                    return found
                raise _Reject(f"{head}; step 1 (trace the forward to find the code applying them) failed "
                              f"({traced_why}), {why}, and {indexed_why}") from None
            parts = None
            break
        region, why = own_weights_region(traced, names, H)
        if region is not None:
            nodes, inputs, y, form = region
            ids_shape = traced.meta[inputs[1]].shape
        else:
            # Applied once per slot (a loop over the k slots): one per-row call on every slot's rows.
            slots, slots_why = slot_regions(traced, names, H)
            if slots is None:
                raise _Reject(f"{head}; step 2 (find the code applying them, from the selected ids to one value per "
                              f"token and slot) failed: {why}" + (f"; read once per slot: {slots_why}" if slots_why
                                                                  else ""))
            (nodes, inputs, y), form, slotted = slots[0], "per-row", True
            ids_shape = (sum(traced.meta[ins[1]].shape[0] for _, ins, _ in slots),)
        region_gm = region_module(traced, nodes, inputs, y)
        if parts is not None and (region_gm.code != parts[0].code or form != parts[1]):
            raise _Reject(f"{head}; step 2 failed: the code applying them differs between train and eval mode")
        parts = parts or (region_gm, form, traced.meta[y].shape, ids_shape)
        gm = (replace_region(traced, nodes, inputs, y, attr) if region is not None
              else replace_slot_regions(traced, slots, attr))
        forwards[training] = type(gm).forward
        for n in gm.graph.nodes:
            owner, _, leaf = n.target.rpartition(".") if n.op == "get_attr" else ("", "", "")
            if n.op == "get_attr" and not hasattr(module.get_submodule(owner), leaf):
                constants[n.target] = getattr(gm, n.target)   # a tensor constant the tracer lifted out
    T = x.shape[:-1].numel()
    if parts is not None:
        region_gm, form, y_shape, ids_shape = parts
        K = int(ids_shape[1]) if form == "per-slot" else max(1, int(ids_shape[0]) // T)
        plan = OwnWeightsPlan(attr=attr, names=names, form=form, region=region_gm, forwards=forwards,
                              constants=constants, out_middle=tuple(y_shape[1:-1]) if form == "per-row" else (),
                              top_k=K, order=tuple(module._parameters))
    K, form = plan.top_k, plan.form
    # Step 3: the block with its weights moved equals the original on the probe, and each expert run alone
    # (as the runtime runs it) equals the moved code.
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    trial = copy.deepcopy(module, shared)
    apply_own_weights(trial, plan)
    for training in (True, False):
        if not _outputs_close(run_probe(module, x, training=training), run_probe(trial, x, training=training)):
            raise _Reject(f"{head}; step 3 (the code moved into an experts module) failed: the block so rewritten "
                          f"differs from the original on a probe ({'train' if training else 'eval'} mode)")
    experts = plan.experts_of(trial)
    experts.__class__ = ServedOwnWeightsExperts
    g = torch.Generator().manual_seed(PROBE_SEED)
    x_TH = torch.randn(T, H, generator=g).to(x)
    ids_TK = torch.randint(0, E, (T, K), generator=g).to(x.device)
    weights_TK = torch.rand(T, K, generator=g).to(x)
    if (why := combine_mismatch(experts, x_TH, ids_TK, weights_TK, E)) is not None:
        raise _Reject(f"{head}; step 3 (each expert alone) failed: {why}")
    call = {"per-slot": "(x [T, H], ids [T, K]) -> [T, K, H]",
            "per-row": "(rows [N, H], ids [N]) -> [N, H]" + (", once per slot (one call on every slot's rows)"
                                                             if slotted and plan.forwards else ""),
            "expert-batched": "(buf [E, C, H]) -> [E, C, H], expert e on buf[e], recorded on a probe"}[form]
    return _recorded_layer(name, module, "own-weights", E, K, router_name, H, x, rec, attr, plan,
                           "slot(s) per token seen at the code applying the stacked weights",
                           f"the block's own code on {', '.join(names)} {call}")


def _recorded_own_weights_plan(module: nn.Module, names: tuple[str, ...], attr: str, x: torch.Tensor, H: int,
                               E: int, rec: Any) -> tuple[OwnWeightsPlan | None, str]:
    """The expert-batched reading of a block FX cannot trace (:class:`~themis_compile.passes.own_weights.
    WeightsRecorder`): (plan, "") or (None, why not)."""
    weights = {n: module._parameters[n] for n in names}
    counter = WeightUses(weights)
    with counter:
        run_probe(module, x, training=True)
    recorder = WeightsRecorder(weights, counter.count)
    with recorder:
        run_probe(module, x, training=True)
    region = recorder.finish()
    if region is None:
        return None, f"step 2 (record the code applying them on a probe) failed: {recorder.reason}"
    xs, ys = recorder.x_shape, recorder.y_shape
    if not (len(xs) == 3 and xs[0] == E and xs[-1] == H and ys == xs):
        return None, (f"step 2 (record the code applying them on a probe) failed: it maps {list(xs)} to {list(ys)}, "
                      f"not a buffer [E={E}, C, {H}] of every expert's rows to one of the same shape")
    return OwnWeightsPlan(attr=attr, names=names, form="expert-batched", region=region, forwards=None, constants={},
                          out_middle=(), top_k=min(E, rec.ks[-1] if rec.ks else max(1, rec.top1)),
                          order=tuple(module._parameters),
                          uses=counter.count,
                          specs=tuple((n, tuple(w.shape), w.dtype) for n, w in weights.items())), ""


def _indexed_weights_layer(name: str, module: nn.Module, names: tuple[str, ...], attr: str, x: torch.Tensor,
                           H: int, E: int, rec: Any, router_name: str, head: str) -> tuple[MoELayerInfo | None, str]:
    """The layer of a block that applies its own stacked weights by expert id in a loop (``self.w1[e]``), read
    as E entries ``w[e]`` of each (:func:`~themis_compile.passes.parallel_lists.indexed_weights_plan`): the
    weights move into one stacked experts module computing the code read on expert e's entries, served by
    capture and replay (``rewrite == "indexed-weights"``). (layer, "") or (None, why not); raises _Reject
    when the code is read so but capture and replay cannot serve it."""
    step = "step 2 (read them as E entries w[e], the code applying expert e's, on a probe) failed"
    plans = [indexed_weights_plan(module, names, lambda: run_probe(module, x, training=training), H, attr)
             for training in (True, False)]
    (plan, why), (in_eval, eval_why) = plans
    if plan is None or in_eval is None:
        return None, f"{step} ({'train' if plan is None else 'eval'} mode): {why or eval_why}"
    if in_eval.region.code != plan.region.code or in_eval.uses != plan.uses:
        return None, f"{step}: the code applying them differs between train and eval mode"
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    trial = copy.deepcopy(module, shared)
    apply_param_lists(trial, plan)
    # Experts without tokens may be skipped: a stacked weight has its gradient every step all the same
    # (zero rows for them), as the runtime gives it.
    replay_plan, why = replay_mismatch(trial, attr, x, PROBE_SEED, allow_skipping=True, num_experts=E)
    if why is not None:
        raise _Reject(f"{head}; step 3 (serve expert e, the code on w[e], through capture and replay) failed: {why}")
    T = x.shape[:-1].numel()
    K = min(E, max(1, -(-captured_rows(trial, attr, x, PROBE_SEED, num_experts=E) // T)))
    plan = dataclasses.replace(plan, replay=replay_plan)
    return _recorded_layer(name, module, "indexed-weights", E, K, router_name, H, x, rec, attr, plan,
                           "row(s) per token seen at the expert code (behaviour)",
                           f"{describe_region(plan.region)} on {', '.join(f'{n}[e]' for n in names)}"), ""


def _parallel_lists(module: nn.Module) -> tuple[list[tuple[str, nn.Module]], int, tuple[str, nn.Module]] | None:
    """(lists, E, router) of a block whose experts may be spread over parallel ModuleLists of single layers
    (``up[e]``, ``down[e]``): two or more such lists of E >= 2 entries next to a Linear router of E outputs;
    None for any other module."""
    lists = [(attr, child) for attr, child in module.named_children()
             if isinstance(child, nn.ModuleList) and len(child) >= 2 and not is_mlp_like(child[0])
             and all(type(c) is type(child[0]) and any(True for _ in c.parameters()) for c in child)]
    return _lists_and_router(module, lists, 2)


def _lists_and_router(module: nn.Module, lists: list[tuple[str, nn.Module]], least: int
                      ) -> tuple[list[tuple[str, nn.Module]], int, tuple[str, nn.Module]] | None:
    """(lists, E, router) when ``module`` holds at least ``least`` of ``lists``, all of E entries, next to a
    Linear router of E outputs; else None."""
    sizes = {len(child) for _, child in lists}
    if len(lists) < least or len(sizes) != 1:
        return None
    E = sizes.pop()
    router = next(((n, c) for n, c in module.named_children() if isinstance(c, nn.Linear) and c.out_features == E),
                  None)
    return None if router is None else (lists, E, router)


def _param_lists(module: nn.Module) -> tuple[list[tuple[str, nn.Module]], int, tuple[str, nn.Module]] | None:
    """(lists, E, router) of a block whose experts may be bare weights in ParameterLists (``w_in[e]``, applied
    with ``F.linear``): one or more ParameterLists of E >= 2 entries next to a Linear router of E outputs;
    None for any other module."""
    lists = [(attr, child) for attr, child in module.named_children()
             if isinstance(child, nn.ParameterList) and len(child) >= 2]
    return _lists_and_router(module, lists, 1)


def _parallel_lists_layer(name: str, module: nn.Module) -> MoELayerInfo | None:
    """The layer of a block whose expert e is entry e of each of two parallel ModuleLists, called
    ``second[e](between(first[e](rows)))`` with row-wise code ``between`` of the block's own
    (:mod:`themis_compile.passes.parallel_lists`): joined into one ModuleList of experts and served by
    capture and replay (``rewrite == "parallel-lists"``). None when the block is not of that shape or its
    calls are not read so (:func:`parallel_expert_lists_reason` then says why it stays data-parallel);
    raises _Reject when they are read so but capture and replay cannot serve the joined block."""
    found = _parallel_lists(module)
    if found is None:
        return None
    lists, E, (router_name, router) = found
    if len(lists) != 2 or not all(isinstance(child, nn.ModuleList) for _, child in lists):
        return None
    if (why := _non_identical_reason(lists[0][1])) or (why := _non_identical_reason(lists[1][1])):
        return None
    H = router.in_features
    try:
        x = probe_input(module, H)
        run_probe(module, x)
    except Exception:  # noqa: BLE001 - not a block run on hidden states
        return None
    attr = free_attribute(module)
    plan, reasons = None, []
    for (first, _), (second, _) in (lists, lists[::-1]):
        plan, why = parallel_lists_plan(module, first, second, lambda: run_probe(module, x, training=True), H, attr)
        if plan is not None:
            break
        reasons.append(why)
    if plan is None:
        return None
    # One expert for both modes: the code between the calls must not depend on the block's training mode.
    in_eval, _ = parallel_lists_plan(module, plan.first, plan.second, lambda: run_probe(module, x, training=False),
                                     H, attr)
    if in_eval is None or in_eval.between.code != plan.between.code:
        return None
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    trial = copy.deepcopy(module, shared)
    apply_parallel_lists(trial, plan)
    replay_plan, why = replay_mismatch(trial, attr, x, PROBE_SEED, allow_skipping=True)
    head = (f"its {E} experts (scored by '{router_name}') are spread over parallel ModuleLists '{plan.first}' and "
            f"'{plan.second}' (expert e: {plan.second}[e] after {plan.first}[e], "
            f"{describe_between(plan.between)} between them)")
    if why is not None:
        raise _Reject(f"{head}, and capture and replay cannot serve them joined: {why}")
    T = x.shape[:-1].numel()
    K = min(E, max(1, -(-captured_rows(trial, attr, x, PROBE_SEED) // T)))
    plan = dataclasses.replace(plan, replay=replay_plan)
    return _recorded_layer(name, module, "parallel-lists", E, K, router_name, H, x, record_calls(module, x), attr,
                           plan, "row(s) per token seen at the expert calls (behaviour)",
                           f"{plan.first}[e] -> {describe_between(plan.between)} -> {plan.second}[e]")


def _param_lists_layer(name: str, module: nn.Module) -> MoELayerInfo | None:
    """The layer of a block whose expert e is entry e of each of its ParameterLists, applied by the block's
    own code (:mod:`themis_compile.passes.parallel_lists`, ``param_lists_plan``): the entries move into one
    ModuleList of experts computing that code, served by capture and replay (``rewrite == "param-lists"``).
    None when the block holds no such lists or does not select on a probe; raises _Reject naming the step
    that failed when it does."""
    found = _param_lists(module)
    if found is None:
        return None
    lists, E, (router_name, router) = found
    H = router.in_features
    if (probed := _selecting_probe(module, H)) is None:
        return None
    x, rec = probed
    names = tuple(attr for attr, _ in lists)
    for attr, child in lists:
        if len({(tuple(p.shape), p.dtype) for p in child}) != 1:
            shapes = ", ".join(f"{e}: {list(p.shape)} {str(p.dtype).removeprefix('torch.')}"
                               for e, p in enumerate(child))
            raise _Reject(f"its {E} experts (scored by '{router_name}') are entry e of each of the ParameterLists "
                          f"{', '.join(map(repr, names))}: experts are not identical (entries of '{attr}': {shapes})")
    shapes = ", ".join(f"'{attr}' ({E} x Parameter {list(child[0].shape)})" for attr, child in lists)
    head = f"its {E} experts (scored by '{router_name}') are entry e of each of the ParameterLists {shapes}"
    attr = free_attribute(module)
    plans = [param_lists_plan(module, names, lambda: run_probe(module, x, training=training), H, attr)
             for training in (True, False)]
    (plan, why), (in_eval, eval_why) = plans
    if plan is None or in_eval is None:
        raise _Reject(f"{head}; step 1 (read the code applying them, per expert, on a probe) failed "
                      f"({'train' if plan is None else 'eval'} mode): {why or eval_why}")
    # One expert for both modes: the code on the weights must not depend on the block's training mode.
    if in_eval.region.code != plan.region.code or in_eval.uses != plan.uses:
        raise _Reject(f"{head}; step 1 failed: the code applying them differs between train and eval mode")
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    trial = copy.deepcopy(module, shared)
    apply_param_lists(trial, plan)
    replay_plan, why = replay_mismatch(trial, attr, x, PROBE_SEED, allow_skipping=True)
    if why is not None:
        raise _Reject(f"{head}; step 2 (serve the experts so read through capture and replay) failed: {why}")
    T = x.shape[:-1].numel()
    K = min(E, max(1, -(-captured_rows(trial, attr, x, PROBE_SEED) // T)))
    plan = dataclasses.replace(plan, replay=replay_plan)
    return _recorded_layer(name, module, "param-lists", E, K, router_name, H, x, rec, attr, plan,
                           "row(s) per token seen at the expert code (behaviour)",
                           f"{describe_region(plan.region)} on entry e of {', '.join(names)}")


def _recorded_layer(name: str, module: nn.Module, rewrite: str, E: int, K: int, router_name: str, H: int,
                    x: torch.Tensor, rec: Any, attr: str, plan: Any, seen: str, activation: str) -> MoELayerInfo:
    """The layer record of a rewrite whose router is described from the calls ``rec`` recorded on the
    probe ``x`` (``seen``: where the K slots per token were counted)."""
    scores, selection = _recorded_routing(rec)
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=K, experts_form=rewrite,
        router=f"'{router_name}' [E={E}, H={H}]: scores {scores}, selection {selection}, {K} {seen}",
        activation=activation, shared_experts=False, experts_attr=attr, rewrite=rewrite, router_path=router_name,
        score_fn=rec.scores[0] if rec.scores else "none", hidden_size=H, probe_flat=x.dim() == 2, plan=plan)


def parallel_expert_lists_reason(module: nn.Module) -> str | None:
    """Why a block whose experts are spread over parallel ModuleLists of single layers (``up[e]``,
    ``down[e]``: expert e is one entry of each) cannot be sharded; None for any other module. It is when
    two or more such lists of E >= 2 entries sit next to a router of E experts and a forward on a probe
    selects (a top-k, a sort cut to k, a top-1 ``max`` / ``argmax``). The runtime shards, gathers and
    runs whole expert modules; here no module is an expert."""
    found = _parallel_lists(module)
    if found is None:
        return None
    lists, E, router = found
    try:
        rec = record_calls(module, probe_input(module, router[1].in_features))
    except Exception:  # noqa: BLE001 - not a block run on hidden states: not this case
        return None
    if not (rec.ks or rec.top1):
        return None
    names = ", ".join(f"'{attr}' ({E} x {type(child[0]).__name__})" for attr, child in lists)
    return (f"its {E} experts (scored by '{router[0]}') are spread over parallel ModuleLists {names}, expert e "
            "being entry e of each: the runtime shards whole expert modules; hold each expert as one module "
            "(an nn.ModuleList of MLPs called as experts[e](rows)) or as stacked [E, ...] weights called as "
            "experts(x, ids, weights)")


def _behaviour_candidates(module: nn.Module) -> list[_ExpertsChild]:
    """Children that may hold the experts: the structural ones (Step 1), then any other child with
    parameters whose attribute names experts (``experts``, ``moe_experts`` ...), E read from it."""
    found = _experts_children(module)
    seen = {c.attr for c in found}
    for attr, child in module.named_children():
        if attr in seen or _is_sharded(child) or "expert" not in attr.lower() or "shared" in attr.lower():
            continue
        if isinstance(child, (nn.Linear, nn.Embedding, nn.ParameterList)) or not any(True for _ in child.parameters()):
            continue     # (a ParameterList is never called: its entries are, passes.parallel_lists)
        E = declared_num_experts(child)
        if E is None and isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            E = len(expert_modules(child))   # a ModuleDict's entries without parameters are not experts
        if (wrapped := wrapped_expert_list(child)) is not None:
            found.append(_ExpertsChild(attr, child, len(wrapped[1]), "wrapped"))
            continue
        found.append(_ExpertsChild(attr, child, E or 0, "modulelist" if isinstance(child, nn.ModuleList)
                                   else "stacked"))
    return found


def _counts(v: Any) -> list[int] | None:
    """Rows per expert when ``v`` is one (an integer vector, a list of ints, or a floating vector of whole
    numbers: torchtitan counts with ``torch.histc``), else None."""
    if isinstance(v, torch.Tensor) and v.dim() == 1 and (not v.is_floating_point() or bool(
            torch.isfinite(v).all() and (v >= 0).all() and (v == v.round()).all())):
        return [int(c) for c in v]
    if isinstance(v, (list, tuple)) and v and all(isinstance(c, int) for c in v):
        return list(v)
    return None


def returned_rows(out: Any) -> tuple[torch.Tensor | None, int]:
    """(rows, n) of what an experts call returned: a tensor (n = 0), or a tuple of a tensor and n Nones
    (Megatron-Core ``SequentialMLP``: ``(output, output_bias)`` with no bias); (None, 0) otherwise."""
    if isinstance(out, torch.Tensor):
        return out, 0
    if (isinstance(out, tuple) and len(out) >= 2 and isinstance(out[0], torch.Tensor)
            and all(v is None for v in out[1:])):
        return out[0], len(out) - 1
    return None, 0


def _describe_call(args: tuple) -> str:
    return ", ".join(f"{'int' if not a.is_floating_point() else 'float'}{list(a.shape)}"
                     if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)


def _unsupported_call(attr: str, calls: list[tuple], T: int) -> str:
    """Why a recorded experts call is not experts(x_TH, ids_TK, weights_TK), and what would make it so."""
    if not calls:
        return f"the forward never calls '{attr}' on the probe"
    if len(calls) > 1:
        return (f"the forward calls '{attr}' {len(calls)} times per forward ({_describe_call(calls[0])} first); "
                f"call it once as {attr}(x_TH, ids_TK, weights_TK)")
    args = calls[0]
    if len(args) == 3 and isinstance(args[1], torch.Tensor) and args[1].dim() == 3:
        return (f"'{attr}' is called with a dispatch mask ({_describe_call(args)}: one-hot [T, K, E] masks, "
                f"Switch/NLLB style); the runtime needs integer ids [T, K]: call {attr}(x, mask.argmax(-1), "
                "weights) with dropped tokens weighted 0")
    if len(args) == 1 and isinstance(args[0], torch.Tensor) and args[0].dim() >= 3:
        return (f"'{attr}' is called on one tensor alone ({_describe_call(args)}): if those are capacity slots "
                "[E, C, H] between dense dispatch and combine tensors (GShard, DeepSpeed), they are read only when "
                "the block's forward traces with FX, routing code FX cannot trace (torch.finfo of a traced dtype, "
                "one_hot of a traced capacity) kept in a method of the block or in a gate module, and each expert "
                f"runs on its own expert's [C, H] slots; else call {attr}(x_TH, ids_TK, weights_TK)")
    if len(args) == 1:
        return (f"'{attr}' is called on hidden states alone ({_describe_call(args)}), so every expert sees "
                f"every row (routing folded into the input, e.g. Llama-4's scores * x repeated over experts); "
                f"call {attr}(x_TH, ids_TK, weights_TK) with the top-k ids and weights instead")
    return (f"'{attr}' is called as {attr}({_describe_call(args)}), not as {attr}(x_TH, ids_TK, weights_TK) "
            f"(x [T, H], integer ids [T, K], floating weights [T, K], T = {T} probe tokens)")


def dispatch_mask_call(calls: list[tuple], num_experts: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(x_TH, mask_TKE, weights_TK) when the experts were called once with a one-hot dispatch mask in place
    of ids (HF Switch Transformers: ``experts(x [T, H], mask [T, K, E], weights [T, K])``), else None."""
    if len(calls) != 1 or len(calls[0]) != 3 or not all(isinstance(a, torch.Tensor) for a in calls[0]):
        return None
    x_TH, mask_TKE, weights_TK = calls[0]
    if not (x_TH.is_floating_point() and x_TH.dim() == 2 and weights_TK.is_floating_point()
            and not mask_TKE.is_floating_point() and mask_TKE.dim() == 3
            and mask_TKE.shape == (x_TH.shape[0],) + tuple(weights_TK.shape[1:2]) + (num_experts,)
            and weights_TK.shape == mask_TKE.shape[:2]):
        return None
    if mask_TKE.numel() and (((mask_TKE != 0) & (mask_TKE != 1)).any() or int(mask_TKE.sum(-1).max()) > 1):
        return None   # not one-hot: at most one expert per slot
    return x_TH, mask_TKE, weights_TK


def mask_slots(mask_TKE: torch.Tensor, weights_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_TK, weights_TK) of a one-hot dispatch mask: each slot's expert, and its weight where the slot
    is routed (0 where the mask is empty: a token dropped by capacity is sent nowhere, so it adds nothing)."""
    routed_TK = mask_TKE.any(dim=-1)
    return mask_TKE.argmax(dim=-1), weights_TK * routed_TK.to(weights_TK.dtype)


def mask_call_experts_class(experts_cls: type, num_experts: int) -> type:
    """A subclass of a mask-called experts module's class called as ``experts(x_TH, ids_TK, weights_TK)``:
    its own forward on the one-hot mask of the ids (the runtime's interface, same computation)."""

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return experts_cls.forward(self, x_TH, F.one_hot(ids_TK, num_experts), weights_TK)

    forward.__doc__ = f"{experts_cls.__name__}.forward on the one-hot dispatch mask of the ids."
    return type(experts_cls.__name__, (experts_cls,), {"forward": forward, "__module__": experts_cls.__module__,
                                                       "_themis_original_class": experts_cls})


def _dispatch_mask_layer(name: str, module: nn.Module, child: _ExpertsChild,
                         mask: tuple[torch.Tensor, torch.Tensor, torch.Tensor], x: torch.Tensor,
                         routers: list[tuple[str, int, int]], H: int, flat: bool) -> MoELayerInfo:
    """The layer whose experts are called with a one-hot dispatch mask: accepted when its experts, called
    with the ids and weights the mask means (:func:`mask_slots`), compute what the sharded runtime
    computes (:func:`combine_mismatch`); the rewrite serves the block's call with one
    ``experts(x, ids, weights)``."""
    x_TH, mask_TKE, weights_TK = mask
    E, K = child.num_experts, int(mask_TKE.shape[1])
    experts = child.module
    ids_TK, slot_weights_TK = mask_slots(mask_TKE, weights_TK)
    original_cls = type(experts)
    experts.__class__ = mask_call_experts_class(original_cls, E)
    try:
        why = combine_mismatch(experts, x_TH, ids_TK, slot_weights_TK, num_experts=E)
    finally:
        experts.__class__ = original_cls
    if why is not None:
        raise _Reject(f"'{child.attr}' is called with a one-hot dispatch mask ({_describe_call(mask)}), read as "
                      f"ids and weights; but {why}")
    rec = record_calls(module, x)
    router_path, width, H_router = next((r for r in routers if r[1] == E), (None, E, H))
    scores = "+".join(dict.fromkeys(rec.scores)) or "none"
    selection = ", ".join(dict.fromkeys(rec.selections)) or "masks"
    expert0 = expert_modules(experts)[0] if expert_modules(experts) else experts
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=K, experts_form=child.form,
        router=(f"'{router_path}' [E={width}, H={H_router}]: scores {scores}, selection {selection}, top-{K} "
                "one-hot dispatch mask at the experts call (behaviour)"),
        activation=describe_activation(expert0), shared_experts=False, experts_attr=child.attr,
        rewrite="dispatch-mask", router_path=router_path or "", score_fn=rec.scores[0] if rec.scores else "none",
        hidden_size=H, probe_flat=flat)


def flat_call_experts_class(experts_cls: type) -> type:
    """A subclass of an experts module's class that takes unflattened hidden states
    (``experts(x [B, S, H], ids_TK, weights_TK) -> [B, S, H]``, DBRX) whose forward is its own on the
    tokens as one sequence ``[1, T, H]``, the result read as ``[T, H]``: the runtime's interface. (One
    sequence rather than ``[T, H]``: the module's code unpacks or views three dimensions, and a view
    ``(T, -1, H)`` is ambiguous for the empty rows an expert without tokens runs on.)"""

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return experts_cls.forward(self, x_TH.unsqueeze(0), ids_TK, weights_TK).reshape(x_TH.shape)

    forward.__doc__ = f"{experts_cls.__name__}.forward on the tokens as one sequence [1, T, H]."
    return type(experts_cls.__name__, (experts_cls,), {"forward": forward, "__module__": experts_cls.__module__,
                                                       "_themis_original_class": experts_cls})


def _adapted_call_mismatch(experts: nn.Module, adapted_cls: type, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                           weights_TK: torch.Tensor, expected: torch.Tensor, otherwise: str,
                           num_experts: int) -> str | None:
    """Why the sharded runtime would not compute what ``experts`` computes (:func:`combine_mismatch`), or
    None when it does, with ``experts`` seen for the time of the check as ``adapted_cls`` (a subclass of its
    class called as ``experts(x_TH, ids_TK, weights_TK)``). Raises ``_Reject(otherwise)`` when, seen so, it
    does not give ``expected``, the block's own call's result on the probe."""
    original_cls = type(experts)
    experts.__class__ = adapted_cls
    try:
        with torch.no_grad(), preserved_state(experts):
            got = experts(x_TH, ids_TK, weights_TK)
        if not _outputs_close(expected.reshape(got.shape), got):
            raise _Reject(otherwise)
        return combine_mismatch(experts, x_TH, ids_TK, weights_TK, num_experts=num_experts)
    finally:
        experts.__class__ = original_cls


def _flattened_call_layer(name: str, module: nn.Module, child: _ExpertsChild, call: tuple, x: torch.Tensor,
                          routers: list[tuple[str, int, int]], H: int, flat: bool) -> MoELayerInfo:
    """The layer whose experts are called on unflattened hidden states with flat ids and weights
    (``experts(x [B, S, H], ids [T, K], weights [T, K]) -> [B, S, H]``): accepted when its experts give the
    same result on ``x`` flattened to ``[T, H]`` and compute what the sharded runtime computes
    (:func:`combine_mismatch`); the rewrite flattens ``x`` for one ``experts(x_TH, ids, weights)`` call and
    reshapes the result back."""
    x_BSH, ids_TK, weights_TK = call
    experts, E = child.module, child.num_experts
    x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
    where = f"'{child.attr}' is called on unflattened hidden states ({_describe_call(call)})"
    with torch.no_grad(), preserved_state(experts):
        expected = experts(x_BSH, ids_TK, weights_TK)
    if not isinstance(expected, torch.Tensor) or expected.shape != x_BSH.shape:
        raise _Reject(f"{where} and returns {getattr(expected, 'shape', type(expected).__name__)}, not the shape of "
                      f"its input; call {child.attr}(x_TH, ids_TK, weights_TK) -> [T, H]")
    try:
        bank = ExpertBank(experts, num_experts=E or None)
    except ValueError as exc:
        raise _Reject(f"{where}; its experts cannot be cut into equal per-expert chunks "
                      f"({str(exc).split(': ', 1)[-1]})")
    if E and bank.num_experts != E:
        # Neither stacked [E, ...] nor flat [E * F, ...] (every leading dimension a multiple of E).
        shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in experts.named_parameters())
        raise _Reject(f"{where}; its weights ({shapes}) are neither stacked along a leading dimension of its {E} "
                      f"experts nor flat with a multiple of {E} rows in each, so they cannot be cut into "
                      f"per-expert chunks; store them stacked [E, ...] or flat [E * F, ...]")
    why = _adapted_call_mismatch(
        experts, flat_call_experts_class(type(experts)), x_TH, ids_TK, weights_TK, expected,
        f"{where} and computes otherwise on the same hidden states flattened to [T, H]", bank.num_experts)
    if why is not None:
        raise _Reject(f"{where}, read flat; but {why}")
    rec = record_calls(module, x)
    K = int(ids_TK.shape[1])
    router_path, width, H_router = next((r for r in routers if r[1] == E), (None, E, H))
    scores, selection = _recorded_routing(rec)
    expert0 = expert_modules(experts)[0] if expert_modules(experts) else experts
    if bank.flat:      # (DBRX: the activation lives on the module holding the flat weights)
        expert0 = next((m for m in experts.modules() if _named_activation(m)), experts)
    return MoELayerInfo(
        name=name, module=module, num_experts=bank.num_experts, top_k=K,
        experts_form="flat" if bank.flat else child.form,
        router=(f"'{router_path}' [E={width}, H={H_router}]: scores {scores}, selection {selection}, top-{K} ids "
                "seen at the experts call on unflattened hidden states (behaviour)"),
        activation=describe_activation(expert0), shared_experts=False, experts_attr=child.attr,
        rewrite="flatten", router_path=router_path or "", score_fn=rec.scores[0] if rec.scores else "none",
        hidden_size=H, probe_flat=flat)


# --- Experts run on every row, the routing folded into their input (Llama 4) ---------------------------

@dataclass(frozen=True)
class AllRowsPlan:
    """How a block that runs every expert on every row is served: its call ``experts(x_NH) -> y_NH`` with
    ``N = E * T`` rows, expert-major (row ``e * T + t`` is token t's copy for expert e, already scaled by
    the routing; Llama 4), becomes one ``experts(rows, ids, weights)`` call with ``slots`` rows per token.

    ``sparse=False`` (the plain reading): every row is routed to its expert with weight 1, ``slots = E``;
    exact for any expert, but every token goes to every expert. ``sparse=True``: only the rows that are
    not all-zero are routed (at most ``slots``, the router's top-k, per token; fewer are padded with
    weight-0 slots) and zero rows return 0; exact only for experts that map a zero row to 0 with zero
    input- and weight-gradients there (gated, bias-free: ``act(g) * u`` with ``g = u = 0``), which
    detection checks (:func:`zero_rows_reason`)."""

    num_experts: int
    slots: int
    sparse: bool


def serve_all_rows(experts: Callable, x_NH: torch.Tensor, plan: AllRowsPlan) -> torch.Tensor:
    """``y_NH`` of an all-rows call, computed by one ``experts(rows_MH, ids_M1, weights_M1)`` call of the
    runtime's interface (every served row a token of its own, ``M = T * slots``).

    Pseudo-code:
        x [E, T, H] = x_NH viewed expert-major
        served[t, e] = row (e, t) is not all-zero (sparse), else True
        ids [T, K] = each token's served experts first (in expert order), then others, cut to K
        assert no token has more than K served rows        # sparse: more would be cut
        y [T, K, H] = experts(x[ids, t], ids, served[t, ids])   # a padded slot has weight 0
        out [E, T, H] = 0; out[ids, t] = y                 # rows not served stay 0
    """
    E, K = plan.num_experts, plan.slots
    N, H = x_NH.shape
    T = N // E
    if N != E * T:
        raise ValueError(f"an all-rows experts call has {N} rows, not a multiple of its {E} experts")
    x_ETH = x_NH.view(E, T, H)
    if plan.sparse:
        served_TE = (x_ETH != 0).any(dim=-1).transpose(0, 1)
        torch._assert_async(served_TE.sum(dim=-1).max() <= K if T else torch.tensor(True),
                            "a token has more nonzero expert rows than the block selects experts")
    else:
        served_TE = torch.ones((T, E), dtype=torch.bool, device=x_NH.device)
    ids_TK = torch.argsort((~served_TE).to(torch.int8), dim=-1, stable=True)[:, :K]
    t_TK = torch.arange(T, device=x_NH.device).view(T, 1).expand(T, K)
    rows_TKH = x_ETH[ids_TK, t_TK]
    weights_TK = served_TE.gather(1, ids_TK).to(x_NH.dtype)
    y_TKH = experts(rows_TKH.reshape(T * K, H), ids_TK.reshape(-1, 1), weights_TK.reshape(-1, 1)).view(T, K, H)
    # (e, t) pairs are distinct (ids of a token are a permutation's prefix): a plain index_put.
    return x_NH.new_zeros((E, T, H), dtype=y_TKH.dtype).index_put((ids_TK, t_TK), y_TKH).view(N, H)


def all_rows_experts_class(experts_cls: type) -> type:
    """A subclass of an all-rows experts module's class (``experts(x [E * T, H]) -> [E * T, H]``, every
    expert on every row) called as ``experts(x_TH, ids_TK, weights_TK)``: its own forward on every token's
    copy for every expert, combined with each token's weights (0 for experts it does not select). The
    runtime runs it one expert at a time (E = 1 slices), where that is one forward on the expert's rows."""

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        E = next(self.parameters()).shape[0]
        T, H = x_TH.shape
        # No rows: run on one zero row padded to them and keep none of it, so that the expert gets its zero
        # gradient and the (empty) input one too: the runtime's exchange of these rows runs its backward.
        rows_NH = (x_TH if T else F.pad(x_TH, (0, 0, 0, 1))).repeat(E, 1)
        y_ETH = experts_cls.forward(self, rows_NH).view(E, max(T, 1), H)[:, :T]
        w_TE = x_TH.new_zeros((T, E), dtype=y_ETH.dtype).scatter_add_(1, ids_TK, weights_TK.to(y_ETH.dtype))
        return torch.einsum("eth,te->th", y_ETH, w_TE)

    forward.__doc__ = f"{experts_cls.__name__}.forward on every token for every expert, combined with the weights."
    return type(experts_cls.__name__, (experts_cls,), {"forward": forward, "__module__": experts_cls.__module__,
                                                       "_themis_original_class": experts_cls})


@dataclass(frozen=True)
class ScoresCallPlan:
    """Where the arguments of a call ``experts(x, scores [T, E], weights [T, K], ids [T, K])`` (any order
    after ``x``; HF DBRX before v5: ``experts(x, probs, top_weights, top_experts)``) are, and whether ``x``
    came unflattened ``[B, S, H]``. The dense scores are not given to the runtime: a rewritten call passes
    ``scores_from_topk(ids, weights, E)`` in their place, which the probe proves changes nothing."""

    num_args: int
    scores: int
    weights: int
    ids: int
    num_experts: int
    unflattened: bool


def scores_call_plan(calls: list[tuple], T: int) -> ScoresCallPlan | None:
    """The plan of a single call ``experts(x, ...)`` whose other arguments are exactly one integer
    ``[T, K]`` (ids), one floating ``[T, K]`` (weights) and one floating ``[T, E]`` (scores, E != K), else
    None."""
    if len(calls) != 1 or len(calls[0]) != 4 or not all(isinstance(a, torch.Tensor) for a in calls[0]):
        return None
    x, *rest = calls[0]
    if not (x.is_floating_point() and x.dim() in (2, 3) and x.shape[:-1].numel() == T):
        return None
    ids = [i for i, a in enumerate(rest, 1) if not a.is_floating_point() and a.dim() == 2 and a.shape[0] == T]
    floats = [i for i, a in enumerate(rest, 1) if a.is_floating_point() and a.dim() == 2 and a.shape[0] == T]
    if len(ids) != 1 or len(floats) != 2:
        return None
    K = calls[0][ids[0]].shape[1]
    weights = [i for i in floats if calls[0][i].shape[1] == K]
    scores = [i for i in floats if calls[0][i].shape[1] != K]
    if len(weights) != 1 or len(scores) != 1:
        return None
    return ScoresCallPlan(num_args=4, scores=scores[0], weights=weights[0], ids=ids[0],
                          num_experts=int(calls[0][scores[0]].shape[1]), unflattened=x.dim() == 3)


def scores_from_topk(ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Dense scores [T, E] holding the top-k weights at their ids and 0 elsewhere (what a rewritten
    scores call passes for the router's scores, which the runtime does not carry)."""
    return torch.zeros(ids_TK.shape[0], num_experts, dtype=weights_TK.dtype, device=weights_TK.device).scatter(
        1, ids_TK, weights_TK)


def scores_call_args(plan: ScoresCallPlan, x: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor
                     ) -> list[torch.Tensor]:
    """The arguments of the user's call for (x, ids, weights), in the user's order."""
    args: list[Any] = [None] * plan.num_args
    args[0], args[plan.ids], args[plan.weights] = x, ids_TK, weights_TK
    args[plan.scores] = scores_from_topk(ids_TK, weights_TK, plan.num_experts)
    return args


def scores_call_experts_class(experts_cls: type, plan: ScoresCallPlan) -> type:
    """A subclass of a scores-called experts module's class called as ``experts(x_TH, ids_TK, weights_TK)``:
    its own forward on the arguments in its order (:func:`scores_call_args`; ``x`` as one sequence
    ``[1, T, H]`` where the block passed it unflattened), the result read as ``[T, H]``."""

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        x = x_TH.unsqueeze(0) if plan.unflattened else x_TH
        return experts_cls.forward(self, *scores_call_args(plan, x, ids_TK, weights_TK)).reshape(x_TH.shape)

    forward.__doc__ = f"{experts_cls.__name__}.forward on (x, ids, weights) in its own argument order."
    return type(experts_cls.__name__, (experts_cls,), {"forward": forward, "__module__": experts_cls.__module__,
                                                       "_themis_original_class": experts_cls})


def all_rows_call(calls: list[tuple], outputs: list[Any], num_experts: int, T: int, H: int
                  ) -> torch.Tensor | None:
    """The rows ``x [E * T, H]`` when the experts were called once on them alone, returning rows of the
    same shape (every expert on every row, Llama 4), else None."""
    if len(calls) != 1 or len(calls[0]) != 1 or num_experts < 2:
        return None
    (x_NH,), y = calls[0], outputs[0] if outputs else None
    if not (isinstance(x_NH, torch.Tensor) and x_NH.is_floating_point() and x_NH.dim() == 2
            and tuple(x_NH.shape) == (num_experts * T, H)
            and isinstance(y, torch.Tensor) and y.shape == x_NH.shape):
        return None
    return x_NH


class _AllRowsStandIn(nn.Module):
    """The experts of a trial block as the all-rows rewrite serves them (:func:`serve_all_rows`), run as
    the sharded runtime runs them (:class:`RuntimeReference`)."""

    def __init__(self, experts: nn.Module, plan: AllRowsPlan) -> None:
        super().__init__()
        self.reference = RuntimeReference(experts)
        self.plan = plan

    def forward(self, x_NH: torch.Tensor) -> torch.Tensor:
        return serve_all_rows(self.reference, x_NH, self.plan)


def zero_rows_reason(experts: nn.Module, H: int) -> str | None:
    """Why serving only the nonzero rows of an all-rows experts module would not be exact, or None when it
    is: on zero rows its output, its input-gradient and every parameter's gradient must be 0. Checked on
    a copy with random parameters (a zero-initialised bias would pass at the user's weights and fail once
    trained), in train and eval mode, for a random output-gradient."""
    trial = copy.deepcopy(experts)
    params = [p for p in trial.parameters() if p.is_floating_point()]
    gen = torch.Generator().manual_seed(PROBE_SEED)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=gen).to(p))
    E = next(iter(params)).shape[0] if params else 1
    dtype, device = (params[0].dtype, params[0].device) if params else (torch.get_default_dtype(), "cpu")
    for training in (True, False):
        trial.train(training)
        x_NH = torch.zeros((E * 2, H), dtype=dtype, device=device, requires_grad=True)
        with torch.enable_grad():
            torch.manual_seed(PROBE_SEED)
            y_NH = trial(x_NH)
            if not isinstance(y_NH, torch.Tensor) or y_NH.shape != x_NH.shape:
                return f"on zero rows it returns {getattr(y_NH, 'shape', type(y_NH).__name__)}"
            if (y_NH != 0).any():
                return (f"it maps a zero row to {float(y_NH.detach().abs().max()):.3g}, not 0 (a bias, or "
                        "act(0) != 0)")
            g_NH = torch.randn(y_NH.shape, generator=gen).to(y_NH)
            names = ["its input"] + [n for n, p in trial.named_parameters() if p.is_floating_point()]
            grads = torch.autograd.grad((y_NH * g_NH).sum(), [x_NH] + params, allow_unused=True)
        for name, g in zip(names, grads):
            if g is not None and (g != 0).any():
                return f"at zero rows the gradient of {name} is not 0 (a bias, or an ungated activation)"
    return None


def token_copies_reason(x_NH: torch.Tensor, num_experts: int) -> str | None:
    """Why the rows ``x [E * T, H]`` of an all-rows call are not expert-major copies of T tokens (row
    ``e * T + t`` a multiple of token t's hidden state, e.g. scaled by its router score), or None when
    they are on this probe: the rows ``(., t)`` of every t span at most one direction. Only then does a
    token's number of nonzero rows count the experts it is routed to (at most the router's top-k)."""
    E = num_experts
    x_TEH = x_NH.detach().view(E, -1, x_NH.shape[-1]).transpose(0, 1).double()
    s_TR = torch.linalg.svdvals(x_TEH)
    if s_TR.shape[-1] > 1 and bool((s_TR[:, 1] > 1e-6 * s_TR[:, 0]).any()):
        return ("the rows e * T + t of a token t are not copies of one hidden state (row-major by token, or "
                "each expert's rows transformed differently), so its nonzero rows do not count its experts")
    return None


def _all_rows_mismatch(module: nn.Module, attr: str, plan: AllRowsPlan, x: torch.Tensor) -> str | None:
    """Why ``module`` with its all-rows experts served by ``plan`` (each expert run alone, as the runtime
    runs it) differs from ``module`` on the probe ``x``: values in train and eval mode, then the input's and
    every parameter's gradients; None when it agrees."""
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    trial = copy.deepcopy(module, shared)
    experts = trial._modules[attr]
    experts.__class__ = all_rows_experts_class(type(experts))
    trial._modules[attr] = _AllRowsStandIn(experts, plan)
    for training in (True, False):
        expected = run_probe(module, x, training=training)
        try:
            got = run_probe(trial, x, training=training)
        except Exception as exc:
            return f"it fails when served so ({type(exc).__name__}: {exc})".splitlines()[0]
        if not _outputs_close(expected, got):
            return f"its output differs ({'train' if training else 'eval'} mode)"
    why = gradient_mismatch(module, trial, x, PROBE_SEED)
    return None if why is None else f"its gradients differ ({why})"


def _all_rows_layer(name: str, module: nn.Module, child: _ExpertsChild, x_NH: torch.Tensor, x: torch.Tensor,
                    routers: list[tuple[str, int, int]], H: int, flat: bool) -> MoELayerInfo:
    """The layer whose experts run on every row, the routing folded into their input (``experts(x [E * T,
    H])``, Llama 4): served by one ``experts(x, ids, weights)`` call (:func:`serve_all_rows`). The sparse
    reading (the nonzero rows, K = the router's top-k per token) is taken when the experts keep zero rows
    at 0 in value and gradient (:func:`zero_rows_reason`) and the block, served so, equals the original
    on the probe, gradients included; else the plain reading (every row, K = E) when that does; else the
    layer is rejected with what differs."""
    experts, E = child.module, child.num_experts
    T = x_NH.shape[0] // E
    where = (f"'{child.attr}' is called on every row alone ({child.attr}(x [E*T={x_NH.shape[0]}, H={H}]), "
             "Llama 4 style)")
    original_cls = type(experts)
    experts.__class__ = all_rows_experts_class(original_cls)
    try:
        bank = ExpertBank(experts)
    except ValueError as exc:
        raise _CallReject(f"{where}; its experts cannot be cut into equal per-expert chunks "
                          f"({str(exc).split(': ', 1)[-1]})")
    finally:
        experts.__class__ = original_cls
    if bank.num_experts != E:
        raise _CallReject(f"{where}; its weights hold {bank.num_experts} rows along the leading dimension, "
                          f"not {E} experts: store them stacked [E, ...]")
    rec = record_calls(module, x)
    K = rec.ks[-1] if rec.ks else rec.top1
    nonzero_T = (x_NH.view(E, T, H) != 0).any(dim=-1).sum(dim=0)
    plain = AllRowsPlan(num_experts=E, slots=E, sparse=False)
    if not 1 <= K < E:
        why_plain = f"the routing makes {K} selections (topk, max or argmax) on the probe, not 1 to {E - 1}"
    elif (why_plain := token_copies_reason(x_NH, E)) is not None:
        pass
    elif int(nonzero_T.max()) > K:
        why_plain = f"a probe token has {int(nonzero_T.max())} nonzero expert rows, more than its top-{K}"
    else:
        why_plain = (zero_rows_reason(experts, H)
                     or _all_rows_mismatch(module, child.attr, AllRowsPlan(E, K, True), x))
    plan = plain if why_plain else AllRowsPlan(num_experts=E, slots=K, sparse=True)
    if why_plain and (why := _all_rows_mismatch(module, child.attr, plain, x)) is not None:
        raise _CallReject(f"{where}; with row n served by expert n // T (the leading dimension of an [E, T, H] "
                          f"view), {why}: the experts module does not run its rows expert-major, each row by "
                          "its expert alone; view the rows [E, T, H] in its forward")
    router_path, width, H_router = next((r for r in routers if r[1] == E), (None, E, H))
    scores, selection = _recorded_routing(rec)
    reading = (f"the nonzero rows, top-{K} per token (zero rows stay 0 in value and gradient)" if plan.sparse
               else f"every row, K = E = {E} (not only the nonzero ones: {why_plain})")
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=plan.slots, experts_form=child.form,
        router=(f"'{router_path}' [E={width}, H={H_router}]: scores {scores}, selection {selection}; every expert "
                f"on every row, served: {reading} (behaviour)"),
        activation=describe_activation(experts), shared_experts=False, experts_attr=child.attr,
        rewrite="all-rows", router_path=router_path or "", score_fn=rec.scores[0] if rec.scores else "none",
        hidden_size=H, probe_flat=flat, plan=plan)


def _moduledict_replay_layer(name: str, module: nn.Module, child: _ExpertsChild, x: torch.Tensor,
                             routers: list[tuple[str, int, int]], H: int, flat: bool
                             ) -> tuple[MoELayerInfo | None, str | None]:
    """(layer, None) for a block that runs the experts of its ``nn.ModuleDict`` one by one itself (HF
    Switch Transformers and NLLB-MoE before transformers 5: ``getattr(self.experts, f"expert_{idx}")
    (rows)`` over the experts that have tokens), served by capture and replay (``rewrite == "replay"``);
    else (None, why). The experts are the entries with parameters (``expert_modules``); K is read off
    the rows the experts get on the probe (ceil(rows / tokens)), the router from the calls recorded."""
    experts = expert_modules(child.module)
    head = f"the forward runs the experts in '{child.attr}' (ModuleDict) one by one itself"
    if len(experts) < 2:
        return None, f"{head}, but only {len(experts)} of its entries has parameters (an expert)"
    if (why := _non_identical_reason(experts)) is not None:
        return None, why
    plan, why = replay_mismatch(module, child.attr, x, PROBE_SEED, allow_skipping=True)
    if why is not None:
        return None, (f"{head} and capture and replay cannot serve it: {why}; reach the experts only as "
                      f"{child.attr}[key](rows) / getattr({child.attr}, key)(rows), or give the container a "
                      f"forward called once as {child.attr}(x, ids, weights)")
    E, T = plan.num_experts, x.shape[:-1].numel()
    K = min(E, max(1, -(-captured_rows(module, child.attr, x, PROBE_SEED) // T)))
    rec = record_calls(module, x)
    router_path, width, H_router = next((r for r in routers if r[1] == E), (None, E, H))
    scores, selection = _recorded_routing(rec)
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=K, experts_form="moduledict",
        router=(f"'{router_path}' [E={width}, H={H_router}]: scores {scores}, selection {selection}, "
                f"{K} row(s) per token seen at the expert calls (behaviour)"),
        activation=describe_activation(experts[0]), shared_experts=False, experts_attr=child.attr,
        rewrite="replay", router_path=router_path or "", score_fn=rec.scores[0] if rec.scores else "none",
        hidden_size=H, probe_flat=flat, plan=plan), None


def _scores_call_layer(name: str, module: nn.Module, child: _ExpertsChild, plan: ScoresCallPlan, call: tuple,
                       expected: Any, x: torch.Tensor, routers: list[tuple[str, int, int]], H: int,
                       flat: bool) -> MoELayerInfo:
    """The layer whose experts are called with the router's dense scores besides the top-k weights and ids
    (HF DBRX before v5). Accepted when, on the probe, the experts called as ``experts(x_TH, ids, weights)``
    (:func:`scores_call_experts_class`: the dense scores replaced by the top-k weights at their ids) give
    the block's result, and compute what the sharded runtime computes (:func:`combine_mismatch`)."""
    x_in, ids_TK, weights_TK = call[0], call[plan.ids], call[plan.weights]
    x_TH = x_in.reshape(-1, x_in.shape[-1])
    experts, E = child.module, plan.num_experts
    where = f"'{child.attr}' is called with the router's scores ({_describe_call(call)})"
    if child.num_experts and child.num_experts != E:
        raise _Reject(f"{where}, scores of {E} experts, but '{child.attr}' declares {child.num_experts}")
    if not isinstance(expected, torch.Tensor) or expected.shape != x_in.shape:
        raise _Reject(f"{where} and returns {getattr(expected, 'shape', type(expected).__name__)}, not the shape of "
                      f"its input; call {child.attr}(x_TH, ids_TK, weights_TK) -> [T, H]")
    try:
        bank = ExpertBank(experts, num_experts=E)
    except ValueError as exc:
        raise _Reject(f"{where}; its experts cannot be cut into equal per-expert chunks "
                      f"({str(exc).split(': ', 1)[-1]})")
    if bank.num_experts != E:
        shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in experts.named_parameters())
        raise _Reject(f"{where}; its weights ({shapes}) cannot be cut into {E} per-expert chunks; store them "
                      "stacked [E, ...] or flat [E * F, ...]")
    why = _adapted_call_mismatch(
        experts, scores_call_experts_class(type(experts), plan), x_TH, ids_TK, weights_TK, expected,
        f"{where}; with the scores given only at the top-k ids (the weights) it computes otherwise: its result "
        "depends on the scores of experts a token is not routed to", E)
    if why is not None:
        raise _Reject(f"{where}, read as experts(x, ids, weights); but {why}")
    rec = record_calls(module, x)
    K = int(ids_TK.shape[1])
    router_path, width, H_router = next((r for r in routers if r[1] == E), (None, E, H))
    scores, selection = _recorded_routing(rec)
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=K, experts_form="flat" if bank.flat else child.form,
        router=(f"'{router_path}' [E={width}, H={H_router}]: scores {scores}, selection {selection}, top-{K} ids "
                "and the dense scores seen at the experts call (behaviour)"),
        activation=describe_activation(next((m for m in experts.modules() if _named_activation(m)), experts)),
        shared_experts=False, experts_attr=child.attr, rewrite="scores-call", router_path=router_path or "",
        score_fn=rec.scores[0] if rec.scores else "none", hidden_size=H, probe_flat=flat, plan=plan)


def _inspect_by_behaviour(name: str, module: nn.Module) -> MoELayerInfo | None:
    """An MoE layer recognised by what it does, whatever its routing code looks like (``max``, sorts,
    masks, group limits, bias corrections ...): its experts child, swapped for a stand-in, is called once
    as ``experts(x_TH, ids_TK, weights_TK)`` with integer ids and floating weights [T, K], the layer's
    output is unchanged, and that call computes what the sharded runtime computes. The router is
    described from the calls recorded on the probe. Raises _Reject (the call seen and what would make
    it work) when an experts child is called otherwise; None when the module does not call one."""
    reject, probe_errors, probe_ran = None, [], False
    for child in _behaviour_candidates(module):
        routers = _router_widths(module, child.module)
        H = _hidden_size(child, routers) if child.num_experts else next(
            (h for _, _, h in routers), None) or next((p.shape[-1] for p in child.module.parameters()
                                                       if p.dim() >= 2), None)
        if H is None:
            continue
        for flat in (False, True):
            x = probe_input(module, H, flat=flat)
            try:
                run_probe(module, x)
            except Exception as exc:
                if "expert" in child.attr.lower():
                    probe_errors.append(f"{list(x.shape)}: {type(exc).__name__}: {exc}".splitlines()[0][:160])
                continue
            probe_ran = True
            stand_in = ExpertsStandIn(child.module)
            setattr(module, child.attr, stand_in)
            try:
                run_probe(module, x)
            except Exception as exc:
                if "expert" in child.attr.lower() and not stand_in.calls and isinstance(child.module, nn.ModuleDict):
                    # The forward reaches into the ModuleDict (getattr(self.experts, f"expert_{i}")) instead
                    # of calling it: it runs the experts itself, which capture and replay serves.
                    setattr(module, child.attr, child.module)    # the probes below run the real experts
                    found, why = _moduledict_replay_layer(name, module, child, x, routers, H, flat)
                    if found is not None:
                        return found
                    reject = reject or _Reject(why)
                elif "expert" in child.attr.lower() and not stand_in.calls and not isinstance(
                        child.module, nn.ModuleList):
                    # The forward reaches into the experts container (getattr(self.experts, f"expert_{i}"))
                    # instead of calling it: it runs the experts itself.
                    reject = reject or _Reject(
                        f"the forward runs the experts in '{child.attr}' ({type(child.module).__name__}) one by one "
                        f"itself instead of calling '{child.attr}' ({type(exc).__name__} when it is a module "
                        f"called as {child.attr}(x, ids, weights)); give the container a forward called once "
                        "that way, running every expert")
                continue
            finally:
                setattr(module, child.attr, child.module)
            calls = stand_in.calls
            T = x.shape[0] * (x.shape[1] if x.dim() == 3 else 1)
            ok = (len(calls) == 1 and len(calls[0]) == 3 and all(isinstance(a, torch.Tensor) for a in calls[0])
                  and not calls[0][1].is_floating_point() and calls[0][2].is_floating_point()
                  and calls[0][1].dim() == 2)
            per_slot = (len(calls) == 1 and len(calls[0]) == 2 and child.form == "stacked"
                        and all(isinstance(a, torch.Tensor) for a in calls[0])
                        and calls[0][0].is_floating_point() and calls[0][0].dim() == 2
                        and not calls[0][1].is_floating_point() and calls[0][1].dim() == 2
                        and isinstance(stand_in.outputs[0], torch.Tensor)
                        and stand_in.outputs[0].shape == calls[0][1].shape + calls[0][0].shape[-1:])
            rows_out, tail = returned_rows(stand_in.outputs[0]) if stand_in.outputs else (None, 0)
            sorted_rows = (len(calls) == 1 and len(calls[0]) == 2 and child.form in ("stacked", "wrapped")
                           and isinstance(calls[0][0], torch.Tensor) and calls[0][0].is_floating_point()
                           and calls[0][0].dim() == 2 and _counts(calls[0][1]) is not None
                           and len(_counts(calls[0][1])) == child.num_experts
                           and sum(_counts(calls[0][1])) == calls[0][0].shape[0]
                           and rows_out is not None and rows_out.shape[0] == calls[0][0].shape[0])
            if sorted_rows and rows_out.shape != calls[0][0].shape:
                # Half of every expert (JetMoE ParallelExperts): joined with the other half it is called
                # with on the same rows, and the block's row-wise code between the two calls.
                return _joined_layer(name, module, child, calls[0], rows_out, x, routers, H, flat)
            if (mask := dispatch_mask_call(calls, child.num_experts)) is not None:
                return _dispatch_mask_layer(name, module, child, mask, x, routers, H, flat)
            if (scores_plan := scores_call_plan(calls, T)) is not None:
                return _scores_call_layer(name, module, child, scores_plan, calls[0], stand_in.outputs[0], x,
                                          routers, H, flat)
            if sorted_rows or per_slot:
                # torchtitan: experts(rows sorted by expert, rows per expert) -> one output row per row;
                # gpt-fast: experts(x_TH, ids_TK) -> y_TKH, combined by the block itself. passes.shard
                # rewrites the call and verifies the rewrite against the runtime's computation.
                rec = record_calls(module, x)
                E = child.num_experts
                if sorted_rows:
                    K, rewrite = max(1, calls[0][0].shape[0] // T), "sorted-rows"
                    seen = "rows sorted by expert with counts at the experts call"
                else:
                    K, rewrite = int(calls[0][1].shape[1]), "per-slot"
                    seen = f"top-{K} ids seen at the experts call"
                router_path, width, H_router = next((r for r in routers if r[1] == E), (None, E, H))
                scores, selection = _recorded_routing(rec)
                return MoELayerInfo(
                    name=name, module=module, num_experts=E, top_k=K, experts_form=child.form,
                    router=(f"'{router_path}' [E={width}, H={H_router}]: scores {scores}, selection {selection}, "
                            f"{seen} (behaviour)"),
                    activation=describe_activation((expert_modules(child.module) or [child.module])[0]),
                    shared_experts=False, experts_attr=child.attr,
                    rewrite=rewrite, router_path=router_path or "",
                    score_fn=rec.scores[0] if rec.scores else "none", hidden_size=H, probe_flat=flat,
                    call_tail=tail if sorted_rows else 0)
            if (rows := all_rows_call(calls, stand_in.outputs, child.num_experts, T, H)) is not None:
                return _all_rows_layer(name, module, child, rows, x, routers, H, flat)
            if not ok:
                # Only a child that names experts, or is called with integer ids, is an experts
                # container used otherwise; a parent of a whole MoE block is not.
                ids_like = any(isinstance(a, torch.Tensor) and not a.is_floating_point() for c in calls for a in c)
                if "expert" in child.attr.lower() or ids_like:
                    reject = reject or _Reject(_unsupported_call(child.attr, calls, T))
                break
            x_TH, ids_TK, weights_TK = calls[0]
            if child.form == "modulelist" and (why := _non_identical_reason(child.module)):
                raise _Reject(why)
            if x_TH.dim() > 2 and x_TH.shape[:-1].numel() == ids_TK.shape[0]:
                return _flattened_call_layer(name, module, child, calls[0], x, routers, H, flat)
            form, detail = experts_call_form(module, child.attr, x, ids_TK.shape[1])
            if form != "none":
                raise _Reject(detail)
            rec = record_calls(module, x)
            E, K = ExpertBank(child.module).num_experts, int(ids_TK.shape[1])
            router_path, width, H_router = next((r for r in routers if r[1] == E), (None, E, H))
            scores, selection = _recorded_routing(rec)
            router_text = (f"'{router_path}' [E={width}, H={H_router}]: scores {scores}, selection {selection}, "
                           f"top-{K} ids seen at the experts call (behaviour)")
            expert0 = child.module[0] if child.form == "modulelist" else child.module
            return MoELayerInfo(
                name=name, module=module, num_experts=E, top_k=K, experts_form=child.form, router=router_text,
                activation=describe_activation(expert0), shared_experts=False, experts_attr=child.attr,
                rewrite="none", router_path=router_path or "", score_fn=rec.scores[0] if rec.scores else "none",
                hidden_size=H, probe_flat=flat)
    if reject is not None:
        raise reject
    if probe_errors and not probe_ran:
        raise _ProbeFailed(f"the forward fails on probe hidden states ({'; '.join(probe_errors)}); detection runs a "
                      "block on hidden states alone: keep the MoE in a module called as moe(hidden_states), "
                      "with any other input (token ids for hash routing, masks) optional")
    return None


def _joined_layer(name: str, module: nn.Module, child: _ExpertsChild, call: tuple, out_NW: torch.Tensor,
                  x: torch.Tensor, routers: list[tuple[str, int, int]], H: int, flat: bool) -> MoELayerInfo:
    """The layer of a block whose stacked experts module ``child`` holds only the first half of every expert
    (called on rows sorted by expert, ``[N, H] -> [N, W]``): joined with a second stacked module of as many
    experts called on the same counts (``[N, F] -> [N, H]``) and the block's code between the two calls, read
    off a probe and proved row-wise (:mod:`themis_compile.passes.joined`). ``rewrite == "joined"``; raises
    _CallReject with the reason when no second half joins it so."""
    rows_NH, counts = call
    E, N = child.num_experts, rows_NH.shape[0]
    seen = (f"'{child.attr}' is called on rows sorted by expert ({_describe_call(call)}) but maps rows of width "
            f"{rows_NH.shape[-1]} to {out_NW.shape[-1]}: only part of each expert")
    why = ("no other stacked module of as many experts is called on the same rows after it; hold whole experts in "
           "one module mapping [N, H] rows to [N, H], or the second half in a stacked module called as "
           f"second(rows, counts) on the rows the code after '{child.attr}' computes")
    for second in _experts_children(module):
        if second.attr == child.attr or second.form != "stacked" or second.num_experts != E:
            continue
        rec = record_between(module, child.attr, second.attr, lambda: run_probe(module, x))
        firsts = [c for w, c in rec.calls if w == "first"]
        seconds = [(c, o) for (w, c), o in zip(rec.calls, rec.outputs) if w == "second"]
        if len(firsts) != 1 or len(seconds) != 1:
            why = (f"'{child.attr}' and '{second.attr}' are called {len(firsts)} and {len(seconds)} times per forward; "
                   "each half must be called once")
            continue
        (second_call, second_out), (second_rows, _) = seconds[0], returned_rows(seconds[0][1])
        if not (len(second_call) == 2 and _counts(second_call[1]) == _counts(counts)
                and isinstance(second_call[0], torch.Tensor) and second_call[0].shape[0] == N
                and second_rows is not None and tuple(second_rows.shape) == tuple(rows_NH.shape)):
            why = (f"'{second.attr}' is called as {second.attr}({_describe_call(second_call)}) -> "
                   f"{_describe_call((second_out,))}, not on the {N} rows and counts of '{child.attr}' returning "
                   f"[{N}, {rows_NH.shape[-1]}] rows")
            continue
        if rec.reason is not None or (why_rows := row_mixing_reason(rec.between, rec.h)) is not None:
            why = (f"the code between '{child.attr}' and '{second.attr}' cannot be part of an expert: "
                   f"{rec.reason or why_rows}; keep it row-wise (each row computed from that row alone by torch "
                   "functions)")
            continue
        plan = JoinedPlan(attr=free_attribute(module), first=child.attr, second=second.attr, between=rec.between,
                          width=int(out_NW.shape[-1]), num_experts=E,
                          counts_as_list=not isinstance(counts, torch.Tensor))
        ids_N1 = torch.repeat_interleave(torch.arange(E), torch.as_tensor(_counts(counts))).view(-1, 1)
        if (mismatch := combine_mismatch(plan.experts_of(module), rows_NH, ids_N1.to(rows_NH.device),
                                         torch.ones(ids_N1.shape, dtype=rows_NH.dtype, device=rows_NH.device),
                                         E)) is not None:
            raise _CallReject(f"{seen}, joined with '{second.attr}': {mismatch}")
        rec_calls = record_calls(module, x)
        T = x.shape[0] * (x.shape[1] if x.dim() == 3 else 1)
        router_path, width, H_router = next((r for r in routers if r[1] == E), (None, E, H))
        scores = "+".join(dict.fromkeys(rec_calls.scores)) or "none"
        selection = ", ".join(dict.fromkeys(rec_calls.selections)) or "no top-k/max/sort call (masks)"
        return MoELayerInfo(
            name=name, module=module, num_experts=E, top_k=max(1, N // T), experts_form="joined",
            router=(f"'{router_path}' [E={width}, H={H_router}]: scores {scores}, selection {selection}, rows sorted "
                    f"by expert with counts at '{child.attr}' and '{second.attr}' (behaviour)"),
            activation=f"{child.attr} -> {describe_between(rec.between)} -> {second.attr}", shared_experts=False,
            experts_attr=plan.attr, rewrite="joined", router_path=router_path or "",
            score_fn=rec_calls.scores[0] if rec_calls.scores else "none", hidden_size=H, probe_flat=flat, plan=plan)
    raise _CallReject(f"{seen}; {why}")


def _inspect_routing(name: str, module: nn.Module) -> MoELayerInfo | None:
    """The layer found from its routing code: a top-k over a learned router's scores (FX graph, or the
    calls recorded on a probe when FX fails), the experts called as experts(x, ids, weights) or looped
    over inline."""
    # Step 1: an experts-like child, preferably the one a router of its width scores.
    children = _experts_children(module)
    if not children:
        return None
    routers_all = {c.attr: _router_widths(module, c.module) for c in children}
    child = next((c for c in children if any(w == c.num_experts for _, w, _ in routers_all[c.attr])), children[0])
    routers, E = routers_all[child.attr], child.num_experts
    H = _hidden_size(child, routers)

    # Step 2: trace (FX first; when FX fails, record the calls on a probe).
    traced, fx_error = None, None
    try:
        traced = trace_block(module, child.module)
    except Exception as exc:
        fx_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    if traced is not None and traced.branch_nodes and not expert_nodes(traced.gm.graph, child.attr):
        # Every expert call sits under a branch on a traced value (`if mask.any():`), which the trace
        # took as False: the graph holds no expert call to rewrite. Read the layer as untraceable.
        traced, fx_error = None, "the expert calls are guarded by branches on traced values"
    topks = selections_of(traced.gm.graph) if traced else []   # top-k, else top-1 (max / argmax)
    if not topks and not any(w == E for _, w, _ in routers):
        return None   # not MoE-like: no top-k and no router of the experts' width

    # Step 3: checks, cheapest first.
    if child.form == "modulelist" and (why := _non_identical_reason(child.module)):
        raise _Reject(why)
    if H is None:
        raise _Reject(f"no router weight [E, H] next to its {E} experts and no Linear to tell the hidden size; "
                      "give the block its router as an nn.Linear(H, E) or a weight [E, H]")
    router = None
    if traced is not None:
        if not topks and (why := variable_selection_reason(traced.gm, E)) is not None:
            raise _Reject(why)
        if not topks:
            raise _Reject("no top-k selection (torch.topk, or max / argmax for top-1) in the traced forward of the "
                          "block or its router, and its experts are not called once as experts(x, ids, weights); "
                          "select with topk, max or argmax, or "
                          "call the experts that way (integer ids [T, K], weights [T, K])")
        router = router_of(traced.gm, topks[-1])
        if router is None:
            raise _Reject("the top-k does not select over scores of a learned router (no Linear or weight [E, H] "
                          "before it)")
        if router[1] != E:
            raise _Reject(f"router '{router[0]}' scores {router[1]} experts but '{child.attr}' holds {E}")
        k = selection_k(topks[-1], {})
        if isinstance(k, int) and not 1 <= k <= E:
            # An MoE layer with a broken top-k: reported as found so that sharding it fails loudly,
            # naming the layer (check_layer), rather than leaving it silently unsharded.
            return MoELayerInfo(
                name=name, module=module, num_experts=E, top_k=k, experts_form=child.form,
                router=f"'{router[0]}' [E={router[1]}, H={router[2]}]: top-{k} (FX graph)",
                activation=_named_activation(child.module[0] if child.form == "modulelist" else child.module)
                or "unknown", shared_experts=False, experts_attr=child.attr, router_path=router[0], hidden_size=H)
    x, errors = None, []
    for flat in (False, True):
        try:
            x = probe_input(module, H, flat=flat)
            run_probe(module, x)
            break
        except Exception as exc:
            errors.append(f"{list(x.shape)}: {type(exc).__name__}: {exc}".splitlines()[0][:200])
            x = None
    if x is None:
        raise _ProbeFailed(f"the forward fails on probe hidden states ({'; '.join(errors)}); detection runs a "
                      "block on hidden states alone: keep the MoE in a module called as moe(hidden_states)")

    if traced is not None:
        try:
            record_meta(traced, module, x)
        except Exception as exc:
            raise _Reject(f"the traced forward does not run on a probe: {exc}")
        topk = topks[-1]
        top_k = selection_k(topk, traced.meta)
        scores_meta = traced.meta.get(topk.args[0]) if is_topk(topk) and topk.args else None
        dim = topk.args[2] if len(topk.args) > 2 else topk.kwargs.get("dim", -1)
        if isinstance(scores_meta, TensorMeta) and isinstance(dim, int) and scores_meta.shape and (
                why := expert_choice_reason(scores_meta.shape, dim % len(scores_meta.shape), E,
                                            x.numel() // x.shape[-1])):
            raise _Reject(why)
        router_path, width, H_router = router
        values, indices = selection_outputs(topk)
        before = {score_kind(n) for n in ancestors(topk)} - {None}
        after = {score_kind(n) for n in descendants(values)} - {None}
        succ = effective_users(traced.gm.graph)
        if not any(n.op == "output" for n in reachable(values + indices, lambda n: succ[n])):
            raise _Reject("the top-k weights and ids never reach the output (no weighted combine); the output must "
                          "combine the selected experts' outputs with the top-k weights")
    else:
        rec = record_calls(module, x)
        ks, scores = rec.ks or [1] * rec.top1, rec.scores    # no top-k: each max / argmax selects one expert
        if not ks and (uncut := [kind for kind in rec.uncut_sorts if kind]):
            raise _Reject(f"a {uncut[0]} ran on a probe but its output was never cut to a fixed k ([..., :k]) and no "
                          f"topk, max or argmax ran (FX tracing failed: {fx_error}): the number of experts per "
                          "token is not fixed (top-p / threshold routing?); FSSDP routes every token to exactly k "
                          "experts: select them with torch.topk or a sort cut to k")
        if not ks:
            raise _Reject(f"no top-k selection: FX tracing failed ({fx_error}) and no topk, max or argmax ran on a "
                          "probe; select with torch.topk (max / argmax for top-1), or call the experts once as "
                          "experts(x, ids, weights)")
        top_k = ks[-1]
        if rec.topk_inputs and rec.selections[-1].startswith("topk(") and (
                why := expert_choice_reason(*rec.topk_inputs[-1], E, x.numel() // x.shape[-1])):
            raise _Reject(why)
        router_path, width, H_router = next((r for r in routers if r[1] == E), None) or (None, None, H)
        if router_path is None:
            widths = sorted({w for _, w, _ in routers})
            raise _Reject(f"no router scores its {E} experts (Linear/weight widths {widths}); FX tracing failed "
                          f"({fx_error})")
        before, after = set(scores[:1]), set(scores[1:])
    if top_k is None or not 1 <= top_k <= E:
        raise _Reject(f"top-k of {top_k} is not in [1, {E}]")

    # Step 4: how the experts are called.
    form, detail = experts_call_form(module, child.attr, x, top_k)
    if form == "unsupported":
        raise _Reject(detail)
    replay_plan = None
    if form == "inline-loop" and traced is None:
        # Not traceable: the loop stays as written, served by capture and replay (passes.replay).
        # Skipping experts without tokens is allowed: the runtime then leaves their gradients None
        # (skips_empty_experts reads the plan).
        replay_plan, why = replay_mismatch(module, child.attr, x, PROBE_SEED, allow_skipping=True)
        if why is not None:
            raise _Reject(f"its forward loops over the experts inline and cannot be traced to rewrite it ({fx_error}); "
                          f"capture and replay cannot serve it either: {why}")
        form = "replay"

    # Step 5: description.
    score = sorted(before)[0] if before else (sorted(after)[0] if after else "none")
    order = f"{score} -> top-{top_k}" if before else f"top-{top_k} -> {score}" if after else f"top-{top_k}"
    if traced is not None:
        by = describe_selection(topk)
    else:    # the selection whose k is the layer's: the last top-k or sort cut recorded
        by = next((sel for sel in reversed(rec.selections) if sel.startswith(("topk(", "sort[", "argsort["))), "")
        by = by if "sort[" in by else ""
    if by:
        order += f" by {by}"
    how = "FX graph" if traced is not None else "recorded on a probe (FX failed)"
    router_text = f"'{router_path}' [E={width}, H={H_router}]: {order} ({how})"
    expert0 = child.module[0] if child.form == "modulelist" else child.module
    combined: list[fx.Node] = []
    if traced is not None:
        combined = [n for n in traced.gm.graph.nodes if n.op == "call_module" and n.target == child.attr]
        if not combined:
            y = combine_node(traced, child.attr)
            combined = [y] if y is not None else []
    shared = _shared_experts(traced, module, combined, child.attr) if traced is not None else ()
    aux = _auxiliary(traced, combined) if traced is not None else ()
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=int(top_k), experts_form=child.form, router=router_text,
        activation=describe_activation(expert0), shared_experts=bool(shared), experts_attr=child.attr,
        rewrite=form, router_path=router_path, score_fn=score, hidden_size=H, shared_expert_names=shared,
        aux_losses=aux, probe_flat=x.dim() == 2, plan=replay_plan,
    )


# --- Dense dispatch tensors (GShard, fairseq Top2Gate) -----------------------------------------------

@dataclass(frozen=True)
class DenseDispatch:
    """Where a dense-dispatch block's parts are in its traced graph: hidden states ``x [T, H]`` dispatched
    into per-expert capacity slots, the combine weights ``[T, E, C]``, the combined output ``y [T, H]``."""

    x: fx.Node
    combine: fx.Node
    y: fx.Node


def _reach_avoiding(starts: list[fx.Node], succ: dict[fx.Node, list[fx.Node]], avoid: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [s for s in starts if s not in avoid]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(u for u in succ[n] if u not in avoid and u not in seen)
    return seen


def dense_dispatch_of(traced: TracedBlock, attr: str, num_experts: int) -> DenseDispatch | None:
    """The dense dispatch of a traced block (needs ``traced.meta``), or None when it has none.

    Every expert is called once (on its capacity slots); ``y`` is the first ``[T, H]`` value all their
    outputs flow through on the way to the output; ``combine`` the nearest ``[T, E, C]`` floating value
    that reaches ``y`` other than through the experts; ``x`` the last ``[T, H]`` floating value that feeds
    every expert and is not computed from ``combine``."""
    graph, meta = traced.gm.graph, traced.meta
    calls = expert_nodes(graph, attr)
    ids = [expert_index(c, attr) for c in calls]
    if (not calls or any(c.op != "call_module" for c in calls) or len(set(ids)) != len(ids)
            or len(ids) != num_experts):
        return None
    succ = effective_users(graph)
    out = output_node(graph)
    reach = reach_by_expert(calls, attr, succ)
    common = set.intersection(*reach.values())
    after_calls = reachable(calls, lambda n: succ[n])

    def floating(n: fx.Node, dims: int) -> TensorMeta | None:
        m = meta.get(n)
        return m if isinstance(m, TensorMeta) and len(m.shape) == dims and m.dtype.is_floating_point else None

    y = next((n for n in graph.nodes if n in common and n not in calls and n is not out and floating(n, 2)
              and not is_inplace(n) and out not in _reach_avoiding(calls, succ, {n})), None)
    if y is None:
        return None
    T, H = meta[y].shape
    combine = [n for n in graph.nodes if n not in after_calls and (m := floating(n, 3)) is not None
               and m.shape[:2] == (T, num_experts) and y in _reach_avoiding([n], succ, set(calls))]
    if not combine:
        return None
    after_combine = reachable([combine[-1]], lambda n: succ[n])
    feeds = [reachable([c], lambda n: n.all_input_nodes) for c in calls]
    xs = [n for n in graph.nodes if n not in after_calls and n not in after_combine
          and (m := floating(n, 2)) is not None and m.shape == (T, H) and all(n in f for f in feeds)]
    return DenseDispatch(x=xs[-1], combine=combine[-1], y=y) if xs else None


def _inspect_dense_dispatch(name: str, module: nn.Module) -> MoELayerInfo | None:
    """A block that dispatches tokens to its ``ModuleList`` experts through dense ``[T, E, C]`` tensors
    (GShard / fairseq ``Top2Gate``: one-hot dispatch mask, experts on ``[E, C, H]`` capacity slots,
    combine ``einsum("sec,ecm->sm", combine, expert_outputs)``), or None when it is not one.

    K is the number of selections its routing makes on a probe (a top-k's k, else one per max / argmax).
    :mod:`themis_compile.passes.shard` rewrites dispatch, experts and combine into one
    ``experts(x, ids, weights)`` call with (ids, weights) read from the combine tensor."""
    children = [c for c in _experts_children(module) if c.form == "modulelist"] + _wrapped_experts_children(module)
    if not children or _non_identical_reason(expert_list(module, children[0].attr)):
        return None
    child = children[0]
    routers = _router_widths(module, child.module)
    E, H = child.num_experts, _hidden_size(child, routers)
    if H is None:
        return None
    try:
        traced = trace_block_with_method_leaves(module, expert_list(module, child.attr))
    except Exception:
        return None
    for flat in (False, True):
        x = probe_input(module, H, flat=flat)
        try:
            record_meta(traced, module, x)
            break
        except Exception:
            x = None
    if x is None or (found := dense_dispatch_of(traced, expert_call_path(module, child.attr), E)) is None:
        return None
    # From here on the block is a dense-dispatch block: what stops it is said.
    if traced.branch_nodes:
        raise _Reject("it dispatches through dense [T, E, C] tensors but its forward branches on a traced value; "
                      "a rewritten forward cannot keep that branch (move it into a method of the block)")
    rec = record_calls(module, x)
    K = rec.ks[-1] if rec.ks else rec.top1
    if not 1 <= K <= E:
        raise _Reject(f"it dispatches through dense [T, E, C] tensors but makes {K} selections (topk, max or "
                      f"argmax) on a probe, not 1 to {E}: the number of experts a token is sent to is unknown")
    router_path, width, H_router = next((r for r in routers if r[1] == E), (None, E, H))
    scores = "+".join(dict.fromkeys(rec.scores)) or "none"
    selection = ", ".join(rec.selections) or "none"
    C = traced.meta[found.combine].shape[-1]
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=K, experts_form=child.form,
        router=(f"'{router_path}' [E={width}, H={H_router}]: scores {scores}, selection {selection}; top-{K} read "
                f"from the combine tensor [T, E, C={C}] (FX graph, methods kept)"),
        activation=describe_activation(expert_list(module, child.attr)[0]), shared_experts=False,
        experts_attr=child.attr,
        rewrite="dense-dispatch", router_path=router_path or "", score_fn=rec.scores[0] if rec.scores else "none",
        hidden_size=H, aux_losses=_auxiliary(traced, [found.y]), probe_flat=flat)


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
    needy = [name for name, why in rejected if isinstance(why, _ProbeFailed)]
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
             ) -> tuple[list[MoELayerInfo], list[tuple[str, _Reject | str]]]:
    """:func:`find_moe_layers` on the probes as they run now (the modules ``names`` only, when given;
    none inside the experts of the layers ``outside``); a rejection is its exception when it is one."""
    found: list[MoELayerInfo] = []
    rejected: list[tuple[str, _Reject | str]] = []
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
        except _Reject as why:
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
            info.probe_call = recorded_call(module)
            found.append(info)
            logger.debug("MoE layer %s: %s", name, info.describe())
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


def explain_moe_layers(model: nn.Module, example_inputs: ExampleInputs | None = None) -> str:
    """A readable report of the MoE layers found and of the MoE-like modules rejected, with reasons."""
    infos, rejected = find_moe_layers(model, example_inputs)
    lines = [f"{len(infos)} MoE layer(s) found"]
    for info in infos:
        lines.append(f"  {info.name}:")
        lines.append(f"    router:         {info.router}")
        lines.append(f"    experts:        {info.num_experts} ({info.experts_form}, attribute "
                     f"'{info.experts_attr}'), top-{info.top_k}")
        lines.append(f"    activation:     {info.activation}")
        lines.append(f"    shared experts: {', '.join(info.shared_expert_names) or 'none'}")
        if shared := shared_parameter_names(info):
            lines.append(f"    every expert uses: {', '.join(shared)} (dense, data-parallel)")
        for aux in info.aux_losses:
            lines.append(f"    auxiliary:      {aux}")
        if info.probe_call is not None:
            lines.append("    probed with:    the arguments it gets in a forward of the model (recorded)")
        lines.append(f"    experts call:   " + {"none": "experts(x, ids, weights)",
                                                "per-slot": "experts(x, ids) -> [T, K, H] (rewritten by optimize)",
                                                "sorted-rows": "experts(rows sorted by expert, counts) (rewritten "
                                                               "by optimize)",
                                                "replay": "experts[i](rows) in an untraceable forward (capture "
                                                          "and replay by optimize)",
                                                "dense-dispatch": "each expert on its [C, H] capacity slots between "
                                                                  "[T, E, C] dispatch and combine tensors "
                                                                  "(rewritten by optimize)",
                                                "dispatch-mask": "experts(x, one-hot mask [T, K, E], weights) "
                                                                 "(rewritten by optimize)",
                                                "flatten": "experts(x [B, S, H], ids, weights) (rewritten by "
                                                           "optimize to flat x [T, H])",
                                                "all-rows": "experts(x [E*T, H]), every expert on every row "
                                                            "(rewritten by optimize)",
                                                "scores-call": "experts(x, scores [T, E], weights, ids) (rewritten "
                                                               "by optimize to experts(x, ids, weights))",
                                                "joined": "two halves of each expert on rows sorted by expert, "
                                                          "row-wise code between them (joined by optimize into "
                                                          f"'{info.experts_attr}', one experts call)",
                                                "zero-experts": "experts(x, ids, weights), ids >= E identity "
                                                                "experts (served by the rewrite)"}.get(
                                                    info.rewrite, "inline loop over the experts (rewritten by "
                                                    "optimize)"))
    if rejected:
        lines.append(f"{len(rejected)} MoE-like module(s) rejected")
        for name, why in rejected:
            lines.append(f"  {name}: {why}")
    if not infos and not rejected:
        lines.append(f"  searched for {SEARCHED}")
    return "\n".join(lines)
