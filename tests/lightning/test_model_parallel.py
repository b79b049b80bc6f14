"""CociCheckpoint under Lightning's ModelParallelStrategy (FSDP2 over a tensor-parallel plan) on
CPU processes with gloo: every rank saves its own shards, a run SIGKILLed mid-epoch resumes
bit-identical to one never stopped."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from coci_core import CheckpointManager
from tests.harness.processes import Child, child_env, module, run
from tests.harness.results import result_rows

pytestmark = [pytest.mark.dist, pytest.mark.slow]

_CHILD = "tests.lightning._model_parallel_child"
TOTAL = 12
KILL = 7  # inside the first epoch (8 steps at 2 data-parallel ranks)


def _ranks(processes: int, *args: str) -> list[str]:
    """The child in ``processes`` processes, as torchrun starts a Lightning script (forked
    with Lightning imported: tests/harness/ranks.py); Lightning's own launcher is
    tests/lightning/test_ddp.py's."""
    return module("tests.harness.ranks", str(processes), _CHILD, *args)


def _run(
    directory: Path, dp: int, tp: int, total: int = TOTAL, env: dict[str, str] | None = None
) -> dict[int, dict[str, Any]]:
    command = _ranks(dp * tp, str(directory), str(dp), str(tp), str(total))
    out = run(command, env=child_env(env), timeout_s=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = {row["rank"]: row for row in result_rows(out.stdout)}
    assert sorted(results) == list(range(dp * tp))
    return results


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    """A 2 x 2 run of TOTAL steps never stopped, asking Lightning for gathered files
    (``save_distributed_checkpoint=False``, which coci's saves ignore): the reference of the
    killed run, and the checkpoint resumed on another mesh. Its directory and results."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    return directory, _run(directory, 2, 2, env={"GATHERED_FILES": "1"})


def test_killed_mid_epoch_resumes_bit_identical(
    tmp_path: Path, uninterrupted: tuple[Path, dict[int, Any]]
) -> None:
    """FSDP2 over the data-parallel dimension of a 2 x 2 mesh, tensor parallel over the other
    (FSDP2 alone, ``ModelParallelStrategy(data_parallel_size=2)``, is the adapter contract's:
    tests/contract/test_contract.py)."""
    dp, tp = 2, 2
    world = dp * tp
    expected = uninterrupted[1]
    assert len({(r["model"], r["optim"]) for r in expected.values()}) == 1

    with Child(
        _ranks(world, str(tmp_path / "run"), str(dp), str(tp), str(TOTAL), str(KILL)),
        stderr=subprocess.DEVNULL,
        kill_scope="group",
    ) as child:
        child.kill_at(f"AT {KILL}")
    directory = tmp_path / "run" / "coci"
    steps = CheckpointManager(directory, keep_last=None).steps()
    assert steps in ([3], [3, 6])  # the persist of step 6 may not have been durable yet
    restored = steps[-1]

    # every rank wrote its own shards: the weights' bytes are split over the ranks' files,
    # each byte once
    manifest = json.loads((directory / f"step-{restored:010d}" / "manifest.json").read_text())
    assert manifest["world_size"] == world
    entries = {e["key"]: e for e in manifest["tensors"]}
    for key, numel in [("/state_dict/net.0.weight", 34 * 16), ("/state_dict/net.3.weight", 8 * 34)]:
        pieces = entries[key]["pieces"]
        assert sum(p["length"] for p in pieces) == numel * 4
        assert len({p["file"] for p in pieces}) == world
    exp_avg = entries["/optimizer_states/0/state/net.0.weight/exp_avg"]["pieces"]
    assert len({p["file"] for p in exp_avg}) == world
    # the norm and head are not tensor-parallel: DTensors of the data-parallel sub-mesh, one
    # copy per tensor-parallel rank, whose bytes are written once (the replicas share the work)
    for key, numel in [("/state_dict/net.5.weight", 8 * 8), ("/state_dict/net.4.bias", 8)]:
        pieces = entries[key]["pieces"]
        assert sum(p["length"] for p in pieces) == numel * 4

    resumed = _run(tmp_path / "run", dp, tp)
    per_step = 4  # samples per rank and step
    for rank in range(world):
        assert resumed[rank]["step"] == TOTAL
        assert resumed[rank]["lr"] == expected[rank]["lr"]
        assert resumed[rank]["model"] == expected[rank]["model"]
        assert resumed[rank]["optim"] == expected[rank]["optim"]
        # the data loader continued where the checkpoint was taken
        assert resumed[rank]["seen"] == expected[rank]["seen"][restored * per_step :]


def test_resumed_on_another_mesh_restores_the_same_state(
    tmp_path: Path, uninterrupted: tuple[Path, dict[int, Any]]
) -> None:
    """A checkpoint of a 2 x 2 (data x tensor parallel) run, resumed by 2 processes at 1 x 2:
    each rank reads the boxes its shards hold now; the full model and optimizer state equal
    the saved run's. The saving run asks Lightning for gathered files
    (``save_distributed_checkpoint=False``): coci still saves each rank's shards."""
    shutil.copytree(uninterrupted[0], tmp_path, dirs_exist_ok=True)
    saved = uninterrupted[1]
    assert CheckpointManager(tmp_path / "coci").latest_step() == TOTAL
    step_dir = tmp_path / "coci" / f"step-{TOTAL:010d}"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    weight = next(e for e in manifest["tensors"] if e["key"] == "/state_dict/net.0.weight")
    assert len({p["file"] for p in weight["pieces"]}) == 4
    resumed = _run(tmp_path, 1, 2)  # max_steps reached: nothing trained after it
    for rank in (0, 1):
        assert resumed[rank]["step"] == TOTAL
        assert resumed[rank]["seen"] == []
        assert resumed[rank]["lr"] == saved[0]["lr"]
        assert (resumed[rank]["model"], resumed[rank]["optim"]) == (
            saved[0]["model"],
            saved[0]["optim"],
        )
