"""The coci command line: ls, verify (exit 1 naming the bad tensor), export, demo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coci_core import CheckpointManager
from coci_core.commands.cli import main
from coci_core.engine.format.manifest import step_dir_name
from tests.harness.processes import module, run
from tests.harness.states import assert_same, tiny_model_state
from tests.telemetry.test_numbers import check_one_set_of_numbers


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """Two committed steps of a small model state."""
    with CheckpointManager(tmp_path / "ck", keep_last=None) as mgr:
        mgr.save(5, tiny_model_state(0))
        mgr.save(9, tiny_model_state(1))
        mgr.wait()
    return tmp_path / "ck"


def test_ls_lists_steps_sizes_and_codecs(
    ckpt_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ls prints one row per committed step with its size, ratio and codec."""
    assert main(["ls", str(ckpt_dir)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[:4] == ["step", "size", "ratio", "tensors"]
    assert [r.split()[0] for r in rows[1:]] == ["5", "9"]
    assert all("coci.raw/1" in r for r in rows[1:])


def test_ls_shows_compression_ratio_and_delta_bases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A lossless delta shows its codecs, a ratio above 1 and the base it needs."""
    w = torch.zeros(64, 1024)
    with CheckpointManager(tmp_path, compression="lossless") as mgr:
        mgr.save(1, {"w": w}).wait()
        mgr.save(2, {"w": w + 1}).wait()
    assert main(["ls", str(tmp_path)]) == 0
    rows = capsys.readouterr().out.splitlines()
    base, delta = rows[1], rows[2]
    assert "coci.zstd/1" in base and "delta of" not in base
    assert "coci.xor-zstd/1" in delta and "(delta of 1)" in delta
    assert float(delta.split()[3].rstrip("x")) > 10


def test_verify_ok_then_damaged(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """verify exits 0 when intact and 1 naming the tensor after a byte is flipped."""
    assert main(["verify", str(ckpt_dir)]) == 0
    manifest = json.loads((ckpt_dir / step_dir_name(9) / "manifest.json").read_text())
    entry = next(t for t in manifest["tensors"] if t["key"] == "/model/0.weight")
    data = ckpt_dir / step_dir_name(9) / entry["pieces"][0]["file"]
    raw = bytearray(data.read_bytes())
    raw[entry["pieces"][0]["offset"] + 10] ^= 0x40
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["verify", str(ckpt_dir)]) == 1
    out = capsys.readouterr().out
    assert "step 5: ok" in out
    assert "/model/0.weight" in out
    assert "step 9: 1 damaged" in out
    assert main(["verify", str(ckpt_dir), "--step", "5"]) == 0


def test_export_torch_save_and_safetensors(ckpt_dir: Path, tmp_path: Path) -> None:
    """export writes the restored state as torch.save (weights_only loadable) or safetensors."""
    assert main(["export", str(ckpt_dir), str(tmp_path / "s5.pt"), "--step", "5"]) == 0
    assert_same(torch.load(tmp_path / "s5.pt", weights_only=True), tiny_model_state(0))
    assert main(["export", str(ckpt_dir), str(tmp_path / "last.safetensors")]) == 0
    tensors = load_file(str(tmp_path / "last.safetensors"))
    assert torch.equal(tensors["model.0.weight"], tiny_model_state(1)["model"]["0.weight"])


def test_errors_exit_1_with_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty directory gives exit code 1 and a message, not a traceback."""
    assert main(["ls", str(tmp_path)]) == 1
    assert main(["export", str(tmp_path), str(tmp_path / "x.pt")]) == 1
    assert "no committed checkpoints" in capsys.readouterr().err


@pytest.mark.slow
def test_coci_demo_engine_end_to_end(tmp_path: Path) -> None:
    """`coci demo --engine` kills a trainer mid-persist and reports a bit-identical resume."""
    proc = run(
        module(
            "coci_core.commands.cli",
            "demo",
            "--engine",
            "--dir",
            str(tmp_path / "demo"),
            "--total-steps",
            "100",
            "--save-every",
            "20",
            "--kill-step",
            "60",
        ),
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "killed with SIGKILL during the persist of step 60" in proc.stdout
    said = re.search(
        r"resumed in a new process from step 40 \((\d+) steps of work lost", proc.stdout
    )
    assert said, proc.stdout
    assert "bit-identical to the uninterrupted run: True" in proc.stdout
    # `coci report` on the demo's directory: the same lost work, from the telemetry it wrote
    report = run(module("coci_core.commands.cli", "report", str(tmp_path / "demo")), check=True)
    assert f"{said[1]} steps of work lost and redone" in report.stdout
    assert int(said[1]) >= 60 - 40  # it trained on while step 60's persist was held


@pytest.mark.slow
def test_coci_demo_lightning_end_to_end(tmp_path: Path) -> None:
    """`coci demo` kills a Lightning run (asked to kill at step 2, before coci's first save:
    just after its first committed checkpoint instead, so that it shows a real resume),
    resumes it exactly and reports the plan; no third-party noise, one progress bar per phase,
    and it says where its files are."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "coci_core.commands.cli",
            "demo",
            "--dir",
            str(tmp_path / "demo"),
            "--total-steps",
            "200",
            "--kill-step",
            "2",
        ],
        capture_output=True,
        timeout=600,
        # every warning shown, deprecations included: the demo silences only known ones
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    # decoded by hand: text=True would turn the progress bars' carriage returns into newlines
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out + err
    assert "killed with SIGKILL at step 2 (or, if coci has not committed" in out
    killed = re.search(r"killed at step (\d+); committed checkpoints at the kill: \[\d", out)
    assert killed and int(killed[1]) > 2, out  # just after the first checkpoint
    assert "final weights bit-identical to the uninterrupted run: True" in out
    assert "each remaining sample trained on exactly once, in the same order: True" in out
    assert "checkfreq" in out
    assert f"coci tab: tensorboard --logdir {tmp_path / 'demo' / 'run'}" in out
    assert f"files in {tmp_path / 'demo'}" in out.splitlines()[0]
    assert f"files in {tmp_path / 'demo'}: reference/" in out.splitlines()[-1]
    # one stated overhead per policy: the table, not also the plan's figure over its horizon
    assert "expected overhead over the horizon" not in out
    for noise in ("Warning", "deprecated", "GPU available", "Tip", "Restoring states", "Epoch"):
        assert noise not in err and noise not in out, (noise, err)
    # one progress bar per phase (each ends where its run ended: the kill, or the last step)
    bars = [line.split("\r")[-1] for line in err.split("\n")]
    bars = [bar for bar in bars if bar.strip().startswith("training:")]
    assert len(bars) == 3, err
    check_one_set_of_numbers(tmp_path / "demo", out, total=200)
    ends = ["200/200", f"{killed[1]}/200", "200/200"]
    assert [end in bar for end, bar in zip(ends, bars, strict=True)] == [True] * 3, bars


def test_sharded_checkpoint_exports_to_dcp_and_imports_back(tmp_path: Path) -> None:
    """A checkpoint written by 2 ranks exports (with rank 1's own state) as a DCP directory,
    which `coci import` turns back into a coci checkpoint of the same state."""
    from coci_core import RankGroup

    state = {"model": {"w": torch.randn(5000, 7), "b": torch.arange(9)}, "n": 3}
    managers = [
        CheckpointManager(tmp_path / "src", group=RankGroup(r, 2, "cli"), chunk_bytes=4096)
        for r in range(2)
    ]
    handles = [
        m.save(4, state, per_rank={"seed": torch.tensor([10 + r])}) for r, m in enumerate(managers)
    ]
    for h in handles:
        h.wait(timeout_s=60)
    for m in managers:
        m.close()
    out = tmp_path / "dcp"
    # a rank the checkpoint was not written by: refused, nothing written (before: exit 0,
    # the per-rank state left out with a warning)
    beyond = ["export", str(tmp_path / "src"), str(tmp_path / "r5.pt"), "--rank", "5"]
    assert main(beyond) == 2
    assert not (tmp_path / "r5.pt").exists()
    # the model's weights alone are the same on every rank: any rank exports them
    assert main([*beyond, "--weights-only"]) == 0
    weights = torch.load(tmp_path / "r5.pt", weights_only=True)
    assert_same(weights, state["model"])
    assert main(["export", str(tmp_path / "src"), str(out), "--format", "dcp", "--rank", "1"]) == 0
    assert (out / ".metadata").exists()
    assert main(["import", str(out), str(tmp_path / "back"), "--step", "4"]) == 0
    with CheckpointManager(tmp_path / "back") as back:
        restored = back.restore()
    assert_same(restored, {**state, "seed": torch.tensor([11])})
