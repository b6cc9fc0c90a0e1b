"""A small training run for the crash test (``tests/runtime/test_checkpoint.py``), launched by torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        tests/runtime/crash_train.py --dir DIR --steps 6 --every 2 [--wait-at 5]

Trains the tiny reference model under themis (re-sharding every 2 steps) on gloo, saves a DCP checkpoint
every ``--every`` steps into ``DIR/step_<n>`` and at the end into ``DIR/final``. At start it resumes from
the newest complete checkpoint (one whose ``.metadata`` DCP has written). With ``--wait-at s``, rank 1
of the first attempt stops before step s, writes its pid to ``DIR/waiting`` and waits to be killed
(bounded: it exits with an error after 120 s). Every attempt writes ``DIR/attempt<k>.rank<r>`` with the
step it started from, and ``DIR/pid<k>.rank<r>`` with its pid.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import themis_compile  # noqa: E402
from themis_compile.checkpoint import get_state_dict, set_state_dict  # noqa: E402
from tests.runtime.equivalence import _batches, make_model, make_optimizer, model_loss  # noqa: E402

MODEL = dict(name="tiny-moe", router_skew=2.0, experts_form="loop", top_k=2, num_experts=6)
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
BATCH, SEQ = 8, 16


def _newest_checkpoint(root: str) -> int:
    steps = [int(n.split("_")[1]) for n in os.listdir(root)
             if n.startswith("step_") and os.path.exists(os.path.join(root, n, ".metadata"))]
    return max(steps, default=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--wait-at", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.path.join(args.dir, f"pid{attempt}.rank{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))     # so that the test can stop a worker torchrun left behind
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()

    model = themis_compile.optimize(make_model(MODEL), themis_compile.ThemisConfig(
        policy="themis", reshard_interval=2, overlap_degree=8, materialization_budget=2))
    opt = make_optimizer(model.parameters(), "adamw")
    # Every rank must resume from the same checkpoint: rank 0 decides.
    start = [_newest_checkpoint(args.dir) if rank == 0 else None]
    dist.broadcast_object_list(start, src=0)
    start = start[0]
    if start:
        model_sd, optim_sd = get_state_dict(model, opt, options=OPTIONS)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(args.dir, f"step_{start}"))
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=OPTIONS)
    with open(os.path.join(args.dir, f"attempt{attempt}.rank{rank}"), "w") as f:
        f.write(str(start))

    local = BATCH // world
    for step, tokens in enumerate(_batches(args.steps, BATCH, SEQ, model.config.vocab_size)):
        if step < start:
            continue
        if step == args.wait_at and attempt == 0 and rank == 1:
            with open(os.path.join(args.dir, "waiting.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(args.dir, "waiting.tmp"), os.path.join(args.dir, "waiting"))
            time.sleep(120)
            raise SystemExit("crash_train: rank 1 was not killed")
        model_loss(model, tokens[rank * local:(rank + 1) * local]).backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            model_sd, optim_sd = get_state_dict(model, opt, options=OPTIONS)
            name = "final" if step + 1 == args.steps else f"step_{step + 1}"
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(args.dir, name))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
