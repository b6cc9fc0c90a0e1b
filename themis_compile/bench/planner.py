"""`python -m themis_compile.bench planner`: time of the per-layer planning path (Alg. 1 + Alg. 3) and of
Alg. 2, at the paper's scale (§5.3: median 24–51 µs, p95 67 µs per MoE layer).

Setups: 4 nodes × 8 devices; E = 64 with top-4 routing (Qwen1.5-MoE) and E = 128 with top-8
(DeepSeek-V3). Loads come from a skewed generator: expert popularity from a Dirichlet(α = 0.3) that
drifts a little every iteration, each device routing its tokens multinomially. The calibration stage
(§4.2, run on the actual gate counts after Alg. 1) is timed separately, on counts drawn from a popularity
perturbed away from the predicted one. Alg. 2 is timed over 24 layers. Prints one JSON document and
returns it; ``load_average`` records how busy the machine was (timings on a shared machine are noisy).

``alg1_plus_alg3_own_row`` is what one MoE layer costs a rank per iteration (Alg. 1 and the rank's own
rows R[:, rank, :] of Alg. 3, as the runtime runs them): ``target_met`` judges it against the target;
``alg1_plus_alg3`` builds the full dense [E, D, D] plan (the readable reference's view; the simulator charges
the plan's sparse totals, `planner.dispatch.dispatch_traffic`) and is reported beside it.

``--devices 256,1024`` times the per-layer path on a rank past the paper's scale instead: DeepSeek-V3-like
(E = 4 experts per device, top-8, 8 devices per node), with the overlap degree t and the materialization
budget m the simulator derives for DeepSeek-V3 on Cluster A at that size (`sim.setup.build_setup`), and
once more with a binding budget (m = `BINDING_BUDGET` < t: Alg. 1's LPT branch). Reported per size: the
median / p95 of Alg. 1, of the rank's own row of Alg. 3 and of both (``per_layer_on_a_rank``: the dense
[E, D] layout the runtime consumes), and the same through the sparse path (``*_sparse``: Alg. 1 as the
experts it replicates everywhere and the other replica pairs it adds, `materialize_pairs`, and the row
as entries from the rank's own counts, `own_row_entries`), each against `DEVICES_TARGET_US`. The full
[E, D, D] plan is not built there (34 GB at 1,024 devices). ``--budget T,M`` (repeatable) times other
budgets instead; ``--clock thread`` times the thread's CPU time (a shared machine).

``backend`` names the planner core that ran (``"c"``: the compiled core, ``"numpy"``: its numpy
reference; see `planner/backend.py`). ``--backend both`` times the two plan by plan, interleaved,
and adds ``numpy_setups`` and the per-metric median ratios ``numpy_over_c`` (ratios are what stay
comparable on a noisy machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from themis_compile.planner import (
    PlanCost, Topology, backend, calibrate, heterogeneous_sharding, homogeneous_sharding,
    sparse_materialization, topology_aware_dispatch,
)
from themis_compile.planner.dispatch import dispatch_rows, own_row_entries
from themis_compile.planner.materialize import materialize_pairs

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


TIMED = ("alg1_plus_alg3", "alg1", "alg3", "alg1_plus_alg3_own_row", "calibrate_with_tokens")


def _timed_plan(i: int, shard, trace, t: int, m: int, topology: Topology, cost: PlanCost, samples: dict):
    """One plan of the timed loop (Alg. 1, Alg. 3, own row, calibration); appends to ``samples``."""
    load_E, tokens_ED, actual_ED = trace
    D = topology.num_devices
    t0 = time.perf_counter()
    placement = sparse_materialization(shard, load_E, t, m, topology)
    t1 = time.perf_counter()
    R_EDD = topology_aware_dispatch(placement, tokens_ED, topology)
    t2 = time.perf_counter()
    samples["alg1"].append((t1 - t0) * 1e6)
    samples["alg3"].append((t2 - t1) * 1e6)
    samples["alg1_plus_alg3"].append((t2 - t0) * 1e6)
    t3 = time.perf_counter()
    dispatch_rows(placement, tokens_ED, topology, i % D)
    # What one rank needs per layer: Alg. 1 and its own row R[:, rank, :] of the Alg. 3 plan.
    samples["alg1_plus_alg3_own_row"].append((time.perf_counter() - t3) * 1e6 + samples["alg1"][-1])
    t3 = time.perf_counter()
    calibrate(shard, placement, actual_ED.sum(axis=1), t, m + 1, topology, cost, tokens_ED=actual_ED)
    samples["calibrate_with_tokens"].append((time.perf_counter() - t3) * 1e6)
    return R_EDD


def bench_setup(setup: dict, plans: int, seed: int, topology: Topology, seq_len: int = 4096,
                backends: tuple | None = None) -> list[dict]:
    """Time one setup; ``backends``: planner cores to interleave plan by plan (the compiled module, or
    None for numpy; default: the loaded one). One result per backend, in that order."""
    if backends is None:
        backends = (backend.compiled_core(),)
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
    samples = [{name: [] for name in TIMED} for _ in backends]
    imbalance = []
    for i in range(plans):
        trace = traces[i % len(traces)]
        for b, core in enumerate(backends):
            with backend.using(core):
                R_EDD = _timed_plan(i, shard, trace, t, m, topology, cost, samples[b])
        if i < len(traces):
            ep = topology_aware_dispatch(shard, trace[1], topology).sum(axis=(0, 1))
            imbalance.append((float(ep.max() / ep.mean()), float(R_EDD.sum(axis=(0, 1)).max() / ep.mean())))
    imb = np.asarray(imbalance)
    return [{
        "setup": setup["name"], "num_experts": E, "top_k": setup["top_k"], "overlap_degree": t,
        "materialization_budget": m, "plans": plans,
        **{name: _percentiles(backend_samples[name]) for name in TIMED},
        "max_over_mean_device_load": {"ep": round(float(imb[:, 0].mean()), 3),
                                      "themis_alg1": round(float(imb[:, 1].mean()), 3)},
    } for backend_samples in samples]


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


# --devices: the per-layer target on a rank at 1,024 devices, and the budget of the LPT-branch variant.
DEVICES_TARGET_US = 100.0
BINDING_BUDGET = 4


# DeepSeek-V3 in Table 1: 4 experts per GPU, top-8, sequences of 4,096 tokens.
DEVICES_EXPERTS_PER_DEVICE, DEVICES_TOP_K, DEVICES_SEQ_LEN = 4, 8, 4096


def simulator_budgets(num_devices: int, devices_per_node: int = 8) -> list[tuple[str, int, int]]:
    """(label, t, m) of the --devices runs: the simulator's t and m for DeepSeek-V3 on Cluster A with
    ``num_devices`` devices (`sim.setup.build_setup`), and the same t with m = `BINDING_BUDGET`."""
    from themis_compile.cost_model.cluster import get_cluster
    from themis_compile.models.presets import preset
    from themis_compile.sim.setup import build_setup

    cluster = get_cluster("A", num_devices // devices_per_node)
    sim = build_setup(preset("deepseek-v3", devices=num_devices, cluster="A"), cluster)
    t = sim.overlap_degree
    return [("simulator", t, sim.materialization_budget), ("binding_budget", t, min(BINDING_BUDGET, t))]


def bench_devices(num_devices: int, plans: int, seed: int, devices_per_node: int = 8,
                  clock=time.perf_counter, budgets: list[tuple[str, int, int]] | None = None) -> list[dict]:
    """Alg. 1 and a rank's own row of Alg. 3 at ``num_devices`` devices for a DeepSeek-V3-like layer
    (module docstring), dense and sparse, once per ``budgets`` entry (label, t, m; default
    `simulator_budgets`). ``clock``: wall time (default) or the thread's CPU time (`time.thread_time`:
    on a shared machine it leaves out the time the process waits for a core)."""
    if num_devices % devices_per_node:
        raise ValueError(f"--devices {num_devices} is not a multiple of {devices_per_node} devices per node")
    nodes = num_devices // devices_per_node
    if budgets is None:
        budgets = simulator_budgets(num_devices, devices_per_node)
    topology = Topology.uniform(nodes, devices_per_node)
    E, D = DEVICES_EXPERTS_PER_DEVICE * num_devices, topology.num_devices
    shard = homogeneous_sharding(1, E, D)[0]
    rng = np.random.default_rng(seed)
    popularity_E = rng.dirichlet(np.full(E, 0.3))
    traces = []
    for _ in range(min(plans, 8)):                      # inputs prepared outside the timed region
        popularity_E = popularity_E * np.exp(rng.normal(0.0, 0.05, E))
        popularity_E /= popularity_E.sum()
        tokens_ED = skewed_tokens(rng, popularity_E, D, DEVICES_SEQ_LEN * DEVICES_TOP_K)
        traces.append((tokens_ED.sum(axis=1).astype(np.float64), tokens_ED))
    out = []
    for label, t, m in budgets:
        names = ("alg1", "alg3_own_row", "per_layer_on_a_rank")
        samples: dict[str, list[float]] = {n: [] for n in names + tuple(f"{n}_sparse" for n in names)}
        sparse_materialization(shard, traces[0][0], t, m, topology)        # warm caches
        owners_E = shard.owners()
        # The two layouts in separate loops: the dense one moves tens of MB per plan at 1,024 devices,
        # which would leave the sparse one timed on a cold cache.
        for i in range(plans):
            load_E, tokens_ED = traces[i % len(traces)]
            t0 = clock()
            placement = sparse_materialization(shard, load_E, t, m, topology)
            t1 = clock()
            dispatch_rows(placement, tokens_ED, topology, i % D)
            t2 = clock()
            for name, a, b in zip(names, (t0, t1, t0), (t1, t2, t2)):
                samples[name].append((b - a) * 1e6)
        for i in range(plans):
            load_E, tokens_ED = traces[i % len(traces)]
            t0 = clock()
            full_J, replicas_X = materialize_pairs(shard, load_E, t, m, topology)
            t1 = clock()
            own_row_entries(owners_E, full_J, replicas_X, tokens_ED[:, i % D], topology, i % D)
            t2 = clock()
            for name, a, b in zip(names, (t0, t1, t0), (t1, t2, t2)):
                samples[f"{name}_sparse"].append((b - a) * 1e6)
        stats = {name: _percentiles(v) for name, v in samples.items()}
        out.append({"devices": D, "nodes": nodes, "num_experts": E, "top_k": DEVICES_TOP_K, "budget": label,
                    "overlap_degree": t, "materialization_budget": m, "plans": plans, **stats,
                    "target_met": stats["per_layer_on_a_rank"]["median_us"] <= DEVICES_TARGET_US,
                    "target_met_sparse": stats["per_layer_on_a_rank_sparse"]["median_us"] <= DEVICES_TARGET_US})
    return out


def _parse_budget(text: str) -> tuple[str, int, int]:
    try:
        t, m = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget takes T,M (two integers), got {text!r}") from None
    if t < 0 or m < 0:
        raise argparse.ArgumentTypeError(f"--budget takes T,M >= 0, got {text!r}")
    return f"t={t},m={m}", t, m


def _parse_devices(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--devices takes comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--devices takes positive device counts, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m themis_compile.bench planner", description=__doc__)
    parser.add_argument("--plans", type=int, default=2000, help="plans per setup (>= 1000 for the report)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few plans only (smoke test)")
    parser.add_argument("--backend", choices=("auto", "c", "numpy", "both"), default="auto",
                        help="planner core: the loaded one (auto), the compiled core, numpy, or both interleaved")
    parser.add_argument("--devices", type=_parse_devices, default=None,
                        help="comma-separated device counts (e.g. 256,1024): the per-layer path on a rank at "
                             "those sizes, DeepSeek-V3-like (see the module docstring)")
    parser.add_argument("--budget", type=_parse_budget, action="append", default=None, metavar="T,M",
                        help="with --devices: an overlap degree and budget to time (repeatable; default: the "
                             "simulator's for DeepSeek-V3 on Cluster A, and m = %d)" % BINDING_BUDGET)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="with --devices: wall time, or the thread's CPU time (a shared machine)")
    args = parser.parse_args(argv)
    plans = 20 if args.quick else args.plans
    if args.devices is not None:
        plans = min(plans, 200) if args.plans == parser.get_default("plans") else plans
        result = {
            "benchmark": "planner_devices", "backend": backend.planner_backend(),
            "target": {"per_layer_on_a_rank_median_us": DEVICES_TARGET_US, "at_devices": 1024},
            "clock": args.clock,
            "sizes": [r for D in args.devices for r in bench_devices(
                D, plans, args.seed, args.devices_per_node,
                clock=time.thread_time if args.clock == "thread" else time.perf_counter, budgets=args.budget)],
            "quick": bool(args.quick), "python": platform.python_version(), "numpy": np.__version__,
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        }
        print(json.dumps(result, indent=2))
        return result
    topology = Topology.uniform(args.nodes, args.devices_per_node)
    loaded = backend.compiled_core()
    if args.backend in ("c", "both") and loaded is None:
        compiled = backend.load_compiled_core() if "THEMIS_PLANNER_NUMPY" not in os.environ else None
        if compiled is None:
            parser.error("--backend c/both: the compiled planner core is not available (pip install -e . builds "
                         "it; THEMIS_PLANNER_NUMPY must be unset)")
        loaded = compiled
    backends = {"auto": (loaded,), "c": (loaded,), "numpy": (None,), "both": (loaded, None)}[args.backend]
    per_setup = [bench_setup(s, plans, args.seed, topology, backends=backends) for s in SETUPS]
    result = {
        "benchmark": "planner",
        "backend": "numpy" if backends[0] is None else "c",
        "topology": topology.describe(),
        "target": {"median_us": 24.0, "p95_us": 50.0, "paper_median_us": [24, 51], "paper_p95_us": 67},
        "setups": [runs[0] for runs in per_setup],
    }
    if len(backends) == 2:
        result["numpy_setups"] = [runs[1] for runs in per_setup]
        result["numpy_over_c"] = [
            {"setup": c["setup"], **{name: round(n[name]["median_us"] / c[name]["median_us"], 2) for name in TIMED}}
            for c, n in (runs for runs in per_setup)]
    # The target applies to what a layer costs a rank per iteration: Alg. 1 and the rank's own rows of
    # Alg. 3 (`dispatch_rows`, what the runtime runs). The full dense [E, D, D] int64 plan (the reference's
    # view; the simulator and inspection charge its sparse totals) is reported beside it: at E = 128, D = 32 it is 1 MiB, whose writing alone
    # costs about half of the budget.
    target = result["target"]
    result["target_met"] = {
        s["setup"]: {"per_layer_on_a_rank": s["alg1_plus_alg3_own_row"]["median_us"] <= target["median_us"]
                     and s["alg1_plus_alg3_own_row"]["p95_us"] <= target["p95_us"],
                     "full_plan": s["alg1_plus_alg3"]["median_us"] <= target["median_us"]
                     and s["alg1_plus_alg3"]["p95_us"] <= target["p95_us"]}
        for s in result["setups"]}
    result.update({
        "alg2": bench_alg2(24, 64, 8, topology, 1 if args.quick else 5, args.seed),
        "quick": bool(args.quick),
        "python": platform.python_version(), "numpy": np.__version__,
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
    })
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
