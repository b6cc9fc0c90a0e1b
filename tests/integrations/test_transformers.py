"""HF Trainer and accelerate on optimized models, against the same stack on the unmodified model at the
same world size (2 gloo ranks; tiny HF Mixtral and Qwen3-MoE; 6 optimizer steps of 2 accumulated
micro-batches with masked labels, so that ``num_items_in_batch`` normalization and gradient accumulation
matter; ``max_grad_norm`` below every step's norm, so that clipping is active):

- ``ThemisTrainer`` with FSDP2 and with DDP dense parallelism: every micro-batch's loss, the logged
  gradient norms, the dense parameters and each rank's owned experts at the end equal plain ``Trainer``'s
  (which wraps the unmodified model in DDP); checkpoints at steps 3 and 6 and a resume from step 3 give
  the uninterrupted run's losses and weights;
- a plain ``Trainer`` on an optimized model stops at its DDP wrap with an error naming ThemisTrainer;
- a hand-written accelerate loop (``no_sync`` accumulation, ``clip_grad_norm_``) with ``ThemisAccelerator``
  equals a plain ``Accelerator`` on the unmodified model, for both dense parallelisms;
- a plain ``Accelerator.prepare`` and a ``DistributedDataParallel`` of an optimized model raise on every
  rank and leave its experts as they were; a block-level ``fully_shard`` makes the next forward raise.

All in one spawn of two ranks (the checks share the ranks' start-up).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tests.integrations.trainer_runs import MAX_NORM, MODELS, integration_checks  # noqa: E402
from tests.runtime.equivalence import assert_equivalent  # noqa: E402
from themis_compile.testing import run_multirank  # noqa: E402

HINT = "themis_compile.integrations.transformers.ThemisTrainer"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_multirank(integration_checks, 2, args=(str(tmp_path_factory.mktemp("trainer")),), timeout_s=400)


def _per_rank(ranks, part, key):
    """(reference-style result, grad norms) of every rank for one run."""
    return [r[part][key] for r in ranks]


def _assert_run_equal(ranks, part, key, reference_key, **tolerances):
    reference, ref_norms = ranks[0][part][reference_key]
    runs = _per_rank(ranks, part, key)
    assert_equivalent(reference, [result for result, _ in runs], **tolerances)
    for _, norms in runs:
        assert len(norms) == len(ref_norms) == 6
        for a, b in zip(norms, ref_norms):
            assert abs(a - b) <= 1e-4 * b and b > MAX_NORM, (norms, ref_norms)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("dense_parallel", ["fsdp2", "ddp"])
def test_themis_trainer_equals_trainer(ranks, family, dense_parallel):
    _assert_run_equal(ranks, "trainer", (family, dense_parallel), (family, "reference"))


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("dense_parallel", ["fsdp2", "ddp"])
def test_save_model_writes_what_from_pretrained_loads(ranks, family, dense_parallel):
    """ThemisTrainer.save_model(): from_pretrained loads the trained weights, every expert included."""
    reference = ranks[0]["trainer"][(family, "reference weights")]
    exported = ranks[0]["trainer"][(family, dense_parallel, "exported")]
    assert exported.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(exported[key], value, rtol=1e-4, atol=5e-4, msg=key)


def _assert_same_weights(dense, owned, full_dense, full_owned) -> None:
    """A resumed run's weights are the uninterrupted run's within 1e-6: every owned expert, every dense one."""
    assert owned.keys() == full_owned.keys()
    for key in owned:
        for a, b in zip(owned[key], full_owned[key]):
            assert (a - b).abs().max() <= 1e-6
    for name in dense:
        assert (dense[name] - full_dense[name]).abs().max() <= 1e-6, name


@pytest.mark.parametrize("dense_parallel", ["fsdp2", "ddp"])
def test_accelerate_load_state_continues_the_run(ranks, dense_parallel):
    """ThemisAccelerator.save_state after step 3, then load_state into a fresh optimized model: steps 4..6
    are the uninterrupted run's (losses, norms, weights)."""
    for rank in ranks:
        (full_losses, full_dense, full_owned, _), full_norms = rank["accelerate"][dense_parallel]
        (losses, dense, owned, _), norms = rank["accelerate"][("resumed", dense_parallel)]
        assert len(losses) == len(full_losses) // 2
        for a, b in zip(losses + norms, full_losses[len(full_losses) // 2:] + full_norms[3:]):
            assert abs(a - b) <= 1e-6 * abs(b), (losses, full_losses)
        _assert_same_weights(dense, owned, full_dense, full_owned)


def test_resume_from_checkpoint_continues_the_run(ranks):
    for rank in ranks:
        (full_losses, full_dense, full_owned, _), _ = rank["trainer"][("mixtral", "fsdp2")]
        (losses, dense, owned, _), _ = rank["trainer"][("mixtral", "resumed")]
        assert len(losses) == 6        # micro-batches of steps 4..6
        for a, b in zip(losses, full_losses[6:]):
            assert abs(a - b) <= 1e-6 * abs(b), (losses, full_losses)
        _assert_same_weights(dense, owned, full_dense, full_owned)


def test_plain_trainer_refuses_an_optimized_model(ranks):
    for rank in ranks:
        message = rank["trainer"]["plain Trainer"]
        assert "must not make it data-parallel again" in message and HINT in message


@pytest.mark.parametrize("dense_parallel", ["fsdp2", "ddp"])
def test_themis_accelerator_equals_accelerator(ranks, dense_parallel):
    _assert_run_equal(ranks, "accelerate", dense_parallel, "reference")


@pytest.mark.parametrize("dense_parallel", ["fsdp2", "ddp"])
def test_wrappers_refuse_and_leave_experts_untouched(ranks, dense_parallel):
    for rank in ranks:
        errors, untouched = rank["accelerate"][("wrapped", dense_parallel)]
        assert len(errors) == 2
        for message in errors:      # accelerate's prepare, then DistributedDataParallel itself
            assert message is not None and "DistributedDataParallel must not make it data-parallel" in message
            assert "ThemisAccelerator" in message and HINT in message
        assert untouched


def test_second_fully_shard_refused_at_the_next_forward(ranks):
    for rank in ranks:
        message = rank["accelerate"]["fully_shard"]
        assert message is not None and "fully_shard (on model.layers.0) must not make it data-parallel" in message
