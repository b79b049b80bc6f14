"""A Trainer checkpoint whose manifest was forged and resealed (its checksum computed again)
is passed over as damaged, inside the restore, by every process together: never a raw error
out of the Trainer's loaders, nor a run that trains from a forged step. A run resumed at its
last step (requeued after a late SIGTERM's exit 143) trains nothing and commits nothing."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState

from coci_core import CheckpointManager
from coci_core.commands import cli
from coci_core.engine.agreement import RestoreAgreement
from coci_core.engine.format.manifest import seal
from coci_core.engine.restore.restore import restore_newest
from coci_core.errors import CorruptCheckpointError
from coci_core.storage import open_storage
from coci_core.training import read_checkpoint
from coci_transformers._check import check_saved, parse_trainer_state
from tests.harness.agreement import on_two_ranks
from tests.transformers.run import BATCH, train

Edit = Callable[[dict[str, Any]], None]
FORMAT = ("--format", "transformers")


@pytest.fixture(autouse=True)
def _reset_accelerate_state() -> Any:
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Trainer run of 6 steps: coci committed steps 3 and 6."""
    AcceleratorState._reset_state(True)
    directory = tmp_path_factory.mktemp("saved")
    train(directory, 6)
    AcceleratorState._reset_state(True)
    return directory


def _forge(directory: Path, step: int, edit: Edit) -> None:
    """Edit ``step``'s manifest (a dict of the stored tree) and seal it again."""
    path = directory / "coci" / f"step-{step:010d}" / "manifest.json"
    manifest = json.loads(path.read_bytes())
    manifest.pop("checksum")
    edit(manifest)
    path.write_bytes(seal(json.dumps(manifest, separators=(",", ":")).encode()))


def _tree(manifest: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = manifest["tree"]["v"]
    return tree


def _state_field(name: str, value: Any) -> Edit:
    def edit(manifest: dict[str, Any]) -> None:
        saved = json.loads(_tree(manifest)["trainer_state"])
        _tree(manifest)["trainer_state"] = json.dumps({**saved, name: value})

    return edit


def _set(name: str, value: Any) -> Edit:
    def edit(manifest: dict[str, Any]) -> None:
        _tree(manifest)[name] = value

    return edit


def _planner(name: str, value: Any) -> Edit:
    def edit(manifest: dict[str, Any]) -> None:
        _tree(manifest)["coci"]["v"]["planner"]["v"][name] = value

    return edit


def _python_rng(manifest: dict[str, Any]) -> None:
    rng = manifest["per_rank"][0]["tree"]["v"]["coci_process"]["v"]["rng"]["v"]
    rng["python"] = {"t": "tuple", "v": [3, 1, None]}


def _own_gone(manifest: dict[str, Any]) -> None:
    """Process 0's own state moved to another key, its arrays with it (the manifest still
    holds each array where the tree says): it resumed from its current random states."""
    tree = manifest["per_rank"][0]["tree"]["v"]
    tree["spare"] = tree.pop("coci_process")
    for entry in manifest["per_rank"][0]["tensors"]:
        entry["key"] = entry["key"].replace("/coci_process/", "/spare/")


FORGED: dict[str, Edit] = {
    "unknown field": _set("trainer_state", json.dumps({"bogus": 1})),
    "not JSON": _set("trainer_state", "{{{"),
    "nested past the parser": _set("trainer_state", "[" * 100_000 + "]" * 100_000),
    "a JSON list": _set("trainer_state", "[1]"),
    "global_step a string": _state_field("global_step", "x"),
    "global_step negative": _state_field("global_step", -5),
    "global_step of another step": _state_field("global_step", 3),
    "log_history a string": _state_field("log_history", "abc"),
    # deeper than the 32 a TrainerState is ever nested (its next save would fail)
    "log_history nested": _state_field("log_history", [{"a": json.loads("[" * 40 + "]" * 40)}]),
    "a callback's state a string": _state_field("stateful_callbacks", {"TrainerControl": "x"}),
    "top-level global_step a string": _set("global_step", "x"),
    "top-level global_step huge": _set("global_step", 10**30),
    "data_parallel_size 0": _set("data_parallel_size", 0),
    "scheduler a string": _set("scheduler", "boom"),
    "scaler a string": _set("scaler", "boom"),
    "python rng not a state": _python_rng,
    # coci's own planner state (before: a raw ValueError or AttributeError out of train())
    "planner observed a string": _planner("observed", "x"),
    "planner costs a string": _planner("costs", "x"),
    "planner of another format": _planner("format_version", 2),
    "own random states gone": _own_gone,
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_a_forged_trainer_state_falls_back_to_the_previous_step(
    saved: Path, tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: TypeError from TrainerState(**...), JSONDecodeError, RecursionError, ValueError,
    AttributeError from the scheduler's load_state_dict, TypeError from random.setstate, or
    training from step -5; now step 6 is damaged and the run resumes step 3 to its end."""
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    _forge(tmp_path, 6, FORGED[case])
    result = train(tmp_path, 8, resume=True)
    assert result["start"] == 3
    assert len(result["seen"]) == (8 - 3) * BATCH
    assert "step 6 is damaged, trying an older one" in caplog.text


def test_a_forged_random_state_of_one_rank_makes_every_rank_fall_back(
    saved: Path, tmp_path: Path
) -> None:
    """Two ranks restore one step (threads agreeing through a real store), and only rank 0's
    own random states of step 6 are forged: rank 0 finds step 6 damaged, rank 1 (no state of
    its own saved) finds it intact, and both restore step 3 (before: rank 0 died in
    random.setstate with a TypeError while the other trained on)."""
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    _forge(tmp_path, 6, _python_rng)

    def restore(r: int, agreement: RestoreAgreement) -> int:
        storage = open_storage(str(tmp_path / "coci"))
        loaded, _ = restore_newest(storage, rank=r, agreement=agreement, check=check_saved)
        return loaded.step

    outcome = on_two_ranks(restore)
    assert outcome == [3, 3]


def test_export_of_a_forged_trainer_state_is_one_line(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`coci export --format transformers` of a forged step: one `coci: ...` line and exit
    code 1, as for damage (before: a JSONDecodeError's or RecursionError's traceback); without
    --step it exports the step a resume takes."""
    shutil.copytree(saved, tmp_path / "run")
    for forged in ("{{{", "[" * 100_000 + "]" * 100_000):
        _forge(tmp_path / "run", 6, _set("trainer_state", forged))
        out = str(tmp_path / "out")
        code = cli.main(["export", str(tmp_path / "run" / "coci"), out, "--step", "6", *FORMAT])
        err = capsys.readouterr().err
        assert code == 1
        assert err.startswith("coci: ") and "trainer_state" in err and "Traceback" not in err
        assert not (tmp_path / "out" / "trainer_state.json").exists()
    command = ["export", str(tmp_path / "run" / "coci"), str(tmp_path / "newest")]
    assert cli.main([*command, *FORMAT]) == 0
    assert "exported step 3" in capsys.readouterr().out


def test_the_saved_trainer_state_is_read_as_the_trainer_wrote_it(saved: Path) -> None:
    """The check passes what CociCallback wrote, and says what is wrong with a forged one."""
    state = read_checkpoint(str(saved / "coci"), 6)[0].state
    check_saved(6, state)
    with pytest.raises(CorruptCheckpointError, match="not the step saved"):
        check_saved(3, state)
    assert parse_trainer_state(state["trainer_state"], 6)["global_step"] == 6
    for forged in ({"train_batch_size": None}, {"global_step": 6}):
        with pytest.raises(CorruptCheckpointError, match="train_batch_size"):
            parse_trainer_state(json.dumps(forged))
    rng = {**state["coci_process"]["rng"], "numpy": ("MT19937", 1)}
    with pytest.raises(CorruptCheckpointError, match="its NumPy random state"):
        check_saved(6, {**state, "coci_process": {"rng": rng}})
    check_saved(6, {"layout": "coci.accelerate/1"})  # another adapter's: its layout says so
    # learning rates a scheduler keeps as tensors (Adafactor's schedule, a tensor lr) or NumPy
    # numbers are learning rates all the same (they were refused: no resume at all)
    lrs = {"_last_lr": [torch.tensor(3.6e-7)], "base_lrs": [np.float64(1e-3), 0.1]}
    check_saved(6, {**state, "scheduler": {**state["scheduler"], **lrs}})
    for bad in (["x"], [torch.ones(2)], [True], "0.1"):
        with pytest.raises(CorruptCheckpointError, match="list of learning rates"):
            check_saved(6, {**state, "scheduler": {**state["scheduler"], "_last_lr": bad}})


def test_a_run_resumed_at_its_last_step_trains_nothing(tmp_path: Path) -> None:
    """A finished run started again (a late SIGTERM's exit 143 requeues it): it restores step
    6 and stops before a step, with nothing committed (before: it trained step 7 and committed
    it); the same with max_steps below the step restored."""
    train(tmp_path, 6)
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        before = {s: mgr.manifest(s).sequence for s in mgr.steps()}
    for total in (6, 4):
        AcceleratorState._reset_state(True)
        result = train(tmp_path, total, resume=True)
        assert result["start"] == 6
        assert result["seen"] == []
        assert result["log"][-1]["step"] == 6
        with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
            assert {s: mgr.manifest(s).sequence for s in mgr.steps()} == before
