"""One configuration dataclass for the whole library, with the paper's defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

POLICIES = ("themis", "themis-rm", "ep", "uniform")


@dataclass
class ThemisConfig:
    """How `themis_compile.optimize` trains the MoE layers.

    Defaults follow the paper (Themis, §4 and §5.1) where it gives one.

    Attributes:
        policy: ``"themis"`` (FSSDP with an ephemeral load-balancing placement every iteration),
            ``"themis-rm"`` (the same with re-materialization: replicas are freed after the layer's
            forward and gathered again before its backward), ``"ep"`` (static expert parallelism, the
            baseline) or ``"uniform"`` (the force-balanced reference: themis' own path, with a gate that
            spreads the pairs evenly over the experts and no replicas; benchmarking only — it changes the
            model's numerics on purpose).
        overlap_degree: t, the most distinct experts materialized per layer and iteration (§4.2). ``None``
            derives it from the cost model, t = floor(T_attn * bw / Psi).
        materialization_budget: m, the most replicas each device adds per layer (§4.2). ``None`` derives it
            from ``memory_budget``.
        memory_budget: spare memory for replicas: a fraction (<= 1.0) of the device's free memory, or a
            number of bytes (> 1.0). With re-materialization the budget spans all layers (§4.2).
        predictor_window: w, the sliding window of the load predictor (paper: 5).
        reshard_interval: iterations between heterogeneous re-shardings with Alg. 2 (paper: 100);
            0 disables re-sharding.
        calibrate: run the calibration stage of §4.2 after the gate has produced the actual loads (its
            compute model: Alg. 3 on the whole count table under ``full_stats``, otherwise on each
            expert's total split evenly over the source ranks).
        devices_per_node: ranks per node for the topology; ``None`` reads LOCAL_WORLD_SIZE (torchrun).
        intra_node_bw, inter_node_bw: link bandwidths in bytes/s used when no profile exists.
        dense_parallel: how dense (non-expert) parameters are data-parallel: ``"fsdp2"`` (torch's
            ``fully_shard``; its hooks stay outside torch.compile graphs, so
            ``torch.compile(model, backend="themis", fullgraph=True)`` captures one graph on any number of
            ranks) or ``"ddp"`` (torch's composable ``replicate``; graph-breaks under torch.compile).
        kernels: dispatch/combine kernels: ``"auto"`` (Triton on CUDA, torch reference on CPU),
            ``"torch"`` or ``"triton"``.
        collective_timeout_s: the deadline of every collective of the library: the sparse collectives
            (SpAG, SpRS), the token-count exchange and the all-to-alls of the token exchange (forward and
            backward), the routing and router-output flags, the count all-reduce of a block's
            ``global_tokens_per_expert``, plan digests, the budget and profile exchanges, the
            re-sharding gathers and the replica check (``check_replicas``). A rank that stops participating makes the others raise
            ``themis_compile.runtime.deadline.CollectiveTimeoutError`` (a ``TimeoutError``) within this
            many seconds, naming the collective, the layer and the ranks that did not participate,
            instead of hanging (`runtime/deadline.py`). On NCCL the all-to-alls of the rows do not block
            the host: a stuck one is named by the next bounded wait on the group, and the process group's
            own timeout applies as well. The set-up collectives inside ``optimize`` (the experts'
            broadcast, the first cost-model exchanges) wait at least 300 s, since ranks reach them after
            rank-local work of any length. Keep the process group's ``timeout`` (``init_process_group``)
            at least this long, or its error (wrapped with the same names) comes first.
        cost_benefit: materialize Alg. 1's replicas of a layer step only when the compute they are
            predicted to save (forward and backward) exceeds their SpAG and SpRS
            (`planner.cost.replicas_pay`): at even loads Alg. 1's top-t replicas only move work and pay two
            transfers. ``False`` materializes what Alg. 1 chooses, as the paper states it.
        check_replicas: under ``dense_parallel="ddp"`` (world size > 1), check at every N-th forward that
            trains (train mode, gradients enabled; the first one included) that the replicated dense
            parameters are still bitwise equal on every rank, and raise on every rank, naming the forward,
            where they are not. They drift apart silently when gradients are scaled per rank, e.g. clipped
            with ``torch.nn.utils.clip_grad_norm_`` (each rank's local norm) instead of
            ``themis_compile.clip_grad_norm_`` (`runtime/replicas.py`). Cost per check: one read of every
            dense parameter (an int32 sum per tensor, as fast as a float sum, no copy), one all-reduce of
            2 int64 per dense tensor and a host synchronisation. 0 disables it; FSDP2 shards its parameters
            and is never checked.
        check_plans: cross-check a digest of every plan across ranks (debugging; one extra collective
            per layer step).
        full_stats: keep the whole count table in the load statistics (``LayerStats.
            tokens_per_device_expert``, [D][E]) and model calibration's compute time on it. Every rank then
            all-gathers the [D, 2E + 2] count table every layer step (O(E·D) bytes and memory per rank);
            without it the counts are all-reduced per expert (O(E)) and each statistics record holds
            summaries only: per-expert totals, device loads, ΔP, the imbalance.
        stats_max_bytes: the most bytes the statistics log (``runtime.stats``) keeps; older records are
            dropped first (and at most 10,000 records are kept).
        schedule: place SpAG/SpRS into the preceding attention's compute window (the scheduling pass).
        profile_path: JSON cache of profiled cost-model inputs (T_attn, bw); ``None`` uses the default
            cache location.
        expert_row_block: the most rows of one expert that one call of its code computes; more are split
            into blocks (each a call) and concatenated. ``"auto"``: on CPU, blocks whose intermediate
            activations fit in about 24 MiB of last-level cache (at least 256 rows; 1,024 for a SwiGLU
            expert with H=128, F=2048), since a hot expert's rows in one GEMM spill the cache and take up to
            twice as long; on GPU no blocks (large GEMMs are what it wants). ``None``: no blocks. Experts are
            row-wise, so the results are the same; only the weight gradient's sum over rows is taken in
            another order (``runtime/experts.py``, `row_block`).
    """

    policy: str = "themis"
    overlap_degree: int | None = None
    materialization_budget: int | None = None
    memory_budget: float = 0.25
    predictor_window: int = 5
    reshard_interval: int = 100
    calibrate: bool = True
    devices_per_node: int | None = None
    intra_node_bw: float = 5e9
    inter_node_bw: float = 1e9
    dense_parallel: str = "fsdp2"
    kernels: str = "auto"
    collective_timeout_s: float = 300.0
    check_plans: bool = False
    check_replicas: int = 1
    cost_benefit: bool = True
    schedule: bool = True
    profile_path: str | None = None
    expert_row_block: int | str | None = "auto"
    full_stats: bool = False
    stats_max_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"ThemisConfig.policy={self.policy!r} is not one of {POLICIES}")
        for name in ("overlap_degree", "materialization_budget"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"ThemisConfig.{name} must be >= 0, got {value}")
        if self.predictor_window < 1:
            raise ValueError(f"ThemisConfig.predictor_window must be >= 1, got {self.predictor_window}")
        if self.reshard_interval < 0:
            raise ValueError(f"ThemisConfig.reshard_interval must be >= 0, got {self.reshard_interval}")
        if self.memory_budget < 0:
            raise ValueError(f"ThemisConfig.memory_budget must be >= 0, got {self.memory_budget}")
        if self.dense_parallel not in ("ddp", "fsdp2"):
            raise ValueError(f"ThemisConfig.dense_parallel must be 'ddp' or 'fsdp2', got {self.dense_parallel!r}")
        if self.kernels not in ("auto", "torch", "triton"):
            raise ValueError(f"ThemisConfig.kernels must be 'auto', 'torch' or 'triton', got {self.kernels!r}")
        block = self.expert_row_block
        if block != "auto" and block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
            raise ValueError(f"ThemisConfig.expert_row_block must be 'auto', None or an int >= 1, got {block!r}")
        if self.stats_max_bytes < 0:
            raise ValueError(f"ThemisConfig.stats_max_bytes must be >= 0, got {self.stats_max_bytes}")
        if isinstance(self.check_replicas, bool) or not isinstance(self.check_replicas, int) or self.check_replicas < 0:
            raise ValueError(f"ThemisConfig.check_replicas must be an int >= 0, got {self.check_replicas!r}")
        if self.collective_timeout_s <= 0:
            raise ValueError("ThemisConfig.collective_timeout_s must be > 0")

    @property
    def rematerialize(self) -> bool:
        return self.policy == "themis-rm"

    def replace(self, **changes) -> "ThemisConfig":
        return dataclasses.replace(self, **changes)
