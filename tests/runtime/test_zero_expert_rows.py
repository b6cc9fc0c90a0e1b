"""Zero (identity) experts stacked after the real ones (HF LongCat-Flash ``LongcatFlashExperts``):
``gate_up_proj [E + Z, 2F, H]`` holds rows for the Z zero experts, ``down_proj [E, H, F]`` does not, and the
router's ids in ``[E, E + Z)`` add ``weight * x``.

- ``ExpertBank`` reads the layout (:func:`zero_expert_rows`): E real experts cut as stacked ones, rows
  ``[E, E + Z)`` of ``gate_up_proj`` no expert's; detection proves on a probe that the module is the
  runtime's sum over ids ``< E`` plus ``weights * x`` over the others and never reads those rows, and a
  module that reads them is rejected;
- on 2 ranks, a block of this shape trains like one process on the whole batch with AdamW's weight decay
  (rows ``[E, E + Z)`` are never read, get a zero gradient every step and decay exactly as in one
  process), with themis' ``clip_grad_norm_``; the state dict holds ``gate_up_proj [E + Z, 2F, H]`` under
  the user's key; a DCP checkpoint (optimizer state in the same key and shape) resumes under ``ep`` with
  DDP and loads into the unmodified model. One spawned process group for all of it.

The HF sweep trains ``longcat_flash`` itself: tests/passes/test_hf_families.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.state_dict import set_state_dict as torch_set_state_dict

import themis_compile
from themis_compile.checkpoint import get_state_dict, set_state_dict
from themis_compile.passes.candidates import combine_mismatch
from themis_compile.passes.detect import find_moe_layers
from themis_compile.passes.styles import describe_layer
from themis_compile.runtime.clip import clip_grad_norm_
from themis_compile.runtime.experts import ExpertBank, zero_expert_rows, zero_rows_span
from themis_compile.testing import run_multirank
from tests.runtime.equivalence import global_losses, rank_state_dict

pytestmark = pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")

# Shape suffixes: T tokens, K top-k, H d_model, E experts, Z zero experts, F expert hidden, V vocabulary.
E, Z, H, FF, K, V = 4, 3, 16, 8, 2, 64
STEPS, SAVE_AT, BATCH, SEQ, LR, WD, MAX_NORM = 5, 2, 8, 6, 2e-2, 0.1, 0.5
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ZeroComputeExperts(nn.Module):
    """E SwiGLU experts stacked with Z zero experts, as LongCat-Flash stores them; an id >= E is an
    identity expert (``weight * x``), which never reads its rows of ``gate_up_proj``."""

    def __init__(self) -> None:
        super().__init__()
        self.n_routed = E
        self.gate_up_proj = nn.Parameter(torch.randn(E + Z, 2 * FF, H) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(E, H, FF) * 0.3)

    def forward(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        out_TH = torch.zeros_like(x_TH)
        for e in range(self.gate_up_proj.shape[0]):
            token_N, slot_N = torch.where(ids_TK == e)
            if e >= self.n_routed:
                y_NH = x_TH[token_N]
            else:
                gate, up = F.linear(x_TH[token_N], self.gate_up_proj[e]).chunk(2, dim=-1)
                y_NH = F.linear(F.silu(gate) * up, self.down_proj[e])
            out_TH.index_add_(0, token_N, y_NH * weights_TK[token_N, slot_N, None])
        return out_TH


class ZeroExpertsMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, E + Z, bias=False)
        self.experts = ZeroComputeExperts()

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, H)
        probs_TE = self.router(x_TH).softmax(-1)
        weights_TK, ids_TK = probs_TE.topk(K, dim=-1)
        return self.experts(x_TH, ids_TK, weights_TK).view(x_BSH.shape)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.norm = nn.LayerNorm(H)
        self.moe = ZeroExpertsMoE()
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens_BS)
        return self.head(x + self.moe(self.norm(x)))


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))


def _tokens() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, V, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _train(model, opt, start: int, *, clip, save=None, norms: list | None = None) -> list[float]:
    """Global losses of steps ``start..STEPS``: each rank its slice of the global batch, gradients clipped
    to MAX_NORM (``clip``: torch's, or themis' drop-in; the norms before clipping appended to ``norms``),
    ``save(model, opt)`` before step SAVE_AT."""

    def clip_grads(model, step):
        norm = clip(model.parameters(), MAX_NORM)
        if norms is not None:
            norms.append(float(norm))

    return global_losses(model, opt, _tokens(), _loss, start, save=save, save_at=SAVE_AT, before_step=clip_grads)


def _adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


# ---------------------------------------------------------------------------------- one process
def test_the_layout_and_the_probe_check():
    experts = _model().moe.experts
    assert zero_expert_rows(experts) == (E, {"gate_up_proj": Z})
    bank = ExpertBank(experts)
    assert (bank.form, bank.num_experts, bank.num_zero_experts, bank.zero_rows) == ("stacked", E, Z, {"gate_up_proj": Z})
    assert [shape for shape, _ in bank.spec] == [(2 * FF, H), (H, FF)]
    assert [zero_rows_span(Z, 2, r) for r in range(2)] == [(0, 2), (2, 3)]
    assert [zero_rows_span(Z, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    g = torch.Generator().manual_seed(0)
    x_TH, ids_TK = torch.randn(16, H, generator=g), torch.randint(0, E + Z, (16, K), generator=g)
    weights_TK = torch.rand(16, K, generator=g)
    assert (ids_TK >= E).any() and combine_mismatch(experts, x_TH, ids_TK, weights_TK) is None

    class ReadsZeroRows(ZeroComputeExperts):        # a "zero" expert that reads its row: not an identity
        def forward(self, x_TH, ids_TK, weights_TK):
            return super().forward(x_TH, ids_TK, weights_TK) + x_TH * self.gate_up_proj[E:].mean() * 0.1

    why = combine_mismatch(ReadsZeroRows(), x_TH, ids_TK, weights_TK)
    assert why is not None and "reads rows [4, 7) of gate_up_proj" in why, why


def test_detection_names_the_zero_experts():
    infos, rejected = find_moe_layers(_model())
    assert not rejected and len(infos) == 1, rejected
    info = infos[0]
    assert (info.num_experts, info.zero_experts, info.rewrite, info.router_path) == (E, Z, "zero-experts",
                                                                                      "router")
    assert f"{E} experts + {Z} zero (identity) experts" in describe_layer(info)      # what explain() prints


# ---------------------------------------------------------------------------------- 2 ranks
def _local_rows(value) -> dict[int, torch.Tensor]:
    """Leading offset -> tensor of each chunk this rank holds of a state-dict value."""
    if hasattr(value, "local_shards"):
        return {s.metadata.shard_offsets[0]: s.tensor.detach().clone() for s in value.local_shards()}
    return {0: value.detach().clone()}


def _two_ranks(rank: int, world_size: int, path: str) -> dict:
    out: dict = {}

    def save(model, opt):
        model_sd, optim_sd = get_state_dict(model, opt, options=OPTIONS)
        out["checkpoint"] = {k.removeprefix("state."): tuple(v.metadata().size)
                             for k, v in {**model_sd, **optim_sd}.items()
                             if ".experts." in k and hasattr(v, "local_shards")}
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    # Re-sharding every 2 steps moves experts; the zero-expert rows stay with their ranks.
    config = themis_compile.ThemisConfig(policy="themis", overlap_degree=4, materialization_budget=2,
                                         reshard_interval=2)
    model = themis_compile.optimize(_model(), config, strict=True)
    opt = _adamw(model)
    out["norms"] = []
    out["losses"] = _train(model, opt, 0, clip=clip_grad_norm_, save=save, norms=out["norms"])
    sd = rank_state_dict(model)
    out["state_dict"] = {k: (tuple(v.metadata().size), _local_rows(v)) for k, v in sd.items() if ".experts." in k}
    out["dense"] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
                    for k, v in sd.items() if ".experts." not in k}
    del model, opt
    # Resumed under another policy and dense wrapper.
    model = themis_compile.optimize(_model(), themis_compile.ThemisConfig(policy="ep", dense_parallel="ddp"),
                                    strict=True)
    opt = _adamw(model)
    model_sd, optim_sd = get_state_dict(model, opt, options=OPTIONS)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=OPTIONS)
    out["resumed"] = _train(model, opt, SAVE_AT, clip=clip_grad_norm_)
    out["resumed_rows"] = _local_rows(rank_state_dict(model)["moe.experts.gate_up_proj"])
    return out


def _reference():
    model = _model()
    initial = model.moe.experts.gate_up_proj.detach().clone()
    opt = _adamw(model)
    at_save = {}

    def save(model, opt):
        at_save.update({k: v.detach().clone() for k, v in rank_state_dict(model).items()})

    norms = []
    losses = _train(model, opt, 0, clip=torch.nn.utils.clip_grad_norm_, save=save, norms=norms)
    return (losses, norms), initial, {k: v.detach().clone() for k, v in rank_state_dict(model).items()}, at_save


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zero_rows") / "ckpt")
    return path, _reference(), run_multirank(_two_ranks, 2, args=(path,), timeout_s=240)


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _assert_rows_match(chunks: dict[int, torch.Tensor], full: torch.Tensor, what: str) -> None:
    for offset, t in chunks.items():
        torch.testing.assert_close(t, full[offset:offset + t.shape[0]], rtol=1e-4, atol=1e-5,
                                   msg=f"{what}, rows from {offset}")


def test_two_ranks_train_like_one_process_with_weight_decay(two_rank_run):
    _, ((losses, norms), initial, final, _), results = two_rank_run
    # The zero-expert rows are never read, yet weight decay moved them in one process.
    assert not torch.allclose(final["moe.experts.gate_up_proj"][E:], initial[E:])
    assert max(norms) > MAX_NORM, norms          # clipping is active
    for r in results:
        assert _rel(r["losses"], losses) < 1e-5, (r["losses"], losses)
        assert _rel(r["norms"], norms) < 1e-5, (r["norms"], norms)     # themis' clip_grad_norm_: one norm
        for k, v in r["dense"].items():
            torch.testing.assert_close(v, final[k], rtol=1e-4, atol=5e-5, msg=k)
    # Every row of both stacked weights, each held by exactly one rank, as one process trained it.
    for key in ("moe.experts.gate_up_proj", "moe.experts.down_proj"):
        rows = {}
        for r in results:
            size, chunks = r["state_dict"][key]
            assert size == tuple(final[key].shape), (key, size)
            assert not rows.keys() & chunks.keys()
            rows.update(chunks)
            _assert_rows_match(chunks, final[key], key)
        assert sum(t.shape[0] for t in rows.values()) == final[key].shape[0]


def test_checkpoint_holds_the_user_keys_and_resumes_under_ep(two_rank_run):
    _, ((losses, _), _, final, _), results = two_rank_run
    for r in results:
        assert r["checkpoint"]["moe.experts.gate_up_proj"] == (E + Z, 2 * FF, H)
        assert r["checkpoint"]["moe.experts.gate_up_proj.exp_avg"] == (E + Z, 2 * FF, H)
        assert r["checkpoint"]["moe.experts.gate_up_proj.exp_avg_sq"] == (E + Z, 2 * FF, H)
        assert r["checkpoint"]["moe.experts.down_proj.exp_avg"] == (E, H, FF)
        assert _rel(r["resumed"], losses[SAVE_AT:]) < 1e-5, (r["resumed"], losses)
        _assert_rows_match(r["resumed_rows"], final["moe.experts.gate_up_proj"], "resumed gate_up_proj")


def test_checkpoint_loads_into_the_unmodified_model(two_rank_run, tmp_path):
    path, ((losses, _), _, final, at_save), _ = two_rank_run
    dcp_to_torch_save(path, tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=False)
    model = _model()
    model.load_state_dict(state["model"])          # strict: exactly the unmodified keys and shapes
    for key, value in rank_state_dict(model).items():
        torch.testing.assert_close(value, at_save[key], rtol=1e-4, atol=5e-5, msg=key)
    opt = _adamw(model)
    torch_set_state_dict(model, opt, model_state_dict={}, optim_state_dict=state["optim"], options=OPTIONS)
    rows = opt.state[model.moe.experts.gate_up_proj]
    assert not rows["exp_avg"][E:].any() and float(rows["step"]) == SAVE_AT   # a zero gradient every step
    assert _rel(_train(model, opt, SAVE_AT, clip=torch.nn.utils.clip_grad_norm_), losses[SAVE_AT:]) < 1e-5
    torch.testing.assert_close(model.moe.experts.gate_up_proj.detach(), final["moe.experts.gate_up_proj"],
                               rtol=1e-4, atol=1e-5)
