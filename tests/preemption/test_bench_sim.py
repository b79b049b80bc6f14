"""The preemption benchmark's simulation (benchmarks/preemption_bench.py) on a small
configuration: the relations between the policies that its model implies. A test of the
simulator's logic, not of timings."""

from __future__ import annotations

import pytest
from benchmarks.preemption_bench import check_targets, simulate


@pytest.fixture(scope="module")
def rows() -> list[dict[str, float]]:
    # 5 GB: a 5 s save that fits; 40 GB: a 42 s save that a 30 s grace period cannot fit
    return simulate((5.0, 40.0), (30.0,), trials=200, seed=1, steps=5000)


def test_coci_never_loses_more_than_the_naive_save_or_no_handling(
    rows: list[dict[str, float]],
) -> None:
    for r in rows:
        assert r["coci mean"] <= r["naive in place mean"] + 1e-9
        assert r["coci mean"] <= r["naive atomic mean"] + 1e-9
        assert r["coci mean"] <= r["none mean"] + 1e-9


def test_where_the_save_fits_nothing_is_lost(rows: list[dict[str, float]]) -> None:
    fits = rows[0]
    assert fits["naive_fits"] == 1.0
    assert fits["coci mean"] == fits["naive atomic mean"] == 0.0
    assert fits["none mean"] > 0


def test_where_the_naive_save_cannot_fit(rows: list[dict[str, float]]) -> None:
    nofit = rows[1]
    assert nofit["naive_fits"] == 0.0
    # against a save that overwrites the newest checkpoint: at least 50% less
    assert nofit["coci mean"] < 0.5 * nofit["naive in place mean"]
    # against an atomic one: the same checkpoint stays the newest
    assert nofit["coci mean"] == pytest.approx(nofit["naive atomic mean"])


def test_the_target_lines() -> None:
    lines = check_targets(simulate((40.0,), (30.0,), trials=50, seed=2, steps=3000))
    assert any(
        line.startswith("coci <= 50% of naive in place") and line.endswith("ok") for line in lines
    )
    assert any("naive atomic where" in line and "FAILS" in line for line in lines)


def test_a_known_end_keeps_more_of_the_job_and_loses_no_more_work() -> None:
    """With the kill's time announced, coci trains on to the planned save: where the save fits
    with time to spare, far less of the job's time is lost than by saving at the notice, and
    the work to redo stays the no-budget save's (the plan's reserve)."""
    from benchmarks.preemption_bench import check_known_end

    known = simulate((5.0, 20.0), (120.0,), trials=300, seed=3, steps=5000, known_end=True)
    for r in known:
        assert r["known_end"] and r["naive_fits"] == 1.0
        assert r["coci mean"] <= r["naive atomic mean"] + 1e-9  # nothing to redo either way
        assert r["coci wall mean"] < 0.5 * r["naive atomic wall mean"]
        # the frameworks save at the notice and stand idle until the kill
        assert r["naive atomic wall mean"] > 100
    assert check_known_end(known)[0].endswith("ok")
