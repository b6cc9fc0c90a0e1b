"""HF ``transformers.Trainer`` for models optimized by themis_compile.

    from themis_compile.integrations.transformers import ThemisTrainer

    model = AutoModelForCausalLM.from_config(config)      # or from_pretrained, on every rank
    trainer = ThemisTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                            themis_config=themis.ThemisConfig())   # optimizes the model if it is not yet
    trainer.train()                                         # torchrun --nproc-per-node N train.py
    trainer.train(resume_from_checkpoint=True)              # continues from the latest checkpoint-*

It trains as ``Trainer`` trains the unmodified model at the same world size (same data order, losses,
``num_items_in_batch`` loss normalization, gradient accumulation, learning-rate schedule), with these
differences, each because ``Trainer``'s own way cannot hold for a model whose experts live on one rank each:

- *No DDP wrap.* The model is already data-parallel; its accelerator is a
  :class:`~themis_compile.integrations.accelerate.ThemisAccelerator` (autocast and ``torch_compile``
  still apply). A plain ``Trainer`` stops on every rank at its DDP wrap with an error naming this class.
- *Clipping* (``max_grad_norm``) and the logged ``grad_norm`` use :func:`themis_compile.clip_grad_norm_`:
  the norm of the whole model's gradient, equal on every rank.
- *Checkpoints.* ``checkpoint-N/`` holds the model in ``themis_model/`` and the optimizer in
  ``themis_optimizer/``, both ``torch.distributed.checkpoint`` directories in the unmodified model's keys
  and full shapes (``themis_compile.checkpoint``: every rank writes the experts it owns; loadable at any
  world size), next to Trainer's own files (``config.json``, scheduler, RNG states, ``trainer_state.json``).
  ``resume_from_checkpoint`` reads them back; the resumed run equals the uninterrupted one.
  ``save_model()`` (your call, after training) writes the whole trained model as a ``from_pretrained``
  directory: ``AutoModelForCausalLM.from_pretrained(output_dir)`` loads it into the unmodified class.
- ``load_best_model_at_end`` is refused (it reloads through ``from_pretrained`` files).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from transformers import Trainer

from themis_compile.api import optimize
from themis_compile.checkpoint import get_state_dict, save_pretrained, set_state_dict
from themis_compile.integrations import is_optimized
from themis_compile.integrations.accelerate import ThemisAccelerator

__all__ = ["ThemisTrainer", "MODEL_DIR", "OPTIMIZER_DIR"]

MODEL_DIR = "themis_model"            # a checkpoint's model state (DCP), in the unmodified model's keys
OPTIMIZER_DIR = "themis_optimizer"    # its optimizer state and the themis runtime's (DCP)
_SCHEDULER_NAME = "scheduler.pt"      # Trainer's own name for the scheduler's state
_TRAINING_ARGS_NAME = "training_args.bin"


class ThemisTrainer(Trainer):
    """``transformers.Trainer`` for a model optimized by themis_compile (see the module docstring).

    Args:
        model: an optimized model, or an unmodified one, which is then optimized with ``themis_config``
            (after ``args`` set up the process group, as torchrun's environment describes it).
        themis_config: the :class:`themis_compile.ThemisConfig` for that ``optimize``; default ``ThemisConfig()``.
        themis_optimize_kwargs: more keyword arguments of ``optimize`` (``example_inputs``, ``strict``).
        Every other argument is ``Trainer``'s.
    """

    def __init__(self, model=None, args=None, *trainer_args, themis_config=None, themis_optimize_kwargs=None,
                 **trainer_kwargs):
        if model is not None and not is_optimized(model):
            if args is not None:
                _ = args.device     # TrainingArguments initialises torch.distributed from torchrun's environment
            model = optimize(model, themis_config, **(themis_optimize_kwargs or {}))
        elif themis_config is not None:
            warnings.warn("ThemisTrainer: the model is already optimized; themis_config is not used", stacklevel=2)
        if args is not None and args.load_best_model_at_end:
            raise ValueError("ThemisTrainer: load_best_model_at_end is not supported (it reloads the model from "
                             "from_pretrained files); pass load_best_model_at_end=False")
        super().__init__(model, args, *trainer_args, **trainer_kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Trainer builds a plain Accelerator; ThemisAccelerator adds method overrides only, no state.
        self.accelerator.__class__ = ThemisAccelerator

    # ------------------------------------------------------------------ clipping
    def _clip_grad_norm(self, model):
        return self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), float("inf"))
        return super()._get_grad_norm(model, grad_norm)

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Called by you: the whole trained model as a ``from_pretrained`` directory (rank 0 writes
        safetensors and the config, :func:`themis_compile.checkpoint.save_pretrained`), the processing
        class and the training arguments beside it. Called by Trainer for a checkpoint: the model's state
        in the unmodified model's keys to ``output_dir/themis_model`` (DCP; every rank writes its experts),
        which ``resume_from_checkpoint`` reads. A collective either way: every rank calls it (Trainer
        does)."""
        if not is_optimized(self.model):
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call:
            model_sd, _ = get_state_dict(self.model, ())
            dcp.save({"model": model_sd}, checkpoint_id=os.path.join(output_dir, MODEL_DIR))
        else:
            save_pretrained(self.model, output_dir)
        if self.args.should_save:
            config = getattr(self.model, "config", None)
            if config is not None and _internal_call:
                config.save_pretrained(output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, _TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not is_optimized(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)
        _, optim_sd = get_state_dict(self.model, self._torch_optimizer())
        dcp.save({"optim": optim_sd}, checkpoint_id=os.path.join(output_dir, OPTIMIZER_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        model = model if model is not None else self.model
        if not is_optimized(model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, MODEL_DIR)
        if not os.path.isdir(path):
            raise ValueError(f"ThemisTrainer: {resume_from_checkpoint} has no {MODEL_DIR}/ (a checkpoint that "
                             f"ThemisTrainer wrote); cannot resume an optimized model from it")
        model_sd, _ = get_state_dict(model, ())
        dcp.load({"model": model_sd}, checkpoint_id=path)
        set_state_dict(model, (), model_state_dict=model_sd, optim_state_dict={})

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_optimized(self.model):
            return super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, OPTIMIZER_DIR)
        if not os.path.isdir(path):
            raise ValueError(f"ThemisTrainer: {checkpoint} has no {OPTIMIZER_DIR}/ (written unless "
                             f"save_only_model=True); cannot resume the optimizer from it")
        optimizer = self._torch_optimizer()
        _, optim_sd = get_state_dict(self.model, optimizer)
        dcp.load({"optim": optim_sd}, checkpoint_id=path)
        set_state_dict(self.model, optimizer, model_state_dict={}, optim_state_dict=optim_sd)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER_NAME), weights_only=True))

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        # accelerate's AcceleratedOptimizer holds the torch optimizer whose state the checkpoint functions read.
        return getattr(self.optimizer, "optimizer", self.optimizer)
