"""CociCheckpointer: coci's planned, asynchronous checkpoints for an Accelerate training loop."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

import coci_accelerate._state as _state
from coci_accelerate._check import check_saved
from coci_accelerate._steps import (
    _check_skip,
    _count_steps,
    _log_skip_advice,
    _skip_expression,
    _total_steps,
)
from coci_accelerate.tracker import CociTracker
from coci_core import CompressionPolicy
from coci_core.errors import CociError, ConfigError, NoCheckpointError, StateMismatchError
from coci_core.planner import SavePolicy
from coci_core.preemption import NoticeSource, Preemption
from coci_core.storage import is_url
from coci_core.telemetry import TelemetrySink
from coci_core.training import (
    Checkpointer,
    CheckpointOptions,
    SaveHandle,
    TensorBoardTelemetry,
    check_bool,
    min_over_ranks,
    report_sink,
    shared_options,
)

__all__ = ["CociCheckpointer"]

logger = logging.getLogger(__name__)


class CociCheckpointer:
    """Saves an Accelerate run when coci's planner says so, on every process; resumes it.

    Registers itself with ``accelerator.register_for_checkpointing``, so that
    ``accelerator.save_state()`` / ``load_state()`` also carry the planner's state.

    Args:
        accelerator: the run's Accelerator.
        dirpath: where checkpoints go: a path, or an fsspec URL string such as
            ``"s3://bucket/run"`` (kept a string); default ``<project_dir>/coci``.
        policy: as for ``coci_lightning.CociCheckpoint``.
        objective: as for ``CociCheckpoint``.
        mtbf_s: as for ``CociCheckpoint``.
        keep_last: as for ``CociCheckpoint``.
        compression: as for ``CociCheckpoint``.
        every_n_steps: as for ``CociCheckpoint``.
        every_n_seconds: as for ``CociCheckpoint``.
        block: as for ``CociCheckpoint``.
        planner_options: as for ``CociCheckpoint``.
        save_on_close: ``close()`` saves the final state (like Lightning's
            ``save_on_train_end``); False: only the planned saves.
        total_steps: the optimizer steps the whole run takes, for the planner's horizon; or
        num_epochs: the run's epochs (then ``total_steps`` is the first prepared loader's
            length, in optimizer steps, times ``num_epochs``). Neither: a rolling horizon.
        verbose: the main process logs a line per save (step, stall, MB written,
            compression, when durable). ``close()`` logs one summary line either way.
        storage_options: as for ``CociCheckpoint``: the fsspec options of a URL ``dirpath``
            (credentials, endpoint), never logged. With a URL ``dirpath``, ``coci report``'s
            records go to objects under ``<dirpath>/telemetry/``, and TensorBoard's panel to
            Accelerate's TensorBoard tracker (and a ``CociTracker``): nothing local.
        remote: as for ``CociCheckpoint``: a second tier that every checkpoint is copied to
            in the background, and that ``resume()`` falls back to.
        remote_keep_last: as for ``CociCheckpoint``.
        remote_storage_options: as for ``CociCheckpoint``.
        remote_upload_every: as for ``CociCheckpoint``.
        preemption: the preemption notices to act on (default ``"auto"``: SIGTERM with a
            30 s grace period, and the metadata of the cloud the machine runs in; None: none;
            see docs/preemption.md). On a notice every process learns of it at the next
            ``step()``, saves that step when the save fits the time left, and ``step()``
            raises :class:`~coci_core.Preempted` (a ``SystemExit``, exit status 143).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        dirpath: str | Path | None = None,
        *,
        policy: str | SavePolicy = "coci",
        objective: str = "time",
        mtbf_s: float | None = None,
        keep_last: int | None = 3,
        compression: str | CompressionPolicy | None = "auto",
        compression_options: Mapping[str, Any] | None = None,
        every_n_steps: int | None = None,
        every_n_seconds: float | None = None,
        block: bool = True,
        planner_options: Mapping[str, Any] | None = None,
        save_on_close: bool = True,
        total_steps: int | None = None,
        num_epochs: int | None = None,
        verbose: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        remote: str | os.PathLike[str] | None = None,
        remote_keep_last: int | None = 10,
        remote_storage_options: Mapping[str, Any] | None = None,
        remote_upload_every: int | Literal["auto"] = "auto",
        preemption: str | Sequence[str | NoticeSource] | Preemption | None = "auto",
    ) -> None:
        if not isinstance(accelerator, Accelerator):
            raise ConfigError(
                f"'accelerator' must be an Accelerator, got {type(accelerator).__name__}"
            )
        planner_options, self._total_source, self._epoch_hint = _total_steps(
            accelerator, total_steps, num_epochs, policy, planner_options
        )
        total = planner_options.get("total_steps") if isinstance(planner_options, Mapping) else 0
        self._total = total if type(total) is int and total > 0 else None  # for a warning only
        check_bool("save_on_close", save_on_close)
        # The options both adapters share, each checked once, here (see CheckpointOptions).
        self.options = CheckpointOptions.check(dirpath=dirpath, **shared_options(locals()))
        self.save_on_close = save_on_close
        self.accelerator = accelerator
        root = Path(accelerator.project_dir) if accelerator.project_dir else Path.cwd()
        url = is_url(dirpath)
        self.dirpath: Path | str = (
            str(dirpath) if url else Path(dirpath) if dirpath is not None else root / "coci"
        )
        is_main = accelerator.is_main_process
        sinks: list[TelemetrySink] = []
        if is_main:  # telemetry.jsonl, or objects under a URL (coci report reads either)
            sinks.append(report_sink(self.dirpath, self.storage_options))
        if is_main and isinstance(self.dirpath, Path):
            with contextlib.suppress(ConfigError):  # tensorboard is not installed
                sinks.append(_tensorboard_sink(accelerator, self.dirpath))
        elif is_main:  # an fsspec URL: TensorBoard only through the run's own tracker
            with contextlib.suppress(ConfigError):
                sinks.extend(
                    TensorBoardTelemetry(writer=tracker.writer, telemetry_dir=self.dirpath)
                    for tracker in accelerator.trackers
                    if type(tracker).__name__ == "TensorBoardTracker"
                )
        several = accelerator.num_processes > 1
        _warn_unless_one_run(accelerator)
        self.checkpointer = Checkpointer(
            self.dirpath,
            self.options,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            broadcast=_broadcast if several else None,
            min_over_ranks=min_over_ranks() if several and self.options.preemption else None,
            sinks=sinks,
            log=logger,
        )
        self.checkpointer.watch_preemption()
        self._shield_loaders()
        self._closed = False
        self._tracker = _find_tracker(accelerator)
        config = accelerator.dataloader_config
        if not config.use_seedable_sampler:
            warnings.warn(
                "coci: a run resumed mid-epoch sees each remaining sample exactly once only with "
                "Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))"
                " and either use_stateful_dataloader=True (needs torchdata) or "
                f"accelerator.skip_first_batches(dataloader, {_skip_expression(accelerator)}); "
                "with this configuration the resumed epoch may repeat or skip samples",
                UserWarning,
                stacklevel=2,
            )
        self._last_step_end: float | None = None
        self._hooked: set[int] = set()
        self._opt_counts: dict[int, int] = {}
        self._count = 0  # optimizer steps completed
        self._observed: int | None = None  # the count at the last step() that observed
        self._saved: int | None = None  # the count at the last save
        self._standins: dict[int, Any] = {}
        self._announced = False
        self._skip_advice: int | None = None  # resumed mid-epoch: the count, until step()
        self._install_skip_tracking()
        self._install_load_state_check()
        self._hook_optimizers()
        _state.own_loader_generators(accelerator)
        objects = accelerator._custom_objects
        closed = [i for i, o in enumerate(objects) if isinstance(o, CociCheckpointer) and o._closed]
        if closed:  # a closed one's place (a second loop on this Accelerator): the order that
            objects[closed[0]] = self  # the checkpoints record the registered objects in
        else:
            accelerator.register_for_checkpointing(self)

    # -- the training loop ----------------------------------------------------------------

    verbose = property(lambda self: self.options.verbose, doc="A log line per save.")
    storage_options = property(
        lambda self: dict(self.options.storage_options), doc="The fsspec options (secret)."
    )

    def _shield_loaders(self) -> None:
        """The workers of the prepared loaders leave a notice's signal sent to every process
        of the job to this one (see :mod:`coci_core.preemption.workers`): those prepared
        before this checkpointer from their first epoch, those prepared after from the epoch
        after the first ``step()`` that sees them."""
        # (each call: the list is replaced by free_memory(); a shielded loader is skipped)
        self.checkpointer.shield_loader_workers(self.accelerator._dataloaders)  # see _state.py

    def step(self, step: int | None = None, *, loss: float | None = None) -> SaveHandle | None:
        """Call once per batch, after ``optimizer.step()``; saves when the plan says so.

        coci counts the optimizer steps itself (a checkpoint is labelled with the number of
        optimizer steps completed when it was taken, as ``overall_step`` in Accelerate's
        checkpointing example), so ``step`` is optional; when given it must be that count, else
        ``ConfigError``. A call after which no optimizer step completed (gradient accumulation)
        does nothing. ``loss`` is only needed without a ``CociTracker`` in ``log_with``.
        Returns the save's handle on the process that writes, else None.

        Raises:
            Preempted: a preemption notice reached a process (see ``preemption``): this step
                was saved if the save fitted the time left, the checkpointer is closed; let
                it end the process (exit status 143) so that the scheduler restarts the job.
        """
        self._check_prepared()
        self._shield_loaders()
        if self._hook_optimizers(late=True):
            _state.own_loader_generators(self.accelerator)
        count = self._count
        if step is not None and (type(step) is not int or step != count):
            gas = self.accelerator.gradient_accumulation_steps
            raise ConfigError(
                f"ckpt.step({step!r}): coci labels a step with the number of optimizer steps "
                f"completed so far, {count} here: count overall_step += 1 after "
                "optimizer.step() (as Accelerate's checkpointing example does) and pass that, "
                "or call ckpt.step() with no argument; ckpt.resume() returns that count"
                + (
                    f". With gradient_accumulation_steps={gas}, optimizer.step() completes an "
                    "optimizer step only once every that many batches, when "
                    "accelerator.sync_gradients is True: count then "
                    "(if accelerator.sync_gradients: overall_step += 1), not every batch"
                    if gas > 1
                    else ""
                )
            )
        if count == 0 or count == self._observed:
            return None  # no optimizer step since the last call (accumulating gradients)
        self._observed = count
        if count == (self._total or -2) + 1 and self.accelerator.is_main_process:
            logger.warning(
                "coci: step %d is past the run's %d total steps (%s): a resumed loop over "
                "epochs that starts again at epoch 0 trains again what the checkpoint holds; "
                "start it at %s",
                count,
                self._total,
                self._total_source,
                self._epoch_hint,
            )
        announce = not self._announced
        self._announced = True
        now = time.perf_counter()
        step_time = None if self._last_step_end is None else now - self._last_step_end
        if loss is None and self._tracker is not None:
            loss = self._tracker.pop_loss(count)
            if loss is None:  # logged with the 0-based index of the step just taken
                loss = self._tracker.pop_loss(count - 1)
        self.checkpointer.observe(count, loss=loss, step_time_s=step_time)
        handle = None
        if announce and self.accelerator.is_main_process:
            # a fresh run into another run's directory (a rerun of the script)
            self.checkpointer.warn_if_not_empty("call ckpt.resume() before the loop")
            self._announce_plan()
        if self._skip_advice is not None:
            _log_skip_advice(self.accelerator, self._skip_advice, self._standins)
            self._skip_advice = None
        if self.checkpointer.should_save(count):
            handle = self.save()
        elif not self.checkpointer.warmed and self.checkpointer.preempted is None:
            self._warm_up(count)
        if self.checkpointer.preempted is not None:
            self._closed = True  # a close() in the user's finally has nothing left to do
            stop = self.checkpointer.end_preempted()
            if self.accelerator.is_main_process:
                self.checkpointer.log_summary(logger)
            raise stop
        self._last_step_end = time.perf_counter()
        return handle

    def _announce_plan(self) -> None:
        """One log line at the first step: what coci plans and how to change it."""
        outline = self.checkpointer.plan_outline()
        line, warn = outline.line(
            outline.report.step,
            adapter="CociCheckpointer",
            objective=self.options.objective,
            total_source=self._total_source,
            total_hint="pass total_steps= or num_epochs=",
            final_save=self.save_on_close,
        )
        (logger.warning if warn else logger.info)(line)

    @property
    def completed_steps(self) -> int:
        """Optimizer steps completed (restored by ``resume()``): the label of the next save."""
        return self._count

    def _warm_up(self, count: int) -> None:
        # the state that save() takes (the user's save hooks are not run for this)
        state = _state.collect(self.accelerator, count, standins=self._standins)
        state["coci"] = self.checkpointer.state_dict()
        own = _state.collect_own(self.accelerator, skip=self)
        self.checkpointer.warm_up(state, per_rank={_state.PROCESS_KEY: own})

    def save(self, step: int | None = None) -> SaveHandle:
        """Save now, labelled with the optimizer steps completed; call it on every process at
        the same step: each writes its share of the state and its own random states and
        registered objects (no collective). ``step``, if given, must be that count."""
        self._check_prepared()
        self._hook_optimizers()
        count = self._count
        if step is not None and (type(step) is not int or step != count):
            raise ConfigError(
                f"ckpt.save({step!r}): coci labels a checkpoint with the number of optimizer "
                f"steps completed, {count} here; call ckpt.save() with no argument"
            )
        if self.accelerator.is_main_process:
            # a fresh run into another run's directory (a rerun of the script)
            self.checkpointer.warn_if_not_empty("call ckpt.resume() before the loop")
        state = _state.collect(self.accelerator, count, standins=self._standins)
        _state.run_save_hooks(self.accelerator, state, str(self.dirpath))
        state["coci"] = self.checkpointer.state_dict()
        own = _state.collect_own(self.accelerator, skip=self)
        handle = self.checkpointer.save(count, state, per_rank={_state.PROCESS_KEY: own})
        self._saved = count
        return handle

    def wait(self) -> None:
        """Block until pending saves are durable (re-raises background errors)."""
        self.checkpointer.wait()

    def close(self, *, save: bool | None = None) -> None:
        """Save the final state (unless ``save_on_close=False`` or ``save=False``), wait for
        pending saves and stop the writer; call it on every process.

        The final save is skipped when no optimizer step completed since the last save, and
        while an exception propagates (``close()`` in a ``finally``: another process may be
        gone, the step may be half done); ``save=True`` forces it then.
        """
        if self._closed and self.checkpointer.preempted is not None:
            return  # stopped on a notice: saved and closed then
        if not self._closed and sys.exc_info()[1] is not None:
            # training ended on an error: a resume of this run is a restart after a failure,
            # and the summary does not tell it as a finished run
            self.checkpointer.mark_failed()
        try:
            forced = save is True
            wanted = self.save_on_close if save is None else save
            if wanted and self._count > 0 and self._count != self._saved:
                if forced or sys.exc_info()[1] is None:
                    self.save()
                else:
                    logger.info(
                        "coci: an exception is propagating: no final save at step %d (the "
                        "newest checkpoint stays step %s); ckpt.close(save=True) forces it",
                        self._count,
                        self._saved,
                    )
        finally:
            try:
                self.checkpointer.close()
            finally:  # the end of training: one summary line on the main process
                if not self._closed and self.accelerator.is_main_process:
                    self.checkpointer.log_summary(logger)
                self._closed = True

    def resume(self, *, partial: bool = False) -> int:
        """Restore the newest committed checkpoint, if any, into everything Accelerate
        prepared and registered; returns the number of optimizer steps it had completed (0
        when starting fresh): the batches of the run already trained on, to skip.

        A model tensor the checkpoint has no value for, or one of another shape, raises
        ``StateMismatchError`` before anything is read; ``partial=True`` allows the missing
        ones (the models are then loaded with ``strict=False``)."""
        self._check_prepared()
        self._hook_optimizers()
        _state.own_loader_generators(self.accelerator)
        try:
            # the models' and optimizers' tensors are read in place: no second copy of them
            targets = _state.live_targets(self.accelerator, partial=partial)
            try:
                # a state that resume() could not put back is damage, passed over by all
                index = self.accelerator.process_index
                names = [type(o).__name__ for o in self.accelerator._custom_objects]
                mine = [i for i, o in enumerate(self.accelerator._custom_objects) if o is self]
                state = self.checkpointer.restore(
                    targets=targets,
                    partial=partial,
                    check=lambda step, saved: check_saved(
                        step, saved, index, names, stateless=mine
                    ),
                )
            except StateMismatchError as e:
                if e.step is not None:  # another program's checkpoint: say that instead
                    manifest = self.checkpointer.manager.manifest(e.step)
                    _state.check_layout(_state.stored_layout(manifest.tree))
                raise
        except NoCheckpointError:
            if self.accelerator.is_main_process:
                logger.info(
                    "coci: no committed checkpoint in %s; starting fresh",
                    self.checkpointer.manager.storage.url,
                )
            return 0
        failure: Exception | None = None
        try:
            _state.apply(
                self.accelerator, state, skip=self, input_dir=str(self.dirpath), strict=not partial
            )
        except Exception as e:
            failure = e
        _state.agree_on_apply(self.accelerator, self.checkpointer.resumed_from, failure)
        self.checkpointer.load_state_dict(state.get("coci", {}))
        self._last_step_end = None
        count = _state.completed_steps(state)
        self._count = count
        self._opt_counts = dict.fromkeys(self._opt_counts, count)
        self._observed = self._saved = count
        if self.accelerator.is_main_process:
            logger.info(
                "coci: Accelerate restores step %d from %s",
                count,
                self.checkpointer.restored_from(),
            )
            self._skip_advice = count  # said at the first step, unless the loop skipped
        return count

    # -- Accelerate's register_for_checkpointing ------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The planner's state and the optimizer steps completed, for
        ``accelerator.save_state``."""
        return {**self.checkpointer.state_dict(), "completed_steps": self._count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the planner's state and the optimizer steps completed, from
        ``accelerator.load_state``."""
        self.checkpointer.load_state_dict(state_dict)
        if "completed_steps" in state_dict:
            self._hook_optimizers()
            count = int(state_dict["completed_steps"])
            self._count = count
            self._opt_counts = dict.fromkeys(self._opt_counts, count)
            self._observed = self._saved = count

    # -- internals ------------------------------------------------------------------------

    def _check_prepared(self) -> None:
        acc = self.accelerator
        if not acc._models and not acc._optimizers:
            raise CociError(
                "CociCheckpointer: nothing is prepared yet; call accelerator.prepare(model, "
                "optimizer, ...) before ckpt.step() or ckpt.resume()"
            )

    def _hook_optimizers(self, *, late: bool = False) -> bool:
        """Count every prepared optimizer's steps; True if one was not counted yet.

        ``late``: from ``step()``, after an optimizer step nobody counted (the checkpointer
        was made before ``accelerator.prepare``): count that one step."""
        new = False
        for opt in self.accelerator._optimizers:  # private: see _state.py
            if id(opt) in self._hooked:
                continue
            self._hooked.add(id(opt))
            new = True
            inner = getattr(opt, "optimizer", opt)
            # The snapshot may overlap the next forward/backward: wait for it before any update.
            inner.register_step_pre_hook(lambda *_: self.checkpointer.before_update())
            self._opt_counts[id(opt)] = self._count + (1 if late else 0)
            _count_steps(opt, functools.partial(self._counted, id(opt)))
        if new:
            self._count = max(self._opt_counts.values(), default=0)
        return new

    def _counted(self, key: int) -> None:
        # An update (or an fp16 update the scaler skipped: the batch is consumed either way).
        self._opt_counts[key] += 1
        self._count = max(self._opt_counts.values())

    def _install_load_state_check(self) -> None:
        """``accelerator.load_state(folder)`` of a folder that ``save_state`` wrote before a
        ``CociCheckpointer`` was registered: Accelerate refuses it counting the registered
        objects, coci's among them, which the user did not register; say why and what to do."""
        acc = self.accelerator
        if getattr(acc.load_state, "_coci_checked", False):
            return  # a second checkpointer on this Accelerator (its place: the closed one's)
        original = acc.load_state

        def load_state(input_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(input_dir, *args, **kwargs)
            except RuntimeError as e:
                found = re.search(r"Found checkpoints: (\d+)", str(e))
                registered = acc._custom_objects  # private: see _state.py
                if (
                    not str(e).startswith("Number of custom checkpoints")
                    or found is None
                    or int(found.group(1)) != len(registered) - 1
                    or not any(isinstance(o, CociCheckpointer) for o in registered)
                ):
                    raise
                raise ConfigError(
                    f"accelerator.load_state({input_dir!r}): the folder holds the states of "
                    f"{found.group(1)} objects registered with register_for_checkpointing, this "
                    f"Accelerator has {len(registered)}: the CociCheckpointer registers itself "
                    "(so that save_state carries coci's planner state), and the folder was "
                    "saved without one. coci cannot take over that run midway (ckpt.resume() "
                    "reads coci's checkpoints only, and its step count would start at 0): "
                    "finish it as it was written, or call accelerator.load_state(...) before "
                    "making the CociCheckpointer to start a new run, counted from step 0, from "
                    "that folder's state (Accelerate has loaded the models, optimizers and "
                    "schedulers already, not the registered objects)"
                ) from e

        load_state._coci_checked = True  # type: ignore[attr-defined]
        acc.load_state = load_state

    def _install_skip_tracking(self) -> None:
        """``accelerator.skip_first_batches(loader, n)`` makes a new loader that runs the rest
        of ``loader``'s current epoch in its place; coci saves its position for ``loader`` and
        moves ``loader`` to the next epoch when it ends (else the next epoch replays this one)."""
        acc = self.accelerator
        original = acc.skip_first_batches
        standins = self._standins

        def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
            if self._skip_advice is not None and num_batches:  # resumed, before the 1st step
                _check_skip(acc, dataloader, self._skip_advice, num_batches)
            skipped = original(dataloader, num_batches)
            if not any(dataloader is dl for dl in acc._dataloaders) or not hasattr(
                skipped, "iteration"
            ):
                return skipped
            standin: Any = skipped
            loader: Any = dataloader
            standins[id(loader)] = standin
            end = standin.end

            def end_of_epoch() -> None:
                iteration = standin.iteration  # the next epoch's
                if standins.get(id(loader)) is standin:
                    loader.iteration = iteration
                    del standins[id(loader)]
                end()

            standin.end = end_of_epoch
            return skipped

        acc.skip_first_batches = skip_first_batches


def _warn_unless_one_run(accelerator: Accelerator) -> None:
    """Warn (once, in the launcher's rank 0) when the launcher started several processes
    (``WORLD_SIZE`` > 1) but the Accelerator runs one: each process is then a run of its own,
    all writing into one checkpoint directory. On a machine without GPUs, Accelerate 1.15 forms
    a process group (gloo) only with ``Accelerator(cpu=True)`` (or ``ACCELERATE_USE_CPU=1``
    under torchrun); ``accelerate launch --multi_gpu`` and ``torchrun`` without it start
    independent runs."""
    try:
        launched = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    # once for the job: by the process the launcher numbered 0 (each of them runs alone)
    if launched > 1 and accelerator.num_processes == 1 and os.environ.get("RANK", "0") == "0":
        warnings.warn(
            f"coci: WORLD_SIZE={launched} but the Accelerator runs one process: each of the "
            f"{launched} processes is a run of its own, writing into the same checkpoint "
            "directory, where the first to save holds it and the others' saves fail with "
            "DirectoryInUseError. On a CPU machine pass Accelerator(cpu=True), so that the "
            "processes form one run (gloo); on a GPU machine, check that each process sees a "
            "GPU",
            UserWarning,
            stacklevel=3,
        )


def _tensorboard_sink(accelerator: Accelerator, dirpath: Path) -> TensorBoardTelemetry:
    """The scalars go through Accelerate's TensorBoard tracker when the run has one (after
    ``init_trackers``), else to coci's own writer under ``dirpath/tensorboard``; either way
    pointed at ``dirpath`` (the telemetry) for TensorBoard's coci tab."""
    for tracker in accelerator.trackers:
        if type(tracker).__name__ == "TensorBoardTracker":
            return TensorBoardTelemetry(writer=tracker.writer, telemetry_dir=dirpath)
    return TensorBoardTelemetry(dirpath / "tensorboard", telemetry_dir=dirpath)


def _broadcast(obj: Any) -> Any:
    box = [obj]
    broadcast_object_list(box, from_process=0)
    return box[0]


def _find_tracker(accelerator: Accelerator) -> CociTracker | None:
    for tracker in [*accelerator.trackers, *accelerator.log_with]:
        if isinstance(tracker, CociTracker):
            if tracker not in accelerator.trackers and accelerator.is_main_process:
                logger.info(
                    "coci: CociTracker is in log_with but accelerator.init_trackers() was not "
                    "called: accelerator.log() does not reach it until it is"
                )
            return tracker
    return None
