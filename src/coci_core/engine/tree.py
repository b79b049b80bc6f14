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
import binascii
import dataclasses
import enum
import importlib
import io
import logging
import math
import os
import pathlib
import pickle
import re
import sys
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from coci_core.engine.pickle_tree import pickle_tree
from coci_core.errors import CorruptCheckpointError, UnsafeCheckpointError, UnsupportedValueError

__all__ = [
    "MAX_TREE_DEPTH",
    "WRAPPER_TAGS",
    "ArrayLeaf",
    "FlatState",
    "check_tree",
    "decode_dtype",
    "flatten_state",
    "build_wrapped",
    "ndarray_dtype",
    "unflatten_state",
]

LeafKind = Literal["tensor", "ndarray", "torch_save"]

logger = logging.getLogger(__name__)

# Types stored by name (see the module's docstring); nothing else is ever built from a name.
_CONFIG_TYPES = ("DictConfig", "ListConfig")  # omegaconf's containers
_CONFIG_FLAGS = ("struct", "readonly")  # the root flags stored
_PATH_TYPES = ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")
_CLASSES = ("omegaconf.DictConfig", "omegaconf.ListConfig", "argparse.Namespace")

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


# How deeply containers (dicts, lists, tuples, tuple keys) may nest in a state: deeper states are
# refused when saved, and deeper trees when read. It keeps every recursive walk of a tree (and
# the JSON parser's, about three levels per container) far from Python's recursion limit.
MAX_TREE_DEPTH = 128

# numpy dtypes of stored arrays (``ndarray`` leaves): little-endian or byte-sized numbers that
# torch.from_numpy takes, by their ``dtype.str``, with the torch dtype of their bytes. Object,
# void, structured, string and big-endian dtypes are never constructed from a manifest.
_NDARRAY_DTYPES: dict[str, str] = {}
for _char in "?bBhHiIlLqQefdFD":
    _np = np.dtype(_char)
    if _np.byteorder != ">":
        try:
            _t = torch.from_numpy(np.empty(1, _np.str)).dtype
        except TypeError:  # pragma: no cover - depends on the torch build
            continue
        _NDARRAY_DTYPES[_np.str] = str(_t).removeprefix("torch.")
# numpy scalar dtypes of ``{"t": "np"}`` nodes: booleans, integers and floats.
_NP_SCALAR_DTYPES = frozenset(
    np.dtype(c).str for c in "?bBhHiIlLqQefdg" if np.dtype(c).byteorder != ">"
)
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
#: values that ``encode`` returns unchanged (with finite floats)
_AS_IS = frozenset({type(None), bool, int, str})


def ndarray_dtype(name: Any, torch_dtype: str) -> np.dtype[Any]:
    """The numpy dtype of a stored ndarray, checked against the torch dtype of its bytes.

    Raises:
        CorruptCheckpointError: the name is not an allowed numpy dtype, or does not match.
    """
    if type(name) is not str or _NDARRAY_DTYPES.get(name) != torch_dtype:
        raise CorruptCheckpointError(
            f"numpy dtype {str(name)[:40]!r} is not allowed for an array of {torch_dtype}"
        )
    return np.dtype(name)


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
                if all(type(v) in _AS_IS or (type(v) is float and math.isfinite(v)) for v in value):
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
        name = a.dtype.str
        if a.dtype.kind not in "biufc" or a.dtype.byteorder == ">" or name not in _NDARRAY_DTYPES:
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
        _check_loadable(buffer.getvalue(), value, key)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        return self.add_leaf(key, data, "torch_save")


def _config_type(value: Any) -> str | None:
    """``"DictConfig"`` or ``"ListConfig"`` when ``value`` is one (omegaconf is imported then:
    nothing is imported to find out)."""
    omegaconf = sys.modules.get("omegaconf")
    if omegaconf is None or not type(value).__module__.startswith("omegaconf"):
        return None
    return next((n for n in _CONFIG_TYPES if isinstance(value, getattr(omegaconf, n))), None)


def _path_type(value: Any) -> str | None:
    """The name of ``value``'s pathlib class, when it is a path of one of them."""
    name = type(value).__name__
    return name if name in _PATH_TYPES and getattr(pathlib, name) is type(value) else None


def _class_name(value: Any) -> str | None:
    """The name under which a class of ``_CLASSES`` is stored, when ``value`` is one."""
    if value is argparse.Namespace:
        return "argparse.Namespace"
    omegaconf = sys.modules.get("omegaconf")
    for name in _CONFIG_TYPES:
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


def _import_omegaconf() -> Any:
    """omegaconf, when it is installed (imported by this fixed name only), else None."""
    try:
        return importlib.import_module("omegaconf")
    except ImportError:
        return None


_warned_no_omegaconf = False


def _without_omegaconf(what: str) -> None:
    global _warned_no_omegaconf
    if not _warned_no_omegaconf:
        _warned_no_omegaconf = True
        logger.warning(
            "coci: the checkpoint holds %s, and omegaconf is not installed: it comes back as "
            "plain dicts and lists (pip install omegaconf to get the DictConfig back)",
            what,
        )


def _make_config(kind: str, content: Any, flags: Mapping[str, bool]) -> Any:
    """A ``DictConfig``/``ListConfig`` built back from its stored content and flags (the plain
    content when omegaconf is not installed)."""
    if type(content) is not (dict if kind == "DictConfig" else list):
        raise CorruptCheckpointError(f"a stored {kind} holds a {type(content).__name__}")
    omegaconf = _import_omegaconf()
    if omegaconf is None:
        _without_omegaconf(f"an OmegaConf {kind}")
        return content
    try:
        conf = omegaconf.OmegaConf
        config = conf.create(content)
        if "struct" in flags:  # before readonly, which would refuse it
            conf.set_struct(config, flags["struct"])
        if "readonly" in flags:
            conf.set_readonly(config, flags["readonly"])
    except Exception as e:  # omegaconf's own errors (a bad key or interpolation)
        raise CorruptCheckpointError(f"a stored {kind} does not build: {e}") from e
    return config


def _make_namespace(content: Any) -> argparse.Namespace:
    if type(content) is not dict or not all(type(k) is str for k in content):
        raise CorruptCheckpointError("a stored argparse.Namespace holds no str-keyed dict")
    return argparse.Namespace(**content)


def _make_path(name: str, text: str) -> pathlib.PurePath:
    cls: type[pathlib.PurePath] = getattr(pathlib, name)  # one of _PATH_TYPES (checked)
    try:
        return cls(text)
    except NotImplementedError:  # a concrete path of another OS: its pure form
        pure = pathlib.PureWindowsPath if name == "WindowsPath" else pathlib.PurePosixPath
        return pure(text)


def _make_class(name: str) -> Any:
    if name == "argparse.Namespace":
        return argparse.Namespace
    omegaconf = _import_omegaconf()
    short = name.removeprefix("omegaconf.")
    if omegaconf is None:  # Lightning reads a str type as "its own AttributeDict"
        _without_omegaconf(f"the class {name}")
        return short
    return getattr(omegaconf, short)


def _check_loadable(data: bytes, value: Any, key: str) -> None:
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
    """Rebuild a state from its JSON tree; ``leaves[i]`` is the restored value of leaf ``i``.

    Raises:
        CorruptCheckpointError: the tree is malformed (checked first, without recursion).
    """
    check_tree(tree, n_leaves=len(leaves))
    return _decode(tree, leaves)


_LEAF_TAGS = ("tensor", "ndarray", "torch_save")
_CONTAINER_TAGS = ("list", "tuple", "dict", "odict")
#: nodes that wrap a container node ("v") and build a value of another type from it
WRAPPER_TAGS = ("config", "namespace")
# a wrapper's content: the container node it must be (by the wrapper's "type")
_WRAPPED = {"DictConfig": "dict", "ListConfig": "list", "namespace": "dict"}
_NODE_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # tag: (required fields, optional fields), besides "t"
    **{tag: (frozenset({"id"}), frozenset()) for tag in _LEAF_TAGS},
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
    "class": (frozenset({"v"}), frozenset()),
}
_MAX_INT64 = 2**63 - 1


def _is_scalar(node: Any) -> bool:
    return node is None or type(node) in (bool, int, float, str)


def check_tree(
    tree: Any,
    *,
    n_leaves: int,
    kinds: Any = None,
    keys: Any = None,
    what: str = "tree",
) -> None:
    """Check a state tree from a manifest without recursion, before anything is built from it.

    Every node must be of a known type with exactly its fields, of the right JSON types;
    containers may nest at most :data:`MAX_TREE_DEPTH` deep; every array node must name one of
    the ``n_leaves`` arrays. With ``kinds`` (the arrays' kinds) an array node must have its
    array's kind (a repeated node, a tied tensor, is ``"tensor"``). With ``keys`` (the arrays'
    keys, as a manifest records them) the arrays must appear in the order the state was
    flattened, each first at the path its key names, and every array must appear.

    Raises:
        CorruptCheckpointError: naming the path of the first bad node.
    """
    next_id = 0
    # (node, its path, the depth of the container holding it)
    stack: list[tuple[Any, str, int]] = [(tree, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        where = f"{what} at {path[:200] or '/'!r}"
        if _is_scalar(node):
            if type(node) is float and not math.isfinite(node):
                raise CorruptCheckpointError(f"{where}: a non-finite number")
            continue
        if type(node) is not dict or type(node.get("t")) is not str:
            raise CorruptCheckpointError(f"{where}: not a tree node ({type(node).__name__})")
        tag = node["t"]
        fields = _NODE_FIELDS.get(tag)
        if fields is None:
            raise CorruptCheckpointError(f"{where}: unknown state tree node type {tag[:40]!r}")
        required, optional = fields
        present = set(node) - {"t"}
        if not required <= present or not present <= required | optional:
            raise CorruptCheckpointError(
                f"{where}: a {tag!r} node has fields {sorted(present)[:8]}, "
                f"expected {sorted(required)} (and optionally {sorted(optional)})"
            )
        value = node.get("v")
        if tag in _LEAF_TAGS:
            i = node["id"]
            if type(i) is not int or not 0 <= i < n_leaves:
                raise CorruptCheckpointError(
                    f"{where}: array id {str(i)[:40]} is not one of the {n_leaves} arrays"
                )
            if kinds is not None and kinds[i] != tag:
                raise CorruptCheckpointError(f"{where}: array {i} is a {kinds[i]}, not a {tag}")
            if keys is not None:
                if i == next_id:
                    if keys[i] != path:
                        raise CorruptCheckpointError(
                            f"{where}: array {i} is stored as {str(keys[i])[:200]!r}"
                        )
                    next_id += 1
                elif i > next_id or tag != "tensor":
                    raise CorruptCheckpointError(
                        f"{where}: array {i} out of order (array {next_id} comes next)"
                    )
        elif tag == "float":
            if type(value) is not str or value not in _NONFINITE:
                raise CorruptCheckpointError(f"{where}: a float node holds {str(value)[:40]!r}")
        elif tag == "np":
            inner = node["v"]
            dtype = node["dtype"]
            if (
                type(dtype) is not str
                or dtype not in _NP_SCALAR_DTYPES
                or not (
                    type(inner) in (bool, int, float)
                    or (type(inner) is dict and inner.get("t") == "float")
                )
            ):
                raise CorruptCheckpointError(f"{where}: a numpy scalar node is malformed")
            stack.append((inner, path, depth))
        elif tag == "dtype":
            if type(value) is not str or value not in _SUPPORTED_DTYPES:
                raise CorruptCheckpointError(f"{where}: unknown dtype {str(value)[:40]!r}")
        elif tag == "size":
            if type(value) is not list or not all(
                type(x) is int and 0 <= x <= _MAX_INT64 for x in value
            ):
                raise CorruptCheckpointError(f"{where}: a torch.Size node is malformed")
        elif tag == "bytes":
            if type(value) is not str:
                raise CorruptCheckpointError(f"{where}: a bytes node holds no string")
        elif tag == "path":
            if node["type"] not in _PATH_TYPES or type(value) is not str:
                raise CorruptCheckpointError(f"{where}: a path node is malformed")
        elif tag == "class":
            if value not in _CLASSES:
                raise CorruptCheckpointError(f"{where}: class {str(value)[:80]!r} is not stored")
        elif tag in WRAPPER_TAGS:
            _check_wrapper(node, where)
            if depth + 1 > MAX_TREE_DEPTH:
                raise CorruptCheckpointError(f"{where}: nested more than {MAX_TREE_DEPTH} deep")
            stack.append((value, path, depth + 1))
        else:  # containers
            if depth + 1 > MAX_TREE_DEPTH:
                raise CorruptCheckpointError(f"{where}: nested more than {MAX_TREE_DEPTH} deep")
            children: list[tuple[Any, str, int]] = []
            if tag in ("list", "tuple"):
                if type(value) is not list:
                    raise CorruptCheckpointError(f"{where}: a {tag} node holds no list")
                children = [(v, f"{path}/{i}", depth + 1) for i, v in enumerate(value)]
            elif ("v" in node) == ("items" in node):
                raise CorruptCheckpointError(f"{where}: a dict node needs 'v' or 'items'")
            elif "v" in node:
                if type(value) is not dict:
                    raise CorruptCheckpointError(f"{where}: a dict node's 'v' is no object")
                children = [(v, f"{path}/{k}", depth + 1) for k, v in value.items()]
            else:
                items = node["items"]
                if type(items) is not list or not all(
                    type(kv) is list and len(kv) == 2 for kv in items
                ):
                    raise CorruptCheckpointError(f"{where}: a dict node's 'items' are malformed")
                for k, v in items:
                    _check_key(k, where, depth + 1)
                    children.append((v, f"{path}/{_decode_key(k)}", depth + 1))
            if "metadata" in node:
                children.append((node["metadata"], f"{path}/_metadata", depth + 1))
            stack.extend(reversed(children))
    if keys is not None and next_id != n_leaves:
        raise CorruptCheckpointError(
            f"{what}: holds {next_id} of its {n_leaves} arrays (array {next_id} is not in it)"
        )


def build_wrapped(node: Mapping[str, Any], content: Any) -> Any:
    """The value of a checked ``config`` or ``namespace`` node (see :data:`WRAPPER_TAGS`),
    from its content, already built.

    Raises:
        CorruptCheckpointError: the content does not build one.
    """
    if node["t"] == "config":
        return _make_config(node["type"], content, node.get("flags", {}))
    return _make_namespace(content)


def _check_wrapper(node: dict[str, Any], where: str) -> None:
    """A config or namespace node: a known type, known flags, and a container of its kind."""
    kind = node["type"] if node["t"] == "config" else "namespace"
    if node["t"] == "config" and kind not in _CONFIG_TYPES:
        raise CorruptCheckpointError(f"{where}: config type {str(kind)[:40]!r} is not stored")
    flags = node.get("flags", {})
    if type(flags) is not dict or not all(
        f in _CONFIG_FLAGS and type(v) is bool for f, v in flags.items()
    ):
        raise CorruptCheckpointError(f"{where}: a config node's flags are malformed")
    content = node["v"]
    if type(content) is not dict or content.get("t") != _WRAPPED[kind]:
        raise CorruptCheckpointError(f"{where}: a {kind} node holds no {_WRAPPED[kind]} node")


def _check_key(k: Any, where: str, depth: int) -> None:
    """A dict key of the "items" form: a scalar, or a tuple of keys (nesting counts as depth)."""
    stack = [(k, depth)]
    while stack:
        item, d = stack.pop()
        if _is_scalar(item):
            if type(item) is float and not math.isfinite(item):
                raise CorruptCheckpointError(f"{where}: a non-finite dict key")
            continue
        if type(item) is not dict or item.get("t") != "tuple" or set(item) != {"t", "v"}:
            raise CorruptCheckpointError(f"{where}: a dict key must be a scalar or a tuple")
        if type(item["v"]) is not list:
            raise CorruptCheckpointError(f"{where}: a tuple key holds no list")
        if d + 1 > MAX_TREE_DEPTH:
            raise CorruptCheckpointError(f"{where}: nested more than {MAX_TREE_DEPTH} deep")
        stack.extend((x, d + 1) for x in item["v"])


def _decode(node: Any, leaves: list[Any]) -> Any:
    # The tree was checked by check_tree: only values still need checking here.
    if _is_scalar(node):
        return node
    tag = node["t"]
    try:
        if tag in _LEAF_TAGS:
            return leaves[node["id"]]
        if tag == "float":
            return _NONFINITE[node["v"]]
        if tag == "np":
            return np.dtype(node["dtype"]).type(_decode(node["v"], leaves))
        if tag == "dtype":
            return decode_dtype(node["v"])
        if tag == "size":
            return torch.Size(node["v"])
        if tag == "bytes":
            return base64.b64decode(node["v"], validate=True)
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
        if tag in WRAPPER_TAGS:
            return build_wrapped(node, _decode(node["v"], leaves))
        if tag == "path":
            return _make_path(node["type"], node["v"])
        if tag == "class":
            return _make_class(node["v"])
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, binascii.Error) as e:
        raise CorruptCheckpointError(f"malformed state tree node {tag!r}: {e}") from e
    raise CorruptCheckpointError(f"unknown state tree node type {str(tag)[:40]!r}")


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
        check_saved_pickle(data, what=what)
        return load_weights_only(data, what=what)
    except CorruptCheckpointError as e:
        e.bad = [key] if key is not None else []
        raise


#: The most levels a stored ``torch.save`` value's pickle may nest, and the most objects (each
#: shared reference counted again) per byte of it: a value coci saves nests at most
#: MAX_TREE_DEPTH containers, a few pickle levels each, while torch.load's unpickler crashes
#: CPython hashing a tuple key ~100,000 deep; larger, a few bytes describe millions of objects.
MAX_SAVED_PICKLE_DEPTH = 1024
SAVED_PICKLE_UNITS_PER_BYTE = 16
_SAVED_PICKLE_FLOOR = 1 << 16


def check_saved_pickle(source: bytes | os.PathLike[str], *, what: str) -> None:
    """Measure the pickle of a ``torch.save`` zip (its ``data.pkl``, the record torch.load
    unpickles) before torch.load runs it, with :func:`~coci_core.engine.pickle_tree.pickle_tree`
    (nothing is built or called); bytes that are no such zip are left to torch.load.

    Raises:
        CorruptCheckpointError: the pickle nests deeper than :data:`MAX_SAVED_PICKLE_DEPTH`
            or describes more than :data:`SAVED_PICKLE_UNITS_PER_BYTE` objects per byte (plus
            a floor), shared references counted again.
    """
    try:
        reader = torch._C.PyTorchFileReader(
            io.BytesIO(source) if isinstance(source, bytes) else os.fspath(source)
        )
        record = reader.get_record("data.pkl")
    except (RuntimeError, OSError, ValueError):
        return
    cap = SAVED_PICKLE_UNITS_PER_BYTE * len(record) + _SAVED_PICKLE_FLOOR
    try:
        tree = pickle_tree(record, cap=cap)
    except ValueError as e:
        raise CorruptCheckpointError(f"{what} cannot be read: {_reason(e)}") from e
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
            f"{len(record)}-byte pickle, plus {_SAVED_PICKLE_FLOOR}, are read)"
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
