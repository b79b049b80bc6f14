"""The manifest's array entries of a save, and their JSON from a template kept between saves.

A state saved again with the same layout (the flatten cache's layout token: the same keys,
dtypes, shapes and kinds of arrays) and written to the same places (every piece's file,
offset, size and byte range of its array) has the same entries but for the pieces'
checksums. :class:`EntriesTemplate` keeps the JSON of the last save's entries cut at each
checksum, and fills the new checksums in: the entries are not built nor encoded again (a few
milliseconds of the writer thread per save, holding the GIL, for a model's few hundred
arrays). Any other difference (a piece moved or resized, another file, an encoded piece, a
new layout) builds the entries and the template again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from coci_core.codecs import RAW
from coci_core.engine.format.manifest import Piece, TensorEntry
from coci_core.engine.format.tree import ArrayLeaf, encode_dtype
from coci_core.engine.save import commit
from coci_core.errors import CommitError

__all__ = ["EntriesTemplate", "tensor_entry"]

# What stands for a checksum in the template's JSON: a string, where the checksum is a number,
# so that the JSON is cut at exactly the checksums (a key holding this text is found: the
# template is then not kept).
_MARK = "\x00coci-crc32c\x00"
_MARK_JSON = json.dumps(_MARK)


def tensor_entry(leaf: ArrayLeaf, pieces: list[Piece]) -> TensorEntry:
    """The manifest entry of ``leaf`` stored as ``pieces``."""
    if leaf.owned:  # the ranks holding no part of a sharded tensor wrote empty pieces
        pieces = [p for p in pieces if p.length]
    codecs = {str(p.params["codec"]) if p.params else RAW for p in pieces} or {RAW}
    entry = TensorEntry(
        key=leaf.key,
        kind=leaf.kind,
        dtype=encode_dtype(leaf.tensor.dtype),
        shape=leaf.shape,
        codec=codecs.pop() if len(codecs) == 1 else "mixed",
        pieces=tuple(sorted(pieces, key=lambda p: p.start)),
        numpy_dtype=leaf.numpy_dtype,
        boxes=leaf.boxes,
    )
    if leaf.owned:
        _check_cover(entry, leaf.tensor.element_size())
    return entry


def _check_cover(entry: TensorEntry, itemsize: int) -> None:
    """The ranks' parts of a sharded tensor fill it, each byte once (else nothing is published:
    a DTensor on a mesh of other ranks than the saving group's, for one)."""
    covered = 0
    for p in entry.pieces:
        if p.start != covered:
            break
        covered += p.length
    if covered != math.prod(entry.shape) * itemsize:
        raise CommitError(
            f"the ranks' parts of {entry.key!r} (shape {entry.shape}) do not fill it, each byte "
            "once: is it a DTensor whose mesh is not the ranks that save (every rank of the "
            "group, one mesh coordinate each)?",
            ranks=[],
        )


def _geometry(shares: Sequence[commit.RankShare]) -> tuple[tuple[Any, ...], ...] | None:
    """Every piece of the shares but its checksum, in the shares' order; None when a piece
    is encoded (its size and parameters change with its contents: no template)."""
    out = []
    for share in shares:
        for leaf, p in share.pieces:
            if p.params is not None:
                return None
            out.append((leaf, p.file, p.offset, p.nbytes, p.start, p.length))
    return tuple(out)


class EntriesTemplate:
    """The JSON of a save's shared array entries, from the last save's where it had the same
    layout and pieces (see the module's docstring). One per writer thread; not thread-safe.
    """

    def __init__(self) -> None:
        self._layout: object | None = None  # held: compared by identity
        self._n_shared = -1
        self._geometry: tuple[tuple[Any, ...], ...] | None = None
        self._parts: list[str] = []  # the JSON around each checksum
        self._order: list[int] = []  # each checksum's place in the shares' pieces
        self._boxes = False
        #: whether the last :meth:`encode` used the template (for tests)
        self.hit = False

    def encode(
        self,
        leaves: Sequence[ArrayLeaf],
        shares: Sequence[commit.RankShare],
        *,
        layout: object | None,
    ) -> tuple[str, bool]:
        """The JSON array of the entries of ``leaves`` (the state's shared arrays) stored as
        the ``shares``' pieces, and whether an entry is stored as boxes. ``layout``: the
        flatten's layout token of ``leaves`` (None: unknown, no template).

        Raises:
            CommitError: a share names an array the state does not have, or the ranks' parts
                of a sharded array do not fill it.
        """
        geometry = _geometry(shares) if layout is not None else None
        self.hit = (
            geometry is not None
            and layout is self._layout
            and len(leaves) == self._n_shared
            and geometry == self._geometry
        )
        if self.hit:
            crcs = [p.crc32c for share in shares for _, p in share.pieces]
            parts = self._parts
            out = [parts[0]]
            for k, part in zip(self._order, parts[1:], strict=True):
                out.append(str(crcs[k]))
                out.append(part)
            return "".join(out), self._boxes
        self._layout = self._geometry = None  # until a template is made below
        by_leaf = commit.pieces_by_leaf(shares, len(leaves))
        entries = [tensor_entry(leaf, pieces) for leaf, pieces in zip(leaves, by_leaf, strict=True)]
        boxes = any(e.boxes is not None for e in entries)
        docs = [e.to_dict() for e in entries]
        if geometry is None:
            return json.dumps(docs, separators=(",", ":"), allow_nan=False), boxes
        # each checksum's place among the shares' pieces, by the piece it is in
        place = {id(p): k for k, p in enumerate(p for s in shares for _, p in s.pieces)}
        order = [place[id(p)] for e in entries for p in e.pieces]
        for doc in docs:
            for piece in doc["pieces"]:
                piece["crc32c"] = _MARK
        parts = json.dumps(docs, separators=(",", ":"), allow_nan=False).split(_MARK_JSON)
        crcs = [p.crc32c for e in entries for p in e.pieces]
        if len(parts) != len(order) + 1:  # the mark's text in a key: no template
            for doc, entry in zip(docs, entries, strict=True):
                for piece, p in zip(doc["pieces"], entry.pieces, strict=True):
                    piece["crc32c"] = p.crc32c
            return json.dumps(docs, separators=(",", ":"), allow_nan=False), boxes
        self._layout, self._n_shared, self._geometry = layout, len(leaves), geometry
        self._parts, self._order, self._boxes = parts, order, boxes
        out = [parts[0]]
        for crc, part in zip(crcs, parts[1:], strict=True):
            out.append(str(crc))
            out.append(part)
        return "".join(out), boxes
