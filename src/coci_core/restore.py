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
    """The entry's raw bytes as a uint8 tensor, checksum verified."""
    stored = torch.empty(entry.nbytes, dtype=torch.uint8)
    view = stored.numpy().data
    try:
        storage.read_into(f"{step_dir_name(manifest.step)}/{entry.file}", entry.offset, view)
    except StorageError as e:
        raise CorruptCheckpointError(
            f"step {manifest.step}: cannot read {entry.key!r}: {e}; the checkpoint is incomplete "
            "or corrupted",
            step=manifest.step,
            bad=[entry.key],
        ) from e
    if crc32c.crc32c(view) != entry.crc32c:
        raise CorruptCheckpointError(
            f"step {manifest.step}: checksum mismatch in {entry.key!r}",
            step=manifest.step,
            bad=[entry.key],
        )
    codec = from_descriptor(entry.codec)
    if entry.codec == "coci.raw/1":
        return stored
    out = torch.empty(_raw_nbytes(entry), dtype=torch.uint8)
    codec.decode(view, out.numpy().data)
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


def load_checkpoint(storage: Storage, step: int) -> LoadedCheckpoint:
    """Read, verify and rebuild the state of ``step`` (tensors on CPU).

    Raises:
        NoCheckpointError: ``step`` is not committed.
        CorruptCheckpointError: the manifest or any array is damaged (the error names them).
    """
    manifest = read_manifest(storage, step)
    values = []
    bytes_read = 0
    for entry in manifest.tensors:
        raw = _fetch(storage, manifest, entry)
        bytes_read += entry.nbytes
        values.append(_as_value(entry, raw))
    state = unflatten_state(manifest.tree, values)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"step {step}: the state is not a mapping", step=step)
    return LoadedCheckpoint(step, state, bytes_read, manifest)


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
    for entry in manifest.tensors:
        try:
            _as_value(entry, _fetch(storage, manifest, entry))
        except CorruptCheckpointError as e:
            bad.append(entry.key)
            if on_bad is not None:
                on_bad(entry.key, str(e))
    return bad
