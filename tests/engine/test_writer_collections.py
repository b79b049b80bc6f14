"""The writer builds a save's records with the cyclic collector paused, and keeps no object
per array through the data write: a collection there walks every object alive, holding the GIL
that the training thread needs. The pause is the process's, shared by coci's threads, and
never turns on a collector that the program turned off."""

from __future__ import annotations

import gc
import multiprocessing as mp
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.engine.directory.steps import gc_paused
from coci_core.storage import LocalStorage


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        if not was:
            gc.disable()


def _collections_by_thread() -> tuple[dict[str, int], Any]:
    counts: dict[str, int] = {}

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            name = threading.current_thread().name
            counts[name] = counts.get(name, 0) + 1

    return counts, callback


def test_saves_of_many_arrays_run_few_collections_in_the_writer(
    tmp_path: Path, collector_on: None
) -> None:
    state = {"model": {f"layer{i}.weight": torch.randn(4) for i in range(6000)}, "step": 0}
    counts, callback = _collections_by_thread()
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        mgr.save(0, state).wait()
        gc.callbacks.append(callback)
        try:
            for step in range(1, 5):
                state["step"] = step
                mgr.save(step, state).wait()
        finally:
            gc.callbacks.remove(callback)
    writer = sum(n for name, n in counts.items() if name.startswith("coci-persist"))
    # each save made about 10 tracked objects per array (60,000), a collection per 700 of
    # them when they were made with the collector on
    assert writer <= 4 * 4, counts


def test_the_pause_lasts_until_the_last_block_in_any_thread_ends(collector_on: None) -> None:
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with gc_paused():
            inside.set()
            release.wait()

    helper = threading.Thread(target=hold)
    with gc_paused():
        helper.start()
        inside.wait()
        assert not gc.isenabled()
    assert not gc.isenabled()  # the helper's block still runs
    release.set()
    helper.join()
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off() -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        if was:
            gc.enable()


def _report_collector(queue: Any) -> None:
    queue.put(gc.isenabled())


def test_a_process_forked_during_a_pause_has_its_collector_on(collector_on: None) -> None:
    """A data loader's worker forked while the writer builds its records."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with gc_paused():
        child = ctx.Process(target=_report_collector, args=(queue,))
        child.start()
        enabled = queue.get(timeout=60)
        child.join(60)
    assert enabled is True
    assert child.exitcode == 0


def test_retention_decodes_no_manifest_the_writer_just_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer notes the head of each manifest it writes: the listing that retention makes
    after each commit finds it by its checksum (a damaged one would not match, and is read)."""
    from coci_core.engine.directory import steps
    from coci_core.engine.format.manifest import read_head_only

    decoded: list[int] = []

    def counted(data: bytes, **kw: Any) -> Any:
        decoded.append(int(kw["step"]))
        return read_head_only(data, **kw)

    monkeypatch.setattr("coci_core.engine.directory.steps.read_head_only", counted)
    state = {f"t{i}": torch.randn(3) for i in range(50)}
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        for step in range(5):
            mgr.save(step, state).wait()
    with CheckpointManager(tmp_path, keep_last=2) as mgr:
        assert mgr.steps() == [3, 4]  # retention ran after each commit
    assert decoded == []
    monkeypatch.setattr(steps, "_infos", {})  # a new process knows none of them
    assert [i.step for i in steps.step_infos(LocalStorage(tmp_path))] == [4, 3]
    assert sorted(decoded) == [3, 4]


class _ReadsWatched(LocalStorage):
    """Local storage that records whether the collector was on at each manifest read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.collector_on: list[bool] = []

    def read_bytes(self, path: str) -> bytes:
        if path.endswith("manifest.json"):
            self.collector_on.append(gc.isenabled())
        return super().read_bytes(path)


def test_a_restore_lists_and_loads_in_one_pause(tmp_path: Path, collector_on: None) -> None:
    """The manifests a restore decodes to order the steps and the state it builds are many
    objects in no cycle: no collection between the listing and the load (each would walk
    them all; in a new process one of them was a full collection, 0.09 s of a 0.3 s restore),
    and the collector on again once the restore has returned."""
    state = {f"w{i}": torch.full((3,), float(i)) for i in range(200)}
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state).wait()
    storage = _ReadsWatched(tmp_path)
    with CheckpointManager(storage, keep_last=None) as mgr:
        got = mgr.restore()
    assert torch.equal(got["w199"], state["w199"]) and mgr.last_restore is not None
    assert mgr.last_restore.step == 3
    assert len(storage.collector_on) >= 3  # the listing's three, and the load's
    assert not any(storage.collector_on), storage.collector_on
    assert gc.isenabled()
