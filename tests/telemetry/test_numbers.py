"""The numbers a user reads agree: ``coci report``, the TensorBoard tab (its plugin's route),
``coci demo``'s own lines and the telemetry records say the same lost work, run length,
planned checkpoints and compression, each computed one way."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from tensorboard.plugins import base_plugin
from torchdata.stateful_dataloader import StatefulDataLoader
from werkzeug.test import Client

from coci_core import CheckpointManager
from coci_core.commands.cli import main
from coci_core.telemetry import JsonlTelemetry, SaveEvent, read_jsonl
from coci_core.telemetry.report import facts, render, render_facts, summarize
from coci_core.telemetry.summary import SaveSummary, save_line
from coci_core.telemetry.tb_plugin import CociPlugin
from coci_core.telemetry.timeline import timeline
from coci_core.training.outline import PlanOutline
from coci_lightning import CociCheckpoint
from tests.harness.processes import Child, module, run, script
from tests.lightning.models import DigitsModel, IndexedDigits


def _tab(logdir: Path, run_name: str) -> dict[str, Any]:
    """The run's data as the coci tab gets it: the plugin's ``timeline`` route."""
    plugin = CociPlugin(base_plugin.TBContext(logdir=str(logdir)))
    apps = plugin.get_plugin_apps()
    runs = json.loads(Client(apps["/runs"]).get("/").get_data())["runs"]
    assert run_name in [r["name"] for r in runs]
    response = Client(apps["/timeline"]).get("/", query_string={"run": run_name})
    assert response.status_code == 200
    return json.loads(response.get_data())  # type: ignore[no-any-return]


def _report(directory: Path) -> str:
    return run(module("coci_core.commands.cli", "report", str(directory)), check=True).stdout


def check_one_set_of_numbers(demo_dir: Path, stdout: str, total: int) -> None:
    """`coci demo` asked to SIGKILL a Lightning run before coci's first save killed it just
    after its first committed checkpoint instead (``stdout``: its lines; ``demo_dir``: its
    ``--dir``) and resumed it: the demo's line, the report, the tab and the telemetry give the
    same lost work (the steps from the restored checkpoint to the kill), the same run length
    and planned checkpoints, and compression 1.00x for its raw checkpoints. Called by
    ``tests/commands/test_demo_and_report.py``'s run of the demo (one run for both)."""
    said = re.search(
        r"killed at step (\d+), resumed from step (\d+): (\d+) steps? of work lost", stdout
    )
    assert said, stdout
    kill, restored, lost = int(said[1]), int(said[2]), int(said[3])
    assert 2 < restored <= kill and lost == kill - restored  # the truth, from the demo's kill
    assert f"killed at step {kill}; committed checkpoints at the kill: [{restored}]" in stdout
    assert f"restart: restored step {restored}" in _report(demo_dir / "run" / "coci")

    ckpt_dir = demo_dir / "run" / "coci"
    records = read_jsonl(ckpt_dir / "telemetry.jsonl")
    (restore,) = [r for r in records if r["type"] == "restore"]
    assert restore["step"] == restored and restore["reached"] == kill
    assert [r["step"] for r in records if r["type"] == "end"] == [total]  # the resumed session

    tab = _tab(demo_dir / "run", "coci")
    (restart,) = tab["restarts"]
    assert (restart["restored"], restart["failed_at"], restart["lost_steps"]) == (
        restored,
        kill,
        lost,
    )
    assert restart["exact"] and tab["resumes"] == []
    summary = tab["summary"]
    assert summary == json.loads(json.dumps(facts(summarize(ckpt_dir))))  # one computation
    assert (summary["lost_steps"], summary["restarts"], summary["steps"]) == (lost, 1, total)

    report = _report(ckpt_dir)
    steps = "step" if lost == 1 else "steps"  # the plan may save the step before the kill
    assert f"the run had reached step {kill}: {lost} {steps} of work lost and redone" in report
    assert f"lost work: {lost} {steps} over 1 restart after a failure" in report
    assert f"over the run's {total} steps" in report
    assert f"checkpoints planned over the {total} steps run: {summary['planned']} at" in report
    # the demo prints the same report lines
    assert f"the run had reached step {kill}: {lost} {steps} of work lost" in stdout

    # planned: the steps reached that the plan in force had; each was taken or missed
    as_stood = summarize(ckpt_dir).planned
    assert len(as_stood) == summary["planned"] > 0 and max(as_stood) <= total
    committed = {s["step"] for s in tab["saves"] if s["outcome"] == "committed"}
    states = {p["step"]: p["state"] for p in tab["planned"]}
    assert {s: states[s] for s in as_stood} == {
        s: "taken" if s in committed else "missed" for s in as_stood
    }
    assert all(s in as_stood for s, state in states.items() if state == "missed")
    # planned, taken (the planned steps committed), committed (the final save too): each
    # says what it counts, and the policy table says it is each policy's plan made afresh
    taken = [s for s in as_stood if s in committed]
    assert summary["taken"] == len(taken) and summary["committed"] == len(committed)
    assert f"at steps {as_stood}, {len(taken)} of them taken" in report
    assert max(committed) == total and total not in as_stood  # the final save
    assert "made afresh with the costs measured by its end" in report
    assert "made afresh with the costs measured by its end" in stdout

    # raw checkpoints: 1.00x, though their files hold padding and the manifest too
    saves = [r for r in records if r["type"] == "save" and r["outcome"] == "committed"]
    assert saves and all(not r["compressed"] and r["raw_bytes"] < r["bytes_written"] for r in saves)
    assert [s["compression_x"] for s in tab["saves"] if s["outcome"] == "committed"] == [1.0] * len(
        saves
    )
    listing = run(module("coci_core.commands.cli", "ls", str(ckpt_dir)), check=True).stdout
    rows = listing.splitlines()[1:]
    assert rows and all(row.split()[3] == "1.00x" for row in rows), listing


_LIGHTNING_RUN = "tests.telemetry._lightning_run"  # forked from a Lightning zygote


def test_a_run_killed_before_its_first_checkpoint_lost_every_step_it_reached(
    tmp_path: Path,
) -> None:
    """A Lightning run SIGKILLed at step 2, before coci saved anything, then started again by
    a new process (``resume=True``, nothing to restore): the restart lost the 2 steps it had
    reached, in the telemetry, the report, the tab and the facts ("0 steps" before)."""
    with Child(module(_LIGHTNING_RUN, str(tmp_path), "12", "2")) as child:
        assert child.kill_at("AT 2") == -9
    ckpt_dir = tmp_path / "coci"
    assert CheckpointManager(ckpt_dir).steps() == []  # nothing to restore
    with Child(module(_LIGHTNING_RUN, str(tmp_path), "12", "-1")) as child:
        assert child.wait(300) == 0
    records = read_jsonl(ckpt_dir / "telemetry.jsonl")
    assert [(r["step"], r["reached"]) for r in records if r["type"] == "start"] == [(0, 2)]
    assert [r for r in records if r["type"] == "restore"] == []

    summary = summarize(ckpt_dir)
    assert summary.lost_steps == [2] and summary.last_step == 12
    f = facts(summary)
    assert (f["restarts"], f["resumes"], f["lost_steps"]) == (1, 0, 2)
    report = _report(ckpt_dir)
    assert (
        "restart: no checkpoint to restore, the run started over from step 0; it had reached "
        "step 2: 2 steps of work lost and redone" in report
    )
    assert "lost work: 2 steps over 1 restart after a failure" in report
    tab = _tab(tmp_path, "coci")
    (restart,) = tab["restarts"]
    assert (restart["restored"], restart["failed_at"], restart["lost_steps"]) == (0, 2, 2)
    assert restart["exact"] and restart["checkpoint"] is False
    assert tab["summary"]["lost_steps"] == 2
    # the killed session's loss points are drawn as lost work, the new session's are not
    start = next(i for i, r in enumerate(records) if r["type"] == "start")
    killed = [r["step"] for r in records[:start] if r["type"] == "loss"]
    assert killed and [p["step"] for p in tab["loss"] if p["lost"]] == killed


def test_the_mtbf_after_one_failure_says_it_is_mostly_the_default(tmp_path: Path) -> None:
    """A Lightning run killed after its first checkpoint and resumed: the MTBF it plans with is
    coci's default counted as one failure and averaged with this one, about half the default;
    the plan line and the report say so (before: "estimated from this run's restarts")."""
    options = json.dumps({"every_n_steps": 4, "kill_after_a_save": True})
    with Child(module(_LIGHTNING_RUN, str(tmp_path), "12", "4", options)) as child:
        assert child.kill_at("AT ") == -9  # after step 4, once its save is committed
    assert CheckpointManager(tmp_path / "coci").steps()  # the resume restores a checkpoint
    resumed = run(module(_LIGHTNING_RUN, str(tmp_path), "12", "-1", options), timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr
    said = re.search(
        r"MTBF assumed (\d+) s \(coci's default (\d+) s, counted as one failure, averaged with "
        r"this run's 1 failure in (\d+) s: \(\d+ \+ \d+\) / 2\)",
        resumed.stderr,
    )
    assert said, resumed.stderr
    mtbf, default, ran = (int(x) for x in said.groups())
    assert abs(mtbf - (default + ran) / 2) <= 1 and mtbf < 0.51 * default + ran
    report = _report(tmp_path / "coci")
    assert "(coci's default, counted as one failure, averaged with this run's failures: " in report
    assert "estimated from this run's" not in report + resumed.stderr


@pytest.mark.slow
def test_a_new_process_going_on_from_a_finished_run_is_a_resume(tmp_path: Path) -> None:
    """A run that ended at step 12, trained on to 24 by a new process (``resume=True``),
    lost nothing and failed nowhere: no restart (nor its cost) is recorded, the report and
    the tab say a resume."""
    for total in ("12", "24"):
        done = run(module(_LIGHTNING_RUN, str(tmp_path), total, "-1"), timeout_s=300)
        assert done.returncode == 0, done.stderr
    ckpt_dir = tmp_path / "coci"
    records = read_jsonl(ckpt_dir / "telemetry.jsonl")
    assert [(r["step"], r["reached"]) for r in records if r["type"] == "restore"] == [(12, 12)]
    assert [r for r in records if r["type"] == "restart"] == []
    assert [r["step"] for r in records if r["type"] == "end"] == [12, 24]
    tab = _tab(tmp_path, "coci")
    assert tab["restarts"] == [] and [r["restored"] for r in tab["resumes"]] == [12]
    assert (tab["summary"]["restarts"], tab["summary"]["lost_steps"]) == (0, 0)
    assert "resume: restored step 12" in _report(ckpt_dir)


class _Plateau(DigitsModel):
    """Digits whose validation metric never improves: EarlyStopping stops it after
    ``patience`` more validations."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", torch.tensor(1.0))

    def train_dataloader(self) -> Any:
        return StatefulDataLoader(IndexedDigits(64), batch_size=4, shuffle=True)

    def val_dataloader(self) -> Any:
        return StatefulDataLoader(IndexedDigits(16), batch_size=16)


def _trainer(root: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=callbacks,
        num_sanity_val_steps=0,
        **kwargs,
    )


def test_an_early_stopped_run_is_as_long_as_the_steps_it_trained(tmp_path: Path) -> None:
    """A run EarlyStopping ends at step 64 is a run of 64 steps in the report and the tab,
    whatever steps its last loss or progress record happened to name."""
    pl.seed_everything(0, verbose=False)
    trainer = _trainer(
        tmp_path, [EarlyStopping(monitor="val_loss", patience=3), CociCheckpoint()], max_epochs=20
    )
    trainer.fit(_Plateau())
    steps = trainer.global_step
    assert steps == 4 * 16  # four epochs of 16 batches: the first validation, then 3 without gain
    records = read_jsonl(tmp_path / "coci" / "telemetry.jsonl")
    assert [r["step"] for r in records if r["type"] == "end"] == [steps]
    assert timeline(str(tmp_path / "coci"))["summary"]["steps"] == steps
    assert f"over the run's {steps} steps" in _report(tmp_path / "coci")


def test_a_checkpoint_has_one_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Lightning run's checkpoints: `coci ls`, the files in the step directory, `coci report`
    and the end-of-training line give one size for each, its data and manifest (before: `ls`
    counted the data alone)."""
    pl.seed_everything(0, verbose=False)
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, [CociCheckpoint(every_n_steps=4)], max_steps=8).fit(DigitsModel())
    ckpt_dir = tmp_path / "coci"
    saves = {
        r["step"]: r["bytes_written"]
        for r in read_jsonl(ckpt_dir / "telemetry.jsonl")
        if r["type"] == "save" and r["outcome"] == "committed"
    }
    assert sorted(saves) == [4, 8]
    files = {
        step: sum(f.stat().st_size for f in (ckpt_dir / f"step-{step:010d}").iterdir())
        for step in saves
    }
    assert files == saves  # what the save wrote is what the directory holds
    capsys.readouterr()
    assert main(["ls", str(ckpt_dir)]) == 0
    rows = [row.split() for row in capsys.readouterr().out.splitlines()[1:]]
    assert {int(r[0]): f"{r[1]} {r[2]}" for r in rows} == {
        step: f"{size / 1000:.1f} KB" for step, size in saves.items()
    }
    report = render(summarize(ckpt_dir))
    for step, size in saves.items():
        assert re.search(rf"^ +{step} .* {size / 1e6:.2f}$", report, re.M), report
    (end,) = [r.getMessage() for r in caplog.records if "checkpoints committed (" in r.getMessage()]
    assert f"{sum(saves.values()) / 1e6:.3g} MB written" in end


class _PlannerAtEnd(pl.Callback):
    """The planner's state and MTBF source when training ends (before the teardown)."""

    def __init__(self, ckpt: CociCheckpoint) -> None:
        self.ckpt = ckpt
        self.state: dict[str, Any] = {}
        self.mtbf_source = ""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.ckpt.checkpointer is not None
        self.state = self.ckpt.checkpointer.planner.state_dict()
        self.mtbf_source = self.ckpt.checkpointer.planner.report().mtbf_source


def test_fit_then_fit_last_in_one_process_is_no_failure(tmp_path: Path) -> None:
    """``fit()`` to step 20, then ``fit(ckpt_path="last")`` to 40 in the same process goes on
    from the step the first ended at: no failure for the planner (no restart cost, the MTBF
    still the default), no restart record, and the report says a resume that lost nothing."""
    model = DigitsModel()
    pl.seed_everything(0, verbose=False)
    _trainer(tmp_path, [CociCheckpoint()], max_steps=20).fit(model)
    second = CociCheckpoint()
    planner = _PlannerAtEnd(second)
    _trainer(tmp_path, [second, planner], max_steps=40).fit(model, ckpt_path="last")
    assert planner.state["failures"] == 0 and planner.state["costs"]["restart_s"] == []
    assert planner.mtbf_source == "default"

    records = read_jsonl(tmp_path / "coci" / "telemetry.jsonl")
    assert [r["step"] for r in records if r["type"] == "restore"] == [20]
    assert [r for r in records if r["type"] == "restart"] == []
    assert [r["step"] for r in records if r["type"] == "end"] == [20, 40]
    f = timeline(str(tmp_path / "coci"))["summary"]
    assert (f["restarts"], f["resumes"], f["lost_steps"], f["steps"]) == (0, 1, 0, 40)
    report = _report(tmp_path / "coci")
    assert "resume: restored step 20" in report and "the run had ended at that step" in report
    assert "lost work: 0 steps over 0 restarts after a failure (and 1 resume that lost" in report


class _Boom(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 7:
            raise RuntimeError("boom")


def test_fit_last_after_an_error_is_a_restart_after_a_failure(tmp_path: Path) -> None:
    """A fit that stopped on an error (coci saved its step) then ``fit(ckpt_path="last")`` in
    the same process: a failure for the planner and the report, though nothing was lost."""
    model = DigitsModel()
    pl.seed_everything(0, verbose=False)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(tmp_path, [CociCheckpoint(), _Boom()], max_steps=20).fit(model)
    second = CociCheckpoint()
    planner = _PlannerAtEnd(second)
    _trainer(tmp_path, [second, planner], max_steps=20).fit(model, ckpt_path="last")
    assert planner.state["failures"] == 1 and len(planner.state["costs"]["restart_s"]) == 1
    records = read_jsonl(tmp_path / "coci" / "telemetry.jsonl")
    assert [(r["step"], r["failed"]) for r in records if r["type"] == "end"] == [
        (7, True),  # the error came after step 7's update, before coci's batch end
        (20, False),
    ]
    assert [r["step"] for r in records if r["type"] == "restart"] == [7]
    f = timeline(str(tmp_path / "coci"))["summary"]
    assert (f["restarts"], f["resumes"], f["lost_steps"]) == (1, 0, 0)
    assert "restart: restored step 7" in _report(tmp_path / "coci")


def _plan(step: int, next_steps: list[int], **kw: Any) -> dict[str, Any]:
    return {"type": "plan", "step": step, "next_steps": next_steps, "policy": "coci"} | kw


def test_planned_is_the_plan_as_it_stood_over_the_steps_run(tmp_path: Path) -> None:
    """Re-plans that propose many steps and then move them: a step counts as planned when the
    plan in force as the run reached it had it (12 and 24 here), not every step any plan
    proposed (10, 12, 20, 24, 30, 40)."""
    records = [
        _plan(1, [10, 20, 30]),
        _plan(5, [12, 24]),
        {"type": "save", "step": 12, "outcome": "committed"},
        _plan(12, [24, 40]),
        {"type": "save", "step": 24, "outcome": "committed"},
        _plan(24, [], interval_steps=None, mtbf_s=86_500.0, mtbf_source="default", costs={}),
        {"type": "end", "step": 30},
    ]
    summary = _summary(tmp_path, records)
    assert summary.proposed == [10, 12, 20, 24, 30, 40]
    assert summary.planned == [12, 24] and summary.last_step == 30
    assert facts(summary)["planned"] == 2 and facts(summary)["committed"] == 2
    text = render(summary)
    assert "checkpoints planned over the 30 steps run: 2 at steps [12, 24]" in text
    # no interval (a plan of uneven steps) is no "no interval yet": it says what it plans
    assert "no checkpoint planned after step 24" in text and "no interval yet" not in text
    # a default MTBF grows with the time run without a failure: said so, not "default" alone
    assert "MTBF 86500 s (no mtbf_s given: coci's default, plus the time run without" in text
    states = {p["step"]: p["state"] for p in timeline(str(tmp_path))["planned"]}
    assert states == {10: "revised", 12: "taken", 20: "revised", 24: "taken"} | {
        30: "revised",
        40: "revised",
    }


def _summary(directory: Path, records: list[dict[str, Any]]) -> Any:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return summarize(directory)


def test_words_and_figures_of_the_facts() -> None:
    """One restart is "1 restart"; the termination hazard's effect is a share of the plan made
    without it (0 to 100%), never a share of a gain over Daly that it exceeds (the plan made
    without it worse than Daly's: 991% before)."""
    f = {
        "planned": 3,
        "committed": 1,
        "skipped": 0,
        "failed": 0,
        "total_stall_s": 0.5,
        "restarts": 1,
        "resumes": 0,
        "lost_steps": 1,
        "steps": 1,
        "policies": [],
        "termination": None,
    }
    text = "\n".join(render_facts(f))
    assert "over 1 save; lost work: 1 step over 1 restart after a failure" in text
    assert "policies not compared: no measured costs yet" in text
    f["policies"] = [{"policy": "coci", "checkpoints": 0, "wall_s": 0.0, "objective_s": 0.0}]
    assert "over the run's 1 step," in "\n".join(render_facts(f))

    summary = _summary_of(
        [
            _plan(
                1,
                [5],
                expected_overhead={
                    "objective_s": 10.0,
                    "without_termination_objective_s": 109.1,
                    "daly_objective_s": 20.0,
                },
            )
        ]
    )
    t = facts(summary)["termination"]
    assert t is not None and t["saving"] == pytest.approx(99.1 / 109.1)
    assert "the hazard saves 91%" in "\n".join(render_facts(facts(summary)))


def _summary_of(records: list[dict[str, Any]]) -> Any:
    from coci_core.telemetry.report import RunSummary

    return RunSummary(records)


def test_a_raw_save_is_not_compressed_in_any_line() -> None:
    """Compression is 1.0x for a raw save (its bytes written exceed its bytes in memory: the
    manifest and padding), and raw over written for a compressed one."""
    raw = SaveEvent(step=5, outcome="committed", bytes_written=1_200, raw_bytes=1_000)
    packed = SaveEvent(
        step=6, outcome="committed", bytes_written=500, raw_bytes=1_000, compressed=True
    )
    assert "compressed" not in save_line(raw)
    assert "compressed 2.00x" in save_line(packed)
    summary = SaveSummary()
    summary.add(raw)
    assert "compressed" not in summary.line()
    summary.add(packed)
    assert "compressed 1.18x" in summary.line()  # 2000 bytes in memory over 1700 written


def test_ls_and_the_tab_show_a_raw_checkpoint_as_1x(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real raw checkpoint (with non-tensor state too) lists as 1.00x in `coci ls` and
    1.0 in the tab's data; a compressed one above 1 in both."""
    state = {"w": torch.randn(256, 64), "step": 3, "note": "x" * 2000}
    with (
        JsonlTelemetry(tmp_path / "raw" / "telemetry.jsonl") as telemetry,
        CheckpointManager(tmp_path / "raw", listeners=[telemetry]) as mgr,
    ):
        mgr.save(3, state).wait()
    with (
        JsonlTelemetry(tmp_path / "zstd" / "telemetry.jsonl") as telemetry,
        CheckpointManager(tmp_path / "zstd", compression="lossless", listeners=[telemetry]) as mgr,
    ):
        mgr.save(3, {"w": torch.zeros(256, 64)}).wait()
    for name, check in (("raw", lambda x: x == 1.0), ("zstd", lambda x: x > 10)):
        capsys.readouterr()
        assert main(["ls", str(tmp_path / name)]) == 0
        ratio = capsys.readouterr().out.splitlines()[1].split()[3]
        assert check(float(ratio.rstrip("x"))), (name, ratio)
        (save,) = timeline(str(tmp_path / name))["saves"]
        assert check(save["compression_x"]), (name, save)


def test_coci_report_tells_a_checkpointmanager_user_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without telemetry, `coci report` says in one line how a CheckpointManager loop writes
    it; doing so (a real loop, SIGKILLed and resumed in new processes) gives a report with
    the commits, and the restart's exact lost work once the loop reports its progress."""
    plain = tmp_path / "plain"
    with CheckpointManager(plain) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
    assert main(["report", str(plain)]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    hint = f"listeners=[JsonlTelemetry({str(plain / 'telemetry.jsonl')!r})]"
    assert hint in line and "coci_core.telemetry" in line
    assert "the Trainer's CociCallback" in line  # it said "the Lightning and Accelerate adapters"
    # a run's output_dir (the Trainer's, Accelerate's project_dir): its coci folder is named
    (tmp_path / "out" / "coci").mkdir(parents=True)
    (tmp_path / "out" / "coci" / "telemetry.jsonl").write_text("")
    assert main(["report", str(tmp_path / "out")]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"did you mean {tmp_path / 'out' / 'coci'}? (it holds a run's telemetry.jsonl)" in line

    directory = tmp_path / "ckpt"

    loop = """
import sys, torch
from coci_core import CheckpointManager
from coci_core.errors import NoCheckpointError
from coci_core.telemetry import JsonlTelemetry
directory, kill = sys.argv[1], int(sys.argv[2])
telemetry = JsonlTelemetry(f"{directory}/telemetry.jsonl")
mgr = CheckpointManager(directory, listeners=[telemetry])
start = 0
try:
    start = mgr.restore()["step"]
except NoCheckpointError:
    pass
for step in range(start + 1, 41):
    telemetry.record_progress(step)
    if step % 10 == 0:
        mgr.save(step, {"w": torch.full((3,), float(step)), "step": step}).wait()
    if step == kill:
        print(f"AT {step}", flush=True)
        sys.stdin.readline()
mgr.close()
telemetry.close()
"""
    with Child(script(loop, str(directory), "27")) as child:
        assert child.kill_at("AT 27") == -9
    with Child(script(loop, str(directory), "-1")) as child:
        assert child.wait(120) == 0
    capsys.readouterr()
    assert main(["report", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "checkpoints committed: 4 at steps [10, 20, 30, 40]" in out
    assert "restart: restored step 20" in out
    assert "the run had reached step 27: 7 steps of work lost and redone" in out
    # no plan, so no policy comparison: said why (before: "no measured costs yet" under the
    # table of measured costs)
    assert "policies not compared: no plan recorded" in out and "no measured costs" not in out


def test_the_plan_line_says_where_a_grown_default_mtbf_comes_from() -> None:
    """The adapters' plan line: a default MTBF that grew with the time run without a failure
    says so beside the figure it shows."""
    from coci_core.planner import Planner

    planner = Planner(total_steps=100)
    outline = PlanOutline.of(planner)
    assert outline.mtbf_source("coci's default") == "coci's default"
    grown = PlanOutline(
        report=dataclasses.replace(outline.report, mtbf_s=planner.default_mtbf_s + 42.0),
        total_steps=100,
        every_n_steps=None,
        every_n_seconds=None,
        default_mtbf_s=planner.default_mtbf_s,
    )
    assert grown.mtbf_source("coci's default") == (
        "coci's default, plus the 42 s run without a failure"
    )


def test_a_second_process_on_a_directory_in_use_records_nothing_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second job started on a directory whose run is still going (and refused it at its
    first save) records no telemetry there: before, its first record read as a restart of the
    first run from step 0 ("17 steps of work lost") and its progress overwrote the first's."""
    import subprocess
    import sys

    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from coci_core.telemetry import JsonlTelemetry; "
            f"t = JsonlTelemetry({str(tmp_path / 'telemetry.jsonl')!r}); "
            "[t.record_progress(s) for s in range(1, 18)]; print('READY', flush=True); "
            "sys.stdin.read(); t.close()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "READY"
        before = (tmp_path / "telemetry.jsonl").read_bytes()
        with caplog.at_level(logging.WARNING):
            second = JsonlTelemetry(tmp_path / "telemetry.jsonl")
        assert "another process is recording telemetry" in caplog.text
        second.record_progress(1)
        second(SaveEvent(step=1, outcome="committed", stall_s=0.01, bytes_written=8))
        second.close()
        assert (tmp_path / "telemetry.jsonl").read_bytes() == before
        step, run = (tmp_path / "telemetry.progress").read_text().split()
        assert step == "17" and f'"run_id": "{run}"' in before.decode()
    finally:
        first.communicate("", timeout=60)
    assert first.returncode == 0
    report = _report(tmp_path)
    assert "lost work: 0 steps over 0 restarts" in report, report
    assert "started over" not in report, report
    third = JsonlTelemetry(tmp_path / "telemetry.jsonl")  # once the first has ended
    assert third.previous_end == 17
    third.close()
