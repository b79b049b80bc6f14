"""CociCheckpoint beside ModelCheckpoint ("best" and "last"), trainer.test() after
fit with coci as the only checkpoint callback, load_from_checkpoint of a coci step, and the
log lines (verbose per save, one summary at the end)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from coci_core import ConfigError
from coci_core.engine.format.manifest import MANIFEST_NAME, step_dir_name
from coci_lightning import CociCheckpoint
from tests.lightning.models import digest
from tests.lightning.test_usual_script import _EvalModel, _trainer

pytestmark = pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")


def _fit_with_best_k(root: Path) -> tuple[_EvalModel, pl.Trainer, ModelCheckpoint]:
    """12 steps, validation every 4 (val_loss logged), ModelCheckpoint keeps the best 2,
    coci saves at 4, 8 and 12."""
    pl.seed_everything(2, verbose=False)
    model = _EvalModel()
    best = ModelCheckpoint(dirpath=root / "best", monitor="val_loss", save_top_k=2)
    coci = CociCheckpoint(policy="every_n_steps", every_n_steps=4, keep_last=None)
    trainer = _trainer(root, 12, [coci, best], val_check_interval=4, num_sanity_val_steps=0)
    trainer.fit(model)
    return model, trainer, best


def test_best_and_last_beside_model_checkpoint(tmp_path: Path) -> None:
    """test(ckpt_path="best") loads ModelCheckpoint's best file (no warning about several
    checkpoint callbacks), "last" coci's newest step, and test() without a model Lightning's
    "best" with Lightning's own message."""
    model, trainer, best = _fit_with_best_k(tmp_path)
    assert len(list((tmp_path / "best").glob("*.ckpt"))) == 2
    assert best.best_model_path
    expected = digest(_EvalModel.load_from_checkpoint(best.best_model_path))

    result = trainer.test(ckpt_path="best")
    assert trainer.ckpt_path == best.best_model_path
    assert digest(model) == expected
    assert "test_loss" in result[0]

    with pytest.warns(UserWarning, match="The best model of the previous `fit` call"):
        trainer.test()
    assert trainer.ckpt_path == best.best_model_path
    assert digest(model) == expected

    trainer.test(ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "coci" / step_dir_name(12))


def _last_of_fresh_trainer(root: Path, mc: ModelCheckpoint) -> str | None:
    pl.seed_everything(3, verbose=False)
    trainer = _trainer(root, 1, [CociCheckpoint(root / "coci"), mc])
    trainer.test(_EvalModel(), ckpt_path="last")
    return None if trainer.ckpt_path is None else str(trainer.ckpt_path)


def test_last_is_the_newer_of_coci_and_last_ckpt(tmp_path: Path) -> None:
    """With ModelCheckpoint(save_last=True) too, "last" is the one of coci's newest step and
    last.ckpt with the larger global step (not the younger file: coci's step 8 may become
    durable after last.ckpt of step 10 is written); a tie is coci's."""
    pl.seed_everything(2, verbose=False)
    mc = ModelCheckpoint(dirpath=tmp_path / "mc", save_last=True, every_n_train_steps=5)
    coci = CociCheckpoint(policy="every_n_steps", every_n_steps=4, save_on_train_end=False)
    _trainer(tmp_path, 10, [coci, mc], limit_val_batches=0).fit(_EvalModel())
    last_ckpt = tmp_path / "mc" / "last.ckpt"
    coci_step = tmp_path / "coci" / step_dir_name(8)
    assert last_ckpt.is_file() and coci_step.is_dir()
    assert torch.load(last_ckpt)["global_step"] == 10
    fresh_mc = ModelCheckpoint(dirpath=tmp_path / "mc", save_last=True, every_n_train_steps=5)
    # coci's step 8 written even later than last.ckpt: the step decides
    later = last_ckpt.stat().st_mtime + 5
    os.utime(coci_step / MANIFEST_NAME, (later, later))
    assert _last_of_fresh_trainer(tmp_path, fresh_mc) == str(last_ckpt)

    # a coci step 10 (as save_on_train_end writes): the tie is coci's
    pl.seed_everything(2, verbose=False)
    mc = ModelCheckpoint(dirpath=tmp_path / "mc2", save_last=True, every_n_train_steps=5)
    _trainer(tmp_path / "b", 10, [CociCheckpoint(tmp_path / "coci2"), mc], limit_val_batches=0).fit(
        _EvalModel()
    )
    assert torch.load(tmp_path / "mc2" / "last.ckpt")["global_step"] == 10
    pl.seed_everything(3, verbose=False)
    fresh_mc = ModelCheckpoint(dirpath=tmp_path / "mc2", save_last=True, every_n_train_steps=5)
    trainer = _trainer(tmp_path / "b", 1, [CociCheckpoint(tmp_path / "coci2"), fresh_mc])
    trainer.test(_EvalModel(), ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "coci2" / step_dir_name(10))


def test_last_falls_back_to_last_ckpt_without_coci_steps(tmp_path: Path) -> None:
    """No committed coci step but a last.ckpt: "last" is that file, not a fresh start."""
    pl.seed_everything(2, verbose=False)
    mc = ModelCheckpoint(dirpath=tmp_path / "mc", save_last=True, every_n_train_steps=2)
    coci = CociCheckpoint(policy="every_n_steps", every_n_steps=100, save_on_train_end=False)
    _trainer(tmp_path, 4, [coci, mc], limit_val_batches=0).fit(_EvalModel())
    assert not (tmp_path / "coci" / step_dir_name(4)).exists()
    fresh_mc = ModelCheckpoint(dirpath=tmp_path / "mc", save_last=True, every_n_train_steps=2)
    assert _last_of_fresh_trainer(tmp_path, fresh_mc) == str(tmp_path / "mc" / "last.ckpt")


def test_test_after_fit_with_coci_only_loads_the_newest_kept_checkpoint(
    tmp_path: Path,
) -> None:
    """The default Trainer with CociCheckpoint (it replaces ModelCheckpoint) and no monitor:
    test(), validate() and predict() after fit load "best", which is the newest kept
    checkpoint (as ModelCheckpoint() without a monitor has its newest file as the best)."""
    pl.seed_everything(2, verbose=False)
    model = _EvalModel()
    trainer = _trainer(
        tmp_path,
        6,
        [CociCheckpoint(policy="every_n_steps", every_n_steps=4, save_on_train_end=False)],
        limit_val_batches=0,
    )
    assert trainer.checkpoint_callback is trainer.callbacks[-1]  # coci is Lightning's Checkpoint
    trainer.fit(model)
    newest = str(tmp_path / "coci" / step_dir_name(4))  # step 6 was not saved
    assert trainer.checkpoint_callback.best_model_path == newest
    with pytest.warns(UserWarning, match=r"The best model of the previous `fit` call"):
        result = trainer.test()
    assert "test_loss" in result[0]
    assert trainer.ckpt_path == newest
    at_step_4 = digest(model)
    assert at_step_4 == digest(_EvalModel.load_from_checkpoint(newest))
    trainer.validate(ckpt_path="best")
    assert trainer.ckpt_path == newest
    trainer.predict(ckpt_path="best")
    assert trainer.ckpt_path == newest
    assert digest(model) == at_step_4


def test_load_from_checkpoint_reads_a_coci_step(tmp_path: Path) -> None:
    """LightningModule.load_from_checkpoint(<coci step directory>) gives the saved weights."""
    pl.seed_everything(2, verbose=False)
    model = _EvalModel()
    _trainer(tmp_path, 6, [CociCheckpoint()], limit_val_batches=0).fit(model)
    step = tmp_path / "coci" / step_dir_name(6)
    for path in (step, str(step)):
        loaded = _EvalModel.load_from_checkpoint(path, map_location="cpu")
        assert digest(loaded) == digest(model)
        assert not loaded.training or loaded.net[0].weight.device == torch.device("cpu")
    # the exported .pt loads with plain torch.load (weights_only) and load_from_checkpoint
    from coci_core.commands.cli import main

    assert main(["export", str(tmp_path / "coci"), str(tmp_path / "model.pt")]) == 0
    assert "state_dict" in torch.load(tmp_path / "model.pt")
    exported = _EvalModel.load_from_checkpoint(tmp_path / "model.pt", map_location="cpu")
    assert digest(exported) == digest(model)


def _messages(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


@pytest.mark.parametrize("verbose", [True, False])
def test_verbose_lines_and_end_summary(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, verbose: bool
) -> None:
    """verbose=True: one line per save (step, stall in ms, MB); always one summary at the end."""
    pl.seed_everything(2, verbose=False)
    coci = CociCheckpoint(policy="every_n_steps", every_n_steps=3, verbose=verbose)
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, 6, [coci], limit_val_batches=0).fit(_EvalModel())
    per_save = [m for m in _messages(caplog, "coci_lightning.callback") if "saved: stall" in m]
    # each save is told once: no second line from the engine at the same level
    assert [r.getMessage() for r in caplog.records if "saved step" in r.getMessage()] == []
    if verbose:
        assert [m.split(" saved")[0] for m in per_save] == ["coci: step 3", "coci: step 6"]
        assert all(" ms, " in m and " MB written" in m and "durable" in m for m in per_save)
    else:
        assert per_save == []
    summary = [m for m in _messages(caplog, "coci_lightning.callback") if "committed" in m]
    assert len(summary) == 1
    assert summary[0].startswith("coci: 2 checkpoints committed (newest step 6), total stall ")
    assert " MB written" in summary[0]


def test_verbose_is_checked() -> None:
    with pytest.raises(ConfigError, match="'verbose' must be a bool"):
        CociCheckpoint(verbose="yes")  # type: ignore[arg-type]


def test_a_resumed_run_is_not_warned_of_a_monitored_key_it_logged_before(tmp_path: Path) -> None:
    """monitor= a validation metric: a fresh run's first save, before any validation, warns
    (the key may be misspelt); a resumed run whose checkpoints hold values of that key does not
    warn at its first save before the next validation."""
    import warnings

    def fit(max_steps: int, **fit_kwargs: object) -> list[str]:
        pl.seed_everything(2, verbose=False)
        coci = CociCheckpoint(
            policy="every_n_steps", every_n_steps=3, monitor="val_loss", keep_last=None
        )
        trainer = _trainer(
            tmp_path, max_steps, [coci], val_check_interval=4, num_sanity_val_steps=0
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(_EvalModel(), **fit_kwargs)  # type: ignore[arg-type]
        return [str(w.message) for w in caught if "monitored key" in str(w.message)]

    assert len(fit(8)) == 1  # at step 3, before the first validation (step 4)
    assert fit(14, ckpt_path="last") == []  # resumed at 8: saves at 9 before validating at 12
