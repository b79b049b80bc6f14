"""Under the ``time`` objective the planner fits no loss curve: it pays for what it uses."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from planner_helpers import noisy_run

from coci_core.planner import Planner, StopDistribution
from coci_core.planner.curve import fit_loss_curve, value_density
from coci_core.planner.policies import Coci

STOPS = StopDistribution(
    steps=(500, 1000, 1500), probabilities=(0.3, 0.2, 0.1), source="a study's history"
)


def _drive(planner: Planner, losses: np.ndarray, start: int, stop: int) -> list[int]:
    saves = []
    for k in range(start, stop):
        planner.observe(k, loss=float(losses[k]), step_time_s=0.3)
        if planner.should_save(k):
            saves.append(k)
            planner.record_save(stall_s=0.5, persist_s=1.0)
    return saves


def _planner(objective: str, **kw: object) -> Planner:
    args: dict[str, object] = {
        "objective": objective,
        "total_steps": 2000,
        "mtbf_s": 1800.0,
        "termination": STOPS,
    }
    args.update(kw)
    return Planner(**args)  # type: ignore[arg-type]


def test_the_time_objective_fits_no_curve_where_convergence_fits_one() -> None:
    losses = noisy_run(2000, seed=3)
    timed, converging = _planner("time"), _planner("convergence")
    _drive(timed, losses, 1, 1200)
    _drive(converging, losses, 1, 1200)
    assert converging.report().loss_params  # the same losses do give a curve
    assert converging.report().fitted_loss is not None
    rep = timed.report()
    assert rep.replans >= 2
    assert rep.loss_params == ()
    assert rep.fitted_loss is None
    assert "not fitted: the time objective" in rep.loss_fit_reason
    assert "loss curve: not fitted: the time objective" in timed.explain(rep.next_steps[0])
    # nor is one kept in its state
    assert json.loads(json.dumps(timed.state_dict()))["curve"]["pieces"] == []


def test_the_time_plan_is_the_one_made_with_the_fitted_curve() -> None:
    """The value density does not enter the time objective: planning the same problem with
    the curve the planner used to fit gives the same steps."""
    losses = noisy_run(2000, seed=4)
    p = _planner("time")
    _drive(p, losses, 1, 700)
    inputs = p.overhead_inputs()
    assert inputs is not None
    problem, steps, _ = inputs
    curve = fit_loss_curve(np.arange(1, 700), losses[1:700])
    assert curve.trusted
    value = value_density(curve, 0, problem.end_step)[problem.start_step :]
    fitted = dataclasses.replace(problem, value=value)
    context = p._plan.context
    assert context is not None
    plain = tuple(int(x) for x in Coci().plan(problem, context=context))
    assert tuple(int(x) for x in Coci().plan(fitted, context=context)) == plain
    assert len(steps) >= 3
    assert plain[len(plain) - len(steps) :] == steps  # the planner's own plan


def test_a_curve_in_a_loaded_state_is_not_used_under_the_time_objective() -> None:
    losses = noisy_run(2000, seed=5)
    converging = _planner("convergence")
    _drive(converging, losses, 1, 1000)
    assert converging.report().loss_params
    timed = _planner("time")
    timed.load_state_dict(converging.state_dict())
    assert timed.report().loss_params == ()
    _drive(timed, losses, 1000, 1100)
    assert timed.report().fitted_loss is None


def test_changing_the_objective_to_convergence_fits_again() -> None:
    losses = noisy_run(2000, seed=6)
    p = _planner("time")
    _drive(p, losses, 1, 600)
    assert p.report().loss_params == ()
    p.objective = "convergence"
    p.set_termination(None)  # any re-plan
    _drive(p, losses, 600, 700)
    assert p.report().loss_params


def test_other_policies_say_they_use_no_curve() -> None:
    p = Planner(policy="daly", objective="time", total_steps=2000, mtbf_s=1800.0)
    _drive(p, noisy_run(2000, seed=7), 1, 300)
    assert p.report().loss_fit_reason == "no loss curve"


def _settled_planner() -> Planner:
    return _planner("time", total_steps=900, step_time_s=0.3, stall_s=0.5, persist_s=1.0)


def test_a_scheduled_replan_that_would_remake_the_same_plan_is_skipped() -> None:
    """Costs given, nothing to refit: the doubling schedule's re-plans would move a
    checkpoint by a step at most (the DP from a checkpoint whose persist is done)."""
    losses = noisy_run(900, seed=8)
    skipping, replanning = _settled_planner(), _settled_planner()
    saves_a, saves_b = [], []
    for k in range(1, 900):
        for planner, saves in ((skipping, saves_a), (replanning, saves_b)):
            planner.observe(k, loss=float(losses[k]))
            if planner is replanning and k in (64, 128, 256, 512):
                planner._plan.replan(k)  # what the doubling schedule did before
            if planner.should_save(k):
                saves.append(k)
    assert skipping.replans == 1
    assert replanning.replans == 5
    assert len(saves_a) == len(saves_b) >= 5
    assert max(abs(a - b) for a, b in zip(saves_a, saves_b, strict=True)) <= 1


def test_a_scheduled_replan_is_made_when_an_input_moved() -> None:
    def run(moved_step_s: float) -> Planner:
        p = _planner("time", total_steps=900, stall_s=0.5, persist_s=1.0)
        for k in range(1, 200):
            p.observe(k, step_time_s=0.3 if k < 10 else moved_step_s)
            p.should_save(k)
        return p

    assert run(0.3).replans == 1
    moved = run(0.33)  # by 10%: not enough for the 20% check, enough at 64 (not again at 128)
    assert moved.replans == 2
    assert moved._plan.plan_inputs["step_time_s"] == 0.33


def test_the_first_measured_save_cost_is_planned_with_at_once() -> None:
    """A plan made with an assumed save cost is remade as soon as a save measures it, not
    at the next periodic check (64 steps): short processes plan most of their steps early."""
    p = Planner(policy="daly", objective="time", total_steps=500, mtbf_s=20.0, default_stall_s=0.01)
    saves = []
    for k in range(1, 40):
        p.observe(k, step_time_s=0.1)
        if p.should_save(k):
            saves.append(k)
            p.record_save(stall_s=0.5, persist_s=0.5)
    assert saves[0] < 10  # the assumed 10 ms stall: short intervals
    assert p.replans == 2  # remade right after the first save, with its 0.5 s
    assert p._plan.plan_inputs["stall_s"] == 0.5
    assert len(saves) == 1  # the next one Daly's interval for 0.5 s later (~45 steps)
    assert p.schedule[0] - saves[0] > 40
