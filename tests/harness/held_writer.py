"""Local storage that can keep coci's writer thread busy, so that a test decides when the
background copy of the next ``block=False`` save starts."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

from coci_core.storage import LocalStorage


class HeldWriter(LocalStorage):
    """Local storage whose next retention (the removal of an old step, on the writer thread
    after a commit) waits for ``release`` once :meth:`hold_next_removal` armed it; the writer
    starts the next queued save, and so its copy, only after that. ``data_written`` is set when
    the next save's data file is written: by then its copy has ended."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self._hold = False
        self.holding = threading.Event()
        self.release = threading.Event()
        self.data_written = threading.Event()

    def hold_next_removal(self) -> None:
        """Arm the hold (and clear the events of the previous one)."""
        self.holding.clear()
        self.release.clear()
        self._hold = True

    def retire(self, final: str) -> None:
        if self._hold:
            self._hold = False
            self.data_written.clear()  # from now on: the next save's data
            self.holding.set()
            assert self.release.wait(60), "the test never released the writer"
        super().retire(final)

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        written = super().write_file(path, chunks, aligned=aligned)
        if path.endswith(".bin"):
            self.data_written.set()
        return written
