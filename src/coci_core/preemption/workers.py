"""Data loader workers that leave a notice's signal to the training process.

A signal sent to every process of a job (SLURM signals every process of the job step; a
machine's shutdown stops the service or session the job runs in; ``kill -TERM -<pgid>``)
reaches the data loader's workers too. PyTorch's handler in a worker ends it on a SIGTERM that
does not come from its parent (SIGUSR1 and SIGUSR2 end it by default; a SIGINT stops its
loop), and the training process then fails at its next batch (``DataLoader worker (pid N) is
killed by signal: Terminated``): the notice's save is lost.

A shielded worker ignores the notice's signals until the training process exits (it sets an
event at exit, before Python's exit ends its daemonic children with SIGTERM) or is gone: the
training process saves, stops its loop and shuts its workers down. (A worker cannot tell who
sent a signal from Python, and it runs threads started before its ``worker_init_fn``, so
blocking the signals in it does not keep them away.)
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

__all__ = ["ShieldedWorkerInit", "shield_loader_workers", "shield_worker"]


_exiting: list[Any] = []  # the events of this process's shielded loaders


def _set_exiting() -> None:
    for event in _exiting:
        with contextlib.suppress(Exception):  # (a semaphore already gone at exit)
            event.set()


def shield_worker(signums: Iterable[int], exiting: Any) -> None:
    """Shield the calling process (a data loader worker, in its main thread) from
    ``signums`` until the event ``exiting`` is set or its parent is gone."""
    parent = os.getppid()  # the training process (fork, spawn) or its forkserver

    def handler(signum: int, frame: FrameType | None) -> None:
        if exiting.is_set() or os.getppid() != parent:
            os._exit(0)  # as PyTorch's handler ends a worker its parent asked to end

    for signum in signums:
        signal.signal(signum, handler)


class ShieldedWorkerInit:
    """A data loader's ``worker_init_fn`` that shields the worker (see :func:`shield_worker`)
    and then calls the loader's own ``worker_init_fn``. Picklable (the ``spawn`` and
    ``forkserver`` start methods) when the inner function is."""

    def __init__(
        self, signums: Iterable[int], inner: Callable[[int], Any] | None, context: Any = None
    ) -> None:
        self.signums = tuple(int(s) for s in signums)
        self.inner = inner
        self.exiting = (context or multiprocessing).Event()
        if not _exiting:
            atexit.register(_set_exiting)  # after multiprocessing's: run before it
        _exiting.append(self.exiting)

    def __call__(self, worker_id: int) -> None:
        shield_worker(self.signums, self.exiting)
        if self.inner is not None:
            self.inner(worker_id)


def _loaders(obj: Any) -> list[Any]:
    """The ``DataLoader`` objects in ``obj``: one, a sequence or mapping of them, or a
    wrapper that holds them (Lightning's ``CombinedLoader``: ``flattened``)."""
    from torch.utils.data import DataLoader

    if obj is None:
        return []
    base = vars(obj).get("base_dataloader") if hasattr(obj, "__dict__") else None
    if base is not None:  # Accelerate's prepared loaders wrap the one that starts the workers
        return _loaders(base)
    if isinstance(obj, DataLoader):
        return [obj]
    flattened = getattr(obj, "flattened", None)
    if isinstance(flattened, list):
        return [x for item in flattened for x in _loaders(item)]
    if isinstance(obj, dict):
        return [x for item in obj.values() for x in _loaders(item)]
    if isinstance(obj, (list, tuple)):
        return [x for item in obj for x in _loaders(item)]
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
    for loader in _loaders(loaders):
        if loader.num_workers == 0 or isinstance(loader.worker_init_fn, ShieldedWorkerInit):
            continue
        context = loader.multiprocessing_context
        with contextlib.suppress(AttributeError, ValueError):  # a loader that refuses it
            loader.worker_init_fn = ShieldedWorkerInit(numbers, loader.worker_init_fn, context)
            count += 1
    return count
