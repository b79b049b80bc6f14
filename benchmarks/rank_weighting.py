"""How well a trial's termination estimate predicts its next prune, with and without its own rank.

Run:  python -m benchmarks.rank_weighting [--trials 40] [--seeds 1 2 3]

Studies of a synthetic noisy training curve (the loss decays to a floor set by the sampled
learning rate, plus seeded noise), 12 reports each, under a median and a successive-halving
pruner. After each report a trial survives, ``study_termination`` gives P(pruned at the next
report); the Brier score of that forecast against what the pruner then did is printed for
rank-weighted estimates of several bandwidths and for the unweighted one (``None``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import numpy as np
import optuna

from coci_core.hpo.optuna import report, study_termination

REPORTS = 12
STEPS_PER_REPORT = 50
BANDWIDTHS: tuple[float | None, ...] = (0.05, 0.1, 0.2, 0.3, None)


def forecasting_objective(
    forecasts: list[tuple[tuple[float, ...], bool]],
    bandwidths: tuple[float | None, ...] = BANDWIDTHS,
) -> Callable[[optuna.Trial], float]:
    """The synthetic objective; after each report a trial survives it appends to ``forecasts``
    P(pruned at the next report) for each of ``bandwidths`` and, once known, whether it was."""

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", 1e-3, 1.0, log=True)
        rng = np.random.default_rng(trial.number)
        floor = abs(math.log10(lr) + 1.5)
        pending: tuple[float, ...] | None = None
        value = math.nan
        for r in range(REPORTS):
            value = floor + 2.0 * math.exp(-0.4 * r) + float(rng.normal(0, 0.15))
            step = (r + 1) * STEPS_PER_REPORT
            report(trial, value, r, train_step=step)
            pruned = trial.should_prune()
            if pending is not None:
                forecasts.append((pending, pruned))
            if pruned:
                raise optuna.TrialPruned
            pending = None
            study = trial.study
            if len(study.get_trials(states=(optuna.trial.TrialState.PRUNED,))) >= 3:
                nxt = np.array([step + 1, step + STEPS_PER_REPORT + 1])
                ps = []
                for bw in bandwidths:
                    s = study_termination(study, trial=trial, rank_bandwidth=bw).survival(nxt)
                    ps.append(float(1 - s[1] / s[0]))
                pending = tuple(ps)
        return value

    return objective


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = " | ".join(f"bandwidth {b}" for b in BANDWIDTHS)
    print(f"| seed | pruner | forecasts | pruned | {names} | weighted 0.2 vs None |")
    print("|---" * (5 + len(BANDWIDTHS)) + "|")
    for seed in args.seeds:
        for name in ("median", "sha"):
            pruner: optuna.pruners.BasePruner = (
                optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1)
                if name == "median"
                else optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
            )
            study = optuna.create_study(
                sampler=optuna.samplers.RandomSampler(seed=seed), pruner=pruner
            )
            forecasts: list[tuple[tuple[float, ...], bool]] = []
            study.optimize(forecasting_objective(forecasts), n_trials=args.trials)
            outcome = np.array([float(p) for _, p in forecasts])
            briers = [
                float(np.mean((np.array([f[i] for f, _ in forecasts]) - outcome) ** 2))
                for i in range(len(BANDWIDTHS))
            ]
            gain = 100 * (briers[BANDWIDTHS.index(0.2)] / briers[-1] - 1)
            print(
                f"| {seed} | {name} | {len(forecasts)} | {int(outcome.sum())} | "
                + " | ".join(f"{b:.4f}" for b in briers)
                + f" | {gain:+.0f}% |"
            )


if __name__ == "__main__":
    main()
