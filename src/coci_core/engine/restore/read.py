"""Reading and verifying stored arrays: each piece read (in chunks where the storage reads in
chunks) and checked against its checksum, delta pieces decoded through their bases, and the
limits that keep a damaged manifest from allocating or reading without bound."""

from __future__ import annotations

import heapq
import os
import threading
import time
from collections import Counter
from collections.abc import Collection, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import crc32c
import torch

from coci_core.codecs import RAW as RAW_CODEC
from coci_core.codecs import decode, needs_base
from coci_core.engine.directory.steps import ManifestCache
from coci_core.engine.format.manifest import Manifest, Piece, TensorEntry, step_dir_name
from coci_core.errors import CheckpointError, CorruptCheckpointError, StorageError
from coci_core.knobs import (
    CHUNKED_MIN_BYTES,
    READ_AHEAD_MIN_BYTES,
    READ_AHEAD_THREADS,
    READ_CHUNK_BYTES,
    REGION_GAP_BYTES,
    REGION_PIECE_BYTES,
    REGION_READ_BYTES,
)
from coci_core.storage import Storage

__all__ = [
    "CHUNKED_MIN_BYTES",
    "MAX_DELTA_CHAIN",
    "OVERLAP_CHECKSUMS",
    "READ_CHUNK_BYTES",
    "ZSTD_MAX_RATIO",
    "ArrayReader",
    "RestoreTimes",
    "read_checked",
]

# A delta is decoded against its base, which may itself be a delta: at most this many steps
# are read to rebuild one array (the array's own step and its bases). The writer's chains are
# at most ``max_lossy_generations`` + 1 steps deep (lossy deltas each against the previous
# reconstruction, back to a lossless base); lossless deltas are one step deep.
MAX_DELTA_CHAIN = 64
# zstd stores at most 128 KiB of output per 4 bytes of input (an RLE block: a 3-byte header and
# the byte): a piece decoded without a base holds at most this many times its stored bytes.
# (Measured: 128 MiB of zeros compress 32585x.) A delta piece is bounded by its base instead.
ZSTD_MAX_RATIO = 32768
# True: each chunk's checksum is computed on a helper thread while the next chunk is read. A
# restore runs before training does, so a core is free for it: measured 1.1-1.3x faster at 1
# and 4 GB on quiet cores; only on cores busy with other jobs was the checksum right after each
# read as fast (benchmarks/restore_bench.py measures both). False checksums inline. The threads
# that read large arrays ahead (READ_AHEAD_THREADS) checksum inline: the cores are theirs.
OVERLAP_CHECKSUMS = True

# Set in the threads that read arrays ahead: each checksums its own chunks, on its own core.
_reading_ahead = threading.local()
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
    *,
    shared: bool = False,
) -> int:
    """Fill ``view`` from ``path`` at ``offset``; return the crc32c of what was read (and add
    the time spent reading and checksumming to ``times``).

    From a storage that :attr:`~coci_core.storage.Storage.reads_in_chunks`, a piece of
    :data:`CHUNKED_MIN_BYTES` or more is read in :data:`READ_CHUNK_BYTES` reads (see
    :meth:`~coci_core.storage.Storage.read_chunks`), each checksummed after it (or, with
    :data:`OVERLAP_CHECKSUMS`, while the next one is read). ``shared``: other processes may
    read the same bytes now (ranks resharding), so it is read whole and its pages are left in
    the page cache for them."""
    times = times if times is not None else RestoreTimes()
    if len(view) >= CHUNKED_MIN_BYTES and storage.reads_in_chunks and not shared:
        return _read_chunked(storage, path, offset, view, times)
    started = time.perf_counter()
    storage.read_into(path, offset, view)
    read = time.perf_counter()
    crc = int(crc32c.crc32c(view))
    times.read_s += read - started
    times.verify_s += time.perf_counter() - read
    return crc


def _read_chunked(
    storage: Storage, path: str, offset: int, view: memoryview, times: RestoreTimes
) -> int:
    crc = _Crc()
    inline = not OVERLAP_CHECKSUMS or getattr(_reading_ahead, "on", False)
    worker = None if inline else _crc_worker()
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


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the system tells it)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _read_ahead_thread() -> None:
    _reading_ahead.on = True


def _alloc(nbytes: int) -> torch.Tensor:
    """A buffer of ``nbytes`` for an array or a stored piece: every size that reaches here was
    checked against the manifest's limits and the data files' sizes."""
    return torch.empty(nbytes, dtype=torch.uint8)


class ArrayReader:
    """Reads arrays of one storage, resolving delta pieces through their bases.

    An array stored as a delta is rebuilt bottom-up, without recursion: first every base it
    needs (through their own bases) is found and checked, at most :data:`MAX_DELTA_CHAIN`
    steps in all, each one listed in the restored manifest's ``bases``; then each is decoded
    once, oldest first, and dropped once nothing above it needs it. Manifests, file sizes and
    the bases found damaged are remembered for the reader's life.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.manifests = ManifestCache(storage)
        self.times = RestoreTimes()
        self._manifests: dict[int, Manifest | CheckpointError] = {}
        self._by_key: dict[int, dict[str, TensorEntry]] = {}
        self._sizes: dict[tuple[int, str], int | StorageError | None] = {}
        self._damaged: dict[tuple[int, str], CorruptCheckpointError] = {}

    def _manifest(self, step: int, top: int, key: str) -> Manifest:
        cached = self._manifests.get(step)
        if cached is None:
            try:
                cached = self.manifests.read(step)
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
                cached = self.storage.size(f"{step_dir_name(step)}/{name}")
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

    def fetch_all(
        self,
        manifest: Manifest,
        entries: Sequence[TensorEntry],
        outs: dict[int, torch.Tensor],
        skip: Collection[int] = (),
    ) -> Generator[torch.Tensor | None, None, None]:
        """What :meth:`fetch` gives for each of ``entries`` in turn (into ``outs[i]`` where
        given), the arrays stored raw in small pieces read by regions of their data files:
        one read per region, each piece checked over its slice. An array that does not fit
        that path (a delta, a compressed or large piece, a region that cannot be read, a
        checksum that does not match) goes through :meth:`fetch`, which reads it again and
        raises what it raises there. The entries in ``skip`` are not read (None).

        Large arrays are read ahead by threads, into ``outs`` too: close the generator (it
        waits for the reads in flight) before using ``outs`` after an error."""
        with self.storage.read_session():
            yield from self._fetch_all(manifest, entries, outs, skip)

    def _fetch_all(
        self,
        manifest: Manifest,
        entries: Sequence[TensorEntry],
        outs: dict[int, torch.Tensor],
        skip: Collection[int],
    ) -> Iterator[torch.Tensor | None]:
        regions = self._read_regions(manifest, entries, skip)
        ahead = [
            i
            for i, entry in enumerate(entries)
            if i not in skip and i not in regions and entry.raw_nbytes >= READ_AHEAD_MIN_BYTES
        ]
        threads = min(READ_AHEAD_THREADS, usable_cores())
        if len(ahead) < 2 or threads < 2 or not self.storage.reads_in_chunks:
            yield from self._fetch_in_order(manifest, entries, outs, skip, regions, {})
            return
        # Several large arrays read at once (each checked whole by its own thread), handed out
        # in order; on an early exit (an error, the caller stopping) nothing is still writing
        # into ``outs`` once this returns.
        pool = ThreadPoolExecutor(
            threads, thread_name_prefix="coci-restore-read", initializer=_read_ahead_thread
        )
        futures: dict[int, Future[torch.Tensor]] = {}
        try:
            for i in ahead:
                futures[i] = pool.submit(self.fetch, manifest, entries[i], outs.get(i))
            yield from self._fetch_in_order(manifest, entries, outs, skip, regions, futures)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _fetch_in_order(
        self,
        manifest: Manifest,
        entries: Sequence[TensorEntry],
        outs: dict[int, torch.Tensor],
        skip: Collection[int],
        regions: dict[int, list[memoryview]],
        futures: dict[int, Future[torch.Tensor]],
    ) -> Iterator[torch.Tensor | None]:
        for i, entry in enumerate(entries):
            if i in skip:
                yield None
                continue
            out = outs.get(i)
            future = futures.pop(i, None)
            if future is not None:
                yield future.result()
                continue
            parts = regions.pop(i, None)
            if parts is None:
                yield self.fetch(manifest, entry, out)
                continue
            # one storage per array, as fetch gives; copied by memoryview, never by a torch
            # op that may wait for intra-op threads
            out = _alloc(entry.raw_nbytes) if out is None else out
            dst = out.numpy().data
            for piece, part in zip(entry.pieces, parts, strict=True):
                dst[piece.start : piece.start + piece.length] = part
            yield out

    def _plain(self, manifest: Manifest, entry: TensorEntry) -> bool:
        """Whether every piece of ``entry`` is raw, of at most :data:`REGION_PIECE_BYTES` and
        within its data file (what :meth:`_check` finds of a raw entry), and the entry was not
        found damaged."""
        if entry.codec not in (RAW_CODEC, "mixed") or (manifest.step, entry.key) in self._damaged:
            return False
        for piece in entry.pieces:
            if piece.params is not None or piece.nbytes > REGION_PIECE_BYTES:
                return False
            try:
                size = self._file_size(manifest.step, piece.file, entry.key)
            except CorruptCheckpointError:
                return False
            if size is not None and piece.offset + piece.nbytes > size:
                return False
        return True

    def _read_regions(
        self, manifest: Manifest, entries: Sequence[TensorEntry], skip: Collection[int] = ()
    ) -> dict[int, list[memoryview]]:
        """For each plain entry (by index) read and checked whole: its pieces' bytes, views of
        the regions read."""
        if len(manifest.bases) >= MAX_DELTA_CHAIN:
            return {}
        spans = [
            (piece.file, piece.offset, piece.nbytes, i, k)
            for i, entry in enumerate(entries)
            if i not in skip and self._plain(manifest, entry)
            for k, piece in enumerate(entry.pieces)
        ]
        spans.sort()
        parts: dict[int, list[memoryview | None]] = {}
        failed: set[int] = set()
        step_dir = step_dir_name(manifest.step)
        first = 0
        while first < len(spans):
            name, start, _, _, _ = spans[first]
            last = first
            stop = start
            while last < len(spans):
                file, offset, nbytes, _, _ = spans[last]
                if file != name or offset > stop + REGION_GAP_BYTES:
                    break
                if max(stop, offset + nbytes) - start > REGION_READ_BYTES and last > first:
                    break
                stop = max(stop, offset + nbytes)
                last += 1
            buf = _alloc(stop - start)
            started = time.perf_counter()
            try:
                self.storage.read_into(f"{step_dir}/{name}", start, buf.numpy().data)
            except StorageError:
                failed.update(i for _, _, _, i, _ in spans[first:last])
                first = last
                continue
            checked = time.perf_counter()
            view = buf.numpy().data
            for _, offset, nbytes, i, k in spans[first:last]:
                entry = entries[i]
                lo = offset - start
                if crc32c.crc32c(view[lo : lo + nbytes]) != entry.pieces[k].crc32c:
                    failed.add(i)
                    continue
                got = parts.get(i)
                if got is None:
                    got = parts[i] = [None] * len(entry.pieces)
                got[k] = view[lo : lo + nbytes]
            self.times.read_s += checked - started
            self.times.verify_s += time.perf_counter() - checked
            first = last
        return {
            i: [p for p in got if p is not None]
            for i, got in parts.items()
            if i not in failed and all(p is not None for p in got)
        }

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
        out = _alloc(entry.raw_nbytes) if out is None else out
        for piece in entry.pieces:
            target = out[piece.start : piece.start + piece.length]
            self._decode_piece(manifest.step, entry, piece, target, bases)
        return out

    def _decode_piece(
        self,
        step: int,
        entry: TensorEntry,
        piece: Piece,
        target: torch.Tensor,
        bases: dict[int, torch.Tensor],
        *,
        shared: bool = False,
    ) -> None:
        """Read, verify and decode one piece into ``target`` (its ``length`` raw bytes);
        ``shared``: see :func:`read_checked`."""
        # raw pieces are read where they belong; compressed ones into a buffer of their stored
        # size, then decoded where they belong
        stored = target if piece.params is None else _alloc(piece.nbytes)
        view = stored.numpy().data
        try:
            crc = read_checked(
                self.storage,
                f"{step_dir_name(step)}/{piece.file}",
                piece.offset,
                view,
                self.times,
                shared=shared,
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

    def fetch_pieces(
        self, manifest: Manifest, entry: TensorEntry, wanted: Sequence[int]
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """The raw bytes of the pieces ``wanted`` (indices into ``entry.pieces``, in order),
        each read, verified and decoded alone, as ``(index, bytes)``; an entry whose pieces
        need bases (deltas) is fetched whole first and its pieces sliced from it. The pieces'
        pages stay in the page cache: the ranks of another mesh may each read some of them."""
        known = self._damaged.get((manifest.step, entry.key))
        if known is not None:
            raise known
        if len(manifest.bases) >= MAX_DELTA_CHAIN or self._check(manifest, entry):
            whole = self.fetch(manifest, entry)
            for i in wanted:
                p = entry.pieces[i]
                yield i, whole[p.start : p.start + p.length]
            return
        for i in wanted:
            p = entry.pieces[i]
            buf = _alloc(p.length)
            try:
                self._decode_piece(manifest.step, entry, p, buf, {}, shared=True)
            except CorruptCheckpointError as e:
                self._damaged[(manifest.step, entry.key)] = e
                raise
            yield i, buf
