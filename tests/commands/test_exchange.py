"""`coci export` then `coci import` gives back the same state, in every export format; an
exported .pt loads with plain ``torch.load``; a plain safetensors file imports flat."""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from coci_core import CheckpointManager
from coci_core.commands.cli import main
from coci_core.engine.format.int_lists import holds_ints
from coci_core.interop.swap import file_beside, remove_leftovers
from tests.harness.states import assert_same, tiny_model_state

FORMATS = {
    "torch": ("state.pt", []),
    "safetensors": ("state.safetensors", []),
    "dcp": ("state_dcp", ["--format", "dcp"]),
}


def realistic_state() -> dict[str, Any]:
    """A nested model + Adam state (int keys), numpy RNG state, per-step scalars."""
    state = tiny_model_state(3)
    state["rng"] = {
        "numpy": np.random.RandomState(7).get_state(),  # a tuple with a uint32 array
        "torch": torch.get_rng_state(),
        "python": random.Random(7).getstate(),  # 625 ints: an "ints" node
    }
    state["loop"] = {
        "step": 120,
        "lr": 1e-3,
        "name": "run-a",
        "best": float("inf"),
        "ema": np.float32(0.25),
        "counts": np.arange(6, dtype=np.int16).reshape(2, 3),
        "ids": list(range(-3, 97)),  # an "ints" node of int8
        "history": [{"step": s, "loss": 1.0 / (s + 1)} for s in range(3)],
        "tag": b"\x00\xff",
        "dtype": torch.bfloat16,
        "shape": torch.Size([2, 3]),
    }
    state["half"] = torch.randn(4, 4).to(torch.bfloat16)
    return state


def _restored(directory: Path) -> dict[str, Any]:
    with CheckpointManager(directory) as mgr:
        return mgr.restore()


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A coci checkpoint of the realistic state at step 120, and that state as restored."""
    with CheckpointManager(tmp_path / "src") as mgr:
        mgr.save(120, realistic_state()).wait()
    return tmp_path / "src", _restored(tmp_path / "src")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_export_then_import_restores_the_same_state(
    fmt: str, saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Bitwise tensors, the same types (int keys, tuples, numpy arrays and scalars, bytes,
    dtypes, OrderedDict with its _metadata) after export + import, in every format; an export
    over an earlier one replaces it without a word (a DCP directory's: before, torch's
    "Detected an existing checkpoint ... overwriting" warning, on five lines of stderr)."""
    src, original = saved
    name, extra = FORMATS[fmt]
    for _ in range(2):
        assert main(["export", str(src), str(tmp_path / name), *extra]) == 0
    assert main(["import", str(tmp_path / name), str(tmp_path / "back"), "--step", "120"]) == 0
    back = _restored(tmp_path / "back")
    assert_same(back, original)
    assert_same(back, realistic_state())
    assert isinstance(back["loop"]["counts"], np.ndarray)
    assert type(back["loop"]["ema"]) is np.float32
    assert isinstance(back["model"], OrderedDict)
    assert back["model"]._metadata == original["model"]._metadata  # type: ignore[attr-defined]
    assert list(back["optim"]["state"]) == [0, 1, 2, 3, 4, 5]
    assert back["rng"]["python"] == random.Random(7).getstate()
    assert type(back["rng"]["python"][1]) is tuple
    assert type(back["loop"]["ids"]) is list and back["loop"]["ids"] == list(range(-3, 97))


def test_exported_pt_loads_with_plain_torch_load(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Plain torch.load (weights_only=True by default) reads the export: numpy arrays are
    tensors of the same bytes, numpy scalars numbers; the note is a record beside the state."""
    src, original = saved
    out = tmp_path / "state.pt"
    assert main(["export", str(src), str(out)]) == 0
    loaded = torch.load(out)
    rng = loaded["rng"]["numpy"]
    assert isinstance(rng, tuple) and rng[0] == "MT19937"
    assert isinstance(rng[1], torch.Tensor) and rng[1].dtype == torch.uint32
    assert rng[1].numpy().tobytes() == original["rng"]["numpy"][1].tobytes()
    assert loaded["loop"]["ema"] == 0.25 and type(loaded["loop"]["ema"]) is float
    assert loaded["rng"]["python"] == random.Random(7).getstate()  # a tuple of ints, as saved
    assert torch.equal(loaded["model"]["0.weight"], original["model"]["0.weight"])
    assert loaded["optim"]["state"][0]["step"] == original["optim"]["state"][0]["step"]
    assert sorted(loaded) == sorted(original)
    with zipfile.ZipFile(out) as archive:
        note = [n for n in archive.namelist() if n.endswith("/coci_export.json")]
        assert len(note) == 1 and json.loads(archive.read(note[0]))["step"] == 120
        assert holds_ints(json.loads(archive.read(note[0]))["tree"])  # the state's ints: compact


def test_exported_safetensors_keeps_readable_names_and_the_tree(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Other tools see one tensor per array by its path; the tree is in the metadata; a
    safetensors file without coci's note imports flat, as before."""
    src, original = saved
    out = tmp_path / "state.safetensors"
    assert main(["export", str(src), str(out)]) == 0
    with safe_open(str(out), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.0.weight"), original["model"]["0.weight"])
        assert torch.equal(
            f.get_tensor("optim.state.0.exp_avg"), original["optim"]["state"][0]["exp_avg"]
        )
        note = json.loads(f.metadata()["coci_export"])
    assert note["step"] == 120 and note["tree"]["t"] == "dict"
    # a file from another tool (no note) still imports as its flat names, in its order
    tensors = {"a.weight": torch.randn(3, 2), "b": torch.arange(4)}
    save_file(tensors, str(tmp_path / "other.safetensors"), metadata={"format": "pt"})
    other = str(tmp_path / "other.safetensors")
    assert main(["import", other, str(tmp_path / "flat"), "--step", "1"]) == 0
    assert_same(_restored(tmp_path / "flat"), tensors)


def _tamper(out: Path, fmt: str, change: Any) -> None:
    """Rewrite the note of an exported file or directory through ``change(note)``."""
    if fmt == "torch":
        with zipfile.ZipFile(out) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/coci_export.json"))
            note = json.loads(archive.read(name))
        torch.save(torch.load(out), out)  # the same state, without the note
        with zipfile.ZipFile(out, "a") as archive:
            prefix = archive.namelist()[0].split("/")[0]
            archive.writestr(f"{prefix}/coci_export.json", json.dumps(change(note)))
    elif fmt == "safetensors":
        with safe_open(str(out), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        note = json.dumps(change(json.loads(metadata["coci_export"])))
        save_file(tensors, str(out), metadata={**metadata, "coci_export": note})
    else:
        path = out / "coci_export.json"
        path.write_text(json.dumps(change(json.loads(path.read_text()))))


def _misplaced(note: Any) -> Any:
    at = note["leaves"][0]["at"]
    note["leaves"][0]["at"] = (
        [99, 0] if isinstance(at, list) and not isinstance(at[0], str) else "nothing"
    )
    return note


def _wrong_kind(note: Any) -> Any:
    note["leaves"][0]["kind"] = "ndarray"  # the tree says tensor
    return note


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("change", [_misplaced, _wrong_kind], ids=["misplaced", "wrong-kind"])
def test_a_tampered_note_is_refused_not_followed(
    fmt: str,
    change: Any,
    saved: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A note naming an array the file does not hold, or contradicting its own tree, is a
    one-line error (exit 2) in every format; nothing is imported."""
    src, _ = saved
    name, extra = FORMATS[fmt]
    out = tmp_path / name
    assert main(["export", str(src), str(out), *extra]) == 0
    _tamper(out, fmt, change)
    capsys.readouterr()
    assert main(["import", str(out), str(tmp_path / "back"), "--step", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert ("leads nowhere" in err or "lacks" in err) if change is _misplaced else "array 0" in err
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_torch_saved_values_round_trip_with_allow_torch_save(fmt: str, tmp_path: Path) -> None:
    """A value coci keeps only as a torch.save'd leaf (a set) comes back with
    `coci import --allow-torch-save`, in every format."""
    state = {"seen": {1, 2, 3}, "w": torch.arange(4)}
    with CheckpointManager(tmp_path / "src", allow_torch_save=True) as mgr:
        mgr.save(2, state).wait()
    name, extra = FORMATS[fmt]
    assert main(["export", str(tmp_path / "src"), str(tmp_path / name), *extra]) == 0
    argv = ["import", str(tmp_path / name), str(tmp_path / "back"), "--step", "2"]
    assert main([*argv, "--allow-torch-save"]) == 0
    with CheckpointManager(tmp_path / "back", allow_torch_save=True) as mgr:
        assert_same(mgr.restore(), state)


def _note_step(out: Path) -> int:
    return int(json.loads((out / "coci_export.json").read_text())["step"])


def test_a_dcp_export_is_written_beside_and_swapped_in_whole(tmp_path: Path) -> None:
    """An export over an earlier one never writes into it: the new one is written beside and
    swapped in whole, so an export killed midway (or racing another of a different step)
    leaves one whole export, its data and note of one step. Here the earlier export's note is
    a FIFO, where the in-place writer (before) blocked after it had written the new step's
    data over the old, and a kill then left step 8's data under no note."""
    with CheckpointManager(tmp_path / "src") as mgr:
        for step in (4, 8):
            mgr.save(step, {"w": torch.full((3,), float(step)), "step": step}).wait()
    out = tmp_path / "out_dcp"
    assert main(["export", str(tmp_path / "src"), str(out), "--format", "dcp", "--step", "4"]) == 0
    assert _note_step(out) == 4
    (out / "coci_export.json").unlink()
    os.mkfifo(out / "coci_export.json")
    args = ["export", str(tmp_path / "src"), str(out), "--format", "dcp", "--step", "8"]
    done: list[int] = []
    export = threading.Thread(target=lambda: done.append(main(args)), daemon=True)
    export.start()
    export.join(timeout=60)
    if export.is_alive():  # the old writer, blocked on the FIFO: let it go, then fail
        os.close(os.open(out / "coci_export.json", os.O_RDONLY | os.O_NONBLOCK))
        export.join(timeout=60)
    assert done == [0] and _note_step(out) == 8
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask  # as mkdir makes it (mkdtemp's: 0700)
    assert main(["import", str(out), str(tmp_path / "back"), "--step", "8"]) == 0
    assert_same(_restored(tmp_path / "back"), {"w": torch.full((3,), 8.0), "step": 8})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "out_dcp", "src"]


def test_a_dcp_export_never_replaces_a_directory_of_other_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with CheckpointManager(tmp_path / "src") as mgr:
        mgr.save(4, {"w": torch.zeros(3)}).wait()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep me")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "src"), str(mine), "--format", "dcp"]) == 2
    err = capsys.readouterr().err
    assert "is not an earlier coci export" in err and err.count("\n") == 1, err
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"]


def test_two_dcp_exports_at_once_into_one_directory_leave_one_whole(tmp_path: Path) -> None:
    """Two exports of different steps racing into one OUT: both succeed and OUT is one of
    them whole, its data of its note's step (before: both exited 0 and OUT was left without
    its ``.metadata`` or its note, or with one step's data under the other's note)."""
    with CheckpointManager(tmp_path / "src") as mgr:
        for step in (4, 8):
            mgr.save(step, {"w": torch.full((200_000,), float(step)), "step": step}).wait()
    out = tmp_path / "out_dcp"
    codes: list[int] = []

    def export(step: int) -> None:
        args = [str(tmp_path / "src"), str(out), "--format", "dcp", "--step", str(step)]
        codes.append(main(["export", *args]))

    for attempt in range(4):
        codes.clear()
        exports = [threading.Thread(target=export, args=(step,)) for step in (4, 8)]
        for thread in exports:
            thread.start()
        for thread in exports:
            thread.join()
        assert codes == [0, 0]
        back = tmp_path / f"back{attempt}"
        assert main(["import", str(out), str(back)]) == 0
        state = _restored(back)
        assert float(state["w"][0]) == state["step"] == _note_step(out)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_dcp_export_has_the_mode_of_a_made_directory_or_of_the_one_it_replaces(
    tmp_path: Path,
) -> None:
    """The export written beside OUT and swapped in is not left private (before: 0700, the
    mode of ``tempfile.mkdtemp``, so other users and tools could not read the export); a new
    OUT has the mode ``mkdir`` gives, an export over an earlier one keeps that one's mode."""
    with CheckpointManager(tmp_path / "src") as mgr:
        mgr.save(4, {"w": torch.zeros(3)}).wait()
    made = tmp_path / "made"
    made.mkdir()
    out = tmp_path / "out_dcp"
    assert main(["export", str(tmp_path / "src"), str(out), "--format", "dcp"]) == 0
    assert out.stat().st_mode & 0o777 == made.stat().st_mode & 0o777 != 0o700
    out.chmod(0o750)
    assert main(["export", str(tmp_path / "src"), str(out), "--format", "dcp"]) == 0
    assert out.stat().st_mode & 0o777 == 0o750 and _note_step(out) == 4


def test_a_dcp_export_into_the_working_directory_is_written_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``coci export RUN . --format dcp``: the working directory cannot be swapped (renaming
    ``.`` fails with EBUSY, and a shell would be left in a removed directory), so the export is
    written into it; a second export of another step there replaces the first's files."""
    with CheckpointManager(tmp_path / "src") as mgr:
        for step in (4, 8):
            mgr.save(step, {"w": torch.full((3,), float(step)), "step": step}).wait()
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for step in (4, 8):
        args = ["export", str(tmp_path / "src"), ".", "--format", "dcp", "--step", str(step)]
        assert main(args) == 0
        assert _note_step(here) == step and (here / ".metadata").is_file()
    assert Path.cwd() == here and here.is_dir()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".coci-tmp")]
    assert main(["import", str(here), str(tmp_path / "back"), "--step", "8"]) == 0
    assert_same(_restored(tmp_path / "back"), {"w": torch.full((3,), 8.0), "step": 8})


def test_a_trainers_own_checkpoint_directory_is_not_replaced_by_an_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--format transformers`` replaces an earlier export whole; a Trainer's own
    ``checkpoint-N`` (its ``trainer_state.json`` beside a tokenizer's files and
    ``training_args.bin``) is no export of coci's, and is refused, naming what it holds."""
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(4, {"w": torch.zeros(3)}).wait()
    checkpoint = tmp_path / "checkpoint-500"
    checkpoint.mkdir()
    for name in ("trainer_state.json", "model.safetensors", "tokenizer.json", "training_args.bin"):
        (checkpoint / name).write_text("the user's")
    capsys.readouterr()
    args = ["export", str(tmp_path / "run"), str(checkpoint), "--format", "transformers"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json, training_args.bin" in err and err.count("\n") == 1, err
    assert sorted(p.read_text() for p in checkpoint.iterdir()) == ["the user's"] * 4


def test_a_link_named_as_an_earlier_exports_note_is_no_mark_of_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory of the user's files holding a symbolic link named ``coci_export.json`` is
    not taken for an earlier export (which the export replaces whole): refused, untouched."""
    with CheckpointManager(tmp_path / "src") as mgr:
        mgr.save(4, {"w": torch.zeros(3)}).wait()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep me")
    (mine / "coci_export.json").symlink_to(mine / "thesis.tex")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "src"), str(mine), "--format", "dcp"]) == 2
    err = capsys.readouterr().err
    assert "is not an earlier coci export" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in mine.iterdir()) == ["coci_export.json", "thesis.tex"]


def test_an_export_killed_between_the_two_renames_loses_nothing_and_is_cleaned_up(
    tmp_path: Path,
) -> None:
    """The swap of a system without ``renameat2`` (two renames), SIGKILLed between them: OUT
    is gone, the earlier export lies whole in a directory beside it. The next export to OUT
    puts it back, then removes what killed exports left (before: both directories stayed
    beside OUT for good, and OUT stayed missing until an export wrote it anew), and leaves a
    live export's directory (locked) and anything else beside OUT alone."""
    with CheckpointManager(tmp_path / "src") as mgr:
        for step in (4, 8):
            mgr.save(step, {"w": torch.full((3,), float(step)), "step": step}).wait()
    out = tmp_path / "out_dcp"
    assert main(["export", str(tmp_path / "src"), str(out), "--format", "dcp", "--step", "4"]) == 0
    child = Path(__file__).with_name("_export_kill_child.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, str(child), str(tmp_path / "src"), str(out), "8"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert not out.exists()
    left = sorted(p for p in tmp_path.iterdir() if p.name.endswith(".coci-tmp"))
    assert len(left) == 2  # the new export, written whole, and the earlier one moved aside
    assert [_note_step(p / "old") for p in left if (p / "old").is_dir()] == [4]
    live = tmp_path / ".out_dcp.0123456789ab.coci-tmp"  # a live export's, locked
    live.mkdir()
    (tmp_path / ".out_dcp.mine.coci-tmp").mkdir()  # not of coci's pattern: a user's
    lock = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert remove_leftovers(out, "dcp") == left
        assert _note_step(out) == 4  # the earlier export, back whole
        args = ["export", str(tmp_path / "src"), str(out), "--format", "dcp", "--step", "8"]
        assert main(args) == 0 and _note_step(out) == 8
    finally:
        os.close(lock)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [
        live.name,
        ".out_dcp.mine.coci-tmp",
    ]
    assert main(args) == 0 and _note_step(out) == 8  # unlocked now: a killed export's
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [
        ".out_dcp.mine.coci-tmp"
    ]


@pytest.mark.parametrize(
    ("name", "args"),
    [("out.pt", []), ("out.safetensors", []), ("out.pt", ["--weights-only"])],
    ids=["torch", "safetensors", "weights-only"],
)
def test_a_file_exports_leftovers_are_removed_by_the_next_export_to_out(
    tmp_path: Path, name: str, args: list[str]
) -> None:
    """The temporary file of a ``.pt`` or ``.safetensors`` export killed midway
    (``.OUT.<12 hex digits>.coci-tmp``, unlocked) is removed by the next export to OUT (before,
    it stayed for good); a live export's (locked), another OUT's, a directory export's and a
    user's file of another name are left."""
    with CheckpointManager(tmp_path / "src") as mgr:
        mgr.save(4, {"model": {"w": torch.full((3,), 4.0)}, "step": 4}).wait()
    out = tmp_path / name
    killed = tmp_path / f".{name}.0123456789ab.coci-tmp"
    killed.write_bytes(b"half an export")
    kept = [
        tmp_path / f".{name}.mine.coci-tmp",  # not of coci's pattern: a user's
        tmp_path / f".other{name}.abcdef012345.coci-tmp",  # another OUT's
    ]
    for path in kept:
        path.write_bytes(b"keep me")
    directory = tmp_path / f".{name}.0000000000aa.coci-tmp"  # a directory export's
    directory.mkdir()
    with file_beside(out) as live:  # a live export's, as an export makes it
        assert re.fullmatch(rf"\.{re.escape(name)}\.[0-9a-f]{{12}}\.coci-tmp", live.name)
        assert main(["export", str(tmp_path / "src"), str(out), *args]) == 0
        assert not killed.exists() and live.is_file()
    assert out.is_file() and not live.exists()
    left = sorted(p for p in tmp_path.iterdir() if p.name.endswith(".coci-tmp"))
    assert left == sorted([*kept, directory])
    assert all(p.read_bytes() == b"keep me" for p in kept)


def test_a_leftover_holding_no_export_is_not_put_in_outs_place(tmp_path: Path) -> None:
    """Only an earlier export of the format is put back at a missing OUT: a directory of
    other files in a leftover's ``old`` (planted, or of another format) is not made OUT
    (where the export would then refuse it), nor removed: it may be the only copy of what was
    at OUT."""
    out = tmp_path / "out_dcp"
    planted = tmp_path / ".out_dcp.00000000abcd.coci-tmp" / "old"
    planted.mkdir(parents=True)
    (planted / "thesis.tex").write_text("not an export")
    assert remove_leftovers(out, "dcp") == []
    assert not out.exists() and (planted / "thesis.tex").read_text() == "not an export"
