"""Objectives are objects behind one registry: each knows its name, its weights and the figure
it minimises, and a newly registered one is planned for like the built-in ones."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from planner_helpers import power_loss

from coci_core.errors import ConfigError
from coci_core.planner import (
    OBJECTIVES,
    CostBreakdown,
    FailureModel,
    Objective,
    Planner,
    Problem,
    Schedule,
    daly_interval_s,
    expected_cost,
    make_objective,
    plan_schedule,
    register_objective,
    uniform_schedule,
)
from coci_core.planner import objectives as objectives_module
from coci_core.planner.objectives import TimeObjective

JOB = {
    "total_steps": 20_000,
    "step_time_s": 0.3,
    "stall_s": 0.5,
    "persist_s": 2.0,
    "restart_s": 60.0,
    "mtbf_s": 8 * 3600.0,
    "loss": power_loss,
}


FALLING = np.linspace(2.0, 0.1, 5_000)
PROBLEM = {
    "start_step": 0,
    "end_step": 5_000,
    "step_time_s": 0.3,
    "stall_s": 0.5,
    "persist_s": 2.0,
    "restart_s": 60.0,
    "failure": FailureModel(mtbf_s=3600.0),
    "value": FALLING / FALLING.mean(),
}


@pytest.mark.parametrize(
    ("name", "figure", "weights"),
    [
        ("time", "wall_s", (False, False)),
        ("convergence", "convergence_s", (True, False)),
        ("progress", "progress_s", (True, True)),
    ],
)
def test_each_objective_minimises_its_figure_with_its_weights(name, figure, weights):
    """The registry's objects give the figure CostBreakdown names, and the weights the solvers
    use."""
    pb = Problem(**PROBLEM, objective=name)
    b = expected_cost(pb, np.arange(500, 5_000, 500))
    objective = make_objective(name)
    assert objective is OBJECTIVES[name] and objective.name == name
    assert objective.cost(b) == getattr(b, figure) == b.objective(name)
    assert pb.goal is objective
    assert pb.weights() == weights
    assert objective.uses_value == any(weights)


@pytest.mark.parametrize("bad", ["speed", None, 3, ["time"]])
def test_an_unknown_objective_is_refused_naming_the_allowed_ones(bad):
    with pytest.raises(ConfigError, match="'objective' must be one of time, convergence, progress"):
        make_objective(bad)


def test_a_registered_objective_is_planned_for_without_other_changes(monkeypatch):
    """One class and its registration: plan_schedule and the Planner accept the new name."""

    class Wall(TimeObjective):
        name = "wall"

    monkeypatch.setitem(OBJECTIVES, "wall", Wall())
    assert isinstance(OBJECTIVES["wall"], Objective)
    assert objectives_module.OBJECTIVES is OBJECTIVES
    wall = plan_schedule(**JOB, objective="wall")
    time = plan_schedule(**JOB, objective="time")
    assert wall.steps == time.steps
    assert wall.expected_overhead_s.objective == "wall"
    assert wall.expected_overhead_s.objective_s == time.expected_overhead_s.objective_s
    assert Planner(objective="wall", total_steps=1_000, mtbf_s=3600.0).objective == "wall"


def test_time_is_the_default_objective_everywhere():
    """Every entry point plans for wall-clock time unless told otherwise: the Planner,
    plan_schedule, the options both adapters share, both adapters and the command line; the
    convergence objective is an opt-in."""
    import argparse
    import inspect

    from coci_accelerate import CociCheckpointer
    from coci_core.commands.simulate import add_subcommands
    from coci_core.training.options import CheckpointOptions
    from coci_lightning import CociCheckpoint

    assert Planner(total_steps=1_000).objective == "time"
    assert plan_schedule(**JOB).expected_overhead_s.objective == "time"
    assert CheckpointOptions.check(dirpath=None).objective == "time"
    for adapter in (CociCheckpoint, CociCheckpointer):
        assert inspect.signature(adapter).parameters["objective"].default == "time"
    parser = argparse.ArgumentParser(prog="coci")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    job = ["--total-steps", "100", "--step-time-s", "1", "--stall-s", "1", "--mtbf-h", "1"]
    for command in ("plan", "simulate"):
        assert parser.parse_args([command, *job]).objective == "time"
    opted = Planner(total_steps=1_000, objective="convergence")
    assert opted.objective == "convergence"


def test_the_default_objective_measures_a_save_early_instead_of_trusting_the_assumed_cost():
    """Before any save is measured the planner assumes 1 s per save: with a 20 s MTBF and 10 ms
    steps that plans no save in 200 steps. One early save measures the real (5 ms) cost, and
    the plan made with it saves every few dozen steps."""
    planner = Planner(total_steps=200, mtbf_s=20.0, step_time_s=0.01)
    saved = []
    for step in range(1, 200):
        planner.observe(step, step_time_s=0.01)
        if planner.should_save(step):
            saved.append(step)
            planner.record_save(stall_s=0.005, persist_s=0.005)
    assert saved and saved[0] <= 60
    assert len(saved) >= 4
    assert planner.cost_source("stall_s") == "measured"


def test_the_default_objective_takes_no_extra_save_where_its_first_planned_one_measures_the_cost():
    """With a save planned before the end, no profiling save is added: the first save is at
    Daly's interval for the assumed 1 s."""
    planner = Planner(total_steps=20_000, mtbf_s=2 * 3600.0, step_time_s=0.3)
    first = None
    for step in range(1, 20_000):
        planner.observe(step, step_time_s=0.3)
        if planner.should_save(step):
            first = step
            break
    assert first is not None
    assert abs(first - daly_interval_s(1.0, 2 * 3600.0) / 0.3) <= 2


class FewSaves(Objective):
    """Wall-clock time, each second of stall counted ten times: fewer checkpoints."""

    name = "few_saves"
    description = "wall-clock time, with each stall counted ten times"

    def cost(self, breakdown: CostBreakdown) -> float:
        return breakdown.wall_s + 9.0 * breakdown.stall_s


class LostWorkOnly(Objective):
    """Only the work a failure loses: saves cost nothing, so many more checkpoints."""

    name = "lost_work_only"
    description = "only the work a failure loses"

    def cost(self, breakdown: CostBreakdown) -> float:
        return breakdown.lost_compute_s + breakdown.lost_stall_s


@pytest.fixture
def registered() -> Iterator[None]:
    """FewSaves and LostWorkOnly registered the documented way, for one test."""
    register_objective(FewSaves())
    register_objective(LostWorkOnly())
    yield
    for name in (FewSaves.name, LostWorkOnly.name):
        del OBJECTIVES[name]


SHORT_JOB = {**JOB, "total_steps": 10_000}


def _best_uniform(schedule: Schedule) -> float:
    """The objective's lowest expected cost over uniform intervals from 0.6 to 1.6 times the
    plan's mean interval."""
    pb = schedule.problem
    mean = pb.horizon_steps / (len(schedule.steps) + 1)
    intervals = np.unique((mean * np.geomspace(0.6, 1.6, 12)).round())
    return min(pb.goal.cost(expected_cost(pb, uniform_schedule(pb, k))) for k in intervals)


def test_a_registered_objective_drives_the_plan_to_its_own_optimum(registered: None) -> None:
    """The solvers minimise the objective's cost(): an objective that counts stalls ten times
    plans fewer checkpoints than "time", one that values only lost work plans more; each plan
    costs less under its objective than Daly's, and no more than the best uniform interval."""
    time = plan_schedule(**SHORT_JOB, objective="time")
    few = plan_schedule(**SHORT_JOB, objective="few_saves")
    many = plan_schedule(**SHORT_JOB, objective="lost_work_only")
    assert 0 < len(few.steps) < len(time.steps) < len(many.steps)
    for plan in (few, many):
        ov = plan.expected_overhead_s
        assert ov.objective_s == plan.problem.goal.cost(expected_cost(plan.problem, plan.steps))
        assert ov.objective_s < 0.9 * ov.daly_objective_s
    assert few.expected_overhead_s.objective_s <= _best_uniform(few) * 1.001
    assert "Daly" not in Planner(objective="few_saves", total_steps=100).report().plan_method


def test_the_built_in_objectives_read_their_weights_off_cost() -> None:
    """The weights the solvers use are those of each objective's figure."""
    w = make_objective("convergence").weights
    assert (w.stall_s, w.lost_compute_s, w.lost_compute_value_s, w.restart_value_s) == (1, 0, 1, 0)
    assert make_objective("time").plans_as_time(value_is_flat=False)
    assert make_objective("progress").plans_as_time(value_is_flat=True)
    assert not make_objective("progress").plans_as_time(value_is_flat=False)


class Squared(Objective):
    name = "squared"

    def cost(self, breakdown: CostBreakdown) -> float:
        return breakdown.wall_s**2


class Rewarded(Objective):
    name = "rewarded"

    def cost(self, breakdown: CostBreakdown) -> float:
        return breakdown.lost_compute_s - breakdown.stall_s


@pytest.mark.parametrize("objective", [Squared(), Rewarded(), object()])
def test_an_objective_the_solvers_cannot_minimise_is_refused(objective: Any) -> None:
    """cost() must be a weighted sum with weights >= 0: refused when registered, and the
    registry is unchanged."""
    before = dict(OBJECTIVES)
    with pytest.raises(ConfigError, match=r"weights >= 0|not an Objective"):
        register_objective(objective)
    assert before == OBJECTIVES
