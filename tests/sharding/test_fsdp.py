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
from tests.harness.processes import Child, free_port, module, rank_env, run, script

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


_EMPTY_STATE_CHILD = """
import json, sys, tempfile, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from coci_core import CheckpointManager, RankGroup

dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1])
mesh = init_device_mesh("cpu", (1,))


def build():
    torch.manual_seed(0)
    model = distribute_module(torch.nn.Linear(4, 4), mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


root = tempfile.mkdtemp()
model, opt = build()
with CheckpointManager(root, group=RankGroup.from_torch_distributed()) as mgr:
    mgr.save(0, {"model": model.state_dict(), "optim": opt.state_dict()}).wait()
model, opt = build()  # a new process's objects
with CheckpointManager(root, group=RankGroup.from_torch_distributed()) as mgr:
    state = mgr.restore(into={"model": model, "optim": opt})
model(DTensor.from_local(torch.ones(2, 4), mesh, [Replicate()])).sum().backward()
opt.step()  # the restored optimizer steps
print("RESULT " + json.dumps({"step": mgr.last_restore.step, "state": len(opt.state)}), flush=True)
dist.destroy_process_group()
"""


def test_an_optimizer_saved_before_its_first_step_restores_into_dtensors() -> None:
    """An optimizer of DTensor parameters saved with no state yet (a step-0 checkpoint) holds
    no array: restore(into=...) takes it (the layout check is for a state saved otherwise,
    not for one that has none), and the optimizer steps after it."""
    result = run(script(_EMPTY_STATE_CHILD, str(free_port())), timeout_s=120)
    assert result.returncode == 0, result.stderr[-2000:]
    (line,) = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT ")]
    assert json.loads(line[len("RESULT ") :]) == {"step": 0, "state": 2}
