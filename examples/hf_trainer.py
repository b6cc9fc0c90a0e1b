"""Train a Hugging Face MoE model with ``transformers.Trainer`` and themis_compile.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --model mixtral --steps 50 \\
        --output-dir runs/hf --save-steps 25               # add --resume to continue from the latest checkpoint

``ThemisTrainer`` is ``Trainer`` for a model that ``themis_compile.optimize`` shards (it optimizes the
model itself when given an unmodified one): the same ``TrainingArguments``, data collator, learning-rate
schedule, gradient accumulation and logging; clipping (``--max-grad-norm``) with the global norm, and
checkpoints written by every rank through ``torch.distributed.checkpoint``. The model is a tiny
Mixtral / Qwen3-MoE with a random configuration, or any local directory ``from_pretrained`` reads
(``--model path/to/model``); the data are fixed-length token blocks of the Python standard library's
sources, one byte a token (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import os

import torch

import themis_compile
from themis_compile.integrations.transformers import ThemisTrainer
from themis_compile.models.data import build_corpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mixtral", help="mixtral, qwen3-moe (tiny, random) or a local model directory")
    p.add_argument("--dense-parallel", default="fsdp2", choices=("fsdp2", "ddp"))
    p.add_argument("--policy", default="themis", help="ThemisConfig policy: themis, themis-rm, ep")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and micro-batch")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--output-dir", default="runs/hf_trainer")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every k steps (0: none)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    p.add_argument("--bf16", action="store_true")
    return p.parse_args(argv)


def build_hf_model(name: str, vocab: int = 256):
    """A tiny random Mixtral / Qwen3-MoE over bytes, or a local model directory."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    torch.manual_seed(0)     # every rank builds the same model
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, num_experts_per_tok=2)
    if name == "mixtral":
        return AutoModelForCausalLM.from_config(MixtralConfig(num_local_experts=8, **common))
    if name == "qwen3-moe":
        return AutoModelForCausalLM.from_config(Qwen3MoeConfig(num_experts=8, moe_intermediate_size=64,
                                                               decoder_sparse_step=1, mlp_only_layers=[],
                                                               head_dim=16, **common))
    return AutoModelForCausalLM.from_pretrained(name)


def token_blocks(seq_len: int, rows: int) -> list[dict[str, torch.Tensor]]:
    """``rows`` blocks of ``seq_len`` byte tokens from the standard library's sources."""
    corpus = torch.from_numpy(build_corpus(max_bytes=1 << 20).astype("int64"))
    starts = torch.linspace(0, len(corpus) - seq_len - 1, rows).long()
    return [{"input_ids": (ids := corpus[s:s + seq_len]), "labels": ids} for s in starts.tolist()]


def main(argv: list[str] | None = None) -> None:
    from transformers import TrainingArguments

    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, max_grad_norm=args.max_grad_norm,
        lr_scheduler_type="cosine", warmup_steps=min(10, args.steps // 10), logging_steps=10,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, bf16=args.bf16,
        report_to="none", use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    model = build_hf_model(args.model)
    rows = args.steps * args.grad_accum * args.batch * world
    trainer = ThemisTrainer(model=model, args=training_args, train_dataset=token_blocks(args.seq_len, rows),
                            themis_config=themis_compile.ThemisConfig(policy=args.policy,
                                                                      dense_parallel=args.dense_parallel))
    if trainer.is_world_process_zero():
        print(themis_compile.explain(trainer.model))
    resume = args.resume and any(d.startswith("checkpoint-") for d in os.listdir(args.output_dir)) \
        if os.path.isdir(args.output_dir) else False
    trainer.train(resume_from_checkpoint=True if resume else None)
    trainer.save_model()     # every rank calls it; rank 0 writes what from_pretrained loads


if __name__ == "__main__":
    main()
