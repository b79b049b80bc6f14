"""A model trained with FSDP2 (over tensor parallelism on a 2-D mesh) and AdamW, saved and
restored with coci through ``get_state_dict`` / ``set_state_dict``: SIGKILLed mid-run, the
resumed run ends bit-identical to one never stopped. Real processes, gloo."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from coci_core import CheckpointManager
from tests.harness.processes import Child, free_port, module, rank_env

MODULE = "tests.sharding._fsdp_child"


def _run(world: int, cfg: dict[str, Any], kill_at: int | None = None) -> list[dict[str, Any]]:
    """Run ``world`` ranks; with ``kill_at``, SIGKILL every rank once rank 0 reached that step.
    The ranks' results (none when killed)."""
    command = module(MODULE, json.dumps(cfg))
    port = free_port()
    results = []
    with contextlib.ExitStack() as stack:
        ranks = [
            stack.enter_context(Child(command, env=rank_env(r, world, port))) for r in range(world)
        ]
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
            assert child.wait(120) == 0
    return results


@pytest.mark.parametrize(
    ("mesh", "api"),
    [([2], "state_dict"), ([2, 2], "state_dict"), ([2], "into")],
    ids=["fsdp2", "fsdp2-over-tp", "fsdp2-restore-into"],
)
def test_killed_and_resumed_run_is_bit_identical(tmp_path: Path, mesh: list[int], api: str) -> None:
    """Through get_state_dict / set_state_dict, or the modules' own state_dict() and
    restore(into=...) (the optimizer's sharded state made before it is filled)."""
    world = 2 if len(mesh) == 1 else 4
    cfg = {"mesh": mesh, "steps": 12, "every": 3, "api": api}
    reference = _run(world, {**cfg, "dir": str(tmp_path / "reference")})
    assert all(r["start"] == 0 for r in reference)

    directory = tmp_path / "killed"
    _run(world, {**cfg, "dir": str(directory)}, kill_at=8)
    saved = CheckpointManager(directory).latest_step()
    assert saved is not None and 3 <= saved <= 8
    resumed = _run(world, {**cfg, "dir": str(directory)})
    assert all(r["start"] == saved for r in resumed)
    assert [(r["model"], r["optim"]) for r in resumed] == [
        (r["model"], r["optim"]) for r in reference
    ]


def test_a_restore_into_of_state_saved_through_get_state_dict_is_refused(tmp_path: Path) -> None:
    """Saved as DCP's docs write it (``get_state_dict``: the optimizer's state keyed by
    parameter names), restored with ``restore(into=...)`` (the optimizer's own ``state_dict()``,
    keyed by index): every rank refuses it with a StateMismatchError that names the layout
    and the way to restore it (before: restored without a word, and the next optimizer step
    failed in torch mixing whole tensors with DTensors)."""
    cfg = {"mesh": [2], "steps": 6, "every": 3, "api": "state_dict", "dir": str(tmp_path)}
    _run(2, cfg)
    command = module(MODULE, json.dumps({**cfg, "steps": 9, "restore_api": "into"}))
    port = free_port()
    with contextlib.ExitStack() as stack:
        ranks = [stack.enter_context(Child(command, env=rank_env(r, 2, port))) for r in range(2)]
        for child in ranks:
            said = [line for line in child.lines() if line.startswith("MISMATCH ")]
            assert child.wait(120) == 3
            assert len(said) == 1 and "another layout" in said[0], said
            assert "set_state_dict" in said[0] and "/optim" in said[0]
