"""Ray Tune trials with coci: each trial's checkpoint directory, ASHA's rungs in its plan, and
the clean-up of the checkpoints of trials the scheduler stopped (``pip install 'ray[tune]'``).

In the function a trial runs::

    from coci_core.hpo import asha_rungs
    from coci_core.hpo.ray import trial_directory

    rungs = asha_rungs(grace_period=1, reduction_factor=2, max_t=16, steps_per_unit=100)
    ckpt = Checkpointer(
        trial_directory("/checkpoints/study"), planner_options={"termination": rungs}
    )

and ``tune.RunConfig(callbacks=[CheckpointCleanup("/checkpoints/study", max_t=16)])``.

Ray stops a trial by ending its function where it reports: the trial takes no final save;
close the ``Checkpointer`` before the last report (at ``max_t``, Tune ends the function there
too), so that the last save is waited for. A
trial that Ray restarts after a failure (``tune.FailureConfig(max_failures=...)``) runs its
function again with the same trial id, so the same directory: ``Checkpointer.restore`` resumes
it from its newest checkpoint.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from ray import tune

from coci_core.errors import ConfigError
from coci_core.hpo.cleanup import delete_checkpoints_unwritten

__all__ = ["CheckpointCleanup", "trial_directory"]

logger = logging.getLogger(__name__)


def trial_directory(root: str | os.PathLike[str]) -> str:
    """``root/<trial id>``: the checkpoint directory of the Tune trial this function runs in
    (the same after Ray restarts the trial)."""
    trial_id = tune.get_context().get_trial_id()
    if not trial_id:
        raise ConfigError("trial_directory() must be called inside a Tune trial")
    return os.path.join(os.fspath(root), str(trial_id))


def _best(trials: list[Any], metric: str | None, mode: str | None) -> Any | None:
    if metric is None:
        return None
    sign = -1.0 if mode == "max" else 1.0
    scored = []
    for trial in trials:
        value = (trial.last_result or {}).get(metric)
        if isinstance(value, (int, float)) and math.isfinite(value):
            scored.append((sign * float(value), trial.trial_id, trial))
    return min(scored, key=lambda s: (s[0], s[1]))[2] if scored else None


class CheckpointCleanup(tune.Callback):
    """A Tune callback that deletes the checkpoints of the trials the scheduler stopped (their
    last ``time_attr`` is below ``max_t``), except the best trial's, once the experiment ends.
    Trials that ran to ``max_t`` and trials that failed keep theirs.

    Args:
        directory_of: the root given to :func:`trial_directory`, or a function of the trial
            id giving its checkpoint directory.
        max_t: a trial's end in ``time_attr`` units (``ASHAScheduler(max_t=...)``).
        time_attr: the result's time attribute (``ASHAScheduler(time_attr=...)``).
        metric, mode: how to find the best trial, by its last result (the Tuner's
            ``metric`` and ``mode``; without a metric, no trial counts as best).
        keep_stopped: keep every trial's checkpoints.
        writer_wait_s: how long, at most, the clean-up waits for the writers of the stopped
            trials' directories (all together): Ray ends a stopped trial's process while the
            experiment ends, and its writer may still make a save durable; each directory is
            deleted once no writer holds it (its lease), under that lease, so that nothing is
            written into it after. One still written to after that is left (a warning). The
            default outlasts an object store's lease of a writer that died (60 s).
    """

    def __init__(
        self,
        directory_of: str | os.PathLike[str] | Callable[[str], str | os.PathLike[str]],
        *,
        max_t: float,
        time_attr: str = "training_iteration",
        metric: str | None = None,
        mode: str | None = None,
        keep_stopped: bool = False,
        writer_wait_s: float = 90.0,
    ) -> None:
        if not isinstance(max_t, (int, float)) or not max_t > 0:
            raise ConfigError(f"'max_t' must be a number > 0: {max_t!r}")
        if (
            type(writer_wait_s) not in (int, float)
            or not math.isfinite(writer_wait_s)
            or writer_wait_s < 0
        ):
            raise ConfigError(
                f"'writer_wait_s' must be a number of seconds >= 0: {writer_wait_s!r}"
            )
        if mode not in (None, "min", "max"):
            raise ConfigError(f"'mode' must be 'min', 'max' or None: {mode!r}")
        if callable(directory_of):
            self._directory_of = directory_of
        else:
            root = os.fspath(directory_of)
            self._directory_of = lambda trial_id: os.path.join(root, trial_id)
        self.max_t = max_t
        self.time_attr = time_attr
        self.metric, self.mode = metric, mode
        self.keep_stopped = keep_stopped
        self.writer_wait_s = float(writer_wait_s)
        self.deleted: list[str] = []  # the trial ids whose checkpoints were deleted

    def stopped(self, trial: Any) -> bool:
        """Whether the scheduler stopped ``trial`` before its end."""
        reached = (trial.last_result or {}).get(self.time_attr)
        return (
            trial.status == "TERMINATED"
            and isinstance(reached, (int, float))
            and reached < self.max_t
        )

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        if self.keep_stopped:
            return
        best = _best(trials, self.metric, self.mode)
        deadline = time.monotonic() + self.writer_wait_s
        for trial in trials:
            if trial is best or not self.stopped(trial):
                continue
            directory = self._directory_of(str(trial.trial_id))
            try:
                deleted = delete_checkpoints_unwritten(
                    directory,
                    deadline=deadline,
                    waiting=functools.partial(
                        logger.info,
                        "coci: trial %s stopped, and its process still writes to %s: waiting "
                        "for it before deleting its checkpoints",
                        trial.trial_id,
                        directory,
                    ),
                )
            except Exception as e:  # a clean-up never fails the experiment
                logger.warning("coci: could not delete %s: %s", directory, e)
                continue
            if deleted is None:
                logger.warning(
                    "coci: trial %s stopped, and its process still wrote to %s after %.0f s "
                    "(writer_wait_s): its checkpoints are left",
                    trial.trial_id,
                    directory,
                    self.writer_wait_s,
                )
                continue
            self.deleted.append(str(trial.trial_id))
