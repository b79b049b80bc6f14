"""DCP's ``.metadata``, read without running code: its pickle measured first
(:mod:`coci_core.engine.format.pickle_tree`), then unpickled by an unpickler that resolves only an
allowlist of globals (DCP's metadata dataclasses, ``torch.Size``, torch dtypes, layouts and
memory formats, ``OrderedDict``, paths and sets).
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, BinaryIO

import torch

from coci_core.engine.format.pickle_tree import PickleTree, pickle_tree
from coci_core.errors import CociError, CorruptCheckpointError, UnsafeCheckpointError
from coci_core.interop.allowance import METADATA_NAME, Allowance, open_regular_file, short
from coci_core.knobs import MAX_METADATA_DEPTH

__all__ = ["METADATA_NAME", "damaged", "load_metadata"]


def _pure_path(*parts: Any) -> str:
    # StorageMeta.checkpoint_id is a pathlib path; coci does not use it, it only must not run
    # anything: the parts are joined as text.
    if not all(isinstance(p, str) for p in parts):
        raise CorruptCheckpointError("a path in .metadata has parts that are not strings")
    return str(PurePosixPath(*parts))


def _pure_windows_path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise CorruptCheckpointError("a path in .metadata has parts that are not strings")
    return str(PureWindowsPath(*parts))


_TORCH_ENUMS = (torch.dtype, torch.layout, torch.memory_format)


def _torch_constant(name: Any) -> Any:
    # What torch.serialization._get_layout does, by name only: "torch.strided" -> torch.strided.
    if isinstance(name, str) and name.startswith("torch."):
        value = vars(torch).get(name.removeprefix("torch."))
        if isinstance(value, _TORCH_ENUMS):
            return value
    raise CorruptCheckpointError(f".metadata names an unknown torch layout {short(name)}")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        (metadata.__name__, name): getattr(metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    for name in ("_StorageInfo", "_StoragePrefix"):
        allowed[(filesystem.__name__, name)] = getattr(filesystem, name)
    try:  # torch < 2.2 pickled TensorProperties from here
        from torch.distributed._shard.sharded_tensor import metadata as sharded
    except ImportError:  # pragma: no cover - present in every torch coci supports
        pass
    else:
        for name in ("TensorProperties", "MEM_FORMAT_ENCODING"):
            if hasattr(sharded, name):
                allowed[(sharded.__name__, name)] = getattr(sharded, name)
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _torch_constant
    allowed[("collections", "OrderedDict")] = OrderedDict
    for module in ("pathlib", "pathlib._local"):
        for name in ("Path", "PosixPath", "PurePath", "PurePosixPath"):
            allowed[(module, name)] = _pure_path
        for name in ("WindowsPath", "PureWindowsPath"):
            allowed[(module, name)] = _pure_windows_path
    allowed[("builtins", "set")] = set
    allowed[("builtins", "frozenset")] = frozenset
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the allowlisted globals; anything else is refused before it exists."""

    def __init__(self, file: BinaryIO, allowed: dict[tuple[str, str], Any], where: str) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is not None:
            return found
        if module == "torch":  # torch.float32, torch.channels_last, ...: only those objects
            value = vars(torch).get(name)
            if isinstance(value, _TORCH_ENUMS):
                return value
        ref = f"{module}.{name}"
        if not ref.isprintable() or len(ref) > 200:  # names come from the file: no escapes
            ref = short(ref)
        raise UnsafeCheckpointError(
            f"refusing to import {self._where}: .metadata references {ref}; coci "
            "never runs code from a checkpoint (a DCP .metadata may name only DCP's metadata "
            "classes, torch.Size, torch dtypes and layouts, OrderedDict, paths and sets)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"refusing to import {self._where}: .metadata holds a persistent reference, which "
            "DCP metadata never does"
        )


def load_metadata(directory: Path, where: str) -> tuple[Any, int]:
    """The Metadata object of ``.metadata``, and the file's size."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not (directory / METADATA_NAME).exists() and not (directory / METADATA_NAME).is_symlink():
        raise CociError(
            f"{where} has no {METADATA_NAME}: not a torch.distributed.checkpoint directory "
            "(or one saved without a global metadata file, which coci cannot import)"
        )
    with open_regular_file(directory / METADATA_NAME, where) as f:
        data = f.read()
    _check_metadata_tree(data, Allowance.of_metadata(len(data), where))
    try:
        meta = _MetadataUnpickler(io.BytesIO(data), _allowed_globals(), where).load()
    except CociError:
        raise
    except Exception as e:  # a garbled pickle raises anything
        why = str(e)
        if not why.isprintable() or len(why) > 300:
            why = short(why)
        raise CorruptCheckpointError(
            f"{where}: {METADATA_NAME} cannot be read ({type(e).__name__}: {why})"
        ) from e
    if type(meta) is not Metadata:
        raise CorruptCheckpointError(
            f"{where}: {METADATA_NAME} holds a {type(meta).__name__}, not DCP Metadata"
        )
    return meta, len(data)


def _depth(tree: PickleTree, cap: int) -> str:
    if tree.depth > cap:  # endless: a reference cycle (or deeper than the pickle is long)
        return f"refers to itself or nests objects more than {cap} levels deep"
    return f"nests objects {tree.depth} levels deep"


def _check_metadata_tree(data: bytes, allowance: Allowance) -> None:
    """Refuse, before unpickling, a ``.metadata`` whose objects, walked as a tree (each shared
    reference again, as hashing and checking them walk it), outnumber the stored bytes, or that
    nests deeper than DCP's metadata ever does."""
    cap = max(allowance.left, MAX_METADATA_DEPTH)
    try:
        tree = pickle_tree(data, cap=cap)
    except ValueError as e:  # what the unpickler would fail on too
        raise CorruptCheckpointError(
            f"{allowance.where}: {METADATA_NAME} cannot be read ({short(str(e))})"
        ) from e
    if tree.depth > MAX_METADATA_DEPTH:
        raise damaged(
            allowance.where,
            f"its pickle {_depth(tree, cap)} (DCP's metadata nests about ten levels; at most "
            f"{MAX_METADATA_DEPTH} are read)",
        )
    big = f"more than {cap}" if tree.size > cap else str(tree.size)
    allowance.spend(
        tree.size,
        f"{METADATA_NAME} describes a tree of {big} objects and characters once each shared "
        "reference is counted where it is used",
    )


def damaged(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {METADATA_NAME} is damaged: {what}")
