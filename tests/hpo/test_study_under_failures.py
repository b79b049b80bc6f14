"""A real Optuna study whose trial processes are SIGKILLed and resumed by coci ends exactly as
the same study with no checkpoints and no failures (the benchmark's driver, on a small study)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import optuna
import pytest
from benchmarks.hpo_bench import BASELINE, run_study, warm_up

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.mark.parametrize("policy", ["coci+term", "daly"])
def test_a_killed_and_resumed_study_ends_as_the_one_without_failures(
    tmp_path: Path, policy: str
) -> None:
    args = argparse.Namespace(trials=6, pruner="sha", state_mb=0)
    warm_up()
    clean = run_study(BASELINE, 0, args, tmp_path / "clean", math.inf, 0.002)
    assert clean.kills == 0 and clean.pruned >= 2  # successive halving prunes most
    # MTBF 1 s of busy time: the first kill comes 0.35 s into the study (seed 0), then more
    killed = run_study(policy, 0, args, tmp_path / policy, 1.0, 0.002)
    assert killed.kills >= 2
    # every report made again by a resumed trial had the value first reported ...
    assert killed.mismatches == []
    # ... and every trial was pruned at the same report, with the same values, or completed
    # with the same value
    assert killed.outcomes == clean.outcomes
    assert killed.best_value == clean.best_value
