"""The time between timed steps (validation, logging, waits) is work a failure loses: the
planner plans with the wall time per step, not only the steps' own times."""

from __future__ import annotations

import numpy as np
import pytest

import coci_core.planner.observations as observations
from coci_core.planner import Planner
from coci_core.planner.optimize import daly_interval_s

STEP_S = 0.01
STALL_S = 0.002
MTBF_S = 30.0


class Clock:
    """A monotonic clock the test moves: the loop's wall time, made exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(observations, "_clock", c)
    return c


def _run(
    clock: Clock, *, between_s: float, every: int = 10, steps: int = 600, **kw: object
) -> tuple[Planner, list[int]]:
    """Steps of ``STEP_S`` with ``between_s`` of untimed work after every ``every``-th step
    (a validation) and the saves' stalls: the wall clock moves by all of it."""
    args: dict[str, object] = {
        "policy": "daly",
        "objective": "time",
        "total_steps": steps,
        "mtbf_s": MTBF_S,
        "stall_s": STALL_S,
    }
    args.update(kw)
    p = Planner(**args)  # type: ignore[arg-type]
    saves = []
    for k in range(1, steps):
        clock.now += STEP_S
        p.observe(k, step_time_s=STEP_S)
        if k % every == 0:
            clock.now += between_s
        if p.should_save(k):
            saves.append(k)
            clock.now += STALL_S
            p.record_save(stall_s=STALL_S)
    return p, saves


def _daly_steps(step_s: float) -> int:
    return round(daly_interval_s(STALL_S, MTBF_S) / step_s)


def test_the_plan_counts_the_time_between_steps(clock: Clock) -> None:
    p, saves = _run(clock, between_s=0.05)  # 5 ms per step on average outside the steps
    gaps = np.diff(saves)[2:]
    assert np.all(np.abs(gaps - _daly_steps(0.015)) <= 1)
    assert _daly_steps(0.015) < _daly_steps(STEP_S) - 10  # what was planned before
    assert p._plan.plan_inputs["step_time_s"] == pytest.approx(0.015, rel=0.06)
    assert p.report().costs["step_time_s"] == pytest.approx(STEP_S)  # the steps' own median
    assert "s of wall time per step: the steps' median 0.01 s" in p.explain(saves[-1])


def test_saves_are_not_counted_as_time_between_steps(clock: Clock) -> None:
    p, saves = _run(clock, between_s=0.0)
    assert p._plan.plan_inputs["step_time_s"] == pytest.approx(STEP_S)
    assert np.all(np.abs(np.diff(saves)[2:] - _daly_steps(STEP_S)) <= 1)
    assert "wall time per step" not in p.explain(saves[-1])


def test_a_replay_faster_than_its_step_times_plans_with_the_step_times(clock: Clock) -> None:
    """Step times given faster than the wall clock moves (a replay, a simulation): as before."""
    p = Planner(policy="daly", objective="time", total_steps=600, mtbf_s=MTBF_S, stall_s=STALL_S)
    for k in range(1, 300):
        clock.now += STEP_S / 100
        p.observe(k, step_time_s=STEP_S)
        p.should_save(k)
    assert p._plan.plan_inputs["step_time_s"] == pytest.approx(STEP_S)


def test_a_user_given_step_time_is_planned_with_as_given(clock: Clock) -> None:
    p, _ = _run(clock, between_s=0.05, step_time_s=STEP_S)
    assert p._plan.plan_inputs["step_time_s"] == STEP_S


def test_the_mtbf_estimate_counts_the_time_between_steps(clock: Clock) -> None:
    """Failures strike during validation too: the run's elapsed time includes it."""
    p, _ = _run(clock, between_s=0.05, steps=401, mtbf_s=None, default_mtbf_s=3600.0)
    p.record_restore(1.0)
    clock.now += 500.0  # the restore and restart: not a step, nor time between steps
    p.observe(401, step_time_s=STEP_S)
    state = p.state_dict()
    assert state["elapsed_s"] > 400 * STEP_S + 39 * 0.05  # the steps and 39 validations
    assert state["elapsed_s"] < 400 * 0.015 + 2.0  # and not the restore's gap
    assert state["failures"] == 1
