"""A ``block=False`` save stores the state as it was when ``save()`` was called, even when the
loop does not call ``before_update()``: torch optimizers wait for the copy by themselves, small
tensors (BatchNorm's statistics) are copied by ``save()`` itself, and a tensor changed in place
before the copy read it fails that save instead of being stored with newer values."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.engine.snapshot import SMALL_COPY_BYTES, Snapshotter
from coci_core.engine.tree import flatten_state
from coci_core.errors import BackgroundSaveError, StateChangedError
from coci_core.storage import LocalStorage
from coci_core.training import Checkpointer


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
            assert not torch.equal(restored["1.running_mean"], model[1].running_mean)


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
        assert handle.event.outcome == "failed"
        mgr.wait()  # given up, not an error of the loop's: the next save does not raise
        assert 3 not in mgr.steps()
        # from now on save() copies it itself: a change right after the call is not saved
        before = big.clone()
        mgr.save(4, {"big": big}, block=False)
        big.add_(1.0)
        mgr.wait()
        assert torch.equal(mgr.restore(4)["big"], before)


def test_the_checkpointer_without_before_update_resumes_exactly(tmp_path: Path) -> None:
    """The loop a user writes with the framework-agnostic Checkpointer (block=False by
    default) and no before_update(): the resumed run ends with the same weights."""

    def run(directory: Path, stop_at: int | None) -> torch.nn.Linear:
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        ckpt = Checkpointer(directory, policy="every_n_steps", every_n_steps=4)
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
