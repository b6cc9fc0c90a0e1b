"""Train a tiny GPT-MoE on the Python standard library's sources with themis_compile: an ordinary loop.

    torchrun --standalone --nproc-per-node 2 examples/train_stdlib.py --policy themis --steps 100

Each rank trains on its slice of every global batch; ``themis_compile.optimize`` shards the experts and
balances their load every step. Rank 0 prints its loss and, under themis / themis-rm, the replicas the
runtime materialized (|ΔP|) and the per-device load imbalance of the last step. ``make demo``
(``demo/``) is the fuller version of this script: policies side by side, traces, plots.

Shape suffixes: B batch, S sequence.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import themis_compile
from themis_compile.api import runtime_of
from themis_compile.models import build_model, lm_loss
from themis_compile.models.data import build_corpus, sample_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="themis", help="ThemisConfig policy (themis, themis-rm, ep, uniform)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = build_corpus(1 << 20)                       # the same bytes on every rank

    torch.manual_seed(0)                                 # the same model on every rank
    model = build_model("tiny-moe", router_skew=1.0, seq_len=args.seq_len)
    model = themis_compile.optimize(model, themis_compile.ThemisConfig(policy=args.policy))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    runtime = runtime_of(model)

    for step in range(args.steps):
        tokens_BS = torch.from_numpy(sample_batch(corpus, step, args.batch * world, args.seq_len))
        tokens_BS = tokens_BS[rank * args.batch:(rank + 1) * args.batch]
        loss = lm_loss(model(tokens_BS), tokens_BS) + model.aux_loss()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            line = f"step {step:4d}  loss {loss.item():.4f}"
            last = runtime.stats[-len(runtime.layers):] if runtime.stats else []
            if last:
                line += "  |dP| " + "/".join(str(s.delta_p) for s in last)
                line += "  device imbalance " + "/".join(f"{s.imbalance:.2f}" for s in last)
            print(line, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
