"""The plan depends on the shape of the loss curve only: not on its scale, offset or time unit."""

from __future__ import annotations

import numpy as np
import pytest
from planner_helpers import power_loss

from coci_core.planner import plan_schedule


@pytest.mark.parametrize("objective", ["convergence", "progress"])
def test_scaling_or_shifting_an_exact_loss_keeps_the_schedule(resnet, objective):
    """Loss x10 or loss + 7 gives the same steps as the original curve."""
    base = plan_schedule(**resnet, loss=power_loss, objective=objective).steps
    scaled = plan_schedule(**resnet, loss=lambda k: 10 * power_loss(k), objective=objective)
    shifted = plan_schedule(**resnet, loss=lambda k: power_loss(k) + 7.0, objective=objective)
    assert len(base) > 10
    assert scaled.steps == base
    assert shifted.steps == base


def test_scaling_or_shifting_observed_losses_keeps_the_schedule(resnet, noisy_observations):
    """The same holds for a curve fitted to noisy observations."""
    steps, losses = noisy_observations
    job = {**resnet, "objective": "convergence"}
    base = plan_schedule(**job, loss=(steps, losses))
    assert base.curve.trusted
    assert plan_schedule(**job, loss=(steps, losses * 10)).steps == base.steps
    assert plan_schedule(**job, loss=(steps, losses - 1.25)).steps == base.steps


@pytest.mark.parametrize("objective", ["time", "convergence", "progress"])
def test_minutes_instead_of_seconds_keeps_the_schedule(resnet, objective):
    """Every time given in minutes instead of seconds gives the same steps."""
    minutes = {k: (v / 60.0 if k.endswith("_s") else v) for k, v in resnet.items()}
    in_s = plan_schedule(**resnet, loss=power_loss, objective=objective)
    in_min = plan_schedule(**minutes, loss=power_loss, objective=objective)
    assert in_min.steps == in_s.steps
    assert np.isclose(in_min.expected_overhead_s.wall_s * 60, in_s.expected_overhead_s.wall_s)


def test_the_convergence_plan_is_denser_early_than_late(resnet):
    """The convergence objective front-loads checkpoints for a diminishing-returns curve."""
    sched = plan_schedule(**resnet, loss=power_loss, objective="convergence")
    iv = sched.intervals()
    assert iv[0] < iv[len(iv) // 2] < iv[-2]
