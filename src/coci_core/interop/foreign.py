"""Reading the checkpoints of other tools (``coci import``) without running code from them.

- A ``torch.save`` file: ``torch.load(weights_only=True)``.
- A ``.safetensors`` file: safetensors (no pickle at all).
- What ``coci export`` wrote (any of the three) carries a note, ``coci_export.json``, from which
  the exact state is rebuilt (:mod:`coci_core.interop.exchange`); the note is JSON, checked like a
  manifest's tree, and every array it names must be a tensor of the file.
- A ``torch.distributed.checkpoint`` (DCP) directory, read here and not by DCP: DCP loads its
  ``.metadata`` with ``pickle.load`` and its non-tensor values with
  ``torch.load(weights_only=False)``, both of which run whatever code the files name. Here
  ``.metadata`` goes through an unpickler that resolves only an allowlist of globals (DCP's
  metadata dataclasses, ``torch.Size``, torch dtypes, layouts and memory formats,
  ``OrderedDict``, paths and sets); each tensor chunk and each non-tensor value is read by the
  offset and length the metadata records, with ``torch.load(weights_only=True)``. Everything
  read is checked before it is used: types, offsets and lengths inside regular files of the
  directory (each stored value its own bytes), chunks inside their tensor and tiling it
  exactly, sizes that the files can hold before anything is allocated.

What an import builds or walks is paid for by the bytes it reads (:class:`_Allowance`), so a
crafted file is refused quickly, with little memory, and a ``CociError`` naming what is wrong:

- before ``.metadata`` is unpickled, the tree its pickle describes (each shared reference
  counted again, :mod:`coci_core.engine.pickle_tree`) must be at most 16 objects and
  characters per byte of it, and at most 64 levels deep; the checks of the chunks spend from
  the same kind of allowance; the pickle of each ``torch.save`` record (a ``.pt`` file, a DCP
  value or chunk) is measured alike before ``torch.load`` runs it (at most 1024 levels deep);
- a tensor is no larger than the bytes of its chunks (which tile it, and each value has bytes
  of its own in its file);
- the None slots that planner_data's list indices pad lists with take 8 bytes each of the bytes
  read, and the state returned, walked as saving it walks it (shared containers once per
  reference), has at most one value or character per byte read.

Every check takes time near-linear in its input (sorts and hashes, never pairs of chunks).

Every failure is a :class:`~coci_core.errors.CociError`: :class:`UnsafeCheckpointError` when a
file names a global outside what is allowed (it is refused, not run), otherwise
:class:`CorruptCheckpointError` (or a plain ``CociError`` for what is not a checkpoint at all).
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import reprlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, BinaryIO

import torch

from coci_core.engine.pickle_tree import PickleTree, pickle_tree
from coci_core.engine.tree import check_saved_pickle, load_weights_only
from coci_core.errors import CociError, CorruptCheckpointError, StorageError, UnsafeCheckpointError
from coci_core.storage.local import open_regular

__all__ = ["read_dcp", "read_foreign", "read_foreign_with_step"]

METADATA_NAME = ".metadata"
# What an import builds or walks is paid for by the bytes it reads, in units (an object, a
# character, a byte of a list slot, a step of a check), plus this many for the parts every
# checkpoint has whatever it stores (DCP's Metadata object): never enough to hurt.
_FLOOR = 1 << 16
# DCP's own .metadata describes about 3 objects and characters per byte of its pickle (which
# shares dtypes and each key among the chunks of its tensor); 16 leaves room for keys of a
# thousand characters shared by every chunk. Data files are not counted here: a sparse file
# can be as large as it likes without storing anything.
_UNITS_PER_METADATA_BYTE = 16
# DCP's metadata objects nest about ten deep; CPython hashes and compares nested tuples
# recursively in C, so a deep one would crash the process while .metadata is unpickled.
_MAX_METADATA_DEPTH = 64
_SLOT_BYTES = 8  # what a list slot takes in memory: the price of padding a list
_MAX_DIM = (1 << 63) - 1  # torch sizes are int64


class _Allowance:
    """How many units an import may still spend on one kind of thing (objects walked, bytes of
    list slots, steps of a check), and what pays for them (``basis``, for the message)."""

    def __init__(self, units: int, basis: str, where: str) -> None:
        self.left = units + _FLOOR
        self.basis = basis
        self.where = where

    @classmethod
    def of_read(cls, nbytes: int, where: str) -> _Allowance:
        """One unit per byte read."""
        return cls(
            nbytes,
            f"one unit (a value, a character, a byte of list slots) per byte of the {nbytes} "
            "bytes it reads",
            where,
        )

    @classmethod
    def of_metadata(cls, nbytes: int, where: str) -> _Allowance:
        """:data:`_UNITS_PER_METADATA_BYTE` per byte of ``.metadata``."""
        return cls(
            _UNITS_PER_METADATA_BYTE * nbytes,
            f"{_UNITS_PER_METADATA_BYTE} units (objects, characters, steps of a check) per "
            f"byte of its {nbytes}-byte {METADATA_NAME}",
            where,
        )

    def spend(self, units: int, what: str) -> None:
        """Take ``units``; beyond what is left, a CorruptCheckpointError naming ``what``."""
        if units > self.left:
            raise CorruptCheckpointError(
                f"{self.where}: {what}; an import builds at most {self.basis} (plus {_FLOOR}): "
                "the checkpoint is crafted or damaged"
            )
        self.left -= units


def read_foreign(src: Path) -> dict[str, Any]:
    """A state from a ``torch.save`` file, a ``.safetensors`` file or a
    ``torch.distributed.checkpoint`` directory, loaded without running code from it.

    Raises:
        UnsafeCheckpointError: a pickle in ``src`` names a function or class that is not
            allowed (loading it would run code from the file).
        CorruptCheckpointError: ``src`` is damaged or not in the format its name says.
        CociError: ``src`` does not exist or does not hold a mapping.
    """
    return read_foreign_with_step(src)[0]


def read_foreign_with_step(src: Path) -> tuple[dict[str, Any], int | None]:
    """:func:`read_foreign`, and the step ``coci export`` recorded in ``src`` (None for a
    file another tool wrote)."""
    from coci_core.interop.exchange import from_note, note_step, pt_locator, read_pt_note

    src = Path(src)
    note: str | None = None
    if src.is_dir():
        state, note, read = _read_dcp_exported(src)
    elif not src.exists():
        raise CociError(f"{src}: no such file or directory")
    elif not src.is_file():
        raise CociError(f"{src} is not a regular file or a directory")
    else:
        read = src.stat().st_size
        if src.suffix == ".safetensors":
            state, note = _read_safetensors(src)
        else:
            check_saved_pickle(src, what=str(src))
            state = load_weights_only(src, what=str(src), map_location="cpu")
            note = read_pt_note(src)
            if note is not None:  # written by coci export: rebuild the exact state
                state = from_note(note, pt_locator(state, str(src)), str(src))
    if not isinstance(state, dict):
        raise CociError(f"{src} holds a {type(state).__name__}, not a mapping")
    _check_state_size(state, _Allowance.of_read(read, str(src)))
    return state, None if note is None else note_step(note)


def _check_state_size(state: Any, allowance: _Allowance) -> None:
    """``state`` walked as saving it walks it (a container shared by many references once per
    reference; strings and bytes by their length) holds no more values than the bytes read: a
    pickle can share one list at every level and describe a tree of billions of values in a
    few bytes."""
    todo: list[Any] = [state]
    used = 1
    while todo and used <= allowance.left:
        node = todo.pop()
        if isinstance(node, (str, bytes, bytearray)):
            used += len(node)
        elif isinstance(node, dict):
            used += 2 * len(node)
            if used <= allowance.left:
                todo.extend(node.keys())
                todo.extend(node.values())
        elif type(node) in (list, tuple, set, frozenset):
            used += len(node)
            if used <= allowance.left:
                todo.extend(node)
    allowance.spend(used, f"the state it holds is a tree of {used} or more values and characters")


def _read_safetensors(src: Path) -> tuple[Any, str | None]:
    from safetensors import safe_open

    from coci_core.interop.exchange import SAFETENSORS_NOTE, from_note

    try:
        with safe_open(str(src), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own error types
        raise CorruptCheckpointError(f"cannot read {src} as a .safetensors file: {e}") from e
    if SAFETENSORS_NOTE not in metadata:  # another tool's file: its flat names
        return tensors, None

    def locate(name: Any) -> Any:
        if type(name) is not str or name not in tensors:
            raise CorruptCheckpointError(f"{src}: the note names an array the file lacks")
        return tensors[name]

    note = metadata[SAFETENSORS_NOTE]
    return from_note(note, locate, str(src)), note


def _read_dcp_exported(directory: Path) -> tuple[Any, str | None, int]:
    """A DCP directory: as coci exported it when it holds coci's note, else as DCP nests it;
    and the bytes read."""
    from coci_core.interop.exchange import NOTE_FILE, from_note, pt_locator

    meta, values, paths, read = _read_dcp_values(Path(directory))
    note_path = Path(directory) / NOTE_FILE
    if not note_path.exists() and not note_path.is_symlink():
        return _nest(meta, values, paths, _Allowance.of_read(read, str(directory))), None, read
    with _open_regular(note_path, str(directory)) as f:
        data = f.read(1 << 28)
    try:
        note = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{directory}: {NOTE_FILE} is not text") from e

    inside = pt_locator(values, str(directory))  # values: DCP key -> value, in its order
    position = {key: i for i, key in enumerate(values)}

    def locate(at: Any) -> Any:
        if type(at) is not list or len(at) != 2 or type(at[0]) is not str or at[0] not in values:
            raise CorruptCheckpointError(f"{directory}: the note names an array DCP lacks")
        return inside([position[at[0]], *at[1]] if type(at[1]) is list else at[1])

    return from_note(note, locate, str(directory)), note, read + len(data)


# -- the restricted unpickler of .metadata ---------------------------------------------------


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
    raise CorruptCheckpointError(f".metadata names an unknown torch layout {_short(name)}")


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
            ref = _short(ref)
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


# -- reading a DCP directory -----------------------------------------------------------------


@dataclass(frozen=True)
class _Item:
    """One stored piece: a chunk of a tensor (its offsets and sizes) or a non-tensor value."""

    key: str
    file: str
    offset: int
    length: int
    chunk: tuple[tuple[int, ...], tuple[int, ...]] | None = None


@dataclass(frozen=True)
class _Tensor:
    dtype: torch.dtype
    size: tuple[int, ...]


def read_dcp(directory: Path) -> dict[str, Any]:
    """The state of a ``torch.distributed.checkpoint`` directory (written with a
    ``FileSystemWriter``), nested as it was saved, without running code from it.

    Raises:
        UnsafeCheckpointError: ``.metadata`` or a stored value names a global that is not
            allowed.
        CorruptCheckpointError: a file is missing, truncated, garbled or inconsistent.
    """
    directory = Path(directory)
    where = str(directory)
    meta, values, paths, read = _read_dcp_values(directory)
    state = _nest(meta, values, paths, _Allowance.of_read(read, where))
    _check_state_size(state, _Allowance.of_read(read, where))
    return state


def _read_dcp_values(
    directory: Path,
) -> tuple[Any, dict[str, Any], dict[str, tuple[str | int, ...]], int]:
    """The metadata, each stored value by its DCP key, the nesting path of each key, and the
    bytes read (``.metadata`` and the values': what the state built from them may take)."""
    where = str(directory)
    meta, metadata_bytes = _load_metadata(directory, where)
    tensors, items, paths = _plan(meta, where, _Allowance.of_metadata(metadata_bytes, where))
    if len(set(paths.values())) != len(paths):
        raise _bad(where, "two keys are nested at the same place")
    by_file: dict[str, list[_Item]] = {}
    for item in items:
        by_file.setdefault(item.file, []).append(item)
    for name, file_items in by_file.items():  # before anything is allocated
        with _open_regular(directory / name, where) as f:
            size = os.fstat(f.fileno()).st_size
        _check_ranges(name, size, file_items, where)
    values: dict[str, Any] = {}
    for key, spec in tensors.items():
        try:
            values[key] = torch.empty(spec.size, dtype=spec.dtype)
        except (RuntimeError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{where}: cannot make the tensor {_short(key)} ({spec.dtype}, "
                f"{list(spec.size)}): {e}"
            ) from e
    for name, file_items in by_file.items():
        with _open_regular(directory / name, where) as f:
            for item in sorted(file_items, key=lambda i: i.offset):
                f.seek(item.offset)
                data = f.read(item.length)
                if len(data) != item.length:
                    raise CorruptCheckpointError(
                        f"{where}: {name} ended while reading {_short(item.key)}"
                    )
                if item.chunk is None:
                    what = f"{where}: the value at {_short(item.key)}"
                    check_saved_pickle(data, what=what)
                    values[item.key] = load_weights_only(data, what=what, map_location="cpu")
                else:
                    _copy_chunk(values[item.key], tensors[item.key], item, data, where)
    return meta, values, paths, metadata_bytes + sum(item.length for item in items)


def _check_ranges(name: str, size: int, items: list[_Item], where: str) -> None:
    """The items stored in file ``name`` (of ``size`` bytes) lie inside it, each in bytes of
    its own: what the import reads and builds is then bounded by the file's size."""
    last: _Item | None = None  # of the items so far, the one that ends last
    for item in sorted(items, key=lambda i: (i.offset, i.length)):
        if item.offset + item.length > size:
            raise CorruptCheckpointError(
                f"{where}: {_short(item.key)} is recorded at bytes {item.offset}-"
                f"{item.offset + item.length} of {name}, which has {size} bytes (the file "
                "is truncated or the metadata is wrong)"
            )
        if last is not None and item.offset < last.offset + last.length:
            raise _bad(
                where,
                f"storage_data records {_short(item.key)} at bytes {item.offset}-"
                f"{item.offset + item.length} of {name}, inside the bytes {last.offset}-"
                f"{last.offset + last.length} of {_short(last.key)} (DCP stores each value "
                "in bytes of its own)",
            )
        if last is None or item.offset + item.length > last.offset + last.length:
            last = item


def _nest(
    meta: Any,
    values: dict[str, Any],
    paths: dict[str, tuple[str | int, ...]],
    allowance: _Allowance,
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for key in meta.state_dict_metadata:
        _set_element(state, paths[key], values[key], allowance)
    return state


def _open_regular(path: Path, where: str) -> BinaryIO:
    """``path`` opened for reading if it is a regular file (not a link, a FIFO, a device)."""
    try:
        fd = open_regular(path, follow_links=False)
    except StorageError as e:
        raise CorruptCheckpointError(f"{where}: {path.name}: {e}") from e
    return os.fdopen(fd, "rb")


def _load_metadata(directory: Path, where: str) -> tuple[Any, int]:
    """The Metadata object of ``.metadata``, and the file's size."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not (directory / METADATA_NAME).exists() and not (directory / METADATA_NAME).is_symlink():
        raise CociError(
            f"{where} has no {METADATA_NAME}: not a torch.distributed.checkpoint directory "
            "(or one saved without a global metadata file, which coci cannot import)"
        )
    with _open_regular(directory / METADATA_NAME, where) as f:
        data = f.read()
    _check_metadata_tree(data, _Allowance.of_metadata(len(data), where))
    try:
        meta = _MetadataUnpickler(io.BytesIO(data), _allowed_globals(), where).load()
    except CociError:
        raise
    except Exception as e:  # a garbled pickle raises anything
        why = str(e)
        if not why.isprintable() or len(why) > 300:
            why = _short(why)
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


def _check_metadata_tree(data: bytes, allowance: _Allowance) -> None:
    """Refuse, before unpickling, a ``.metadata`` whose objects, walked as a tree (each shared
    reference again, as hashing and checking them walk it), outnumber the stored bytes, or that
    nests deeper than DCP's metadata ever does."""
    cap = max(allowance.left, _MAX_METADATA_DEPTH)
    try:
        tree = pickle_tree(data, cap=cap)
    except ValueError as e:  # what the unpickler would fail on too
        raise CorruptCheckpointError(
            f"{allowance.where}: {METADATA_NAME} cannot be read ({_short(str(e))})"
        ) from e
    if tree.depth > _MAX_METADATA_DEPTH:
        raise _bad(
            allowance.where,
            f"its pickle {_depth(tree, cap)} (DCP's metadata nests about ten levels; at most "
            f"{_MAX_METADATA_DEPTH} are read)",
        )
    big = f"more than {cap}" if tree.size > cap else str(tree.size)
    allowance.spend(
        tree.size,
        f"{METADATA_NAME} describes a tree of {big} objects and characters once each shared "
        "reference is counted where it is used",
    )


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 200, 80


def _short(value: Any) -> str:
    """A bounded repr of a value read from a file (never deep, never long)."""
    try:
        return _REPR.repr(value)
    except Exception:  # a repr of odd data must not fail the message
        return f"<{type(value).__name__}>"


def _bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {METADATA_NAME} is damaged: {what}")


def _int(value: Any) -> bool:
    return type(value) is int and value >= 0


def _shape(value: Any, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, (torch.Size, tuple, list)) or not all(
        _int(n) and n <= _MAX_DIM for n in value
    ):
        raise _bad(where, f"{what} is not a shape (sizes from 0 to 2**63-1): {_short(value)}")
    return tuple(value)


def _numel(shape: tuple[int, ...]) -> int:
    """The elements of ``shape``; ``_MAX_DIM + 1`` for more than torch can index (no product
    of thousands of huge sizes is ever computed)."""
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n > _MAX_DIM:
            return _MAX_DIM + 1
    return n


def _plan(
    meta: Any, where: str, allowance: _Allowance
) -> tuple[dict[str, _Tensor], list[_Item], dict[str, tuple[str | int, ...]]]:
    """Check the metadata: the tensors to make, the pieces to read, the path of each key
    (``allowance``: what the checks of the chunks may spend)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    entries = getattr(meta, "state_dict_metadata", None)
    storage = getattr(meta, "storage_data", None)
    planner = getattr(meta, "planner_data", None)
    if type(entries) is not dict or type(storage) is not dict:
        raise _bad(where, "no state_dict_metadata or storage_data mappings")
    if planner is not None and type(planner) is not dict:
        raise _bad(where, f"planner_data is a {type(planner).__name__}")

    def located(key: str, index: Any) -> tuple[str, int, int]:
        info = storage.get(index)
        if info is None:
            raise _bad(where, f"no storage entry for {_short(key)}")
        if type(info) is not _StorageInfo:
            raise _bad(where, f"the storage entry of {_short(key)} is a {type(info).__name__}")
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if getattr(info, "transform_descriptors", None):
            raise CorruptCheckpointError(
                f"{where}: {_short(key)} is stored through DCP stream transforms "
                f"{_short(info.transform_descriptors)} (compression), which coci cannot import"
            )
        if not _plain_name(name):
            raise _bad(
                where, f"{_short(key)} is stored in {_short(name)}, not a file of the directory"
            )
        if not _int(offset) or not _int(length):
            raise _bad(
                where, f"{_short(key)} has offset {_short(offset)} and length {_short(length)}"
            )
        assert isinstance(name, str)
        assert isinstance(offset, int)
        assert isinstance(length, int)
        return name, offset, length

    tensors: dict[str, _Tensor] = {}
    items: list[_Item] = []
    paths: dict[str, tuple[str | int, ...]] = {}
    for key, entry in entries.items():
        if type(key) is not str:
            raise _bad(where, f"a key is a {type(key).__name__}: {_short(key)}")
        paths[key] = _path_of(key, planner, where)
        if type(entry) is BytesStorageMetadata:
            name, offset, length = located(key, MetadataIndex(key))
            items.append(_Item(key, name, offset, length))
            continue
        if type(entry) is not TensorStorageMetadata:
            raise _bad(where, f"{_short(key)} is described by a {type(entry).__name__}")
        dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise _bad(where, f"{_short(key)} has no dtype")
        size = _shape(getattr(entry, "size", None), where, f"the size of {_short(key)}")
        if _numel(size) > _MAX_DIM:
            raise _bad(where, f"the size of {_short(key)} has more than 2**63-1 elements")
        chunks = getattr(entry, "chunks", None)
        if type(chunks) is not list:
            raise _bad(where, f"{_short(key)} has no list of chunks")
        boxes = []
        for chunk in chunks:
            if type(chunk) is not ChunkStorageMetadata:
                raise _bad(where, f"a chunk of {_short(key)} is a {type(chunk).__name__}")
            offsets = _shape(
                getattr(chunk, "offsets", None), where, f"a chunk offset of {_short(key)}"
            )
            sizes = _shape(getattr(chunk, "sizes", None), where, f"a chunk size of {_short(key)}")
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise _bad(
                    where, f"a chunk of {_short(key)} has another rank than its {list(size)}"
                )
            if any(o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)):
                raise _bad(
                    where,
                    f"a chunk of {_short(key)} at {list(offsets)} of {list(sizes)} leaves "
                    f"its {list(size)}",
                )
            name, offset, length = located(key, MetadataIndex(key, offsets))
            nbytes = _numel(sizes) * dtype.itemsize
            if nbytes > length:
                raise _bad(
                    where,
                    f"a chunk of {_short(key)} needs {nbytes} bytes and is stored in {length}",
                )
            boxes.append((offsets, sizes))
            items.append(_Item(key, name, offset, length, (offsets, sizes)))
        _check_tiling(key, size, boxes, allowance)
        tensors[key] = _Tensor(dtype, size)
    return tensors, items, paths


def _plain_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..", METADATA_NAME)
        and not any(c in name for c in "/\\\0")
        and len(name) <= 255
    )


def _path_of(key: str, planner: dict[Any, Any] | None, where: str) -> tuple[str | int, ...]:
    """Where ``key`` goes in the nested state (DCP flattened ``{"a": {"b": x}}`` to ``a.b``)."""
    if planner is None or key not in planner:
        return (key,)
    path = planner[key]
    field = f"the nesting path planner_data[{_short(key)}]"
    if type(path) not in (tuple, list) or not path or type(path[0]) is not str:
        raise _bad(where, f"{field} is {_short(path)}")
    for part in path:
        if type(part) is not str and (type(part) is not int or part < 0):
            raise _bad(where, f"{field} has the part {_short(part)} (parts are str or int >= 0)")
    return tuple(path)


def _check_tiling(
    key: str,
    size: tuple[int, ...],
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    allowance: _Allowance,
) -> None:
    """The chunks (offsets, sizes) tile the tensor: each element is in exactly one chunk, so
    nothing is left unread and nothing is read twice.

    A box is the signed sum of the orthants at its corners (inclusion-exclusion over its 2**k
    corners, k the dimensions the chunks split); orthants at distinct points are linearly
    independent, so the chunks tile the tensor exactly iff the signed counts of their corners
    are the tensor's own. One dict update per corner, no comparison of pairs of chunks.
    """
    where = allowance.where
    whole = _numel(size)
    if sum(_numel(s) for _, s in boxes) != whole:
        raise _bad(where, f"the chunks of {_short(key)} do not cover its {list(size)} exactly")
    if whole == 0:
        return  # all chunks empty, all inside the tensor: nothing to read
    solid = [b for b in boxes if _numel(b[1])]
    split = sorted(
        {d for offsets, sizes in solid for d, n in enumerate(size) if offsets[d] or sizes[d] != n}
    )
    allowance.spend(
        (len(solid) + 1) << len(split),
        f"checking that the {len(solid)} chunks of {_short(key)} tile it takes "
        f"{(len(solid) + 1) << len(split)} steps (they split {len(split)} of its dimensions)",
    )
    counts: dict[tuple[int, ...], int] = {}
    for (offsets, sizes), sign in itertools.chain(
        [(((0,) * len(size), size), -1)], zip(solid, itertools.repeat(1))
    ):
        low = [offsets[d] for d in split]
        high = [offsets[d] + sizes[d] for d in split]
        for corner in range(1 << len(split)):
            at = tuple(high[i] if corner >> i & 1 else low[i] for i in range(len(split)))
            count = counts.pop(at, 0) + (-sign if corner.bit_count() & 1 else sign)
            if count:
                counts[at] = count
    if counts:  # their elements add up to the tensor's: some are in two chunks, some in none
        raise _bad(where, f"two chunks of {_short(key)} overlap (their corners do not tile it)")


def _copy_chunk(out: torch.Tensor, spec: _Tensor, item: _Item, data: bytes, where: str) -> None:
    assert item.chunk is not None
    offsets, sizes = item.chunk
    what = f"{where}: a chunk of the tensor {_short(item.key)}"
    check_saved_pickle(data, what=what)
    chunk = load_weights_only(data, what=what, map_location="cpu")
    if (
        not isinstance(chunk, torch.Tensor)
        or chunk.layout != torch.strided
        or chunk.dtype != spec.dtype
        or tuple(chunk.shape) != sizes
    ):
        got = (
            f"a {chunk.dtype} tensor of shape {list(chunk.shape)} ({chunk.layout})"
            if isinstance(chunk, torch.Tensor)
            else f"a {type(chunk).__name__}"
        )
        raise CorruptCheckpointError(
            f"{where}: the chunk of {_short(item.key)} at {list(offsets)} holds {got}, the "
            f"metadata says {spec.dtype} of shape {list(sizes)}"
        )
    region = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
    out[region].copy_(chunk.detach())


def _set_element(
    root: dict[str, Any], path: Sequence[str | int], value: Any, slots: _Allowance
) -> None:
    """``torch.distributed.checkpoint._traverse.set_element``, refusing paths that clash (a
    value where a container must be) instead of writing into the value, and lists padded
    beyond what ``slots`` (bytes) pays for."""
    where = slots.where
    node: Any = root
    for prev, key in itertools.pairwise(path):
        fresh: Callable[[], Any] = dict if type(key) is str else list
        node = _child(node, prev, fresh, path, slots)
    last = path[-1]
    _check_slot(node, last, path, where)
    if isinstance(node, list):
        assert isinstance(last, int)
        _pad(node, last, path, slots)
        taken = node[last] is not None
    else:
        taken = last in node
    if taken:  # another key's path goes through this one (paths themselves are distinct)
        raise _bad(where, f"the nesting path {_short(list(path))} is also a container")
    node[last] = value


def _check_slot(node: Any, key: str | int, path: Sequence[str | int], where: str) -> None:
    if (type(node) is dict and type(key) is str) or (type(node) is list and type(key) is int):
        return
    raise _bad(where, f"the nesting path {_short(list(path))} goes through a {type(node).__name__}")


def _pad(node: list[Any], index: int, path: Sequence[str | int], slots: _Allowance) -> None:
    """Pad ``node`` with None up to ``index``, paying for the new slots before making them."""
    more = index + 1 - len(node)
    if more > 0:
        slots.spend(
            more * _SLOT_BYTES,
            f"the nesting path {_short(list(path))} of planner_data pads a list with {more} "
            f"more slots ({more * _SLOT_BYTES} bytes)",
        )
        node.extend([None] * more)


def _child(
    node: Any,
    key: str | int,
    fresh: Callable[[], Any],
    path: Sequence[str | int],
    slots: _Allowance,
) -> Any:
    where = slots.where
    _check_slot(node, key, path, where)
    if isinstance(node, dict):
        child = node.setdefault(key, fresh())
    else:
        assert isinstance(key, int)
        _pad(node, key, path, slots)
        if node[key] is None:
            node[key] = fresh()
        child = node[key]
    if type(child) not in (dict, list):
        raise _bad(where, f"the nesting path {_short(list(path))} goes through a value")
    return child
