"""An Accelerate loop in a real Optuna study: the termination estimate reaches the planner,
pruned trials take no final save and their checkpoints are deleted."""

from __future__ import annotations

from pathlib import Path

import optuna
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration, set_seed

from coci_accelerate import CociCheckpointer
from coci_accelerate.hpo import close_stopped, optuna_planner_options, report
from coci_core.hpo.optuna import STEP_ATTR, CheckpointCleanup
from coci_core.planner import StopDistribution

optuna.logging.set_verbosity(optuna.logging.WARNING)

EPOCHS, STEPS_PER_EPOCH = 4, 5


def test_an_accelerate_loop_in_a_pruned_study(tmp_path: Path) -> None:
    def directory_of(trial: optuna.trial.FrozenTrial | optuna.Trial) -> Path:
        return tmp_path / f"trial-{trial.number}"

    terminations: dict[int, object] = {}
    stops: dict[int, int] = {}

    def objective(trial: optuna.Trial) -> float:
        AcceleratorState._reset_state(True)
        lr = trial.suggest_float("lr", 1e-4, 1.0, log=True)
        set_seed(trial.number)
        accelerator = Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
        )
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        model, optimizer = accelerator.prepare(model, optimizer)
        ckpt = CociCheckpointer(
            accelerator,
            directory_of(trial),
            every_n_steps=2,
            mtbf_s=600.0,
            total_steps=EPOCHS * STEPS_PER_EPOCH,
            planner_options=optuna_planner_options(trial),
        )
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        y = x.sum(dim=1, keepdim=True)
        loss = torch.tensor(0.0)
        for epoch in range(EPOCHS):
            for _ in range(STEPS_PER_EPOCH):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                ckpt.step(loss=float(loss.detach()))
            if report(ckpt, trial, float(loss.detach()), epoch):
                terminations[trial.number] = ckpt.checkpointer.planner.termination
                stops[trial.number] = ckpt.completed_steps
                close_stopped(ckpt)
                raise optuna.TrialPruned
        terminations[trial.number] = ckpt.checkpointer.planner.termination
        ckpt.close()
        return float(loss.detach())

    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=3))
    for lr in (0.1, 0.08, 0.12, 1e-4, 0.1, 2e-4):
        study.enqueue_trial({"lr": lr})
    kept = CheckpointCleanup(directory_of, keep_stopped=True)
    study.optimize(objective, n_trials=6, callbacks=[kept])
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert [t.number for t in pruned] == [3, 5]
    for t in pruned:
        # recorded in optimizer steps; no final save at the step it was pruned at
        assert t.user_attrs[STEP_ATTR] == stops[t.number] == STEPS_PER_EPOCH
        assert (
            max(int(p.name.split("-")[-1]) for p in directory_of(t).glob("step-*"))
            < stops[t.number]
        )
    # after 3 completed trials and one pruned at step 5, trial 4 plans with that history
    term = terminations[4]
    assert isinstance(term, StopDistribution)
    assert term.steps == (5,) and abs(term.stop_probability - 0.25) < 1e-9
    # the clean-up without keep_stopped deletes the pruned trials' checkpoints
    cleanup = CheckpointCleanup(directory_of)
    for t in pruned:
        cleanup(study, t)
        assert not directory_of(t).exists()
    assert directory_of(study.trials[0]).exists()
