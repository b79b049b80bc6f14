"""benchmarks/tensor_count_bench.py runs end to end on small states (its --quick sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import tensor_count_bench


@pytest.mark.slow
def test_quick_run_writes_results_and_tables(tmp_path: Path) -> None:
    res = tensor_count_bench.main(
        [
            "--quick",
            "--rounds=1",
            "--idle-budget=0",
            "--states=gpt-adamw",  # each restore sample is a process of its own: few of them
            "--methods=copy,copy_foreach,coci,torch_save,coci_restore,torch_load_mmap",
            f"--dir={tmp_path / 'scratch'}",
            f"--out={tmp_path / 'out'}",
        ]
    )
    (path,) = (tmp_path / "out").glob("tensor-count-*.json")
    assert json.loads(path.read_text())["rounds"] == 1
    assert not list((tmp_path / "scratch").iterdir())  # the checkpoints are removed
    (gpt,) = res["cells"]
    assert gpt["state"]["name"] == "gpt-adamw" and gpt["state"]["tensors"] > 300
    assert len(gpt["saves"]["coci"]["reps"]) == 1
    assert set(gpt["restores"]) == {"coci_restore", "torch_load_mmap"}
    assert gpt["summary"]["coci_restore_over_best_peer_warm"] > 0
    assert gpt["summary"]["us_per_tensor_stall"] == gpt["summary"]["us_per_tensor_stall"]
    assert "| gpt-adamw |" in tensor_count_bench.report(res)
