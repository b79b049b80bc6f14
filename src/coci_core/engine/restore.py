"""Restore: discover committed steps, read a manifest, fetch and verify every array, rebuild."""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import crc32c
import torch

from coci_core.codecs import RAW as RAW_CODEC
from coci_core.codecs import decode, needs_base
from coci_core.engine.inplace import Fill, InPlaceTargets
from coci_core.engine.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    TensorEntry,
    parse_step_dir,
    step_dir_name,
)
from coci_core.engine.tree import decode_dtype, load_torch_saved, ndarray_dtype, unflatten_state
from coci_core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    StorageError,
)
from coci_core.storage import LocalStorage, Storage
from coci_core.telemetry.events import RestoreEvent

__all__ = [
    "MAX_DELTA_CHAIN",
    "ZSTD_MAX_RATIO",
    "Candidate",
    "LoadedCheckpoint",
    "RestoreCache",
    "ResumePoint",
    "check_checkpoint",
    "committed_steps",
    "highest_sequence",
    "load_checkpoint",
    "newest_first",
    "read_manifest",
    "restore_newest",
    "resume_order",
    "resume_step",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

# A delta is decoded against its base, which may itself be a delta: at most this many steps
# are read to rebuild one array (the array's own step and its bases). The writer's chains are
# at most ``max_lossy_generations`` + 1 steps deep (lossy deltas each against the previous
# reconstruction, back to a lossless base); lossless deltas are one step deep.
MAX_DELTA_CHAIN = 64
# zstd stores at most 128 KiB of output per 4 bytes of input (an RLE block: a 3-byte header and
# the byte): a piece decoded without a base holds at most this many times its stored bytes.
# (Measured: 128 MiB of zeros compress 32585x.) A delta piece is bounded by its base instead.
ZSTD_MAX_RATIO = 32768
# A stored piece larger than this is read from local storage in reads of this size, the
# checksum of each computed on a helper thread while the next one is read.
READ_CHUNK_BYTES = 16 << 20
# Pieces from this size on are read from local storage in chunks whose pages are then dropped
# from the page cache (smaller ones are read whole and left there).
CHUNKED_MIN_BYTES = 1 << 20
# True: each chunk's checksum is computed on a helper thread while the next chunk is read. A
# restore runs before training does, so a core is free for it: measured 1.1-1.3x faster at 1
# and 4 GB on quiet cores; only on cores busy with other jobs was the checksum right after each
# read as fast (benchmarks/restore_bench.py measures both). False checksums inline.
OVERLAP_CHECKSUMS = True

_crc_lock = threading.Lock()
_crc_pool: ThreadPoolExecutor | None = None


def _crc_worker() -> ThreadPoolExecutor:
    """The one thread that checksums what restores read (in the order given)."""
    global _crc_pool
    with _crc_lock:
        if _crc_pool is None:
            _crc_pool = ThreadPoolExecutor(1, thread_name_prefix="coci-restore-crc")
        return _crc_pool


def _forget_worker() -> None:
    """In a forked child: the parent's thread is not there (a new one starts when needed)."""
    global _crc_lock, _crc_pool
    _crc_lock, _crc_pool = threading.Lock(), None


os.register_at_fork(after_in_child=_forget_worker)


class _Crc:
    """A crc32c computed over consecutive chunks (each added after the one before it)."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, chunk: memoryview) -> None:
        self.value = crc32c.crc32c(chunk, self.value)


@dataclass
class RestoreTimes:
    """Where a restore's time went (seconds, summed over its pieces): reading the bytes,
    verifying their checksums, and decoding compressed pieces."""

    read_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0


def read_checked(
    storage: Storage,
    path: str,
    offset: int,
    view: memoryview,
    times: RestoreTimes | None = None,
) -> int:
    """Fill ``view`` from ``path`` at ``offset``; return the crc32c of what was read (and add
    the time spent reading and checksumming to ``times``).

    From local storage (whose ``read_into`` is not overridden), a piece of
    :data:`CHUNKED_MIN_BYTES` or more is read in :data:`READ_CHUNK_BYTES` reads (see
    :meth:`LocalStorage.read_chunks`), each checksummed after it (or, with
    :data:`OVERLAP_CHECKSUMS`, while the next one is read)."""
    times = times if times is not None else RestoreTimes()
    if (
        isinstance(storage, LocalStorage)
        and type(storage).read_into is LocalStorage.read_into
        and len(view) >= CHUNKED_MIN_BYTES
    ):
        return _read_chunked(storage, path, offset, view, times)
    started = time.perf_counter()
    storage.read_into(path, offset, view)
    read = time.perf_counter()
    crc = int(crc32c.crc32c(view))
    times.read_s += read - started
    times.verify_s += time.perf_counter() - read
    return crc


def _read_chunked(
    storage: LocalStorage, path: str, offset: int, view: memoryview, times: RestoreTimes
) -> int:
    crc = _Crc()
    worker = _crc_worker() if OVERLAP_CHECKSUMS else None
    last: Future[None] | None = None
    verify = 0.0
    started = time.perf_counter()
    try:
        for chunk in storage.read_chunks(path, offset, view, READ_CHUNK_BYTES):
            t = time.perf_counter()
            if worker is None:
                crc.add(chunk)
            else:
                last = worker.submit(crc.add, chunk)
            verify += time.perf_counter() - t
    finally:
        if last is not None:
            t = time.perf_counter()
            last.result()  # the chunks before it ran first (one thread, in order)
            verify += time.perf_counter() - t
    times.verify_s += verify
    times.read_s += time.perf_counter() - started - verify
    return crc.value


def committed_steps(storage: Storage) -> list[int]:
    """Steps that have a committed manifest, ascending (damage is found on read, not here)."""
    steps = []
    for name in storage.list_dir(""):
        step = parse_step_dir(name)
        if step is not None and storage.exists(f"{name}/{MANIFEST_NAME}"):
            steps.append(step)
    return sorted(steps)


@dataclass(frozen=True)
class StepInfo:
    """What ordering and retention need of a committed step: its run, creation time, commit
    sequence (see :attr:`Manifest.sequence`) and the steps its deltas need (``intact`` False:
    its manifest cannot be read; the rest is then unknown, and ``sequence`` and
    ``created_unix`` are those of the newest intact step below it)."""

    step: int
    run: str
    created_unix: float
    intact: bool
    bases: tuple[int, ...] = ()
    sequence: int = 0

    @property
    def order(self) -> tuple[int, float]:
        """Newer is greater: the commit sequence; the creation time only between manifests
        that record no sequence (an earlier 0.1.0.dev0's)."""
        return (self.sequence, self.created_unix if self.sequence == 0 else 0.0)


def _newest_first_key(info: StepInfo) -> tuple[tuple[int, float], bool, int]:
    # a damaged manifest just before the intact step whose place it takes
    return (info.order, info.intact is False, info.step)


def step_infos(storage: Storage) -> list[StepInfo]:
    """Every committed step, newest first: by commit sequence (never by a wall clock), so
    that the newest checkpoint of the newest run comes first even when an older run left
    higher step numbers (and a run that went back to an older step and trained on prefers its
    new branch).

    A step whose manifest cannot be read is placed where its step number would place it in
    one run (tried just before the newest intact step below it), so that restore reports it.
    """
    infos: list[StepInfo] = []
    newest_below: StepInfo | None = None  # steps ascend: the newest intact step below this one
    for step in committed_steps(storage):
        try:
            m = read_manifest(storage, step)
        except NoCheckpointError:
            continue  # removed meanwhile (retention)
        except CorruptCheckpointError:
            below = newest_below
            created, sequence = (below.created_unix, below.sequence) if below else (-1.0, 0)
            infos.append(StepInfo(step, "", created, intact=False, sequence=sequence))
        else:
            info = StepInfo(step, m.run, m.created_unix, True, m.bases, m.sequence)
            infos.append(info)
            if newest_below is None or info.order > newest_below.order:
                newest_below = info
    return sorted(infos, key=_newest_first_key, reverse=True)


def highest_sequence(storage: Storage) -> int:
    """The highest commit sequence of the intact committed steps of ``storage`` (0: none)."""
    return max((i.sequence for i in step_infos(storage) if i.intact), default=0)


def newest_first(storage: Storage) -> list[int]:
    """Committed steps in the order a resume tries them (see :func:`step_infos`)."""
    return [i.step for i in step_infos(storage)]


TierName = Literal["local", "remote"]


@dataclass(frozen=True)
class Candidate:
    """A committed step of one tier, as a resume tries it."""

    tier: TierName
    storage: Storage
    info: StepInfo

    @property
    def step(self) -> int:
        return self.info.step


def _tiers(storage: Storage, remote: Storage | None) -> list[tuple[TierName, Storage]]:
    tiers: list[tuple[TierName, Storage]] = [("local", storage)]
    if remote is not None:
        tiers.append(("remote", remote))
    return tiers


def resume_order(storage: Storage, remote: Storage | None = None) -> list[Candidate]:
    """Every committed step of ``storage`` and of its ``remote`` tier, in the order a resume
    tries them: newest first by commit sequence across both tiers (see :func:`step_infos`),
    the local copy of a checkpoint before the remote one. A remote tier that cannot be read
    (down, refusing the credentials) leaves the local tier's steps, with a warning.

    Raises:
        StorageError: a tier cannot be read, and no other has a step (never an empty list).
    """
    candidates = [Candidate("local", storage, info) for info in step_infos(storage)]
    if remote is not None:
        try:
            infos = step_infos(remote)
        except StorageError as e:
            if not candidates:
                raise
            logger.warning("coci: the remote tier cannot be read (%s); resuming from local", e)
            infos = []
        candidates += [Candidate("remote", remote, info) for info in infos]
    # stable: of equal keys, the local tier (listed first) stays first
    return sorted(candidates, key=lambda c: _newest_first_key(c.info), reverse=True)


def _size(storage: Storage, path: str) -> int | None:
    """The size of a file, when the storage can tell it without reading it (``size()``)."""
    size = getattr(storage, "size", None)
    return int(size(path)) if callable(size) else None


def read_manifest(storage: Storage, step: int) -> Manifest:
    """The manifest of ``step``, checked (see :meth:`Manifest.from_json`).

    Raises:
        NoCheckpointError: ``step`` is not committed.
        CorruptCheckpointError: the manifest is too large, cannot be read or parsed, fails
            its checksum or a check, or names another step.
    """
    path = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    if not storage.exists(path):
        raise NoCheckpointError(f"no committed checkpoint at step {step} in {storage.url}")
    where = f"manifest of step {step} in {storage.url}"
    try:
        size = _size(storage, path)
        if size is not None and size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"{where} has {size} bytes, more than {MAX_MANIFEST_BYTES}", step=step
            )
        data = storage.read_bytes(path)
    except StorageError as e:
        raise CorruptCheckpointError(f"cannot read manifest of step {step}: {e}", step=step) from e
    manifest = Manifest.from_json(data, where=where, step=step)
    if manifest.step != step:
        raise CorruptCheckpointError(
            f"manifest in {step_dir_name(step)} says step {manifest.step}", step=step
        )
    return manifest


def _alloc(nbytes: int) -> torch.Tensor:
    """A buffer of ``nbytes`` for an array or a stored piece: every size that reaches here was
    checked against the manifest's limits and the data files' sizes."""
    return torch.empty(nbytes, dtype=torch.uint8)


class _Reader:
    """Reads arrays of one storage, resolving delta pieces through their bases.

    An array stored as a delta is rebuilt bottom-up, without recursion: first every base it
    needs (through their own bases) is found and checked, at most :data:`MAX_DELTA_CHAIN`
    steps in all, each one listed in the restored manifest's ``bases``; then each is decoded
    once, oldest first, and dropped once nothing above it needs it. Manifests, file sizes and
    the bases found damaged are remembered for the reader's life.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.times = RestoreTimes()
        self._manifests: dict[int, Manifest | CheckpointError] = {}
        self._by_key: dict[int, dict[str, TensorEntry]] = {}
        self._sizes: dict[tuple[int, str], int | StorageError | None] = {}
        self._damaged: dict[tuple[int, str], CorruptCheckpointError] = {}

    def _manifest(self, step: int, top: int, key: str) -> Manifest:
        cached = self._manifests.get(step)
        if cached is None:
            try:
                cached = read_manifest(self.storage, step)
            except CheckpointError as e:
                cached = e
            self._manifests[step] = cached
        if isinstance(cached, CheckpointError):
            raise CorruptCheckpointError(
                f"step {top}: {key!r} is a delta against step {step}, which cannot be read: "
                f"{cached}",
                step=top,
                bad=[key],
            ) from cached
        return cached

    def _entry(self, manifest: Manifest, key: str, top: int) -> TensorEntry:
        by_key = self._by_key.get(manifest.step)
        if by_key is None:
            by_key = self._by_key[manifest.step] = {t.key: t for t in manifest.tensors}
        entry = by_key.get(key)
        if entry is None:
            raise CorruptCheckpointError(
                f"step {top}: {key!r} is a delta against step {manifest.step}, which has no "
                "such array",
                step=top,
                bad=[key],
            )
        return entry

    def _file_size(self, step: int, name: str, key: str) -> int | None:
        cached = self._sizes.get((step, name), -1)
        if cached == -1:
            try:
                cached = _size(self.storage, f"{step_dir_name(step)}/{name}")
            except StorageError as e:
                cached = e
            self._sizes[(step, name)] = cached
        if isinstance(cached, StorageError):
            raise CorruptCheckpointError(
                f"step {step}: cannot read {key!r}: {cached}; the checkpoint is incomplete or "
                "corrupted",
                step=step,
                bad=[key],
            )
        return cached

    def _check(self, manifest: Manifest, entry: TensorEntry) -> tuple[int, ...]:
        """Check what the entry's pieces claim against its codecs' limits and the data files'
        actual sizes, before anything is allocated or read; return the steps of its bases."""
        step, key = manifest.step, entry.key
        bases = set()
        for piece in entry.pieces:
            span = f"{piece.start}-{piece.start + piece.length}"
            where = f"step {step}: a piece of {key!r} (bytes {span})"
            try:
                if piece.params is None:
                    if entry.codec not in (RAW_CODEC, "mixed") and not any(
                        q.params for q in entry.pieces
                    ):
                        raise CorruptCheckpointError(
                            f"unknown codec {entry.codec!r} for pieces stored as they are in "
                            f"memory ({RAW_CODEC!r})"
                        )
                    delta = False
                else:
                    delta = needs_base(piece.params)
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{where}: {e}", step=step, bad=[key]) from e
            if piece.params is None:
                pass
            elif delta:
                base_step = piece.params.get("base_step")
                if type(base_step) is not int or not 0 <= base_step < step:
                    raise CorruptCheckpointError(
                        f"{where} is a delta that names no earlier base step ({base_step!r})",
                        step=step,
                        bad=[key],
                    )
                bases.add(base_step)
            elif piece.length > ZSTD_MAX_RATIO * piece.nbytes:
                raise CorruptCheckpointError(
                    f"{where} claims {piece.length} bytes from {piece.nbytes} stored ones, more "
                    f"than zstd can expand ({ZSTD_MAX_RATIO}x)",
                    step=step,
                    bad=[key],
                )
            size = self._file_size(step, piece.file, key)
            if size is not None and piece.offset + piece.nbytes > size:
                raise CorruptCheckpointError(
                    f"{where} is stored at {piece.offset}-{piece.offset + piece.nbytes} of "
                    f"{piece.file}, which has {size} bytes; the checkpoint is incomplete or "
                    "corrupted",
                    step=step,
                    bad=[key],
                )
        return tuple(sorted(bases))

    def _plan(
        self, manifest: Manifest, entry: TensorEntry
    ) -> list[tuple[Manifest, TensorEntry, tuple[int, ...]]]:
        """The entry and every base entry it needs, each with its bases' steps, oldest first."""
        top, key = manifest.step, entry.key
        nodes = {top: (manifest, entry)}
        depth = {top: 1}
        bases_of: dict[int, tuple[int, ...]] = {}
        listed = set(manifest.bases)
        heap = [-top]
        while heap:  # newest first: every step's dependents are done before it
            step = -heapq.heappop(heap)
            m, e = nodes[step]
            bases_of[step] = bases = self._check(m, e)
            for base in bases:
                known = self._damaged.get((base, key))
                if known is not None:
                    raise CorruptCheckpointError(
                        f"step {top}: {key!r} needs step {base}'s, which is damaged: {known}",
                        step=top,
                        bad=[key],
                    )
                if base not in listed:
                    raise CorruptCheckpointError(
                        f"step {top}: {key!r} needs step {base} (through step {step}), which "
                        f"the manifest of step {top} does not list among its bases",
                        step=top,
                        bad=[key],
                    )
                if base not in nodes:
                    bm = self._manifest(base, top, key)
                    nodes[base] = (bm, self._entry(bm, key, top))
                    heapq.heappush(heap, -base)
                depth[base] = max(depth.get(base, 0), depth[step] + 1)
                if depth[base] > MAX_DELTA_CHAIN:
                    raise CorruptCheckpointError(
                        f"step {top}: {key!r} is a chain of deltas more than {MAX_DELTA_CHAIN} "
                        "steps deep",
                        step=top,
                        bad=[key],
                    )
                base_raw = nodes[base][1].raw_nbytes
                for p in e.pieces:
                    if (
                        p.params is not None
                        and p.params.get("base_step") == base
                        and p.start + p.length > base_raw
                    ):
                        raise CorruptCheckpointError(
                            f"step {step}: {key!r} needs bytes {p.start}-{p.start + p.length} "
                            f"of step {base}'s, which has {base_raw}",
                            step=top,
                            bad=[key],
                        )
        return [(nodes[s][0], nodes[s][1], bases_of[s]) for s in sorted(nodes)]

    def fetch(
        self, manifest: Manifest, entry: TensorEntry, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The entry's raw bytes as a uint8 tensor, assembled from its pieces (decoded, through
        their bases), every checksum verified: in ``out`` (of ``entry.raw_nbytes``) if given.
        When this raises, ``out`` may have been partly written."""
        if len(manifest.bases) >= MAX_DELTA_CHAIN:
            raise CorruptCheckpointError(
                f"step {manifest.step} lists {len(manifest.bases)} bases; a chain of deltas is "
                f"at most {MAX_DELTA_CHAIN} steps deep",
                step=manifest.step,
                bad=[entry.key],
            )
        known = self._damaged.get((manifest.step, entry.key))
        if known is not None:
            raise known
        self._manifests.setdefault(manifest.step, manifest)
        plan = self._plan(manifest, entry)
        uses = Counter(b for _, _, bases in plan for b in bases)
        decoded: dict[int, torch.Tensor] = {}
        for m, e, bases in plan:
            try:
                top = m.step == manifest.step
                decoded[m.step] = self._decode(m, e, decoded, out if top else None)
            except CorruptCheckpointError as err:
                if m.step == manifest.step:
                    raise
                self._damaged[(m.step, e.key)] = err
                raise CorruptCheckpointError(
                    f"step {manifest.step}: {e.key!r} is a delta against step {m.step}, which "
                    f"is damaged: {err}",
                    step=manifest.step,
                    bad=[e.key],
                ) from err
            for b in bases:
                uses[b] -= 1
                if not uses[b]:
                    del decoded[b]
        return decoded[manifest.step]

    def _decode(
        self,
        manifest: Manifest,
        entry: TensorEntry,
        bases: dict[int, torch.Tensor],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        step = manifest.step
        out = _alloc(entry.raw_nbytes) if out is None else out
        for piece in entry.pieces:
            # raw pieces are read where they belong; compressed ones (one piece at a time)
            # into a buffer of their stored size, then decoded where they belong
            target = out[piece.start : piece.start + piece.length]
            stored = target if piece.params is None else _alloc(piece.nbytes)
            view = stored.numpy().data
            try:
                crc = read_checked(
                    self.storage,
                    f"{step_dir_name(step)}/{piece.file}",
                    piece.offset,
                    view,
                    self.times,
                )
            except StorageError as e:
                raise CorruptCheckpointError(
                    f"step {step}: cannot read {entry.key!r}: {e}; the checkpoint is incomplete "
                    "or corrupted",
                    step=step,
                    bad=[entry.key],
                ) from e
            if crc != piece.crc32c:
                raise CorruptCheckpointError(
                    f"step {step}: checksum mismatch in {entry.key!r} (bytes "
                    f"{piece.start}-{piece.start + piece.length} in {piece.file})",
                    step=step,
                    bad=[entry.key],
                )
            if piece.params is not None:
                base = None
                if needs_base(piece.params):
                    whole = bases[piece.params["base_step"]]
                    base = whole[piece.start : piece.start + piece.length].numpy()
                started = time.perf_counter()
                try:
                    decode(stored.numpy(), piece.params, target.numpy(), base)
                except CorruptCheckpointError as e:
                    raise CorruptCheckpointError(
                        f"step {step}: {entry.key!r}: {e}", step=step, bad=[entry.key]
                    ) from e
                finally:
                    self.times.decode_s += time.perf_counter() - started
        return out


def _fetch(storage: Storage, manifest: Manifest, entry: TensorEntry) -> torch.Tensor:
    return _Reader(storage).fetch(manifest, entry)


def _as_value(entry: TensorEntry, raw: torch.Tensor) -> Any:
    if raw.numel() != entry.raw_nbytes:
        raise CorruptCheckpointError(
            f"{entry.key!r} has {raw.numel()} bytes, its shape and dtype need {entry.raw_nbytes}"
        )
    if entry.kind == "torch_save":
        return load_torch_saved(raw.numpy().tobytes(), entry.key)
    if entry.kind == "ndarray":
        dtype = ndarray_dtype(entry.numpy_dtype, entry.dtype)
        return raw.numpy().view(dtype).reshape(entry.shape)
    return raw.view(decode_dtype(entry.dtype)).reshape(entry.shape)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A restored state and what it cost to read."""

    step: int
    state: dict[str, Any]
    bytes_read: int
    manifest: Manifest
    rank_state_restored: bool = True


def _values(
    reader: _Reader,
    manifest: Manifest,
    entries: Any,
    fills: dict[int, Fill],
    targets: InPlaceTargets | None,
) -> tuple[list[Any], int]:
    """The entries' values; those in ``fills`` read into their live tensors (the values)."""
    values, nbytes = [], 0
    for i, entry in enumerate(entries):
        fill = fills.get(i)
        if fill is None or targets is None:
            values.append(_as_value(entry, reader.fetch(manifest, entry)))
        else:
            targets.written.add(fill.path)  # before: a failed read may leave it half written
            reader.fetch(manifest, entry, out=fill.raw)
            values.append(fill.tensor)
        nbytes += entry.nbytes
    return values, nbytes


def _unexpected(step: int, e: Exception, what: str = "") -> CorruptCheckpointError:
    """The CorruptCheckpointError for an error that no check foresaw (a safety net: malformed
    data must never escape as a ValueError, a RecursionError, a MemoryError, ...)."""
    return CorruptCheckpointError(
        f"step {step}{what}: cannot be read: {type(e).__name__}: {str(e)[:300]}", step=step
    )


class RestoreCache:
    """What restoring from ``storage`` learned (manifests, data file sizes, bases found
    damaged), shared by the steps one fallback loop tries: pass it to each
    :func:`load_checkpoint` of the loop, and a base found damaged for one step is not read and
    decoded again for the next. Use one per restore (a step may be saved again later)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._reader = _Reader(storage)


def load_checkpoint(
    storage: Storage,
    step: int,
    *,
    rank: int = 0,
    cache: RestoreCache | None = None,
    targets: InPlaceTargets | None = None,
) -> LoadedCheckpoint:
    """Read, verify and rebuild the state of ``step`` (tensors on CPU), with the per-rank
    state that rank ``rank`` saved merged in (when the checkpoint has that rank).

    With ``targets``, the arrays that fit a live tensor at the same path are read into it, and
    the state holds that tensor; if this raises, those tensors may be partly overwritten.

    Raises:
        NoCheckpointError: ``step`` is not committed.
        CorruptCheckpointError: the manifest or any array is damaged (the error names them);
            also any error that reading the checkpoint raised unforeseen.
        StorageError: the storage cannot tell whether ``step`` exists (it refuses the
            credentials, its bucket is missing, it cannot be reached).
    """
    reader = cache._reader if cache is not None and cache.storage is storage else None
    try:
        return _load(storage, step, rank, reader or _Reader(storage), targets)
    except (CheckpointError, StorageError):
        raise  # a store that cannot say whether the step exists (refused, down): not damage
    except Exception as e:
        raise _unexpected(step, e) from e


def _rank_trees(manifest: Manifest, rank: int) -> tuple[list[tuple[Any, Any]], bool]:
    """The trees (with their tensor entries) a restore for ``rank`` reads: the shared state's,
    then the rank's own when it has one; and whether the checkpoint holds per-rank state."""
    has_rank_state = any(r.tree is not None for r in manifest.per_rank)
    own = manifest.per_rank[rank] if has_rank_state and rank < len(manifest.per_rank) else None
    trees: list[tuple[Any, Any]] = [(manifest.tree, manifest.tensors)]
    if own is not None:
        trees.append((own.tree, own.tensors))
    return trees, has_rank_state


def _load(
    storage: Storage, step: int, rank: int, reader: _Reader, targets: InPlaceTargets | None
) -> LoadedCheckpoint:
    manifest = read_manifest(storage, step)
    trees, has_rank_state = _rank_trees(manifest, rank)
    fills = targets.plan(trees) if targets is not None else [{} for _ in trees]
    values, bytes_read = _values(reader, manifest, manifest.tensors, fills[0], targets)
    state = unflatten_state(manifest.tree, values)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"step {step}: the state is not a mapping", step=step)
    restored = not has_rank_state
    if len(trees) > 1:
        own_tree, own_entries = trees[1]
        own_values, n = _values(reader, manifest, own_entries, fills[1], targets)
        bytes_read += n
        own_state = unflatten_state(own_tree, own_values)
        if not isinstance(own_state, dict):
            raise CorruptCheckpointError(
                f"step {step}: the state of rank {rank} is not a mapping", step=step
            )
        state.update(own_state)
        restored = True
    elif has_rank_state:
        logger.warning(
            "coci: step %d was written by %d rank(s); rank %d gets no per-rank state",
            step,
            len(manifest.per_rank),
            rank,
        )
    return LoadedCheckpoint(step, state, bytes_read, manifest, restored)


def verify_checkpoint(
    storage: Storage, step: int, *, on_bad: Callable[[str, str], None] | None = None
) -> list[str]:
    """Check the manifest of ``step`` (its checksum and every field) and every array against
    its checksums; return the keys that are damaged.

    Raises:
        NoCheckpointError: ``step`` is not committed, or was removed (by retention, say) while
            it was being verified: then it is gone, not damaged.
        CorruptCheckpointError: the manifest itself is damaged.
    """
    path = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    try:
        manifest = read_manifest(storage, step)
        # the values in the trees (numpy scalars, bytes...), as restore would build them
        unflatten_state(manifest.tree, [None] * len(manifest.tensors))
        for own in manifest.per_rank:
            unflatten_state(own.tree, [None] * len(own.tensors))
    except CorruptCheckpointError:
        _raise_if_removed(storage, step, path)
        raise
    except (CheckpointError, StorageError):
        raise  # see load_checkpoint
    except Exception as e:
        _raise_if_removed(storage, step, path)
        raise _unexpected(step, e, " (its manifest)") from e
    reader = _Reader(storage)
    bad = []
    for entry in (*manifest.tensors, *(t for r in manifest.per_rank for t in r.tensors)):
        try:
            _as_value(entry, reader.fetch(manifest, entry))
        except Exception as e:
            if isinstance(e, CheckpointError) and not isinstance(e, CorruptCheckpointError):
                raise
            bad.append(entry.key)
            if on_bad is not None:
                why = str(e) if isinstance(e, CorruptCheckpointError) else str(_unexpected(step, e))
                on_bad(entry.key, why)
    if bad:
        _raise_if_removed(storage, step, path)
    return bad


def _raise_if_removed(storage: Storage, step: int, path: str) -> None:
    """Reading failed: when the step's manifest is gone, the step was removed (retention
    un-publishes a step before it deletes its files), not damaged."""
    try:
        present = storage.exists(path)
    except Exception:  # the storage cannot tell: keep the original error
        return
    if not present:
        raise NoCheckpointError(
            f"step {step} was removed from {storage.url} while it was being read (not damaged)"
        )


def _check_loadable(storage: Storage, step: int, rank: int, reader: _Reader) -> None:
    """What :func:`load_checkpoint` checks for ``rank``, without keeping the state: the
    manifest, the trees, and every array that rank's restore reads (one at a time)."""
    manifest = read_manifest(storage, step)
    trees, _ = _rank_trees(manifest, rank)
    for tree, entries in trees:
        unflatten_state(tree, [None] * len(entries))  # the tree's own values, as restore does
    for _, entries in trees:
        for entry in entries:
            _as_value(entry, reader.fetch(manifest, entry))


def check_checkpoint(
    storage: Storage, step: int, *, rank: int = 0, cache: RestoreCache | None = None
) -> None:
    """Check ``step`` as :func:`load_checkpoint` reads it for ``rank`` (the manifest and
    every array it needs, against their checksums), holding one array at a time.

    Raises:
        NoCheckpointError: ``step`` is not committed.
        CorruptCheckpointError: what :func:`load_checkpoint` would raise it for.
    """
    reader = cache._reader if cache is not None and cache.storage is storage else None
    try:
        _check_loadable(storage, step, rank, reader or _Reader(storage))
    except CheckpointError:
        raise
    except Exception as e:
        raise _unexpected(step, e) from e


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a resume takes (``candidate``) and the newer ones it passes over as
    damaged, each with why (``skipped``)."""

    candidate: Candidate
    skipped: tuple[tuple[Candidate, str], ...] = ()

    @property
    def step(self) -> int:
        return self.candidate.step

    @property
    def tier(self) -> TierName:
        return self.candidate.tier


_T = TypeVar("_T")


def _same_checkpoint(c: Candidate, newest: StepInfo) -> bool:
    """Whether ``c`` is a copy of ``newest`` (in the other tier: same step, run, sequence)."""
    info = c.info
    return info.intact and (info.step, info.run, info.sequence) == (
        newest.step,
        newest.run,
        newest.sequence,
    )


def _urls(storage: Storage, remote: Storage | None) -> str:
    return storage.url if remote is None else f"{storage.url} or {remote.url}"


def _first_intact(
    storage: Storage,
    remote: Storage | None,
    step: int | None,
    start_at: int | None,
    strict: bool,
    attempt: Callable[[Candidate, RestoreCache], _T],
    caches: dict[int, RestoreCache],
    on_damaged: Callable[[Candidate, CorruptCheckpointError], None] | None = None,
) -> tuple[ResumePoint, _T]:
    """The one decision of which checkpoint a resume takes: the candidates in
    :func:`resume_order` (or ``step`` in each tier), the first that ``attempt`` reads without
    damage. Restore, ``coci ls``, ``coci export`` and the adapters all come here."""
    if step is not None:
        candidates = [
            Candidate(tier, s, StepInfo(step, "", 0.0, intact=True))
            for tier, s in _tiers(storage, remote)
        ]
    else:
        candidates = resume_order(storage, remote)
        if not candidates:
            raise NoCheckpointError(f"no committed checkpoint in {_urls(storage, remote)}")
        starts = [i for i, c in enumerate(candidates) if c.step == start_at]
        if starts:
            candidates = candidates[starts[0] :]
    newest = candidates[0].info
    skipped: list[tuple[Candidate, str]] = []
    errors: list[str] = []
    damage: CorruptCheckpointError | None = None
    absence: NoCheckpointError | None = None
    for c in candidates:
        if strict and step is None and damage is not None and not _same_checkpoint(c, newest):
            raise damage  # strict: only another tier's copy of the newest may replace it
        cache = caches.setdefault(id(c.storage), RestoreCache(c.storage))
        try:
            return ResumePoint(c, tuple(skipped)), attempt(c, cache)
        except NoCheckpointError as e:
            absence = absence or e
            if step is None:  # removed while we read it (the writer's retention): not damage
                logger.info("coci: step %d was removed from %s while restoring it", c.step, c.tier)
                errors.append(f"step {c.step} ({c.tier}) was removed")
        except CorruptCheckpointError as e:
            damage = damage or e
            if on_damaged is not None:
                on_damaged(c, e)
            if step is None:
                where = f" ({c.tier})" if remote is not None else ""
                logger.warning(
                    "coci: step %d%s is damaged, trying an older one: %s", c.step, where, e
                )
            elif c.tier == "local" and remote is not None:
                logger.warning(
                    "coci: step %d (local) is damaged, trying the remote tier's copy: %s", step, e
                )
            skipped.append((c, str(e)))
            errors.append(str(e))
    if step is not None:
        raise damage or absence or NoCheckpointError(f"no step {step}")  # damage before absence
    raise CorruptCheckpointError(
        f"no intact checkpoint in {_urls(storage, remote)}: " + "; ".join(errors), bad=[]
    )


def resume_step(
    storage: Storage,
    *,
    remote: Storage | None = None,
    rank: int = 0,
    strict: bool = False,
    on_damaged: Callable[[Candidate, CorruptCheckpointError], None] | None = None,
) -> ResumePoint:
    """The checkpoint a resume takes from ``storage`` and its ``remote`` tier, as
    :func:`restore_newest` decides it, found by checking the candidates (newest first, every
    array that ``rank`` reads) without keeping their states. ``on_damaged`` is given each
    newer candidate found damaged, as it is found (also when none is intact).

    Raises:
        NoCheckpointError: nothing is committed.
        CorruptCheckpointError: no intact checkpoint is left (or, with ``strict``, the newest
            is damaged).
    """

    def check(c: Candidate, cache: RestoreCache) -> None:
        check_checkpoint(c.storage, c.step, rank=rank, cache=cache)

    return _first_intact(storage, remote, None, None, strict, check, {}, on_damaged)[0]


def restore_newest(
    storage: Storage,
    step: int | None = None,
    *,
    start_at: int | None = None,
    rank: int = 0,
    strict: bool = False,
    targets: InPlaceTargets | None = None,
    remote: Storage | None = None,
) -> tuple[LoadedCheckpoint, RestoreEvent]:
    """Restore ``step``, or without it the newest checkpoint of the newest run (from
    ``start_at`` on, in that order, when given), falling back past damaged ones unless
    ``strict``: the one restore path that every caller (the manager, the Lightning adapter,
    ``coci export``) uses, returning the event to report. With ``remote`` (a second tier), the
    newest intact checkpoint of either tier (see :func:`resume_order`), or ``step`` from the
    first tier where it is intact. ``targets``: live tensors to fill in place (see
    :func:`load_checkpoint`; call ``targets.check`` once a step is restored).

    Raises:
        NoCheckpointError: nothing is committed (or not ``step``).
        CorruptCheckpointError: ``step`` (or, with ``strict``, the newest) is damaged, or no
            intact checkpoint is left.
        StorageError: the storage cannot be listed or read (see :func:`load_checkpoint`).
    """
    started = time.perf_counter()
    caches: dict[int, RestoreCache] = {}  # per tier: a base found damaged is not read again

    def load(c: Candidate, cache: RestoreCache) -> LoadedCheckpoint:
        return load_checkpoint(c.storage, c.step, rank=rank, cache=cache, targets=targets)

    point, loaded = _first_intact(storage, remote, step, start_at, strict, load, caches)
    times = [cache._reader.times for cache in caches.values()]
    event = RestoreEvent(
        step=loaded.step,
        seconds=time.perf_counter() - started,
        bytes_read=loaded.bytes_read,
        skipped_steps=tuple(dict.fromkeys(c.step for c, _ in point.skipped)),  # once per step
        rank_state_restored=loaded.rank_state_restored,
        tier=point.tier,
        read_s=sum(t.read_s for t in times),
        verify_s=sum(t.verify_s for t in times),
        decode_s=sum(t.decode_s for t in times),
    )
    logger.info(
        "coci: restored step %d from %s (%.1f MB, %.3f s)",
        loaded.step,
        point.candidate.storage.url,
        loaded.bytes_read / 1e6,
        event.seconds,
    )
    return loaded, event
