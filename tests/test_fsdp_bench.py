"""benchmarks/fsdp_bench.py runs end to end on a small FSDP2 state over two processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import fsdp_bench


@pytest.mark.slow
def test_small_run_writes_results_and_table(tmp_path: Path) -> None:
    out = tmp_path / "fsdp.json"
    res = fsdp_bench.main(
        ["--worlds=2", "--state-mb=8", "--rounds=1", f"--dir={tmp_path / 's'}", f"--out={out}"]
    )
    summary = json.loads(out.read_text())["worlds"]["2"]["summary"]
    assert set(summary) == {*fsdp_bench.SAVES, *fsdp_bench.RESTORES}
    # coci writes what each rank holds, no more (the step counter's share aside)
    assert 0.9 < summary["coci"]["written_over_owned"] < 1.05
    assert summary["coci_restore"]["restore_s"] > 0
    assert res["worlds"]["2"]["summary"] == summary
    assert not list((tmp_path / "s").glob("run-*"))  # the checkpoints are removed
