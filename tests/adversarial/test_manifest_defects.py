"""Damaged manifests: one test per reproduced defect (silent wrong values, raw exceptions,
hangs, huge allocations, false alarms).

A committed checkpoint either restores exactly what was saved or raises CorruptCheckpointError,
and ``CheckpointManager.restore()`` then falls back to the newest intact older step.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coci_core import (
    CheckpointManager,
    CorruptCheckpointError,
    NoCheckpointError,
)
from coci_core.commands import cli, inputs
from coci_core.engine.directory import steps
from coci_core.engine.format import tree
from coci_core.engine.format.manifest import step_dir_name
from coci_core.engine.restore import read, restore
from coci_core.engine.restore.restore import load_checkpoint, verify_checkpoint
from coci_core.storage import LocalStorage
from tests.adversarial.craft import (
    HookedStorage,
    craft_chain,
    edit_manifest,
    encode_doc,
    manifest_path,
    read_doc,
    same,
    write_doc,
)

pytestmark = pytest.mark.timeout(60)

MAX_TREE_DEPTH = getattr(tree, "MAX_TREE_DEPTH", 128)


def _states() -> dict[int, dict[str, Any]]:
    return {
        1: {"a": torch.arange(6.0), "b": torch.full((6,), -1.0), "epoch": 1},
        2: {"a": torch.arange(6.0) * 2, "b": torch.full((6,), -2.0), "epoch": 3},
    }


def _saved(root: Path, **kwargs: Any) -> dict[int, dict[str, Any]]:
    states = _states()
    with CheckpointManager(root, keep_last=None, **kwargs) as mgr:
        for step, state in states.items():
            mgr.save(step, state).wait()
    return states


def _refused(root: Path, step: int = 2, match: str | None = None) -> CorruptCheckpointError:
    """Restoring ``step`` raises CorruptCheckpointError (nothing else), verify reports it,
    and the manager falls back to step 1."""
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        load_checkpoint(LocalStorage(root), step)
    with CheckpointManager(root, keep_last=None) as mgr:
        assert same(mgr.restore(), _states()[1])
        assert mgr.last_restore is not None and mgr.last_restore.skipped_steps == (step,)
    try:
        bad = verify_checkpoint(LocalStorage(root), step)
    except CorruptCheckpointError:
        pass
    else:
        assert bad, "verify calls a refused step intact"
    return info.value


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every buffer restore allocates (where the coci has the hook)."""
    sizes: list[int] = []
    original = getattr(read, "_alloc", None)
    if original is not None:

        def alloc(nbytes: int) -> torch.Tensor:
            sizes.append(nbytes)
            assert nbytes <= 1 << 30, f"restore allocates {nbytes} bytes"
            return original(nbytes)

        monkeypatch.setattr(read, "_alloc", alloc)
    return sizes


# --- defect 6: the manifest protects itself ----------------------------------------------


def test_two_changed_bytes_in_the_manifest_are_found(tmp_path: Path) -> None:
    """Changing two bytes (tensor ids swapped, epoch 3 -> 8) used to restore 'a' with b's
    values and epoch 8 while verify said ok: the checksum refuses the manifest."""
    _saved(tmp_path)
    path = manifest_path(tmp_path, 2)
    data = path.read_bytes()
    assert data.count(b'"id":0') == 1 and data.count(b'"id":1') == 1
    data = data.replace(b'"id":0', b'"id":#').replace(b'"id":1', b'"id":0')
    data = data.replace(b'"id":#', b'"id":1').replace(b'"epoch":3', b'"epoch":8')
    path.write_bytes(data)
    _refused(tmp_path, match="checksum")
    assert cli.main(["verify", str(tmp_path), "--step", "2"]) == 1


def test_a_crafted_manifest_with_a_valid_checksum_is_still_checked(tmp_path: Path) -> None:
    """Swapped tree ids with a recomputed checksum: the arrays' keys name their place in
    the tree, so the swap is refused by validation."""

    def swap(doc: dict[str, Any]) -> None:
        v = doc["tree"]["v"]
        v["a"]["id"], v["b"]["id"] = v["b"]["id"], v["a"]["id"]

    _saved(tmp_path)
    edit_manifest(tmp_path, 2, swap)
    _refused(tmp_path)


@pytest.mark.parametrize("sealed", [False, True], ids=["unsealed", "sealed"])
@pytest.mark.parametrize("version", [1, 2])
def test_formats_before_3_are_refused(tmp_path: Path, version: int, sealed: bool) -> None:
    """coci reads formats 3, 4 and 5 only: a manifest of format 1 or 2 (no checksum) is
    refused naming its version, with or without a valid checksum."""
    _saved(tmp_path)
    doc = read_doc(tmp_path, 2)
    doc["format_version"] = version
    write_doc(tmp_path, 2, doc, seal=sealed)
    _refused(tmp_path, match=f"format_version {version}; this coci reads formats 3, 4 and 5")


def test_format_3_without_its_checksum_is_refused(tmp_path: Path) -> None:
    _saved(tmp_path)
    write_doc(tmp_path, 2, read_doc(tmp_path, 2), seal=False)
    _refused(tmp_path, match="checksum")


def test_rank_markers_are_checked_like_manifests(tmp_path: Path) -> None:
    from coci_core.engine.format.manifest import DataFile, Piece, RankState
    from coci_core.engine.save.commit import RankShare

    share = RankShare(
        rank=1,
        token="t-1",
        layout="abc",
        pieces=((0, Piece("data-r1.bin", 0, 64, 64, 64, 123)),),
        per_rank=RankState(tree=None, tensors=()),
        file=DataFile("data-r1.bin", 64),
    )
    data = share.to_json()
    assert RankShare.from_json(data) == share
    for bad in (
        data.replace(b'"offset":0', b'"offset":8'),  # damage: the checksum finds it
        encode_doc({**json.loads(data), "rank": "1"}),  # crafted: a string for an int
        encode_doc({**json.loads(data), "file": {"name": "../x", "nbytes": 64}}),
    ):
        with pytest.raises(CorruptCheckpointError):
            RankShare.from_json(bad)


# --- defect 7: crashes instead of fallback -----------------------------------------------


def _set_piece(entry: int = 0, **fields: Any) -> Any:
    def edit(doc: dict[str, Any]) -> None:
        doc["tensors"][entry]["pieces"][0].update(fields)

    return edit


def test_a_huge_shape_fails_fast_without_allocating(tmp_path: Path, allocations: list[int]) -> None:
    """A shape of 2**40 used to allocate 4 TB before any check."""
    _saved(tmp_path)

    def huge(doc: dict[str, Any]) -> None:
        t = doc["tensors"][0]
        t["shape"] = [2**40]
        t["pieces"][0].update(length=2**42)

    edit_manifest(tmp_path, 2, huge)
    started = time.perf_counter()
    _refused(tmp_path)
    assert time.perf_counter() - started < 10
    assert all(n < 1 << 20 for n in allocations)


@pytest.mark.parametrize(
    "numpy_dtype", ["O", "|O", "V8", "<U2", ">f4", "[('x', '<f4')]", "<f8", "bogus", 5]
)
def test_bad_numpy_dtypes_are_refused(tmp_path: Path, numpy_dtype: Any) -> None:
    """Object, void, structured, string, big-endian or mismatched numpy dtypes are never
    built from a manifest (they used to reach np.dtype() unchecked)."""
    states = _states()
    states[1]["x"] = np.arange(3, dtype=np.float32)
    states[2]["x"] = np.arange(3, dtype=np.float32) + 1
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step, state in states.items():
            mgr.save(step, state).wait()

    def edit(doc: dict[str, Any]) -> None:
        (entry,) = (t for t in doc["tensors"] if t["key"] == "/x")
        entry["numpy_dtype"] = numpy_dtype

    edit_manifest(tmp_path, 2, edit)
    with pytest.raises(CorruptCheckpointError):
        load_checkpoint(LocalStorage(tmp_path), 2)


@pytest.mark.parametrize("dtype", ["O", "V4", "<U1", ">i4", "bogus", 3])
def test_bad_numpy_scalar_dtypes_in_the_tree_are_refused(tmp_path: Path, dtype: Any) -> None:
    states = _saved(tmp_path)

    def edit(doc: dict[str, Any]) -> None:
        doc["tree"]["v"]["epoch"] = {"t": "np", "dtype": dtype, "v": 3}

    edit_manifest(tmp_path, 2, edit)
    with pytest.raises(CorruptCheckpointError):
        load_checkpoint(LocalStorage(tmp_path), 2)
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        assert same(mgr.restore(), states[1])


@pytest.mark.parametrize(
    "edit",
    [
        _set_piece(offset=2**62),
        _set_piece(offset=2**64),
        _set_piece(file="data-r0\x00.bin"),
        _set_piece(file="dätä.bin"),
        _set_piece(file="../step-0000000001/data-r0.bin"),
        _set_piece(offset="0"),
        _set_piece(nbytes=-1),
        _set_piece(crc32c=2**32),
        lambda doc: doc["tensors"][0].update(shape=[2**63]),
        lambda doc: doc["tensors"][0].update(shape=[2**63, 0]),
        lambda doc: doc["tensors"][0].update(shape=[1] * 65),
        lambda doc: doc["files"][0].update(nbytes=2**70),
        lambda doc: doc.update(step="2"),
        lambda doc: doc.update(world_size=0),
        lambda doc: doc["tree"]["v"].update(a={"t": "tensor", "id": 7}),
        lambda doc: doc["tree"]["v"].update(a={"t": "bytes", "v": 5}),
        lambda doc: doc["tree"]["v"].update(a={"t": "size", "v": [2**64]}),
        lambda doc: doc["tree"]["v"].update(a={"t": "float", "v": "1e999"}),
        lambda doc: doc.update(extra=1),
        lambda doc: doc.pop("files"),
    ],
    ids=[
        "offset-2**62",
        "offset-2**64",
        "nul-in-name",
        "non-ascii-name",
        "path-in-name",
        "offset-string",
        "negative",
        "crc-2**32",
        "dim-2**63",
        "dim-2**63-empty",
        "65-dims",
        "file-size-2**70",
        "step-string",
        "world-size-0",
        "id-out-of-range",
        "bytes-not-string",
        "size-2**64",
        "float-node",
        "extra-field",
        "no-files",
    ],
)
def test_malformed_fields_are_refused(tmp_path: Path, edit: Any, allocations: list[int]) -> None:
    """Each malformed field (with a valid checksum) is a CorruptCheckpointError, never a
    ValueError, OverflowError or TypeError, and nothing large is allocated."""
    _saved(tmp_path)
    edit_manifest(tmp_path, 2, edit)
    _refused(tmp_path)
    assert all(n < 1 << 20 for n in allocations)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e300", "1e999", "-5"])
def test_bad_creation_times_are_refused_and_ls_survives(
    tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """json.loads accepts NaN and Infinity: the manifest parser refuses them; `coci ls` used to
    crash formatting a time of 1e300."""
    _saved(tmp_path)
    doc = read_doc(tmp_path, 2)
    doc["created_unix"] = "<time>"
    write_doc(tmp_path, 2, doc, raw={"<time>": value})
    _refused(tmp_path)
    assert cli.main(["ls", str(tmp_path)]) == 0
    assert "damaged manifest" in capsys.readouterr().out


@pytest.mark.parametrize("value", [-1, "7", 1.5, True, None, 2**63, [], {}])
def test_a_malformed_commit_sequence_is_refused(tmp_path: Path, value: Any) -> None:
    """The commit sequence that orders checkpoints is an integer in [0, 2**63), checked like
    every integer field: anything else is refused, naming the field."""
    _saved(tmp_path)
    edit_manifest(tmp_path, 2, lambda doc: doc.__setitem__("sequence", value))
    _refused(tmp_path, match="field sequence")


@pytest.mark.parametrize("where", ["metadata", "tree"])
def test_deeply_nested_json_is_refused(tmp_path: Path, where: str) -> None:
    """100,000 nested arrays used to raise RecursionError out of restore."""
    _saved(tmp_path)
    doc = read_doc(tmp_path, 2)
    deep = "[" * 100_000 + "]" * 100_000
    if where == "metadata":
        doc["metadata"] = {"x": "<deep>"}
    else:
        doc["tree"]["v"]["deep"] = {"t": "list", "v": "<deep>"}
    write_doc(tmp_path, 2, doc, raw={"<deep>": deep})
    _refused(tmp_path)


def test_a_tree_one_level_too_deep_is_refused_and_save_refuses_it_too(tmp_path: Path) -> None:
    """Save refuses what load refuses: a state nested MAX_TREE_DEPTH deep round-trips, one
    level more is refused by save (UnsupportedValueError) and by load (crafted)."""
    from coci_core import UnsupportedValueError
    from coci_core.engine.format.tree import flatten_state

    def nested(depth: int) -> dict[str, Any]:
        state: Any = [1]
        for _ in range(depth - 2):
            state = [state]
        return {"x": state}  # the root dict is one level

    ok = nested(MAX_TREE_DEPTH)
    with CheckpointManager(tmp_path / "ok") as mgr:
        mgr.save(1, ok).wait()
        assert same(mgr.restore(), ok)
    with pytest.raises(UnsupportedValueError, match="nested"):
        flatten_state(nested(MAX_TREE_DEPTH + 1))
    with pytest.raises(UnsupportedValueError, match="nested"):
        flatten_state({"k": {_deep_tuple_key(MAX_TREE_DEPTH): 1}})

    _saved(tmp_path)
    doc = read_doc(tmp_path, 2)
    node: Any = {"t": "list", "v": [1]}
    for _ in range(MAX_TREE_DEPTH - 1):
        node = {"t": "list", "v": [node]}
    doc["tree"]["v"]["epoch"] = node
    write_doc(tmp_path, 2, doc)
    _refused(tmp_path, match="nested")


def _deep_tuple_key(depth: int) -> Any:
    key: Any = (1,)
    for _ in range(depth - 2):
        key = (key,)
    return key


@pytest.mark.parametrize("list_bases", [True, False], ids=["bases-listed", "bases-hidden"])
def test_long_delta_chains_fail_fast_and_fall_back(tmp_path: Path, list_bases: bool) -> None:
    """A chain of 1,200 deltas used to recurse until RecursionError (and 400 steps took 14 s
    as every fallback decoded its chain again): chains are at most 64 steps deep, resolved
    without recursion, and the manager falls back to the newest step within the limit."""
    state = craft_chain(tmp_path, 1200, list_bases=list_bases)
    storage = LocalStorage(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=r"bases|deep"):
        load_checkpoint(storage, 1199)
    if list_bases:
        assert same(load_checkpoint(storage, 63).state, state)  # 64 steps: within the limit
    started = time.perf_counter()
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        assert same(mgr.restore(), state)
        assert mgr.last_restore is not None
        restored = mgr.last_restore.step
    # a manifest that does not list its chain's steps among its bases is inconsistent
    assert restored == (63 if list_bases else 1)
    assert time.perf_counter() - started < 30


def test_a_fallback_loop_does_not_decode_a_damaged_base_again(
    tmp_path: Path, allocations: list[int]
) -> None:
    """With a RestoreCache shared by the steps a fallback loop tries, a base found damaged is
    remembered: the steps above it fail without decoding their chains again."""
    state = craft_chain(tmp_path, 10)
    data = tmp_path / step_dir_name(3) / "data-r0.bin"
    data.write_bytes(b"\xff" * data.stat().st_size)
    storage = LocalStorage(tmp_path)

    def fall_back(cache: Any) -> tuple[int, int]:
        allocations.clear()
        for step in range(9, -1, -1):
            try:
                loaded = load_checkpoint(storage, step, cache=cache)
            except CorruptCheckpointError:
                continue
            assert same(loaded.state, state)
            return step, sum(n == 80000 for n in allocations)  # arrays decoded
        raise AssertionError("nothing restored")

    # arrays allocated: each of 9..4 decodes 0, 1, 2 and fails at 3; 3 fails; 2 is restored
    assert fall_back(None) == (2, 6 * 4 + 4 + 3)
    # with the cache, 9 finds 3 damaged, and 8..3 fail at once
    assert fall_back(restore.RestoreCache(storage)) == (2, 4 + 3)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_data_files_that_are_not_regular_files_are_refused(
    tmp_path: Path, kind: str, allocations: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO as a data file used to hang restore, verify and ls; a symlink to /dev/zero was
    read until memory ran out (here: a manifest claiming a 1 GB piece)."""
    _saved(tmp_path)
    data = tmp_path / step_dir_name(2) / "data-r0.bin"
    data.unlink()
    if kind == "fifo":
        os.mkfifo(data)
    elif kind == "dev-zero":
        data.symlink_to("/dev/zero")

        def claim(doc: dict[str, Any]) -> None:
            t = doc["tensors"][0]
            t["shape"], t["dtype"] = [1 << 30], "uint8"
            t["pieces"][0].update(nbytes=1 << 30, length=1 << 30)
            doc["files"][0]["nbytes"] = 1 << 31

        edit_manifest(tmp_path, 2, claim)
    else:
        data.mkdir()
    _refused(tmp_path, match="regular file")
    assert all(n < 1 << 20 for n in allocations)
    assert cli.main(["ls", str(tmp_path)]) == 0
    assert cli.main(["verify", str(tmp_path)]) == 1
    assert "not a regular file" in capsys.readouterr().out


def test_a_manifest_larger_than_the_limit_is_not_read(tmp_path: Path) -> None:
    """A huge manifest (here a sparse 300 MB file) is refused by its size, before reading."""
    _saved(tmp_path)
    with open(manifest_path(tmp_path, 2), "r+b") as f:
        f.truncate(300 * 1024 * 1024)
    reads: list[str] = []
    storage = HookedStorage(
        LocalStorage(tmp_path),
        lambda op, path: reads.append(path) if op == "read_bytes" else None,
    )
    with pytest.raises(CorruptCheckpointError, match="more than"):
        load_checkpoint(storage, 2)
    assert reads == []


@pytest.mark.parametrize(
    "name", ["step-00000000009", "step-٠٠٠٠٠٠٠٠٠٩", "step-0000000009x", "step-000000009"]
)
def test_non_canonical_step_directories_are_ignored(tmp_path: Path, name: str) -> None:
    """A step directory named with 11 digits or non-ASCII digits used to parse as step 9 and
    then block every restore (step 9's canonical directory does not exist)."""
    states = _saved(tmp_path)
    shutil.copytree(tmp_path / step_dir_name(2), tmp_path / name)
    assert cli.main(["ls", str(tmp_path)]) == 0
    assert cli.main(["verify", str(tmp_path)]) == 0
    assert same(load_checkpoint(LocalStorage(tmp_path), 2).state, states[2])
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        assert mgr.steps() == [1, 2]
        assert same(mgr.restore(), states[2])


def test_unforeseen_errors_become_corrupt_checkpoint_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The safety net: an error no check foresaw (here a decoder's ValueError) still makes a
    CorruptCheckpointError, so the manager falls back."""
    states = _states()
    with CheckpointManager(tmp_path, keep_last=None, compression="lossless") as mgr:
        mgr.save(1, {"w": torch.zeros(4096), **states[1]}).wait()
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        mgr.save(2, states[2]).wait()
    monkeypatch.setattr(read, "needs_base", _raise_value_error)
    with pytest.raises(CorruptCheckpointError, match="ValueError"):
        load_checkpoint(LocalStorage(tmp_path), 1)
    assert verify_checkpoint(LocalStorage(tmp_path), 1) == ["/w"]
    monkeypatch.setattr(steps, "_parse", _raise_value_error)
    with pytest.raises(CorruptCheckpointError, match="ValueError"):
        load_checkpoint(LocalStorage(tmp_path), 2)


def _raise_value_error(*args: Any, **kwargs: Any) -> Any:
    raise ValueError("an unforeseen error")


# --- defect 9: false alarms ---------------------------------------------------------------


def _delete_at(root: Path, step: int, op: str, nth: int = 1) -> HookedStorage:
    """A storage that deletes ``step``'s directory just before its ``nth`` ``op`` call on a
    path of that step (as retention would, manifest first)."""
    prefix = step_dir_name(step) + "/"
    calls = {"n": 0}

    def hook(called: str, path: str) -> None:
        if called == op and path.startswith(prefix):
            calls["n"] += 1
            if calls["n"] == nth:
                manifest_path(root, step).unlink()
                shutil.rmtree(root / step_dir_name(step))

    return HookedStorage(LocalStorage(root), hook)


@pytest.mark.parametrize(
    ("op", "nth"), [("read_into", 1), ("read_bytes", 1), ("exists", 2)], ids=str
)
def test_verify_reports_a_step_removed_while_verifying_as_gone(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    op: str,
    nth: int,
) -> None:
    """Retention deleting a step while `coci verify` reads it is not damage."""
    _saved(tmp_path)
    storage = _delete_at(tmp_path, 1, op, nth)
    monkeypatch.setattr(inputs, "open_storage", lambda target: storage)
    assert cli.main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step 1: removed while verifying (not damaged)" in out
    assert "step 2: ok" in out
    assert "damaged:" not in out


def test_verify_checkpoint_raises_no_checkpoint_for_a_removed_step(tmp_path: Path) -> None:
    _saved(tmp_path)
    with pytest.raises(NoCheckpointError, match="removed"):
        verify_checkpoint(_delete_at(tmp_path, 1, "read_into"), 1)
    # a damaged step that is still there stays damaged
    data = tmp_path / step_dir_name(2) / "data-r0.bin"
    data.write_bytes(b"\xff" * data.stat().st_size)
    assert verify_checkpoint(LocalStorage(tmp_path), 2) == ["/a", "/b"]


@pytest.mark.parametrize(("op", "nth"), [("read_bytes", 1), ("exists", 2)], ids=str)
def test_ls_skips_a_step_removed_under_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    op: str,
    nth: int,
) -> None:
    _saved(tmp_path)
    storage = _delete_at(tmp_path, 1, op, nth)
    monkeypatch.setattr(inputs, "open_storage", lambda target: storage)
    assert cli.main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "damaged" not in out
    lines = [line.split()[0] for line in out.splitlines()[1:]]
    assert lines == ["2"]
