"""The whole trained model out of an optimized one (``themis_compile.checkpoint.full_state_dict``,
``get_state_dict`` with ``full_state_dict=True``, ``save_pretrained``), against the unmodified model
trained in one process on the global batch; and no partial state dict without an error.

Each case trains 3 AdamW steps on 2 gloo ranks with re-sharding every 2 steps (experts have moved from
their first owners), then exports. Models: the reference model with ModuleList experts and with
stacked experts, tiny HF Mixtral under FSDP2 and Qwen3-MoE under DDP dense parallelism
(``save_pretrained`` -> ``from_pretrained``). A rank's ``state_dict()`` and torch's full path must raise.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import themis_compile
from themis_compile.checkpoint import full_state_dict, get_state_dict, save_pretrained
from themis_compile.testing import run_multirank
from tests.runtime.equivalence import _batches, global_losses, make_model, make_optimizer, model_loss

pytestmark = pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")

STEPS, BATCH, SEQ = 3, 8, 16
MODELS = {
    "ref-loop": (dict(name="tiny-moe", router_skew=2.0, experts_form="loop", top_k=2, num_experts=6), "fsdp2"),
    "ref-stacked": (dict(name="tiny-moe", router_skew=2.0, experts_form="stacked", top_k=1, shared_expert=True),
                    "ddp"),
    "mixtral": (dict(hf="mixtral", num_experts=6), "fsdp2"),
    "qwen3-moe": (dict(hf="qwen3-moe", num_experts=8), "ddp"),
}
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _trained(name: str, policy: str | None):
    spec, dense = MODELS[name]
    model = make_model(spec)
    if policy is not None:
        model = themis_compile.optimize(model, themis_compile.ThemisConfig(
            policy=policy, dense_parallel=dense, reshard_interval=2, overlap_degree=8, materialization_budget=2))
    opt = make_optimizer(model.parameters(), "adamw")
    losses = global_losses(model, opt, _batches(STEPS, BATCH, SEQ, model.config.vocab_size), model_loss)
    return model, opt, losses


def _export(rank: int, world_size: int, name: str, out_dir: str) -> dict:
    model, opt, losses = _trained(name, "themis")
    record: dict = {"losses": losses}
    sd = full_state_dict(model)                                     # rank 0 only, on the CPU
    everywhere = full_state_dict(model, rank0_only=False)
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True))
    record["rank0_only_empty"] = rank == 0 or (sd == {} and model_sd == {} and optim_sd == {})
    record["everywhere"] = everywhere
    if rank == 0:
        record["full"] = sd
        record["get_state_dict_equal"] = sd.keys() == model_sd.keys() and all(
            torch.equal(model_sd[k], v) for k, v in sd.items())
        record["optim_keys"] = sorted(k for k in optim_sd if k.startswith("state."))
    # torch's own calls: the whole model, or an error naming what to call.
    for what, call in (("state_dict", model.state_dict),
                       ("torch_full", lambda: get_model_state_dict(model, options=FULL)),
                       ("torch_sharded", lambda: get_model_state_dict(model))):
        try:
            record[what] = ",".join(call())
        except RuntimeError as err:
            record[what] = f"raised: {err}"
    if MODELS[name][0].get("hf"):
        model.save_pretrained(out_dir)                                # collective; rank 0 writes
        if rank == 0:
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
            record["from_pretrained"] = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
    return record


def _reference(name: str):
    model, _, losses = _trained(name, None)
    return model, losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_full_model_equals_one_process(name, tmp_path):
    ref_model, ref_losses, ref_sd = _reference(name)
    ref_params = [n for n, _ in ref_model.named_parameters()]
    records = run_multirank(_export, 2, args=(name, str(tmp_path / "hf")), timeout_s=120)
    rank0 = records[0]
    for a, b in zip(rank0["losses"], ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (rank0["losses"], ref_losses)
    full = rank0["full"]
    assert list(full) == list(ref_sd), "the unmodified model's keys, in its order"
    for key, value in ref_sd.items():
        assert full[key].device.type == "cpu" and not full[key].requires_grad
        torch.testing.assert_close(full[key], value, rtol=1e-4, atol=5e-4, msg=key)
    assert rank0["get_state_dict_equal"]
    assert all(r["rank0_only_empty"] for r in records)
    for r in records:                                                  # rank0_only=False: on every rank
        assert r["everywhere"].keys() == full.keys()
        assert all(torch.equal(r["everywhere"][k], v) for k, v in full.items())
    # The full optimizer state: every trainable parameter's moments, whichever rank owned its expert.
    assert {k.rsplit(".", 1)[0] for k in rank0["optim_keys"]} == {f"state.{n}" for n in ref_params}
    # A rank's view is no state dict of the model: model.state_dict() and torch's full path raise (ModuleList
    # experts would be missing, stacked ones in the wrong rows); torch's sharded DCP path gives the view.
    for what in ("state_dict", "torch_full"):
        assert rank0[what].startswith("raised:") and "full_state_dict" in rank0[what], rank0[what]
    assert rank0["torch_sharded"] and not rank0["torch_sharded"].startswith("raised:")
    if "from_pretrained" in rank0:
        loaded = rank0["from_pretrained"]
        assert loaded.keys() == full.keys()
        for key, value in full.items():
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)
        # ... and in this process: from_pretrained gives the logits of the model trained in one process.
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
        tokens = _batches(1, 4, SEQ, ref_model.config.vocab_size, seed=7)[0]
        with torch.no_grad():
            torch.testing.assert_close(exported(input_ids=tokens).logits, ref_model(input_ids=tokens).logits,
                                       rtol=1e-4, atol=1e-4)


def _save_pretrained_refuses_state_dict(rank: int, world_size: int) -> str:
    model = themis_compile.optimize(make_model(MODELS["mixtral"][0]))
    try:
        save_pretrained(model, "/nonexistent", state_dict={})
    except TypeError as err:
        return str(err)
    return "no error"


def test_save_pretrained_gathers_its_own_state_dict():
    assert all("state_dict= cannot be given" in r for r in run_multirank(_save_pretrained_refuses_state_dict, 2))
