"""Turns a nested training state into a JSON tree plus a flat list of array leaves, and back.

The JSON tree is what the manifest stores; every tensor (or numpy array) in the state becomes a
``{"t": "tensor", "id": n}`` node pointing into the leaf list. Nothing here serializes tensor
bytes and nothing executes code on the way back: the only opt-in exception is ``torch.save``'d
leaves, which are read back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import base64
import io
import math
import os
import pickle
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from coci_core.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedValueError

__all__ = ["ArrayLeaf", "FlatState", "decode_dtype", "flatten_state", "unflatten_state"]

LeafKind = Literal["tensor", "ndarray", "torch_save"]

# dtypes whose bytes can be copied and viewed (sub-byte and quantized dtypes cannot).
_SUPPORTED_DTYPES: dict[str, torch.dtype] = {
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
        _SUPPORTED_DTYPES[_name] = getattr(torch, _name)


def encode_dtype(dtype: torch.dtype) -> str:
    """The manifest name of a torch dtype (``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def decode_dtype(name: str) -> torch.dtype:
    """The torch dtype for a manifest name; never calls ``getattr`` on arbitrary names."""
    try:
        return _SUPPORTED_DTYPES[name]
    except KeyError:
        raise CorruptCheckpointError(f"unknown dtype in manifest: {name!r}") from None


@dataclass(frozen=True)
class ArrayLeaf:
    """One array in the state: the live tensor and how it must come back."""

    key: str
    tensor: torch.Tensor
    kind: LeafKind
    numpy_dtype: str | None = None
    global_shape: tuple[int, ...] | None = None
    global_start: int = 0

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def owned(self) -> bool:
        """A shard of a larger tensor (``global_shape``), at byte ``global_start`` of it:
        written by the rank that holds it, not split over ranks."""
        return self.global_shape is not None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the whole array (for a shard, of the tensor it is part of)."""
        return self.global_shape if self.global_shape is not None else tuple(self.tensor.shape)


@dataclass(frozen=True)
class FlatState:
    """A state split into its JSON tree and its array leaves (in tree order)."""

    tree: Any
    leaves: tuple[ArrayLeaf, ...]


def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    if t.numel() == 0:
        return None
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.device,
    )


class _Flattener:
    def __init__(self, allow_torch_save: bool) -> None:
        self.allow_torch_save = allow_torch_save
        self.leaves: list[ArrayLeaf] = []
        self._aliases: dict[tuple[Any, ...], int] = {}

    def add_leaf(
        self,
        key: str,
        t: torch.Tensor,
        kind: LeafKind,
        numpy_dtype: str | None = None,
        shard: tuple[tuple[int, ...], int] | None = None,
    ) -> Any:
        alias = _alias_key(t) if kind == "tensor" else None
        if alias is not None and alias in self._aliases:
            return {"t": "tensor", "id": self._aliases[alias]}
        index = len(self.leaves)
        global_shape, global_start = shard if shard is not None else (None, 0)
        self.leaves.append(
            ArrayLeaf(
                key=key,
                tensor=t,
                kind=kind,
                numpy_dtype=numpy_dtype,
                global_shape=global_shape,
                global_start=global_start,
            )
        )
        if alias is not None:
            self._aliases[alias] = index
        return {"t": kind, "id": index}

    def encode(self, value: Any, key: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int) and type(value) is int:
            return value
        if type(value) is float:
            return value if math.isfinite(value) else {"t": "float", "v": repr(value)}
        if isinstance(value, torch.Tensor):
            return self._encode_tensor(value, key)
        if isinstance(value, np.ndarray):
            return self._encode_ndarray(value, key)
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return {"t": "np", "dtype": value.dtype.str, "v": self.encode(value.item(), key)}
        if isinstance(value, torch.dtype):
            return {"t": "dtype", "v": encode_dtype(value)}
        if isinstance(value, torch.Size):
            return {"t": "size", "v": list(value)}
        if isinstance(value, bytes):
            return {"t": "bytes", "v": base64.b64encode(value).decode("ascii")}
        if type(value) in (dict, OrderedDict):
            return self._encode_dict(value, key)
        if type(value) in (list, tuple):
            items = [self.encode(v, f"{key}/{i}") for i, v in enumerate(value)]
            return {"t": "list" if type(value) is list else "tuple", "v": items}
        return self._fallback(value, key)

    def _encode_tensor(self, t: torch.Tensor, key: str) -> Any:
        if t.is_sparse or t.layout != torch.strided:
            return self._fallback(t, key, why="sparse and other non-strided layouts are not stored")
        if t.is_quantized or encode_dtype(t.dtype) not in _SUPPORTED_DTYPES:
            return self._fallback(t, key, why=f"dtype {t.dtype} is not stored")
        if t.device.type == "meta":
            raise UnsupportedValueError(f"state value at {key!r} is a meta tensor: it has no data")
        if type(t).__name__ == "DTensor":
            return self._encode_dtensor(t, key)
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return self._fallback(t, key, why=f"tensor subclass {type(t).__name__} is not stored")
        return self.add_leaf(key, t.detach(), "tensor")

    def _encode_dtensor(self, t: Any, key: str) -> Any:
        # Replicated: like any tensor (split over ranks). Shard(0) on a 1-D mesh (FSDP2): the
        # local rows are one byte range of the whole tensor, written by their owner.
        from torch.distributed.tensor import Replicate, Shard

        placements = tuple(t.placements)
        local = t.to_local().detach()
        if all(isinstance(p, Replicate) for p in placements):
            return self.add_leaf(key, local, "tensor")
        mesh = t.device_mesh
        if mesh.ndim != 1 or placements != (Shard(0),):
            raise UnsupportedValueError(
                f"state value at {key!r} is a DTensor with placements {placements} on a "
                f"{mesh.ndim}-D mesh; coci stores Replicate() and Shard(0) on a 1-D mesh: save "
                "its full_tensor() (or a full state dict) instead"
            )
        rows = int(t.shape[0])
        world, rank = mesh.size(), mesh.get_local_rank()
        per_rank = -(-rows // world) if rows else 0
        first = min(rows, rank * per_rank)
        count = max(0, min(rows, first + per_rank) - first)
        if tuple(local.shape) != (count, *t.shape[1:]):
            raise UnsupportedValueError(
                f"state value at {key!r}: a DTensor shard of shape {tuple(local.shape)} where "
                f"torch.chunk over {world} ranks gives {(count, *t.shape[1:])}"
            )
        row_bytes = local.element_size() * math.prod(t.shape[1:])
        return self.add_leaf(key, local, "tensor", shard=(tuple(t.shape), first * row_bytes))

    def _encode_ndarray(self, a: np.ndarray, key: str) -> Any:
        if a.dtype.kind not in "biufc" or a.dtype.byteorder == ">":
            return self._fallback(a, key, why=f"numpy dtype {a.dtype} is not stored")
        return self.add_leaf(key, torch.from_numpy(np.ascontiguousarray(a)), "ndarray", a.dtype.str)

    def _encode_dict(self, d: Mapping[Any, Any], key: str) -> Any:
        node: dict[str, Any] = {"t": "odict" if type(d) is OrderedDict else "dict"}
        if all(type(k) is str for k in d):
            node["v"] = {k: self.encode(v, f"{key}/{k}") for k, v in d.items()}
        else:
            node["items"] = [
                [self._encode_key(k, key), self.encode(v, f"{key}/{k}")] for k, v in d.items()
            ]
        metadata = getattr(
            d, "_metadata", None
        )  # nn.Module.state_dict() keeps module versions here
        if metadata is not None:
            node["metadata"] = self.encode(metadata, f"{key}/_metadata")
        return node

    def _encode_key(self, k: Any, key: str) -> Any:
        if k is None or type(k) in (str, int, bool) or (type(k) is float and math.isfinite(k)):
            return k
        if type(k) is tuple:
            return {"t": "tuple", "v": [self._encode_key(x, key) for x in k]}
        raise UnsupportedValueError(
            f"dict key {k!r} of type {type(k).__name__} at {key!r} is not stored: "
            "keys may be str, int, float, bool, None or tuples of those"
        )

    def _fallback(self, value: Any, key: str, why: str | None = None) -> Any:
        if not self.allow_torch_save:
            reason = why or f"values of type {type(value).__module__}.{type(value).__qualname__}"
            raise UnsupportedValueError(
                f"state value at {key!r} cannot be stored without pickle ({reason}); store "
                "tensors, numpy arrays, numbers, strings, bytes, None, lists, tuples and dicts, "
                "or pass allow_torch_save=True to keep it with torch.save and load it back "
                "with torch.load(weights_only=True)"
            )
        buffer = io.BytesIO()
        torch.save(value, buffer)
        _check_loadable(buffer.getvalue(), value, key)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        return self.add_leaf(key, data, "torch_save")


def _check_loadable(data: bytes, value: Any, key: str) -> None:
    """Refuse at save what ``load_torch_saved`` would refuse at restore: the value must load back
    with ``torch.load(weights_only=True)`` (with whatever ``add_safe_globals`` registered)."""
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


def flatten_state(state: Mapping[str, Any], *, allow_torch_save: bool = False) -> FlatState:
    """Split ``state`` into a JSON tree and its array leaves.

    Tensors that are the same view of the same storage (tied weights) become one leaf.

    Raises:
        UnsupportedValueError: a value cannot be stored without pickle and
            ``allow_torch_save`` is off.
    """
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(f"state must be a mapping, got {type(state).__name__}")
    flattener = _Flattener(allow_torch_save)
    tree = flattener.encode(dict(state), "")
    return FlatState(tree=tree, leaves=tuple(flattener.leaves))


def unflatten_state(tree: Any, leaves: list[Any]) -> Any:
    """Rebuild a state from its JSON tree; ``leaves[i]`` is the restored value of leaf ``i``."""
    return _decode(tree, leaves)


def _decode(node: Any, leaves: list[Any]) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        raise CorruptCheckpointError("malformed state tree: bare list node")
    if not isinstance(node, dict) or "t" not in node:
        raise CorruptCheckpointError(f"malformed state tree node: {str(node)[:80]}")
    tag = node["t"]
    try:
        if tag in ("tensor", "ndarray", "torch_save"):
            return leaves[int(node["id"])]
        if tag == "float":
            return float(node["v"])
        if tag == "np":
            return np.dtype(node["dtype"]).type(_decode(node["v"], leaves))
        if tag == "dtype":
            return decode_dtype(node["v"])
        if tag == "size":
            return torch.Size(int(x) for x in node["v"])
        if tag == "bytes":
            return base64.b64decode(node["v"])
        if tag == "list":
            return [_decode(v, leaves) for v in node["v"]]
        if tag == "tuple":
            return tuple(_decode(v, leaves) for v in node["v"])
        if tag in ("dict", "odict"):
            out: dict[Any, Any] = OrderedDict() if tag == "odict" else {}
            if "v" in node:
                for k, v in node["v"].items():
                    out[k] = _decode(v, leaves)
            else:
                for k, v in node["items"]:
                    out[_decode_key(k)] = _decode(v, leaves)
            if "metadata" in node:
                out._metadata = _decode(node["metadata"], leaves)  # type: ignore[attr-defined]
            return out
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"malformed state tree node {tag!r}: {e}") from e
    raise CorruptCheckpointError(f"unknown state tree node type {tag!r}")


def _decode_key(k: Any) -> Any:
    if isinstance(k, dict) and k.get("t") == "tuple":
        return tuple(_decode_key(x) for x in k["v"])
    return k


def load_torch_saved(data: bytes, key: str | None = None) -> Any:
    """Load an opt-in ``torch.save`` leaf without executing code (``weights_only=True``).

    Raises:
        CorruptCheckpointError: the bytes do not load (``UnsafeCheckpointError`` when they
            name a global that ``weights_only`` refuses), so a restore moves on to an older
            checkpoint instead of crashing.
    """
    what = f"the torch.save'd value at {key!r}" if key is not None else "a torch.save'd value"
    try:
        return load_weights_only(data, what=what)
    except CorruptCheckpointError as e:
        e.bad = [key] if key is not None else []
        raise


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
    data: bytes | os.PathLike[str], *, what: str, map_location: str | None = None
) -> Any:
    """``torch.load(data, weights_only=True)`` (bytes or a file), every failure a CociError
    naming ``what``.

    Raises:
        UnsafeCheckpointError: the pickle names a global that ``weights_only`` refuses (loading
            it would run code from the file).
        CorruptCheckpointError: the bytes are not a loadable ``torch.save`` file.
    """
    try:
        source = io.BytesIO(data) if isinstance(data, bytes) else data
        return torch.load(source, weights_only=True, map_location=map_location)
    except Exception as e:  # torch raises many types for a bad file (OSError included)
        name = refused_global(e)
        if name is not None:
            raise UnsafeCheckpointError(
                f"{what} cannot be loaded without running code: it refers to {name}, which "
                "torch.load(weights_only=True) does not allow; coci never runs code from a "
                "checkpoint"
            ) from e
        raise CorruptCheckpointError(f"{what} cannot be read: {_reason(e)}") from e
