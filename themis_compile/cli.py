"""The `themis-compile` command (also `python -m themis_compile`).

Subcommands:
    inspect MODEL     the cost model per MoE layer: Psi, T_attn, bw, overlap degree t, budget m, ...
    simulate ...      the cluster simulator: Themis and the baselines on a simulated cluster
    bench NAME ...    the benchmarks (planner, collectives, kernels, step, overlap)
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "inspect": "themis_compile.sim.inspect_model",
    "simulate": "themis_compile.sim.cli",
    "bench": "themis_compile.bench.__main__",
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    if argv[0] in ("-V", "--version"):
        from themis_compile import __version__

        print(__version__)
        return
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        raise SystemExit(f"themis-compile: unknown command {name!r}; choose from {sorted(SUBCOMMANDS)}")
    importlib.import_module(SUBCOMMANDS[name]).main(rest)


if __name__ == "__main__":
    main()
