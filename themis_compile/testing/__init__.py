"""Testing utilities: the multi-rank harness used by every distributed test."""

from themis_compile.testing.multirank import RankError, run_multirank

__all__ = ["run_multirank", "RankError"]
