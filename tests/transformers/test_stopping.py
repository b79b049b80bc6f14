"""Runs stopped on purpose: an EarlyStoppingCallback (its hazard reaches the planner, its counter
resumes; load_best_model_at_end loads coci's best kept step) and SIGTERM (one save at the next
step boundary, then a clean stop; the Trainer's JIT checkpoint saves nothing more)."""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import EarlyStoppingCallback, TrainerCallback

from coci_core import CheckpointManager, Preempted
from coci_core.commands import cli
from coci_core.engine.format.manifest import step_dir_name
from coci_core.engine.save.writer import SaveWriter
from coci_transformers import CociCallback
from tests.transformers.run import Terminate, tiny_model, train


@pytest.fixture(autouse=True)
def _reset_accelerate_state() -> Any:
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_early_stopping_and_the_best_kept_step(tmp_path: Path) -> None:
    """EarlyStoppingCallback(patience 1, a threshold no evaluation beats) stops the run at its
    second evaluation (step 4 of 12); its hazard reaches the planner; the final state is
    saved; load_best_model_at_end loads the weights of the kept step with the lower
    eval_loss."""
    callback = CociCallback(policy="every_n_steps")
    stopper = EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=10.0)
    result = train(
        tmp_path,
        12,
        callback=callback,
        extra_callbacks=(stopper,),
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
    )
    evals = {e["step"]: e["eval_loss"] for e in result["log"] if "eval_loss" in e}
    assert sorted(evals) == [2, 4]
    assert callback.checkpointer is not None
    assert "EarlyStoppingCallback" in callback.checkpointer.plan_outline().report.termination
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [2, 4]
        best = min(evals, key=lambda k: evals[k])
        saved = mgr.restore(best)["model"]
    assert result["best_model"].keys() == saved.keys()
    assert all(torch.equal(result["best_model"][k], saved[k]) for k in saved)
    assert not all(torch.equal(tiny_model().state_dict()[k], saved[k]) for k in saved)


def test_sigterm_saves_once_and_stops(tmp_path: Path) -> None:
    """SIGTERM after step 5: coci saves at step 6 (the next boundary), training stops and
    ``train()`` raises ``Preempted`` (exit status 143); the Trainer's JIT checkpoint
    (enable_jit_checkpoint=True) writes nothing; the previous SIGTERM handler is back
    afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as stopped:
        train(
            tmp_path,
            12,
            callback=CociCallback(policy="every_n_steps", every_n_steps=100),
            extra_callbacks=(Terminate(5),),
            enable_jit_checkpoint=True,
        )
    assert stopped.value.step == 6 and stopped.value.code == 143
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coci"]
    assert signal.getsignal(signal.SIGTERM) is before


class _StopAt3(TrainerCallback):
    """A user's stopping rule, given after CociCallback: stops the run at step 3."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 3:
            control.should_training_stop = True


def test_a_sigterm_as_a_later_callback_stops_the_run_saves_that_step_once(
    tmp_path: Path,
) -> None:
    """SIGTERM during step 3's end, after CociCallback's ``on_step_end``, in the step a user's
    callback given after it stops the run (``should_training_stop``), the Trainer's JIT
    checkpoint on: one save, step 3 (the final save), then ``Preempted`` (exit status 143);
    no ``checkpoint-N`` of the Trainer's."""
    with pytest.raises(Preempted) as stopped:
        train(
            tmp_path,
            12,
            callback=CociCallback(policy="every_n_steps", every_n_steps=100),
            extra_callbacks=(Terminate(3), _StopAt3()),
            enable_jit_checkpoint=True,
        )
    assert stopped.value.step == 3 and stopped.value.code == 143
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coci"]


def test_a_sigterm_after_the_last_step_stops_train_once_the_final_save_is_durable(
    tmp_path: Path,
) -> None:
    """A SIGTERM after the last step's boundary (here in a callback's ``on_step_end`` of step
    6, the last) was dropped: ``train()`` returned and the script went on. It raises
    ``Preempted`` once the final save (step 6) is durable."""
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as stopped:
        train(
            tmp_path,
            6,
            callback=CociCallback(policy="every_n_steps", every_n_steps=100),
            extra_callbacks=(Terminate(6),),
        )
    assert stopped.value.code == 143 and stopped.value.step == 6
    assert stopped.value.source == "SIGTERM"
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [6]
    assert signal.getsignal(signal.SIGTERM) is before


class _JitMark(TrainerCallback):
    """What the Trainer's JIT checkpoint does before it calls ``_save_checkpoint`` at step 3:
    makes ``checkpoint-3`` with its "incomplete" mark in it."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 3:
            folder = Path(args.output_dir) / "checkpoint-3"
            folder.mkdir()
            (folder / "checkpoint-is-incomplete.txt").write_text("in progress")


def test_the_jit_checkpoints_empty_folder_is_not_left(tmp_path: Path) -> None:
    """With ``enable_jit_checkpoint`` and ``preemption=None``, the Trainer's JIT save goes
    through coci, which left the Trainer's ``checkpoint-N`` empty once the Trainer removed its
    mark: ``get_last_checkpoint`` would pick that empty folder."""
    train(tmp_path, 4, extra_callbacks=(_JitMark(),))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coci"]
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [3, 4]


def test_early_stopping_counter_resumes(tmp_path: Path) -> None:
    """The EarlyStoppingCallback's counter is saved with the TrainerState: a run resumed at
    step 4 with one evaluation without improvement behind it (patience 2) stops at its next
    evaluation (step 6), as the run never stopped would; with the counter lost it would run
    on to step 8."""

    def stopper() -> EarlyStoppingCallback:
        return EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=10.0)

    options: dict[str, Any] = {
        "save_steps": 2,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "metric_for_best_model": "loss",
        "restore_callback_states_from_checkpoint": True,
    }
    first = train(tmp_path, 4, extra_callbacks=(stopper(),), **options)
    assert [e["step"] for e in first["log"] if "eval_loss" in e] == [2, 4]
    AcceleratorState._reset_state(True)
    resumed = train(tmp_path, 8, resume=True, extra_callbacks=(stopper(),), **options)
    assert resumed["start"] == 4
    assert [e["step"] for e in resumed["log"] if "eval_loss" in e] == [2, 4, 6]
    assert len(resumed["seen"]) == 2 * 4  # steps 5 and 6


def _best_at_step_2(directory: Path, callback: CociCallback, **extra: Any) -> dict[str, Any]:
    """4 steps, an evaluation every 2 whose score falls each time (greater is better: step 2
    is the Trainer's best), load_best_model_at_end."""
    evaluations: list[int] = []

    def falling_score(_: Any) -> dict[str, float]:
        evaluations.append(1)
        return {"score": -float(len(evaluations))}

    return train(
        directory,
        4,
        callback=callback,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="score",
        greater_is_better=True,
        compute_metrics=falling_score,
        **extra,
    )


def test_the_best_step_is_kept_besides_save_total_limit(tmp_path: Path) -> None:
    """load_best_model_at_end with save_total_limit=1 (coci's keep_last): the best evaluation
    (the first: a score that falls at each evaluation) is at step 2, and the Trainer's
    rotation keeps the best checkpoint besides the newest (its documented behaviour: "the last
    one and the best one"). coci's retention removed step 2 once step 4 was committed, and the
    end loaded step 4's weights; step 2 is kept, loaded, and named the best."""
    result = _best_at_step_2(tmp_path, CociCallback(policy="every_n_steps"), save_total_limit=1)
    scores = {e["step"]: e["eval_score"] for e in result["log"] if "eval_score" in e}
    assert scores == {2: -1.0, 4: -2.0}
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [2, 4]
        saved = mgr.restore(2)["model"]
    assert all(torch.equal(result["best_model"][k], saved[k]) for k in saved)
    assert result["best_checkpoint"] == str(tmp_path / "coci" / step_dir_name(2))
    assert Path(result["best_checkpoint"]).is_dir()


def test_the_best_step_older_than_keep_last_is_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """load_best_model_at_end with keep_last=1 and the plan's save at step 3 after the best
    evaluation's (step 2; the evaluation at step 4 no better, and no final save): step 2 stays
    beside step 3 and is loaded; it was removed, and the final weights stayed with a warning
    that no kept step was evaluated."""
    with caplog.at_level("WARNING"):
        result = _best_at_step_2(
            tmp_path,
            CociCallback(
                policy="every_n_steps", every_n_steps=3, save_on_train_end=False, keep_last=1
            ),
        )
    assert [e["step"] for e in result["log"] if "eval_score" in e] == [2, 4]
    assert result["best_checkpoint"] == str(tmp_path / "coci" / step_dir_name(2))
    assert "no kept step was evaluated" not in caplog.text
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [2, 3]
        saved = mgr.restore(2)["model"]
    assert all(torch.equal(result["best_model"][k], saved[k]) for k in saved)


def test_the_trainers_best_evaluation_is_saved_and_loaded_whatever_the_plan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """load_best_model_at_end with a plan that does not save at the evaluations (every 3
    steps, evaluations every 2; coci's own plan does not follow eval_steps either): the
    evaluation that improves metric_for_best_model (step 2, of a falling score) is saved, as
    the Trainer's saves at its evaluations are, and its weights are loaded at the end; it
    loaded the final weights (step 4) before, while the TrainerState named step 2 its best.
    ``best_model_checkpoint`` names step 2's directory."""
    with caplog.at_level("INFO"):
        result = _best_at_step_2(tmp_path, CociCallback(policy="every_n_steps", every_n_steps=3))
    assert {e["step"] for e in result["log"] if "eval_score" in e} == {2, 4}
    (loading,) = [r.getMessage() for r in caplog.records if "best kept step" in r.getMessage()]
    # the metric as the Trainer logs it, 6 digits (it read "(loss 3.6434712409973145)")
    said = r"coci: loading the best kept step 2 \(eval_score [-0-9.e+]{1,12}\)"
    assert re.fullmatch(said, loading), loading
    assert result["best_checkpoint"] == str(tmp_path / "coci" / step_dir_name(2))
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [2, 3, 4]  # the best, the plan's, the final state
        saved = mgr.restore(2)["model"]
    assert all(torch.equal(result["best_model"][k], saved[k]) for k in saved)
    # the best weights are read, not a resume: no restart in the run's report
    assert result["start"] is None  # resumed from nothing
    assert cli.main(["report", str(tmp_path / "coci")]) == 0
    assert "lost work: 0 steps over 0 restarts after a failure\n" in capsys.readouterr().out


@pytest.mark.parametrize("first_keep_last", [2, None])
def test_the_best_step_is_among_the_steps_retention_keeps_after_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first_keep_last: int | None
) -> None:
    """A run killed after its final save's commit and before retention removed the oldest
    step (here: a first run whose retention never ran) resumes at its final step with one step
    too many on disk; load_best_model_at_end chose among all of them, a step that the
    uninterrupted run had removed. It chooses among the newest ``keep_last`` and the best
    step (step 4, kept besides them as the Trainer's rotation keeps it), and the resumed run's
    close removes the step that retention left (step 2). A first run that kept every step
    (``keep_last=None``) keeps them all: the resumed run's smaller ``keep_last`` deletes
    nothing until it saves."""
    evaluations: list[int] = []

    def falling_score(_: Any) -> dict[str, float]:
        evaluations.append(1)
        return {"score": [-2.0, -1.0, -3.0][len(evaluations) - 1]}  # step 4's is the best

    options: dict[str, Any] = {
        "save_steps": 2,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "load_best_model_at_end": True,
        "metric_for_best_model": "score",
        "greater_is_better": True,
        "compute_metrics": falling_score,
    }
    with monkeypatch.context() as killed:  # what a kill right after each commit leaves
        killed.setattr(SaveWriter, "_apply_retention", lambda *_, **__: None)
        first = CociCallback(policy="every_n_steps", keep_last=first_keep_last)
        train(tmp_path, 6, callback=first, **options)
    AcceleratorState._reset_state(True)
    resumed = train(
        tmp_path,
        6,
        # no save to take: steps 2, 4 and 6 are on disk until the run closes
        callback=CociCallback(
            policy="every_n_steps", every_n_steps=100, keep_last=2, save_on_train_end=False
        ),
        resume=True,
        **options,
    )
    assert resumed["start"] == 6
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == ([4, 6] if first_keep_last == 2 else [2, 4, 6])
    assert resumed["best_checkpoint"] == str(tmp_path / "coci" / step_dir_name(4))


def test_the_best_model_is_never_another_runs(tmp_path: Path) -> None:
    """A second run started fresh in the directory of a first (steps 2, 4, 6 kept there)
    evaluates at steps 2 and 4 (a falling score: its best is step 2, which it saves beside
    the first run's as ``step-...-v1``): load_best_model_at_end loads its own step 2, never
    the first run's step 2 or 4 (steps of the same numbers, evaluated by the second run's log
    history only; its step 2 holds the same weights as the first run's, same seed and data)."""
    train(tmp_path, 6, save_steps=2)
    AcceleratorState._reset_state(True)
    result = _best_at_step_2(
        tmp_path, CociCallback(policy="every_n_steps", every_n_steps=5, save_on_train_end=False)
    )
    assert {e["step"] for e in result["log"] if "eval_score" in e} == {2, 4}
    own = Path(result["best_checkpoint"])
    assert own.name == step_dir_name(2) + "-v1" and own.is_dir()
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [2, 4, 6]
        saved = mgr.restore(own.name)["model"]
        other = mgr.restore(step_dir_name(4))["model"]  # the first run's
    assert all(torch.equal(result["best_model"][k], saved[k]) for k in saved)
    assert not all(torch.equal(result["best_model"][k], other[k]) for k in other)


def test_a_new_machine_resuming_a_notices_save_counts_no_failure(tmp_path: Path) -> None:
    """A run stopped by a notice resumes on a new machine (its directory copied, without the
    telemetry that told the old machine the run ended there): the restore of the notice's
    save is no failure for the planner's MTBF (it counted one); the restore of a planned
    save is one."""
    with pytest.raises(Preempted):
        train(
            tmp_path / "old",
            12,
            callback=CociCallback(policy="every_n_steps", every_n_steps=3),
            extra_callbacks=(Terminate(4),),
        )
    for new, step in (("new", 5), ("older", 3)):
        name = step_dir_name(step)
        shutil.copytree(tmp_path / "old" / "coci" / name, tmp_path / new / "coci" / name)
        AcceleratorState._reset_state(True)
        callback = CociCallback(policy="every_n_steps", every_n_steps=3)
        resumed = train(tmp_path / new, step + 1, resume=True, callback=callback)
        assert resumed["start"] == step
        assert callback.checkpointer is not None
        assert callback.checkpointer.planner.failures == (0 if step == 5 else 1), new


def test_a_weights_only_runs_notice_warns_and_its_requeue_resumes_the_older_full_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run saving with save_only_model=True stopped by SIGTERM exits 143 ("requeue me") with
    a WARNING that the requeued run cannot resume from its save (it said nothing), and the
    requeued run, whose newest step is weights-only, resumes from the older step an earlier
    session saved in full, saying so (it raised CheckpointError); found on the remote tier
    when the node's disk no longer holds it (it listed the local directory only)."""

    def coci() -> CociCallback:
        return CociCallback(policy="every_n_steps", remote=str(tmp_path / "remote"))

    train(tmp_path, 3, callback=coci())  # step 3, in full, on both tiers
    AcceleratorState._reset_state(True)
    with caplog.at_level("WARNING", logger="coci_transformers"), pytest.raises(Preempted) as stop:
        train(
            tmp_path,
            8,
            resume=True,
            callback=coci(),
            save_only_model=True,
            extra_callbacks=(Terminate(4),),
        )
    assert stop.value.code == 143 and stop.value.step == 5
    assert "save_only_model=True: the preemption notice's save (step 5) holds" in caplog.text
    assert "the requeued run cannot resume from it" in caplog.text
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [3, 5]
    lost = list((tmp_path / "coci").glob("step-0000000003*"))
    assert len(lost) == 1
    shutil.rmtree(lost[0])  # the node's disk lost step 3: the remote tier holds it
    AcceleratorState._reset_state(True)
    caplog.clear()
    with caplog.at_level("INFO", logger="coci_transformers"):
        resumed = train(tmp_path, 8, resume=True, callback=coci())
    assert resumed["start"] == 3 and len(resumed["seen"]) == 5 * 4
    assert "coci: the newest step 5 was saved with save_only_model=True" in caplog.text
    assert "resuming from step 3, the newest step saved in full" in caplog.text
    assert "coci: the Trainer restores step 3 from" in caplog.text


def test_a_weights_only_run_stopped_after_its_last_step_is_requeued_as_finished(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """save_only_model=True and a SIGTERM after the last step's boundary: the final save
    (step 6, weights-only) is durable and train() raises Preempted (exit 143). The requeued
    run resumes it as the Trainer resumes its own weights-only checkpoint at the run's end:
    nothing left to train, the saved weights in the model (it raised CheckpointError)."""
    with pytest.raises(Preempted) as stopped:
        train(
            tmp_path,
            6,
            callback=CociCallback(policy="every_n_steps", every_n_steps=100),
            extra_callbacks=(Terminate(6),),
            save_only_model=True,
        )
    assert stopped.value.code == 143 and stopped.value.step == 6
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        saved = mgr.restore(6)
    assert saved["weights_only"] is True
    AcceleratorState._reset_state(True)
    with caplog.at_level("INFO", logger="coci_transformers"):
        again = train(tmp_path, 6, resume=True)
    assert again["start"] == 6 and again["seen"] == []
    assert "nothing left to train" in caplog.text and "not bit-identical" not in caplog.text
    assert all(torch.equal(again["best_model"][k], v) for k, v in saved["model"].items())
