"""Packaging: the sdist and the wheel build without a deprecation warning, and install into a fresh
environment with and without a C compiler (the compiled planner core is optional: the numpy code runs).

What `python -m build` and `pip install .` do, made cheap enough for the suite: the build backend's own
PEP 517 hooks (``setuptools.build_meta``, no isolation, nothing downloaded) build the sdist from a copy
of the source tree and the wheel from the unpacked sdist (so a file missing from the sdist fails here);
the installs go with ``--no-deps`` into fresh virtual environments that borrow this environment's
site-packages (torch and the rest) through a ``.pth`` line, so that nothing is fetched. Then, from
outside the source tree, the installed package is imported and asked which planner core it runs.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240

# Run in the installed environment, from a directory that is not the source tree.
PROBE = """
import json, importlib.metadata as md
import themis_compile
from themis_compile.planner.backend import planner_backend
eps = [ep.value for ep in md.entry_points(group="torch_dynamo_backends") if ep.name == "themis"]
print(json.dumps({"file": themis_compile.__file__, "backend": planner_backend(), "dynamo": eps}))
"""


def _run(cmd: list[str], cwd: Path, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "THEMIS_PLANNER_NUMPY")}
    proc = subprocess.run(cmd, cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out[-6000:]}"
    return out


def _hook(hook: str, source: Path, out_dir: Path, **env: str) -> tuple[Path, str]:
    """Call ``setuptools.build_meta.<hook>(out_dir)`` in ``source``; the artifact and the build's output."""
    code = f"from setuptools import build_meta; print('ARTIFACT=' + build_meta.{hook}({str(out_dir)!r}))"
    out = _run([sys.executable, "-c", code], source, **env)
    name = out.rsplit("ARTIFACT=", 1)[1].split()[0]
    return out_dir / name, out


def _fresh_env(path: Path) -> Path:
    """A virtual environment without pip whose site-packages ends with this one's (torch, numpy, ...):
    a path line, so that this environment's own ``.pth`` hooks (the editable install) do not run."""
    venv.EnvBuilder(with_pip=False).create(path)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _install(python: Path, target: Path, cwd: Path, **env: str) -> str:
    return _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-v", "--no-deps",
                 "--no-build-isolation", "--ignore-installed", "--no-index", "--no-cache-dir", str(target)],
                cwd, **env)


def _probe(python: Path, cwd: Path) -> dict:
    return json.loads(_run([str(python), "-I", "-c", PROBE], cwd).strip().splitlines()[-1])


def _assert_no_deprecation(out: str, what: str) -> None:
    lines = [line for line in out.splitlines() if "deprecat" in line.lower()]
    assert not lines, f"{what} printed deprecation warnings:\n" + "\n".join(lines)


def test_sdist_and_wheel_install_with_and_without_a_compiler(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "themis_compile", src / "themis_compile",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    dist.mkdir()

    # Step 1: the sdist, then the wheel from the unpacked sdist (as `python -m build` does).
    sdist, out = _hook("build_sdist", src, dist)
    _assert_no_deprecation(out, "build_sdist")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert any(n.endswith("themis_compile/planner/_cplan.c") for n in names), "the C source is not in the sdist"
    unpacked = tmp_path / "unpacked" / sdist.name.removesuffix(".tar.gz")
    wheel, out = _hook("build_wheel", unpacked, dist)
    _assert_no_deprecation(out, "build_wheel")
    with zipfile.ZipFile(wheel) as zf:
        members = zf.namelist()
        metadata = zf.read(next(n for n in members if n.endswith(".dist-info/METADATA"))).decode()
    assert any(n.startswith("themis_compile/planner/_cplan") and n.endswith(".so") for n in members)
    assert "License-Expression: Apache-2.0" in metadata
    assert "Provides-Extra: hf" in metadata and "accelerate" in metadata

    # Step 2: the wheel into a fresh environment: the compiled planner core runs.
    with_cc = _fresh_env(tmp_path / "venv-cc")
    _install(with_cc, wheel, tmp_path)
    got = _probe(with_cc, tmp_path)
    assert got["file"].startswith(str(tmp_path / "venv-cc")), got
    assert got["backend"] == "c" and got["dynamo"] == ["themis_compile.passes.backend:themis_backend"], got
    assert (tmp_path / "venv-cc" / "bin" / "themis-compile").exists()

    # Step 3: the sdist built by pip where the C compiler fails: the install succeeds, numpy plans.
    no_cc = _fresh_env(tmp_path / "venv-nocc")
    out = _install(no_cc, sdist, tmp_path, CC="/bin/false")
    _assert_no_deprecation(out, "pip install of the sdist")
    assert "_cplan" in out and "failed" in out.lower(), "the compiler was not even tried:\n" + out[-3000:]
    got = _probe(no_cc, tmp_path)
    assert got["file"].startswith(str(tmp_path / "venv-nocc")), got
    assert got["backend"] == "numpy", got
