"""The remote tier: every checkpoint committed locally is copied, in the background, to a
second storage (an object store, usually) and committed there too.

A process crash restores from the fast local tier; a lost node (an empty local disk) restores
from the remote one. The copy runs on its own thread and never stops training: a failed upload
is retried with exponential backoff (each failure reported as an :class:`UploadEvent`), and a
newer local checkpoint supersedes a pending one. Data files go first and the manifest last,
byte for byte as committed locally, so the remote step restores exactly as the local one and
a reader never sees a torn step (on an object store the manifest is the commit marker). A
delta checkpoint's bases are uploaded before it when the remote lacks them. Retention on the
remote keeps the run's newest ``keep_last`` steps and the steps kept also (an adapter's best
step: :attr:`RemoteTier.also_keep`), deleting only behind a newer remote commit.

Uploads write only while this run holds the remote directory's lease. A store that is down
when the run starts, or for longer than the lease time, is not a reason to stop: the lease is
taken (again) by the next attempt once the store answers, unless another writer took it.
``close()`` retries nothing (a failed upload gets one last attempt at once) and names the steps
that did not reach the remote.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from coci_core.engine.directory import retention
from coci_core.engine.directory.lease import Lease, acquire_lease
from coci_core.engine.directory.steps import (
    StepInfo,
    highest_sequence,
    step_infos,
    step_versions,
)
from coci_core.engine.format.manifest import MANIFEST_NAME, read_head_only, step_dir_name
from coci_core.engine.group import RankGroup
from coci_core.errors import CheckpointError, DirectoryInUseError, NoCheckpointError, StorageError
from coci_core.knobs import (
    UPLOAD_BACKOFF_MAX_S,
    UPLOAD_BACKOFF_START_S,
    UPLOAD_CHUNK_BYTES,
    UPLOAD_CLOSE_TIMEOUT_S,
    UPLOAD_KEPT_WAITING,
)
from coci_core.storage import Storage
from coci_core.telemetry import UploadEvent

__all__ = ["RemoteTier", "same_place"]

logger = logging.getLogger(__name__)


def same_place(a: Storage, b: Storage) -> bool:
    """Whether two storages are one directory (one local directory by its real path, else
    one URL)."""
    root_a, root_b = a.local_root(), b.local_root()
    if root_a is not None and root_b is not None:
        return os.path.realpath(root_a) == os.path.realpath(root_b)
    return a.url.rstrip("/") == b.url.rstrip("/")


class RemoteTier:
    """Copies committed steps of ``local`` to ``remote`` on a background thread.

    Args:
        local: the manager's (fast) storage, where steps are committed first.
        remote: the second storage.
        keep_last: the run's committed steps kept on the remote (None: all).
        group: the manager's ranks: the coordinator uploads every rank's files (the local
            directory is one that every rank writes to, as a commit of several ranks needs),
            the other ranks only restore from the remote.
        run_id: the run whose steps retention counts (read at each upload).
        emit: receives every :class:`UploadEvent`.
        upload_every: upload every this many local commits (and the newest one at close):
            the remote period of a two-level plan
            (:func:`coci_core.planner.two_level.plan_two_levels`).
    """

    def __init__(
        self,
        local: Storage,
        remote: Storage,
        *,
        keep_last: int | None,
        group: RankGroup,
        run_id: Callable[[], str],
        emit: Callable[[UploadEvent], None],
        upload_every: int = 1,
    ) -> None:
        self.upload_every = upload_every
        self._commits = 0
        self._newest_unsent: int | None = None
        # the steps the period passed over (not uploaded), for a keep_also given after them
        self._passed: set[int] = set()
        self.local = local
        self.remote = remote
        self.keep_last = keep_last
        self._group = group
        self._run_id = run_id
        self._emit = emit
        self._cond = threading.Condition()
        self._pending: int | None = None
        # the steps of also_keep that a newer one replaced before they were uploaded (or that
        # the period passed over), oldest first: uploaded when nothing newer is pending
        self._kept_waiting: deque[int] = deque()
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._lease: Lease | None = None
        # the highest commit sequence on the remote (read under its lease): a save's sequence
        # is above it, so that the remote orders the uploads after what it holds
        self.highest_sequence = 0
        # why nothing is uploaded: another writer owns the remote directory (for good)
        self._refused: str | None = None
        # the steps handed to the upload thread since the newest one it committed, in order
        self._not_uploaded: list[int] = []
        self._last_error: str | None = None
        self._closing = False  # close() began: no retry, no backoff
        self._remote_read = False  # highest_sequence read under the lease
        self._lease_generation = 0
        #: steps the remote's retention keeps besides the newest ``keep_last`` (set by the
        #: manager's :meth:`~coci_core.CheckpointManager.keep_also`, replaced, never changed)
        self.also_keep: frozenset[int] = frozenset()

    def claim(self) -> None:
        """Take the remote directory's lease, at the manager's first save (on rank 0; the
        other ranks read the remote tier, they never upload): a manager that only restores
        never holds it, so it never keeps another run's uploads out. Never raises: another
        writer's lease refuses the uploads (a warning says so), a store that cannot be
        reached is tried again at each upload."""
        if not self._group.is_coordinator or self._lease is not None or self._refused:
            return
        remote = self.remote
        try:
            lease = acquire_lease(remote, self._group.session)
        except DirectoryInUseError as e:
            with self._cond:
                self._refused = str(e)
            logger.warning("coci: remote %s: %s; nothing will be uploaded there", remote.url, e)
            return
        except StorageError as e:
            logger.warning(
                "coci: remote %s: %s; each upload tries to take its lease again", remote.url, e
            )
            return
        with self._cond:
            self._lease = lease
        try:
            self._take_over_remote()
        except StorageError as e:
            logger.warning("coci: remote %s: %s; read again before the first upload", remote.url, e)

    @property
    def writable(self) -> bool:
        """Whether this tier uploads: on rank 0, unless another writer owns the remote
        directory (a store that cannot be reached is retried)."""
        return self._group.is_coordinator and self._refused is None

    @property
    def not_uploaded(self) -> list[int]:
        """The steps handed to the upload since the newest upload that committed, in the order
        they were committed locally (each newer upload supersedes the older ones), and the
        kept steps waiting for their upload behind it."""
        with self._cond:
            return list(self._not_uploaded)

    def submit(self, step: int) -> None:
        """``step`` was committed locally: upload it (every ``upload_every``-th commit, and
        a step in :attr:`also_keep` whatever the period) when the thread is free; a step
        submitted before the previous one started replaces it."""
        if not self.writable:
            if self._group.is_coordinator:  # refused: close() names what never went there
                with self._cond:
                    if step in self._not_uploaded:
                        self._not_uploaded.remove(step)
                    self._not_uploaded.append(step)
            return
        self._commits += 1
        if self._commits % self.upload_every and step not in self.also_keep:
            self._newest_unsent = step
            with self._cond:
                self._passed.add(step)
                if len(self._passed) > 4096:  # a long run's: the oldest are retired locally
                    self._passed.discard(min(self._passed))
            return
        self._newest_unsent = None
        self._enqueue(step)

    def upload_kept(self) -> None:
        """The steps of :attr:`also_keep` that the period passed over at their commit (a
        ``keep_also`` given after it: the best step known after its save): uploaded when the
        thread is free, after the one pending."""
        if not self.writable:
            return
        with self._cond:
            late = sorted(self._passed & self.also_keep, reverse=True)
            if not late or self._stopping:
                return
            for step in late:
                if self._pending is None:
                    self._pending = step
                else:
                    self._wait_kept(step)
                self._passed.discard(step)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="coci-upload", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _enqueue(self, step: int) -> None:
        with self._cond:
            if self._stopping:
                return
            if self._pending not in (None, step) and self._pending in self.also_keep:
                self._wait_kept(self._pending)
            self._pending = step
            if step in self._not_uploaded:
                self._not_uploaded.remove(step)
            self._not_uploaded.append(step)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="coci-upload", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _wait_kept(self, step: int) -> None:
        """``step``, kept also, waits for its upload behind a newer one (under ``_cond``); the
        oldest waiting is left out, with a WARNING, past ``UPLOAD_KEPT_WAITING`` of them."""
        if step in self._kept_waiting:
            return
        self._kept_waiting.append(step)
        if step not in self._not_uploaded:
            self._not_uploaded.insert(0, step)
        if len(self._kept_waiting) > UPLOAD_KEPT_WAITING:
            dropped = self._kept_waiting.popleft()
            if dropped in self._not_uploaded:
                self._not_uploaded.remove(dropped)
            logger.warning(
                "coci: more than %d kept steps wait for their upload; kept step %d is not "
                "uploaded to %s (the oldest waiting), it stays in %s",
                UPLOAD_KEPT_WAITING,
                dropped,
                self.remote.url,
                self.local.url,
            )

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing is pending or being uploaded; whether that happened in time."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None or self._kept_waiting or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = UPLOAD_CLOSE_TIMEOUT_S, *, retry: bool = True) -> None:
        """Upload the newest local commit if it was left for a later one, finish the pending
        upload (waiting at most ``timeout_s``), then stop. Nothing is retried once close()
        began: an attempt running then is the last, a failed upload waiting out its backoff
        gets one more attempt at once. Steps left without an upload are named in one error
        line, with the remote and the local directory where they stay committed. ``retry`` is
        no longer needed (close() never retries) and stays for the callers that pass it."""
        if self._newest_unsent is not None and self.writable:
            self._enqueue(self._newest_unsent)
            self._newest_unsent = None
        with self._cond:
            self._closing = True
            self._cond.notify_all()  # a retry waiting out its backoff starts now
        finished = self.flush(timeout_s)
        unsent = self.not_uploaded
        if unsent:  # one line: the last attempt's own failure is not logged (see _run)
            if finished:
                why = f"failed ({self._refused or self._last_error})"
            else:
                why = f"did not finish within {timeout_s:.0f} s"
            kept, gone = self._still_local(unsent)
            lost = (
                f"; step(s) {_steps_text(gone)} were removed from {self.local.url} by its "
                "retention (keep_last) before an upload: they are in neither"
                if gone
                else ""
            )
            logger.error(
                "coci: upload of step %d to %s %s; close() gives up: step(s) %s were not "
                "uploaded, they stay committed in %s (the remote keeps what it had)%s",
                unsent[-1],
                self.remote.url,
                why,
                _steps_text(kept) if kept else "none",
                self.local.url,
                lost,
            )
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=1.0)
            if thread.is_alive():
                # An upload attempt is still running: the remote's owner record is given up
                # when it ends (by the thread), never while it may still write.
                return
        self._release_lease()

    def _still_local(self, steps: list[int]) -> tuple[list[int], list[int]]:
        """``steps`` split into those this run still holds committed on the local tier and
        those its retention removed (all held when the local tier cannot be listed)."""
        run = self._run_id()
        try:
            held = {i.step for i in step_infos(self.local) if i.intact and i.run == run}
        except (StorageError, CheckpointError):
            return list(steps), []
        return [s for s in steps if s in held], [s for s in steps if s not in held]

    def _release_lease(self) -> None:
        with self._cond:
            lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

    # -- the upload thread ---------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._run()
        finally:
            with self._cond:
                stopping = self._stopping
            if stopping:  # close() left the lease to this thread
                self._release_lease()

    def _run(self) -> None:
        attempt, backoff = 0, UPLOAD_BACKOFF_START_S
        step: int | None = None
        while True:
            with self._cond:
                if self._pending is not None and self._pending != step:
                    if step is not None and step in self.also_keep:  # failed: after the newer
                        self._wait_kept(step)
                    step, attempt, backoff = self._pending, 0, UPLOAD_BACKOFF_START_S
                self._pending = None
                while step is None and self._kept_waiting:  # kept steps a newer one replaced
                    kept = self._kept_waiting.popleft()
                    if kept in self.also_keep:  # (else no longer kept: superseded)
                        step, attempt, backoff = kept, 0, UPLOAD_BACKOFF_START_S
                    elif kept in self._not_uploaded:
                        self._not_uploaded.remove(kept)
                if step is None:
                    self._busy = False
                    self._cond.notify_all()
                    while self._pending is None and not self._kept_waiting and not self._stopping:
                        self._cond.wait()
                    if self._pending is None and not self._kept_waiting:
                        return
                    continue
                if self._stopping:
                    self._busy = False
                    self._cond.notify_all()
                    return
                self._busy = True
            attempt += 1
            if self._upload(step, attempt):
                step = None
                continue
            with self._cond:
                if self._closing or self._refused is not None:
                    # no retry once close() began: the failure is the one close() names
                    step = None
                    if self._refused is not None:
                        self._pending = None
                        self._kept_waiting.clear()
                    continue
                logger.warning(
                    "coci: upload of step %d to %s failed: %s",
                    step,
                    self.remote.url,
                    self._last_error,
                )
                # retry after the backoff, unless a newer step, close() or a stop comes
                deadline = time.monotonic() + backoff
                while self._pending is None and not self._stopping and not self._closing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._stopping:
                    self._busy = False
                    self._cond.notify_all()
                    return
            backoff = min(backoff * 2, UPLOAD_BACKOFF_MAX_S)

    def _upload(self, step: int, attempt: int) -> bool:
        """One attempt; whether it committed (or the step is superseded). The caller logs a
        failure (in :attr:`_last_error`), close() the one it gives up on."""
        started = time.perf_counter()
        error: str | None = None
        try:
            self._hold_lease()
            sent = self._upload_with_bases(step, self._run_id(), set())
            if self.keep_last is not None:
                retention.apply_keep_last(
                    self.remote,
                    keep_last=self.keep_last,
                    run_id=self._run_id(),
                    newest=step,
                    next_base=None,
                    also_keep=self.also_keep,
                )
        except DirectoryInUseError as e:  # another writer owns the remote: write nothing
            with self._cond:
                self._refused = f"the remote tier is not this run's: {e}"
            error = f"{type(e).__name__}: {e}"
            logger.error("coci: %s; nothing more is uploaded there", self._refused)
        except Exception as e:  # a remote that fails never stops training: retried
            if not _held_by(self.local, step, self._run_id()):
                # retention removed the local step meanwhile: a newer one supersedes it
                self._emit(UploadEvent(step=step, outcome="superseded", attempt=attempt))
                return True
            error = f"{type(e).__name__}: {e}"
        else:
            with self._cond:
                if step in self._not_uploaded:  # the ones handed over before it are superseded
                    at = self._not_uploaded.index(step)  # (but the kept ones waiting)
                    self._not_uploaded[: at + 1] = [
                        s for s in self._not_uploaded[:at] if s in self._kept_waiting
                    ]
        self._last_error = error
        self._emit(
            UploadEvent(
                step=step,
                outcome="failed" if error else "committed",
                attempt=attempt,
                seconds=time.perf_counter() - started,
                bytes_uploaded=0 if error else sent,
                error=error,
            )
        )
        return error is None

    def _hold_lease(self) -> None:
        """Hold the remote directory's lease before writing there: take it if the store was
        down when the run started, take it again if it lapsed in an outage.

        Raises:
            DirectoryInUseError: another writer owns the directory.
            StorageError: the store cannot be reached (the upload is retried).
        """
        if self._lease is None:
            lease = acquire_lease(self.remote, self._group.session)
            with self._cond:
                self._lease = lease
        else:
            self._lease.ensure_held()
            if self._lease.generation != self._lease_generation:  # taken again after a lapse:
                self._lease_generation = self._lease.generation  # another writer may have
                self._remote_read = False  # committed meanwhile
        if not self._remote_read:
            self._take_over_remote()

    def _take_over_remote(self) -> None:
        """Once the lease is taken: remove the data files a killed upload left without a
        manifest (invisible), and read the remote's highest commit sequence.

        Raises:
            StorageError: the remote cannot be listed (tried again before the next upload).
        """
        try:
            retention.remove_uncommitted(self.remote, self._group, done_seq=None)
        except Exception as e:  # leftovers are invisible: never a reason to stop uploading
            logger.warning("coci: cannot clean up %s: %s", self.remote.url, e)
        self.highest_sequence = highest_sequence(self.remote)
        self._remote_read = True

    def _upload_with_bases(self, step: int, run: str, seen: set[int]) -> int:
        """Upload ``run``'s checkpoint of ``step`` after any of its delta bases the remote
        lacks; the bytes sent. A step that another run holds on the remote is uploaded beside
        it (``step-...-v1``), as the manager saves it locally."""
        if step in seen:
            raise CheckpointError(f"step {step}: its delta bases form a cycle")
        local = _held_by(self.local, step, run)
        if local is None and not seen:
            raise NoCheckpointError(
                f"{self.local.url} holds no checkpoint of step {step} of run {run}"
            )
        seen.add(step)
        # a base of an earlier coci (no run holds it under a versioned name): its plain name
        source = local.name if local is not None else step_dir_name(step)
        manifest = self.local.read_bytes(f"{source}/{MANIFEST_NAME}")
        held = step_versions(self.remote, step)
        own = [i for i in held if i.intact and i.run == run]
        final = (
            own[0].name
            if own
            else step_dir_name(step, max((i.version for i in held), default=-1) + 1)
        )
        if own and self.remote.read_bytes(f"{final}/{MANIFEST_NAME}") == manifest:
            return 0  # already there, byte for byte
        sent = 0
        where = f"manifest of {source} in {self.local.url}"
        for base in read_head_only(manifest, where=where, step=step)[1].bases:  # the head suffices
            sent += self._upload_with_bases(base, run, seen)
        if own:
            # another version of the step (a re-save): its files may share names with ours
            retention.retire(self.remote, step, own[0].version)
        staging = self.remote.staging_dir(final, f"{self._group.session}up-{step}")
        for name in self.local.list_dir(source):
            if name == MANIFEST_NAME or not name.startswith("data-"):
                continue
            sent += self.remote.write_file(f"{staging}/{name}", self._chunks(f"{source}/{name}"))
        sent += self.remote.write_file(f"{staging}/{MANIFEST_NAME}", [memoryview(manifest)])
        self.remote.publish(staging, final)
        return sent

    def _chunks(self, path: str) -> Iterator[memoryview]:
        """The local file in bounded chunks (one buffer, reused); whole where the local
        storage cannot tell its size."""
        size = self.local.size(path)
        if size is None:
            yield memoryview(self.local.read_bytes(path))
            return
        buffer = bytearray(min(size, UPLOAD_CHUNK_BYTES))
        offset = 0
        while offset < size:
            n = min(len(buffer), size - offset)
            view = memoryview(buffer)[:n]
            self.local.read_into(path, offset, view)
            yield view
            offset += n


def _held_by(storage: Storage, step: int, run: str) -> StepInfo | None:
    """``run``'s checkpoint of ``step`` in ``storage``, or None."""
    own = [i for i in step_versions(storage, step) if i.intact and i.run == run]
    return own[0] if own else None


def _steps_text(steps: list[int], most: int = 10) -> str:
    """``steps`` for a message: all of them, or the first and last few and how many."""
    if len(steps) <= most:
        return ", ".join(map(str, steps))
    half = most // 2
    shown = ", ".join(map(str, steps[:half])) + ", ..., " + ", ".join(map(str, steps[-half:]))
    return f"{shown} ({len(steps)} steps)"
