"""What a user trips over on the command line: a missing optional package, a file that is no
checkpoint at all, and the help that lists every command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.commands.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]

# Runs `coci` with the safetensors package made unimportable (as if it were not installed).
_WITHOUT_SAFETENSORS = (
    "import sys\n"
    "sys.modules['safetensors'] = None\n"
    "sys.modules['safetensors.torch'] = None\n"
    "from coci_core.commands.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _coci_without_safetensors(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_SAFETENSORS, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    with CheckpointManager(run) as mgr:
        mgr.save(7, {"w": torch.arange(4.0)}).wait()
    return run


def test_export_to_safetensors_without_the_package_names_the_install(
    run_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "x.safetensors"
    result = _coci_without_safetensors("export", str(run_dir), str(out))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # one line, no traceback
    assert "Traceback" not in result.stderr
    assert "pip install safetensors" in result.stderr
    assert str(out) in result.stderr
    assert not out.exists()
    # a torch.save export needs no safetensors
    pt = tmp_path / "x.pt"
    assert _coci_without_safetensors("export", str(run_dir), str(pt)).returncode == 0
    assert torch.equal(torch.load(pt, weights_only=True)["w"], torch.arange(4.0))


def test_import_of_safetensors_without_the_package_names_the_install(
    run_dir: Path, tmp_path: Path
) -> None:
    src = tmp_path / "x.safetensors"
    assert main(["export", str(run_dir), str(src)]) == 0
    result = _coci_without_safetensors("import", str(src), str(tmp_path / "dest"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "pip install safetensors" in result.stderr


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("f.txt", b"hello, not a checkpoint\n", "is not a torch.save file"),
        ("empty.pt", b"", "is empty"),
    ],
)
def test_import_of_a_file_that_is_no_checkpoint_says_what_import_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, content: bytes, says: str
) -> None:
    src = tmp_path / name
    src.write_bytes(content)
    assert main(["import", str(src), str(tmp_path / "dest")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{src} {says}" in err
    assert "a torch.save file, a .safetensors file or a torch.distributed.checkpoint" in err
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").glob("step*"))


def test_help_lists_every_command() -> None:
    """`coci --help` names plan and simulate beside the others, in its summary too."""
    text = build_parser().format_help()
    for command in ("ls", "verify", "export", "import", "report", "demo", "plan", "simulate"):
        assert f"\n    {command} " in text, command
    summary = text.split("positional arguments")[0]
    assert "simulate" in summary
