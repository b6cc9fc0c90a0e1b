"""The closed-form cost model of §3.3 and §4.2, computed from a model configuration.

Where a profile exists (``cost_model/profile.py``) its measured T_attn and bandwidths replace the
modeled ones; everything here is the *modeled* fallback and the symbolic form of the same formulas.

The quantities:

* Ψ — one expert's parameter bytes: ``n_mats · d_model · d_ffn · param_bytes`` (SwiGLU experts have three
  matrices, GeLU experts two).
* T_attn — the forward latency of one attention layer (the overlap window of §4.2), modeled as its
  FLOPs at a stated fraction of the device's peak: ``(8·B·S·d² + 4·B·S²·d) / (peak · efficiency)``
  (QKV and output projections, then QKᵀ and AV; causal masking is not discounted).
* t = ⌊T_attn · bw / Ψ⌋ — the overlap degree (§4.2): the expert chunks a receiving link absorbs within
  the window. On several nodes bw is the per-node inter-node bandwidth (the per-node ingress binds).
* m — the materialization budget (§4.2): replicas per device and layer that fit a memory budget. A
  replica costs its parameters until the layer's backward and a gradient buffer during the backward.
  Without re-materialization all layers' replicas are alive at once (m = ⌊M / (L·Ψ + Ψ_g)⌋); with
  re-materialization replicas are freed after use, so the budget spans all layers (m = ⌊M / (Ψ + Ψ_g)⌋).

`symbolic_cost_model` gives the same formulas in sympy over d_model, d_ffn, seq_len, batch, bw and the
attention throughput, and `min_seq_len_for` / `min_batch_for` solve for the smallest sequence length or
batch at which t experts fit the window.

Legend: B sequences per device (batch), S sequence length, d d_model, f d_ffn, L MoE layers, E experts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import sympy

    from themis_compile.models.gpt_moe import MoEModelConfig

logger = logging.getLogger(__name__)

__all__ = [
    "Precision", "AttentionShape", "expert_matrices", "expert_params", "expert_bytes", "expert_flops_per_token",
    "attention_flops", "attention_params", "attention_time", "activation_bytes", "dense_params", "head_flops",
    "overlap_degree",
    "materialization_budget", "replica_bytes", "symbolic_cost_model", "min_seq_len_for", "min_batch_for",
]


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model-state kind (mixed-precision training with Adam).

    Attributes:
        param_bytes: a parameter as used in compute and moved by SpAG (bf16: 2).
        grad_bytes: a gradient as reduced by SpRS / AllReduce (bf16: 2).
        optimizer_bytes: optimizer state per parameter (fp32 master weight + Adam m and v: 12).
    """

    param_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 12

    def __post_init__(self) -> None:
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"Precision.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def state_bytes(self) -> int:
        """Bytes per parameter of an owned parameter: parameter + gradient + optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")


# --------------------------------------------------------------------------------------- sizes
def expert_matrices(cfg: MoEModelConfig) -> int:
    """Weight matrices of one expert: 3 for SwiGLU (w1, w2, w3), 2 for GeLU (w1, w2)."""
    return 3 if cfg.activation == "swiglu" else 2


def expert_params(cfg: MoEModelConfig) -> int:
    """Parameters of one expert."""
    return expert_matrices(cfg) * cfg.d_model * cfg.d_ffn


def expert_bytes(cfg: MoEModelConfig, param_bytes: int = 2) -> int:
    """Ψ: parameter bytes of one expert (§3.3)."""
    return expert_params(cfg) * int(param_bytes)


def expert_flops_per_token(cfg: MoEModelConfig) -> float:
    """Forward FLOPs of one token through one expert: 2 per multiply-add of every expert matrix."""
    return 2.0 * expert_params(cfg)


@dataclass(frozen=True)
class AttentionShape:
    """The attention a model really has, for its FLOPs and parameters (T_attn of §4.2).

    ``kind`` is ``"mha"`` (every head has its own K and V), ``"gqa"`` (``n_kv_heads`` K/V heads shared by
    groups of query heads) or ``"mla"`` (DeepSeek's multi-head latent attention: queries and keys/values
    pass through low-rank latents of ``q_rank`` / ``kv_rank``; every head scores with a
    ``qk_head_dim``-wide key, ``rope_dim`` of it shared, and reads a ``v_head_dim``-wide value).
    ``head_dim`` defaults to d_model / n_heads.
    """

    kind: str = "mha"
    n_kv_heads: int | None = None
    head_dim: int | None = None
    q_rank: int = 0
    kv_rank: int = 0
    qk_head_dim: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("mha", "gqa", "mla"):
            raise ValueError(f"AttentionShape.kind must be 'mha', 'gqa' or 'mla', got {self.kind!r}")
        if self.kind == "gqa" and not (self.n_kv_heads and self.n_kv_heads > 0):
            raise ValueError("a 'gqa' AttentionShape needs n_kv_heads >= 1")
        if self.kind == "mla" and min(self.q_rank, self.kv_rank, self.qk_head_dim, self.v_head_dim) <= 0:
            raise ValueError("an 'mla' AttentionShape needs q_rank, kv_rank, qk_head_dim and v_head_dim > 0")

    def _per_token(self, cfg: MoEModelConfig) -> tuple[int, int]:
        """(projection parameters, score-and-value width per key) of one layer."""
        d, h = cfg.d_model, cfg.n_heads
        if self.kind == "mla":
            proj = (d * self.q_rank + self.q_rank * h * self.qk_head_dim          # q down / up
                    + d * (self.kv_rank + self.rope_dim)                          # kv down (+ shared rope key)
                    + self.kv_rank * h * (self.qk_head_dim - self.rope_dim + self.v_head_dim)   # k, v up
                    + h * self.v_head_dim * d)                                    # output projection
            return proj, h * (self.qk_head_dim + self.v_head_dim)
        hd = self.head_dim or d // h
        kv = h if self.kind == "mha" else int(self.n_kv_heads or h)
        return d * h * hd + 2 * d * kv * hd + h * hd * d, 2 * h * hd


MHA = AttentionShape()


def attention_params(cfg: MoEModelConfig, shape: AttentionShape = MHA) -> int:
    """Weights of one attention layer (no biases): 4·d² for MHA; see `AttentionShape`."""
    return shape._per_token(cfg)[0]


def dense_params(cfg: MoEModelConfig, include_embeddings: bool = True, attention: AttentionShape = MHA) -> int:
    """Parameters outside the routed experts (data-parallel): attention, norms, routers, shared experts,
    and (optionally) token/position embeddings and the untied LM head."""
    d = cfg.d_model
    per_layer = attention_params(cfg, attention) + 4 * d + d * cfg.num_experts   # attention, 2 LayerNorms, router
    if cfg.shared_expert:
        per_layer += expert_params(cfg)
    total = cfg.n_layers * per_layer + 2 * d                      # final LayerNorm
    if include_embeddings:
        total += cfg.vocab_size * d + cfg.seq_len * d + d * cfg.vocab_size
    return int(total)


def attention_flops(cfg: MoEModelConfig, batch: int, shape: AttentionShape = MHA) -> float:
    """Forward FLOPs of one attention layer on ``batch`` sequences: 2 per weight per token for the
    projections, plus QKᵀ and AV over S keys per token (causal masking not discounted). For MHA this is
    8·B·S·d² + 4·B·S²·d."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1 sequence, got {batch}")
    proj, width = shape._per_token(cfg)
    tokens = float(batch) * cfg.seq_len
    return 2.0 * tokens * proj + 2.0 * tokens * cfg.seq_len * width


def activation_bytes(cfg: MoEModelConfig, batch: int, shape: AttentionShape = MHA, *, act_bytes: int = 2,
                     tokens_factor: float = 1.0, include_head: bool = True) -> float:
    """Activation memory one device keeps for backward over all layers (flash attention: no S² term).

    Per token and layer, in ``act_bytes`` units: the attention block's saved tensors (two LayerNorm
    inputs, Q, K, V, the attention output and the projection input: 7·d for MHA, scaled by the real
    Q/K/V widths), the router logits (E), and per routed assignment (k of them, ``tokens_factor`` times
    the mean when a device computes more than its share) the expert's input, its ``n_mats - 1`` hidden
    activations of width f, the output, and the dispatch / combine buffers (4·d + (n_mats-1)·f); a shared
    expert adds the same once. With ``include_head`` the LM head's fp32 logits (B·S·V·4) are added.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1 sequence, got {batch}")
    d, f = cfg.d_model, cfg.d_ffn
    _, width = shape._per_token(cfg)
    attn = 4 * d + 1.5 * width                    # LN inputs, attention out, projection in; Q, K, V
    expert = 4 * d + (expert_matrices(cfg) - 1) * f
    per_token = attn + cfg.num_experts + cfg.top_k * expert * tokens_factor
    if cfg.shared_expert:
        per_token += expert
    head = 4.0 * batch * cfg.seq_len * cfg.vocab_size if include_head else 0.0
    return float(batch) * cfg.seq_len * cfg.n_layers * per_token * act_bytes + head


def head_flops(cfg: MoEModelConfig, batch: int) -> float:
    """Forward FLOPs of the LM head on ``batch`` sequences: 2·B·S·d·V."""
    return 2.0 * batch * cfg.seq_len * cfg.d_model * cfg.vocab_size


def attention_time(cfg: MoEModelConfig, batch: int, peak_flops: float, efficiency: float,
                   shape: AttentionShape = MHA) -> float:
    """Modeled T_attn (s): attention forward FLOPs at ``efficiency`` of ``peak_flops``."""
    _check_positive(peak_flops=peak_flops, efficiency=efficiency)
    return attention_flops(cfg, batch, shape) / (peak_flops * efficiency)


# --------------------------------------------------------------------------------------- §4.2 caps
def overlap_degree(t_attn_s: float, bw: float, psi: float) -> int:
    """t = ⌊T_attn · bw / Ψ⌋ (§4.2)."""
    if t_attn_s < 0 or not math.isfinite(t_attn_s):
        raise ValueError(f"T_attn must be a finite number >= 0, got {t_attn_s!r}")
    _check_positive(bw=bw, psi=psi)
    # A tiny epsilon so that exact multiples are not lost to float rounding.
    return int(math.floor(t_attn_s * bw / psi + 1e-9))


def replica_bytes(psi: float, precision: Precision = Precision(), num_layers: int = 1,
                  rematerialize: bool = False) -> float:
    """Memory one replica slot per layer costs a device: parameters of the replica in every layer that
    holds one at the same time (L without re-materialization, 1 with it) plus one gradient buffer."""
    grad = psi * precision.grad_bytes / max(precision.param_bytes, 1)
    held_layers = 1 if rematerialize else int(num_layers)
    return held_layers * psi + grad


def materialization_budget(memory_bytes: float, psi: float, num_layers: int, *, rematerialize: bool = False,
                           precision: Precision = Precision()) -> int:
    """m: replicas per device and layer that fit ``memory_bytes`` of spare memory (§4.2).

    With re-materialization (``rematerialize=True``) the budget spans all layers, since released replicas
    do not accumulate; without it every layer's replicas are held from forward to backward.
    """
    if memory_bytes < 0 or not math.isfinite(memory_bytes):
        raise ValueError(f"memory budget must be a finite number of bytes >= 0, got {memory_bytes!r}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    _check_positive(psi=psi)
    return int(memory_bytes // replica_bytes(psi, precision, num_layers, rematerialize))


# --------------------------------------------------------------------------------------- symbolic
def symbolic_cost_model() -> dict[str, Any]:
    """The cost formulas as sympy expressions.

    Returns a dict with the symbols (``d_model, d_ffn, seq_len, batch, bw, attn_throughput, n_mats,
    param_bytes``) and the expressions ``psi``, ``t_attn``, ``chunks_in_window`` (T_attn·bw/Ψ, real) and
    ``overlap_degree`` (its floor).
    """
    import sympy as sp

    d, f, S, B = sp.symbols("d_model d_ffn seq_len batch", positive=True)
    bw, F = sp.symbols("bw attn_throughput", positive=True)
    n, b = sp.symbols("n_mats param_bytes", positive=True)
    psi = n * d * f * b
    t_attn = (8 * B * S * d**2 + 4 * B * S**2 * d) / F
    ratio = sp.simplify(t_attn * bw / psi)
    return {"d_model": d, "d_ffn": f, "seq_len": S, "batch": B, "bw": bw, "attn_throughput": F,
            "n_mats": n, "param_bytes": b, "psi": psi, "t_attn": t_attn, "chunks_in_window": ratio,
            "overlap_degree": sp.floor(ratio)}


def _subs(model: dict[str, Any], values: dict[str, float]) -> dict[sympy.Symbol, float]:
    names = ("d_model", "d_ffn", "seq_len", "batch", "bw", "attn_throughput", "n_mats", "param_bytes")
    unknown = set(values) - set(names)
    if unknown:
        raise ValueError(f"unknown symbol(s) {sorted(unknown)}; known: {names}")
    return {model[k]: v for k, v in values.items()}


def _min_integer_for(target: str, t: int, values: dict[str, float]) -> int:
    import sympy as sp

    if t < 0:
        raise ValueError(f"t must be >= 0, got {t}")
    model = symbolic_cost_model()
    if target in values:
        raise ValueError(f"{target} is the unknown; do not give it a value")
    subs = _subs(model, values)
    missing = [name for name in ("d_model", "d_ffn", "seq_len", "batch", "bw", "attn_throughput", "n_mats",
                                 "param_bytes") if name != target and model[name] not in subs]
    if missing:
        raise ValueError(f"values missing for {missing}")
    if t == 0:
        return 1
    x = model[target]
    roots = sp.solve(sp.Eq(model["chunks_in_window"].subs(subs), t), x)
    positive = [float(r) for r in roots if r.is_real and float(r) > 0]
    if not positive:
        raise ValueError(f"no positive {target} lets {t} experts fit the window")
    need = min(positive)
    value = math.ceil(need - 1e-9)
    # Guard against rounding: the result must really reach t.
    while math.floor(float(model["chunks_in_window"].subs(subs).subs(x, value)) + 1e-9) < t:
        value += 1
    return max(int(value), 1)


def min_seq_len_for(t: int, **values: float) -> int:
    """The smallest sequence length at which t experts fit the attention window, i.e. T_attn·bw/Ψ ≥ t.

    ``values`` give every other symbol of `symbolic_cost_model` (``d_model, d_ffn, batch, bw,
    attn_throughput, n_mats, param_bytes``).
    """
    return _min_integer_for("seq_len", t, values)


def min_batch_for(t: int, **values: float) -> int:
    """The smallest batch (sequences per device) at which t experts fit the attention window."""
    return _min_integer_for("batch", t, values)
