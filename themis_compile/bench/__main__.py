"""`python -m themis_compile.bench NAME [args]`: run one benchmark; each prints one JSON document.

Benchmarks live in this package, one module each, exposing ``main(argv: list[str] | None) -> dict``
which prints its JSON result to stdout (rank 0 only for multi-rank benchmarks) and returns it.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "planner": "themis_compile.bench.planner",
    "collectives": "themis_compile.bench.collectives",
    "kernels": "themis_compile.bench.kernels",
    "step": "themis_compile.bench.step",
    "overlap": "themis_compile.bench.overlap",
    "simulator": "themis_compile.bench.simulator",
    "scale": "themis_compile.bench.scale",
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m themis_compile.bench {" + ",".join(BENCHMARKS) + "} [args]")
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {name!r}; choose from {sorted(BENCHMARKS)}")
    try:
        module = importlib.import_module(BENCHMARKS[name])
    except ModuleNotFoundError as exc:
        raise SystemExit(f"benchmark {name!r} is not available: {exc}") from exc
    module.main(rest)


if __name__ == "__main__":
    main()
