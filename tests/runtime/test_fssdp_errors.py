"""Bad input and edge cases of the FSSDP runtime: every rank fails with the layer's name, nothing hangs."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import themis_compile
from themis_compile import ThemisConfig
from themis_compile.models import build_model, lm_loss
from themis_compile.testing import RankError, run_multirank


def _nan_router_on_rank_one(rank, world_size):
    torch.manual_seed(0)
    model = themis_compile.optimize(build_model("tiny-moe"), ThemisConfig(policy="themis", overlap_degree=2,
                                                                          materialization_budget=1))
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens)   # the first forward also lets DDP broadcast rank 0's dense parameters
    if rank == 1:
        with torch.no_grad():
            model.blocks[1].moe.gate.weight.fill_(float("nan"))
    try:
        model(tokens)
    except FloatingPointError as exc:
        return str(exc)
    return "no error"


def test_non_finite_router_output_raises_on_every_rank():
    messages = run_multirank(_nan_router_on_rank_one, 2, timeout_s=30)
    for msg in messages:
        assert "blocks.1.moe" in msg and "non-finite router output on ranks [1]" in msg


def _few_experts(rank, world_size):
    # E = 3 < 4 ranks: one rank owns no expert; it still computes replicas and takes part in SpRS.
    torch.manual_seed(0)
    model = themis_compile.optimize(build_model("tiny-moe", num_experts=3, top_k=1, router_skew=2.0),
                                    ThemisConfig(policy="themis", overlap_degree=3, materialization_budget=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runtime = themis_compile.api.runtime_of(model)
    for _ in range(3):
        tokens = torch.randint(0, 256, (2, 16))
        lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
    return [len(layer.owned_experts()) for layer in runtime.layers.values()], sum(s.delta_p for s in runtime.stats)


def test_fewer_experts_than_ranks():
    out = run_multirank(_few_experts, 4, timeout_s=60)
    owned = [o for o, _ in out]
    assert [sum(o[i] for o in owned) for i in range(2)] == [3, 3]
    assert any(o[0] == 0 for o in owned)
    assert out[0][1] > 0


def test_world_size_one_themis_policy_matches_unmodified_model():
    torch.manual_seed(0)
    ref = build_model("tiny-moe")
    torch.manual_seed(0)
    model = themis_compile.optimize(build_model("tiny-moe"), ThemisConfig(policy="themis"))
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model(tokens), ref(tokens), rtol=1e-5, atol=1e-5)


class _Dense(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        return self.ff(x)


def test_model_without_moe_is_returned_unchanged_with_warning():
    model = _Dense()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = themis_compile.optimize(model)
    assert out is model and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert any("no MoE layer" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="no MoE layer"):
        themis_compile.optimize(_Dense(), strict=True)


def test_optimizing_twice_is_refused():
    model = themis_compile.optimize(build_model("tiny-moe"), ThemisConfig(policy="ep"))
    with pytest.raises(ValueError, match="already optimized"):
        themis_compile.optimize(model)


def _rank_without_experts(rank, world_size, policy):
    # E = 3 on 4 ranks with no replicas (m = 0): rank 3 holds no expert at all and must still take part
    # in the backward all-to-all.
    torch.manual_seed(0)
    config = ThemisConfig(policy=policy, overlap_degree=0, materialization_budget=0, collective_timeout_s=20)
    model = themis_compile.optimize(build_model("tiny-moe", num_experts=3, top_k=1), config)
    tokens = torch.randint(0, 256, (2, 16))
    lm_loss(model(tokens), tokens).backward()
    return sum(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("policy", ["ep", "themis"])
def test_rank_holding_no_expert_joins_backward(policy):
    assert all(n > 0 for n in run_multirank(_rank_without_experts, 4, args=(policy,), timeout_s=30))


def _accumulate_and_eval(rank, world_size):
    torch.manual_seed(0)
    model = themis_compile.optimize(build_model("tiny-moe", router_skew=2.0, n_layers=3),
                                    ThemisConfig(policy="themis-rm", overlap_degree=4, materialization_budget=2))
    runtime = themis_compile.api.runtime_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        a, b = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
        (lm_loss(model(a), a) + lm_loss(model(b), b)).backward()    # two forwards, one backward
        opt.step()
        opt.zero_grad()
    layer = next(iter(runtime.layers.values()))
    before = layer.predictor.predict(0).copy()
    with torch.no_grad():
        model(torch.randint(0, 256, (2, 16)))
    return bool((layer.predictor.predict(0) == before).all()), sum(s.delta_p for s in runtime.stats)


def test_gradient_accumulation_under_rematerialization_and_eval_forward():
    for same_prediction, delta in run_multirank(_accumulate_and_eval, 2, timeout_s=60):
        assert same_prediction          # an evaluation forward does not steer the next plans
        assert delta > 0


def _expert_groups_after_resharding(rank, world_size, momentum):
    torch.manual_seed(0)
    model = themis_compile.optimize(build_model("tiny-moe", router_skew=2.0),
                                    ThemisConfig(policy="themis", overlap_degree=4, materialization_budget=1,
                                                 reshard_interval=2))
    runtime = themis_compile.api.runtime_of(model)
    expert_ids = {id(p) for layer in runtime.layers.values() for c in layer.local_chunks().values() for p in c}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    experts = [p for p in model.parameters() if id(p) in expert_ids]
    opt = torch.optim.SGD([{"params": dense}, {"params": experts, "lr": 0.0}], lr=0.1, momentum=momentum)
    for _ in range(6):
        tokens = torch.randint(0, 256, (2, 16))
        lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
    owned = {id(p) for layer in runtime.layers.values() for c in layer.local_chunks().values() for p in c}
    in_expert_group = {id(p) for p in opt.param_groups[1]["params"]}
    return runtime.reshard_scheduler.moved, owned <= in_expert_group, len(owned & {id(p) for p in dense})


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_resharding_keeps_param_groups(momentum):
    # SGD without momentum keeps no state: the param group must still travel with a moving expert.
    for moved, in_group, in_dense in run_multirank(_expert_groups_after_resharding, 2, args=(momentum,),
                                                   timeout_s=60):
        assert moved > 0 and in_group and in_dense == 0
