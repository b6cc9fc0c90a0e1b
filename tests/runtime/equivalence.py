"""Train a model distributed and single-process on the same global batches, and compare.

The reference is the unmodified model trained in one process on the whole global batch; the
distributed run gives each rank a contiguous slice of every global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import themis_compile
from themis_compile.models import build_model, lm_loss

LR = 1e-2

# The models the runtime's equivalence tests train: the reference model in both expert forms and tiny HF
# Mixtral, Qwen3-MoE and DeepSeek-V3 (``make_model`` specs).
MODELS = {
    "ref-loop": dict(name="tiny-moe", router_skew=2.0, experts_form="loop", top_k=2, num_experts=6),
    "ref-stacked": dict(name="tiny-moe", router_skew=2.0, experts_form="stacked", top_k=1, shared_expert=True),
    "mixtral": dict(hf="mixtral", num_experts=6),
    # A lower learning rate: at 1e-2 this tiny Qwen3 config's router flips near-tied top-k choices after
    # ~12 steps, so that even EP and the single-process run drift apart by 1e-5 (rounding made chaotic).
    "qwen3-moe": dict(hf="qwen3-moe", num_experts=8, lr=2e-3),
    "deepseek-v3": dict(hf="deepseek-v3", num_experts=8),
}


def _batches(steps: int, global_batch: int, seq_len: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (global_batch, seq_len), generator=g) for _ in range(steps)]


def make_model(spec: dict):
    """A reference model (``build_model(**spec)``) or, with ``hf="mixtral"|"qwen3-moe"|"deepseek-v3"``, a
    tiny random-init Hugging Face MoE model (no download)."""
    torch.manual_seed(0)
    spec = dict(spec)
    spec.pop("lr", None)
    family = spec.pop("hf", None)
    if family is None:
        return build_model(**spec)
    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=spec.pop("top_k", 2))
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(intermediate_size=64, num_local_experts=spec.pop("num_experts", 4), **common)
        return MixtralForCausalLM(cfg)
    if family == "deepseek-v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        # A dense first layer (first_k_dense_replace=1), then one MoE layer: group-limited sigmoid routing
        # (2 groups, the best 1 kept) and one shared expert; low-rank (MLA) attention.
        cfg = DeepseekV3Config(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                               n_routed_experts=spec.pop("num_experts", 4), n_shared_experts=1,
                               num_experts_per_tok=spec.pop("top_k", 2), n_group=2, topk_group=1,
                               first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                               qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64)
        return DeepseekV3ForCausalLM(cfg)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=spec.pop("num_experts", 4),
                         decoder_sparse_step=1, mlp_only_layers=[], head_dim=8, **common)
    return Qwen3MoeForCausalLM(cfg)


def model_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "aux_loss"):
        return lm_loss(model(tokens), tokens) + model.aux_loss()
    return model(input_ids=tokens, labels=tokens).loss


def global_losses(model, opt, batches, loss_fn, start: int = 0, *, save=None, save_at: int | None = None,
                  before_step=None) -> list[float]:
    """Global losses of the steps of ``batches`` from ``start`` on: every rank trains on its slice of each
    global batch (``loss_fn(model, tokens)``, AdamW-style ``opt``), and the losses are averaged over the
    ranks; ``save(model, opt)`` runs before step ``save_at`` (the checkpoint-and-resume tests), and
    ``before_step(model, step)`` between backward and the optimizer step (clipping goes there), as in
    `train_reference`."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    losses = []
    for step, tokens in enumerate(batches):
        if step < start:
            continue
        if step == save_at and save is not None:
            save(model, opt)
        local = tokens.shape[0] // world
        loss = loss_fn(model, tokens[rank * local:(rank + 1) * local])
        loss.backward()
        if before_step is not None:
            before_step(model, step)
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _expert_chunks_reference(model) -> dict[tuple[int, int], list[torch.Tensor]]:
    from themis_compile.passes.detect import find_moe_layers
    from themis_compile.runtime.experts import ExpertBank

    out = {}
    infos, _ = find_moe_layers(model)
    for li, info in enumerate(infos):
        experts = getattr(info.module, info.experts_attr)
        bank = ExpertBank(experts)
        for e in range(bank.num_experts):
            out[(li, e)] = [t.detach().clone() for t in bank.chunk(experts, e)]
    return out


def _dense_params(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if ".experts." in n:
            continue
        p = p.detach()
        if hasattr(p, "full_tensor"):   # FSDP2 shards dense parameters as DTensors (collective)
            p = p.full_tensor()
        out[n] = p.clone()
    return out


def make_optimizer(params, optimizer: str, lr: float = LR):
    # AdamW is invariant to a constant gradient scale; SGD is not, so it checks the gradient scaling.
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=lr)


def train_reference(model_kwargs: dict, steps: int, global_batch: int, seq_len: int, optimizer: str = "adamw",
                    *, prepare=None, before_step=None, step_callback=None):
    """One process on the whole global batch. ``prepare(model)`` runs once before the optimizer is built,
    ``before_step(model, step)`` between backward and the optimizer step (clipping goes there), and
    ``step_callback(model, opt, step)`` after the step, as in `train_distributed`."""
    model = make_model(model_kwargs)
    if prepare is not None:
        prepare(model)
    opt = make_optimizer(model.parameters(), optimizer, model_kwargs.get("lr", LR))
    losses = []
    for step, tokens in enumerate(_batches(steps, global_batch, seq_len, model.config.vocab_size)):
        loss = model_loss(model, tokens)
        loss.backward()
        if before_step is not None:
            before_step(model, step)
        opt.step()
        opt.zero_grad()
        if step_callback is not None:
            step_callback(model, opt, step)
        losses.append(loss.item())
    return losses, _dense_params(model), _expert_chunks_reference(model)


def train_distributed(rank: int, world_size: int, model_kwargs: dict, config_kwargs: dict, steps: int,
                      global_batch: int, seq_len: int, step_callback=None, optimizer: str = "adamw",
                      *, prepare=None, before_step=None):
    """Runs on every rank; returns (global losses, dense params, owned expert chunks, extra).
    ``prepare(model)`` runs on the unmodified model before ``optimize``; ``before_step(model, step)``
    between backward and the optimizer step."""
    model = make_model(model_kwargs)
    if prepare is not None:
        prepare(model)
    model = themis_compile.optimize(model, themis_compile.ThemisConfig(**config_kwargs))
    opt = make_optimizer(model.parameters(), optimizer, model_kwargs.get("lr", LR))
    runtime = themis_compile.api.runtime_of(model)
    if hasattr(runtime, "attach_optimizer"):
        runtime.attach_optimizer(opt)
    local = global_batch // world_size
    losses, extra = [], []
    for step, tokens in enumerate(_batches(steps, global_batch, seq_len, model.config.vocab_size)):
        tokens = tokens[rank * local:(rank + 1) * local]
        loss = model_loss(model, tokens)
        loss.backward()
        if before_step is not None:
            before_step(model, step)
        opt.step()
        opt.zero_grad()
        if step_callback is not None:
            extra.append(step_callback(model, opt, step))
        t = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world_size)
    owned = {}
    for li, (name, experts) in enumerate(runtime.layers.items()):
        for e, chunk in experts.local_chunks().items():
            owned[(li, e)] = [t.detach().clone() for t in chunk]
    return losses, _dense_params(model), owned, extra


def assert_equivalent(reference, results, *, loss_rtol: float = 1e-5, rtol: float = 1e-4, atol: float = 5e-4) -> None:
    """Losses per step within ``loss_rtol`` relative; parameters allclose at the end.

    Parameters get a looser tolerance than losses: AdamW divides each gradient by its own running RMS,
    so a 1e-7 reduction-order difference in a rarely touched weight (an embedding row seen once, an
    expert that gets a token every few steps) can move that weight by a fraction of one step (lr = 1e-2)
    over 20 steps, while the loss stays equal to ~1e-7. ``atol`` = 5e-4 is 5% of one AdamW step: a lost
    or misplaced optimizer state moves weights by whole steps. SGD runs (no normalisation) are compared
    with ``atol=1e-5``, which also pins the gradient scale that AdamW cannot see.
    """
    ref_losses, ref_dense, ref_experts = reference
    for rank, (losses, dense, owned, _) in enumerate(results):
        assert len(losses) == len(ref_losses)
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) <= loss_rtol * abs(b), f"rank {rank} step {step}: loss {a} vs reference {b}"
        assert dense.keys() == ref_dense.keys()
        for name, p in dense.items():
            torch.testing.assert_close(p, ref_dense[name], rtol=rtol, atol=atol, msg=f"rank {rank} {name}")
    owned_all = {}
    for _, _, owned, _ in results:
        for key, chunk in owned.items():
            assert key not in owned_all, f"expert {key} owned by two ranks"
            owned_all[key] = chunk
    assert owned_all.keys() == ref_experts.keys(), "every expert must be owned by exactly one rank"
    for key, chunk in owned_all.items():
        for a, b in zip(chunk, ref_experts[key]):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=f"expert {key}")


def rank_state_dict(model) -> dict:
    """``model.state_dict()`` as this rank sees it (an optimized model's own state_dict() raises at more than
    one rank: a rank's view is not the model's state dict)."""
    from themis_compile.export import rank_view

    with rank_view():
        return model.state_dict()
