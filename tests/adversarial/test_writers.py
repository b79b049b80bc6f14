"""Two of everything at once: threads, managers and processes on one directory."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import signal
import textwrap
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from coci_core import (
    BackgroundSaveError,
    CheckpointManager,
    DirectoryInUseError,
    LocalStorage,
    RankGroup,
    StepExistsError,
    StorageError,
)
from coci_core.engine.format.manifest import step_dir_name
from coci_core.training.checkpointer import Checkpointer
from tests.harness.faults import FaultyStorage, HeldStorage
from tests.harness.processes import Child, run, script


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 256, generator=g), "b": torch.full((300,), float(step))}


def _assert_every_step_exact(directory: Path) -> list[int]:
    with CheckpointManager(directory, keep_last=None) as reader:
        steps = reader.steps()
        for step in steps:
            restored = reader.restore(step=step)
            expected = _state(step)
            for key, value in expected.items():
                assert torch.equal(restored[key], value), f"step {step} restored other values"
            assert reader.verify(step) == {step: []}
    return steps


@pytest.mark.parametrize(
    ("compression", "block"), [("none", True), ("lossless", False)], ids=["raw", "lossless-nb"]
)
def test_two_threads_saving_on_one_manager(tmp_path: Path, compression: str, block: bool) -> None:
    """50 saves from two threads: every committed step restores its own values exactly."""
    errors: list[BaseException] = []
    with CheckpointManager(tmp_path, keep_last=None, compression=compression) as mgr:

        def saver(steps: range) -> None:
            try:
                for step in steps:
                    mgr.save(step, _state(step), block=block)
                    mgr.before_update()
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=saver, args=(range(first, 50, 2),)) for first in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        mgr.wait()
    assert errors == []
    assert _assert_every_step_exact(tmp_path) == list(range(50))


def test_second_manager_in_process_cannot_write(tmp_path: Path) -> None:
    """A second manager may restore while the first writes, but its save is refused with an
    error naming the directory; once the first is closed it may write."""
    first = CheckpointManager(tmp_path)
    first.save(1, _state(1)).wait()
    second = CheckpointManager(tmp_path)
    assert torch.equal(second.restore()["w"], _state(1)["w"])
    with pytest.raises(DirectoryInUseError, match="close\\(\\) it first"):
        second.save(2, _state(2))
    first.close()
    second.save(2, _state(2)).wait()
    second.close()
    assert _assert_every_step_exact(tmp_path) == [1, 2]


def test_a_second_job_continuing_the_first_is_told_the_directory_is_in_use(
    tmp_path: Path,
) -> None:
    """A second job started with the README's loop while the first still runs restores the
    first's newest step, goes on, and reaches a step that the first saved meanwhile: its save
    says the directory is in use (it used to say "this run's checkpoint of step 3 exists")."""
    with CheckpointManager(tmp_path) as first:
        first.save(2, _state(2)).wait()
        second = CheckpointManager(tmp_path)
        assert torch.equal(second.restore()["w"], _state(2)["w"])  # it goes on from step 2
        first.save(3, _state(3)).wait()  # and so does the first job, meanwhile
        with pytest.raises(DirectoryInUseError, match="close\\(\\) it first"):
            second.save(3, _state(3))
        second.close()
    with CheckpointManager(tmp_path) as after:  # the first job's steps are intact
        assert after.steps() == [2, 3]
        assert torch.equal(after.restore()["w"], _state(3)["w"])


_TRAINING_RUN = textwrap.dedent(
    """
    import sys, torch
    from coci_core import CheckpointManager
    def state(step):
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(64, 256, generator=g), "b": torch.full((300,), float(step))}
    with CheckpointManager(sys.argv[1]) as mgr:
        for step in (2, 3):
            mgr.save(step, state(step)).wait()
    print("SAVED", flush=True)
    """
)


def test_a_manager_that_only_restores_never_refuses_a_writer(tmp_path: Path) -> None:
    """An evaluation process keeps a manager open to restore the newest checkpoint, from
    before a training run (re)starts in the directory: the run's saves commit, and so do
    those of a second manager of the evaluating process once that run is done, with a remote
    tier too (the reader used to take the directory's lease, and the remote's, when it was
    made: the run failed at its first save, told that the reader "is writing", and a writer
    beside it in one process uploaded nothing)."""
    local, remote = tmp_path / "run", tmp_path / "remote"
    with CheckpointManager(local) as first:
        first.save(1, _state(1)).wait()
    reader = CheckpointManager(local, remote=remote)
    assert torch.equal(reader.restore()["w"], _state(1)["w"])
    proc = run(script(_TRAINING_RUN, str(local)))
    assert proc.returncode == 0 and "SAVED" in proc.stdout, proc.stderr[-2000:]
    assert torch.equal(reader.restore()["w"], _state(3)["w"])
    with CheckpointManager(local, remote=remote) as writer:
        writer.save(4, _state(4)).wait()
        assert writer.remote is not None and writer.remote.flush(timeout_s=60)
    assert _assert_every_step_exact(remote) == [4]
    reader.close()
    assert _assert_every_step_exact(local) == [1, 2, 3, 4]


_CONTINUING_RUN = textwrap.dedent(
    """
    import sys, torch
    from coci_core import CheckpointManager
    def state(step):
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(64, 256, generator=g), "b": torch.full((300,), float(step))}
    with CheckpointManager(sys.argv[1], keep_last=None) as mgr:
        mgr.restore()
        assert mgr.claim() is None
        print("HOLDING", flush=True)
        sys.stdin.readline()  # its last steps, then its final save
        step = int(sys.argv[2])
        mgr.save(step, state(step)).wait()
    print("SAVED", flush=True)
    """
)


def test_a_run_continued_by_two_processes_is_told_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A script started again while the first one still wrote its final save resumes from the
    checkpoint before it and reaches that step: its save says that another writer committed
    the step after its restore (before: "already holds this run's checkpoint", as if it had
    saved it itself); the Checkpointer an adapter uses replaces it, with a warning (before:
    without a word). A re-save of a step it saved itself says what it said before."""
    with CheckpointManager(tmp_path) as first:
        for step in (1, 2):
            first.save(step, _state(step)).wait()
    second = CheckpointManager(tmp_path, keep_last=None)
    assert torch.equal(second.restore()["w"], _state(2)["w"])
    proc = run(script(_CONTINUING_RUN, str(tmp_path), "3"), input="\n")  # the first job
    assert proc.returncode == 0 and "SAVED" in proc.stdout, proc.stderr[-2000:]
    with pytest.raises(StepExistsError, match="by another writer after this manager restored"):
        second.save(3, _state(3))
    second.save(4, _state(4)).wait()
    with pytest.raises(StepExistsError, match="already holds this run's checkpoint") as caught:
        second.save(4, _state(4))
    assert not caught.value.elsewhere
    second.close()
    with Child(script(_CONTINUING_RUN, str(tmp_path), "5")) as first_job:
        assert first_job.readline().strip() == "HOLDING"
        checkpointer = Checkpointer(tmp_path, keep_last=None)  # warned: the directory is held
        checkpointer.restore()  # step 4, while the first job still trains to its step 5
        first_job.send("\n")
        assert first_job.readline().strip() == "SAVED" and first_job.wait(60) == 0
    with caplog.at_level(logging.WARNING, logger="coci_core"):
        checkpointer.save(5, _state(5)).wait()
    assert "committed by another writer after this manager restored step 4" in caplog.text
    checkpointer.close()
    assert _assert_every_step_exact(tmp_path) == [1, 2, 3, 4, 5]


_TRAINING_PROCESS = textwrap.dedent(
    """
    import sys, torch
    from coci_core import CheckpointManager
    with CheckpointManager(sys.argv[1], keep_last=None) as mgr:
        mgr.save(1, {"w": torch.ones(4)}).wait()
        print("SAVED", flush=True)
        sys.stdin.readline()  # trains on until the test says it is done
    """
)


def test_a_training_run_holds_its_directory_from_its_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A training run (the adapters' Checkpointer) started while another process writes to its
    directory is warned at its start, naming that process (before: it was told only at its
    first save, which a plan may put many minutes on); a run that started first holds the
    directory before it saves, so a manager that saves there later is the one refused."""
    with Child(script(_TRAINING_PROCESS, str(tmp_path))) as other:
        assert other.readline().strip() == "SAVED"
        with caplog.at_level(logging.WARNING, logger="coci_core"):
            late = Checkpointer(tmp_path, keep_last=None)
        assert f"(process {other.pid} on" in caplog.text
        assert "this run's saves are refused while it does" in caplog.text
        with pytest.raises(DirectoryInUseError, match=f"process {other.pid}"):
            late.save(2, _state(2))
        late.close()
        other.send("done\n")
        assert other.wait(60) == 0
    first = Checkpointer(tmp_path, keep_last=None)  # holds the directory before its first save
    later = CheckpointManager(tmp_path)
    with pytest.raises(DirectoryInUseError, match="close\\(\\) it first"):
        later.save(3, _state(3))
    later.close()
    first.save(3, _state(3)).wait()
    first.close()
    assert CheckpointManager(tmp_path).steps() == [1, 3]


def test_second_manager_never_removes_a_live_save(tmp_path: Path) -> None:
    """A manager opened while another is mid-save leaves its staging alone: the save commits
    with all its data (before the lease, it deleted the staging and a manifest-only step was
    published)."""
    held = HeldStorage(LocalStorage(tmp_path))
    with CheckpointManager(held, keep_last=None) as writer:
        handle = writer.save(7, _state(7))
        assert held.entered.wait(30)
        staging = [n for n in os.listdir(tmp_path) if ".coci-tmp-" in n]
        CheckpointManager(tmp_path).close()  # a second manager starts and ends meanwhile
        assert [n for n in os.listdir(tmp_path) if ".coci-tmp-" in n] == staging
        held.release.set()
        handle.wait()
    assert _assert_every_step_exact(tmp_path) == [7]


class _RemovesStaging(FaultyStorage):
    """Someone (not coci) removes the staging directory right after the data file is written."""

    def __init__(self, inner: LocalStorage) -> None:
        super().__init__(inner, fail={})
        self.armed = False

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        n = self.inner.write_file(path, chunks, aligned=aligned)
        if self.armed and path.endswith(".bin"):
            shutil.rmtree(Path(self.inner.url) / path.split("/")[0])
        return n


def test_directory_removed_during_save_publishes_nothing(tmp_path: Path) -> None:
    """The staging directory removed under a save: the save fails and no manifest-only step
    is published (the manifest write used to recreate the directory)."""
    storage = _RemovesStaging(LocalStorage(tmp_path))
    with CheckpointManager(storage, keep_last=None) as writer:
        writer.save(1, _state(1)).wait()
        storage.armed = True
        handle = writer.save(2, _state(2))
        with pytest.raises(BackgroundSaveError) as info:
            handle.wait()
        assert isinstance(info.value.__cause__, StorageError)
    assert not (tmp_path / step_dir_name(2)).exists()
    assert _assert_every_step_exact(tmp_path) == [1]


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from coci_core import CheckpointManager, DirectoryInUseError
    directory, first, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    def state(step):
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(64, 256, generator=g), "b": torch.full((300,), float(step))}
    mgr = CheckpointManager(directory, keep_last=None)
    print("READY", flush=True)
    sys.stdin.readline()  # both writers start saving together
    committed, refused = [], 0
    for step in range(first, first + 20, 2):
        try:
            mgr.save(step, state(step)).wait()
            committed.append(step)
        except DirectoryInUseError:
            refused += 1
    print("RESULT", committed, refused, flush=True)
    mgr.close()
    """
)


def test_two_writer_processes_and_a_reader(tmp_path: Path) -> None:
    """Two processes saving to one directory while a third restores: exactly one writes, the
    other is refused on every save, and every committed step (seen by the reader while they
    run, and afterwards) restores exactly."""
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(Child(script(_WRITER, str(tmp_path), str(first), "go")))
            for first in (0, 1)
        ]
        for p in procs:
            assert p.readline().strip() == "READY"
        for p in procs:
            p.send("go\n")
        seen: set[int] = set()
        while any(p.poll() is None for p in procs):
            seen.update(_assert_every_step_exact(tmp_path))
        outputs = [p.communicate(timeout_s=120)[0] for p in procs]
        assert all(p.wait() == 0 for p in procs), outputs
    results = [
        line.split(" ", 1)[1]
        for out in outputs
        for line in out.splitlines()
        if line.startswith("RESULT")
    ]
    committed = [eval(r.rsplit(" ", 1)[0]) for r in results]
    refused = [int(r.rsplit(" ", 1)[1]) for r in results]
    assert sorted(refused) == [0, 10]  # one process wrote everything, the other nothing
    steps = _assert_every_step_exact(tmp_path)
    assert steps == sorted(committed[0] + committed[1])
    assert seen <= set(steps)


def test_lease_is_released_by_a_killed_process(tmp_path: Path) -> None:
    """A writer killed with SIGKILL leaves no lease behind: the next manager writes."""
    code = textwrap.dedent(
        f"""
        import os, signal, torch
        from coci_core import CheckpointManager
        mgr = CheckpointManager({str(tmp_path)!r})
        mgr.save(1, {{"w": torch.ones(4)}}).wait()
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = run(script(code))
    assert proc.returncode == -9
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(2, {"w": torch.zeros(4)}).wait()
        assert mgr.steps() == [1, 2]


def test_a_forked_child_that_outlives_a_killed_writer_holds_no_lease(tmp_path: Path) -> None:
    """A writer forks a child (as a data loader forks its workers), then is killed: while the
    child lives on, the next writer may write (the child used to hold the lock it inherited),
    and the child, which holds no lease of its parent's, may not write there meanwhile."""
    code = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        from coci_core import CheckpointManager, DirectoryInUseError
        mgr = CheckpointManager({str(tmp_path)!r})
        mgr.save(1, {{"w": torch.ones(4)}}).wait()
        if os.fork() == 0:
            print("CHILD", os.getpid(), flush=True)
            sys.stdin.readline()  # the next writer holds the directory now
            try:
                CheckpointManager({str(tmp_path)!r}).save(5, {{"w": torch.ones(4)}}).wait()
                print("CHILD WROTE", flush=True)
            except DirectoryInUseError:
                print("CHILD REFUSED", flush=True)
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    with Child(script(code)) as writer:
        word, pid = writer.readline().split()
        assert word == "CHILD"
        assert writer.wait(timeout_s=60) == -9
        try:
            with CheckpointManager(tmp_path) as mgr:
                mgr.save(2, {"w": torch.zeros(4)}).wait()
                writer.send("go\n")
                assert writer.readline().strip() == "CHILD REFUSED"
                assert mgr.steps() == [1, 2]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_unclosed_managers_are_freed(tmp_path: Path) -> None:
    """Managers dropped without close() free their writer thread, memory and lease (the
    thread used to hold its manager for ever: ten managers, ten threads and arenas)."""
    refs = []
    threads_before = threading.active_count()
    for i in range(10):
        mgr = CheckpointManager(tmp_path / "run", keep_last=1)
        mgr.save(i, {"w": torch.full((1 << 20,), float(i))}).wait()
        refs.append(weakref.ref(mgr))
        writer = next(t for t in threading.enumerate() if t.name == "coci-persist")
        del mgr
        # The writer thread ends by itself once its last job is done and nothing else holds
        # the manager: joining it is the synchronisation.
        gc.collect()
        writer.join(timeout=60)
        assert not writer.is_alive()
        assert refs[-1]() is None
    assert threading.active_count() == threads_before
    with CheckpointManager(tmp_path / "run") as mgr:  # the lease was given back
        mgr.save(10, {"w": torch.ones(4)}).wait()


def test_read_only_directory_restores(tmp_path: Path) -> None:
    """A manager on a directory it cannot write (an evaluation job on a read-only mount) still
    restores; its save() fails with a clear StorageError."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(1)).wait()
    (tmp_path / ".coci-owner").unlink()
    tmp_path.chmod(0o555)
    try:
        if os.access(tmp_path, os.W_OK):  # root writes anyway: make the lease file a directory
            tmp_path.chmod(0o755)
            (tmp_path / ".coci-owner").mkdir()
        with CheckpointManager(tmp_path) as reader:
            assert torch.equal(reader.restore()["w"], _state(1)["w"])
            with pytest.raises(StorageError, match="lease"):
                reader.save(2, _state(2))
    finally:
        tmp_path.chmod(0o755)


class _CountingAborts(LocalStorage):
    """A local directory that counts the calls to abort the uploads left open."""

    aborts = 0

    def abort_uploads(self) -> int:
        type(self).aborts += 1
        return 0


def test_the_first_save_of_several_ranks_aborts_no_upload(tmp_path: Path) -> None:
    """Rank 0 takes the lease at the first save, once the other ranks may have begun
    uploading their shares of it: it aborts no open upload then (on S3 it cut theirs, and the
    save failed with NoSuchUpload); a manager of one rank, or a claim at the start of training,
    still aborts what a killed writer left open."""
    state = {"w": torch.arange(8.0)}
    ranks = [
        CheckpointManager(_CountingAborts(tmp_path / "two"), group=RankGroup(r, 2, "ab"))
        for r in (1, 0)
    ]
    try:
        handles = [mgr.save(1, state) for mgr in ranks]
        for handle in handles:
            handle.wait()
        assert _CountingAborts.aborts == 0
    finally:
        for mgr in ranks:
            mgr.close()
    with CheckpointManager(_CountingAborts(tmp_path / "one")) as alone:
        alone.save(1, state).wait()
    assert _CountingAborts.aborts == 1
    with CheckpointManager(_CountingAborts(tmp_path / "two"), group=RankGroup(0, 2, "c")) as mgr:
        assert mgr.claim() is None
    assert _CountingAborts.aborts == 2
