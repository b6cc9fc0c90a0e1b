"""What a candidate MoE block holds, and the checks every recognizer of :mod:`themis_compile.passes.detect` shares.

A block is read for: its experts child (:func:`experts_children`: an ``nn.ModuleList`` of identical MLPs,
stacked ``[E, ...]`` weights, a parameter-free wrapper of one such list), the routers scoring that many
experts (:func:`router_widths`), the hidden size, the experts' activation, the shared experts beside the
routed ones and the auxiliary losses it computes. The checks a layer found must pass before it is
served: :func:`combine_mismatch` (a whole-module experts call computes what the sharded runtime
computes, each expert alone), :func:`zero_experts_mismatch`, :func:`experts_call_form`, and the
reference the rewrites are verified against (:class:`RuntimeReference`). A recognizer that sees an
MoE-like block it cannot serve raises :class:`Reject` with a reason the user can act on.

Shape suffixes: T tokens, H hidden size, E experts, K top-k.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from themis_compile.layer_info import MoELayerInfo
from themis_compile.passes.fx_graph import (
    TracedBlock,
    ancestors,
    effective_users,
    is_fn,
    is_inplace,
    is_mlp_like,
    reachable,
)
from themis_compile.passes.probe import PROBE_SEED, ExpertsStandIn, preserved_state, probe_input, run_probe
from themis_compile.passes.replay import (
    output_tensors,
)
from themis_compile.runtime.experts import (
    ExpertBank,
    expert_modules,
    stacked_layout,
    wrapped_expert_list,
)

logger = logging.getLogger(__name__)


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


def is_sharded(m: nn.Module) -> bool:
    """Experts already replaced by a themis_compile runtime (they carry the owner table)."""
    return hasattr(m, "owner_E")


@dataclass(frozen=True)
class ExpertsChild:
    attr: str
    module: nn.Module
    num_experts: int
    form: str


def _single_layer_lists(module: nn.Module) -> list[nn.ModuleList]:
    """The children of ``module`` that are ModuleLists of >= 2 single ``nn.Linear`` layers."""
    return [c for c in module.children() if isinstance(c, nn.ModuleList) and len(c) >= 2
            and all(type(m) is nn.Linear for m in c)]


def experts_children(module: nn.Module) -> list[ExpertsChild]:
    """The children of ``module`` that hold E experts: a ModuleList of MLPs (or of single Linears, when it is
    the block's only list of them: two or more such lists are experts spread over parallel lists, read by
    ``find_weights``), or stacked ``[E, ...]`` weights."""
    found = []
    singles = _single_layer_lists(module)
    for attr, child in module.named_children():
        if is_sharded(child):
            continue
        if isinstance(child, nn.ModuleList) and len(child) >= 2 and (
                all(is_mlp_like(c) for c in child) or (len(singles) == 1 and singles[0] is child)):
            found.append(ExpertsChild(attr, child, len(child), "modulelist"))
        elif (E := _stacked_width(child) or _stacked_width_with_shared(child)) is not None \
                and not _holds_stacked_experts(child, E):
            found.append(ExpertsChild(attr, child, E, "stacked"))
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


def wrapped_experts_children(module: nn.Module) -> list[ExpertsChild]:
    """Children that wrap their experts' ModuleList (:func:`~themis_compile.runtime.experts.wrapped_expert_list`:
    Megatron-Core ``SequentialMLP``, DeepSpeed ``Experts``) and hold MLP-like experts."""
    found = []
    for attr, child in module.named_children():
        wrapped = None if is_sharded(child) else wrapped_expert_list(child)
        if wrapped is not None and len(wrapped[1]) >= 2 and all(is_mlp_like(c) for c in wrapped[1]):
            found.append(ExpertsChild(attr, child, len(wrapped[1]), "wrapped"))
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


def non_identical_reason(experts: nn.ModuleList) -> str | None:
    sig0 = _expert_signature(experts[0])
    for e, expert in enumerate(experts):
        sig = _expert_signature(expert)
        if sig != sig0:
            shapes = lambda s: ", ".join(f"{n} {list(shape)}" for n, shape, _ in s[1])  # noqa: E731
            return (f"experts are not identical: expert {e} is {sig[0].__name__}({shapes(sig)}) but expert 0 is "
                    f"{sig0[0].__name__}({shapes(sig0)}); FSSDP needs equal-sized expert chunks")
    return None


def router_widths(module: nn.Module, experts: nn.Module) -> list[tuple[str, int, int]]:
    """(path, scored width, input width) of every Linear or bare 2-D weight outside the experts. A bare
    weight is read both ways, ``[E, H]`` (``F.linear(x, w)``, ``x @ w.t()``) and ``[H, E]`` (``x @ w``, the
    ``w_gate`` of Shazeer et al.'s noisy top-k gating as it is often written)."""
    inside = {id(p) for p in experts.parameters()}
    out = []
    for path, sub in module.named_modules():
        if sub is experts:
            continue
        if isinstance(sub, nn.Linear):
            if id(sub.weight) not in inside:
                # The last Linear of a small router MLP (Linear -> tanh -> Linear(E)) scores the experts;
                # the input width is that of the child's first Linear, which reads the hidden states.
                top = module.get_submodule(path.split(".")[0]) if "." in path else sub
                first = next((m for m in top.modules() if isinstance(m, nn.Linear)), sub)
                out.append((path, sub.out_features, first.in_features))
            continue
        for pname, p in sub.named_parameters(recurse=False):
            if p.dim() == 2 and id(p) not in inside:
                out.append((f"{path}.{pname}" if path else pname, p.shape[0], p.shape[1]))
                if p.shape[0] != p.shape[1]:
                    out.append((f"{path}.{pname}" if path else pname, p.shape[1], p.shape[0]))
    return out


def expert_hidden_size(child: ExpertsChild, routers: list[tuple[str, int, int]]) -> int | None:
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


def outputs_close(a: Any, b: Any) -> bool:
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


def skipped_expert_gradient(experts: nn.Module, x_TH: torch.Tensor, ids_TK: torch.Tensor,
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
        if ok and outputs_close(expected, got):
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
        return "unsupported", (f"the forward never calls the {len(experts)} experts of '{attr}' on the probe (it reads "
                               "their parameters itself, e.g. torch.stack([e.w1.weight for e in experts]), or "
                               "does not use them); call each expert as a module on its rows (experts[e](rows)), "
                               "call the experts once as experts(x, ids, weights), or hold the weights stacked "
                               "[E, ...] in the block itself (the own-weights style)")
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


def named_activation(m: nn.Module) -> str | None:
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
    named = named_activation(expert)
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


def shared_experts_of(traced: TracedBlock, module: nn.Module, combined: list[fx.Node], experts_attr: str
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


def shared_experts_by_probe(info: MoELayerInfo) -> tuple[str, ...]:
    """The MLP-like children of a layer found without a graph to read them in (by behaviour, experts that
    are not a module) whose output reaches the block's output: on a probe, the block's output changes when
    the child's output is replaced by zeros. The experts and the router's child are not candidates."""
    module = info.module
    skip = {info.experts_attr, info.router_path.split(".")[0]}
    candidates = [(attr, c) for attr, c in module.named_children() if attr not in skip and is_mlp_like(c)]
    if not candidates:
        return ()
    x = probe_input(module, info.hidden_size, flat=info.probe_flat)
    expected = run_probe(module, x)
    names = []
    for attr, child in candidates:
        handle = child.register_forward_hook(lambda m, args, out: torch.zeros_like(out)
                                             if isinstance(out, torch.Tensor) else out)
        try:
            got = run_probe(module, x)
        except Exception:  # noqa: BLE001 - a block that cannot run so says nothing about it
            continue
        finally:
            handle.remove()
        if not outputs_close(expected, got):
            names.append(attr)
    return tuple(names)


def auxiliary_losses(traced: TracedBlock, combined: list[fx.Node]) -> tuple[str, ...]:
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

class Reject(Exception):
    """An MoE-like block that cannot be served as written; the message says what was seen and what would
    make it work."""


class NoSelection(Reject):
    """A rejection that says only that no top-k (or max, argmax, sort) selection was found: what a later
    analysis saw says more (:data:`themis_compile.passes.detect.ANALYSES`)."""


class CallReject(Reject):
    """A rejection by behaviour that read the experts call and says best what stops it (over what the
    routing analysis, which did not understand the call, says)."""


class ProbeFailed(Reject):
    """The block's forward does not run on probe hidden states alone: it needs the other arguments it
    gets in the model (position embeddings, masks, token ids), which :func:`find_moe_layers` records."""


def recorded_routing(rec: Any) -> tuple[str, str]:
    """(score functions, selections) of the calls recorded on a probe, as a router description says them."""
    return ("+".join(dict.fromkeys(rec.scores)) or "none",
            ", ".join(dict.fromkeys(rec.selections)) or "no top-k/max/sort call (masks)")
