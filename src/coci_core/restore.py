"""Restore: discover committed steps, read a manifest, fetch and verify every array, rebuild."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import torch

from coci_core.codecs import decode, from_descriptor, needs_base
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


class _Reader:
    """Reads arrays of one storage, resolving delta pieces through their bases."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._manifests: dict[int, Manifest] = {}
        self._decoded: dict[tuple[int, str], torch.Tensor] = {}

    def forget(self) -> None:
        """Drop decoded base arrays (after each array of the checkpoint being restored)."""
        self._decoded.clear()

    def _base(self, step: int, base_step: int, key: str, start: int, length: int) -> Any:
        cached = self._decoded.get((base_step, key))
        if cached is None:
            try:
                manifest = self._manifests.get(base_step) or read_manifest(self.storage, base_step)
            except (NoCheckpointError, CorruptCheckpointError) as e:
                raise CorruptCheckpointError(
                    f"step {step}: {key!r} is a delta against step {base_step}, which cannot be "
                    f"read: {e}",
                    step=step,
                    bad=[key],
                ) from e
            self._manifests[base_step] = manifest
            entry = next((t for t in manifest.tensors if t.key == key), None)
            if entry is None:
                raise CorruptCheckpointError(
                    f"step {step}: {key!r} is a delta against step {base_step}, which has no "
                    "such array",
                    step=step,
                    bad=[key],
                )
            cached = self.fetch(manifest, entry)
            self._decoded[(base_step, key)] = cached
        if start + length > cached.numel():
            raise CorruptCheckpointError(
                f"step {step}: {key!r} needs bytes {start}-{start + length} of step {base_step}'s, "
                f"which has {cached.numel()}",
                step=step,
                bad=[key],
            )
        return cached[start : start + length].numpy()

    def fetch(self, manifest: Manifest, entry: TensorEntry) -> torch.Tensor:
        """The entry's raw bytes as a uint8 tensor, assembled from its pieces (decoded, through
        their bases), every checksum verified."""
        step = manifest.step
        nbytes = _raw_nbytes(entry)
        out = torch.empty(nbytes, dtype=torch.uint8)
        covered = 0
        for piece in entry.pieces:
            if piece.start != covered or piece.start + piece.length > nbytes:
                raise CorruptCheckpointError(
                    f"step {step}: the pieces of {entry.key!r} do not tile its {nbytes} bytes",
                    step=step,
                    bad=[entry.key],
                )
            target = out[piece.start : piece.start + piece.length]
            raw = piece.params is None
            if (
                raw
                and entry.codec not in ("coci.raw/1", "mixed")
                and not any(q.params for q in entry.pieces)
            ):
                from_descriptor(entry.codec)  # an unknown codec name is refused
            if raw and piece.nbytes != piece.length:
                raise CorruptCheckpointError(
                    f"step {step}: a raw piece of {entry.key!r} has {piece.nbytes} stored bytes "
                    f"for {piece.length} raw ones",
                    step=step,
                    bad=[entry.key],
                )
            stored = target if raw else torch.empty(piece.nbytes, dtype=torch.uint8)
            view = stored.numpy().data
            try:
                self.storage.read_into(f"{step_dir_name(step)}/{piece.file}", piece.offset, view)
            except StorageError as e:
                raise CorruptCheckpointError(
                    f"step {step}: cannot read {entry.key!r}: {e}; the checkpoint is incomplete "
                    "or corrupted",
                    step=step,
                    bad=[entry.key],
                ) from e
            if crc32c.crc32c(view) != piece.crc32c:
                raise CorruptCheckpointError(
                    f"step {step}: checksum mismatch in {entry.key!r} (bytes "
                    f"{piece.start}-{piece.start + piece.length} in {piece.file})",
                    step=step,
                    bad=[entry.key],
                )
            if piece.params is not None:
                base = None
                if needs_base(piece.params):
                    base_step = piece.params.get("base_step")
                    if type(base_step) is not int or not 0 <= base_step < step:
                        raise CorruptCheckpointError(
                            f"step {step}: a delta piece of {entry.key!r} names no earlier base "
                            f"step ({base_step!r})",
                            step=step,
                            bad=[entry.key],
                        )
                    base = self._base(step, base_step, entry.key, piece.start, piece.length)
                try:
                    decode(stored.numpy(), piece.params, target.numpy(), base)
                except CorruptCheckpointError as e:
                    raise CorruptCheckpointError(
                        f"step {step}: {entry.key!r}: {e}", step=step, bad=[entry.key]
                    ) from e
            covered += piece.length
        if covered != nbytes:
            raise CorruptCheckpointError(
                f"step {step}: the pieces of {entry.key!r} cover {covered} of its {nbytes} bytes",
                step=step,
                bad=[entry.key],
            )
        return out


def _fetch(storage: Storage, manifest: Manifest, entry: TensorEntry) -> torch.Tensor:
    return _Reader(storage).fetch(manifest, entry)


def _raw_nbytes(entry: TensorEntry) -> int:
    numel = 1
    for n in entry.shape:
        numel *= n
    return numel * decode_dtype(entry.dtype).itemsize


def _as_value(entry: TensorEntry, raw: torch.Tensor) -> Any:
    if entry.kind == "torch_save":
        return load_torch_saved(raw.numpy().tobytes(), entry.key)
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
    reader = _Reader(storage)
    values, nbytes = [], 0
    for entry in entries:
        values.append(_as_value(entry, reader.fetch(manifest, entry)))
        reader.forget()
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
