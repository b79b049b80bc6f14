"""SaveHandle: the pending result of one save, used like a :class:`concurrent.futures.Future`.

The manager completes a handle through its completion methods (:meth:`SaveHandle.add_stall`,
:meth:`SaveHandle.check_copy`, :meth:`SaveHandle.finish`, ...), as an executor completes a
``Future`` with ``set_result``; the handle keeps its own state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from coci_core.engine.save.save_inputs import check_timeout
from coci_core.engine.save.snapshot import Snapshot
from coci_core.errors import BackgroundSaveError
from coci_core.telemetry import SaveEvent

__all__ = ["SaveHandle"]

logger = logging.getLogger(__name__)


class SaveHandle:
    """The pending result of one :meth:`CheckpointManager.save`, used like a
    :class:`concurrent.futures.Future`: :meth:`done`, :meth:`result` (or :meth:`wait`),
    :meth:`exception` and :meth:`add_done_callback`."""

    def __init__(
        self, step: int, *, block: bool, started: float, snapshot: Snapshot | None
    ) -> None:
        self.step = step
        self.block = block
        self._started = started
        self._snapshot = snapshot
        self._done = threading.Event()
        self._stall_s = 0.0
        self._update_wait_s = 0.0
        self._event: SaveEvent | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._callbacks: list[Callable[[SaveHandle], None]] = []
        self._callbacks_lock = threading.Lock()

    def __repr__(self) -> str:
        state = self._event.outcome if self._event else "pending"
        return f"SaveHandle(step={self.step}, {state})"

    def done(self) -> bool:
        """Whether the save has finished (committed, skipped or failed). On the thread that
        saved, a finished ``block=False`` copy is checked here (its commit waits for that)."""
        snapshot = self._snapshot
        if (
            not self._done.is_set()
            and snapshot is not None
            and snapshot.copied.is_set()
            and snapshot.may_check_here()
        ):
            self.check_copy(0)
        return self._done.is_set()

    @property
    def skipped(self) -> bool:
        """Whether the save was skipped because the previous persist was still running."""
        return self._event is not None and self._event.outcome == "skipped"

    @property
    def event(self) -> SaveEvent | None:
        """What the save did, once it is done."""
        return self._event

    def add_done_callback(self, fn: Callable[[SaveHandle], None]) -> None:
        """Call ``fn(handle)`` once the save is done: at once if it is, otherwise on the
        writer thread before :meth:`wait` returns. An exception in ``fn`` is logged."""
        with self._callbacks_lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        self._call(fn)

    def result(self, timeout: float | None = None) -> SaveEvent:
        """The same as :meth:`wait` (``Future.result``)."""
        return self.wait(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """What made the save fail (None if it did not), once it is done.

        Raises:
            TimeoutError: ``timeout`` passed first.
        """
        if not self.check_copy(timeout) or not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} not done after {timeout} s")
        if self._error is not None:
            self._reported = True
        return self._error

    def wait(self, timeout_s: float | None = None) -> SaveEvent:
        """Block until the save is durable (or skipped) and return what it did.

        Raises:
            BackgroundSaveError: the save failed; nothing was published.
            TimeoutError: ``timeout_s`` passed first.
        """
        timeout_s = check_timeout("timeout_s", timeout_s)
        if not self.check_copy(timeout_s) or not self._done.wait(timeout_s):
            raise TimeoutError(f"save of step {self.step} not durable after {timeout_s} s")
        if self._error is not None:
            self._reported = True
            raise BackgroundSaveError(
                f"background save of step {self.step} failed: {self._error}", step=self.step
            ) from self._error
        if self._event is None:
            raise AssertionError("a finished save has no event")
        return self._event

    # -- completion: the manager reports through these ------------------------------------

    def wait_done(self, timeout_s: float | None = None) -> bool:
        """Block until the save has finished, without checking its copy; whether it has."""
        return self._done.wait(timeout_s)

    def add_stall(self, seconds: float, *, update_wait: bool = False) -> None:
        """Count ``seconds`` in which the training loop was held (``update_wait``: waiting
        for the copy before an update)."""
        self._stall_s += seconds
        if update_wait:
            self._update_wait_s += seconds

    def before_update(self) -> None:
        """For a ``block=False`` save: wait until its copy is finished (the wait counts as
        stall), order later work on the current CUDA stream after it, and check it where this
        thread may (see :meth:`check_copy`)."""
        snapshot = self._snapshot
        if snapshot is None or self.block:
            return
        if not snapshot.copied.is_set():
            started = time.perf_counter()
            snapshot.copied.wait()
            self.add_stall(time.perf_counter() - started, update_wait=True)
        snapshot.order_current_stream()
        self.check_copy()

    def check_copy(self, timeout_s: float | None = None, *, any_thread: bool = False) -> bool:
        """For a ``block=False`` save: once its copy is finished, check on this thread that no
        saved tensor changed in place meanwhile (its commit waits for that check). Only the
        thread that saved may, or any thread once it has ended; ``any_thread``: ``close()``,
        after training. Returns False if ``timeout_s`` passed before the copy finished."""
        snapshot = self._snapshot
        if self.block or snapshot is None or snapshot.checked.is_set():
            return True
        if not (any_thread or snapshot.may_check_here()):
            return True
        if not snapshot.copied.is_set():
            started = time.perf_counter()
            if not snapshot.copied.wait(timeout_s):
                return False
            self.add_stall(time.perf_counter() - started, update_wait=True)
        snapshot.check_copy()
        return True

    def new_event(self, **fields: Any) -> SaveEvent:
        """A :class:`SaveEvent` of this save, now: its timings and ``fields``."""
        now = time.perf_counter()
        snapshot = self._snapshot
        if snapshot is None:
            return SaveEvent(step=self.step, stall_s=self._stall_s, block=self.block, **fields)
        return SaveEvent(
            step=self.step,
            stall_s=self._stall_s,
            update_wait_s=self._update_wait_s,
            copy_s=snapshot.copy_s,
            persist_s=now - snapshot.copied_at if snapshot.copied_at else 0.0,
            time_to_durable_s=now - self._started,
            first_save=snapshot.allocated,
            block=self.block,
            **fields,
        )

    def finish(
        self,
        event: SaveEvent,
        error: BaseException | None = None,
        notify: Callable[[SaveEvent], None] | None = None,
    ) -> None:
        """Record the outcome, give it to ``notify`` (listeners: before ``wait()`` returns,
        they have it), then wake the waiters."""
        self._event = event
        self._error = error
        try:
            if notify is not None:
                notify(event)
        finally:
            # callbacks added before the end run before waiters wake (and in order)
            while True:
                with self._callbacks_lock:
                    callbacks, self._callbacks = self._callbacks, []
                    if not callbacks:
                        self._done.set()
                        break
                for callback in callbacks:
                    self._call(callback)

    def take_unreported_error(self) -> BaseException | None:
        """The error of a failed save that nobody was told of yet (then it counts as told)."""
        if self._reported or self._error is None:
            return None
        self._reported = True
        return self._error

    def _call(self, callback: Callable[[SaveHandle], None]) -> None:
        try:
            callback(self)
        except Exception:
            logger.exception("coci: a done callback of %r failed", self)
