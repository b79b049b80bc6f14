"""The save hand-off goes one way: the writer thread runs the task it is given, the task runs the
save's writer, the writer runs the persist code, the persist code writes to the storage; no frame
calls back into a module that handed the save on."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Iterable
from pathlib import Path

import torch

from coci_core import CheckpointManager
from coci_core.storage import Storage, StorageWrapper
from coci_core.storage.local import LocalStorage

#: The save path's modules in the order the hand-off goes.
SAVE_PATH = (
    "coci_core/engine/save/workers.py",
    "coci_core/engine/save/writer.py",
    "coci_core/engine/save/persist.py",
)


class _StackAtWrite(StorageWrapper):
    """Records, for each data file written, the save-path modules of the writing thread's
    frames, outermost first."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.stacks: list[tuple[str, list[str]]] = []

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        frames = [
            next(m for m in SAVE_PATH if f.filename.replace("\\", "/").endswith(m))
            for f in traceback.extract_stack()
            if any(f.filename.replace("\\", "/").endswith(m) for m in SAVE_PATH)
        ]
        self.stacks.append((threading.current_thread().name, frames))
        return super().write_file(path, chunks, aligned=aligned)


def _runs(modules: list[str]) -> list[str]:
    """``modules`` with each run of one module's frames counted once."""
    return [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]


def test_the_writer_threads_frames_go_one_way(tmp_path: Path) -> None:
    storage = _StackAtWrite(LocalStorage(tmp_path))
    state = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10)}
    with CheckpointManager(storage, compression="none") as mgr:
        for step in (1, 2):
            mgr.save(step, state, block=step == 1).wait()
    data = [(thread, frames) for thread, frames in storage.stacks if frames]
    assert data, storage.stacks
    for thread, frames in data:
        assert thread == "coci-persist"
        assert _runs(frames) == list(SAVE_PATH), frames


def test_the_check_finds_a_turn_back() -> None:
    worker, writer, persist = SAVE_PATH
    assert _runs([worker, writer, writer, persist]) == list(SAVE_PATH)
    assert _runs([persist, writer, persist]) != list(SAVE_PATH)  # before: the worker in persist
