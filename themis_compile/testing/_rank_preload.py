"""Imported once by the fork server that starts every rank of `run_multirank`.

A spawned rank pays for a fresh interpreter importing torch (and, for the HF tests, transformers'
modelling code) before it runs a line of the test: seconds of CPU per rank, and a distributed test suite
starts hundreds of ranks. Ranks are instead forked from one server process that imported these modules
once: torch, the library below its entry point (detection, sharding, the runtime, the planner: the
modules ``themis_compile.optimize`` imports), and the transformers modules an HF model's first forward
imports lazily (generation, masking) with the MoE families the runtime tests train. The server only
imports: it runs no tensor computation, so no OpenMP thread pool exists when it forks (a pool created
before a fork is unusable in the child). What these modules read from the environment at import time
(``THEMIS_PLANNER_NUMPY``: the planner core) is read when the server starts, i.e. from the environment
of the first `run_multirank` call of the process.
"""

import importlib
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401

import themis_compile  # noqa: E402,F401
import themis_compile.passes.schedule  # noqa: E402,F401
import themis_compile.passes.shard  # noqa: E402,F401
import themis_compile.planner  # noqa: E402,F401
import themis_compile.runtime.budgets  # noqa: E402,F401
import themis_compile.runtime.clip  # noqa: E402,F401
import themis_compile.runtime.ep  # noqa: E402,F401
import themis_compile.runtime.fssdp  # noqa: E402,F401
import themis_compile.runtime.registry  # noqa: E402,F401
import themis_compile.runtime.reshard  # noqa: E402,F401

torch.set_num_threads(1)

# Optional (the HF tests' ranks build models from transformers), each on its own: an older transformers
# may lack a family.
for _name in ("transformers.modeling_utils", "transformers.generation.utils", "transformers.masking_utils",
              "transformers.models.mixtral.modeling_mixtral", "transformers.models.qwen3_moe.modeling_qwen3_moe",
              "transformers.models.deepseek_v3.modeling_deepseek_v3"):
    try:
        importlib.import_module(_name)
    except ImportError:
        pass
