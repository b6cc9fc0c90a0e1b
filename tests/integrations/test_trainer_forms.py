"""HF Trainer on models whose experts ``optimize`` moves into an experts child it creates, keeping the
user's state-dict keys through key maps: our own small HF models (``tests/integrations/custom_models.py``)
with experts as ``nn.ParameterList`` s ("param-lists"), as stacked parameters of the MoE block gathered by
id ("own-weights") and as those parameters indexed by expert id in a loop ("indexed-weights"). On 2 gloo ranks, 6 optimizer steps of 2 accumulated micro-batches with masked labels
and active clipping, for FSDP2 and DDP dense parallelism:

- ``ThemisTrainer`` equals plain ``Trainer`` on the unmodified model: every micro-batch's loss, the logged
  gradient norms, the whole trained model in the user's keys (dense parameters and every expert) and each
  rank's owned experts;
- ``trainer.save_model(dir)`` writes what ``from_pretrained(dir)`` of the unmodified class loads, with the
  user's keys and the trained weights;
- ``resume_from_checkpoint`` from the step-3 checkpoint continues to the uninterrupted run's result;
- (expected to fail) a model whose whole forward torch.fx can trace, optimized, still takes its optional
  arguments: today the schedule installs that trace, with the branches it took and a dict for the output.

All in one spawn of two ranks.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.integrations.trainer_runs import FORMS, MAX_NORM, forms_equivalence  # noqa: E402
from themis_compile.testing import run_multirank  # noqa: E402

DENSE = ["fsdp2", "ddp"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_multirank(forms_equivalence, 2, args=(str(tmp_path_factory.mktemp("forms")),), timeout_s=400)


def _assert_weights(got: dict, want: dict, *, rtol: float = 1e-4, atol: float = 5e-4) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=rtol, atol=atol, msg=key)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dense_parallel", DENSE)
def test_themis_trainer_equals_trainer(ranks, form, dense_parallel):
    ref_losses, ref_weights, ref_norms = ranks[0][(form, "reference")]
    owned = 0
    for rank in ranks:
        losses, weights, norms, expert_error, n_owned = rank[(form, dense_parallel)]
        assert len(losses) == len(ref_losses) == 12
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
        assert len(norms) == len(ref_norms) == 6
        for a, b in zip(norms, ref_norms):
            assert abs(a - b) <= 1e-4 * b and b > MAX_NORM, (norms, ref_norms)
        _assert_weights(weights, ref_weights)
        assert expert_error <= 5e-4
        owned += n_owned
    assert owned == 2 * 4           # every expert of both layers owned by exactly one rank


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dense_parallel", DENSE)
def test_save_model_loads_into_the_unmodified_class(ranks, form, dense_parallel):
    from tests.integrations.custom_models import CUSTOM_MODELS

    _, ref_weights, _ = ranks[0][(form, "reference")]
    cls, loaded = ranks[0][(form, dense_parallel, "exported")]
    assert cls is CUSTOM_MODELS[form]
    _assert_weights(loaded, ref_weights)
    trained = ranks[0][(form, dense_parallel)][1]
    _assert_weights(loaded, trained, rtol=0, atol=0)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dense_parallel", DENSE)
def test_resume_from_checkpoint_continues_the_run(ranks, form, dense_parallel):
    for rank in ranks:
        full_losses, full_weights, full_norms = rank[(form, dense_parallel)][:3]
        losses, weights, norms = rank[(form, dense_parallel, "resumed")]
        assert len(losses) == 6         # micro-batches of steps 4..6
        norms = norms[-3:]              # (the log history before them is the checkpoint's)
        for a, b in zip(losses + norms, full_losses[6:] + full_norms[3:]):
            assert abs(a - b) <= 1e-6 * abs(b), (losses, full_losses[6:], norms, full_norms[3:])
        _assert_weights(weights, full_weights, rtol=0, atol=1e-6)


@pytest.mark.parametrize("call", ["labels, num_items_in_batch", "labels", "no labels"])
def test_a_forward_traced_whole_keeps_its_optional_arguments(ranks, call):
    """A model whose whole forward torch.fx can trace, with optional arguments (labels, num_items_in_batch):
    the schedule does not install a trace of it (its branches on those arguments would be taken one way for
    good, its ModelOutput a plain dict) but schedules its children; every call computes what the unmodified
    model does."""
    for rank in ranks:
        result = rank["traced whole"][call]
        assert isinstance(result, float) and result <= 1e-5, result
