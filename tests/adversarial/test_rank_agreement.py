"""Ranks that restore together end on one step: the newest intact for every one of them, or
all raise the same error (never a model made of shards of two steps, never a rank left
waiting in a collective).

Two real gloo ranks save a ``Shard(0)`` DTensor and per-rank state at steps 1 to 3; copies of
the checkpoint are damaged (one rank's piece, one rank's own state, different steps for
different ranks, every step for some rank), or missing or unreadable on one rank only, or
damaged locally with an intact copy on a remote tier, or another run's on one rank only, or
the newest manifest forged on one rank only (another world size, step, run). The
same two ranks, then four ranks (another world size: a resharding restore), restore every
copy through ``restore()``, ``restore(into=...)`` and ``InPlaceTargets``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.sharding._dist_child import launch

pytestmark = [pytest.mark.dist, pytest.mark.faults]

PATHS = ("restore", "into", "targets")
EXPECTED = {"intact": 3, "piece": 2, "rank_state": 2, "staggered": 1, "tiers": 3}
# rank 1's copy of the newest manifest forged (resealed): another world size, the ranks' own
# states of one rank only (before: step 3 restored, rank 1 silently without its own state),
# another step, another run; the step before it on every rank
EXPECTED.update(dict.fromkeys(("forged_world1", "forged_world4", "forged_step", "forged_run"), 2))
# of the same world and ranks: another shared value, another layout of rank 1's piece (before:
# step 3 restored, rank 1 with its copy's value, or rows of the other piece)
EXPECTED.update(dict.fromkeys(("forged_tree", "forged_layout"), 2))
# rank 1's forged copy, the original on a remote tier: taken there
EXPECTED["forged_tiers"] = EXPECTED["forged_tree_tiers"] = 3
# other_run_here: rank 1's node-local directory holds another run's steps 1 to 3 (before: the
# ranks, each holding a step 3 of the same commit sequence, exchanged the same reports for ever)
FAILING = ("all", "missing_here", "unreadable_here", "other_run_here")


def _results(world: int, directory: Path, *, save: bool) -> list[dict[str, Any]]:
    runs = launch(
        world,
        {"dir": str(directory), "save": save},
        module="tests.adversarial._agree_child",
        timeout_s=300,
    )
    assert all(code == 0 for code, _ in runs), runs
    return [result["results"] for _, result in runs if result is not None]


def _check(results: list[dict[str, Any]], saved_world: int) -> None:
    for name, step in EXPECTED.items():
        for path in PATHS:
            got = [r[f"{name}/{path}"] for r in results]
            assert [g.get("step") for g in got] == [step] * len(got), (name, path, got)
            assert all(g["exact"] for g in got), (name, path, got)
            own = [g["own"] for g in got[:saved_world]]  # ranks the checkpoint has state of
            assert all(own), (name, path, got)
    for name in FAILING:
        for path in PATHS:
            errors = [r[f"{name}/{path}"].get("error") for r in results]
            assert errors[0] is not None, (name, path, errors)
            assert errors == [errors[0]] * len(errors), (name, path, errors)  # the same error
            assert "on every rank" in errors[0]


def test_ranks_agree_on_the_newest_step_intact_for_all_on_the_same_and_another_world_size(
    tmp_path: Path,
) -> None:
    _check(_results(2, tmp_path, save=True), saved_world=2)
    _check(_results(4, tmp_path, save=False), saved_world=2)
