"""Checkpoints of optimized models through torch.distributed.checkpoint, in the unmodified model's keys.

Each model trains 6 AdamW steps with re-sharding every 2 steps (experts have moved when the checkpoint is
taken after step 3); the checkpoint must
- hold the unmodified model's keys and full shapes, every expert chunk written by its owner at the save;
- resume at the same world size (4 ranks as 2 nodes x 2 here; 2 and 4 ranks for every model and policy
  in test_train_matrix.py) bit for bit (placement, predictor windows, iteration
  counters and re-sharding schedule restored), and at another world size or under another policy within
  1e-6 of the uninterrupted run;
- load into the unmodified model in one process (``dcp_to_torch_save``), and an unmodified model's
  checkpoint must load into an optimized one.

Models: the reference model with ModuleList experts and with stacked [E, ...] experts, and tiny HF
Mixtral, Qwen3-MoE and DeepSeek-V3 (stacked ``gate_up_proj``; DeepSeek-V3 with its shared experts and
group-limited sigmoid routing), each saved and loaded under a different pairing of policies. Spawned groups are shared: one run on 2 ranks, one on 4 ranks as
2 nodes x 2, and one more on 2 ranks for 4 -> 2.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict
from torch.distributed.checkpoint.state_dict import set_state_dict as torch_set_state_dict

import themis_compile
from themis_compile.checkpoint import RUNTIME_STATE_KEY, get_state_dict, set_state_dict
from themis_compile.planner import Placement
from themis_compile.runtime.ep import expert_sharded_tensor
from themis_compile.testing import run_multirank
from tests.runtime.equivalence import _batches, global_losses, make_model, make_optimizer, model_loss, rank_state_dict

pytestmark = pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")

STEPS, SAVE_AT, BATCH, SEQ = 6, 3, 8, 16
MODELS = {
    "ref-loop": dict(name="tiny-moe", router_skew=2.0, experts_form="loop", top_k=2, num_experts=6),
    "ref-stacked": dict(name="tiny-moe", router_skew=2.0, experts_form="stacked", top_k=1, shared_expert=True),
    "mixtral": dict(hf="mixtral", num_experts=6),
    "qwen3-moe": dict(hf="qwen3-moe", num_experts=8),
    "deepseek-v3": dict(hf="deepseek-v3", num_experts=8),
}
# model -> (policy that saves, policy that loads the same checkpoint, policy that loads the unmodified
# model's checkpoint, policy of the 4-rank load, optimizer state dict flattened as torchtitan does)
CASES = {
    "ref-loop": ("themis", "ep", "themis-rm", "themis-rm", True),
    "ref-stacked": ("themis-rm", "themis", "ep", "themis", False),
    "mixtral": ("themis", "themis-rm", "themis", "ep", True),
    "qwen3-moe": ("themis-rm", "ep", "themis", "themis", False),
    "deepseek-v3": ("themis", "ep", "themis-rm", "ep", True),
}
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
NESTED = StateDictOptions()


def _config(policy: str) -> themis_compile.ThemisConfig:
    # t and m fixed: profiled budgets would make the plans depend on timing.
    return themis_compile.ThemisConfig(policy=policy, reshard_interval=2, overlap_degree=8, materialization_budget=2)


def _build(name: str, policy: str | None):
    model = make_model(MODELS[name])
    if policy is not None:
        model = themis_compile.optimize(model, _config(policy))
    return model, make_optimizer(model.parameters(), "adamw")


def _train(model, opt, start: int, stop: int, *, save=None) -> list[float]:
    """Global losses of steps [start, stop); ``save(model, opt)`` runs before step SAVE_AT."""
    return global_losses(model, opt, _batches(stop, BATCH, SEQ, model.config.vocab_size), model_loss, start,
                         save=save, save_at=SAVE_AT)


def _save(path: str, options, record: dict | None = None):
    def save(model, opt):
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        if record is not None:
            # torch's own functions: the same model keys; the same optimizer keys for ModuleList
            # experts (stacked experts' optimizer state needs themis_compile.checkpoint).
            torch_model_sd, torch_optim_sd = torch_get_state_dict(model, opt, options=options)
            record["torch_same_keys"] = (set(torch_model_sd) == set(model_sd),
                                         _optim_keys(torch_optim_sd) == _optim_keys(optim_sd))
            runtime = themis_compile.api.runtime_of(model)
            record["placements"] = {n: layer.shard_placement.owners().tolist() for n, layer in runtime.layers.items()}
            record["moved"] = 0 if runtime.reshard_scheduler is None else runtime.reshard_scheduler.moved
            # What rank_state_dict(model) holds on this rank: keys and (global) shapes.
            record["state_dict"] = {k: _shape(v) for k, v in rank_state_dict(model).items()}
    return save


def _optim_keys(optim_sd: dict) -> set[str]:
    keys = set(optim_sd["state"]) if "state" in optim_sd else set(optim_sd)
    return keys - {RUNTIME_STATE_KEY}


def _shape(v) -> tuple[int, ...]:
    return tuple(v.metadata().size) if hasattr(v, "local_shards") else tuple(v.shape)


def _load(model, opt, path: str, options, *, runtime_state: bool = True) -> None:
    scheduler = themis_compile.api.runtime_of(model).reshard_scheduler
    steps = None if scheduler is None else scheduler.steps
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    # torch's zero-lr step that created the fresh optimizer's state is no step of the schedule
    assert scheduler is None or scheduler.steps == steps
    if not runtime_state:      # a checkpoint of the unmodified model has no runtime state
        optim_sd.pop(RUNTIME_STATE_KEY)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)


def _placements(model) -> dict[str, list[int]]:
    layers = themis_compile.api.runtime_of(model).layers
    return {n: layer.shard_placement.owners().tolist() for n, layer in layers.items()}


def _runtime_view(model) -> dict:
    """Placements, iteration counters, predictions and the re-sharding schedule at the end of a run."""
    runtime = themis_compile.api.runtime_of(model)
    scheduler = runtime.reshard_scheduler
    return {"placements": _placements(model),
            "iterations": [getattr(layer, "iteration", None) for layer in runtime.layers.values()],
            "predictions": [layer.predictor.predict(0).tolist() for layer in runtime.layers.values()
                            if hasattr(layer, "predictor")],
            "schedule": None if scheduler is None else scheduler.state_dict()}


# ---------------------------------------------------------------------------------- 2 ranks
def _two_ranks(rank, world_size, dirs):
    out = {}
    for name, (policy, other, unmod_policy, _, flat) in CASES.items():
        options = FLAT if flat else NESTED
        path = os.path.join(dirs["ckpt2"], name)
        record: dict = {}
        model, opt = _build(name, policy)
        full = _train(model, opt, 0, STEPS, save=_save(path, options, record))
        del model, opt
        # (Resuming at 2 ranks under the same policy: test_train_matrix.py, for every model and policy.)
        model, opt = _build(name, other)
        _load(model, opt, path, options)
        crossed = _train(model, opt, SAVE_AT, STEPS)
        del model, opt
        model, opt = _build(name, unmod_policy)
        _load(model, opt, os.path.join(dirs["unmodified"], name), options, runtime_state=False)
        from_unmodified = _train(model, opt, SAVE_AT, STEPS)
        del model, opt
        out[name] = dict(full=full, crossed=crossed, from_unmodified=from_unmodified, **record)
    return out


def _unmodified_checkpoints(root: str) -> dict[str, list[float]]:
    """One process, unmodified models, torch's own functions: the reference losses and checkpoints."""
    losses = {}
    for name, (*_, flat) in CASES.items():
        options = FLAT if flat else NESTED
        model, opt = _build(name, None)

        def save(model, opt, path=os.path.join(root, name)):
            model_sd, optim_sd = torch_get_state_dict(model, opt, options=options)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, no_dist=True)

        losses[name] = _train(model, opt, 0, STEPS, save=save)
    return losses


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    dirs = {k: str(root / k) for k in ("unmodified", "ckpt2", "ckpt4")}
    reference = _unmodified_checkpoints(dirs["unmodified"])
    results = run_multirank(_two_ranks, 2, args=(dirs,), timeout_s=240)
    return dirs, reference, results


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_has_unmodified_keys_and_shapes(two_rank_run, name):
    dirs, _, results = two_rank_run
    unmodified = {k: tuple(v.shape) for k, v in make_model(MODELS[name]).state_dict().items()}
    per_rank = [r[name]["state_dict"] for r in results]
    union = {k: s for sd in per_rank for k, s in sd.items()}
    assert union == unmodified
    for key in unmodified:
        holders = [rank for rank, sd in enumerate(per_rank) if key in sd]
        m = re.search(r"\.experts\.(\d+)\.", key)
        if m:   # a ModuleList expert: on its owner only (experts have moved: not the contiguous owner)
            layer = key[:key.index(".experts.")]
            assert holders == [results[0][name]["placements"][layer][int(m.group(1))]], key
        else:
            assert holders == [0, 1], key
    assert results[0][name]["moved"] > 0
    stacked = MODELS[name].get("experts_form") == "stacked" or "hf" in MODELS[name]
    assert all(r[name]["torch_same_keys"] == (True, not stacked) for r in results)
    # The checkpoint itself: the unmodified keys and full shapes, each expert chunk written by its owner.
    metadata = dcp.FileSystemReader(os.path.join(dirs["ckpt2"], name)).read_metadata()
    saved = {k[len("model."):]: tuple(md.size) for k, md in metadata.state_dict_metadata.items()
             if k.startswith("model.")}
    assert saved == unmodified
    placements = results[0][name]["placements"]
    for index, info in metadata.storage_data.items():
        layer = next((lay for lay in placements if f"{lay}.experts." in index.fqn), None)
        if layer is None:
            continue
        m = re.search(r"\.experts\.(\d+)\.", index.fqn)
        if m:
            e = int(m.group(1))
        elif index.offset:      # a chunk of a stacked weight or of its optimizer state
            e = index.offset[0]
        else:                   # shared by the stacked weight's experts (Adam's step, param groups)
            continue
        writer = int(re.match(r"__(\d+)_", info.relative_path).group(1))
        assert writer == placements[layer][e], (index, info.relative_path)


@pytest.mark.parametrize("name", list(CASES))
def test_load_under_another_policy_and_from_unmodified(two_rank_run, name):
    _, reference, results = two_rank_run
    res = results[0][name]
    assert _rel(res["crossed"], res["full"][SAVE_AT:]) < 1e-6
    # 1 -> 2: the unmodified model's checkpoint (one process) continues as the unmodified model does.
    assert _rel(res["from_unmodified"], reference[name][SAVE_AT:]) < 1e-6


@pytest.mark.parametrize("name", list(CASES))
def test_load_into_unmodified_model(two_rank_run, tmp_path, name):
    dirs, _, results = two_rank_run
    *_, flat = CASES[name]
    options = FLAT if flat else NESTED
    dcp_to_torch_save(os.path.join(dirs["ckpt2"], name), tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=False)
    model, opt = _build(name, None)
    model.load_state_dict(state["model"])       # strict: exactly the unmodified keys and shapes
    torch_set_state_dict(model, opt, model_state_dict={}, optim_state_dict=state["optim"], options=options)
    assert _rel(_train(model, opt, SAVE_AT, STEPS), results[0][name]["full"][SAVE_AT:]) < 1e-6


# ---------------------------------------------------------------------------------- 4 ranks (2 nodes x 2)
FOUR_SAVES = ("ref-stacked",)


def _four_ranks(rank, world_size, dirs):
    out = {}
    for name, (*_, policy4, flat) in CASES.items():
        options = FLAT if flat else NESTED
        model, opt = _build(name, policy4)
        _load(model, opt, os.path.join(dirs["ckpt2"], name), options)
        out[name] = {"loaded": _train(model, opt, SAVE_AT, STEPS)}
        del model, opt
    for name in FOUR_SAVES:
        options = FLAT if CASES[name][-1] else NESTED
        path = os.path.join(dirs["ckpt4"], name)
        record: dict = {}
        model, opt = _build(name, "themis")
        out[name]["full"] = _train(model, opt, 0, STEPS, save=_save(path, options, record))
        out[name]["end"] = _runtime_view(model)
        del model, opt
        model, opt = _build(name, "themis")
        _load(model, opt, path, options)
        out[name]["adopted"] = _placements(model) == record["placements"]
        out[name]["resumed"] = _train(model, opt, SAVE_AT, STEPS)
        out[name]["resumed_end"] = _runtime_view(model)
    return out


@pytest.fixture(scope="module")
def four_rank_run(two_rank_run):
    dirs, _, _ = two_rank_run
    return run_multirank(_four_ranks, 4, args=(dirs,), devices_per_node=2, timeout_s=240)


@pytest.mark.parametrize("name", list(CASES))
def test_two_to_four(two_rank_run, four_rank_run, name):
    _, _, results = two_rank_run
    assert _rel(four_rank_run[0][name]["loaded"], results[0][name]["full"][SAVE_AT:]) < 1e-6


def test_resume_is_exact_on_two_nodes(four_rank_run):
    for r in four_rank_run:
        for name in FOUR_SAVES:
            res = r[name]
            assert res["adopted"]
            assert res["resumed"] == res["full"][SAVE_AT:]
            assert res["resumed_end"] == res["end"]


def _four_to_two(rank, world_size, dirs):
    # A rank that owns no expert of a layer holds no chunk of its stacked weights (and builds the sharded
    # tensor without communicating).
    shard = Placement.from_owners([0, 0, 0], world_size)
    tensors_E = {e: torch.full((2,), float(e)) for e in range(3)} if rank == 0 else {}
    weight = expert_sharded_tensor(tensors_E, shard, ((2,), torch.float32), dist.group.WORLD)
    dcp.save({"w": weight}, checkpoint_id=os.path.join(dirs["ckpt4"], "one-owner"))
    out = {}
    for name in FOUR_SAVES:
        policy = CASES[name][0]
        options = FLAT if CASES[name][-1] else NESTED
        model, opt = _build(name, policy)
        _load(model, opt, os.path.join(dirs["ckpt4"], name), options)
        out[name] = _train(model, opt, SAVE_AT, STEPS)
    return out


def test_four_to_two(two_rank_run, four_rank_run, tmp_path):
    dirs, _, _ = two_rank_run
    results = run_multirank(_four_to_two, 2, args=(dirs,), timeout_s=240)
    for name in FOUR_SAVES:
        assert _rel(results[0][name], four_rank_run[0][name]["full"][SAVE_AT:]) < 1e-6
    dcp_to_torch_save(os.path.join(dirs["ckpt4"], "one-owner"), tmp_path / "one-owner.pt")
    torch.testing.assert_close(torch.load(tmp_path / "one-owner.pt")["w"],
                               torch.arange(3.0)[:, None].expand(3, 2), rtol=0, atol=0)


# ---------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("name", ["ref-loop", "ref-stacked"])
def test_one_process_optimized_model_speaks_unmodified_keys(name, tmp_path):
    """Without a process group one rank owns every expert: ``state_dict`` is the unmodified model's,
    and ``load_state_dict`` takes the unmodified model's own state dict."""
    unmodified = make_model(MODELS[name])
    with torch.no_grad():
        for p in unmodified.parameters():
            p.add_(0.01)
    model, opt = _build(name, "themis")
    assert {k: tuple(v.shape) for k, v in rank_state_dict(model).items()} == \
        {k: tuple(v.shape) for k, v in unmodified.state_dict().items()}
    model.load_state_dict(unmodified.state_dict())
    for key, value in rank_state_dict(model).items():
        torch.testing.assert_close(value, unmodified.state_dict()[key], rtol=0, atol=0, msg=key)
    tokens = _batches(1, 2, SEQ, model.config.vocab_size)[0]
    torch.testing.assert_close(model_loss(model, tokens), model_loss(unmodified, tokens))
    # One step each, then torch's functions on the unmodified model and ours on the optimized one (also
    # through torch.compile's wrapper) name the same model and optimizer entries with the same shapes.
    unmodified_opt = make_optimizer(unmodified.parameters(), "adamw")
    for m, o in ((model, opt), (unmodified, unmodified_opt)):
        model_loss(m, tokens).backward()
        o.step()
    expected = _entries(*torch_get_state_dict(unmodified, unmodified_opt, options=FLAT))
    assert _entries(*get_state_dict(model, opt, options=FLAT)) == expected
    if name == "ref-stacked":   # stacked weights are found by module path, here under _orig_mod
        assert _entries(*get_state_dict(torch.compile(model), opt, options=FLAT)) == expected
    # A state dict of another expert count, or without one expert, is refused by name.
    if name == "ref-stacked":
        bad = {k: v[:3] if k.endswith("experts.w1_EFH") else v for k, v in unmodified.state_dict().items()}
        match = r"experts\.w1_EFH: expected a stacked tensor of 8 experts, got \(3,"
    else:
        bad = {k: v for k, v in unmodified.state_dict().items() if ".experts.5." not in k}
        match = r"Missing key\(s\).*experts\.5\.w1\.weight"
    with pytest.raises(RuntimeError, match=match):
        model.load_state_dict(bad)


def _entries(model_sd: dict, optim_sd: dict) -> dict[str, tuple]:
    out = {f"model.{k}": _shape(v) for k, v in model_sd.items()}
    out.update({f"optim.{k}": _shape(v) if torch.is_tensor(v) or hasattr(v, "local_shards") else v
                for k, v in optim_sd.items() if k != RUNTIME_STATE_KEY})
    return out


def test_runtime_state_keeps_owners_and_reads_the_older_matrix() -> None:
    """The runtime state saves each layer's shard placement as its owners [E] (an [E][D] matrix is 4M
    entries at 1,024 ranks); a state written with the matrix still loads to the same placement."""
    from themis_compile.checkpoint import _saved_shard
    from themis_compile.planner import Placement

    shard = Placement.from_owners([2, 0, 1, 1], 3)
    assert _saved_shard({"shard_owners": shard.owners().tolist()}, (4, 3)) == shard
    assert _saved_shard({"shard_placement": shard.mask.astype(int).tolist()}, (4, 3)) == shard
    with pytest.raises(ValueError, match="do not fit"):
        _saved_shard({"shard_owners": [0, 1, 5, 0]}, (4, 3))
