"""Reading any box of a stored array: an array stored as boxes (a DTensor cut along a dim
other than its first) rebuilt whole, and the part of an array that one rank of another mesh
holds, read from only the pieces that hold its bytes (resharding restore).

An entry's stored bytes are its boxes' row-major bytes one after another (one box, the whole
array, when the entry has none); its pieces are byte ranges of those. To fill a target box,
each stored box meeting it gives the byte runs of the common part
(:func:`~coci_core.engine.regions.byte_runs`); the pieces holding those runs are read whole
(so that each is verified against its checksum) and the runs copied out of them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from coci_core.engine.manifest import Manifest, TensorEntry
from coci_core.engine.read import ArrayReader
from coci_core.engine.regions import Region, box_bases, byte_runs, clip_runs
from coci_core.engine.tree import decode_dtype
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
    """Part of the target held by one stored box: its stored byte runs, joined in ``data``."""

    source: Region
    runs: list[tuple[int, int]]  # (offset in the stored bytes, length)
    destination: tuple[slice, ...]


def _plan(entry: TensorEntry, target: Region) -> list[_Step]:
    itemsize = decode_dtype(entry.dtype).itemsize
    steps = []
    for box, base in stored_boxes_of(entry):
        common = box.intersect(target)
        if common is None:
            continue
        runs = [(base + o, n) for o, n in byte_runs(common, box, itemsize)]
        steps.append(_Step(common, runs, common.slices(target)))
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
    starts = [p.start for p in entry.pieces]
    wanted: set[int] = set()
    for s in steps:
        for offset, length in s.runs:
            first = max(0, bisect.bisect_right(starts, offset) - 1)
            last = bisect.bisect_left(starts, offset + length)
            wanted.update(range(first, last))
    itemsize = decode_dtype(entry.dtype).itemsize
    data = [torch.empty(s.source.volume * itemsize, dtype=torch.uint8) for s in steps]
    nbytes = 0
    joined = [0] * len(steps)
    for i, raw in reader.fetch_pieces(manifest, entry, sorted(wanted)):
        piece = entry.pieces[i]
        nbytes += piece.nbytes
        for k, s in enumerate(steps):
            for at, length, dest in clip_runs(s.runs, piece.start, piece.start + piece.length):
                data[k][dest : dest + length] = raw[at : at + length]
                joined[k] += length
    dtype = decode_dtype(entry.dtype)
    for k, s in enumerate(steps):
        if joined[k] != data[k].numel():
            raise CorruptCheckpointError(
                f"step {manifest.step}: the pieces of {entry.key!r} do not hold all of {s.source}",
                step=manifest.step,
                bad=[entry.key],
            )
        out[s.destination].copy_(data[k].view(dtype).view(s.source.shape))
    return nbytes


def assemble(entry: TensorEntry, raw: torch.Tensor, step: int) -> torch.Tensor:
    """The whole array of an entry stored as boxes, from its stored bytes ``raw``."""
    dtype = decode_dtype(entry.dtype)
    whole = Region.whole(entry.shape)
    steps = _plan(entry, whole)
    _check_filled(entry, whole, steps, step)
    out = torch.empty(entry.shape, dtype=dtype)
    for s in steps:
        ((offset, length),) = s.runs  # a whole box is one run of its own bytes
        out[s.destination].copy_(raw[offset : offset + length].view(dtype).view(s.source.shape))
    return out
