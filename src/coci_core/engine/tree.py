"""Turns a nested training state into a JSON tree plus a flat list of array leaves, and back.

The JSON tree is what the manifest stores; every tensor (or numpy array) in the state becomes a
``{"t": "tensor", "id": n}`` node pointing into the leaf list. Nothing here serializes tensor
bytes and nothing executes code on the way back: the only opt-in exception is ``torch.save``'d
leaves, which are read back with ``torch.load(weights_only=True)``.

A few types that hyper-parameters are made of are stored as plain values plus the name of their
type, and built back only from fixed lists of names: OmegaConf's ``DictConfig`` and
``ListConfig`` (their content unresolved, as ``OmegaConf.to_container(resolve=False)`` gives it,
and their root's ``readonly``/``struct`` flags; built with ``OmegaConf.create`` when omegaconf
is installed, else plain dicts and lists), ``argparse.Namespace``, ``pathlib`` paths, and the
classes ``omegaconf.DictConfig``, ``omegaconf.ListConfig`` and ``argparse.Namespace`` themselves
(Lightning records its hyper-parameters' type as the class).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import enum
import io
import math
import pathlib
import sys
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from coci_core.engine.torch_saved import (
    check_loadable,
    check_saved_pickle,
    load_torch_saved,
    load_weights_only,
)
from coci_core.engine.tree_nodes import (
    AS_IS,
    CONFIG_TYPES,
    MAX_TREE_DEPTH,
    NDARRAY_DTYPES,
    PATH_TYPES,
    SUPPORTED_DTYPES,
    WRAPPER_TAGS,
    LeafKind,
    decode_dtype,
    encode_dtype,
    ndarray_dtype,
)
from coci_core.engine.tree_read import build_wrapped, check_tree, unflatten_state
from coci_core.errors import UnsupportedValueError

# Reading a tree (tree_read), its vocabulary (tree_nodes) and torch.save'd values (torch_saved)
# live in their own modules; their names stay importable from here.
__all__ = [
    "MAX_TREE_DEPTH",
    "WRAPPER_TAGS",
    "ArrayLeaf",
    "FlatState",
    "LeafKind",
    "build_wrapped",
    "check_saved_pickle",
    "check_tree",
    "decode_dtype",
    "encode_dtype",
    "flatten_state",
    "load_torch_saved",
    "load_weights_only",
    "ndarray_dtype",
    "unflatten_state",
]


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
        self._depth = 0

    def _enter(self, key: str) -> None:
        # Containers nested deeper than a manifest may hold are refused here, at save time.
        self._depth += 1
        if self._depth > MAX_TREE_DEPTH:
            raise UnsupportedValueError(
                f"state value at {key[:200]!r} is nested more than {MAX_TREE_DEPTH} containers "
                "deep (dicts, lists, tuples, tuple keys): flatten it"
            )

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
        if value is None or type(value) in (bool, str):
            return value
        if isinstance(value, str) and not isinstance(value, enum.Enum):
            return value  # a str subclass (numpy.str_) as its str; a StrEnum member is refused
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
            self._enter(key)
            try:
                return self._encode_dict(value, key)
            finally:
                self._depth -= 1
        if type(value) in (list, tuple):
            self._enter(key)
            try:
                if all(type(v) in AS_IS or (type(v) is float and math.isfinite(v)) for v in value):
                    items = list(value)  # what encode gives each (a planner's samples: fast)
                else:
                    items = [self.encode(v, f"{key}/{i}") for i, v in enumerate(value)]
            finally:
                self._depth -= 1
            return {"t": "list" if type(value) is list else "tuple", "v": items}
        return self._encode_named(value, key)

    def _encode_named(self, value: Any, key: str) -> Any:
        """A value stored with the name of its type (see the module's docstring), or the
        fallback, with what to store instead for types a checkpoint cannot name."""
        config = _config_type(value)
        if config is not None:
            return self._encode_config(value, config, key)
        if type(value) is argparse.Namespace:
            return self._wrapped("namespace", vars(value), key)
        if _path_type(value) is not None:
            return {"t": "path", "type": type(value).__name__, "v": str(value)}
        name = _class_name(value)
        if name is not None:
            return {"t": "class", "v": name}
        return self._fallback(value, key, why=_why_not_stored(value))

    def _wrapped(self, tag: str, content: Any, key: str, **fields: Any) -> Any:
        self._enter(key)  # the wrapper counts as a container level (as its content does)
        try:
            return {"t": tag, **fields, "v": self.encode(content, key)}
        finally:
            self._depth -= 1

    def _encode_config(self, value: Any, kind: str, key: str) -> Any:
        from omegaconf import OmegaConf, SCMode  # importable: ``value`` is one of its objects

        schema = OmegaConf.get_type(value)
        if schema not in (dict, list, tuple):
            raise UnsupportedValueError(
                f"state value at {key[:200]!r} is a structured OmegaConf config (of "
                f"{getattr(schema, '__qualname__', schema)}): restoring it would import that "
                "class, code that a checkpoint must not run; store it as a plain config, "
                "OmegaConf.create(OmegaConf.to_container(cfg)), which coci stores exactly"
            )
        # nested structured nodes stay DictConfig objects here, and are refused above
        content = OmegaConf.to_container(
            value, resolve=False, structured_config_mode=SCMode.DICT_CONFIG
        )
        flags = {
            flag: bool(on)
            for flag, on in (
                ("struct", OmegaConf.is_struct(value)),
                ("readonly", OmegaConf.is_readonly(value)),
            )
            if on is not None
        }
        extra = {"flags": flags} if flags else {}
        return self._wrapped("config", content, key, type=kind, **extra)

    def _encode_tensor(self, t: torch.Tensor, key: str) -> Any:
        if t.is_sparse or t.layout != torch.strided:
            return self._fallback(t, key, why="sparse and other non-strided layouts are not stored")
        if t.is_quantized or encode_dtype(t.dtype) not in SUPPORTED_DTYPES:
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
        name = a.dtype.str
        if a.dtype.kind not in "biufc" or a.dtype.byteorder == ">" or name not in NDARRAY_DTYPES:
            return self._fallback(a, key, why=f"numpy dtype {a.dtype} is not stored")
        data = np.ascontiguousarray(a).view(np.dtype(name))  # e.g. ulonglong as uint64
        return self.add_leaf(key, torch.from_numpy(data), "ndarray", name)

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
            self._enter(key)
            try:
                return {"t": "tuple", "v": [self._encode_key(x, key) for x in k]}
            finally:
                self._depth -= 1
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
        check_loadable(buffer.getvalue(), value, key)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        return self.add_leaf(key, data, "torch_save")


def _config_type(value: Any) -> str | None:
    """``"DictConfig"`` or ``"ListConfig"`` when ``value`` is one (omegaconf is imported then:
    nothing is imported to find out)."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is None or not type(value).__module__.startswith("omegaconf"):
        return None
    return next((n for n in CONFIG_TYPES if isinstance(value, getattr(omegaconf, n))), None)


def _path_type(value: Any) -> str | None:
    """The name of ``value``'s pathlib class, when it is a path of one of them."""
    name = type(value).__name__
    return name if name in PATH_TYPES and getattr(pathlib, name) is type(value) else None


def _class_name(value: Any) -> str | None:
    """The name under which a class of ``CLASSES`` is stored, when ``value`` is one."""
    if value is argparse.Namespace:
        return "argparse.Namespace"
    omegaconf = sys.modules.get("omegaconf")
    for name in CONFIG_TYPES:
        if omegaconf is not None and value is getattr(omegaconf, name):
            return f"omegaconf.{name}"
    return None


def _why_not_stored(value: Any) -> str | None:
    """Why a value of a user-defined type cannot be stored by coci, and what to store."""
    cls = type(value)
    what = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(value, enum.Enum):
        return (
            f"{what}.{value.name} is an enum member: restoring it would import {what}, code "
            "that a checkpoint must not run; store its .value or .name"
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (
            f"an instance of the dataclass {what}: restoring it would import that class, code "
            "that a checkpoint must not run; store dataclasses.asdict(value)"
        )
    return None


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
