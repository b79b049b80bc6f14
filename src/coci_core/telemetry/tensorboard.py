"""Writes coci's telemetry (saves, restores, the planner's plan, the loss fit) to TensorBoard.

``TensorBoardTelemetry`` is a listener for :class:`~coci_core.CheckpointManager` (it is called
with each :class:`~coci_core.SaveEvent` and :class:`~coci_core.RestoreEvent`) and has two
methods the adapters call: :meth:`~TensorBoardTelemetry.record_plan` when the plan changes and
at checkpoints, and :meth:`~TensorBoardTelemetry.record_loss` with the observed and fitted loss.

Called as: 1) (rank 0) ``TensorBoardTelemetry(log_dir)`` or ``TensorBoardTelemetry(writer=w)``;
2) (rank 0, any thread) ``telemetry(event)``, ``record_plan(step, report)``,
``record_loss(step, loss, fitted)``; 3) (rank 0) ``flush()`` and ``close()``.

Scalars written (the x axis is always a training step):

=================================== ==========================================================
tag                                 value at step ``x``
=================================== ==========================================================
``coci/save/committed_step``        ``x``: a save of step ``x`` was committed (durable)
``coci/save/skipped_step``          ``x``: the save of step ``x`` was skipped (``on_busy="skip"``)
``coci/save/failed_step``           ``x``: the save of step ``x`` failed (nothing was published)
``coci/save/stall_ms``              training-loop stall of the save (committed and failed saves)
``coci/save/copy_ms``               copy into host buffers (committed saves)
``coci/save/persist_ms``            end of the copy to the commit (committed saves)
``coci/save/time_to_durable_ms``    ``save`` call to the commit (committed saves)
``coci/save/bytes_written``         bytes of data and manifest written (committed saves)
``coci/save/compression_ratio``     raw bytes / bytes written (committed saves)
``coci/restore/seconds``            duration of the restore of step ``x``
``coci/restore/bytes_read``         bytes read by that restore
``coci/plan/next_step``             the first of the plan's next steps, as planned at step ``x``
                                    (below ``x`` when that checkpoint is overdue)
``coci/plan/planned_step``          ``x``: step ``x`` is a planned checkpoint (see below)
``coci/plan/interval_steps``        steps between the planned checkpoints around ``x``
``coci/plan/mtbf_s``                the MTBF (job level) the plan was made with
``coci/overhead/plan_wall_s``       the plan's expected wall-clock overhead over its horizon
``coci/overhead/daly_wall_s``       the same for Daly's uniform plan
``coci/overhead/plan_objective_s``  the plan's expected overhead as its objective counts it
``coci/overhead/daly_objective_s``  the same for Daly's uniform plan
``coci/loss/observed``              the training loss given to ``record_loss``
``coci/loss/fitted``                the planner's fitted loss curve at ``x`` (when trusted)
=================================== ==========================================================

A skipped save writes only ``coci/save/skipped_step``: it stalled the loop for no more than a
check, and it is reported from the training thread, so writing its stall would mix two threads'
steps in one series. A failed save writes ``coci/save/failed_step`` and its stall (the loop was
held), but no persist time, durability time or bytes: nothing became durable.

TensorBoard's data server keeps each series' steps increasing: a point at step ``s`` hides the
points at steps ``>= s`` already written to that tag (this is how it shows a resumed run). So
``coci/plan/planned_step`` gets one point per planned step the first time a plan holds it; when a
later plan moves its upcoming checkpoints, the revised steps are written again from the first
one that changed, which hides the stale points after it. Steps a plan says are already due (at
or before the step recorded) are not drawn there: they are taken at the next step.

Values are TensorBoard ``simple_value`` scalars, i.e. float32: steps and byte counts above
2**24 are rounded.

The custom-scalars layout (written once per writer) has one category ``"coci"`` with the
multiline charts of :data:`LAYOUT`: ``"planned vs actual"`` (the plan series and the
committed, skipped and failed steps), ``"cost"`` (measured save times in ms beside the
expected overhead of the plan and of Daly in s: use the chart's log scale), ``"loss fit"`` and
``"compression"`` (raw bytes / bytes written per save).
A TensorBoard run shows one custom-scalars layout: on a writer that already has one (written by
the host or the user), the one written last is shown.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, SupportsFloat, SupportsIndex

from coci_core.errors import ConfigError, StorageError
from coci_core.telemetry import Event, RestoreEvent, SaveEvent, UploadEvent

if TYPE_CHECKING:
    from coci_core.planner.planner import PlannerReport

__all__ = ["LAYOUT", "LAYOUT_TITLE", "TensorBoardTelemetry"]

logger = logging.getLogger(__name__)

LAYOUT_TITLE = "coci"

LAYOUT: Mapping[str, tuple[str, ...]] = {
    "planned vs actual": (
        "coci/plan/next_step",
        "coci/plan/planned_step",
        "coci/save/committed_step",
        "coci/save/skipped_step",
        "coci/save/failed_step",
    ),
    "cost": (
        "coci/save/stall_ms",
        "coci/save/persist_ms",
        "coci/save/time_to_durable_ms",
        "coci/overhead/plan_wall_s",
        "coci/overhead/daly_wall_s",
        "coci/overhead/plan_objective_s",
        "coci/overhead/daly_objective_s",
    ),
    "loss fit": ("coci/loss/observed", "coci/loss/fitted"),
    "compression": ("coci/save/compression_ratio",),
}
"""Chart title -> the tags it draws, in the custom-scalars category :data:`LAYOUT_TITLE`."""

_INSTALL_HINT = "install it with: pip install 'coci[tensorboard]'"
_WRITER_METHODS = ("add_scalar", "add_custom_scalars", "flush")

# Writers that already hold the layout; a second telemetry on the same writer must not
# write it again (torch's add_custom_scalars may be called once per writer).
_layout_lock = threading.Lock()
_layout_written: weakref.WeakSet[Any] = weakref.WeakSet()


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
    """Writes saves, restores, plans and losses as TensorBoard scalars (tags: module docstring).

    Thread-safe: save events arrive from the writer thread while the training thread records
    plans and losses; every write holds one lock.

    Args:
        log_dir: a directory for a new ``torch.utils.tensorboard.SummaryWriter`` (needs the
            ``tensorboard`` package).
        writer: a writer the host already has instead (e.g. Lightning's
            ``TensorBoardLogger.experiment``): anything with ``add_scalar``,
            ``add_custom_scalars`` and ``flush`` like ``SummaryWriter``. It is flushed by
            :meth:`close`, never closed.

    Raises:
        ConfigError: if neither or both of ``log_dir`` and ``writer`` are given, either is of
            the wrong kind, ``log_dir`` is a file, or tensorboard is not installed.
        StorageError: if the log directory cannot be created.
    """

    def __init__(
        self, log_dir: str | os.PathLike[str] | None = None, *, writer: Any | None = None
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
        self._planned: list[int] = []  # planned_step points written that are still ahead
        self._write_layout()

    # ------------------------------------------------------------------ inputs

    def __call__(self, event: Event) -> None:
        """Write one save or restore event (a ``CheckpointManager`` listener; any thread).

        Raises:
            ConfigError: if ``event`` is neither a SaveEvent nor a RestoreEvent.
        """
        if isinstance(event, SaveEvent):
            self._write(event.step, self._save_scalars(event))
        elif isinstance(event, RestoreEvent):
            self._write(
                event.step,
                [
                    ("coci/restore/seconds", event.seconds),
                    ("coci/restore/bytes_read", float(event.bytes_read)),
                ],
            )
        elif isinstance(event, UploadEvent):
            if event.outcome == "committed":
                self._write(
                    event.step,
                    [
                        ("coci/upload/seconds", event.seconds),
                        ("coci/upload/bytes", float(event.bytes_uploaded)),
                    ],
                )
            elif event.outcome == "failed":
                self._write(event.step, [("coci/upload/failed_attempt", float(event.attempt))])
        else:
            raise ConfigError(
                f"'event' must be a SaveEvent, a RestoreEvent or an UploadEvent: {event!r}"
            )

    def record_plan(self, step: SupportsIndex, report: PlannerReport) -> None:
        """Write the plan in ``report`` (from ``Planner.report()``) at ``step``.

        Raises:
            ConfigError: if ``step`` is not an integer >= 0 or ``report`` not a PlannerReport.
        """
        from coci_core.planner.planner import PlannerReport

        k = _check_step(step)
        if not isinstance(report, PlannerReport):
            raise ConfigError(f"'report' must be a PlannerReport: {report!r}")
        scalars: list[tuple[str, float]] = []
        if report.next_steps:
            scalars.append(("coci/plan/next_step", float(report.next_steps[0])))
        if report.interval_steps is not None:
            scalars.append(("coci/plan/interval_steps", float(report.interval_steps)))
        if report.mtbf_s is not None:
            scalars.append(("coci/plan/mtbf_s", float(report.mtbf_s)))
        ov = report.expected_overhead
        if ov is not None:
            scalars += [
                ("coci/overhead/plan_wall_s", ov.wall_s),
                ("coci/overhead/daly_wall_s", ov.daly_wall_s),
                ("coci/overhead/plan_objective_s", ov.objective_s),
                ("coci/overhead/daly_objective_s", ov.daly_objective_s),
            ]
            if ov.without_termination_objective_s is not None:
                # how much of the plan's change comes from the termination hazard
                scalars += [
                    ("coci/termination/stop_probability", report.stop_probability),
                    ("coci/termination/without_objective_s", ov.without_termination_objective_s),
                    ("coci/termination/share_of_gain", ov.termination_share or 0.0),
                ]
        with self._lock:
            if not self._writable():
                return
            for tag, value in scalars:
                self._writer.add_scalar(tag, value, k)
            for s in self._new_planned_steps(k, report.next_steps):
                self._writer.add_scalar("coci/plan/planned_step", float(s), s)

    def record_loss(
        self, step: SupportsIndex, loss: SupportsFloat, fitted: SupportsFloat | None = None
    ) -> None:
        """Write the observed ``loss`` and the ``fitted`` curve's value (if any) at ``step``.

        Non-finite losses are written as they are.

        Raises:
            ConfigError: if ``step`` is not an integer >= 0 or a value is not a real number.
        """
        k = _check_step(step)
        scalars = [("coci/loss/observed", _check_number("loss", loss))]
        if fitted is not None:
            scalars.append(("coci/loss/fitted", _check_number("fitted", fitted)))
        self._write(k, scalars)

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

    def _write_layout(self) -> None:
        layout = {
            LAYOUT_TITLE: {title: ["Multiline", list(tags)] for title, tags in LAYOUT.items()}
        }
        with _layout_lock:
            try:
                if self._writer in _layout_written:
                    return
            except TypeError:  # not weak-referenceable (or hashable): cannot tell, write it
                self._writer.add_custom_scalars(layout)
                return
            self._writer.add_custom_scalars(layout)
            _layout_written.add(self._writer)

    @staticmethod
    def _save_scalars(event: SaveEvent) -> list[tuple[str, float]]:
        if event.outcome == "skipped":
            return [("coci/save/skipped_step", float(event.step))]
        if event.outcome == "failed":
            return [
                ("coci/save/failed_step", float(event.step)),
                ("coci/save/stall_ms", 1e3 * event.stall_s),
            ]
        return [
            ("coci/save/committed_step", float(event.step)),
            ("coci/save/stall_ms", 1e3 * event.stall_s),
            ("coci/save/copy_ms", 1e3 * event.copy_s),
            ("coci/save/persist_ms", 1e3 * event.persist_s),
            ("coci/save/time_to_durable_ms", 1e3 * event.time_to_durable_s),
            ("coci/save/bytes_written", float(event.bytes_written)),
            ("coci/save/compression_ratio", event.raw_bytes / max(1, event.bytes_written)),
        ]

    def _new_planned_steps(self, step: int, next_steps: tuple[int, ...]) -> list[int]:
        """The planned steps to write now, keeping the planned_step series' steps increasing.

        Called with the lock held.
        """
        ahead = [s for s in self._planned if s > step]
        plan = sorted({int(s) for s in next_steps if s > step})
        n = min(len(ahead), len(plan))
        first_change = next((i for i in range(n) if ahead[i] != plan[i]), n)
        if first_change < n:  # the plan moved: rewrite it from the first change
            self._planned = plan
            return plan[first_change:]
        if len(plan) > n:  # the same plan, reaching further
            self._planned = plan
            return plan[n:]
        self._planned = ahead
        return []

    def _write(self, step: int, scalars: list[tuple[str, float]]) -> None:
        with self._lock:
            if not self._writable():
                return
            for tag, value in scalars:
                self._writer.add_scalar(tag, value, step)

    def _writable(self) -> bool:
        """False (warning once) after close. Called with the lock held."""
        if not self._closed:
            return True
        if not self._warned_closed:
            self._warned_closed = True
            logger.warning("coci: TensorBoard telemetry is closed; dropping later records")
        return False
