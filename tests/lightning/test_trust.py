"""A Lightning checkpoint whose manifest was forged and resealed (its checksum computed again)
with this rank's random states made invalid is passed over as damaged inside the restore (by
every rank together): never Lightning's raw ``ValueError`` from ``_set_rng_states`` on that
rank alone. The resume from the newest step intact ends bit-identical to one never forged."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from coci_core.engine.format.manifest import seal
from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel, digest

Edit = Callable[[dict[str, Any]], None]


class _ResumedFrom(pl.Callback):
    """Notes the checkpoint the fit resumed from."""

    path: str | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.path = trainer.ckpt_path


def _fit(root: Path, steps: int) -> tuple[str, str | None]:
    """Fit to ``steps`` (resuming from ``root``): the weights' digest, the step resumed."""
    pl.seed_everything(1, verbose=False)
    model = DigitsModel()
    callback = CociCheckpoint(policy="every_n_steps", every_n_steps=3, keep_last=None, resume=True)
    seen = _ResumedFrom()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[callback, seen],
        limit_val_batches=0,
    )
    trainer.fit(model)
    return digest(model), seen.path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A run of 6 steps (coci saves at steps 3 and 6); the digest of the same run resumed to
    step 9 from its intact copy."""
    root = tmp_path_factory.mktemp("saved")
    _fit(root, 6)
    intact = tmp_path_factory.mktemp("intact")
    shutil.copytree(root, intact, dirs_exist_ok=True)
    return root, _fit(intact, 9)[0]


def _rng(doc: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's random states in a manifest."""
    rng: dict[str, Any] = doc["per_rank"][0]["tree"]["v"]["coci_rank_state"]["v"]["rng"]["v"]
    return rng


def _numpy_none(doc: dict[str, Any]) -> None:
    """NumPy's state made None, its array kept in the tree under another key (the manifest
    still holds each of its arrays where the tree says)."""
    rng = _rng(doc)
    rng["spare"], rng["numpy"] = rng["numpy"], None
    for entry in doc["per_rank"][0]["tensors"]:
        entry["key"] = entry["key"].replace("/rng/numpy/", "/rng/spare/")


def _own_gone(doc: dict[str, Any]) -> None:
    """Rank 0's own state moved to another key, its arrays with it (the manifest still holds
    each array where the tree says): it trained on from its current random states."""
    tree = doc["per_rank"][0]["tree"]["v"]
    tree["spare"] = tree.pop("coci_rank_state")
    for entry in doc["per_rank"][0]["tensors"]:
        entry["key"] = entry["key"].replace("/coci_rank_state/", "/spare/")


def _planner_observed(doc: dict[str, Any]) -> None:
    """The callback's planner state (wherever Lightning keeps the callback's state) says it
    observed "x" steps."""
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            planner = node.get("planner")
            inner = planner.get("v") if isinstance(planner, dict) else None
            if isinstance(inner, dict) and "observed" in inner:
                found.append(inner)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc["tree"])
    assert found, "no planner state in the manifest"
    for planner in found:
        planner["observed"] = "x"


FORGED: dict[str, Edit] = {
    "python-str": lambda doc: _rng(doc).__setitem__("python", "boom"),
    "python-short": lambda doc: _rng(doc).__setitem__("python", {"t": "list", "v": [3]}),
    "numpy": lambda doc: _rng(doc).__setitem__("numpy", {"t": "list", "v": ["MT19937", 1]}),
    "torch": lambda doc: _rng(doc).__setitem__("torch", "x"),
    # the key Lightning's _set_rng_states reads: an AttributeError or TypeError on that rank
    "cuda-str": lambda doc: _rng(doc).__setitem__("torch.cuda", "x"),
    "cuda-int": lambda doc: _rng(doc).__setitem__("torch.cuda", 3),
    "numpy-none": _numpy_none,
    "python-gauss-str": lambda doc: _rng(doc)["python"]["v"].__setitem__(2, "x"),
    "own-state-gone": _own_gone,
    # coci's own planner state (before: a raw ValueError out of fit())
    "planner-observed": _planner_observed,
}


@pytest.mark.parametrize("edit", FORGED.values(), ids=FORGED.keys())
def test_forged_random_states_are_passed_over_and_the_resume_is_exact(
    saved: tuple[Path, str], tmp_path: Path, edit: Edit
) -> None:
    source, expected = saved
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    path = tmp_path / "coci" / "step-0000000006" / "manifest.json"
    doc = json.loads(path.read_bytes())
    doc.pop("checksum")
    edit(doc)
    path.write_bytes(seal(json.dumps(doc, separators=(",", ":")).encode()))
    final, resumed = _fit(tmp_path, 9)
    assert str(resumed).endswith("step-0000000003")  # the newest intact
    assert final == expected  # bit-identical
