"""Values kept with ``torch.save`` (``allow_torch_save=True``, and the files ``coci import``
reads): every pickle ``torch.load(weights_only=True)`` would unpickle is measured before it
runs, so that no code from a checkpoint runs and no crafted pickle exhausts memory or the C
stack. A value coci stored is a ``torch.save`` zip, or damage; a file to import may also be in
torch's legacy format, whose pickles are measured alike.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from typing import Any

import torch

from coci_core.engine.format.pickle_tree import PickleTree, pickle_tree, pickle_tree_from
from coci_core.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedValueError
from coci_core.knobs import (
    MAX_SAVED_PICKLE_DEPTH,
    SAVED_PICKLE_FLOOR,
    SAVED_PICKLE_UNITS_PER_BYTE,
)

__all__ = [
    "check_loadable",
    "check_saved_pickle",
    "load_torch_saved",
    "load_weights_only",
    "refused_global",
]


def check_loadable(data: bytes, value: Any, key: str) -> None:
    """Refuse at save what ``load_torch_saved`` would refuse at restore: the value must load back
    with ``torch.load(weights_only=True)`` (with whatever ``add_safe_globals`` registered)."""
    try:
        check_saved_pickle(data, what="it")
    except CorruptCheckpointError as e:
        raise UnsupportedValueError(
            f"state value at {key!r} cannot be stored: {e} (restore measures a stored value's "
            "pickle before loading it)"
        ) from e
    try:  # the fast path: the weights-only unpickler runs, storages are not read (meta)
        torch.load(io.BytesIO(data), weights_only=True, map_location="meta")
        return
    except Exception:  # decided by the full load below
        pass
    try:  # some tensors (quantized) cannot be rebuilt on meta: the load restore does
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # any failure means it could never be restored
        name = refused_global(e)
        what = (
            f"refers to {name}, which torch.load(weights_only=True) does not allow"
            if name is not None
            else f"does not load back with torch.load(weights_only=True) ({_reason(e)})"
        )
        cls = type(value)
        raise UnsupportedValueError(
            f"state value at {key!r} of type {cls.__module__}.{cls.__qualname__} {what}, so "
            "the checkpoint could never be restored; store it as a str or a number (or lists "
            "and dicts of those) instead, or, if you trust that type, register it with "
            "torch.serialization.add_safe_globals([...]) (before saving and before restoring)"
        ) from e


def load_torch_saved(data: bytes, key: str | None = None) -> Any:
    """Load an opt-in ``torch.save`` leaf without executing code (``weights_only=True``).

    Raises:
        CorruptCheckpointError: the bytes do not load (``UnsafeCheckpointError`` when they
            name a global that ``weights_only`` refuses), so a restore moves on to an older
            checkpoint instead of crashing.
    """
    what = f"the torch.save'd value at {key!r}" if key is not None else "a torch.save'd value"
    try:
        check_saved_pickle(data, what=what)
        return load_weights_only(data, what=what)
    except CorruptCheckpointError as e:
        e.bad = [key] if key is not None else []
        raise


def check_saved_pickle(
    source: bytes | os.PathLike[str], *, what: str, legacy: bool = False
) -> None:
    """Measure every pickle ``torch.load`` would unpickle from ``source`` before it runs, with
    :func:`~coci_core.engine.format.pickle_tree.pickle_tree` (nothing is built or called): a
    ``torch.save`` zip's ``data.pkl``; with ``legacy``, the pickles of torch's legacy
    (non-zip) format; without, such bytes are refused (coci writes only zips).

    Raises:
        CorruptCheckpointError: the bytes are in the legacy format and ``legacy`` is False,
            or a pickle nests deeper than :data:`MAX_SAVED_PICKLE_DEPTH` or describes more than
            :data:`SAVED_PICKLE_UNITS_PER_BYTE` objects per byte (plus a floor), shared
            references counted again, or is malformed.
    """
    if not _is_zip(source):
        if not legacy:
            raise CorruptCheckpointError(
                f"{what} cannot be read: it is not a torch.save zip archive, the only format "
                "coci stores values in"
            )
        _check_legacy(source, what)
        return
    try:
        reader = torch._C.PyTorchFileReader(
            io.BytesIO(source) if isinstance(source, bytes) else os.fspath(source)
        )
        record = reader.get_record("data.pkl")
    except (RuntimeError, OSError, ValueError):
        return  # torch.load reads the record the same way: it fails before unpickling
    try:
        tree = pickle_tree(record, cap=_cap(len(record)))
    except ValueError as e:
        raise CorruptCheckpointError(f"{what} cannot be read: {_reason(e)}") from e
    _check_tree(tree, len(record), what)


# torch.load of the legacy format unpickles five pickles one after another (a magic number,
# the protocol version, system information, the object, its storages' keys), then reads the
# storages' raw bytes (torch/serialization.py, _legacy_load)
_LEGACY_PICKLES = 5
_ZIP_MAGIC = b"PK\x03\x04"  # how torch.load tells a zip (serialization._is_zipfile)


def _is_zip(source: bytes | os.PathLike[str]) -> bool:
    if isinstance(source, bytes):
        return source.startswith(_ZIP_MAGIC)
    try:
        with open(source, "rb") as f:
            return f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
    except OSError:
        return True  # torch.load fails to open it too: nothing is unpickled


def _check_legacy(source: bytes | os.PathLike[str], what: str) -> None:
    """Measure the pickles of torch's legacy format, each against its own length (up to the
    end of the bytes: torch.load fails there, after unpickling only what was measured)."""
    with io.BytesIO(source) if isinstance(source, bytes) else open(source, "rb") as stream:
        for _ in range(_LEGACY_PICKLES):
            if not stream.read(1):
                return
            stream.seek(-1, io.SEEK_CUR)
            try:
                tree, length = pickle_tree_from(stream, _cap)
            except ValueError as e:
                raise CorruptCheckpointError(f"{what} cannot be read: {_reason(e)}") from e
            _check_tree(tree, length, what)


def _cap(nbytes: int) -> int:
    return SAVED_PICKLE_UNITS_PER_BYTE * nbytes + SAVED_PICKLE_FLOOR


def _check_tree(tree: PickleTree, nbytes: int, what: str) -> None:
    """Refuse a pickle of ``nbytes`` whose tree is too deep or too large."""
    cap = _cap(nbytes)
    if tree.depth > MAX_SAVED_PICKLE_DEPTH:
        nests = (
            f"refers to itself or nests objects more than {cap} levels deep"
            if tree.depth > cap
            else f"nests objects {tree.depth} levels deep"
        )
        raise CorruptCheckpointError(
            f"{what} cannot be read: its pickle {nests} (at most {MAX_SAVED_PICKLE_DEPTH} "
            "levels are read)"
        )
    if tree.size > cap:
        raise CorruptCheckpointError(
            f"{what} cannot be read: its pickle describes a tree of more than {cap} objects "
            f"and characters (at most {SAVED_PICKLE_UNITS_PER_BYTE} per byte of its "
            f"{nbytes}-byte pickle, plus {SAVED_PICKLE_FLOOR}, are read)"
        )


_REFUSED_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")


def refused_global(error: BaseException) -> str | None:
    """The global that ``torch.load(weights_only=True)`` refused, when that is why it failed."""
    if isinstance(error, pickle.UnpicklingError):
        found = _REFUSED_GLOBAL.search(str(error))
        if found is not None:
            return found.group(1)
    return None


def _reason(error: BaseException) -> str:
    text = str(error)
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    line = found.group(1) if found else (text.strip().splitlines() or [""])[0]
    line = line or type(error).__name__
    if not line.isprintable():  # messages may quote bytes of the file: no terminal escapes
        line = repr(line)
    return line if len(line) <= 300 else line[:300] + "..."


def load_weights_only(
    data: bytes | os.PathLike[str],
    *,
    what: str,
    map_location: str | None = None,
    mmap: bool = False,
) -> Any:
    """``torch.load(data, weights_only=True)`` (bytes or a file; a zip file memory-mapped with
    ``mmap``), every failure a CociError naming ``what``.

    Raises:
        UnsafeCheckpointError: the pickle names a global that ``weights_only`` refuses (loading
            it would run code from the file).
        CorruptCheckpointError: the bytes are not a loadable ``torch.save`` file.
    """
    try:
        if isinstance(data, bytes):
            return torch.load(io.BytesIO(data), weights_only=True, map_location=map_location)
        if _is_zip(data):
            return torch.load(data, weights_only=True, map_location=map_location, mmap=mmap)
        with _Unnumbered(io.FileIO(data, "rb")) as stream:
            return torch.load(stream, weights_only=True, map_location=map_location)
    except Exception as e:  # torch raises many types for a bad file (OSError included)
        name = refused_global(e)
        if name is not None:
            raise UnsafeCheckpointError(
                f"{what} cannot be loaded without running code: it refers to {name}, which "
                "torch.load(weights_only=True) does not allow; coci never runs code from a "
                "checkpoint"
            ) from e
        raise CorruptCheckpointError(f"{what} cannot be read: {_reason(e)}") from e


class _Unnumbered(io.BufferedReader):
    """A file that hides its file number: given a real file of the legacy format, torch.load
    first tries it as a tar archive of yet older torch, whose pickles
    :func:`check_saved_pickle` does not measure; given a stream, it reads the pickles it
    measured."""

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")
