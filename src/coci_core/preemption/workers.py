"""Data loader workers that leave a notice's signal to the training process.

A signal sent to every process of a job (SLURM signals every process of the job step; a
machine's shutdown stops the service or session the job runs in; ``kill -TERM -<pgid>``)
reaches the data loader's workers too. PyTorch's handler in a worker ends it on a SIGTERM that
does not come from its parent (SIGUSR1 and SIGUSR2 end it by default; a SIGINT stops its
loop), and the training process then fails at its next batch (``DataLoader worker (pid N) is
killed by signal: Terminated``): the notice's save is lost.

A shielded worker ignores the notice's signals until the training process exits (it sets an
event at exit) or is gone: the training process saves, stops its loop and shuts its workers
down. At its exit it ends the data loader workers still running itself, SIGKILLing those that
do not end within ``WORKER_EXIT_S`` (a worker stuck in a C call), so that Python's exit, which
joins its daemonic children without a timeout, never waits for one. (A worker cannot tell who
sent a signal from Python, and it runs threads started before its ``worker_init_fn``, so
blocking the signals in it does not keep them away.)
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

__all__ = ["WORKER_EXIT_S", "ShieldedWorkerInit", "loaders_in", "shield_loader_workers"]

logger = logging.getLogger(__name__)

#: how long the training process's exit waits for its loader workers before SIGKILLing them
WORKER_EXIT_S = 2.0

_events: dict[str, Any] = {}  # start method -> the event set at exit (one each, not per loader)
_events_lock = threading.Lock()


def _exiting_event(method: str) -> Any:
    """The event of start method ``method`` that this process sets at its exit."""
    with _events_lock:
        event = _events.get(method)
        if event is None:
            event = multiprocessing.get_context(method).Event()
            if not _events:
                atexit.register(_at_exit)  # after multiprocessing's and torch's: runs first
            _events[method] = event
        return event


def _at_exit() -> None:
    for event in list(_events.values()):
        with contextlib.suppress(Exception):  # (a semaphore already gone at exit)
            event.set()
    workers = [p for p in multiprocessing.active_children() if p.daemon and _loader_worker(p)]
    for p in workers:
        with contextlib.suppress(Exception):
            p.terminate()
    deadline = time.monotonic() + WORKER_EXIT_S
    for p in workers:
        with contextlib.suppress(Exception):
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)


def _loader_worker(process: Any) -> bool:
    """Whether ``process`` is a PyTorch data loader worker (which names itself so; Linux)."""
    try:
        with open(f"/proc/{process.pid}/comm", encoding="ascii") as f:
            return f.read().strip() == "pt_data_worker"
    except (OSError, ValueError):
        return False


def _shield_worker(signums: Iterable[int], exiting: Any) -> None:
    """Shield the calling process (a data loader worker, in its main thread) from
    ``signums`` until the event ``exiting`` is set or its parent is gone."""
    parent = os.getppid()  # the training process (fork, spawn) or its forkserver

    def handler(signum: int, frame: FrameType | None) -> None:
        if exiting.is_set() or os.getppid() != parent:
            os._exit(0)  # as PyTorch's handler ends a worker its parent asked to end

    for signum in signums:
        signal.signal(signum, handler)


def _start_method(context: Any) -> str:
    """The start method of a loader's ``multiprocessing_context`` (None: the default, read
    without fixing it)."""
    method = context.get_start_method() if context is not None else None
    return (
        method
        or multiprocessing.get_start_method(allow_none=True)
        or (multiprocessing.get_all_start_methods()[0])
    )


class ShieldedWorkerInit:
    """A data loader's ``worker_init_fn`` that shields the worker from ``signums`` (see the
    module) and then calls the loader's own ``worker_init_fn``, ``inner``. It pickles for
    the ``spawn`` and ``forkserver`` start methods when ``inner`` does, and copies."""

    def __init__(
        self, signums: Iterable[int], inner: Callable[[int], Any] | None, context: Any = None
    ) -> None:
        self.signums = tuple(int(s) for s in signums)
        self.inner = inner
        self.method = _start_method(context)
        self.exiting = _exiting_event(self.method)  # inherited by forked workers

    def __getstate__(self) -> dict[str, Any]:
        from multiprocessing.context import get_spawning_popen

        popen = get_spawning_popen()
        method = getattr(popen, "method", None) if popen is not None else None
        state = {"signums": self.signums, "inner": self.inner, "method": method or self.method}
        if method is not None:  # a worker being started: it takes the event along
            state["exiting"] = _exiting_event(method)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.signums, self.inner, self.method = state["signums"], state["inner"], state["method"]
        self.exiting = state.get("exiting") or _exiting_event(self.method)

    def __call__(self, worker_id: int) -> None:
        _shield_worker(self.signums, self.exiting)
        if self.inner is not None:
            self.inner(worker_id)


def loaders_in(obj: Any) -> list[Any]:
    """The ``DataLoader`` objects in ``obj``: one, a sequence or mapping of them, or a
    wrapper that holds them (Lightning's ``CombinedLoader``: ``flattened``)."""
    from torch.utils.data import DataLoader

    if obj is None:
        return []
    base = vars(obj).get("base_dataloader") if hasattr(obj, "__dict__") else None
    if base is not None:  # Accelerate's prepared loaders wrap the one that starts the workers
        return loaders_in(base)
    if isinstance(obj, DataLoader):
        return [obj]
    flattened = getattr(obj, "flattened", None)
    if isinstance(flattened, list):
        return [x for item in flattened for x in loaders_in(item)]
    if isinstance(obj, dict):
        return [x for item in obj.values() for x in loaders_in(item)]
    if isinstance(obj, (list, tuple)):
        return [x for item in obj for x in loaders_in(item)]
    return []


def shield_loader_workers(loaders: Any, signums: Iterable[int]) -> int:
    """Shield the workers of ``loaders`` (a ``DataLoader``, a sequence or mapping of them,
    Lightning's ``CombinedLoader``) from ``signums`` sent to the whole job: their
    ``worker_init_fn`` is wrapped in :class:`ShieldedWorkerInit`. Workers already running
    (an iterator made before, ``persistent_workers=True``) keep their handling; those started
    from then on are shielded. How many loaders were newly wrapped."""
    numbers = tuple(int(s) for s in signums)
    if not numbers:
        return 0
    count = 0
    for loader in loaders_in(loaders):
        if loader.num_workers == 0 or isinstance(loader.worker_init_fn, ShieldedWorkerInit):
            continue
        try:
            shielded = ShieldedWorkerInit(
                numbers, loader.worker_init_fn, loader.multiprocessing_context
            )
            loader.worker_init_fn = shielded
        except (AttributeError, ValueError, OSError) as e:  # a loader that refuses it
            logger.info("coci: the workers of a %s are not shielded: %s", type(loader).__name__, e)
            continue
        count += 1
    return count
