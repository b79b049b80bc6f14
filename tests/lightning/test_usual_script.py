"""A normal Lightning script (ModelCheckpoint, other entry points, ddp_spawn)
keeps working with CociCheckpoint attached."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ModelCheckpoint

from coci_core import CheckpointManager, ConfigError
from coci_core.engine.format.manifest import step_dir_name
from coci_core.engine.restore.restore import committed_steps
from coci_core.storage import open_storage
from coci_lightning import CociCheckpoint
from tests.harness.processes import run, script
from tests.lightning.models import DigitsModel, IndexedDigits, digest


def _trainer(root: Path, max_steps: int, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "max_steps": max_steps,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": root,
        "callbacks": callbacks,
        "log_every_n_steps": 1,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_model_checkpoint_files_load_with_weights_only(tmp_path: Path) -> None:
    """The .ckpt files that ModelCheckpoint and trainer.save_checkpoint write next to
    CociCheckpoint load with torch.load (weights_only=True), load_from_checkpoint and
    fit(ckpt_path=...), and the RNG state in them still resumes the random streams."""
    pl.seed_everything(1, verbose=False)
    model = DigitsModel()
    mc = ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=4, save_top_k=-1)
    trainer = _trainer(tmp_path, 8, [CociCheckpoint(save_on_train_end=False), mc])
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "manual.ckpt")
    paths = [*sorted((tmp_path / "mc").glob("*.ckpt")), tmp_path / "manual.ckpt"]
    assert len(paths) == 3
    for path in paths:
        loaded = torch.load(path)  # weights_only=True is torch's default
        assert "rng" in loaded["callbacks"]["CociCheckpoint"]
        restored = DigitsModel.load_from_checkpoint(path)
        assert digest(restored) == digest(model) or path != paths[-1]
    resumed = DigitsModel()
    mc2 = ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=4, save_top_k=-1)
    _trainer(tmp_path, 10, [CociCheckpoint(save_on_train_end=False), mc2]).fit(
        resumed, ckpt_path=paths[0]
    )
    assert len(resumed.seen) == 6 * 16  # resumed from step 4 of the ModelCheckpoint file


def test_plain_rng_states_round_trip() -> None:
    """The callback's random states are plain values and put every stream back."""
    import random

    import numpy as np

    from coci_lightning._rng import collect_plain_rng_states, set_plain_rng_states

    states = collect_plain_rng_states()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.save(states, buffer := __import__("io").BytesIO())
    buffer.seek(0)
    set_plain_rng_states(torch.load(buffer))  # weights_only=True
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


def _configured() -> CociCheckpoint:
    return CociCheckpoint(
        "runs/x",
        policy="every_n_steps",
        every_n_steps=2,
        keep_last=2,
        compression="lossless",
        monitor="train_loss",
    )


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_callback_copies_and_pickles(tmp_path: Path, how: str) -> None:
    """A configured callback deep-copies and pickles (Lightning deep-copies callbacks;
    strategy="ddp_spawn" pickles them) into one with the same settings that trains and saves."""
    callback = _configured()
    callback._relay(_committed_event())  # a pending telemetry event goes along
    copied = copy.deepcopy(callback) if how == "deepcopy" else pickle.loads(pickle.dumps(callback))
    assert copied is not callback
    for name in ("dirpath", "policy", "keep_last", "compression", "monitor", "planner_options"):
        assert getattr(copied, name) == getattr(callback, name)
    assert len(copied._relay._events) == 1
    copied.dirpath = tmp_path / "coci"
    pl.seed_everything(1, verbose=False)
    _trainer(tmp_path, 8, [copied]).fit(DigitsModel())
    with CheckpointManager(tmp_path / "coci") as mgr:
        assert mgr.steps()[-1] == 8 and len(mgr.steps()) <= 3  # keep_last=2 (+ a delta base)


def test_callback_with_a_live_checkpointer_copies(tmp_path: Path) -> None:
    """A copy taken during fit does not share (or try to copy) the live writer; it keeps the
    planner's estimates."""
    callback = CociCheckpoint(policy="every_n_steps", every_n_steps=2)
    copies: list[CociCheckpoint] = []

    class _Copy(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                copies.append(copy.deepcopy(callback))
                copies.append(pickle.loads(pickle.dumps(callback)))

    pl.seed_everything(1, verbose=False)
    _trainer(tmp_path, 6, [callback, _Copy()]).fit(DigitsModel())
    assert len(copies) == 2
    for copied in copies:
        assert copied.checkpointer is None
        assert copied._planner_state is not None and "planner" in copied._planner_state
    with CheckpointManager(tmp_path / "coci") as mgr:
        assert mgr.steps()[-1] == 6


def _committed_event() -> Any:
    from coci_core.telemetry import SaveEvent

    return SaveEvent(step=2, outcome="committed")


@pytest.mark.dist
@pytest.mark.slow
def test_ddp_spawn_fit(tmp_path: Path) -> None:
    """strategy="ddp_spawn" (which pickles the callbacks into 2 CPU processes) trains and saves."""
    pl.seed_everything(1, verbose=False)
    callback = CociCheckpoint(policy="every_n_steps", every_n_steps=2, block=True)
    trainer = _trainer(tmp_path, 4, [callback], devices=2, strategy="ddp_spawn")
    trainer.fit(DigitsModel(batch_size=8, distributed=True))
    with CheckpointManager(tmp_path / "coci") as mgr:
        assert mgr.steps()[-1] == 4
        assert mgr.restore()["global_step"] == 4


class _BadValidation(DigitsModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        raise RuntimeError("validation is broken")

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(IndexedDigits(32), batch_size=16)


def test_failed_sanity_check_commits_nothing(tmp_path: Path) -> None:
    """An exception in the sanity check (before any training) commits no checkpoint: there is
    nothing to save, and a step-0 save would be what "last" resumes from next time. A failure
    in a validation after some steps still saves the step reached."""
    pl.seed_everything(1, verbose=False)
    callback = CociCheckpoint(policy="every_n_steps", every_n_steps=2)
    with pytest.raises(RuntimeError, match="validation is broken"):
        _trainer(tmp_path, 4, [callback]).fit(_BadValidation())
    assert callback.checkpointer is None  # closed
    assert committed_steps(open_storage(str(tmp_path / "coci"))) == []

    pl.seed_everything(1, verbose=False)
    callback = CociCheckpoint(policy="every_n_steps", every_n_steps=100)
    trainer = _trainer(tmp_path, 10, [callback], num_sanity_val_steps=0, val_check_interval=3)
    with pytest.raises(RuntimeError, match="validation is broken"):
        trainer.fit(_BadValidation())
    assert committed_steps(open_storage(str(tmp_path / "coci"))) == [3]


@pytest.mark.parametrize(("n", "expected"), [(3, [3, 6, 9, 12]), (2, [2, 4, 6, 8, 10, 12])])
def test_every_n_steps_saves_exactly_at_multiples(
    tmp_path: Path, n: int, expected: list[int]
) -> None:
    """policy="every_n_steps" saves after the optimizer steps that are multiples of N
    (trainer.global_step), from the first one on: docs/planner.md, "every_n_steps: multiples
    of N"."""
    callback = CociCheckpoint(
        policy="every_n_steps", every_n_steps=n, keep_last=None, save_on_train_end=False
    )
    pl.seed_everything(1, verbose=False)
    _trainer(tmp_path, 12, [callback]).fit(DigitsModel())
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == expected
        assert [mgr.restore(s)["global_step"] for s in expected] == expected


class _EvalModel(DigitsModel):
    """Also validates, tests and predicts on 32 unshuffled samples."""

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y, _ = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def _eval_loader(self) -> Any:
        return torch.utils.data.DataLoader(IndexedDigits(32), batch_size=16)

    val_dataloader = test_dataloader = predict_dataloader = _eval_loader


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 6-step run with coci saves at steps 3 and 6: (its directory, the final weights' digest)."""
    root = tmp_path_factory.mktemp("fitted")
    pl.seed_everything(1, verbose=False)
    model = _EvalModel()
    callback = CociCheckpoint(policy="every_n_steps", every_n_steps=3, keep_last=None)
    _trainer(root, 6, [callback], limit_val_batches=0).fit(model)
    with CheckpointManager(root / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [3, 6]
    return root, digest(model)


@pytest.mark.parametrize("entry", ["validate", "test", "predict"])
@pytest.mark.parametrize("which", ["step_dir", "last", "step_dir_without_callback"])
def test_evaluation_entry_points_read_coci_steps(
    tmp_path: Path, fitted: tuple[Path, str], entry: str, which: str
) -> None:
    """validate/test/predict(ckpt_path=<coci step dir> or "last") on a fresh Trainer load the
    coci checkpoint's weights (the step directory also without a CociCheckpoint attached)."""
    root, final = fitted
    pl.seed_everything(5, verbose=False)
    model = _EvalModel()
    assert digest(model) != final
    callbacks: list[pl.Callback] = []
    if which != "step_dir_without_callback":
        callbacks.append(CociCheckpoint(root / "coci"))
    ckpt_path = "last" if which == "last" else str(root / "coci" / step_dir_name(6))
    trainer = _trainer(tmp_path, 1, callbacks)
    if callbacks:
        result = getattr(trainer, entry)(model, ckpt_path=ckpt_path)
    else:  # Lightning's own note that the checkpoint has a callback's state
        with pytest.warns(UserWarning, match="callbacks used to create the checkpoint"):
            result = getattr(trainer, entry)(model, ckpt_path=ckpt_path)
    assert digest(model) == final
    if entry == "predict":
        assert len(result) == 2 and result[0].shape == (16, 10)
    else:
        assert f"{entry.replace('validate', 'val')}_loss" in result[0]


def test_evaluation_does_not_resume_and_fit_resume_still_does(
    tmp_path: Path, fitted: tuple[Path, str]
) -> None:
    """resume=True means "fit continues": validate(model) without ckpt_path keeps the model's
    own weights, as in Lightning (it used to try to read the newest coci step)."""
    root, final = fitted
    pl.seed_everything(5, verbose=False)
    model = _EvalModel()
    before = digest(model)
    assert before != final
    _trainer(tmp_path, 1, [CociCheckpoint(root / "coci", resume=True)]).validate(model)
    assert digest(model) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dirpath": 123}, r"'dirpath' must be .*str.*os\.PathLike.*fsspec URL.*: 123"),
        ({"dirpath": ""}, "'dirpath' must be"),
        ({"dirpath": ["runs"]}, "'dirpath' must be"),
        ({"save_on_train_end": "yes"}, "'save_on_train_end' must be a bool"),
        ({"save_on_exception": 1}, "'save_on_exception' must be a bool"),
        ({"monitor": 5}, "'monitor' must be the name of a logged metric"),
        ({"monitor": ""}, "'monitor' must be the name of a logged metric"),
        ({"compression_options": [("lossy_bits", 8)]}, "'compression_options' must be a dict"),
        ({"planner_options": "total_steps=10"}, "'planner_options' must be a dict"),
    ],
)
def test_every_argument_is_checked_at_construction(kwargs: dict[str, Any], message: str) -> None:
    """Each bad argument raises ConfigError naming it and what is allowed (the others:
    test_callback.py::test_bad_arguments_raise_at_construction)."""
    with pytest.raises(ConfigError, match=message):
        CociCheckpoint(**kwargs)


def test_dirpath_kinds(tmp_path: Path) -> None:
    """A str path and a PathLike resolve to that directory; an fsspec URL stays a string (a
    pathlib.Path would turn "s3://bucket/run" into "s3:/bucket/run")."""
    trainer = _trainer(tmp_path, 1, [])
    assert CociCheckpoint(str(tmp_path / "a")).resolve_dirpath(trainer) == tmp_path / "a"
    assert CociCheckpoint(tmp_path / "b").resolve_dirpath(trainer) == tmp_path / "b"
    url = CociCheckpoint("s3://bucket/run").resolve_dirpath(trainer)
    assert url == "s3://bucket/run" and isinstance(url, str)


def test_fit_to_an_fsspec_url(tmp_path: Path) -> None:
    """A run saves to an fsspec URL (memory://) and "last" finds its newest step there."""
    url = f"memory://coci-lightning-{tmp_path.name}/run"
    pl.seed_everything(1, verbose=False)
    callback = CociCheckpoint(url, policy="every_n_steps", every_n_steps=2)
    _trainer(tmp_path, 4, [callback]).fit(DigitsModel())
    assert committed_steps(open_storage(url)) == [2, 4]
    newest = CociCheckpoint(url).newest_step_dir(_trainer(tmp_path, 1, []))
    assert newest == f"{url}/{step_dir_name(4)}"


def test_monitor_never_logged_raises_like_model_checkpoint(tmp_path: Path) -> None:
    """monitor= a metric that is never logged: a warning at a save before any validation,
    then MisconfigurationException once a validation has run without it (as ModelCheckpoint);
    the metric that validation does log is fine."""
    pl.seed_everything(1, verbose=False)
    callback = CociCheckpoint(policy="every_n_steps", every_n_steps=3, monitor="val_loss")
    trainer = _trainer(tmp_path, 4, [callback], val_check_interval=2, num_sanity_val_steps=0)
    trainer.fit(_EvalModel())
    assert trainer.global_step == 4
    pl.seed_everything(1, verbose=False)
    callback = CociCheckpoint(policy="every_n_steps", every_n_steps=1, monitor="val_los")
    trainer = _trainer(tmp_path, 8, [callback], val_check_interval=3, num_sanity_val_steps=0)
    with (
        pytest.warns(UserWarning, match="could not find the monitored key"),
        pytest.raises(MisconfigurationException, match=r"monitor='val_los'.*val_loss"),
    ):
        trainer.fit(_EvalModel())
    assert trainer.global_step == 3  # right after the first validation, as ModelCheckpoint


def _plan_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("coci: plan")]


@pytest.mark.slow
def test_max_epochs_run_is_planned_and_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 160-step run given by max_epochs (no max_steps) with default settings is planned over
    its estimated 160 steps, saves before its end, and says its plan in one rank-zero log line:
    the first planned save, the interval, the MTBF and where it came from, how to change it."""
    callback = CociCheckpoint(keep_last=None, save_on_train_end=False)
    pl.seed_everything(1, verbose=False)
    trainer = _trainer(tmp_path, -1, [callback], max_epochs=10, log_every_n_steps=50)
    with caplog.at_level("INFO"):
        trainer.fit(DigitsModel())
    assert trainer.global_step == 160
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        steps = mgr.steps()
    assert steps and steps[0] < 160
    (line,) = _plan_lines(caplog)
    for part in ("of 160 steps", "first save at step", "interval", "MTBF", "mtbf_s="):
        assert part in line, line
    assert "default" in line  # the MTBF's source: nothing given, no failure seen yet


def test_every_n_steps_plan_is_told(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The fixed policy's plan line names its first save and interval."""
    pl.seed_everything(1, verbose=False)
    callback = CociCheckpoint(policy="every_n_steps", every_n_steps=4)
    with caplog.at_level("INFO"):
        _trainer(tmp_path, 8, [callback]).fit(DigitsModel())
    (line,) = _plan_lines(caplog)
    assert "first save at step 4" in line and "every 4 steps" in line, line


def test_importing_coci_lightning_is_enough_to_read_step_dirs() -> None:
    """In a fresh process, importing coci_lightning (without making a CociCheckpoint) installs
    the resolution that reads coci step directories, as docs/lightning.md says."""
    code = (
        "import coci_lightning\n"
        "from lightning.pytorch.trainer.connectors.checkpoint_connector import "
        "_CheckpointConnector\n"
        "print(getattr(_CheckpointConnector._parse_ckpt_path, '_coci', False))\n"
    )
    out = run(script(code), check=True)
    assert out.stdout.strip() == "True"


def test_a_policy_object_as_the_policy(tmp_path: Path) -> None:
    """CociCheckpoint(policy=EveryNSteps(every_n_steps=4)) is policy="every_n_steps",
    every_n_steps=4; anything else that is not a policy is refused at construction."""
    from coci_core.planner import EveryNSteps

    callback = CociCheckpoint(
        policy=EveryNSteps(every_n_steps=4), keep_last=None, save_on_train_end=False
    )
    pl.seed_everything(1, verbose=False)
    _trainer(tmp_path, 12, [callback]).fit(DigitsModel())
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [4, 8, 12]
    with pytest.raises(ConfigError, match="'policy' must be one of"):
        CociCheckpoint(policy=42)  # type: ignore[arg-type]
