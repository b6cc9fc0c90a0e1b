"""Train an MoE language model with themis_compile: a complete torchrun training script.

    torchrun --standalone --nproc-per-node 2 examples/train.py --model tiny --policy themis --steps 200
    torchrun --standalone --nproc-per-node 2 examples/train.py --model mixtral --bf16 --clip 1.0 \\
        --ckpt-dir runs/ckpt --ckpt-every 50          # ... and after a crash, the same line with --resume
    torchrun --standalone --nproc-per-node 8 --max-restarts 3 examples/train.py \\
        --model path/to/hf-model --data path/to/texts --resume auto --ckpt-dir runs/ckpt --ckpt-every 100 \\
        --export-dir runs/export                      # starts, continues after a crash, writes the HF model

The model (``--model``) is the project's reference GPT-MoE (``tiny``: ``build_model("tiny-moe")``), a tiny
Hugging Face Mixtral / Qwen3-MoE with a random configuration (``mixtral``, ``qwen3-moe``), or your own
Hugging Face model: a local model directory (its weights are loaded when it has them, otherwise the model
is initialised at random from its ``config.json``) or a ``config.json`` file (random init). Nothing is
downloaded. The data (``--data``) is a text file, a directory of text files (every file under it, in path
order) or a dataset saved with ``datasets``' ``save_to_disk`` (its ``text`` column; needs the ``datasets``
package), default the Python standard library's sources. Text is tokenized with the model directory's
tokenizer when it has one and as UTF-8 bytes otherwise (the built-in models are byte-level); documents
are joined by the tokenizer's end-of-sequence token (a newline byte without a tokenizer).

Every rank builds the same model, ``themis_compile.optimize`` shards the experts and makes the rest
data-parallel, and the loop below is an ordinary PyTorch loop: AdamW, linear warmup then cosine decay of
the learning rate, optional bf16 autocast and gradient clipping, a checkpoint every k steps. Rank 0 shows
a progress bar with the global loss, tokens per second and, under themis / themis-rm, the expert load
imbalance of the last MoE layer (max / mean rows computed per rank; 1.0 is perfect balance).

``--resume auto`` continues from the latest complete checkpoint of ``--ckpt-dir`` when there is one and
starts from scratch otherwise, so that one ``torchrun --max-restarts k`` command both starts a run and
continues it after a rank fails (``--resume`` alone requires a checkpoint). To try that path, set
``TRAIN_EXAMPLE_CRASH_AT_STEP=k``: the last rank of the first attempt exits after k steps (a test hook).
``--collective-timeout`` bounds every collective (the process group's and themis's own). ``--export-dir``
writes the trained model as a Hugging Face checkpoint (safetensors, ``from_pretrained`` loads it) at the
end, with the tokenizer when there is one.

Shape suffixes: B batch, S sequence.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

import torch
import torch.distributed as dist

import themis_compile
from themis_compile.api import runtime_of
from themis_compile.checkpoint import save_pretrained
from themis_compile.models import build_model, lm_loss
from themis_compile.models.data import build_corpus, sample_batch

VOCAB = 256       # byte-level tokens
BUILTIN_MODELS = ("tiny", "mixtral", "qwen3-moe")
CRASH_ENV = "TRAIN_EXAMPLE_CRASH_AT_STEP"
# Files of a Hugging Face model directory: weights, tokenizer; and of a dataset saved by `save_to_disk`.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny",
                   help="tiny, mixtral, qwen3-moe, or a local Hugging Face model directory or config.json")
    p.add_argument("--data", default=None,
                   help="a text file, a directory of text files or a saved HF dataset (default: stdlib sources)")
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
    p.add_argument("--resume", nargs="?", const="latest", choices=("latest", "auto"), default=None,
                   help="continue from the latest checkpoint in --ckpt-dir (`--resume`: one must exist; "
                        "`--resume auto`: start from scratch when there is none)")
    p.add_argument("--collective-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="deadline of every collective: the process group's and themis_compile's")
    p.add_argument("--export-dir", default=None, help="write the trained model as a Hugging Face checkpoint here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.resume and not args.ckpt_dir:
        p.error("--resume needs --ckpt-dir")
    if args.model not in BUILTIN_MODELS and not os.path.exists(args.model):
        p.error(f"--model {args.model!r} is neither one of {', '.join(BUILTIN_MODELS)} nor an existing "
                "model directory or config.json")
    if args.data is not None and not os.path.exists(args.data):
        p.error(f"--data {args.data!r} does not exist")
    if args.collective_timeout <= 0:
        p.error("--collective-timeout must be > 0 seconds")
    return args


# ------------------------------------------------------------------------------------------- model
def make_model(name: str, seq_len: int) -> torch.nn.Module:
    """One of the built-in models (byte-level, random init)."""
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


def load_model(spec: str, seq_len: int):
    """``(model, tokenizer or None, description)`` for ``--model``: a built-in name, a Hugging Face model
    directory (weights loaded when it has them, else random init from its config) or a ``config.json``
    (random init). Random initialisation draws from torch's global generator: seed it first, the same on
    every rank. Only local files are read."""
    if spec in BUILTIN_MODELS:
        return make_model(spec, seq_len), None, spec
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(spec)
    directory = path.parent if path.is_file() else path
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {spec!r}: a model directory needs a config.json")
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    has_weights = path.is_dir() and any((path / f).is_file() for f in WEIGHT_FILES)
    if has_weights:
        # float32 parameters whatever the checkpoint's dtype: the optimizer's master weights (--bf16 autocasts).
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = None
    if any((directory / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    how = "weights loaded" if has_weights else "random init from its config"
    return model, tokenizer, f"{type(model).__name__} from {spec} ({how})"


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


# ------------------------------------------------------------------------------------------- data
def load_documents(data: str | None) -> tuple[list[str], str]:
    """The documents of ``--data`` as strings, and a description: a text file (one document), every file
    under a directory (sorted by path; each one document), the rows of a saved HF dataset's ``text``
    column, or (``None``) the Python standard library's sources."""
    if data is None:
        return [build_corpus(1 << 20).tobytes().decode("utf-8", errors="replace")], "the stdlib sources"
    path = Path(data)
    if path.is_dir() and any((path / f).is_file() for f in DATASET_FILES):
        return _dataset_documents(path), f"the saved dataset {data}"
    files = [path] if path.is_file() else _files_under(path)
    if not files:
        raise ValueError(f"--data {data!r}: no files in this directory")
    docs = []
    for f in files:
        try:
            docs.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"--data: {str(f)!r} is not a UTF-8 text file ({exc})") from exc
    return docs, f"{len(files)} text file(s) from {data}"


def _files_under(root: Path) -> list[Path]:
    """Every file under ``root`` but hidden ones (a name starting with "."), sorted by relative path."""
    files = [f for f in root.rglob("*")
             if f.is_file() and not any(part.startswith(".") for part in f.relative_to(root).parts)]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def _dataset_documents(path: Path) -> list[str]:
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"--data {str(path)!r} is a saved Hugging Face dataset: loading it needs the `datasets` "
                          "package (pip install datasets), or pass text files instead") from exc
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, dict):                             # a DatasetDict: the train split, or the only one
        splits = list(ds.keys())
        if "train" not in splits and len(splits) != 1:
            raise ValueError(f"--data {str(path)!r}: a dataset dict without a 'train' split ({splits}); "
                             "save the split to train on")
        ds = ds["train" if "train" in splits else splits[0]]
    if "text" not in ds.column_names:
        raise ValueError(f"--data {str(path)!r}: the dataset has no 'text' column (columns: {ds.column_names})")
    return [str(t) for t in ds["text"]]


def tokenize(docs: list[str], tokenizer) -> np.ndarray:
    """One 1-D array of token ids: every document tokenized (``tokenizer``, or its UTF-8 bytes without
    one), followed by the tokenizer's end-of-sequence token (a newline byte)."""
    if tokenizer is None:
        return np.frombuffer("\n".join(docs).encode("utf-8") + b"\n", dtype=np.uint8)
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    ids = tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]
    return np.asarray([t for doc in ids for t in (*doc, *eos)], dtype=np.int64)


def load_tokens(data: str | None, tokenizer, vocab_size: int, seq_len: int) -> tuple[np.ndarray, str]:
    """The training tokens of ``--data`` for a model with ``vocab_size`` embedding rows, checked."""
    if tokenizer is None and vocab_size < 256:
        raise ValueError(f"the model has no tokenizer and a vocabulary of {vocab_size} < 256 byte values: "
                         "put its tokenizer into the model directory")
    if data is None and tokenizer is None:
        tokens, what = build_corpus(1 << 20), "the stdlib sources"
    else:
        docs, what = load_documents(data)
        tokens = tokenize(docs, tokenizer)
    if tokens.size <= seq_len:
        raise ValueError(f"--data: {tokens.size} tokens, fewer than one sequence of --seq-len {seq_len} + 1")
    if int(tokens.max()) >= vocab_size:
        raise ValueError(f"--data: token id {int(tokens.max())} is outside the model's vocabulary of {vocab_size}")
    how = type(tokenizer).__name__ if tokenizer is not None else "bytes"
    return tokens, f"{tokens.size:,} tokens from {what} (tokenizer: {how})"


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


def load_checkpoint(path: str, model, optimizer, scheduler) -> int:
    """Load the checkpoint at ``path``; returns the number of steps it had done."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from themis_compile.checkpoint import get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd, "train": {"step": 0, "scheduler": scheduler.state_dict()}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    scheduler.load_state_dict(state["train"]["scheduler"])
    return int(state["train"]["step"])


def checkpoint_to_resume(ckpt_dir: str, mode: str) -> str | None:
    """The checkpoint every rank resumes from (rank 0 looks, the others take its answer, so that all
    load the same one), or None to start from scratch (``mode`` "auto" and no checkpoint yet)."""
    found = [latest_checkpoint(ckpt_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is None and mode != "auto":
        raise FileNotFoundError(f"--resume: no complete checkpoint in {ckpt_dir!r} "
                                "(`--resume auto` starts from scratch when there is none)")
    return found[0]


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


def init_distributed(timeout_s: float) -> torch.device:
    """The default process group (NCCL on GPU, gloo on CPU) with a ``timeout_s`` deadline; its device."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun lends its rendezvous store to the workers; after a restart (--max-restarts) the store still
    # holds the previous attempt's keys, and a new gloo group would read its peers' old addresses from it
    # (torch issue 135712). The keys of every attempt get a prefix of their own.
    store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda")
    return torch.device("cpu")


def crash_step() -> int | None:
    """The number of steps after which the last rank of the first attempt exits (``TRAIN_EXAMPLE_CRASH_AT_STEP``)."""
    value = os.environ.get(CRASH_ENV)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    return int(value) if value and first_attempt and dist.get_rank() == dist.get_world_size() - 1 else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = init_distributed(args.collective_timeout)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)                         # the same model on every rank
    model, tokenizer, model_what = load_model(args.model, args.seq_len)
    vocab_size = model.get_input_embeddings().num_embeddings if hasattr(model, "get_input_embeddings") else VOCAB
    corpus, data_what = load_tokens(args.data, tokenizer, vocab_size, args.seq_len)    # the same on every rank
    model = model.to(device)
    config = themis_compile.ThemisConfig(policy=args.policy, dense_parallel=args.dense_parallel,
                                         reshard_interval=args.reshard_interval,
                                         collective_timeout_s=args.collective_timeout)
    model = themis_compile.optimize(model, config)
    runtime = runtime_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = cosine_schedule(optimizer, args.warmup, args.steps, args.min_lr_ratio)
    resume_from = checkpoint_to_resume(args.ckpt_dir, args.resume) if args.resume else None
    start = load_checkpoint(resume_from, model, optimizer, scheduler) if resume_from else 0
    if rank == 0:
        print(f"model: {model_what}\ndata: {data_what}", file=sys.stderr, flush=True)
        print(f"resuming from {resume_from} (step {start})" if resume_from else "starting from step 0",
              file=sys.stderr, flush=True)
        print(themis_compile.explain(model), file=sys.stderr, flush=True)

    progress = Progress(args.steps, start, enabled=rank == 0)
    tokens_per_step = args.batch * world * args.seq_len
    crash_at = crash_step()
    for step in range(start, args.steps):
        if step == crash_at:
            print(f"rank {rank}: exiting after {step} steps ({CRASH_ENV})", file=sys.stderr, flush=True)
            os._exit(1)
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
    if args.export_dir is not None:
        save_pretrained(model, args.export_dir)          # collective: the full model, written by rank 0
        if rank == 0 and tokenizer is not None:
            tokenizer.save_pretrained(args.export_dir)
        if rank == 0:
            print(f"exported the trained model to {args.export_dir}", file=sys.stderr, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
