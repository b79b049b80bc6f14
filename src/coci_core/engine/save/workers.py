"""The engine's background threads: the writer thread of a manager (:class:`PersistWorker`),
a thread that runs only the newest submission (:class:`LatestOnlyWorker`), and the lower
priority they run at. Nothing here knows what the work is."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["LatestOnlyWorker", "PersistWorker", "Task", "lower_thread_priority"]

logger = logging.getLogger(__name__)


def lower_thread_priority(niceness: int) -> None:
    """Lower the calling thread's priority by ``niceness`` (Linux; elsewhere nothing)."""
    # Linux applies nice values per thread: the writer yields the cores to training.
    if niceness <= 0 or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)


class Task(Protocol):
    """A job of a :class:`PersistWorker`: it runs itself and reports its own errors."""

    def run(self) -> None: ...


@dataclass(frozen=True)
class _Barrier:
    """A task that only says the tasks queued before it have run."""

    done: threading.Event

    def run(self) -> None:
        self.done.set()


class PersistWorker:
    """A single background thread that runs tasks in order (one persist in flight at a time).

    The hand-off goes one way: the worker calls each task's ``run`` and knows nothing of what
    it does (a manager queues a :class:`~coci_core.engine.save.writer.QueuedSave`).
    """

    def __init__(self, *, niceness: int = 5) -> None:
        self._niceness = niceness
        self._queue: queue.Queue[Task | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, task: Task) -> None:
        """Queue ``task``; starts the thread on first use."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="coci-persist", daemon=True)
                self._thread.start()
        self._queue.put(task)

    def _loop(self) -> None:
        lower_thread_priority(self._niceness)
        while True:
            task = self._queue.get()
            if task is None:
                return
            try:
                task.run()
            except Exception:  # the task reports its own errors; never let the worker die
                logger.exception("coci: unexpected error in the writer thread")
            # A task may hold its owner (the manager): let go of it before waiting for the next.
            task = None

    def drain(self, timeout_s: float | None = None) -> bool:
        """Block until every task queued before this call has run (at once when the thread is
        not running, or when called from it); False when ``timeout_s`` passed first."""
        done = threading.Event()
        with self._lock:
            thread = self._thread
            if thread is None or not thread.is_alive() or thread is threading.current_thread():
                return True
            self._queue.put(_Barrier(done))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done.wait(0.05):  # a stop() queued before the barrier ends the thread first
            if not thread.is_alive():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    def stop(self, *, wait: bool = True) -> None:
        """Finish the queued tasks and end the thread (``wait``: join it, unless called from
        the thread itself)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            if wait and thread is not threading.current_thread():
                thread.join()


class LatestOnlyWorker:
    """A background thread that runs ``fn(*args)`` for the newest submission only: work that
    is superseded before it starts (an older plan's telemetry) is dropped."""

    def __init__(self, fn: Callable[..., None], *, name: str, niceness: int = 5) -> None:
        self._fn = fn
        self._name = name
        self._niceness = niceness
        self._pending: tuple[Any, ...] | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def submit(self, *args: Any) -> None:
        """Replace any pending work with ``args``."""
        with self._cond:
            if self._stopping:
                return
            self._pending = args
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        lower_thread_priority(self._niceness)
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    self._cond.wait()
                if self._pending is None:
                    return
                args, self._pending = self._pending, None
            try:
                self._fn(*args)
            except Exception:
                logger.exception("coci: error in %s", self._name)

    def stop(self) -> None:
        """Finish the pending work, then end the thread."""
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify()
        if thread is not None:
            thread.join()
