"""The state tree's vocabulary: its node tags and their fields, the types stored by name, the
dtypes an array may have, and how deeply containers may nest.

:mod:`coci_core.engine.format.tree` writes trees of these nodes and
:mod:`coci_core.engine.restore.tree_read` checks and reads them; nothing here builds a value.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch

from coci_core.errors import CorruptCheckpointError

__all__ = [
    "AS_IS",
    "CLASSES",
    "CONFIG_FLAGS",
    "CONFIG_TYPES",
    "LEAF_TAGS",
    "MAX_INT64",
    "MAX_TREE_DEPTH",
    "NDARRAY_DTYPES",
    "NODE_FIELDS",
    "NONFINITE",
    "NP_SCALAR_DTYPES",
    "PATH_TYPES",
    "SUPPORTED_DTYPES",
    "WRAPPER_TAGS",
    "LeafKind",
    "decode_dtype",
    "encode_dtype",
    "is_scalar",
    "ndarray_dtype",
]


LeafKind = Literal["tensor", "ndarray", "torch_save"]

# Types stored by name (see coci_core.engine.format.tree's docstring); nothing else is built
# from a name.
CONFIG_TYPES = ("DictConfig", "ListConfig")  # omegaconf's containers
CONFIG_FLAGS = ("struct", "readonly")  # the root flags stored
PATH_TYPES = ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")
CLASSES = ("omegaconf.DictConfig", "omegaconf.ListConfig", "argparse.Namespace")

# dtypes whose bytes can be copied and viewed (sub-byte and quantized dtypes cannot).
SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex32,
        torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2,
        torch.float8_e5m2fnuz,
    )
}
for _name in (
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bits8",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
):
    if hasattr(torch, _name):
        SUPPORTED_DTYPES[_name] = getattr(torch, _name)


# How deeply containers (dicts, lists, tuples, tuple keys) may nest in a state: deeper states are
# refused when saved, and deeper trees when read. It keeps every recursive walk of a tree (and
# the JSON parser's, about three levels per container) far from Python's recursion limit.
MAX_TREE_DEPTH = 128

# numpy dtypes of stored arrays (``ndarray`` leaves): little-endian or byte-sized numbers that
# torch.from_numpy takes, by their ``dtype.str``, with the torch dtype of their bytes. Object,
# void, structured, string and big-endian dtypes are never constructed from a manifest.
NDARRAY_DTYPES: dict[str, str] = {}
for _char in "?bBhHiIlLqQefdFD":
    _np = np.dtype(_char)
    if _np.byteorder != ">":
        try:
            _t = torch.from_numpy(np.empty(1, _np.str)).dtype
        except TypeError:  # pragma: no cover - depends on the torch build
            continue
        NDARRAY_DTYPES[_np.str] = str(_t).removeprefix("torch.")
# numpy scalar dtypes of ``{"t": "np"}`` nodes: booleans, integers and floats.
NP_SCALAR_DTYPES = frozenset(
    np.dtype(c).str for c in "?bBhHiIlLqQefdg" if np.dtype(c).byteorder != ">"
)
NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
#: values that ``encode`` returns unchanged (with finite floats)
AS_IS = frozenset({type(None), bool, int, str})

LEAF_TAGS = ("tensor", "ndarray", "torch_save")
#: nodes that wrap a container node ("v") and build a value of another type from it
WRAPPER_TAGS = ("config", "namespace")
NODE_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # tag: (required fields, optional fields), besides "t"
    **{tag: (frozenset({"id"}), frozenset()) for tag in LEAF_TAGS},
    "float": (frozenset({"v"}), frozenset()),
    "np": (frozenset({"dtype", "v"}), frozenset()),
    "dtype": (frozenset({"v"}), frozenset()),
    "size": (frozenset({"v"}), frozenset()),
    "bytes": (frozenset({"v"}), frozenset()),
    "list": (frozenset({"v"}), frozenset()),
    "tuple": (frozenset({"v"}), frozenset()),
    "dict": (frozenset(), frozenset({"v", "items", "metadata"})),
    "odict": (frozenset(), frozenset({"v", "items", "metadata"})),
    "config": (frozenset({"type", "v"}), frozenset({"flags"})),
    "namespace": (frozenset({"v"}), frozenset()),
    "path": (frozenset({"type", "v"}), frozenset()),
    # a long list of ints (manifest format 5: see coci_core.engine.format.int_lists)
    "ints": (frozenset({"type", "dtype", "n", "v"}), frozenset()),
    "class": (frozenset({"v"}), frozenset()),
}
MAX_INT64 = 2**63 - 1


def is_scalar(node: Any) -> bool:
    return node is None or type(node) in (bool, int, float, str)


def ndarray_dtype(name: Any, torch_dtype: str) -> np.dtype[Any]:
    """The numpy dtype of a stored ndarray, checked against the torch dtype of its bytes.

    Raises:
        CorruptCheckpointError: the name is not an allowed numpy dtype, or does not match.
    """
    if type(name) is not str or NDARRAY_DTYPES.get(name) != torch_dtype:
        raise CorruptCheckpointError(
            f"numpy dtype {str(name)[:40]!r} is not allowed for an array of {torch_dtype}"
        )
    return np.dtype(name)


_DTYPE_NAMES = {dtype: name for name, dtype in SUPPORTED_DTYPES.items()}


def encode_dtype(dtype: torch.dtype) -> str:
    """The manifest name of a torch dtype (``"float32"``)."""
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def decode_dtype(name: str) -> torch.dtype:
    """The torch dtype for a manifest name; never calls ``getattr`` on arbitrary names."""
    try:
        return SUPPORTED_DTYPES[name]
    except KeyError:
        raise CorruptCheckpointError(f"unknown dtype in manifest: {name!r}") from None
