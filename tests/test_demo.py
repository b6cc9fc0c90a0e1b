"""The demo: corpus builder, batch sampler, statistics, summary, and one real run under torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import demo


def _fake_stdlib(root: Path) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "site-packages" / "thirdparty").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "b.py").write_bytes(b"bbb")
    (root / "a.py").write_bytes(b"a\xff\x00")
    (root / "pkg" / "c.py").write_bytes(b"cc")
    (root / "notes.txt").write_bytes(b"not python")
    (root / "site-packages" / "thirdparty" / "x.py").write_bytes(b"third party")
    (root / "test" / "test_x.py").write_bytes(b"a test")


def test_stdlib_sources_sorted_and_filtered(tmp_path):
    _fake_stdlib(tmp_path)
    rel = [p.relative_to(tmp_path).as_posix() for p in demo.stdlib_sources(tmp_path)]
    assert rel == ["a.py", "b.py", "pkg/c.py"]


def test_build_corpus_concatenates_in_order_and_caps(tmp_path):
    _fake_stdlib(tmp_path)
    corpus = demo.build_corpus(max_bytes=1000, root=tmp_path)
    assert corpus.dtype == np.uint8
    assert corpus.tobytes() == b"a\xff\x00\nbbb\ncc\n"
    assert demo.build_corpus(max_bytes=6, root=tmp_path).tobytes() == b"a\xff\x00\nbb"


def test_build_corpus_real_stdlib_is_deterministic_bytes():
    a = demo.build_corpus(max_bytes=256 << 10)
    b = demo.build_corpus(max_bytes=256 << 10)
    assert a.dtype == np.uint8 and a.size == 256 << 10
    assert np.array_equal(a, b)
    assert int(a.min()) >= 0 and int(a.max()) < 256
    # Python source: mostly printable ASCII, and it contains Python.
    assert (a < 128).mean() > 0.95
    assert b"def " in a.tobytes() and b"import " in a.tobytes()


def test_build_corpus_bad_input(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        demo.build_corpus(root=tmp_path / "missing")
    with pytest.raises(ValueError, match="max_bytes"):
        demo.build_corpus(max_bytes=1, root=tmp_path)
    with pytest.raises(ValueError, match="no Python sources"):
        demo.build_corpus(root=tmp_path)


def test_sample_batch_is_a_pure_function_of_step():
    corpus = np.arange(1000, dtype=np.int64).astype(np.uint8)
    x = demo.sample_batch(corpus, step=3, global_batch=4, seq_len=16, seed=0)
    assert x.shape == (4, 16) and x.dtype == np.int64
    assert np.array_equal(x, demo.sample_batch(corpus, 3, 4, 16, 0))
    assert not np.array_equal(x, demo.sample_batch(corpus, 4, 4, 16, 0))
    # Each row is a contiguous window of the corpus.
    assert all(((np.diff(row) % 256) == 1).all() for row in x)
    with pytest.raises(ValueError, match="seq_len"):
        demo.sample_batch(corpus, 0, 1, 1001)


def test_imbalance_and_relative_difference():
    assert demo.imbalance([1, 1, 1, 1]) == 1.0
    assert demo.imbalance([4, 0, 0, 0]) == 4.0
    assert demo.imbalance([0, 0]) == 1.0
    assert demo.max_relative_difference([1.0, 2.0], [1.0, 2.2]) == pytest.approx(0.2 / 2.2)
    assert demo.max_relative_difference([1.0, 2.0, 9.0], [1.0, 2.0]) == 0.0


def test_cli_rejects_bad_input(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--policies", "ep,fastest"])
    assert "fastest" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--steps", "0"])
    assert "--steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--policies", "ep,ep"])


def _metrics(policy: str, losses: list[float], delta_p=None) -> dict:
    n = len(losses)
    return {"policy": policy, "world_size": 2, "num_layers": 2, "num_experts": 4, "top_k": 2, "model": "m",
            "tokens_per_step": 100, "trace": f"trace_{policy}.jsonl", "loss": losses, "lm_loss": losses,
            "step_time_s": [1.0, 1.0, 0.5, 0.5][:n], "expert_imbalance": [[2.0, 3.0]] * n,
            "device_imbalance": [[1.5, 1.0]] * n, "delta_p": delta_p or [0] * n}


def test_summary_compares_exact_policies_and_plots(tmp_path):
    (tmp_path / "metrics_ep.json").write_text(json.dumps(_metrics("ep", [4.0, 3.0, 2.0, 1.0])))
    themis = _metrics("themis", [4.0, 3.0, 2.0, 1.00001], delta_p=[3, 2, 2, 1])
    themis["phase_ms_per_step"] = {"SpAG start (plan, post)": 2.0, "forward: experts": 30.0, "rest of the step": 50.0}
    (tmp_path / "metrics_themis.json").write_text(json.dumps(themis))
    (tmp_path / "metrics_uniform.json").write_text(json.dumps(_metrics("uniform", [4.0, 2.5, 2.0, 1.5])))
    (tmp_path / "metrics_themis-rm.json").write_text(json.dumps({"policy": "themis-rm", "skipped": "why"}))
    s = demo.summarize(tmp_path, ["ep", "themis", "uniform", "themis-rm"])
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(s))
    assert s["policies"]["ep"]["step_time_s"] == 0.5          # the first two steps are warm-up
    assert s["policies"]["ep"]["tokens_per_s"] == 200.0
    assert s["policies"]["themis"]["mean_delta_p"] == 2.0
    assert s["policies"]["ep"]["mean_expert_imbalance"] == [2.0, 3.0]
    assert s["loss_baseline"] == "ep"
    assert set(s["loss_max_rel_diff"]) == {"themis"}           # uniform changes the routing on purpose
    assert s["loss_max_rel_diff"]["themis"] == pytest.approx(1e-5)
    assert s["loss_coincide"] == {"themis": True}
    assert s["skipped"] == {"themis-rm": "why"}
    for name in ("loss.png", "imbalance.png", "delta_p.png", "breakdown.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert s["policies"]["themis"]["phase_ms_per_step"]["forward: experts"] == 30.0
    assert s["policies"]["ep"]["phase_ms_per_step"] == {}
    text = demo.format_summary(s, tmp_path)
    assert "coincide" in text and "themis-rm skipped: why" in text
    # The breakdown table: one column per profiled policy, the rest of the step last.
    rows = text.split("breakdown, ms per step")[1].splitlines()[1:]
    assert rows[0].split() == ["phase", "themis"]
    assert rows[3].split() == ["rest", "of", "the", "step", "50.0"]


def test_summary_missing_run_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="ep"):
        demo.summarize(tmp_path, ["ep"])


def test_demo_runs_under_torchrun(tmp_path, capsys):
    """The real demo, tiny: 2 ranks under torchrun, EP, Uniform, plain FSDP2 (and Themis if the runtime has it)."""
    steps, seq, batch = 3, 16, 2
    out = tmp_path / "demo"
    demo.main(["--steps", str(steps), "--seq-len", str(seq), "--batch", str(batch), "--out", str(out),
               "--policies", "ep,uniform,fsdp2,themis", "--no-progress", "--corpus-bytes", "65536", "--timeout", "60",
               "--profile-steps", "1"])
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    ran = set(summary["policies"])
    assert {"ep", "uniform"} <= ran
    assert ran | set(summary["skipped"]) == {"ep", "uniform", "fsdp2", "themis"}
    for policy in ran:
        lines = [json.loads(line) for line in (out / f"trace_{policy}.jsonl").read_text().splitlines()]
        header = lines[0]["header"]
        assert header == {"num_experts": 8, "top_k": 2, "world_size": 2, "model": "tiny-moe", "policy": policy,
                          "seq_len": seq, "batch_per_rank": batch}
        layers = 2
        assert len(lines) == 1 + steps * layers
        assert [(r["step"], r["layer"]) for r in lines[1:]] == [(s, li) for s in range(steps) for li in range(layers)]
        for r in lines[1:]:
            tpe, tpde = r["tokens_per_expert"], r["tokens_per_device_expert"]
            assert len(tpe) == 8 and len(tpde) == 2 and all(len(row) == 8 for row in tpde)
            # Every (token, k) pair of every rank is counted once.
            assert sum(tpe) == 2 * batch * seq * 2
            assert all(sum(row) == batch * seq * 2 for row in tpde)
            assert np.array_equal(np.sum(tpde, 0), tpe)
            if policy != "fsdp2":     # plain FSDP2 has no placement
                assert isinstance(r["delta_p"], int) and r["delta_p"] >= 0
        s = summary["policies"][policy]
        assert s["steps"] == steps and np.isfinite(s["final_loss"]) and s["tokens_per_s"] > 0
    # Static placements materialize nothing; the uniform gate balances experts exactly.
    assert summary["policies"]["ep"]["mean_delta_p"] == 0.0
    assert summary["policies"]["uniform"]["mean_expert_imbalance"] == [1.0, 1.0]
    assert summary["policies"]["ep"]["mean_expert_imbalance"][0] > 1.0
    for name in ("loss.png", "imbalance.png", "delta_p.png", "breakdown.png"):
        assert (out / name).stat().st_size > 0
    # The profiled step's breakdown: each policy's own phases (the profiled step is not a timed one).
    phases = {p: set(summary["policies"][p]["phase_ms_per_step"]) for p in ran}
    for kind in ("attention", "router", "dispatch", "experts", "combine"):
        assert {f"forward: {kind}", f"backward: {kind}"} <= phases["ep"], kind
    assert "rest of the step" in phases["ep"]
    if "fsdp2" in ran:
        assert "dense FSDP2 (gather, reduce)" in phases["fsdp2"] and "forward: dispatch" not in phases["fsdp2"]
    if "themis" in ran:
        assert {"SpAG start (plan, post)", "SpRS start", "forward: experts"} <= phases["themis"]
    assert "tokens/s" in printed and "ep" in printed
    if "themis" in ran:
        # Same model, seed and data: Themis trains exactly what EP trains.
        assert summary["loss_coincide"] == {"fsdp2": True, "themis": True}


def test_example_script_trains_under_torchrun():
    """examples/train_stdlib.py, the ordinary-loop version of the demo, runs as its docstring says."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(root / "examples" / "train_stdlib.py"), "--steps", "2", "--batch", "2", "--seq-len", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    assert [line.split()[1] for line in lines] == ["0", "1"]
    assert all(np.isfinite(float(line.split()[3])) for line in lines)
