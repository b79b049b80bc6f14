"""The exact cost model, the DP, the closed form and the Monte Carlo agree with each other."""

from __future__ import annotations

import math

import numpy as np
import pytest
from planner_helpers import power_loss
from scipy.special import lambertw

from coci_core.planner import (
    AshaRungs,
    FailureModel,
    Problem,
    closed_form_schedule,
    daly_interval_s,
    dp_schedule,
    expected_cost,
    simulate,
    uniform_schedule,
    value_density,
)
from coci_core.planner.curve import curve_from_callable


def _problem(total=50_000, stall=0.5, persist=2.0, mtbf_h=8.0, objective="convergence", **kw):
    curve = curve_from_callable(power_loss, 0, total)
    return Problem(
        start_step=0,
        end_step=total,
        step_time_s=0.3,
        stall_s=stall,
        persist_s=persist,
        restart_s=60.0,
        failure=FailureModel(mtbf_s=mtbf_h * 3600),
        value=value_density(curve, 0, total),
        objective=objective,
        **kw,
    )


def test_dalys_formula_is_close_to_the_exact_lambert_w_optimum():
    """Daly's interval (plus the stall) is within 1% of the Lambert-W optimum for s << M."""
    s, m = 5.0, 8 * 3600.0
    exact_period = m * (1 + float(np.real(lambertw(-math.exp(-s / m - 1)))))
    assert daly_interval_s(s, m) + s == pytest.approx(exact_period, rel=0.01)


def test_synchronous_uniform_cost_matches_the_textbook_formula():
    """With persist 0 and no termination, each segment costs (e^(λ(T+s)) - 1)(1/λ + R)."""
    pb = _problem(total=10_000, stall=5.0, persist=0.0, mtbf_h=2.0, objective="time")
    steps = uniform_schedule(pb, 1000)
    lam, r, tau = 1 / 7200, 60.0, 0.3
    seg = (math.exp(lam * (1000 * tau + 5.0)) - 1) * (1 / lam + r)
    last = (math.exp(lam * 1000 * tau) - 1) * (1 / lam + r)
    expected_wall = 9 * seg + last - 10_000 * tau
    assert expected_cost(pb, steps).wall_s == pytest.approx(expected_wall, rel=1e-9)


@pytest.mark.parametrize(
    ("stall", "persist", "mtbf_h"), [(0.5, 2.0, 2.0), (5.0, 20.0, 8.0), (5.0, 20.0, 24.0)]
)
def test_dp_and_closed_form_agree_within_5_percent(stall, persist, mtbf_h):
    """The DP and the closed form reach the same objective within 5%."""
    pb = _problem(stall=stall, persist=persist, mtbf_h=mtbf_h)
    dp = expected_cost(pb, dp_schedule(pb)).convergence_s
    cf = expected_cost(pb, closed_form_schedule(pb)).convergence_s
    assert abs(dp - cf) <= 0.05 * dp


def test_the_dp_beats_daly_on_its_own_objective():
    """The convergence-aware DP lowers the convergence-weighted cost by well over 10%."""
    pb = _problem()
    daly = uniform_schedule(pb, daly_interval_s(0.5, 8 * 3600) / 0.3)
    ours = expected_cost(pb, dp_schedule(pb)).convergence_excl_restart_s
    theirs = expected_cost(pb, daly).convergence_excl_restart_s
    assert ours < 0.88 * theirs


def test_with_asha_rungs_the_time_dp_is_no_worse_than_daly():
    """Known rungs never make the wall-clock plan worse than Daly's, and move it to rungs."""
    term = AshaRungs.geometric(min_steps=1000, reduction_factor=3.0, max_steps=50_000)
    pb = _problem(stall=5.0, persist=20.0, mtbf_h=2.0, objective="time", termination=term)
    ours = dp_schedule(pb)
    daly = uniform_schedule(pb, daly_interval_s(5.0, 7200) / 0.3)
    assert expected_cost(pb, ours).wall_s < expected_cost(pb, daly).wall_s
    assert 1000 in set(ours.tolist()) or 3000 in set(ours.tolist())


CASES = {
    "daly, persist inside interval": dict(stall=0.5, persist=2.0, mtbf_h=0.5, every=300),
    "persist longer than interval": dict(stall=0.5, persist=20.0, mtbf_h=0.5, every=20),
    "asha termination": dict(stall=5.0, persist=20.0, mtbf_h=0.5, every=500, asha=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_analytic_cost_is_inside_the_monte_carlo_confidence_interval(case):
    """Exact expected cost and simulated mean agree for wall, convergence and progress metrics."""
    c = CASES[case]
    kw = {}
    if c.get("asha"):
        kw["termination"] = AshaRungs(rung_steps=(2000, 6000), reduction_factor=3.0)
    pb = _problem(total=10_000, stall=c["stall"], persist=c["persist"], mtbf_h=c["mtbf_h"], **kw)
    steps = uniform_schedule(pb, c["every"])
    exact = expected_cost(pb, steps)
    row = simulate({"p": steps}, pb, runs=6_000, seed=3, confidence=0.99).rows["p"]
    assert exact.failures > 0.3  # the case exercises failures
    for metric, value in (
        ("wall_s", exact.wall_s),
        ("convergence_excl_restart_s", exact.convergence_excl_restart_s),
        ("progress_s", exact.progress_s),
    ):
        est = row[metric]
        assert abs(value - est.mean) <= est.half_width, (metric, value, str(est))


def test_simulated_wall_clock_equals_the_sum_of_its_parts():
    """Per run, end time minus compute equals stall + lost work + restart (bookkeeping check)."""
    pb = _problem(total=5_000, mtbf_h=0.3)
    steps = uniform_schedule(pb, 200)
    row = simulate({"p": steps}, pb, runs=500, seed=1).rows["p"]
    assert row["failures"].mean > 1
    assert row["end_time_s"].mean == pytest.approx(row["wall_s"].mean, rel=1e-9)


def test_common_random_numbers_give_identical_results_for_identical_schedules():
    """Two names for the same schedule see the same failures, so their results are identical."""
    pb = _problem(total=5_000, mtbf_h=0.5)
    steps = uniform_schedule(pb, 250)
    res = simulate({"a": steps, "b": steps.copy()}, pb, runs=300, seed=7)
    assert res.rows["a"]["wall_s"].mean == res.rows["b"]["wall_s"].mean
    assert res.rows["a"]["failures"].mean > 0


def test_a_run_needing_many_failures_is_simulated_not_truncated():
    """With no checkpoint and a short MTBF, runs need many failures; the mean stays exact."""
    pb = _problem(total=10_000, mtbf_h=0.4, objective="time")
    exact = expected_cost(pb, [])
    row = simulate({"none": []}, pb, runs=3_000, seed=4, confidence=0.99).rows["none"]
    assert exact.failures > 5
    assert abs(row["wall_s"].mean - exact.wall_s) <= row["wall_s"].half_width


def test_more_nodes_early_means_denser_checkpoints_early(resnet):
    """A world size of 8 then 2 nodes gives intervals about twice as short early (sqrt(4))."""
    from coci_core.planner import plan_schedule

    resnet["mtbf_s"] = 24 * 3600.0
    sched = plan_schedule(**resnet, objective="time", nodes=lambda k: 8 if k < 25_000 else 2)
    steps = np.array(sched.steps)
    early = np.diff(steps[steps < 20_000]).mean()
    late = np.diff(steps[steps > 30_000]).mean()
    assert 1.6 < late / early < 2.4
