"""Ranks that restore together from delta chains and two tiers end on one step.

Two real gloo ranks save a ``Shard(0)`` DTensor as a lossless XOR-delta chain (a base at step
1, deltas at steps 2 to 4) with per-rank state; each rank's node-local copy is damaged
differently at the same time (one rank's base, one rank's newest step and the other's
second-newest, a step absent on one rank's disk), with or without a remote tier holding an
intact copy (or only the older steps). Every rank must restore the same step exactly, or all
raise the same error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.adversarial._agree_delta_child import EXPECTED
from tests.sharding._dist_child import launch

pytestmark = [pytest.mark.dist, pytest.mark.faults]


def test_ranks_damaged_differently_in_delta_chains_and_tiers_agree_on_one_step(
    tmp_path: Path,
) -> None:
    runs = launch(
        2, {"dir": str(tmp_path)}, module="tests.adversarial._agree_delta_child", timeout_s=120
    )
    assert all(code == 0 for code, _ in runs), runs
    results = [result["results"] for _, result in runs if result is not None]
    assert len(results) == 2
    for name, step in EXPECTED.items():
        got = [r[name] for r in results]
        if step is None:  # no step intact for every rank: the same error on each
            errors = [g.get("error") for g in got]
            assert errors[0] is not None and errors == [errors[0]] * 2, (name, got)
            assert "on every rank" in errors[0], (name, got)
        else:
            assert [g.get("step") for g in got] == [step, step], (name, got)
            assert all(g["exact"] for g in got), (name, got)
