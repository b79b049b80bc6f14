"""Optuna: the planner's termination model from a study's own history.

A trial of a study with a pruner may be stopped at any report; how likely that is, step by
step, is what the study's earlier trials show. :func:`study_termination` estimates it
(Kaplan-Meier over the step each trial stopped at: a pruned trial is a stop there, a completed
or running one is censored at its last step) and returns a termination model for the trial's
planner. Before ``min_trials`` trials have finished it falls back to the pruner's own rungs when
it exposes them (``SuccessiveHalvingPruner``, ``HyperbandPruner``), else to no termination.

A trial that has reported is not like every other: under a median pruner a trial leading the
study is rarely pruned and one trailing it usually is. So once the trial has reported, the
other trials (finished or running) that reported a finite value at the trial's newest report
step are weighted by how close their value there ranks to the trial's own (a Gaussian kernel
over rank quantiles, ``rank_bandwidth`` wide, see :func:`rank_weights`), and the estimate is
the weighted Kaplan-Meier of those that went on from that step; when they weigh less than
``min_trials`` equal trials would, every trial counts alike.

Call it per trial (the study grows between trials); the adapters' helpers do so when a trial's
training starts and again at each report (Lightning: each validation and each epoch's start).
Pruning itself stays Optuna's: the trial's ``should_prune()``, or optuna-integration's
``PyTorchLightningPruningCallback``.

Steps: Optuna's report steps are whatever the objective reports with (often an epoch index);
the planner counts training steps. The helpers record each report's training step in the
trial's user attribute ``coci_step`` (see :func:`report`); trials without it are mapped with
``train_step_of`` (default: the report step is the training step; :func:`per_epoch` for an
epoch index).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import optuna
from optuna.pruners import BasePruner, HyperbandPruner, SuccessiveHalvingPruner
from optuna.trial import FrozenTrial, TrialState

from coci_core.errors import ConfigError
from coci_core.hpo.cleanup import delete_checkpoints
from coci_core.hpo.survival import StoppedRun, kaplan_meier
from coci_core.knobs import ASHA_MAX_RUNGS, MIN_RANK_WEIGHT
from coci_core.planner.checks import check_int
from coci_core.planner.model import AshaRungs, NoTermination, Termination

__all__ = [
    "EARLY_STOPPED_ATTR",
    "STEP_ATTR",
    "StepMap",
    "CheckpointCleanup",
    "should_prune",
    "per_epoch",
    "planner_options",
    "pruner_rungs",
    "MIN_RANK_WEIGHT",
    "rank_weights",
    "report",
    "study_runs",
    "study_termination",
]

logger = logging.getLogger(__name__)

#: the trial user attribute holding the training step of its newest report
STEP_ATTR = "coci_step"
#: the trial user attribute set (True) when early stopping ended the trial
EARLY_STOPPED_ATTR = "coci_early_stopped"
#: the trial user attribute holding the pruner's answer at each report step asked
DECISIONS_ATTR = "coci_prune_decisions"

StepMap = Callable[[int], int]


def per_epoch(steps_per_epoch: int) -> StepMap:
    """The training step of a report made at the end of epoch ``e`` (numbered from 0, as
    ``PyTorchLightningPruningCallback`` reports): ``(e + 1) * steps_per_epoch``."""
    n = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    return lambda epoch: (int(epoch) + 1) * n


def report(trial: optuna.trial.Trial, value: float, step: int, *, train_step: int) -> None:
    """``trial.report(value, step)``, recording ``train_step`` (the training step the value
    was measured at) for the estimates of later trials; a step reported before (by a trial
    resumed from a checkpoint) is left as it was, and so is every step once the trial was
    pruned (:func:`should_prune`)."""
    decided = trial.user_attrs.get(DECISIONS_ATTR) or {}
    if str(int(step)) in decided or any(bool(answer) for answer in decided.values()):
        return  # reported before (a resumed trial), or the trial was pruned already
    trial.set_user_attr(STEP_ATTR, int(train_step))
    trial.report(value, step)


def should_prune(trial: optuna.trial.Trial, step: int) -> bool:
    """``trial.should_prune()`` after the report of ``step``, asked once per step: a trial
    resumed from a checkpoint that reports ``step`` again gets the study's first answer (a
    successive-halving pruner asked twice at a rung would judge the next rung instead). A trial
    once told to stop is told so at every later step too: a process killed after it was pruned
    and resumed from a save made at or after that step never reports that step again."""
    decided = dict(trial.user_attrs.get(DECISIONS_ATTR) or {})
    key = str(int(step))
    if key in decided:
        return bool(decided[key])
    if any(bool(answer) and int(k) < int(step) for k, answer in decided.items()):
        return True
    answer = trial.should_prune()
    trial.set_user_attr(DECISIONS_ATTR, {**decided, key: answer})
    return answer


def _train_step(trial: FrozenTrial, train_step_of: StepMap | None) -> int | None:
    recorded = trial.user_attrs.get(STEP_ATTR)
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        return recorded
    if trial.last_step is None:
        return None
    return int(train_step_of(trial.last_step)) if train_step_of else int(trial.last_step)


def study_runs(
    study: optuna.Study,
    *,
    exclude: int | None = None,
    train_step_of: StepMap | None = None,
    weights: Mapping[int, float] | None = None,
) -> list[StoppedRun]:
    """How far each trial of ``study`` got (but trial number ``exclude``): pruned trials
    stopped there; completed and running ones are censored there. Failed trials (killed,
    crashed) are left out. With ``weights`` (trial number to weight), only the trials it names,
    each with its weight."""
    return _runs(_live_trials(study), exclude, train_step_of, weights)


def _live_trials(study: optuna.Study) -> list[FrozenTrial]:
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return list(study.get_trials(deepcopy=False, states=states))


def _runs(
    trials: list[FrozenTrial],
    exclude: int | None,
    train_step_of: StepMap | None,
    weights: Mapping[int, float] | None,
) -> list[StoppedRun]:
    runs = []
    for t in trials:
        if t.number == exclude or (weights is not None and t.number not in weights):
            continue
        step = _train_step(t, train_step_of)
        if step is not None and step >= 1:
            weight = 1.0 if weights is None else float(weights[t.number])
            runs.append(StoppedRun(step, t.state == TrialState.PRUNED, weight))
    return runs


def pruner_rungs(
    pruner: BasePruner,
    *,
    train_step_of: StepMap | None = None,
    max_report_step: int | None = None,
) -> Termination:
    """The rungs of a successive-halving pruner as :class:`~coci_core.planner.AshaRungs`
    (``min_resource * reduction_factor ** (min_early_stopping_rate + i)``, report steps mapped
    to training steps; Hyperband: its first bracket's), a trial reaching a rung going on with
    probability ``1 / reduction_factor``. :class:`~coci_core.planner.NoTermination` for other
    pruners, and while ``min_resource="auto"`` is not yet known.

    Optuna keeps these parameters in private attributes; they are read defensively.
    """
    if isinstance(pruner, HyperbandPruner):
        rate = 0
        top = getattr(pruner, "_max_resource", None)
        if isinstance(top, int) and max_report_step is None:
            max_report_step = top
    elif isinstance(pruner, SuccessiveHalvingPruner):
        rate = getattr(pruner, "_min_early_stopping_rate", 0)
    else:
        return NoTermination()
    low = getattr(pruner, "_min_resource", None)
    eta = getattr(pruner, "_reduction_factor", None)
    if not isinstance(low, int) or not isinstance(eta, (int, float)) or low < 1 or eta <= 1:
        return NoTermination()
    limit = max_report_step if max_report_step is not None else 2**40
    rungs: list[int] = []
    r = low * eta**rate
    while r < limit and len(rungs) < ASHA_MAX_RUNGS:
        step = int(train_step_of(int(r))) if train_step_of else int(r)
        if step >= 1 and (not rungs or step > rungs[-1]):
            rungs.append(step)
        r *= eta
    if not rungs:
        return NoTermination()
    return AshaRungs(rung_steps=tuple(rungs), reduction_factor=float(eta))


def rank_weights(
    study: optuna.Study, trial_number: int, *, bandwidth: float
) -> tuple[int, dict[int, float]] | None:
    """How much each other trial of ``study`` tells about trial ``trial_number``'s future.

    At that trial's newest report step, each other trial that reported a finite value there
    (completed, pruned or running) has the rank quantile ``q_i`` of its value among those
    values (best first, in the study's direction; ties share the middle), and the trial the
    quantile ``q`` of its own value. The weight is ``exp(-((q_i - q) / bandwidth) ** 2 / 2)``,
    at least :data:`MIN_RANK_WEIGHT`. Trials pruned at that very step only rank: the trial
    has passed it. Returns the report step and the weights of the trials that went on from it;
    None when there is nothing to compare (the trial is not in the study or has not reported,
    its value there is not finite, fewer than two others reported there, a multi-objective
    study)."""
    return _rank_weights(study, _live_trials(study), trial_number, bandwidth)


def _rank_weights(
    study: optuna.Study, trials: list[FrozenTrial], number: int, bandwidth: float
) -> tuple[int, dict[int, float]] | None:
    if len(study.directions) != 1:
        return None
    me = next((t for t in trials if t.number == number), None)
    if me is None or not me.intermediate_values:
        return None
    at = max(me.intermediate_values)
    mine = float(me.intermediate_values[at])
    others = [
        t
        for t in trials
        if t.number != number
        and at in t.intermediate_values
        and math.isfinite(t.intermediate_values[at])
    ]
    if len(others) < 2 or not math.isfinite(mine):
        return None
    sign = 1.0 if study.direction == optuna.study.StudyDirection.MINIMIZE else -1.0
    values = sign * np.array([float(t.intermediate_values[at]) for t in others])
    n = len(values)

    def quantile(v: float) -> float:
        return float((np.sum(values < v) + 0.5 * np.sum(values == v)) / n)

    q = quantile(sign * mine)
    weights = {}
    for t, v in zip(others, values, strict=True):
        if t.state == TrialState.PRUNED and t.last_step == at:
            continue
        kernel = math.exp(-0.5 * ((quantile(float(v)) - q) / bandwidth) ** 2)
        weights[t.number] = max(MIN_RANK_WEIGHT, kernel)
    return at, weights


def _effective_size(weights: Mapping[int, float]) -> float:
    """Kish's effective number of equally weighted runs."""
    w = np.array(list(weights.values()), dtype=np.float64)
    return float(w.sum() ** 2 / np.sum(w**2)) if w.size else 0.0


def study_termination(
    study: optuna.Study,
    *,
    trial: optuna.trial.BaseTrial | None = None,
    train_step_of: StepMap | None = None,
    min_trials: int = 3,
    max_report_step: int | None = None,
    rank_bandwidth: float | None = 0.2,
) -> Termination:
    """The termination model of a new trial of ``study``, from the study's history.

    Args:
        study: the study (any storage).
        trial: the trial it is for (left out of its own history; once it has reported, the
            others are weighted by how their value ranks next to its own, see
            :func:`rank_weights`, when they weigh as much as ``min_trials`` equal trials).
        train_step_of: maps the report step of trials without a recorded ``coci_step`` to a
            training step (default: the same number; :func:`per_epoch` for epoch indices).
        min_trials: finished (completed or pruned) trials needed before the history is used,
            until then the pruner's rungs (or no termination); and the effective number of
            trials (Kish's) the rank weighting must keep, else every trial counts alike.
        max_report_step: the last report step, bounding the fallback rungs.
        rank_bandwidth: the width of the rank kernel (a share of the trials, > 0); None: every
            earlier trial counts alike, whatever the trial has reported.
    """
    check_int("min_trials", min_trials, minimum=1)
    if rank_bandwidth is not None and (
        isinstance(rank_bandwidth, bool)
        or not isinstance(rank_bandwidth, numbers.Real)
        or not math.isfinite(rank_bandwidth)
        or rank_bandwidth <= 0
    ):
        raise ConfigError(f"'rank_bandwidth' must be a number > 0 or None: {rank_bandwidth!r}")
    exclude = None if trial is None else trial.number
    trials = _live_trials(study)
    finished = [
        t
        for t in trials
        if t.number != exclude and t.state in (TrialState.COMPLETE, TrialState.PRUNED)
    ]
    if len(finished) < min_trials:
        return pruner_rungs(
            study.pruner, train_step_of=train_step_of, max_report_step=max_report_step
        )
    pruned = sum(t.state == TrialState.PRUNED for t in finished)
    source = (
        f"Optuna study {study.study_name!r}: {len(finished)} finished trials, {pruned} "
        "pruned (Kaplan-Meier"
    )
    ranked = (
        None
        if rank_bandwidth is None or exclude is None
        else _rank_weights(study, trials, exclude, float(rank_bandwidth))
    )
    if ranked is not None and _effective_size(ranked[1]) >= min_trials:
        at, weights = ranked
        return kaplan_meier(
            _runs(trials, exclude, train_step_of, weights),
            source=f"{source}, weighted by the rank of the trial's value at report step {at})",
        )
    return kaplan_meier(_runs(trials, exclude, train_step_of, None), source=source + ")")


def planner_options(
    trial: optuna.trial.BaseTrial, options: Mapping[str, Any] | None = None, **arguments: Any
) -> dict[str, Any]:
    """``options`` (a Planner's keyword arguments) with ``termination`` estimated for
    ``trial`` from its study (``arguments``: those of :func:`study_termination`); for
    ``CociCheckpointer(planner_options=...)`` or ``CociCheckpoint(planner_options=...)``."""
    study = getattr(trial, "study", None)
    if study is None:
        raise ConfigError(f"'trial' must be an Optuna trial of a study: {trial!r}")
    return {
        **dict(options or {}),
        "termination": study_termination(study, trial=trial, **arguments),
    }


class CheckpointCleanup:
    """A study callback (``study.optimize(..., callbacks=[CheckpointCleanup(...)])``) that
    deletes the checkpoints of stopped trials: pruned ones, and completed ones that early
    stopping ended (user attribute ``coci_early_stopped``), except the best trial's, unless
    ``keep_stopped``. Checkpoints of trials that ran to their end are kept.

    Args:
        directory_of: the checkpoint directory of a trial.
        keep_stopped: keep every trial's checkpoints.
        storage_options: fsspec options of URL directories.
    """

    def __init__(
        self,
        directory_of: Callable[[FrozenTrial], str | os.PathLike[str]],
        *,
        keep_stopped: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.directory_of = directory_of
        self.keep_stopped = keep_stopped
        self.storage_options = dict(storage_options or {})
        self._best_stopped: FrozenTrial | None = None  # an early-stopped best, kept for now
        self.deleted: list[int] = []  # trial numbers whose checkpoints were deleted

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """Called by Optuna after each trial."""
        if self.keep_stopped:
            return
        if trial.state == TrialState.PRUNED:
            self._delete(trial)
            return
        if trial.state != TrialState.COMPLETE:
            return
        try:
            best = study.best_trial.number
        except (RuntimeError, ValueError):  # multi-objective: no single best
            return
        kept = self._best_stopped
        if kept is not None and kept.number != best:
            self._best_stopped = None
            self._delete(kept)
        if trial.user_attrs.get(EARLY_STOPPED_ATTR):
            if trial.number == best:
                self._best_stopped = trial
            else:
                self._delete(trial)

    def _delete(self, trial: FrozenTrial) -> None:
        try:
            delete_checkpoints(self.directory_of(trial), **self.storage_options)
            self.deleted.append(trial.number)
        except Exception as e:  # a study must not fail on clean-up
            logger.warning("coci: could not delete trial %d's checkpoints: %s", trial.number, e)
