"""Without a trustworthy loss curve the plan is Daly's uniform interval."""

from __future__ import annotations

import numpy as np
import pytest

from coci_core.planner import daly_interval_s, plan_schedule


def _daly_steps(job):
    return round(daly_interval_s(job["stall_s"], job["mtbf_s"]) / job["step_time_s"])


def _assert_uniform(steps, interval):
    gaps = np.diff(np.array([0, *steps]))
    assert len(steps) > 5
    assert set(gaps.tolist()) == {interval}


def test_a_flat_loss_gives_dalys_interval(resnet):
    """A constant loss has no value gradient, so the interval is Daly's."""
    sched = plan_schedule(**resnet, loss=lambda k: 3.0, objective="convergence")
    _assert_uniform(sched.steps, _daly_steps(resnet))


def test_an_all_noise_loss_gives_dalys_interval(resnet):
    """Pure noise around a constant is not trusted, so the interval is Daly's."""
    rng = np.random.default_rng(5)
    steps = np.arange(30_000)
    losses = 2.0 + 0.3 * rng.standard_normal(steps.size)
    sched = plan_schedule(**resnet, loss=(steps, losses), objective="convergence")
    assert not sched.curve.trusted
    _assert_uniform(sched.steps, _daly_steps(resnet))


def test_a_noisy_callable_is_fitted_and_then_rejected(resnet):
    """A callable that returns noise is treated like observations, and rejected."""
    rng = np.random.default_rng(9)
    table = 2.0 + 0.3 * rng.standard_normal(resnet["total_steps"] + 1)
    sched = plan_schedule(**resnet, loss=lambda k: table[k], objective="convergence")
    assert not sched.curve.trusted
    _assert_uniform(sched.steps, _daly_steps(resnet))


@pytest.mark.parametrize("objective", ["time", "convergence", "progress"])
def test_no_loss_gives_dalys_interval_for_every_objective(resnet, objective):
    """With no loss at all, every objective reduces to Daly."""
    sched = plan_schedule(**resnet, objective=objective)
    _assert_uniform(sched.steps, _daly_steps(resnet))
    assert sched.expected_overhead_s.gain_vs_daly == pytest.approx(0.0, abs=1e-12)
