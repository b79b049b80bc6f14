"""benchmarks/loop_bench.py runs end to end on a tiny model (its --quick sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks import loop_bench


@pytest.mark.slow
def test_quick_run_writes_results_and_tables(tmp_path: Path) -> None:
    res = loop_bench.main(
        [
            "--quick",
            "--rounds=1",
            "--every=1,2",
            "--idle-budget=0",
            f"--dir={tmp_path / 'scratch'}",
            f"--out={tmp_path / 'out'}",
        ]
    )
    (path,) = (tmp_path / "out").glob("loop-*.json")
    saved = json.loads(path.read_text())
    assert saved["rounds"] == 1 and saved["every"] == [1, 2]
    assert not list((tmp_path / "scratch").iterdir())  # the checkpoints are removed
    savers = [m for m in loop_bench.METHODS if m != "none"]
    assert [c["threads"] for c in res["cells"]] == loop_bench._threads("1,all")
    for c in res["cells"]:
        (rnd,) = c["rounds"]
        assert len(rnd["none"]) == 2 and rnd["none_step_s"] > 0
        assert sorted(rnd["order"]) == sorted(savers)
        assert {(b["method"], b["every"]) for b in rnd["blocks"]} == {
            (m, e) for m in savers for e in (1, 2)
        }
        for b in rnd["blocks"]:
            saves = b["periods"]
            assert saves == (4 if b["every"] == 1 else 2)  # ceil(--min-steps 4 / N)
            assert len(b["step_s"]) == b["steps"] == saves * b["every"]
            assert len(b["save_call_s"]) == len(b["stall_s"]) == saves
            assert len(b["durable_s"]) == saves, b["method"]  # every save became durable
            assert all(0 < d < 60 for d in b["durable_s"])
            assert "load_before" in b and "uptime_after" in b
            m = b["metrics"]
            assert m["lost_steps"] >= b["every"] / 2 and m["cost_pct"] >= m["overhead_pct"]
        for m in savers:
            for e in ("1", "2"):
                s = c["summary"][m][e]
                assert s["overhead_pct"]["n"] == 1 and s["durable_s"]["median"] > 0
    table = loop_bench.report(saved)
    assert table.count("| method | every |") == len(res["cells"])
    assert "| dcp_zero | 2 | 2 |" in table and "| torch_save_bg | 1 | 4 |" in table


def test_plot_draws_overhead_against_interval() -> None:
    from benchmarks import plots

    res = {
        "state_bytes": 1e9,
        "rounds": 3,
        "cells": [
            {
                "threads": t,
                "summary": {
                    "none": {"step_s": {"median": 0.2}},
                    "coci": {
                        "1": {"overhead_pct": {"median": 50.0, "min": 40.0, "max": 60.0}},
                        "10": {"overhead_pct": {"median": 2.0, "min": 1.0, "max": 3.0}},
                    },
                },
            }
            for t in (1, 2)
        ],
    }
    fig = plots.loop(res)
    assert len(fig.axes) == 2
    assert fig.axes[0].get_xscale() == "log"
