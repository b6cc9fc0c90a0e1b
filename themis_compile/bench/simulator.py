"""`python -m themis_compile.bench.simulator`: wall time of the cluster simulator at the paper's scale.

The target (issue 8): a 100-iteration simulation of DeepSeek-V3 on 4 nodes x 8 GPUs of Cluster A, all
seven policies, finishes in under 60 s on a CPU. Trace generation and simulation are timed separately.
Prints one JSON document and returns it.
"""

from __future__ import annotations

import argparse
import json
import time

from themis_compile.cost_model.cluster import get_cluster
from themis_compile.sim import DEFAULT_POLICIES, build_setup, resolve_model_config, simulate
from themis_compile.sim.traces import synthetic_trace

TARGET_S = 60.0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m themis_compile.bench.simulator")
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--cluster", default="A")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--iterations", type=int, default=100)
    args = p.parse_args(argv)
    cluster = get_cluster(args.cluster, args.nodes)
    cfg = resolve_model_config(args.model, devices=cluster.num_devices, cluster=cluster.name)
    setup = build_setup(cfg, cluster)
    t0 = time.perf_counter()
    trace = synthetic_trace(cfg.n_layers, cfg.num_experts, cluster.num_devices, setup.tokens_per_device,
                            cfg.top_k, args.iterations, seed=0, model=cfg.name)
    t1 = time.perf_counter()
    result = simulate(setup, trace, DEFAULT_POLICIES, iterations=args.iterations)
    t2 = time.perf_counter()
    total = t2 - t0
    out = {"benchmark": "simulator", "model": cfg.name, "cluster": cluster.name, "num_devices": cluster.num_devices,
           "num_experts": cfg.num_experts, "moe_layers": cfg.n_layers, "iterations": args.iterations,
           "policies": list(DEFAULT_POLICIES), "trace_s": round(t1 - t0, 3), "simulate_s": round(t2 - t1, 3),
           "total_s": round(total, 3), "target_s": TARGET_S, "within_target": total < TARGET_S,
           "throughput_vs_ep": {k: round(v, 3) for k, v in result.speedup_over("ep").items()}}
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
