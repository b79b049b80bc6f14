"""The Optuna integration on real (in-memory) studies: Kaplan-Meier from pruned and completed
trials, the pruner's rungs with no history, the planner taking the estimate, clean-up."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import optuna
import pytest
from benchmarks.rank_weighting import forecasting_objective

from coci_core.errors import ConfigError
from coci_core.hpo import StoppedRun, kaplan_meier
from coci_core.hpo.optuna import (
    EARLY_STOPPED_ATTR,
    MIN_RANK_WEIGHT,
    STEP_ATTR,
    CheckpointCleanup,
    per_epoch,
    planner_options,
    pruner_rungs,
    rank_weights,
    report,
    should_prune,
    study_runs,
    study_termination,
)
from coci_core.planner import AshaRungs, NoTermination, Planner, StopDistribution

optuna.logging.set_verbosity(optuna.logging.WARNING)

REPORTS = 12
STEPS_PER_REPORT = 50


def _objective(trial: optuna.Trial) -> float:
    """A synthetic training curve: the loss decays to a floor set by the 'lr' parameter."""
    lr = trial.suggest_float("lr", 1e-3, 1.0, log=True)
    floor = abs(math.log10(lr) + 1.5)
    value = float("nan")
    for r in range(REPORTS):
        value = floor + 2.0 * math.exp(-0.4 * r)
        report(trial, value, r, train_step=(r + 1) * STEPS_PER_REPORT)
        if trial.should_prune():
            raise optuna.TrialPruned
    return value


def _study(pruner: optuna.pruners.BasePruner, n_trials: int) -> optuna.Study:
    study = optuna.create_study(
        sampler=optuna.samplers.RandomSampler(seed=0), pruner=pruner, study_name="t"
    )
    study.optimize(_objective, n_trials=n_trials)
    return study


def test_kaplan_meier_matches_the_hand_computed_estimate() -> None:
    # 4 runs: stopped at 10, censored at 20, stopped at 30, censored at 40
    runs = [
        StoppedRun(10, True),
        StoppedRun(20, False),
        StoppedRun(30, True),
        StoppedRun(40, False),
    ]
    km = kaplan_meier(runs)
    # S after 10: 3/4; after 30: 3/4 * (1 - 1/2) = 3/8
    assert km.steps == (10, 30)
    assert km.probabilities == pytest.approx((0.25, 0.375))
    assert km.survival([10, 11, 30, 31, 1000]).tolist() == pytest.approx(
        [1, 0.75, 0.75, 0.375, 0.375]
    )


def test_a_median_pruned_study_gives_its_trials_a_kaplan_meier_termination() -> None:
    study = _study(optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2), 20)
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned, "the synthetic study must prune some trials"
    new = study.ask()
    term = study_termination(study, trial=new)
    assert isinstance(term, StopDistribution)
    # every pruned trial's recorded training step is a stop step, and only those
    assert set(term.steps) == {t.user_attrs[STEP_ATTR] for t in pruned}
    share = len(pruned) / 20
    # nothing is censored before the last step, so the estimate is the empirical share
    assert term.stop_probability == pytest.approx(share)
    assert "Kaplan-Meier" in term.source
    # the planner takes it and plans with it
    p = Planner(
        total_steps=REPORTS * STEPS_PER_REPORT,
        step_time_s=0.1,
        stall_s=0.5,
        mtbf_s=600.0,
        **{k: v for k, v in planner_options(new).items()},
    )
    assert p.termination == term
    for k in range(1, 10):
        p.observe(k, loss=1.0 / k, step_time_s=0.1)
    assert p.report().stop_probability == pytest.approx(share, abs=0.02)


def test_the_estimate_is_refreshed_as_the_study_grows() -> None:
    study = _study(optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1), 6)
    first = study_termination(study)
    study.optimize(_objective, n_trials=14)
    second = study_termination(study)
    assert isinstance(first, StopDistribution) and isinstance(second, StopDistribution)
    assert len(study_runs(study)) == 20
    assert first != second


def test_no_history_falls_back_to_the_successive_halving_rungs() -> None:
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    study = optuna.create_study(pruner=pruner)
    term = study_termination(study, train_step_of=per_epoch(100), max_report_step=12)
    # report steps 1, 3, 9 (below 12), reported at the end of epochs 1, 3, 9: steps 200, 400, 1000
    assert term == AshaRungs(rung_steps=(200, 400, 1000), reduction_factor=3.0)
    hyper = pruner_rungs(optuna.pruners.HyperbandPruner(min_resource=2, max_resource=20))
    assert hyper == AshaRungs(rung_steps=(2, 6, 18), reduction_factor=3.0)
    assert isinstance(pruner_rungs(optuna.pruners.MedianPruner()), NoTermination)
    assert isinstance(pruner_rungs(optuna.pruners.SuccessiveHalvingPruner()), NoTermination)


def test_a_successive_halving_study_is_estimated_from_its_history() -> None:
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    study = _study(pruner, 24)
    term = study_termination(study)
    assert isinstance(term, StopDistribution)
    pruned_steps = {
        t.user_attrs[STEP_ATTR] for t in study.trials if t.state == optuna.trial.TrialState.PRUNED
    }
    assert set(term.steps) == pruned_steps
    # successive halving prunes at its rungs: report steps 1, 3, 9 (training steps 100, 200, 500)
    assert pruned_steps <= {100, 200, 500}
    surv = term.survival(np.array([1, 101, 201, 501]))
    assert np.all(np.diff(surv) <= 0) and surv[-1] < 1


def test_cleanup_deletes_pruned_and_early_stopped_trials_but_keeps_the_best(
    tmp_path: Path,
) -> None:
    def directory_of(trial: optuna.trial.FrozenTrial) -> Path:
        return tmp_path / f"trial-{trial.number}"

    def objective(trial: optuna.Trial) -> float:
        directory_of(trial).mkdir()  # type: ignore[arg-type]
        (directory_of(trial) / "step").write_text("x")  # type: ignore[arg-type]
        value = [5.0, 3.0, 4.0, 1.0, 2.0][trial.number]
        if trial.number == 2:
            raise optuna.TrialPruned
        trial.set_user_attr(EARLY_STOPPED_ATTR, trial.number != 4)  # 4 ran to its end
        return value

    cleanup = CheckpointCleanup(directory_of)
    study = optuna.create_study()
    study.optimize(objective, n_trials=5, callbacks=[cleanup])
    left = sorted(p.name for p in tmp_path.iterdir())
    # 0 (worse), 1 (best until 3), 2 (pruned) deleted; 3 is the best; 4 ran to its end
    assert left == ["trial-3", "trial-4"]
    assert sorted(cleanup.deleted) == [0, 1, 2]


def _halving_study_with_a_pruned_trial() -> tuple[optuna.Study, optuna.Trial]:
    """Two trials promoted at report step 1 (training step 100), then one pruned there."""
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    study = optuna.create_study(pruner=pruner)
    for value in (0.2, 0.1):  # each better than the ones before: promoted
        trial = study.ask()
        report(trial, value, 1, train_step=100)
        assert not should_prune(trial, 1)
        study.tell(trial, value)
    bad = study.ask()
    report(bad, 9.0, 1, train_step=100)
    assert should_prune(bad, 1)  # the worst of three at the rung
    return study, bad


def test_a_resumed_trial_asking_again_gets_the_studys_first_answer() -> None:
    _, bad = _halving_study_with_a_pruned_trial()
    # a resumed process reports step 1 again: the same answer (Optuna's own second answer
    # would judge the next rung and let it go on)
    report(bad, 9.0, 1, train_step=100)
    assert should_prune(bad, 1)
    assert not bad.should_prune()  # what asking Optuna again gives


def test_weighted_kaplan_meier_counts_runs_by_their_weight() -> None:
    runs = [
        StoppedRun(10, True, 3.0),
        StoppedRun(20, False, 1.0),
        StoppedRun(30, True, 0.5),
        StoppedRun(40, False, 0.0),  # left out
    ]
    km = kaplan_meier(runs)
    # after 10: 1 - 3/4.5; after 30: that * (1 - 0.5/0.5) = 0
    assert km.steps == (10, 30)
    assert km.survival([11, 31]).tolist() == pytest.approx([1 - 3 / 4.5, 0.0])
    # integer weights are repeated runs
    repeated = kaplan_meier([StoppedRun(10, True)] * 3 + [StoppedRun(20, False)])
    assert kaplan_meier([StoppedRun(10, True, 3.0), StoppedRun(20, False)]) == repeated
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ConfigError, match="'weight'"):
            kaplan_meier([StoppedRun(10, True, bad)])


def test_a_trials_own_rank_sharpens_its_estimate() -> None:
    # a median pruner prunes the trials that trail the study: the trial's rank at its newest
    # report says much about its next one, and the weighted estimate predicts better
    forecasts: list[tuple[tuple[float, ...], bool]] = []
    study = optuna.create_study(
        sampler=optuna.samplers.RandomSampler(seed=1),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1),
    )
    study.optimize(forecasting_objective(forecasts, (0.2, None)), n_trials=40)
    predictions = [(ranked, plain, pruned) for (ranked, plain), pruned in forecasts]
    assert sum(p for _, _, p in predictions) >= 5, "the study must prune trials under watch"
    ranked = np.array([r for r, _, _ in predictions])
    plain = np.array([u for _, u, _ in predictions])
    outcome = np.array([float(p) for _, _, p in predictions])
    brier_ranked = float(np.mean((ranked - outcome) ** 2))
    brier_plain = float(np.mean((plain - outcome) ** 2))
    assert brier_ranked < 0.9 * brier_plain, (brier_ranked, brier_plain)  # 0.057, 0.069 here
    # the pruned trials were given a higher chance than unweighted, the others a lower one
    assert ranked[outcome == 1].mean() > plain[outcome == 1].mean()
    assert ranked[outcome == 0].mean() < plain[outcome == 0].mean()


def test_the_best_and_the_worst_trial_at_a_report_get_different_estimates() -> None:
    study = _study(optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2), 20)
    # before the pruner's first judgement (report 2): the best and the worst value of report 1
    values = [t.intermediate_values[1] for t in study.trials if 1 in t.intermediate_values]
    best, worst = study.ask(), study.ask()
    for t, v in ((best, min(values) - 0.1), (worst, max(values) + 0.1)):
        report(t, v, 1, train_step=2 * STEPS_PER_REPORT)
    after = np.array([2 * STEPS_PER_REPORT + 1, REPORTS * STEPS_PER_REPORT + 1])

    def stop(t: optuna.Trial, **kw: object) -> float:
        s = study_termination(study, trial=t, **kw).survival(after)  # type: ignore[arg-type]
        return float(1 - s[1] / s[0])

    unweighted = stop(best, rank_bandwidth=None)  # 0.7 here
    assert stop(best) < 0.5 * unweighted and stop(worst) > 0.9 > unweighted
    assert "rank" in str(study_termination(study, trial=best).to_dict())
    assert stop(worst, rank_bandwidth=None) == pytest.approx(unweighted)
    for bad in (0, -0.1, math.nan, "wide"):
        with pytest.raises(ConfigError, match="'rank_bandwidth'"):
            study_termination(study, trial=best, rank_bandwidth=bad)  # type: ignore[arg-type]


def test_a_trial_resumed_after_it_was_pruned_is_told_to_stop_again() -> None:
    # pruned at report 1, killed in its final save, resumed from that save: it reports step 2
    # next, where a successive-halving pruner (no rung there) would let it run to its end
    study, bad = _halving_study_with_a_pruned_trial()
    report(bad, 8.0, 2, train_step=200)
    assert not bad.should_prune()  # what Optuna answers at step 2
    assert should_prune(bad, 2)
    # a trial not pruned before is asked as before: the best value at step 2 goes on
    good = study.ask()
    report(good, 0.05, 1, train_step=100)
    assert not should_prune(good, 1)
    report(good, 0.04, 2, train_step=200)
    assert not should_prune(good, 2)


def _reported_study(values: list[float], direction: str = "minimize") -> optuna.Study:
    """Trials that reported ``values`` at report step 0 and completed (the last one runs)."""
    study = optuna.create_study(direction=direction)
    for v in values:
        t = study.ask()
        report(t, v, 0, train_step=10)
        study.tell(t, v)
    return study


def test_rank_weights_follow_the_studys_direction_and_skip_what_cannot_be_ranked() -> None:
    values = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    low = _reported_study(values)
    t = low.ask()
    report(t, 0.15, 0, train_step=10)
    high = _reported_study([-v for v in values], direction="maximize")
    u = high.ask()
    report(u, -0.15, 0, train_step=10)
    at, w = rank_weights(low, t.number, bandwidth=0.2)  # type: ignore[misc]
    assert at == 0 and rank_weights(high, u.number, bandwidth=0.2) == (0, w)
    # the closest values weigh most; far ones keep the floor
    assert w[0] == w[1] > w[2] > w[5] >= MIN_RANK_WEIGHT
    # a non-finite value of its own: nothing to rank; others' are left out
    v = low.ask()
    report(v, math.nan, 0, train_step=10)
    assert rank_weights(low, v.number, bandwidth=0.2) is None
    assert v.number not in rank_weights(low, t.number, bandwidth=0.2)[1]  # type: ignore[index]
    assert rank_weights(low, low.ask().number, bandwidth=0.2) is None  # no report yet


def test_trials_pruned_at_the_report_only_rank_and_few_trials_count_alike() -> None:
    study = optuna.create_study()
    for i, v in enumerate([0.1, 0.2, 0.8, 0.9]):
        t = study.ask()
        report(t, v, 0, train_step=10)
        if i >= 2:  # the worst two pruned at report 0
            study.tell(t, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(t, v)
    t = study.ask()
    report(t, 0.85, 0, train_step=10)  # went on from report 0 among the worst
    _, w = rank_weights(study, t.number, bandwidth=0.2)  # type: ignore[misc]
    assert sorted(w) == [0, 1]  # 2 and 3 stopped at the step it passed
    # two trials at most: fewer than min_trials=3 effective trials, every trial counts alike
    term = study_termination(study, trial=t)
    assert "rank" not in str(term.to_dict())
    assert "rank" in str(study_termination(study, trial=t, min_trials=1).to_dict())


def test_a_pruned_trial_reports_nothing_more() -> None:
    study, bad = _halving_study_with_a_pruned_trial()
    report(bad, 8.0, 2, train_step=250)  # resumed from a save made after the prune
    frozen = study.get_trials()[bad.number]
    assert frozen.user_attrs[STEP_ATTR] == 100 and 2 not in frozen.intermediate_values
