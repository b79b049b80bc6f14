"""Failure and termination models: probabilities, MTBF estimate, and their use in the plan."""

from __future__ import annotations

import numpy as np
import pytest
from planner_helpers import power_loss

from coci_core.errors import ConfigError
from coci_core.planner import (
    AshaRungs,
    FailureModel,
    Problem,
    SurvivalFunction,
    UniformKill,
    estimate_mtbf_s,
    expected_cost,
    plan_schedule,
    simulate,
    uniform_schedule,
)


def test_asha_atoms_put_the_kill_mass_on_the_rungs():
    """With eta 3, 2/3 stop at the first rung, 2/9 at the second, 1/9 run to the end."""
    steps, probs = AshaRungs(rung_steps=(100, 300), reduction_factor=3.0).atoms(0, 1_000)
    assert steps.tolist() == [100.0, 300.0, 1_000.0]
    assert probs == pytest.approx([2 / 3, 2 / 9, 1 / 9])


def test_uniform_kill_and_survival_function_atoms_are_distributions():
    """Discretised kill models sum to one and match the survival at the end."""
    uk = UniformKill(start_step=0, end_step=1_000, probability=0.5)
    sf = SurvivalFunction(fn=lambda k: float(np.exp(-k / 2_000)))
    for model, end_survival in ((uk, 0.5), (sf, np.exp(-0.5))):
        steps, probs = model.atoms(0, 1_000)
        assert probs.sum() == pytest.approx(1.0)
        assert probs[-1] == pytest.approx(end_survival, rel=1e-6)
        assert np.all(np.diff(steps) > 0)


def test_expected_cost_with_a_uniform_kill_window_matches_the_monte_carlo():
    """The termination mixture in the exact cost agrees with simulated kills."""
    uk = UniformKill(start_step=0, end_step=8_000, probability=0.6)
    pb = Problem(
        start_step=0,
        end_step=8_000,
        step_time_s=0.3,
        stall_s=2.0,
        persist_s=5.0,
        restart_s=60.0,
        failure=FailureModel(mtbf_s=1_800.0),
        termination=uk,
    )
    steps = uniform_schedule(pb, 400)
    exact = expected_cost(pb, steps).wall_s
    est = simulate({"p": steps}, pb, runs=6_000, seed=2, confidence=0.99).rows["p"]["wall_s"]
    assert abs(exact - est.mean) <= est.half_width


def test_a_likely_early_kill_makes_the_plan_sparser_early_than_without(resnet):
    """If most jobs are killed by step 10k, fewer checkpoints are planned before it."""
    kill = UniformKill(start_step=0, end_step=10_000, probability=0.9)
    with_kill = plan_schedule(**resnet, loss=power_loss, termination=kill, objective="convergence")
    without = plan_schedule(**resnet, loss=power_loss, objective="convergence")
    early = lambda s: sum(1 for x in s.steps if x < 10_000)  # noqa: E731
    assert early(with_kill) < early(without)


def test_mtbf_estimate_starts_at_the_prior_and_follows_the_history():
    """No failures give the prior; many failures approach elapsed / failures."""
    assert estimate_mtbf_s(failures=0, elapsed_s=0.0, prior_mtbf_s=86_400.0) == 86_400.0
    est = estimate_mtbf_s(failures=99, elapsed_s=99 * 3_600.0, prior_mtbf_s=86_400.0)
    assert est == pytest.approx(3_600.0 * 99 / 100 + 864.0)


@pytest.mark.parametrize(
    ("factory", "name"),
    [
        (lambda: FailureModel(mtbf_s=-1.0), "mtbf_s"),
        (lambda: FailureModel(mtbf_s=10.0, nodes=0), "nodes"),
        (lambda: AshaRungs(rung_steps=(300, 100)), "rung_steps"),
        (lambda: AshaRungs(rung_steps=(100,), reduction_factor=1.0), "reduction_factor"),
        (lambda: UniformKill(start_step=0, end_step=10, probability=1.5), "probability"),
    ],
)
def test_bad_model_arguments_name_the_parameter(factory, name):
    """Model constructors validate their fields and name the bad one."""
    with pytest.raises(ConfigError, match=f"'{name}'"):
        factory()
