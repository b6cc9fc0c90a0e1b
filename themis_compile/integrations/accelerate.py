"""HF accelerate: an ``Accelerator`` that trains optimized models as ``optimize`` returned them.

    from themis_compile.integrations.accelerate import ThemisAccelerator

    model = themis.optimize(model)                        # already data-parallel: experts sharded, dense FSDP2/DDP
    accelerator = ThemisAccelerator()                      # every Accelerator argument works as before
    model, opt, data = accelerator.prepare(model, torch.optim.AdamW(model.parameters()), data)
    for batch in data:
        with accelerator.no_sync(model) if accumulating else contextlib.nullcontext():
            accelerator.backward(model(**batch).loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)   # the global norm (themis.clip_grad_norm_)
        opt.step(); opt.zero_grad()

What changes against a plain ``Accelerator``, for optimized models only (every other model is prepared
as accelerate prepares it):

- ``prepare`` / ``prepare_model`` do not wrap the model in ``DistributedDataParallel`` (which an
  optimized model refuses: it would broadcast rank 0's experts over the others' and average gradients of
  different experts) and do not move it (place the model on its device before ``optimize``); autocast
  for mixed precision and ``torch.compile`` from the accelerator's settings still apply.
- ``clip_grad_norm_`` is :func:`themis_compile.clip_grad_norm_` once an optimized model was prepared:
  one norm over the whole model's gradient, equal on every rank (torch's sees this rank's experts only).
- ``no_sync`` defers FSDP2's gradient reduce-scatter (``set_requires_gradient_sync``) for a model whose
  dense part is FSDP2; under DDP-style dense parallelism every micro-batch is reduced (the same sum).
  The experts' SparseReduceScatter runs every backward: accumulated gradients are the same either way.

- ``save_state`` / ``load_state`` keep accelerate's files (RNG states, schedulers, dataloaders,
  registered objects) and write each optimized model with its optimizers as a
  ``torch.distributed.checkpoint`` directory ``themis_<i>/`` that every rank writes (accelerate's own
  model and optimizer files hold the main process's state only); ``get_state_dict`` is the whole model on
  the main process and ``save_model`` writes what ``from_pretrained`` loads
  (:func:`themis_compile.checkpoint.save_pretrained`).

Dataloaders, optimizers and schedulers are prepared as always (each rank reads its own share of the
data).
"""

from __future__ import annotations

import contextlib
import os

import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from torch import nn

from themis_compile.checkpoint import full_state_dict, get_state_dict, save_pretrained, set_state_dict

from themis_compile.integrations import is_optimized
from themis_compile.runtime.clip import clip_grad_norm_ as themis_clip_grad_norm_

__all__ = ["ThemisAccelerator", "prepare_optimized_model"]


def prepare_optimized_model(accelerator: Accelerator, model: nn.Module, *, evaluation_mode: bool = False):
    """What ``accelerator.prepare_model`` does to a model that is already data-parallel: autocast and
    compilation from the accelerator's settings, no ``DistributedDataParallel``, no device move.
    ``evaluation_mode`` is accepted for the signature's sake: there is no wrap to leave out."""
    del evaluation_mode
    if any(m is model for m in accelerator._models):     # prepared by this accelerator already
        return model
    model = Accelerator.prepare_model(accelerator, model, device_placement=False, evaluation_mode=True)
    _forget_prepared(model)
    return model


def _forget_prepared(model: nn.Module) -> None:
    # accelerate marks what it prepared so that no accelerator prepares it again; a plain Accelerator (or
    # Trainer) given this model later must reach its DDP wrap, which the optimized model refuses, rather
    # than train it unwrapped with torch's clipping.
    model.__dict__.pop("_is_accelerate_prepared", None)


class ThemisAccelerator(Accelerator):
    """``accelerate.Accelerator`` that keeps models optimized by themis_compile unwrapped, clips them with
    the global norm and defers FSDP2's reduction under ``no_sync`` (see the module docstring)."""

    def prepare(self, *args, device_placement=None):
        result = super().prepare(*args, device_placement=device_placement)
        for item in result if isinstance(result, tuple) else (result,):
            if isinstance(item, nn.Module) and is_optimized(item):
                _forget_prepared(item)
        return result

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if is_optimized(model):
            return prepare_optimized_model(self, model, evaluation_mode=evaluation_mode)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        if not any(is_optimized(m) for m in self._models):
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
        self.unscale_gradients()
        return themis_clip_grad_norm_(parameters, max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        from torch.distributed.fsdp import FSDPModule

        if not (is_optimized(model) and isinstance(model, FSDPModule)):
            with super().no_sync(model):
                yield
            return
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    # ------------------------------------------------------------------ whole model and checkpoints
    def get_state_dict(self, model: nn.Module, unwrap: bool = True):
        """The whole model's state dict on the main process (``{}`` elsewhere), as accelerate gives it
        for sharded models; a collective for an optimized model (every rank calls it)."""
        if not is_optimized(model):
            return super().get_state_dict(model, unwrap=unwrap)
        return full_state_dict(model, rank0_only=True, cpu_offload=True)

    def save_model(self, model: nn.Module, save_directory, **kwargs) -> None:
        """For an optimized model :func:`themis_compile.checkpoint.save_pretrained`: rank 0 writes what
        ``from_pretrained`` loads (an HF model) or ``model.pt``; a collective."""
        if not is_optimized(model):
            return super().save_model(model, save_directory, **kwargs)
        save_pretrained(model, save_directory)        # HF's own sharding and safetensors defaults

    def save_state(self, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs):
        """accelerate's ``save_state`` (RNG states, schedulers, dataloaders, registered objects, other
        models), with each optimized model and its optimizers in ``themis_<i>/`` instead: a
        ``torch.distributed.checkpoint`` directory in the unmodified model's keys that every rank writes
        (accelerate's own files hold the main process's state only, which is not an optimized model's)."""
        with self._optimized_apart() as parts:
            location = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        for i, (model, optimizers) in enumerate(parts):
            model_sd, optim_sd = get_state_dict(model, optimizers)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(location, f"themis_{i}"))
        return location

    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        """accelerate's ``load_state``, then each optimized model and its optimizers from ``themis_<i>/``
        (what `save_state` wrote)."""
        found: list[str] = []
        handle = self.register_load_state_pre_hook(lambda models, where: found.append(where))
        try:
            with self._optimized_apart() as parts:
                super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        finally:
            handle.remove()
        for i, (model, optimizers) in enumerate(parts):
            path = os.path.join(found[0], f"themis_{i}")
            if not os.path.isdir(path):
                raise ValueError(f"ThemisAccelerator.load_state: {found[0]} has no themis_{i}/ (written by "
                                 f"ThemisAccelerator.save_state for an optimized model)")
            model_sd, optim_sd = get_state_dict(model, optimizers)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
            set_state_dict(model, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd)

    @contextlib.contextmanager
    def _optimized_apart(self):
        """The prepared optimized models and the optimizers holding their parameters, taken out of the
        accelerator's lists for the duration; yields [(model, [torch optimizers])]."""
        models, optimizers = self._models, self._optimizers
        optimized = [m for m in models if is_optimized(m)]
        parts, taken = [], set()
        for model in optimized:
            ids = {id(p) for p in model.parameters()}
            mine = [o for o in optimizers if any(id(p) in ids for g in o.param_groups for p in g["params"])]
            taken |= {id(o) for o in mine}
            parts.append((model, [getattr(o, "optimizer", o) for o in mine]))
        self._models = [m for m in models if not is_optimized(m)]
        self._optimizers = [o for o in optimizers if id(o) not in taken]
        try:
            yield parts
        finally:
            self._models, self._optimizers = models, optimizers
