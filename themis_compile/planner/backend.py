"""Which implementation of the planner's per-layer cores runs: the compiled core or numpy.

Alg. 1 (`materialize`), calibration and Alg. 3 (`dispatch`) have three implementations that must agree
bit for bit: the readable reference (`planner/reference.py`, the paper's pseudo-code), the vectorised
numpy code of each module, and the compiled core ``themis_compile.planner._cplan`` (C99, built by
``pip install -e .``). The reference is never chosen here — it is what the other two are tested
against. Between the other two this module decides, once per process:

- the compiled core when it is importable and speaks this module's argument conventions (`CORE_ABI`,
  ``ABI`` in ``_cplan.c``; a stale build falls back to numpy with a warning instead of failing);
- numpy when it is not built, or when ``THEMIS_PLANNER_NUMPY`` is set to anything but ``0``/empty.

`compiled_core()` is what the planner modules ask on every call; `using(core)` swaps it for a block
(tests and the planner benchmark compare both); `planner_backend()` names the one in use.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from types import ModuleType

logger = logging.getLogger(__name__)

__all__ = ["CORE_ABI", "compiled_core", "load_compiled_core", "planner_backend", "using"]

CORE_ABI = 4    # the argument conventions the planner calls the core with (`ABI` in _cplan.c)


def load_compiled_core() -> ModuleType | None:
    """The compiled planner core, or None (not built, built from an older source, or
    ``THEMIS_PLANNER_NUMPY`` set to anything but ``0``/empty): the numpy code then runs."""
    if os.environ.get("THEMIS_PLANNER_NUMPY", "") not in ("", "0"):
        return None
    try:
        from themis_compile.planner import _cplan
    except ImportError as exc:
        logger.debug("compiled planner core unavailable (%s); using numpy", exc)
        return None
    if getattr(_cplan, "ABI", None) != CORE_ABI:
        logger.warning("compiled planner core %s is stale (rebuild with `pip install -e .`); using numpy",
                       _cplan.__file__)
        return None
    return _cplan


_core: ModuleType | None = load_compiled_core()


def compiled_core() -> ModuleType | None:
    """The compiled core the planner uses now, or None for numpy."""
    return _core


def planner_backend() -> str:
    """``"c"`` when Alg. 1 and Alg. 3 run through the compiled core, ``"numpy"`` otherwise."""
    return "numpy" if _core is None else "c"


@contextlib.contextmanager
def using(core: ModuleType | None) -> Iterator[None]:
    """Run the block with ``core`` (the compiled module, or None for numpy) as the planner's backend."""
    global _core
    saved, _core = _core, core
    try:
        yield
    finally:
        _core = saved
