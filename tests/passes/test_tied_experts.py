"""MoE layers whose experts are tied (the same parameters, as HF DiffusionGemma's encoder and decoder
layer i): detection marks the later layer ``tied_to`` the earlier one and ``optimize`` serves both with
one sharded experts module, so their gradients meet in one owner's chunk as in one parameter in one
process. Experts that share only some parameters are rejected (each sharded layer would hold its own copy
of its experts, training apart). The 2-rank training check of a tied model is HF diffusion_gemma's entry in
tests/passes/test_hf_families.py; this file holds the single-process part and a tiny model on 2 ranks."""

from __future__ import annotations

import torch

import themis_compile
import themis_compile.api
from themis_compile.models import build_model, lm_loss
from themis_compile.passes.detect import find_moe_layers

from tests.runtime.equivalence import global_losses


def _tied(tie: str = "module"):
    torch.manual_seed(0)
    model = build_model("tiny-moe", experts_form="stacked", n_layers=3)
    first, last = model.blocks[0].moe, model.blocks[2].moe
    if tie == "module":
        last.experts = first.experts
    elif tie == "parameters":      # every tensor tied, each layer its own experts module
        for name, param in first.experts.named_parameters():
            setattr(last.experts, name, param)
    else:                          # one tensor tied, the others the layer's own
        name, param = next(iter(first.experts.named_parameters()))
        setattr(last.experts, name, param)
    return model


def test_layers_with_tied_experts_are_found_tied_to_the_first():
    for tie in ("module", "parameters"):
        infos, rejected = find_moe_layers(_tied(tie))
        assert [(i.name, i.tied_to) for i in infos] == [("blocks.0.moe", ""), ("blocks.1.moe", ""),
                                                        ("blocks.2.moe", "blocks.0.moe")] and not rejected, rejected
        assert "experts tied to 'blocks.0.moe'" in themis_compile.explain(_tied(tie)).splitlines()[3]


def test_experts_sharing_some_parameters_are_rejected_naming_the_other():
    infos, rejected = find_moe_layers(_tied("one tensor"))
    assert [i.name for i in infos] == ["blocks.1.moe"], rejected
    reasons = dict(rejected)
    assert "share some parameters with those of MoE layer 'blocks.2.moe'" in reasons["blocks.0.moe"], rejected
    assert "share some parameters with those of MoE layer 'blocks.0.moe'" in reasons["blocks.2.moe"], rejected


STEPS, BATCH, SEQ = 3, 4, 8


def _losses(model) -> list[float]:
    """Global losses of STEPS AdamW steps on seeded batches, each rank on its slice (one process: all)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    return global_losses(model, opt, batches, lambda m, tokens: lm_loss(m(tokens), tokens))


def _rank(rank: int, world_size: int, policies: dict[str, dict]) -> dict[str, tuple[int, list[float]]]:
    out = {}
    for policy, options in policies.items():
        model = _tied()
        themis_compile.optimize(model, themis_compile.ThemisConfig(policy=policy, **options))
        assert model.blocks[2].moe.experts is model.blocks[0].moe.experts
        out[policy] = (len(themis_compile.api.runtime_of(model).layers), _losses(model))
    return out


def test_tied_experts_train_like_one_process_on_two_ranks():
    from themis_compile.testing.multirank import run_multirank

    # themis re-shards every step: the tied layers' experts move once, as one module.
    policies = {"ep": {}, "themis": {"reshard_interval": 1}, "themis-rm": {}}
    reference = _losses(_tied())
    for policy, (layers, losses) in run_multirank(_rank, 2, args=(policies,), timeout_s=120)[0].items():
        assert layers == 2, policy     # blocks.2.moe is served by blocks.0.moe's sharded experts
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, reference)), (policy, losses, reference)
