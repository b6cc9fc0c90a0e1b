"""Build of the optional compiled planner core; everything else is declared in pyproject.toml.

``themis_compile.planner._cplan`` (C99, CPython C API only) runs the planner's per-layer hot path
(Alg. 1 and Alg. 3). It is optional: when it does not compile, the install still succeeds and the
planner runs its numpy code. ``-ffp-contract=off`` keeps every floating-point operation rounded as
written (no fused multiply-add), which the bit-identical plans rely on.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "themis_compile.planner._cplan",
            ["themis_compile/planner/_cplan.c"],
            extra_compile_args=["-O3", "-std=c99", "-ffp-contract=off"],
            optional=True,
        )
    ],
)
