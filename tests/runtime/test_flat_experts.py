"""Flat expert weights: experts stored as rows of one ``[E * F, H]`` tensor per weight (HF DBRX ``w1``,
``v1``, ``w2``; DBRX before transformers 5 in ``tests/passes/zoo_models.py``).

- ``ExpertBank`` reads the layout from the shapes and E (`flat_layout`), cuts expert e's rows
  ``[e * F, (e + 1) * F)`` and runs one expert as the user's module with E = 1 on them; an expert without
  rows gets a zero gradient (one process always has a gradient for the whole flat weight);
- detection finds both DBRX forms and rejects a scores call whose result depends on the scores of
  experts a token is not routed to;
- on 2 ranks, tiny HF DBRX trains like one process on the whole batch with re-sharding every 2 steps
  (the experts' rows move between ranks), its state dict and checkpoint hold the user's flat keys and
  shapes, the checkpoint loads into the unmodified model and resumes under another policy, and the
  unmodified model's checkpoint loads into an optimized one. One spawned process group for all of it.

The zoo matrix (2 and 4 ranks x themis / themis-rm / ep) trains the DBRX-before-v5 block:
tests/passes/test_zoo_training.py; the HF sweep trains ``dbrx``: tests/passes/test_hf_families.py.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict
from torch.distributed.checkpoint.state_dict import set_state_dict as torch_set_state_dict

import themis_compile
from themis_compile.checkpoint import RUNTIME_STATE_KEY, get_state_dict, set_state_dict
from themis_compile.passes.candidates import combine_mismatch
from themis_compile.passes.detect import find_moe_layers
from themis_compile.passes.styles import prepare_moe_layers
from themis_compile.runtime.experts import ExpertBank, flat_layout
from themis_compile.testing import run_multirank
from tests.passes import hf_families as hf
from tests.passes import zoo_models as zoo
from tests.runtime.equivalence import global_losses, rank_state_dict

pytestmark = pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")

STEPS, SAVE_AT, BATCH, SEQ, LR = 6, 3, 8, 8, 1e-2
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
F = 32        # DBRX's ffn_hidden_size in the tiny config (tests/passes/hf_families.py)


def _dbrx():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hf.tiny_model("dbrx")
    model.train()
    return model


def _config(policy: str) -> themis_compile.ThemisConfig:
    # t and m fixed (profiled budgets would make the plans depend on timing); re-shard every 2 steps.
    return themis_compile.ThemisConfig(policy=policy, reshard_interval=2, overlap_degree=8, materialization_budget=2)


def _tokens() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 128, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _flat_keys(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in rank_state_dict(model).items() if ".experts.mlp." in k}


# ---------------------------------------------------------------------------------- one process
def test_the_flat_layout_is_read_from_the_shapes_and_the_number_of_experts():
    model = _dbrx()
    experts = model.transformer.blocks[0].ffn.experts
    E, H = experts.num_experts, model.config.d_model
    assert flat_layout(experts) == (F, F, F) == flat_layout(experts, E)     # declared, or given by the router
    assert flat_layout(experts, 2 * E) == (F // 2,) * 3 and flat_layout(experts, 5) is None
    bank = ExpertBank(experts, num_experts=E)
    assert (bank.form, bank.flat, bank.num_experts, bank.names) == ("stacked", True, E, ("mlp.w1", "mlp.v1", "mlp.w2"))
    assert [shape for shape, _ in bank.spec] == [(F, H)] * 3
    for e in range(E):
        for t, w in zip(bank.chunk(experts, e), (experts.mlp.w1, experts.mlp.v1, experts.mlp.w2)):
            assert t.data_ptr() == w[e * F].data_ptr() and t.shape == (F, H)      # a view of its rows
    # Stacked [E, F, H] weights keep the stacked layout whatever the module declares.
    stacked = zoo.Llama4OldMoe().experts
    stacked.num_experts = 2
    assert flat_layout(stacked) is None and not ExpertBank(stacked).flat


class RoutedFlatExperts(nn.Module):
    """Flat experts sized by ``n_routed_experts`` (the DeepSeek attribute), viewed [E, F, H] in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.n_routed_experts = zoo.E
        self.w1 = nn.Parameter(torch.randn(zoo.E * zoo.FFN, zoo.H) * 0.1)
        self.w2 = nn.Parameter(torch.randn(zoo.E * zoo.FFN, zoo.H) * 0.1)

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        w1 = self.w1.view(self.n_routed_experts, -1, x_TH.shape[-1])
        w2 = self.w2.view(self.n_routed_experts, -1, x_TH.shape[-1])
        out = torch.zeros_like(x_TH)
        for e in range(self.n_routed_experts):
            t, k = torch.where(ids_TK == e)
            out.index_add_(0, t, torch.relu(x_TH[t] @ w1[e].t()) @ w2[e] * weights_TK[t, k, None])
        return out


def test_every_attribute_that_declares_the_number_of_experts_sizes_the_one_expert_copy():
    """The attributes detection reads E from are those the one-expert copy sets to 1 (n_routed_experts too)."""
    torch.manual_seed(0)
    experts = RoutedFlatExperts()
    assert flat_layout(experts) == (zoo.FFN, zoo.FFN)
    x_TH, ids_TK = torch.randn(16, zoo.H), torch.randint(0, zoo.E, (16, 2))
    assert combine_mismatch(experts, x_TH, ids_TK, torch.rand(16, 2), num_experts=zoo.E) is None


@pytest.mark.parametrize("make", [lambda: _dbrx().transformer.blocks[0].ffn, zoo.DbrxOldFFN],
                         ids=["hf_dbrx", "hf_dbrx_v4"])
def test_one_expert_alone_on_its_rows_is_the_module_for_its_tokens(make):
    torch.manual_seed(0)
    block = make()
    info = prepare_moe_layers(block, strict=True)[0]
    experts = info.experts
    assert info.experts_form == "flat" and info.rewrite in ("flatten", "scores-call")
    H = info.hidden_size
    g = torch.Generator().manual_seed(0)
    x_TH, ids_TK = torch.randn(16, H, generator=g), torch.randint(0, info.num_experts, (16, 2), generator=g)
    weights_TK = torch.rand(16, 2, generator=g)
    assert combine_mismatch(experts, x_TH, ids_TK, weights_TK, num_experts=info.num_experts) is None
    # Another E would cut other rows: the probe check sees it.
    assert combine_mismatch(experts, x_TH, ids_TK % 2, weights_TK, num_experts=2) is not None
    # An expert with no rows: a zero gradient, not none (its module's loop skips experts without tokens).
    bank = ExpertBank(experts, num_experts=info.num_experts)
    params = [t.detach().clone().requires_grad_() for t in bank.chunk(experts, 1)]
    y_NH = bank.run(params, torch.zeros(0, H, requires_grad=True))
    assert y_NH.shape == (0, H)
    y_NH.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in params)


def test_a_scores_call_that_reads_unrouted_scores_is_rejected():
    class ScaledByLastScore(zoo.DbrxOldFFN.Experts):
        def forward(self, x, weights, top_weights, top_experts):
            out = super().forward(x, weights, top_weights, top_experts)
            return out * (1 + weights[:, -1:]).view(x.shape[0], x.shape[1], 1)

    torch.manual_seed(0)
    block = zoo.DbrxOldFFN()
    block.experts = ScaledByLastScore()
    infos, rejected = find_moe_layers(block)
    assert not infos and "depends on the scores of experts a token is not routed to" in rejected[0][1], rejected


def test_explain_names_the_flat_layout():
    report = themis_compile.explain(_dbrx())
    assert report.startswith("2 MoE layer(s) found") and report.count("4 experts (flat, 'experts')") == 2, report


# ---------------------------------------------------------------------------------- 2 ranks
def _train(model, opt, start: int, stop: int, *, save=None) -> list[float]:
    return global_losses(model, opt, _tokens()[:stop], hf.family_loss, start, save=save, save_at=SAVE_AT)


def _optimized(policy: str):
    model = themis_compile.optimize(_dbrx(), _config(policy), strict=True)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _load(model, opt, path: str, *, runtime_state: bool = True) -> None:
    model_sd, optim_sd = get_state_dict(model, opt, options=OPTIONS)
    if not runtime_state:       # the unmodified model's checkpoint has none
        optim_sd.pop(RUNTIME_STATE_KEY)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=OPTIONS)


def _two_ranks(rank: int, world_size: int, dirs: dict[str, str]) -> dict:
    out: dict = {}

    def save(model, opt):
        out["state_dict"] = _flat_keys(model)
        model_sd, optim_sd = get_state_dict(model, opt, options=OPTIONS)
        out["checkpoint"] = {k: tuple(v.metadata().size) if hasattr(v, "local_shards") else tuple(v.shape)
                             for k, v in {**model_sd, **optim_sd}.items() if ".experts.mlp." in k
                             and (hasattr(v, "local_shards") or torch.is_tensor(v) and v.dim() > 0)}
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=dirs["optimized"])

    model, opt = _optimized("themis")
    out["full"] = _train(model, opt, 0, STEPS, save=save)
    runtime = themis_compile.api.runtime_of(model)
    out["moved"] = runtime.reshard_scheduler.moved
    out["owned"] = {(name, e): [t.detach().clone() for t in chunk]
                    for name, layer in runtime.layers.items() for e, chunk in layer.local_chunks().items()}
    del model, opt
    model, opt = _optimized("ep")                      # resumed under another policy
    _load(model, opt, dirs["optimized"])
    out["resumed"] = _train(model, opt, SAVE_AT, STEPS)
    del model, opt
    model, opt = _optimized("themis-rm")               # from the unmodified model's checkpoint
    _load(model, opt, dirs["unmodified"], runtime_state=False)
    out["from_unmodified"] = _train(model, opt, SAVE_AT, STEPS)
    return out


def _reference(path: str):
    """One process, the unmodified model: losses, each expert's rows at the end, the parameters at the
    save, and a checkpoint of the save (torch's own functions)."""
    model = _dbrx()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    at_save = {}

    def save(model, opt):
        at_save.update({k: v.detach().clone() for k, v in rank_state_dict(model).items()})
        model_sd, optim_sd = torch_get_state_dict(model, opt, options=OPTIONS)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, no_dist=True)

    losses = _train(model, opt, 0, STEPS, save=save)
    experts = {}
    for info in find_moe_layers(model)[0]:
        bank = ExpertBank(info.experts, num_experts=info.num_experts)
        experts.update({(info.name, e): [t.detach().clone() for t in bank.chunk(info.experts, e)]
                        for e in range(bank.num_experts)})
    return losses, experts, at_save, _flat_keys(model)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("flat")
    dirs = {k: str(root / k) for k in ("optimized", "unmodified")}
    reference = _reference(dirs["unmodified"])
    return dirs, reference, run_multirank(_two_ranks, 2, args=(dirs,), timeout_s=240)


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_two_ranks_train_like_one_process_while_rows_move(two_rank_run):
    _, (losses, experts, _, _), results = two_rank_run
    for r in results:
        assert _rel(r["full"], losses) < 1e-5, (r["full"], losses)
    assert results[0]["moved"] > 0, "re-sharding moved no expert: the rows' move is not exercised"
    owned = {key: chunk for r in results for key, chunk in r["owned"].items()}
    assert owned.keys() == experts.keys() and sum(len(r["owned"]) for r in results) == len(experts)
    for key, chunk in owned.items():
        for a, b in zip(chunk, experts[key]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-4, msg=f"expert {key}")


def test_state_dict_and_checkpoint_hold_the_flat_weights(two_rank_run):
    _, (_, _, _, flat_keys), results = two_rank_run
    assert flat_keys and all(shape == (4 * F, 32) for shape in flat_keys.values())
    for r in results:
        assert r["state_dict"] == flat_keys
        # The weights and their AdamW moments, each [E * F, H] under the user's key.
        assert {k.split(".experts.mlp.")[1] for k in r["checkpoint"]} >= {"w1", "v1", "w2", "w1.exp_avg",
                                                                        "w2.exp_avg_sq"}, r["checkpoint"]
        assert all(s == (4 * F, 32) for s in r["checkpoint"].values()), r["checkpoint"]


def test_checkpoint_loads_into_the_unmodified_model_and_resumes(two_rank_run, tmp_path):
    dirs, (losses, _, at_save, _), results = two_rank_run
    dcp_to_torch_save(dirs["optimized"], tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=False)
    model = _dbrx()
    model.load_state_dict(state["model"])          # strict: exactly the unmodified keys and shapes
    for key, value in rank_state_dict(model).items():
        torch.testing.assert_close(value, at_save[key], rtol=1e-4, atol=5e-4, msg=key)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    torch_set_state_dict(model, opt, model_state_dict={}, optim_state_dict=state["optim"], options=OPTIONS)
    assert _rel(_train(model, opt, SAVE_AT, STEPS), results[0]["full"][SAVE_AT:]) < 1e-6
    for r in results:
        assert _rel(r["resumed"], r["full"][SAVE_AT:]) < 1e-6
        assert _rel(r["from_unmodified"], losses[SAVE_AT:]) < 1e-6
