"""benchmarks/save_overheads_bench.py runs end to end on small states (its --quick sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import save_overheads_bench


@pytest.mark.slow
def test_quick_run_writes_results_and_tables(tmp_path: Path) -> None:
    res = save_overheads_bench.main(
        [
            "--quick",
            "--rounds=2",
            "--states=3000-mixed",
            f"--dir={tmp_path / 'scratch'}",
            f"--out={tmp_path / 'out'}",
        ]
    )
    (path,) = (tmp_path / "out").glob("save-overheads-*.json")
    assert json.loads(path.read_text())["rounds"] == 2
    assert not list((tmp_path / "scratch").iterdir())  # the checkpoints are removed
    (cell,) = res["cells"]
    assert len(cell["copy"]["runs"]) == len(cell["copy"]["per_tensor"]) == 2
    for variant in ("paused", "running"):
        assert len(cell["writer"][variant]) == 2
        assert cell["summary"][variant]["mean"]["writer_cpu_s"] > 0
    table = save_overheads_bench.report(res)
    assert "| 3000-mixed | 300 |" in table
