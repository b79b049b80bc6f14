"""A ``block=False`` save stores the state as it was when ``save()`` was called, even when the
loop does not call ``before_update()``: torch optimizers wait for the copy by themselves, small
tensors (BatchNorm's statistics) are copied by ``save()`` itself, and a tensor changed in place
before the copy read it fails that save instead of being stored with newer values."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from coci_core import CheckpointManager, SaveHandle
from coci_core.engine.format.tree import flatten_state
from coci_core.engine.save.snapshot import SMALL_COPY_BYTES, Snapshotter
from coci_core.errors import BackgroundSaveError, StateChangedError
from coci_core.storage import LocalStorage
from coci_core.training import Checkpointer
from tests.harness.held_writer import HeldWriter


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_optimizer_step_right_after_the_save_waits_for_the_copy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 512)  # 2 MiB of weights: copied in the background
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(8, 1024)
    with CheckpointManager(tmp_path / "c", compression="none") as mgr:
        for step in range(1, 6):
            model(x).square().mean().backward()
            opt.step()  # no before_update() anywhere in this loop
            opt.zero_grad()
            expected = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
            mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, block=False)
            model(x).square().mean().backward()
            opt.step()  # changes every tensor just saved
            opt.zero_grad()
            mgr.wait()
            got = mgr.restore(step)
            assert _equal(got["model"], expected["model"])
            for k, v in expected["optim"]["state"].items():
                assert _equal(got["optim"]["state"][k], v)


def test_batchnorm_statistics_are_saved_as_they_were(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 4096), torch.nn.BatchNorm1d(4096), torch.nn.Linear(4096, 8)
    )
    stats = {k: v for k, v in model.state_dict().items() if "running" in k or "tracked" in k}
    assert all(v.numel() * v.element_size() <= SMALL_COPY_BYTES for v in stats.values())
    x = torch.randn(16, 64)
    with CheckpointManager(tmp_path / "c", compression="none") as mgr:
        for step in range(1, 6):
            model(x)  # a training forward pass: the running statistics move
            expected = copy.deepcopy(model.state_dict())
            mgr.save(step, {"model": model.state_dict()}, block=False)
            model(x)  # the next forward pass, before the copy could be finished
            mgr.wait()
            restored = mgr.restore(step)["model"]
            assert _equal(restored, expected)
            assert not torch.equal(restored["1.running_mean"], model.get_buffer("1.running_mean"))


def test_a_change_before_the_copy_read_it_fails_the_save_not_silently() -> None:
    big = torch.randn(1 << 16)  # 256 KiB: not one of the small tensors save() copies itself
    small = torch.zeros(4)
    flat = flatten_state({"big": big, "small": small})
    snapshotter = Snapshotter()
    snap = snapshotter.prepare(flat.leaves)
    snapshotter.copy_small(snap)
    big.add_(1.0)  # before the background copy
    small.add_(1.0)  # after its copy by save(): the saved value is the old one
    snapshotter.copy(snap, background=True)
    with pytest.raises(StateChangedError, match=r"\['/big'\] changed while"):
        snap.wait_copied()


class HeldDeletes(LocalStorage):
    """Local storage whose next removal of a step (retention, on the writer thread) waits
    until the test lets it go: the writer is busy while the test changes the state."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.hold = False
        self.holding = threading.Event()
        self.release = threading.Event()

    def retire(self, final: str) -> None:
        if self.hold:
            self.hold = False
            self.holding.set()
            assert self.release.wait(120), "the test never let the removal go"
        super().retire(final)


def test_a_tensor_changed_before_the_copy_gives_the_save_up_and_is_copied_by_save_next(
    tmp_path: Path,
) -> None:
    big = torch.zeros(1 << 20)  # 4 MiB: copied in the background
    storage = HeldDeletes(tmp_path / "c")
    with CheckpointManager(storage, compression="none", keep_last=1) as mgr:
        mgr.save(1, {"big": big}).wait()
        storage.hold = True
        mgr.save(2, {"big": big}).wait()  # its retention (removing step 1) is held
        assert storage.holding.wait(60)
        handle = mgr.save(3, {"big": big}, block=False)  # queued behind the removal
        big.add_(1.0)  # before the copy: a forward pass updating a large buffer, say
        storage.release.set()
        with pytest.raises(BackgroundSaveError) as failed:
            handle.wait()
        assert isinstance(failed.value.__cause__, StateChangedError)
        assert failed.value.__cause__.keys == ["/big"]
        assert handle.event is not None and handle.event.outcome == "failed"
        mgr.wait()  # given up, not an error of the loop's: the next save does not raise
        assert 3 not in mgr.steps()
        # from now on save() copies it itself: a change right after the call is not saved
        before = big.clone()
        mgr.save(4, {"big": big}, block=False)
        big.add_(1.0)
        mgr.wait()
        assert torch.equal(mgr.restore(4)["big"], before)


def test_the_checkpointer_without_before_update_resumes_exactly(tmp_path: Path) -> None:
    """The loop a user writes with the framework-agnostic Checkpointer, opting in to
    block=False, and no before_update(): the resumed run ends with the same weights."""

    def run(directory: Path, stop_at: int | None) -> torch.nn.Linear:
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        ckpt = Checkpointer(directory, policy="every_n_steps", every_n_steps=4, block=False)
        start = 0
        if ckpt.latest_step() is not None:
            ckpt.restore(into={"model": model, "optim": opt})
            start = int(ckpt.resumed_from or 0)
        g = torch.Generator().manual_seed(1)
        batches = [torch.randn(16, 256, generator=g) for _ in range(32)]
        for k in range(start + 1, 33):
            model(batches[k - 1]).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.observe(k)
            if ckpt.should_save(k):
                ckpt.save(k, {"model": model.state_dict(), "optim": opt.state_dict()})
            if k == stop_at:
                break
        ckpt.close()
        return model

    whole = run(tmp_path / "whole", None)
    run(tmp_path / "cut", 22)  # the last save is step 20; steps 21 and 22 are lost
    resumed = run(tmp_path / "cut", None)
    assert _equal(resumed.state_dict(), whole.state_dict())


def _held_manager(storage: HeldWriter) -> CheckpointManager:
    """A manager whose writer is busy removing step 1 (held) when the caller saves next."""
    mgr = CheckpointManager(storage, compression="none", keep_last=1)
    mgr.save(1, {"other": torch.zeros(4)})
    storage.hold_next_removal()
    mgr.save(2, {"other": torch.zeros(4)}).wait()  # its retention removes step 1: held
    assert storage.holding.wait(60)
    return mgr


def test_a_version_bump_after_the_copy_ended_still_gives_the_save_up(tmp_path: Path) -> None:
    """An in-place torch op writes its tensor, then bumps its version counter (autograd's
    ADInplaceOrView kernel): an op still running when the background copy ends is seen only
    by a check after it returned, on the training thread. Here the op's two halves are taken
    apart: the write (through ``.data``, which bumps nothing), the copy, then the bump."""
    big = torch.zeros(1 << 20)  # 4 MiB: copied in the background
    storage = HeldWriter(tmp_path / "c")
    with _held_manager(storage) as mgr:
        handle = mgr.save(3, {"big": big}, block=False)  # its copy waits behind the removal
        big.data.fill_(1.0)  # the kernel's writes
        storage.release.set()
        assert storage.data_written.wait(60)  # the copy has ended
        torch.autograd.graph.increment_version(big)  # the op returns: its bump comes now
        with pytest.raises(BackgroundSaveError) as failed:
            handle.wait()
        assert isinstance(failed.value.__cause__, StateChangedError)
        assert failed.value.__cause__.keys == ["/big"]
        assert 3 not in mgr.steps()


def test_numpy_arrays_are_copied_by_save_itself(tmp_path: Path) -> None:
    """A write to a numpy array moves no version counter: a block=False save copies numpy
    arrays before it returns, so ``arr += 1`` right after it is not saved."""
    arr = np.arange(1 << 18, dtype=np.float64)  # 2 MiB: not one of the small tensors
    before = arr.copy()
    storage = HeldWriter(tmp_path / "c")
    with _held_manager(storage) as mgr:
        handle = mgr.save(3, {"arr": arr, "big": torch.zeros(1 << 18)}, block=False)
        arr += 1  # before the background copy (held) of the rest
        storage.release.set()
        handle.wait()
        restored = mgr.restore(3)["arr"]
    assert isinstance(restored, np.ndarray)
    np.testing.assert_array_equal(restored, before)


def test_a_save_whose_thread_ended_is_checked_by_the_writer(tmp_path: Path) -> None:
    """The commit of a block=False save waits for the saving thread to check the copy; a
    thread that saved and ended is not waited for."""
    big = torch.zeros(1 << 20)
    handles: list[SaveHandle] = []
    with CheckpointManager(tmp_path / "c", compression="none") as mgr:
        saver = threading.Thread(
            target=lambda: handles.append(mgr.save(1, {"big": big}, block=False))
        )
        saver.start()
        saver.join()
        assert handles[0].wait_done(60)  # not wait(): the writer must commit by itself
        assert handles[0].event is not None and handles[0].event.outcome == "committed"
        assert torch.equal(mgr.restore(1)["big"], big)


def test_another_threads_wait_does_not_check_the_copy(tmp_path: Path) -> None:
    """Only the thread that saved can know that none of its in-place writes is still running:
    a wait from another thread waits for that thread's check (its next optimizer step here)."""
    model = torch.nn.Linear(512, 512)  # 1 MiB of weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 512)).sum().backward()
    with CheckpointManager(tmp_path / "c", compression="none") as mgr:
        expected = copy.deepcopy(model.state_dict())
        handle = mgr.save(1, {"model": model.state_dict()}, block=False)
        waiter = threading.Thread(target=handle.wait)
        waiter.start()
        waiter.join(0.2)  # bounded: it must still be waiting (no commit before the check)
        assert waiter.is_alive() and not handle.done()
        opt.step()  # the pre-hook checks the copy on this, the saving, thread
        waiter.join(60)
        assert not waiter.is_alive()
        assert handle.event is not None and handle.event.outcome == "committed"
        assert _equal(mgr.restore(1)["model"], expected)


def test_close_from_another_thread_checks_the_copy_itself(tmp_path: Path) -> None:
    """close() comes after training: it checks a pending copy from any thread, so it does not
    wait for a saving thread that is alive but will not come back (a pool's worker, say)."""
    big = torch.zeros(1 << 20)
    saved, finish = threading.Event(), threading.Event()
    mgr = CheckpointManager(tmp_path / "c", compression="none")

    def saver() -> None:
        mgr.save(1, {"big": big}, block=False)
        saved.set()
        assert finish.wait(60)

    thread = threading.Thread(target=saver)
    thread.start()
    assert saved.wait(60)
    mgr.close()  # the saver is alive and idle
    finish.set()
    thread.join()
    with CheckpointManager(tmp_path / "c") as reader:
        assert torch.equal(reader.restore(1)["big"], big)


def test_done_polled_on_the_saving_thread_turns_true_by_itself(tmp_path: Path) -> None:
    """A loop that polls ``handle.done()`` on the thread that saved (and calls nothing else of
    coci) sees a block=False save finish: done() checks the finished copy there."""
    big = torch.zeros(1 << 20)
    with CheckpointManager(tmp_path / "c", compression="none") as mgr:
        handle = mgr.save(1, {"big": big}, block=False)
        deadline = time.monotonic() + 60
        while not handle.done() and time.monotonic() < deadline:
            handle.wait_done(0.01)  # not wait(): that would check the copy itself
        assert handle.done()
        assert handle.event is not None and handle.event.outcome == "committed"


def test_a_saving_thread_that_does_not_come_back_does_not_hold_the_commit(
    tmp_path: Path,
) -> None:
    """A saving thread that stays away from coci after a block=False save (a rank blocked in a
    collective, say) holds the commit up only for the grace time: the writer then checks the
    copy itself and commits."""
    big = torch.zeros(1 << 20)
    with CheckpointManager(tmp_path / "c", compression="none") as mgr:
        handle = mgr.save(1, {"big": big}, block=False)
        assert handle.wait_done(60)  # on this thread, without coming back into coci
        assert handle.event is not None and handle.event.outcome == "committed"
        assert torch.equal(mgr.restore(1)["big"], big)
