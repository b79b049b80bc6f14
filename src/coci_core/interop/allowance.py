"""What an import may build or walk, paid for by the bytes it reads (see
:mod:`coci_core.interop.foreign`), and the helpers every reader of untrusted files shares: a
bounded repr for messages and opening only regular files.
"""

from __future__ import annotations

import os
import reprlib
from pathlib import Path
from typing import Any, BinaryIO

from coci_core.errors import CorruptCheckpointError, StorageError
from coci_core.knobs import IMPORT_FLOOR_UNITS, UNITS_PER_METADATA_BYTE
from coci_core.storage.local import open_regular

__all__ = ["Allowance", "check_state_size", "open_regular_file", "short"]

METADATA_NAME = ".metadata"


class Allowance:
    """How many units an import may still spend on one kind of thing (objects walked, bytes of
    list slots, steps of a check), and what pays for them (``basis``, for the message)."""

    def __init__(self, units: int, basis: str, where: str) -> None:
        self.left = units + IMPORT_FLOOR_UNITS
        self.basis = basis
        self.where = where

    @classmethod
    def of_read(cls, nbytes: int, where: str) -> Allowance:
        """One unit per byte read."""
        return cls(
            nbytes,
            f"one unit (a value, a character, a byte of list slots) per byte of the {nbytes} "
            "bytes it reads",
            where,
        )

    @classmethod
    def of_metadata(cls, nbytes: int, where: str) -> Allowance:
        """:data:`UNITS_PER_METADATA_BYTE` per byte of ``.metadata``."""
        return cls(
            UNITS_PER_METADATA_BYTE * nbytes,
            f"{UNITS_PER_METADATA_BYTE} units (objects, characters, steps of a check) per "
            f"byte of its {nbytes}-byte {METADATA_NAME}",
            where,
        )

    def spend(self, units: int, what: str) -> None:
        """Take ``units``; beyond what is left, a CorruptCheckpointError naming ``what``."""
        if units > self.left:
            raise CorruptCheckpointError(
                f"{self.where}: {what}; an import builds at most {self.basis} (plus "
                f"{IMPORT_FLOOR_UNITS}): the checkpoint is crafted or damaged"
            )
        self.left -= units


def check_state_size(state: Any, allowance: Allowance) -> None:
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


def open_regular_file(path: Path, where: str) -> BinaryIO:
    """``path`` opened for reading if it is a regular file (not a link, a FIFO, a device)."""
    try:
        fd = open_regular(path, follow_links=False)
    except StorageError as e:
        raise CorruptCheckpointError(f"{where}: {path.name}: {e}") from e
    return os.fdopen(fd, "rb")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 200, 80


def short(value: Any) -> str:
    """A bounded repr of a value read from a file (never deep, never long)."""
    try:
        return _REPR.repr(value)
    except Exception:  # a repr of odd data must not fail the message
        return f"<{type(value).__name__}>"
