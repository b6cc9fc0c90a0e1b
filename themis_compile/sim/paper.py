"""``simulate --paper``: the paper's §5 experiments on the simulator, next to the figures the paper reports.

Every run uses the same inputs for a given cluster and model (`themis_compile.sim.setup.build_setup`
defaults, synthetic traces at `traces.model_cv` with the default dynamics); nothing is tuned per row.
Each row carries ours/paper, and a row outside ±20 % carries the modeling assumption responsible.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from themis_compile.cost_model.cluster import Cluster, get_cluster
from themis_compile.models.presets import PAPER_PRESETS
from themis_compile.sim.engine import DEFAULT_POLICIES, SimResult, simulate
from themis_compile.sim.setup import build_setup, check_simulation_size, resolve_model_config
from themis_compile.sim.traces import PAPER_CV, RoutingTrace, model_cv, synthetic_trace

__all__ = ["TOLERANCE", "run_config", "paper_report", "format_paper_report", "weak_scaling",
           "format_weak_scaling"]

TOLERANCE = 0.2
# The paper's median planning time per MoE layer, 24-51 µs across its configurations (§5.3).
_PLAN_US = (24.0, 51.0)


def run_config(model_name: str, cluster: Cluster, *, policies: tuple[str, ...] | list[str] = DEFAULT_POLICIES,
               iterations: int = 30, cv: float | None = None, drift: float | None = None, seed: int = 0,
               batch: int | None = None, top_k: int | None = None, trace: RoutingTrace | None = None,
               max_layers: int | None = None, progress: bool = False, progress_label: str | None = None,
               **setup_kwargs: Any) -> SimResult:
    """Build a setup for a preset (or factory) on ``cluster``, a synthetic trace unless one is given,
    and simulate. ``cv`` defaults to the model's (`traces.model_cv`); ``max_layers`` caps the MoE layers
    (for quick runs); ``setup_kwargs`` go to `build_setup`."""
    cfg = resolve_model_config(model_name, devices=cluster.num_devices, cluster=cluster.name)
    if max_layers is not None:
        cfg = cfg.replace(n_layers=min(cfg.n_layers, int(max_layers)))
    if top_k is not None:
        cfg = cfg.replace(top_k=int(top_k))
    setup = build_setup(cfg, cluster, batch=batch, **setup_kwargs)
    if trace is None:
        cv = model_cv(cfg.experts_per_device, cfg.num_experts, cluster.num_devices) if cv is None else cv
        trace = synthetic_trace(cfg.n_layers, cfg.num_experts, cluster.num_devices, setup.tokens_per_device,
                                cfg.top_k, iterations, cv=cv, drift=drift, seed=seed, model=cfg.name)
    return simulate(setup, trace, policies, iterations=min(iterations, len(trace.steps)), progress=progress,
                    progress_label=progress_label)


# Per metric: (explanation when ours is higher than the paper's, when it is lower); formatted with the
# context of the runs (overlap degrees, budgets, ...).
_EXPLAIN: dict[str, tuple[str, str]] = {
    "themis_vs_ep": (
        "Themis wins more than measured where the window is wide: t = {t_fig9} replicas per layer (T_attn "
        "calibrated once from Fig. 12) replicate most of the load on every device, Alg. 3 keeps those tokens "
        "on their own device, and sparse collectives are charged at their lower bound with no per-message "
        "overhead and no contention with the all-to-all or compute",
        "Themis replicates at most t = floor(T_attn*bw/Psi) experts per layer (t = {t_fig9} across the runs) "
        "and m = {m_fig9}; where t is small the next-hottest experts stay whole on one device and keep the "
        "straggler and the inter-node all-to-all"),
    "themis_vs_fastermoe": (
        "FasterMoE is the planner's latency model (greedy shadowing) with broadcasts at the §3.3 lower bound "
        "on the critical path; where it shadows little, Themis's overlapped replicas win more",
        "FasterMoE's shadow broadcasts are charged at the §3.3 lower bound, faster than the real system's "
        "NCCL broadcasts, and it shadows without the t cap that binds Themis (t = {t_fig9})"),
    "ep_vs_uniform": (
        "the all-to-all is charged at its ingress/egress lower bound, so EP's hot-spot ingress costs the full "
        "bound while Uniform's balanced traffic reaches it; every model is given the same CV {cv:.2f} at 32 GPUs",
        "EP's penalty is straggler compute plus hot-spot ingress at the all-to-all's lower bound; the "
        "synthetic traces have no source locality and compute charges no kernel-efficiency or memory penalty "
        "to overloaded devices, so imbalance costs less than measured"),
    "topk": (
        "the CV of the expert shares is held as k grows, so EP's straggler and its hot node's all-to-all "
        "ingress grow linearly with the k-fold assignments at their lower bounds, while attention, the LM "
        "head, the shared expert and the optimizer stay fixed; the measured EP grows less: its fixed costs "
        "are larger than modeled (the released Qwen1.5-MoE's shared expert is 4x the preset's) or its gate "
        "flattens as k grows",
        "with the CV held, EP's all-to-all grows linearly with k at its lower bound while its straggler's "
        "share stays put; the paper's gate flattens less as k grows"),
    "weak_scaling": (
        "the Std of the shares is held as E grows with the GPUs (CV {cv_weak}), so EP's imbalance worsens "
        "with the EP degree, as §5.4 observes; t = {t_weak} replicas cover more of it than measured",
        "the Std of the shares is held as E grows with the GPUs (CV {cv_weak}); Themis replicates t = "
        "{t_weak} of 4 experts per device (DeepSeek-V3, Cluster A), a share of the load that falls as E "
        "grows, and the rest crosses more nodes"),
    "memory": (
        "replicas are charged with their parameters in every layer until backward (t = {t_mem} per layer on "
        "every device); the paper may free some earlier",
        "model states include dense parameters and embeddings ({dense_share:.0%} of EP's total here, bf16 "
        "params/grads, 12 B/param optimizer state), which dilutes the replicas' share; Themis holds t = "
        "{t_mem} replicated experts per layer, Themis-RM two layers' worth (the one in use and the one gathered "
        "ahead)"),
    "flexmoe_memory": (
        "FlexMoE's reserve is {slots} slots per layer with optimizer state, the memory fraction Fig. 12 "
        "implies",
        "FlexMoE's reserve is {slots} slots per layer with optimizer state, the memory fraction Fig. 12 "
        "implies; Themis holds more replicas here than in the paper"),
    "a2a": (
        "Themis's all-to-all is charged at its lower bound after placement removes the hot spots",
        "the all-to-all is charged at its ingress/egress lower bound: Themis keeps the tokens that the t = "
        "{t_mem} replicated experts draw on their own device, but at CV {cv:.2f} over 32 experts those carry "
        "about half the load, and the rest still crosses nodes at full cost (the 13x needs the top {t_mem} "
        "experts to carry over 90 %: a more skewed Phi-3.5-MoE, which would put its EP/Uniform above the "
        "paper's range)"),
    "plan_time": (
        "planning runs in one Python process on a shared CPU, and the simulated plans include calibration "
        "and the dispatch plan",
        "the compiled planner core is faster than the paper's implementation"),
}


def _rel(paper: float | tuple[float, float], ours: float, ceiling: bool = False) -> float:
    """Relative difference; for a range, the distance to its nearest end (0 inside). With ``ceiling``
    (a cost the paper reports, such as its planning time) anything at or below the range is 0."""
    if isinstance(paper, tuple):
        lo, hi = paper
        if ceiling:
            lo = 0.0
        return 0.0 if lo <= ours <= hi else (ours - hi) / hi if ours > hi else (ours - lo) / lo
    return (ours - paper) / paper


def paper_report(iterations: int = 20, progress: bool = False, quick: bool = False,
                 max_layers: int | None = None) -> dict[str, Any]:
    """Simulate the paper's experiments and compare with its reported figures (§5).

    ``quick`` runs two models for Fig. 9 instead of five; ``max_layers`` caps every model's MoE layers.

    Returns ``{"rows": [...], "runs": {...}, "fig9": {...}}``; each row has the metric, the paper's
    value, ours, ours/paper, the relative difference and, when it exceeds `TOLERANCE`, the modeling
    assumption responsible (``within`` says which).
    """
    models = PAPER_PRESETS if not quick else ("gpt-s-moe", "phi-3.5-moe")
    runs: dict[str, Any] = {}
    fig9: dict[str, dict[str, dict[str, float]]] = {"A": {}, "B": {}}
    plan_us: list[float] = []
    for cname in ("A", "B"):
        for model in models:
            res = run_config(model, get_cluster(cname), iterations=iterations, max_layers=max_layers,
                             progress=progress)
            fig9[cname][model] = res.speedup_over("ep")
            plan_us.append(res.policies["themis"].plan_us_median)
            runs[f"fig9/{cname}/{model}"] = res.as_dict()
    rows: list[dict[str, Any]] = []
    pending: list[tuple[dict[str, Any], str]] = []

    def row(metric: str, paper: float | tuple[float, float], ours: float, key: str, ceiling: bool = False) -> None:
        diff = _rel(paper, float(ours), ceiling)
        ref = paper if not isinstance(paper, tuple) else 0.5 * (paper[0] + paper[1])
        rows.append({"metric": metric, "paper": list(paper) if isinstance(paper, tuple) else paper,
                     "ours": round(float(ours), 3), "ours_over_paper": round(float(ours) / ref, 3),
                     "rel_diff": round(diff, 3), "within": abs(diff) <= TOLERANCE, "explanation": ""})
        if abs(diff) > TOLERANCE:
            pending.append((rows[-1], _EXPLAIN[key][0 if diff > 0 else 1]))

    for cname, paper in (("A", 2.41), ("B", 2.60)):
        row(f"Themis vs EP, average (cluster {cname})", paper,
            float(np.mean([v["themis"] for v in fig9[cname].values()])), "themis_vs_ep")
    vs_fm = [v["themis"] / v["fastermoe"] for c in fig9.values() for v in c.values()]
    row("Themis vs FasterMoE, min", 1.26, min(vs_fm), "themis_vs_fastermoe")
    row("Themis vs FasterMoE, max", 2.37, max(vs_fm), "themis_vs_fastermoe")
    ep_slow = [v["uniform"] for c in fig9.values() for v in c.values()]
    row("EP slower than Uniform, min", 1.48, min(ep_slow), "ep_vs_uniform")
    row("EP slower than Uniform, max", 2.87, max(ep_slow), "ep_vs_uniform")
    # Fig. 16b: Qwen1.5-MoE on cluster B, top-k 2 -> 5.
    lat: dict[int, dict[str, float]] = {}
    t_topk = []
    for k in (2, 5):
        res = run_config("qwen1.5-moe", get_cluster("B"), policies=("ep", "themis"), top_k=k,
                         iterations=iterations, max_layers=max_layers, progress=progress)
        lat[k] = {n: r.mean_iteration_s for n, r in res.policies.items()}
        runs[f"topk/{k}"] = res.as_dict()
        t_topk.append(res.setup.overlap_degree)
    row("top-k 2->5 latency growth, Themis", 0.212, lat[5]["themis"] / lat[2]["themis"] - 1, "topk")
    row("top-k 2->5 latency growth, EP", 0.636, lat[5]["ep"] / lat[2]["ep"] - 1, "topk")
    # Fig. 13b: weak scaling of DeepSeek-V3 on cluster A, 16 -> 64 GPUs.
    for nodes, paper in ((2, 1.48), (8, 3.35)):
        res = run_config("deepseek-v3", get_cluster("A", nodes), policies=("ep", "themis"),
                         iterations=iterations, max_layers=max_layers, progress=progress)
        runs[f"weak/{nodes * 8}"] = res.as_dict()
        row(f"weak scaling: Themis vs EP at {nodes * 8} GPUs", paper, res.speedup_over("ep")["themis"], "weak_scaling")
    # Fig. 11 / 12: Phi-3.5-MoE on cluster A.
    res = runs_phi = run_config("phi-3.5-moe", get_cluster("A"), iterations=iterations, max_layers=max_layers,
                                progress=progress)
    runs["fig11_12/phi-3.5-moe/A"] = res.as_dict()
    mem = {n: r.memory_bytes["Total"] for n, r in res.policies.items()}
    row("memory: Themis over EP", 0.356, mem["themis"] / mem["ep"] - 1, "memory")
    row("memory: Themis-RM over EP", 0.178, mem["themis-rm"] / mem["ep"] - 1, "memory")
    row("memory: FlexMoE / Themis", 3.0, mem["flexmoe"] / mem["themis"], "flexmoe_memory")
    a2a = {n: r.breakdown_s["A2A"] for n, r in res.policies.items()}
    row("Fig. 11: A2A reduction, Themis vs EP", 13.0, a2a["ep"] / max(a2a["themis"], 1e-12), "a2a")
    # A cost of this implementation on this machine, not a simulated figure: it matches when it is no
    # slower than the paper's.
    row("plan time per MoE layer, median (us)", _PLAN_US, float(np.median(plan_us)), "plan_time", ceiling=True)
    # The context the explanations cite.
    fig9_runs = [r for k, r in runs.items() if k.startswith("fig9/")]
    t_fig9 = sorted({r["setup"]["overlap_degree"] for r in fig9_runs})
    m_fig9 = sorted({r["setup"]["materialization_budget"] for r in fig9_runs})
    ctx = {"cv": PAPER_CV,
           "cv_weak": "/".join(f"{model_cv(4, 4 * n, n):.2f}" for n in (16, 64)),
           "t_fig9": f"{t_fig9[0]}-{t_fig9[-1]}" if len(t_fig9) > 1 else str(t_fig9[0]),
           "m_fig9": f"{m_fig9[0]}-{m_fig9[-1]}" if len(m_fig9) > 1 else str(m_fig9[0]),
           "t_topk": "/".join(map(str, t_topk)),
           "t_weak": "/".join(str(runs[f"weak/{n}"]["setup"]["overlap_degree"]) for n in (16, 64)),
           "t_mem": runs_phi.setup.overlap_degree, "slots": runs_phi.setup.replica_slots,
           "dense_share": runs_phi.setup.dense_params * runs_phi.setup.precision.state_bytes / mem["ep"]}
    for entry, text in pending:
        entry["explanation"] = text.format(**ctx)
    return {"rows": rows, "runs": runs, "fig9": fig9}


def weak_scaling(devices: list[int] | tuple[int, ...], *, iterations: int = 12, model: str = "deepseek-v3",
                 policies: tuple[str, ...] = ("ep", "fastermoe", "themis"), progress: bool = False,
                 max_memory_bytes: float | None = None) -> list[dict[str, Any]]:
    """Fig. 13b's weak scaling past the paper's scale: ``model`` (the paper's DeepSeek-V3, E = 4 experts
    per device; any preset whose E grows with the devices, such as Qwen1.5-MoE's 2) on Cluster A nodes of
    8 devices, with the inputs of `simulate --paper`, at each device count. One row per size: Themis's
    throughput over EP's and over FasterMoE's, t, m, the mean iteration times, and the wall and CPU
    times (the CPU time is what other jobs on a shared machine do not inflate).

    Raises ValueError for a size that is not whole nodes, or whose simulation would exceed the memory
    limit (`setup.check_simulation_size`; every size is checked before the first one runs).
    """
    sizes = [int(D) for D in devices]
    for D in sizes:
        if D < 8 or D % 8:
            raise ValueError(f"weak scaling runs whole nodes of 8 devices; got {D} devices")
        check_simulation_size(resolve_model_config(model, devices=D, cluster="A"), get_cluster("A", D // 8),
                              max_memory_bytes)
    rows = []
    for D in sizes:
        cfg = resolve_model_config(model, devices=D, cluster="A")
        started, cpu_started = time.perf_counter(), time.process_time()
        res = run_config(model, get_cluster("A", D // 8), policies=policies, iterations=iterations,
                         progress=progress, progress_label=f"{D} devices", max_memory_bytes=max_memory_bytes)
        speed = res.speedup_over("ep")
        row = {"model": cfg.name, "devices": D, "num_experts": cfg.num_experts, "num_layers": cfg.n_layers,
               "overlap_degree": res.setup.overlap_degree,
               "materialization_budget": res.setup.materialization_budget, "iterations": iterations,
               "mean_iteration_s": {n: r.mean_iteration_s for n, r in res.policies.items()},
               "themis_vs_ep": speed["themis"], "wall_s": time.perf_counter() - started,
               "cpu_s": time.process_time() - cpu_started,
               "peak_rss_bytes": _peak_rss_bytes()}
        if "fastermoe" in speed:
            row["themis_vs_fastermoe"] = speed["themis"] / speed["fastermoe"]
        rows.append(row)
    return rows


def _peak_rss_bytes() -> float:
    """The process's peak resident memory so far (NaN where `resource` is missing): with sizes run in
    ascending order, each row's is its own size's peak."""
    try:
        import resource
    except ImportError:  # not on every platform
        return math.nan
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0     # KiB on Linux


def format_weak_scaling(rows: list[dict[str, Any]]) -> str:
    model = rows[0]["model"] if rows else "deepseek-v3"
    lines = [f"Weak scaling (Fig. 13b's setup: {model}, Cluster A, experts growing with the devices)", "",
             f"{'devices':>8}{'experts':>9}{'t':>5}{'m':>6}{'EP ms':>10}{'Themis ms':>11}{'Themis/EP':>11}"
             f"{'Themis/FasterMoE':>18}{'wall s':>9}{'CPU s':>9}{'peak RSS GiB':>14}"]
    for r in rows:
        vs_fm = r.get("themis_vs_fastermoe")
        it = r["mean_iteration_s"]
        lines.append(f"{r['devices']:>8}{r['num_experts']:>9}{r['overlap_degree']:>5}{r['materialization_budget']:>6}"
                     f"{it['ep'] * 1e3:>10.1f}{it['themis'] * 1e3:>11.1f}"
                     f"{r['themis_vs_ep']:>11.2f}{'-' if vs_fm is None else f'{vs_fm:.2f}':>18}{r['wall_s']:>9.1f}"
                     f"{r.get('cpu_s', math.nan):>9.1f}"
                     f"{r.get('peak_rss_bytes', math.nan) / 2 ** 30:>14.2f}")
    return "\n".join(lines)


def format_paper_report(report: dict[str, Any]) -> str:
    lines = ["Reproduction report: simulated figures next to the paper's (§5)", "",
             f"{'metric':<44}{'paper':>11}{'ours':>9}{'ours/paper':>11}{'diff':>8}"]
    notes = []
    for r in report["rows"]:
        paper = r["paper"] if not isinstance(r["paper"], list) else "-".join(f"{v:g}" for v in r["paper"])
        mark = f" [{len(notes) + 1}]" if r["explanation"] else ""
        lines.append(f"{r['metric']:<44}{paper:>11}{r['ours']:>9.3f}{r['ours_over_paper']:>11.2f}"
                     f"{r['rel_diff'] * 100:>+7.0f}%{mark}")
        if r["explanation"]:
            notes.append(r["explanation"])
    inside = sum(r["within"] for r in report["rows"])
    lines += ["", f"{inside} of {len(report['rows'])} rows within ±{TOLERANCE:.0%} of the paper",
              "", "Throughput relative to EP (Fig. 9 shape):"]
    for cname, per_model in report["fig9"].items():
        for model, speed in per_model.items():
            lines.append(f"  {cname} {model:<13}" + " ".join(f"{n}={v:.2f}" for n, v in speed.items()))
    if notes:
        lines += ["", "Differences over 20% and the modeling assumption responsible:"]
        lines += [f"  [{i}] {text}" for i, text in enumerate(notes, 1)]
    return "\n".join(lines)
