"""Experts held in a ModuleList inside a wrapper module (Megatron-Core ``SequentialMLP.local_experts``,
DeepSpeed ``Experts.deepspeed_experts``): the sharded experts keep the user's names under the wrapper's
list, and checkpoints speak those names.

- What counts as a wrapper (``wrapped_expert_list``) and how ``ExpertBank`` / ``ShardedExperts`` read it,
  in one process.
- On 2 ranks (one spawned group) the zoo's Megatron block (tests/passes/zoo_models.py, router skewed
  as in the zoo matrix) trains 4 AdamW steps with re-sharding every 2 steps and saves a DCP checkpoint
  before step 2 (experts have moved by then); each rank's ``state_dict()`` holds exactly its owned
  experts under ``...experts.<list>.<e>.``; the checkpoint resumes under another policy and loads into
  the unmodified model in one process (2 -> 1), and the unmodified model's one-process checkpoint loads
  into the optimized model on 2 ranks (1 -> 2), each continuing within 1e-6 of the uninterrupted run.
"""

from __future__ import annotations

import os
import re

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
from themis_compile.planner import Placement
from themis_compile.runtime.ep import ShardedExperts
from themis_compile.runtime.experts import ExpertBank, expert_modules, wrapped_expert_list
from themis_compile.testing import run_multirank
from tests.passes import zoo_models as zoo
from tests.passes.test_zoo_training import _model as skewed_zoo_model
from tests.runtime.equivalence import global_losses, rank_state_dict

pytestmark = pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")

STEPS, SAVE_AT, BATCH, SEQ, LR = 4, 2, 8, 8, 1e-2
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# style -> (experts' list in the wrapper, policy that saves, policy that resumes, policy loading 1 -> 2)
# (DeepSpeed's wrapper is held and named the same way; the zoo matrix trains it under every policy.)
CASES = {
    "megatron": ("local_experts", "themis-rm", "ep", "themis"),
}


# ---------------------------------------------------------------------------------- one process
class _Wrapper(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.act = nn.GELU()
        self.local_experts = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
                                           for _ in range(n))


def test_what_counts_as_a_wrapper():
    w = _Wrapper()
    assert wrapped_expert_list(w) == ("local_experts", w.local_experts)
    assert expert_modules(w) == list(w.local_experts)
    assert wrapped_expert_list(w.local_experts) is None          # the list itself is no wrapper
    own = _Wrapper()
    own.scale = nn.Parameter(torch.ones(8))                       # a parameter of its own
    assert wrapped_expert_list(own) is None
    buffered = _Wrapper()
    buffered.register_buffer("counts", torch.zeros(4))            # state the sharded experts would lose
    assert wrapped_expert_list(buffered) is None
    two = _Wrapper()
    two.more = nn.ModuleList([nn.Linear(8, 8)])                   # parameters in two children
    assert wrapped_expert_list(two) is None
    with pytest.raises(ValueError, match="neither an nn.ModuleList"):
        ExpertBank(own)


def test_sharded_wrapper_keeps_the_users_names():
    torch.manual_seed(0)
    w = _Wrapper()
    bank = ExpertBank(w)
    assert (bank.list_name, bank.form, bank.num_experts) == ("local_experts", "modulelist", 4)
    assert bank.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert all(a is b for a, b in zip(bank.chunk(w, 2), w.local_experts[2].parameters()))
    full = {k: v.clone() for k, v in w.state_dict().items()}
    # Rank 1 of 2 (no process group is needed to hold and name experts): it owns experts 2 and 3.
    sharded = ShardedExperts(bank, w, Placement.contiguous(4, 2), rank=1, world_size=2)
    assert sharded.owned_experts() == [2, 3]
    assert sharded.expert(3) is w.local_experts[3]
    assert set(sharded.state_dict()) == {k for k in full if re.match(r"local_experts\.[23]\.", k)}
    with torch.no_grad():
        for p in sharded.parameters():
            p.zero_()
    result = sharded.load_state_dict(full, strict=True)           # the unmodified full state dict
    assert not result.missing_keys and not result.unexpected_keys
    assert all(torch.equal(v, full[k]) for k, v in sharded.state_dict().items())
    # An expert leaving and arriving (re-sharding) keeps the layout.
    moved = sharded.remove_expert(2)
    assert sharded.owned_experts() == [3]
    sharded.add_expert(2, bank.new_shard(list(moved.parameters())))
    assert set(sharded.state_dict()) == {k for k in full if re.match(r"local_experts\.[23]\.", k)}


# ---------------------------------------------------------------------------------- 2 ranks
def _config(policy: str) -> themis_compile.ThemisConfig:
    return themis_compile.ThemisConfig(policy=policy, reshard_interval=2, overlap_degree=8, materialization_budget=2)


def _build(style: str, policy: str | None):
    model = skewed_zoo_model(style)
    if policy is not None:
        model = themis_compile.optimize(model, _config(policy), strict=True)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, zoo.VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _train(model, opt, start: int, *, save=None) -> list[float]:
    return global_losses(model, opt, _batches(), lambda model, tokens: model.loss(tokens), start, save=save,
                         save_at=SAVE_AT)


def _load(model, opt, path: str, *, runtime_state: bool = True) -> None:
    model_sd, optim_sd = get_state_dict(model, opt, options=OPTIONS)
    if not runtime_state:
        optim_sd.pop(RUNTIME_STATE_KEY)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=OPTIONS)


def _two_ranks(rank, world_size, dirs):
    out = {}
    for style, (_, policy, other, from_unmodified_policy) in CASES.items():
        path = os.path.join(dirs["ckpt2"], style)
        record = {}

        def save(model, opt):
            model_sd, optim_sd = get_state_dict(model, opt, options=OPTIONS)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            runtime = themis_compile.api.runtime_of(model)
            record["placements"] = {n: layer.shard_placement.owners().tolist() for n, layer in runtime.layers.items()}
            record["moved"] = runtime.reshard_scheduler.moved
            record["keys"] = sorted(rank_state_dict(model))
            record["params"] = sorted(n for n, _ in model.named_parameters())

        model, opt = _build(style, policy)
        full = _train(model, opt, 0, save=save)
        del model, opt
        model, opt = _build(style, other)
        _load(model, opt, path)
        crossed = _train(model, opt, SAVE_AT)
        del model, opt
        model, opt = _build(style, from_unmodified_policy)
        _load(model, opt, os.path.join(dirs["unmodified"], style), runtime_state=False)
        from_unmodified = _train(model, opt, SAVE_AT)
        out[style] = dict(full=full, crossed=crossed, from_unmodified=from_unmodified, **record)
    return out


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("wrapped")
    dirs = {k: str(root / k) for k in ("unmodified", "ckpt2")}
    reference = {}
    for style in CASES:       # one process, the unmodified model, torch's own functions
        model, opt = _build(style, None)

        def save(model, opt, path=os.path.join(dirs["unmodified"], style)):
            model_sd, optim_sd = torch_get_state_dict(model, opt, options=OPTIONS)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, no_dist=True)

        reference[style] = _train(model, opt, 0, save=save)
    return dirs, reference, run_multirank(_two_ranks, 2, args=(dirs,), timeout_s=240)


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("style", list(CASES))
def test_state_dict_keys_are_the_users_under_the_wrapper(two_rank_run, style):
    _, reference, results = two_rank_run
    list_name = CASES[style][0]
    unmodified = set(zoo.ZooLM(style).state_dict())
    assert any(f".experts.{list_name}." in k for k in unmodified)
    per_rank = [set(r[style]["keys"]) for r in results]
    assert set.union(*per_rank) == unmodified
    assert results[0][style]["moved"] > 0           # experts changed owner before the save
    placements = results[0][style]["placements"]
    for key in unmodified:
        holders = [rank for rank, keys in enumerate(per_rank) if key in keys]
        m = re.search(rf"\.experts\.{list_name}\.(\d+)\.", key)
        if m:   # an expert: on its owner only, under the user's own name
            layer = key[:key.index(".experts.")]
            assert holders == [placements[layer][int(m.group(1))]], key
        else:
            assert holders == [0, 1], key
    for r in results:   # the optimizer sees parameters named as the unmodified model names them
        assert set(r[style]["params"]) <= unmodified
    # Training itself equals one process (the zoo matrix checks parameters too).
    assert _rel(results[0][style]["full"], reference[style]) < 1e-5


@pytest.mark.parametrize("style", list(CASES))
def test_resume_under_another_policy_and_from_unmodified(two_rank_run, style):
    _, reference, results = two_rank_run
    res = results[0][style]
    assert _rel(res["crossed"], res["full"][SAVE_AT:]) < 1e-6
    assert _rel(res["from_unmodified"], reference[style][SAVE_AT:]) < 1e-6


@pytest.mark.parametrize("style", list(CASES))
def test_checkpoint_loads_into_the_unmodified_model(two_rank_run, tmp_path, style):
    dirs, _, results = two_rank_run
    dcp_to_torch_save(os.path.join(dirs["ckpt2"], style), tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=False)
    model, opt = _build(style, None)
    model.load_state_dict(state["model"])       # strict: exactly the unmodified keys and shapes
    torch_set_state_dict(model, opt, model_state_dict={}, optim_state_dict=state["optim"], options=OPTIONS)
    assert _rel(_train(model, opt, SAVE_AT), results[0][style]["full"][SAVE_AT:]) < 1e-6
