"""`coci import`: the step defaults to the one `coci export` recorded (else 0), and every file
it cannot or will not import (missing, garbage, truncated, tampered, or one whose loading would
run code) is one line on stderr and exit code 2; nothing runs and nothing is imported."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.commands.cli import build_parser, main
from tests.harness.states import assert_same

STATE = {"w": torch.arange(6.0), "epoch": 3}


class _Payload:
    """Unpickling this calls os.system (creating ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def exported(tmp_path: Path) -> dict[str, Path]:
    """Step 42 of a run exported as .pt, .safetensors and a DCP directory."""
    run = tmp_path / "run"
    with CheckpointManager(run) as mgr:
        mgr.save(42, STATE).wait()
    outs = {"torch": tmp_path / "e.pt", "safetensors": tmp_path / "e.safetensors"}
    outs["dcp"] = tmp_path / "e-dcp"
    for fmt, out in outs.items():
        assert main(["export", str(run), str(out), "--format", fmt]) == 0
    return outs


def _steps(directory: Path) -> list[int]:
    with CheckpointManager(directory, keep_last=None) as mgr:
        return mgr.steps()


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_import_without_step_takes_the_exported_step(
    fmt: str, exported: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file coci exported from step 42 is imported as step 42 when --step is not given."""
    dest = tmp_path / f"back-{fmt}"
    assert main(["import", str(exported[fmt]), str(dest)]) == 0
    assert "as step 42" in capsys.readouterr().out
    assert _steps(dest) == [42]
    with CheckpointManager(dest) as mgr:
        state = mgr.restore(42)
    if fmt == "safetensors":  # only the arrays live in its tensors; the note restores the rest
        assert torch.equal(state["w"], STATE["w"])
    else:
        assert_same(state, STATE)
    assert main(["import", str(exported[fmt]), str(dest), "--step", "7"]) == 0
    assert _steps(dest) == [7, 42]


def test_import_without_step_of_another_tools_file_is_step_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plain torch.save file records no step: step 0, and the help says so."""
    src = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, src)
    assert main(["import", str(src), str(tmp_path / "d")]) == 0
    assert _steps(tmp_path / "d") == [0]
    (sub,) = (
        a.choices["import"]
        for a in build_parser()._actions
        if hasattr(a, "choices") and isinstance(a.choices, dict) and "import" in a.choices
    )
    text = " ".join(sub.format_help().split())
    assert "default: the step `coci export` recorded in SRC, else 0" in text


def _refused(src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], *words: str) -> None:
    capsys.readouterr()
    dest = tmp_path / "dest"
    assert main(["import", str(src), str(dest)]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err and captured.out == ""
    assert err.count("\n") == 1 and err.startswith("coci: "), err
    for word in words:
        assert word in err, err
    assert not dest.exists() or not any(dest.glob("step*"))


def test_every_refused_or_unreadable_source_is_one_line_and_exit_2(
    exported: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Missing, garbage, code-running pickles (torch.save'd and raw), truncated safetensors and
    a DCP directory whose .metadata was tampered with: exit 2, one line; the payload never
    runs."""
    marker = tmp_path / "marker"
    _refused(tmp_path / "nope.pt", tmp_path, capsys, "no such file")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(bytes(range(256)) * 4)
    _refused(garbage, tmp_path, capsys, "garbage.pt")
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(1), "x": _Payload(marker)}, evil)
    _refused(evil, tmp_path, capsys, "system", "without running code")
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps(_Payload(marker), protocol=2))
    _refused(raw, tmp_path, capsys, "system")
    data = exported["safetensors"].read_bytes()
    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(data[: len(data) - 7])
    _refused(truncated, tmp_path, capsys, "cut.safetensors")
    meta = exported["dcp"] / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    _refused(exported["dcp"], tmp_path, capsys, ".metadata")
    meta.write_bytes(pickle.dumps(_Payload(marker)))
    _refused(exported["dcp"], tmp_path, capsys, "refusing to import", "system")
    assert not marker.exists()
