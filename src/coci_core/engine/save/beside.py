"""Run a function on a helper thread while the caller does something else."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

__all__ = ["Beside", "a_core_is_free"]

T = TypeVar("T")


class Beside(Generic[T]):
    """``fn()`` on a new thread, started at once; :meth:`result` waits for it and returns its
    value or raises its exception. A new thread each time (about 0.1 ms): nothing to stop at
    exit or to lose across ``fork``."""

    def __init__(self, fn: Callable[[], T], *, name: str) -> None:
        self._fn = fn
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as e:  # handed to the caller by result()
            self._error = e

    def result(self) -> T:
        """Wait for ``fn`` and return what it returned (or raise what it raised)."""
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._value  # type: ignore[return-value]


def a_core_is_free() -> bool:
    """Whether this process may use more cores than torch's own threads (intra-op) take: work
    beside a torch op then runs on a core of its own. Where torch's threads take every core
    (one process on a machine, torch's default), a helper thread slows the op's threads by as
    much as it saves (measured: a save's copy beside its flatten, 0.92-1.12x the two one after
    the other, against 0.75-0.95x with a core free)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores
