"""Phase 2: checksum, write and commit a snapshot, in one background worker thread per rank.

Each rank writes its share of the arrays (and its own per-rank state) as one data file: the
snapshot's arena as it is (large sequential writes from the reused buffer, direct I/O where the
file system allows). With one rank the manifest follows at once; with several, each rank leaves
a marker naming its pieces, and rank 0 writes the manifest only when every rank's marker is
there (``commit.py``). Nothing here pickles, and nothing runs on the training thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import crc32c

from coci_core.codecs import stores_compressed
from coci_core.engine.directory.steps import (
    StepInfo,
    gc_paused,
    remember_written,
    step_versions,
)
from coci_core.engine.format.manifest import (
    MANIFEST_NAME,
    DataFile,
    Manifest,
    Piece,
    RankState,
    check_readable_head,
    step_dir_name,
)
from coci_core.engine.format.tree import encode_dtype
from coci_core.engine.group import RankGroup
from coci_core.engine.pulse import Watch
from coci_core.engine.restore.restore import read_manifest
from coci_core.engine.save import commit
from coci_core.engine.save.compress import PieceEncoder
from coci_core.engine.save.entries import EntriesTemplate, tensor_entry
from coci_core.engine.save.snapshot import Snapshot
from coci_core.engine.save.workers import lower_thread_priority
from coci_core.errors import StorageError
from coci_core.knobs import SHARD_PIECE_BYTES, WRITE_CHUNK_BYTES
from coci_core.storage import Storage

__all__ = [
    "PersistJob",
    "WriteResult",
    "data_file_name",
    "write_checkpoint",
]

logger = logging.getLogger(__name__)


def data_file_name(rank: int, token: str | None = None) -> str:
    """The data file that ``rank`` writes (named after the save too where a storage writes in
    place, so that a re-save never overwrites the committed step's files)."""
    return f"data-r{rank}.bin" if token is None else f"data-r{rank}-{token}.bin"


@dataclass
class PersistJob:
    """One snapshot to make durable.

    The snapshot's first ``n_shared`` leaves are the state shared by every rank (``tree``);
    the rest are this rank's own state (``rank_tree``).
    """

    step: int
    snapshot: Snapshot
    tree: Any
    metadata: dict[str, Any]
    n_shared: int
    seq: int = 0  # the save's number in its session (the same on every rank)
    solo: bool = False  # rank 0 saves alone (not counted in ``seq``)
    rank_tree: Any = None
    tree_ints: bool | None = None  # whether ``tree`` holds an ``ints`` node (None: unknown)
    # the flatten's layout token of the shared arrays (None: unknown; see FlatState.layout)
    leaf_layout: object | None = None
    layout: str = ""
    group: RankGroup = field(default_factory=RankGroup.single)
    run: str = ""  # the run the checkpoint belongs to (see CheckpointManager.run_id)
    version: int = 0  # of the step directory (see step_dir_name): the same on every rank
    # the commit order (Manifest.sequence), set by the coordinator's writer thread before the
    # write, under the directory's lease
    sequence: int = 0

    @property
    def token(self) -> str:
        """The save's name in staging directories and data files: unique per session and
        save, and the same on every rank."""
        return save_token(self.group.session, self.solo, self.seq)


def save_token(session: str, solo: bool, seq: int) -> str:
    """See :attr:`PersistJob.token`."""
    return f"{session}{'solo' if solo else ''}-{seq}"


def abandon_for_the_others(
    storage: Storage, step: int, version: int, token: str, group: RankGroup, error: BaseException
) -> None:
    """The coordinator's save failed before anything was queued (the directory's lease is
    another writer's): record the abort where the other ranks, whose saves went on, wait for
    the commit, so that they raise its reason at once instead of after twice the group's
    timeout (best effort)."""
    if not group.is_coordinator or group.world_size == 1:
        return
    final = step_dir_name(step, version)
    staging = storage.staging_dir(final, token)
    commit.fail(
        storage, commit.records_dir(final, token) if staging == final else staging, group, error
    )


@dataclass(frozen=True)
class WriteResult:
    """A committed checkpoint: where, how many bytes this rank wrote, how many raw bytes they
    hold, and how long the write (with any encoding) took."""

    path: str
    bytes_written: int
    raw_bytes: int = 0
    write_s: float = 0.0
    encoded: bool = False


class _RunAhead:
    """Runs an iterator on a helper thread, up to ``depth`` items ahead of its consumer, so
    that producing the next chunk (waiting for the copy, checksums, encoding) overlaps the
    write of this one. Use as a context manager: leaving it stops and joins the thread."""

    _END = object()

    def __init__(self, items: Iterator[memoryview], *, depth: int = 2) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._fill, args=(items,), name="coci-persist-ahead", daemon=True
        )

    def __enter__(self) -> Iterator[memoryview]:
        self._thread.start()
        return self._drain()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _fill(self, items: Iterator[memoryview]) -> None:
        lower_thread_priority(5)
        try:
            for item in items:
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as e:
            self._put(e)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()  # a generator's own clean-up (its encoder pool) runs here, not later

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue  # the consumer is writing; re-check whether it gave up
        return False

    def _drain(self) -> Iterator[memoryview]:
        while True:
            item = self._queue.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class _Pieces:
    """This rank's pieces as they are written: raw from the arena, or encoded."""

    def __init__(self, job: PersistJob, file: str) -> None:
        self.job = job
        self.file = file
        self.placed: list[tuple[int, Piece]] = []
        self._crcs: list[int] | None = None  # of the raw arena's pieces (checksum_raw)
        self.raw_bytes = 0
        self.stored_bytes = 0
        self.encoded = False

    def raw(self) -> Iterator[memoryview]:
        """The arena as it is, in large aligned chunks (checksums: :meth:`checksum_raw`)."""
        snap = self.job.snapshot
        total = snap.arena.total_bytes
        for start in range(0, total, WRITE_CHUNK_BYTES):
            yield snap.arena.memoryview(start, min(start + WRITE_CHUNK_BYTES, total))

    def _raw_parts(self) -> Iterator[tuple[Any, int, int]]:
        """``(slot, offset in the arena, bytes)`` of every piece of the raw arena: a slot
        whole, or a rank's part of a sharded tensor in pieces (a rank of another mesh reading
        some of it reads, and verifies, only the pieces that hold what it needs)."""
        snap = self.job.snapshot
        for slot in snap.slots:
            if not snap.leaves[slot.leaf].owned or slot.nbytes <= SHARD_PIECE_BYTES:
                yield slot, slot.offset, slot.nbytes
                continue
            for at in range(0, slot.nbytes, SHARD_PIECE_BYTES):
                yield slot, slot.offset + at, min(SHARD_PIECE_BYTES, slot.nbytes - at)

    def checksum_raw(self) -> None:
        """Checksum every piece of the raw arena (on a helper thread, while the arena is being
        written: CRC32C releases the GIL); :meth:`share` places them.

        Only integers are kept here: objects made while the write goes on would live through
        garbage collections and be promoted to the oldest generation, each of whose
        collections walks every object alive while holding the GIL (measured: 85 ms per save
        of a GPT state of 3,092 arrays, in the writer thread, blocking the training thread).
        """
        arena = self.job.snapshot.arena
        crcs = self._crcs = []
        for _, offset, nbytes in self._raw_parts():
            crcs.append(crc32c.crc32c(arena.memoryview(offset, offset + nbytes)))

    def _place_raw(self) -> None:
        """The pieces of the raw arena, from the checksums of :meth:`checksum_raw`."""
        leaves, crcs = self.job.snapshot.leaves, self._crcs
        assert crcs is not None
        for (slot, offset, nbytes), crc in zip(self._raw_parts(), crcs, strict=True):
            start = leaves[slot.leaf].global_start + slot.start + offset - slot.offset
            self.placed.append((slot.leaf, Piece(self.file, offset, nbytes, start, nbytes, crc)))
            self.raw_bytes += nbytes
            self.stored_bytes += nbytes
        self._crcs = None

    def encoded_stream(self, encoder: PieceEncoder) -> Iterator[memoryview]:
        """Each piece encoded and written back to back; the next piece is encoded (on a helper
        thread: zstd and the hashes release the GIL) while this one is written."""
        snap = self.job.snapshot

        def encode(slot: Any) -> tuple[memoryview, Any]:
            leaf = snap.leaves[slot.leaf]
            data = snap.arena.memoryview(slot.offset, slot.offset + slot.nbytes)
            if slot.leaf >= self.job.n_shared or leaf.kind == "torch_save":
                return data, None
            dtype = encode_dtype(leaf.tensor.dtype)
            where = (leaf.key, leaf.global_start + slot.start, slot.nbytes, dtype)
            return data, encoder.encode(where, data, dtype, leaf.key)

        offset = 0
        with ThreadPoolExecutor(
            1, "coci-encode", initializer=lower_thread_priority, initargs=(5,)
        ) as pool:
            slots = list(snap.slots)
            ahead = pool.submit(encode, slots[0]) if slots else None
            for i, slot in enumerate(slots):
                assert ahead is not None
                data, enc = ahead.result()
                ahead = pool.submit(encode, slots[i + 1]) if i + 1 < len(slots) else None
                stored = data if enc is None else memoryview(enc.data).cast("B")
                self._place(slot, offset, stored, enc.params if enc is not None else None)
                self.encoded = self.encoded or (enc is not None and stores_compressed(enc.params))
                offset += stored.nbytes
                yield stored

    def _place(
        self, slot: Any, offset: int, stored: memoryview, params: Any, at: int | None = None
    ) -> None:
        """Record ``stored`` (a slot, or with ``at`` its raw bytes from ``at`` on) as a piece
        at ``offset`` of the data file."""
        start = self.job.snapshot.leaves[slot.leaf].global_start + slot.start + (at or 0)
        length = slot.nbytes if at is None else stored.nbytes
        crc = crc32c.crc32c(stored)
        piece = Piece(self.file, offset, stored.nbytes, start, length, crc, params)
        self.placed.append((slot.leaf, piece))
        self.raw_bytes += length
        self.stored_bytes += stored.nbytes

    def share(self, data_bytes: int) -> commit.RankShare:
        """What this rank wrote, for the commit (call under :func:`gc_paused`)."""
        job = self.job
        if self._crcs is not None:
            self._place_raw()
        shared = [(leaf, p) for leaf, p in self.placed if leaf < job.n_shared]
        own: dict[int, list[Piece]] = {}
        for leaf, p in self.placed:
            if leaf >= job.n_shared:
                own.setdefault(leaf, []).append(p)
        own_leaves = job.snapshot.leaves[job.n_shared :]
        rank_state = RankState(
            tree=job.rank_tree,
            tensors=tuple(
                tensor_entry(leaf, own.get(job.n_shared + i, []))
                for i, leaf in enumerate(own_leaves)
            ),
        )
        return commit.RankShare(
            rank=job.group.rank,
            token=job.token,
            layout=job.layout,
            pieces=tuple(shared),
            per_rank=rank_state,
            file=DataFile(self.file, data_bytes),
        )


def _bases(storage: Storage, shares: list[commit.RankShare], run: str) -> tuple[int, ...]:
    """Every earlier step this checkpoint's deltas need, through their own bases (steps of
    ``run``: read where that run wrote them)."""
    direct = {
        int(p.params["base_step"])
        for s in shares
        for _, p in s.pieces
        if p.params and p.params.get("base") and "base_step" in p.params
    }
    needed = set(direct)
    for step in direct:
        held = [i for i in step_versions(storage, step) if i.intact and i.run == run]
        needed.update(read_manifest(storage, step, held[0].version if held else 0).bases)
    return tuple(sorted(needed))


def _manifest_json(
    job: PersistJob,
    shares: list[commit.RankShare],
    bases: tuple[int, ...],
    template: EntriesTemplate | None = None,
) -> tuple[bytes, StepInfo]:
    """The sealed manifest of the committed shares and its head; raises what reading its head
    back would (never commit what a resume would refuse: the save fails instead, loudly).
    ``template``: the entries' JSON of the writer's last save (see :mod:`.entries`)."""
    tensors, boxes = (template if template is not None else EntriesTemplate()).encode(
        job.snapshot.leaves[: job.n_shared], shares, layout=job.leaf_layout
    )
    manifest = Manifest(
        step=job.step,
        created_unix=time.time(),  # shown only: never orders checkpoints (see sequence)
        tree=job.tree,
        tensors=(),  # given as JSON below
        files=tuple(s.file for s in shares),
        world_size=job.group.world_size,
        metadata=job.metadata,
        per_rank=tuple(s.per_rank for s in shares),
        token=job.token,
        bases=bases,
        run=job.run,
        sequence=job.sequence,
    )
    check_readable_head(
        manifest, where=f"step {job.step} (not committed: a resume could not read its manifest)"
    )
    head = StepInfo(
        manifest.step,
        manifest.run,
        manifest.created_unix,
        True,
        manifest.bases,
        manifest.sequence,
        job.version,
    )
    return manifest.to_json(tree_ints=job.tree_ints, tensors_json=(tensors, boxes)), head


def write_checkpoint(
    storage: Storage,
    job: PersistJob,
    encoder: PieceEncoder | None = None,
    template: EntriesTemplate | None = None,
) -> WriteResult:
    """Checksum (and, with an active ``encoder``, encode) this rank's part of the snapshot,
    write it, and commit with the other ranks; clean up on failure (a failure on any rank
    publishes nothing). The encoder's session for this save begins and ends here.

    Raises:
        StorageError: this rank's write failed.
        CommitError: another rank failed, or did not report within the group's timeout.
    """
    try:
        result = _write_checkpoint(storage, job, encoder, template)
    except BaseException:
        if encoder is not None:
            encoder.finish(committed=False, raw_bytes=0, stored_bytes=0, write_s=0.0)
        raise
    if encoder is not None:
        encoder.finish(
            committed=True,
            raw_bytes=result.raw_bytes,
            stored_bytes=result.bytes_written,
            write_s=0.0 if result.encoded else result.write_s,  # encoding time is not disk time
        )
    return result


def _write_checkpoint(
    storage: Storage,
    job: PersistJob,
    encoder: PieceEncoder | None,
    template: EntriesTemplate | None,
) -> WriteResult:
    snap = job.snapshot
    group = job.group
    final = step_dir_name(job.step, job.version)
    staging = storage.staging_dir(final, job.token)
    in_place = staging == final
    file = data_file_name(group.rank, job.token if in_place else None)
    # The ranks' commit records (shares, failures, an abort) go in a directory of this save
    # alone: where the data is written in the step's own directory, records of an earlier save
    # of the step must never count for this one.
    records = commit.records_dir(final, job.token) if in_place else staging
    pieces = _Pieces(job, file)
    try:
        # a failed or changed copy fails this save on every rank (through the commit records)
        snap.wait_copied()
        if encoder is not None and encoder.active:
            encoder.begin(job.step, lambda: _probe(job))
        started = time.perf_counter()  # the write (and encoding), not the probe
        path = f"{staging}/{file}"
        if encoder is not None and encoder.active and not encoder.writes_raw:
            with _RunAhead(pieces.encoded_stream(encoder)) as chunks:
                data_bytes = storage.write_file(path, chunks, aligned=False)
        else:
            with ThreadPoolExecutor(
                1, "coci-persist-crc", initializer=lower_thread_priority, initargs=(5,)
            ) as pool:
                checksums = pool.submit(pieces.checksum_raw)
                data_bytes = storage.write_file(path, pieces.raw(), aligned=True)
                checksums.result()
        write_s = time.perf_counter() - started
        # a background copy is committed only once the thread that saved has checked it
        snap.wait_checked()
        # The records below are many objects per array, in no cycle and dropped before the
        # collector runs again: see ``checksum_raw`` for what a collection among them costs.
        with gc_paused():
            share = pieces.share(data_bytes)
        if not group.is_coordinator:
            commit.report_share(storage, records, share)
            commit.await_outcome(storage, records, final, job.token, group, Watch.of(group))
            return WriteResult(final, data_bytes, pieces.raw_bytes, write_s, pieces.encoded)
        shares = commit.collect_shares(storage, records, share, group, Watch.of(group))
        bases = _bases(storage, shares, job.run)
        with gc_paused():
            manifest_json, head = _manifest_json(job, shares, bases, template)
            data_files = [s.file.name for s in shares]
            del share, shares
            pieces.placed.clear()
        storage.write_file(f"{staging}/{MANIFEST_NAME}", [memoryview(manifest_json)])
        remember_written(manifest_json, head)
        # The staging directory may have been removed under us (by hand, or by a tool that is
        # not coci): the manifest write would then recreate it with no data in it.
        missing = [name for name in data_files if not storage.exists(f"{staging}/{name}")]
        if missing:
            raise StorageError(
                f"the data files {missing} of step {job.step} disappeared before the commit "
                f"(was {storage.url}/{staging} removed?); nothing was published"
            )
        storage.publish(staging, final)
    except BaseException as e:
        commit.fail(storage, records, group, e)
        raise
    if records != staging and group.world_size > 1:
        with contextlib.suppress(Exception):  # left behind, the next clean-up removes them
            storage.remove_dir(records)
    return WriteResult(
        final,
        data_bytes + len(manifest_json),
        pieces.raw_bytes,
        write_s,
        pieces.encoded,
    )


def _probe(job: PersistJob) -> list[tuple[memoryview, str]]:
    """Float pieces of this save, largest first: what "auto" measures compression on."""
    snap = job.snapshot
    slots = sorted(
        (s for s in snap.slots if s.leaf < job.n_shared and s.dtype.is_floating_point),
        key=lambda s: -s.nbytes,
    )
    return [
        (snap.arena.memoryview(s.offset, s.offset + s.nbytes), encode_dtype(s.dtype))
        for s in slots[:4]
    ]
