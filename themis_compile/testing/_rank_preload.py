"""Imported once by the fork server that starts every rank of `run_multirank`.

A spawned rank pays for a fresh interpreter importing torch (and, for the HF tests, transformers'
modelling code) before it runs a line of the test: seconds of CPU per rank, and a distributed test suite
starts hundreds of ranks. Ranks are instead forked from one server process that imported these modules
once. The server only imports: it runs no tensor computation, so no OpenMP thread pool exists when it
forks (a pool created before a fork is unusable in the child).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401

import themis_compile  # noqa: E402,F401

torch.set_num_threads(1)

try:  # optional: the HF tests' ranks build models from transformers
    import transformers.modeling_utils  # noqa: F401
except ImportError:
    pass
