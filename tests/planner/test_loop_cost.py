"""What a save costs the training loop: its stall plus the slowdown of the steps that overlap
its persist, measured from the step times and planned with."""

from __future__ import annotations

import pytest

from coci_core.planner import Planner

TAU = 0.3


def _run(
    planner: Planner,
    steps: int,
    *,
    slowed: int,
    slow_by: float,
    stall: float,
    unobserved: float | None = None,
    start: int = 1,
) -> list[int]:
    """Steps of TAU s; after each save, ``slowed`` steps take ``slow_by`` longer, then the
    persist commits (``record_save``) and the steps are back to TAU."""
    saves = []
    k = start
    while k < steps:
        planner.observe(k, loss=1.0, step_time_s=TAU)
        if planner.should_save(k):
            saves.append(k)
            for _ in range(slowed):
                k += 1
                planner.observe(k, loss=1.0, step_time_s=TAU + slow_by)
                assert not planner.should_save(k)
            planner.record_save(stall_s=stall, persist_s=1.0, unobserved_stall_s=unobserved)
        k += 1
    return saves


def _planner(**kw: float) -> Planner:
    return Planner(policy="daly", total_steps=20_000, mtbf_s=7200.0, **kw)


def test_a_save_that_slows_the_steps_of_its_persist_costs_more_than_its_stall() -> None:
    """Two steps slowed by 0.3 s each cost the loop 0.6 s on top of a 10 ms stall; the plan
    uses that cost (Daly's interval grows with it) where the stall alone would over-save."""
    slowed, free = _planner(), _planner()
    _run(slowed, 4000, slowed=2, slow_by=0.3, stall=0.01)
    _run(free, 4000, slowed=2, slow_by=0.0, stall=0.01)
    rep_slowed, rep_free = slowed.report(), free.report()
    assert rep_slowed.cost_sources["loop_cost_s"] == "measured"
    assert rep_slowed.costs["loop_cost_s"] == pytest.approx(0.61)
    assert rep_free.costs["loop_cost_s"] == pytest.approx(0.01)
    assert rep_slowed.costs["stall_s"] == pytest.approx(0.01)  # the stall itself is kept apart
    plan_slowed, plan_free = slowed.overhead_inputs(), free.overhead_inputs()
    assert plan_slowed is not None and plan_free is not None
    assert plan_slowed[0].stall_s == pytest.approx(0.61)
    assert plan_free[0].stall_s == pytest.approx(0.01)
    # Daly's interval scales with the square root of the checkpoint cost: sqrt(61) ~ 7.8x
    assert rep_slowed.interval_steps is not None and rep_free.interval_steps is not None
    assert 6 * rep_free.interval_steps < rep_slowed.interval_steps < 10 * rep_free.interval_steps


def test_a_wait_inside_the_next_step_is_not_counted_twice() -> None:
    """With block=False the before_update wait is both stall and step time: only the part of
    the stall outside the observed steps is added to their excess."""
    p = _planner()
    _run(p, 2000, slowed=1, slow_by=0.19, stall=0.2, unobserved=0.01)
    assert p.report().costs["loop_cost_s"] == pytest.approx(0.2)


def test_a_user_given_stall_is_planned_with_as_given() -> None:
    p = _planner(stall_s=0.01)
    _run(p, 2000, slowed=2, slow_by=0.3, stall=0.01)
    rep = p.report()
    assert rep.costs["loop_cost_s"] == pytest.approx(0.61)
    inputs = p.overhead_inputs()
    assert inputs is not None and inputs[0].stall_s == pytest.approx(0.01)


def test_a_save_that_never_commits_is_not_charged_and_the_charge_survives_a_state_round_trip() -> (
    None
):
    p = _planner()
    saved_at, k = None, 1
    while saved_at is None or k < saved_at + 300:  # a save whose persist never reports
        p.observe(k, loss=1.0, step_time_s=TAU)
        if p.should_save(k) and saved_at is None:
            saved_at = k
        k += 1
    assert p.report().cost_sources["loop_cost_s"] == "unknown"
    _run(p, k + 2000, slowed=1, slow_by=0.5, stall=0.0, start=k)
    restored = _planner()
    restored.load_state_dict(p.state_dict())
    assert restored.report().costs["loop_cost_s"] == pytest.approx(0.5)
