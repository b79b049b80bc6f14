"""Runs stopped on purpose: the termination hazard of an early-stopping rule from the
validations it judged, and whether an exception is Optuna's pruning of the trial.

The planner plans with these hazards (see :meth:`Checkpointer.set_termination
<coci_core.training.Checkpointer.set_termination>` and :mod:`coci_core.hpo.early_stopping`);
an adapter feeds its framework's early-stopping callback into :class:`ValidationHistory`.
"""

from __future__ import annotations

import numpy as np

from coci_core.hpo import (
    combine_terminations,
    improvement_probability,
    patience_stops,
    threshold_stops,
)
from coci_core.knobs import EARLY_STOPPING_COMING_VALIDATIONS, EARLY_STOPPING_ROLLING_VALIDATIONS
from coci_core.planner import Termination

__all__ = ["ValidationHistory", "is_trial_pruned"]


class ValidationHistory:
    """The validations an early-stopping rule judged in this fit, and the probability that it
    stops the run at each coming one."""

    def __init__(self) -> None:
        # (global step, improved, monitored value) per judged validation
        self.validations: list[tuple[int, bool, float]] = []

    def add(self, step: int, *, improved: bool, value: float) -> bool:
        """Record the validation at ``step``; False when that step is recorded already."""
        if self.validations and self.validations[-1][0] == step:
            return False
        self.validations.append((step, improved, value))
        return True

    def termination(
        self,
        *,
        rule: str,
        start: int,
        total: int | None,
        patience: int,
        wait_count: int,
        min_delta: float,
        mode: str = "min",
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
    ) -> Termination:
        """The rule's stop hazard after the newest validation, from its patience and wait
        count and how often the metric improved lately (and the trend of its values towards
        either threshold). ``rule`` names the rule in the plan's explanation (e.g.
        ``"EarlyStopping(monitor='val_loss'"``, left open); ``start``: the fit's first step;
        ``total``: the run's last step, if known."""
        step = self.validations[-1][0]
        steps = [k for k, _, _ in self.validations]
        gaps = np.diff([start, *steps])
        interval = max(1, int(np.median(gaps[gaps > 0]))) if np.any(gaps > 0) else 1
        last = total if total is not None else step + EARLY_STOPPING_ROLLING_VALIDATIONS * interval
        coming = list(range(step + interval, last + 1, interval))[
            :EARLY_STOPPING_COMING_VALIDATIONS
        ]
        patience = max(1, int(patience))
        p = improvement_probability(
            [improved for _, improved, _ in self.validations], window=max(2 * patience, 4)
        )
        source = (
            f"{rule}, patience {patience}, wait {wait_count}, min_delta {abs(min_delta):g}; "
            f"P(improve) {p:.2f} per validation, every {interval} steps)"
        )
        model: Termination = patience_stops(
            patience=patience,
            wait_count=wait_count,
            improve_probability=p,
            validation_steps=coming,
            source=source,
        )
        if stopping_threshold is None and divergence_threshold is None:
            return model
        limits = ", ".join(
            f"{name} {t:g}"
            for name, t in (
                ("stopping_threshold", stopping_threshold),
                ("divergence_threshold", divergence_threshold),
            )
            if t is not None
        )
        crossing = threshold_stops(
            [v for _, _, v in self.validations],
            mode="max" if mode == "max" else "min",
            validation_steps=coming,
            stopping_threshold=stopping_threshold,
            divergence_threshold=divergence_threshold,
            source=f"its {limits}, from the trend of the last values",
        )
        return combine_terminations([model, crossing], source=f"{source[:-1]}; {crossing.source})")


def is_trial_pruned(exception: BaseException) -> bool:
    """Whether ``exception`` is Optuna's ``TrialPruned`` (without importing Optuna)."""
    return any(
        c.__name__ == "TrialPruned" and c.__module__.startswith("optuna")
        for c in type(exception).__mro__
    )
