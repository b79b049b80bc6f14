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
from accelerate.state import AcceleratorState

from coci_core.engine.format.manifest import seal
from tests.accelerate.example import train_like_example

Edit = Callable[[dict[str, Any]], None]


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
