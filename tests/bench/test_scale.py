"""`bench scale` at small sizes: one rank of N on the fake process group trains with host memory flat
over 1,000 steps, statistics bounded in bytes, no dense [E, D, D] Alg. 3 plan anywhere in the training
path (the planner's dense entry point raises if called), and no [E, D] placement matrix in the layer
steps (placements are held as pairs; `Placement.mask` is counted while the steps run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Runs in a process of its own: the fake process group is process-wide.
SCRIPT = r"""
import json, sys
import themis_compile.planner as planner
import themis_compile.planner.dispatch as dispatch

def dense(*args, **kwargs):
    raise AssertionError("the dense [E, D, D] Alg. 3 plan was built in the training path")

for module in (planner, dispatch):
    module.topology_aware_dispatch = dense

import themis_compile.runtime.fssdp as fssdp
from themis_compile.planner.placement import Placement

# Count [E, D] matrices built from pairs inside layer steps (forward to backward's reductions).
built = {"in_steps": 0}
in_step = [0]          # depth: start_materialization also runs inside forward
lazy_mask = Placement.mask.fget

def mask(self):
    if self.is_sparse and in_step[0] > 0:
        built["in_steps"] += 1
    return lazy_mask(self)

Placement.mask = property(mask)
def counted(method):
    def run(self, *args, **kwargs):
        in_step[0] += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            in_step[0] -= 1
    return run

for name in ("forward", "start_materialization"):
    setattr(fssdp.FSSDPExperts, name, counted(getattr(fssdp.FSSDPExperts, name)))

from themis_compile.bench.scale import run_one
ranks, experts, steps, cap = (int(a) for a in sys.argv[1:5])
print(json.dumps({**run_one(ranks, experts, 8, steps, 1, 0, stats_max_bytes=cap), **built}))
"""


def _run(ranks: int, experts: int, steps: int, cap: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(ranks), str(experts), str(steps), str(cap)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("ranks, experts, steps", [(8, 16, 1000), (64, 64, 100)])
def test_flat_memory_and_sparse_plans(ranks, experts, steps):
    cap = 256 << 10          # reached within the run: from then on the log drops its oldest records
    record = _run(ranks, experts, steps, cap)
    assert record["ranks"] == ranks and record["layers"] == 1
    assert record["stats_bytes"] <= cap and record["stats_records"] < steps
    if steps >= 1000:
        # RSS over the second half of the run, fitted linearly: flat within allocator noise.
        assert record["rss_growth_mb_per_1000_steps"] < 8.0, record
    # O(E) counts per layer step: far below the [N, 2E + 2] all-gather once N is large.
    assert record["metadata_bytes_per_layer_step"] < 8 * (2 * experts + 2) * 4 + 8 * experts * 4 + 64 * ranks
    assert record["plan_us_median"] > 0 and record["reshard_s"] >= 0
    assert record["in_steps"] == 0, "a layer step built an [E, D] placement matrix"
