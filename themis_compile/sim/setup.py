"""The simulator's inputs: one `SimSetup` per (model, cluster, batch), derived once and used by every policy.

Every input the paper leaves open is fixed here, once per cluster and model, with its derivation next to
it (docs/simulator.md tabulates them):

* T_attn, the §4.2 overlap window: the FLOPs of the attention the model really has (`PAPER_ATTENTION`:
  GQA for Phi-3.5-MoE, MLA for DeepSeek-V3, MHA otherwise) at `ATTENTION_EFFICIENCY` of the device's
  peak. That efficiency is calibrated once, from Fig. 12 (`calibrate_attention_efficiency`), or replaced
  by a measured profile (``--profile``).
* Pipeline stages: where the paper trains one stage of a pipeline-parallel model (DeepSeek-V3, "matching
  the per-stage layer count of the original 61-layer model with 16-way pipeline parallelism", §5.1) the
  simulated model has no embeddings and no LM head (`PIPELINE_STAGE_MODELS`).
* m, the materialization budget: the memory a device has left after EP's parameters, gradients and
  optimizer states, the activations of its batch and a fixed runtime reserve (`RUNTIME_RESERVE_BYTES`).
* FlexMoE's reserve: the fraction of device memory Fig. 12's 3.0x implies (`flexmoe_reserve_fraction`).

And one limit of the simulator itself: `check_simulation_size` refuses, with the size and the limit in the
message, a model and cluster whose [E, D] arrays would not fit in `MAX_SIM_BYTES` (`simulation_bytes`).

Legend: E experts, D devices, L MoE layers, B sequences per device, S sequence length.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from themis_compile.cost_model import analytic
from themis_compile.cost_model.analytic import MHA, AttentionShape, Precision
from themis_compile.cost_model.cluster import Cluster, get_cluster
from themis_compile.models.gpt_moe import MoEModelConfig
from themis_compile.models.presets import preset
from themis_compile.planner.topology import Topology

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BATCH", "PAPER_ATTENTION", "PIPELINE_STAGE_MODELS", "ATTENTION_EFFICIENCY", "RUNTIME_RESERVE_BYTES",
    "SimSetup", "build_setup", "resolve_model_config", "read_profile", "calibrate_attention_efficiency",
    "fig12_replicas_per_layer", "flexmoe_reserve_fraction", "MAX_SIM_BYTES", "simulation_bytes",
    "check_simulation_size",
]

# Sequences per device when none is given: roughly the largest micro-batch whose activations fit beside
# the model states on 80 GB (the paper picks "the largest batch size that avoids OOM across all systems").
DEFAULT_BATCH = {"gpt-s-moe": 16, "gpt-l-moe": 8, "phi-3.5-moe": 2, "qwen1.5-moe": 4, "deepseek-v3": 1}

# The attention of the paper's production models (their published configurations): Phi-3.5-MoE has 8
# key/value heads for 32 query heads; DeepSeek-V3 uses multi-head latent attention (q_lora_rank 1536,
# kv_lora_rank 512, 128 + 64 (rope) wide query/key heads, 128 wide value heads); Qwen1.5-MoE and the
# GPT-3-derived models use multi-head attention.
PAPER_ATTENTION: dict[str, AttentionShape] = {
    "phi-3.5-moe": AttentionShape("gqa", n_kv_heads=8),
    "deepseek-v3": AttentionShape("mla", q_rank=1536, kv_rank=512, qk_head_dim=192, rope_dim=64, v_head_dim=128),
}

# Models the paper trains as one pipeline stage (no embeddings, no LM head; §5.1).
PIPELINE_STAGE_MODELS = frozenset({"deepseek-v3"})

# Memory no policy can use for model states or activations: CUDA context, NCCL and cuBLAS workspaces,
# allocator fragmentation (a few GB on an 80 GB device in practice).
RUNTIME_RESERVE_BYTES = 4e9

# Fig. 12 (Phi-3.5-MoE, Cluster A): "Themis uses more parameter memory (3.1x over EP)", total +35.6%;
# "FlexMoE uses the most memory, 3.0x that of Themis".
_FIG12_MODEL, _FIG12_CLUSTER = "phi-3.5-moe", "A"
_FIG12_PARAM_RATIO, _FIG12_THEMIS_TOTAL, _FIG12_FLEXMOE_RATIO = 3.1, 1.356, 3.0


def _base(name: str) -> str:
    return name.removesuffix("-tiny")


def attention_shape(model: MoEModelConfig) -> AttentionShape:
    """The model's attention (`PAPER_ATTENTION`, else multi-head)."""
    return PAPER_ATTENTION.get(_base(model.name), MHA)


def is_pipeline_stage(model: MoEModelConfig) -> bool:
    return _base(model.name) in PIPELINE_STAGE_MODELS


def _ep_param_counts(model: MoEModelConfig, num_devices: int) -> tuple[int, int]:
    """(data-parallel parameters, routed-expert parameters EP's busiest device owns)."""
    dense = analytic.dense_params(model, include_embeddings=not is_pipeline_stage(model),
                                  attention=attention_shape(model))
    owned = math.ceil(model.num_experts / num_devices) * model.n_layers * analytic.expert_params(model)
    return dense, owned


def fig12_replicas_per_layer(precision: Precision = Precision()) -> float:
    """Replicated experts per layer on a device that Fig. 12's "3.1x parameter memory over EP" implies
    for Phi-3.5-MoE on Cluster A: (3.1 - 1) · EP's parameters / (L · one expert's parameters)."""
    cluster = get_cluster(_FIG12_CLUSTER)
    model = preset(_FIG12_MODEL, devices=cluster.num_devices, cluster=_FIG12_CLUSTER)
    dense, owned = _ep_param_counts(model, cluster.num_devices)
    return (_FIG12_PARAM_RATIO - 1.0) * (dense + owned) / (model.n_layers * analytic.expert_params(model))


def calibrate_attention_efficiency(precision: Precision = Precision()) -> float:
    """The fraction of peak FLOP/s attention achieves, from Fig. 12 (done once; `ATTENTION_EFFICIENCY`).

    With memory to spare Alg. 1 replicates the top-t experts on every device, so Fig. 12's replicas per
    layer (`fig12_replicas_per_layer`, about 5.3) are t for Phi-3.5-MoE on Cluster A at its default batch.
    The efficiency puts T_attn·bw/Ψ at the middle of that integer t's interval: t + 0.5 chunks per window.
    """
    cluster = get_cluster(_FIG12_CLUSTER)
    model = preset(_FIG12_MODEL, devices=cluster.num_devices, cluster=_FIG12_CLUSTER)
    t = round(fig12_replicas_per_layer(precision))
    flops = analytic.attention_flops(model, DEFAULT_BATCH[_FIG12_MODEL], attention_shape(model))
    psi = analytic.expert_bytes(model, precision.param_bytes)
    t_attn = (t + 0.5) * psi / cluster.window_bw
    return flops / (t_attn * cluster.peak_flops)


def flexmoe_reserve_fraction(precision: Precision = Precision()) -> float:
    """The fraction of device memory FlexMoE pre-allocates for replicas, from Fig. 12: its model states
    are 3.0x Themis's, which are 1.356x EP's, on Phi-3.5-MoE / Cluster A."""
    cluster = get_cluster(_FIG12_CLUSTER)
    model = preset(_FIG12_MODEL, devices=cluster.num_devices, cluster=_FIG12_CLUSTER)
    dense, owned = _ep_param_counts(model, cluster.num_devices)
    ep_states = (dense + owned) * precision.state_bytes
    return (_FIG12_FLEXMOE_RATIO * _FIG12_THEMIS_TOTAL - 1.0) * ep_states / cluster.memory_bytes


ATTENTION_EFFICIENCY = calibrate_attention_efficiency()
FLEXMOE_RESERVE_FRACTION = flexmoe_reserve_fraction()


# =========================================================================================== size
# The simulator's memory. Its plans are sparse (`planner.dispatch.dispatch_traffic`: per-device totals,
# no [E, D, D] plan), so what grows is the E·D cells of its [E, D] arrays: one step's token counts per MoE
# layer (2 bytes a cell), the placements policies keep per layer (1 byte), and the transients of drawing
# one synthetic record (float64 probabilities, int64 counts) and of planning one layer (int64 counts,
# masks). Fitted to the peak RSS of `simulate --weak-scaling` at 1,024 and 4,096 devices
# (docs/simulator.md, "Scale"), with some margin.
SIM_BASE_BYTES = 1.0 * 2 ** 30          # the interpreter, numpy, torch, per-device arrays
SIM_BYTES_PER_CELL = 40.0               # per (expert, device) cell, whatever the layers
SIM_BYTES_PER_LAYER_CELL = 6.0          # per cell and MoE layer
# Refuse sizes above this (`--max-memory-gb`; tests patch it).
MAX_SIM_BYTES = 16.0 * 2 ** 30


def simulation_bytes(num_experts: int, num_devices: int, num_layers: int) -> float:
    """Estimated peak memory (bytes) of simulating E experts on D devices with L MoE layers:
    ``SIM_BASE_BYTES + E·D·(SIM_BYTES_PER_CELL + L·SIM_BYTES_PER_LAYER_CELL)``."""
    cells = float(num_experts) * float(num_devices)
    return SIM_BASE_BYTES + cells * (SIM_BYTES_PER_CELL + num_layers * SIM_BYTES_PER_LAYER_CELL)


def check_simulation_size(model: MoEModelConfig, cluster: Cluster, limit_bytes: float | None = None) -> None:
    """ValueError naming the size and the limit when `simulation_bytes` exceeds ``limit_bytes`` (default
    `MAX_SIM_BYTES`), before anything large is allocated."""
    limit = MAX_SIM_BYTES if limit_bytes is None else float(limit_bytes)
    need = simulation_bytes(model.num_experts, cluster.num_devices, model.n_layers)
    if need > limit:
        raise ValueError(
            f"{cluster.num_devices} devices x {model.num_experts} experts x {model.n_layers} MoE layers "
            f"({model.name}) would need about {need / 2 ** 30:.1f} GiB for the simulator's [E, D] token counts "
            f"and placements (limit {limit / 2 ** 30:.1f} GiB); raise it with --max-memory-gb on a machine "
            f"with that much memory, or time the planner alone at this size with "
            f"`python -m themis_compile.bench planner --devices {cluster.num_devices}`")


# =========================================================================================== setup
@dataclass(frozen=True)
class SimSetup:
    """Everything the simulator charges, derived from a model, a cluster and a batch.

    Times are seconds on one device; bytes are per device unless stated.
    """

    model: MoEModelConfig
    cluster: Cluster
    batch: int
    precision: Precision
    psi: float                     # Ψ, parameter bytes of one expert
    expert_params: int
    tokens_per_device: int         # B·S
    time_per_token_s: float        # forward time of one token through one expert
    token_bytes: float             # one token's hidden state in the all-to-all
    t_attn_s: float                # forward attention of one layer (the overlap window)
    shared_s: float                # forward shared expert of one layer (0 without)
    head_s: float                  # forward LM head (0 on a pipeline stage)
    dense_params: int
    layer_dense_params: int        # data-parallel parameters of one transformer layer
    embedding_params: int          # token and position embeddings (0 on a pipeline stage)
    head_params: int               # LM head and final norm (0 on a pipeline stage)
    activation_bytes: float        # activations kept for backward, at a balanced load
    overlap_degree: int
    memory_budget_bytes: float
    materialization_budget: int
    materialization_budget_rm: int
    replica_slots: int             # FlexMoE's reserved slots per layer and device
    reshard_interval: int = 100
    t_attn_source: str = "modeled"
    pipeline_stage: bool = False

    @property
    def num_layers(self) -> int:
        return self.model.n_layers

    @property
    def num_experts(self) -> int:
        return self.model.num_experts

    @property
    def num_devices(self) -> int:
        return self.cluster.num_devices

    def topology(self) -> Topology:
        return self.cluster.topology()

    def describe(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("model", "cluster", "precision")}
        out["model"] = self.model.name
        out["cluster"] = self.cluster.describe()
        out["precision"] = dataclasses.asdict(self.precision)
        return out


def resolve_model_config(spec: str, devices: int = 32, cluster: str = "A", seq_len: int | None = None
                         ) -> MoEModelConfig:
    """A model configuration from a preset name or ``package.module:factory``.

    The factory may return a `MoEModelConfig`, a model with a ``config`` attribute holding one, or any
    ``nn.Module`` whose MoE layers `themis_compile.passes.detect.find_moe_layers` recognises (then
    d_model/d_ffn come from the first expert's weights and ``seq_len`` must be given).
    """
    if ":" not in spec:
        cfg = preset(spec, devices=devices, cluster=cluster if cluster in ("A", "B") else "A")
        return cfg.replace(seq_len=seq_len) if seq_len else cfg
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load model factory {spec!r}: {exc}") from exc
    obj = factory() if callable(factory) else factory
    if isinstance(obj, MoEModelConfig):
        cfg = obj
    elif isinstance(getattr(obj, "config", None), MoEModelConfig):
        cfg = obj.config
    else:
        cfg = _config_from_module(obj, spec, seq_len)
    return cfg.replace(seq_len=seq_len) if seq_len else cfg


def _config_from_module(module: Any, spec: str, seq_len: int | None) -> MoEModelConfig:
    from torch import nn

    from themis_compile.passes.detect import find_moe_layers

    if not isinstance(module, nn.Module):
        raise ValueError(f"{spec!r} returned {type(module).__name__}, not a MoEModelConfig or nn.Module")
    layers, rejected = find_moe_layers(module)
    if not layers:
        raise ValueError(f"{spec!r}: no MoE layer found ({rejected or 'no router with experts'})")
    if seq_len is None:
        raise ValueError(f"{spec!r} is a generic nn.Module: pass --seq-len")
    first = layers[0]
    weights = [p for p in first.module.experts.parameters() if p.dim() >= 2]
    shape = weights[0].shape[-2:]
    d_ffn, d_model = (int(shape[0]), int(shape[1]))
    if d_ffn < d_model:
        d_ffn, d_model = d_model, d_ffn
    act = "swiglu" if first.activation == "swiglu" else "gelu"
    return MoEModelConfig(name=spec, d_model=d_model, n_heads=1, n_layers=len(layers), d_ffn=d_ffn,
                          num_experts=first.num_experts, top_k=first.top_k, seq_len=int(seq_len),
                          activation=act, shared_expert=bool(first.shared_experts), vocab_size=1)


def read_profile(path: str | Path) -> dict[str, Any]:
    """A profile JSON: ``{"t_attn_fwd_s": {layer: s}, "bw_intra": B/s, "bw_inter": B/s, "psi": bytes}``
    (any key may be missing; missing ones fall back to the modeled values)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"profile {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"profile {str(path)!r} must be a JSON object")
    return data


def build_setup(model: MoEModelConfig, cluster: Cluster, *, batch: int | None = None,
                precision: Precision = Precision(), memory_budget_bytes: float | None = None,
                overlap_degree: int | None = None, materialization_budget: int | None = None,
                replica_slots: int | None = None, reshard_interval: int = 100,
                attention_efficiency: float | None = None, profile: dict[str, Any] | None = None,
                max_memory_bytes: float | None = None) -> SimSetup:
    """Derive the simulator's inputs (see `SimSetup` and the module docstring).

    Defaults: ``batch`` from `DEFAULT_BATCH` (1 for unknown models); T_attn from the model's attention at
    ``attention_efficiency`` (default `ATTENTION_EFFICIENCY`) of peak; the memory budget for replicas is
    what a device has left after EP's model states, the batch's activations and `RUNTIME_RESERVE_BYTES`;
    t and m from the §4.2 formulas (`analytic.overlap_degree`, `analytic.materialization_budget`);
    FlexMoE reserves `FLEXMOE_RESERVE_FRACTION` of device memory for replica slots with their gradients
    and optimizer state. A ``profile`` (see `read_profile`) replaces T_attn, Ψ and the bandwidths used
    for t. ValueError when the simulation would exceed ``max_memory_bytes`` (default `MAX_SIM_BYTES`;
    `check_simulation_size`).
    """
    check_simulation_size(model, cluster, max_memory_bytes)
    base = _base(model.name)
    batch = int(batch if batch is not None else DEFAULT_BATCH.get(base, 1))
    if batch < 1:
        raise ValueError(f"batch must be >= 1 sequence per device, got {batch}")
    if model.num_experts < cluster.num_devices:
        logger.info("%d experts on %d devices: some devices own no expert", model.num_experts, cluster.num_devices)
    eta = ATTENTION_EFFICIENCY if attention_efficiency is None else float(attention_efficiency)
    if not 0 < eta <= 1:
        raise ValueError(f"attention efficiency must be in (0, 1], got {eta}")
    flops = cluster.effective_flops
    shape = attention_shape(model)
    stage = is_pipeline_stage(model)
    e_params = analytic.expert_params(model)
    psi = float(analytic.expert_bytes(model, precision.param_bytes))
    t_attn = analytic.attention_time(model, batch, cluster.peak_flops, eta, shape)
    source = "modeled"
    window_bw = cluster.window_bw
    if profile:
        t_by_layer = profile.get("t_attn_fwd_s") or {}
        if t_by_layer:
            t_attn = float(np.mean([float(v) for v in t_by_layer.values()]))
            source = "profiled"
        psi = float(profile.get("psi", psi))
        key = "bw_inter" if cluster.num_nodes > 1 else "bw_intra"
        window_bw = float(profile.get(key, window_bw))
    dense, owned = _ep_param_counts(model, cluster.num_devices)
    layer_dense = (analytic.dense_params(model.replace(n_layers=1), include_embeddings=False, attention=shape)
                   - 2 * model.d_model)
    d = model.d_model
    emb_params = 0 if stage else (model.vocab_size + model.seq_len) * d
    head_params = 0 if stage else model.vocab_size * d + 2 * d
    acts = analytic.activation_bytes(model, batch, shape, act_bytes=precision.param_bytes, include_head=not stage)
    L = model.n_layers
    if memory_budget_bytes is None:
        ep_states = (dense + owned) * precision.state_bytes
        memory_budget_bytes = max(0.0, cluster.memory_bytes - ep_states - acts - RUNTIME_RESERVE_BYTES)
    t = analytic.overlap_degree(t_attn, window_bw, psi) if overlap_degree is None else int(overlap_degree)
    if materialization_budget is None:
        m = analytic.materialization_budget(memory_budget_bytes, psi, L, precision=precision)
        # Re-materialized replicas are alive for the layer in use and the one gathered ahead of it.
        m_rm = analytic.materialization_budget(memory_budget_bytes, psi, min(2, L), precision=precision)
    else:
        m = m_rm = int(materialization_budget)
    if replica_slots is None:
        per_slot = L * e_params * precision.state_bytes
        replica_slots = max(1, int(FLEXMOE_RESERVE_FRACTION * cluster.memory_bytes // per_slot)) if per_slot else 1
    return SimSetup(
        model=model, cluster=cluster, batch=batch, precision=precision, psi=psi, expert_params=e_params,
        tokens_per_device=batch * model.seq_len,
        time_per_token_s=analytic.expert_flops_per_token(model) / flops,
        token_bytes=float(d * precision.param_bytes), t_attn_s=t_attn,
        shared_s=(analytic.expert_flops_per_token(model) * batch * model.seq_len / flops
                  if model.shared_expert else 0.0),
        head_s=0.0 if stage else analytic.head_flops(model, batch) / flops, dense_params=dense,
        layer_dense_params=layer_dense, embedding_params=emb_params, head_params=head_params,
        activation_bytes=acts, overlap_degree=t, memory_budget_bytes=float(memory_budget_bytes),
        materialization_budget=m, materialization_budget_rm=m_rm, replica_slots=int(replica_slots),
        reshard_interval=int(reshard_interval), t_attn_source=source, pipeline_stage=stage)
