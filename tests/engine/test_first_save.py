"""The first save without the page-fault tax: ``warm_up`` maps the host buffers'
pages before the first save, so that its copy runs like later ones."""

from __future__ import annotations

import ctypes
import resource
from pathlib import Path

import torch

from coci_core import CheckpointManager

MiB = 1 << 20
PAGE = resource.getpagesize()
PAGES = 64 * MiB // PAGE


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(8 * MiB, generator=g), "b": torch.randn(8 * MiB, generator=g)}


def _faults_during_save(mgr: CheckpointManager, step: int, state: dict[str, torch.Tensor]) -> int:
    """Minor page faults of this thread during a blocking save's copy (and the event)."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    handle = mgr.save(step, state, block=True)
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    event = handle.wait()
    assert event.outcome == "committed"
    return faults


def _resident_pages(address: int, length: int) -> int:
    """How many pages of ``[address, address + length)`` are in memory (``mincore(2)``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = (length + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec)


def test_warm_up_maps_the_buffers_before_the_first_save(tmp_path: Path) -> None:
    """After warm_up every page of the 64 MB host buffer is in memory, so the first save's
    copy faults in almost none on the training thread (like a later save); it reports no
    allocation and restores exactly."""
    state = _state(1)
    with CheckpointManager(tmp_path, compression="none") as mgr:
        mgr.warm_up(state).join()
        arena = mgr._snapshotter._arena  # the buffer the saves copy into
        assert arena is not None
        address, length = arena.bytes.data_ptr(), arena.total_bytes
        assert address % PAGE == 0
        assert _resident_pages(address, length) == (length + PAGE - 1) // PAGE
        warm = _faults_during_save(mgr, 1, state)
        assert mgr._snapshotter._arena is arena  # no second allocation
        event = mgr.save(2, _state(2), block=True).wait()
        assert not event.first_save
        restored = mgr.restore(step=1)
    assert warm < PAGES // 20
    assert all(torch.equal(restored[k], state[k]) for k in state)


def test_a_save_right_after_warm_up_waits_for_it(tmp_path: Path) -> None:
    """A save that comes while the buffers are still being mapped waits, then copies into
    them (no second allocation)."""
    state = _state(3)
    with CheckpointManager(tmp_path, compression="none") as mgr:
        mgr.warm_up(state)  # not joined
        event = mgr.save(1, state, block=True).wait()
        assert not event.first_save
        assert all(torch.equal(mgr.restore()[k], state[k]) for k in state)


def test_a_changed_layout_allocates_again(tmp_path: Path) -> None:
    """warm_up for one layout does not serve a state of another (e.g. before the optimizer
    created its state): that save allocates its own buffers, and restores exactly."""
    with CheckpointManager(tmp_path, compression="none") as mgr:
        mgr.warm_up({"a": torch.zeros(1024)}).join()
        state = _state(4)
        event = mgr.save(1, state, block=True).wait()
        assert event.first_save
        assert all(torch.equal(mgr.restore()[k], state[k]) for k in state)
