"""Events that every save and restore reports, and the listeners that receive them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

__all__ = ["Event", "Listener", "RestoreEvent", "SaveEvent", "emit"]

logger = logging.getLogger(__name__)

SaveOutcome = Literal["committed", "skipped", "failed"]


@dataclass(frozen=True, kw_only=True)
class SaveEvent:
    """What one save did.

    Attributes:
        step: the training step saved.
        outcome: ``"committed"`` (durable), ``"skipped"`` (a previous persist was still running
            and ``on_busy="skip"``) or ``"failed"`` (see ``error``; nothing was published).
        stall_s: time the training loop was held: the ``save`` call, including any wait for the
            previous persist, plus the wait in ``before_update`` when ``block=False``.
        copy_s: time spent copying the state into host buffers.
        persist_s: time from the end of the copy to the commit (checksums, writes, fsync, rename).
        time_to_durable_s: time from the ``save`` call to the commit.
        bytes_written: bytes of data and manifest written.
        first_save: the host buffers were allocated by this save (not reused).
        path: where the checkpoint was published.
    """

    step: int
    outcome: SaveOutcome
    stall_s: float = 0.0
    copy_s: float = 0.0
    persist_s: float = 0.0
    time_to_durable_s: float = 0.0
    bytes_written: int = 0
    first_save: bool = False
    block: bool = True
    path: str = ""
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class RestoreEvent:
    """What one restore did; ``skipped_steps`` were newer but damaged and passed over."""

    step: int
    seconds: float
    bytes_read: int
    skipped_steps: tuple[int, ...] = ()


Event: TypeAlias = SaveEvent | RestoreEvent
Listener: TypeAlias = Callable[[Event], None]


def emit(listeners: list[Listener], event: Event) -> None:
    """Give ``event`` to every listener; a failing listener is logged, never raised."""
    for listener in list(listeners):
        try:
            listener(event)
        except Exception:
            logger.exception("coci telemetry listener %r failed on %r", listener, event)
