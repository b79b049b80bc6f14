"""Where a Lightning run's coci telemetry goes: the Trainer's loggers, TensorBoard, JSON lines."""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from coci_core.errors import ConfigError
from coci_core.telemetry import Event, SaveEvent, TelemetrySink
from coci_core.training import report_sink


def make_sinks(
    trainer: pl.Trainer, root: Path | str, storage_options: dict[str, Any] | None = None
) -> list[TelemetrySink]:
    """On rank 0: ``coci report``'s records (a JSON-lines file under ``root``, or objects
    under an fsspec URL ``root``, see :func:`~coci_core.telemetry.objects.report_sink`) and
    TensorBoard (the Trainer's TensorBoardLogger when it has one, else, for a local ``root``,
    coci's own writer under ``root/tensorboard`` if tensorboard is installed), pointed at
    ``root`` for TensorBoard's coci tab."""
    if not trainer.is_global_zero:
        return []
    from coci_core.training import TensorBoardTelemetry

    local = root if isinstance(root, Path) else None
    sinks: list[TelemetrySink] = [report_sink(root, storage_options)]
    loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
    try:
        if loggers:
            sinks.append(TensorBoardTelemetry(writer=loggers[0].experiment, telemetry_dir=root))
        elif local is not None:
            sinks.append(TensorBoardTelemetry(local / "tensorboard", telemetry_dir=local))
    except ConfigError:  # tensorboard is not installed: the JSON file still has everything
        pass
    return sinks


class LoggerRelay:
    """Passes committed saves (reported on the writer thread) to the Trainer's other loggers,
    on the training thread."""

    def __init__(self) -> None:
        self._events: collections.deque[SaveEvent] = collections.deque()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # A lock neither pickles nor deep-copies (Lightning deep-copies callbacks, and
        # strategy="ddp_spawn" pickles them): the copy gets its own lock and the pending events.
        with self._lock:
            return {"events": list(self._events)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._events = collections.deque(state.get("events", ()))
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        if isinstance(event, SaveEvent) and event.outcome == "committed":
            with self._lock:
                self._events.append(event)

    def drain(self, trainer: pl.Trainer, *, final: bool = False) -> None:
        """Log the saves that finished since the last call (rank 0; TensorBoard has its panel)."""
        with self._lock:
            events, self._events = list(self._events), collections.deque()
        loggers: list[Any] = [lg for lg in trainer.loggers if not isinstance(lg, TensorBoardLogger)]
        for event in events:
            metrics = {
                "coci/stall_ms": 1e3 * event.stall_s,
                "coci/persist_ms": 1e3 * event.persist_s,
                "coci/bytes_written": float(event.bytes_written),
            }
            for lg in loggers:
                lg.log_metrics(metrics, step=event.step)
        if events and final:
            for lg in loggers:
                lg.save()  # the run is ending: do not leave the last save's metrics unwritten
