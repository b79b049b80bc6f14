"""Reading any box of a stored array: an array stored as boxes (a DTensor cut along a dim
other than its first) rebuilt whole, and the part of an array that one rank of another mesh
holds, read from only the pieces that hold its bytes (resharding restore).

An entry's stored bytes are its boxes' row-major bytes one after another (one box, the whole
array, when the entry has none); its pieces are byte ranges of those. To fill a target box,
the common part with each stored box lies in one span of that box's bytes (from its first
element to its last); the pieces holding the span are read whole (so that each is verified
against its checksum), and the part is copied out of the span with the box's strides.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from coci_core.engine.format.manifest import Manifest, TensorEntry
from coci_core.engine.format.regions import Region, box_bases
from coci_core.engine.format.tree import decode_dtype
from coci_core.engine.restore.read import ArrayReader
from coci_core.errors import CorruptCheckpointError

__all__ = ["assemble", "read_box", "stored_boxes_of"]


def stored_boxes_of(entry: TensorEntry) -> list[tuple[Region, int]]:
    """Each stored box of ``entry`` with its first byte in the stored bytes."""
    if entry.boxes is None:
        return [(Region.whole(entry.shape), 0)]
    itemsize = decode_dtype(entry.dtype).itemsize
    return list(zip(entry.boxes, box_bases(entry.boxes, itemsize), strict=True))


@dataclass
class _Step:
    """Part of the target held by one stored box, and where its bytes are."""

    source: Region
    span: tuple[int, int]  # the stored bytes from its first element to its last (end)
    destination: tuple[slice, ...]
    strides: tuple[int, ...]  # of the box that holds it, in elements


def _plan(entry: TensorEntry, target: Region) -> list[_Step]:
    itemsize = decode_dtype(entry.dtype).itemsize
    steps = []
    for box, base in stored_boxes_of(entry):
        common = box.intersect(target)
        if common is None:
            continue
        strides = tuple(math.prod(box.shape[d + 1 :]) for d in range(len(box.shape)))
        first = sum(
            (c - b) * n for c, b, n in zip(common.offsets, box.offsets, strides, strict=True)
        )
        last = sum(
            (e - 1 - b) * n for e, b, n in zip(common.ends, box.offsets, strides, strict=True)
        )
        lo, hi = base + itemsize * first, base + itemsize * (last + 1)
        steps.append(_Step(common, (lo, hi), common.slices(target), strides))
    return steps


def _check_filled(entry: TensorEntry, target: Region, steps: list[_Step], step: int) -> None:
    """The stored boxes fill ``target``, each element once (a manifest's boxes are checked to
    hold as many elements as the array, so an overlap shows as an element left unfilled)."""
    if len(steps) == 1 and steps[0].source == target:
        return
    filled = torch.zeros(target.shape, dtype=torch.bool)
    for s in steps:
        part = filled[s.destination]
        if bool(part.any()):
            raise CorruptCheckpointError(
                f"step {step}: the boxes of {entry.key!r} overlap in {s.source}",
                step=step,
                bad=[entry.key],
            )
        part.fill_(True)
    if not bool(filled.all()):
        raise CorruptCheckpointError(
            f"step {step}: the boxes of {entry.key!r} leave part of {target} unfilled",
            step=step,
            bad=[entry.key],
        )


def read_box(
    reader: ArrayReader, manifest: Manifest, entry: TensorEntry, target: Region, out: torch.Tensor
) -> int:
    """Fill ``out`` (of ``target``'s shape and the entry's dtype, on any device) with box
    ``target`` of the stored array, reading only the pieces that hold its bytes; return the
    stored bytes read.

    Raises:
        CorruptCheckpointError: a piece is damaged, or the boxes do not tile the array.
    """
    if tuple(out.shape) != target.shape or str(out.dtype).removeprefix("torch.") != entry.dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not hold {target}")
    if not target.volume:
        return 0
    steps = _plan(entry, target)
    _check_filled(entry, target, steps, manifest.step)
    # Each step's bytes lie in one span of its box's stored bytes (from its first element to
    # its last): the span is gathered from the pieces, then viewed with the box's strides.
    spans = [s.span for s in steps]
    starts = [p.start for p in entry.pieces]
    wanted: set[int] = set()
    for lo, hi in spans:
        first = max(0, bisect.bisect_right(starts, lo) - 1)
        wanted.update(range(first, bisect.bisect_left(starts, hi)))
    buffers: list[torch.Tensor | None] = [None] * len(steps)
    filled = [0] * len(steps)
    nbytes = 0
    for i, raw in reader.fetch_pieces(manifest, entry, sorted(wanted)):
        piece = entry.pieces[i]
        nbytes += piece.nbytes
        p_lo, p_hi = piece.start, piece.start + piece.length
        for k, (lo, hi) in enumerate(spans):
            a, b = max(lo, p_lo), min(hi, p_hi)
            if a >= b:
                continue
            if a == lo and b == hi:  # the whole span in this piece: a view of it
                buffers[k] = raw[a - p_lo : b - p_lo]
            else:
                buf = buffers[k]
                if buf is None:
                    buf = buffers[k] = torch.empty(hi - lo, dtype=torch.uint8)
                buf[a - lo : b - lo] = raw[a - p_lo : b - p_lo]
            filled[k] += b - a
    dtype = decode_dtype(entry.dtype)
    for k, s in enumerate(steps):
        buf = buffers[k]
        if buf is None or filled[k] != spans[k][1] - spans[k][0]:
            raise CorruptCheckpointError(
                f"step {manifest.step}: the pieces of {entry.key!r} do not hold all of {s.source}",
                step=manifest.step,
                bad=[entry.key],
            )
        out[s.destination].copy_(torch.as_strided(buf.view(dtype), s.source.shape, s.strides))
    return nbytes


def assemble(entry: TensorEntry, raw: torch.Tensor, step: int) -> torch.Tensor:
    """The whole array of an entry stored as boxes, from its stored bytes ``raw``."""
    dtype = decode_dtype(entry.dtype)
    whole = Region.whole(entry.shape)
    steps = _plan(entry, whole)
    _check_filled(entry, whole, steps, step)
    out = torch.empty(entry.shape, dtype=dtype)
    for s in steps:  # a whole box: its bytes are its span
        lo, hi = s.span
        out[s.destination].copy_(raw[lo:hi].view(dtype).view(s.source.shape))
    return out
