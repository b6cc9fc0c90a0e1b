"""`bench step --network emulated`: its options, and the branch that runs nothing where namespaces cannot be
built. (A real emulated run takes over a minute here — four ranks, every policy: it is the benchmark's
job, not the suite's; see docs/bench_step_network.md for its figures.)"""

from __future__ import annotations

import json

import pytest

from themis_compile.bench import step
from themis_compile.testing.netns import EmulatedNodes


def test_emulated_network_options():
    args = step._parse(["--network", "emulated"])
    # 2 nodes x 2 ranks, each rank a quarter of the loopback default's global batch, the emulated model.
    assert (args.nproc, args.nodes, args.devices_per_node) == (4, 2, 2)
    assert args.inter_node_bw == step.EMULATED_INTER_NODE_BW
    assert (args.batch, args.d_model, args.d_ffn) == (8, 256, 128) == tuple(step.EMULATED_DEFAULTS.values())
    # What is given wins over the emulated defaults; --quick keeps its tiny sizes.
    args = step._parse(["--network", "emulated", "--batch", "3", "--d-ffn=512", "--nodes", "3",
                        "--inter-node-bw", "1e8"])
    assert (args.nproc, args.batch, args.d_model, args.d_ffn, args.inter_node_bw) == (6, 3, 256, 512, 1e8)
    assert (step._parse(["--network", "emulated", "--quick"]).d_ffn, step._parse(["--quick"]).d_ffn) == (64, 64)
    loopback = step._parse([])
    assert (loopback.network, loopback.batch, loopback.d_model, loopback.d_ffn) == ("loopback", 16, 128, 2048)
    for bad in (["--nodes", "1"], ["--inter-node-bw", "0"], ["--devices-per-node", "0"]):
        with pytest.raises(SystemExit):
            step._parse(["--network", "emulated", *bad])


def test_emulated_network_unavailable_exits_cleanly_with_the_reason(monkeypatch, capsys, tmp_path):
    reason = "building network namespaces needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root on the host)"
    monkeypatch.setattr(EmulatedNodes, "unavailable_reason", staticmethod(lambda: reason))
    monkeypatch.delenv("RANK", raising=False)

    def never(*a, **k):
        raise AssertionError("nothing may be built or launched when the network is unavailable")

    monkeypatch.setattr(EmulatedNodes, "__enter__", never)
    monkeypatch.setattr("themis_compile.testing.run_multirank", never)
    out_file = tmp_path / "out.json"
    # Through the command's own entry point: it returns (exit code 0) instead of raising SystemExit.
    from themis_compile.bench.__main__ import main as bench_main

    bench_main(["step", "--network", "emulated", "--inter-node-bw", "2e7", "--out", str(out_file)])
    captured = capsys.readouterr()
    printed = json.loads(captured.out.strip().splitlines()[-1])
    assert printed == json.loads(out_file.read_text())
    assert printed["unavailable"] == reason
    assert printed["network"]["mode"] == "emulated" and printed["network"]["inter_node_bw"] == 2e7
    assert (printed["network"]["nodes"], printed["network"]["devices_per_node"], printed["world_size"]) == (2, 2, 4)
    assert printed["policies"] == {} and printed["ratios"] == {}
    assert reason in captured.err and "not run" in captured.err


def test_emulated_network_refuses_torchrun(monkeypatch):
    # torchrun cannot put its ranks into namespaces: a clear error, not a loopback run labelled emulated.
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit, match="without torchrun"):
        step.main(["--network", "emulated"])
