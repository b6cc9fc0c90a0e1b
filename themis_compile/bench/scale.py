"""`python -m themis_compile.bench scale`: the runtime's own per-rank cost at 8 to 4,096 ranks.

One rank of N runs in one process on torch's fake process group (``dist.init_process_group("fake")``:
collectives return at once and carry no data), so that a rank's share of a large job can be measured on
one machine. The model is the reference tiny MoE transformer (``d_model`` 16, a few layers, top-8 over
E = 4·N experts by default), small enough that compute is negligible beside the runtime's own work:
``themis_compile.optimize``, then training steps (forward, backward, AdamW) of the real FSSDP layers.

The fake collectives would feed the planner zeros, so the two count exchanges of a layer step are
replaced on the layer's `FSSDPState` (its ``counts`` object, `runtime.fssdp.CountExchange`) by
`GeneratedCounts`: the totals of the other N - 1 ranks come from a skewed, seeded load generator
(expert popularity from a Dirichlet(α = 0.3) that drifts every step, tokens routed multinomially, as in
`bench/planner.py`), added to this rank's own router counts; what the sources send this rank follows
from those totals and the plan. Everything else — Alg. 1, the rank's row of Alg. 3, the SpAG/SpRS plans,
the statistics, the optimizer and Alg. 2's re-sharding — is the runtime's own code.

Reported per size (``sizes``, one JSON document, ``--json``; a table otherwise):

* ``plan_us_median`` / ``plan_us_p95``: host time of one layer's planning in one step on the rank
  (`FSSDPExperts.plan_ns`: Alg. 1 materialization, SpAG plan, calibration, the rank's own row of Alg. 3
  and its receive plan, statistics, SpRS plan), over the measured steps and layers;
* ``metadata_bytes_per_layer_step``: bytes the rank sends plus receives per layer step besides
  parameters and token rows (the count all-reduce, counted as a ring: 2·(N - 1)/N of the vector each way,
  and the held-count all-to-all); ``metadata_bytes_full_gather``: what the [N, 2E + 2] count all-gather
  of ``ThemisConfig.full_stats`` would receive instead;
* ``rss_mb`` (after the last step), ``rss_growth_mb_per_1000_steps`` (linear fit of the RSS over the
  second half of the steps), ``stats_bytes`` (the statistics log, `runtime.fssdp.StatsLog`);
* ``optimize_s`` and ``reshard_s`` (one Alg. 2 re-sharding of every layer, `runtime.reshard.reshard`;
  the layouts of optimizer state it would gather from the other ranks are this rank's own).

Each size runs in a subprocess of its own (``--one N``), so that sizes do not share heap or caches.
``--plot PATH`` draws plan µs and RSS per rank against ranks (log-log) beside published anchors.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

# Published per-plan times of other planners (ms), drawn beside ours by --plot.
ANCHORS_MS = {
    "LAER-MoE planner": [(64, 0.49), (256, 3.6), (1024, 100.0)],
    "vLLM EPLB (8 ranks)": [(8, 10.0), (8, 44.0)],
}
TARGET_PLAN_US = 200.0          # per layer step on a rank at 1,024 ranks, one core
OVERLAP_DEGREE, MATERIALIZATION_BUDGET = 32, 2     # t > m: Alg. 1's LPT branch, at most 2 replicas a device


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


class GeneratedCounts:
    """`runtime.fssdp.CountExchange` for one rank of N on a fake process group: the counts a real job
    would exchange, from a skewed, seeded load generator instead of the other ranks.

    ``layer_counts``: this rank's counts plus the other ranks' totals (popularity from a Dirichlet that
    drifts every step; router flags cleared: the fake collectives leave activations undefined, and a
    real job's routers are finite). ``receive_counts``: every source sends this rank its share of each
    held expert's load, split over the expert's holders. Also counts the metadata bytes of both.
    """

    def __init__(self, num_ranks: int, num_experts: int, pairs_per_rank: int, seed: int = 0,
                 alpha: float = 0.3, drift: float = 0.05) -> None:
        self.rng = np.random.default_rng(seed)
        self.N, self.E, self.pairs = num_ranks, num_experts, pairs_per_rank
        self.drift = drift
        self.popularity_E = self.rng.dirichlet(np.full(num_experts, alpha))
        self.load_E: dict[str, np.ndarray] = {}
        self.metadata_bytes = 0
        self.calls = 0

    def step(self) -> None:
        """Drift the popularity (once per training step)."""
        noise_E = self.rng.dirichlet(np.full(self.E, 0.3))
        self.popularity_E = (1 - self.drift) * self.popularity_E + self.drift * noise_E

    def layer_counts(self, layer: Any, local_C: Any) -> Any:
        import torch

        E, N = self.E, self.N
        others_E = self.rng.multinomial(self.pairs * (N - 1), self.popularity_E)
        out = local_C.clone()
        out[:E] += torch.from_numpy(others_E)
        out[E:E + 2] = 0
        self.load_E[layer.layer] = out[:E].numpy().copy()
        ring = 2 * local_C.numel() * local_C.element_size() * (N - 1) / N
        self.metadata_bytes += int(2 * ring)        # sent + received
        self.calls += 1
        return out

    def receive_counts(self, layer: Any, send_P: Any, send_splits_W: list[int], held_H: np.ndarray) -> Any:
        import torch

        N, rank = self.N, layer.rank
        load_E = self.load_E[layer.layer]
        copies_H = 1 + np.bincount(layer._planned_added // N, minlength=self.E)[held_H]
        share_H = np.ceil(load_E[held_H] / (N * copies_H)).astype(np.int64)
        recv_SH = np.broadcast_to(share_H, (N, held_H.size)).copy()
        start = sum(send_splits_W[:rank])
        recv_SH[rank] = send_P[start:start + held_H.size].numpy()       # what this rank sends itself
        self.metadata_bytes += 8 * (sum(send_splits_W) - send_splits_W[rank] + (N - 1) * held_H.size)
        return torch.from_numpy(recv_SH)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def run_one(num_ranks: int, num_experts: int, top_k: int, steps: int, layers: int, seed: int,
            rank: int = 0, stats_max_bytes: int | None = None) -> dict[str, Any]:
    """One rank of ``num_ranks`` on the fake process group: optimize, ``steps`` training steps, one
    re-sharding. Returns the size's record (see the module docstring). ``stats_max_bytes``: the
    statistics log's bound (`ThemisConfig.stats_max_bytes`; None: its default)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import themis_compile
    from themis_compile.models import build_model
    from themis_compile.runtime import deadline
    from themis_compile.runtime.reshard import reshard

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=num_ranks)
    batch, seq = 2, 16
    model = build_model("tiny-moe", d_model=16, n_heads=2, d_ffn=16, n_layers=layers, num_experts=num_experts,
                        top_k=top_k, vocab_size=64, seq_len=seq, experts_form="stacked", router_skew=1.0)
    # Nodes of 8 devices; t and m fixed (a profile would make them depend on this machine's timing);
    # Alg. 1's replicas always materialized, so that the planning measured is that of a skewed job's.
    config = themis_compile.ThemisConfig(dense_parallel="fsdp2", reshard_interval=0, schedule=False,
                                         cost_benefit=False, devices_per_node=min(8, num_ranks), overlap_degree=OVERLAP_DEGREE,
                                         materialization_budget=MATERIALIZATION_BUDGET)
    if stats_max_bytes is not None:
        config = config.replace(stats_max_bytes=stats_max_bytes)
    start = time.perf_counter()
    model = themis_compile.optimize(model, config)
    optimize_s = time.perf_counter() - start
    runtime = themis_compile.api.runtime_of(model)
    state = runtime.fssdp
    counts = GeneratedCounts(num_ranks, num_experts, batch * seq * top_k, seed=seed)
    state.counts = counts
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    plan_us, comm_us, rss = [], [], []
    warmup = min(10, steps // 10)
    for step in range(steps):
        tokens = torch.randint(0, 64, (batch, seq), generator=g)
        counts.step()
        model(tokens).float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            plan_us += [layer.plan_ns / 1e3 for layer in runtime.layers.values()]
            comm_us += [layer.comm_plan_ns / 1e3 for layer in runtime.layers.values()]
        rss.append(_rss_mb())
    half = steps // 2
    growth = float(np.polyfit(np.arange(half, steps), rss[half:], 1)[0] * 1000) if steps - half >= 2 else 0.0
    metadata = counts.metadata_bytes / max(counts.calls, 1)

    # One Alg. 2 re-sharding; the fake group carries no objects, so the optimizer-state layouts the other
    # ranks would send are this rank's own (every rank runs the same optimizer on the same shapes).
    gather_object = deadline.all_gather_object

    def own_layouts(obj, **kwargs):
        if not str(kwargs.get("purpose", "")).startswith("re-sharding"):
            return [obj] * num_ranks
        template = next((lay for per_layer in obj.values() for lay in per_layer.values()), None)
        if template is None:
            layer = next(iter(runtime.layers.values()))
            from themis_compile.runtime.reshard import _state_layout
            template = _state_layout(opt, next(iter(layer.local_chunks().values())))
        others = {li: {e: template for e in range(num_experts)
                       if e not in obj.get(li, {}) and int(layer.owner_E[e]) != rank}
                  for li, layer in enumerate(runtime.layers.values())}
        return [obj, others]

    deadline.all_gather_object = own_layouts
    try:
        start = time.perf_counter()
        moved = reshard(runtime, opt)
        reshard_s = time.perf_counter() - start
    finally:
        deadline.all_gather_object = gather_object
    E = num_experts
    record = {
        "ranks": num_ranks, "experts": E, "top_k": top_k, "layers": len(runtime.layers), "steps": steps,
        "plan_us_median": round(_percentile(plan_us, 50), 1), "plan_us_p95": round(_percentile(plan_us, 95), 1),
        "comm_plan_us_median": round(_percentile(comm_us, 50), 1),
        "metadata_bytes_per_layer_step": int(metadata),
        "metadata_bytes_full_gather": int(8 * (2 * E + 2) * (num_ranks - 1)),
        "rss_mb": round(rss[-1], 1), "rss_growth_mb_per_1000_steps": round(growth, 2),
        "stats_records": len(state.stats), "stats_bytes": int(state.stats.nbytes),
        "stats_max_bytes": int(state.stats.max_bytes),
        "optimize_s": round(optimize_s, 3), "reshard_s": round(reshard_s, 3), "reshard_moved": int(moved),
    }
    dist.destroy_process_group()
    return record


def _child(args: argparse.Namespace, num_ranks: int) -> dict[str, Any]:
    experts = args.experts if args.experts else args.experts_per_rank * num_ranks
    cmd = [sys.executable, "-m", "themis_compile.bench", "scale", "--one", str(num_ranks), "--experts", str(experts),
           "--top-k", str(args.top_k), "--steps", str(args.steps), "--layers", str(args.layers),
           "--seed", str(args.seed)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(result: dict[str, Any], path: str) -> None:
    """Log-log: plan µs per layer step and RSS per rank against ranks, beside the published anchors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["sizes"]
    ranks = [s["ranks"] for s in sizes]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    ax.plot(ranks, [s["plan_us_median"] for s in sizes], "o-", label="themis_compile, median")
    ax.plot(ranks, [s["plan_us_p95"] for s in sizes], "o--", label="themis_compile, p95")
    markers = iter("sD^v")
    for name, points in ANCHORS_MS.items():
        ax.plot([r for r, _ in points], [ms * 1e3 for _, ms in points], next(markers), ls=":", label=name)
    ax.axhline(TARGET_PLAN_US, color="grey", lw=0.8, ls="--", label=f"target {TARGET_PLAN_US:.0f} µs")
    ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="planning per layer step on a rank (µs)")
    ax.legend(fontsize=7)
    bx.plot(ranks, [s["rss_mb"] for s in sizes], "o-", label="RSS per rank (MB)")
    bx.plot(ranks, [max(s["rss_growth_mb_per_1000_steps"], 1e-2) for s in sizes], "o--",
            label="RSS growth (MB / 1,000 steps)")
    bx.set(xscale="log", yscale="log", xlabel="ranks", ylabel="MB")
    bx.legend(fontsize=7)
    fig.suptitle(f"one rank of N, E = {sizes[0]['experts'] // sizes[0]['ranks']}·N experts, top-{sizes[0]['top_k']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m themis_compile.bench scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="8,64,256,1024", help="comma-separated world sizes")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--experts-per-rank", type=int, default=4, help="E = this × ranks (default 4)")
    group.add_argument("--experts", type=int, default=None, help="a fixed number of experts instead")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the JSON document only")
    parser.add_argument("--plot", default=None, help="write a log-log plot (PNG) to this path")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        experts = args.experts if args.experts else args.experts_per_rank * args.one
        record = run_one(args.one, experts, args.top_k, args.steps, args.layers, args.seed)
        print(json.dumps(record))
        return record
    result = {"benchmark": "scale", "target_plan_us": TARGET_PLAN_US,
              "sizes": [_child(args, int(n)) for n in args.ranks.split(",")]}
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        keys = ("ranks", "experts", "plan_us_median", "plan_us_p95", "metadata_bytes_per_layer_step", "rss_mb",
                "rss_growth_mb_per_1000_steps", "optimize_s", "reshard_s")
        print(" ".join(f"{k:>14}" for k in keys))
        for s in result["sizes"]:
            print(" ".join(f"{s[k]!s:>14}" for k in keys))
    return result


if __name__ == "__main__":
    main()
