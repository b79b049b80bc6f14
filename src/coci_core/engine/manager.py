"""CheckpointManager: wires snapshot, persist, commit, retention and restore together."""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from coci_core.engine import retention
from coci_core.engine.compress import CompressionPolicy, PieceEncoder, check_policy
from coci_core.engine.group import RankGroup
from coci_core.engine.inplace import InPlaceTargets, in_place_targets
from coci_core.engine.lease import Lease, acquire_lease
from coci_core.engine.manifest import MANIFEST_NAME, Manifest, step_dir_name
from coci_core.engine.partition import DEFAULT_CHUNK_BYTES, Share, partition
from coci_core.engine.persist import PersistJob, PersistWorker, write_checkpoint
from coci_core.engine.restore import (
    committed_steps,
    highest_sequence,
    read_manifest,
    restore_newest,
    resume_order,
    step_infos,
    verify_checkpoint,
)
from coci_core.engine.snapshot import Snapshot, Snapshotter
from coci_core.engine.stateful import Stateful
from coci_core.engine.tiers import RemoteTier
from coci_core.engine.tree import ArrayLeaf, FlatState, flatten_state
from coci_core.errors import (
    BackgroundSaveError,
    CheckpointError,
    CociError,
    ConfigError,
    DirectoryInUseError,
    NoCheckpointError,
    StateChangedError,
    StepExistsError,
    StorageError,
)
from coci_core.knobs import ROOM_MARGIN_BYTES
from coci_core.storage import Storage, open_storage
from coci_core.telemetry import Listener, RestoreEvent, SaveEvent, UploadEvent, emit

__all__ = ["CheckpointManager", "SaveHandle"]

logger = logging.getLogger(__name__)

OnBusy = Literal["wait", "skip"]
_ON_BUSY = ("wait", "skip")


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
            self._check_copy(0)
        return self._done.is_set()

    @property
    def skipped(self) -> bool:
        """Whether the save was skipped because the previous persist was still running."""
        return self._event is not None and self._event.outcome == "skipped"

    @property
    def event(self) -> SaveEvent | None:
        """What the save did, once it is done."""
        return self._event

    # -- completion: the manager reports through these, the handle keeps its own state ----

    def _add_stall(self, seconds: float, *, update_wait: bool = False) -> None:
        self._stall_s += seconds
        if update_wait:
            self._update_wait_s += seconds

    def _finish(
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

    def _call(self, callback: Callable[[SaveHandle], None]) -> None:
        try:
            callback(self)
        except Exception:
            logger.exception("coci: a done callback of %r failed", self)

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
        if not self._check_copy(timeout) or not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} not done after {timeout} s")
        if self._error is not None:
            self._reported = True
        return self._error

    def _wait_done(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)

    def _check_copy(self, timeout_s: float | None = None, *, any_thread: bool = False) -> bool:
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
            self._add_stall(time.perf_counter() - started, update_wait=True)
        snapshot.check_copy()
        return True

    def _take_unreported_error(self) -> BaseException | None:
        if self._reported or self._error is None:
            return None
        self._reported = True
        return self._error

    def wait(self, timeout_s: float | None = None) -> SaveEvent:
        """Block until the save is durable (or skipped) and return what it did.

        Raises:
            BackgroundSaveError: the save failed; nothing was published.
            TimeoutError: ``timeout_s`` passed first.
        """
        if not self._check_copy(timeout_s) or not self._done.wait(timeout_s):
            raise TimeoutError(f"save of step {self.step} not durable after {timeout_s} s")
        if self._error is not None:
            self._reported = True
            raise BackgroundSaveError(
                f"background save of step {self.step} failed: {self._error}", step=self.step
            ) from self._error
        if self._event is None:
            raise AssertionError("a finished save has no event")
        return self._event


_LIVE: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


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
        manager._close_at_exit()


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


class CheckpointManager:
    """Two-phase, asynchronous, atomic and verified checkpoints of a training state.

    Args:
        directory: a local path, an fsspec URL (``memory://``, ``file://``, ``s3://``...) or a
            :class:`~coci_core.storage.Storage`.
        keep_last: how many committed checkpoints of this run to keep (``None`` keeps all).
            An old one is deleted only after a newer one is durable; checkpoints of other runs
            in the directory are never deleted (see ``run_id``).
        on_busy: what ``save`` does while the previous persist is still running: ``"wait"``
            for it (the wait counts as stall) or ``"skip"`` this save.
        strict: when the newest checkpoint is damaged, raise instead of restoring the newest
            intact one.
        allow_torch_save: store values that are not tensors, arrays or JSON data with
            ``torch.save``, and load them with ``torch.load(weights_only=True)``. Off by default:
            such values are refused with an error naming them.
        listeners: callables that receive a :class:`SaveEvent` or :class:`RestoreEvent`
            (from the background thread for saves).
        worker_niceness: how much to lower the writer thread's CPU priority (0 keeps it).
        storage_options: passed to fsspec for URLs.
        group: the ranks that write each checkpoint together. Default: in an initialized
            ``torch.distributed`` job of several processes, its default group
            (:meth:`RankGroup.default`: every rank must make its manager), else this process
            alone. Each rank then snapshots and writes only its share of the (replicated)
            state, rank 0 commits once every rank succeeded, and only rank 0 deletes old
            checkpoints. ``RankGroup.single()`` opts out: a manager of this process alone
            (give it a directory of its own: one writer per directory).
        chunk_bytes: the unit in which the state is split over ranks (a multiple of 64).
        compression: ``"auto"`` (default: compress only where it shortens the time to
            durable; raw on a fast local disk), ``"none"``, ``"lossless"``, ``"lossy"``
            (opt-in, bounded error); or a
            :class:`~coci_core.engine.compress.CompressionPolicy`. See docs/compression.md.
        compression_options: knobs of :class:`~coci_core.engine.compress.CompressionPolicy`
            (``full_every``, ``max_lossy_generations``, ``lossy_bits``, ...).
        remote: a second, remote tier (an fsspec URL such as ``"s3://bucket/run"``, a path or
            a Storage): each checkpoint committed in ``directory`` is then copied there in the
            background and committed there too (see :mod:`coci_core.engine.tiers`); a restore
            takes the newest intact checkpoint of either tier, from ``directory`` when it is
            intact there, else from ``remote`` (a damaged local copy, or a new node with an
            empty disk).
        remote_keep_last: committed checkpoints kept on the remote tier (None: all).
        remote_storage_options: fsspec options of ``remote`` (credentials, endpoint).
        remote_upload_every: copy every this many checkpoints to ``remote`` (and the newest
            at ``close``); see :func:`coci_core.planner.two_level.plan_two_levels`.

    Runs: each manager starts a new run (``run_id``, stored in every manifest); a restore
    continues the restored checkpoint's run. Restoring without a step takes the newest
    intact checkpoint of the newest run (by commit sequence, never by step number or wall
    clock; with ``remote``, of either tier), retention counts and deletes only this run's
    checkpoints, and ``save`` of a step the directory already holds raises
    :class:`StepExistsError` unless ``overwrite=True``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | Storage,
        *,
        keep_last: int | None = 3,
        on_busy: OnBusy = "wait",
        strict: bool = False,
        allow_torch_save: bool = False,
        listeners: Iterable[Listener] = (),
        worker_niceness: int = 5,
        storage_options: Mapping[str, Any] | None = None,
        group: RankGroup | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        compression: str | CompressionPolicy | None = "auto",
        compression_options: Mapping[str, Any] | None = None,
        remote: str | os.PathLike[str] | Storage | None = None,
        remote_keep_last: int | None = 10,
        remote_storage_options: Mapping[str, Any] | None = None,
        remote_upload_every: int = 1,
    ) -> None:
        retention.check_keep_last(keep_last)
        retention.check_keep_last(remote_keep_last, "remote_keep_last")
        if type(remote_upload_every) is not int or remote_upload_every < 1:
            raise ConfigError(
                f"'remote_upload_every' must be an integer >= 1: {remote_upload_every!r}"
            )
        if on_busy not in _ON_BUSY:
            raise ConfigError(f"'on_busy' must be one of {_ON_BUSY}: {on_busy!r}")
        if type(worker_niceness) is not int or not 0 <= worker_niceness <= 19:
            raise ConfigError(
                f"'worker_niceness' must be an integer in [0, 19]: {worker_niceness!r}"
            )
        if group is not None and not isinstance(group, RankGroup):
            raise ConfigError(f"'group' must be a RankGroup or None, got {group!r}")
        group = group if group is not None else RankGroup.default()
        if group.world_size > 1 and on_busy != "wait":
            raise ConfigError(
                "'on_busy' must be 'wait' when several ranks write a checkpoint (a skip on one "
                "rank but not another would leave the save incomplete); for a manager of this "
                "process alone pass group=RankGroup.single()"
            )
        partition([], 1, chunk_bytes=chunk_bytes)  # validates chunk_bytes
        self.compression = check_policy(compression, compression_options)
        listeners = list(listeners)
        for listener in listeners:
            if not callable(listener):
                raise ConfigError(f"'listeners' must be callables, got {listener!r}")
        self.storage = open_storage(directory, **dict(storage_options or {}))
        self.keep_last = keep_last
        self.on_busy = on_busy
        self.strict = bool(strict)
        self.allow_torch_save = bool(allow_torch_save)
        self.listeners: list[Listener] = listeners
        self.last_restore: RestoreEvent | None = None
        self.group = group
        # The run this manager's saves belong to: new for each manager (the group's session,
        # the same on every rank), and the restored checkpoint's run after a restore, so that
        # a resumed run continues its own retention while other runs' checkpoints are left be.
        self.run_id = group.session
        # The commit order of this manager's saves (Manifest.sequence): the highest sequence in
        # the directory and its remote tier, read once under the lease by the writer thread
        # (None until then), and at least that of the restored checkpoint.
        self._sequence: int | None = None
        self._lease_generation = 0
        self._sequence_floor = 0
        self.chunk_bytes = chunk_bytes
        self._saves = 0
        self._snapshotter = Snapshotter()
        self._encoder = PieceEncoder(self.compression)
        # The writer thread holds the manager only while a save of it is queued or running:
        # an unclosed manager that nothing else references is freed once its saves are
        # durable (its thread ends, its lease is released), never with a save still pending.
        self._worker = PersistWorker(_run_save, niceness=worker_niceness)
        self._pid = os.getpid()  # a forked child's copy has none of this process's threads
        self._inflight: SaveHandle | None = None
        self._failed: list[SaveHandle] = []
        # leaves found changed during a background copy: copied by save() itself from then on
        self._hot_keys: set[str] = set()
        self._failed_lock = threading.Lock()
        self._save_lock = threading.RLock()
        self._closed = False
        self._owner = _Owner()
        self._finalizer = weakref.finalize(self, self._owner.release, self._worker)
        self._finalizer.atexit = False  # at exit, _close_at_exit makes pending saves durable
        self._closed_at_exit = False
        if group.is_coordinator:
            try:
                self._owner.lease = acquire_lease(self.storage, group.session)
            except (DirectoryInUseError, StorageError) as e:
                # Reading is fine while another writer runs (or from a read-only directory);
                # save() asks again and raises.
                logger.info("coci: %s; this manager can restore, not save, for now", e)
            else:
                retention.remove_uncommitted(self.storage, self.group, done_seq=None)
        self.remote: RemoteTier | None = None
        if remote is not None:
            self.remote = RemoteTier(
                self.storage,
                open_storage(remote, **dict(remote_storage_options or {})),
                keep_last=remote_keep_last,
                group=group,
                run_id=_weak_run_id(self),
                emit=_weak_emit(self),
                upload_every=remote_upload_every,
            )
            self._owner.remote = self.remote
        _LIVE.add(self)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.storage.url!r}, keep_last={self.keep_last})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- saving ---------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        block: bool = True,
        metadata: Mapping[str, Any] | None = None,
        per_rank: Mapping[str, Any] | None = None,
        alone: bool = False,
        overwrite: bool = False,
    ) -> SaveHandle:
        """Snapshot ``state`` as ``step`` and persist it in the background.

        With ``block=True`` (the default) this returns once every tensor is copied into host
        memory, so training may change the tensors at once, by any means. With
        ``block=False`` it returns once the tensors of at most 64 KiB (what a forward pass
        changes: BatchNorm's statistics) and the numpy arrays are copied; the rest of the copy
        overlaps the next forward and backward pass. Every torch optimizer's ``step()`` waits
        for it, and :meth:`before_update` waits for it by hand. The save commits only once
        this thread has checked the copy (at its next optimizer step, :meth:`before_update`,
        ``save``, :meth:`wait`, ``handle.wait()`` or :meth:`close`): a saved tensor changed in
        place meanwhile (its version counter moved) gives the save up
        (:class:`~coci_core.errors.StateChangedError`). Writes that move no version counter
        are not seen and may be saved: through ``.data``, through a numpy view of a tensor
        (``t.numpy()``) or its storage, or from another thread; use ``block=True`` when code
        other than a torch optimizer changes saved tensors before the next step.

        Args:
            step: the training step (an integer >= 0).
            state: a mapping of tensors, numpy arrays, JSON values, lists, tuples and dicts.
            block: wait for the copy (True) or let it overlap the caller's next work (False;
                see above for which writes it then sees).
            metadata: JSON values stored in the manifest (shown by ``coci ls``).
            per_rank: state that differs per rank (random states, ...), under keys that
                ``state`` does not use; each rank writes its own, and :meth:`restore` merges
                the restoring rank's into the state. With several ranks, ``state`` must be the
                same on every rank (it is split over them and written once).
            alone: rank 0 writes the whole state by itself while the other ranks do not save
                (for a save only rank 0 reaches, such as one on an exception).
            overwrite: replace the checkpoint if the directory already holds ``step`` (the
                old one stays readable until the new one is committed).

        ``save`` may be called from any thread: concurrent calls run one after the other.

        Raises:
            BackgroundSaveError: an earlier background save failed (reported once).
            UnsupportedValueError: ``state`` holds a value that cannot be stored without pickle.
            DirectoryInUseError: another manager (in this or another process) is writing to
                the directory.
            StepExistsError: the directory holds ``step`` and ``overwrite`` is False.
        """
        inflight = self._inflight
        if inflight is not None:
            # before the lock: another thread's save may hold it while it waits for this
            # thread's previous save, which commits only once this thread has checked it
            inflight._check_copy()
        with self._save_lock:  # saves from several threads run one after the other
            return self._save(step, state, block, metadata, per_rank, alone, overwrite)

    def _save(
        self,
        step: int,
        state: Mapping[str, Any],
        block: bool,
        metadata: Mapping[str, Any] | None,
        per_rank: Mapping[str, Any] | None,
        alone: bool,
        overwrite: bool,
    ) -> SaveHandle:
        started = time.perf_counter()
        self._check_open()
        if type(step) is not int or step < 0:
            raise ConfigError(f"'step' must be an integer >= 0: {step!r}")
        if type(overwrite) is not bool:
            raise ConfigError(f"'overwrite' must be True or False: {overwrite!r}")
        previous = self._inflight
        if previous is not None and not previous.done():
            if previous.step == step:
                previous._wait_done()  # its commit decides whether the step exists
            elif self.on_busy == "skip":
                return self._skip(step, block=block, started=started)
            else:
                previous._wait_done()
        self._raise_failed()
        if not overwrite:
            self._refuse_existing(step)
        if alone and not self.group.is_coordinator:
            raise ConfigError("'alone' saves are made by rank 0 only")
        group = RankGroup(0, 1, self.group.session) if alone else self.group
        flat = flatten_state(state, allow_torch_save=self.allow_torch_save)
        own = self._flatten_per_rank(state, per_rank)
        if self.group.is_coordinator and self._owner.lease is None:  # after the input checks
            self._owner.lease = acquire_lease(self.storage, self.group.session)
            retention.remove_uncommitted(self.storage, self.group, done_seq=None)
        lost = self._owner.lease.lost if self._owner.lease is not None else None
        if lost is not None:
            raise DirectoryInUseError(f"{lost}: this manager no longer owns the directory")
        leaves = flat.leaves + (own.leaves if own else ())
        if alone and any(leaf.owned and leaf.shape != leaf.tensor.shape for leaf in flat.leaves):
            raise ConfigError(
                "an 'alone' save cannot hold shards of DTensors: the other ranks' rows are not "
                "written (save a full state dict instead)"
            )
        regions = None if alone else self._regions(flat.leaves, leaves)
        snapshot = self._snapshotter.prepare(leaves, regions)
        handle = SaveHandle(step, block=block, started=started, snapshot=snapshot)
        job = PersistJob(
            step,
            snapshot,
            flat.tree,
            _json_metadata(metadata),
            # A save that only rank 0 makes must not shift the count the ranks agree on.
            seq=self._saves,
            solo=alone,
            n_shared=len(flat.leaves),
            rank_tree=own.tree if own else None,
            layout=_layout_digest(flat.leaves, self.chunk_bytes) if regions is not None else "",
            group=group,
            run=self.run_id,
        )
        if block:
            # Copied before the writer starts: writing the copied part of the arena while the
            # rest is copied was measured to slow the copy to 1.8x the copy limit (from 1.1x).
            self._snapshotter.copy(snapshot)
            snapshot.wait_copied()
        else:
            self._snapshotter.copy_small(snapshot, also=self._hot_keys)
        self._saves += 0 if alone else 1
        self._inflight = handle
        handle._add_stall(time.perf_counter() - started)
        self._worker.submit((self, job, handle))
        return handle

    def warm_up(
        self, state: Mapping[str, Any], *, per_rank: Mapping[str, Any] | None = None
    ) -> threading.Thread:
        """Allocate the host buffers that saves of ``state`` (and ``per_rank``) use and fault
        their pages in now, on a helper thread, so that the first save stalls no longer than
        later ones (the kernel maps a new buffer's pages as the first copy touches them: about
        4x the steady stall). Call it once the state has its final shapes (after the first
        optimizer step, which creates the optimizer's state). A first save that comes sooner
        waits for it. Returns the helper thread."""
        self._check_open()
        flat = flatten_state(state, allow_torch_save=self.allow_torch_save)
        own = self._flatten_per_rank(state, per_rank)
        leaves = flat.leaves + (own.leaves if own else ())
        return self._snapshotter.reserve(leaves, self._regions(flat.leaves, leaves))

    def _refuse_existing(self, step: int) -> None:
        if not self.storage.exists(f"{step_dir_name(step)}/{MANIFEST_NAME}"):
            return
        try:
            run = read_manifest(self.storage, step).run
        except NoCheckpointError:
            return  # removed meanwhile
        except CheckpointError:
            run = "?"
        own = run == self.run_id
        whose = "this run's" if own else f"run {run}'s"
        raise StepExistsError(
            f"{self.storage.url} already holds {whose} checkpoint of step {step}; pass "
            "overwrite=True to replace it, or save into another directory",
            step=step,
            run=run,
            own=own,
        )

    def _flatten_per_rank(
        self, state: Mapping[str, Any], per_rank: Mapping[str, Any] | None
    ) -> FlatState | None:
        if per_rank is None:
            return None
        if not isinstance(per_rank, Mapping):
            raise ConfigError(f"'per_rank' must be a mapping or None, got {type(per_rank)}")
        clash = sorted(str(k) for k in per_rank if k in state)
        if clash:
            raise ConfigError(f"'per_rank' keys {clash} are also keys of 'state'")
        return flatten_state(per_rank, allow_torch_save=self.allow_torch_save)

    def _regions(
        self, shared: tuple[ArrayLeaf, ...], leaves: tuple[ArrayLeaf, ...]
    ) -> tuple[Share, ...] | None:
        # One rank writes every leaf whole; several split the replicated leaves and each writes
        # its shards of sharded tensors and its own per-rank leaves whole.
        if self.group.world_size == 1:
            partial = [
                leaf.key for leaf in shared if leaf.owned and leaf.shape != leaf.tensor.shape
            ]
            if partial:
                raise ConfigError(
                    f"{partial[:3]} are shards of DTensors: every rank must save, with a "
                    "'group' (RankGroup.from_torch_distributed())"
                )
            return None
        mine = partition(
            [0 if leaf.owned else leaf.nbytes for leaf in shared],
            self.group.world_size,
            chunk_bytes=self.chunk_bytes,
        )[self.group.rank]
        owned = tuple(Share(i, 0, leaf.nbytes) for i, leaf in enumerate(shared) if leaf.owned)
        own = tuple(Share(i, 0, leaves[i].nbytes) for i in range(len(shared), len(leaves)))
        return mine + owned + own

    def before_update(self) -> None:
        """Wait, if needed, until a ``block=False`` snapshot is fully copied; on the thread
        that saved, also check it (its commit waits for that check, see :meth:`save`).

        Torch optimizers call it by themselves before each ``step()`` (a process-wide
        optimizer pre-hook); call it before any other in-place change of saved tensors. It
        returns at once when there is nothing to wait for. The wait counts as stall.
        """
        handle = self._inflight
        if handle is None or handle._snapshot is None or handle.block:
            return
        snapshot = handle._snapshot
        if not snapshot.copied.is_set():
            started = time.perf_counter()
            snapshot.copied.wait()
            handle._add_stall(time.perf_counter() - started, update_wait=True)
        event = snapshot._cuda_event
        if event is not None:  # later work on this stream runs after the device-to-host copy
            torch.cuda.current_stream().wait_event(event)
        handle._check_copy()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every pending save is durable.

        Raises:
            BackgroundSaveError: a background save failed (each failure is reported once).
            TimeoutError: ``timeout_s`` passed first.
        """
        handle = self._inflight
        if handle is not None and not (
            handle._check_copy(timeout_s) and handle._wait_done(timeout_s)
        ):
            raise TimeoutError(f"save of step {handle.step} not durable after {timeout_s} s")
        self._raise_failed()

    def close(self) -> None:
        """Wait for pending saves and stop the background worker (idempotent). A manager that
        is never closed is closed when the main thread ends, before the interpreter shuts
        down: its pending saves are made durable then (a save that fails logs one line).

        Raises:
            BackgroundSaveError: a background save failed and was not reported yet.
        """
        inflight = self._inflight
        if inflight is not None:  # before the lock, as in save()
            inflight._check_copy(any_thread=True)
        with self._save_lock:
            if self._closed:
                return
            self._closed = True
            _LIVE.discard(self)
            handle = self._inflight
            if handle is not None:
                handle._check_copy(any_thread=True)
                handle._wait_done()
            self._worker.stop()
            if self.remote is not None:
                self.remote.close(retry=not self._closed_at_exit)
            self._finalizer.detach()
            self._owner.release(None)  # never raises
            self._raise_failed()

    def _close_at_exit(self) -> None:
        """:meth:`close` at interpreter exit: never raises, logs at most one line (a failed
        save was logged by the writer thread when it failed, naming its step)."""
        if self._pid != os.getpid():
            return  # inherited through fork: the saves and threads are the parent's
        self._closed_at_exit = not self._closed
        try:
            self.close()
        except BackgroundSaveError:
            pass
        except Exception as e:
            logger.warning("coci: closing %r at exit failed: %s", self, e)

    def _check_open(self) -> None:
        if self._closed_at_exit:
            raise CociError(
                f"{self!r} was closed at interpreter exit (after the main thread ended): a "
                "thread that saves after that must close() its manager before the main "
                "thread returns"
            )
        if self._closed:
            raise CociError(f"{self!r} is closed")

    def skip(self, step: int, reason: str) -> SaveHandle:
        """Record that ``step`` is not saved, for ``reason``: listeners get a skipped
        :class:`SaveEvent` (telemetry shows it), and nothing is written."""
        return self._skip(step, block=True, started=time.perf_counter(), reason=reason)

    def _skip(
        self,
        step: int,
        *,
        block: bool,
        started: float,
        reason: str = "the previous persist is still running",
    ) -> SaveHandle:
        handle = SaveHandle(step, block=block, started=started, snapshot=None)
        stall = time.perf_counter() - started
        handle._add_stall(stall)
        logger.info("coci: skipped step %d: %s", step, reason)
        event = SaveEvent(step=step, outcome="skipped", stall_s=stall, block=block)
        handle._finish(event, notify=lambda e: emit(self.listeners, e))
        return handle

    def _raise_failed(self) -> None:
        with self._failed_lock:
            failed, self._failed = self._failed, []
        unreported = [(h.step, e) for h in failed if (e := h._take_unreported_error()) is not None]
        if not unreported:
            return
        first_step, first_error = unreported[0]
        steps = ", ".join(str(step) for step, _ in unreported)
        raise BackgroundSaveError(
            f"background save of step {steps} failed: {first_error}; committed checkpoints "
            "are intact",
            step=first_step,
        ) from first_error

    def _run_job(self, item: tuple[PersistJob, SaveHandle]) -> None:
        # WARNING: runs on the writer thread; it must never touch the training process group.
        job, handle = item
        snapshot = job.snapshot
        try:
            if not handle.block:  # the copy overlaps the caller's next work
                self._snapshotter.copy(snapshot, background=True)
            lease = self._owner.lease
            if self.group.is_coordinator and lease is not None:
                # an object store's lease that lapsed in an outage is taken again, or this
                # save fails (StorageError) without writing: another writer may own it now
                lease.ensure_held()
                if lease.generation != self._lease_generation:  # another writer may have
                    self._lease_generation = lease.generation  # committed meanwhile
                    self._sequence = None
            resaved = self.group.is_coordinator and self.storage.exists(
                f"{step_dir_name(job.step)}/{MANIFEST_NAME}"
            )
            if self.group.is_coordinator:
                retention.make_room(
                    self.storage,
                    keep_last=self.keep_last,
                    run_id=self.run_id,
                    step=job.step,
                    needed_bytes=job.snapshot.arena.total_bytes * job.group.world_size
                    + ROOM_MARGIN_BYTES,
                    next_base=self._encoder.base_step,
                )
                job.sequence = self._next_sequence()
            result = write_checkpoint(self.storage, job, self._encoder)
        except BaseException as e:
            error: BaseException | None = e
            with contextlib.suppress(Exception):  # the handle must finish: close() waits on it
                error = retention.explain_full_disk(self.storage, e, self.keep_last)
            event = self._event(
                handle, snapshot, outcome="failed", error=f"{type(error).__name__}: {error}"
            )
            if isinstance(error, StateChangedError):
                # The loop changed tensors in place while the copy ran (a large buffer that
                # the forward pass updates, say): later saves copy them before returning.
                self._hot_keys.update(error.keys)
                logger.warning("coci: save of step %d given up: %s", job.step, error)
            else:
                logger.error("coci: save of step %d failed: %s", job.step, error)
        else:
            error = None
            event = self._event(
                handle,
                snapshot,
                outcome="committed",
                path=result.path,
                bytes_written=result.bytes_written,
                raw_bytes=result.raw_bytes,
                compressed=result.encoded,
            )
            logger.info(
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
            emit(self.listeners, event)

        handle._finish(event, error, notify=notify)
        if event.outcome == "committed" and self.group.is_coordinator:
            # After done: deleting old steps (0.3 s per GB here) must not hold up wait() or
            # the next save; the next job on this thread starts once it is finished.
            if resaved:
                retention.drop_dependants(self.storage, job.step)
            if self.remote is not None:
                self.remote.submit(job.step)
            self._apply_retention(newest=job.step, done_seq=job.seq)

    def _continue_run(self, run: str, sequence: int) -> None:
        """Later saves continue ``run`` and are committed after ``sequence``: those of a
        restored checkpoint (restored here, or by an adapter's own restore)."""
        self.run_id = run
        self._sequence_floor = max(self._sequence_floor, sequence)

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
        self._sequence = max(self._sequence, self._sequence_floor, remote) + 1
        return self._sequence

    def _event(self, handle: SaveHandle, snapshot: Snapshot, **fields: Any) -> SaveEvent:
        now = time.perf_counter()
        return SaveEvent(
            step=handle.step,
            stall_s=handle._stall_s,
            update_wait_s=handle._update_wait_s,
            copy_s=snapshot.copy_s,
            persist_s=now - snapshot.copied_at if snapshot.copied_at else 0.0,
            time_to_durable_s=now - handle._started,
            first_save=snapshot.allocated,
            block=handle.block,
            **fields,
        )

    def _apply_retention(self, *, newest: int, done_seq: int) -> None:
        # Retention never fails a save that is already durable: its errors are logged.
        try:
            if self.keep_last is not None:
                retention.apply_keep_last(
                    self.storage,
                    keep_last=self.keep_last,
                    run_id=self.run_id,
                    newest=newest,
                    next_base=self._encoder.base_step,
                )
            retention.remove_uncommitted(self.storage, self.group, done_seq=done_seq, newest=newest)
        except Exception as e:
            logger.warning("coci: retention after step %d failed: %s", newest, e)

    # -- restoring ------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return committed_steps(self.storage)

    def latest_step(self) -> int | None:
        """The step a restore without ``step`` tries first: the newest checkpoint of the
        newest run (by commit sequence, in either tier), or None when nothing is committed."""
        remote = self.remote.remote if self.remote is not None else None
        candidates = resume_order(self.storage, remote)
        return candidates[0].step if candidates else None

    def runs(self) -> dict[str, list[int]]:
        """The committed steps of each run in the directory (ascending), newest run first."""
        found: dict[str, list[int]] = {}
        for info in step_infos(self.storage):
            if info.intact:
                found.setdefault(info.run, []).append(info.step)
        return {run: sorted(steps) for run, steps in found.items()}

    def manifest(self, step: int) -> Manifest:
        """The manifest of a committed step."""
        return read_manifest(self.storage, step)

    def restore(
        self,
        step: int | None = None,
        *,
        into: Mapping[str, Stateful] | None = None,
        strict: bool | None = None,
        rank: int | None = None,
        targets: InPlaceTargets | None = None,
    ) -> dict[str, Any]:
        """Read, verify and return a committed state (tensors on CPU).

        A checkpoint restores on any number of ranks, whatever number wrote it. The per-rank
        state that rank ``rank`` (default: this manager's rank) saved is merged in; a rank the
        checkpoint does not have gets none (logged; ``last_restore.rank_state_restored``).

        Pending saves are made durable first. Without ``step`` the newest checkpoint of the
        newest run is used (:meth:`latest_step`; with a remote tier, of either tier); if it
        is damaged, it is reported and the next newest intact one (the other tier's copy
        first) is used instead (unless ``strict``, which accepts only that copy). Later saves
        of this manager continue the restored checkpoint's run and are committed after it.
        ``into`` maps keys of the state to objects whose ``load_state_dict`` receives them.
        The restored step is in ``last_restore.step``.

        Modules and torch optimizers in ``into`` are filled in place: each stored tensor whose
        live counterpart (in their ``state_dict()``) is a contiguous CPU tensor of the same
        dtype and shape is read straight into it and verified there, so the restore needs no
        second copy of them; the returned state then holds those live tensors. A restore that
        raises may have left them partly overwritten. ``targets`` (instead of what ``into``
        gives) names live tensors of any layout to fill in place, for a caller that loads the
        state itself (see :class:`~coci_core.engine.inplace.InPlaceTargets`).

        Raises:
            NoCheckpointError: nothing is committed (or not ``step``).
            CorruptCheckpointError: the requested (or, with ``strict``, the newest) checkpoint
                is damaged, or no intact one is left.
            StorageError: the directory cannot be read (refused credentials or permission, a
                missing bucket, a store that cannot be reached): never read as empty.
        """
        self.wait()
        if targets is None and into is not None:
            targets = in_place_targets(into)
        loaded, event = restore_newest(
            self.storage,
            step,
            rank=self.group.rank if rank is None else rank,
            strict=self.strict if strict is None else strict,
            targets=targets,
            remote=self.remote.remote if self.remote is not None else None,
        )
        self.last_restore = event
        if targets is not None:
            targets.check(loaded.step)
        if into is not None:
            started = time.perf_counter()
            _load_into(loaded.state, into)
            load_s = time.perf_counter() - started
            self.last_restore = dataclasses.replace(
                self.last_restore, seconds=self.last_restore.seconds + load_s, load_s=load_s
            )
        self._continue_run(loaded.manifest.run, loaded.manifest.sequence)
        emit(self.listeners, self.last_restore)
        return loaded.state

    def verify(self, step: int | None = None) -> dict[int, list[str]]:
        """Damaged array keys per committed step (all steps, or just ``step``); a step that
        retention removes while it is checked is left out, not reported damaged."""
        if step is not None:
            return {step: verify_checkpoint(self.storage, step)}
        found: dict[int, list[str]] = {}
        for s in self.steps():
            try:
                found[s] = verify_checkpoint(self.storage, s)
            except NoCheckpointError:
                continue
        return found


class _Owner:
    """What a manager holds that must be given up even when it is never closed: the
    directory's lease and the writer thread (see ``weakref.finalize`` in the manager)."""

    def __init__(self) -> None:
        self.lease: Lease | None = None
        self.remote: RemoteTier | None = None

    def release(self, worker: PersistWorker | None) -> None:
        """Give everything up; never raises (it runs from ``close``, a finalizer or at exit,
        when the storage may be gone: a lease that cannot be removed expires by itself)."""
        if worker is not None:
            worker.stop(wait=False)
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


def _weak_run_id(manager: CheckpointManager) -> Callable[[], str]:
    """The manager's current run, without keeping it alive (the upload thread holds this)."""
    ref = weakref.ref(manager)
    session = manager.group.session
    return lambda: getattr(ref(), "run_id", session)


def _weak_emit(manager: CheckpointManager) -> Callable[[UploadEvent], None]:
    """Give an upload event to the manager's listeners while the manager exists."""
    ref = weakref.ref(manager)

    def send(event: UploadEvent) -> None:
        owner = ref()
        if owner is not None:
            emit(owner.listeners, event)

    return send


def _run_save(item: tuple[CheckpointManager, PersistJob, SaveHandle]) -> None:
    """The writer thread's job: the queued item holds its manager until the save is done."""
    manager, job, handle = item
    manager._run_job((job, handle))


def _load_into(state: Mapping[str, Any], into: Mapping[str, Stateful]) -> None:
    missing = [key for key in into if key not in state]
    if missing:
        raise CheckpointError(
            f"the restored state has no {missing}; it has {sorted(map(str, state))}"
        )
    for key, target in into.items():
        if not hasattr(target, "load_state_dict"):
            raise ConfigError(f"'into[{key!r}]' has no load_state_dict: {type(target).__name__}")
        target.load_state_dict(state[key])


def _layout_digest(leaves: tuple[ArrayLeaf, ...], chunk_bytes: int) -> str:
    """What every rank must agree on to split the state the same way."""
    text = repr([(leaf.key, str(leaf.tensor.dtype), leaf.shape, leaf.owned) for leaf in leaves])
    return hashlib.sha1(f"{chunk_bytes}|{text}".encode()).hexdigest()[:16]


def _json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    import json

    if metadata is None:
        return {}
    try:
        decoded: dict[str, Any] = json.loads(json.dumps(dict(metadata), allow_nan=False))
        return decoded
    except (TypeError, ValueError, RecursionError) as e:
        raise ConfigError(f"'metadata' must hold JSON values only: {e}") from e
