"""CociCheckpoint on a real Lightning Trainer (CPU): exact resume, fallback, warnings, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from coci_core import CheckpointManager, ConfigError
from coci_core.engine.format.manifest import step_dir_name
from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel, digest

STEPS_PER_EPOCH = 16  # 256 samples, batches of 16


def _trainer(root: Path, max_steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=callbacks,
        log_every_n_steps=1,
    )


def _fit(
    root: Path, max_steps: int, callbacks: list[pl.Callback], seed: int = 1, **fit_kwargs: Any
) -> DigitsModel:
    pl.seed_everything(seed, verbose=False)
    model = DigitsModel()
    _trainer(root, max_steps, callbacks).fit(model, **fit_kwargs)
    return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> DigitsModel:
    """An uninterrupted 40-step run (2.5 epochs) without checkpoints."""
    return _fit(tmp_path_factory.mktemp("ref"), 40, [])


@pytest.mark.parametrize("how", ["ckpt_path_last", "resume_true", "explicit_step_dir"])
def test_interrupted_run_resumes_bit_exact_and_exactly_once(
    tmp_path: Path, reference: DigitsModel, how: str
) -> None:
    """A run stopped at step 23 and resumed (from step 20, mid-epoch) ends bit-identical,
    having trained on each remaining sample exactly once."""
    first = _fit(
        tmp_path,
        23,
        [CociCheckpoint(policy="every_n_steps", every_n_steps=5, save_on_train_end=False)],
    )
    assert CheckpointManager(tmp_path / "coci", keep_last=None).steps() == [10, 15, 20]
    kwargs: dict[str, Any] = {}
    if how == "ckpt_path_last":
        kwargs["ckpt_path"] = "last"
    elif how == "explicit_step_dir":
        kwargs["ckpt_path"] = str(tmp_path / "coci" / step_dir_name(20))
    callback = CociCheckpoint(policy="every_n_steps", every_n_steps=5, resume=how == "resume_true")
    resumed = _fit(tmp_path, 40, [callback], seed=99, **kwargs)  # another seed: state comes back
    assert digest(resumed) == digest(reference)
    done = 20 * 16
    assert first.seen[:done] == reference.seen[:done]
    assert resumed.seen == reference.seen[done:]
    epoch2 = first.seen[256:done] + resumed.seen[: 512 - done]
    assert sorted(epoch2) == list(range(256))


class _LoadedInPlace(pl.Callback):
    """Records whether the checkpoint Lightning loads holds the module's own tensors."""

    def __init__(self) -> None:
        self.same: list[bool] = []

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        live = pl_module.state_dict()
        self.same = [
            t.data_ptr() == live[k].data_ptr() for k, t in checkpoint["state_dict"].items()
        ]


def test_resume_reads_the_module_in_place(tmp_path: Path, reference: DigitsModel) -> None:
    """A resume reads the module's tensors straight into it (the checkpoint Lightning gets
    holds them: no second copy) and still ends bit-identical."""
    _fit(tmp_path, 23, [CociCheckpoint(policy="every_n_steps", every_n_steps=5)])
    probe = _LoadedInPlace()
    resumed = _fit(
        tmp_path,
        40,
        [CociCheckpoint(policy="every_n_steps", every_n_steps=5), probe],
        seed=99,
        ckpt_path="last",
    )
    assert probe.same and all(probe.same)
    assert digest(resumed) == digest(reference)


class _KeepsHead(DigitsModel):
    """Keeps its own output layer when it loads a checkpoint (as for fine-tuning)."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"]["net.3.weight"] = self.net[3].weight.detach().clone()


def test_a_module_that_changes_what_it_loads_is_not_filled_in_place(tmp_path: Path) -> None:
    """A LightningModule whose on_load_checkpoint replaces a weight gets the weight it chose:
    its tensors are not overwritten before the hook runs."""
    _fit(tmp_path, 10, [CociCheckpoint(policy="every_n_steps", every_n_steps=5)])
    with CheckpointManager(tmp_path / "coci") as mgr:
        saved = mgr.restore(step=10)["state_dict"]
    pl.seed_everything(7, verbose=False)
    model = _KeepsHead()
    head = model.net[3].weight.detach().clone()
    assert not torch.equal(head, saved["net.3.weight"])
    callback = CociCheckpoint(policy="every_n_steps", every_n_steps=5, save_on_train_end=False)
    _trainer(tmp_path, 10, [callback]).fit(model, ckpt_path="last")  # nothing left to train
    assert torch.equal(model.net[3].weight, head)
    assert torch.equal(model.net[0].weight, saved["net.0.weight"])


def test_lossless_compression_resumes_bit_exact(tmp_path: Path, reference: DigitsModel) -> None:
    """With compression="lossless" the saves are XOR deltas against a base that retention
    keeps, and the resume is still bit-exact."""
    callback = CociCheckpoint(
        policy="every_n_steps", every_n_steps=5, compression="lossless", save_on_train_end=False
    )
    _fit(tmp_path, 23, [callback])
    with CheckpointManager(tmp_path / "coci") as mgr:
        assert mgr.steps() == [5, 10, 15, 20]  # 5 is the base the kept deltas need
        manifest = mgr.manifest(20)
    assert manifest.bases == (5,)
    assert manifest.nbytes < 0.9 * sum(t.raw_nbytes for t in manifest.tensors)
    resumed = _fit(
        tmp_path,
        40,
        [CociCheckpoint(policy="every_n_steps", every_n_steps=5, compression="lossless")],
        seed=99,
        ckpt_path="last",
    )
    assert digest(resumed) == digest(reference)


def test_damaged_newest_falls_back_to_previous(
    tmp_path: Path, reference: DigitsModel, caplog: pytest.LogCaptureFixture
) -> None:
    """With the newest step damaged, ckpt_path='last' resumes from the one before, exactly."""
    _fit(
        tmp_path,
        23,
        [
            CociCheckpoint(
                policy="every_n_steps", every_n_steps=5, save_on_train_end=False, keep_last=None
            )
        ],
    )
    data = tmp_path / "coci" / step_dir_name(20) / "data-r0.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with caplog.at_level("WARNING", logger="coci_core"), caplog.at_level("INFO", "lightning"):
        resumed = _fit(
            tmp_path,
            40,
            [CociCheckpoint(policy="every_n_steps", every_n_steps=5)],
            ckpt_path="last",
        )
    assert "step 20 is damaged, trying an older one" in caplog.text
    # Lightning names the step restored, not the damaged one it was given
    restored = tmp_path / "coci" / step_dir_name(15)
    assert f"Restored all states from the checkpoint at {restored}" in caplog.text
    assert step_dir_name(20) not in caplog.text.split("Restored all states", 1)[1]
    # Lightning's restore reports its event like the manager's, to the run's telemetry
    lines = (tmp_path / "coci" / "telemetry.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    restores = [r for r in records if r["type"] == "restore"]
    assert [(r["step"], r["skipped_steps"]) for r in restores] == [(15, [20])]
    assert digest(resumed) == digest(reference)
    assert resumed.seen == reference.seen[15 * 16 :]


def test_default_callback_saves_at_end_with_lightning_state(tmp_path: Path) -> None:
    """CociCheckpoint() with no arguments saves (at least) the final step with the full
    Lightning state, under default_root_dir/coci."""
    _fit(tmp_path, 12, [CociCheckpoint()])
    with CheckpointManager(tmp_path / "coci") as mgr:
        assert mgr.steps()[-1] == 12
        state = mgr.restore()
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks"):
        assert key in state
    assert state["global_step"] == 12
    assert "planner" in state["callbacks"]["CociCheckpoint"]


class _Boom(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 7:
            raise RuntimeError("boom")


def test_exception_saves_a_checkpoint(tmp_path: Path) -> None:
    """An exception during fit saves the current step before the error propagates."""
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, 30, [CociCheckpoint(policy="every_n_steps", every_n_steps=100), _Boom()])
    assert CheckpointManager(tmp_path / "coci").steps() == [7]


def test_planner_state_survives_resume(tmp_path: Path) -> None:
    """The planner's measured estimates saved with a step come back into the resumed planner
    (after a failure: the run stopped on an error at step 7, saving that step)."""
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, 30, [CociCheckpoint(policy="every_n_steps", every_n_steps=5), _Boom()])
    with CheckpointManager(tmp_path / "coci") as mgr:
        saved = mgr.restore()["callbacks"]["CociCheckpoint"]["planner"]
    seen: dict[str, Any] = {}

    class _Peek(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
            seen.update(callback.checkpointer.planner.state_dict())  # type: ignore[union-attr]

    callback = CociCheckpoint(policy="every_n_steps", every_n_steps=5, resume=True)
    _fit(tmp_path, 12, [callback, _Peek()])
    saved = json.loads(json.dumps(saved))
    # the resume itself is recorded on top of the saved state: one more failure, its restore
    assert seen["failures"] == saved["failures"] + 1
    assert seen["costs"]["restart_s"][:-1] == saved["costs"]["restart_s"]
    assert seen["force_replan"]
    assert seen["elapsed_s"] > saved["elapsed_s"]
    moved = {"failures", "costs", "force_replan", "session", "recorded", "elapsed_s"}
    assert {k: v for k, v in seen.items() if k not in moved} == {
        k: v for k, v in saved.items() if k not in moved
    }
    assert {k: v for k, v in seen["costs"].items() if k != "restart_s"} == {
        k: v for k, v in saved["costs"].items() if k != "restart_s"
    }


def test_plain_dataloader_warns_once(tmp_path: Path) -> None:
    """A plain DataLoader gets one clear warning naming StatefulDataLoader."""
    pl.seed_everything(1, verbose=False)
    model = DigitsModel(stateful_loader=False)
    with pytest.warns(UserWarning, match="StatefulDataLoader") as record:
        _trainer(tmp_path, 3, [CociCheckpoint()]).fit(model)
    assert sum("StatefulDataLoader" in str(w.message) for w in record) == 1


def test_resume_with_nothing_committed_starts_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """resume=True on an empty directory trains from step 0 and says so."""
    with caplog.at_level("INFO"):
        model = _fit(tmp_path, 5, [CociCheckpoint(resume=True)])
    assert len(model.seen) == 5 * 16
    assert "starting fresh" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "sometimes"}, "'policy' must be one of"),
        ({"keep_last": 0}, "'keep_last'"),
        ({"mtbf_s": -1.0}, "'mtbf_s'"),
        ({"objective": "speed"}, "'objective'"),
        ({"compression": "zstd"}, "'compression'"),
        ({"compression": "lossy", "compression_options": {"lossy_bits": 3}}, "'lossy_bits'"),
        ({"policy": "every_n_steps"}, "'every_n_steps' must be given"),
        ({"resume": "yes"}, "'resume' must be a bool"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs: dict[str, Any], message: str) -> None:
    """Each bad argument raises ConfigError naming it, before any training."""
    with pytest.raises(ConfigError, match=message):
        CociCheckpoint(**kwargs)


def test_a_dirpath_that_cannot_be_written_names_it(tmp_path: Path) -> None:
    """A ``dirpath`` under a regular file (a newcomer's slip; a read-only mount fails the
    same way) is a StorageError naming the checkpoint directory when ``fit`` starts, before
    any training, not a bare NotADirectoryError from coci's telemetry file."""
    from coci_core.errors import StorageError

    (tmp_path / "notes").write_text("a file")
    dirpath = tmp_path / "notes" / "coci"
    with pytest.raises(StorageError) as raised:
        _fit(tmp_path, 2, [CociCheckpoint(dirpath=dirpath)])
    said = str(raised.value)
    assert f"cannot write in the checkpoint directory {str(dirpath)!r} (dirpath)" in said
    assert "Not a directory" in said and raised.value.errno == 20


def test_ckpt_path_of_the_checkpoint_directory_says_what_to_give(tmp_path: Path) -> None:
    """``fit(ckpt_path="<root>/coci")``, the directory rather than one of its steps: a
    ValueError naming a step to give or "last", not the IsADirectoryError of Lightning's
    torch.load."""
    _fit(tmp_path, 2, [CociCheckpoint()])
    with pytest.raises(ValueError, match="is a coci checkpoint directory, not a checkpoint") as e:
        _fit(tmp_path, 4, [CociCheckpoint()], ckpt_path=str(tmp_path / "coci"))
    assert repr(str(tmp_path / "coci" / step_dir_name(2, 0))) in str(e.value)
    assert "ckpt_path='last'" in str(e.value)


def test_replaces_default_model_checkpoint(tmp_path: Path) -> None:
    """As a Checkpoint callback it replaces Lightning's default ModelCheckpoint."""
    trainer = _trainer(tmp_path, 1, [CociCheckpoint()])
    assert [type(cb).__name__ for cb in trainer.checkpoint_callbacks] == ["CociCheckpoint"]
    assert torch.get_num_threads() >= 1


def test_save_planned_on_an_epochs_last_batch_is_taken_at_that_step(
    tmp_path: Path, reference: DigitsModel
) -> None:
    """A save planned on the last batch of an epoch is taken at that step (as
    ModelCheckpoint(every_n_train_steps=16) takes it), and the resume from it, which runs the
    epoch's end work (an epoch-interval LR schedule), is bit-exact."""
    _fit(
        tmp_path,
        20,
        [CociCheckpoint(policy="every_n_steps", every_n_steps=16, save_on_train_end=False)],
    )
    assert CheckpointManager(tmp_path / "coci").steps() == [16]
    resumed = _fit(
        tmp_path,
        40,
        [CociCheckpoint(policy="every_n_steps", every_n_steps=16)],
        seed=99,
        ckpt_path="last",
    )
    assert digest(resumed) == digest(reference)
    assert resumed.seen == reference.seen[16 * 16 :]


def test_a_fresh_fit_into_another_runs_directory(
    tmp_path: Path, reference: DigitsModel, caplog: pytest.LogCaptureFixture
) -> None:
    """A fresh fit() into a directory with another run's checkpoints warns, never deletes or
    overwrites them (a step both runs reach is saved beside the other's, ``-v1``), and
    ckpt_path="last" then resumes the new run's newest checkpoint, exactly."""
    _fit(tmp_path, 40, [CociCheckpoint(policy="every_n_steps", every_n_steps=10)], seed=7)
    root = tmp_path / "coci"
    old = {s: (root / step_dir_name(s) / "manifest.json").read_bytes() for s in (20, 30, 40)}
    with caplog.at_level("WARNING", logger="coci_core"):
        _fit(
            tmp_path,
            23,
            [CociCheckpoint(policy="every_n_steps", every_n_steps=10, save_on_train_end=False)],
        )
    assert "holds 3 checkpoint(s) of another run (steps 20, 30, 40)" in caplog.text
    assert {s: (root / step_dir_name(s) / "manifest.json").read_bytes() for s in old} == old
    with CheckpointManager(root) as mgr:
        assert mgr.latest() == step_dir_name(20, 1)  # the new run's newest, not step 40
    resumed = _fit(
        tmp_path,
        40,
        [CociCheckpoint(policy="every_n_steps", every_n_steps=10)],
        seed=99,
        ckpt_path="last",
    )
    assert digest(resumed) == digest(reference)
    assert {s: (root / step_dir_name(s) / "manifest.json").read_bytes() for s in old} == old


def test_restart_from_last_parity(tmp_path: Path, reference: DigitsModel) -> None:
    """Lightning's test_restart_from_last_parity with CociCheckpoint: 8 steps into a
    directory, then a new Trainer with the same dirpath trains 4 steps. Its save of step 4 is
    kept beside the first run's (``step-...-v1``; the first run's files untouched), and
    ckpt_path="last" resumes it, the checkpoint written last, exactly."""

    def coci() -> CociCheckpoint:
        return CociCheckpoint(dirpath=tmp_path / "ckpts", policy="every_n_steps", every_n_steps=4)

    _fit(tmp_path, 8, [coci()], seed=5)
    root = tmp_path / "ckpts"
    first = {p.name: p.joinpath("manifest.json").read_bytes() for p in root.glob("step-*")}
    assert sorted(first) == [step_dir_name(4), step_dir_name(8)]
    _fit(tmp_path, 4, [coci()])  # seed 1: the reference's first 4 steps
    assert {name: (root / name / "manifest.json").read_bytes() for name in first} == first
    assert (root / step_dir_name(4, 1) / "manifest.json").is_file()
    resumed = _fit(tmp_path, 40, [coci()], seed=99, ckpt_path="last")
    assert resumed.seen == reference.seen[4 * 16 :]  # from the second run's step 4
    assert digest(resumed) == digest(reference)
    assert {name: (root / name / "manifest.json").read_bytes() for name in first} == first


@pytest.mark.parametrize(
    "options",
    [{"policy": "epoch"}, {"every_n_epochs": 1, "policy": "every_n_steps", "every_n_steps": 100}],
    ids=["policy_epoch", "every_n_epochs"],
)
def test_epoch_end_saves_resume_exactly(
    tmp_path: Path, reference: DigitsModel, options: dict[str, Any]
) -> None:
    """policy="epoch" (steps per epoch from the Trainer) and every_n_epochs save at each
    epoch's last step (where ModelCheckpoint(every_n_epochs=1) saves); a run resumed from such
    a checkpoint (with an epoch-interval LR schedule) ends bit-identical."""
    _fit(tmp_path, 2 * STEPS_PER_EPOCH + 7, [CociCheckpoint(save_on_train_end=False, **options)])
    with CheckpointManager(tmp_path / "coci") as mgr:
        assert mgr.steps() == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    resumed = _fit(tmp_path, 40, [CociCheckpoint(**options)], seed=99, ckpt_path="last")
    assert digest(resumed) == digest(reference)
    assert resumed.seen == reference.seen[2 * STEPS_PER_EPOCH * 16 :]


def test_every_n_epochs_is_checked() -> None:
    with pytest.raises(ConfigError, match="'every_n_epochs' must be an integer >= 1"):
        CociCheckpoint(every_n_epochs=0)


def test_a_new_node_resumes_from_the_remote_tier(
    tmp_path: Path, reference: DigitsModel, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``remote=``, each checkpoint also reaches the remote tier; a second fit on a node
    whose local directory is gone (``resume=True``) continues from the remote's newest step
    (the log line names it, not the empty local directory) and ends bit-identical to an
    uninterrupted run."""
    remote = tmp_path / "remote"
    first = CociCheckpoint(
        tmp_path / "node1",
        policy="every_n_steps",
        every_n_steps=5,
        save_on_train_end=False,
        remote=str(remote),
    )
    _fit(tmp_path, 23, [first])
    assert CheckpointManager(remote, keep_last=None).steps()[-1] == 20
    shutil.rmtree(tmp_path / "node1")
    second = CociCheckpoint(
        tmp_path / "node2",
        policy="every_n_steps",
        every_n_steps=5,
        resume=True,
        remote=str(remote),
    )
    with caplog.at_level("INFO", logger="coci_lightning"):
        resumed = _fit(tmp_path, 40, [second], seed=99)  # another seed: the state comes back
    assert f"coci: Lightning restores step 20 from {remote} (the remote tier)" in caplog.text
    assert digest(resumed) == digest(reference)
    assert CheckpointManager(tmp_path / "node2", keep_last=None).steps()[-1] == 40


def test_the_plan_line_of_a_fixed_interval_names_no_mtbf(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fixed interval is told as one: no MTBF (which does not move it) and no mtbf_s= advice,
    but how to change the interval or let coci plan."""
    with caplog.at_level("INFO", logger="coci_lightning"):
        _fit(tmp_path, 12, [CociCheckpoint(policy="every_n_steps", every_n_steps=4)])
    (line,) = [r.getMessage() for r in caplog.records if "coci: plan" in r.getMessage()]
    assert "every_n_steps policy" in line and "first save at step 4" in line
    assert "MTBF assumed" not in line and "mtbf_s" not in line
    assert "a fixed interval: the MTBF and the measured costs do not change it" in line
    assert "CociCheckpoint(every_n_steps=N)" in line


class _RankCacheSeen(pl.Callback):
    """At each batch's end, before CociCheckpoint's save of it (Lightning calls checkpoint
    callbacks last): the per-rank flatten cache's tree nodes (the same list while flattens
    hit it), whether the last save copied in planned runs, and the torch random state that
    this batch's save takes."""

    def __init__(self, coci: CociCheckpoint) -> None:
        self.coci = coci
        self.nodes: list[object] = []
        self.runs: list[bool] = []
        self.rng: list[torch.Tensor] = []

    def on_train_batch_end(self, *args: Any) -> None:
        assert self.coci.checkpointer is not None
        mgr = self.coci.checkpointer.manager
        self.nodes.append(mgr._rank_cache.nodes)
        self.runs.append(mgr._snapshotter._runs is not None)
        self.rng.append(torch.get_rng_state())


def test_the_random_states_saved_per_rank_hit_the_flatten_cache(tmp_path: Path) -> None:
    """Each save's random states are new tensors at new addresses (``torch.get_rng_state()``,
    numpy's keys) of the same layout: the second save's flatten of them hits the per-rank
    cache, and from the third on the save copies in planned runs (before: every flatten
    missed, so no save ever did), with the states of its own step, not an earlier one's."""
    coci = CociCheckpoint(policy="every_n_steps", every_n_steps=1, save_on_train_end=False)
    seen = _RankCacheSeen(coci)
    _fit(tmp_path, 5, [coci, seen])
    # seen at batch k: after the save of step k - 1
    assert seen.nodes[1] and seen.nodes[2] is seen.nodes[1] and seen.nodes[4] is seen.nodes[1]
    assert seen.runs == [False, False, False, True, True]
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        for step in (4, 5):
            saved = mgr.restore(step)["coci_rank_state"]["rng"]["torch"]
            assert torch.equal(saved, seen.rng[step - 1])
