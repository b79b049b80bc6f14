"""Restore: discover committed steps, read a manifest, fetch and verify every array, rebuild."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import torch

from coci_core.codecs import from_descriptor
from coci_core.errors import CorruptCheckpointError, NoCheckpointError, StorageError
from coci_core.manifest import MANIFEST_NAME, Manifest, TensorEntry, parse_step_dir, step_dir_name
from coci_core.storage import Storage
from coci_core.tree import decode_dtype, load_torch_saved, unflatten_state

__all__ = [
    "LoadedCheckpoint",
    "committed_steps",
    "load_checkpoint",
    "read_manifest",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)


def committed_steps(storage: Storage) -> list[int]:
    """Steps that have a committed manifest, ascending (damage is found on read, not here)."""
    steps = []
    for name in storage.list_dir(""):
        step = parse_step_dir(name)
        if step is not None and storage.exists(f"{name}/{MANIFEST_NAME}"):
            steps.append(step)
    return sorted(steps)


def read_manifest(storage: Storage, step: int) -> Manifest:
    """The manifest of ``step``.

    Raises:
        NoCheckpointError: ``step`` is not committed.
        CorruptCheckpointError: the manifest cannot be parsed or names another step.
    """
    path = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    if not storage.exists(path):
        raise NoCheckpointError(f"no committed checkpoint at step {step} in {storage.url}")
    try:
        data = storage.read_bytes(path)
    except StorageError as e:
        raise CorruptCheckpointError(f"cannot read manifest of step {step}: {e}", step=step) from e
    manifest = Manifest.from_json(data, where=f"manifest of step {step} in {storage.url}")
    if manifest.step != step:
        raise CorruptCheckpointError(
            f"manifest in {step_dir_name(step)} says step {manifest.step}", step=step
        )
    return manifest


def _fetch(storage: Storage, manifest: Manifest, entry: TensorEntry) -> torch.Tensor:
    """The entry's raw bytes as a uint8 tensor, assembled from its pieces, checksums verified."""
    nbytes = (
        _raw_nbytes(entry) if entry.kind != "torch_save" else sum(p.length for p in entry.pieces)
    )
    out = torch.empty(nbytes, dtype=torch.uint8)
    out_view = out.numpy().data
    codec = from_descriptor(entry.codec)
    covered = 0
    for piece in entry.pieces:
        if piece.start != covered or piece.start + piece.length > nbytes:
            raise CorruptCheckpointError(
                f"step {manifest.step}: the pieces of {entry.key!r} do not tile its {nbytes} bytes",
                step=manifest.step,
                bad=[entry.key],
            )
        raw = entry.codec == "coci.raw/1"
        stored = (
            out[piece.start : piece.start + piece.length]
            if raw
            else torch.empty(piece.nbytes, dtype=torch.uint8)
        )
        view = stored.numpy().data
        if view.nbytes != piece.nbytes:
            raise CorruptCheckpointError(
                f"step {manifest.step}: a piece of {entry.key!r} has {piece.nbytes} stored "
                f"bytes for {piece.length} raw ones",
                step=manifest.step,
                bad=[entry.key],
            )
        try:
            storage.read_into(f"{step_dir_name(manifest.step)}/{piece.file}", piece.offset, view)
        except StorageError as e:
            raise CorruptCheckpointError(
                f"step {manifest.step}: cannot read {entry.key!r}: {e}; the checkpoint is "
                "incomplete or corrupted",
                step=manifest.step,
                bad=[entry.key],
            ) from e
        if crc32c.crc32c(view) != piece.crc32c:
            raise CorruptCheckpointError(
                f"step {manifest.step}: checksum mismatch in {entry.key!r} (bytes "
                f"{piece.start}-{piece.start + piece.length} in {piece.file})",
                step=manifest.step,
                bad=[entry.key],
            )
        if not raw:
            codec.decode(view, out_view[piece.start : piece.start + piece.length])
        covered += piece.length
    if covered != nbytes:
        raise CorruptCheckpointError(
            f"step {manifest.step}: the pieces of {entry.key!r} cover {covered} of its "
            f"{nbytes} bytes",
            step=manifest.step,
            bad=[entry.key],
        )
    return out


def _raw_nbytes(entry: TensorEntry) -> int:
    numel = 1
    for n in entry.shape:
        numel *= n
    return numel * decode_dtype(entry.dtype).itemsize


def _as_value(entry: TensorEntry, raw: torch.Tensor) -> Any:
    if entry.kind == "torch_save":
        return load_torch_saved(raw.numpy().tobytes())
    dtype = decode_dtype(entry.dtype)
    if raw.numel() != _raw_nbytes(entry):
        raise CorruptCheckpointError(
            f"{entry.key!r} has {raw.numel()} bytes, its shape and dtype need {_raw_nbytes(entry)}"
        )
    if entry.kind == "ndarray":
        if entry.numpy_dtype is None:
            raise CorruptCheckpointError(f"{entry.key!r} is an ndarray without a numpy dtype")
        return raw.numpy().view(np.dtype(entry.numpy_dtype)).reshape(entry.shape)
    return raw.view(dtype).reshape(entry.shape)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A restored state and what it cost to read."""

    step: int
    state: dict[str, Any]
    bytes_read: int
    manifest: Manifest
    rank_state_restored: bool = True


def _values(storage: Storage, manifest: Manifest, entries: Any) -> tuple[list[Any], int]:
    values, nbytes = [], 0
    for entry in entries:
        values.append(_as_value(entry, _fetch(storage, manifest, entry)))
        nbytes += entry.nbytes
    return values, nbytes


def load_checkpoint(storage: Storage, step: int, *, rank: int = 0) -> LoadedCheckpoint:
    """Read, verify and rebuild the state of ``step`` (tensors on CPU), with the per-rank
    state that rank ``rank`` saved merged in (when the checkpoint has that rank).

    Raises:
        NoCheckpointError: ``step`` is not committed.
        CorruptCheckpointError: the manifest or any array is damaged (the error names them).
    """
    manifest = read_manifest(storage, step)
    values, bytes_read = _values(storage, manifest, manifest.tensors)
    state = unflatten_state(manifest.tree, values)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"step {step}: the state is not a mapping", step=step)
    has_rank_state = any(r.tree is not None for r in manifest.per_rank)
    restored = not has_rank_state
    if has_rank_state and rank < len(manifest.per_rank):
        own = manifest.per_rank[rank]
        own_values, n = _values(storage, manifest, own.tensors)
        bytes_read += n
        own_state = unflatten_state(own.tree, own_values)
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
    """Check every array of ``step`` against its checksum; return the keys that are damaged.

    Raises:
        NoCheckpointError: ``step`` is not committed.
        CorruptCheckpointError: the manifest itself is damaged.
    """
    manifest = read_manifest(storage, step)
    bad = []
    for entry in (*manifest.tensors, *(t for r in manifest.per_rank for t in r.tensors)):
        try:
            _as_value(entry, _fetch(storage, manifest, entry))
        except CorruptCheckpointError as e:
            bad.append(entry.key)
            if on_bad is not None:
                on_bad(entry.key, str(e))
    return bad
