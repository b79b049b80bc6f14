"""Loading one checkpoint: the state a rank restores (arrays read into live tensors where
given), and the checks of a step that ``coci verify``, ``coci ls`` and resume make without
keeping its state."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from coci_core.engine.directory.steps import ManifestCache, StepInfo, gc_paused, read_manifest
from coci_core.engine.format.manifest import MANIFEST_NAME, Manifest, TensorEntry, step_dir_name
from coci_core.engine.format.regions import Region
from coci_core.engine.format.tree import (
    decode_dtype,
    load_torch_saved,
    ndarray_dtype,
    unflatten_state,
)
from coci_core.engine.restore.inplace import Fill, InPlaceTargets
from coci_core.engine.restore.read import ArrayReader, RestoreTimes
from coci_core.engine.restore.reshard import assemble, read_box
from coci_core.errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    StorageError,
)
from coci_core.storage import Storage

__all__ = [
    "LoadedCheckpoint",
    "RestoreCache",
    "check_checkpoint",
    "load_checkpoint",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)


def _as_value(entry: TensorEntry, raw: torch.Tensor, step: int) -> Any:
    if raw.numel() != entry.raw_nbytes:
        raise CorruptCheckpointError(
            f"{entry.key!r} has {raw.numel()} bytes, its shape and dtype need {entry.raw_nbytes}"
        )
    if entry.boxes is not None:
        return assemble(entry, raw, step)
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
    #: the local checkpoints the restore passed over (damaged, or not intact on every rank)
    passed_over: tuple[StepInfo, ...] = ()


def _values(
    reader: ArrayReader,
    manifest: Manifest,
    entries: Any,
    fills: dict[int, Fill],
    targets: InPlaceTargets | None,
) -> tuple[list[Any], int]:
    """The entries' values; those in ``fills`` read into their live tensors (the values)."""
    if targets is None:
        fills = {}
    boxed = {i for i, f in fills.items() if f.box is not None}
    outs = {i: f.raw for i, f in fills.items() if f.box is None}
    if targets is not None:
        # before the reads: a failed one may leave its tensor half written, and the threads
        # that read large arrays ahead may write any of ``outs`` before the loop reaches it
        targets.written.update(fills[i].path for i in outs)
    values, nbytes = [], 0
    # closed on any error here, so that no read ahead still writes into ``outs`` afterwards
    with contextlib.closing(reader.fetch_all(manifest, entries, outs, skip=boxed)) as fetched:
        for i, entry in enumerate(entries):
            fill = fills.get(i)
            raw = next(fetched)
            if fill is not None and fill.box is not None:
                assert fill.local is not None
                if targets is not None:
                    targets.written.add(fill.path)
                nbytes += _read_box_into(reader, manifest, entry, fill.box, fill.local)
                values.append(fill.tensor)
                continue
            assert raw is not None
            values.append(_as_value(entry, raw, manifest.step) if fill is None else fill.tensor)
            nbytes += entry.nbytes
    return values, nbytes


def _read_box_into(
    reader: ArrayReader, manifest: Manifest, entry: TensorEntry, box: Region, local: torch.Tensor
) -> int:
    """Read ``box`` of the array into ``local`` (through a CPU buffer when it is elsewhere)."""
    if local.device.type == "cpu":
        return read_box(reader, manifest, entry, box, local)
    staged = torch.empty(local.shape, dtype=local.dtype)
    nbytes = read_box(reader, manifest, entry, box, staged)
    local.copy_(staged)
    return nbytes


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
        self._reader = ArrayReader(storage)

    @property
    def manifests(self) -> ManifestCache:
        """The manifests this restore parsed (see :class:`ManifestCache`)."""
        return self._reader.manifests

    @property
    def times(self) -> RestoreTimes:
        """Where the time of the reads through this cache went."""
        return self._reader.times


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
        NoCheckpointError: ``step`` is not committed, or was removed (by retention, say)
            while it was being read.
        CorruptCheckpointError: the manifest or any array is damaged (the error names them);
            also any error that reading the checkpoint raised unforeseen.
        StorageError: the storage cannot tell whether ``step`` exists (it refuses the
            credentials, its bucket is missing, it cannot be reached).
    """
    reader = cache._reader if cache is not None and cache.storage is storage else None
    path = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    try:
        with gc_paused():  # many new objects, none in a cycle
            return _load(storage, step, rank, reader or ArrayReader(storage), targets)
    except CorruptCheckpointError:
        _raise_if_removed(storage, step, path)
        raise
    except (CheckpointError, StorageError):
        raise  # a store that cannot say whether the step exists (refused, down): not damage
    except Exception as e:
        _raise_if_removed(storage, step, path)
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
    storage: Storage, step: int, rank: int, reader: ArrayReader, targets: InPlaceTargets | None
) -> LoadedCheckpoint:
    manifest = reader.manifests.read(step)  # parsed once: step_infos may have parsed it
    trees, has_rank_state = _rank_trees(manifest, rank)
    # a rank the checkpoint has no per-rank state for gets none (reported), as without targets
    absent = None
    if has_rank_state and len(trees) == 1:
        absent = next(r.tree for r in manifest.per_rank if r.tree is not None)
    fills = targets.plan(trees, step, absent) if targets is not None else [{} for _ in trees]
    values, bytes_read = _values(reader, manifest, manifest.tensors, fills[0], targets)
    state = unflatten_state(manifest.tree, values, checked=True)  # checked with the manifest
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"step {step}: the state is not a mapping", step=step)
    restored = not has_rank_state
    if len(trees) > 1:
        own_tree, own_entries = trees[1]
        own_values, n = _values(reader, manifest, own_entries, fills[1], targets)
        bytes_read += n
        own_state = unflatten_state(own_tree, own_values, checked=True)
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
    reader = ArrayReader(storage)
    bad = []
    for entry in (*manifest.tensors, *(t for r in manifest.per_rank for t in r.tensors)):
        try:
            _as_value(entry, reader.fetch(manifest, entry), manifest.step)
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


def _check_loadable(storage: Storage, step: int, rank: int, reader: ArrayReader) -> None:
    """What :func:`load_checkpoint` checks for ``rank``, without keeping the state: the
    manifest, the trees, and every array that rank's restore reads (one at a time)."""
    manifest = reader.manifests.read(step)
    trees, _ = _rank_trees(manifest, rank)
    for tree, entries in trees:
        unflatten_state(tree, [None] * len(entries))  # the tree's own values, as restore does
    for _, entries in trees:
        for entry in entries:
            _as_value(entry, reader.fetch(manifest, entry), manifest.step)


def check_checkpoint(
    storage: Storage, step: int, *, rank: int = 0, cache: RestoreCache | None = None
) -> None:
    """Check ``step`` as :func:`load_checkpoint` reads it for ``rank`` (the manifest and
    every array it needs, against their checksums), holding one array at a time.

    Raises:
        NoCheckpointError: ``step`` is not committed, or was removed while it was checked.
        CorruptCheckpointError: what :func:`load_checkpoint` would raise it for.
    """
    reader = cache._reader if cache is not None and cache.storage is storage else None
    path = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    try:
        _check_loadable(storage, step, rank, reader or ArrayReader(storage))
    except CorruptCheckpointError:
        _raise_if_removed(storage, step, path)
        raise
    except CheckpointError:
        raise
    except Exception as e:
        _raise_if_removed(storage, step, path)
        raise _unexpected(step, e) from e
