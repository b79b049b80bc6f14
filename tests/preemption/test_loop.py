"""A plain training loop stopped by real notices: SIGTERM to a real child (and SIGKILL after
the grace period, as a scheduler does), a grace period too short for the measured save, the
AWS notice from a local stand-in for the metadata endpoint, a SIGUSR1 a set time before the
end (the save moved to the last step that fits), and two and four gloo ranks of which only one
gets the signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from coci_core import CheckpointManager
from coci_core.telemetry import read_jsonl
from coci_core.telemetry.report import notices, preemption_line, render, summarize
from tests.harness.processes import Child, free_port, module, rank_env, script
from tests.preemption.metadata_server import MetadataServer

CHILD = "tests.preemption._loop_child"


def _marks(lines: list[str], mark: str) -> list[dict[str, Any]]:
    # ranks share the pipe: one's line may run into another's (print writes the newline apart)
    decoder, rows = json.JSONDecoder(), []
    for line in lines:
        if mark + " " in line:
            rows += [decoder.raw_decode(p.strip())[0] for p in line.split(mark + " ")[1:]]
    return rows


def _preempt(
    child: Child, grace_s: float, notify: Any, mark: str = "READY"
) -> tuple[int, list[str]]:
    """Read the child's lines; at the line starting with ``mark`` call ``notify``;
    SIGKILL it if it still runs ``grace_s`` later (the scheduler's end of the grace period).
    Its status and lines."""
    lines = []
    while line := child.readline():  # (leaving lines() early would close the pipe)
        lines.append(line)
        if line.startswith(mark):
            notify()
            break
    try:
        code = child.wait(grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        code = child.wait()
    lines.extend(child.lines())
    return code, lines


def _restored(directory: Path) -> tuple[int, dict[str, Any]]:
    with CheckpointManager(directory, keep_last=None) as mgr:
        step = mgr.latest_step()
        assert step is not None
        return step, mgr.restore(step)


def _digest(state: dict[str, Any]) -> str:
    import hashlib

    return hashlib.sha256(
        b"".join(t.numpy().tobytes() for t in state["model"].values())
    ).hexdigest()


def test_sigterm_with_time_to_save_saves_the_next_step(tmp_path: Path) -> None:
    args = {"dir": str(tmp_path), "sources": ["TERM@20"], "margin_s": 2}
    with Child(module(CHILD, json.dumps(args)), stderr=subprocess.DEVNULL) as child:
        code, lines = _preempt(child, 20, lambda: os.kill(child.pid, signal.SIGTERM))
    assert code == 143  # stopped by itself, before the SIGKILL
    (stop,) = _marks(lines, "PREEMPTED")
    assert stop["source"] == "SIGTERM" and stop["saved"] == stop["at"] > 5
    saved = {s["step"]: s["digest"] for s in _marks(lines, "SAVED")}
    step, state = _restored(tmp_path)
    assert step == stop["at"] and _digest(state) == saved[step]
    # the job starts again from that step
    with Child(
        module(CHILD, json.dumps({**args, "ready_at": 1})), stderr=subprocess.DEVNULL
    ) as child:
        code, lines = _preempt(child, 20, lambda: os.kill(child.pid, signal.SIGTERM))
    assert code == 143
    (resumed,) = _marks(lines, "RESUMED")
    assert resumed == {"step": step, "digest": saved[step]}


def test_a_save_that_cannot_fit_the_grace_period_is_not_started(tmp_path: Path) -> None:
    """The measured save takes over 2 s (a slow disk); SIGTERM with a 2 s grace period: the
    notice's step is not saved, the previous step stays the newest. The child stops, or is
    SIGKILLed at the end of the grace period while its interpreter exits (torch's teardown
    takes seconds on a loaded machine)."""
    args = {
        "dir": str(tmp_path),
        "sources": ["TERM@2"],
        "margin_s": 0.5,
        "write_delay_s": 2.5,
    }
    with Child(module(CHILD, json.dumps(args)), stderr=subprocess.DEVNULL) as child:
        code, lines = _preempt(child, 2, lambda: os.kill(child.pid, signal.SIGTERM))
    (stop,) = _marks(lines, "PREEMPTED")
    assert code in (143, -signal.SIGKILL)
    assert stop["saved"] is None and "not started" in stop["reason"]
    assert [s["step"] for s in _marks(lines, "SAVED")] == [5]
    assert _restored(tmp_path)[0] == 5
    assert not any(
        p.name.startswith("step-") and p.name != "step-0000000005" for p in tmp_path.iterdir()
    )


def test_a_notice_whose_save_a_sigkill_cuts_short_is_in_the_report(tmp_path: Path) -> None:
    """SIGTERM, then SIGKILL sooner than the grace period coci was told (30 s), while the
    notice's save is being written: ``coci report`` names the notice and says that its save
    was not durable (it said nothing of it: the notice's record was written once the save was
    durable); the newest checkpoint stays the previous one."""
    args = {"dir": str(tmp_path), "sources": ["TERM@30"], "write_delay_s": 2, "telemetry": True}
    lines: list[str] = []
    with Child(module(CHILD, json.dumps(args)), stderr=subprocess.DEVNULL) as child:
        assert _until(child, "READY", lines)
        os.kill(child.pid, signal.SIGTERM)
        assert _until(child, "SAVED", lines)  # the notice's save began: its write takes 2 s
        child.kill()
        assert child.wait() == -signal.SIGKILL
    (notice,) = notices(read_jsonl(tmp_path / "telemetry.jsonl"))
    assert notice["save"] and notice["saved"] is None and notice["step"] > 5
    assert _restored(tmp_path)[0] == 5
    report = render(summarize(tmp_path))
    assert (
        f"preemption notice (SIGTERM) at step {notice['step']}, 30.0 s left: not saved: the "
        "process ended before the save was durable (killed before the deadline coci was "
        "given?)"
    ) in report, report


def test_the_aws_spot_notice_from_the_metadata_endpoint(tmp_path: Path) -> None:
    """The notice's time is the end (two minutes ahead on EC2; 3 to 4 s here): training goes
    on to the last step before it at which the save fits, saves it and stops."""
    with MetadataServer() as server:
        args = {"dir": str(tmp_path), "sources": [{"aws": server.url}], "margin_s": 2}

        def notify() -> None:
            when = time.gmtime(time.time() + 4)
            server.aws_action = {
                "action": "terminate",
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", when),
            }

        with Child(module(CHILD, json.dumps(args)), stderr=subprocess.DEVNULL) as child:
            code, lines = _preempt(child, 60, notify)
    assert code == 143
    (stop,) = _marks(lines, "PREEMPTED")
    assert stop["source"] == "aws" and stop["saved"] == stop["at"] > stop["noticed_at"]
    assert _restored(tmp_path)[0] == stop["at"]


def test_two_gloo_ranks_save_the_same_step_when_only_one_gets_sigterm(tmp_path: Path) -> None:
    """Rank 1 alone gets SIGTERM; at the next step boundary both ranks learn of it, both save
    that step (each its share) and stop; the checkpoint restores to what they saved."""
    args = json.dumps({"dir": str(tmp_path), "sources": ["TERM@30"], "margin_s": 2})
    port = free_port()
    children = [
        Child(module(CHILD, args), env=rank_env(r, 2, port), stderr=subprocess.DEVNULL)
        for r in range(2)
    ]
    try:
        ready = 0
        lines: list[list[str]] = [[], []]
        for rank, child in enumerate(children):  # both saved step 5 and wait at READY
            while line := child.readline():
                lines[rank].append(line)
                if line.startswith("READY"):
                    ready += 1
                    break
        assert ready == 2
        os.kill(children[1].pid, signal.SIGTERM)
        codes = _wait_all(children, lines)
    finally:
        for child in children:
            child.close()
    assert codes == [143, 143]
    stops = [_marks(rank_lines, "PREEMPTED")[0] for rank_lines in lines]
    assert [s["source"] for s in stops] == ["another rank", "SIGTERM"]
    assert stops[0]["at"] == stops[1]["at"] == stops[0]["saved"] == stops[1]["saved"] > 5
    saved = {s["step"]: s["digest"] for s in _marks(lines[0], "SAVED")}
    step, state = _restored(tmp_path)
    assert step == stops[0]["at"] and _digest(state) == saved[step]


def test_a_notice_of_a_known_end_moves_the_save_to_the_last_step_that_fits(
    tmp_path: Path,
) -> None:
    """SIGUSR1 4 s before the end (SLURM's ``--signal=USR1@4``), 20 ms steps: training goes
    on; the plan moves the save to the last step before the deadline at which it fits, the
    save is taken there, durable before the deadline, and the run stops."""
    args = {
        "dir": str(tmp_path),
        "sources": ["USR1@4"],
        "margin_s": 1,
        "step_s": 0.02,
        "telemetry": True,
    }
    with Child(module(CHILD, json.dumps(args)), stderr=subprocess.DEVNULL) as child:
        code, lines = _preempt(child, 30, lambda: os.kill(child.pid, signal.SIGUSR1))
    assert code == 143
    (stop,) = _marks(lines, "PREEMPTED")
    assert stop["source"] == "SIGUSR1" and stop["saved"] == stop["at"]
    assert stop["at"] > stop["noticed_at"] + 50  # about 150 steps fit before the deadline
    records = read_jsonl(tmp_path / "telemetry.jsonl")
    plans = [r for r in records if r["type"] == "plan" and r["step"] >= stop["noticed_at"]]
    ahead = [r for r in plans if r["step"] < stop["at"]]  # the plan in force until the save
    assert ahead and ahead[-1]["next_steps"] == [stop["at"]]
    assert ahead[-1]["plan_method"].startswith("preemption notice: SIGUSR1")
    # the record at the save: the plan has moved past it, as at any planned save
    assert plans[-1]["step"] == stop["at"] and plans[-1]["next_steps"] == []
    pending, notice = [r for r in records if r["type"] == "preemption"]
    assert pending["pending"] and pending["saved"] is None  # the decision, before its save
    assert notices(records) == [notice] and "pending" not in notice
    assert notice["noticed_at"] == stop["noticed_at"] and notice["step"] == stop["at"]
    assert 3 < notice["noticed_left_s"] <= 4
    # as late as fits: less than a second more than the margin left at the planned step; the
    # save durable before the deadline (the margin is the reserve for a save slower than the
    # measured ones: a CI run's took 0.039 s with 1.023 s left and a 1 s margin)
    assert 1 < notice["time_left_s"] < 2
    assert notice["save_s"] < notice["time_left_s"]
    assert preemption_line(notice).startswith(
        f"preemption notice (SIGUSR1) at step {stop['noticed_at']}, "
    ) and f"the save moved to step {stop['at']}" in preemption_line(notice)
    assert _restored(tmp_path)[0] == stop["at"]


def _wait_all(children: list[Child], lines: list[list[str]]) -> list[int]:
    """Each child's exit status, once it ended; the rest of its lines added to ``lines``."""
    codes = [child.wait(60) for child in children]
    for rank, child in enumerate(children):
        lines[rank].extend(child.lines())
    return codes


def _until(child: Child, mark: str, lines: list[str]) -> bool:
    """Read ``child``'s lines into ``lines`` up to one starting with ``mark``; whether one did."""
    while line := child.readline():
        lines.append(line)
        if line.startswith(mark):
            return True
    return False


@pytest.mark.dist
@pytest.mark.slow
def test_four_gloo_ranks_agree_on_a_moved_save_when_only_one_gets_the_notice(
    tmp_path: Path,
) -> None:
    """Rank 3 of 4 alone gets SIGUSR1 3 s before the end: every rank learns of it at the same
    step, every rank trains on to the same planned step and saves it (each its share), all
    stop with exit status 143; the checkpoint restores exactly what they saved."""
    args = {"dir": str(tmp_path), "sources": ["USR1@3"], "margin_s": 1, "step_s": 0.02}
    world = 4
    lines: list[list[str]] = [[] for _ in range(world)]
    port = free_port()
    children = [
        Child(
            module(CHILD, json.dumps(args)), env=rank_env(r, world, port), stderr=subprocess.DEVNULL
        )
        for r in range(world)
    ]
    try:
        assert all(_until(child, "READY", lines[r]) for r, child in enumerate(children))
        os.kill(children[3].pid, signal.SIGUSR1)
        codes = _wait_all(children, lines)
    finally:
        for child in children:
            child.close()
    assert codes == [143] * world
    stops = [_marks(rank_lines, "PREEMPTED")[0] for rank_lines in lines]
    assert [s["source"] for s in stops] == ["another rank"] * 3 + ["SIGUSR1"]
    assert len({(s["noticed_at"], s["at"], s["saved"]) for s in stops}) == 1
    step = stops[0]["saved"]
    assert step == stops[0]["at"] > stops[0]["noticed_at"] > 5
    saved = {s["step"]: s["digest"] for s in _marks(lines[0], "SAVED")}
    restored, state = _restored(tmp_path)  # every rank's share, committed together
    assert restored == step and _digest(state) == saved[step]


@pytest.mark.parametrize(
    ("sent", "handler", "ends"),
    [
        ("SIGTERM", "none", True),  # as the default action would, once the save is durable
        ("none", "none", False),
        ("SIGUSR1", "none", False),  # a known end to come: the process may finish first
        ("SIGTERM", "user", False),  # the user's handler ran when it came: theirs to act
    ],
)
def test_a_sigterm_after_the_last_step_boundary_ends_the_process_at_close(
    tmp_path: Path, sent: str, handler: str, ends: bool
) -> None:
    """A SIGTERM after the last step boundary (a final evaluation, the final save) was
    recorded by coci's handler, never acted on, and dropped at ``close()``: the process went
    on, where without coci it would have ended. ``close()`` raises ``Preempted`` (exit status
    143) now, once the final save is durable."""
    from tests.harness.processes import run

    out = run(module("tests.preemption._late_child", str(tmp_path), sent, handler), timeout_s=120)
    if ends:
        assert out.returncode == 143, (out.returncode, out.stderr)
        assert "CLOSED" not in out.stdout
        assert "SIGTERM came after the last step boundary" in out.stderr
    else:
        assert out.returncode == 0, out.stderr
        assert "CLOSED" in out.stdout
    assert ("USER HANDLER" in out.stdout) == (handler == "user" and sent == "SIGTERM")
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        assert mgr.steps()[-1] == 7  # the final save is durable either way


def test_a_handler_installed_after_cocis_is_left_in_place(tmp_path: Path) -> None:
    """Stopping the watch put back the handler from before coci's, over one the user
    installed after it."""
    from coci_core.preemption.notice import NoticeBoard
    from coci_core.preemption.signals import SignalNotice

    before = signal.getsignal(signal.SIGUSR2)
    notice = SignalNotice("USR2", 60)
    assert notice.start(NoticeBoard())

    def users(signum: int, frame: Any) -> None:
        pass

    signal.signal(signal.SIGUSR2, users)
    try:
        notice.stop()
        assert signal.getsignal(signal.SIGUSR2) is users
    finally:
        signal.signal(signal.SIGUSR2, before)


_RANK_GONE = """
import os, sys
import torch.distributed as dist
from coci_core.training.preemption import min_over_ranks
dist.init_process_group("gloo")
reduce = min_over_ranks()
print("FIRST", reduce(float(dist.get_rank())), flush=True)
if dist.get_rank() == 1:
    os._exit(0)  # a rank killed between two step boundaries
try:
    reduce(5.0)
except Exception as e:
    print("ERROR", type(e).__name__, e, flush=True)
os._exit(0)
"""


def test_a_rank_gone_at_a_step_boundary_is_named_not_a_gloo_error() -> None:
    """The ranks compare notices at every step boundary: when another rank has exited, the
    survivor is told so in coci's words (before: gloo's raw "Connection closed by peer")."""
    port = free_port()
    command = script(_RANK_GONE)
    with (
        Child(command, env=rank_env(0, 2, port)) as rank0,
        Child(command, env=rank_env(1, 2, port)) as rank1,
    ):
        out1 = [line.strip() for line in rank1.lines()]
        out0 = [line.strip() for line in rank0.lines()]
        assert rank1.wait(60) == 0 and rank0.wait(60) == 0
    assert "FIRST 0.0" in out0 and "FIRST 0.0" in out1
    (error,) = [line for line in out0 if line.startswith("ERROR")]
    assert error.startswith("ERROR CociError the ranks could not compare preemption notices")
    assert "another rank has most likely exited" in error


def test_a_notice_at_a_planned_step_moves_the_plan_past_it(tmp_path: Path) -> None:
    """SIGTERM at the step the plan saves at: the notice's save is that planned save, so the
    plan saved with it has moved past it, and the resumed run does not take it as still due
    (it saved again at the first step after the resume)."""
    import torch

    from coci_core import Preempted
    from coci_core.training import Checkpointer

    options: dict[str, Any] = {
        "policy": "coci",
        "mtbf_s": 600.0,
        "preemption": "TERM@30",
        "planner_options": {"total_steps": 100, "step_time_s": 1.0, "stall_s": 1.0},
    }
    ckpt = Checkpointer(tmp_path, **options)
    ckpt.watch_preemption()
    try:
        ckpt.observe(1)
        planned = ckpt.planner.schedule[0]
        assert not any(ckpt.should_save(s) for s in range(1, planned))
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line
        assert ckpt.should_save(planned) and ckpt.preempted is not None
        ckpt.save(planned, {"w": torch.zeros(2), "coci": ckpt.state_dict(), "step": planned})
        with pytest.raises(Preempted):
            ckpt.stop_if_preempted()
    finally:
        ckpt.close()
    resumed = Checkpointer(tmp_path, **options)
    try:
        state = resumed.restore()
        resumed.load_state_dict(state["coci"])  # the plan, as the adapters restore it
        assert state["step"] == planned
        assert all(s > planned for s in resumed.planner.schedule)
        resumed.observe(planned + 1)
        assert not resumed.should_save(planned + 1)
    finally:
        resumed.close()


def test_a_resumed_run_plans_a_known_end_from_the_saves_measured_before_it(
    tmp_path: Path,
) -> None:
    """The save times measured before a resume count at the resumed run's first notice: a
    known end (SIGUSR1 30 s ahead) before its first save of its own moves the save to the last
    step that fits (it stopped at once, "the save's time is not measured yet")."""
    import torch

    from coci_core.training import Checkpointer

    options: dict[str, Any] = {"policy": "every_n_steps", "every_n_steps": 10**9}
    first = Checkpointer(tmp_path, **options)
    try:
        first.save(1, {"w": torch.zeros(2), "step": 1})
        first.wait()  # its time to durable is measured
        first.save(2, {"w": torch.zeros(2), "coci": first.state_dict(), "step": 2})
    finally:
        first.close()
    resumed = Checkpointer(tmp_path, preemption="USR1@30", **options)
    try:
        resumed.load_state_dict(resumed.restore()["coci"])
        resumed.watch_preemption()
        for step in range(3, 12):  # steps of a few microseconds each
            resumed.observe(step)
            assert not resumed.should_save(step)
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs before the next line
        resumed.observe(12)
        assert not resumed.should_save(12)
        assert resumed.preempted is None and resumed.notice_plan is not None
        assert resumed.notice_plan.save_at > 1000  # training goes on towards the deadline
    finally:
        resumed.close()


class _StepClock:
    """``time.monotonic()`` as a loop's steps move it, by exactly their compute time: on a
    loaded machine a 2 ms ``time.sleep`` takes 2 to 50 ms, far more than the 2 % a step slows
    by, so the pace the plan is checked against was noise (the plan held, or was made again
    only once: 5 failures in 12 runs beside two busy processes)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_moved_save_made_again_as_steps_slow_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGUSR1 30 s before the end, steps slowing a little at a time: the plan is made again
    every few steps, a few steps sooner each time. One WARNING line says the save moved; the
    small moves after it are INFO lines (they were a WARNING each, 4-5 per notice); a notice
    of another source with an earlier end is said again; a SIGTERM that cuts the plan short
    names both notices. The steps' times are exact (:class:`_StepClock`); the save and its
    measured time to durable are real."""
    import logging

    import torch

    from coci_core.training import Checkpointer

    options: dict[str, Any] = {"policy": "every_n_steps", "every_n_steps": 10**9}
    ckpt = Checkpointer(tmp_path, preemption=["USR1@30", "USR2@20", "TERM@10"], **options)
    caplog.set_level(logging.INFO, logger="coci_core.training.checkpointer")
    plans = []
    try:
        ckpt.save(1, {"w": torch.zeros(2)})
        ckpt.wait()  # its time to durable is measured
        clock = _StepClock(time.monotonic())
        monkeypatch.setattr(time, "monotonic", clock)  # the notices' times and the steps'
        ckpt.watch_preemption()
        compute_s = 0.002
        for step in range(2, 60):
            if step == 12:
                signal.raise_signal(signal.SIGUSR1)  # its handler has run when this returns
            if step > 12:
                compute_s *= 1.02  # steps slowing (a longer compute)
            clock.now += compute_s
            ckpt.observe(step)
            assert not ckpt.should_save(step)
            if ckpt.notice_plan is not None and ckpt.notice_plan not in plans:
                plans.append(ckpt.notice_plan)
        said = [r for r in caplog.records if "preemption notice" in r.getMessage()]
        warned = [r for r in said if r.levelno == logging.WARNING]
        assert len(plans) >= 3 and len(said) == len(plans)  # made again, each logged
        assert warned[0] is said[0] and "the save moves to step" in said[0].getMessage()
        assert len(warned) < len(plans)  # the small moves are not warned of again
        assert all(r.levelno == logging.INFO for r in said[1:] if r not in warned)
        assert all("moves from step" in r.getMessage() for r in said[1:])
        step, made = 59, ckpt.notice_plan
        while ckpt.notice_plan is made and step < 120:  # until the plan was just made again
            step += 1
            compute_s *= 1.02  # slowing on
            clock.now += compute_s
            ckpt.observe(step)
            assert not ckpt.should_save(step)
        assert ckpt.notice_plan is not made
        signal.raise_signal(signal.SIGUSR2)  # an earlier end: planned for at once, said again
        step += 1
        ckpt.observe(step)
        assert not ckpt.should_save(step)
        last = [r for r in caplog.records if "preemption notice" in r.getMessage()][-1]
        assert last.levelno == logging.WARNING  # (the plan just made held for 4 steps)
        assert f"the preemption notice (SIGUSR2) at step {step} " in last.getMessage()
        planned = ckpt.notice_plan.save_at  # type: ignore[union-attr]
        signal.raise_signal(signal.SIGTERM)  # cuts the known end short: the save now
        ckpt.observe(step + 1)
        assert ckpt.should_save(step + 1)
        cut = [r for r in caplog.records if "preemption notice" in r.getMessage()][-1]
        assert cut.getMessage().startswith(
            f"coci: preemption notice (SIGTERM) at step {step + 1}, before step {planned} where "
            f"the save for the preemption notice (SIGUSR2) at step {step} was planned, "
        )  # it read "the save planned for the preemption notice (SIGTERM) at step 61"
    finally:
        monkeypatch.undo()  # the real clock for close's waits
        ckpt.close()


def test_a_sigterm_with_a_known_end_pending_is_named_as_the_notice_in_force(
    tmp_path: Path,
) -> None:
    """SIGUSR1 20 s before the end and SIGTERM (30 s grace) to one process: the SIGTERM asks to
    stop now, so it is the notice the save is taken for, in the decision and in the report
    (it was named SIGUSR1, the earlier deadline: "the steps slowed down", "the save moved")."""
    args = {
        "dir": str(tmp_path),
        "sources": ["TERM@30", "USR1@20"],
        "margin_s": 1,
        "telemetry": True,
    }

    def notify() -> None:
        os.kill(child.pid, signal.SIGUSR1)
        os.kill(child.pid, signal.SIGTERM)

    with Child(module(CHILD, json.dumps(args)), stderr=subprocess.DEVNULL) as child:
        code, lines = _preempt(child, 30, notify)
    assert code == 143
    (stop,) = _marks(lines, "PREEMPTED")
    assert stop["source"] == "SIGTERM" and stop["saved"] == stop["at"]
    (notice,) = notices(read_jsonl(tmp_path / "telemetry.jsonl"))
    assert "SIGTERM" in preemption_line(notice) and "moved" not in preemption_line(notice)
    assert _restored(tmp_path)[0] == stop["at"]


@pytest.mark.dist
def test_a_sigterm_on_another_rank_than_a_known_ends_is_named_on_rank_0(tmp_path: Path) -> None:
    """Rank 0 gets SIGUSR1 (20 s to the end), rank 1 SIGTERM: both save the same step at once
    and stop; rank 0, which logs and records the notice, names another rank's notice as the
    one in force, not its own SIGUSR1 (it said "the steps slowed down")."""
    args = {
        "dir": str(tmp_path),
        "sources": ["TERM@30", "USR1@20"],
        "margin_s": 1,
        "step_s": 0.02,
        "telemetry": True,
    }
    lines: list[list[str]] = [[], []]
    port = free_port()
    children = [
        Child(  # rank 0's log lines read from a pipe of their own
            module(CHILD, json.dumps(args)),
            env=rank_env(r, 2, port),
            stderr="pipe" if r == 0 else subprocess.DEVNULL,
        )
        for r in range(2)
    ]
    try:
        assert all(_until(child, "READY", lines[r]) for r, child in enumerate(children))
        os.kill(children[0].pid, signal.SIGUSR1)
        log = children[0].proc.stderr
        assert log is not None
        while "coci: preemption notice (SIGUSR1)" not in (line := log.readline()):  # planned
            assert line, "rank 0 never planned the save for its SIGUSR1"
        os.kill(children[1].pid, signal.SIGTERM)
        logged = log.read()
        codes = _wait_all(children, lines)
    finally:
        for child in children:
            child.close()
    assert codes == [143, 143]
    stops = [_marks(rank_lines, "PREEMPTED")[0] for rank_lines in lines]
    assert [s["source"] for s in stops] == ["another rank", "SIGTERM"]
    assert stops[0]["saved"] == stops[1]["saved"] == stops[0]["at"] == stops[1]["at"]
    assert "coci: preemption notice (another rank) at step" in logged
    (notice,) = notices(read_jsonl(tmp_path / "telemetry.jsonl"))
    assert "then a notice on another rank at step" in preemption_line(notice)
    saved = {s["step"]: s["digest"] for s in _marks(lines[0], "SAVED")}
    step, state = _restored(tmp_path)
    assert step == stops[0]["at"] and _digest(state) == saved[step]
