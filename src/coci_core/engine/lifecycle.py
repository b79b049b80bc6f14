"""What holds for every manager of the process, whether or not its owner closes it.

The live (unclosed) managers: before any torch optimizer's step, their unfinished
``block=False`` copies are waited for; when the main thread ends, each is closed (its pending
saves made durable). And :class:`Owner`, what a manager holds that must be given up even when
it is never closed: its directory's lease, its writer thread and its upload to a remote tier.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from torch.optim.optimizer import register_optimizer_step_pre_hook

from coci_core.engine.directory.lease import Lease
from coci_core.engine.directory.tiers import RemoteTier
from coci_core.engine.pulse import Pulse
from coci_core.engine.save.workers import PersistWorker
from coci_core.telemetry import Listener, SaveEvent, UploadEvent, emit

__all__ = ["Owner", "track", "untrack", "weak_emit", "weak_run_id"]

logger = logging.getLogger(__name__)


class Managed(Protocol):
    """What this module needs of a manager."""

    run_id: str
    listeners: list[Listener]

    def before_update(self) -> None: ...

    def close_at_exit(self) -> None: ...


_LIVE: weakref.WeakSet[Managed] = weakref.WeakSet()


def track(manager: Managed) -> None:
    """Count ``manager`` as live (until :func:`untrack`, or until it is freed)."""
    _LIVE.add(manager)


def untrack(manager: Managed) -> None:
    """``manager`` is closed."""
    _LIVE.discard(manager)


def _wait_for_snapshot_copies(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Before any torch optimizer's step: wait for the unfinished ``block=False`` copies, so
    that a step never changes a tensor that a save is still reading."""
    for manager in list(_LIVE):
        manager.before_update()


# Process-wide: a loop that does not call before_update() still never saves a torn state.
register_optimizer_step_pre_hook(_wait_for_snapshot_copies)


def _close_all_at_exit() -> None:
    """Make every unclosed manager's pending saves durable and stop its threads, before the
    interpreter tears anything down (see :func:`_register_exit_hooks`)."""
    for manager in list(_LIVE):
        manager.close_at_exit()


def _register_exit_hooks() -> None:
    """Run :func:`_close_all_at_exit` as soon as the main thread has finished.

    Python's ``atexit`` comes too late: by then ``concurrent.futures`` has refused new work
    (the writer's helper pools raise "cannot schedule new futures after interpreter
    shutdown", and the save is lost), and a daemon thread still inside a native call when the
    interpreter finalizes is ended by ``pthread_exit``, which aborts the process when it
    unwinds through C++ (torch: "terminate called without an active exception"). Threading's
    own exit hooks run first, newest first, so this one, registered after
    ``concurrent.futures.thread`` was imported, runs before that module shuts its pools down.
    ``atexit`` stays as the fallback for managers made after that point (by a non-daemon
    thread that outlives the main thread).
    """
    register = getattr(threading, "_register_atexit", None)  # CPython 3.9+
    if register is not None:
        with contextlib.suppress(RuntimeError):  # imported while the interpreter shuts down
            register(_close_all_at_exit)
    atexit.register(_close_all_at_exit)


_register_exit_hooks()


class Owner:
    """What a manager holds that must be given up even when it is never closed: the
    directory's lease and the writer thread (see ``weakref.finalize`` in the manager)."""

    def __init__(self) -> None:
        self.lease: Lease | None = None
        self.remote: RemoteTier | None = None
        self.pulse: Pulse | None = None

    def release(self, worker: PersistWorker | None) -> None:
        """Give everything up; never raises (it runs from ``close``, a finalizer or at exit,
        when the storage may be gone: a lease that cannot be removed expires by itself)."""
        if worker is not None:
            worker.stop(wait=False)
        pulse, self.pulse = self.pulse, None
        if pulse is not None:
            pulse.stop()
        lease, self.lease = self.lease, None
        if lease is not None:
            try:
                lease.release()
            except Exception as e:
                logger.info("coci: could not release the lease of %s: %s", lease.key, e)
        remote, self.remote = self.remote, None
        if remote is not None and worker is not None:  # freed unclosed: give up the upload
            try:
                remote.close(timeout_s=0.0)
            except Exception as e:
                logger.info("coci: could not stop the upload to %s: %s", remote.remote.url, e)


def weak_run_id(manager: Managed, session: str) -> Callable[[], str]:
    """The manager's current run (``session`` once it is freed), without keeping it alive
    (the writer and upload threads hold this)."""
    ref = weakref.ref(manager)
    return lambda: getattr(ref(), "run_id", session)


def weak_emit(manager: Managed) -> Callable[[SaveEvent | UploadEvent], None]:
    """Give an event to the manager's listeners while the manager exists."""
    ref = weakref.ref(manager)

    def send(event: SaveEvent | UploadEvent) -> None:
        owner = ref()
        if owner is not None:
            emit(owner.listeners, event)

    return send
