"""Sharded saves with real processes (gloo on CPU): every rank writes its share, a checkpoint
restores on another number of ranks with each sample seen once, per-rank random state returns to
its rank, and a rank killed during a persist publishes nothing."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.engine.restore.restore import load_checkpoint
from coci_core.storage import LocalStorage
from tests.harness.processes import free_port, run, script
from tests.sharding._dist_child import BATCH, SAMPLES, digest, launch

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _ok(results: list[tuple[int, dict[str, Any] | None]]) -> list[dict[str, Any]]:
    assert [code for code, _ in results] == [0] * len(results), results
    out = [r for _, r in results]
    assert all(r is not None for r in out)
    return out  # type: ignore[return-value]


def _seen(runs: list[list[dict[str, Any]]], upto: list[int | None]) -> list[int]:
    """Sample indices every rank of each run took, up to that run's last committed step."""
    seen: list[int] = []
    for results, last in zip(runs, upto, strict=True):
        for r in results:
            seen += [
                i for s, ids in r["steps"].items() if last is None or int(s) <= last for i in ids
            ]
    return seen


# shrinking (4 -> 2: two ranks' positions onto each) and growing (1 -> 2); onto one process:
# tests/transformers/test_ddp.py, tests/accelerate/test_fsdp2_tp.py
@pytest.mark.parametrize(("before", "after", "stop"), [(4, 2, 12), (1, 2, 40)])
def test_resume_on_another_world_size_sees_each_sample_once(
    tmp_path: Path, before: int, after: int, stop: int
) -> None:
    first = _ok(launch(before, {"dir": str(tmp_path), "every": stop // 2, "stop_step": stop}))
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [stop // 2, stop]
        manifest = mgr.manifest(stop)
    assert manifest.world_size == before
    # every rank wrote its share of the replicated state, balanced within one chunk
    shared = {f.name: 0 for f in manifest.files}
    for entry in manifest.tensors:
        for piece in entry.pieces:
            shared[piece.file] += piece.length
    assert len(shared) == before
    assert max(shared.values()) - min(shared.values()) <= 64 * 1024 + 64 * len(manifest.tensors)
    # a checkpoint written by N ranks reads back on one, with each rank's own random state
    for r in first:
        loaded = load_checkpoint(LocalStorage(tmp_path), stop, rank=r["rank"])
        assert digest(loaded.state["rng"]) == r["rng_at_save"][str(stop)]
    second = _ok(launch(after, {"dir": str(tmp_path), "every": 1000}))
    assert all(r["restored_step"] == stop for r in second)
    seen = _seen([first, second], [stop, None])
    assert sorted(seen) == list(range(SAMPLES))  # each sample of the epoch exactly once
    assert all(len(r["steps"]) == stop for r in first)
    assert all(len(ids) == BATCH for r in first + second for ids in r["steps"].values())


def test_ranks_that_do_not_share_the_directory_are_told_so_at_the_first_save(
    tmp_path: Path,
) -> None:
    """Each rank's "same" path on a disk of its own (node-local /scratch): the first save
    fails at once on every rank with one error naming the rank that does not see rank 0's
    directory, and nothing is committed (before: every save stalled for the group's timeout,
    600 s by default, then failed blaming rank 1 for not reporting, which it had, elsewhere)."""
    cfg = {"dir": str(tmp_path / "node{rank}"), "every": 2, "stop_step": 4, "timeout_s": 600}
    results = _ok(launch(2, cfg, timeout_s=120))
    for r in results:
        assert "do not share one checkpoint directory: rank(s) [1]" in r["save_error"]
        assert str(tmp_path / "node0") in r["save_error"]
        assert list(r["steps"]) == ["1", "2"]  # the first save, not one 600 s later
    for node in ("node0", "node1"):
        with CheckpointManager(tmp_path / node) as mgr:
            assert mgr.steps() == []
    assert not any(p.name.startswith(".coci-shared-") for p in (tmp_path / "node0").iterdir())


def test_a_rank_whose_first_save_fails_its_input_checks_tells_the_others_at_once(
    tmp_path: Path,
) -> None:
    """Rank 1's state holds an object coci refuses, at the first save: rank 1 raises its own
    error, and rank 0, at the check that the ranks share the directory, is told at once which
    rank failed and why (before: it waited there for the group's timeout, 600 s, on the
    training thread); nothing is committed and no probe is left."""
    cfg = {"dir": str(tmp_path), "every": 2, "stop_step": 4, "timeout_s": 600, "bad_rank": 1}
    results = _ok(launch(2, cfg, timeout_s=120))
    assert "'/extra' cannot be stored" in results[1]["save_error"]
    assert "the save of rank(s) [1] failed before anything was written" in results[0]["save_error"]
    assert "UnsupportedValueError: state value at '/extra'" in results[0]["save_error"]
    assert [list(r["steps"]) for r in results] == [["1", "2"]] * 2
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".coci-shared-")] == []


def test_rank_killed_during_persist_publishes_nothing_and_the_others_get_an_error(
    tmp_path: Path,
) -> None:
    """The last of 4 ranks is SIGKILLed in the middle of writing its data file of step 20:
    nothing is published, step 10 stays intact, every survivor (rank 0, which collects, and
    the others, which wait for its word) gets an error naming that rank within the timeout,
    and a relaunch resumes from step 10 with each rank's own random state."""
    world = 4
    dead = world - 1
    cfg = {"dir": str(tmp_path), "every": 10, "pause_rank": dead, "pause_step": 20, "timeout_s": 3}
    results = launch(world, cfg, kill_rank=dead)
    assert results[dead] == (-signal.SIGKILL, None)
    survivors = [r for code, r in results[:dead] if code == 0 and r is not None]
    assert len(survivors) == dead
    assert re.search(rf"rank\(s\) \[{dead}\] did not report within 3 s", survivors[0]["save_error"])
    for r in survivors[1:]:
        assert re.search(rf"abandoned: .*rank\(s\) \[{dead}\]", r["save_error"])
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [10]  # step 20 unpublished, step 10 intact
        assert mgr.verify() == {10: []}
    resumed = _ok(launch(world, {"dir": str(tmp_path), "every": 1000, "stop_step": 22}))
    assert [r["restored_step"] for r in resumed] == [10] * world
    for before, after in zip(survivors, resumed, strict=False):
        assert after["restored_rng"] == before["rng_at_save"]["10"]  # its own, back on its rank
    assert len({r["restored_rng"] for r in resumed}) == world


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_shards_are_written_by_their_owners_and_restore_whole(
    tmp_path: Path, world: int
) -> None:
    """Shard(0) DTensors (uneven over 4 ranks) are written by the rank that holds each shard,
    with their global offsets; the checkpoint restores whole, on those ranks and on one."""
    from tests.sharding._dtensor_child import full_state

    results = _ok(
        launch(world, {"dir": str(tmp_path / "ckpt")}, module="tests.sharding._dtensor_child")
    )
    assert all(r["restored_equal"] for r in results)
    assert all("Partial" in r["refused"] and "redistribute" in r["refused"] for r in results)
    assert all("'/x'" in r["refused"] for r in results)  # names the value
    manifest = CheckpointManager(tmp_path / "ckpt").manifest(3)
    entries = {e.key: e for e in manifest.tensors}
    emb = entries["/model/emb"]
    assert emb.shape == (10, 7)
    row = 7 * 4
    rows = [r["local_rows"] for r in sorted(results, key=lambda r: r["rank"])]
    assert [(p.file, p.start, p.length) for p in emb.pieces] == [
        (f"data-r{r}.bin", sum(rows[:r]) * row, rows[r] * row) for r in range(world) if rows[r]
    ]
    state = load_checkpoint(LocalStorage(tmp_path / "ckpt"), 3).state
    for key in ("emb", "w", "rep"):
        assert torch.equal(state["model"][key], full_state()[key])


_HANDMADE_RANKS = """
import os, sys, torch, torch.distributed as dist
from coci_core import CheckpointManager, RankGroup
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)  # as Lightning and Accelerate on one device
groups = [RankGroup(r, 2, "handmade", timeout_s=5) for r in (0, 1)]
managers = [CheckpointManager(sys.argv[1], group=g) for g in groups]
handles = [m.save(1, {"w": torch.ones(4)}) for m in managers]
for h in handles:
    h.wait()
for m in managers:
    m.close()
print("SAVED", sorted(os.listdir(sys.argv[1])))
"""


def test_ranks_made_by_hand_in_one_process_save_without_the_directory_check(
    tmp_path: Path,
) -> None:
    """Two ranks made by hand in one process of a one-process torch.distributed job: no
    exchange through the job's store can meet them (rank 1 saves only once rank 0's save has
    returned), so the shared-directory check is not made; the save commits at once and no
    probe is left behind."""
    proc = run(script(_HANDMADE_RANKS, str(tmp_path), str(free_port())), timeout_s=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SAVED ['.coci-owner', 'step-0000000001']" in proc.stdout
