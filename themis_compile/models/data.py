"""Offline training data for the reference models: a byte-level corpus of the Python standard library.

Every machine that runs Python has it, so the demo (``demo/``) and the examples train on real text without
a download. Tokens are bytes (vocab 256).

Shape suffixes: B batch.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

__all__ = ["build_corpus", "sample_batch", "stdlib_sources"]

# Directories of the stdlib that are not "the standard library's sources" in the sense we want: installed
# third-party packages, and the test suites (large, repetitive, full of deliberately odd bytes).
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_sources(root: str | os.PathLike | None = None) -> list[Path]:
    """The ``.py`` files under the standard library ``root`` (default: this interpreter's), sorted by
    their path relative to ``root`` so that the order is the same on every run and every rank."""
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if not root.is_dir():
        raise ValueError(f"standard library directory {str(root)!r} does not exist")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_corpus(max_bytes: int = 4 << 20, root: str | os.PathLike | None = None) -> np.ndarray:
    """Byte-level corpus (tokens in [0, 256)) from the standard library's ``.py`` sources.

    Files are concatenated in :func:`stdlib_sources` order, each followed by a newline, and the result is
    cut at ``max_bytes``. Deterministic for a given interpreter installation.

    Returns a 1-D ``uint8`` array.
    """
    if max_bytes < 2:
        raise ValueError(f"max_bytes must be >= 2, got {max_bytes}")
    chunks, total = [], 0
    for path in stdlib_sources(root):
        data = path.read_bytes() + b"\n"
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    if corpus.size < 2:
        raise ValueError(f"no Python sources found under {root!r}")
    return corpus


def sample_batch(corpus: np.ndarray, step: int, global_batch: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """The global batch of ``step``: ``global_batch`` windows of ``seq_len`` bytes at seeded offsets.

    A pure function of (corpus, step, sizes, seed), so every policy and every rank sees the same data.
    Returns int64 ``[global_batch, seq_len]``.
    """
    if seq_len > corpus.size:
        raise ValueError(f"seq_len={seq_len} exceeds the corpus ({corpus.size} bytes)")
    rng = np.random.default_rng([seed, step])
    starts_B = rng.integers(0, corpus.size - seq_len + 1, size=global_batch)
    return np.stack([corpus[s:s + seq_len] for s in starts_B]).astype(np.int64)
