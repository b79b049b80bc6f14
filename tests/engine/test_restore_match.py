"""A restore into live state that the checkpoint does not match raises before reading (a key it
lacks, unless ``partial=True``; a stored shape other than the live tensor's, always), as DCP's
``load`` does; ``restore(into=...)`` loads its objects in an order every rank agrees on. The
DTensor paths (in place on the same mesh, resharding) are tested with real processes in
``tests/sharding/test_recipe_2d.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager, ConfigError, InPlaceTargets, StateMismatchError


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": {"a": torch.ones(4), "n": 3}, "step": 1}).wait()
    return tmp_path


def test_a_target_key_the_checkpoint_lacks_raises_unless_partial(saved: Path) -> None:
    live = {"model": {"a": torch.zeros(4), "b": torch.zeros(3), "n": torch.zeros(())}}
    with CheckpointManager(saved) as mgr:
        with pytest.raises(StateMismatchError, match="/model/b") as info:
            mgr.restore(targets=InPlaceTargets(live))
        assert info.value.missing == ["/model/b"]  # "n": stored as a number, not missing
        assert torch.equal(live["model"]["a"], torch.zeros(4))  # nothing read
        state = mgr.restore(targets=InPlaceTargets(live), partial=True)
    assert state["model"]["a"] is live["model"]["a"] and torch.equal(
        live["model"]["a"], torch.ones(4)
    )
    assert torch.equal(live["model"]["b"], torch.zeros(3)) and "b" not in state["model"]


def test_a_stored_shape_other_than_the_targets_raises_even_when_partial(saved: Path) -> None:
    live = {"model": {"a": torch.zeros(5)}}
    with CheckpointManager(saved) as mgr:
        for partial in (False, True):
            with pytest.raises(
                StateMismatchError,
                match=r"/model/a: stored \(4,\), live \(5,\) \(the checkpoint holds another "
                r"model: resume with the model it was saved from, or train the changed one as a "
                r"new run, in a directory of its own\)",
            ):
                mgr.restore(targets=InPlaceTargets(live, partial=partial))
    assert torch.equal(live["model"]["a"], torch.zeros(5))


def test_into_a_module_the_checkpoint_does_not_match_raises_before_reading(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": saved.state_dict()}).wait()
    wider = torch.nn.Sequential(torch.nn.Linear(4, 5))
    deeper = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    before = deeper[1].weight.detach().clone()
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(StateMismatchError, match=r"/model/0\.weight: stored \(3, 4\)"):
            mgr.restore(into={"model": wider})
        with pytest.raises(StateMismatchError, match=r"/model/1\.bias, /model/1\.weight"):
            mgr.restore(into={"model": deeper})
        mgr.restore(into={"model": deeper}, partial=True)  # strict=False for the module
    assert torch.equal(deeper[0].weight, saved[0].weight)
    assert torch.equal(deeper[1].weight, before)


def test_into_objects_load_in_sorted_key_order(tmp_path: Path) -> None:
    """Each rank may list ``into`` in another order; a load_state_dict that runs collectives
    must run in the same order on every rank (tested with collectives in
    tests/sharding/test_recipe_2d.py)."""
    loaded: list[str] = []

    class Recorder:
        def __init__(self, key: str) -> None:
            self.key = key

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            loaded.append(self.key)

    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"b": {"x": 1}, "a": {"x": 2}, "c": {"x": 3}}).wait()
        mgr.restore(into={"c": Recorder("c"), "a": Recorder("a"), "b": Recorder("b")})
    assert loaded == ["a", "b", "c"]


def test_partial_must_be_a_bool(saved: Path) -> None:
    with pytest.raises(ConfigError, match="'partial'"):
        InPlaceTargets({}, partial="yes")  # type: ignore[arg-type]
    with CheckpointManager(saved) as mgr, pytest.raises(ConfigError, match="'partial'"):
        mgr.restore(partial=1)  # type: ignore[arg-type]
