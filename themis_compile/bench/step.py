"""Training-step benchmark: the same model and skewed data under ep, themis, themis-rm and uniform.

    torchrun --nproc-per-node 2 -m themis_compile.bench step          # or without torchrun: it relaunches

Every policy trains an identical model (same seed, same batches) for ``--warmup`` + ``--steps`` steps;
the JSON reports per policy the median step time, tokens/s, load imbalance (max/mean rows computed per
rank), |ΔP| per layer and, per rank, the bytes of parameters, gradients, optimizer state and replica
buffers. Ratios are measured side by side in one run (the machines are shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

POLICIES = ("ep", "themis", "themis-rm", "uniform")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m themis_compile.bench step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--nproc", type=int, default=2, help="ranks when launched without torchrun")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=6,
                   help="untimed steps; they include the cost-model profiling (1 + 3 steps)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--skew", type=float, default=4.0, help="router_skew of the reference model")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    p.add_argument("--out", default=None, help="also write the JSON here (rank 0)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.d_model, args.d_ffn, args.batch, args.seq_len = 2, 1, 32, 64, 2, 16
    return args


def _tensor_bytes(tensors) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors if t is not None))


class _PolicyRun:
    """One policy's model, optimizer and measurements; steps of all policies are interleaved so that a
    shared, noisy machine loads them alike."""

    def __init__(self, policy: str, args: argparse.Namespace, rank: int, world: int) -> None:
        import torch

        import themis_compile
        from themis_compile.api import runtime_of
        from themis_compile.models import build_model

        self.policy, self.args, self.rank, self.world = policy, args, rank, world
        torch.manual_seed(0)
        model = build_model("tiny-moe", d_model=args.d_model, d_ffn=args.d_ffn, num_experts=args.experts,
                            top_k=args.top_k, n_layers=args.layers, seq_len=args.seq_len,
                            router_skew=args.skew, n_heads=4)
        self.model = themis_compile.optimize(model, themis_compile.ThemisConfig(policy=policy))
        self.runtime = runtime_of(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(1)
        self.times: list[float] = []
        self.imbalance: list[float] = []
        self.delta: list[int] = []
        self.replica_bytes = 0

    def step(self, step: int, timed: bool) -> None:
        import torch
        import torch.distributed as dist

        from themis_compile.models import lm_loss

        args, rank, world = self.args, self.rank, self.world
        tokens = torch.randint(0, 256, (args.batch * world, args.seq_len), generator=self.gen)[rank::world]
        dist.barrier()
        t0 = time.perf_counter()
        loss = lm_loss(self.model(tokens), tokens) + self.model.aux_loss()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        dist.barrier()
        if timed:
            self.times.append(time.perf_counter() - t0)
            for s in self.runtime.stats:
                if s.iteration == step:
                    self.delta.append(s.delta_p)
                    self.imbalance.append(s.imbalance)
                    held = sum(1 for row in s.placement if row[rank])
                    layer = self.runtime.layers[s.layer]
                    self.replica_bytes = max(self.replica_bytes, (held - len(layer.owned_experts())) * layer.bank.chunk_bytes)

    def result(self) -> dict:
        import torch

        args, world = self.args, self.world
        imbalance = list(self.imbalance)
        if not imbalance:   # EP / uniform: rows per rank follow the owners
            for layer, m in zip(self.runtime.layers.values(), self.model.moe_layers()):
                per_rank = torch.zeros(world, dtype=torch.int64).index_add_(0, layer.owner_E, m.last_tokens_per_expert)
                imbalance.append(float(per_rank.max()) / max(float(per_rank.float().mean()), 1.0))
        params = list(self.model.parameters())
        state = [v for st in self.opt.state.values() for v in st.values() if torch.is_tensor(v)]
        replica_bytes = self.replica_bytes
        if self.runtime.fssdp is not None and not self.runtime.config.rematerialize:
            # Themis keeps every layer's replicas alive until that layer's backward: all layers at once.
            replica_bytes *= len(self.runtime.layers)
        med = statistics.median(self.times)
        return {
            "step_time_s": med,
            "tokens_per_s": args.batch * world * args.seq_len / med,
            "imbalance_max_over_mean": statistics.mean(imbalance) if imbalance else 1.0,
            "mean_delta_p_per_layer": statistics.mean(self.delta) if self.delta else 0.0,
            "memory_bytes": {
                "parameters": _tensor_bytes(params),
                "gradients": _tensor_bytes(params),     # one gradient per parameter (freed after the step)
                "optimizer_state": _tensor_bytes(state),
                "replica_buffers_peak": replica_bytes,
            },
        }


def _worker(args: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = [_PolicyRun(policy, args, rank, world) for policy in args.policies.split(",")]
    for step in range(args.warmup + args.steps):
        for run in runs:
            run.step(step, timed=step >= args.warmup)
    results = {run.policy: run.result() for run in runs}
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, results)
    dist.destroy_process_group()
    if rank != 0:
        return None
    out = {"benchmark": "step", "world_size": world, "config": {k: v for k, v in vars(args).items()}, "policies": {}}
    for policy in results:
        r0 = per_rank[0][policy]
        mem = [pr[policy]["memory_bytes"] for pr in per_rank]
        out["policies"][policy] = {
            "step_time_s": max(pr[policy]["step_time_s"] for pr in per_rank),
            "tokens_per_s": r0["tokens_per_s"],
            "imbalance_max_over_mean": r0["imbalance_max_over_mean"],
            "mean_delta_p_per_layer": r0["mean_delta_p_per_layer"],
            "memory_bytes_per_rank": mem,
            "model_state_bytes_max_rank": max(m["parameters"] + m["gradients"] + m["optimizer_state"]
                                              + m["replica_buffers_peak"] for m in mem),
        }
    pol = out["policies"]
    if "ep" in pol:
        ep = pol["ep"]
        out["ratios"] = {
            f"{p}_speedup_over_ep": ep["step_time_s"] / v["step_time_s"] for p, v in pol.items() if p != "ep"}
        if "uniform" in pol:
            out["ratios"]["ep_over_uniform"] = ep["step_time_s"] / pol["uniform"]["step_time_s"]
            for p in ("themis", "themis-rm"):
                if p in pol:
                    out["ratios"][f"{p}_over_uniform"] = pol[p]["step_time_s"] / pol["uniform"]["step_time_s"]
        for p in ("themis", "themis-rm"):
            if p in pol:
                out["ratios"][f"{p}_memory_over_ep"] = (pol[p]["model_state_bytes_max_rank"]
                                                        / ep["model_state_bytes_max_rank"])
    return out


def main(argv: list[str] | None = None) -> dict | None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if "RANK" not in os.environ:
        # Not under torchrun: launch ourselves with it and relay rank 0's JSON.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "themis_compile.bench", "step", *(sys.argv[1:] if argv is None else argv)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"benchmark ranks failed:\n{proc.stderr[-4000:]}")
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
        print(line)
        return json.loads(line)
    out = _worker(args)
    if out is not None:
        text = json.dumps(out)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    return out


if __name__ == "__main__":
    main()
