"""Invariances over a spread of curves and units (hypothesis is not installed: a fixed grid)."""

from __future__ import annotations

import pytest

from coci_core.planner import plan_schedule

JOB = {
    "total_steps": 20_000,
    "step_time_s": 0.5,
    "stall_s": 2.0,
    "persist_s": 5.0,
    "restart_s": 30.0,
    "mtbf_s": 4 * 3600.0,
}


@pytest.mark.parametrize(
    ("alpha", "k0", "scale", "offset"),
    [
        (0.2, 50.0, 0.01, -50.0),
        (0.5, 500.0, 3.0, 0.5),
        (1.0, 2_000.0, 1e3, 20.0),
        (2.0, 5_000.0, 0.37, -1.0),
        (0.8, 120.0, 42.0, 7.5),
    ],
)
def test_any_affine_change_of_a_power_law_loss_keeps_the_schedule(alpha, k0, scale, offset):
    """For power-law curves of many shapes, a positive scale and an offset never change steps."""

    def base(k):
        return 1.0 + 4.0 * (1 + k / k0) ** -alpha

    ref = plan_schedule(**JOB, loss=base).steps
    moved = plan_schedule(**JOB, loss=lambda k: scale * base(k) + offset).steps
    assert len(ref) > 3
    assert moved == ref


@pytest.mark.parametrize("unit", [1 / 60, 1 / 3600, 1e-3, 7.0])
def test_any_time_unit_keeps_the_schedule(unit):
    """Expressing every time in another unit never changes the steps."""

    def loss(k):
        return 2.0 + 3.0 * (1 + k / 800) ** -0.7

    ref = plan_schedule(**JOB, loss=loss).steps
    scaled = {k: (v * unit if k.endswith("_s") else v) for k, v in JOB.items()}
    assert len(ref) > 3
    assert plan_schedule(**scaled, loss=loss).steps == ref
