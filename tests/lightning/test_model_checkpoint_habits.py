"""What a ModelCheckpoint user brings to CociCheckpoint (issue 42): ``every_n_train_steps=``
(the every_n_steps policy), ``train_time_interval`` (every_n_seconds), ``mode="max"``,
``save_weights_only``, ``filename``, ``save_top_k`` and ``save_last=False`` (refused, saying
why), and ``coci export --weights-only``, whose file ``load_state_dict`` reads."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from coci_core import CheckpointManager
from coci_core.engine.format.manifest import step_dir_name
from coci_core.errors import ConfigError
from coci_lightning import CociCheckpoint
from tests.harness.processes import module, run
from tests.lightning.models import DigitsModel
from tests.lightning.test_usual_script import _EvalModel, _trainer

# the accuracy each validation logs, by the training step it follows
VAL_ACC = {3: 0.5, 6: 0.875, 9: 0.75}


class _Accuracy(_EvalModel):
    """Logs ``val_acc`` from :data:`VAL_ACC`: a metric to maximise, its best step known."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_acc", VAL_ACC[self.trainer.global_step])


def test_every_n_train_steps_saves_every_n_steps(tmp_path: Path) -> None:
    """``every_n_train_steps=3`` (ModelCheckpoint's name): a save at steps 3 and 6, and the
    final one at 7, as ``policy="every_n_steps", every_n_steps=3``."""
    pl.seed_everything(3, verbose=False)
    coci = CociCheckpoint(every_n_train_steps=3, keep_last=None, preemption=None)
    assert coci.options.policy == "every_n_steps"
    assert coci.options.planner_options["every_n_steps"] == 3
    _trainer(tmp_path, 7, [coci], limit_val_batches=0).fit(DigitsModel())
    with CheckpointManager(tmp_path / "coci") as mgr:
        assert mgr.steps() == [3, 6, 7]


@pytest.mark.filterwarnings("ignore:`CociCheckpoint\\(monitor='val_acc'\\)` could not")
def test_mode_max_takes_the_highest_value_as_best(tmp_path: Path) -> None:
    """``mode="max"``: ``best_model_path`` is the save with the highest ``val_acc``."""
    pl.seed_everything(3, verbose=False)
    coci = CociCheckpoint(
        monitor="val_acc", mode="max", every_n_train_steps=3, keep_last=None, preemption=None
    )
    trainer = _trainer(
        tmp_path, 9, [coci], val_check_interval=3, limit_val_batches=1, num_sanity_val_steps=0
    )
    trainer.fit(_Accuracy())
    assert coci.best_model_path == str(tmp_path / "coci" / step_dir_name(6))
    assert coci.best_model_score == 0.875


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"save_weights_only": True}, "coci export DIR model.safetensors --weights-only"),
        ({"filename": "{epoch}-{step}"}, "names each checkpoint by its step"),
        ({"every_n_train_steps": 5, "every_n_steps": 5}, "coci's 'every_n_steps': pass one"),
        ({"every_n_train_steps": 5, "policy": "young"}, "pass every_n_steps=N"),
        ({"every_n_train_steps": 0}, "an integer >= 1"),
        ({"mode": "maximize"}, "'mode' must be 'min'"),
        ({"save_top_k": 2}, "ModelCheckpoint(monitor=..., save_top_k=k) beside"),
        ({"save_last": False}, "coci always keeps its newest checkpoint"),
        ({"save_last": "link"}, "coci always keeps its newest checkpoint"),
        ({"train_time_interval": 5}, "must be a datetime.timedelta"),
        ({"train_time_interval": timedelta(0)}, "must be a datetime.timedelta"),
        (
            {"train_time_interval": timedelta(minutes=5), "every_n_seconds": 60.0},
            "pass one of train_time_interval",
        ),
        ({"train_time_interval": timedelta(minutes=5), "policy": "epoch"}, "every_n_seconds=S"),
        ({"policy": "epoch", "every_n_steps": 10}, "policy 'epoch' does not use it"),
    ],
)
def test_model_checkpoint_arguments_coci_refuses_say_why(
    arguments: dict[str, Any], says: str
) -> None:
    """A ConfigError naming the argument and what to do, not a bare TypeError."""
    with pytest.raises(ConfigError, match=r"'(\w+)'") as raised:
        CociCheckpoint(**arguments)
    assert says in str(raised.value)


def test_model_checkpoint_arguments_that_coci_does_are_taken() -> None:
    """``save_last=True`` is what coci does; ``train_time_interval`` is the every_n_seconds
    policy, as ``every_n_train_steps`` is the every_n_steps one."""
    assert CociCheckpoint(save_last=True).options.policy == "coci"
    timed = CociCheckpoint(train_time_interval=timedelta(minutes=30))
    assert timed.options.policy == "every_n_seconds"
    assert timed.options.planner_options["every_n_seconds"] == 1800.0


def test_the_epoch_plan_line_says_how_to_change_an_epoch_interval() -> None:
    """The epoch policy's advice named every_n_steps=N, which that policy ignored."""
    from coci_core.planner import Planner
    from coci_core.training.outline import PlanOutline

    advice = PlanOutline.of(Planner(policy="epoch", steps_per_epoch=5)).fixed_advice("X")
    assert "X(policy='every_n_steps', every_n_steps=N)" in advice


def test_export_weights_only_loads_into_the_module(tmp_path: Path) -> None:
    """``coci export DIR model.safetensors --weights-only`` of a Lightning checkpoint: keys as
    the LightningModule's ``state_dict()`` (no ``state_dict.`` prefix), read by
    ``model.load_state_dict(load_file(path))`` as it is; ``model.pt`` likewise with torch.load."""
    from safetensors.torch import load_file

    pl.seed_everything(3, verbose=False)
    trained = DigitsModel()
    coci = CociCheckpoint(every_n_train_steps=4, preemption=None)
    _trainer(tmp_path, 4, [coci], limit_val_batches=0).fit(trained)
    directory = str(tmp_path / "coci")
    for name in ("model.safetensors", "model.pt"):
        out = tmp_path / name
        done = run(
            module("coci_core.commands.cli", "export", directory, str(out), "--weights-only")
        )
        assert done.returncode == 0, done.stderr
        assert "weights of step 4" in done.stdout
        weights = load_file(out) if name.endswith(".safetensors") else torch.load(out)
        assert sorted(weights) == sorted(trained.state_dict())
        fresh = DigitsModel()
        fresh.load_state_dict(weights)  # strict: every key, no prefix
        for key, value in trained.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], value), key
    dcp = ("export", directory, str(tmp_path / "d"), "--weights-only", "--format", "dcp")
    refused = run(module("coci_core.commands.cli", *dcp))
    assert refused.returncode == 2 and "--weights-only writes" in refused.stderr


def test_a_relative_dirpath_is_where_the_callback_was_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``ModelCheckpoint``: ``CociCheckpoint(dirpath="ckpt")`` made in one directory saves
    there after a ``cd`` (the process's working directory changed before ``fit``)."""
    monkeypatch.chdir(tmp_path)
    coci = CociCheckpoint(dirpath="ckpt", preemption=None)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    _trainer(tmp_path, 2, [coci], limit_val_batches=0).fit(DigitsModel())
    assert not (tmp_path / "elsewhere" / "ckpt").exists()
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.steps() == [2]


class _OwnCheckpoint(CociCheckpoint):
    """A user's subclass, defined outside coci_lightning."""


@pytest.mark.parametrize("kind", [CociCheckpoint, _OwnCheckpoint])
def test_enable_checkpointing_false_beside_coci_says_what_to_do(
    tmp_path: Path, kind: type[CociCheckpoint]
) -> None:
    """Lightning's own refusal names a ``ModelCheckpoint`` that is not there."""
    with pytest.raises(
        Exception,
        match=r"enable_checkpointing=False\) with a CociCheckpoint.*"
        r"leave enable_checkpointing out",
    ):
        _trainer(tmp_path, 2, [kind(preemption=None)], enable_checkpointing=False)
