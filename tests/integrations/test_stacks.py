"""Lightning and torchtitan: their parallelize functions train the tiny HF Mixtral on 2 gloo ranks as one
process trains it on the whole global batch (4 steps; losses per step, dense parameters and each rank's
owned experts at the end):

- Lightning Fabric's ``ModelParallelStrategy(parallelize_fn=themis_compile.integrations.lightning.parallelize,
  data_parallel_size=2, tensor_parallel_size=1)`` (FSDP2 dense parallelism), through ``fabric.backward``;
- ``themis_compile.integrations.torchtitan.parallelize(model, parallel_dims, job_config)`` with a stand-in
  for torchtitan's ``ParallelDims`` (torchtitan is not installable here) replicating data parallelism
  (DDP dense parallelism);
- and the refusals: a mesh with tensor parallelism, a ``parallel_dims`` with TP, and data parallelism over
  fewer ranks than the world, each raising before anything changes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from tests.integrations.stack_runs import BATCH, MIXTRAL, SEQ, STEPS, stacks  # noqa: E402
from tests.runtime.equivalence import assert_equivalent, train_reference  # noqa: E402
from themis_compile.testing import run_multirank  # noqa: E402


def test_lightning_and_torchtitan_parallelize():
    ranks = run_multirank(stacks, 2, timeout_s=300)
    reference = train_reference(MIXTRAL, STEPS, BATCH, SEQ)
    assert_equivalent(reference, [r["fabric"][0] for r in ranks])
    assert [r["fabric"][1:] for r in ranks] == [("FSDPMixtralForCausalLM", "fsdp2")] * 2
    assert_equivalent(reference, [r["torchtitan"][0] for r in ranks])
    assert [r["torchtitan"][1] for r in ranks] == ["ddp"] * 2
    for r in ranks:
        tp_mesh, tp_dims, partial_dp = r["refusals"]
        assert "tensor_parallel_size=1" in tp_mesh
        assert "{'tp': 2} > 1 is not supported" in tp_dims
        assert "data parallelism over 1 of 2 ranks" in partial_dp
