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

Dataloaders, optimizers and schedulers are prepared as always (each rank reads its own share of the
data). Saving: ``themis_compile.checkpoint.get_state_dict`` / ``set_state_dict`` with
``torch.distributed.checkpoint`` (``docs/checkpoint.md``); ``accelerator.save_state`` sees one rank's
experts only.
"""

from __future__ import annotations

import contextlib

from accelerate import Accelerator
from torch import nn

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
