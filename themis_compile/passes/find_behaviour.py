"""Recognize an MoE block by what it does, whatever its routing code looks like (``max``, sorts, masks,
group limits, bias corrections): its experts child, swapped for a stand-in on a probe, is called once, and
the call's shape says the style — ``experts(x_TH, ids_TK, weights_TK)`` ("none"), per slot
``experts(x_TH, ids_TK) -> y_TKH`` ("per-slot", gpt-fast), on rows sorted by expert ``experts(rows_NH,
counts_E)`` ("sorted-rows", torchtitan), half of each expert on sorted rows ("joined", JetMoE), a one-hot
mask ("dispatch-mask", HF Switch), unflattened hidden states ("flatten", DBRX), every expert on every row
("all-rows", Llama 4), the router's dense scores beside the top-k ("scores-call", DBRX before v5), or a
``ModuleDict`` whose entries the forward runs itself ("replay"). The matchers of one call are tried in
:data:`CALL_STYLES` order. A whole-module call is accepted only when it computes what the sharded runtime
computes (:func:`~themis_compile.passes.candidates.combine_mismatch`).

:func:`find_by_behaviour` is one analysis of :data:`themis_compile.passes.detect.ANALYSES`.

Shape suffixes: B batch, S sequence, T tokens, N rows, H hidden size, E experts, K top-k.
"""

from __future__ import annotations

import copy
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from themis_compile.layer_info import MoELayerInfo
from themis_compile.passes.candidates import (
    CallReject,
    ExpertsChild,
    ProbeFailed,
    Reject,
    RuntimeReference,
    combine_mismatch,
    describe_activation,
    expert_hidden_size,
    experts_call_form,
    experts_children,
    is_sharded,
    named_activation,
    non_identical_reason,
    outputs_close,
    recorded_routing,
    router_widths,
)
from themis_compile.passes.fx_graph import (
    record_calls,
)
from themis_compile.passes.joined import (
    JoinedPlan,
    describe_between,
    free_attribute,
    record_between,
    row_mixing_reason,
)
from themis_compile.passes.probe import (
    PROBE_SEED,
    ExpertsStandIn,
    preserved_state,
    probe_input,
    run_probe,
)
from themis_compile.passes.replay import (
    captured_rows,
    gradient_mismatch,
    replay_mismatch,
)
from themis_compile.runtime.experts import (
    ExpertBank,
    declared_num_experts,
    expert_modules,
    wrapped_expert_list,
)

logger = logging.getLogger(__name__)


def behaviour_router(routers: list[tuple[str, int, int]], E: int, H: int, rec: Any, seen: str, *, sep: str = ", "
                     ) -> dict[str, str]:
    """The router fields of a layer found by behaviour (``router``, ``router_path``, ``score_fn`` of
    :class:`MoELayerInfo`): the router of width E among ``routers``, the score functions and selections a
    probe recorded (``rec``), and ``seen``, what the experts call showed."""
    path, width, H_router = next((r for r in routers if r[1] == E), (None, E, H))
    scores, selection = recorded_routing(rec)
    router = f"'{path}' [E={width}, H={H_router}]: scores {scores}, selection {selection}{sep}{seen} (behaviour)"
    return {"router": router, "router_path": path or "", "score_fn": rec.scores[0] if rec.scores else "none"}


def _behaviour_candidates(module: nn.Module) -> list[ExpertsChild]:
    """Children that may hold the experts: the structural ones (Step 1), then any other child with
    parameters whose attribute names experts (``experts``, ``moe_experts`` ...), E read from it."""
    found = experts_children(module)
    seen = {c.attr for c in found}
    for attr, child in module.named_children():
        if attr in seen or is_sharded(child) or "expert" not in attr.lower() or "shared" in attr.lower():
            continue
        if isinstance(child, (nn.Linear, nn.Embedding, nn.ParameterList)) or not any(True for _ in child.parameters()):
            continue     # (a ParameterList is never called: its entries are, passes.parallel_lists)
        E = declared_num_experts(child)
        if E is None and isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            E = len(expert_modules(child))   # a ModuleDict's entries without parameters are not experts
        if (wrapped := wrapped_expert_list(child)) is not None:
            found.append(ExpertsChild(attr, child, len(wrapped[1]), "wrapped"))
            continue
        found.append(ExpertsChild(attr, child, E or 0, "modulelist" if isinstance(child, nn.ModuleList)
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


def _dispatch_mask_layer(name: str, module: nn.Module, child: ExpertsChild,
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
        raise Reject(f"'{child.attr}' is called with a one-hot dispatch mask ({_describe_call(mask)}), read as "
                      f"ids and weights; but {why}")
    expert0 = expert_modules(experts)[0] if expert_modules(experts) else experts
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=K, experts_form=child.form,
        **behaviour_router(routers, E, H, record_calls(module, x),
                           f"top-{K} one-hot dispatch mask at the experts call"),
        activation=describe_activation(expert0), shared_experts=False, experts_attr=child.attr,
        rewrite="dispatch-mask", hidden_size=H, probe_flat=flat)


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
    class called as ``experts(x_TH, ids_TK, weights_TK)``). Raises ``Reject(otherwise)`` when, seen so, it
    does not give ``expected``, the block's own call's result on the probe."""
    original_cls = type(experts)
    experts.__class__ = adapted_cls
    try:
        with torch.no_grad(), preserved_state(experts):
            got = experts(x_TH, ids_TK, weights_TK)
        if not outputs_close(expected.reshape(got.shape), got):
            raise Reject(otherwise)
        return combine_mismatch(experts, x_TH, ids_TK, weights_TK, num_experts=num_experts)
    finally:
        experts.__class__ = original_cls


def _flattened_call_layer(name: str, module: nn.Module, child: ExpertsChild, call: tuple, x: torch.Tensor,
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
        raise Reject(f"{where} and returns {getattr(expected, 'shape', type(expected).__name__)}, not the shape of "
                      f"its input; call {child.attr}(x_TH, ids_TK, weights_TK) -> [T, H]")
    try:
        bank = ExpertBank(experts, num_experts=E or None)
    except ValueError as exc:
        raise Reject(f"{where}; its experts cannot be cut into equal per-expert chunks "
                      f"({str(exc).split(': ', 1)[-1]})")
    if E and bank.num_experts != E:
        # Neither stacked [E, ...] nor flat [E * F, ...] (every leading dimension a multiple of E).
        shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in experts.named_parameters())
        raise Reject(f"{where}; its weights ({shapes}) are neither stacked along a leading dimension of its {E} "
                      f"experts nor flat with a multiple of {E} rows in each, so they cannot be cut into "
                      f"per-expert chunks; store them stacked [E, ...] or flat [E * F, ...]")
    why = _adapted_call_mismatch(
        experts, flat_call_experts_class(type(experts)), x_TH, ids_TK, weights_TK, expected,
        f"{where} and computes otherwise on the same hidden states flattened to [T, H]", bank.num_experts)
    if why is not None:
        raise Reject(f"{where}, read flat; but {why}")
    K = int(ids_TK.shape[1])
    expert0 = expert_modules(experts)[0] if expert_modules(experts) else experts
    if bank.flat:      # (DBRX: the activation lives on the module holding the flat weights)
        expert0 = next((m for m in experts.modules() if named_activation(m)), experts)
    return MoELayerInfo(
        name=name, module=module, num_experts=bank.num_experts, top_k=K,
        experts_form="flat" if bank.flat else child.form,
        **behaviour_router(routers, E, H, record_calls(module, x),
                           f"top-{K} ids seen at the experts call on unflattened hidden states"),
        activation=describe_activation(expert0), shared_experts=False, experts_attr=child.attr,
        rewrite="flatten", hidden_size=H, probe_flat=flat)


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
        if not outputs_close(expected, got):
            return f"its output differs ({'train' if training else 'eval'} mode)"
    why = gradient_mismatch(module, trial, x, PROBE_SEED)
    return None if why is None else f"its gradients differ ({why})"


def _all_rows_layer(name: str, module: nn.Module, child: ExpertsChild, x_NH: torch.Tensor, x: torch.Tensor,
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
        raise CallReject(f"{where}; its experts cannot be cut into equal per-expert chunks "
                          f"({str(exc).split(': ', 1)[-1]})")
    finally:
        experts.__class__ = original_cls
    if bank.num_experts != E:
        raise CallReject(f"{where}; its weights hold {bank.num_experts} rows along the leading dimension, "
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
        raise CallReject(f"{where}; with row n served by expert n // T (the leading dimension of an [E, T, H] "
                          f"view), {why}: the experts module does not run its rows expert-major, each row by "
                          "its expert alone; view the rows [E, T, H] in its forward")
    reading = (f"the nonzero rows, top-{K} per token (zero rows stay 0 in value and gradient)" if plan.sparse
               else f"every row, K = E = {E} (not only the nonzero ones: {why_plain})")
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=plan.slots, experts_form=child.form,
        **behaviour_router(routers, E, H, rec, f"every expert on every row, served: {reading}", sep="; "),
        activation=describe_activation(experts), shared_experts=False, experts_attr=child.attr,
        rewrite="all-rows", hidden_size=H, probe_flat=flat, plan=plan)


def _moduledict_replay_layer(name: str, module: nn.Module, child: ExpertsChild, x: torch.Tensor,
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
    if (why := non_identical_reason(experts)) is not None:
        return None, why
    plan, why = replay_mismatch(module, child.attr, x, PROBE_SEED, allow_skipping=True)
    if why is not None:
        return None, (f"{head} and capture and replay cannot serve it: {why}; reach the experts only as "
                      f"{child.attr}[key](rows) / getattr({child.attr}, key)(rows), or give the container a "
                      f"forward called once as {child.attr}(x, ids, weights)")
    E, T = plan.num_experts, x.shape[:-1].numel()
    K = min(E, max(1, -(-captured_rows(module, child.attr, x, PROBE_SEED) // T)))
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=K, experts_form="moduledict",
        **behaviour_router(routers, E, H, record_calls(module, x), f"{K} row(s) per token seen at the expert calls"),
        activation=describe_activation(experts[0]), shared_experts=False, experts_attr=child.attr,
        rewrite="replay", hidden_size=H, probe_flat=flat, plan=plan), None


def _scores_call_layer(name: str, module: nn.Module, child: ExpertsChild, plan: ScoresCallPlan, call: tuple,
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
        raise Reject(f"{where}, scores of {E} experts, but '{child.attr}' declares {child.num_experts}")
    if not isinstance(expected, torch.Tensor) or expected.shape != x_in.shape:
        raise Reject(f"{where} and returns {getattr(expected, 'shape', type(expected).__name__)}, not the shape of "
                      f"its input; call {child.attr}(x_TH, ids_TK, weights_TK) -> [T, H]")
    try:
        bank = ExpertBank(experts, num_experts=E)
    except ValueError as exc:
        raise Reject(f"{where}; its experts cannot be cut into equal per-expert chunks "
                      f"({str(exc).split(': ', 1)[-1]})")
    if bank.num_experts != E:
        shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in experts.named_parameters())
        raise Reject(f"{where}; its weights ({shapes}) cannot be cut into {E} per-expert chunks; store them "
                      "stacked [E, ...] or flat [E * F, ...]")
    why = _adapted_call_mismatch(
        experts, scores_call_experts_class(type(experts), plan), x_TH, ids_TK, weights_TK, expected,
        f"{where}; with the scores given only at the top-k ids (the weights) it computes otherwise: its result "
        "depends on the scores of experts a token is not routed to", E)
    if why is not None:
        raise Reject(f"{where}, read as experts(x, ids, weights); but {why}")
    K = int(ids_TK.shape[1])
    return MoELayerInfo(
        name=name, module=module, num_experts=E, top_k=K, experts_form="flat" if bank.flat else child.form,
        **behaviour_router(routers, E, H, record_calls(module, x),
                           f"top-{K} ids and the dense scores seen at the experts call"),
        activation=describe_activation(next((m for m in experts.modules() if named_activation(m)), experts)),
        shared_experts=False, experts_attr=child.attr, rewrite="scores-call", hidden_size=H, probe_flat=flat,
        plan=plan)


@dataclass(frozen=True)
class ExpertsCall:
    """What a stand-in for the experts child saw on a probe: the block ``module`` run on ``x`` called it
    with ``calls`` (one argument tuple per call) and got ``outputs``. What the call styles read."""

    name: str
    module: nn.Module
    child: ExpertsChild
    x: torch.Tensor
    routers: list[tuple[str, int, int]]
    H: int
    flat: bool
    calls: list[tuple]
    outputs: list[Any]

    @property
    def T(self) -> int:
        return self.x.shape[0] * (self.x.shape[1] if self.x.dim() == 3 else 1)

    @property
    def rows(self) -> tuple[torch.Tensor | None, int]:
        """(rows, Nones after them) of the first call's result, :func:`returned_rows`."""
        return returned_rows(self.outputs[0]) if self.outputs else (None, 0)

    def xiw(self) -> bool:
        """One call ``experts(x, ids_TK, weights_TK)``: integer ids and floating weights [T, K]."""
        c = self.calls
        return (len(c) == 1 and len(c[0]) == 3 and all(isinstance(a, torch.Tensor) for a in c[0])
                and not c[0][1].is_floating_point() and c[0][2].is_floating_point() and c[0][1].dim() == 2)

    def sorted_rows(self) -> bool:
        """One call ``experts(rows_NH sorted by expert, counts_E)`` returning one row per row."""
        c, (out, _) = self.calls, self.rows
        counts = _counts(c[0][1]) if len(c) == 1 and len(c[0]) == 2 else None
        return (counts is not None and self.child.form in ("stacked", "wrapped") and isinstance(c[0][0], torch.Tensor)
                and c[0][0].is_floating_point() and c[0][0].dim() == 2 and len(counts) == self.child.num_experts
                and sum(counts) == c[0][0].shape[0] and out is not None and out.shape[0] == c[0][0].shape[0])

    def per_slot(self) -> bool:
        """One call ``experts(x_TH, ids_TK) -> y_TKH`` of stacked experts."""
        c = self.calls
        return (len(c) == 1 and len(c[0]) == 2 and self.child.form == "stacked"
                and all(isinstance(a, torch.Tensor) for a in c[0])
                and c[0][0].is_floating_point() and c[0][0].dim() == 2
                and not c[0][1].is_floating_point() and c[0][1].dim() == 2
                and isinstance(self.outputs[0], torch.Tensor)
                and self.outputs[0].shape == c[0][1].shape + c[0][0].shape[-1:])


def _match_joined(seen: ExpertsCall) -> MoELayerInfo | None:
    # Half of every expert (JetMoE ParallelExperts): joined with the other half it is called with on the
    # same rows, and the block's row-wise code between the two calls.
    rows_out = seen.rows[0]
    if not seen.sorted_rows() or rows_out.shape == seen.calls[0][0].shape:
        return None
    return _joined_layer(seen.name, seen.module, seen.child, seen.calls[0], rows_out, seen.x, seen.routers, seen.H,
                         seen.flat)


def _match_dispatch_mask(seen: ExpertsCall) -> MoELayerInfo | None:
    if (mask := dispatch_mask_call(seen.calls, seen.child.num_experts)) is None:
        return None
    return _dispatch_mask_layer(seen.name, seen.module, seen.child, mask, seen.x, seen.routers, seen.H, seen.flat)


def _match_scores_call(seen: ExpertsCall) -> MoELayerInfo | None:
    if (plan := scores_call_plan(seen.calls, seen.T)) is None:
        return None
    return _scores_call_layer(seen.name, seen.module, seen.child, plan, seen.calls[0], seen.outputs[0], seen.x,
                              seen.routers, seen.H, seen.flat)


def _rows_or_slots_layer(seen: ExpertsCall, rewrite: str, K: int, what: str, tail: int) -> MoELayerInfo:
    # torchtitan: experts(rows sorted by expert, rows per expert) -> one output row per row; gpt-fast:
    # experts(x_TH, ids_TK) -> y_TKH, combined by the block itself. passes.shard rewrites the call and
    # verifies the rewrite against the runtime's computation.
    child, E = seen.child, seen.child.num_experts
    return MoELayerInfo(
        name=seen.name, module=seen.module, num_experts=E, top_k=K, experts_form=child.form,
        **behaviour_router(seen.routers, E, seen.H, record_calls(seen.module, seen.x), what),
        activation=describe_activation((expert_modules(child.module) or [child.module])[0]),
        shared_experts=False, experts_attr=child.attr, rewrite=rewrite, hidden_size=seen.H, probe_flat=seen.flat,
        call_tail=tail)


def _match_sorted_rows(seen: ExpertsCall) -> MoELayerInfo | None:
    if not seen.sorted_rows():
        return None
    return _rows_or_slots_layer(seen, "sorted-rows", max(1, seen.calls[0][0].shape[0] // seen.T),
                                "rows sorted by expert with counts at the experts call", seen.rows[1])


def _match_per_slot(seen: ExpertsCall) -> MoELayerInfo | None:
    if not seen.per_slot():
        return None
    K = int(seen.calls[0][1].shape[1])
    return _rows_or_slots_layer(seen, "per-slot", K, f"top-{K} ids seen at the experts call", 0)


def _match_all_rows(seen: ExpertsCall) -> MoELayerInfo | None:
    if (rows := all_rows_call(seen.calls, seen.outputs, seen.child.num_experts, seen.T, seen.H)) is None:
        return None
    return _all_rows_layer(seen.name, seen.module, seen.child, rows, seen.x, seen.routers, seen.H, seen.flat)


def _identical_experts(seen: ExpertsCall) -> None:
    if seen.child.form == "modulelist" and (why := non_identical_reason(seen.child.module)):
        raise Reject(why)


def _match_flatten(seen: ExpertsCall) -> MoELayerInfo | None:
    if not seen.xiw():
        return None
    x_TH, ids_TK, _ = seen.calls[0]
    _identical_experts(seen)
    if not (x_TH.dim() > 2 and x_TH.shape[:-1].numel() == ids_TK.shape[0]):
        return None
    return _flattened_call_layer(seen.name, seen.module, seen.child, seen.calls[0], seen.x, seen.routers, seen.H,
                                 seen.flat)


def _match_none(seen: ExpertsCall) -> MoELayerInfo | None:
    if not seen.xiw():
        return None
    _identical_experts(seen)
    module, child, x = seen.module, seen.child, seen.x
    ids_TK = seen.calls[0][1]
    form, detail = experts_call_form(module, child.attr, x, ids_TK.shape[1])
    if form != "none":
        raise Reject(detail)
    E, K = ExpertBank(child.module).num_experts, int(ids_TK.shape[1])
    expert0 = child.module[0] if child.form == "modulelist" else child.module
    return MoELayerInfo(
        name=seen.name, module=module, num_experts=E, top_k=K, experts_form=child.form,
        **behaviour_router(seen.routers, E, seen.H, record_calls(module, x), f"top-{K} ids seen at the experts call"),
        activation=describe_activation(expert0), shared_experts=False, experts_attr=child.attr,
        rewrite="none", hidden_size=seen.H, probe_flat=seen.flat)


# The call styles, in priority order: each matcher reads the one experts call a probe saw and returns the
# layer, None when the call is not of its style, or raises Reject with what stops that style; the first
# that returns a layer wins. A call no style takes is rejected as unsupported (its reason lists the call).
CALL_STYLES: tuple[tuple[str, Callable[[ExpertsCall], MoELayerInfo | None]], ...] = (
    ("joined", _match_joined),                  # half of each expert on sorted rows (JetMoE)
    ("dispatch-mask", _match_dispatch_mask),    # experts(x, one-hot mask [T, K, E], weights) (HF Switch)
    ("scores-call", _match_scores_call),        # experts(x, scores [T, E], weights, ids) (DBRX before v5)
    ("sorted-rows", _match_sorted_rows),        # experts(rows sorted by expert, counts) (torchtitan)
    ("per-slot", _match_per_slot),              # experts(x, ids) -> [T, K, H] (gpt-fast)
    ("all-rows", _match_all_rows),              # experts(x [E*T, H]), every expert on every row (Llama 4)
    ("flatten", _match_flatten),                # experts(x [B, S, H], ids, weights) (DBRX)
    ("none", _match_none),                      # experts(x, ids, weights): the runtime's own interface
)


def find_by_behaviour(name: str, module: nn.Module) -> MoELayerInfo | None:
    """An MoE layer recognised by what it does, whatever its routing code looks like (``max``, sorts,
    masks, group limits, bias corrections ...): its experts child, swapped for a stand-in, is called once
    as ``experts(x_TH, ids_TK, weights_TK)`` with integer ids and floating weights [T, K], the layer's
    output is unchanged, and that call computes what the sharded runtime computes. The router is
    described from the calls recorded on the probe. Raises Reject (the call seen and what would make
    it work) when an experts child is called otherwise; None when the module does not call one."""
    reject, probe_errors, probe_ran = None, [], False
    for child in _behaviour_candidates(module):
        routers = router_widths(module, child.module)
        H = expert_hidden_size(child, routers) if child.num_experts else next(
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
                    reject = reject or Reject(why)
                elif "expert" in child.attr.lower() and not stand_in.calls and not isinstance(
                        child.module, nn.ModuleList):
                    # The forward reaches into the experts container (getattr(self.experts, f"expert_{i}"))
                    # instead of calling it: it runs the experts itself.
                    reject = reject or Reject(
                        f"the forward runs the experts in '{child.attr}' ({type(child.module).__name__}) one by one "
                        f"itself instead of calling '{child.attr}' ({type(exc).__name__} when it is a module "
                        f"called as {child.attr}(x, ids, weights)); give the container a forward called once "
                        "that way, running every expert")
                continue
            finally:
                setattr(module, child.attr, child.module)
            seen = ExpertsCall(name=name, module=module, child=child, x=x, routers=routers, H=H, flat=flat,
                               calls=stand_in.calls, outputs=stand_in.outputs)
            for style, match in CALL_STYLES:
                if (found := match(seen)) is not None:
                    logger.debug("%s: call style %s", name, style)
                    return found
            # No style takes the call. Only a child that names experts, or is called with integer ids, is
            # an experts container used otherwise; a parent of a whole MoE block is not.
            calls = seen.calls
            ids_like = any(isinstance(a, torch.Tensor) and not a.is_floating_point() for c in calls for a in c)
            if "expert" in child.attr.lower() or ids_like:
                reject = reject or Reject(_unsupported_call(child.attr, calls, seen.T))
            break
    if reject is not None:
        raise reject
    if probe_errors and not probe_ran:
        raise ProbeFailed(f"the forward fails on probe hidden states ({'; '.join(probe_errors)}); detection runs a "
                      "block on hidden states alone: keep the MoE in a module called as moe(hidden_states), "
                      "with any other input (token ids for hash routing, masks) optional")
    return None


def _joined_layer(name: str, module: nn.Module, child: ExpertsChild, call: tuple, out_NW: torch.Tensor,
                  x: torch.Tensor, routers: list[tuple[str, int, int]], H: int, flat: bool) -> MoELayerInfo:
    """The layer of a block whose stacked experts module ``child`` holds only the first half of every expert
    (called on rows sorted by expert, ``[N, H] -> [N, W]``): joined with a second stacked module of as many
    experts called on the same counts (``[N, F] -> [N, H]``) and the block's code between the two calls, read
    off a probe and proved row-wise (:mod:`themis_compile.passes.joined`). ``rewrite == "joined"``; raises
    CallReject with the reason when no second half joins it so."""
    rows_NH, counts = call
    E, N = child.num_experts, rows_NH.shape[0]
    seen = (f"'{child.attr}' is called on rows sorted by expert ({_describe_call(call)}) but maps rows of width "
            f"{rows_NH.shape[-1]} to {out_NW.shape[-1]}: only part of each expert")
    why = ("no other stacked module of as many experts is called on the same rows after it; hold whole experts in "
           "one module mapping [N, H] rows to [N, H], or the second half in a stacked module called as "
           f"second(rows, counts) on the rows the code after '{child.attr}' computes")
    for second in experts_children(module):
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
            raise CallReject(f"{seen}, joined with '{second.attr}': {mismatch}")
        T = x.shape[0] * (x.shape[1] if x.dim() == 3 else 1)
        return MoELayerInfo(
            name=name, module=module, num_experts=E, top_k=max(1, N // T), experts_form="joined",
            **behaviour_router(routers, E, H, record_calls(module, x),
                               f"rows sorted by expert with counts at '{child.attr}' and '{second.attr}'"),
            activation=f"{child.attr} -> {describe_between(rec.between)} -> {second.attr}", shared_experts=False,
            experts_attr=plan.attr, rewrite="joined", hidden_size=H, probe_flat=flat, plan=plan)
    raise CallReject(f"{seen}; {why}")
