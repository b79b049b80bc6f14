"""Two tiers: every local commit is copied to a remote tier in the background.

These use a second local directory as the remote (the same code path as an object store; the
real S3 server is in tests/storage/test_s3_tiers.py)."""

from __future__ import annotations

import errno
import logging
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager, ConfigError, DirectoryInUseError
from coci_core.engine.directory.lease import acquire_lease
from coci_core.engine.format.manifest import MANIFEST_NAME, step_dir_name
from coci_core.engine.restore.restore import newest_first
from coci_core.storage import LocalStorage
from coci_core.telemetry import TELEMETRY_FILE, Event, JsonlTelemetry, UploadEvent
from coci_core.telemetry.report import render, summarize
from tests.harness.faults import FaultyStorage


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(128, 64, generator=g), "step": torch.tensor(seed)}


def _steps(directory: Path) -> list[int]:
    with CheckpointManager(directory) as mgr:
        return mgr.steps()


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_commit_reaches_the_remote_and_restores_from_it(tmp_path: Path) -> None:
    """Each committed step is uploaded (data, then the manifest), keep_last applies per tier,
    and a new node with an empty local disk restores the newest step from the remote, bit for
    bit, reporting the tier."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    events: list[Event] = []
    with CheckpointManager(
        local, remote=remote, keep_last=2, remote_keep_last=4, listeners=[events.append]
    ) as mgr:
        assert mgr.remote is not None
        for step in range(1, 7):
            mgr.save(step, _state(step), block=True).wait()
            assert mgr.remote.flush(timeout_s=60)  # each upload done before the next save
    assert _steps(local) == [5, 6]
    assert _steps(remote) == [3, 4, 5, 6]
    committed = [e.step for e in events if isinstance(e, UploadEvent) and e.outcome == "committed"]
    assert committed == [1, 2, 3, 4, 5, 6]
    shutil.rmtree(local)  # the node is gone
    fresh: list[Event] = []
    with CheckpointManager(tmp_path / "new-node", remote=remote, listeners=[fresh.append]) as mgr:
        restored = mgr.restore()
        assert mgr.last_restore is not None and mgr.last_restore.tier == "remote"
        assert mgr.last_restore.step == 6
    assert _equal(restored, _state(6))


def test_steps_kept_also_stay_on_the_remote_too(tmp_path: Path) -> None:
    """``keep_also`` (an adapter's best step) is kept by the remote's retention too, besides
    its ``remote_keep_last`` (it kept it locally only: the remote deleted the best step), and
    forgotten there too once replaced."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(local, remote=remote, keep_last=1, remote_keep_last=1) as mgr:
        assert mgr.remote is not None
        for step in (1, 2, 3):
            mgr.save(step, _state(step), block=True).wait()
            assert mgr.remote.flush(timeout_s=60)
            if step == 1:
                mgr.keep_also({1})
        assert _steps(local) == [1, 3]
        assert _steps(remote) == [1, 3]
        mgr.keep_also({3})
        mgr.save(4, _state(4), block=True).wait()
        assert mgr.remote.flush(timeout_s=60)
        assert _steps(remote) == [3, 4]


def test_a_step_kept_also_is_uploaded_between_the_remote_period(tmp_path: Path) -> None:
    """With ``remote_upload_every=3`` a step kept also (the best step, given before its save)
    that is not the period's was never uploaded: a node that lost its disk lost it. It is
    uploaded at its commit, and the period goes on."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(
        local, remote=remote, keep_last=None, remote_keep_last=None, remote_upload_every=3
    ) as mgr:
        assert mgr.remote is not None
        for step in (1, 2, 3, 4, 5):
            if step == 2:
                mgr.keep_also({2})
            mgr.save(step, _state(step), block=True).wait()
            assert mgr.remote.flush(timeout_s=60)
        assert _steps(remote) == [2, 3]
        mgr.wait()
    assert _steps(remote) == [2, 3, 5]  # the newest at close, as before
    with CheckpointManager(remote) as mgr:
        assert _equal(mgr.restore(step=2), _state(2))


def test_a_step_kept_also_after_its_commit_is_uploaded(tmp_path: Path) -> None:
    """``keep_also`` given after the step's commit (the best step, known from a later
    evaluation), which ``remote_upload_every=3`` passed over: kept on the local disk only, and a
    node that lost its disk lost it. It is uploaded then."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(
        local, remote=remote, keep_last=2, remote_keep_last=None, remote_upload_every=3
    ) as mgr:
        assert mgr.remote is not None
        for step in (1, 2, 3, 4):
            mgr.save(step, _state(step), block=True).wait()
            if step == 2:
                mgr.keep_also({2})
            assert mgr.remote.flush(timeout_s=60)
        assert _steps(remote) == [2, 3]
    with CheckpointManager(remote) as mgr:
        assert _equal(mgr.restore(step=2), _state(2))


def test_a_newer_save_supersedes_a_pending_upload(tmp_path: Path) -> None:
    """Saves that come faster than uploads: the remote gets the newest step, and never more
    than keep_last of them; every step it has restores exactly."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(local, remote=remote, remote_keep_last=3) as mgr:
        for step in range(1, 11):
            mgr.save(step, _state(step), block=True).wait()
    on_remote = _steps(remote)
    assert on_remote[-1] == 10 and len(on_remote) <= 3
    with CheckpointManager(remote) as mgr:
        for step in on_remote:
            assert _equal(mgr.restore(step=step), _state(step))


def test_local_is_preferred_when_intact_and_remote_when_damaged(tmp_path: Path) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(local, remote=remote) as mgr:
        mgr.save(1, _state(1), block=True).wait()
        mgr.save(2, _state(2), block=True).wait()
    with CheckpointManager(local, remote=remote) as mgr:
        assert _equal(mgr.restore(), _state(2))
        assert mgr.last_restore is not None and mgr.last_restore.tier == "local"
    data = next((local / step_dir_name(2)).glob("data-*"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with CheckpointManager(local, remote=remote) as mgr:
        # the newest intact step of either tier: the remote's copy of step 2, not local step 1
        assert _equal(mgr.restore(), _state(2))
        assert mgr.last_restore is not None
        assert (mgr.last_restore.step, mgr.last_restore.tier) == (2, "remote")
        assert mgr.last_restore.skipped_steps == (2,)
        # and a restore of step 2 itself
        assert _equal(mgr.restore(step=2), _state(2))
        assert mgr.last_restore is not None and mgr.last_restore.tier == "remote"


def test_a_fresh_run_on_a_new_node_is_newer_on_the_remote_than_the_old_run(
    tmp_path: Path,
) -> None:
    """A fresh run (not resumed) on a node with an empty disk, beside an older run's steps
    in the remote tier: its saves are committed after the remote's newest (the commit
    sequence starts above the remote's), on the remote too."""
    remote = tmp_path / "remote"
    with CheckpointManager(tmp_path / "node1", remote=remote) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step)).wait()
            assert mgr.remote is not None and mgr.remote.flush(timeout_s=60)
    with CheckpointManager(tmp_path / "node2", remote=remote) as mgr:
        for step in (10, 11):
            mgr.save(step, _state(step)).wait()
            assert mgr.remote is not None and mgr.remote.flush(timeout_s=60)
        fresh = mgr.run_id
    with CheckpointManager(remote) as bucket:
        assert bucket.latest_step() == 11
        assert next(iter(bucket.runs())) == fresh
    with CheckpointManager(tmp_path / "node1", remote=remote) as mgr:
        assert mgr.latest_step() == 11


def test_saves_after_a_restore_from_a_remote_it_cannot_write_come_after_it(
    tmp_path: Path,
) -> None:
    """The remote tier belongs to another writer (this manager uploads nothing there): a
    restore from it still makes later local saves newer than the restored step."""
    remote = tmp_path / "remote"
    with CheckpointManager(remote) as owner:
        for step in (1, 2, 3, 4, 5):
            owner.save(step, _state(step)).wait()
        with CheckpointManager(tmp_path / "local", remote=remote) as mgr:
            mgr.restore()
            assert mgr.last_restore is not None
            assert (mgr.last_restore.step, mgr.last_restore.tier) == (5, "remote")
            mgr.save(6, _state(6)).wait()
            assert mgr.remote is not None and not mgr.remote.writable  # refused at the save
            assert mgr.latest_step() == 6
            assert _equal(mgr.restore(), _state(6))
            assert mgr.last_restore is not None and mgr.last_restore.tier == "local"


def test_deltas_take_their_bases_to_the_remote(tmp_path: Path) -> None:
    """With lossless deltas, a step whose base the remote lacks (retention removed it there)
    is uploaded after its base, and restores exactly from the remote alone."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    options = {"full_every": 4}
    with CheckpointManager(
        local,
        remote=remote,
        keep_last=None,
        remote_keep_last=1,
        compression="lossless",
        compression_options=options,
    ) as mgr:
        for step in range(1, 4):
            mgr.save(step, _state(step), block=True).wait()
        assert mgr.remote is not None and mgr.remote.flush(timeout_s=60)
        assert mgr.manifest(3).bases == (1,)
    assert 3 in _steps(remote) and 1 in _steps(remote)  # the base stays: step 3 needs it
    shutil.rmtree(local)
    with CheckpointManager(tmp_path / "new", remote=remote) as mgr:
        assert _equal(mgr.restore(step=3), _state(3))


def test_a_failing_upload_is_retried_and_never_stops_training(tmp_path: Path) -> None:
    """While the remote cannot take the step (a file stands where its directory must go),
    saves go on committing locally and every attempt is reported as failed; once the obstacle
    is gone, the retry (after a backoff) publishes the newest step."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    events: list[Event] = []
    first_failure = threading.Event()

    def listen(event: Event) -> None:
        events.append(event)
        if isinstance(event, UploadEvent) and event.outcome == "failed":
            first_failure.set()

    sink = JsonlTelemetry(tmp_path / "telemetry" / TELEMETRY_FILE)
    with CheckpointManager(local, remote=remote, listeners=[listen, sink]) as mgr:
        assert mgr.remote is not None
        mgr.save(0, _state(0)).wait()  # the first save takes the remote's lease (and cleans it)
        assert mgr.remote.flush(timeout_s=60)
        blocker = remote / f"{step_dir_name(1)}.coci-tmp-{mgr.group.session}up-1"
        blocker.write_bytes(b"not a directory")
        mgr.save(1, _state(1), block=True).wait()
        assert first_failure.wait(timeout=60)
        failed = [e for e in events if isinstance(e, UploadEvent) and e.outcome == "failed"]
        assert failed and failed[0].step == 1 and failed[0].error
        assert _steps(local) == [0, 1]  # training goes on: the local commit is unaffected
        blocker.unlink()
        assert mgr.remote.flush(timeout_s=60)
    assert _steps(remote) == [0, 1]
    ok = [e for e in events if isinstance(e, UploadEvent) and e.outcome == "committed"]
    assert ok and ok[-1].step == 1 and ok[-1].attempt >= 2
    sink.close()
    report = render(summarize(tmp_path / "telemetry"))  # what `coci report` prints
    assert "remote tier: 2 checkpoints uploaded, newest step 1" in report
    assert re.search(r"\d+ failed attempts?, the last at step 1", report)


def test_a_torn_remote_upload_is_invisible_and_cleaned_by_the_next_run(tmp_path: Path) -> None:
    """Data files uploaded without their manifest (a process killed mid-upload) are not a
    step for any reader, and the next manager with that remote removes them."""
    remote = tmp_path / "remote"
    torn = remote / f"{step_dir_name(5)}.coci-tmp-deadbeefup-5"
    torn.mkdir(parents=True)
    (torn / "data-r0.bin").write_bytes(b"\0" * 1024)
    assert newest_first(LocalStorage(remote)) == []  # no reader sees a step
    with CheckpointManager(tmp_path / "local", remote=remote) as mgr:
        mgr.save(1, _state(1), block=True).wait()
    assert not torn.exists()
    assert (remote / step_dir_name(1) / MANIFEST_NAME).exists()
    assert not [n for n in LocalStorage(remote).list_dir("") if n.startswith(step_dir_name(5))]


def test_remote_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'remote_keep_last'"):
        CheckpointManager(tmp_path, remote=tmp_path / "r", remote_keep_last=0)


def test_every_kth_save_goes_remote_and_the_last_one_at_close(tmp_path: Path) -> None:
    """remote_upload_every=3 (a two-level plan's period): steps 3 and 6 are uploaded as they
    commit, and step 7, the newest, when the manager closes."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(
        local, remote=remote, keep_last=None, remote_keep_last=None, remote_upload_every=3
    ) as mgr:
        assert mgr.remote is not None
        for step in range(1, 8):
            mgr.save(step, _state(step), block=True).wait()
            assert mgr.remote.flush(timeout_s=60)
        assert _steps(remote) == [3, 6]
    assert _steps(remote) == [3, 6, 7]
    with pytest.raises(ConfigError, match="'remote_upload_every'"):
        CheckpointManager(tmp_path / "x", remote=remote, remote_upload_every=0)


class _HeldUploads(LocalStorage):
    """A remote tier whose data uploads wait until the test lets them finish."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.started = threading.Event()
        self.release = threading.Event()

    def write_file(self, path: str, chunks: Any, *, aligned: bool = False) -> int:
        if path.endswith(".bin"):
            self.started.set()
            assert self.release.wait(60)
        return super().write_file(path, chunks, aligned=aligned)


def test_a_step_kept_also_is_not_superseded_by_a_newer_upload(tmp_path: Path) -> None:
    """Saves that come faster than uploads: a newer step replaced the kept step's pending
    upload, and the remote never had it. It is uploaded after the newer one."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(local, remote=remote) as mgr:
        assert mgr.remote is not None
        held = mgr.remote.remote = _HeldUploads(remote)
        mgr.save(1, _state(1)).wait()
        assert held.started.wait(60)  # step 1's upload is being written
        mgr.keep_also({2})
        mgr.save(2, _state(2)).wait()
        mgr.save(3, _state(3)).wait()  # replaces step 2's pending upload
        held.release.set()
        assert mgr.remote.flush(timeout_s=60)
        assert _steps(remote) == [1, 2, 3]
    with CheckpointManager(remote) as reader:
        assert _equal(reader.restore(step=2), _state(2))


def _kept_while_uploading(mgr: CheckpointManager) -> list[int]:
    """``keep_also({2, 3, 4})``, then steps 2 to 5 saved while step 1 uploads (each kept
    step replaced in the pending upload by the next save): the steps on the remote after."""
    assert mgr.remote is not None
    remote = mgr.remote.remote.local_root()
    assert remote is not None
    held = mgr.remote.remote = _HeldUploads(Path(remote))
    mgr.keep_also({2, 3, 4})
    mgr.save(1, _state(1)).wait()
    assert held.started.wait(60)  # step 1's upload is being written
    for step in (2, 3, 4, 5):
        mgr.save(step, _state(step)).wait()
    held.release.set()
    assert mgr.remote.flush(timeout_s=60)
    return _steps(Path(remote))


def test_kept_steps_saved_faster_than_uploads_all_reach_the_remote(tmp_path: Path) -> None:
    """Three steps kept also (``keep_also({2, 3, 4})``), each replaced in the upload's one
    pending place by the next save while step 1 uploads: one place held the kept step a newer
    save replaced, so steps 2 and 3 never reached the remote (only 1, 4, 5 did). Every kept
    step waits its turn, and uploads after the newer one."""
    remote = tmp_path / "remote"
    with CheckpointManager(tmp_path / "local", remote=remote, keep_last=None) as mgr:
        assert _kept_while_uploading(mgr) == [1, 2, 3, 4, 5]
        assert mgr.remote is not None and mgr.remote.not_uploaded == []
    with CheckpointManager(remote) as reader:
        assert all(_equal(reader.restore(step=s), _state(s)) for s in (2, 3, 4))


def test_kept_steps_given_after_the_period_passed_them_all_reach_the_remote(
    tmp_path: Path,
) -> None:
    """``keep_also({1, 2, 3})`` after ``remote_upload_every=5`` passed over steps 1 to 4:
    two places (the pending upload and one kept step) took steps 3 and 2, and step 1 waited
    for a later ``keep_also`` that never came: the remote never had it. All three are
    uploaded."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(
        local, remote=remote, keep_last=None, remote_keep_last=None, remote_upload_every=5
    ) as mgr:
        assert mgr.remote is not None
        for step in (1, 2, 3, 4):
            mgr.save(step, _state(step), block=True).wait()
        mgr.keep_also({1, 2, 3})
        assert mgr.remote.flush(timeout_s=60)
        assert _steps(remote) == [1, 2, 3]
    assert _steps(remote) == [1, 2, 3, 4]  # the newest at close, as before


def test_a_kept_step_dropped_from_a_full_upload_queue_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More kept steps wait for the remote than it holds places for (2 here): the oldest is
    left out of the remote tier, and a WARNING names it, the remote and where it stays."""
    import coci_core.engine.directory.tiers as tiers

    monkeypatch.setattr(tiers, "UPLOAD_KEPT_WAITING", 2)
    local, remote = tmp_path / "local", tmp_path / "remote"
    with (
        CheckpointManager(local, remote=remote, keep_last=None) as mgr,
        caplog.at_level(logging.WARNING, logger="coci_core.engine.directory.tiers"),
    ):
        assert _kept_while_uploading(mgr) == [1, 3, 4, 5]  # 2, 3 and 4 waited behind 5
    said = [r.getMessage() for r in caplog.records if "kept step" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert f"step 2 is not uploaded to {LocalStorage(remote).url}" in said[0]
    assert f"stays in {LocalStorage(local).url}" in said[0]


def test_close_that_gives_up_on_an_upload_keeps_the_remote_until_the_upload_ends(
    tmp_path: Path,
) -> None:
    """close() stops waiting for an upload after its timeout, but the remote's owner record
    stays held while that upload may still write; the upload thread gives it up when it ends,
    and the step it was writing is then committed whole on the remote."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    mgr = CheckpointManager(local, remote=remote)
    assert mgr.remote is not None
    held = mgr.remote.remote = _HeldUploads(remote)
    mgr.save(1, _state(1)).wait()
    assert held.started.wait(60)
    thread = mgr.remote._thread
    mgr.remote.close(timeout_s=0.0)
    with pytest.raises(DirectoryInUseError):  # still held: the upload goes on
        acquire_lease(LocalStorage(remote), "another")
    held.release.set()
    assert thread is not None
    thread.join(60)
    assert not thread.is_alive()
    acquire_lease(LocalStorage(remote), "another").release()  # given up when it ended
    mgr.close()
    assert _steps(remote) == [1]
    with CheckpointManager(remote) as reader:
        assert _equal(reader.restore(), _state(1))


def test_close_gives_up_on_a_remote_that_keeps_failing_and_names_the_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A remote that refuses every write: close() makes one last attempt instead of retrying
    until its timeout (600 s), logs an error naming the steps not uploaded and the remote,
    and the local steps stay committed."""
    caplog.set_level(logging.ERROR, logger="coci_core")
    refusing = FaultyStorage(
        LocalStorage(tmp_path / "remote"),
        fail={"write_file": range(10_000)},
        error=PermissionError(errno.EACCES, "Permission denied"),
    )
    failed = threading.Event()

    def listen(event: Event) -> None:
        if isinstance(event, UploadEvent) and event.outcome == "failed":
            failed.set()

    mgr = CheckpointManager(tmp_path / "local", remote=refusing, listeners=[listen])
    assert mgr.remote is not None
    for step in (1, 2):
        mgr.save(step, _state(step), block=True).wait()
    assert failed.wait(timeout=60)
    closer = threading.Thread(target=mgr.close)
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive(), "close() kept retrying an upload that cannot succeed"
    assert mgr.remote.not_uploaded == [1, 2]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(
        "1, 2" in m and "were not uploaded" in m and refusing.url in m and "Permission denied" in m
        for m in errors
    ), errors
    assert _steps(tmp_path / "local") == [1, 2]
    assert _steps(tmp_path / "remote") == []


def test_close_names_the_steps_a_remote_owned_by_another_writer_never_got(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two managers of one process given one remote tier (two runs of a sweep with the same
    remote): the second is refused the remote at its first save (a warning), and its close()
    names in one error line the steps that stay on its local disk alone (before: nothing was
    said at the end, as if every step had reached the remote)."""
    remote = tmp_path / "remote"
    with CheckpointManager(tmp_path / "a", remote=remote) as first:
        first.save(1, _state(1)).wait()
        second = CheckpointManager(tmp_path / "b", remote=remote, keep_last=None)
        for step in (2, 3):
            second.save(step, _state(step)).wait()
        assert second.remote is not None and not second.remote.writable
        caplog.set_level(logging.ERROR, logger="coci_core")
        second.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(
        "step(s) 2, 3 were not uploaded" in m and str(remote) in m and "close() it first" in m
        for m in errors
    ), errors
    assert _steps(tmp_path / "b") == [2, 3]
    assert _steps(remote) == [1]


def test_close_does_not_say_steps_retention_removed_stay_on_the_local_disk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The second manager refused the remote keeps two steps locally (``keep_last=2``): its
    close() names steps 4 and 5 as staying on its disk, and steps 1 to 3 as removed by its
    retention, in neither tier (before: "step(s) 1, 2, 3, 4, 5 were not uploaded, they stay
    committed in" its directory, which held only 4 and 5)."""
    remote = tmp_path / "remote"
    with CheckpointManager(tmp_path / "a", remote=remote) as first:
        first.save(1, _state(1)).wait()
        second = CheckpointManager(tmp_path / "b", remote=remote, keep_last=2)
        for step in range(1, 6):
            second.save(step, _state(step)).wait()
        caplog.set_level(logging.ERROR, logger="coci_core")
        second.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert _steps(tmp_path / "b") == [4, 5]
    assert any(
        "step(s) 4, 5 were not uploaded, they stay committed in" in m
        and "step(s) 1, 2, 3 were removed" in m
        and "in neither" in m
        for m in errors
    ), errors
