"""An Accelerate checkpoint whose manifest was forged and resealed (its checksum computed again)
is passed over as damaged inside the restore, by every process together: never a raw error out
of ``random.setstate`` (on the forged process only, after the models were loaded) nor a run that
trains from a forged step. Resumed from the newest step intact, the run ends bit-identical to
one never stopped."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration

from coci_accelerate import CociCheckpointer
from coci_accelerate._check import check_saved
from coci_core import CheckpointError
from coci_core.engine.agreement import RestoreAgreement
from coci_core.engine.format.manifest import seal
from coci_core.engine.restore.restore import restore_newest
from coci_core.storage import open_storage
from tests.accelerate.example import train_like_example
from tests.harness.agreement import on_two_ranks
from tests.harness.processes import child_env, free_port, module, run

Edit = Callable[[dict[str, Any]], None]
_APPLY_CHILD = "tests.accelerate._apply_child"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A run of one epoch: coci committed steps 4, 8 and 12; its result."""
    AcceleratorState._reset_state(True)
    directory = tmp_path_factory.mktemp("saved")
    result = train_like_example(str(directory), epochs=1)
    AcceleratorState._reset_state(True)
    return directory, result


def _own(doc: dict[str, Any]) -> dict[str, Any]:
    """The process's random states in a manifest's tree (process 0)."""
    own: dict[str, Any] = doc["per_rank"][0]["tree"]["v"]["coci_process"]["v"]["rng"]["v"]
    return own


def _top(doc: dict[str, Any]) -> dict[str, Any]:
    top: dict[str, Any] = doc["tree"]["v"]
    return top


def _own_gone(doc: dict[str, Any]) -> None:
    """Process 0's own state moved to another key, its arrays with it (the manifest still
    holds each array where the tree says): the process has no own state to put back."""
    tree = doc["per_rank"][0]["tree"]["v"]
    tree["spare"] = tree.pop("coci_process")
    for entry in doc["per_rank"][0]["tensors"]:
        entry["key"] = entry["key"].replace("/coci_process/", "/spare/")


FORGED: dict[str, Edit] = {
    "python-random-state": lambda doc: _own(doc).__setitem__("python", "boom"),
    "python-random-state-short": lambda doc: _own(doc).__setitem__(
        "python", {"t": "tuple", "v": [3]}
    ),
    "negative-step": lambda doc: _top(doc).__setitem__("completed_steps", -5),
    "accelerate-step": lambda doc: _top(doc).__setitem__("accelerate_step", "x"),
    "loader-position": lambda doc: _top(doc)["dataloaders"]["v"][0]["v"].__setitem__(
        "iteration", "x"
    ),
    # coci's own planner state (before: a raw ValueError out of resume(), after the models
    # were loaded)
    "planner-observed": lambda doc: _top(doc)["coci"]["v"]["planner"]["v"].__setitem__(
        "observed", "x"
    ),
    # a CheckpointError of this process alone, after the restore (a hang in a collective with
    # several processes)
    "own-state-gone": _own_gone,
}


@pytest.mark.parametrize("edit", FORGED.values(), ids=FORGED.keys())
def test_a_forged_state_is_passed_over_and_the_resume_is_exact(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, edit: Edit
) -> None:
    source, reference = saved
    directory = tmp_path / "run"
    shutil.copytree(source, directory)
    path = directory / "coci" / "step-0000000012" / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc.pop("checksum")
    edit(doc)
    path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))
    resumed = train_like_example(str(directory), epochs=1)
    assert resumed["start"] == 8  # the newest step intact
    assert resumed["digest"] == reference["digest"]


def test_a_registered_object_count_forged_on_one_process_is_every_process_error(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Two ranks restore together (threads agreeing through a real store), and process 0's
    own state of step 12 says it registered no object: both raise the same CheckpointError,
    naming the count, inside the restore (before: process 0 alone raised it once the restore
    was done, while the others trained on into a collective with it)."""
    shutil.copytree(saved[0], tmp_path, dirs_exist_ok=True)
    path = tmp_path / "coci" / "step-0000000012" / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc.pop("checksum")
    _own(doc)  # its random states are there
    doc["per_rank"][0]["tree"]["v"]["coci_process"]["v"]["custom"] = {"t": "list", "v": []}
    path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))

    def restore(r: int, agreement: RestoreAgreement) -> int:
        def check(step: int, state: dict[str, Any]) -> None:
            check_saved(step, state, r, ["CociCheckpointer"])

        storage = open_storage(str(tmp_path / "coci"))
        loaded, _ = restore_newest(storage, rank=r, agreement=agreement, check=check)
        return loaded.step

    outcome = on_two_ranks(restore)
    assert all(isinstance(e, CheckpointError) for e in outcome), outcome
    assert str(outcome[0]) == str(outcome[1])
    assert "registered objects: 0 at the save, 1 now (CociCheckpointer)" in str(outcome[0])


def test_a_registered_object_refusing_its_state_on_one_process_stops_every_process(
    tmp_path: Path,
) -> None:
    """A registered object's ``load_state_dict`` raises on process 1 only (two real processes
    under torchrun): both processes' ``resume()`` raise the same CheckpointError naming it
    (before: process 1 alone raised, and process 0 trained on into a collective with it)."""
    port = str(free_port())  # not torchrun's default 29500, which another test may hold
    command = module(
        "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port, "-m", _APPLY_CHILD
    )
    env = child_env({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    out = run([*command, str(tmp_path)], env=env, timeout_s=120)
    assert out.returncode == 0, out.stderr
    results = [json.loads(x[7:]) for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert sorted(r["index"] for r in results) == [0, 1], out.stdout
    errors = {r["error"] for r in results}
    assert errors == {
        "CheckpointError: process 1 could not put step 2's state back (ValueError: n=2 is "
        "not a count this process accepts): every process stops"
    }, errors


class _Counter:
    """An object registered for checkpointing: its state is each process's own."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


class _NoState:
    """A registered object whose ``state_dict()`` returns None; what its
    ``load_state_dict`` was given."""

    def __init__(self) -> None:
        self.loaded: list[object] = []

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: None) -> None:
        self.loaded.append(state)


def _counted_run(
    directory: Path, steps: int, *, counter_first: bool = True, also: object = None
) -> tuple[int, int]:
    """Resume, then train to ``steps`` saving each step, the registered counter at 10 x the
    step: the step resumed from and the counter it restored. ``counter_first``: the counter
    is registered before the checkpointer registers itself, else after; ``also``: an object
    registered right after the counter."""
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(directory),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    counter = _Counter()
    registered = [counter] if also is None else [counter, also]
    if counter_first:
        accelerator.register_for_checkpointing(*registered)
    ckpt = CociCheckpointer(accelerator, policy="every_n_steps", every_n_steps=1, keep_last=None)
    if not counter_first:
        accelerator.register_for_checkpointing(*registered)
    try:
        start = ckpt.resume()
        restored = counter.n
        for step in range(start + 1, steps + 1):
            optimizer.step()
            counter.n = 10 * step
            ckpt.step(step)
    finally:
        ckpt.close()
        AcceleratorState._reset_state(True)
    return start, restored


def test_a_registered_objects_state_forged_away_is_passed_over(tmp_path: Path) -> None:
    """Process 0's own state of step 3 holds None for its registered counter (the manifest
    forged and resealed, that process's entry alone): the step is passed over, the resume
    takes step 2 with the counter's state of step 2 (before: step 3 restored, the counter
    silently left fresh on that process while the others put back theirs)."""
    assert _counted_run(tmp_path, 3) == (0, 0)
    path = tmp_path / "coci" / "step-0000000003" / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc.pop("checksum")
    custom = doc["per_rank"][0]["tree"]["v"]["coci_process"]["v"]["custom"]["v"]
    assert custom[0] == {"t": "dict", "v": {"n": 30}} and custom[1] is None  # the checkpointer's
    custom[0] = None
    path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))
    assert _counted_run(tmp_path, 3) == (2, 20)


def test_a_registered_objects_state_of_none_is_put_back_and_its_record_forged_away_is_not(
    tmp_path: Path,
) -> None:
    """An object whose ``state_dict()`` really returns None: the resume takes the newest
    step and hands it None, as Accelerate's ``load_state`` does (before: its None read as a
    state forged away, and every process passed over every step). A forged manifest that drops
    the record that its state was None, or records a None where a state is, is still damage:
    the step before it is taken."""
    assert _counted_run(tmp_path, 3, also=_NoState()) == (0, 0)
    resumed = _NoState()
    assert _counted_run(tmp_path, 3, also=resumed) == (3, 30)
    assert resumed.loaded == [None]
    for step, forge, taken in (
        (3, lambda own: own.pop("custom_none"), (2, 20)),
        (2, lambda own: own["custom_none"]["v"].append(0), (1, 10)),  # the counter's place
    ):
        path = tmp_path / "coci" / f"step-{step:010d}" / "manifest.json"
        doc = json.loads(path.read_bytes())
        doc.pop("checksum")
        own = doc["per_rank"][0]["tree"]["v"]["coci_process"]["v"]
        assert own["custom"]["v"][1] is None and own["custom_none"] == {"t": "list", "v": [1]}
        forge(own)
        path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))
        resumed = _NoState()
        assert _counted_run(tmp_path, 2, also=resumed) == taken  # (saves no step 3)
        assert resumed.loaded == [None]


def test_objects_registered_in_another_order_are_refused(tmp_path: Path) -> None:
    """The counter saved before the checkpointer, registered after it at the resume: one
    CheckpointError naming the order (before: the counter silently left fresh, its saved
    state handed to the checkpointer's place and dropped)."""
    assert _counted_run(tmp_path, 2) == (0, 0)
    with pytest.raises(CheckpointError, match=r"another order: CociCheckpointer at \[1\]"):
        _counted_run(tmp_path, 2, counter_first=False)
