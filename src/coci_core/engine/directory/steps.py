"""The committed steps of a storage: which exist, their manifests, and their order (newest
first by commit sequence), as resume and retention see them."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from coci_core.engine.format.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    parse_step_version,
    read_head_only,
    seal_of,
    step_dir_name,
)
from coci_core.errors import CorruptCheckpointError, NoCheckpointError, StorageError
from coci_core.knobs import STEP_INFO_CACHE_ENTRIES
from coci_core.storage import Storage, StorageWrapper

__all__ = [
    "ManifestCache",
    "RunView",
    "StepInfo",
    "checkpoint_storage",
    "committed_dirs",
    "committed_steps",
    "gc_paused",
    "highest_sequence",
    "newest_first",
    "newest_first_key",
    "read_manifest",
    "step_info",
    "remember_written",
    "step_infos",
    "step_versions",
]


def committed_dirs(storage: Storage) -> list[tuple[int, int]]:
    """(step, version) of each step directory with a committed manifest, ascending (damage
    is found on read, not here); see :func:`~coci_core.engine.format.manifest.step_dir_name`."""
    found = []
    for name in storage.list_dir(""):
        parsed = parse_step_version(name)
        if parsed is not None and storage.exists(f"{name}/{MANIFEST_NAME}"):
            found.append(parsed)
    return sorted(found)


def committed_steps(storage: Storage) -> list[int]:
    """Steps that have a committed manifest, ascending, each once (two runs may each hold a
    checkpoint of a step: see :func:`committed_dirs`)."""
    return sorted({step for step, _ in committed_dirs(storage)})


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
    #: 0, or the version suffix of a step that another run held first (``step-...-v1``)
    version: int = 0

    @property
    def name(self) -> str:
        """The step directory's name."""
        return step_dir_name(self.step, self.version)

    @property
    def order(self) -> tuple[int, float]:
        """Newer is greater: the commit sequence; the creation time only between manifests
        that record no sequence (an earlier 0.1.0.dev0's)."""
        return (self.sequence, self.created_unix if self.sequence == 0 else 0.0)


def newest_first_key(info: StepInfo) -> tuple[tuple[int, float], bool, int, int]:
    """The sort key of :func:`step_infos` (descending): a damaged manifest just before the
    intact step whose place it takes."""
    return (info.order, info.intact is False, info.step, info.version)


def step_infos(storage: Storage, *, kept: ManifestCache | None = None) -> list[StepInfo]:
    """Every committed step, newest first: by commit sequence (never by a wall clock), so
    that the newest checkpoint of the newest run comes first even when an older run left
    higher step numbers (and a run that went back to an older step and trained on prefers its
    new branch).

    A step whose manifest cannot be read is placed where its step number would place it in
    one run (tried just before the newest intact step below it), so that restore reports it.

    Each manifest's head is read (see :func:`step_info`): a manifest damaged beyond its head
    is found by the restore that reads it. ``kept`` keeps the newest document decoded whole
    (a manifest written by an earlier coci, with its head elsewhere), for the restore that
    follows to check and use without decoding it again.
    """
    infos: list[StepInfo] = []
    newest_below: StepInfo | None = None  # steps ascend: the newest intact step below this one
    for step, version in committed_dirs(storage):
        try:
            info = _step_info(storage, step, kept, version)
        except NoCheckpointError:
            continue  # removed meanwhile (retention)
        except CorruptCheckpointError:
            below = newest_below
            created, sequence = (below.created_unix, below.sequence) if below else (-1.0, 0)
            infos.append(
                StepInfo(step, "", created, intact=False, sequence=sequence, version=version)
            )
        else:
            infos.append(info)
            if newest_below is None or info.order > newest_below.order:
                newest_below = info
    return sorted(infos, key=newest_first_key, reverse=True)


def highest_sequence(storage: Storage) -> int:
    """The highest commit sequence of the intact committed steps of ``storage`` (0: none)."""
    return max((i.sequence for i in step_infos(storage) if i.intact), default=0)


def newest_first(storage: Storage) -> list[int]:
    """Committed steps in the order a resume tries them (see :func:`step_infos`)."""
    return [i.step for i in step_infos(storage)]


def read_manifest(storage: Storage, step: int, version: int = 0) -> Manifest:
    """The manifest of ``step`` (in its directory of ``version``), checked (see
    :meth:`Manifest.from_json`).

    Raises:
        NoCheckpointError: ``step`` is not committed.
        CorruptCheckpointError: the manifest is too large, cannot be read or parsed, fails
            its checksum or a check, or names another step.
    """
    return _parse(storage, step, _manifest_bytes(storage, step, version), version)


def _manifest_bytes(storage: Storage, step: int, version: int = 0) -> bytes:
    name = step_dir_name(step, version)
    path = f"{name}/{MANIFEST_NAME}"
    if not storage.exists(path):
        what = f"step {step}" if version == 0 else name
        raise NoCheckpointError(f"no committed checkpoint at {what} in {storage.url}")
    try:
        size = storage.size(path)
        if size is not None and size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"{_where(storage, step, version)} has {size} bytes, more than "
                f"{MAX_MANIFEST_BYTES}",
                step=step,
            )
        return storage.read_bytes(path)
    except StorageError as e:
        raise CorruptCheckpointError(f"cannot read manifest of step {step}: {e}", step=step) from e


def _where(storage: Storage, step: int, version: int = 0) -> str:
    what = f"step {step}" if version == 0 else step_dir_name(step, version)
    return f"manifest of {what} in {storage.url}"


_gc_lock = threading.Lock()
_gc_pauses = 0  # the gc_paused blocks running now, in any thread
_gc_was_enabled = False  # whether the collector was on when the first of them began


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: decoding a manifest, building a state and the
    writer's records make many objects in no cycle, and each collection walks every object
    alive (measured: 0.14 s to decode a manifest of 50,000 arrays with collection paused, 1.5 s
    without, while an earlier one was held).

    The pause is the process's: it ends when the last block that began it ends, in whichever
    thread, and then only if the collector was on when the first began (a program that turned
    it off keeps it off; a ``gc.disable()`` made while a pause runs is undone at its end). Keep
    such blocks short and free of waits on other processes."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def _gc_before_fork() -> None:
    _gc_lock.acquire()  # no fork between a change of the collector and of the count


def _gc_after_fork_in_parent() -> None:
    _gc_lock.release()


def _gc_after_fork() -> None:
    """In a forked child (a data loader's worker) no block of the parent's is running: the
    collector is turned back on if a pause of the parent's had turned it off."""
    global _gc_lock, _gc_pauses
    _gc_lock = threading.Lock()
    if _gc_pauses and _gc_was_enabled:
        gc.enable()
    _gc_pauses = 0


os.register_at_fork(
    before=_gc_before_fork,
    after_in_parent=_gc_after_fork_in_parent,
    after_in_child=_gc_after_fork,
)


def _parse(storage: Storage, step: int, data: bytes, version: int = 0) -> Manifest:
    with gc_paused():
        manifest = Manifest.from_json(data, where=_where(storage, step, version), step=step)
    return _checked(manifest, step, version)


def _checked(manifest: Manifest, step: int, version: int = 0) -> Manifest:
    if manifest.step != step:
        raise CorruptCheckpointError(
            f"manifest in {step_dir_name(step, version)} says step {manifest.step}", step=step
        )
    return manifest


# What ordering and retention need of the manifests read in this process, by step directory
# and the SHA-256 of the manifest's exact bytes: the same bytes give the same head, so a
# manifest read again (after each save, at each restore) is hashed, not parsed again.
_infos: dict[tuple[int, int, bytes], StepInfo] = {}


def _step_info(
    storage: Storage, step: int, kept: ManifestCache | None, version: int = 0
) -> StepInfo:
    data = _manifest_bytes(storage, step, version)
    key = (step, version, hashlib.sha256(data).digest())
    info = _infos.get(key)
    if info is None:
        with gc_paused():
            doc, head = read_head_only(data, where=_where(storage, step, version), step=step)
        if head.step != step:
            raise CorruptCheckpointError(
                f"manifest in {step_dir_name(step, version)} says step {head.step}", step=step
            )
        info = StepInfo(step, head.run, head.created_unix, True, head.bases, head.sequence, version)
        _remember(key, info)
        if kept is not None and doc is not None:
            kept.offer(key[2], doc, info)
    return info


def remember_written(data: bytes, info: StepInfo) -> None:
    """Note the head of a manifest this process has just written as ``data``: the listings
    that follow (retention after each commit) find it by its checksum without decoding it
    again (one JSON decode of the whole manifest per save, holding the GIL)."""
    _remember((info.step, info.version, hashlib.sha256(data).digest()), info)


def _remember(key: tuple[int, int, bytes], info: StepInfo) -> None:
    if len(_infos) >= STEP_INFO_CACHE_ENTRIES:
        _infos.clear()
    _infos[key] = info


def step_info(storage: Storage, step: int, version: int = 0) -> StepInfo:
    """What ordering and retention need of ``step``'s manifest (its run, sequence, bases):
    its checksum, format and head checked (see :func:`read_head_only`: from the head's fields
    alone where the manifest starts with them), the other fields, arrays and trees not
    (restore checks them all before it uses the step).

    Raises:
        NoCheckpointError: ``step`` is not committed.
        CorruptCheckpointError: the manifest cannot be read, fails its checksum or a check of
            its head, or names another step.
    """
    return _step_info(storage, step, None, version)


def step_versions(storage: Storage, step: int) -> list[StepInfo]:
    """The checkpoints of ``step`` in ``storage`` (one per run that holds it), newest first;
    one whose manifest cannot be read is listed with ``intact`` False."""
    prefix = step_dir_name(step)
    found = []
    for name in storage.list_dir(""):
        parsed = parse_step_version(name) if name.startswith(prefix) else None
        if parsed is None or parsed[0] != step:
            continue
        try:
            found.append(_step_info(storage, step, None, parsed[1]))
        except NoCheckpointError:
            continue
        except CorruptCheckpointError:
            found.append(StepInfo(step, "", -1.0, intact=False, version=parsed[1]))
    return sorted(found, key=newest_first_key, reverse=True)


class RunView(StorageWrapper):
    """A storage as one run's checkpoints read it: each step that the run holds under a
    versioned name (``step-...-v1``, see :func:`step_dir_name`) appears under the step's plain
    name, so that a checkpoint and the bases of its deltas (steps of its own run) are read
    where that run wrote them. Read only by restore; nothing is written through it."""

    def __init__(self, inner: Storage, versions: Mapping[int, int]) -> None:
        super().__init__(inner)
        self._names = {step_dir_name(s): step_dir_name(s, v) for s, v in versions.items() if v}

    def _map(self, path: str) -> str:
        head, sep, rest = path.partition("/")
        name = self._names.get(head)
        return path if name is None else name + sep + rest

    def list_dir(self, path: str = "") -> list[str]:
        return self.inner.list_dir(self._map(path))

    def exists(self, path: str) -> bool:
        return self.inner.exists(self._map(path))

    def read_bytes(self, path: str) -> bytes:
        return self.inner.read_bytes(self._map(path))

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(self._map(path), offset, out)

    def size(self, path: str) -> int | None:
        return self.inner.size(self._map(path))

    @property
    def reads_in_chunks(self) -> bool:
        return self.inner.reads_in_chunks

    def read_session(self) -> contextlib.AbstractContextManager[None]:
        return self.inner.read_session()

    def read_chunks(
        self, path: str, offset: int, out: memoryview, chunk_bytes: int
    ) -> Iterator[memoryview]:
        return self.inner.read_chunks(self._map(path), offset, out, chunk_bytes)

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        raise StorageError(f"{self.url}: a run's view of the directory is read only")

    def remove_dir(self, path: str) -> None:
        raise StorageError(f"{self.url}: a run's view of the directory is read only")

    def publish(self, staging: str, final: str) -> None:
        raise StorageError(f"{self.url}: a run's view of the directory is read only")


def checkpoint_storage(
    storage: Storage, info: StepInfo, infos: Iterable[StepInfo] | None = None
) -> Storage:
    """Where the checkpoint ``info`` is read, as step ``info.step`` (its plain name): the
    storage itself, or, when its run holds steps under versioned names, the run's
    :class:`RunView` (``infos``: the storage's :func:`step_infos`, when read already)."""
    if infos is None:
        if info.version == 0 and all(v == 0 for _, v in committed_dirs(storage)):
            return storage
        infos = step_infos(storage)
    versions = {i.step: i.version for i in infos if i.intact and i.run == info.run and info.run}
    versions[info.step] = info.version
    if not any(versions.values()):
        return storage
    return RunView(storage, versions)


class ManifestCache:
    """The manifests of one storage as one restore reads them: the document of the newest
    that :func:`step_infos` read is kept, and :meth:`read` checks it in full without reading
    and decoding it again while the file holds the same bytes (hashed again, so a manifest
    replaced meanwhile is read anew)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._kept: tuple[bytes, Any, StepInfo] | None = None
        #: what each manifest read says of the ranks that saved it (its world size and how
        #: many ranks' own states it holds), by step: what ranks restoring together compare
        self.ranks: dict[int, tuple[int, int]] = {}
        #: the seal of each manifest read (its checksum: see :func:`seal_of`), by step: copies
        #: of one checkpoint on the ranks' own disks hold the same, a forged one another
        self.seals: dict[int, str | None] = {}

    def offer(self, digest: bytes, doc: Any, info: StepInfo) -> None:
        """Keep ``doc`` if it is the newest offered so far."""
        if self._kept is None or newest_first_key(info) > newest_first_key(self._kept[2]):
            self._kept = (digest, doc, info)

    def read(self, step: int) -> Manifest:
        """The manifest of ``step``, as :func:`read_manifest` returns it."""
        data = _manifest_bytes(self.storage, step)
        kept = self._kept
        if kept is not None and kept[2].step == step and hashlib.sha256(data).digest() == kept[0]:
            self._kept = None  # parsed once: the load keeps the Manifest
            with gc_paused():
                manifest = Manifest.from_head(kept[1], where=_where(self.storage, step), step=step)
            manifest = _checked(manifest, step)
        else:
            manifest = _parse(self.storage, step, data)
        self.ranks[step] = (manifest.world_size, len(manifest.per_rank))
        self.seals[step] = seal_of(data)
        return manifest
