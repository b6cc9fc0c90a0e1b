"""Train an MoE language model with themis_compile: a complete torchrun training script.

    torchrun --standalone --nproc-per-node 2 examples/train.py --model tiny --policy themis --steps 200
    torchrun --standalone --nproc-per-node 2 examples/train.py --model mixtral --bf16 --clip 1.0 \\
        --ckpt-dir runs/ckpt --ckpt-every 50          # ... and after a crash, the same line with --resume

The model is the project's reference GPT-MoE (``--model tiny``: ``build_model("tiny-moe")``) or a tiny
Hugging Face Mixtral / Qwen3-MoE with a random configuration (``--model mixtral|qwen3-moe``; nothing is
downloaded), trained on the bytes of the Python standard library's sources. Every rank builds the same
model, ``themis_compile.optimize`` shards the experts and makes the rest data-parallel, and the loop
below is an ordinary PyTorch loop: AdamW, linear warmup then cosine decay of the learning rate, optional
bf16 autocast and gradient clipping, a checkpoint every k steps. Rank 0 shows a progress bar with the
global loss, tokens per second and, under themis / themis-rm, the expert load imbalance of the last MoE
layer (max / mean rows computed per rank; 1.0 is perfect balance).

Shape suffixes: B batch, S sequence.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time

import torch
import torch.distributed as dist

import themis_compile
from themis_compile.api import runtime_of
from themis_compile.models import build_model, lm_loss
from themis_compile.models.data import build_corpus, sample_batch

VOCAB = 256       # byte-level tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=("tiny", "mixtral", "qwen3-moe"))
    p.add_argument("--policy", default="themis", help="ThemisConfig policy: themis, themis-rm, ep, uniform")
    p.add_argument("--dense-parallel", default="fsdp2", choices=("fsdp2", "ddp"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=10, help="linear warmup steps before the cosine decay")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the forward pass")
    p.add_argument("--clip", type=float, default=0.0, help="clip the global gradient norm to this (0: off)")
    p.add_argument("--reshard-interval", type=int, default=100, help="re-shard experts every k steps (Alg. 2)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-dir", default=None, help="directory of torch.distributed.checkpoint checkpoints")
    p.add_argument("--ckpt-every", type=int, default=0, help="save a checkpoint every k steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    return args


# ------------------------------------------------------------------------------------------- model
def make_model(name: str, seq_len: int) -> torch.nn.Module:
    if name == "tiny":
        return build_model("tiny-moe", router_skew=1.0, seq_len=seq_len, vocab_size=VOCAB)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=max(seq_len, 64), num_experts_per_tok=2)
    if name == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(intermediate_size=128, num_local_experts=8, **common))
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                                              decoder_sparse_step=1, mlp_only_layers=[], head_dim=16, **common))


def model_loss(model: torch.nn.Module, tokens_BS: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "aux_loss"):      # the reference model: next-token loss + its load-balancing loss
        return lm_loss(model(tokens_BS), tokens_BS) + model.aux_loss()
    return model(input_ids=tokens_BS, labels=tokens_BS).loss


def cosine_schedule(optimizer: torch.optim.Optimizer, warmup: int, steps: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(steps - warmup, 1), 1.0)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    # torch.nn.utils.clip_grad_norm_ cannot be used on an optimized model: it raises on FSDP2's DTensor
    # gradients and, under DDP, each rank would see only the gradients of the experts it owns. The drop-in
    # takes the global norm over dense and expert gradients, the same on every rank.
    return themis_compile.clip_grad_norm_(model, max_norm)


# ------------------------------------------------------------------------------------------- checkpoints
# One function pair: torch.distributed.checkpoint with themis_compile.checkpoint's get_state_dict /
# set_state_dict (torch's signatures; they add the stacked experts' optimizer state and the runtime's own
# state for an exact resume, see docs/checkpoint.md). The checkpoint holds the unmodified model's keys, so
# it loads at any world size or policy; this script only names the directory and the step.
def save_checkpoint(ckpt_dir: str, step: int, model, optimizer, scheduler) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from themis_compile.checkpoint import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    path = os.path.join(ckpt_dir, f"step-{step:08d}")
    dcp.save({"model": model_sd, "optim": optim_sd, "train": {"step": step, "scheduler": scheduler.state_dict()}},
             checkpoint_id=path)
    return path


def load_checkpoint(ckpt_dir: str, model, optimizer, scheduler) -> int:
    """Load the latest complete checkpoint of ``ckpt_dir``; returns the number of steps it had done."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from themis_compile.checkpoint import get_state_dict, set_state_dict

    path = latest_checkpoint(ckpt_dir)
    if path is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint in {ckpt_dir!r}")
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd, "train": {"step": 0, "scheduler": scheduler.state_dict()}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    scheduler.load_state_dict(state["train"]["scheduler"])
    return int(state["train"]["step"])


def latest_checkpoint(ckpt_dir: str) -> str | None:
    # dcp.save writes .metadata last: a directory without it is a checkpoint that did not finish.
    done = [d for d in os.listdir(ckpt_dir) if re.fullmatch(r"step-\d+", d)
            and os.path.exists(os.path.join(ckpt_dir, d, ".metadata"))] if os.path.isdir(ckpt_dir) else []
    return os.path.join(ckpt_dir, max(done)) if done else None


# ------------------------------------------------------------------------------------------- loop
class Progress:
    """Rank 0's progress display: a tqdm bar when tqdm is installed, log lines otherwise."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self.bar = None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass

    def update(self, step: int, metrics: dict[str, str], log: bool) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(metrics, refresh=False)
            if log:
                self.bar.write(f"step {step:5d}  " + "  ".join(f"{k} {v}" for k, v in metrics.items()))
        elif self.enabled and log:
            print(f"step {step:5d}  " + "  ".join(f"{k} {v}" for k, v in metrics.items()), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    corpus = build_corpus(1 << 20)                       # the same bytes on every rank

    torch.manual_seed(args.seed)                         # the same model on every rank
    model = make_model(args.model, args.seq_len).to(device)
    config = themis_compile.ThemisConfig(policy=args.policy, dense_parallel=args.dense_parallel,
                                         reshard_interval=args.reshard_interval)
    model = themis_compile.optimize(model, config)
    runtime = runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = cosine_schedule(optimizer, args.warmup, args.steps, args.min_lr_ratio)
    start = load_checkpoint(args.ckpt_dir, model, optimizer, scheduler) if args.resume else 0
    if rank == 0:
        print(themis_compile.explain(model), file=sys.stderr, flush=True)

    progress = Progress(args.steps, start, enabled=rank == 0)
    tokens_per_step = args.batch * world * args.seq_len
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        tokens_BS = torch.from_numpy(sample_batch(corpus, step, args.batch * world, args.seq_len, seed=args.seed))
        tokens_BS = tokens_BS[rank * args.batch:(rank + 1) * args.batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = model_loss(model, tokens_BS)
        loss.backward()
        grad_norm = clip_gradients(model, args.clip) if args.clip > 0 else None
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

        global_loss = loss.detach().float().clone()
        dist.all_reduce(global_loss)                     # mean over ranks = loss of the global batch
        global_loss /= world
        metrics = {"loss": f"{global_loss.item():.4f}", "lr": f"{lr:.2e}",
                   "tok/s": f"{tokens_per_step / (time.perf_counter() - t0):,.0f}"}
        if runtime.stats:
            metrics["imbalance"] = f"{runtime.stats[-1].imbalance:.2f}"
        if grad_norm is not None:
            metrics["grad_norm"] = f"{float(grad_norm):.3f}"
        done = step + 1
        progress.update(done, metrics, log=done % args.log_every == 0 or done == args.steps)
        if args.ckpt_dir and ((args.ckpt_every and done % args.ckpt_every == 0) or done == args.steps):
            save_checkpoint(args.ckpt_dir, done, model, optimizer, scheduler)
    progress.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
