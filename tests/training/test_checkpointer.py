"""Checkpointer: the planner and the engine joined; shared decisions across ranks."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import ConfigError
from coci_core.planner import Planner
from coci_core.training.checkpointer import Checkpointer
from coci_core.training.decision import SharedDecision


def test_measured_save_costs_reach_the_planner(tmp_path: Path) -> None:
    """After a committed save the planner's stall and persist are measured, not defaults."""
    with_ckpt = Checkpointer(tmp_path, policy="every_n_steps", planner_options={"every_n_steps": 2})
    assert with_ckpt.planner.cost_source("stall_s") == "default"
    with_ckpt.save(2, {"w": torch.ones(10)})
    with_ckpt.wait()
    assert with_ckpt.planner.cost_source("stall_s") == "measured"
    assert with_ckpt.planner.cost_source("persist_s") == "measured"
    with_ckpt.close()


def test_bad_arguments(tmp_path: Path) -> None:
    """Unknown compression modes and bad telemetry settings are refused."""
    with pytest.raises(ConfigError, match="'compression' must be one of"):
        Checkpointer(tmp_path, compression="zstd")
    with pytest.raises(ConfigError, match="'telemetry_every_n_steps'"):
        Checkpointer(tmp_path, telemetry_every_n_steps=0)
    with pytest.raises(ConfigError, match="'policy'"):
        Checkpointer(tmp_path, policy="often")


def test_shared_decision_same_on_every_rank_with_few_broadcasts() -> None:
    """Two ranks whose planners see different losses and step times decide identically,
    broadcasting only at sync steps (far fewer than the steps)."""
    sent: dict[int, Any] = {}
    calls = {0: [], 1: []}  # type: dict[int, list[int]]

    def broadcaster(rank: int, step_of: list[int]) -> Any:
        def broadcast(obj: Any) -> Any:
            calls[rank].append(step_of[0])
            if rank == 0:
                sent[step_of[0]] = obj
            return sent[step_of[0]]

        return broadcast

    current = [0]
    planners = [
        Planner(policy="daly", total_steps=3000, mtbf_s=600.0, stall_s=0.5, step_time_s=0.1),
        Planner(policy="daly", total_steps=3000, mtbf_s=600.0, stall_s=0.5, step_time_s=0.3),
    ]
    ranks = [SharedDecision(planners[r], rank=r, broadcast=broadcaster(r, current)) for r in (0, 1)]
    decided: dict[int, list[int]] = {0: [], 1: []}
    for step in range(1, 3000):
        current[0] = step
        for r in (0, 1):  # rank 0 reaches each collective first, as a real broadcast orders
            planners[r].observe(step, loss=5.0 / (1 + step * (r + 1)), step_time_s=0.1 * (r + 1))
            if ranks[r].should_save(step):
                decided[r].append(step)
    assert decided[0] == decided[1]
    assert len(decided[0]) >= 3
    assert calls[0] == calls[1]
    assert len(calls[0]) < len(decided[0]) + 15


def test_shared_decision_of_every_n_steps_syncs_at_the_multiples() -> None:
    """policy every_n_steps with two ranks: both save at exactly 3, 6, 9 (the multiples are
    sync steps from the start, before any plan), broadcasting at far fewer steps than run."""
    sent: dict[int, Any] = {}
    calls: dict[int, list[int]] = {0: [], 1: []}
    current = [0]

    def broadcaster(rank: int) -> Any:
        def broadcast(obj: Any) -> Any:
            calls[rank].append(current[0])
            if rank == 0:
                sent[current[0]] = obj
            return sent[current[0]]

        return broadcast

    planners = [Planner(policy="every_n_steps", every_n_steps=3, total_steps=40) for _ in (0, 1)]
    ranks = [SharedDecision(planners[r], rank=r, broadcast=broadcaster(r)) for r in (0, 1)]
    decided: dict[int, list[int]] = {0: [], 1: []}
    for step in range(1, 41):
        current[0] = step
        for r in (0, 1):
            if ranks[r].should_save(step):
                decided[r].append(step)
    assert decided[0] == decided[1] == list(range(3, 40, 3))
    assert calls[0] == calls[1]
    assert set(range(3, 40, 3)) <= set(calls[0]) and len(calls[0]) < 25


class _PlanRecorder:
    """A telemetry sink that keeps each recorded plan and signals its arrival."""

    def __init__(self) -> None:
        self.plans: list[tuple[int, Any]] = []
        self.arrived = threading.Event()

    def __call__(self, event: Any) -> None:
        pass

    def record_plan(self, step: int, report: Any) -> None:
        self.plans.append((step, report))
        self.arrived.set()

    def record_loss(self, step: int, loss: float, fitted: float | None = None) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_plan_is_costed_once_not_at_every_save(tmp_path: Path) -> None:
    """Saves that leave the plan unchanged reuse its expected overhead against Daly (costing
    a plan takes tens of ms that the training thread shares); a new plan is costed anew."""
    sink = _PlanRecorder()
    ckpt = Checkpointer(
        tmp_path,
        policy="daly",
        mtbf_s=3600.0,
        keep_last=1,
        compression="none",
        sinks=[sink],
        planner_options={"total_steps": 2000, "step_time_s": 0.1, "stall_s": 0.5},
    )
    try:
        for step in range(1, 40):
            ckpt.observe(step, loss=2.0 / step, step_time_s=0.1)
            if step % 10 == 0:
                sink.arrived.clear()
                ckpt.save(step, {"w": torch.full((8,), float(step))})
                assert sink.arrived.wait(timeout=60), "no plan reached the sink"
    finally:
        ckpt.close()
    by_plan: dict[int, set[int]] = {}
    for _, report in sink.plans:
        assert report.expected_overhead is not None
        by_plan.setdefault(report.replans, set()).add(id(report.expected_overhead))
    assert all(len(ids) == 1 for ids in by_plan.values()), by_plan
    assert len(sink.plans) > len(by_plan), "every save changed the plan: test is void"


def test_the_restart_is_measured_from_process_start_and_planned_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restore, the first step ends the restart: a RestartEvent (process start to that
    step, the restore within it) reaches the telemetry and replaces the restore's time as the
    planner's restart cost; progress records tell how far the run got."""
    import coci_core.telemetry.events as events_module
    from coci_core.telemetry import JsonlTelemetry, RestartEvent, read_jsonl
    from coci_core.training.restart import process_start_unix

    first = Checkpointer(tmp_path, policy="every_n_steps", every_n_steps=5)
    first.save(5, {"w": torch.ones(10)})
    first.close()
    monkeypatch.setattr(events_module, "TELEMETRY_PROGRESS_EVERY_S", 1e9)
    events: list[Any] = []
    sink = JsonlTelemetry(tmp_path / "t.jsonl")
    ckpt = Checkpointer(tmp_path, listeners=[events.append], sinks=[sink])
    started = process_start_unix()
    assert started is not None  # Linux: read from /proc
    ckpt.restore()
    restore = ckpt.manager.last_restore
    assert restore is not None
    assert ckpt.planner.report().costs["restart_s"] == pytest.approx(restore.seconds)
    ckpt.observe(6, loss=1.0, step_time_s=0.01)
    ckpt.observe(7, loss=1.0, step_time_s=0.01)
    (restart,) = [e for e in events if isinstance(e, RestartEvent)]
    assert restart.step == 5 and restart.since == "process start"
    assert restart.restore_s == restore.seconds
    assert time.time() - started >= restart.seconds > restore.seconds
    assert ckpt.planner.report().costs["restart_s"] == pytest.approx(restart.seconds)
    ckpt.close()
    records = read_jsonl(tmp_path / "t.jsonl")
    assert [r["step"] for r in records if r["type"] == "progress"] == [6]  # then at most 1/s
    # the step reached is kept at every step, and the session's end is recorded
    step, ended, run = (tmp_path / "telemetry.progress").read_text().split()
    assert (step, ended) == ("7", "end") and {r["run_id"] for r in records} == {run}
    assert [r["step"] for r in records if r["type"] == "end"] == [7]
    assert [r["seconds"] for r in records if r["type"] == "restart"] == [restart.seconds]


def _resume(directory: Path) -> Checkpointer:
    """A new process's Checkpointer: restore, then the planner state from the checkpoint."""
    import coci_core.training.checkpointer as checkpointer_module

    # a new process has trained nowhere yet (in this one, a restore of the step it ended
    # at would continue the run: no failure)
    checkpointer_module._TRAINED_HERE.clear()
    ckpt = Checkpointer(
        directory,
        policy="coci",
        objective="time",
        planner_options={"total_steps": 100, "default_stall_s": 0.01},
        mtbf_s=60.0,
    )
    state = ckpt.restore()
    ckpt.load_state_dict(state.get("coci", {}))
    return ckpt


def _train(ckpt: Checkpointer, first: int, last: int) -> None:
    for k in range(first, last + 1):
        ckpt.observe(k, loss=1.0, step_time_s=0.01)
    ckpt.save(last, {"w": torch.ones(4), "coci": ckpt.state_dict()}, block=True).wait()


def test_a_resume_keeps_its_failure_and_restart_after_the_checkpoints_planner_state(
    tmp_path: Path,
) -> None:
    """``restore()`` then ``load_state_dict()`` (the adapters' order): the state, taken before
    the failure, does not erase it: the failures add up and each restart is kept."""
    first = Checkpointer(tmp_path, policy="coci", objective="time", mtbf_s=60.0)
    _train(first, 1, 10)
    first.close()
    restarts = []
    for resume in range(1, 4):
        ckpt = _resume(tmp_path)
        plans = ckpt.planner.replans
        _train(ckpt, 10 * resume + 1, 10 * resume + 10)
        state = ckpt.planner.state_dict()
        assert state["failures"] == resume
        restarts = state["costs"]["restart_s"]
        assert len(restarts) == resume  # one whole restart per resume, none replaced
        # one re-plan, at the first step, with the restart known
        assert ckpt.planner.replans == plans + 1
        ckpt.close()
    assert ckpt.planner.report().costs["restart_s"] == pytest.approx(
        sorted(restarts)[len(restarts) // 2]
    )


def test_a_resume_from_a_step_the_user_chose_is_no_failure(tmp_path: Path) -> None:
    """A restore of an older step than the newest (Lightning's ``ckpt_path=<step>``, the
    Trainer's ``resume_from_checkpoint=<step dir>``: going back on purpose) counts no failure
    for the MTBF; a resume of the newest (after a crash) still counts one."""
    import coci_core.training.checkpointer as checkpointer_module

    first = Checkpointer(tmp_path, policy="coci", objective="time", mtbf_s=60.0)
    _train(first, 1, 10)
    _train(first, 11, 20)
    first.close()
    checkpointer_module._TRAINED_HERE.clear()  # a new process
    chosen = Checkpointer(tmp_path, policy="coci", objective="time", mtbf_s=60.0)
    try:
        chosen.load_state_dict(chosen.restore(10)["coci"])
        assert chosen.resumed_from == 10 and chosen.planner.failures == 0
    finally:
        chosen.close()
    crashed = _resume(tmp_path)  # the newest, step 20
    try:
        assert crashed.resumed_from == 20 and crashed.planner.failures == 1
    finally:
        crashed.close()


def test_termination_hazards_combine_by_source(tmp_path: Path) -> None:
    """Each source's hazard replaces that source's earlier one, multiplies with the others and
    with the options' own, and None removes it."""
    from coci_core.planner import UniformKill

    own = UniformKill(start_step=0, end_step=100, probability=0.5)
    ckpt = Checkpointer(tmp_path, planner_options={"termination": own})
    early = UniformKill(start_step=0, end_step=100, probability=0.2)
    ckpt.set_termination("early_stopping", early)
    ckpt.set_termination("early_stopping", early)  # replaced, not counted twice
    assert float(ckpt.planner.termination.survival([100])[0]) == pytest.approx(0.5 * 0.8, abs=0.02)
    ckpt.set_termination("early_stopping", None)
    assert ckpt.planner.termination == own
    ckpt.close()


def test_the_rank_group_of_an_adapter(tmp_path: Path) -> None:
    """world_size=1 writes alone; several processes need the broadcast for the session name."""
    ckpt = Checkpointer(tmp_path / "one", world_size=1)
    assert ckpt.manager.group.world_size == 1
    ckpt.close()
    with pytest.raises(ConfigError, match="'broadcast' is needed"):
        Checkpointer(tmp_path / "two", rank=0, world_size=2)
