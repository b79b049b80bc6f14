"""Runs never delete or overwrite each other's checkpoints (a step another run holds is saved
beside it, ``step-...-v1``), a resume takes the newest checkpoint of the newest run, and
saving a step this run holds is refused unless asked."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager, LocalStorage, StepExistsError
from coci_core.engine.directory.lease import acquire_lease
from coci_core.engine.format.manifest import MANIFEST_NAME, step_dir_name
from coci_core.engine.restore.restore import newest_first, read_manifest
from coci_core.errors import CorruptCheckpointError
from coci_core.storage import open_storage
from coci_core.training.checkpointer import Checkpointer
from tests.adversarial.craft import edit_manifest


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), value)}


def _manifest_bytes(root: Path, step: int) -> bytes:
    return (root / step_dir_name(step) / MANIFEST_NAME).read_bytes()


def test_a_fresh_run_never_touches_another_runs_checkpoints(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2, compression="none") as old:
        for step in (10, 20, 30):
            old.save(step, _state(step)).wait()
        old_run = old.run_id
    assert [s for s in newest_first(open_storage(str(tmp_path)))] == [30, 20]
    before = {s: _manifest_bytes(tmp_path, s) for s in (20, 30)}

    with CheckpointManager(tmp_path, keep_last=2, compression="none") as new:
        assert new.run_id != old_run
        new.save(20, _state(-1.0)).wait()  # beside the old run's step 20, retired below
        for step in (1, 2, 3, 4):
            new.save(step, _state(1000 + step)).wait()
        new_run = new.run_id
    with CheckpointManager(tmp_path, compression="none") as reader:  # after close: retired
        # retention counted only the new run's checkpoints
        assert reader.runs() == {new_run: [3, 4], old_run: [20, 30]}
        # the newest run's newest checkpoint, although the old run has higher steps
        assert reader.latest_step() == 4
        assert float(reader.restore()["w"][0]) == 1004.0
    assert {s: _manifest_bytes(tmp_path, s) for s in (20, 30)} == before
    assert not (tmp_path / step_dir_name(20, 1)).exists()


def test_two_runs_saving_the_same_steps_keep_both_and_agree_on_the_newest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second run saves the steps the first run holds under versioned names; both runs'
    checkpoints are kept and listed, retention counts each run's own, and latest_step(),
    restore() and coci ls all take the newest commit; restore(step) is the step's newest
    commit, and a step directory's name reads the other one."""
    from coci_core.commands.cli import main

    with CheckpointManager(tmp_path, keep_last=None, compression="none") as first:
        for step in (2, 4, 6, 8):
            first.save(step, _state(step)).wait()
        first_run = first.run_id
    before = {s: _manifest_bytes(tmp_path, s) for s in (2, 4, 6, 8)}
    with CheckpointManager(tmp_path, keep_last=2, compression="none") as second:
        for step in (2, 4, 6):
            second.save(step, _state(100 + step)).wait()
        with pytest.raises(StepExistsError, match="this run's checkpoint of step 6"):
            second.save(6, _state(-1.0))
        second_run = second.run_id
    assert {s: _manifest_bytes(tmp_path, s) for s in before} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-0000000002",
        "step-0000000004",
        "step-0000000004-v1",
        "step-0000000006",
        "step-0000000006-v1",
        "step-0000000008",
    ]
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as reader:
        assert reader.runs() == {second_run: [4, 6], first_run: [2, 4, 6, 8]}
        assert reader.steps() == [2, 4, 6, 8]
        assert reader.latest_step() == 6 and reader.latest() == "step-0000000006-v1"
        assert float(reader.restore(4)["w"][0]) == 104.0  # the newest commit of step 4
        assert float(reader.restore("step-0000000004")["w"][0]) == 4.0
        assert reader.manifest(6).run == second_run
        assert set(reader.verify()) == {2, 4, 6, 8, "step-0000000004-v1", "step-0000000006-v1"}
        assert float(reader.restore()["w"][0]) == 106.0
        assert reader.last_restore is not None and reader.last_restore.step == 6
    assert main(["ls", str(tmp_path)]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.split()[0] for r in rows if "a resume takes this one" in r] == ["6-v1"]
    assert main(["verify", str(tmp_path), "--step", "step-0000000006-v1"]) == 0
    assert "step-0000000006-v1: ok" in capsys.readouterr().out


def test_a_restore_continues_the_restored_run(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2, compression="none") as first:
        for step in (1, 2):
            first.save(step, _state(step)).wait()
        run = first.run_id
    with CheckpointManager(tmp_path, keep_last=2, compression="none") as resumed:
        assert resumed.restore()["w"][0] == 2.0
        assert resumed.run_id == run
        resumed.save(3, _state(3)).wait()
        assert read_manifest(resumed.storage, 3).run == run
    with CheckpointManager(tmp_path) as reader:
        assert reader.steps() == [2, 3]  # its step 1 was retired, as in one run


def test_a_run_resumed_at_its_end_closes_with_keep_last_steps(tmp_path: Path) -> None:
    """A training run killed between its last commit and that commit's retention (here: a
    first manager that kept one step more) and resumed at its end saves nothing more: its
    close removes the step that retention left, never the restored step nor another run's.
    A reader's restore, a restore of an older step, a manager that does not own the
    directory, or more steps than one beyond ``keep_last`` (a run that kept every step, read
    with the default) remove nothing."""
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as other:
        other.save(1, _state(0)).wait()  # another run's
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as killed:
        for step in (2, 3, 4):
            killed.save(step, _state(step)).wait()

    def close_resumed(step: int | None, keep_last: int) -> list[int]:
        with CheckpointManager(tmp_path, keep_last=keep_last, compression="none") as resumed:
            assert resumed.restore(step)["w"][0] == (step or 4)
            resumed.close(resumed_retention=True)
        with CheckpointManager(tmp_path, keep_last=None) as listing:
            return listing.steps()

    with CheckpointManager(tmp_path, keep_last=2, compression="none") as reader:
        assert reader.restore()["w"][0] == 4.0  # a reader: close() deletes nothing
    assert close_resumed(3, keep_last=2) == [1, 2, 3, 4]  # not where the run stopped
    assert close_resumed(None, keep_last=1) == [1, 2, 3, 4]  # two over: not a kill's
    holder = acquire_lease(LocalStorage(tmp_path), "another")  # a writer's, as at its save
    try:
        assert close_resumed(None, keep_last=2) == [1, 2, 3, 4]  # another writer's directory
    finally:
        holder.release()
    assert close_resumed(None, keep_last=2) == [1, 3, 4]  # step 1 is the other run's
    with CheckpointManager(tmp_path, keep_last=None) as listing:
        assert listing.restore()["w"][0] == 4.0


def test_retention_counts_no_step_the_restore_found_damaged(tmp_path: Path) -> None:
    """Steps 10, 26 and 40 with the data of 26 and 40 damaged: the run resumes from 10 and
    saves 17 with keep_last=3. The two damaged steps are neither counted among the three kept
    (which deleted step 10, the only intact step before 17) nor deleted; 26 is replaced when
    the run reaches it, and retention then keeps the newest three intact steps."""
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as first:
        for step in (10, 26, 40):
            first.save(step, _state(step)).wait()
    for step in (26, 40):
        data = next((tmp_path / step_dir_name(step)).glob("data-*"))
        raw = bytearray(data.read_bytes())
        raw[0] ^= 0xFF
        data.write_bytes(bytes(raw))
    with CheckpointManager(tmp_path, keep_last=3, compression="none") as resumed:
        assert resumed.restore()["w"][0] == 10.0
        resumed.save(17, _state(17)).wait()
        assert resumed.steps() == [10, 17, 26, 40]
        resumed.save(20, _state(20)).wait()
        assert resumed.steps() == [10, 17, 20, 26, 40]
        resumed.save(26, _state(26)).wait()  # replaces the damaged 26, now counted
        resumed.wait(retention=True)
        assert resumed.steps() == [17, 20, 26, 40]
        assert resumed.restore(26)["w"][0] == 26.0


def test_overwrite_true_replaces_a_step(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, compression="none") as mgr:
        mgr.save(5, _state(1.0)).wait()
        with pytest.raises(StepExistsError, match=r"this run's checkpoint of step 5") as caught:
            mgr.save(5, _state(2.0))
        assert caught.value.own
        mgr.save(5, _state(2.0), overwrite=True).wait()
        assert float(mgr.restore(5)["w"][0]) == 2.0
        with pytest.raises(ValueError, match="'overwrite' must be True or False"):
            mgr.save(6, _state(2.0), overwrite=1)  # type: ignore[arg-type]


def test_a_run_that_went_back_prefers_its_new_branch(tmp_path: Path) -> None:
    """Resumed from an older step, a run that trains on and saves is resumed from its new
    checkpoint, not from a higher step it abandoned; re-saving its own old steps is allowed."""
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as first:
        for step in (10, 20, 30):
            first.save(step, _state(step)).wait()
    ckpt = Checkpointer(tmp_path, keep_last=None, compression="none", block=True)
    try:
        ckpt.restore(10)
        ckpt.save(15, _state(15.0)).wait()
        ckpt.save(20, _state(-20.0)).wait()  # its own abandoned step 20: replaced
    finally:
        ckpt.close()
    order = newest_first(open_storage(str(tmp_path)))
    assert order[:2] == [20, 15] and set(order) == {10, 15, 20, 30}
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as mgr:
        assert float(mgr.restore()["w"][0]) == -20.0


def test_saves_of_the_same_step_in_flight_are_ordered(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, compression="none") as mgr:
        mgr.save(1, _state(1.0), block=False)
        with pytest.raises(StepExistsError):
            mgr.save(1, _state(2.0), block=False)  # waits for the first, which committed
        assert float(mgr.restore(1)["w"][0]) == 1.0


def test_checkpointer_saves_beside_another_runs_step_and_overwrites_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as other:
        other.save(4, _state(-4.0)).wait()
    foreign = _manifest_bytes(tmp_path, 4)
    events: list[object] = []
    ckpt = Checkpointer(
        tmp_path, keep_last=None, compression="none", block=True, listeners=[events.append]
    )
    try:
        with caplog.at_level(logging.WARNING, logger="coci_core"):
            assert ckpt.warn_if_not_empty()
            assert not ckpt.warn_if_not_empty()  # once
            ckpt.save(2, _state(2.0)).wait()
            ckpt.save(4, _state(4.0)).wait()  # another run's step: saved beside it
            assert ckpt.save(2, _state(22.0)).wait().outcome == "committed"  # its own: replaced
        assert "holds 1 checkpoint(s) of another run (steps 4)" in caplog.text
        assert [getattr(e, "outcome", None) for e in events] == ["committed"] * 3
        assert _manifest_bytes(tmp_path, 4) == foreign
        assert float(ckpt.manager.restore(2)["w"][0]) == 22.0
        assert float(ckpt.manager.restore(4)["w"][0]) == 4.0
        assert float(ckpt.manager.restore(step_dir_name(4))["w"][0]) == -4.0
    finally:
        ckpt.close()


def test_the_step_a_run_resumed_from_is_not_saved_again(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, compression="none") as first:
        first.save(7, _state(7.0)).wait()
    before = _manifest_bytes(tmp_path, 7)
    ckpt = Checkpointer(tmp_path, compression="none", block=True)
    try:
        ckpt.restore()
        assert not ckpt.warn_if_not_empty()  # resumed: nothing to warn about
        assert ckpt.save(7, _state(7.0)).wait().outcome == "skipped"
        assert ckpt.save(8, _state(8.0)).wait().outcome == "committed"
    finally:
        ckpt.close()
    assert _manifest_bytes(tmp_path, 7) == before


def test_a_damaged_newest_manifest_is_reported_and_skipped(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step)).wait()
    path = tmp_path / step_dir_name(3) / MANIFEST_NAME
    path.write_bytes(path.read_bytes()[:-10])
    assert newest_first(open_storage(str(tmp_path))) == [3, 2, 1]
    with CheckpointManager(tmp_path, compression="none") as mgr:
        assert float(mgr.restore()["w"][0]) == 2.0
        assert mgr.last_restore is not None and mgr.last_restore.skipped_steps == (3,)


def test_a_step_passed_over_as_damaged_is_replaced_when_training_reaches_it(
    tmp_path: Path,
) -> None:
    """The README's loop after a resume past a damaged newest step: training reaches that
    step again and saves it, without ``overwrite`` (before: StepExistsError, the damaged
    step counted as this run's). Only that step: another of this run's still raises."""
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as mgr:
        for step in (100, 200, 300):
            mgr.save(step, _state(step)).wait()
    data = next((tmp_path / step_dir_name(300)).glob("data-*"))
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as mgr:
        assert float(mgr.restore()["w"][0]) == 200.0
        assert mgr.last_restore is not None and mgr.last_restore.skipped_steps == (300,)
        mgr.save(300, _state(301)).wait()
        with pytest.raises(StepExistsError, match="step 300"):
            mgr.save(300, _state(302))  # saved by this run now: not passed over again
        with pytest.raises(StepExistsError, match="step 200"):
            mgr.save(200, _state(201))
    with CheckpointManager(tmp_path) as reader:
        assert float(reader.restore()["w"][0]) == 301.0
        assert reader.last_restore is not None and reader.last_restore.skipped_steps == ()
        assert [d.name for d in sorted(tmp_path.glob("step-*"))] == [
            step_dir_name(s) for s in (100, 200, 300)
        ]


def _flip_data(directory: Path) -> None:
    data = next(directory.glob("data-*"))
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_only_this_runs_checkpoint_passed_over_is_replaced(tmp_path: Path) -> None:
    """Another run's damaged checkpoint of a step passed over (``step-5-v1``) does not make a
    save of that step replace this run's healthy one, the one just restored."""
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as a:
        a.save(4, _state(4)).wait()
        a.save(5, _state(5)).wait()
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as b:
        b.save(5, _state(55)).wait()  # beside a's: step-...-v1
    _flip_data(tmp_path / step_dir_name(5, 1))
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as mgr:
        assert float(mgr.restore()["w"][0]) == 5.0
        assert mgr.last_restore is not None and mgr.last_restore.skipped_steps == (5,)
        with pytest.raises(StepExistsError, match="step 5"):
            mgr.save(5, _state(999))
    with CheckpointManager(tmp_path) as reader:
        assert float(reader.restore(step_dir_name(5))["w"][0]) == 5.0


def test_a_save_that_fails_its_checks_keeps_the_replacement(tmp_path: Path) -> None:
    """A save of the passed-over step refused before it is queued (a value it cannot store)
    leaves the step to be replaced by the next save of it."""
    from coci_core import UnsupportedValueError

    with CheckpointManager(tmp_path, keep_last=None, compression="none") as mgr:
        for step in (4, 5):
            mgr.save(step, _state(step)).wait()
    _flip_data(tmp_path / step_dir_name(5))
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as mgr:
        assert float(mgr.restore()["w"][0]) == 4.0
        with pytest.raises(UnsupportedValueError):
            mgr.save(5, {**_state(6), "bad": object()})
        mgr.save(5, _state(6)).wait()
    with CheckpointManager(tmp_path) as reader:
        assert float(reader.restore()["w"][0]) == 6.0


@pytest.mark.parametrize("run", [17, None, "", "a-b", "x" * 65, "é", ["a"]])
def test_a_bad_run_field_is_refused(tmp_path: Path, run: object) -> None:
    from coci_core.engine.format.manifest import Manifest, seal

    with CheckpointManager(tmp_path, compression="none") as mgr:
        mgr.save(1, _state(1.0)).wait()
    path = tmp_path / step_dir_name(1) / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    del doc["checksum"]
    doc["run"] = run
    data = seal(json.dumps(doc, separators=(",", ":")).encode())
    with pytest.raises(CorruptCheckpointError, match="run"):
        Manifest.from_json(data)


def test_coci_ls_shows_each_checkpoints_run_and_what_a_resume_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from coci_core.commands.cli import main

    with CheckpointManager(tmp_path, compression="none") as old:
        old.save(30, _state(30.0)).wait()
    with CheckpointManager(tmp_path, compression="none") as new:
        new.save(5, _state(5.0)).wait()
        runs = {5: new.run_id[:8], 30: old.run_id[:8]}
    assert main(["ls", str(tmp_path)]) == 0
    lines = {int(line.split()[0]): line for line in capsys.readouterr().out.splitlines()[1:]}
    assert runs[5] in lines[5] and runs[30] in lines[30]
    assert "a resume takes this one" in lines[5]
    assert "a resume takes this one" not in lines[30]


def test_manifests_without_a_sequence_order_by_creation_before_any_with_one(
    tmp_path: Path,
) -> None:
    """Manifests of an earlier 0.1.0.dev0 record no commit sequence: they are ordered by
    creation time among themselves, and before every manifest that records one."""
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step)).wait()

    def as_written_before_sequences(created: float) -> Callable[[dict[str, Any]], None]:
        def edit(doc: dict[str, Any]) -> None:
            del doc["sequence"]
            doc["created_unix"] = created

        return edit

    for step, created in ((1, 3000.0), (2, 1000.0), (3, 2000.0)):
        edit_manifest(tmp_path, step, as_written_before_sequences(created))
    storage = open_storage(str(tmp_path))
    assert newest_first(storage) == [1, 3, 2]
    with CheckpointManager(tmp_path, keep_last=None, compression="none") as mgr:
        assert float(mgr.restore()["w"][0]) == 1.0
        mgr.save(4, _state(4)).wait()
        assert mgr.manifest(4).sequence == 1
    assert newest_first(storage) == [4, 1, 3, 2]
