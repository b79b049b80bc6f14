"""Boxes of a global array: which part each mesh coordinate of a DTensor holds, who writes
which bytes, and what to read to fill a region from pieces cut by another mesh.

Pure functions of shapes and placements: no I/O and no collectives, so every rank computes the
same answers for every coordinate. Placements are read by duck typing (``is_shard``,
``is_replicate``, ``is_partial``, ``split_factor``), so this module does not import
``torch.distributed``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from coci_core.errors import CorruptCheckpointError, UnsupportedValueError

__all__ = [
    "Coordinate",
    "ReadStep",
    "Region",
    "ShardLayout",
    "box_bases",
    "byte_runs",
    "check_tiling",
    "clip_runs",
    "dtensor_layout",
    "dtensor_regions",
    "plan_read",
    "shard_layout",
    "stored_boxes",
    "writers",
]

Coordinate = tuple[int, ...]
"""A position in a device mesh, one index per mesh dimension."""

P = TypeVar("P")


@dataclass(frozen=True)
class Region:
    """The box ``[offsets, offsets + shape)`` of a global array (``()``, ``()`` for a 0-d one)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise ValueError(f"offsets {self.offsets} and shape {self.shape} differ in rank")
        if any(o < 0 for o in self.offsets) or any(n < 0 for n in self.shape):
            raise ValueError(f"negative offsets or shape: {self.offsets}, {self.shape}")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Region:
        """The whole array of ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @property
    def volume(self) -> int:
        """The number of elements in the box."""
        return math.prod(self.shape)

    @property
    def ends(self) -> tuple[int, ...]:
        """One past the last index along each dimension."""
        return tuple(o + n for o, n in zip(self.offsets, self.shape, strict=True))

    def intersect(self, other: Region) -> Region | None:
        """The common box of two regions of the same array, or None if they share no element."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        ends = tuple(min(a, b) for a, b in zip(self.ends, other.ends, strict=True))
        if any(e <= s for s, e in zip(starts, ends, strict=True)):
            return None
        return Region(starts, tuple(e - s for s, e in zip(starts, ends, strict=True)))

    def contains(self, other: Region) -> bool:
        """Whether ``other`` lies inside this box."""
        return all(a <= b for a, b in zip(self.offsets, other.offsets, strict=True)) and all(
            a >= b for a, b in zip(self.ends, other.ends, strict=True)
        )

    def slices(self, within: Region | None = None) -> tuple[slice, ...]:
        """Index of this box in the global array, or in the local array of box ``within``."""
        base = within.offsets if within is not None else (0,) * len(self.offsets)
        return tuple(
            slice(o - b, o - b + n) for o, b, n in zip(self.offsets, base, self.shape, strict=True)
        )


def byte_runs(sub: Region, within: Region, itemsize: int = 1) -> list[tuple[int, int]]:
    """The ``(offset, length)`` byte runs of box ``sub`` in the row-major layout of box
    ``within``, in ``sub``'s own row-major order, adjacent runs merged.

    Raises:
        ValueError: ``sub`` is not inside ``within``.
    """
    if not within.contains(sub):
        raise ValueError(f"{sub} is not inside {within}")
    if sub.volume == 0:
        return []
    ndim = len(sub.shape)
    if ndim == 0:
        return [(0, itemsize)]
    strides = [math.prod(within.shape[d + 1 :]) for d in range(ndim)]
    rel = [s - w for s, w in zip(sub.offsets, within.offsets, strict=True)]
    inner = ndim - 1  # the outermost dimension of the contiguous run
    while inner > 0 and sub.shape[inner] == within.shape[inner]:
        inner -= 1
    length = sub.shape[inner] * strides[inner]
    base = rel[inner] * strides[inner]
    runs: list[tuple[int, int]] = []
    for index in itertools.product(*(range(n) for n in sub.shape[:inner])):
        start = base + sum((rel[d] + i) * strides[d] for d, i in enumerate(index))
        if runs and runs[-1][0] + runs[-1][1] == start * itemsize:
            runs[-1] = (runs[-1][0], runs[-1][1] + length * itemsize)
        else:
            runs.append((start * itemsize, length * itemsize))
    return runs


def clip_runs(runs: Sequence[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int, int]]:
    """The parts of byte ``runs`` that fall in ``[start, stop)`` (a stored piece holding those
    bytes of its box), as ``(offset in the piece, length, offset in the joined runs)``."""
    out: list[tuple[int, int, int]] = []
    joined = 0
    for offset, length in runs:
        lo, hi = max(offset, start), min(offset + length, stop)
        if lo < hi:
            out.append((lo - start, hi - lo, joined + lo - offset))
        joined += length
    return out


def _tiling_problem(bounds: Region, regions: Iterable[Region]) -> str | None:
    """Why the distinct non-empty ``regions`` do not tile ``bounds`` exactly, or None."""
    boxes = list({r for r in regions if r.volume})
    for box in boxes:
        if len(box.shape) != len(bounds.shape) or not bounds.contains(box):
            return f"{box} is outside {bounds}"
    if bounds.shape:  # sweep along the dim that separates the most boxes
        sweep = max(range(len(bounds.shape)), key=lambda d: len({b.offsets[d] for b in boxes}))
        boxes.sort(key=lambda r: r.offsets[sweep])
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                if b.offsets[sweep] >= a.ends[sweep]:  # no later box meets a
                    break
                common = a.intersect(b)
                if common is not None:
                    return f"{a} and {b} overlap in {common}"
    covered = sum(b.volume for b in boxes)
    if covered != bounds.volume:
        return f"the regions cover {covered} of the {bounds.volume} elements of {bounds}"
    return None


def check_tiling(global_shape: Sequence[int], regions: Iterable[Region]) -> None:
    """Check that the distinct non-empty ``regions`` tile an array of ``global_shape`` exactly:
    every element in one and only one of them.

    Raises:
        UnsupportedValueError: a region overlaps another, lies outside, or an element is in none.
    """
    problem = _tiling_problem(Region.whole(global_shape), regions)
    if problem is not None:
        raise UnsupportedValueError(f"regions do not tile shape {tuple(global_shape)}: {problem}")


def _describe(placements: Sequence[Any]) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def _dim_of(placement: Any, ndim: int, key: str) -> int:
    dim = int(placement.dim)
    if not -ndim <= dim < ndim:
        raise UnsupportedValueError(
            f"{key}: placement {placement!r} shards dim {dim} of a {ndim}-d tensor"
        )
    return dim % ndim


def _strided_order(
    sharded: Mapping[int, int], placements: Sequence[Any], mesh_shape: Sequence[int]
) -> dict[int, list[int]] | None:
    """The order in which mesh dims split each tensor dim that ``_StridedShard`` placements
    encode (``sharded``: mesh dim -> tensor dim), as torch reads them
    (``DTensorSpec._maybe_convert_StridedShard_to_shard_order``): right to left, each placement
    goes where the mesh dims before it multiply to its split factor. None if one fits nowhere."""
    order: dict[int, list[int]] = {}
    for mesh_dim in sorted(sharded, reverse=True):
        dims = order.setdefault(sharded[mesh_dim], [])
        factor = int(getattr(placements[mesh_dim], "split_factor", None) or 1)
        product = 1
        for i in range(len(dims) + 1):
            if product == factor:
                dims.insert(i, mesh_dim)
                break
            if i < len(dims):
                product *= mesh_shape[dims[i]]
        else:
            return None
    return order


def dtensor_regions(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Any],
    *,
    shard_order: Mapping[int, Sequence[int]] | None = None,
    key: str = "tensor",
) -> dict[Coordinate, Region]:
    """The region of the global array that each mesh coordinate holds, as DTensor reads its
    layout: each tensor dim is split by ``torch.chunk`` (uneven, trailing shards possibly empty)
    over the mesh dims of its ``Shard`` placements, in mesh order, in the order ``shard_order``
    gives (tensor dim -> mesh dims, as ``DTensorSpec.shard_order``), or in the order that
    ``_StridedShard`` split factors encode (FSDP2 over tensor parallelism: the tensor-parallel
    split first); ``Replicate()`` holds the whole.

    Raises:
        UnsupportedValueError: a ``Partial`` or unknown placement, or ``_StridedShard`` split
            factors that no order produces (interleaved rows).
    """
    ndim = len(global_shape)
    if len(placements) != len(mesh_shape):
        raise UnsupportedValueError(
            f"{key}: {len(placements)} placements for a {len(mesh_shape)}-d mesh"
        )
    sharded: dict[int, int] = {}  # mesh dim -> the tensor dim it splits
    for mesh_dim, p in enumerate(placements):
        if p.is_partial():
            raise UnsupportedValueError(
                f"{key}: placement {p!r} on mesh dim {mesh_dim} holds partial values; "
                "redistribute it to Replicate() before saving"
            )
        if p.is_replicate():
            continue
        if getattr(p, "split_factor", None) is None and not p.is_shard():
            raise UnsupportedValueError(f"{key}: unsupported placement {p!r}")
        sharded[mesh_dim] = _dim_of(p, ndim, key)
    steps: dict[int, list[int]] = {}  # tensor dim -> the mesh dims that split it, in order
    for mesh_dim, dim in sharded.items():
        steps.setdefault(dim, []).append(mesh_dim)
    strided = any(getattr(p, "split_factor", None) is not None for p in placements)
    if strided:
        if shard_order is not None:
            raise UnsupportedValueError(
                f"{key}: both _StridedShard placements and a shard order: {_describe(placements)}"
            )
        order = _strided_order(sharded, placements, mesh_shape)
        if order is None:
            raise UnsupportedValueError(
                f"{key}: placements {_describe(placements)} on mesh {tuple(mesh_shape)} "
                "interleave the shards (no sharding order gives these split factors); "
                "redistribute it (e.g. to Shard or Replicate placements) before saving"
            )
        steps = order
    elif shard_order is not None:
        given = {d % ndim if ndim else d: list(m) for d, m in shard_order.items() if m}
        if {d: sorted(m) for d, m in given.items()} != steps:
            raise UnsupportedValueError(
                f"{key}: shard order {dict(shard_order)} does not match {_describe(placements)}"
            )
        steps = given

    out: dict[Coordinate, Region] = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        offsets, shape = [], []
        for dim in range(ndim):
            indices = range(global_shape[dim])
            for mesh_dim in steps.get(dim, ()):
                size = -(-len(indices) // mesh_shape[mesh_dim])
                indices = indices[coord[mesh_dim] * size : (coord[mesh_dim] + 1) * size]
            offsets.append(indices.start if indices else global_shape[dim])
            shape.append(len(indices))
        out[coord] = Region(tuple(offsets), tuple(shape))
    return out


def dtensor_layout(
    dtensor: Any,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...], dict[int, list[int]] | None]:
    """``(global_shape, mesh_shape, placements, shard_order)`` of a DTensor, the arguments of
    :func:`dtensor_regions` (``shard_order`` None when the placements alone say it)."""
    spec = dtensor._spec
    order: dict[int, list[int]] | None = None
    if not getattr(spec, "use_strided_shard_as_shard_order", True):
        entries = getattr(spec, "shard_order", None) or ()
        order = {int(e.tensor_dim): [int(m) for m in e.mesh_dims] for e in entries}
    return (
        tuple(dtensor.shape),
        tuple(dtensor.device_mesh.shape),
        tuple(dtensor.placements),
        order,
    )


def writers(regions: Mapping[Coordinate, Region], *, rotate: int = 0) -> dict[Coordinate, Region]:
    """Which part of its region each coordinate writes, so that every element is written once;
    a coordinate that writes nothing is left out.

    The coordinates holding the same region (its replicas) split it in their sorted order into
    slices along its first dim with at least as many indices as replicas (dim 0 when none has),
    sizes differing by at most one; ``rotate`` (say a tensor's index) shifts which replicas get
    the larger slices, so that small tensors do not all land on one rank. A 0-d region is
    written by replica ``rotate % replicas``.
    """
    holders: dict[Region, list[Coordinate]] = {}
    for coord in sorted(regions):
        holders.setdefault(regions[coord], []).append(coord)
    out: dict[Coordinate, Region] = {}
    for region, coords in holders.items():
        n = len(coords)
        if region.volume == 0:
            continue
        if not region.shape:
            out[coords[rotate % n]] = region
            continue
        dim = next((d for d, size in enumerate(region.shape) if size >= n), 0)
        base, extra = divmod(region.shape[dim], n)
        start = region.offsets[dim]
        for j, coord in enumerate(coords):
            size = base + (1 if (j - rotate) % n < extra else 0)
            if size:
                offsets = (*region.offsets[:dim], start, *region.offsets[dim + 1 :])
                out[coord] = Region(offsets, (*region.shape[:dim], size, *region.shape[dim + 1 :]))
            start += size
    return out


@dataclass(frozen=True)
class ReadStep(Generic[P]):
    """Read ``runs`` (byte offset, length) of stored ``piece``; joined, they are the row-major
    bytes of box ``source``, which goes to ``destination`` of the target's local array."""

    piece: P
    source: Region
    runs: list[tuple[int, int]]
    destination: tuple[slice, ...]


def plan_read(
    target: Region, stored: Sequence[tuple[Region, P]], itemsize: int
) -> list[ReadStep[P]]:
    """What to read from ``stored`` pieces (each the row-major bytes of its region) to fill the
    local array of region ``target``, in the order given.

    Raises:
        CorruptCheckpointError: the pieces overlap inside ``target`` or leave part of it unfilled.
    """
    steps: list[ReadStep[P]] = []
    for region, piece in stored:
        common = region.intersect(target)
        if common is None:
            continue
        steps.append(
            ReadStep(piece, common, byte_runs(common, region, itemsize), common.slices(target))
        )
    if target.volume:
        problem = _tiling_problem(target, (s.source for s in steps))
        if problem is None and len({s.source for s in steps}) != len(steps):
            problem = "two pieces hold the same region"
        if problem is not None:
            raise CorruptCheckpointError(f"the stored pieces do not fill {target}: {problem}")
    return steps


def stored_boxes(global_shape: Sequence[int], parts: Iterable[Region]) -> tuple[Region, ...] | None:
    """The non-empty ``parts`` of an array in the order they are stored (by their offsets),
    each as its own row-major bytes one after another; None when they are whole rows, whose
    bytes so stored are the array's own row-major bytes."""
    boxes = sorted({p for p in parts if p.volume}, key=lambda r: r.offsets)
    if all(tuple(b.shape[1:]) == tuple(global_shape[1:]) for b in boxes):
        return None
    return tuple(boxes)


def box_bases(boxes: Sequence[Region], itemsize: int) -> list[int]:
    """The byte offset of each box in an array stored as its boxes' bytes one after another."""
    bases, at = [], 0
    for box in boxes:
        bases.append(at)
        at += box.volume * itemsize
    return bases


@dataclass(frozen=True)
class ShardLayout:
    """How a DTensor layout is saved: the region each coordinate holds, the part of it each
    coordinate writes, the boxes as stored (None: whole rows, stored as the array's own
    bytes) and each writer's first byte in the stored bytes."""

    held: dict[Coordinate, Region]
    parts: dict[Coordinate, Region]
    boxes: tuple[Region, ...] | None
    starts: dict[Coordinate, int]


def shard_layout(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Any],
    itemsize: int,
    *,
    shard_order: Mapping[int, Sequence[int]] | None = None,
    rotate: int = 0,
    key: str = "tensor",
) -> ShardLayout:
    """The :class:`ShardLayout` of a DTensor layout (see :func:`dtensor_regions` and
    :func:`writers`), its parts checked to tile the array.

    Raises:
        UnsupportedValueError: what :func:`dtensor_regions` raises for, or parts that do not
            tile the array.
    """
    held = dtensor_regions(global_shape, mesh_shape, placements, shard_order=shard_order, key=key)
    parts = writers(held, rotate=rotate)
    check_tiling(global_shape, parts.values())
    boxes = stored_boxes(global_shape, parts.values())
    row = itemsize * math.prod(global_shape[1:])
    if boxes is None:
        starts = {c: (p.offsets[0] * row if p.offsets else 0) for c, p in parts.items()}
    else:
        base = dict(zip(boxes, box_bases(boxes, itemsize), strict=True))
        starts = {c: base[p] for c, p in parts.items()}
    return ShardLayout(held, parts, boxes, starts)
