"""Long lists of ints in a state tree: ``ints`` nodes (manifest format 5).

A list or tuple of at least :data:`INT_LIST_MIN` Python ints that all fit in one of
:data:`INT_DTYPES` (the 625 of ``random.getstate()``, a loader's indices) is stored in the tree
as one node rather than one JSON number per int::

    {"t": "ints", "type": "tuple", "dtype": "uint32", "n": 625, "v": "<base64>"}

``v`` is the standard base64 (with padding) of the ``n`` ints as fixed-width little-endian
integers of ``dtype``, the narrowest that holds them all (unsigned before signed). The node is
a value of the tree like any other: it is not an array of the data file, so it takes no part in
the layout the ranks agree on and no part in a flatten cache's tensors.

Reading checks the node before anything is decoded: its fields, ``dtype`` one of the eight
names, ``n`` an int of ``[0, 2**63)`` and ``v`` a string of exactly the length that ``n``
ints of ``dtype`` encode to (so a huge ``n`` is refused without allocating anything, and what
is decoded is at most the manifest's own size), and ``v`` only base64's alphabet, in its one
canonical spelling, of exactly ``n`` ints' bytes (checked on the text, so that the reader's
check of the tree names where a forged ``v`` is; decoding checks it again).
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from typing import Any

from coci_core.errors import CorruptCheckpointError

__all__ = [
    "INT_DTYPES",
    "INT_LIST_MIN",
    "base64_problem",
    "check_ints",
    "decode_ints",
    "encode_ints",
    "holds_ints",
]

#: The fewest ints a list or tuple holds to be stored as an ``ints`` node (shorter ones stay
#: JSON numbers, readable in the manifest).
INT_LIST_MIN = 64

#: The widths of an ``ints`` node, narrowest first (the writer takes the first that holds every
#: value): the node's ``dtype`` name and the :mod:`struct` code of one little-endian int.
INT_DTYPES: dict[str, str] = {
    "uint8": "B",
    "int8": "b",
    "uint16": "H",
    "int16": "h",
    "uint32": "I",
    "int32": "i",
    "uint64": "Q",
    "int64": "q",
}


def _itemsize(dtype: str) -> int:
    return struct.calcsize("<" + INT_DTYPES[dtype])


def _bounds(dtype: str) -> tuple[int, int]:
    bits = 8 * _itemsize(dtype)
    if dtype.startswith("int"):
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


_RANGES = [(name, *_bounds(name)) for name in INT_DTYPES]
_MAX_N = 2**63 - 1


_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
# base64's alphabet (the padding "=" apart): matched on the text before the padding
_ALPHABET_ONLY = re.compile(r"[A-Za-z0-9+/]*")


def base64_problem(text: str, *, canonical: bool = False) -> str | None:
    """Why ``text`` is not standard base64 with its padding (as ``b64decode(validate=True)``
    takes it), or None; ``canonical``: also refuse the bits that padding leaves unused set
    (another spelling of the same bytes). Read on the text: nothing is decoded."""
    pads = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
    if len(text) % 4 or _ALPHABET_ONLY.fullmatch(text, 0, len(text) - pads) is None:
        return "is not base64 (a character outside its alphabet, or padding out of place)"
    if canonical and pads:
        unused = 0x0F if pads == 2 else 0x03
        if _ALPHABET.index(text[-pads - 1]) & unused:
            return "is not base64 in its canonical spelling (padding bits set)"
    return None


def encode_ints(values: list[Any] | tuple[Any, ...]) -> dict[str, Any] | None:
    """The ``ints`` node of a list or tuple, or None when it is not one: shorter than
    :data:`INT_LIST_MIN`, holding anything but ints (a bool, a numpy integer), or an int
    outside 64 bits."""
    if len(values) < INT_LIST_MIN or not all(type(v) is int for v in values):
        return None
    low, high = min(values), max(values)
    name = next((n for n, lo, hi in _RANGES if lo <= low and high <= hi), None)
    if name is None:
        return None
    data = struct.pack(f"<{len(values)}{INT_DTYPES[name]}", *values)
    return {
        "t": "ints",
        "type": "list" if type(values) is list else "tuple",
        "dtype": name,
        "n": len(values),
        "v": base64.b64encode(data).decode("ascii"),
    }


def _encoded_length(n: int, dtype: str) -> int:
    return 4 * -(-(n * _itemsize(dtype)) // 3)


def check_ints(node: dict[str, Any]) -> str | None:
    """Why an ``ints`` node (with exactly its fields) is malformed, or None; nothing is decoded
    or allocated."""
    kind, dtype, n, text = node["type"], node["dtype"], node["n"], node["v"]
    if type(kind) is not str or kind not in ("list", "tuple"):
        return f"an ints node's type {str(kind)[:40]!r} is not 'list' or 'tuple'"
    if type(dtype) is not str or dtype not in INT_DTYPES:
        return f"an ints node's dtype {str(dtype)[:40]!r} is not one of {', '.join(INT_DTYPES)}"
    if type(n) is not int or not 0 <= n <= _MAX_N:
        return f"an ints node's count n={str(n)[:40]} is not an int of [0, 2**63)"
    if type(text) is not str:
        return f"an ints node's v is a {type(text).__name__}, not a base64 string"
    if len(text) != _encoded_length(n, dtype):
        return (
            f"an ints node's v has {len(text)} characters, where {n} ints of {dtype} take "
            f"{_encoded_length(n, dtype)} in base64"
        )
    why = base64_problem(text, canonical=True)
    if why is not None:
        return f"an ints node's v {why}"
    if len(text) - len(text.rstrip("=")) != -(n * _itemsize(dtype)) % 3:
        return f"an ints node's v is not the base64 of {n} ints of {dtype} (its padding)"
    return None


def decode_ints(node: dict[str, Any]) -> list[int] | tuple[int, ...]:
    """The list or tuple of Python ints of a checked ``ints`` node (see :func:`check_ints`).

    Raises:
        CorruptCheckpointError: ``v`` is not the canonical base64 of ``n`` ints.
    """
    text, dtype, n = node["v"], node["dtype"], node["n"]
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise CorruptCheckpointError(f"an ints node's v is not base64 ({e})") from None
    if len(data) != n * _itemsize(dtype) or base64.b64encode(data).decode() != text:
        raise CorruptCheckpointError(f"an ints node's v is not the base64 of {n} ints of {dtype}")
    values = struct.unpack(f"<{n}{INT_DTYPES[dtype]}", data)
    return list(values) if node["type"] == "list" else values


def holds_ints(tree: Any) -> bool:
    """Whether a state tree (as this coci writes it) holds an ``ints`` node; walked without
    recursion, node by node (a user's dict ``{"t": "ints"}`` is a dict node's value, not a
    node), stopping at the first."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if type(node) is not dict:
            continue
        tag = node.get("t")
        if tag == "ints":
            return True
        value = node.get("v")
        if tag in ("dict", "odict"):
            if type(value) is dict:
                stack.extend(value.values())
            stack.extend(pair[1] for pair in node.get("items") or ())
            if "metadata" in node:
                stack.append(node["metadata"])
        elif tag in ("list", "tuple") and type(value) is list:
            stack.extend(value)
        elif tag in ("config", "namespace"):
            stack.append(value)
    return False
