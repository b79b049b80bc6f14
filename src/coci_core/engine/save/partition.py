"""Which rank writes which bytes: a pure function of the arrays' sizes and the world size.

The replicated arrays of a state are laid end to end (each at a 64-byte aligned offset, so that
every cut falls on an element boundary) and the stream is cut into ``chunk_bytes`` chunks; rank
``r`` takes a contiguous run of ``K // N`` or ``K // N + 1`` of the ``K`` chunks. Every rank's
share is therefore within one chunk of every other's, and a large tensor is split over ranks
instead of landing on one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coci_core.errors import ConfigError
from coci_core.knobs import DEFAULT_CHUNK_BYTES

__all__ = ["DEFAULT_CHUNK_BYTES", "LEAF_ALIGN_BYTES", "Share", "partition", "share_bytes"]

LEAF_ALIGN_BYTES = 64


@dataclass(frozen=True)
class Share:
    """Bytes ``[start, stop)`` of array ``leaf``, written by one rank."""

    leaf: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def partition(
    sizes: Sequence[int], world_size: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> tuple[tuple[Share, ...], ...]:
    """Each rank's shares of arrays of ``sizes`` bytes (empty arrays are in no share).

    Raises:
        ConfigError: ``world_size`` is not a positive integer, ``chunk_bytes`` is not a
            positive multiple of 64, or a size is negative.
    """
    if type(world_size) is not int or world_size < 1:
        raise ConfigError(f"'world_size' must be an integer >= 1: {world_size!r}")
    if type(chunk_bytes) is not int or chunk_bytes < 1 or chunk_bytes % LEAF_ALIGN_BYTES:
        raise ConfigError(
            f"'chunk_bytes' must be a positive multiple of {LEAF_ALIGN_BYTES}: {chunk_bytes!r}"
        )
    starts = []
    offset = 0
    for i, size in enumerate(sizes):
        if type(size) is not int or size < 0:
            raise ConfigError(f"'sizes[{i}]' must be an integer >= 0: {size!r}")
        starts.append(offset)
        offset = _round_up(offset + size, LEAF_ALIGN_BYTES)
    total = offset
    chunks = -(-total // chunk_bytes)
    shares: list[tuple[Share, ...]] = []
    leaf = 0
    for rank in range(world_size):
        lo = min(total, rank * chunks // world_size * chunk_bytes)
        hi = min(total, (rank + 1) * chunks // world_size * chunk_bytes)
        mine = []
        while leaf < len(sizes) and starts[leaf] < hi:
            begin, end = starts[leaf], starts[leaf] + sizes[leaf]
            cut_lo, cut_hi = max(begin, lo), min(end, hi)
            if cut_hi > cut_lo:
                mine.append(Share(leaf, cut_lo - begin, cut_hi - begin))
            if end > hi:
                break  # the rest of this array belongs to the next rank
            leaf += 1
        shares.append(tuple(mine))
    return tuple(shares)


def share_bytes(shares: Sequence[Share]) -> int:
    """Bytes in ``shares``."""
    return sum(s.nbytes for s in shares)
