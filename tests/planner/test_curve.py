"""The loss-curve fit: recovers a real curve, rejects noise, finds a regime change."""

from __future__ import annotations

import numpy as np
import pytest
from planner_helpers import noisy_run, power_loss

from coci_core.errors import ConfigError
from coci_core.planner import fit_loss_curve, value_density
from coci_core.planner.curve import curve_from_callable


def test_a_noisy_power_law_is_fitted_and_its_value_density_is_close_to_the_truth():
    """10% noise on 20k steps still gives the true value density within 20% where it matters."""
    steps = np.arange(20_000)
    curve = fit_loss_curve(steps, noisy_run(20_000, seed=3))
    assert curve.trusted
    fitted = value_density(curve, 0, 50_000)
    truth = value_density(curve_from_callable(power_loss, 0, 50_000), 0, 50_000)
    for k in (0, 1_000, 5_000, 20_000):
        assert fitted[k] == pytest.approx(truth[k], rel=0.2)


def test_value_density_has_mean_one_and_falls_for_diminishing_returns():
    """The normalised value is 1 on average and decreasing for a power-law curve."""
    v = value_density(curve_from_callable(power_loss, 0, 50_000), 0, 50_000)
    assert v.mean() == pytest.approx(1.0, rel=1e-9)
    assert v[0] > 5 > 1 > v[-1]


def test_a_learning_rate_drop_is_found_as_a_second_piece():
    """A sudden drop in the loss splits the curve at the drop, unannounced."""
    steps = np.arange(40_000)
    base = power_loss(steps)
    dropped = np.where(steps < 20_000, base, base - 1.0 * (1 - np.exp(-(steps - 20_000) / 300)))
    rng = np.random.default_rng(2)
    curve = fit_loss_curve(steps, dropped * (1 + 0.05 * rng.standard_normal(steps.size)))
    assert curve.trusted
    assert len(curve.pieces) == 2
    assert abs(curve.pieces[1].start_step - 20_000) <= 1_000


def test_known_breakpoints_are_used_as_piece_boundaries():
    """A breakpoint given by the user starts a new piece there."""
    steps = np.arange(10_000)
    curve = fit_loss_curve(steps, power_loss(steps), breakpoints=[6_000])
    assert [p.start_step for p in curve.pieces] == [0, 6_000]


def test_too_few_losses_are_not_trusted():
    """A handful of values gives a flat (untrusted) curve and flat value."""
    curve = fit_loss_curve(np.arange(10), np.linspace(5, 1, 10))
    assert not curve.trusted
    assert np.all(value_density(curve, 0, 100) == 1.0)


def test_non_finite_observations_are_an_error():
    """fit_loss_curve refuses NaN/inf rather than silently fitting them."""
    with pytest.raises(ConfigError, match="'loss'"):
        fit_loss_curve([0, 1, 2], [1.0, np.inf, 0.5])
