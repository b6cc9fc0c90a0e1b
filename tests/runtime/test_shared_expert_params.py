"""Stacked experts with parameters that every expert uses (a post-expert norm, a per-channel scale).

HF MuseSpark's experts hold ``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]`` next to one RMSNorm
applied to every expert's output (``post_expert_norm``). The stacked weights are cut into per-expert
chunks; the shared ones stay dense parameters, data parallel with the rest of the model through FSDP2 or
DDP, and every copy of every expert (owned or materialized on another rank) runs with them. Their
gradient is then the sum over the rows each rank computed, whichever rank's tokens they were, and the
dense wrapper's average over ranks makes it the one-process gradient of the global-batch loss.

Held here, on a block written the way such code is written (not shaped after the detector):
- detection finds it (by the attribute naming the experts, or by structure and routing code whatever the
  attribute is called), the bank cuts only the stacked weights, the probe proves the runtime's computation;
- on 2 gloo ranks, in one process group: under ``themis``, ``themis-rm`` and ``ep``, with FSDP2 and with
  DDP, 10 AdamW steps equal one process on the whole global batch (loss per step within 1e-5 relative,
  dense parameters including the shared ones and every expert allclose), the shared parameters' first
  gradient equal to the one-process gradient, with replicas made (|dP| > 0) under a skewed router, and
  with activation checkpointing (the experts recomputed inside the backward);
  re-sharding moves experts and changes nothing; a checkpoint keeps the unmodified keys, resumes under
  another policy and dense wrapper, and loads into the unmodified model.
"""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils.checkpoint import checkpoint

import themis_compile
from tests.passes import zoo_models as zoo
from tests.runtime.equivalence import assert_equivalent, rank_state_dict
from themis_compile.passes.styles import prepare_moe_layers
from themis_compile.runtime.experts import ExpertBank

pytestmark = pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")

H, FFN, E, K, VOCAB = zoo.H, zoo.FFN, zoo.E, zoo.K, zoo.VOCAB
STEPS, SAVE_AT, BATCH, SEQ, LR = 10, 4, 8, 8, 1e-2
SKEW, SKEWED_EXPERT = 3.0, 0
CONFIG = dict(overlap_degree=8, materialization_budget=2)
SHARED = ("layer_scale", "post_norm.weight")     # in named_parameters order


class NormedExperts(nn.Module):
    """SwiGLU experts stacked ``[E, ...]``; each expert's output goes through one RMSNorm and one
    per-channel scale that all experts share, then gets its routing weight (MuseSpark's experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * FFN, H) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(E, H, FFN) * 0.1)
        self.post_norm = nn.RMSNorm(H, eps=1e-6)
        self.layer_scale = nn.Parameter(torch.full((H,), 0.5))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token_idx, slot = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            gate, up = F.linear(x[token_idx], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            y = self.post_norm(y) * self.layer_scale
            out.index_add_(0, token_idx, y * top_k_weights[token_idx, slot, None])
        return out


class NormedMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = NormedExperts()

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x = x_BSH.reshape(-1, H)
        probs = self.router(x).softmax(dim=-1)
        weights, ids = probs.topk(K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, ids, weights).view_as(x_BSH)


class NormedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(zoo.Layer(NormedMoE()) for _ in range(2))
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens_BS)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def loss(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        logits = self(tokens_BS)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens_BS[:, 1:].reshape(-1))


def _model() -> NormedLM:
    """Seeded; shared parameters away from their initial values (so that a wrong use shows); the router
    skewed towards one expert from outside the block (as tests/passes/test_zoo_training.py does)."""
    torch.manual_seed(0)
    model = NormedLM()
    v_H = torch.full((H,), H ** -0.5)
    with torch.no_grad():
        for layer in model.layers:
            layer.moe.experts.post_norm.weight.copy_(1 + 0.3 * torch.randn(H))
            layer.moe.experts.layer_scale.copy_(0.5 + 0.3 * torch.randn(H))
            layer.norm2.bias.copy_(v_H)
            layer.moe.router.weight[SKEWED_EXPERT] += SKEW * v_H
    return model


def _shared_names() -> list[str]:
    return [f"layers.{i}.moe.experts.{n}" for i in range(2) for n in SHARED]


def _is_expert(name: str) -> bool:
    """A stacked weight (unmodified model) or an owned expert's tensor (optimized model)."""
    parts = name.split(".")
    return "experts" in parts and (parts[-1] in ("gate_up_proj", "down_proj") or parts[parts.index("experts") + 1]
                                   .isdigit())


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()   # FSDP2: a collective


def _comparable(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` as compared across runs: the key third of each attention's qkv bias is left out (its gradient is
    exactly zero, so what it gets is rounding noise, which AdamW amplifies into lr-sized steps)."""
    if name.endswith(".qkv.bias"):
        q_H, _, v_H = t.split(H)
        return torch.cat([q_H, v_H])
    return t


def _dense(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter outside the experts' chunks (the shared ones included), full."""
    return {n: _comparable(n, _full(p)) for n, p in model.named_parameters() if not _is_expert(n)}


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _reference():
    """One process, unmodified, the whole global batch: losses, dense params, expert chunks, the shared
    parameters' first gradient and the state dict after SAVE_AT steps."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads0, at_save = [], {}, {}
    for step, tokens in enumerate(_batches()):
        if step == SAVE_AT:
            at_save = {k: v.detach().clone() for k, v in rank_state_dict(model).items()}
        loss = model.loss(tokens)
        loss.backward()
        if step == 0:
            grads0 = {n: model.get_parameter(n).grad.clone() for n in _shared_names()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    experts = {}
    for li, layer in enumerate(model.layers):
        bank = ExpertBank(layer.moe.experts)
        for e in range(E):
            experts[(li, e)] = [t.detach().clone() for t in bank.chunk(layer.moe.experts, e)]
    return (losses, _dense(model), experts), grads0, at_save


# ---------------------------------------------------------------------------------- one process
def test_bank_cuts_only_the_stacked_weights():
    experts = _model().layers[0].moe.experts
    bank = ExpertBank(experts)
    assert bank.form == "stacked" and bank.num_experts == E
    assert bank.names == ("gate_up_proj", "down_proj") and bank.shared_names == SHARED
    assert bank.chunk_bytes == 4 * (2 * FFN * H + H * FFN)          # Psi: the shared tensors are in no chunk
    assert [tuple(t.shape) for t in bank.chunk(experts, 1)] == [(2 * FFN, H), (H, FFN)]
    x_NH = torch.randn(5, H)
    ids_N1 = torch.ones((5, 1), dtype=torch.int64)
    expected = experts(x_NH, ids_N1, torch.ones(5, 1))
    torch.testing.assert_close(bank.run(bank.chunk(experts, 1), x_NH, bank.shared_tensors(experts)), expected)
    with pytest.raises(ValueError, match="shared parameters layer_scale, post_norm.weight"):
        bank.run(bank.chunk(experts, 1), x_NH)


def test_expert_on_zero_rows_gives_the_shared_parameters_a_zero_gradient():
    """A rank whose experts all get no rows runs each on zero rows; the user's loop skips an expert without
    tokens, yet the shared parameters must get a (zero) gradient there, as every other rank's do: the
    dense wrapper (DDP, FSDP2) reduces the same gradients on every rank."""
    experts = NormedExperts()
    bank = ExpertBank(experts)
    out = bank.run(bank.chunk(experts, 0), torch.randn(0, H), bank.shared_tensors(experts))
    out.sum().backward()
    for name, p in experts.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


class ScaledSortedExperts(nn.Module):
    """torchtitan-style grouped experts called on rows sorted by expert with the counts, with one
    per-channel scale every expert uses, registered before the stacked weights."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((H,), 0.5))
        self.w1 = nn.Parameter(torch.randn(E, FFN, H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(E, H, FFN) * 0.1)

    def forward(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        out = [(F.silu(x @ self.w1[e].t()) @ self.w2[e].t()) * self.scale
               for e, x in enumerate(torch.split(x_NH, counts_E.tolist()))]
        return torch.cat(out)


def test_sorted_rows_experts_with_a_shared_parameter_first():
    """The sorted-rows rewrite reads E from the stacked weights, not from whichever parameter comes first:
    found, rewritten and verified, the rewritten block computes the unmodified one (value and gradients)."""
    torch.manual_seed(0)
    block = zoo.TitanGroupedMoE()
    block.experts = ScaledSortedExperts()
    reference = copy.deepcopy(block)
    model = nn.Sequential(block)
    infos = prepare_moe_layers(model, strict=True)
    assert [(i.rewrite, i.experts_form) for i in infos] == [("sorted-rows", "stacked")]
    assert ExpertBank(block.experts).shared_names == ("scale",)
    x = torch.randn(2, 4, H)
    torch.testing.assert_close(model(x), reference(x))
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, p), q in zip(block.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_submodule_mixing_stacked_and_shared_is_rejected():
    experts = NormedExperts()
    experts.post_norm.register_parameter("per_expert", nn.Parameter(torch.ones(E, H)))
    with pytest.raises(ValueError, match="submodule 'post_norm' of the experts holds stacked parameters"):
        ExpertBank(experts)


def test_found_verified_and_one_process_optimized_model_keeps_keys():
    from themis_compile.passes.detect import find_moe_layers

    model = _model()
    infos, rejected = find_moe_layers(model)
    assert [i.name for i in infos] == ["layers.0.moe", "layers.1.moe"] and not rejected, rejected
    assert all(i.experts_form == "stacked" and i.num_experts == E for i in infos)
    assert themis_compile.explain(model).count(
        "parameters every expert uses (dense, data-parallel): layer_scale, post_norm.weight") == 2
    assert themis_compile.explain(model, verbose=True).count(
        "every expert uses: layer_scale, post_norm.weight (dense, data-parallel)") == 2
    keys = {k: tuple(v.shape) for k, v in rank_state_dict(model).items()}
    tokens = _batches()[0]
    with torch.no_grad():
        before = model.loss(tokens)
    norm = model.layers[0].moe.experts.post_norm
    themis_compile.optimize(model, strict=True)       # probes the rewrite; world size 1
    experts = themis_compile.api.runtime_of(model).layers["layers.0.moe"]
    assert experts.post_norm is norm and experts.owned_experts() == list(range(E))
    assert {id(p) for p in experts.shared_parameters()} == {id(norm.weight), id(experts.layer_scale)}
    assert not {id(p) for p in experts.shared_parameters()} & {id(p) for p in experts.expert_parameters()}
    assert {k: tuple(v.shape) for k, v in rank_state_dict(model).items()} == keys
    with torch.no_grad():
        torch.testing.assert_close(model.loss(tokens), before)
    assert "parameters every expert uses (dense, data-parallel): layer_scale, post_norm.weight" in \
        themis_compile.explain(model)
    # A rank that holds no expert of the layer (EP with fewer experts than ranks) still gives the shared
    # parameters a (zero) gradient, so that every rank reduces the same dense gradients.
    rows_0H = torch.zeros(0, H, requires_grad=True)
    experts.run_experts({}, rows_0H, [0] * E).sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in experts.shared_parameters())
    assert rows_0H.grad.shape == (0, H)
    assert all(p.grad is None for p in experts.expert_parameters())


def test_found_by_structure_whatever_the_attribute_name():
    from themis_compile.passes.detect import find_moe_layers

    class FfnMoE(NormedMoE):
        """The same block with its experts under a name that does not say so: found from the router's
        top-k and the stacked weights beside the shared ones, not from the attribute name."""

        def __init__(self) -> None:
            super().__init__()
            self.ffn = self._modules.pop("experts")

        def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
            x = x_BSH.reshape(-1, H)
            weights, ids = self.router(x).softmax(dim=-1).topk(K, dim=-1)
            return self.ffn(x, ids, weights / weights.sum(dim=-1, keepdim=True)).view_as(x_BSH)

    torch.manual_seed(0)
    infos, rejected = find_moe_layers(nn.Sequential(FfnMoE()))
    assert [(i.name, i.experts_attr, i.experts_form, i.num_experts) for i in infos] == [("0", "ffn", "stacked", E)]
    assert not rejected


# ---------------------------------------------------------------------------------- 2 ranks
# (policy, dense wrapper, re-shard every n steps or 0, activation checkpointing of every layer)
CASES = [("themis", "fsdp2", 0, False), ("themis", "ddp", 0, False), ("ep", "fsdp2", 0, False),
         ("ep", "ddp", 0, False), ("themis-rm", "fsdp2", 0, False), ("themis", "fsdp2", 3, False),
         ("themis-rm", "fsdp2", 0, True)]


def _optimized(policy: str, dense: str, reshard: int, checkpointed: bool = False) -> NormedLM:
    config = themis_compile.ThemisConfig(policy=policy, dense_parallel=dense, reshard_interval=reshard, **CONFIG)
    model = themis_compile.optimize(_model(), config, strict=True)
    if checkpointed:
        # Recomputed inside the backward: the experts read the shared parameters again there (FSDP2 keeps
        # the root's unsharded parameters until its post-backward reduce-scatter).
        for layer in model.layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    return model


def _train(rank: int, world_size: int, model, opt, start: int, stop: int, save=None) -> tuple[list[float], dict]:
    local = BATCH // world_size
    losses, grads0 = [], {}
    for step, tokens in enumerate(_batches()[:stop]):
        if step < start:
            continue
        if step == SAVE_AT and save is not None:
            save(model, opt)
        loss = model.loss(tokens[rank * local:(rank + 1) * local])
        loss.backward()
        if step == 0:
            grads0 = {n: _full(model.get_parameter(n).grad) for n in _shared_names()}
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world_size)
    return losses, grads0


def _case(rank: int, world_size: int, policy: str, dense: str, reshard: int, checkpointed: bool):
    model = _optimized(policy, dense, reshard, checkpointed)
    runtime = themis_compile.api.runtime_of(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads0 = _train(rank, world_size, model, opt, 0, STEPS)
    delta_p = [sum(s.delta_p for s in runtime.stats if s.iteration == step) for step in range(STEPS)]
    owned = {(li, e): [t.detach().clone() for t in chunk] for li, layer in enumerate(runtime.layers.values())
             for e, chunk in layer.local_chunks().items()}
    moved = 0 if runtime.reshard_scheduler is None else runtime.reshard_scheduler.moved
    return (losses, _dense(model), owned, delta_p), grads0, moved


def _checkpoint(rank: int, world_size: int, root: str):
    """Saved at SAVE_AT under themis + FSDP2 (re-sharding every 2 steps, so experts have moved), resumed
    under ep + DDP; the keys and global shapes of what was saved."""
    from themis_compile.checkpoint import get_state_dict, set_state_dict

    path = os.path.join(root, "ckpt")
    saved = {}

    def save(model, opt):
        model_sd, optim_sd = get_state_dict(model, opt)
        saved.update({k: tuple(v.metadata().size) if hasattr(v, "local_shards") else tuple(v.shape)
                      for k, v in model_sd.items()})
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    model = _optimized("themis", "fsdp2", 2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    full, _ = _train(rank, world_size, model, opt, 0, STEPS, save=save)
    moved = themis_compile.api.runtime_of(model).reshard_scheduler.moved
    del model, opt
    model = _optimized("ep", "ddp", 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    resumed, _ = _train(rank, world_size, model, opt, SAVE_AT, STEPS)
    return full, resumed, saved, moved


def _ranks(rank: int, world_size: int, root: str):
    return [_case(rank, world_size, *case) for case in CASES], _checkpoint(rank, world_size, root)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from themis_compile.testing.multirank import run_multirank

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = _reference()
    finally:
        torch.set_num_threads(threads)
    root = str(tmp_path_factory.mktemp("shared_params"))
    return reference, run_multirank(_ranks, 2, args=(root,), timeout_s=240), root


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_two_ranks_train_like_one_process(two_ranks, case):
    (reference, grads0, _), results, _ = two_ranks
    i = CASES.index(case)
    per_rank = [r[0][i] for r in results]
    assert_equivalent(reference, [r[0] for r in per_rank])
    assert set(per_rank[0][0][1]) >= set(_shared_names())           # the shared parameters were compared
    for rank, (_, g0, _) in enumerate(per_rank):
        for name, g in grads0.items():
            torch.testing.assert_close(g0[name], g, rtol=1e-5, atol=1e-7, msg=f"rank {rank}: gradient of {name}")
    policy, _, reshard, _ = case
    if policy != "ep":
        assert any(d > 0 for d in per_rank[0][0][3]), f"{case}: the skewed router never made a replica"
    if reshard:
        assert per_rank[0][2] > 0, f"{case}: re-sharding moved no expert"


def test_checkpoint_resumes_under_another_policy_and_loads_unmodified(two_ranks):
    (reference, _, at_save), results, root = two_ranks
    for full, resumed, saved, moved in (r[1] for r in results):
        assert moved > 0
        assert max(abs(a - b) / abs(b) for a, b in zip(full, reference[0])) <= 1e-5
        assert max(abs(a - b) / abs(b) for a, b in zip(resumed, full[SAVE_AT:])) <= 1e-6, (resumed, full)
        # The unmodified model's keys and shapes: stacked weights whole, shared parameters under their names.
        assert saved == {k: tuple(v.shape) for k, v in at_save.items()}
    path = os.path.join(root, "unmodified.pt")
    dcp_to_torch_save(os.path.join(root, "ckpt"), path)
    model = _model()
    model.load_state_dict(torch.load(path, weights_only=False)["model"])
    for k, v in rank_state_dict(model).items():
        torch.testing.assert_close(_comparable(k, v), _comparable(k, at_save[k]), rtol=1e-4, atol=5e-4, msg=k)
