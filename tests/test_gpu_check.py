"""benchmarks/gpu_check.py: its checks pass on CPU (--device cpu), and without CUDA it says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness.processes import child_env, module, run


@pytest.mark.slow
def test_cpu_mode_passes_its_checks_and_writes_the_figures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run(
        module("benchmarks.gpu_check", "--device", "cpu", "--quick", f"--out={out}"),
        timeout_s=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: all checks passed" in proc.stdout
    (path,) = out.glob("gpu-check-cpu-*.json")
    res = json.loads(path.read_text())
    assert res["ok"] and res["machine"]["device"] == "cpu"
    checks = res["checks"]
    assert set(checks) == {"inplace", "kill_resume", "fsdp2"}
    assert all(c["ok"] for c in checks.values()), checks
    assert checks["inplace"]["same_tensors"] and checks["inplace"]["bit_exact"]
    assert checks["kill_resume"]["returncode"] == -9
    assert checks["kill_resume"]["resumed_bit_exact"]
    assert checks["fsdp2"]["placements"] == ["(Shard(dim=0),)"]
    assert checks["fsdp2"]["restored_in_place"] is True
    stall = res["stall"]
    assert stall["bytes"] == 8 << 20
    for key in (
        "copy_limit_s",
        "coci_save_block_s",
        "coci_save_nonblock_s",
        "coci_durable_s",
        "dcp_async_blocking_s",
    ):
        assert stall[key] > 0, key
    assert isinstance(stall["target_block_vs_copy_met"], bool)
    assert isinstance(stall["target_dcp_vs_nonblock_met"], bool)
    assert "| DCP async_save blocking |" in proc.stdout


def test_without_cuda_it_exits_2_with_one_line(tmp_path: Path) -> None:
    env = child_env({"CUDA_VISIBLE_DEVICES": ""})
    proc = run(module("benchmarks.gpu_check", f"--out={tmp_path}"), env=env, timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gpu_check: CUDA is not available") and "--device cpu" in line
    assert not list(tmp_path.iterdir())
