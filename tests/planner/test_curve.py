"""The loss-curve fit: recovers a real curve, rejects noise, finds a regime change."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from planner_helpers import noisy_run, power_loss

from coci_core.errors import ConfigError
from coci_core.planner import Planner, fit_loss_curve, value_density
from coci_core.planner.curve import curve_from_callable, curve_from_dict


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


def _linear_fall(n: int = 200, top: float = 0.8, seed: int = 0) -> np.ndarray:
    """A loss that falls about linearly to near 0, then levels off (10% noise)."""
    k = np.arange(n)
    rng = np.random.default_rng(seed)
    return (np.maximum(top - top * k / (0.9 * n), 0.0) + 0.05) * (1 + 0.1 * rng.standard_normal(n))


def test_the_fitted_loss_of_a_non_negative_loss_is_never_below_zero():
    """A loss never seen below 0 is fitted, reported and extrapolated at or above 0 (this
    curve's exponential fit used to reach -0.5 within as many steps again)."""
    losses = _linear_fall()
    curve = fit_loss_curve(np.arange(losses.size), losses)
    assert curve.trusted and curve.lower == 0.0
    ahead = curve.predict(np.arange(0, 4 * losses.size))
    assert ahead.min() >= 0.0
    assert ahead[0] == pytest.approx(0.85, abs=0.1)  # the fit itself is unchanged
    # the floor survives the planner's state
    assert curve_from_dict(curve.to_dict()).predict(np.array([800]))[0] >= 0.0
    # the planner's report gives the same, long after the fit
    planner = Planner(objective="convergence", total_steps=2_000, step_time_s=1.0, mtbf_s=3600.0)
    for step, loss in enumerate(losses, start=1):
        planner.observe(step, loss=float(loss), step_time_s=1.0)
    for step in range(losses.size + 1, 4 * losses.size):
        planner.observe(step, step_time_s=1.0)
    fitted = planner.report().fitted_loss
    assert fitted is not None and 0.0 <= fitted < 0.1


def test_a_loss_that_can_be_negative_is_not_floored():
    """A loss observed below 0 (a log-likelihood, say) has no floor at 0."""
    losses = _linear_fall() - 1.0
    curve = fit_loss_curve(np.arange(losses.size), losses)
    assert curve.lower is None
    assert curve.predict(np.array([4 * losses.size]))[0] < -1.0


@functools.cache
def _sgd_losses(steps: int, seed: int = 0) -> tuple[float, ...]:
    """The training losses of a small real model (an MLP, minibatch SGD on a noisy task)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend
    try:
        return tuple(_train(steps, seed))
    finally:
        torch.set_num_threads(threads)


def _train(steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, 16, generator=gen)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (32,), generator=gen)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("with_nan", [False, True], ids=["finite", "some-nan"])
@pytest.mark.filterwarnings("error")
def test_an_ordinary_noisy_run_raises_no_warning(with_nan):
    """A real model's noisy losses (some NaN, as a step in float16 may give) are observed,
    fitted and planned with at every size along the run without a RuntimeWarning."""
    losses = list(_sgd_losses(600))
    if with_nan:
        losses = [math.nan if i % 97 == 5 else v for i, v in enumerate(losses)]
    planner = Planner(objective="convergence", total_steps=5_000, step_time_s=1.0, mtbf_s=3600.0)
    for step, loss in enumerate(losses, start=1):
        planner.observe(step, loss=loss, step_time_s=1.0)
        if step in (33, 40, 50, 64, 100, 300, 600):
            finite = [(k, v) for k, v in enumerate(losses[:step]) if math.isfinite(v)]
            ks, vs = np.array(finite).T
            fit_loss_curve(ks, vs)
    assert planner.report().skipped_losses == (7 if with_nan else 0)
    assert planner.report().loss_fit_reason


def test_too_few_bins_to_measure_the_noise_try_no_regime_split(monkeypatch):
    """With fewer losses than bins, the noise of the residual's jumps cannot be measured: no
    split is tried (an unmeasured noise used to let every fit try one)."""
    import coci_core.planner.curve as curve_module

    tried: list[list[int]] = []
    fit_pieces = curve_module._fit_pieces

    def spy(x, y, offset, scale, cuts, max_bins):
        tried.append(list(cuts))
        return fit_pieces(x, y, offset, scale, cuts, max_bins)

    monkeypatch.setattr(curve_module, "_fit_pieces", spy)
    rng = np.random.default_rng(0)
    for n in (33, 40, 48):
        k = np.arange(n)
        losses = 2.3 * np.exp(-k / (n / 4)) + 0.1 + 0.05 * rng.standard_normal(n)
        curve = fit_loss_curve(k, losses)
        assert curve.trusted and len(curve.pieces) == 1
    assert tried == [[], [], []]
