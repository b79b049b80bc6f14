"""benchmarks/replay_bench.py runs end to end on small states (its --quick sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import replay_bench


@pytest.mark.slow
def test_quick_run_writes_results_and_tables(tmp_path: Path) -> None:
    res = replay_bench.main(
        [
            "--quick",
            "--rounds=2",
            "--states=64x4MiB,3000-mixed",
            f"--dir={tmp_path / 'scratch'}",
            f"--out={tmp_path / 'out'}",
        ]
    )
    (path,) = (tmp_path / "out").glob("replay-*.json")
    assert json.loads(path.read_text())["rounds"] == 2
    assert not list((tmp_path / "scratch").iterdir())  # the checkpoints are removed
    for cell in res["cells"]:
        for variant in replay_bench.VARIANTS:
            assert len(cell["samples"][variant]["stall"]) == 2
    table = replay_bench.report(res)
    assert "| 3000-mixed | 300 |" in table
