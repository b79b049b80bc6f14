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

A list or tuple of at least 64 Python ints (the 625 of ``random.getstate()``) is one ``ints``
node: its values as base64 of fixed-width little-endian ints, a value of the tree (not an array
of the data file: see :mod:`coci_core.engine.format.int_lists`).

Why one module: every kind of value a state may hold is decided in one place (stored, stored
with ``torch.save``, or refused by key before anything is written), together with the cache
that replays a state's tensors; split, the rules for one value would sit in two files.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import enum
import functools
import io
import itertools
import math
import operator
import pathlib
import sys
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from coci_core.engine.format.int_lists import INT_LIST_MIN, encode_ints
from coci_core.engine.format.regions import Region, ShardLayout, dtensor_layout, shard_layout
from coci_core.engine.format.torch_saved import (
    check_loadable,
    check_saved_pickle,
    load_torch_saved,
    load_weights_only,
)
from coci_core.engine.format.tree_nodes import (
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
from coci_core.engine.restore.meshes import mesh_copies, with_copies
from coci_core.engine.restore.tree_read import build_wrapped, check_tree, unflatten_state
from coci_core.errors import UnsupportedValueError

_TensorGuards: Any
try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # a torch without it: tensors are checked part by part
    _TensorGuards = None

# Reading a tree (tree_read), its vocabulary (tree_nodes) and torch.save'd values (torch_saved)
# live in their own modules; their names stay importable from here.
__all__ = [
    "MAX_TREE_DEPTH",
    "WRAPPER_TAGS",
    "ArrayLeaf",
    "FlatState",
    "FlattenCache",
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
    # the array's stored boxes when a part of it is not whole rows (see regions.stored_boxes);
    # ``global_start`` is then this part's first byte in those boxes' bytes
    boxes: tuple[Region, ...] | None = None
    # made anew from another array at each save (a random state's tensor, a numpy array):
    # a snapshot's copy runs keep no view of it (see FlattenCache)
    moves: bool = dataclasses.field(default=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def owned(self) -> bool:
        """A part of a larger tensor (``global_shape``), at byte ``global_start`` of its stored
        bytes: written by the rank that holds it, not split over ranks."""
        return self.global_shape is not None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the whole array (for a shard, of the tensor it is part of)."""
        return self.global_shape if self.global_shape is not None else tuple(self.tensor.shape)


@dataclass(frozen=True)
class FlatState:
    """A state split into its JSON tree and its array leaves (in tree order).

    ``layout``: the same object for every flatten of one :class:`FlattenCache` whose leaves
    have the same tensors' layout (addresses, dtypes, shapes, strides, devices; a leaf marked
    ``moves`` may be at another address each time), None when that is not known (no cache, or
    leaves the cache does not keep).
    """

    tree: Any
    leaves: tuple[ArrayLeaf, ...]
    layout: object | None = None
    #: whether ``tree`` holds an ``ints`` node (a long list of ints)
    ints: bool = False


def _fingerprint(t: torch.Tensor) -> tuple[Any, ...]:
    """Where a tensor's bytes are and how they are viewed: equal fingerprints are the same
    view of the same memory (tied weights). With the tensor's type (a plain tensor or a
    parameter: stored alike), all that its leaf and tree node depend on. The lazy conjugate
    and negative bits count: ``c.conj()`` reads other values from the same bytes."""
    return (t.data_ptr(), t.dtype, t.shape, t.stride(), t.device, t.is_conj(), t.is_neg())


# the parts of ``_fingerprint``, in its order: each read from many tensors by one ``map``
_LAYOUT_PARTS = (
    torch.Tensor.data_ptr,
    operator.attrgetter("dtype"),
    operator.attrgetter("shape"),
    torch.Tensor.stride,
    operator.attrgetter("device"),
    torch.Tensor.is_conj,
    torch.Tensor.is_neg,
)


def _layouts(tensors: list[torch.Tensor]) -> list[list[Any]]:
    """Every tensor's :func:`_fingerprint`, as one list per part of it."""
    return [list(map(part, tensors)) for part in _LAYOUT_PARTS]


def _guard(tensors: list[torch.Tensor]) -> Any:
    """A check that tensors have the Python types, dispatch keys (device type, lazy conjugate
    and negative bits), dtypes, device indexes, ``requires_grad``, shapes and strides of
    ``tensors``, all of them in one C++ call (torch's ``TensorGuards``, what ``torch.compile``
    checks its inputs with); None where this torch has none."""
    if _TensorGuards is None:
        return None
    try:
        return _TensorGuards(*tensors, dynamic_dims_sizes=[], dynamic_dims_strides=[])
    except Exception:  # another signature: the checks part by part
        return None


def _holds(guard: Any, tensors: list[torch.Tensor]) -> bool:
    """Whether :func:`_guard`'s ``guard`` holds for ``tensors`` (False: not known)."""
    if guard is None:
        return False
    try:
        return bool(guard.check(*tensors))
    except Exception:
        return False


# tensor types whose leaves a FlattenCache keeps (subclasses of Parameter are encoded anew)
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_STR = frozenset({str})
_INT = frozenset({int})
_DICT = frozenset({dict})


@functools.lru_cache(maxsize=4096)
def _shard_layout(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Any, ...],
    itemsize: int,
    order: tuple[tuple[int, tuple[int, ...]], ...] | None,
    rotate: int,
    key: str,
) -> ShardLayout:
    """:func:`~coci_core.engine.format.regions.shard_layout`, once per layout: its cost grows
    with the mesh, and a state's layouts repeat every save."""
    return shard_layout(
        shape,
        mesh_shape,
        placements,
        itemsize,
        shard_order=None if order is None else dict(order),
        rotate=rotate,
        key=key,
    )


def _local(t: Any) -> torch.Tensor:
    """A DTensor's local tensor (its attribute: ``to_local()`` goes through autograd)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


def _dtensor_fingerprint(t: Any, local: torch.Tensor) -> tuple[Any, ...]:
    """All that a DTensor's leaf and tree node depend on (see :func:`_fingerprint`)."""
    mesh = t.device_mesh
    order = getattr(t._spec, "shard_order", None)
    return (
        _fingerprint(local),
        t.shape,
        t.placements,
        tuple(mesh.shape),
        tuple(mesh.get_coordinate() or ()),
        mesh_copies(mesh),
        None if order is None else repr(order),
    )


class _Part:
    """Makes a DTensor's leaf from its local tensor: the part this rank writes."""

    __slots__ = ("index",)

    def __init__(self, index: tuple[slice, ...] | None) -> None:
        self.index = index  # None: this rank writes none of it

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        local = local.detach()
        return local[self.index] if self.index is not None else local.reshape(-1)[:0]


_Maker = Any  # makes a leaf's tensor from its source: _detached, or a _Part


class _Miss(Exception):
    """The state's tensors are not laid out as in the cached flatten."""


class FlattenCache:
    """The tensor part of the last flatten of a state: one fingerprint, key and tree node per
    tensor met (in tree order) and the leaves they made. A later flatten of a state whose
    tensors have the same fingerprints under the same keys reuses the nodes and the leaves
    (those of the very same tensor objects whole), and checks no tensor again; every other
    value is encoded anew each time.

    A plain tensor that made a leaf of its own may come back at another address with the same
    layout (a random state, ``torch.get_rng_state()``, is a new tensor at each save), where
    its new fingerprint is none the cache met (so no tie between tensors is made or undone);
    a numpy array (``numpy.random.get_state()``'s) is known by its dtype and shape. Their
    leaves are made anew and marked ``moves``; the layout token stays the same once every
    leaf that moves is marked so (a leaf newly found moving gives a new one).

    Kept only for states whose leaves are all plain strided tensors, DTensors or numpy arrays
    (no ``torch.save``'d values); a DTensor's fingerprint adds its global shape, placements,
    mesh shape and coordinate to its local tensor's. Not thread-safe: one flatten at a time.
    """

    def __init__(self) -> None:
        self.fingerprints: list[tuple[Any, ...]] = []
        self.keys: list[str] = []
        self.nodes: list[dict[str, Any]] = []
        # for each leaf, the index of the first tensor met that makes it
        self.firsts: list[int] = []
        # the leaf each of ``firsts`` made, every fingerprint met, and the tensors met that
        # others tie to (met again under another key: they cannot move alone)
        self.leaf_of: dict[int, int] = {}
        self.known: frozenset[tuple[Any, ...]] = frozenset()
        self.tied: frozenset[int] = frozenset()
        self.leaves: tuple[ArrayLeaf, ...] = ()
        # for each leaf, the tensor it was made from (a DTensor's: its local tensor; a numpy
        # array) and how
        self.sources: list[Any] = []
        self.makers: list[_Maker] = []
        self.layout: object | None = None
        # the tensors met that are not plain tensors (DTensors, numpy arrays); the
        # fingerprints of the plain ones as ``_layouts`` gives them, and their ``_guard``
        self.others: list[int] = []
        self.plain_at: list[int] = []
        self.plain_layouts: list[list[Any]] = []
        self.guard: Any = None
        # dicts of plain tensors only, under str keys, by (first tensor met, key): their
        # keys and the tree's mapping of them (see ``_Flattener.tensor_dicts``)
        self.tensor_dicts: dict[tuple[int, str], tuple[list[str], dict[str, Any]]] = {}
        # dicts of such dicts under int keys (an optimizer's state), likewise: their keys,
        # each inner dict's keys and the tree's items of them
        self.dict_dicts: dict[tuple[int, str], tuple[list[int], list[list[str]], list[Any]]] = {}

    def store(self, flattener: _Flattener) -> object | None:
        """Keep what ``flattener`` met (when it can be reused); the new layout's token."""
        keep = flattener.plain
        self.fingerprints, self.keys, self.nodes = flattener.met if keep else ([], [], [])
        self.firsts = flattener.firsts if keep else []
        self.leaf_of = {m: j for j, m in enumerate(self.firsts)}
        self.known = frozenset(self.fingerprints)
        # by the leaf the others' nodes name, not by equal fingerprints: a replicated DTensor
        # over a plain tensor's memory ties to its leaf with a fingerprint of its own
        shared = {node["id"] for i, node in enumerate(self.nodes) if i not in self.leaf_of}
        self.tied = frozenset(i for i, j in self.leaf_of.items() if j in shared)
        self.makers = flattener.makers if keep else []
        self.others = flattener.others if keep else []
        others = frozenset(self.others)
        self.plain_at = [i for i in range(len(self.fingerprints)) if i not in others]
        self.plain_layouts = [
            [self.fingerprints[i][part] for i in self.plain_at]
            for part in range(len(_LAYOUT_PARTS))
        ]
        self.guard = _guard(flattener.plains) if keep else None
        self.tensor_dicts = flattener.tensor_dicts if keep else {}
        self.dict_dicts = flattener.dict_dicts if keep else {}
        self.keep_leaves(tuple(flattener.leaves) if keep else (), flattener.sources if keep else [])
        self.layout = object() if keep else None
        return self.layout

    def keep_leaves(self, leaves: tuple[ArrayLeaf, ...], sources: list[Any]) -> None:
        self.leaves = leaves
        self.sources = sources


class _Flattener:
    def __init__(self, allow_torch_save: bool, cache: FlattenCache | None = None) -> None:
        self.allow_torch_save = allow_torch_save
        self.leaves: list[ArrayLeaf] = []
        self._aliases: dict[tuple[Any, ...], int] = {}
        self._depth = 0
        # Recording for a FlattenCache: every plain tensor met, and whether all leaves were.
        self.plain = True
        self.ints = False  # an ``ints`` node was made
        self.met: tuple[list[tuple[Any, ...]], list[str], list[dict[str, Any]]] = ([], [], [])
        self.firsts: list[int] = []
        self.sources: list[Any] = []
        self.makers: list[_Maker] = []
        # where DTensors and numpy arrays were met, among the tensors met
        self.others: list[int] = []
        # each dict of plain tensors only, under str keys: (first tensor met, key) ->
        # (its keys, its node's mapping), replayed whole (see ``_replay_tensor_dict``)
        self.tensor_dicts: dict[tuple[int, str], tuple[list[str], dict[str, Any]]] = {}
        self.dict_dicts: dict[tuple[int, str], tuple[list[int], list[list[str]], list[Any]]] = {}
        # the plain tensors met (replaying, their layouts are checked after the walk, all at
        # once: ``check_layouts``)
        self.plains: list[Any] = []
        # Replaying a FlattenCache: the tensors met so far (each must match the cache's; a
        # DTensor's local tensor stands for it), the leaves made anew from arrays that moved
        # and those arrays' fingerprints.
        self._cache = cache
        self.tensors: list[Any] = []
        self.moved: list[int] = []
        self._moved: set[tuple[Any, ...]] = set()

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
        shard: tuple[tuple[int, ...], int, tuple[Region, ...] | None] | None = None,
        moves: bool = False,
    ) -> Any:
        alias = _fingerprint(t) if kind == "tensor" and t.numel() else None
        if alias is not None and alias in self._aliases:
            return {"t": "tensor", "id": self._aliases[alias]}
        index = len(self.leaves)
        global_shape, global_start, boxes = shard if shard is not None else (None, 0, None)
        self.leaves.append(
            ArrayLeaf(
                key=key,
                tensor=t,
                kind=kind,
                numpy_dtype=numpy_dtype,
                global_shape=global_shape,
                global_start=global_start,
                boxes=boxes,
                moves=moves,
            )
        )
        if alias is not None:
            self._aliases[alias] = index
        return {"t": kind, "id": index}

    def encode(self, value: Any, key: str) -> Any:
        if self._cache is not None:
            if type(value) in _PLAIN_TENSORS:
                return self._replay_tensor(value, key)
            if type(value) is np.ndarray:
                return self._replay_ndarray(value, key)
        if value is None or type(value) in (bool, str):
            return value
        if isinstance(value, str) and not isinstance(value, enum.Enum):
            return value  # a str subclass (numpy.str_) as its str; a StrEnum member is refused
        if isinstance(value, int) and type(value) is int:
            return value
        if type(value) is float:
            return value if math.isfinite(value) else {"t": "float", "v": repr(value)}
        if type(value) in (dict, OrderedDict):  # the exact types: before the slower checks
            self._enter(key)
            try:
                return self._encode_dict(value, key)
            finally:
                self._depth -= 1
        if isinstance(value, torch.Tensor):
            try:
                return self._encode_tensor(value, key)
            except UnsupportedValueError:
                raise
            except Exception as e:  # a kind of tensor no check foresaw: still named, unwritten
                raise UnsupportedValueError(
                    f"state value at {key!r} is a {type(value).__name__} that cannot be stored "
                    f"({type(e).__name__}: {str(e)[:200]})"
                ) from e
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
        if type(value) in (list, tuple):
            if len(value) >= INT_LIST_MIN:
                ints = encode_ints(value)  # a long list of ints: compact, in the tree
                if ints is not None:
                    self.ints = True
                    return ints
            self._enter(key)
            try:
                if all(_as_is(v) for v in value):
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
        if type(t).__name__ == "ShardedTensor":  # its attributes raise: refuse it by name
            raise UnsupportedValueError(
                f"state value at {key!r} is a ShardedTensor (FSDP1's sharded state dict when FSDP "
                "has no device mesh): coci stores DTensors; pass device_mesh= to FSDP (e.g. "
                "init_device_mesh('cuda', (world_size,))) so that its state dict holds DTensors"
            )
        why = _no_data(t)
        if why is not None:
            raise UnsupportedValueError(f"state value at {key!r} is {why}")
        if t.is_nested:  # before any size or stride: a nested tensor has none
            return self._fallback(t, key, why="nested tensors are not stored")
        if t.is_sparse or t.layout != torch.strided:
            return self._fallback(t, key, why="sparse and other non-strided layouts are not stored")
        if t.is_quantized or encode_dtype(t.dtype) not in SUPPORTED_DTYPES:
            return self._fallback(t, key, why=f"dtype {t.dtype} is not stored")
        if type(t).__name__ == "DTensor":
            if self._cache is not None:
                return self._replay_dtensor(t, key)
            return self._encode_dtensor(t, key)
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return self._fallback(t, key, why=f"tensor subclass {type(t).__name__} is not stored")
        if _storage_short(t):
            raise UnsupportedValueError(
                f"state value at {key!r} is a tensor whose storage was freed or shrunk in place "
                "(untyped_storage().resize_()): it no longer holds the tensor's bytes"
            )
        leaves = len(self.leaves)
        node = self.add_leaf(key, _detached(t), "tensor")
        if type(t) not in _PLAIN_TENSORS:
            self.plain = False
            return node
        self._record(_fingerprint(t), key, node, leaves, t, _detached)
        return node

    def _record(
        self,
        fingerprint: tuple[Any, ...],
        key: str,
        node: Any,
        leaves: int,
        source: Any,
        maker: _Maker,
    ) -> None:
        """Note a tensor met for a FlattenCache (with the leaf it made, when it made one)."""
        fingerprints, keys, nodes = self.met
        if maker is _detached:
            self.plains.append(source)
        else:  # a DTensor's or a numpy array's
            self.others.append(len(fingerprints))
        fingerprints.append(fingerprint)
        keys.append(key)
        nodes.append(node)
        if len(self.leaves) > leaves:
            self.firsts.append(len(nodes) - 1)
            self.sources.append(source)
            self.makers.append(maker)

    def _replay_tensor(self, t: torch.Tensor, key: str) -> Any:
        """A plain tensor met while replaying the cache: the node of the tensor the cache met at
        this place, under the same key (its layout is checked by :meth:`check_layouts`)."""
        cache = self._cache
        assert cache is not None
        i = len(self.tensors)
        if i >= len(cache.keys) or cache.keys[i] != key:
            raise _Miss
        self.tensors.append(t)
        self.plains.append(t)
        return cache.nodes[i]

    def _replay_tensor_dict(self, d: Mapping[Any, Any], key: str) -> dict[str, Any] | None:
        """The mapping of a dict of plain tensors that the cache met at this place with the
        same keys (its tensors' layouts are checked by :meth:`check_layouts`), or None."""
        cache = self._cache
        assert cache is not None
        known = cache.tensor_dicts.get((len(self.tensors), key))
        if known is None:
            return None
        names, mapping = known
        if len(d) != len(names) or list(d) != names or set(map(type, d)) != _STR:
            return None
        values = list(d.values())
        if not set(map(type, values)) <= _PLAIN_TENSORS:
            return None
        self.tensors.extend(values)
        self.plains.extend(values)
        return mapping

    def _replay_dict_dicts(self, d: Mapping[Any, Any], key: str) -> list[Any] | None:
        """The items of a dict of dicts of plain tensors, under int keys (an optimizer's
        state), that the cache met at this place with the same keys, or None."""
        cache = self._cache
        assert cache is not None
        known = cache.dict_dicts.get((len(self.tensors), key))
        if known is None:
            return None
        names, inner, items = known
        if len(d) != len(names) or list(d) != names or set(map(type, d)) != _INT:
            return None
        dicts = list(d.values())
        if set(map(type, dicts)) != _DICT or list(map(list, dicts)) != inner:
            return None
        if not set(map(type, itertools.chain.from_iterable(dicts))) <= _STR:
            return None
        values = list(itertools.chain.from_iterable(map(dict.values, dicts)))
        if not set(map(type, values)) <= _PLAIN_TENSORS:
            return None
        self.tensors.extend(values)
        self.plains.extend(values)
        return items

    def check_layouts(self) -> None:
        """After a replay's walk over as many tensors as the cache met: :class:`_Miss` unless
        every plain tensor is laid out as the one the cache met at its place, or moved where
        :meth:`_moves` allows it. Checked over all tensors at once (their addresses, then the
        cache's guard; where it does not hold, one ``map`` per part of the fingerprints):
        one fingerprint per tensor was most of a replay."""
        cache = self._cache
        assert cache is not None
        if self.others != cache.others:
            raise _Miss
        plains = self.plains
        ptrs = list(map(torch.Tensor.data_ptr, plains))
        held = _holds(cache.guard, plains)
        if held and ptrs == cache.plain_layouts[0]:
            return
        # where the guard holds, every part but the address is the cache's
        layouts = [ptrs] if held else _layouts(plains)
        differ: set[int] = set()
        for new, old in zip(layouts, cache.plain_layouts, strict=False):
            if new != old:
                differ.update(k for k, (a, b) in enumerate(zip(new, old, strict=True)) if a != b)
        for k in sorted(differ):
            if _storage_short(plains[k]):  # freed in place (address 0): refused by the flatten
                raise _Miss
            i = cache.plain_at[k]
            fingerprint = _fingerprint(plains[k])
            if cache.fingerprints[i] != fingerprint:
                self._moves(i, fingerprint)
        if not held:  # laid out as the cache's (requires_grad or a type changed): guard these
            cache.guard = _guard(plains)

    def _moves(self, i: int, fingerprint: tuple[Any, ...]) -> None:
        """The tensor met ``i``-th is laid out as the cache's but at another address: a leaf
        made anew, when it made a leaf of its own that no other tensor tied to and now ties with
        no other (its new fingerprint is none the cache met, nor another moved one's); else
        :class:`_Miss`."""
        cache = self._cache
        assert cache is not None
        j = cache.leaf_of.get(i)
        if (
            j is None
            or i in cache.tied
            or cache.fingerprints[i][1:] != fingerprint[1:]
            or fingerprint in cache.known
            or fingerprint in self._moved
        ):
            raise _Miss
        self._moved.add(fingerprint)
        self.moved.append(j)

    def _replay_ndarray(self, a: np.ndarray, key: str) -> Any:
        """:meth:`_replay_tensor` for a numpy array: its leaf is made anew each time."""
        cache = self._cache
        assert cache is not None
        i = len(self.tensors)
        if (
            i >= len(cache.keys)
            or cache.keys[i] != key
            or cache.fingerprints[i] != _ndarray_fingerprint(a)
        ):
            raise _Miss
        self.others.append(i)
        self.tensors.append(a)
        self.moved.append(cache.leaf_of[i])
        return cache.nodes[i]

    def _replay_dtensor(self, t: Any, key: str) -> Any:
        """:meth:`_replay_tensor` for a DTensor (its local tensor stands for it)."""
        cache = self._cache
        assert cache is not None
        i = len(self.tensors)
        local = _local(t)
        if (
            i >= len(cache.keys)
            or cache.keys[i] != key
            or cache.fingerprints[i] != _dtensor_fingerprint(t, local)
        ):
            raise _Miss
        self.others.append(i)
        self.tensors.append(local)
        return cache.nodes[i]

    def _encode_dtensor(self, t: Any, key: str) -> Any:
        # Replicated: like any tensor (split over ranks). Sharded: each rank writes its part
        # of the region it holds (replicas split it), as one piece of the whole tensor.
        source = _local(t)
        local = source.detach()
        fingerprint = _dtensor_fingerprint(t, source)
        leaves = len(self.leaves)
        shape, mesh_shape, placements, order = dtensor_layout(t)
        if all(p.is_replicate() for p in placements):
            node = self.add_leaf(key, local, "tensor")
            self._record(fingerprint, key, node, leaves, source, _Part((slice(None),) * local.ndim))
            return node
        mesh_shape, placements, coord, order = with_copies(t.device_mesh, placements, order)
        layout = _shard_layout(
            shape,
            mesh_shape,
            placements,
            local.element_size(),
            None if order is None else tuple((d, tuple(m)) for d, m in sorted(order.items())),
            len(self.leaves),
            f"state value at {key!r}",
        )
        held = layout.held.get(coord)
        if held is None or tuple(local.shape) != held.shape:
            raise UnsupportedValueError(
                f"state value at {key!r}: a DTensor shard of shape {tuple(local.shape)} at mesh "
                f"coordinate {coord}, where its placements {placements} on mesh "
                f"{mesh_shape} give {None if held is None else held.shape}"
            )
        part = layout.parts.get(coord)
        maker = _Part(part.slices(held) if part is not None else None)
        start = layout.starts.get(coord, 0)
        node = self.add_leaf(key, maker(local), "tensor", shard=(shape, start, layout.boxes))
        self._record(fingerprint, key, node, leaves, source, maker)
        return node

    def _encode_ndarray(self, a: np.ndarray, key: str) -> Any:
        name = a.dtype.str
        if a.dtype.kind not in "biufc" or a.dtype.byteorder == ">" or name not in NDARRAY_DTYPES:
            return self._fallback(a, key, why=f"numpy dtype {a.dtype} is not stored")
        maker = _FromNumpy(name)
        leaves = len(self.leaves)
        node = self.add_leaf(key, maker(a), "ndarray", name, moves=True)
        if type(a) is np.ndarray:
            self._record(_ndarray_fingerprint(a), key, node, leaves, a, maker)
        else:  # a subclass (a memmap, a matrix): encoded anew each time
            self.plain = False
        return node

    def _encode_dict(self, d: Mapping[Any, Any], key: str) -> Any:
        node: dict[str, Any] = {"t": "odict" if type(d) is OrderedDict else "dict"}
        mapping = self._replay_tensor_dict(d, key) if self._cache is not None else None
        if mapping is not None:
            node["v"] = mapping
        elif all(type(k) is str for k in d):
            if all(_as_is(v) for v in d.values()):
                node["v"] = dict(d)  # what encode gives each value (module versions: fast)
            else:
                first = len(self.met[0])
                node["v"] = {k: self.encode(v, f"{key}/{k}") for k, v in d.items()}
                if (
                    self._cache is None
                    and d
                    and len(self.met[0]) - first == len(d)
                    and set(map(type, d.values())) <= _PLAIN_TENSORS
                ):
                    self.tensor_dicts[(first, key)] = (list(d), node["v"])
        elif items := self._replay_dict_dicts(d, key) if self._cache is not None else None:
            node["items"] = items
        else:
            first = len(self.met[0])
            node["items"] = [
                [self._encode_key(k, key), self.encode(v, f"{key}/{k}")] for k, v in d.items()
            ]
            if self._cache is None and d and self._only_tensor_dicts(d, first):
                inner = [list(v) for v in d.values()]
                self.dict_dicts[(first, key)] = (list(d), inner, node["items"])
        metadata = getattr(
            d, "_metadata", None
        )  # nn.Module.state_dict() keeps module versions here
        if metadata is not None:
            node["metadata"] = self.encode(metadata, f"{key}/_metadata")
        return node

    def _only_tensor_dicts(self, d: Mapping[Any, Any], first: int) -> bool:
        """Whether ``d``, just encoded from the ``first``-th tensor met on, holds under int keys
        only dicts that hold under str keys only plain tensors, each met once."""
        if set(map(type, d)) != _INT or set(map(type, d.values())) != _DICT:
            return False
        keys = list(itertools.chain.from_iterable(d.values()))
        values = list(itertools.chain.from_iterable(map(dict.values, d.values())))
        return (
            len(self.met[0]) - first == len(values)
            and set(map(type, keys)) <= _STR
            and set(map(type, values)) <= _PLAIN_TENSORS
        )

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
        self.plain = False
        if not self.allow_torch_save:
            reason = why or f"values of type {type(value).__module__}.{type(value).__qualname__}"
            raise UnsupportedValueError(
                f"state value at {key!r} cannot be stored without pickle ({reason}); store "
                "tensors, numpy arrays, numbers, strings, bytes, None, lists, tuples and dicts, "
                "or pass allow_torch_save=True to keep it with torch.save and load it back "
                "with torch.load(weights_only=True)"
            )
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)
        except Exception as e:  # a local class, an opaque tensor, a dtype torch.save lacks
            raise UnsupportedValueError(
                f"state value at {key!r} cannot be stored: torch.save refuses it "
                f"({type(e).__name__}: {str(e)[:200]})"
            ) from e
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


def _as_is(value: Any) -> bool:
    """Whether ``encode`` gives ``value`` back unchanged."""
    return type(value) in AS_IS or (type(value) is float and math.isfinite(value))


def _no_data(t: torch.Tensor) -> str | None:
    """Why ``t`` has no data of its own to store (None: it has): a meta tensor, an
    uninitialized parameter of a lazy module, a tensor inside a ``torch.func`` transform."""
    if torch.nn.parameter.is_lazy(t):
        return (
            "an uninitialized parameter or buffer of a lazy module: it has no data until the "
            "module's first forward pass"
        )
    if t.device.type == "meta":
        return "a meta tensor: it has no data"
    if torch._C._functorch.is_functorch_wrapped_tensor(t) or torch._is_functional_tensor(t):
        return (
            "a tensor inside a torch.func transform (grad, vmap, functionalize, ...): it has "
            "no data of its own; save the state outside the transform"
        )
    return None


def _storage_short(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage no longer holds all of its bytes (freed or shrunk in place, as
    parameter offloading does): a copy of it would read memory that it does not own."""
    if t.numel() == 0:
        return False
    extent = sum((n - 1) * step for n, step in zip(t.shape, t.stride(), strict=True)) + 1
    return bool(t.untyped_storage().nbytes() < (t.storage_offset() + extent) * t.element_size())


def _ndarray_fingerprint(a: np.ndarray) -> tuple[Any, ...]:
    """What a numpy array's leaf and tree node depend on (its leaf is made anew each time)."""
    return ("ndarray", a.dtype.str, a.shape)


class _FromNumpy:
    """Makes a numpy array's leaf: its bytes as a tensor (a copy when it is not contiguous)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, a: np.ndarray) -> torch.Tensor:
        data = np.ascontiguousarray(a).view(np.dtype(self.name))  # e.g. ulonglong as uint64
        return torch.from_numpy(data)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without autograd history (itself when it has none)."""
    return t if type(t) is torch.Tensor and not t.requires_grad else t.detach()


def _with_tensor(leaf: ArrayLeaf, tensor: torch.Tensor, *, moves: bool) -> ArrayLeaf:
    """``dataclasses.replace(leaf, tensor=tensor, moves=moves)``, without its walk over the
    fields and ``__init__`` (a model's ``state_dict()`` gives new tensors at every save: a leaf
    each, on the training thread)."""
    new = object.__new__(ArrayLeaf)
    new.__dict__.update(leaf.__dict__, tensor=tensor, moves=moves)
    return new


def _replay(state: dict[str, Any], cache: FlattenCache, allow_torch_save: bool) -> FlatState:
    """Flatten with ``cache``'s tensor nodes and leaves (:class:`_Miss` when they differ)."""
    flattener = _Flattener(allow_torch_save, cache)
    tree = flattener.encode(state, "")
    met = flattener.tensors
    if len(met) != len(cache.keys) or flattener.leaves:
        raise _Miss  # fewer tensors, or a value that made a leaf of its own
    flattener.check_layouts()
    sources = list(map(met.__getitem__, cache.firsts))
    moved = set(flattener.moved)
    # new tensor objects, same layout; or arrays that moved (a parameter whose .data was
    # replaced is the same object: its leaf, a detached view, is made anew all the same)
    if moved or not all(map(operator.is_, sources, cache.sources)):
        newly = any(not cache.leaves[j].moves for j in moved)
        cache.keep_leaves(
            tuple(
                leaf
                if new is old and j not in moved
                else _with_tensor(leaf, make(new), moves=leaf.moves or j in moved)
                for j, (leaf, new, old, make) in enumerate(
                    zip(cache.leaves, sources, cache.sources, cache.makers, strict=True)
                )
            ),
            sources,
        )
        if newly:  # copy runs planned with a view of its old memory are planned again
            cache.layout = object()
    return FlatState(tree=tree, leaves=cache.leaves, layout=cache.layout, ints=flattener.ints)


def flatten_state(
    state: Mapping[str, Any], *, allow_torch_save: bool = False, cache: FlattenCache | None = None
) -> FlatState:
    """Split ``state`` into a JSON tree and its array leaves.

    Tensors that are the same view of the same memory (tied weights) become one leaf.
    ``cache``: the last flatten of a state like this one (see :class:`FlattenCache`), updated.

    Raises:
        UnsupportedValueError: a value cannot be stored without pickle and
            ``allow_torch_save`` is off.
    """
    if not isinstance(state, Mapping):
        raise UnsupportedValueError(f"state must be a mapping, got {type(state).__name__}")
    if cache is not None and cache.layout is not None:
        try:
            return _replay(dict(state), cache, allow_torch_save)
        except Exception:  # a miss, or an error that the full flatten raises again
            pass
    flattener = _Flattener(allow_torch_save)
    tree = flattener.encode(dict(state), "")
    layout = cache.store(flattener) if cache is not None else None
    return FlatState(tree=tree, leaves=tuple(flattener.leaves), layout=layout, ints=flattener.ints)
