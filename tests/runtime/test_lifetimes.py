"""What ``optimize`` leaves behind has an owner and a lifetime, and its configuration is the one read.

- The re-sharding optimizer hook is process-wide; it goes when its model goes: two models optimized in
  one process, one deleted, the other's optimizer steps run one hook — and recognising the owning
  optimizer is decided once, not on every step.
- ``ThemisConfig.kernels`` chooses the dispatch/combine kernels of the optimized model, whatever the
  process default of ``kernels.set_backend`` says.
"""

from __future__ import annotations

import gc

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks

import themis_compile
from themis_compile import kernels
from themis_compile.kernels import ops
from themis_compile.models import build_model, lm_loss
from themis_compile.testing import run_multirank


def _tiny(seed: int):
    torch.manual_seed(seed)
    return build_model("tiny-moe", router_skew=2.0, num_experts=4, top_k=2)


def _step(model, opt, rank: int) -> None:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    lm_loss(model(tokens), tokens).backward()
    opt.step()
    opt.zero_grad()


def _hook_follows_its_model(rank: int, world_size: int) -> dict:
    config = themis_compile.ThemisConfig(policy="themis", reshard_interval=100, overlap_degree=2,
                                         materialization_budget=1)
    before = len(_global_optimizer_post_hooks)
    model_a = themis_compile.optimize(_tiny(0), config)
    model_b = themis_compile.optimize(_tiny(1), config)
    with_both = len(_global_optimizer_post_hooks)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=1e-2)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=1e-2)
    _step(model_a, opt_a, rank)
    scheduler_a = themis_compile.api.runtime_of(model_a).reshard_scheduler
    steps_a = scheduler_a.steps
    del model_a, opt_a, scheduler_a
    gc.collect()
    after_delete = len(_global_optimizer_post_hooks)
    scheduler_b = themis_compile.api.runtime_of(model_b).reshard_scheduler
    scans = []
    scan = scheduler_b._scan
    scheduler_b._scan = lambda optimizer: scans.append(1) or scan(optimizer)
    for _ in range(3):
        _step(model_b, opt_b, rank)
    return {"before": before, "with_both": with_both, "after_delete": after_delete, "steps_a": steps_a,
            "steps_b": scheduler_b.steps, "scans_b": len(scans)}


def test_reshard_hook_goes_with_its_model_and_recognises_its_optimizer_once():
    for result in run_multirank(_hook_follows_its_model, 2, timeout_s=120):
        assert result["with_both"] == result["before"] + 2          # one hook per optimized model
        assert result["after_delete"] == result["before"] + 1       # model a gone: its hook too
        assert result["steps_a"] == 1
        assert result["steps_b"] == 3                               # only b's hook counts b's steps
        assert result["scans_b"] == 1                               # decided at the first step only


def test_config_kernels_choose_the_runtime_kernels(monkeypatch):
    used = []
    impl = ops._impl
    monkeypatch.setattr(ops, "_impl", lambda tensor, backend: used.append(backend) or impl(tensor, backend))
    chosen = "torch"
    model = themis_compile.optimize(_tiny(0), themis_compile.ThemisConfig(policy="ep", kernels=chosen))
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with kernels.use_backend("triton"):                              # the process default says otherwise
        lm_loss(model(tokens), tokens).backward()
    assert used and set(used) == {chosen}, used
    for layer in themis_compile.api.runtime_of(model).layers.values():
        assert layer.kernels_backend == chosen
