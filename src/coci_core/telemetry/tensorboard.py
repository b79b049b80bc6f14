"""Writes coci's costs to TensorBoard's Scalars tab, and points the **coci** tab at the run.

``TensorBoardTelemetry`` is a listener for :class:`~coci_core.CheckpointManager` (it is called
with each :class:`~coci_core.SaveEvent`) and has the sink methods the adapters call
(:meth:`~TensorBoardTelemetry.record_plan`, :meth:`~TensorBoardTelemetry.record_loss`).

Called as: 1) (rank 0) ``TensorBoardTelemetry(log_dir)`` or ``TensorBoardTelemetry(writer=w)``;
2) (rank 0, any thread) ``telemetry(event)``, ``record_plan(step, report)``,
``record_loss(step, loss, fitted)``; 3) (rank 0) ``flush()`` and ``close()``.

The Scalars tab gets only what reads well as a scalar, under one ``coci/`` group (the x axis is
the training step):

============================ ===============================================================
tag                          value at step ``x``
============================ ===============================================================
``coci/stall_ms``            training-loop stall of the save of step ``x`` (committed and
                             failed saves)
``coci/persist_s``           end of the copy to the commit (committed saves)
``coci/checkpoint_MB``       megabytes of data and manifest written (committed saves)
``coci/expected_overhead_s`` the plan's expected wall-clock overhead over its horizon, as
                             planned at step ``x``
============================ ===============================================================

Where checkpoints were planned and taken, restarts, lost work, the loss fit and the
comparison with Daly and CheckFreq are in the **coci** tab (the TensorBoard plugin
:mod:`coci_core.telemetry.tb_plugin`), which reads the run's ``telemetry.jsonl``: with
``telemetry_dir`` (the adapters pass their checkpoint directory) this writes
``coci-telemetry.json`` next to the event files, naming that directory, so that the tab finds
the run under any TensorBoard log directory above it.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any, SupportsFloat, SupportsIndex

from coci_core.errors import ConfigError, StorageError
from coci_core.telemetry import Event, RestartEvent, RestoreEvent, SaveEvent, UploadEvent
from coci_core.telemetry.timeline import write_log_dir, write_pointer

if TYPE_CHECKING:
    from coci_core.planner.planner import PlannerReport

__all__ = ["TensorBoardTelemetry"]

logger = logging.getLogger(__name__)

_INSTALL_HINT = "install it with: pip install 'coci[tensorboard]'"
_WRITER_METHODS = ("add_scalar", "flush")


def _check_step(step: Any) -> int:
    if isinstance(step, bool):
        raise ConfigError(f"'step' must be an integer: {step!r}")
    try:
        k = operator.index(step)
    except TypeError:
        raise ConfigError(f"'step' must be an integer: {step!r}") from None
    if k < 0:
        raise ConfigError(f"'step' must be >= 0: {step!r}")
    return k


def _check_number(name: str, value: Any) -> float:
    # numbers.Real, numpy scalars and one-element tensors; NaN and inf are kept (a diverging
    # loss is worth seeing), strings and bools are refused
    if isinstance(value, (bool, str, bytes)) or not hasattr(type(value), "__float__"):
        raise ConfigError(f"{name!r} must be a real number: {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"{name!r} must be a real number: {value!r}") from None


def _open_summary_writer(log_dir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            f"'log_dir' needs the tensorboard package, which is not installed; {_INSTALL_HINT}"
        ) from e
    if os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ConfigError(f"'log_dir' must be a directory: {log_dir!r} is a file")
    try:
        return SummaryWriter(log_dir=log_dir)
    except OSError as e:
        raise StorageError.wrap(
            f"cannot create the TensorBoard log directory {log_dir!r}", e
        ) from e


class TensorBoardTelemetry:
    """Writes the saves' costs and the plan's expected overhead as TensorBoard scalars (tags:
    module docstring), and points the coci tab at ``telemetry_dir``.

    Thread-safe: save events arrive from the writer thread while the training thread records
    plans; every write holds one lock.

    Args:
        log_dir: a directory for a new ``torch.utils.tensorboard.SummaryWriter`` (needs the
            ``tensorboard`` package).
        writer: a writer the host already has instead (e.g. Lightning's
            ``TensorBoardLogger.experiment``): anything with ``add_scalar`` and ``flush`` like
            ``SummaryWriter``. It is flushed by :meth:`close`, never closed.
        telemetry_dir: the directory (or fsspec URL) of the run's ``telemetry.jsonl``, i.e.
            its checkpoint directory: written to ``coci-telemetry.json`` in the writer's
            directory, where the coci tab looks for it.

    Raises:
        ConfigError: if neither or both of ``log_dir`` and ``writer`` are given, either is of
            the wrong kind, ``log_dir`` is a file, or tensorboard is not installed.
        StorageError: if the log directory cannot be created.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        writer: Any | None = None,
        telemetry_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if log_dir is None and writer is None:
            raise ConfigError("'log_dir' or 'writer' must be given: both are None")
        if log_dir is not None and writer is not None:
            raise ConfigError(
                f"'log_dir' and 'writer' cannot both be given: log_dir={log_dir!r}, "
                f"writer={writer!r}"
            )
        if writer is not None:
            missing = [m for m in _WRITER_METHODS if not callable(getattr(writer, m, None))]
            if missing:
                raise ConfigError(
                    f"'writer' must be a SummaryWriter (with {', '.join(_WRITER_METHODS)}); "
                    f"{type(writer).__name__} has no {', '.join(missing)}: {writer!r}"
                )
            self._writer = writer
            self._owns_writer = False
        else:
            if not isinstance(log_dir, (str, os.PathLike)):
                raise ConfigError(f"'log_dir' must be a str or os.PathLike: {log_dir!r}")
            path = os.fspath(log_dir)
            if not isinstance(path, str) or not path:
                raise ConfigError(f"'log_dir' must be a non-empty path: {log_dir!r}")
            self._writer = _open_summary_writer(path)
            self._owns_writer = True
        self._lock = threading.Lock()
        self._closed = False
        self._warned_closed = False
        if telemetry_dir is not None:
            self._point_to(telemetry_dir)

    def _point_to(self, telemetry_dir: str | os.PathLike[str]) -> None:
        """Write the coci tab's pointer next to the writer's event files (a warning if not)."""
        get_logdir = getattr(self._writer, "get_logdir", None)
        log_dir = get_logdir() if callable(get_logdir) else getattr(self._writer, "log_dir", None)
        if not isinstance(log_dir, (str, os.PathLike)) or "://" in os.fspath(log_dir):
            return  # not a local directory: the tab finds telemetry.jsonl under the logdir
        try:
            write_pointer(log_dir, telemetry_dir)
            write_log_dir(telemetry_dir, log_dir)
        except OSError as e:
            logger.warning("coci: cannot write the coci tab's pointer in %s: %s", log_dir, e)

    # ------------------------------------------------------------------ inputs

    def __call__(self, event: Event) -> None:
        """Write one save's costs (a ``CheckpointManager`` listener; any thread); restores,
        restarts and uploads are only in the coci tab.

        Raises:
            ConfigError: if ``event`` is not a SaveEvent, RestoreEvent, RestartEvent or
                UploadEvent.
        """
        if isinstance(event, SaveEvent):
            self._write(event.step, self._save_scalars(event))
        elif not isinstance(event, (RestoreEvent, UploadEvent, RestartEvent)):
            raise ConfigError(
                "'event' must be a SaveEvent, a RestoreEvent, a RestartEvent or an UploadEvent: "
                f"{event!r}"
            )

    def record_plan(self, step: SupportsIndex, report: PlannerReport) -> None:
        """Write the plan's expected overhead in ``report`` (from ``Planner.report()``) at
        ``step``.

        Raises:
            ConfigError: if ``step`` is not an integer >= 0 or ``report`` not a PlannerReport.
        """
        from coci_core.planner.planner import PlannerReport

        k = _check_step(step)
        if not isinstance(report, PlannerReport):
            raise ConfigError(f"'report' must be a PlannerReport: {report!r}")
        ov = report.expected_overhead
        if ov is not None:
            scalars = [("coci/expected_overhead_s", ov.wall_s)]
            if ov.without_termination_objective_s is not None:
                # how much of the plan's change comes from the termination hazard
                scalars += [
                    ("coci/termination/stop_probability", report.stop_probability),
                    ("coci/termination/without_objective_s", ov.without_termination_objective_s),
                    ("coci/termination/share_of_gain", ov.termination_share or 0.0),
                ]
            self._write(k, scalars)

    def record_loss(
        self, step: SupportsIndex, loss: SupportsFloat, fitted: SupportsFloat | None = None
    ) -> None:
        """Check the arguments; the loss and its fit are drawn by the coci tab (from
        ``telemetry.jsonl``), not written as scalars (the run logs its own loss).

        Raises:
            ConfigError: if ``step`` is not an integer >= 0 or a value is not a real number.
        """
        _check_step(step)
        _check_number("loss", loss)
        if fitted is not None:
            _check_number("fitted", fitted)

    # ------------------------------------------------------------------ lifecycle

    def flush(self) -> None:
        """Write everything recorded so far to the event file."""
        with self._lock:
            if not self._closed:
                self._writer.flush()

    def close(self) -> None:
        """Flush, and close the writer if this object created it; later records are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._owns_writer:
                self._writer.close()
            else:
                self._writer.flush()

    def __enter__(self) -> TensorBoardTelemetry:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _save_scalars(event: SaveEvent) -> list[tuple[str, float]]:
        if event.outcome == "skipped":  # the loop was held for no more than a check
            return []
        if event.outcome == "failed":  # the loop was held; nothing became durable
            return [("coci/stall_ms", 1e3 * event.stall_s)]
        return [
            ("coci/stall_ms", 1e3 * event.stall_s),
            ("coci/persist_s", event.persist_s),
            ("coci/checkpoint_MB", event.bytes_written / 1e6),
        ]

    def _write(self, step: int, scalars: list[tuple[str, float]]) -> None:
        with self._lock:
            if not self._writable():
                return
            try:
                for tag, value in scalars:
                    self._writer.add_scalar(tag, value, step)
            except OSError as e:  # "Writer is closed": the host closed its writer meanwhile
                if self._owns_writer:
                    raise
                # (the Trainer's TensorBoardCallback closes its writer at the train's end,
                # while a notice's save still reports from the writer thread)
                self._closed = self._warned_closed = True
                logger.info(
                    "coci: the TensorBoard writer coci shares was closed by its owner (%s); "
                    "coci's later TensorBoard scalars are dropped (telemetry.jsonl and coci "
                    "report keep them)",
                    e,
                )

    def _writable(self) -> bool:
        """False (warning once) after close. Called with the lock held."""
        if not self._closed:
            return True
        if not self._warned_closed:
            self._warned_closed = True
            logger.warning("coci: TensorBoard telemetry is closed; dropping later records")
        return False
