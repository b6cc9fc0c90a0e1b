"""The cost model's t and m during training: defaults first, profiled values after the first steps,
then the cached profile on the next run."""

from __future__ import annotations

import torch

import themis_compile
from themis_compile.cost_model.analytic import overlap_degree
from themis_compile.testing import run_multirank


def _train(rank, world_size, cache_dir, steps):
    import os

    os.environ["THEMIS_CACHE_DIR"] = cache_dir
    from themis_compile.models import build_model, lm_loss

    torch.manual_seed(0)
    model = themis_compile.optimize(build_model("tiny-moe", router_skew=2.0), themis_compile.ThemisConfig())
    runtime = themis_compile.api.runtime_of(model)
    opt = torch.optim.AdamW(model.parameters())
    budgets = []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (4, 32))
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        budgets.append([(layer.overlap_degree, layer.materialization_budget) for layer in runtime.layers.values()])
    controller = runtime.fssdp.budget_controller
    source = controller.profile.source if controller.profile is not None else None
    profiled = [controller.budgets[name].overlap_degree for name in runtime.layers]
    formula = [overlap_degree(b.t_attn_s, b.bw, b.psi_bytes) for b in map(controller.budgets.get, runtime.layers)]
    assert profiled == formula, (profiled, formula)
    return budgets, source, {n: b.t_attn_s for n, b in controller.budgets.items()}, profiled


def test_profiled_budgets_replace_defaults_and_are_cached(tmp_path):
    first = run_multirank(_train, 2, args=(str(tmp_path), 7), timeout_s=60)
    budgets, source, t_attn, profiled = first[0]
    assert all(t == 1 for t, _ in budgets[0])        # conservative default until measured
    # Then every layer runs with its profiled t = floor(T_attn * bw / Psi) (checked in `_train`). Its value
    # follows the measured timings (0 where attention is too short to hide one expert), so the test checks
    # that it is applied, not how large it is.
    assert [t for t, _ in budgets[-1]] == profiled and all(t >= 0 for t in profiled)
    assert source == "measured" and all(v is not None and v > 0 for v in t_attn.values())
    # Every rank plans with rank 0's profile.
    # (m follows the free memory at the time, so only t is compared.)
    assert [t for t, _ in first[1][0][-1]] == [t for t, _ in budgets[-1]] and first[1][2] == t_attn
    assert (tmp_path / "profiles.json").exists()
    second = run_multirank(_train, 2, args=(str(tmp_path), 1), timeout_s=60)
    assert second[0][1] == "cache" and second[0][2] == t_attn and second[0][3] == profiled
    assert [t for t, _ in second[0][0][0]] == [t for t, _ in budgets[-1]]   # cached t from the first step
