"""SaveWriter: what the writer thread does with each save of a manager.

It finishes a ``block=False`` copy, takes the directory's lease again where it lapsed, makes
room, numbers the commit (the order restores and retention go by), writes and commits, reports
the outcome through the save's handle, then applies retention and hands the step to the remote
tier. Failures are kept until the training loop is told of them (:meth:`raise_failed`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from coci_core.engine.directory import retention
from coci_core.engine.directory.steps import step_infos
from coci_core.engine.directory.tiers import RemoteTier
from coci_core.engine.format.manifest import MANIFEST_NAME, MAX_SEQUENCE, step_dir_name
from coci_core.engine.group import RankGroup
from coci_core.engine.handle import SaveHandle
from coci_core.engine.lifecycle import Owner
from coci_core.engine.restore.restore import highest_sequence
from coci_core.engine.save.compress import PieceEncoder
from coci_core.engine.save.entries import EntriesTemplate
from coci_core.engine.save.persist import PersistJob, write_checkpoint
from coci_core.engine.save.snapshot import Snapshotter
from coci_core.errors import BackgroundSaveError, CorruptCheckpointError, StateChangedError
from coci_core.knobs import ROOM_MARGIN_BYTES
from coci_core.storage import Storage
from coci_core.telemetry import SaveEvent

__all__ = ["QueuedSave", "SaveWriter"]

logger = logging.getLogger(__name__)


@dataclass(eq=False, repr=False)
class SaveWriter:
    """Runs the saves of one manager on its writer thread (:meth:`run`), one at a time.

    It holds no reference to the manager (``run_id`` and ``emit`` reach the manager's current
    run and listeners through a weak reference), so that an unclosed manager is freed once its
    queued saves are done.
    """

    storage: Storage
    group: RankGroup
    keep_last: int | None
    encoder: PieceEncoder
    snapshotter: Snapshotter
    owner: Owner
    remote: RemoteTier | None
    emit: Callable[[SaveEvent], None]
    run_id: Callable[[], str]
    #: leaves found changed during a background copy: copied by save() itself from then on
    hot_keys: set[str] = field(default_factory=set)
    #: ``(step, version)`` of the run's steps its restore passed over as damaged: retention
    #: neither counts nor deletes them (replaced whole by the manager, never changed)
    damaged: frozenset[tuple[int, int]] = frozenset()
    #: steps of the run that retention keeps besides the newest ``keep_last`` (replaced whole
    #: by the manager, never changed: :meth:`CheckpointManager.keep_also`)
    also_keep: frozenset[int] = frozenset()
    #: the manifest entries' JSON of the last save (see :mod:`.entries`): this thread only
    template: EntriesTemplate = field(default_factory=EntriesTemplate)
    _failed: list[SaveHandle] = field(default_factory=list)
    _failed_lock: threading.Lock = field(default_factory=threading.Lock)
    # The commit order of the saves (Manifest.sequence): the highest sequence in the directory
    # and its remote tier, read once under the lease on this thread (None until then), and at
    # least that of the restored checkpoint.
    _sequence: int | None = None
    _lease_generation: int = 0
    _sequence_floor: int = 0
    #: the sequence of this writer's first commit (None before it): any commit of the run
    #: below it and above the restored checkpoint's was another process's
    first_sequence: int | None = None

    def commit_after(self, sequence: int) -> None:
        """Later saves are committed after ``sequence`` (that of a restored checkpoint)."""
        self._sequence_floor = max(self._sequence_floor, sequence)
        self.first_sequence = None  # this writer's commits after that restore are to come

    def run(self, job: PersistJob, handle: SaveHandle) -> None:
        """Make ``job`` durable and finish ``handle``; never raises."""
        # WARNING: runs on the writer thread; it must never touch the training process group.
        snapshot = job.snapshot
        try:
            if not handle.block:  # the copy overlaps the caller's next work
                self.snapshotter.copy(snapshot, background=True)
            lease = self.owner.lease
            if self.group.is_coordinator and lease is not None:
                # an object store's lease that lapsed in an outage is taken again, or this
                # save fails (StorageError) without writing: another writer may own it now
                lease.ensure_held()
                if lease.generation != self._lease_generation:  # another writer may have
                    self._lease_generation = lease.generation  # committed meanwhile
                    self._sequence = None
            resaved = self.group.is_coordinator and self.storage.exists(
                f"{step_dir_name(job.step, job.version)}/{MANIFEST_NAME}"
            )
            if self.group.is_coordinator:
                retention.make_room(
                    self.storage,
                    keep_last=self.keep_last,
                    run_id=self.run_id(),
                    step=job.step,
                    needed_bytes=job.snapshot.arena.total_bytes * job.group.world_size
                    + ROOM_MARGIN_BYTES,
                    next_base=self.encoder.base_step,
                    damaged=self.damaged,
                    also_keep=self.also_keep,
                )
                job.sequence = self._next_sequence()
            result = write_checkpoint(self.storage, job, self.encoder, self.template)
        except BaseException as e:
            error: BaseException | None = e
            with contextlib.suppress(Exception):  # the handle must finish: close() waits on it
                error = retention.explain_full_disk(self.storage, e, self.keep_last)
            event = handle.new_event(outcome="failed", error=f"{type(error).__name__}: {error}")
            if isinstance(error, StateChangedError):
                # The loop changed tensors in place while the copy ran (a large buffer that
                # the forward pass updates, say): later saves copy them before returning.
                self.hot_keys.update(error.keys)
                logger.warning("coci: save of step %d given up: %s", job.step, error)
            else:
                logger.error("coci: save of step %d failed: %s", job.step, error)
        else:
            error = None
            event = handle.new_event(
                outcome="committed",
                path=result.path,
                bytes_written=result.bytes_written,
                raw_bytes=result.raw_bytes,
                compressed=result.encoded,
            )
            # DEBUG: the adapters' verbose=True line tells the user of each save (once)
            logger.debug(
                "coci: saved step %d to %s/%s (%.1f MB, stall %.3f s, durable after %.3f s)",
                job.step,
                self.storage.url,
                result.path,
                result.bytes_written / 1e6,
                event.stall_s,
                event.time_to_durable_s,
            )

        def notify(event: SaveEvent) -> None:
            # reported by the next save/wait/close if nobody waits on it; a save given up for
            # a changed tensor is not an error of the training loop's (the next one copies it)
            if error is not None and not isinstance(error, StateChangedError):
                with self._failed_lock:
                    self._failed.append(handle)
            self.emit(event)

        handle.finish(event, error, notify=notify)
        if event.outcome == "committed" and self.group.is_coordinator:
            # After done: deleting old steps (0.3 s per GB here) must not hold up wait() or
            # the next save; the next job on this thread starts once it is finished.
            if resaved:
                retention.drop_dependants(self.storage, job.step, job.run)
            if self.remote is not None:
                self.remote.submit(job.step)
            self._apply_retention(newest=job.step, done_seq=job.seq)

    def raise_failed(self) -> None:
        """Raise for the saves that failed since the last call, unless each was reported.

        Raises:
            BackgroundSaveError: naming the failed steps, from the first one's error.
        """
        with self._failed_lock:
            failed, self._failed = self._failed, []
        unreported = [(h.step, e) for h in failed if (e := h.take_unreported_error()) is not None]
        if not unreported:
            return
        first_step, first_error = unreported[0]
        steps = ", ".join(str(step) for step, _ in unreported)
        raise BackgroundSaveError(
            f"background save of step {steps} failed: {first_error}; committed checkpoints "
            "are intact",
            step=first_step,
        ) from first_error

    def _next_sequence(self) -> int:
        """The commit sequence of the next save (on the coordinator's writer thread, under the
        directory's lease: no other writer commits meanwhile): 1 + the highest committed in
        the directory and in the remote tier, and above the restored checkpoint's, so that the
        order survives any wall clock and a move between nodes and tiers."""
        remote = self.remote.highest_sequence if self.remote is not None else 0
        if self._sequence is None:
            self._sequence = highest_sequence(self.storage)
        # the remote's is read again: a remote that was down when the run started is read
        # once its lease is taken
        top = max(self._sequence, self._sequence_floor, remote)
        if top >= MAX_SEQUENCE:  # the reader bounds what this read: only a forged one is here
            raise self._sequence_exhausted(top)
        self._sequence = top + 1
        if self.first_sequence is None:
            self.first_sequence = self._sequence
        return self._sequence

    def _sequence_exhausted(self, top: int) -> CorruptCheckpointError:
        """The error of a save that cannot be numbered after a (forged) checkpoint at
        :data:`MAX_SEQUENCE`: it fails rather than commit a number the reader refuses."""
        steps = [i.step for i in step_infos(self.storage) if i.intact and i.sequence == top]
        where = f"step {steps[0]} of {self.storage.url}" if steps else "a restored checkpoint"
        return CorruptCheckpointError(
            f"{where} records commit sequence {top}, the highest a checkpoint may record (no "
            "run commits that often: it is damaged or forged), so no save can be ordered "
            "after it; nothing was committed: remove that step's directory",
            step=steps[0] if steps else None,
        )

    def _apply_retention(self, *, newest: int, done_seq: int) -> None:
        # Retention never fails a save that is already durable: its errors are logged.
        try:
            if self.keep_last is not None:
                retention.apply_keep_last(
                    self.storage,
                    keep_last=self.keep_last,
                    run_id=self.run_id(),
                    newest=newest,
                    next_base=self.encoder.base_step,
                    damaged=self.damaged,
                    also_keep=self.also_keep,
                )
            retention.remove_uncommitted(self.storage, self.group, done_seq=done_seq, newest=newest)
        except Exception as e:
            logger.warning("coci: retention after step %d failed: %s", newest, e)


@dataclass(frozen=True, eq=False, repr=False)
class QueuedSave:
    """One save queued on a manager's writer thread: ``run`` makes it durable.

    It holds ``holder`` (the manager) until the save is done, so that a manager that nothing
    else references is never freed with a save still pending.
    """

    writer: SaveWriter
    job: PersistJob
    handle: SaveHandle
    holder: object

    def run(self) -> None:
        """Make the save durable and finish its handle; never raises."""
        self.writer.run(self.job, self.handle)
