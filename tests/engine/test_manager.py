"""CheckpointManager: saving, the consistency point, retention, busy policy, errors, restore."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import (
    BackgroundSaveError,
    CheckpointManager,
    CociError,
    ConfigError,
    CorruptCheckpointError,
    LocalStorage,
    NoCheckpointError,
    RestoreEvent,
    SaveEvent,
    StorageError,
)
from coci_core.engine.directory.lease import LEASE_NAME
from coci_core.engine.directory.steps import committed_steps
from coci_core.engine.format.manifest import seal, step_dir_name
from tests.harness.faults import FaultyStorage, HeldStorage
from tests.harness.states import assert_same, tiny_model_state


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_save_restore_and_steps(tmp_path: Path) -> None:
    """Saved steps are listed ascending and each restores its own state."""
    events: list[Any] = []
    with CheckpointManager(tmp_path, keep_last=None, listeners=[events.append]) as mgr:
        states = {}
        for step in (10, 30, 20):
            states[step] = {"w": torch.full((4,), float(step)), "step": step}
            handle = mgr.save(step, states[step])
            result = handle.wait()
            assert result.outcome == "committed"
            assert result.step == step
            assert result.bytes_written > 0
            assert result.time_to_durable_s >= result.stall_s >= 0
        assert mgr.steps() == [10, 20, 30]
        assert_same(mgr.restore(), states[20])  # the newest save, not the highest step
        assert_same(mgr.restore(step=20), states[20])
        assert mgr.last_restore is not None
        assert mgr.last_restore.step == 20
    saves = [e for e in events if isinstance(e, SaveEvent)]
    assert [e.step for e in saves] == [10, 30, 20]
    assert [e.first_save for e in saves] == [True, False, False]  # same layout: buffers reused
    assert any(isinstance(e, RestoreEvent) for e in events)


def test_buffers_are_reused_and_snapshot_is_consistent(tmp_path: Path) -> None:
    """A blocking save copies the state: changing tensors right after it does not leak in."""
    w = torch.zeros(1000)
    with CheckpointManager(tmp_path) as mgr:
        h1 = mgr.save(1, {"w": w})
        w.add_(1.0)  # training goes on while the persist runs
        h2 = mgr.save(2, {"w": w})
        w.add_(1.0)
        mgr.wait()
        assert h1.event is not None
        assert h1.event.first_save
        assert h2.event is not None
        assert not h2.event.first_save
        assert torch.equal(mgr.restore(step=1)["w"], torch.zeros(1000))
        assert torch.equal(mgr.restore(step=2)["w"], torch.ones(1000))


def test_non_blocking_save_with_before_update(tmp_path: Path) -> None:
    """block=False returns before the copy; before_update makes the snapshot consistent."""
    held = HeldStorage(LocalStorage(tmp_path))
    w = torch.zeros(100_000)
    with CheckpointManager(held) as mgr:
        handle = mgr.save(5, {"w": w}, block=False)
        mgr.before_update()  # waits for the copy only, not for the held write
        assert not handle.done()
        w.add_(1.0)  # the optimizer step after the consistency point
        held.release.set()
        event = handle.wait()
        assert not event.block
    with CheckpointManager(tmp_path) as mgr:
        assert torch.equal(mgr.restore()["w"], torch.zeros(100_000))


def test_retention_keeps_last_and_never_the_new_one(tmp_path: Path) -> None:
    """keep_last=2 keeps the two newest committed steps after each durable save."""
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        mgr.save(step, {"x": torch.tensor(step)})
    mgr.close()  # retention runs after each save is durable; close waits for it
    assert mgr.steps() == [4, 5]


def test_steps_kept_also_stay_besides_keep_last(tmp_path: Path) -> None:
    """``keep_also`` (an adapter's best step): retention keeps it besides the newest
    ``keep_last``, and forgets it once replaced."""
    with CheckpointManager(tmp_path, keep_last=1) as mgr:
        mgr.save(1, {"x": torch.tensor(1)})
        mgr.keep_also({1})
        for step in (2, 3):
            mgr.save(step, {"x": torch.tensor(step)})
        mgr.wait(retention=True)
        assert mgr.steps() == [1, 3] and mgr.kept_also == {1}
        mgr.keep_also({3})
        mgr.save(4, {"x": torch.tensor(4)})
        mgr.wait(retention=True)
        assert mgr.steps() == [3, 4]


def test_steps_kept_also_stay_on_the_remote_tier(tmp_path: Path) -> None:
    """The remote tier's retention keeps them too (before: ``remote_keep_last`` deleted the
    best step there, the copy that a run on a node that lost its disk resumes from)."""
    remote = tmp_path / "remote"
    with CheckpointManager(
        tmp_path / "local", keep_last=1, remote=remote, remote_keep_last=1
    ) as mgr:
        assert mgr.remote is not None
        for step in (1, 2, 3):
            mgr.save(step, {"x": torch.tensor(step)})
            mgr.wait(retention=True)  # handed to the upload thread, then uploaded
            assert mgr.remote.flush(30)
            mgr.keep_also({1})
        assert committed_steps(LocalStorage(remote)) == [1, 3]


@pytest.mark.parametrize("steps", [5, "12", [1.0], [-1], [2**63], [True], None])
def test_keep_also_refuses_what_is_no_steps_by_name(tmp_path: Path, steps: Any) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ConfigError, match=r"'steps' must be an iterable of step numbers"):
            mgr.keep_also(steps)
        assert mgr.kept_also == frozenset()


def test_on_busy_skip_and_wait(tmp_path: Path) -> None:
    """While a persist runs, on_busy='skip' skips the save and says so; 'wait' waits."""
    held = HeldStorage(LocalStorage(tmp_path / "skip"))
    events: list[Any] = []
    with CheckpointManager(held, on_busy="skip", listeners=[events.append]) as mgr:
        first = mgr.save(1, {"x": torch.ones(3)})
        assert held.entered.wait(timeout=30)
        second = mgr.save(2, {"x": torch.ones(3)})
        assert second.skipped
        assert second.done()
        held.release.set()
        first.wait()
        assert mgr.steps() == [1]
    assert [e.outcome for e in events] == ["skipped", "committed"]

    with CheckpointManager(tmp_path / "wait", on_busy="wait") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"x": torch.ones(3)})
        mgr.wait()
        assert mgr.steps() == [1, 2, 3]


def test_restore_into_stateful_objects(tmp_path: Path) -> None:
    """restore(into=...) loads the model and optimizer in place."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": model.state_dict(), "optim": optim.state_dict()})
        other = torch.nn.Linear(4, 2)
        other_optim = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
        mgr.restore(into={"model": other, "optim": other_optim})
        assert_same(dict(other.state_dict()), dict(model.state_dict()))
        assert_same(other_optim.state_dict(), optim.state_dict())
        with pytest.raises(CociError, match="no \\['sched'\\]"):
            mgr.restore(into={"sched": other_optim})


def test_no_checkpoint(tmp_path: Path) -> None:
    """An empty directory gives NoCheckpointError, and so does an unknown step."""
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(NoCheckpointError):
            mgr.restore()
        mgr.save(1, {"x": 1}).wait()
        with pytest.raises(NoCheckpointError, match="step 2"):
            mgr.restore(step=2)


def _corrupt_latest(tmp_path: Path) -> None:
    data = tmp_path / step_dir_name(2) / "data-r0.bin"
    manifest = json.loads((tmp_path / step_dir_name(2) / "manifest.json").read_text())
    entry = next(t for t in manifest["tensors"] if t["key"] == "/w")
    _flip_byte(data, entry["pieces"][0]["offset"] + 3)


def test_corrupt_latest_falls_back_and_strict_raises(tmp_path: Path) -> None:
    """A flipped byte in the newest step is reported; restore uses the previous step."""
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(1, {"w": torch.ones(64)})
        mgr.save(2, {"w": torch.full((64,), 2.0)})
        mgr.wait()
    _corrupt_latest(tmp_path)
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        assert mgr.verify() == {1: [], 2: ["/w"]}
        state = mgr.restore()
        assert torch.equal(state["w"], torch.ones(64))
        assert mgr.last_restore is not None
        assert mgr.last_restore.skipped_steps == (2,)
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch in '/w'") as info:
            mgr.restore(strict=True)
        assert info.value.bad == ["/w"]
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(step=2)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda m: m.update(format_version=99),
            "format_version 99; this coci reads formats 3, 4 and 5",
        ),
        (
            lambda m: m.update(format_version=2),
            "format_version 2; this coci reads formats 3, 4 and 5",
        ),
        (
            lambda m: m.update(format_version=1),
            "format_version 1; this coci reads formats 3, 4 and 5",
        ),
        (lambda m: m.pop("tensors"), "malformed"),
        (lambda m: m["tensors"][0]["pieces"][0].update(file="../../etc/passwd"), "plain name"),
        (lambda m: m["tensors"][0]["pieces"][0].update(start=4), "do not tile"),
        (lambda m: m["tensors"][0].update(pieces=[]), "cover 0 of its 8 bytes"),
        (lambda m: m["tensors"][0].update(dtype="object"), "unknown dtype"),
        (lambda m: m["tensors"][0].update(codec="evil/1"), "unknown codec"),
        (lambda m: m.update(tree={"t": "pickle", "v": "x"}), "unknown state tree node"),
        (lambda m: m.update(step=5), "says step 5"),
    ],
)
@pytest.mark.parametrize("resealed", [True, False], ids=["crafted", "damaged"])
def test_malformed_manifest_gives_clear_error(
    tmp_path: Path, edit: Any, message: str, resealed: bool
) -> None:
    """Each kind of malformed manifest is refused with an error saying what is wrong; with its
    checksum left as it was, the checksum finds the change first."""
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(1, {"w": torch.ones(2)}).wait()
    path = tmp_path / step_dir_name(1) / "manifest.json"
    doc = json.loads(path.read_text())
    checksum = doc.pop("checksum")
    edit(doc)
    body = json.dumps(doc, separators=(",", ":")).encode()
    if resealed:
        path.write_bytes(seal(body))
    else:
        path.write_bytes(body[:-1] + b',"checksum":' + json.dumps(checksum).encode() + b"}")
        message = "checksum mismatch"
    with (
        CheckpointManager(tmp_path, keep_last=None) as mgr,
        pytest.raises(CorruptCheckpointError, match=message),
    ):
        mgr.restore(step=1)


def test_manifest_that_is_not_json(tmp_path: Path) -> None:
    """A truncated manifest is reported as damaged, not as a JSON traceback."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(2)}).wait()
        path = tmp_path / step_dir_name(1) / "manifest.json"
        path.write_bytes(path.read_bytes()[:20])
        with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
            mgr.restore()


@pytest.mark.parametrize(
    ("fail", "error"),
    [
        ({"write_file": [0]}, OSError(errno.ENOSPC, "No space left on device")),
        ({"write_file": [1]}, OSError(errno.EACCES, "Permission denied")),
        ({"publish": [0]}, OSError(errno.EIO, "Input/output error")),
    ],
    ids=["disk-full-data", "permission-manifest", "io-error-publish"],
)
def test_background_failure_surfaces_and_keeps_previous(
    tmp_path: Path, fail: dict[str, list[int]], error: OSError
) -> None:
    """A failed persist raises on the next save, publishes nothing and keeps step 1 intact."""
    with CheckpointManager(tmp_path) as good:
        good.save(1, {"w": torch.ones(8)}).wait()
    faulty = FaultyStorage(LocalStorage(tmp_path), fail=fail, error=error)
    with CheckpointManager(faulty) as mgr:
        handle = mgr.save(2, {"w": torch.zeros(8)})
        with pytest.raises(BackgroundSaveError, match=os.strerror(error.errno or 0)) as info:
            handle.wait()
        assert info.value.step == 2
        assert isinstance(info.value.__cause__, StorageError | OSError)
        mgr.save(3, {"w": torch.zeros(8)})  # the failure was reported by handle.wait()
        mgr.wait()
        assert mgr.steps() == [1, 3]
        assert torch.equal(mgr.restore(step=1)["w"], torch.ones(8))
    assert sorted(n for n in os.listdir(tmp_path) if n != LEASE_NAME) == [
        step_dir_name(1),
        step_dir_name(3),
    ]


@pytest.mark.parametrize("where", ["save", "wait", "close"])
def test_unobserved_failure_raises_on_next_save_wait_and_close(tmp_path: Path, where: str) -> None:
    """A failure nobody waited for is raised once by the next save, wait or close."""
    finished = threading.Event()
    faulty = FaultyStorage(LocalStorage(tmp_path), fail={"write_file": [0]})
    mgr = CheckpointManager(faulty, listeners=[lambda event: finished.set()])
    mgr.save(1, {"w": torch.ones(8)})
    assert finished.wait(timeout=60)

    def next_call() -> None:
        if where == "save":
            mgr.save(2, {"w": torch.ones(8)})
        elif where == "wait":
            mgr.wait()
        else:
            mgr.close()

    with pytest.raises(BackgroundSaveError, match="step 1 failed"):
        next_call()
    mgr.close()  # reported once: closing again does not raise
    assert mgr.steps() == []


def test_leftovers_are_removed_at_the_first_save(tmp_path: Path) -> None:
    """Unpublished directories from a killed run are removed by the next manager's first save
    (a manager that only reads removes nothing); user files are not."""
    (tmp_path / "step-0000000005.coci-tmp-abc").mkdir()
    (tmp_path / "step-0000000005.coci-tmp-abc" / "data-r0.bin").write_bytes(b"x")
    (tmp_path / "step-0000000006").mkdir()  # no manifest: not a checkpoint
    (tmp_path / "notes.txt").write_text("mine")
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == []
    assert len(os.listdir(tmp_path)) == 3
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"v": 1}).wait()
    assert sorted(n for n in os.listdir(tmp_path) if n != LEASE_NAME) == [
        "notes.txt",
        "step-0000000001",
    ]


def test_resave_same_step_replaces_it(tmp_path: Path) -> None:
    """Saving a step that is already committed replaces it atomically."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(4, {"v": 1}).wait()
        mgr.save(4, {"v": 2}, overwrite=True).wait()
        assert mgr.steps() == [4]
        assert mgr.restore()["v"] == 2


def test_metadata_is_stored(tmp_path: Path) -> None:
    """JSON metadata goes into the manifest; anything else is refused."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"v": 1}, metadata={"run": "exp1"}).wait()
        assert mgr.manifest(1).metadata == {"run": "exp1"}
        with pytest.raises(ConfigError, match="'metadata'"):
            mgr.save(2, {"v": 1}, metadata={"x": object()})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_last": 0}, "'keep_last' must be an integer >= 1 or None: 0"),
        ({"keep_last": 1.5}, "'keep_last'"),
        ({"on_busy": "drop"}, "'on_busy' must be one of ('wait', 'skip'): 'drop'"),
        ({"worker_niceness": -1}, "'worker_niceness'"),
        ({"listeners": [3]}, "'listeners'"),
    ],
)
def test_bad_arguments_name_the_parameter(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    """Bad constructor arguments raise ConfigError naming the parameter and what is allowed."""
    with pytest.raises(ConfigError) as info:
        CheckpointManager(tmp_path, **kwargs)
    assert message in str(info.value)


def test_bad_directory_and_step(tmp_path: Path) -> None:
    """An empty directory string, a bad step and saving after close are refused clearly."""
    with pytest.raises(ConfigError, match="'directory'"):
        CheckpointManager("")
    with pytest.raises(ConfigError, match="'directory'"):
        CheckpointManager(42)  # type: ignore[arg-type]
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(ConfigError, match=r"'step' must be an integer in \[0, 2\*\*63-1\], got -1"):
        mgr.save(-1, {})
    mgr.close()
    with pytest.raises(CociError, match="closed"):
        mgr.save(1, {})


def test_model_state_round_trip_on_fsspec_memory() -> None:
    """The full path works on fsspec's memory:// file system (manifest as commit marker)."""
    state = tiny_model_state()
    with CheckpointManager("memory://coci-test/run1", keep_last=1) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
    with CheckpointManager("memory://coci-test/run1", keep_last=1) as mgr:
        assert mgr.steps() == [2]
        assert_same(mgr.restore(), state)


def test_a_save_handle_is_used_like_a_future(tmp_path: Path) -> None:
    """done/result/exception/add_done_callback as on concurrent.futures.Future: a callback
    added before the end runs once it is done, one added after runs at once; a failed save's
    exception is the storage's error, and result() raises it as BackgroundSaveError."""
    seen: list[tuple[int, str]] = []
    with CheckpointManager(tmp_path / "ok") as mgr:
        handle = mgr.save(1, {"w": torch.ones(8)})
        handle.add_done_callback(lambda h: seen.append((h.step, "early")))
        event = handle.result(timeout=60)
        assert handle.done() and event.outcome == "committed" and handle.exception() is None
        handle.add_done_callback(lambda h: seen.append((h.step, "late")))
    assert seen == [(1, "early"), (1, "late")]
    faulty = FaultyStorage(LocalStorage(tmp_path / "bad"), fail={"write_file": [0]})
    mgr = CheckpointManager(faulty)
    failed = mgr.save(1, {"w": torch.ones(8)})
    error = failed.exception(timeout=60)
    assert error is not None
    with pytest.raises(BackgroundSaveError, match="step 1 failed"):
        failed.result()
    mgr.close()  # reported through the handle: close does not raise it again


def test_a_restore_reports_where_its_time_went(tmp_path: Path) -> None:
    """RestoreEvent splits the restore: reading, verifying, decoding, loading into the model."""
    model = torch.nn.Linear(512, 512)
    with CheckpointManager(tmp_path, compression="none") as mgr:
        mgr.save(1, {"model": model.state_dict()})
    fresh = torch.nn.Linear(512, 512)
    with CheckpointManager(tmp_path) as mgr:
        mgr.restore(into={"model": fresh})
        event = mgr.last_restore
    assert event is not None
    assert event.read_s > 0 and event.verify_s > 0 and event.load_s > 0
    assert event.decode_s == 0.0  # nothing was compressed
    assert event.seconds >= event.read_s + event.verify_s + event.load_s
    assert torch.equal(fresh.weight, model.weight)


class _HeldRetire(FaultyStorage):
    """Holds every ``retire`` (retention's delete) until ``release`` is set."""

    def __init__(self, inner: LocalStorage) -> None:
        super().__init__(inner, fail={})
        self.release = threading.Event()
        self.entered = threading.Event()

    def retire(self, final: str) -> None:
        self.entered.set()
        self.release.wait()
        self.inner.retire(final)


def test_wait_with_retention_waits_for_the_retired_steps(tmp_path: Path) -> None:
    """``wait()`` returns once the saves are durable, while retention (after each save, on
    the writer thread) may still be removing old steps, which ``steps()`` then still lists;
    ``wait(retention=True)`` returns only once they are gone (or raises on its timeout), so
    that a step it lists stays while it is read (the Trainer adapter's best model)."""
    storage = _HeldRetire(LocalStorage(tmp_path))
    mgr = CheckpointManager(storage, keep_last=1)
    try:
        mgr.save(1, {"x": torch.tensor(1)})
        mgr.save(2, {"x": torch.tensor(2)})
        mgr.wait()
        assert storage.entered.wait(60)  # retention of step 1 has begun, and is held
        assert mgr.steps() == [1, 2]
        with pytest.raises(TimeoutError, match="retention"):
            mgr.wait(timeout_s=0.2, retention=True)
        waited = threading.Event()
        waiter = threading.Thread(target=lambda: (mgr.wait(retention=True), waited.set()))
        waiter.start()
        assert not waited.wait(0.2)  # still held: the wait goes on
        storage.release.set()
        waiter.join(60)
        assert waited.is_set()
        assert mgr.steps() == [2]
    finally:
        storage.release.set()
        mgr.close()
    # no writer thread (closed, or never started): nothing to wait for
    mgr.wait(retention=True)
    with CheckpointManager(tmp_path / "empty", keep_last=1) as fresh:
        fresh.wait(retention=True)


def test_a_data_file_cut_short_only_in_its_padding_restores_and_verifies(tmp_path: Path) -> None:
    """A data file of another size than the manifest's ``files`` records, cut only in the
    padding after its last piece, is no damage (docs/engine.md): every stored byte of every
    array is under its crc32c, and refusing the step would fall back past an intact one. Cut
    one byte into the last piece, it is damage."""
    state = {"w": torch.arange(5, dtype=torch.float32), "b": torch.ones(3, dtype=torch.float64)}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, state).wait()
        manifest = mgr.manifest(1)
        (data,) = manifest.files
        end = max(p.offset + p.nbytes for t in manifest.tensors for p in t.pieces)
        path = tmp_path / step_dir_name(1) / data.name
        assert path.stat().st_size == data.nbytes > end  # padding after the last piece
        os.truncate(path, end)
        assert mgr.verify(1) == {1: []}
        assert_same(mgr.restore(1), state)
        os.truncate(path, end - 1)
        assert mgr.verify(1)[1] != []  # the last piece cut: damage
