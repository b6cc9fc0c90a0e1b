"""`python -m themis_compile.bench planner`: time of the per-layer planning path (Alg. 1 + Alg. 3) and of
Alg. 2, at the paper's scale (§5.3: median 24–51 µs, p95 67 µs per MoE layer).

Setups: 4 nodes × 8 devices; E = 64 with top-4 routing (Qwen1.5-MoE) and E = 128 with top-8
(DeepSeek-V3). Loads come from a skewed generator: expert popularity from a Dirichlet(α = 0.3) that
drifts a little every iteration, each device routing its tokens multinomially. The calibration stage
(§4.2, run on the actual gate counts after Alg. 1) is timed separately, on counts drawn from a popularity
perturbed away from the predicted one. Alg. 2 is timed over 24 layers. Prints one JSON document and
returns it; ``load_average`` records how busy the machine was (timings on a shared machine are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from themis_compile.planner import (
    PlanCost, Topology, calibrate, heterogeneous_sharding, homogeneous_sharding, sparse_materialization,
    topology_aware_dispatch,
)
from themis_compile.planner.dispatch import dispatch_rows

SETUPS = (
    {"name": "qwen1.5-moe", "num_experts": 64, "top_k": 4, "overlap_degree": 8, "materialization_budget": 2},
    {"name": "deepseek-v3", "num_experts": 128, "top_k": 8, "overlap_degree": 16, "materialization_budget": 4},
)


def skewed_tokens(rng: np.random.Generator, popularity_E: np.ndarray, num_devices: int,
                  tokens_per_device: int) -> np.ndarray:
    """[E, D] int64 gate counts: every device routes ``tokens_per_device`` assignments by popularity."""
    return rng.multinomial(tokens_per_device, popularity_E, size=num_devices).T.astype(np.int64)


def _percentiles(samples_us: list[float]) -> dict[str, float]:
    arr = np.asarray(samples_us)
    return {"median_us": round(float(np.median(arr)), 2), "p95_us": round(float(np.percentile(arr, 95)), 2),
            "min_us": round(float(arr.min()), 2)}


def bench_setup(setup: dict, plans: int, seed: int, topology: Topology, seq_len: int = 4096) -> dict:
    rng = np.random.default_rng(seed)
    E, D = setup["num_experts"], topology.num_devices
    t, m = setup["overlap_degree"], setup["materialization_budget"]
    shard = homogeneous_sharding(1, E, D)[0]
    popularity_E = rng.dirichlet(np.full(E, 0.3))
    cost = PlanCost(time_per_token_s=1e-6, expert_bytes=16e6, topology=topology)
    rng_actual = np.random.default_rng(seed + 1)        # its own stream: the predicted traces stay as they were
    traces = []
    for _ in range(min(plans, 64)):                     # inputs prepared outside the timed region
        popularity_E = popularity_E * np.exp(rng.normal(0.0, 0.05, E))
        popularity_E /= popularity_E.sum()
        tokens_ED = skewed_tokens(rng, popularity_E, D, seq_len * setup["top_k"])
        actual_E = popularity_E * np.exp(rng_actual.normal(0.0, 0.3, E))
        actual_ED = skewed_tokens(rng_actual, actual_E / actual_E.sum(), D, seq_len * setup["top_k"])
        traces.append((tokens_ED.sum(axis=1).astype(np.float64), tokens_ED, actual_ED))
    alg1_us, alg3_us, total_us, calib_us, rows_us, imbalance = [], [], [], [], [], []
    for i in range(plans):
        load_E, tokens_ED, actual_ED = traces[i % len(traces)]
        t0 = time.perf_counter()
        placement = sparse_materialization(shard, load_E, t, m, topology)
        t1 = time.perf_counter()
        R_EDD = topology_aware_dispatch(placement, tokens_ED, topology)
        t2 = time.perf_counter()
        alg1_us.append((t1 - t0) * 1e6)
        alg3_us.append((t2 - t1) * 1e6)
        total_us.append((t2 - t0) * 1e6)
        t3 = time.perf_counter()
        dispatch_rows(placement, tokens_ED, topology, i % D)
        rows_us.append((time.perf_counter() - t3) * 1e6 + alg1_us[-1])
        t3 = time.perf_counter()
        calibrate(shard, placement, actual_ED.sum(axis=1), t, m + 1, topology, cost, tokens_ED=actual_ED)
        calib_us.append((time.perf_counter() - t3) * 1e6)
        if i < len(traces):
            ep = topology_aware_dispatch(shard, tokens_ED, topology).sum(axis=(0, 1))
            imbalance.append((float(ep.max() / ep.mean()), float(R_EDD.sum(axis=(0, 1)).max() / ep.mean())))
    imb = np.asarray(imbalance)
    return {
        "setup": setup["name"], "num_experts": E, "top_k": setup["top_k"], "overlap_degree": t,
        "materialization_budget": m, "plans": plans,
        "alg1_plus_alg3": _percentiles(total_us), "alg1": _percentiles(alg1_us), "alg3": _percentiles(alg3_us),
        # What one rank needs per layer: Alg. 1 and its own row R[:, rank, :] of the Alg. 3 plan.
        "alg1_plus_alg3_own_row": _percentiles(rows_us),
        "calibrate_with_tokens": _percentiles(calib_us),
        "max_over_mean_device_load": {"ep": round(float(imb[:, 0].mean()), 3),
                                      "themis_alg1": round(float(imb[:, 1].mean()), 3)},
    }


def bench_alg2(num_layers: int, num_experts: int, overlap_degree: int, topology: Topology, repeats: int,
               seed: int) -> dict:
    rng = np.random.default_rng(seed)
    times_ms = []
    for _ in range(repeats):
        load_LE = np.stack([rng.dirichlet(np.full(num_experts, 0.3)) * 1e5 for _ in range(num_layers)]).round()
        t0 = time.perf_counter()
        heterogeneous_sharding(load_LE, overlap_degree, topology)
        times_ms.append((time.perf_counter() - t0) * 1e3)
    return {"num_layers": num_layers, "num_experts": num_experts, "overlap_degree": overlap_degree,
            "median_ms": round(float(np.median(times_ms)), 3), "max_ms": round(float(np.max(times_ms)), 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m themis_compile.bench planner", description=__doc__)
    parser.add_argument("--plans", type=int, default=2000, help="plans per setup (>= 1000 for the report)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few plans only (smoke test)")
    args = parser.parse_args(argv)
    plans = 20 if args.quick else args.plans
    topology = Topology.uniform(args.nodes, args.devices_per_node)
    result = {
        "benchmark": "planner",
        "topology": topology.describe(),
        "target": {"median_us": 24.0, "p95_us": 50.0, "paper_median_us": [24, 51], "paper_p95_us": 67},
        "setups": [bench_setup(s, plans, args.seed, topology) for s in SETUPS],
        "alg2": bench_alg2(24, 64, 8, topology, 1 if args.quick else 5, args.seed),
        "quick": bool(args.quick),
        "python": platform.python_version(), "numpy": np.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
