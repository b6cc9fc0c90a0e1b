"""``themis-compile inspect MODEL``: what Themis will do with a model before any GPU hour is spent.

For every MoE layer: Ψ, T_attn (profiled when ``--profile`` gives it, else modeled from FLOPs), the
bandwidth that binds, the overlap degree t = ⌊T_attn·bw/Ψ⌋, the materialization budget m (with and
without re-materialization), and — for a sample plan P' that the planner draws from a synthetic skewed
load — the predicted SpAG/SpRS time against the attention window and the time left exposed.

``--png FILE`` draws the shard placement P and the sample plan P' as device × expert heat maps (tokens
each device computes for each expert under Alg. 3); ``--json`` prints the same numbers for machines;
``--symbolic`` prints the cost formulas (sympy) and the smallest sequence length / batch at which t
experts fit the window.

Legend: E experts, D devices, L MoE layers.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from themis_compile.cost_model import analytic
from themis_compile.cost_model.cluster import get_cluster
from themis_compile.sim.report import agg_pyplot
from themis_compile.sim.setup import (
    ATTENTION_EFFICIENCY,
    SimSetup,
    attention_shape,
    build_setup,
    read_profile,
    resolve_model_config,
)
from themis_compile.sim.traces import PAPER_CV, model_cv, synthetic_trace
from themis_compile.cost_model.volume import sparse_all_gather_volume
from themis_compile.planner import Placement, sparse_materialization
from themis_compile.planner.dispatch import dispatch_expert_load
from themis_compile.planner.cost import sparse_transfer_time

logger = logging.getLogger(__name__)

__all__ = ["inspect_model", "sample_plan", "symbolic_report", "plot_plan", "main"]


def sample_plan(setup: SimSetup, *, cv: float = PAPER_CV, seed: int = 0, rematerialize: bool = False,
                overlap_degree: int | None = None) -> tuple[Placement, Placement, np.ndarray, np.ndarray]:
    """(P, P', tokens_ED, load_ED) for one layer: EP's shard placement, Alg. 1 on a synthetic skewed load
    with the setup's t (or ``overlap_degree``) and m, and the tokens each device computes for each expert
    under Alg. 3's dispatch plan (``R.sum(axis=1)``, from the sparse `dispatch_expert_load`)."""
    cfg, topo = setup.model, setup.topology()
    trace = synthetic_trace(1, cfg.num_experts, setup.num_devices, setup.tokens_per_device, cfg.top_k, 1,
                            cv=cv, seed=seed)
    tokens_ED = trace.records[0].tokens_ED(setup.num_devices)
    shard = Placement.contiguous(cfg.num_experts, setup.num_devices)
    m = setup.materialization_budget_rm if rematerialize else setup.materialization_budget
    t = setup.overlap_degree if overlap_degree is None else int(overlap_degree)
    placement = sparse_materialization(shard, tokens_ED.sum(axis=1), t, m, topo)                       # Alg. 1
    load_ED = dispatch_expert_load(placement, tokens_ED, topo)                                         # Alg. 3
    return shard, placement, tokens_ED, load_ED


def inspect_model(setup: SimSetup, *, profile: dict[str, Any] | None = None, cv: float = PAPER_CV,
                  seed: int = 0) -> dict[str, Any]:
    """The per-layer cost-model report (see the module docstring) as a JSON-friendly dict."""
    cfg, cluster, topo = setup.model, setup.cluster, setup.topology()
    t_by_layer = {int(k): float(v) for k, v in ((profile or {}).get("t_attn_fwd_s") or {}).items()}
    bw_key = "bw_inter" if cluster.num_nodes > 1 else "bw_intra"
    bw = float((profile or {}).get(bw_key, cluster.window_bw))
    bw_source = "profiled" if profile and bw_key in profile else "modeled"
    grad_psi = setup.expert_params * setup.precision.grad_bytes
    modeled_t_attn = analytic.attention_time(cfg, setup.batch, cluster.peak_flops, ATTENTION_EFFICIENCY,
                                            attention_shape(cfg))
    plans: dict[int, tuple[float, float]] = {}
    layers = []
    for layer in range(cfg.n_layers):
        t_attn = t_by_layer.get(layer, modeled_t_attn)
        t = analytic.overlap_degree(t_attn, bw, setup.psi)
        if t not in plans:   # one sample plan per distinct t (layers of one model share shapes)
            shard, placement, _, _ = sample_plan(setup, cv=cv, seed=seed, overlap_degree=t)
            plans[t] = (sparse_transfer_time(shard, placement, setup.psi, topo),
                        sparse_transfer_time(shard, placement, grad_psi, topo))
        spag_s, sprs_s = plans[t]
        layers.append({
            "layer": layer, "psi_bytes": setup.psi,
            "t_attn_s": t_attn, "t_attn_source": "profiled" if layer in t_by_layer else "modeled",
            "bw": bw, "bw_source": bw_source, "overlap_degree": t,
            "materialization_budget": setup.materialization_budget,
            "materialization_budget_rm": setup.materialization_budget_rm,
            "spag_s": spag_s, "spag_exposed_s": max(0.0, spag_s - t_attn),
            "sprs_s": sprs_s, "sprs_window_s": 2.0 * t_attn, "sprs_exposed_s": max(0.0, sprs_s - 2.0 * t_attn),
            "sprs_remat_exposed_s": max(0.0, sprs_s + spag_s - 2.0 * t_attn),
        })
    shard, placement, tokens_ED, load_ED = sample_plan(setup, cv=cv, seed=seed)
    vol = sparse_all_gather_volume(shard, placement, int(setup.psi), topo)
    load_D = load_ED.sum(axis=0)
    ep_load_D = np.bincount(shard.owners(), weights=tokens_ED.sum(axis=1), minlength=setup.num_devices)
    return {
        "model": cfg.name, "cluster": cluster.name, "num_nodes": cluster.num_nodes,
        "devices_per_node": cluster.devices_per_node, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
        "batch": setup.batch, "seq_len": cfg.seq_len, "memory_budget_bytes": setup.memory_budget_bytes,
        "layers": layers,
        "sample_plan": {
            "cv": cv, "added_replicas": placement.num_pairs() - shard.num_pairs(),
            "replicated_experts": int((placement.copies() > 1).sum()),
            "spag_bytes": vol.total_bytes, "spag_inter_node_bytes": vol.inter_node_bytes,
            "max_over_mean_load_ep": float(ep_load_D.max() / max(ep_load_D.mean(), 1e-12)),
            "max_over_mean_load_themis": float(load_D.max() / max(load_D.mean(), 1e-12)),
        },
    }


def symbolic_report(setup: SimSetup, t_target: int | None = None) -> dict[str, Any]:
    """The sympy formulas and, for ``t_target`` experts (default max(t, 1)), the minimum seq_len and
    batch at which they fit the window with this model and cluster."""
    model = analytic.symbolic_cost_model()
    values = {"d_model": setup.model.d_model, "d_ffn": setup.model.d_ffn, "bw": setup.cluster.window_bw,
              "attn_throughput": setup.cluster.peak_flops * ATTENTION_EFFICIENCY,
              "n_mats": analytic.expert_matrices(setup.model),
              "param_bytes": setup.precision.param_bytes}
    t_target = max(setup.overlap_degree, 1) if t_target is None else int(t_target)
    min_seq = analytic.min_seq_len_for(t_target, batch=setup.batch, **values)
    min_batch = analytic.min_batch_for(t_target, seq_len=setup.model.seq_len, **values)
    return {"psi": str(model["psi"]), "t_attn": str(model["t_attn"]),
            "overlap_degree": str(model["overlap_degree"]), "t_target": t_target,
            "min_seq_len": min_seq, "min_batch": min_batch, "values": values,
            "at_batch": setup.batch, "at_seq_len": setup.model.seq_len}


def plot_plan(setup: SimSetup, path: str | Path, *, cv: float = PAPER_CV, seed: int = 0) -> Path:
    """PNG heat maps (device × expert): the shard placement P under EP's dispatch and the sample plan P'
    under Alg. 3 — colour is the tokens a device computes for an expert, dots mark added replicas."""
    plt = agg_pyplot()
    shard, placement, tokens_ED, th_ED = sample_plan(setup, cv=cv, seed=seed)
    topo = setup.topology()
    ep_ED = dispatch_expert_load(shard, tokens_ED, topo)
    vmax = max(ep_ED.max(), th_ED.max(), 1)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, comp_ED, title in ((axes[0], ep_ED, "shard placement P (EP)"),
                               (axes[1], th_ED, f"sample plan P' (t={setup.overlap_degree}, "
                                                f"m={setup.materialization_budget})")):
        im = ax.imshow(comp_ED.T, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_xlabel("expert")
        ax.set_title(title, fontsize=9)
        for n in range(1, topo.num_nodes):
            ax.axhline(topo.node_offsets[n] - 0.5, color="w", lw=0.6)
    added_ED = placement.mask & ~shard.mask
    e_idx, d_idx = np.nonzero(added_ED)
    axes[1].scatter(e_idx, d_idx, s=6, c="red", marker="o", label="added replica")
    axes[1].legend(fontsize=7, loc="upper right")
    axes[0].set_ylabel("device")
    fig.colorbar(im, ax=axes, label="tokens computed")
    fig.suptitle(f"{setup.model.name}: cluster {setup.cluster.name}, {setup.num_devices} GPUs, CV {cv:.2f}",
                 fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _format(report: dict[str, Any], symbolic: dict[str, Any] | None) -> str:
    lines = [f"{report['model']} on cluster {report['cluster']} ({report['num_nodes']} x {report['devices_per_node']} "
             f"GPUs), E={report['num_experts']} top-{report['top_k']}, batch {report['batch']} x {report['seq_len']}",
             "", f"{'layer':>5}{'Psi MB':>9}{'T_attn ms':>11}{'bw GB/s':>9}{'t':>4}{'m':>5}{'m_rm':>6}"
             f"{'SpAG ms':>9}{'exposed':>9}{'SpRS ms':>9}{'exposed':>9}"]
    for row in report["layers"]:
        src = "*" if row["t_attn_source"] == "profiled" else " "
        lines.append(f"{row['layer']:>5}{row['psi_bytes'] / 1e6:>9.2f}{row['t_attn_s'] * 1e3:>10.3f}{src}"
                     f"{row['bw'] / 1e9:>9.1f}{row['overlap_degree']:>4}{row['materialization_budget']:>5}"
                     f"{row['materialization_budget_rm']:>6}{row['spag_s'] * 1e3:>9.3f}"
                     f"{row['spag_exposed_s'] * 1e3:>9.3f}{row['sprs_s'] * 1e3:>9.3f}"
                     f"{row['sprs_exposed_s'] * 1e3:>9.3f}")
    sp = report["sample_plan"]
    lines += ["", "(* profiled T_attn)  SpAG window: attention forward; SpRS window: attention backward (2x)",
              f"sample plan at CV {sp['cv']:.2f}: {sp['added_replicas']} added replicas of "
              f"{sp['replicated_experts']} experts, {sp['spag_bytes'] / 1e6:.1f} MB SpAG "
              f"({sp['spag_inter_node_bytes'] / 1e6:.1f} MB inter-node); max/mean device load "
              f"EP {sp['max_over_mean_load_ep']:.2f} -> Themis {sp['max_over_mean_load_themis']:.2f}"]
    if symbolic:
        lines += ["", "cost formulas (§3.3, §4.2):", f"  Psi    = {symbolic['psi']}",
                  f"  T_attn = {symbolic['t_attn']}", f"  t      = {symbolic['overlap_degree']}",
                  f"  {symbolic['t_target']} experts fit the window from seq_len >= {symbolic['min_seq_len']} "
                  f"(at batch {symbolic['at_batch']}) or batch >= {symbolic['min_batch']} "
                  f"(at seq_len {symbolic['at_seq_len']})"]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="themis-compile inspect", description="The cost model of a model's MoE layers.")
    p.add_argument("model", help="preset name or package.module:factory")
    p.add_argument("--cluster", default="A", help="A, B, or a .toml/.json cluster file")
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--devices-per-node", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="sequences per device")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--memory-budget-gb", type=float, default=None)
    p.add_argument("--profile", default=None, help="profile JSON: t_attn_fwd_s per layer, bw_intra, bw_inter, psi")
    p.add_argument("--cv", type=float, default=None,
                   help="CV of the sample plan's synthetic expert shares (default: the model's, traces.model_cv)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default=None, help="write the device x expert heat maps here")
    p.add_argument("--json", action="store_true")
    p.add_argument("--symbolic", action="store_true", help="print the formulas and the minimum seq_len / batch")
    p.add_argument("--t", type=int, default=None, help="with --symbolic: the number of experts to fit")
    return p


def main(argv: list[str] | None = None) -> None:
    """``themis-compile inspect MODEL ...`` (see ``--help``)."""
    args = _parser().parse_args(argv)
    try:
        cluster = get_cluster(args.cluster, args.nodes)
        if args.devices_per_node is not None:
            cluster = cluster.replace(devices_per_node=args.devices_per_node)
        cfg = resolve_model_config(args.model, devices=cluster.num_devices, cluster=cluster.name, seq_len=args.seq_len)
        profile = read_profile(args.profile) if args.profile else None
        setup = build_setup(cfg, cluster, batch=args.batch, profile=profile,
                            memory_budget_bytes=None if args.memory_budget_gb is None else args.memory_budget_gb * 1e9)
        cfg = setup.model
        cv = args.cv if args.cv is not None else model_cv(cfg.experts_per_device, cfg.num_experts, setup.num_devices)
        report = inspect_model(setup, profile=profile, cv=cv, seed=args.seed)
        symbolic = symbolic_report(setup, args.t) if args.symbolic else None
        if args.png:
            report["png"] = str(plot_plan(setup, args.png, cv=cv, seed=args.seed))
    except ValueError as exc:
        raise SystemExit(f"themis-compile inspect: {exc}") from exc
    if symbolic:
        report["symbolic"] = symbolic
    if args.json:
        print(json.dumps(report, indent=2, default=float))
    else:
        print(_format(report, symbolic))
        if args.png:
            print(f"\nheat map: {report['png']}")


if __name__ == "__main__":
    main()
