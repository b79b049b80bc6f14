"""What a newcomer meets on the command line (issue 42): ``coci ... | head`` ends quietly, every
subcommand's ``--help`` says what it does, and ``coci verify --remote`` checks the remote tier."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.commands.cli import BROKEN_PIPE_EXIT
from coci_core.engine.format.manifest import step_dir_name
from coci_core.planner.schedule import ExpectedOverhead
from coci_core.telemetry import JsonlTelemetry
from tests.harness.processes import child_env, module, run

COMMANDS = ("ls", "verify", "export", "import", "report", "demo", "plan", "simulate")


def _coci_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``coci args`` with its stdout a pipe whose reader has gone (as ``| head -1`` is once
    it read its line): every write to it fails, deterministically."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            module("coci_core.commands.cli", *args),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            timeout=120,
        )
    finally:
        os.close(write_end)


def _run_dir(directory: Path) -> Path:
    """A checkpoint directory with steps and the telemetry ``coci report`` reads."""
    with CheckpointManager(directory) as mgr:
        for step in (2, 4):
            mgr.save(step, {"w": torch.arange(4.0) + step}).wait()
    tel = JsonlTelemetry(directory / "telemetry.jsonl")
    tel.record_plan(
        1,
        SimpleNamespace(
            policy="every_n_steps",
            objective="time",
            next_steps=(2, 4),
            interval_steps=2,
            mtbf_s=3600.0,
            mtbf_source="given",
            costs={"step_time_s": 0.1},
            cost_sources={},
            expected_overhead=ExpectedOverhead(
                objective="time",
                objective_s=1.0,
                wall_s=1.0,
                daly_objective_s=2.0,
                daly_wall_s=2.0,
                plan=None,  # type: ignore[arg-type]
                daly=None,  # type: ignore[arg-type]
            ),
        ),
    )
    tel.close()
    with (directory / "telemetry.jsonl").open("a") as f:
        for step in (2, 4):
            f.write(json.dumps({"type": "save", "step": step, "outcome": "committed"}) + "\n")
    return directory


@pytest.mark.parametrize("command", ["report", "ls"])
def test_coci_into_a_closed_pipe_ends_quietly(tmp_path: Path, command: str) -> None:
    """``coci report DIR | head -1``: no "Broken pipe", no traceback, exit 141 (a shell's for
    SIGPIPE), whatever the command had left to print."""
    directory = _run_dir(tmp_path / "run")
    assert run(module("coci_core.commands.cli", command, str(directory))).returncode == 0
    proc = _coci_into_closed_pipe(command, str(directory))
    assert proc.stderr == "", proc.stderr
    assert proc.returncode == BROKEN_PIPE_EXIT


def _description(help_text: str) -> str:
    """The paragraph between a help's usage and its first section of arguments."""
    after_usage = help_text.split("\n\n", 1)[1] if "\n\n" in help_text else ""
    return re.split(r"^(?:positional arguments|options):$", after_usage, flags=re.M)[0].strip()


def test_every_subcommand_says_what_it_does() -> None:
    """``coci --help`` gives every subcommand a line, and each subcommand's ``--help`` opens
    with a description (``demo``'s says it kills a Lightning run at a step, the engine one
    in a save); ``verify`` takes ``--remote``, with its help."""
    top = run(module("coci_core.commands.cli", "--help"), check=True).stdout
    for command in COMMANDS:
        (line,) = [x for x in top.splitlines() if x.strip().startswith(command + " ")]
        assert line.split(command, 1)[1].strip(), line
    for command in COMMANDS:
        text = run(module("coci_core.commands.cli", command, "--help"), check=True).stdout
        assert len(_description(text)) > 40, f"coci {command} --help:\n{text}"
    demo = run(module("coci_core.commands.cli", "demo", "--help"), check=True).stdout
    assert "Lightning" in _description(demo) and "--engine" in _description(demo)
    verify = run(module("coci_core.commands.cli", "verify", "--help"), check=True).stdout
    assert re.search(r"--remote URL\s+a remote tier", verify), verify


def test_verify_remote_checks_the_remote_tier_too(tmp_path: Path) -> None:
    """``coci verify DIR --remote URL`` verifies both tiers' checkpoints, each line naming
    its tier; damage on the remote one is exit 1."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    with CheckpointManager(local, remote=str(remote), remote_upload_every=1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.randn(64)}).wait()
    ok = run(module("coci_core.commands.cli", "verify", str(local), "--remote", str(remote)))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = ok.stdout.splitlines()
    assert "step 2: ok" in lines and "remote step 2: ok" in lines, ok.stdout
    manifest = json.loads((remote / step_dir_name(2) / "manifest.json").read_text())
    piece = manifest["tensors"][0]["pieces"][0]
    data = remote / step_dir_name(2) / piece["file"]
    raw = bytearray(data.read_bytes())
    raw[piece["offset"] + 3] ^= 0x10
    data.write_bytes(bytes(raw))
    bad = run(module("coci_core.commands.cli", "verify", str(local), "--remote", str(remote)))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "remote step 2: 1 damaged" in bad.stdout.splitlines(), bad.stdout
    assert "step 2: ok" in bad.stdout.splitlines()
    # --step: the tier that holds it
    args = ("verify", str(local), "--remote", str(remote), "--step", "2")
    one = run(module("coci_core.commands.cli", *args))
    assert one.returncode == 1 and "remote step 2: 1 damaged" in one.stdout, one.stdout


@pytest.mark.parametrize(
    "layout",
    [
        lambda sd: {"model": sd, "optim": {"lr": 0.1}, "step": 3},  # a loop's own
        lambda sd: {"models": [sd], "optimizers": [{}]},  # Accelerate's
    ],
)
def test_export_weights_only_of_a_loop_s_and_accelerate_s_layout(
    tmp_path: Path, layout: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    from coci_core.commands.cli import main

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(3, layout(model.state_dict())).wait()
    out = tmp_path / "w.safetensors"
    assert main(["export", str(tmp_path / "run"), str(out), "--weights-only"]) == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    fresh.load_state_dict(load_file(out))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_export_weights_only_of_an_unknown_layout_says_where_it_looks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from coci_core.commands.cli import main

    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(3, {"net": {"w": torch.zeros(2)}}).wait()
    out = tmp_path / "w.safetensors"
    assert main(["export", str(tmp_path / "run"), str(out), "--weights-only"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'state_dict'" in err and "'net'" in err, err
    assert not out.exists()


def test_a_directory_next_to_the_checkpoints_says_where_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``coci ls`` of the project folder (the adapters write into its ``coci`` folder) or of one
    step's directory said only "no committed checkpoints": it says where they are, on stderr;
    ``verify --step`` of a missing step lists the steps there are, as ``export`` does."""
    from coci_core.commands.cli import main

    with CheckpointManager(tmp_path / "proj" / "coci") as mgr:
        mgr.save(3, {"w": torch.ones(2)}).wait()
        mgr.save(5, {"w": torch.ones(2)}).wait()
    assert main(["ls", str(tmp_path / "proj")]) == 1
    err = capsys.readouterr().err
    assert f"did you mean {tmp_path / 'proj' / 'coci'}?" in err, err
    assert main(["verify", str(tmp_path / "proj" / "coci" / step_dir_name(3))]) == 1
    err = capsys.readouterr().err
    assert f"is one checkpoint; give the directory holding it, {tmp_path / 'proj' / 'coci'}" in err
    assert main(["verify", "--step", "9", str(tmp_path / "proj" / "coci")]) == 2
    assert "(its steps: 3, 5)" in capsys.readouterr().err


def test_export_format_transformers_of_another_layout_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loop's checkpoint exported with ``--format transformers`` told the user to "point
    CociCallback at its own directory" (exit 1): it says which formats fit (exit 2)."""
    from coci_core.commands.cli import main

    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(3, {"w": torch.ones(2)}).wait()
    assert (
        main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--format", "transformers"])
        == 2
    )
    err = capsys.readouterr().err
    assert "step 3 was written by a CheckpointManager: export it with --format torch" in err, err
