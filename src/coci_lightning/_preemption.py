"""CociCheckpoint on a preemption notice, beside Lightning's own SIGTERM handling.

Lightning 2.x registers a SIGTERM handler when training starts (its ``_SignalConnector``): it
sets ``trainer.received_sigterm``, forwards SIGTERM to the processes its launcher started,
broadcasts a flag from rank 0 *inside the handler* with several processes, and the loops then
raise ``SIGTERMException`` (a ``SystemExit`` with exit status 0) after the step, which
``OnExceptionCheckpoint`` and ``CociCheckpoint(save_on_exception=True)`` save on. While coci
watches SIGTERM (``preemption`` names it, as ``"auto"`` does), that notifier is replaced on the
Trainer's connector (an instance attribute over a private method) by one that does nothing:
coci's handler, which Lightning chains after its own, records the notice; the ranks agree at
the next step boundary; CociCheckpoint saves that step if it fits and raises
:class:`~coci_core.Preempted` (exit status 143). The rest of Lightning's SIGTERM handler (the
``SLURMEnvironment(auto_requeue=True)`` "bypass" line) and its requeue signal handler are left
alone.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import _auto_add_worker_init_fn

from coci_core.preemption import loaders_in
from coci_core.training import CheckpointOptions, min_over_ranks

_NOTIFIER = "_sigterm_notifier_fn"


def rank_minimum(
    trainer: pl.Trainer, options: CheckpointOptions
) -> Callable[[float], float] | None:
    """The per-step collective of the notice watch with several processes (over gloo: a
    group of its own when the strategy's backend is another; every rank makes it in
    ``setup``), or None."""
    if trainer.world_size > 1 and options.preemption is not None:
        return min_over_ranks()
    return None


def _ignore(signum: int, frame: FrameType | None) -> None:
    """Lightning's SIGTERM notifier while coci watches SIGTERM: nothing (coci's handler,
    chained after it, records the notice; no I/O or collective in a signal handler)."""


def take_sigterm_over(trainer: pl.Trainer) -> None:
    """Lightning neither flags SIGTERM nor raises ``SIGTERMException`` for this fit: coci's
    notice handling stops the run. Call it before Lightning registers its handlers (``setup``)."""
    connector: Any = getattr(trainer, "_signal_connector", None)
    if connector is not None:
        setattr(connector, _NOTIFIER, _ignore)


def give_sigterm_back(trainer: pl.Trainer) -> None:
    """Lightning's own SIGTERM notifier again (for a later fit without coci's notices)."""
    connector: Any = getattr(trainer, "_signal_connector", None)
    if connector is not None:
        vars(connector).pop(_NOTIFIER, None)


Handlers = dict[int, Any]


def signal_handlers() -> Handlers:
    """The handlers of the signals a notice may come by, now."""
    return {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}


def forget_coci_handlers(trainer: pl.Trainer, before: Handlers, mine: Handlers) -> None:
    """On an exception, Lightning puts back the handlers it found when it registered its own
    (coci's, installed in ``setup``) after the callbacks' ``on_exception``, where coci has
    stopped watching: it puts back the ones coci replaced instead (``before``), so that no
    stopped coci handler is left to swallow a later SIGTERM. A no-op after a fit that ended
    normally (Lightning put its handlers back first)."""
    connector: Any = getattr(trainer, "_signal_connector", None)
    originals = getattr(connector, "_original_handlers", None)
    if not isinstance(originals, dict):
        return
    for signum, handler in mine.items():
        if handler is not before.get(signum) and originals.get(signum) is handler:
            originals[signum] = before.get(signum)


_SHIELDED = "_coci_shields_workers"


def _data_sources(trainer: pl.Trainer) -> list[Any]:
    """Where the fit's training and validation loaders come from (Lightning's private
    ``_DataLoaderSource`` objects of its loops), those found."""
    loops = [trainer.fit_loop, getattr(trainer.fit_loop.epoch_loop, "val_loop", None)]
    sources = [getattr(loop, "_data_source", None) for loop in loops]
    return [s for s in sources if s is not None and callable(getattr(s, "dataloader", None))]


def shield_loader_workers(trainer: pl.Trainer, shield: Callable[[Any], int]) -> None:
    """The workers of the loaders the fit requests from now on are shielded (``shield``:
    ``Checkpointer.shield_loader_workers``) from the notice's signals sent to every process
    of the job (see :mod:`coci_core.preemption.workers`). Lightning starts the first epoch's
    workers before any hook sees the loaders, so its sources' ``dataloader`` is wrapped (an
    instance attribute over a private object's method; :func:`give_loaders_back` removes it).
    """
    for source in _data_sources(trainer):
        request = source.dataloader
        if getattr(request, _SHIELDED, False):
            continue

        def shielded(request: Callable[[], Any] = request) -> Any:
            loaders = request()
            for loader in loaders_in(loaders):
                # what Lightning's _process_dataloader does next, which it skips for a loader
                # with a worker_init_fn already: seed_everything(workers=True)'s seeding
                _auto_add_worker_init_fn(loader, trainer.global_rank)
            shield(loaders)
            return loaders

        setattr(shielded, _SHIELDED, True)
        source.dataloader = shielded


def give_loaders_back(trainer: pl.Trainer) -> None:
    """Undo :func:`shield_loader_workers` (at teardown)."""
    for source in _data_sources(trainer):
        if getattr(vars(source).get("dataloader"), _SHIELDED, False):
            del source.dataloader
