"""Training a style's model on gloo ranks and in one process on the whole batch, and the checks every style test
makes (``tests/passes/test_style_*.py``): the model's MoE layers sharded (each rank owning some of every
layer's experts, not all) and, under every policy, the losses per step, the dense parameters and every expert
at the end equal to one process (``tests.runtime.equivalence.assert_equivalent``), with replicas made under
``themis`` / ``themis-rm`` where the router is skewed.

A style gives ``build()`` (the seeded unmodified model, with ``model.loss(tokens)``) and ``is_expert(name)``
(which parameter names of the unmodified model are expert weights); the optimized model's are its experts
attribute's.
"""

from __future__ import annotations

from typing import Callable

import torch

import themis_compile
from tests.passes import zoo_models as zoo
from tests.runtime.equivalence import assert_equivalent, global_losses

STEPS, BATCH, SEQ, LR = 6, 8, 8, 1e-2
POLICIES = ("themis", "themis-rm", "ep")
CONFIG = dict(overlap_degree=8, materialization_budget=2, cost_benefit=False)   # replicas even where tiny experts cannot pay


def loss(model, tokens: torch.Tensor) -> torch.Tensor:
    return model.loss(tokens)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, zoo.VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def reference(build: Callable, is_expert: Callable[[str], bool]):
    """One process on the whole batch: (losses, dense parameters, every expert's chunk by (layer, e))."""
    from themis_compile.passes.detect import find_moe_layers
    from themis_compile.runtime.experts import ExpertBank

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build()
        infos, _ = find_moe_layers(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for tokens in batches():
            step_loss = model.loss(tokens)
            step_loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(step_loss.item())
    finally:
        torch.set_num_threads(threads)
    experts = {}
    for info in infos:
        bank = ExpertBank(info.experts)
        for e in range(bank.num_experts):
            experts[(info.name, e)] = [t.detach().clone() for t in bank.chunk(info.experts, e)]
    return losses, zoo.dense_params(model, is_expert), experts


def train(build: Callable, policy: str, layers: list[str]):
    """On every rank: optimize ``build()`` under ``policy`` (strict), train; (global losses, dense parameters,
    owned expert chunks by (layer, e), |ΔP| per step)."""
    model = themis_compile.optimize(build(), themis_compile.ThemisConfig(policy=policy, **CONFIG), strict=True)
    runtime = themis_compile.api.runtime_of(model)
    assert sorted(runtime.layers) == layers, sorted(runtime.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = global_losses(model, opt, batches(), loss)
    delta_p = [sum(s.delta_p for s in runtime.stats if s.iteration == step) for step in range(STEPS)]
    owned = {(name, e): [t.detach().clone() for t in chunk]
             for name, experts in runtime.layers.items() for e, chunk in experts.local_chunks().items()}
    attr = runtime.layer_infos[layers[0]].experts_attr
    return losses, zoo.dense_params(model, lambda n: f".{attr}." in n), owned, delta_p


def check_sharded_and_equal(reference_run, per_rank: list, layers: list[str], num_experts: int, what: str,
                            *, replicas: bool = True) -> None:
    """Each rank owns some of every layer's experts, not all (sharded); the training equals one process; with
    ``replicas``, themis made some (a step with |ΔP| > 0)."""
    for r in per_rank:
        assert all(0 < sum(n == name for n, _ in r[2]) < num_experts for name in layers), (what, sorted(r[2]))
    try:
        assert_equivalent(reference_run, per_rank)
    except AssertionError as err:
        raise AssertionError(f"{what}: {err}") from err
    if replicas:
        assert any(d > 0 for d in per_rank[0][3]), f"{what}: no replica was made ({per_rank[0][3]})"


def _ranks(rank: int, world_size: int, build: Callable, policies: tuple[str, ...], layers: list[str]):
    torch.set_num_threads(1)
    return [train(build, policy, layers) for policy in policies]


def trains_like_one_process(build: Callable, is_expert: Callable[[str], bool], layers: list[str], num_experts: int,
                            world_size: int, policies: tuple[str, ...] = POLICIES, *, devices_per_node: int | None = None,
                            timeout_s: float = 180) -> None:
    """``build()`` sharded on ``world_size`` gloo ranks under each of ``policies`` (``devices_per_node``: ranks
    per emulated node) trains equal to one process (:func:`check_sharded_and_equal`). ``build`` must be
    picklable (a module-level function)."""
    from themis_compile.testing.multirank import run_multirank

    ref = reference(build, is_expert)
    results = run_multirank(_ranks, world_size, args=(build, policies, layers), devices_per_node=devices_per_node,
                            timeout_s=timeout_s)
    for i, policy in enumerate(policies):
        check_sharded_and_equal(ref, [r[i] for r in results], layers, num_experts,
                                f"{getattr(build, '__name__', build)} under {policy} on {world_size} ranks",
                                replicas=policy != "ep")


def check_own_weights_rewrite(build: Callable, block_path: str, weight: str, dense: str, layers: list[str],
                              num_experts: int, top_k: int) -> None:
    """``prepare_moe_layers`` reads every layer as ``own-weights`` (E, k); the block at ``block_path`` then
    holds its stacked ``weight`` (the same parameter object) in its experts child, the model's state-dict
    keys are the unmodified model's, both ways, and the block computes what the unmodified one does: values,
    and the gradients of the hidden states, of ``weight`` and of the dense parameter ``dense``."""
    from themis_compile.passes.styles import prepare_moe_layers

    model, original = build(), build()
    keys = list(original.state_dict())
    block, ref = model.get_submodule(block_path), original.get_submodule(block_path)
    w = block._parameters[weight]
    infos = prepare_moe_layers(model, strict=True)
    assert [(i.name, i.rewrite, i.num_experts, i.top_k) for i in infos] == [
        (n, "own-weights", num_experts, top_k) for n in layers]
    assert block.experts._parameters[weight] is w and weight not in block._parameters
    assert list(model.state_dict()) == keys
    model.load_state_dict(original.state_dict())
    x = torch.randn(2, 5, w.shape[1], generator=torch.Generator().manual_seed(1), requires_grad=True)
    want, got = ref(x), block(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    g_want = torch.autograd.grad(want.square().sum(), [x, ref.get_parameter(weight), ref.get_parameter(dense)])
    g_got = torch.autograd.grad(got.square().sum(), [x, block.experts.get_parameter(weight), block.get_parameter(dense)])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def check_explained(build: Callable, num_layers: int, *fragments: str) -> None:
    """``explain`` of ``build()`` finds ``num_layers`` MoE layers and says each of ``fragments``."""
    text = themis_compile.explain(build())
    assert text.startswith(f"{num_layers} MoE layer(s) found"), text
    for fragment in fragments:
        assert fragment in text, (fragment, text)


SAVE_AT = 3


def _checkpointed(rank: int, world_size: int, build: Callable, path: str):
    """Train with a checkpoint (``themis_compile.checkpoint`` + DCP) before step SAVE_AT, resume a fresh
    optimized model from it; the losses of both, the full state dict of each, and the keys the rank's
    checkpoint view holds."""
    import torch.distributed.checkpoint as dcp

    from themis_compile.checkpoint import full_state_dict, get_state_dict, set_state_dict

    def optimized():
        model = themis_compile.optimize(build(), themis_compile.ThemisConfig(policy="themis", reshard_interval=2,
                                                                             **CONFIG), strict=True)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    def save(model, opt):
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    model, opt = optimized()
    full_losses = global_losses(model, opt, batches(), loss, save=save, save_at=SAVE_AT)
    full = full_state_dict(model)
    resumed, opt2 = optimized()
    model_sd, optim_sd = get_state_dict(resumed, opt2)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(resumed, opt2, model_state_dict=model_sd, optim_state_dict=optim_sd)
    losses = global_losses(resumed, opt2, batches(), loss, SAVE_AT)
    return full_losses, losses, full, full_state_dict(resumed), sorted(model_sd)


def _atol(key: str) -> float:
    # The key projection's bias shifts every score of a query alike: softmax cancels it, its gradient is
    # rounding noise that AdamW scales to full steps, so its value is compared with 10 such steps.
    return 10 * LR if key.endswith("qkv.bias") else 5e-4


def checkpoint_resumes_in_the_users_keys(build: Callable, tmp_path) -> None:
    """On 2 gloo ranks (themis, re-sharding every 2 steps): torch.distributed.checkpoint through
    themis_compile.checkpoint holds the user's keys (each rank its own experts, together all of them) and
    resumes the run exactly; the full state dict is the unmodified model's keys in order, its values those
    of one process trained on the whole batch."""
    from themis_compile.testing.multirank import run_multirank

    reference_model = build()
    unmodified_keys = list(reference_model.state_dict())
    opt = torch.optim.AdamW(reference_model.parameters(), lr=LR)
    for tokens in batches():
        reference_model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
    results = run_multirank(_checkpointed, 2, args=(build, str(tmp_path / "ckpt")), timeout_s=180)
    full_losses, losses, full, resumed_full, saved_keys = results[0]
    assert set().union(*(r[4] for r in results)) == set(unmodified_keys)
    for r in results:
        for a, b in zip(r[1], r[0][SAVE_AT:]):
            assert abs(a - b) <= 1e-6 * abs(b), (r[1], r[0])
    assert list(full) == unmodified_keys and list(resumed_full) == unmodified_keys
    for key, value in reference_model.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-4, atol=_atol(key), msg=key)
        torch.testing.assert_close(resumed_full[key], full[key], rtol=0, atol=1e-6, msg=key)
