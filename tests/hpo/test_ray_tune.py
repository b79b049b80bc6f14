"""Real Ray Tune runs with coci in each trial: ASHA stops trials exactly at the rungs that
``asha_rungs`` gives the plan, the stopped trials' checkpoints are deleted, and a trial
SIGKILLed mid-run is restarted by Ray and resumed by coci to the same result."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from ray import tune
from ray.tune.experiment import Trial
from ray.tune.schedulers import ASHAScheduler

from coci_core import CheckpointManager, ConfigError, DirectoryInUseError
from coci_core.engine.restore.restore import newest_first
from coci_core.hpo import asha_rungs
from coci_core.hpo.ray import CheckpointCleanup, trial_directory
from coci_core.storage import open_storage
from coci_core.training import Checkpointer

STEPS_PER_ITER = 4
MAX_T = 8
RUNGS = asha_rungs(grace_period=1, reduction_factor=2, max_t=MAX_T, steps_per_unit=STEPS_PER_ITER)
REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    # trial processes import this module (the trainable) from the repository
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, old) if p)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        for signum, handler in handlers.items():  # ray.init leaves its SIGTERM handler (exit)
            signal.signal(signum, handler)
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    return x, x @ torch.arange(8.0) + 0.1 * torch.randn(64, generator=g)


def _model(lr: float) -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, k: int) -> float:
    x, y = _data()
    batch = slice((k % 4) * 16, (k % 4) * 16 + 16)
    loss = torch.nn.functional.mse_loss(model(x[batch]).squeeze(1), y[batch])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _validate(model: torch.nn.Module) -> float:
    x, y = _data()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x).squeeze(1), y))


def train(config: dict[str, Any]) -> None:
    """A trial: STEPS_PER_ITER optimizer steps per Tune iteration, coci saving every
    iteration's last step, ASHA's rungs in the plan; ``kill_at``: SIGKILL itself once there."""
    torch.set_num_threads(1)
    model, opt = _model(config["lr"])
    ckpt = Checkpointer(
        trial_directory(config["root"]),
        policy="every_n_steps",
        every_n_steps=STEPS_PER_ITER,
        planner_options={"termination": RUNGS, "total_steps": MAX_T * STEPS_PER_ITER},
    )
    start = 0
    if ckpt.latest_step() is not None:
        ckpt.restore(into={"model": model, "optim": opt})
        start = int(ckpt.resumed_from or 0)
    for k in range(start + 1, MAX_T * STEPS_PER_ITER + 1):
        _step(model, opt, k)
        ckpt.observe(k)
        if ckpt.should_save(k):
            ckpt.save(k, {"model": model.state_dict(), "optim": opt.state_dict()})
        marker = Path(config["root"]) / "killed"
        if k == config.get("kill_at") and not marker.exists():
            ckpt.close()  # the saves so far are durable; what follows is lost
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if k == MAX_T * STEPS_PER_ITER:
            ckpt.close()  # before the last report, after which Tune ends the function
        if k % STEPS_PER_ITER == 0:
            tune.report(
                {
                    "loss": _validate(model),
                    "step": k,
                    "resumed_from": start,
                    "termination": ckpt.planner.report().termination,
                }
            )


def _saved(directory: Path) -> list[int]:
    return sorted(newest_first(open_storage(str(directory))))


def test_asha_stops_trials_at_coci_rungs_and_their_checkpoints_are_deleted(
    ray_session: None, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    cleanup = CheckpointCleanup(root, max_t=MAX_T, metric="loss", mode="min")
    # the best first: each later trial is worse than every result before it at the first rung,
    # so ASHA stops it there whatever the order in which the trials reach it
    lrs = [0.05, 0.02, 0.003, 0.001]
    tuner = tune.Tuner(
        train,
        param_space={"lr": tune.grid_search(lrs), "root": str(root)},
        tune_config=tune.TuneConfig(
            scheduler=ASHAScheduler(grace_period=1, reduction_factor=2, max_t=MAX_T),
            metric="loss",
            mode="min",
        ),
        run_config=tune.RunConfig(
            storage_path=str(tmp_path / "ray"), name="asha", callbacks=[cleanup], verbose=0
        ),
    )
    results = tuner.fit()
    assert not results.errors
    ends = {r.config["lr"]: int(r.metrics["step"]) for r in results}
    stopped = {lr: end for lr, end in ends.items() if end < MAX_T * STEPS_PER_ITER}
    assert stopped, f"ASHA stopped no trial: {ends}"
    # every stop is at a rung that the plan was given
    assert set(stopped.values()) <= set(RUNGS.rung_steps), (stopped, RUNGS.rung_steps)
    assert all("ASHA rungs at steps [4, 8, 16]" in r.metrics["termination"] for r in results)
    # the stopped trials' checkpoints are gone, the finished trials keep theirs
    ids = {r.config["lr"]: Path(r.path).name for r in results}
    assert len(cleanup.deleted) == len(stopped)
    for r in results:
        trial_dir = root / str(r.metrics["trial_id"])
        if r.config["lr"] in stopped:
            # no checkpoint left: only the clean-up's mark and the lease file it held
            left = sorted(p.name for p in trial_dir.iterdir()) if trial_dir.exists() else []
            assert all(n.startswith("coci-deleted-") or n == ".coci-owner" for n in left), (
                ids[r.config["lr"]],
                left,
            )
        else:
            assert _saved(trial_dir)[-1] == MAX_T * STEPS_PER_ITER


def test_a_trial_killed_mid_run_is_restarted_by_ray_and_resumed_by_coci(
    ray_session: None, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    lr = 0.01
    tuner = tune.Tuner(
        train,
        param_space={"lr": lr, "root": str(root), "kill_at": 22},
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(
            storage_path=str(tmp_path / "ray"),
            name="kill",
            failure_config=tune.FailureConfig(max_failures=1),
            verbose=0,
        ),
    )
    results = tuner.fit()
    assert (root / "killed").exists(), "the trial was not killed"
    assert not results.errors
    result = results[0].metrics
    # killed at step 22 after the save at step 20: the restarted trial resumed from it
    assert result["resumed_from"] == 20
    assert result["step"] == MAX_T * STEPS_PER_ITER
    # the same final loss as the uninterrupted run, to the bit
    model, opt = _model(lr)
    for k in range(1, MAX_T * STEPS_PER_ITER + 1):
        _step(model, opt, k)
    assert result["loss"] == _validate(model)


class _Told(logging.Handler):
    """Sets ``event`` when a record holding ``text`` is logged."""

    def __init__(self, text: str, event: threading.Event) -> None:
        super().__init__()
        self.text, self.event = text, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


def test_the_cleanup_waits_for_a_stopped_trials_writer_and_nothing_is_written_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopped trial whose process still lives when the experiment ends (Ray ends it while
    the experiment ends) and makes a pending save durable: the clean-up deleted its directory
    at once, and the save then wrote its step there (files found after the clean-up); it
    waits for the trial's writer (its lease), deletes under it, and nothing is left."""
    root = tmp_path / "ckpt"
    trial = Trial("train", trial_id="stopped", stub=True)
    trial.update_last_result({"training_iteration": 1})
    trial.set_status(Trial.TERMINATED)
    cleanup = CheckpointCleanup(root, max_t=MAX_T, writer_wait_s=60)
    writer = CheckpointManager(root / "stopped")  # the stopped trial's, in its process
    writer.save(4, {"w": torch.zeros(3)}).wait()
    began = threading.Event()  # the clean-up waits, or (before) it is done
    told = _Told("still writes to", began)
    logging.getLogger("coci_core.hpo.ray").addHandler(told)

    def clean() -> None:
        cleanup.on_experiment_end(trials=[trial])
        began.set()

    thread = threading.Thread(target=clean)
    try:
        with caplog.at_level("INFO", logger="coci_core.hpo.ray"):
            thread.start()
            assert began.wait(60)
            writer.save(8, {"w": torch.ones(3)}).wait()  # its save pending when Ray stopped it
            writer.close()
            thread.join(60)
    finally:
        logging.getLogger("coci_core.hpo.ray").removeHandler(told)
    assert not thread.is_alive() and cleanup.deleted == ["stopped"]
    # nothing but the clean-up's mark (and the lease's lock file)
    left = [p.name[:13] for p in (root / "stopped").iterdir() if p.name != ".coci-owner"]
    assert left == ["coci-deleted-"]


def test_a_stopped_trials_first_save_after_the_cleanup_is_refused(tmp_path: Path) -> None:
    """A stopped trial whose manager had not saved yet (no lease held, no directory made)
    when the experiment ended: the clean-up found nothing to wait for, and the trial's first
    save, late, then wrote its step into the cleaned directory (a checkpoint of a stopped trial
    left after the clean-up). The clean-up leaves a mark: that save is refused; a manager made
    after the clean-up (a new run there) saves as usual."""
    root = tmp_path / "ckpt"
    trial = Trial("train", trial_id="late", stub=True)
    trial.update_last_result({"training_iteration": 1})
    trial.set_status(Trial.TERMINATED)
    writer = CheckpointManager(root / "late")  # the stopped trial's, made before its first save
    CheckpointCleanup(root, max_t=MAX_T, writer_wait_s=0).on_experiment_end(trials=[trial])
    with pytest.raises(DirectoryInUseError, match="were deleted by a clean-up"):
        writer.save(4, {"w": torch.zeros(3)}).wait()
    writer.close()
    left = [p.name[:13] for p in (root / "late").iterdir() if p.name != ".coci-owner"]
    assert left == ["coci-deleted-"]  # the mark alone: nothing of the stopped trial
    with CheckpointManager(root / "late") as again:  # made after the clean-up: a new run
        again.save(1, {"w": torch.ones(3)}).wait()
        assert again.steps() == [1]


@pytest.mark.parametrize("wait", [-1, float("nan"), "5", True])
def test_the_cleanups_writer_wait_is_checked_by_name(wait: Any) -> None:
    with pytest.raises(ConfigError, match="'writer_wait_s' must be a number of seconds >= 0"):
        CheckpointCleanup("/tmp/x", max_t=MAX_T, writer_wait_s=wait)
