"""Checkpointer: the planner and the engine joined, as every framework adapter uses them.

An adapter calls, on every rank: ``observe(step, loss=..., step_time_s=...)`` then
``should_save(step)``; ``save(step, state)`` when it says so; ``before_update()`` before each
optimizer step; ``restore()`` on resume; ``close()`` at teardown. The Checkpointer feeds the
measured stall, persist and restore times back into the planner.

Why one module: it is the one object every adapter holds, and each of its methods is a thin
step of that protocol handing its work to the planner, the engine (``CheckpointManager``) or
:mod:`coci_core.training.preemption`; split, the protocol would be read across files.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from coci_core.engine.group import RankGroup
from coci_core.engine.manager import CheckpointManager, SaveHandle
from coci_core.engine.restore.inplace import InPlaceTargets
from coci_core.engine.save.workers import LatestOnlyWorker
from coci_core.engine.stateful import Stateful
from coci_core.errors import ConfigError, Preempted, StepExistsError
from coci_core.hpo import combine_terminations
from coci_core.knobs import MAX_CHECKPOINTS_COSTED
from coci_core.planner import Planner, Termination
from coci_core.planner.optimize import Problem
from coci_core.planner.schedule import ExpectedOverhead, compare_with_daly
from coci_core.preemption.signals import SignalNotice
from coci_core.preemption.workers import shield_loader_workers
from coci_core.storage import Storage
from coci_core.telemetry import (
    Event,
    Listener,
    RestartEvent,
    RestoreEvent,
    SaveEvent,
    TelemetrySink,
    UploadEvent,
)
from coci_core.telemetry.summary import SaveSummary, save_line
from coci_core.training.decision import SharedDecision
from coci_core.training.options import CheckpointOptions
from coci_core.training.outline import PlanOutline
from coci_core.training.preemption import (
    NoticePlan,
    PreemptionDecision,
    PreemptionWatch,
    SaveTimes,
    plan_changed,
)
from coci_core.training.restart import process_start_unix

__all__ = ["Checkpointer"]

logger = logging.getLogger(__name__)

#: The checkpoint directories (storage URLs) a Checkpointer of this process trained in and
#: closed -> the last step it trained: a later restore of that very step in this process
#: (``fit()`` then ``fit(ckpt_path="last")``) continues the run, with no work lost; it is no
#: failure and no restart.
_TRAINED_HERE: dict[str, int] = {}


class Checkpointer:
    """Decides when to checkpoint (a :class:`~coci_core.planner.Planner`) and saves through a
    :class:`~coci_core.CheckpointManager`.

    Args:
        directory: where checkpoints go (a path, an fsspec URL or a Storage).
        options: the checked options (see :class:`CheckpointOptions`); or, instead,
        **arguments: the keyword arguments of :meth:`CheckpointOptions.check` (``policy``,
            ``objective``, ``mtbf_s``, ``keep_last``, ``compression``, ``compression_options``,
            ``every_n_steps``, ``every_n_seconds``, ``block``, ``planner_options``,
            ``verbose``, ``storage_options``), checked here.
        listeners: telemetry listeners for every save and restore event.
        manager_options: further keyword arguments of :class:`~coci_core.CheckpointManager`.
        rank: this process's global rank (rank 0 decides when to save and commits).
        world_size: the number of processes, which each write their share of every save (a
            :class:`~coci_core.RankGroup` whose session name rank 0 broadcasts); unless
            ``manager_options`` gives a ``group``. None: the manager's default group.
        broadcast: for several processes, a collective that sends rank 0's object to every
            rank; save decisions are then shared at a few sync steps (see ``decision.py``).
        min_over_ranks: for several processes that watch preemption notices, a collective
            that returns the minimum of a number over the ranks (see
            :func:`~coci_core.training.preemption.min_over_ranks`), called at every step
            boundary once :meth:`watch_preemption` started.
        sinks: telemetry sinks (TensorBoard, JSON lines): every save and restore event, the
            plan whenever it changes and at each save, and the observed loss beside the fitted
            curve every ``telemetry_every_n_steps`` steps.
        log: where the lines for the user go (rank 0: a line per save with ``verbose``, the
            restart's cost): the adapter's logger; default this module's.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | Storage,
        options: CheckpointOptions | None = None,
        *,
        listeners: Iterable[Listener] = (),
        manager_options: Mapping[str, Any] | None = None,
        rank: int = 0,
        world_size: int | None = None,
        broadcast: Callable[[Any], Any] | None = None,
        min_over_ranks: Callable[[float], float] | None = None,
        sinks: Iterable[TelemetrySink] = (),
        telemetry_every_n_steps: int = 50,
        log: logging.Logger | None = None,
        **arguments: Any,
    ) -> None:
        if options is None:
            options = CheckpointOptions.check(dirpath=directory, **arguments)
        elif arguments:
            raise ConfigError(
                f"give the options as 'options' or as keyword arguments, not both: "
                f"{sorted(arguments)}"
            )
        self.options = options
        self.verbose = options.verbose
        self.log = log if log is not None else logger
        self.summary = SaveSummary()
        self.block = options.block
        self.planner = Planner.from_config(options.planner)
        if type(telemetry_every_n_steps) is not int or telemetry_every_n_steps < 1:
            raise ConfigError(
                f"'telemetry_every_n_steps' must be an integer >= 1: {telemetry_every_n_steps!r}"
            )
        self.rank = rank
        self.sinks: list[TelemetrySink] = list(sinks)
        self.telemetry_every_n_steps = telemetry_every_n_steps
        self._replans_seen = -1
        self._telemetry_step = -telemetry_every_n_steps
        self._last_loss: float | None = None
        self._plans = LatestOnlyWorker(self._record_plan, name="coci-telemetry")
        # Telemetry thread only: the last plan costed and its cost (one plan, many saves).
        self._costed: tuple[Any, ExpectedOverhead | None] | None = None
        self.decision = SharedDecision(self.planner, rank=rank, broadcast=broadcast)
        self._listeners: list[Listener] = list(listeners)
        manager_options = dict(manager_options or {})
        if world_size is not None and "group" not in manager_options:
            manager_options["group"] = _rank_group(rank, world_size, broadcast)
        self.manager = CheckpointManager(
            directory,
            listeners=[self._on_event],
            **options.manager_arguments(),
            **manager_options,
        )
        # A training run writes: it holds the directory from its start (a run started later
        # there is the one refused), and is told at once when another run holds it, not
        # only at its first save, which the plan may put many minutes on.
        busy = self.manager.claim()
        if busy is not None:
            logger.warning(
                "coci: %s; this run's saves are refused while it does (DirectoryInUseError "
                "at the first one)",
                busy,
            )
        self.warmed = False  # warm_up was called (else the first save maps the buffers)
        # termination models by source ("early_stopping", "optuna"), combined with the options'
        self._terminations: dict[str, Termination] = {}
        self.last_save: SaveEvent | None = None
        self._checked_not_empty = False
        self.resumed_from: int | None = None  # the step this run was restored from
        self._resumed_unfinished = False  # see resumed_unfinished()
        started = process_start_unix()
        self._since: Literal["process start", "adapter start"] = (
            "process start" if started is not None else "adapter start"
        )
        self._started_unix = started if started is not None else time.time()
        self._restored: RestoreEvent | None = None  # until the first step after it
        self._last_observed: int | None = None
        self._failed = False  # training ended on an error (see mark_failed)
        # the keep_last of the run that wrote the restored checkpoint (see close)
        self._restored_keep_last: object = _UNKNOWN
        self._world_size = world_size if world_size is not None else 1
        self._broadcast = broadcast
        self._min_over_ranks = min_over_ranks
        self._watch: PreemptionWatch | None = None
        #: a SIGTERM/SIGINT that came after the last step boundary (see :meth:`close`)
        self.stopped_late: str | None = None
        #: what the ranks agreed on at a preemption notice (None until one came)
        self.preempted: PreemptionDecision | None = None
        self._failure_counted = False  # the last restore counted as a failure
        #: the save planned before a notice's known end, while training goes on to it
        self.notice_plan: NoticePlan | None = None
        self._notice_said: NoticePlan | None = None  # the plan the last WARNING line told of
        self._durable_s: list[float] = []  # the last committed saves' time to durable
        self._notice_handle: SaveHandle | None = None
        # the last save's handle and when it began (time.monotonic())
        self._last_save: tuple[SaveHandle, float] | None = None

    def __repr__(self) -> str:
        return f"Checkpointer({self.manager.storage.url!r}, policy={self.planner.policy_name!r})"

    def add_listener(self, listener: Callable[[Event], None]) -> None:
        """Also give every later save and restore event to ``listener``."""
        self._listeners.append(listener)

    def _continues_here(self, event: RestoreEvent) -> bool:
        """Whether ``event`` restored the step the run's previous session ended its training
        at (a Checkpointer of this process, or as the telemetry kept it): the run goes on,
        nothing failed."""
        if _TRAINED_HERE.get(self.manager.storage.url) == event.step:
            return True
        return any(getattr(sink, "previous_end", None) == event.step for sink in self.sinks)

    def _chosen_older(self, event: RestoreEvent) -> bool:
        """Whether ``event`` restored another step than the one a restore without ``step``
        tries first, passing over no damaged newer one: a step the user chose (Lightning's
        ``ckpt_path=<step>``, the Trainer's ``resume_from_checkpoint=<step dir>``,
        ``restore(step)``), going back on purpose, not a failure for the MTBF."""
        if event.skipped_steps:
            return False
        try:
            return self.manager.latest_step() not in (None, event.step)
        except Exception:  # a listing that fails: counted as a failure, as before
            return False

    def _on_event(self, event: Event) -> None:
        if isinstance(event, RestoreEvent) and not self._continues_here(event):
            self.planner.record_restore(event.seconds, tier=event.tier)
            self._failure_counted = not self._chosen_older(event)
            if not self._failure_counted:  # its time stays a restart cost
                self.planner.forgive_restore()
        if isinstance(event, UploadEvent) and event.outcome == "committed":
            self._on_upload(event)
        if isinstance(event, RestartEvent):
            self.planner.record_restart(event.seconds)
        if isinstance(event, RestartEvent) and self.rank == 0:
            self.log.info(
                "coci: restarted in %.1f s from %s to the first step after step %d "
                "(restore %.2f s)",
                event.seconds,
                event.since,
                event.step,
                event.restore_s,
            )
        if isinstance(event, SaveEvent):
            if event.outcome == "committed":
                self._durable_s = [*self._durable_s[-3:], event.time_to_durable_s]
                self.planner.record_save(
                    stall_s=event.stall_s,
                    persist_s=event.persist_s,
                    unobserved_stall_s=event.stall_s - event.update_wait_s,
                )
            self.last_save = event
            self.summary.add(event)
            # a failed save is logged by the engine (WARNING or ERROR), verbose or not
            if self.verbose and self.rank == 0 and event.outcome != "failed":
                self.log.info(save_line(event))
        receivers: list[Callable[[Event], None]] = [*self.sinks, *self._listeners]
        for listener in receivers:
            try:
                listener(event)
            except Exception:
                logger.exception("coci telemetry listener %r failed", listener)

    def _on_upload(self, event: UploadEvent) -> None:
        # WARNING: runs on the upload thread.
        if event.bytes_uploaded == 0:
            return  # the step was there already: nothing was measured
        self.planner.record_upload(event.seconds)
        remote = self.manager.remote
        if remote is not None and self.options.remote_upload_every == "auto":
            every = self.planner.upload_every()
            if every != remote.upload_every:
                logger.info(
                    "coci: uploading every %d checkpoint(s) to %s from now on (%s)",
                    every,
                    remote.remote.url,
                    "two-level plan for the measured upload cost",
                )
                remote.upload_every = every

    def summary_line(self) -> str:
        """One line on this rank's saves so far: checkpoints committed, skipped and failed
        (when any), total stall and bytes written (see
        :class:`~coci_core.telemetry.summary.SaveSummary`); for a run resumed at its newest
        checkpoint that trained nothing after it (a finished run requeued), that it did so;
        not for a run that ended on an error (:meth:`mark_failed`) before its next step.
        """
        summary, resumed = self.summary, self.resumed_from
        if (
            resumed is not None
            and not self._failed  # a resume refused or a crash, not a finished run
            and self._last_observed in (None, resumed)
            and not (summary.committed or summary.skipped or summary.failed)
        ):  # a requeued run that had finished: not a run whose saves all went wrong
            return (
                f"coci: resumed at step {resumed}, the newest checkpoint; no step to train after it"
            )
        return summary.line(world_size=self.manager.group.world_size)

    def log_summary(self, log: logging.Logger) -> None:
        """Log :meth:`summary_line` on ``log``: INFO, or WARNING when a save failed."""
        line = self.summary_line()
        if self.summary.failed:
            log.warning(line)
        else:
            log.info(line)

    def plan_outline(self) -> PlanOutline:
        """The current plan, as an adapter's log line tells it."""
        return PlanOutline.of(self.planner)

    def set_termination(self, source: str, model: Termination | None) -> None:
        """Plan with ``model`` as the termination hazard from ``source`` (e.g. ``"optuna"``,
        ``"early_stopping"``; None removes it), combined with the others and the one in the
        options' ``planner_options`` (independent causes: the survivals multiply). The plan is
        re-made at the next step."""
        if model is None:
            self._terminations.pop(source, None)
        else:
            self._terminations[source] = model
        own = self.options.planner.settings.termination
        self.planner.set_termination(combine_terminations([own, *self._terminations.values()]))

    def observe(
        self, step: int, *, loss: float | None = None, step_time_s: float | None = None
    ) -> None:
        """Record one training step (never raises on odd loss or time values)."""
        if self._restored is not None:
            # before the planner sees the step: one re-plan with the whole restart, not two
            self._restart_done(self._restored)
        self._last_observed = step
        self.planner.observe(step, loss=loss, step_time_s=step_time_s)
        if not self.sinks:
            return
        self._record_progress(step)
        if loss is not None and math.isfinite(loss):
            self._last_loss = float(loss)
        if (
            self.planner.replans != self._replans_seen
            or step - self._telemetry_step >= self.telemetry_every_n_steps
        ):
            self._record_telemetry(step)

    def _record_progress(self, step: int) -> None:
        """Every step: the sinks keep the step reached (and write a record every few s)."""
        for sink in self.sinks:
            record_progress = getattr(sink, "record_progress", None)
            if record_progress is not None:
                try:
                    record_progress(step)
                except Exception:
                    logger.exception("coci telemetry sink %r failed", sink)

    def _restart_done(self, restored: RestoreEvent) -> None:
        """The first step after a restore ended: report the whole restart."""
        self._restored = None
        self._on_event(
            RestartEvent(
                step=restored.step,
                seconds=max(time.time() - self._started_unix, restored.seconds),
                restore_s=restored.seconds,
                since=self._since,
                tier=restored.tier,
            )
        )

    def _record_telemetry(self, step: int, *, plan: bool = False) -> None:
        report = self.planner.report(with_overhead=False)  # cheap on the training thread
        plan = plan or report.replans != self._replans_seen
        self._replans_seen = report.replans
        self._telemetry_step = step
        for sink in self.sinks:
            try:
                if self._last_loss is not None:
                    sink.record_loss(step, self._last_loss, report.fitted_loss)
            except Exception:
                logger.exception("coci telemetry sink %r failed", sink)
        if plan:
            self._plans.submit(step, report, self.planner.overhead_inputs())

    def _record_plan(self, step: int, report: Any, inputs: Any) -> None:
        # WARNING: runs on the telemetry thread (the expected overhead can take seconds).
        # The exact cost is linear in the number of checkpoints; a rolling horizon of a
        # fixed-interval policy can hold hundreds of thousands: then it is left out.
        overhead = self._expected_overhead(inputs)
        if overhead is not None:
            report = dataclasses.replace(report, expected_overhead=overhead)
        for sink in self.sinks:
            try:
                sink.record_plan(step, report)
            except Exception:
                logger.exception("coci telemetry sink %r failed", sink)

    def _expected_overhead(
        self, inputs: tuple[Problem, tuple[int, ...], Callable[[], tuple[int, ...]] | None] | None
    ) -> ExpectedOverhead | None:
        """The plan's expected overhead against Daly, computed once per plan (a save that
        does not change the plan reuses it: costing takes tens of ms that training shares)."""
        if inputs is None or len(inputs[1]) > MAX_CHECKPOINTS_COSTED:
            return None
        if self._costed is not None:
            (problem, steps, _), overhead = self._costed
            if problem is inputs[0] and steps == inputs[1]:
                return overhead
        overhead = compare_with_daly(*inputs)
        self._costed = (inputs, overhead)
        return overhead

    def should_save(self, step: int) -> bool:
        """Whether the plan checkpoints after ``step`` (the same on every rank). Once a
        preemption notice came to any rank (see :meth:`watch_preemption`): whether the
        notice's save fits the time left, at the step boundary every rank learned of it;
        :attr:`preempted` then holds the decision, and the loop stops after this step."""
        if self._watch is not None and self.preempted is None:
            checked = self._watch.check(step, self._save_time_s)
            if isinstance(checked, NoticePlan):
                if checked is not self.notice_plan:
                    previous, self.notice_plan = self.notice_plan, checked
                    self._on_notice_plan(step, checked, previous)
                return False  # the save moved to the plan's step; none before it
            if checked is not None:
                self.preempted = checked
                self._on_notice(checked)
                self._record_preemption(checked, None, None, pending=True)
                if checked.save:  # the plan saved with it moves past this step
                    self.planner.take_save(step)
                return checked.save
        if self.preempted is not None:
            return False
        return self.decision.should_save(step)

    def watch_preemption(self) -> list[str]:
        """Start watching the preemption notices of the options (signal handlers on the main
        thread, metadata pollers on threads of their own): from now on every
        :meth:`should_save` learns of any rank's notice. Call it on every rank, where the
        loop can stop at a step boundary (it checks :attr:`preempted` after each step, or
        calls :meth:`stop_if_preempted`). The names of the sources watched.

        Raises:
            ConfigError: several processes without ``min_over_ranks``.
        """
        config = self.options.preemption
        if config is None or self._watch is not None:
            return [s.name for s in self._watch.sources] if self._watch is not None else []
        if self._world_size > 1 and (self._min_over_ranks is None or self._broadcast is None):
            raise ConfigError(
                f"watching preemption notices with {self._world_size} processes needs "
                "'min_over_ranks' and 'broadcast' (see coci_core.training.preemption)"
            )
        self._watch = PreemptionWatch(
            config, rank=self.rank, min_over_ranks=self._min_over_ranks, broadcast=self._broadcast
        )
        return [s.name for s in self._watch.start()]

    def shield_loader_workers(self, loaders: Any) -> int:
        """Shield the workers of ``loaders`` (a ``DataLoader``, a list or dict of them,
        Lightning's ``CombinedLoader``) from the notice signals watched (see
        :meth:`watch_preemption`) when they are sent to every process of the job, as SLURM
        does: the training process saves and shuts its workers down. Call it before the
        loader's iterator starts its workers. How many loaders were newly shielded (0 with no
        signal watched or no worker); see :mod:`coci_core.preemption.workers`."""
        if self._watch is None:
            return 0
        signums = [s.signum for s in self._watch.sources if isinstance(s, SignalNotice)]
        return shield_loader_workers(loaders, signums)

    def _save_time_s(self) -> SaveTimes:
        """What a save takes to be durable: the longest and the fastest of the last few (None:
        none measured yet), and the wait for one still being written. One that may not fit is
        tried only where a cut-short save costs nothing: no upload to a remote tier waits."""
        longest = max(self._durable_s) if self._durable_s else None
        wait = 0.0
        last = self._last_save
        if longest is not None and last is not None and not last[0].done():
            wait = max(0.0, longest - (time.monotonic() - last[1]))
        return SaveTimes(
            longest_s=longest,
            fastest_s=min(self._durable_s) if self._durable_s else None,
            wait_s=wait,
            try_uncertain=self.manager.remote is None,
        )

    def _on_notice_plan(self, step: int, plan: NoticePlan, previous: NoticePlan | None) -> None:
        """A notice of a known end, far enough ahead: the planner's next save moves to the
        plan's step (the plan's telemetry says so), and training goes on to it. Said once (a
        WARNING line); made again (``previous``: the plan before), said again only when it
        changes what the user was told (see :func:`plan_changed`), else logged at INFO."""
        self.planner.plan_notice(plan.save_at, f"{plan.source}: {plan.reason}")
        if self.sinks:
            self._record_telemetry(step, plan=True)
        if self.rank != 0:
            return
        said = self._notice_said
        if said is None or previous is None:
            self._notice_said = plan
            self.log.warning(
                "coci: preemption notice (%s) at step %d: %s",
                plan.source,
                plan.noticed_at,
                plan.reason,
            )
            return
        changed = plan_changed(said, plan, step)
        if changed:
            self._notice_said = plan
        self.log.log(
            logging.WARNING if changed else logging.INFO,
            "coci: the save for the preemption notice (%s) at step %d moves from step %d: %s",
            plan.source,
            plan.noticed_at,
            previous.save_at,
            plan.reason,
        )

    def _on_notice(self, decision: PreemptionDecision) -> None:
        if self.rank != 0:
            return
        plan = self.notice_plan
        if decision.moved and plan is not None and plan.save_at == decision.step:
            self.log.warning(
                "coci: step %d, where the save for the preemption notice (%s) at step %d was "
                "planned, %.1f s left: %s",
                decision.step,
                plan.source,
                plan.noticed_at,
                decision.time_left_s,
                decision.reason,
            )
        elif decision.moved and plan is not None:  # cut short: a SIGTERM, or slower steps
            why = (
                f"preemption notice ({decision.source})"
                if decision.source != plan.source
                else "the steps slowed down"
            )
            self.log.warning(
                "coci: %s at step %d, before step %d where the save for the preemption notice "
                "(%s) at step %d was planned, %.1f s left: %s",
                why,
                decision.step,
                plan.save_at,
                plan.source,
                plan.noticed_at,
                decision.time_left_s,
                decision.reason,
            )
        else:
            self.log.warning(
                "coci: preemption notice (%s) at step %d, %.1f s left: %s",
                decision.source,
                decision.step,
                decision.time_left_s,
                decision.reason,
            )

    def stop_if_preempted(self) -> None:
        """Raise :class:`~coci_core.Preempted` (after :meth:`end_preempted`) when the ranks
        agreed on a notice; else nothing. A plain loop calls it after each step's
        ``should_save``/``save``."""
        if self.preempted is not None:
            raise self.end_preempted()

    def end_preempted(self) -> Preempted:
        """After a notice's step: wait for its save to be durable (within the time left),
        give the remote upload what is left of it, close (telemetry flushed), and return
        the exception to stop with (an adapter that stops otherwise, Lightning's
        ``should_stop``, only logs it)."""
        decision = self.preempted
        assert decision is not None
        saved: int | None = None
        save_s: float | None = None
        handle = self._notice_handle
        if handle is not None:
            try:
                event = handle.wait(max(0.0, decision.time_left()))
                saved = event.step if event.outcome == "committed" else None
                save_s = event.time_to_durable_s if saved is not None else None
            except Exception as e:
                self.log.warning("coci: the save at the notice did not finish: %s", e)
        self._record_preemption(decision, saved, save_s)
        upload_s = max(0.0, decision.time_left() - decision.margin_s)
        try:
            self.close(upload_timeout_s=upload_s)
        except Exception as e:
            self.log.warning("coci: closing after the notice failed: %s", e)
        if saved is not None:
            message = (
                f"coci: stopped on a preemption notice ({decision.source}) after saving step "
                f"{saved}, {decision.time_left():.1f} s before the deadline"
            )
        else:
            message = (
                f"coci: stopped on a preemption notice ({decision.source}) at step "
                f"{decision.step} without saving it: {decision.reason}"
            )
        if self.rank == 0:
            self.log.warning(message)
        return Preempted(
            message,
            code=self.options.preemption.exit_code if self.options.preemption else 143,
            step=saved,
            source=decision.source,
        )

    def _record_preemption(
        self,
        decision: PreemptionDecision,
        saved: int | None,
        save_s: float | None,
        *,
        pending: bool = False,
    ) -> None:
        """The notice, the decision and its outcome, to the sinks that keep it (before they
        are closed); ``pending``: the decision alone, before its save (a kill during the save
        leaves this record to tell of the notice)."""
        for sink in self.sinks:
            record = getattr(sink, "record_preemption", None)
            if record is None:
                continue
            try:
                record(
                    decision.step,
                    source=decision.source,
                    time_left_s=decision.time_left_s,
                    save=decision.save,
                    needed_s=decision.needed_s,
                    margin_s=decision.margin_s,
                    reason=decision.reason,
                    saved=saved,
                    save_s=save_s,
                    noticed_at=decision.noticed_at,
                    noticed_left_s=decision.noticed_left_s,
                    noticed_source=decision.noticed_source,
                    pending=pending,
                )
            except Exception:
                logger.exception("coci telemetry sink %r failed", sink)

    def warm_up(
        self, state: Mapping[str, Any], *, per_rank: Mapping[str, Any] | None = None
    ) -> None:
        """Map the host buffers for saves of ``state`` in the background (see
        :meth:`CheckpointManager.warm_up`); never raises (the first save then maps them).
        Adapters call it once (see :attr:`warmed`), after the run's first optimizer step: the
        state then has its final shapes (the optimizer made its state)."""
        self.warmed = True
        try:
            self.manager.warm_up(state, per_rank=per_rank)
        except Exception as e:
            logger.debug("coci: warm-up skipped: %s", e)

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        block: bool | None = None,
        per_rank: Mapping[str, Any] | None = None,
        alone: bool = False,
    ) -> SaveHandle:
        """Save ``state`` as ``step`` (see :meth:`CheckpointManager.save`).

        A step the directory already holds is replaced when it belongs to this run (a run
        that went back to an older step and trained on), and never when it belongs to
        another run: the engine saves it beside that run's (``step-...-v1``). The step this
        run resumed from is not saved again (but see :meth:`resumed_unfinished`).
        """
        started = time.monotonic()
        save = functools.partial(
            self.manager.save,
            step,
            state,
            block=self.block if block is None else block,
            per_rank=per_rank,
            alone=alone,
        )
        try:
            handle = save()
        except StepExistsError as e:
            if not e.own:  # not raised for another run's step (saved beside it)
                raise
            if self.resumed_from != step or self._resumed_unfinished:
                if e.elsewhere:  # never replaced without a word
                    logger.warning("coci: %s; this run replaces it with its own", e)
                handle = save(overwrite=True)
            else:
                return self.manager.skip(step, "it is the checkpoint this run resumed from")
        self._last_save = (handle, started)
        if self.sinks:
            self._record_telemetry(step, plan=True)
        if self.preempted is not None and self.preempted.step == step:
            self._notice_handle = handle
        return handle

    def warn_if_not_empty(self, resume_hint: str = "resume from it") -> bool:
        """At the start of a run that did not resume: warn (rank 0, at the first call) when
        the directory holds checkpoints of another run, as Lightning's ModelCheckpoint warns
        of a non-empty directory (a script rerun into its default directory). ``resume_hint``:
        how the adapter's user continues that run instead. Returns whether it did."""
        if self._checked_not_empty or self.rank != 0 or self.resumed_from is not None:
            return False
        self._checked_not_empty = True
        runs = {r: s for r, s in self.manager.runs().items() if r != self.manager.run_id}
        if not runs:
            return False
        steps = sorted(s for run_steps in runs.values() for s in run_steps)
        shown = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
        logger.warning(
            "coci: %s holds %d checkpoint(s) of %s (steps %s). This is a new run, not a "
            "resumed one: it saves beside them (a step they hold as step-...-v1) and never "
            "deletes or overwrites them, and a resume takes this run's newest checkpoint once "
            "it has one. To continue that run instead, %s; to keep runs apart, give each run "
            "a directory of its own.",
            self.manager.storage.url,
            len(steps),
            "another run" if len(runs) == 1 else f"{len(runs)} other runs",
            shown,
            resume_hint,
        )
        return True

    def before_update(self, step: int | None = None) -> None:
        """Wait for an unfinished snapshot copy (torch optimizers do before each ``step()``;
        call it before other in-place changes of the saved tensors). ``step``: the step this
        update completes, kept by the telemetry as reached (a process killed before the step
        is observed still tells how far it got)."""
        self.manager.before_update()
        if step is not None:
            self._record_progress(step)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return self.manager.latest_step()

    def restore(
        self,
        step: int | str | None = None,
        *,
        into: Mapping[str, Stateful] | None = None,
        targets: InPlaceTargets | None = None,
        partial: bool = False,
        check: Callable[[int, dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Restore (see :meth:`CheckpointManager.restore`) and tell the planner what it cost."""
        state = self.manager.restore(step, into=into, targets=targets, partial=partial, check=check)
        event: RestoreEvent | None = self.manager.last_restore  # reported by the manager
        if event is not None:
            self.resumed_from = event.step
            self._restored = None if self._continues_here(event) else event
        return state

    def resumed_unfinished(self) -> None:
        """The checkpoint this run resumed from holds its step before work that the step
        still had to do (Lightning's save before an epoch's validation): a save of that step
        once it is done replaces it, instead of being skipped as the checkpoint resumed from
        (a rerun of the finished script would do that work again)."""
        self._resumed_unfinished = True

    def restored_from(self) -> str:
        """Where the last restore read its checkpoint, for the log line that names it: the
        remote tier's URL when it came from there (a new machine, its local directory
        empty), else the directory's."""
        event, remote = self.manager.last_restore, self.manager.remote
        if event is not None and event.tier == "remote" and remote is not None:
            return f"{remote.remote.url} (the remote tier)"
        return self.manager.storage.url

    def restored_elsewhere(self, run: str, event: RestoreEvent, sequence: int = 0) -> None:
        """A checkpoint of this directory was restored by other code (Lightning's own
        restore through coci's CheckpointIO, with :func:`restore_newest`): continue its run
        (later saves are committed after its ``sequence``), count its cost and report its
        event as the manager reports its own."""
        self.resumed_from = event.step
        self.manager.continue_run(run, sequence, restored=event)
        self._restored = None if self._continues_here(event) else event
        self._on_event(event)

    def wait(self, *, retention: bool = False) -> None:
        """Block until every pending save is durable (re-raises background errors);
        ``retention``: and until the steps they retire are removed (see
        :meth:`CheckpointManager.wait`)."""
        self.manager.wait(retention=retention)

    def mark_failed(self) -> None:
        """Training ended on an error (an adapter calls it before :meth:`close`): the session
        is recorded as failed, so a resume of its last step is a restart after a failure."""
        self._failed = True

    def close(self, *, upload_timeout_s: float | None = None, stop_late: bool = True) -> None:
        """Wait for pending saves, stop the writer and close the telemetry sinks, then stop
        watching preemption notices. ``upload_timeout_s``: how long the remote tier's last
        upload may still take (see :meth:`CheckpointManager.close`).

        A SIGTERM (or SIGINT) that came after the last step boundary (during a final
        evaluation or the final save), which without coci would have ended the process, is
        :attr:`stopped_late`; with ``stop_late`` (an adapter that raises it itself passes
        False) and everything closed and durable, ``close`` then raises :class:`Preempted`
        (exit status 143), on one process: ranks could not agree on it after their last
        boundary, and a warning says so instead."""
        if self._last_observed is not None and not self._failed:
            _TRAINED_HERE[self.manager.storage.url] = self._last_observed
        try:
            # the retention a kill right after the restored step's commit left undone, when
            # the run that wrote it kept as many steps as this one
            same_keep_last = self._restored_keep_last == self.manager.keep_last
            self.manager.close(
                upload_timeout_s=upload_timeout_s,
                resumed_retention=self.resumed_from is not None
                and same_keep_last
                and not self._failed,
            )
        finally:
            # after the final save is durable: a SIGTERM meanwhile is one that came late
            unanswered = self._watch.stop() if self._watch is not None else []
            self._plans.stop()
            for sink in self.sinks:
                record_end = getattr(sink, "record_end", None)
                if self._failed and record_end is not None:
                    try:
                        record_end(failed=True)
                    except Exception:
                        logger.exception("coci telemetry sink %r failed", sink)

                try:
                    sink.close()
                except Exception:
                    logger.exception("coci telemetry sink %r failed to close", sink)
        if unanswered and self._world_size > 1:
            self.log.warning(
                "coci: %s came after the last step boundary on this rank; the ranks cannot "
                "agree on it now, so it is not acted on",
                unanswered[0].name,
            )
        elif unanswered:
            self.stopped_late = unanswered[0].name
            if stop_late:
                self.raise_if_stopped_late()

    def raise_if_stopped_late(self) -> None:
        """Raise :class:`Preempted` if a stop request came after the last step boundary (see
        :meth:`close`)."""
        if self.stopped_late is None:
            return
        message = (
            f"coci: {self.stopped_late} came after the last step boundary; the final save is "
            "durable, and the process stops as it was asked"
        )
        self.log.warning(message)
        code = self.options.preemption.exit_code if self.options.preemption else 143
        raise Preempted(
            message, code=code, step=self.manager.latest_step(), source=self.stopped_late
        )

    def state_dict(self) -> dict[str, Any]:
        """The planner's estimates (JSON), so that a resumed run keeps them, the run's
        ``keep_last``, and the time the last committed saves took to be durable (what a
        preemption notice's decision is made from)."""
        notice = self.preempted is not None and self.preempted.save
        return {
            "planner": self.planner.state_dict(),
            "keep_last": self.manager.keep_last,
            "durable_s": list(self._durable_s),
            **({"notice_save": True} if notice else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the planner's estimates and the measured save times. The state of a save
        a preemption notice asked for makes the restore of it no failure for the MTBF (the
        run stopped as planned), on whatever machine it resumes."""
        if "planner" in state:
            self.planner.load_state_dict(dict(state["planner"]))
        if state.get("notice_save") is True and self._failure_counted:
            self.planner.forgive_restore()
        self._failure_counted = False
        kept = state.get("keep_last", _UNKNOWN)
        self._restored_keep_last = kept if kept is None or type(kept) is int else _UNKNOWN
        durable = state.get("durable_s")
        if isinstance(durable, list) and all(
            type(t) in (int, float) and math.isfinite(t) and t >= 0 for t in durable
        ):  # a resumed run's first notice judges its save by the run's saves before
            self._durable_s = [*[float(t) for t in durable], *self._durable_s][-4:]


_UNKNOWN = object()  # a checkpoint that does not say its keep_last (older, or forged)


def _rank_group(rank: int, world_size: int, broadcast: Callable[[Any], Any] | None) -> RankGroup:
    """Every rank writes its share; the session name comes from rank 0 (one broadcast)."""
    if world_size == 1:
        return RankGroup.single()
    if broadcast is None:
        raise ConfigError(f"'broadcast' is needed with several processes (world_size {world_size})")
    return RankGroup(rank, world_size, str(broadcast(uuid.uuid4().hex[:16])))
