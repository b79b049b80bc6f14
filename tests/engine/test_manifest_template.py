"""The writer's template of the manifest's array entries (``engine/save/entries.py``): a save
of the same layout and pieces fills the new checksums into the last save's JSON; any other
change builds it again. Either way the bytes are those of the entries built and encoded anew."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.engine.format.manifest import MANIFEST_NAME, DataFile, Piece, RankState
from coci_core.engine.format.tree import FlattenCache, flatten_state
from coci_core.engine.save.commit import RankShare
from coci_core.engine.save.entries import _MARK, EntriesTemplate, tensor_entry
from coci_core.errors import CommitError


def _shares(leaves: Any, crcs: list[int], *, move: int = -1, file: str = "data-r0.bin") -> Any:
    """One rank's raw pieces of ``leaves`` back to back (the piece ``move`` one byte on)."""
    pieces, offset = [], 0
    for i, (leaf, crc) in enumerate(zip(leaves, crcs, strict=True)):
        offset += i == move
        pieces.append((i, Piece(file, offset, leaf.nbytes, 0, leaf.nbytes, crc)))
        offset += leaf.nbytes
    return [RankShare(0, "t", "", tuple(pieces), RankState(None, ()), DataFile(file, offset))]


def _reference(leaves: Any, shares: Any) -> str:
    """The entries built and encoded anew (what the writer wrote before the template)."""
    by_leaf: list[list[Piece]] = [[] for _ in leaves]
    for share in shares:
        for leaf, p in share.pieces:
            by_leaf[leaf].append(p)
    docs = [tensor_entry(leaf, ps).to_dict() for leaf, ps in zip(leaves, by_leaf, strict=True)]
    return json.dumps(docs, separators=(",", ":"), allow_nan=False)


def _state() -> dict[str, Any]:
    return {
        "w": torch.randn(4, 3),
        "b": torch.zeros(3),
        "n": {"k": torch.ones(2, dtype=torch.int64)},
    }


def test_same_layout_fills_in_the_new_checksums() -> None:
    state, cache, template = _state(), FlattenCache(), EntriesTemplate()
    flat = flatten_state(state, cache=cache)
    first = _shares(flat.leaves, [1, 2, 3])
    assert template.encode(flat.leaves, first, layout=flat.layout) == (
        _reference(flat.leaves, first),
        False,
    )
    assert not template.hit
    again = flatten_state(state, cache=cache)
    second = _shares(again.leaves, [4, 5, 2**32 - 1])
    text, _ = template.encode(again.leaves, second, layout=again.layout)
    assert template.hit
    assert text == _reference(again.leaves, second)
    assert [p["crc32c"] for e in json.loads(text) for p in e["pieces"]] == [4, 5, 2**32 - 1]


@pytest.mark.parametrize(
    "change",
    [
        lambda s: ({**s, "w": torch.randn(3, 4)}, {}),  # another shape
        lambda s: ({**s, "b": s["b"].double()}, {}),  # another dtype
        lambda s: ({**s, "x": torch.ones(1)}, {}),  # one more array
        lambda s: ({"w": s["w"], "c": s["b"], "n": s["n"]}, {}),  # a key renamed
        lambda s: (s, {"move": 1}),  # a piece at another offset
        lambda s: (s, {"file": "data-r0-other.bin"}),  # another data file
    ],
)
def test_any_other_change_builds_the_entries_again(change: Any) -> None:
    state, cache, template = _state(), FlattenCache(), EntriesTemplate()
    flat = flatten_state(state, cache=cache)
    template.encode(flat.leaves, _shares(flat.leaves, [1, 2, 3]), layout=flat.layout)
    state, how = change(state)
    again = flatten_state(state, cache=cache)
    shares = _shares(again.leaves, list(range(7, 7 + len(again.leaves))), **how)
    text, _ = template.encode(again.leaves, shares, layout=again.layout)
    assert not template.hit
    assert text == _reference(again.leaves, shares)


def test_encoded_pieces_and_unknown_layouts_keep_no_template() -> None:
    state, cache, template = _state(), FlattenCache(), EntriesTemplate()
    flat = flatten_state(state, cache=cache)
    shares = _shares(flat.leaves, [1, 2, 3])
    for _ in range(2):  # no layout token: never a template
        assert template.encode(flat.leaves, shares, layout=None)[0] == _reference(
            flat.leaves, shares
        )
        assert not template.hit
    p = shares[0].pieces[0][1]
    coded = Piece(p.file, p.offset, p.nbytes, p.start, p.length, 9, {"codec": "zstd"})
    encoded = [
        RankShare(
            0, "t", "", ((0, coded), *shares[0].pieces[1:]), RankState(None, ()), shares[0].file
        )
    ]
    for _ in range(2):  # an encoded piece: its size and parameters follow its contents
        assert template.encode(flat.leaves, encoded, layout=flat.layout)[0] == _reference(
            flat.leaves, encoded
        )
        assert not template.hit


def test_a_key_holding_the_marks_text_is_written_as_it_is() -> None:
    state = {_MARK: torch.ones(2), f'{_MARK}"': torch.zeros(1)}
    cache, template = FlattenCache(), EntriesTemplate()
    for crcs in ([1, 2], [3, 4]):
        flat = flatten_state(state, cache=cache)
        shares = _shares(flat.leaves, crcs)
        assert template.encode(flat.leaves, shares, layout=flat.layout)[0] == _reference(
            flat.leaves, shares
        )


def test_a_piece_of_an_array_the_state_lacks_is_refused_hit_or_not() -> None:
    state, cache, template = _state(), FlattenCache(), EntriesTemplate()
    flat = flatten_state(state, cache=cache)
    template.encode(flat.leaves, _shares(flat.leaves, [1, 2, 3]), layout=flat.layout)
    with pytest.raises(CommitError, match="array 2, the state has 2"):
        template.encode(flat.leaves[:2], _shares(flat.leaves, [1, 2, 3]), layout=flat.layout)


def test_saves_write_the_manifest_of_their_own_checksums(tmp_path: Path) -> None:
    """Real saves: from the second on the writer fills its template, and each manifest holds
    the checksums of its own data (every restore verifies them) and is byte for byte the
    manifest encoded whole."""
    from coci_core.engine.format.manifest import Manifest

    model = torch.nn.Linear(8, 4)
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        hits, weights = [], []
        for step in range(3):
            with torch.no_grad():
                model.weight.add_(1.0)
            weights.append(model.weight.detach().clone())
            mgr.save(
                step, {"model": model.state_dict(), "step": step}, per_rank={"r": torch.randn(2)}
            ).wait()
            hits.append(mgr._writer.template.hit)
        assert hits == [False, True, True]
        crcs = set()
        for step in range(3):
            data = (tmp_path / f"step-{step:010d}" / MANIFEST_NAME).read_bytes()
            manifest = Manifest.from_json(data)
            assert data == manifest.to_json()
            crcs.add(manifest.tensors[0].pieces[0].crc32c)
            restored = mgr.restore(step=step)
            assert torch.equal(restored["model"]["weight"], weights[step])
        assert len(crcs) == 3
