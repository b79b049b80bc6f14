"""The standard 2-D recipe (tensor parallelism on some layers, then FSDP2 over ``mesh["dp"]``):
the layers that are not tensor-parallel hold DTensors of the ``dp`` sub-mesh, one copy per
``tp`` rank, each byte written once. Saved with coci through ``get_state_dict``, SIGKILLed, and
resumed bit-identical on the same mesh; restored bit-exact onto ``(4,)``, ``(1, 4)`` and one
process; exported to DCP and loaded by DCP; restored with ``into=`` objects listed in another
order on odd ranks, whose ``load_state_dict`` runs collectives; and into targets the
checkpoint does not match (a missing key, another shape: refused before reading, on the same
and on another mesh). Real processes, gloo, AdamW. Three launches of four ranks, a tiny model.

torch's own distributed-checkpoint tests that apply, as they are ported here:
``test_2d_fsdp_dt_checkpoint`` / ``fsdp_tp_checkpoint_conversion`` (FSDP2 over tensor
parallelism saved, loaded onto another layout and unsharded): the restores onto ``(4,)``,
``(1, 4)`` and one process; ``test_different_ordered_state_dict_keys``: its load half (the
``into=`` order test; on the save side coci refuses ranks whose keys are ordered differently,
with an error that says so, where DCP saves them); DCP's partial load and shape-mismatch
errors: the mismatch test here and ``tests/engine/test_restore_match.py``. Not ported: DCP's
planner, storage-writer and ``async_save`` tests (coci has no planner hooks, its own storage and
asynchronous saves), and FSDP1 ``ShardedTensor`` tests (coci stores DTensors).

Lightning's ``ModelParallelStrategy`` and Accelerate's FSDP2 on a 2-D mesh with layers that are
not tensor-parallel are tested in ``tests/lightning/test_model_parallel.py`` and
``tests/accelerate/test_fsdp2_tp.py``; the rest of torch's distributed-checkpoint tests that
apply, in ``test_ported_dcp.py``.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest

from coci_core import CheckpointManager
from coci_core.commands import cli
from tests.harness.processes import Child, free_port, module, rank_env
from tests.harness.states import full_digest

MODULE = "tests.sharding._recipe_child"
CFG = {"mesh": [2, 2], "steps": 6, "every": 2}


def _run(cfg: dict[str, Any], kill_at: int | None = None) -> list[dict[str, Any]]:
    """Run 4 ranks; with ``kill_at``, SIGKILL every rank once rank 0 reached that step. The
    ranks' results, by rank (none when killed)."""
    command = module(MODULE, json.dumps(cfg))
    port = free_port()
    results = []
    with contextlib.ExitStack() as stack:
        ranks = [stack.enter_context(Child(command, env=rank_env(r, 4, port))) for r in range(4)]
        if kill_at is not None:
            for line in ranks[0].lines():
                if line.startswith(f"AT {kill_at}"):
                    for child in ranks:
                        child.kill()
            assert all(child.wait(60) != 0 for child in ranks)
            return []
        for child in ranks:
            for line in child.lines():
                if line.startswith("RESULT "):
                    results.append(json.loads(line[len("RESULT ") :]))
            assert child.wait(240) == 0
    assert len(results) == 4
    return sorted(results, key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run never stopped, one killed at step 5 and resumed, which then checks the last step
    of the first (onto other meshes, through DCP, key order, mismatches)."""
    root = tmp_path_factory.mktemp("recipe")
    reference = _run({**CFG, "dir": str(root / "reference")})
    killed = root / "killed"
    _run({**CFG, "dir": str(killed)}, kill_at=5)
    saved = CheckpointManager(killed).latest_step()
    exported = root / "dcp"
    assert cli.main(["export", str(root / "reference"), str(exported), "--format", "dcp"]) == 0
    check = {
        "dir": str(root / "reference"),
        "step": CFG["steps"],
        "meshes": [[2, 2], [4], [1, 4]],
        "dcp": str(exported),
    }
    resumed = _run({**CFG, "dir": str(killed), "check": check})
    return {
        "root": root,
        "reference": reference,
        "saved": saved,
        "resumed": resumed,
        "checks": [r["check"] for r in resumed],
    }


def test_killed_and_resumed_2d_recipe_is_bit_identical(runs: dict[str, Any]) -> None:
    assert runs["saved"] in (2, 4)
    assert all(r["start"] == runs["saved"] for r in runs["resumed"])
    assert [r["final"] for r in runs["resumed"]] == [r["final"] for r in runs["reference"]]


def test_2d_recipe_restores_bit_exact_onto_other_meshes_and_one_process(
    runs: dict[str, Any],
) -> None:
    expected = runs["reference"][0]["saved"][str(CFG["steps"])]
    for rank in runs["checks"]:
        for mesh in rank["meshes"]:  # (2, 2), (4,), (1, 4)
            assert mesh == {"digests": expected, "in_place": True}
    state = CheckpointManager(runs["root"] / "reference").restore()
    assert [full_digest(state["model"]), full_digest(state["optim"])] == expected


def test_2d_recipe_exported_to_dcp_loads_with_dcp(runs: dict[str, Any]) -> None:
    expected = runs["reference"][0]["saved"][str(CFG["steps"])]
    assert all(rank["dcp"] == expected for rank in runs["checks"])


def test_into_objects_listed_in_another_order_load_alike_on_every_rank(
    runs: dict[str, Any],
) -> None:
    """Odd ranks list ``into`` in reverse; each object's load_state_dict runs collectives."""
    expected = runs["reference"][0]["saved"][str(CFG["steps"])]
    assert all(rank["key_order"] == expected for rank in runs["checks"])


def test_dtensor_targets_the_checkpoint_does_not_match_raise_before_reading(
    runs: dict[str, Any],
) -> None:
    for rank in runs["checks"]:
        assert rank["missing"].startswith("StateMismatchError"), rank["missing"]
        assert "/model/extra.weight" in rank["missing"] and "partial=True" in rank["missing"]
        assert rank["untouched"] and rank["partial"]
        assert rank["shape"].startswith("StateMismatchError"), rank["shape"]
        assert "/model/head.weight: stored (6, 16), live (7, 16)" in rank["shape"]
