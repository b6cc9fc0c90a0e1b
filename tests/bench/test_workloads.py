"""``bench step --workload`` / ``--workloads``: the named loads, reproducible from a seed, realized by the
routers, and the report against the force-balanced ideal."""

from __future__ import annotations

import numpy as np
import pytest

from themis_compile.bench import step
from themis_compile.bench.workloads import HOT_SHARE, SYNTHETIC, ZIPF_S, workload_shares

E, K, D = 8, 2, 2


@pytest.mark.parametrize("name", SYNTHETIC)
def test_shares_are_assignment_shares_reproducible_from_the_seed(name):
    for rank in (None, 0, 1):
        for s in (0, 3, 7):
            shares = workload_shares(name, s, E, K, D, rank=rank, seed=5, total_steps=8)
            assert shares.shape == (E,) and (shares >= 0).all() and abs(shares.sum() - 1) < 1e-12
            assert (shares <= 1 / K + 1e-12).all()             # a token picks K distinct experts
            np.testing.assert_array_equal(shares, workload_shares(name, s, E, K, D, rank=rank, seed=5, total_steps=8))


def test_each_workload_has_its_shape():
    zipf = workload_shares("zipf", 0, E, K, D, seed=1)
    ranked = np.sort(zipf)[::-1]
    np.testing.assert_allclose(ranked[0] / ranked[1:], np.arange(2, E + 1) ** ZIPF_S)
    assert not np.array_equal(zipf, workload_shares("zipf", 0, E, K, D, seed=2))        # the seed orders them
    np.testing.assert_array_equal(workload_shares("balanced", 4, E, K, D), np.full(E, 1 / E))
    hot = workload_shares("hot-expert", 0, E, K, D, seed=1)
    assert np.isclose(hot.max(), HOT_SHARE / K) and np.allclose(np.sort(hot)[:-1], (1 - HOT_SHARE / K) / (E - 1))
    # hot-rank: one rank sends everything to the experts EP places on it, the other routes evenly.
    per_rank = [workload_shares("hot-rank", 0, E, K, D, rank=r, seed=1) for r in range(D)]
    hot_rank = next(r for r, sh in enumerate(per_rank) if not np.allclose(sh, 1 / E))
    owned = np.arange(E)[(np.arange(E) * D) // E == hot_rank]
    assert np.isclose(per_rank[hot_rank][owned].sum(), 1.0)
    np.testing.assert_allclose(workload_shares("hot-rank", 0, E, K, D, seed=1), np.mean(per_rank, axis=0))
    # drift rotates the popularity; shift changes it once, at mid-run.
    drift = [workload_shares("drift", s, E, K, D) for s in range(4)]
    np.testing.assert_allclose(np.sort(drift[0]), np.sort(drift[2]))        # the same profile, moved on
    assert drift[0].argmax() != drift[2].argmax() and np.abs(drift[1] - drift[0]).max() < drift[0].max() / 2
    first, late = (workload_shares("shift", s, E, K, D, total_steps=10) for s in (4, 5))
    assert np.array_equal(first, workload_shares("shift", 0, E, K, D, total_steps=10)) and not np.array_equal(first, late)


def test_unknown_workloads_are_refused():
    with pytest.raises(SystemExit):
        step._parse(["--workloads", "zipf,nope"])
    with pytest.raises(SystemExit):
        step._parse(["--workload", "zipf", "--workloads", "all"])


def test_workloads_sweep_reports_each_against_the_ideal():
    out = step.main(["--quick", "--workloads", "hot-rank,drift", "--policies", "ep,themis,uniform", "--seed", "3"])
    assert list(out["workloads"]) == ["hot-rank", "drift"]
    for name, result in out["workloads"].items():
        assert result["workload"] == name and set(result["policies"]) == {"ep", "themis", "uniform"}
        times = {p: v["step_time_s"] for p, v in result["policies"].items()}
        assert result["fraction_of_balanced"] == pytest.approx(times["uniform"] / times["themis"])
        assert result["themis_speedup_over"]["ep"] == pytest.approx(times["ep"] / times["themis"])
        assert result["fastest_policy"] == min(times, key=times.get)
        assert result["ideal_is_fastest"] == (times["uniform"] <= min(times.values()) * (1 + step.NOISE))
        assert result["ideal_is_fastest"] or "not a lower bound" in result["ideal_note"]
        for policy in ("ep", "themis"):       # the routers realized the workload's global loads
            assert result["policies"][policy]["trace_replay"]["max_share_deviation"] <= 1 / 64, (name, policy)
    # hot-rank leaves EP's owner of the hot experts with everything to compute; themis spreads it.
    hot = out["workloads"]["hot-rank"]["policies"]
    assert hot["ep"]["imbalance_max_over_mean"] > 1.3
    assert hot["themis"]["imbalance_max_over_mean"] < hot["ep"]["imbalance_max_over_mean"]
