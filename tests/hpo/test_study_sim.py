"""The simulated study of the termination-aware plan (benchmarks/study_sim.py) runs, and its
bookkeeping holds: costs add up, and a policy with no failures pays its stalls only."""

from __future__ import annotations

from pathlib import Path

import optuna
from benchmarks.study_sim import Job, main, run_study, simulate_policy


def test_the_quick_study_runs_and_prints_both_policies(tmp_path: Path, capsys) -> None:
    res = main(
        ["--quick", "--trials", "8", "--seeds", "0", "--mtbf-h", "3", "--out-dir", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert "| 3 | 96 | coci+term |" in out and "| 3 | 96 | daly |" in out
    assert "coci+term vs Daly over 1 MTBFs x 1 seeds" in out
    assert list(tmp_path.glob("study-sim-*.json"))
    for run in res["mtbfs"][0]["runs"]:
        assert run["total_s"] > 0 and run["expected_s"] > 0
        assert abs(run["stall_s"] + run["lost_s"] + run["restart_s"] - run["total_s"]) < 1e-6
        assert run["lost_s"] >= 0


def test_without_failures_a_study_costs_its_stalls_and_the_hazard_saves_fewer() -> None:
    """No failure: nothing is lost or restarted, every trial runs to the stop the study gave
    it; and knowing the stops are likely, coci+term takes fewer saves than Daly."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    job = Job(steps_per_report=50, step_s=10.0, mtbf_s=3 * 3600.0, grid_points=100)
    plans = run_study(0, 10, "sha", job)
    assert any(p.pruned for p in plans) and len(plans[0].models) >= 1
    costs = {
        policy: simulate_policy(policy, plans, job, 0, failures=False)
        for policy in ("coci+term", "daly")
    }
    for c in costs.values():
        assert c.kills == 0 and c.restart_s == 0
        assert abs(c.lost_s) < 1e-6
        assert c.ideal_s == sum(p.stop_step for p in plans) * job.step_s
        for trial, steps in zip(plans, c.save_steps, strict=True):
            assert all(step < trial.stop_step for step in steps)  # no final save
    assert costs["coci+term"].saves < costs["daly"].saves
