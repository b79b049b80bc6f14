"""CheckpointManager: the engine's public entry; wires snapshot, persist, commit, retention
and restore together.

Beside it: the handle a save returns (``handle.py``), what the writer thread does with each
save (``writer.py``), the checks of a save's inputs and the regions each rank writes
(``save_inputs.py``), and what holds for every manager of the process: the optimizer pre-hook,
closing unclosed managers when the main thread ends (``lifecycle.py``).

Why one module: it holds one public class whose methods are thin and each hands its work to
one of the modules above; most of its lines are the public API's docstrings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from coci_core.engine import lifecycle
from coci_core.engine.agreement import RestoreAgreement
from coci_core.engine.directory import retention
from coci_core.engine.directory.lease import acquire_lease, deletion_marks
from coci_core.engine.directory.shared import check_shared_directory, meets_every_rank
from coci_core.engine.directory.tiers import RemoteTier, same_place
from coci_core.engine.format.manifest import Manifest
from coci_core.engine.format.tree import ArrayLeaf, FlattenCache, flatten_state
from coci_core.engine.group import RankGroup
from coci_core.engine.handle import SaveHandle
from coci_core.engine.pulse import Pulse, Watch
from coci_core.engine.restore.inplace import InPlaceTargets, in_place_targets
from coci_core.engine.restore.restore import (
    CheckpointRef,
    checkpoint_storage,
    committed_steps,
    find_checkpoint,
    read_manifest,
    restore_newest,
    resume_order,
    step_infos,
    verify_checkpoint,
)
from coci_core.engine.save.compress import CompressionPolicy, PieceEncoder, check_policy
from coci_core.engine.save.partition import DEFAULT_CHUNK_BYTES, Share, partition
from coci_core.engine.save.persist import PersistJob, abandon_for_the_others, save_token
from coci_core.engine.save.save_inputs import (
    check_run_position,
    check_step,
    check_timeout,
    committed_elsewhere,
    flatten_per_rank,
    json_metadata,
    layout_digest,
    rank_regions,
    save_version,
)
from coci_core.engine.save.snapshot import Snapshotter
from coci_core.engine.save.workers import PersistWorker
from coci_core.engine.save.writer import QueuedSave, SaveWriter
from coci_core.engine.stateful import Stateful, load_into
from coci_core.errors import (
    BackgroundSaveError,
    CociError,
    ConfigError,
    DirectoryInUseError,
    NoCheckpointError,
    StepExistsError,
    StorageError,
)
from coci_core.storage import Storage, check_storage_options, open_storage, open_storage_named
from coci_core.telemetry import Listener, RestoreEvent, emit

__all__ = ["CheckpointManager", "SaveHandle"]

logger = logging.getLogger(__name__)

OnBusy = Literal["wait", "skip"]
_ON_BUSY = ("wait", "skip")
_BUSY = "the previous persist is still running"  # the reason of an on_busy="skip" skip


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
            durable without slowing a restore; raw on a fast local disk), ``"none"``,
            ``"lossless"``, ``"lossy"`` (opt-in, bounded error); or a
            :class:`~coci_core.engine.save.compress.CompressionPolicy`. See docs/compression.md.
        compression_options: knobs of :class:`~coci_core.engine.save.compress.CompressionPolicy`
            (``full_every``, ``max_lossy_generations``, ``lossy_bits``, ...).
        remote: a second, remote tier (an fsspec URL such as ``"s3://bucket/run"``, a path or
            a Storage): each checkpoint committed in ``directory`` is then copied there in the
            background and committed there too (see
            :mod:`coci_core.engine.directory.tiers`); a restore takes the newest intact
            checkpoint of either tier, from ``directory`` when it is intact there, else from
            ``remote`` (a damaged local copy, or a new node with an empty disk).
        remote_keep_last: committed checkpoints kept on the remote tier (None: all).
        remote_storage_options: fsspec options of ``remote`` (credentials, endpoint).
        remote_upload_every: copy every this many checkpoints to ``remote`` (and the newest
            at ``close``); see :func:`coci_core.planner.two_level.plan_two_levels`.

    Runs: each manager starts a new run (``run_id``, stored in every manifest); a restore
    continues the restored checkpoint's run. Restoring without a step takes the newest
    intact checkpoint of the newest run (by commit sequence, never by step number or wall
    clock; with ``remote``, of either tier), retention counts and deletes only this run's
    checkpoints, and ``save`` of a step this run already holds raises
    :class:`StepExistsError` unless ``overwrite=True``. A step that another run holds is saved
    beside it, under the step's name with a version suffix (``step-0000000004-v1``), as
    Lightning's ``ModelCheckpoint`` names a file whose name is taken: neither run's checkpoint
    is lost, and the newest commit is the one a restore takes.
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
        for name, flag in (("strict", strict), ("allow_torch_save", allow_torch_save)):
            if type(flag) is not bool:  # "False" would be true
                raise ConfigError(f"{name!r} must be True or False: {flag!r:.100}")
        if isinstance(listeners, (str, bytes)) or callable(listeners):
            raise ConfigError(f"'listeners' must be a list of callables, got {listeners!r:.100}")
        try:
            listeners = list(listeners)
        except TypeError:
            raise ConfigError(
                f"'listeners' must be a list of callables, got {listeners!r:.100}"
            ) from None
        storage_options = check_storage_options(
            storage_options, directory, names=("storage_options", "directory")
        )
        remote_storage_options = check_storage_options(
            remote_storage_options, remote, names=("remote_storage_options", "remote")
        )
        group = group if group is not None else RankGroup.default()
        if group.world_size > 1 and on_busy != "wait":
            raise ConfigError(
                "'on_busy' must be 'wait' when several ranks write a checkpoint (a skip on one "
                "rank but not another would leave the save incomplete); for a manager of this "
                "process alone pass group=RankGroup.single()"
            )
        partition([], 1, chunk_bytes=chunk_bytes)  # validates chunk_bytes
        self.compression = check_policy(compression, compression_options)
        for listener in listeners:
            if not callable(listener):
                raise ConfigError(f"'listeners' must be callables, got {listener!r}")
        self.storage = open_storage(directory, **storage_options)
        remote_storage = (
            None if remote is None else open_storage_named("remote", remote, remote_storage_options)
        )
        if (
            remote_storage is not None
            and same_place(self.storage, remote_storage)
            # one URL on two servers (another endpoint in the options) is two places
            and (self.storage.local_root() is not None or storage_options == remote_storage_options)
        ):
            raise ConfigError(
                f"'remote' must be another place than 'directory': both are {self.storage.url!r}"
            )
        self.keep_last = keep_last
        self.on_busy = on_busy
        self.strict = bool(strict)
        self.allow_torch_save = bool(allow_torch_save)
        self.listeners: list[Listener] = listeners
        self.last_restore: RestoreEvent | None = None
        # (step, version) of this run's checkpoints that the last restore passed over as
        # damaged: a save of one replaces it
        self._passed_over: set[tuple[int, int]] = set()
        self.group = group
        # The run this manager's saves belong to: new for each manager (the group's session,
        # the same on every rank), and the restored checkpoint's run after a restore, so that
        # a resumed run continues its own retention while other runs' checkpoints are left be.
        self.run_id = group.session
        # the commit sequence of the checkpoint this run resumed from (see close)
        self._resumed_at: int | None = None
        # the step restored, when restore() took the newest checkpoint (see _save)
        self._restored_newest: int | None = None
        self._shared_checked = False  # whether the ranks see one directory (the first save)
        self.chunk_bytes = chunk_bytes
        self._saves = 0
        self._snapshotter = Snapshotter()
        # the last save's flattens of ``state`` and ``per_rank`` (used under ``_save_lock``)
        self._flat_cache = FlattenCache()
        self._rank_cache = FlattenCache()
        # the flatten's layout tokens of the last save, its regions and their digest
        self._last_split: tuple[tuple[object, ...], tuple[Share, ...] | None, str] | None = None
        self._encoder = PieceEncoder(self.compression)
        # The writer thread holds the manager only while a save of it is queued or running
        # (QueuedSave.holder): an unclosed manager that nothing else references is freed once
        # its saves are durable (its thread ends, its lease is released).
        self._worker = PersistWorker(niceness=worker_niceness)
        self._pid = os.getpid()  # a forked child's copy has none of this process's threads
        self._inflight: SaveHandle | None = None
        self._save_lock = threading.RLock()
        self._closed = False
        self._owner = lifecycle.Owner()
        self._finalizer = weakref.finalize(self, self._owner.release, self._worker)
        self._finalizer.atexit = False  # at exit, close_at_exit makes pending saves durable
        self._closed_at_exit = False
        self._owner.pulse = Pulse.start(group)  # the others' waits for this rank's shares
        # The directory's lease is taken at the first save (see _own_directory), not here: a
        # manager that only restores (an evaluation process, a script that lists steps) never
        # holds it, so it never refuses the saves of a run started after it.
        # the marks of clean-ups (delete_checkpoints_unwritten) there now: one left after this
        # (a stopped run's directory deleted) refuses this manager the lease (see _take_lease)
        self._deleted_seen: frozenset[str] | None = None
        if group.is_coordinator:
            self._put_back_aside()
        self.remote: RemoteTier | None = None
        if remote_storage is not None:
            self.remote = RemoteTier(
                self.storage,
                remote_storage,
                keep_last=remote_keep_last,
                group=group,
                run_id=lifecycle.weak_run_id(self, group.session),
                emit=lifecycle.weak_emit(self),
                upload_every=remote_upload_every,
            )
            self._owner.remote = self.remote
        self._writer = SaveWriter(
            storage=self.storage,
            group=group,
            keep_last=keep_last,
            encoder=self._encoder,
            snapshotter=self._snapshotter,
            owner=self._owner,
            remote=self.remote,
            emit=lifecycle.weak_emit(self),
            run_id=lifecycle.weak_run_id(self, group.session),
        )
        lifecycle.track(self)

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
            step: the training step (an integer in ``[0, 2**63-1]``).
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
            overwrite: replace this run's checkpoint of ``step`` (or, when only other runs
                hold ``step``, the newest of theirs); the old one stays readable until the
                new one is committed. Without it, a step that another run holds is saved
                beside that run's checkpoint (``step-...-v1``), never over it.

        ``save`` may be called from any thread: concurrent calls run one after the other.

        Raises:
            BackgroundSaveError: an earlier background save failed (reported once).
            UnsupportedValueError: ``state`` holds a value that cannot be stored without pickle.
            DirectoryInUseError: another manager (in this or another process) is writing to
                the directory.
            StepExistsError: this run's checkpoint of ``step`` exists and ``overwrite`` is
                False (but for one that the restore this run continues passed over as
                damaged: the save replaces it).
            ConfigError: an argument is malformed (``step`` not an integer in
                ``[0, 2**63-1]``, ...).
        """
        inflight = self._inflight
        if inflight is not None:
            # before the lock: another thread's save may hold it while it waits for this
            # thread's previous save, which commits only once this thread has checked it
            inflight.check_copy()
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
        check_step(step)
        for name, flag in (("overwrite", overwrite), ("block", block), ("alone", alone)):
            if type(flag) is not bool:
                raise ConfigError(f"{name!r} must be True or False: {flag!r:.100}")
        previous = self._inflight
        if previous is not None and not previous.done():
            if previous.step == step:
                previous.wait_done()  # its commit decides whether the step exists
            elif self.on_busy == "skip":
                return self._skip(step, block=block, started=started)
            else:
                previous.wait_done()
        self._writer.raise_failed()
        if alone and not self.group.is_coordinator:
            raise ConfigError("'alone' saves are made by rank 0 only")
        group = RankGroup(0, 1, self.group.session) if alone else self.group
        first_of_ranks = group.world_size > 1 and not self._shared_checked
        try:
            version = self._version(step, overwrite)
            flat = flatten_state(
                state, allow_torch_save=self.allow_torch_save, cache=self._flat_cache
            )
            own = flatten_per_rank(
                state, per_rank, allow_torch_save=self.allow_torch_save, cache=self._rank_cache
            )
        except Exception as e:
            if first_of_ranks:  # the others are at the check below: tell them, not time out
                with contextlib.suppress(CociError):
                    self._check_shared(group, failed=e)
            raise
        if first_of_ranks:
            self._check_shared(group, claim=True)
            self._shared_checked = True
        self._own_directory(step, version, group, alone)  # after the input checks
        leaves = flat.leaves + (own.leaves if own else ())
        if alone and any(leaf.owned and leaf.shape != leaf.tensor.shape for leaf in flat.leaves):
            raise ConfigError(
                "an 'alone' save cannot hold shards of DTensors: the other ranks' rows are not "
                "written (save a full state dict instead)"
            )
        known = flat.layout is not None and (own is None or own.layout is not None)
        layout = (flat.layout, own.layout if own else None) if known else None
        regions, digest = self._split(flat.leaves, leaves, layout, alone)
        snapshot = self._snapshotter.prepare(leaves, regions, layout, background=not block)
        handle = SaveHandle(step, block=block, started=started, snapshot=snapshot)
        job = PersistJob(
            step,
            snapshot,
            flat.tree,
            json_metadata(metadata),
            # A save that only rank 0 makes must not shift the count the ranks agree on.
            seq=self._saves,
            solo=alone,
            n_shared=len(flat.leaves),
            rank_tree=own.tree if own else None,
            tree_ints=flat.ints,
            leaf_layout=flat.layout,
            layout=digest,
            group=group,
            run=self.run_id,
            version=version,
        )
        if block:
            # Copied before the writer starts: writing the copied part of the arena while the
            # rest is copied was measured to slow the copy to 1.8x the copy limit (from 1.1x).
            self._snapshotter.copy(snapshot)
            snapshot.wait_copied()
        else:
            self._snapshotter.copy_small(snapshot, also=self._writer.hot_keys)
        self._saves += 0 if alone else 1
        self._inflight = handle
        handle.add_stall(time.perf_counter() - started)
        self._worker.submit(QueuedSave(self._writer, job, handle, holder=self))
        self._set_passed_over(self._passed_over - {(step, version)})  # replaced (now queued)
        return handle

    def _version(self, step: int, overwrite: bool) -> int:
        try:
            return save_version(
                self.storage, step, self.run_id, overwrite=overwrite, passed_over=self._passed_over
            )
        except StepExistsError as e:
            # A second job that restored the first's newest step and went on, while the first
            # still runs, reaches the first's steps: say that the directory is in use, first.
            # A probe only: no rank queued this save, so nothing is aborted or counted.
            if self.group.is_coordinator and self._owner.lease is None:
                with contextlib.suppress(StorageError):  # the step exists all the same
                    acquire_lease(self.storage, self.group.session).release()
            if (
                self._restored_newest is None
                or self._resumed_at is None
                or not self.group.is_coordinator  # the one that knows its commits
            ):
                raise
            said = committed_elsewhere(
                self.storage,
                e,
                restored=(self._restored_newest, self._resumed_at),
                first_own=self._writer.first_sequence,
            )
            if said is e:
                raise
            raise said from None

    def _check_shared(
        self, group: RankGroup, failed: BaseException | None = None, *, claim: bool = False
    ) -> None:
        """The first save's check that the ranks share the directory. With ``claim``, rank 0
        takes the lease before it when every rank waits there (no rank writes this save yet):
        the uploads a killed writer left open are aborted then, as at a claim; a lease
        refused is said to every rank there."""
        agreement = RestoreAgreement.for_group(
            group, timeout_s=group.timeout_s, topic="-dir", watch=Watch.of(group)
        )
        if (
            claim
            and failed is None
            and self.group.is_coordinator
            and self._owner.lease is None
            and meets_every_rank(group, agreement)
        ):
            try:
                self._take_lease(nothing_in_flight=True)
            except (DirectoryInUseError, StorageError) as e:
                with contextlib.suppress(CociError):
                    check_shared_directory(self.storage, group, agreement, failed=e)
                raise
        check_shared_directory(self.storage, group, agreement, failed=failed)

    def claim(self) -> str | None:
        """Take the directory's lease now, as the first save does (on rank 0), for a manager
        that is to write (the adapters' take it when training starts): a run started later
        in the directory is then the one refused. Returns None once held, else why it is not
        (another writer holds it: this manager's saves raise :class:`DirectoryInUseError`
        meanwhile; or the storage refuses it); never raises."""
        if not self.group.is_coordinator or self._owner.lease is not None:
            return None
        try:
            self._take_lease(nothing_in_flight=True)
        except (DirectoryInUseError, StorageError) as e:
            return str(e)
        return None

    def _put_back_aside(self) -> None:
        """A crash between the two renames of a re-save left a step renamed aside: put it
        back now, under a lease held for that only, so that a restore finds it (while a live
        writer holds the lease, it completes its re-save itself). Never raises."""
        try:
            names = self.storage.list_dir("")
            self._deleted_seen = deletion_marks(names)
            if not any(".coci-old-" in name for name in names):
                return
            lease = acquire_lease(self.storage, self.group.session)
        except (DirectoryInUseError, StorageError):
            return
        try:
            retention.remove_uncommitted(
                self.storage, self.group, done_seq=None, abort_uploads=False
            )
        except Exception as e:  # the steps are where they were: never a reason to fail
            logger.warning("coci: could not put back a step a crash left aside: %s", e)
        finally:
            lease.release()

    def _take_lease(self, *, nothing_in_flight: bool) -> None:
        """Take the directory's lease (and the remote tier's), then clear what an earlier
        writer left uncommitted. ``nothing_in_flight``: no rank of this group can be writing
        (the uploads an earlier writer left open are aborted only then: at a save of several
        ranks, the others' uploads of that save may have begun).

        Raises:
            DirectoryInUseError: another writer holds it.
            StorageError: the lease file or record cannot be made.
        """
        self._owner.lease = acquire_lease(self.storage, self.group.session)
        if self._deleted_seen is not None:
            try:
                late = deletion_marks(self.storage.list_dir("")) - self._deleted_seen
            except BaseException:
                self._owner.lease.release()
                self._owner.lease = None
                raise
            if late:
                self._owner.lease.release()
                self._owner.lease = None
                raise DirectoryInUseError(
                    f"the checkpoints of {self.storage.url} were deleted by a clean-up "
                    f"({sorted(late)[0]}: CheckpointCleanup, delete_checkpoints_unwritten) after "
                    "this CheckpointManager was made: its run was stopped, and nothing of it is "
                    "written there now (a run started afterwards writes there as usual)"
                )
        try:  # the lease is held: what an earlier writer left is never a reason to fail
            retention.remove_uncommitted(
                self.storage, self.group, done_seq=None, abort_uploads=nothing_in_flight
            )
        except Exception as e:
            logger.warning("coci: could not clear what an earlier writer left: %s", e)
        if self.remote is not None:
            self.remote.claim()

    def _own_directory(self, step: int, version: int, group: RankGroup, alone: bool) -> None:
        """Take the directory's lease on the coordinator's first save (then clear what an
        earlier writer left uncommitted); raise if another writer holds it, after recording the
        abort of this save where the other ranks wait for it."""
        try:
            if self.group.is_coordinator and self._owner.lease is None:
                self._take_lease(nothing_in_flight=group.world_size == 1)
            lost = self._owner.lease.lost if self._owner.lease is not None else None
            if lost is not None:
                raise DirectoryInUseError(f"{lost}: this manager no longer owns the directory")
        except (DirectoryInUseError, StorageError) as e:
            token = save_token(group.session, alone, self._saves)
            abandon_for_the_others(self.storage, step, version, token, group, e)
            # the other ranks queued this save: a later one of this rank must meet theirs
            self._saves += 0 if alone else 1
            raise

    def _split(
        self,
        shared: tuple[ArrayLeaf, ...],
        leaves: tuple[ArrayLeaf, ...],
        layout: tuple[object, ...] | None,
        alone: bool,
    ) -> tuple[tuple[Share, ...] | None, str]:
        """This rank's regions of ``leaves`` and the digest of the split that every rank must
        agree on (none for a save of one rank); the last save's while the flatten's ``layout``
        tokens stay the same."""
        if alone:
            return None, ""
        if layout is not None and self._last_split is not None and self._last_split[0] == layout:
            return self._last_split[1], self._last_split[2]
        regions = rank_regions(self.group, self.chunk_bytes, shared, leaves)
        digest = layout_digest(shared, self.chunk_bytes) if regions is not None else ""
        self._last_split = (layout, regions, digest) if layout is not None else None
        return regions, digest

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
        own = flatten_per_rank(state, per_rank, allow_torch_save=self.allow_torch_save)
        leaves = flat.leaves + (own.leaves if own else ())
        regions = rank_regions(self.group, self.chunk_bytes, flat.leaves, leaves)
        return self._snapshotter.reserve(leaves, regions)

    def before_update(self) -> None:
        """Wait, if needed, until a ``block=False`` snapshot is fully copied; on the thread
        that saved, also check it (its commit waits for that check, see :meth:`save`).

        Torch optimizers call it by themselves before each ``step()`` (a process-wide
        optimizer pre-hook); call it before any other in-place change of saved tensors. It
        returns at once when there is nothing to wait for. The wait counts as stall.
        """
        handle = self._inflight
        if handle is not None:
            handle.before_update()

    def wait(self, timeout_s: float | None = None, *, retention: bool = False) -> None:
        """Block until every pending save is durable.

        ``retention``: also until the writer has removed the steps beyond ``keep_last`` that
        those saves retire (it does so after each save is durable, so that this wait and the
        next save do not wait for it), so that :meth:`steps` lists only steps that stay.

        Raises:
            BackgroundSaveError: a background save failed (each failure is reported once).
            TimeoutError: ``timeout_s`` passed first.
        """
        timeout_s = check_timeout("timeout_s", timeout_s)
        handle = self._inflight
        if handle is not None and not (
            handle.check_copy(timeout_s) and handle.wait_done(timeout_s)
        ):
            raise TimeoutError(f"save of step {handle.step} not durable after {timeout_s} s")
        if retention and not self._worker.drain(timeout_s):
            raise TimeoutError(f"retention after the last save not done after {timeout_s} s")
        self._writer.raise_failed()

    def close(
        self, *, upload_timeout_s: float | None = None, resumed_retention: bool = False
    ) -> None:
        """Wait for pending saves and stop the background worker (idempotent). A manager that
        is never closed is closed when the main thread ends, before the interpreter shuts
        down: its pending saves are made durable then (a save that fails logs one line).
        ``upload_timeout_s``: how long the remote tier's last upload may still take (default
        ``UPLOAD_CLOSE_TIMEOUT_S``; a preempted run gives the time it has left).
        ``resumed_retention``: this manager resumed training (the adapters pass it): if it
        restored its run's newest checkpoint and committed nothing since, delete the one
        step beyond ``keep_last`` that a kill between the run's last commit and that commit's
        retention left (a reader's restore, False, never deletes anything).

        Raises:
            BackgroundSaveError: a background save failed and was not reported yet.
        """
        upload_timeout_s = check_timeout("upload_timeout_s", upload_timeout_s)
        inflight = self._inflight
        if inflight is not None:  # before the lock, as in save()
            inflight.check_copy(any_thread=True)
        with self._save_lock:
            if self._closed:
                return
            self._closed = True
            lifecycle.untrack(self)
            handle = self._inflight
            if handle is not None:
                handle.check_copy(any_thread=True)
                handle.wait_done()
            self._worker.stop()
            if resumed_retention:
                self._trim_resumed_run()
            if self.remote is not None and upload_timeout_s is not None:
                self.remote.close(max(0.0, upload_timeout_s))
            elif self.remote is not None:
                self.remote.close(retry=not self._closed_at_exit)
            self._finalizer.detach()
            self._owner.release(None)  # never raises
            self._writer.raise_failed()

    def _trim_resumed_run(self) -> None:
        if self._resumed_at is None or self.keep_last is None or not self.group.is_coordinator:
            return
        if self._owner.lease is None:  # a run that resumed and saved nothing since
            try:
                self._owner.lease = acquire_lease(self.storage, self.group.session)
            except (DirectoryInUseError, StorageError) as e:
                logger.info("coci: %s; nothing of this run is trimmed at close", e)
                return
        if self._owner.lease.lost is not None:
            return
        retention.trim_resumed_run(
            self.storage,
            keep_last=self.keep_last,
            run_id=self.run_id,
            sequence=self._resumed_at,
            next_base=self._encoder.base_step,
            also_keep=self._writer.also_keep,
        )

    def keep_also(self, steps: Iterable[int]) -> None:
        """Keep this run's ``steps`` besides the newest ``keep_last`` (replacing the steps given
        before): retention, a full disk's early removal and the remote tier's retention (beside
        its ``remote_keep_last``, where a step was uploaded) leave them. An adapter's best
        model's step (``load_best_model_at_end``), as the Trainer's rotation always keeps its
        best checkpoint besides the newest ``save_total_limit``."""
        kept = list(steps) if isinstance(steps, Iterable) and not isinstance(steps, str) else None
        if kept is None or not all(type(s) is int and 0 <= s < 2**63 for s in kept):
            raise ConfigError(
                f"'steps' must be an iterable of step numbers (integers in [0, 2**63)): {steps!r}"
            )
        self._writer.also_keep = frozenset(kept)
        if self.remote is not None:
            self.remote.also_keep = self._writer.also_keep
            self.remote.upload_kept()  # one committed before, passed over by the period

    @property
    def kept_also(self) -> frozenset[int]:
        """The steps given to :meth:`keep_also`."""
        return self._writer.also_keep

    def close_at_exit(self) -> None:
        """:meth:`close`, when the main thread has ended (for a manager left unclosed): never
        raises, logs at most one line (a failed save was logged by the writer thread when it
        failed, naming its step)."""
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
        :class:`SaveEvent` (telemetry shows it), and nothing is written.

        Raises:
            ConfigError: ``step`` is not an integer in ``[0, 2**63-1]``.
        """
        check_step(step)
        return self._skip(step, block=True, started=time.perf_counter(), reason=reason)

    def _skip(
        self,
        step: int,
        *,
        block: bool,
        started: float,
        reason: str = _BUSY,
    ) -> SaveHandle:
        handle = SaveHandle(step, block=block, started=started, snapshot=None)
        handle.add_stall(time.perf_counter() - started)
        # DEBUG: the adapters' verbose=True line tells the user of each save (once)
        logger.debug("coci: skipped step %d: %s", step, reason)
        # a skip for another reason than a busy writer says why (the event's ``error``)
        why = None if reason == _BUSY else reason
        event = handle.new_event(outcome="skipped", error=why)
        handle.finish(event, notify=lambda e: emit(self.listeners, e))
        return handle

    def continue_run(self, run: str, sequence: int, restored: RestoreEvent | None = None) -> None:
        """Later saves continue ``run`` and are committed after ``sequence``: those of a
        restored checkpoint (restored here, or by an adapter's own restore: ``restored``, its
        event, then becomes :attr:`last_restore`).

        Raises:
            ConfigError: ``run`` is not a run id or ``sequence`` not a commit sequence that a
                manifest can record (as the restored manifest's are).
        """
        check_run_position(run, sequence)
        self._restored_newest = None
        self.run_id = run
        self._resumed_at = sequence
        self._writer.commit_after(sequence)
        if restored is not None:
            self.last_restore = restored
        self._set_passed_over(set())

    def _set_passed_over(self, passed: set[tuple[int, int]]) -> None:
        self._passed_over = passed
        self._writer.damaged = frozenset(passed)  # read by the writer thread's retention

    # -- restoring ------------------------------------------------------------------------

    def steps(self, *, remote: bool = False) -> list[int]:
        """Committed steps, ascending; with ``remote=True`` those held by either tier (the
        remote tier's as far as it can be read), each once: the steps a restore can read."""
        if type(remote) is not bool:
            raise ConfigError(f"'remote' must be True or False: {remote!r:.100}")
        if not remote or self.remote is None:
            return committed_steps(self.storage)
        return sorted({c.step for c in resume_order(self.storage, self.remote.remote)})

    def latest_step(self) -> int | None:
        """The step a restore without ``step`` tries first: the newest checkpoint of the
        newest run (by commit sequence, in either tier), or None when nothing is committed."""
        remote = self.remote.remote if self.remote is not None else None
        candidates = resume_order(self.storage, remote)
        return candidates[0].step if candidates else None

    def latest(self) -> str | None:
        """The step directory's name of the checkpoint a restore without ``step`` tries first
        (see :meth:`latest_step`; ``step-0000000004-v1`` when two runs hold step 4), or None."""
        remote = self.remote.remote if self.remote is not None else None
        candidates = resume_order(self.storage, remote)
        return candidates[0].name if candidates else None

    def runs(self) -> dict[str, list[int]]:
        """The committed steps of each run in the directory (ascending), newest run first.
        Two runs may each hold a checkpoint of one step: it is listed under both."""
        found: dict[str, list[int]] = {}
        for info in step_infos(self.storage):
            if info.intact:
                found.setdefault(info.run, []).append(info.step)
        return {run: sorted(steps) for run, steps in found.items()}

    def manifest(self, step: CheckpointRef) -> Manifest:
        """The manifest of a committed step (its newest checkpoint), or of a step directory
        named by its name (``"step-0000000004-v1"``)."""
        info = find_checkpoint(self.storage, step)
        return read_manifest(self.storage, info.step, info.version)

    def restore(
        self,
        step: CheckpointRef | None = None,
        *,
        into: Mapping[str, Stateful] | None = None,
        strict: bool | None = None,
        rank: int | None = None,
        targets: InPlaceTargets | None = None,
        partial: bool = False,
        check: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Read, verify and return a committed state (tensors on CPU).

        A checkpoint restores on any number of ranks, whatever number wrote it. The per-rank
        state that rank ``rank`` (default: this manager's rank) saved is merged in; a rank the
        checkpoint does not have gets none (logged; ``last_restore.rank_state_restored``).

        Pending saves are made durable first. ``step``: a step, whose newest checkpoint is read when
        two runs hold one of it (by commit sequence), or a step directory's name
        (``"step-0000000004-v1"``, as :meth:`latest` and ``coci ls`` show it) for that one. Without
        ``step`` the newest checkpoint of the newest run is used (:meth:`latest_step`; with a remote
        tier, of either tier); if it is damaged, it is reported and the next newest intact one (the
        other tier's copy first) is used instead (unless ``strict``, which accepts only that copy).
        Later saves of this manager continue the restored checkpoint's run and are committed after
        it. ``into`` maps keys of the state to objects whose ``load_state_dict`` receives them. The
        restored step is in ``last_restore.step``.

        Modules and torch optimizers in ``into`` are filled in place: each stored tensor whose
        live counterpart (in their ``state_dict()``) is a contiguous CPU tensor of the same
        dtype and shape is read straight into it and verified there, so the restore needs no
        second copy of them; the returned state then holds those live tensors. A restore that
        raises may have left them partly overwritten. ``targets`` (instead of what ``into``
        gives) names live tensors of any layout to fill in place, for a caller that loads the
        state itself (see :class:`~coci_core.engine.restore.inplace.InPlaceTargets`). The objects in
        ``into`` are loaded in the sorted order of their keys, the same on every rank (their
        ``load_state_dict`` may run collectives).

        The checkpoint must match the live state that ``into`` or ``targets`` gives: a live
        tensor it has no value for, or a stored array of another shape, raises
        :class:`~coci_core.errors.StateMismatchError` before anything is read. ``partial=True``
        allows the missing ones (left as they are; modules in ``into`` are loaded with
        ``strict=False``, and objects whose key the checkpoint lacks are not loaded); shapes
        must match all the same.

        ``check(step, state)``: called on each checkpoint read, before it is taken; a
        :class:`~coci_core.errors.CorruptCheckpointError` it raises makes that checkpoint
        damaged (an adapter's check that the state it wrote holds what it can load: a forged
        manifest resealed with a valid checksum is then passed over like a damaged one).

        Raises:
            NoCheckpointError: nothing is committed (or not ``step``).
            CorruptCheckpointError: the requested (or, with ``strict``, the newest) checkpoint
                is damaged, or no intact one is left.
            StateMismatchError: the checkpoint does not match ``into`` or ``targets``.
            StorageError: the directory cannot be read (refused credentials or permission, a
                missing bucket, a store that cannot be reached): never read as empty.
        """
        if type(partial) is not bool:
            raise ConfigError(f"'partial' must be True or False: {partial!r}")
        if strict is not None and type(strict) is not bool:
            raise ConfigError(f"'strict' must be None, True or False: {strict!r}")
        if rank is not None and (type(rank) is not int or not 0 <= rank < 2**31):
            raise ConfigError(f"'rank' must be None or an integer in [0, 2**31): {rank!r:.100}")
        if check is not None and not callable(check):
            raise ConfigError(f"'check' must be None or a callable: {check!r:.100}")
        if targets is not None and not isinstance(targets, InPlaceTargets):
            raise ConfigError(
                f"'targets' must be None or InPlaceTargets (see in_place_targets): {targets!r:.100}"
            )
        self.wait()
        if targets is None and into is not None:
            targets = in_place_targets(into, partial=partial)
        elif targets is not None and partial:
            targets.partial = True
        loaded, event = restore_newest(
            self.storage,
            step,
            rank=self.group.rank if rank is None else rank,
            strict=self.strict if strict is None else strict,
            targets=targets,
            remote=self.remote.remote if self.remote is not None else None,
            agreement=RestoreAgreement.for_group(self.group, watch=Watch.of(self.group)),
            check=check,
        )
        self.last_restore = event
        if targets is not None:
            targets.check(loaded.step)
        if into is not None:
            started = time.perf_counter()
            load_into(loaded.state, into, partial=partial)
            load_s = time.perf_counter() - started
            self.last_restore = dataclasses.replace(
                self.last_restore, seconds=self.last_restore.seconds + load_s, load_s=load_s
            )
        self.continue_run(loaded.manifest.run, loaded.manifest.sequence)
        self._restored_newest = loaded.step if step is None else None
        self._set_passed_over(
            {(i.step, i.version) for i in loaded.passed_over if i.intact and i.run == self.run_id}
        )
        emit(self.listeners, self.last_restore)
        return loaded.state

    def verify(self, step: CheckpointRef | None = None) -> dict[int | str, list[str]]:
        """Damaged array keys per committed checkpoint (all, or ``step`` named as in
        :meth:`restore`), by step (by name for one saved beside another run's, ``step-...-v1``);
        one that retention removes while it is checked is left out, not reported damaged."""
        if step is not None:
            info = find_checkpoint(self.storage, step)
            where = checkpoint_storage(self.storage, info)
            return {step: verify_checkpoint(where, info.step)}
        found: dict[int | str, list[str]] = {}
        infos = step_infos(self.storage)
        for info in sorted(infos, key=lambda i: (i.step, i.version)):
            where = checkpoint_storage(self.storage, info, infos)
            try:
                key = info.step if info.version == 0 else info.name
                found[key] = verify_checkpoint(where, info.step)
            except NoCheckpointError:
                continue
        return found
