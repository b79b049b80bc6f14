"""Reading a ``torch.distributed.checkpoint`` directory (written with a ``FileSystemWriter``)
without DCP: each tensor chunk and each non-tensor value read by the offset and length the
metadata records, with ``torch.load(weights_only=True)``, after checking types, offsets and
lengths inside regular files of the directory, chunks inside their tensor and tiling it
exactly, and sizes that the files can hold before anything is allocated.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coci_core.engine.format.torch_saved import check_saved_pickle, load_weights_only
from coci_core.errors import CorruptCheckpointError
from coci_core.interop.allowance import (
    METADATA_NAME,
    Allowance,
    check_state_size,
    open_regular_file,
    short,
)
from coci_core.interop.dcp_metadata import damaged, load_metadata

__all__ = ["check_tiling", "nest", "read_dcp", "read_dcp_values"]

_SLOT_BYTES = 8  # what a list slot takes in memory: the price of padding a list
_MAX_DIM = (1 << 63) - 1  # torch sizes are int64


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
    meta, values, paths, read = read_dcp_values(directory)
    state = nest(meta, values, paths, Allowance.of_read(read, where))
    check_state_size(state, Allowance.of_read(read, where))
    return state


def read_dcp_values(
    directory: Path,
) -> tuple[Any, dict[str, Any], dict[str, tuple[str | int, ...]], int]:
    """The metadata, each stored value by its DCP key, the nesting path of each key, and the
    bytes read (``.metadata`` and the values': what the state built from them may take)."""
    where = str(directory)
    meta, metadata_bytes = load_metadata(directory, where)
    tensors, items, paths = _plan(meta, where, Allowance.of_metadata(metadata_bytes, where))
    if len(set(paths.values())) != len(paths):
        raise damaged(where, "two keys are nested at the same place")
    by_file: dict[str, list[_Item]] = {}
    for item in items:
        by_file.setdefault(item.file, []).append(item)
    for name, file_items in by_file.items():  # before anything is allocated
        with open_regular_file(directory / name, where) as f:
            size = os.fstat(f.fileno()).st_size
        _check_ranges(name, size, file_items, where)
    values: dict[str, Any] = {}
    for key, spec in tensors.items():
        try:
            values[key] = torch.empty(spec.size, dtype=spec.dtype)
        except (RuntimeError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{where}: cannot make the tensor {short(key)} ({spec.dtype}, "
                f"{list(spec.size)}): {e}"
            ) from e
    for name, file_items in by_file.items():
        with open_regular_file(directory / name, where) as f:
            for item in sorted(file_items, key=lambda i: i.offset):
                f.seek(item.offset)
                data = f.read(item.length)
                if len(data) != item.length:
                    raise CorruptCheckpointError(
                        f"{where}: {name} ended while reading {short(item.key)}"
                    )
                if item.chunk is None:
                    what = f"{where}: the value at {short(item.key)}"
                    check_saved_pickle(data, what=what, legacy=True)
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
                f"{where}: {short(item.key)} is recorded at bytes {item.offset}-"
                f"{item.offset + item.length} of {name}, which has {size} bytes (the file "
                "is truncated or the metadata is wrong)"
            )
        if last is not None and item.offset < last.offset + last.length:
            raise damaged(
                where,
                f"storage_data records {short(item.key)} at bytes {item.offset}-"
                f"{item.offset + item.length} of {name}, inside the bytes {last.offset}-"
                f"{last.offset + last.length} of {short(last.key)} (DCP stores each value "
                "in bytes of its own)",
            )
        if last is None or item.offset + item.length > last.offset + last.length:
            last = item


def nest(
    meta: Any,
    values: dict[str, Any],
    paths: dict[str, tuple[str | int, ...]],
    allowance: Allowance,
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for key in meta.state_dict_metadata:
        _set_element(state, paths[key], values[key], allowance)
    return state


def _int(value: Any) -> bool:
    return type(value) is int and value >= 0


def _shape(value: Any, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, (torch.Size, tuple, list)) or not all(
        _int(n) and n <= _MAX_DIM for n in value
    ):
        raise damaged(where, f"{what} is not a shape (sizes from 0 to 2**63-1): {short(value)}")
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
    meta: Any, where: str, allowance: Allowance
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
        raise damaged(where, "no state_dict_metadata or storage_data mappings")
    if planner is not None and type(planner) is not dict:
        raise damaged(where, f"planner_data is a {type(planner).__name__}")

    def located(key: str, index: Any) -> tuple[str, int, int]:
        info = storage.get(index)
        if info is None:
            raise damaged(where, f"no storage entry for {short(key)}")
        if type(info) is not _StorageInfo:
            raise damaged(where, f"the storage entry of {short(key)} is a {type(info).__name__}")
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if getattr(info, "transform_descriptors", None):
            raise CorruptCheckpointError(
                f"{where}: {short(key)} is stored through DCP stream transforms "
                f"{short(info.transform_descriptors)} (compression), which coci cannot import"
            )
        if not _plain_name(name):
            raise damaged(
                where, f"{short(key)} is stored in {short(name)}, not a file of the directory"
            )
        if not _int(offset) or not _int(length):
            raise damaged(
                where, f"{short(key)} has offset {short(offset)} and length {short(length)}"
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
            raise damaged(where, f"a key is a {type(key).__name__}: {short(key)}")
        paths[key] = _path_of(key, planner, where)
        if type(entry) is BytesStorageMetadata:
            name, offset, length = located(key, MetadataIndex(key))
            items.append(_Item(key, name, offset, length))
            continue
        if type(entry) is not TensorStorageMetadata:
            raise damaged(where, f"{short(key)} is described by a {type(entry).__name__}")
        dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise damaged(where, f"{short(key)} has no dtype")
        size = _shape(getattr(entry, "size", None), where, f"the size of {short(key)}")
        if _numel(size) > _MAX_DIM:
            raise damaged(where, f"the size of {short(key)} has more than 2**63-1 elements")
        chunks = getattr(entry, "chunks", None)
        if type(chunks) is not list:
            raise damaged(where, f"{short(key)} has no list of chunks")
        boxes = []
        for chunk in chunks:
            if type(chunk) is not ChunkStorageMetadata:
                raise damaged(where, f"a chunk of {short(key)} is a {type(chunk).__name__}")
            offsets = _shape(
                getattr(chunk, "offsets", None), where, f"a chunk offset of {short(key)}"
            )
            sizes = _shape(getattr(chunk, "sizes", None), where, f"a chunk size of {short(key)}")
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise damaged(
                    where, f"a chunk of {short(key)} has another rank than its {list(size)}"
                )
            if any(o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)):
                raise damaged(
                    where,
                    f"a chunk of {short(key)} at {list(offsets)} of {list(sizes)} leaves "
                    f"its {list(size)}",
                )
            name, offset, length = located(key, MetadataIndex(key, offsets))
            nbytes = _numel(sizes) * dtype.itemsize
            if nbytes > length:
                raise damaged(
                    where,
                    f"a chunk of {short(key)} needs {nbytes} bytes and is stored in {length}",
                )
            boxes.append((offsets, sizes))
            items.append(_Item(key, name, offset, length, (offsets, sizes)))
        check_tiling(key, size, boxes, allowance)
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
    field = f"the nesting path planner_data[{short(key)}]"
    if type(path) not in (tuple, list) or not path or type(path[0]) is not str:
        raise damaged(where, f"{field} is {short(path)}")
    for part in path:
        if type(part) is not str and (type(part) is not int or part < 0):
            raise damaged(where, f"{field} has the part {short(part)} (parts are str or int >= 0)")
    return tuple(path)


def check_tiling(
    key: str,
    size: tuple[int, ...],
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    allowance: Allowance,
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
        raise damaged(where, f"the chunks of {short(key)} do not cover its {list(size)} exactly")
    if whole == 0:
        return  # all chunks empty, all inside the tensor: nothing to read
    solid = [b for b in boxes if _numel(b[1])]
    split = sorted(
        {d for offsets, sizes in solid for d, n in enumerate(size) if offsets[d] or sizes[d] != n}
    )
    allowance.spend(
        (len(solid) + 1) << len(split),
        f"checking that the {len(solid)} chunks of {short(key)} tile it takes "
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
        raise damaged(where, f"two chunks of {short(key)} overlap (their corners do not tile it)")


def _copy_chunk(out: torch.Tensor, spec: _Tensor, item: _Item, data: bytes, where: str) -> None:
    assert item.chunk is not None
    offsets, sizes = item.chunk
    what = f"{where}: a chunk of the tensor {short(item.key)}"
    check_saved_pickle(data, what=what, legacy=True)
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
            f"{where}: the chunk of {short(item.key)} at {list(offsets)} holds {got}, the "
            f"metadata says {spec.dtype} of shape {list(sizes)}"
        )
    region = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
    out[region].copy_(chunk.detach())


def _set_element(
    root: dict[str, Any], path: Sequence[str | int], value: Any, slots: Allowance
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
        raise damaged(where, f"the nesting path {short(list(path))} is also a container")
    node[last] = value


def _check_slot(node: Any, key: str | int, path: Sequence[str | int], where: str) -> None:
    if (type(node) is dict and type(key) is str) or (type(node) is list and type(key) is int):
        return
    raise damaged(
        where, f"the nesting path {short(list(path))} goes through a {type(node).__name__}"
    )


def _pad(node: list[Any], index: int, path: Sequence[str | int], slots: Allowance) -> None:
    """Pad ``node`` with None up to ``index``, paying for the new slots before making them."""
    more = index + 1 - len(node)
    if more > 0:
        slots.spend(
            more * _SLOT_BYTES,
            f"the nesting path {short(list(path))} of planner_data pads a list with {more} "
            f"more slots ({more * _SLOT_BYTES} bytes)",
        )
        node.extend([None] * more)


def _child(
    node: Any,
    key: str | int,
    fresh: Callable[[], Any],
    path: Sequence[str | int],
    slots: Allowance,
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
        raise damaged(where, f"the nesting path {short(list(path))} goes through a value")
    return child
