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


def _batches(steps: int, global_batch: int, seq_len: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (global_batch, seq_len), generator=g) for _ in range(steps)]


def _expert_chunks_reference(model) -> dict[tuple[int, int], list[torch.Tensor]]:
    from themis_compile.runtime.experts import ExpertBank

    out = {}
    for li, block in enumerate(model.moe_layers()):
        bank = ExpertBank(block.experts)
        for e in range(bank.num_experts):
            out[(li, e)] = [t.detach().clone() for t in bank.chunk(block.experts, e)]
    return out


def _dense_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." not in n}


def make_optimizer(params, optimizer: str):
    # AdamW is invariant to a constant gradient scale; SGD is not, so it checks the gradient scaling.
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=LR)


def train_reference(model_kwargs: dict, steps: int, global_batch: int, seq_len: int, optimizer: str = "adamw"):
    torch.manual_seed(0)
    model = build_model(**model_kwargs)
    opt = make_optimizer(model.parameters(), optimizer)
    losses = []
    for tokens in _batches(steps, global_batch, seq_len, model.config.vocab_size):
        loss = lm_loss(model(tokens), tokens) + model.aux_loss()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _dense_params(model), _expert_chunks_reference(model)


def train_distributed(rank: int, world_size: int, model_kwargs: dict, config_kwargs: dict, steps: int,
                      global_batch: int, seq_len: int, step_callback=None, optimizer: str = "adamw"):
    """Runs on every rank; returns (global losses, dense params, owned expert chunks, extra)."""
    torch.manual_seed(0)
    model = build_model(**model_kwargs)
    model = themis_compile.optimize(model, themis_compile.ThemisConfig(**config_kwargs))
    opt = make_optimizer(model.parameters(), optimizer)
    runtime = themis_compile.api.runtime_of(model)
    if hasattr(runtime, "attach_optimizer"):
        runtime.attach_optimizer(opt)
    local = global_batch // world_size
    losses, extra = [], []
    for step, tokens in enumerate(_batches(steps, global_batch, seq_len, model.config.vocab_size)):
        tokens = tokens[rank * local:(rank + 1) * local]
        loss = lm_loss(model(tokens), tokens) + model.aux_loss()
        loss.backward()
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


def assert_equivalent(reference, results, *, loss_rtol: float = 1e-5, rtol: float = 1e-4, atol: float = 1e-4) -> None:
    """Losses per step within ``loss_rtol`` relative; parameters allclose at the end.

    Parameters get a looser tolerance than losses: AdamW divides each gradient by its own running RMS,
    so a 1e-7 reduction-order difference in a rarely touched weight (an embedding row seen once) can
    move that weight by ~1e-5 after a few steps, while the loss stays equal to 1e-6.
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
