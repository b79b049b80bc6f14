"""The one plan line of the three adapters (``PlanOutline.line``): the same words whichever
adapter tells it, naming that adapter's class in the advice."""

from __future__ import annotations

import dataclasses

import pytest

from coci_core.planner import Planner
from coci_core.training import PlanOutline


def _outline(**report: object) -> PlanOutline:
    outline = PlanOutline.of(Planner(total_steps=100))
    fields = {"step": 10, "costs": {"step_time_s": 0.5}, **report}
    return dataclasses.replace(outline, report=dataclasses.replace(outline.report, **fields))


@pytest.mark.parametrize("adapter", ["CociCheckpoint", "CociCheckpointer", "CociCallback"])
def test_a_planned_run_is_told_with_its_times_and_the_advice_of_its_adapter(adapter: str) -> None:
    outline = _outline(policy="coci", next_steps=(40, 70), interval_steps=30)
    line, warn = outline.line(
        10, adapter=adapter, objective="time", total_source="given as total_steps"
    )
    assert line.startswith(
        "coci: plan at step 10 (coci policy, time objective) of 100 steps (given as "
        "total_steps): first save at step 40 (in ~15 s), then every 30 steps (~15 s); MTBF "
        "assumed "
    )
    assert f"Change it with {adapter}(mtbf_s=..., every_n_steps=N" in line
    assert not warn


def test_a_huge_mtbf_is_told_in_a_few_digits() -> None:
    """``mtbf_s=1e308`` (accepted: finite and > 0) was told in 309 digits."""
    outline = PlanOutline.of(Planner(total_steps=100, mtbf_s=1e308))
    line, _ = outline.line(1, adapter="CociCallback", objective="time")
    assert "MTBF assumed 1e+308 s (given as mtbf_s)" in line
    outline = PlanOutline.of(Planner(total_steps=100, mtbf_s=3600))
    assert "MTBF assumed 3600 s" in outline.line(1, adapter="CociCallback", objective="time")[0]


def test_no_save_before_the_end_is_a_warning() -> None:
    line, warn = _outline(policy="coci", next_steps=(), interval_steps=None).line(
        10, adapter="CociCallback", objective="time"
    )
    assert "no save planned before the end (only the final save)" in line and warn
    line, warn = _outline(policy="coci", next_steps=(), interval_steps=None).line(
        10, adapter="CociCallback", objective="time", final_save=False
    )
    assert "no save planned before the end; MTBF" in line and warn
    longer = _outline(policy="every_n_steps", next_steps=(), interval_steps=100)
    line, warn = longer.line(10, adapter="CociCallback", objective="time")
    assert "no save planned before the end (only the final save); a fixed interval" in line
    assert "then every" not in line and warn


def test_a_fixed_interval_names_no_mtbf_and_an_unknown_total_its_hint() -> None:
    outline = dataclasses.replace(
        _outline(policy="every_n_steps", next_steps=(12,), interval_steps=None),
        total_steps=None,
        every_n_steps=4,
    )
    line, warn = outline.line(
        10, adapter="CociCheckpointer", objective="time", total_hint="pass total_steps="
    )
    assert line == (
        "coci: plan at step 10 (every_n_steps policy, time objective) over a rolling horizon "
        "(pass total_steps=): first save at step 12 (in ~1 s), then every 4 steps (~2 s); a "
        "fixed interval: the MTBF and the measured costs do not change it; change it with "
        "CociCheckpointer(every_n_steps=N), or leave policy out for coci to plan from the "
        "measured costs."
    )
    assert not warn
    seconds = dataclasses.replace(
        _outline(policy="every_n_seconds", next_steps=()), every_n_seconds=30.0
    )
    line, warn = seconds.line(10, adapter="CociCallback", objective="time")
    assert ": a save every 30 s;" in line and "every_n_seconds=S" in line and not warn
    measuring = _outline(policy="coci", next_steps=(), interval_steps=None, costs={})
    line, warn = measuring.line(1, adapter="CociCallback", objective="time")
    assert "first save planned once a few step times are measured" in line and not warn


def test_a_first_save_at_the_runs_last_step_is_told_without_an_interval_after_it() -> None:
    """``epoch`` policy resumed at step 51 of 100 (50 steps an epoch): the one save left is at
    the run's last step. The line said "first save at step 100 ..., then every 50 steps", an
    interval past the run's end; it says that step is the run's last instead."""
    outline = _outline(policy="epoch", next_steps=(100,), interval_steps=50)
    line, warn = outline.line(51, adapter="CociCallback", objective="time")
    assert "first save at step 100 (in ~24.5 s), the run's last step;" in line, line
    assert "then every" not in line and not warn
