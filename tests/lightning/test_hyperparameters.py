"""A LightningModule with OmegaConf hyper-parameters (``save_hyperparameters`` of a
``DictConfig``, as every Hydra project does) trains and saves with CociCheckpoint, and its
checkpoints load back as Lightning's own do: the restored state, ``load_from_checkpoint`` of a
coci step and of ``coci export``'s file, and a resumed fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, ListConfig, OmegaConf

from coci_core import CheckpointManager
from coci_core.commands.cli import main as coci
from coci_core.engine.format.manifest import step_dir_name
from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel, digest

pytestmark = pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")


def _config() -> DictConfig:
    """A Hydra-like config: nested nodes, a list, an interpolation, read-only."""
    config = OmegaConf.create(
        {
            "optim": {"lr": 0.01, "betas": [0.9, 0.99]},
            "data": {"batch_size": 16, "root": "/data/digits"},
            "run": {"name": "digits-${data.batch_size}", "seeds": [1, 2]},
        }
    )
    OmegaConf.set_readonly(config, True)
    return config


class _ConfigModel(DigitsModel):
    """``self.save_hyperparameters(cfg)``: the config is the module's ``hparams``."""

    def __init__(self, cfg: DictConfig) -> None:
        super().__init__(batch_size=cfg.data.batch_size)
        self.save_hyperparameters(cfg)


class _ArgumentsModel(DigitsModel):
    """``self.save_hyperparameters()`` of arguments that are configs: ``hparams`` is a dict."""

    def __init__(self, model: DictConfig, layers: ListConfig, width: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()


def _fit(root: Path, model: pl.LightningModule, steps: int, **fit_kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[
            CociCheckpoint(policy="every_n_steps", every_n_steps=3, keep_last=None),
            ModelCheckpoint(dirpath=root / "mc", every_n_train_steps=3, save_top_k=-1),
        ],
    )
    trainer.fit(model, **fit_kwargs)
    return trainer


def test_a_dictconfig_module_trains_and_its_checkpoints_load_as_lightnings_do(
    tmp_path: Path,
) -> None:
    """fit() ends with its checkpoints (no error at the first save); each holds the config as a
    DictConfig equal to the original (its interpolation kept, read-only), with Lightning's
    hparams_type; load_from_checkpoint of a coci step and of the exported .ckpt gives what it
    gives for ModelCheckpoint's file of the same step; a resumed fit continues."""
    config = _config()
    pl.seed_everything(1, verbose=False)
    model = _ConfigModel(config)
    _fit(tmp_path, model, 6)
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [3, 6]
        state = mgr.restore(6)
    saved = state["hyper_parameters"]
    assert type(saved) is DictConfig and saved == config
    assert OmegaConf.is_interpolation(saved.run, "name") and saved.run.name == "digits-16"
    assert OmegaConf.is_readonly(saved)
    assert state["hparams_type"] is DictConfig
    assert state["hparams_name"] == "cfg"

    own = _ConfigModel.load_from_checkpoint(
        tmp_path / "mc" / "epoch=0-step=6.ckpt", weights_only=False
    )
    from_step = _ConfigModel.load_from_checkpoint(tmp_path / "coci" / step_dir_name(6))
    assert coci(["export", str(tmp_path / "coci"), str(tmp_path / "model.ckpt")]) == 0
    exported = _ConfigModel.load_from_checkpoint(tmp_path / "model.ckpt", weights_only=False)
    for loaded in (from_step, exported):
        assert type(loaded.hparams) is DictConfig
        assert loaded.hparams == own.hparams == config
        assert digest(loaded) == digest(own) == digest(model)

    pl.seed_everything(2, verbose=False)
    resumed = _ConfigModel(config)
    trainer = _fit(tmp_path, resumed, 9, ckpt_path="last")
    assert trainer.global_step == 9
    assert CheckpointManager(tmp_path / "coci", keep_last=None).steps() == [3, 6, 9]


def test_configs_among_the_init_arguments_come_back_as_configs(tmp_path: Path) -> None:
    """save_hyperparameters() of __init__ arguments that are a DictConfig and a ListConfig: the
    saved hyper-parameters are a dict holding them, and load_from_checkpoint of a coci step
    builds the module with equal configs, as from ModelCheckpoint's file."""
    node = OmegaConf.create({"hidden": 64, "act": "relu", "tag": "${act}-${hidden}"})
    layers = OmegaConf.create([{"out": 64}, {"out": 10}])
    pl.seed_everything(1, verbose=False)
    _fit(tmp_path, _ArgumentsModel(node, layers, width=32), 3)
    state = CheckpointManager(tmp_path / "coci").restore(3)
    saved = state["hyper_parameters"]
    assert type(saved) is dict and saved["width"] == 32
    assert type(saved["model"]) is DictConfig and saved["model"] == node
    assert OmegaConf.is_interpolation(saved["model"], "tag")
    assert type(saved["layers"]) is ListConfig and saved["layers"] == layers
    own = _ArgumentsModel.load_from_checkpoint(
        tmp_path / "mc" / "epoch=0-step=3.ckpt", weights_only=False
    )
    loaded = _ArgumentsModel.load_from_checkpoint(tmp_path / "coci" / step_dir_name(3))
    assert dict(loaded.hparams) == dict(own.hparams)
    assert type(loaded.hparams["model"]) is DictConfig and loaded.hparams["model"] == node
    assert digest(loaded) == digest(own)
