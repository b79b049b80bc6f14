"""trainer.hyperparameter_search with Optuna: each trial saves into its own directory, the
planner gets the trial's termination hazard from the study, and a pruned trial takes no final
save."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import Trainer

from coci_core import CheckpointManager
from coci_transformers import CociCallback
from tests.transformers.run import Tokens, arguments, tiny_model


class _PruneTrialOne(optuna.pruners.BasePruner):
    """Prunes trial 1 at its first report (a real Optuna pruner, decided in advance)."""

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return trial.number == 1


@pytest.fixture(autouse=True)
def _reset_accelerate_state() -> Any:
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_pruned_trial_takes_no_final_save(tmp_path: Path) -> None:
    callback = CociCallback(policy="every_n_steps")
    trainer = Trainer(
        model_init=lambda trial: tiny_model(),
        args=arguments(tmp_path, 6, save_steps=4, eval_strategy="steps", eval_steps=2),
        train_dataset=Tokens(),
        eval_dataset=Tokens(),
        callbacks=[callback],
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.hyperparameter_search(
            hp_space=lambda trial: {
                "learning_rate": trial.suggest_float("learning_rate", 1e-4, 0.01)
            },
            backend="optuna",
            n_trials=4,
            direction="minimize",
            pruner=_PruneTrialOne(),
        )
    finally:
        torch.set_num_threads(threads)

    def steps(trial: int) -> list[int]:
        with CheckpointManager(tmp_path / f"run-{trial}" / "coci", keep_last=None) as mgr:
            return mgr.steps()

    assert steps(0) == steps(2) == steps(3) == [4, 6]  # planned, then the final save
    assert steps(1) == []  # pruned at its first evaluation (step 2): no final save
    assert callback.checkpointer is not None
    # the last trial planned with the hazard estimated from the three trials before it
    assert callback.checkpointer.plan_outline().report.termination != "none"
