"""What the integration tests' ranks run: HF Trainer and accelerate loops on tiny HF MoE models, with and
without themis, and the wrappers an optimized model must refuse.

Every comparison is against the same stack on the unmodified model at the same world size (Trainer /
accelerate wrap it in DDP): the same data order, so per micro-batch losses and the parameters at the end
must agree (``tests.runtime.equivalence.assert_equivalent``).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

import themis_compile
from tests.runtime.equivalence import _dense_params, _expert_chunks_reference
from tests.runtime.equivalence import make_model as _make_hf_model

STEPS, ACCUM, BATCH, SEQ = 6, 2, 2, 16          # optimizer steps, micro-batches per step, per-rank rows
SAVE_AT = 3                                      # accelerate: save_state after this step, resume from it
MAX_NORM = 0.05                                 # below every step's norm: clipping is active (checked)
MODELS = {"mixtral": dict(hf="mixtral", num_experts=4), "qwen3-moe": dict(hf="qwen3-moe", num_experts=4)}
LR = {"mixtral": 1e-2, "qwen3-moe": 1e-3, "param-lists": 1e-2, "own-weights": 1e-2, "indexed-weights": 1e-2}
# Our own small HF models whose experts optimize moves into a child it creates (tests/integrations/custom_models.py),
# keyed by that rewrite; an expert size unlike the hidden size, so that each expert's two weights differ in shape.
FORMS = {form: dict(custom=form, expert_size=48) for form in ("param-lists", "own-weights", "indexed-weights")}


def make_model(spec: dict):
    """``tests.runtime.equivalence.make_model(spec)``, or with ``custom=form`` a model of
    ``tests.integrations.custom_models`` (the rest of ``spec`` its config)."""
    spec = dict(spec)
    form = spec.pop("custom", None)
    if form is None:
        return _make_hf_model(spec)
    from tests.integrations.custom_models import make_custom_model

    return make_custom_model(form, **spec)


def _spec(family: str) -> dict:
    return MODELS[family] if family in MODELS else FORMS[family]


def dataset(vocab: int = 128, rows: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Token rows whose labels mask a random share of positions (-100), so that micro-batches hold
    different numbers of label tokens and Trainer's ``num_items_in_batch`` normalization matters."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rows = rows or STEPS * ACCUM * BATCH * world
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, SEQ), generator=g)
    labels = ids.masked_fill(torch.rand(rows, SEQ, generator=g) < 0.3, -100)
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]


def _recording(trainer_cls):
    class Recording(trainer_cls):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.recorded.append(loss.item())
            return loss

    return Recording


def _args(out: str, family: str, **over):
    from transformers import TrainingArguments

    kw = dict(output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
              learning_rate=LR[family], max_grad_norm=MAX_NORM, logging_steps=1, save_strategy="no", report_to="none",
              use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    kw.update(over)
    return TrainingArguments(**kw)


def _global(losses: list[float]) -> list[float]:
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _grad_norms(trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def _owned(model) -> dict:
    runtime = themis_compile.api.runtime_of(model)
    return {(li, e): [t.detach().clone() for t in chunk]
            for li, experts in enumerate(runtime.layers.values()) for e, chunk in experts.local_chunks().items()}


def _reference_trainer(family: str, out: str):
    from transformers import Trainer

    trainer = _recording(Trainer)(model=make_model(_spec(family)), args=_args(out, family), train_dataset=dataset())
    trainer.recorded = []
    trainer.train()
    model = trainer.model
    _LAST_REFERENCE.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return (_global(trainer.recorded), _dense_params(model), _expert_chunks_reference(model)), _grad_norms(trainer)


_LAST_REFERENCE: list[dict] = []      # the reference run's final weights, taken by trainer_equivalence


def _themis_trainer(family: str, dense_parallel: str, out: str, **args_over):
    from themis_compile.integrations.transformers import ThemisTrainer

    trainer = _recording(ThemisTrainer)(model=make_model(_spec(family)), args=_args(out, family, **args_over),
                                        train_dataset=dataset(),
                                        themis_config=themis_compile.ThemisConfig(dense_parallel=dense_parallel))
    trainer.recorded = []
    return trainer


def trainer_equivalence(rank: int, world_size: int, out: str) -> dict:
    """Per family: Trainer on the unmodified model, ThemisTrainer with FSDP2 and with DDP dense
    parallelism (gradient accumulation, clipping active, masked labels); for Mixtral/FSDP2 also
    checkpoints at steps 3 and 6 and a resume from step 3; and a plain Trainer on an optimized model."""
    from transformers import Trainer

    results = {}
    for family in MODELS:
        results[(family, "reference")] = _reference_trainer(family, os.path.join(out, f"{family}-ref"))
        results[(family, "reference weights")] = _LAST_REFERENCE.pop()
        for dense_parallel in ("fsdp2", "ddp"):
            saving = family == "mixtral" and dense_parallel == "fsdp2"
            run_dir = os.path.join(out, f"{family}-{dense_parallel}")
            over = dict(save_strategy="steps", save_steps=3) if saving else {}
            trainer = _themis_trainer(family, dense_parallel, run_dir, **over)
            trainer.train()
            results[(family, dense_parallel)] = ((_global(trainer.recorded), _dense_params(trainer.model),
                                                  _owned(trainer.model), None), _grad_norms(trainer))
            # save_model(): the whole trained model as a from_pretrained directory, written by rank 0.
            trainer.save_model(os.path.join(run_dir, "final"))
            if rank == 0:
                from transformers import AutoModelForCausalLM

                loaded = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "final"), dtype=torch.float32)
                results[(family, dense_parallel, "exported")] = {k: v.detach().clone()
                                                                 for k, v in loaded.state_dict().items()}
            if saving:
                resumed = _themis_trainer(family, dense_parallel, run_dir, **over)
                resumed.train(resume_from_checkpoint=os.path.join(run_dir, "checkpoint-3"))
                results[(family, "resumed")] = ((_global(resumed.recorded), _dense_params(resumed.model),
                                                 _owned(resumed.model), None), _grad_norms(resumed))
    model = trainer.model       # Qwen3-MoE as ThemisTrainer trained it (DDP-dense): a plain Trainer refuses it
    try:
        Trainer(model=model, args=_args(os.path.join(out, "plain"), "mixtral"), train_dataset=dataset()).train()
        results["plain Trainer"] = "trained"
    except RuntimeError as e:
        results["plain Trainer"] = str(e)
    return results


def accelerate_equivalence(rank: int, world_size: int, out_dir: str) -> dict:
    """A hand-written accelerate loop (gradient accumulation under ``no_sync``, ``clip_grad_norm_``) on
    the unmodified model with a plain Accelerator, and on optimized ones with ThemisAccelerator (FSDP2 and
    DDP dense parallelism), with ``save_state`` after step SAVE_AT and a run resumed from it by
    ``load_state``; then what wrappers do to an optimized model: a plain ``Accelerator.prepare``
    and a ``DistributedDataParallel`` refuse (experts untouched), a block-level ``fully_shard`` makes the
    next forward refuse."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from themis_compile.integrations.accelerate import ThemisAccelerator

    def train(model, accelerator, *, save_dir=None, resume=False):
        """``save_dir``: ``accelerator.save_state`` there after step SAVE_AT; ``resume``: ``load_state``
        from it first and train the steps after SAVE_AT."""
        opt = torch.optim.AdamW(model.parameters(), lr=LR["mixtral"])
        loader = DataLoader(dataset(), batch_size=BATCH, shuffle=False)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        if resume:
            accelerator.load_state(save_dir)
        losses, norms = [], []
        for i, batch in enumerate(loader):
            if resume and i < SAVE_AT * ACCUM:
                continue
            if save_dir is not None and not resume and i == SAVE_AT * ACCUM:
                accelerator.save_state(save_dir)
            last = i % ACCUM == ACCUM - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                loss = model(**batch).loss / ACCUM
                accelerator.backward(loss)
            losses.append(loss.item())
            if last:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM).item())
                opt.step()
                opt.zero_grad()
        return losses, norms

    out = {}
    model = make_model(MODELS["mixtral"])
    losses, norms = train(model, Accelerator(cpu=True))
    out["reference"] = ((_global(losses), _dense_params(model), _expert_chunks_reference(model)), norms)
    for dense_parallel in ("fsdp2", "ddp"):
        model = themis_compile.optimize(make_model(MODELS["mixtral"]),
                                        themis_compile.ThemisConfig(dense_parallel=dense_parallel))
        save_dir = os.path.join(out_dir, f"accelerate-{dense_parallel}")
        losses, norms = train(model, ThemisAccelerator(cpu=True), save_dir=save_dir)
        out[dense_parallel] = ((_global(losses), _dense_params(model), _owned(model), None), norms)
        resumed = themis_compile.optimize(make_model(MODELS["mixtral"]),
                                          themis_compile.ThemisConfig(dense_parallel=dense_parallel))
        losses, norms = train(resumed, ThemisAccelerator(cpu=True), save_dir=save_dir, resume=True)
        out[("resumed", dense_parallel)] = ((_global(losses), _dense_params(resumed), _owned(resumed), None), norms)

        # The trained model under the wrappers it must refuse: each raises, and the experts stay as trained.
        before = _owned(model)
        errors = []
        for wrap in (lambda m: Accelerator(cpu=True).prepare(m), torch.nn.parallel.DistributedDataParallel):
            try:
                wrap(model)
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
        after = _owned(model)
        untouched = before.keys() == after.keys() and all(
            torch.equal(a, b) for key, chunk in after.items() for a, b in zip(chunk, before[key]))
        out[("wrapped", dense_parallel)] = errors, untouched

    from torch.distributed.fsdp import fully_shard

    fully_shard(model.model.layers[0])      # the DDP-dense model of the last round
    try:
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
        out["fully_shard"] = None
    except RuntimeError as e:
        out["fully_shard"] = str(e)
    return out


def integration_checks(rank: int, world_size: int, out: str) -> dict:
    """Everything of ``test_transformers.py`` in one spawn."""
    return {"trainer": trainer_equivalence(rank, world_size, out), "accelerate": accelerate_equivalence(rank, world_size, out)}


# --- Experts the rewrite moves into a child it creates (ParameterLists, stacked own weights) --------------

def _user_experts(model, form: str) -> dict[tuple[int, int], list[torch.Tensor]]:
    """Per (MoE layer, expert) of an unmodified custom model, the expert's weights in its block."""
    out = {}
    for li, layer in enumerate(model.layers):
        moe = layer.moe
        first, second = (moe.up, moe.down) if form == "param-lists" else (moe.w_in, moe.w_out)
        for e in range(len(first)):
            out[(li, e)] = [first[e].detach().clone(), second[e].detach().clone()]
    return out


def _expert_error(owned: dict, reference: dict) -> float:
    """The largest difference of each owned expert's tensors to the reference's (matched by shape: the
    experts child may list an expert's tensors in its own order); inf where one has no match."""
    worst = 0.0
    for key, tensors in owned.items():
        ref = {tuple(t.shape): t for t in reference[key]}
        for t in tensors:
            match = ref.get(tuple(t.shape))
            if match is None:
                return float("inf")
            worst = max(worst, (t.detach() - match).abs().max().item())
    return worst


def _whole(model) -> dict[str, torch.Tensor]:
    """Every rank: the whole model in the user's keys (``themis_compile.checkpoint.full_state_dict``)."""
    from themis_compile.checkpoint import full_state_dict

    return full_state_dict(model, rank0_only=False)


def forms_equivalence(rank: int, world_size: int, out: str) -> dict:
    """Per custom form: Trainer on the unmodified model, then ThemisTrainer with FSDP2 and with DDP dense
    parallelism (checkpoints at steps 3 and 6), the trained model through ``save_model`` and
    ``from_pretrained`` on the unmodified class, and a run resumed from step 3."""
    from transformers import Trainer

    from tests.integrations.custom_models import CUSTOM_MODELS

    results = {}
    for form in FORMS:
        ref = _recording(Trainer)(model=make_model(FORMS[form]), args=_args(os.path.join(out, f"{form}-ref"), form),
                                  train_dataset=dataset())
        ref.recorded = []
        ref.train()
        reference = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
        results[(form, "reference")] = (_global(ref.recorded), reference, _grad_norms(ref))
        experts = _user_experts(ref.model, form)
        for dense_parallel in ("fsdp2", "ddp"):
            run_dir = os.path.join(out, f"{form}-{dense_parallel}")
            over = dict(save_strategy="steps", save_steps=SAVE_AT)
            trainer = _themis_trainer(form, dense_parallel, run_dir, **over)
            trainer.train()
            results[(form, dense_parallel)] = (_global(trainer.recorded), _whole(trainer.model), _grad_norms(trainer),
                                               _expert_error(_owned(trainer.model), experts),
                                               len(_owned(trainer.model)))
            trainer.save_model(os.path.join(run_dir, "final"))
            if rank == 0:
                loaded = CUSTOM_MODELS[form].from_pretrained(os.path.join(run_dir, "final"))
                results[(form, dense_parallel, "exported")] = (type(loaded), {
                    k: v.detach().clone() for k, v in loaded.state_dict().items()})
            resumed = _themis_trainer(form, dense_parallel, run_dir, **over)
            resumed.train(resume_from_checkpoint=os.path.join(run_dir, f"checkpoint-{SAVE_AT}"))
            results[(form, dense_parallel, "resumed")] = (_global(resumed.recorded), _whole(resumed.model),
                                                          _grad_norms(resumed))
    results["traced whole"] = _traced_whole_forward()
    return results


def _traced_whole_forward() -> dict[str, object]:
    """A model whose whole forward torch.fx traces, optimized: its loss with labels and num_items_in_batch,
    with labels alone and its logits without labels, each against the unmodified model's (the largest
    difference), or the error the call raised."""
    from tests.integrations.custom_models import TinyMoEConfig, TraceableListedMoEForCausalLM

    torch.manual_seed(0)
    plain = TraceableListedMoEForCausalLM(TinyMoEConfig(expert_size=48))
    torch.manual_seed(0)
    model = themis_compile.optimize(TraceableListedMoEForCausalLM(TinyMoEConfig(expert_size=48)))
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(2))
    calls = {"labels, num_items_in_batch": (dict(labels=ids, num_items_in_batch=torch.tensor(20)), "loss"),
             "labels": (dict(labels=ids), "loss"), "no labels": ({}, "logits")}
    out = {}
    for name, (kwargs, field) in calls.items():
        try:
            got = getattr(model(input_ids=ids, **kwargs), field)
            want = getattr(plain(input_ids=ids, **kwargs), field)
            out[name] = (got.detach() - want.detach()).abs().max().item()
        except Exception as e:  # noqa: BLE001 - reported by the test
            out[name] = f"{type(e).__name__}: {e}"
    return out
