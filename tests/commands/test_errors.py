"""Bad input is one line on stderr and exit code 2, never a traceback; `coci import` does not
replace a step without --force."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.commands.cli import main
from tests.harness.states import assert_same


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A checkpoint directory with step 5."""
    with CheckpointManager(tmp_path / "ck") as mgr:
        mgr.save(5, {"w": torch.arange(6.0), "epoch": 1}).wait()
    return tmp_path / "ck"


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> str:
    """``coci argv`` exits 2 with one line on stderr containing ``words``."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("coci"), err
    for word in words:
        assert word in err, err
    return err


def test_missing_and_unreadable_import_sources(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing file, garbage .pt / .safetensors files and a directory that is not a DCP
    checkpoint: exit 2, one line, nothing imported."""
    dest = str(tmp_path / "dest")
    _fails(["import", str(tmp_path / "nope.pt"), dest, "--step", "1"], capsys, "no such file")
    (tmp_path / "junk.pt").write_bytes(b"this is not a checkpoint\n" * 10)
    _fails(["import", str(tmp_path / "junk.pt"), dest, "--step", "1"], capsys, "junk.pt")
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    _fails(["import", str(tmp_path / "junk.safetensors"), dest, "--step", "1"], capsys, "junk")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hello")
    _fails(["import", str(tmp_path / "plain"), dest, "--step", "1"], capsys, ".metadata")
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").glob("step*"))


@pytest.mark.parametrize("command", ["ls", "verify", "export", "report"])
def test_a_missing_directory_is_named(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ls, verify, export and report on a directory that does not exist say so, exit 2."""
    argv = [command, str(tmp_path / "missing")]
    if command == "export":
        argv.append(str(tmp_path / "out.pt"))
    _fails(argv, capsys, "missing", "does not exist")
    (tmp_path / "file").write_text("x")
    argv[1] = str(tmp_path / "file")
    _fails(argv, capsys, "not a directory")


def test_bad_steps(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --step that is not a number, is negative, or is not committed: exit 2, one line."""
    out = str(tmp_path / "o.pt")
    _fails(["verify", str(ckpt), "--step", "x"], capsys, "--step", "not a step number")
    _fails(["export", str(ckpt), out, "--step", "-3"], capsys, "--step", "[0, 2**63-1]")
    _fails(["import", out, str(ckpt), "--step", "1.5"], capsys, "--step")
    _fails(["import", out, str(ckpt), "--step"], capsys, "--step", "expected one argument")
    _fails(["verify", str(ckpt), "--step", "7"], capsys, "7")
    _fails(["export", str(ckpt), out, "--step", "7"], capsys, "step 7", "its steps: 5")
    _fails(["export", str(ckpt), str(tmp_path / "no" / "o.pt")], capsys, "does not exist")
    _fails(["frobnicate"], capsys, "invalid choice")
    assert not Path(out).exists()


def test_import_over_an_existing_step_needs_force(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Importing as a committed step is refused (the step unchanged) unless --force."""
    src = tmp_path / "new.pt"
    torch.save({"w": torch.ones(2)}, src)
    _fails(["import", str(src), str(ckpt), "--step", "5"], capsys, "step 5", "--force")
    with CheckpointManager(ckpt) as mgr:
        assert_same(mgr.restore(), {"w": torch.arange(6.0), "epoch": 1})
    assert main(["import", str(src), str(ckpt), "--step", "5", "--force"]) == 0
    with CheckpointManager(ckpt) as mgr:
        assert mgr.steps() == [5]
        assert_same(mgr.restore(), {"w": torch.ones(2)})


def test_export_never_replaces_what_is_not_its_file(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """OUT a FIFO, a symbolic link, a directory for a file format, a file for a directory
    format: refused by name, exit 2, OUT left as it was (before: each was replaced by the
    export's file, a device node too); a negative --rank is refused (it read the last rank's
    state, as Python indexes)."""
    import os
    import stat

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _fails(["export", str(ckpt), str(fifo)], capsys, "not a regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    target = tmp_path / "target.pt"
    link = tmp_path / "link.pt"
    link.symlink_to(target)
    _fails(["export", str(ckpt), str(link)], capsys, "symbolic link")
    assert link.is_symlink() and not target.exists()
    (tmp_path / "adir").mkdir()
    _fails(["export", str(ckpt), str(tmp_path / "adir")], capsys, "not a regular file")
    (tmp_path / "a.pt").write_bytes(b"x")
    _fails(["export", str(ckpt), str(tmp_path / "a.pt"), "--format", "dcp"], capsys, "directory")
    assert (tmp_path / "a.pt").read_bytes() == b"x"
    _fails(["export", str(ckpt), str(tmp_path / "out.pt"), "--rank", "-1"], capsys, "--rank")
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_an_export_that_cannot_write_says_so_in_one_line(
    ckpt: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A target the writer cannot create (procfs takes no new file): one line naming it,
    exit 1, never a traceback (before: torch's, safetensors' and DCP's own errors, with their
    tracebacks)."""
    out = f"/proc/coci-export-test-{fmt}"
    capsys.readouterr()
    assert main(["export", str(ckpt), out, "--format", fmt]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"coci: cannot write {out}") and err.count("\n") == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize("weights_only", [False, True])
def test_export_writes_through_no_link_planted_beside_out(
    ckpt: Path, tmp_path: Path, weights_only: bool
) -> None:
    """A symbolic link planted at the name an export used to write first (``.OUT.coci-tmp``)
    is not written through: the file it points to stays as it was, and OUT is a new regular
    file (before: the link's target was overwritten and OUT became the link)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (out_dir / ".model.pt.coci-tmp").symlink_to(victim)
    argv = ["export", str(ckpt), str(out_dir / "model.pt")]
    if weights_only:
        argv.append("--weights-only")
    code = main(argv)
    assert victim.read_bytes() == b"keep me"
    out = out_dir / "model.pt"
    if code == 0:
        assert out.is_file() and not out.is_symlink()
    assert not list(out_dir.glob(".model.pt.*.coci-tmp"))  # no temporary file left
