"""Smoke test of `python -m themis_compile.bench kernels --quick` (the CPU reference path)."""

from __future__ import annotations

import json

from themis_compile.bench import kernels as bench_kernels


def test_kernels_benchmark_quick_runs_on_cpu(capsys):
    result = bench_kernels.main(["--quick", "--iters", "1"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(result))
    assert result["quick"] and "reference" in result["path"]
    # The check runs the interpreted Triton kernels against the reference, including torch.compile.
    assert result["check"]["passed"], result["check"]["failures"]
    assert [s["name"] for s in result["shapes"]] == ["deepseek-v3-quick", "qwen1.5-moe-quick"]
    for shape in result["shapes"]:
        assert shape["rows"] == shape["tokens"] * shape["top_k"]
        for op in ("permute", "unpermute_combine", "permute_backward", "unpermute_combine_backward"):
            assert shape["ops"][op]["torch_GBps"] > 0 and shape["ops"][op]["bytes"] > 0
        assert shape["ops"]["routing_metadata"]["torch_ms"] > 0
