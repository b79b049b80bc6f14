"""Retention beside readers and crashes, with delta chains: a step that retention removes while a
reader runs is reported removed, never damaged; no base goes while a listed step needs it, also
when a SIGKILL stops retention part way."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager, CompressionPolicy, LocalStorage, NoCheckpointError
from coci_core.engine.directory import retention
from coci_core.engine.directory.steps import committed_steps, step_info
from coci_core.engine.format.manifest import MANIFEST_NAME, step_dir_name
from coci_core.engine.restore.load import check_checkpoint, load_checkpoint, verify_checkpoint
from coci_core.engine.restore.restore import resume_step
from coci_core.storage import Storage, StorageWrapper
from coci_core.training.reading import read_checkpoint
from tests.harness.processes import module, run

# A base every third save: 1 base, 2 and 3 deltas against 1, 4 base, 5 against 4, ...
POLICY = CompressionPolicy("lossless", full_every=3)


def _state(step: int) -> dict[str, torch.Tensor]:
    w = torch.arange(4096, dtype=torch.float32)
    w[:16] += step  # a delta that differs in a few bytes
    return {"w": w}


def _damage(storage: Storage) -> dict[int, list[str]]:
    """The damaged keys of each listed step that is still there when it has been read."""
    found = {}
    for step in committed_steps(storage):
        try:
            bad = verify_checkpoint(storage, step)
        except NoCheckpointError:
            continue
        if bad:
            found[step] = bad
    return found


def _saved(directory: Path, steps: range, keep_last: int | None = None) -> LocalStorage:
    with CheckpointManager(directory, keep_last=keep_last, compression=POLICY) as mgr:
        for step in steps:
            mgr.save(step, _state(step)).wait()
    return LocalStorage(directory)


class _ReadAtEachRetire(StorageWrapper):
    """After each step retention deletes, every listed step is verified (a reader that runs
    between two deletions)."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.retired: list[str] = []
        self.seen: list[dict[int, list[str]]] = []

    def retire(self, final: str) -> None:
        self.inner.retire(final)
        self.retired.append(final)
        self.seen.append(_damage(self.inner))


def test_a_reader_between_two_deletions_of_retention_finds_no_damage(tmp_path: Path) -> None:
    storage = _ReadAtEachRetire(LocalStorage(tmp_path))
    with CheckpointManager(storage, keep_last=2, compression=POLICY) as mgr:
        for step in range(1, 8):
            mgr.save(step, _state(step)).wait()
    # retention removed a base (1) and the delta on it (3) in one pass, with a reader between
    assert {step_dir_name(1), step_dir_name(3)} <= set(storage.retired)
    assert storage.seen and all(not found for found in storage.seen), storage.seen
    assert _damage(storage.inner) == {}


class _RetentionMidRead(StorageWrapper):
    """Runs ``retention`` (once) when the reader first asks for step 1's manifest: the reader
    has read step 3's manifest and not yet its base."""

    def __init__(self, inner: Storage, retention: Callable[[], None]) -> None:
        super().__init__(inner)
        self.retention: Callable[[], None] | None = retention

    def exists(self, path: str) -> bool:
        if path == f"{step_dir_name(1)}/{MANIFEST_NAME}" and self.retention is not None:
            self.retention, ran = None, self.retention
            ran()
        return self.inner.exists(path)


READERS: dict[str, Callable[[Storage], Any]] = {
    "verify": lambda s: verify_checkpoint(s, 3),
    "load": lambda s: load_checkpoint(s, 3),
    "check": lambda s: check_checkpoint(s, 3),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_a_step_removed_with_its_base_mid_read_is_removed_not_damaged(
    tmp_path: Path, reader: str
) -> None:
    inner = _saved(tmp_path, range(1, 6))
    assert step_info(inner, 3).bases == (1,)
    run_id = step_info(inner, 5).run

    def keep_last_2() -> None:
        retention.apply_keep_last(inner, keep_last=2, run_id=run_id, newest=5, next_base=4)

    storage = _RetentionMidRead(inner, keep_last_2)
    with pytest.raises(NoCheckpointError, match=r"removed .* while it was being read"):
        READERS[reader](storage)
    assert storage.retention is None  # it ran mid-read
    assert committed_steps(inner) == [4, 5]


class _CommitAndRemovalMidRead(StorageWrapper):
    """A reader's view of a directory whose writer (``keep_last=1``) commits step 2 and
    removes step 1 right after the reader listed the steps (``when="list"``: before it read
    step 1's manifest) or once it started reading step 1's data (``when="data"``)."""

    def __init__(self, inner: Storage, writer: CheckpointManager, when: str) -> None:
        super().__init__(inner)
        self.writer, self.when, self.raced = writer, when, False

    def _race(self) -> None:
        if not self.raced:
            self.raced = True
            self.writer.save(2, _state(2)).wait()
            self.writer.wait(retention=True)
            assert committed_steps(self.inner) == [2]

    def list_dir(self, path: str = "") -> list[str]:
        names = self.inner.list_dir(path)
        if path == "" and self.when == "list":
            self._race()
        return names

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        if path.startswith(step_dir_name(1)) and self.when == "data":
            self._race()
        self.inner.read_into(path, offset, out)

    def read_bytes(self, path: str) -> bytes:
        if (
            path.startswith(step_dir_name(1))
            and not path.endswith(MANIFEST_NAME)
            and self.when == "data"
        ):
            self._race()
        return self.inner.read_bytes(path)


@pytest.mark.parametrize("when", ["list", "data"])
@pytest.mark.parametrize("reader", ["restore", "coci ls", "last"])
def test_a_reader_racing_a_keep_last_1_writer_takes_the_newer_step(
    tmp_path: Path, when: str, reader: str
) -> None:
    """A reader that listed step 1 just before the writer (``keep_last=1``) committed step 2
    and removed step 1 lists again: it restores step 2. Before, it raised "no committed
    checkpoint" (which the README's resume loop reads as a fresh start) or "no intact
    checkpoint" on a healthy directory (about 15 of 13,000 restores beside such a writer); a
    resume of the step resolved as the newest ("last": Lightning's own restore of it, the
    Trainer's export) raised "no intact checkpoint ... step 1 was removed" until now."""
    with CheckpointManager(tmp_path, keep_last=1, compression="none") as writer:
        writer.save(1, _state(1)).wait()
        storage = _CommitAndRemovalMidRead(LocalStorage(tmp_path), writer, when)
        if reader == "restore":
            with CheckpointManager(storage) as other:
                assert torch.equal(other.restore()["w"], _state(2)["w"])
        elif reader == "last":  # Lightning's ckpt_path="last", the Trainer's export: step 1
            loaded, _ = read_checkpoint(storage, 1, fall_back=True)  # was the newest
            assert loaded.step == 2 and torch.equal(loaded.state["w"], _state(2)["w"])
        else:
            assert resume_step(storage).candidate.step == 2
        assert storage.raced


class _FreedByOneDeletion(StorageWrapper):
    """A storage that reports no free space until one step is deleted, then plenty."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.retired: list[str] = []

    def retire(self, final: str) -> None:
        self.inner.retire(final)
        self.retired.append(final)

    def free_bytes(self) -> int | None:
        return 10**12 if self.retired else 0


def test_room_made_early_never_leaves_a_delta_without_its_base(tmp_path: Path) -> None:
    inner = _saved(tmp_path, range(1, 5))  # 1 base, 2 and 3 deltas on it, 4 base
    storage = _FreedByOneDeletion(inner)
    retention.make_room(
        storage,
        keep_last=2,
        run_id=step_info(inner, 4).run,
        step=5,
        needed_bytes=1,
        next_base=4,
    )
    # step 1 went first by age, so the deltas on it went with it (before it)
    assert storage.retired == [step_dir_name(3), step_dir_name(2), step_dir_name(1)]
    assert committed_steps(inner) == [4]
    assert _damage(inner) == {}


def test_sigkill_at_every_point_of_retention_leaves_no_step_without_its_base(
    tmp_path: Path,
) -> None:
    template = _saved(tmp_path / "template", range(1, 6))
    run_id = step_info(template, 5).run
    out = tmp_path / "killed"
    proc = run(
        module(
            "tests.adversarial._retention_kill_child",
            str(tmp_path / "template"),
            str(out),
            run_id,
        )
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    # two steps each renamed away, fsynced and deleted: every operation between was a kill point
    assert result["killed"] >= 6 and result["statuses_killed"] == [-9] * result["killed"]
    # keeping step 2 besides them (keep_also): only step 3 goes, and 2 and its base never
    assert result["killed_also"] >= 2
    assert result["statuses_killed_also"] == [-9] * result["killed_also"]
    for prefix, kept in (("k", {4, 5}), ("a", {1, 2, 4, 5})):
        for kill_at in range(result["killed" if prefix == "k" else "killed_also"]):
            with CheckpointManager(out / f"{prefix}{kill_at}", keep_last=None) as mgr:
                steps = mgr.steps()
                assert kept <= set(steps) <= {1, 2, 3, 4, 5}, (prefix, kill_at, steps)
                for step in steps:
                    assert mgr.verify(step) == {step: []}, (prefix, kill_at, step)
                    assert torch.equal(mgr.restore(step=step)["w"], _state(step)["w"])
    assert committed_steps(LocalStorage(out / f"k{result['killed']}")) == [4, 5]
    assert committed_steps(LocalStorage(out / f"a{result['killed_also']}")) == [1, 2, 4, 5]
    shutil.rmtree(out)
