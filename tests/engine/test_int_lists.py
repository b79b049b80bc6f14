"""Long lists of ints (``random.getstate()``'s 625) in a manifest: compact ``ints`` nodes of the
tree (format 5), read back exactly; no array of the data file; older formats read as before;
forged nodes refused naming what is wrong."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coci_core import CheckpointManager, CorruptCheckpointError
from coci_core.engine.format.int_lists import holds_ints
from coci_core.engine.format.tree import FlattenCache, flatten_state, unflatten_state
from coci_core.engine.restore.load import load_checkpoint, verify_checkpoint
from coci_core.engine.save.save_inputs import layout_digest
from coci_core.storage import LocalStorage
from tests.adversarial.craft import edit_manifest, read_doc


def _rng_states(seed: int) -> dict[str, Any]:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_random_states_take_half_the_bytes_of_a_ranks_manifest_entry_and_resume_exact(
    tmp_path: Path,
) -> None:
    """A rank's random states (Python's 625 ints, NumPy's and torch's arrays) took 7.5 KB of
    its manifest entry, Python's as 625 JSON numbers: now one base64 string of 625 uint32
    (3.4 KB), and the generators set from the restored states draw what the saved run drew."""
    rng = _rng_states(11)
    expected = _draws()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"w": torch.ones(2)}, per_rank={"rng": rng}).wait()
        doc = read_doc(tmp_path, 3)
        entry = len(json.dumps(doc["per_rank"][0], separators=(",", ":")))
        node = doc["per_rank"][0]["tree"]["v"]["rng"]["v"]["python"]["v"][1]
        back = mgr.restore()["rng"]
    assert doc["format_version"] == 5
    assert node["t"] == "ints" and node["dtype"] == "uint32" and node["n"] == 625
    assert len(node["v"]) == 3336  # 2,500 bytes in base64
    assert entry < 4300, entry
    assert back["python"] == rng["python"] and type(back["python"][1]) is tuple
    _rng_states(0)  # other states, then the restored ones
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    torch.set_rng_state(back["torch"])
    assert _draws() == expected


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        (list(range(64)), "uint8"),
        (tuple(range(-64, 64)), "int8"),
        (list(range(0, 2**16, 1000)), "uint16"),
        ([-(2**15)] * 70, "int16"),
        ([2**32 - 1, *range(63)], "uint32"),
        ((-(2**31), *range(63)), "int32"),
        ([2**64 - 1, *range(63)], "uint64"),
        ((-(2**63), 2**63 - 1, *range(62)), "int64"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_int_lists_take_the_narrowest_width_and_come_back_as_they_were(
    values: list[int] | tuple[int, ...], dtype: str
) -> None:
    """Each list or tuple of 64+ ints is one node of the narrowest width that holds it, and
    comes back through JSON as the same list or tuple of Python ints."""
    tree = flatten_state({"x": values}).tree
    node = tree["v"]["x"]
    assert node["t"] == "ints" and node["dtype"] == dtype and node["n"] == len(values)
    back = unflatten_state(json.loads(json.dumps(tree)), [])["x"]
    assert type(back) is type(values) and back == values
    assert all(type(v) is int for v in back)


@pytest.mark.parametrize(
    "values",
    [
        list(range(63)),  # short: readable JSON numbers
        [True, *range(63)],  # a bool comes back a bool
        [np.int64(1), *range(63)],  # a numpy integer comes back one
        [1.0, *range(63)],
        [2**64, *range(63)],  # beyond 64 bits
        [-(2**63) - 1, *range(63)],
        [None, *range(63)],
    ],
    ids=["short", "bool", "np-int", "float", "2**64", "-2**63-1", "None"],
)
def test_lists_that_are_not_64_plain_ints_stay_as_they_were(values: list[Any]) -> None:
    tree = flatten_state({"x": values}).tree
    assert tree["v"]["x"]["t"] == "list"
    back = unflatten_state(json.loads(json.dumps(tree)), [])["x"]
    assert back == values and [type(v) for v in back] == [type(v) for v in values]


def test_int_lists_are_no_arrays_and_keep_the_flatten_cache() -> None:
    """An ints node is a value of the tree: lists of other lengths (a loader's indices on each
    rank) give the same leaves and layout, and a state's flatten cache stays hit (an array per
    list made a new tensor at every save: every save missed the cache, and a shared list of
    another length on each rank split the ranks' layouts)."""
    w = torch.randn(4)
    cache = FlattenCache()
    flats = [
        flatten_state(
            {"w": w, "rng": random.Random(n).getstate(), "ids": list(range(n))}, cache=cache
        )
        for n in (100, 300)
    ]
    assert layout_digest(flats[0].leaves, 1 << 20) == layout_digest(flats[1].leaves, 1 << 20)
    assert flats[1].layout is flats[0].layout is not None
    assert flats[1].leaves == flats[0].leaves and len(flats[0].leaves) == 1
    assert [f.tree["v"]["ids"]["n"] for f in flats] == [100, 300]


def _as_json_lists(tree: Any) -> Any:
    """The tree as a coci before format 5 wrote it: each ints node a list or tuple node of
    JSON numbers."""
    if isinstance(tree, dict):
        if tree.get("t") == "ints":
            values = unflatten_state(tree, [])
            return {"t": tree["type"], "v": list(values)}
        return {k: _as_json_lists(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_as_json_lists(v) for v in tree]
    return tree


def _saved(root: Path) -> dict[str, Any]:
    state = {"w": torch.arange(3.0), "ids": list(range(-5, 95))}
    with CheckpointManager(root) as mgr:
        mgr.save(1, state, per_rank={"python": random.Random(5).getstate()}).wait()
    return state


@pytest.mark.parametrize("version", [3, 4])
def test_earlier_formats_read_as_before_and_hold_no_ints_node(tmp_path: Path, version: int) -> None:
    """A manifest of format 3 or 4 (an earlier coci's: lists of ints as JSON numbers) reads
    as it always did; an ints node in one is damage, refused naming it."""
    state = _saved(tmp_path / "old")
    doc = read_doc(tmp_path / "old", 1)
    assert doc["format_version"] == 5 and holds_ints(doc["tree"])

    def older(d: dict[str, Any]) -> None:
        d["format_version"] = version
        d["tree"] = _as_json_lists(d["tree"])
        d["per_rank"][0]["tree"] = _as_json_lists(d["per_rank"][0]["tree"])

    edit_manifest(tmp_path / "old", 1, older)
    got = load_checkpoint(LocalStorage(tmp_path / "old"), 1)
    assert got.state["ids"] == state["ids"] and torch.equal(got.state["w"], state["w"])
    with CheckpointManager(tmp_path / "old") as mgr:
        assert mgr.restore(step=1)["python"] == random.Random(5).getstate()
    _saved(tmp_path / "forged")
    edit_manifest(tmp_path / "forged", 1, lambda d: d.update(format_version=version))
    with pytest.raises(CorruptCheckpointError, match="an 'ints' node, which this manifest's"):
        load_checkpoint(LocalStorage(tmp_path / "forged"), 1)


def _node(doc: dict[str, Any]) -> dict[str, Any]:
    node: dict[str, Any] = doc["tree"]["v"]["ids"]
    return node


def _flip_padding(v: str) -> str:
    """The same bytes spelled with nonzero padding bits (100 int8 = 100 bytes: ends "xx==")."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    last = alphabet.index(v[-3])
    return v[:-3] + alphabet[last | 1] + "=="


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda n: n.update(n=101), "not the base64 of 101 ints"),  # same base64 length
        (lambda n: n.update(n=99), "has 136 characters, where 99 ints of int8 take 132"),
        (lambda n: n.update(n=2**62), r"where 4611686018427387904 ints of int8 take"),
        (lambda n: n.update(n=2**63), r"count n=9223372036854775808 is not an int"),
        (lambda n: n.update(n=-1), r"count n=-1 is not an int"),
        (lambda n: n.update(n=True), r"count n=True is not an int"),
        (lambda n: n.update(dtype="uint16"), "where 100 ints of uint16 take 268"),
        (lambda n: n.update(dtype="float32"), "dtype 'float32' is not one of uint8"),
        (lambda n: n.update(dtype="<i1"), "dtype '<i1' is not one of"),
        (lambda n: n.update(type="set"), "type 'set' is not 'list' or 'tuple'"),
        (lambda n: n.update(type=["list"]), "type .* is not 'list' or 'tuple'"),
        (lambda n: n.update(v=None), "v is a NoneType, not a base64 string"),
        (lambda n: n.update(v="!" + n["v"][1:]), "v is not base64"),
        (lambda n: n.update(v="\n" + n["v"][1:]), "v is not base64"),
        (lambda n: n.update(v=n["v"][:4] + "====" + n["v"][8:]), "v is not"),
        (lambda n: n.update(v=_flip_padding(n["v"])), "v is not base64 in its canonical"),
        (lambda n: n.pop("n"), r"fields \['dtype', 'type', 'v'\]"),
        (lambda n: n.update(extra=1), r"fields \['dtype', 'extra', 'n', 'type', 'v'\]"),
    ],
    ids=[
        "n+1",
        "n-1",
        "n-huge",
        "n-2**63",
        "n-negative",
        "n-bool",
        "dtype-wider",
        "dtype-float",
        "dtype-numpy-name",
        "type-set",
        "type-list",
        "v-none",
        "v-bad-char",
        "v-newline",
        "v-padding-inside",
        "v-noncanonical",
        "no-n",
        "extra-field",
    ],
)
def test_forged_ints_nodes_are_refused_naming_what_is_wrong(
    tmp_path: Path, edit: Any, match: str
) -> None:
    """A forged ints node (the checksum recomputed) is refused with a CorruptCheckpointError
    saying what is wrong and where in the tree, by the restore and by verify, before anything
    is decoded (a count of 2**62 allocates nothing; a bad base64 was refused by the decoding,
    naming no path)."""
    _saved(tmp_path)
    edit_manifest(tmp_path, 1, lambda d: edit(_node(d)))
    storage = LocalStorage(tmp_path)
    match = "field tree at '/ids': .*" + match
    started = time.perf_counter()
    with pytest.raises(CorruptCheckpointError, match=match):
        load_checkpoint(storage, 1)
    assert time.perf_counter() - started < 2
    with pytest.raises(CorruptCheckpointError, match=match):
        verify_checkpoint(storage, 1)


@pytest.mark.parametrize("forged", ["!AAA", "AA=A", "AAA", "AA\n", "A==="])
def test_a_forged_bytes_node_is_refused_naming_where(tmp_path: Path, forged: str) -> None:
    """A bytes node whose v is not base64 is refused naming its path in the tree (it failed
    in the decoding, as 'malformed state tree node', naming none)."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.zeros(2), "blob": b"\x00\xffcoci"}).wait()
    edit_manifest(tmp_path, 1, lambda d: d["tree"]["v"]["blob"].update(v=forged))
    with pytest.raises(CorruptCheckpointError, match="field tree at '/blob': a bytes node's v is"):
        load_checkpoint(LocalStorage(tmp_path), 1)


def test_saves_of_new_random_states_keep_the_planned_copy_runs(tmp_path: Path) -> None:
    """Saves whose Python random state (per rank) and a shared list of ints change every time
    keep the layout: from the second save on, the copy goes by the planned runs (an array per
    list was a new tensor at each save: no save had them)."""
    state = {"w": torch.zeros(64), "b": torch.zeros(3)}
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in range(3):
            random.random()
            state["ids"] = list(range(step, 100 + 10 * step))
            mgr.save(step, state, per_rank={"python": random.getstate()}).wait()
            assert (mgr._snapshotter._runs is not None) == (step >= 1)
        assert mgr.restore(step=2)["python"] == random.getstate()


def test_the_flatten_says_whether_its_tree_holds_ints_and_the_manifest_takes_its_word(
    tmp_path: Path,
) -> None:
    """The flatten says whether the tree it made holds an ``ints`` node, from the cache too
    (so a save's manifest does not walk a tree of thousands of tensors to find out, before:
    every save did); each save's manifest is of format 5 exactly when its state holds one."""
    w = torch.randn(4)
    states = [{"w": w, "ids": list(range(100)), "nested": {"x": [{"r": random.getstate()}]}}]
    states += [{"w": w, "ids": list(range(3)), "nested": {"x": []}}, states[0]]
    cache = FlattenCache()
    flats = [flatten_state(s, cache=cache) for s in states]
    assert flats[2].layout is flats[1].layout is flats[0].layout is not None  # all hits
    assert [f.ints for f in flats] == [holds_ints(f.tree) for f in flats] == [True, False, True]
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step, state in enumerate(states):
            mgr.save(step, state).wait()
    assert [read_doc(tmp_path, step)["format_version"] for step in range(3)] == [5, 3, 5]
