"""CociCallback: coci's planned, asynchronous checkpoints for a ``transformers.Trainer``.

The callback takes the Trainer's saving over. The Trainer has no hook for a callback to save
or to resume through, so, when the Trainer is made (``on_init_end``), the callback replaces a
few of that Trainer's own methods on the instance (never on the class):

- ``_save_checkpoint`` (called where ``control.should_save`` is set, after the step's logging
  and evaluation, and by the Trainer's JIT checkpoint unless coci watches SIGTERM): a coci
  save of the same state;
- ``train``: ``resume_from_checkpoint=True``, a coci directory or a step directory restores
  coci's newest intact checkpoint (or that step), then runs the Trainer's own resume with a
  ``trainer_state.json`` written from it, so that the Trainer puts back its state, callbacks
  and data position itself;
- ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler``,
  ``_load_rng_state``: read the restored state instead of files, for that resume only;
- ``_load_best_model`` (``load_best_model_at_end``): coci's best kept step;
- ``_run_epoch``: runs nothing when the run was resumed at its last step (the Trainer checks
  ``should_training_stop`` only after a step, and would train one past ``max_steps``).

Each restore checks the state it read (``_check``): a forged one is damage, passed over.

These are private methods of ``transformers`` 5.x (the extra pins ``<6``).

Why one module: it is one callback's hooks and the methods it puts on its Trainer, each thin
(the Trainer's arguments, state and plan line live in ``_trainer``, ``_state``), and the
documentation of each of its arguments.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

import coci_transformers._state as _state
from coci_core import CompressionPolicy
from coci_core.errors import ConfigError, CorruptCheckpointError, NoCheckpointError, Preempted
from coci_core.planner import SavePolicy
from coci_core.preemption import NoticeSource, Preemption
from coci_core.storage import is_url
from coci_core.telemetry import TelemetrySink
from coci_core.training import (
    Checkpointer,
    CheckpointOptions,
    SaveHandle,
    ValidationHistory,
    check_bool,
    is_trial_pruned,
    min_over_ranks,
    ranks_read_alike,
    read_checkpoint,
    report_sink,
    run_step_dir,
    shared_options,
    step_dir_of,
)
from coci_transformers._check import check_saved
from coci_transformers._trainer import (
    best_to_load,
    broadcast,
    calling_trainer,
    check_arguments,
    coci_directory,
    data_parallel_size,
    early_stopping,
    jit_checkpoint_off,
    metric,
    planned_steps,
    quiet_default_flow,
    record_step,
    same_directory,
    shield_eval_loaders,
    tensorboard_sink,
    trial_termination,
)

__all__ = ["CociCallback"]

logger = logging.getLogger(__name__)


class _Default(int):
    """A default that tells itself from the same number given (``keep_last=3``)."""


_KEEP_LAST = _Default(3)
#: the file the Trainer's JIT checkpoint puts in checkpoint-<step> while it saves
_JIT_MARK = "checkpoint-is-incomplete.txt"


class CociCallback(TrainerCallback):
    """Saves a ``transformers.Trainer`` run when coci's planner says so and resumes it:
    ``Trainer(..., callbacks=[CociCallback()])``.

    While attached, the Trainer writes no ``checkpoint-N`` directory of its own: every save
    goes through coci (the copy before the next optimizer step, the write in the background).
    ``trainer.train(resume_from_checkpoint=True)`` resumes from coci's newest intact step.

    Args:
        dirpath: where checkpoints go: a path or an fsspec URL; default
            ``<output_dir>/coci`` (``<output_dir>/run-<trial>/coci`` in a hyper-parameter
            search).
        policy: as for ``coci_lightning.CociCheckpoint``; ``"every_n_steps"`` without
            ``every_n_steps`` takes the Trainer's ``save_steps``.
        objective: as for ``CociCheckpoint``.
        mtbf_s: as for ``CociCheckpoint``.
        keep_last: checkpoints to keep; the Trainer's ``save_total_limit`` when that is set.
        compression: as for ``CociCheckpoint``.
        compression_options: as for ``CociCheckpoint``.
        every_n_steps: as for ``CociCheckpoint``.
        every_n_seconds: as for ``CociCheckpoint``.
        block: as for ``CociCheckpoint``.
        planner_options: as for ``CociCheckpoint``.
        verbose: a log line per save.
        storage_options: as for ``CociCheckpoint``.
        remote: as for ``CociCheckpoint``.
        remote_keep_last: as for ``CociCheckpoint``.
        remote_storage_options: as for ``CociCheckpoint``.
        remote_upload_every: as for ``CociCheckpoint``.
        preemption: the preemption notices to act on (default ``"auto"``: SIGTERM with a
            30 s grace period, and the metadata of the cloud the machine runs in; None: none;
            see docs/preemption.md). On a notice every process learns of it at the next
            step's end, saves that step when the save fits the time left (none otherwise),
            and training stops (``control.should_training_stop``, no evaluation); once the
            save is durable ``trainer.train()`` raises :class:`~coci_core.Preempted` (a
            ``SystemExit``, exit status 143). The Trainer's JIT checkpoint is then off.
        save_on_train_end: also save the final state (unless a pruned trial's).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        policy: str | SavePolicy = "coci",
        objective: str = "time",
        mtbf_s: float | None = None,
        keep_last: int | None = _KEEP_LAST,
        compression: str | CompressionPolicy | None = "auto",
        compression_options: Mapping[str, Any] | None = None,
        every_n_steps: int | None = None,
        every_n_seconds: float | None = None,
        block: bool = True,
        planner_options: Mapping[str, Any] | None = None,
        verbose: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        remote: str | os.PathLike[str] | None = None,
        remote_keep_last: int | None = 10,
        remote_storage_options: Mapping[str, Any] | None = None,
        remote_upload_every: int | Literal["auto"] = "auto",
        preemption: str | Sequence[str | NoticeSource] | Preemption | None = "auto",
        save_on_train_end: bool = True,
    ) -> None:
        check_bool("save_on_train_end", save_on_train_end)
        # given (even as 3) or not: the Trainer's save_total_limit stands in for it if not
        self._keep_last_given = keep_last is not _KEEP_LAST
        keep_last = 3 if keep_last is _KEEP_LAST else keep_last
        self._arguments = shared_options(locals())
        # checked now for what does not depend on the Trainer, again when training starts
        early = dict(self._arguments)
        own = "every_n_steps" in (planner_options if isinstance(planner_options, Mapping) else {})
        if policy == "every_n_steps" and every_n_steps is None and not own:
            early["every_n_steps"] = 1  # the Trainer's save_steps, known when training starts
        if policy == "epoch" and (planner_options is None or isinstance(planner_options, Mapping)):
            # the steps per epoch come from the Trainer when training starts: a stand-in
            early["planner_options"] = {"steps_per_epoch": 1, **dict(planner_options or {})}
        self.options = CheckpointOptions.check(dirpath=dirpath, **early)
        self.save_on_train_end = save_on_train_end
        self._dirpath_given = dirpath is not None
        self._dirpath_arg: Path | str | None = (
            None if dirpath is None else str(dirpath) if is_url(dirpath) else Path(dirpath)
        )
        self.dirpath: Path | str | None = self._dirpath_arg
        self.trainer: Trainer | None = None
        self.checkpointer: Checkpointer | None = None
        self._restored: dict[str, Any] | None = None
        self._resume_dir: str | None = None
        self._state_json = _state.StateJson()  # the TrainerState's JSON at the last save
        self._reset_run()

    def _reset_run(self) -> None:
        self._last_step_end: float | None = None
        self._loss: float | None = None
        self._saved: int | None = None
        self._announced = False
        self._closed = False
        self._pruning = False
        self._stop: Preempted | None = None  # raised out of train() once it returns
        self._steps_per_epoch: int | None = None
        self._total_source = ""
        self._validations = ValidationHistory()
        self._es_wait = 0
        self._start_step = 0
        self._best_tried = False  # load_best_model_at_end's load done (or found nothing)
        self._done = False  # resumed at (or past) the run's last step: nothing to train

    # -- attaching to the Trainer ---------------------------------------------------------

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Find the Trainer being made and take its saving over."""
        trainer = calling_trainer(inspect.currentframe())
        if trainer is None:
            raise ConfigError(
                "CociCallback must be given to a transformers.Trainer: "
                "Trainer(..., callbacks=[CociCallback()])"
            )
        self.attach(trainer)

    def attach(self, trainer: Trainer) -> None:
        """Take ``trainer``'s saving and resuming over (``Trainer(callbacks=[...])`` does it;
        after ``trainer.add_callback(callback)``, call it yourself)."""
        if self.trainer is trainer:
            return
        if self.trainer is not None:
            raise ConfigError("a CociCallback serves one Trainer: make one per Trainer")
        t: Any = trainer
        if getattr(t, "_coci_callback", None) is not None:
            # the second would take the saves over from the first (each replaces the
            # Trainer's _save_checkpoint and sets should_save), and both save at the end
            raise ConfigError(
                "a Trainer takes one CociCallback, and this one has one already: give one "
                "(for a second copy of the checkpoints, its remote= tier)"
            )
        t._coci_callback = self
        self.trainer = trainer
        quiet_default_flow(trainer)  # its save schedule is coci's plan; the user's asks stand
        t.train = functools.partial(self._train, trainer.train)
        t._save_checkpoint = self._save_checkpoint
        t._load_from_checkpoint = _when_restoring(
            self, trainer._load_from_checkpoint, self._load_model
        )
        t._load_optimizer_and_scheduler = _when_restoring(
            self, trainer._load_optimizer_and_scheduler, self._load_optimizer
        )
        t._load_scaler = _when_restoring(self, trainer._load_scaler, self._load_scaler)
        t._load_rng_state = _when_restoring(self, trainer._load_rng_state, self._load_rng)
        t._load_best_model = self._load_best_model
        if callable(getattr(trainer, "_run_epoch", None)):
            t._run_epoch = functools.partial(self._run_epoch, trainer._run_epoch)
        t._report_to_hp_search = functools.partial(
            self._report_to_hp_search, trainer._report_to_hp_search
        )
        if trainer.args.process_index == 0:
            logger.info(_own_saves_off(trainer.args, self._arguments["policy"]))
            if trainer.args.fsdp and not getattr(trainer, "is_fsdp_enabled", False):
                logger.warning(
                    "coci: TrainingArguments(fsdp=...) is set, but the Trainer trains without "
                    "FSDP: Accelerate applies its FSDP plugin on GPUs only, and on CPU trains "
                    "with DDP, saying nothing. coci saves the whole model and optimizer state "
                    "(not shards), which a run with FSDP does not resume"
                )
            strategy = str(getattr(trainer.args.hub_strategy, "value", trainer.args.hub_strategy))
            if trainer.args.push_to_hub and strategy == "every_save":
                logger.warning(
                    "coci: push_to_hub with hub_strategy='every_save' pushes at the Trainer's "
                    "own saves, which CociCallback replaces: nothing is pushed during training; "
                    "the model is pushed when you call trainer.push_to_hub() or "
                    "trainer.save_model() (hub_strategy='end')"
                )

    # -- train(): the run's checkpointer and the resume -----------------------------------

    def _train(
        self,
        original: Callable[..., Any],
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        **kwargs: Any,
    ) -> Any:
        trainer = self._trainer()
        check_arguments(trainer.args)
        self._reset_run()
        resume: Any = resume_from_checkpoint
        coci_step: int | str | None = None
        coci_root = False  # resuming from a coci directory given by path
        if isinstance(resume, (str, os.PathLike)):
            found = step_dir_of(resume, self.options.storage_options)
            root = found[0] if found else (resume if coci_directory(resume) else None)
            if root is not None:
                coci_root = True
                if self._dirpath_given and not same_directory(root, self._dirpath_arg or ""):
                    raise ConfigError(
                        f"resume_from_checkpoint={str(resume)!r} is not in CociCallback's "
                        f"dirpath {str(self._dirpath_arg)!r}: resume from a step of that "
                        "directory, or leave dirpath out to continue in the one given"
                    )
                self.dirpath = root if isinstance(root, str) else Path(root)
                coci_step = found[1] if found else None
                resume = True
            else:
                _check_resume_path(resume)
        if not self._dirpath_given and not coci_root:
            self.dirpath = Path(trainer._get_output_dir(trial)) / "coci"
        checkpointer = self._open(trainer, trial)
        self.checkpointer = checkpointer
        self._restored, self._resume_dir = None, None
        try:
            if resume is True:
                resume = self._restore(trainer, checkpointer, coci_step)
            result = original(resume_from_checkpoint=resume, trial=trial, **kwargs)
            if self._stop is not None:  # the notice's save is durable (see on_train_end)
                raise self._stop
            checkpointer.raise_if_stopped_late()  # a SIGTERM after the last step boundary
            return result
        except BaseException as e:
            if not self._closed:
                if not self._pruning and not is_trial_pruned(e):
                    checkpointer.mark_failed()
                self._close()
            raise
        finally:
            if self._resume_dir is not None:
                shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._restored, self._resume_dir = None, None

    def _open(self, trainer: Trainer, trial: Any) -> Checkpointer:
        args = trainer.args
        arguments = dict(self._arguments)
        if args.save_total_limit is not None:
            if self._keep_last_given and arguments["keep_last"] != args.save_total_limit:
                raise ConfigError(
                    f"keep_last={arguments['keep_last']} and save_total_limit="
                    f"{args.save_total_limit} disagree: give one of them"
                )
            arguments["keep_last"] = args.save_total_limit
        own = "every_n_steps" in (arguments["planner_options"] or {})  # the user's stands
        if (
            arguments["policy"] == "every_n_steps"
            and arguments["every_n_steps"] is None
            and not own
        ):
            save_steps = args.save_steps
            if save_steps < 1:  # a fraction of the run, as the Trainer reads it
                total = planned_steps(trainer)[0]
                save_steps = math.ceil((total or 1) * save_steps)
            arguments["every_n_steps"] = int(save_steps)
        planner_options = dict(arguments["planner_options"] or {})
        total, per_epoch, source = planned_steps(trainer)
        self._steps_per_epoch = per_epoch
        if total is not None and "total_steps" not in planner_options:
            planner_options["total_steps"] = total
            self._total_source = source
        elif "total_steps" in planner_options:
            self._total_source = "given as planner_options['total_steps']"
        if arguments["policy"] == "epoch" and per_epoch is not None:
            planner_options.setdefault("steps_per_epoch", per_epoch)
        elif arguments["policy"] == "epoch" and "steps_per_epoch" not in planner_options:
            raise ConfigError(
                "policy 'epoch' needs the steps of an epoch, and this Trainer's training data "
                "has no length (an IterableDataset): give CociCallback(planner_options="
                "{'steps_per_epoch': N}), or another policy"
            )
        arguments["planner_options"] = planner_options
        assert self.dirpath is not None
        options = CheckpointOptions.check(dirpath=self.dirpath, **arguments)
        self.options = options
        is_main = args.process_index == 0
        sinks: list[TelemetrySink] = []
        if is_main:
            sinks.append(report_sink(self.dirpath, dict(options.storage_options)))
        world = args.world_size
        checkpointer = Checkpointer(
            self.dirpath,
            options,
            rank=args.process_index,
            world_size=world,
            broadcast=broadcast if world > 1 else None,
            min_over_ranks=min_over_ranks() if world > 1 and options.preemption else None,
            sinks=sinks,
            log=logger,
        )
        if trial is not None and trainer.hp_search_backend is not None:
            checkpointer.set_termination("optuna", trial_termination(trial))
        return checkpointer

    def _restore(
        self, trainer: Trainer, checkpointer: Checkpointer, step: int | str | None
    ) -> str | bool | None:
        """Restore coci's newest intact checkpoint (or ``step``); the directory to give the
        Trainer's own resume: a ``trainer_state.json`` written from it (what the Trainer
        reads of a checkpoint directory itself), or a Trainer ``checkpoint-N`` when coci has
        none, or None (start fresh)."""
        # a step whose state the Trainer cannot load (a forged, resealed manifest) is damaged:
        # passed over inside the restore, by every process together
        callbacks = None
        if trainer.args.restore_callback_states_from_checkpoint:
            callbacks = [*trainer.callback_handler.callbacks, trainer.control]
        index = trainer.args.process_index
        check = functools.partial(check_saved, callbacks=callbacks, process_index=index)
        try:
            state = checkpointer.restore(step, check=check)
        except NoCheckpointError:
            output_dir = str(trainer.args.output_dir)
            last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
            if trainer.args.world_size > 1:
                # each process looks in its output_dir (a node's own disk): all resume from
                # one Trainer checkpoint, or all start fresh, or all raise (before: process 0
                # resumed from its checkpoint-N while process 1 started fresh, and the
                # processes' collectives no longer matched)
                none = NoCheckpointError(f"no Trainer checkpoint in {output_dir}")
                name = os.path.basename(last) if last is not None else None
                ranks_read_alike(last, none, name=name, coci=False)
            if trainer.args.process_index == 0:
                where = checkpointer.manager.storage.url
                if last is not None:
                    logger.info(
                        "coci: no coci checkpoint in %s; resuming from the Trainer's %s",
                        where,
                        os.path.abspath(last),
                    )
                else:
                    logger.info("coci: no committed checkpoint in %s; starting fresh", where)
            return last
        total = planned_steps(trainer)[0]
        finished = total is not None and int(state["global_step"]) >= total
        if step is None and state.get("weights_only") and not finished:
            state = self._full_before(trainer, checkpointer, state, check)
        # a weights-only step at the run's end (a SIGTERM after the last step) resumes as the
        # Trainer's own would: nothing is left to train, so no optimizer state is needed
        _state.check_fits(state, trainer, finished=finished)
        if trainer.args.process_index == 0:
            logger.info(
                "coci: the Trainer restores step %d from %s",
                state["global_step"],
                checkpointer.restored_from(),
            )
        checkpointer.load_state_dict(state.get("coci", {}))
        self._restored = state
        self._saved = int(state["global_step"])
        self._resume_dir = tempfile.mkdtemp(prefix="coci-resume-")
        saved_state = _state.trainer_state(state)
        best = saved_state.best_global_step
        if best and self.dirpath is not None:
            saved_state.best_model_checkpoint = self._step_dir(best)
            if trainer.args.load_best_model_at_end:
                checkpointer.manager.keep_also({best})
        saved_state.save_to_json(os.path.join(self._resume_dir, "trainer_state.json"))
        saved_world = state.get("world_size")
        if state.get("weights_only"):  # the run's last step: no batch left to skip
            pass
        elif trainer.args.process_index == 0 and (
            _state.own(state) is None or saved_world != trainer.args.world_size
        ):
            # fewer processes than at the save: each has its random state, but the Trainer
            # still skips the trained batches by its own count, not the samples trained on
            logger.warning(
                "coci: step %d was saved by %s processes and this run has %d: the Trainer "
                "skips the trained batches by count (batches of this run's size, not the "
                "samples the saved run trained on), and the processes without a saved random "
                "state start from their current one: not bit-identical to a run never stopped",
                state["global_step"],
                saved_world,
                trainer.args.world_size,
            )
        elif trainer.args.process_index == 0 and (
            saved_dp := state.get("data_parallel_size", saved_world)
        ) != data_parallel_size(trainer):
            # as many processes on another mesh: they share batches otherwise
            logger.warning(
                "coci: step %d was saved with %s data-parallel processes (each taking its own "
                "batches) and this run has %d, on as many processes (another tensor-parallel "
                "size): the Trainer skips the trained batches by count (batches of this run's "
                "size, not the samples the saved run trained on): not bit-identical to a run "
                "never stopped",
                state["global_step"],
                saved_dp,
                data_parallel_size(trainer),
            )
        return self._resume_dir

    def _full_before(
        self,
        trainer: Trainer,
        checkpointer: Checkpointer,
        newest: dict[str, Any],
        check: Callable[[int, dict[str, Any]], None],
    ) -> dict[str, Any]:
        """``resume_from_checkpoint=True`` found a newest step saved with
        ``save_only_model=True`` (no resume from it): the newest older step of the directory
        saved in full (a run whose ``save_only_model`` changed between sessions), said in a
        WARNING; ``newest`` itself when there is none (refused by ``check_fits``)."""
        at = int(newest["global_step"])
        held = checkpointer.manager.steps(remote=True)  # a node that lost its disk: the remote's
        older = sorted((s for s in held if s < at), reverse=True)
        if trainer.args.world_size > 1:  # the ranks restore the same steps together
            older = broadcast(older)
        for candidate in older:
            try:
                state = checkpointer.restore(candidate, check=check)
            except (CorruptCheckpointError, NoCheckpointError):  # damaged, or removed since
                continue
            if state.get("weights_only"):
                continue
            if trainer.args.process_index == 0:
                logger.warning(
                    "coci: the newest step %d was saved with save_only_model=True (the weights "
                    "and TrainerState only: no resume from it); resuming from step %d, the "
                    "newest step saved in full: the steps since are trained again",
                    at,
                    candidate,
                )
            return state
        return newest

    def _load_model(self, trainer: Trainer, *args: Any) -> None:
        pass  # loaded with the optimizer, after accelerator.prepare (see _load_optimizer)

    def _load_optimizer(self, trainer: Trainer, *args: Any) -> None:
        state = self._restored
        assert state is not None
        t: Any = trainer
        _state.load_model(trainer, state)
        if state.get("weights_only"):  # the run's last step: nothing left to train
            return
        _state.load_optimizer(trainer, state)
        t.lr_scheduler.load_state_dict(state["scheduler"])

    def _load_scaler(self, trainer: Trainer, *args: Any) -> None:
        state = self._restored
        assert state is not None
        scaler = trainer.accelerator.scaler
        if scaler is not None and state.get("scaler") is not None:
            scaler.load_state_dict(state["scaler"])

    def _load_rng(self, trainer: Trainer, *args: Any) -> None:
        state = self._restored
        assert state is not None
        mine = _state.own(state)
        if mine is not None:
            _state.set_rng_state(mine["rng"])

    # -- the Trainer's events ---------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer, checkpointer = self._trainer(), self._checkpointer()
        optimizer: Any = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        if not getattr(optimizer, "_coci_hooked", False):
            # the snapshot may overlap the next forward/backward: wait for it before an update
            optimizer.register_step_pre_hook(lambda *_: self._before_update())
            optimizer._coci_hooked = True
        if args.process_index == 0 and isinstance(self.dirpath, Path):
            with contextlib.suppress(ConfigError):  # tensorboard is not installed
                checkpointer.sinks.append(tensorboard_sink(trainer, self.dirpath))
        jit_checkpoint_off(trainer, self.options.preemption)  # before coci's handler
        checkpointer.watch_preemption()
        # workers started after this hook (the epoch's iterator, each evaluation's loader)
        checkpointer.shield_loader_workers(kwargs.get("train_dataloader"))
        shield_eval_loaders(trainer, checkpointer.shield_loader_workers)
        self._start_step = state.global_step
        # A run resumed at its last step (requeued after its final save, as a late SIGTERM's
        # exit 143 asks) trains no step past max_steps: the Trainer's epoch loop would train
        # one before it checks should_training_stop (see _run_epoch).
        self._done = state.max_steps > 0 and state.global_step >= state.max_steps
        if self._done:
            control.should_training_stop = True
            if args.process_index == 0:
                logger.info(
                    "coci: the restored step %d is the run's last (max steps %d): nothing "
                    "left to train",
                    state.global_step,
                    state.max_steps,
                )
        stopper = early_stopping(trainer)
        self._es_wait = stopper.early_stopping_patience_counter if stopper is not None else 0

    def _run_epoch(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``_run_epoch``, unless the run was resumed at its last step: the
        Trainer checks ``should_training_stop`` only after a step, so it would train one more
        (and coci commit it)."""
        if self._done:
            self._trainer().control.should_training_stop = True
            return None
        return original(*args, **kwargs)

    def _before_update(self) -> None:
        if self.checkpointer is not None and not self._closed:
            self.checkpointer.before_update()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs and isinstance(logs.get("loss"), (int, float)):
            self._loss = float(logs["loss"])

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        checkpointer = self._checkpointer()
        count = state.global_step
        now = time.perf_counter()
        step_time = None if self._last_step_end is None else now - self._last_step_end
        loss, self._loss = self._loss, None  # logged at an earlier step (on_log follows)
        checkpointer.observe(count, loss=loss, step_time_s=step_time)
        if not self._announced:
            self._announced = True
            if args.process_index == 0:
                checkpointer.warn_if_not_empty("trainer.train(resume_from_checkpoint=True)")
                self._announce_plan()
        # a save asked by a callback before this one (the Trainer's DefaultFlowCallback asks
        # none: quiet_default_flow) stands, as with the Trainer's own saves
        asked = bool(control.should_save)
        save = checkpointer.should_save(count)
        if checkpointer.preempted is not None:  # the notice's step: saved if it fits, stop
            control.should_training_stop = True
            control.should_evaluate = False
            asked = False
            if args.save_only_model and args.process_index == 0:
                _warn_weights_only_requeue(f"the preemption notice's save (step {count})")
        elif self.save_on_train_end and state.max_steps > 0 and count >= state.max_steps:
            save = True
        control.should_save = (save or asked) and count != self._saved
        if not control.should_save and not checkpointer.warmed and not self._preempted():
            trainer = self._trainer()
            weights_only = bool(args.save_only_model)
            checkpointer.warm_up(
                {**_state.collect(trainer, weights_only=weights_only, warm_up=True), "coci": {}},
                per_rank=None if weights_only else {_state.PROCESS_KEY: _state.collect_own()},
            )
        self._last_step_end = time.perf_counter()

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """With ``load_best_model_at_end``, an evaluation that improves
        ``metric_for_best_model`` is saved, as the Trainer's saves at its evaluations are (its
        save follows this event), whatever the plan: the best model loaded at the end is then
        the Trainer's best, not only the best of the steps the plan happened to save. The
        planner plans with the stop hazard of an ``EarlyStoppingCallback``, judged as it
        judges ``metric_for_best_model`` (before the Trainer updates ``best_metric``)."""
        stopper = early_stopping(self._trainer())
        value = metric(args, metrics)
        if (
            args.load_best_model_at_end
            and value is not None
            and self.checkpointer is not None
            and not self._closed
            and state.global_step != self._saved
            and self._improves(args, state.best_metric, value)
        ):
            control.should_save = True
        if stopper is None or value is None or self.checkpointer is None:
            return
        best = state.best_metric
        threshold = stopper.early_stopping_threshold or 0.0
        improved = best is None or (
            (value > best if args.greater_is_better else value < best)
            and abs(value - best) > threshold
        )
        self._es_wait = 0 if improved else self._es_wait + 1
        if not self._validations.add(state.global_step, improved=improved, value=value):
            return
        model = self._validations.termination(
            rule=f"EarlyStoppingCallback(metric_for_best_model={args.metric_for_best_model!r}",
            start=self._start_step,
            total=state.max_steps if state.max_steps > 0 else None,
            patience=stopper.early_stopping_patience,
            wait_count=self._es_wait,
            min_delta=threshold,
            mode="max" if args.greater_is_better else "min",
        )
        self.checkpointer.set_termination("early_stopping", model)

    @staticmethod
    def _improves(args: TrainingArguments, best: float | None, value: float) -> bool:
        """Whether ``value`` is a new best, as the Trainer's ``_determine_best_metric``
        judges it."""
        if best is None:
            return True
        return value > best if args.greater_is_better else value < best

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # the plan decided at the step's end (policy "epoch" too); a save asked by a callback
        # before this one stands (the Trainer's DefaultFlowCallback asks none)
        if self._preempted() or state.global_step == self._saved:
            control.should_save = False
        if self._preempted():
            control.should_evaluate = False

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._closed:
            return
        checkpointer = self._checkpointer()
        if checkpointer.preempted is not None:  # wait for the notice's save, then stop
            self._closed = True
            self._stop = checkpointer.end_preempted()
            if args.process_index == 0:
                checkpointer.log_summary(logger)
            return
        if not self._pruning:
            if args.load_best_model_at_end and not self._best_tried:
                # the Trainer loads the best model only when best_model_checkpoint is set (a
                # saved step was its best); coci's kept steps may still hold an evaluated one
                self._load_best_model()
            else:
                self._final_save()
        self._close()

    # -- saving -----------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any = None, trial: Any = None) -> SaveHandle | None:
        """The Trainer's ``_save_checkpoint``, through coci (every process, same step)."""
        trainer, checkpointer = self._trainer(), self._checkpointer()
        if self._closed:
            return None
        step = trainer.state.global_step
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()
        best = trainer.state.best_global_step
        if best and (best == step or best in set(checkpointer.manager.steps())):
            trainer.state.best_model_checkpoint = self._step_dir(best)
            if trainer.args.load_best_model_at_end:  # kept besides keep_last, as the Trainer's
                checkpointer.manager.keep_also({best})
        weights_only = bool(trainer.args.save_only_model)
        state = _state.collect(trainer, weights_only=weights_only, cache=self._state_json)
        state["coci"] = checkpointer.state_dict()
        per_rank = None if weights_only else {_state.PROCESS_KEY: _state.collect_own()}
        handle = checkpointer.save(step, state, per_rank=per_rank)
        self._saved = step
        # the Trainer's JIT checkpoint made checkpoint-<step> with only its "incomplete" mark
        # for this save: left empty, get_last_checkpoint would pick it
        jit_dir = Path(trainer._get_output_dir(trial)) / f"checkpoint-{step}"
        with contextlib.suppress(OSError):  # none there: nothing to do
            if [p.name for p in jit_dir.iterdir()] == [_JIT_MARK]:
                shutil.rmtree(jit_dir, ignore_errors=True)
        return handle

    def _final_save(self) -> None:
        trainer = self._trainer()
        step = trainer.state.global_step
        if self.save_on_train_end and step > 0 and step != self._saved:
            self._save_checkpoint()

    def _close(self) -> None:
        self._closed = True
        checkpointer = self._checkpointer()
        try:
            checkpointer.close(stop_late=False)  # raised once train() returns (see _train)
        finally:
            if self._trainer().args.process_index == 0:
                checkpointer.log_summary(logger)

    def _step_dir(self, step: int, run: str | None = None) -> str:
        """The directory of ``run``'s checkpoint of ``step`` (without ``run``: its plain name)."""
        assert self.dirpath is not None
        return str(run_step_dir(self.dirpath, step, run, self.options.storage_options))

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the final state is saved first, then the weights of the
        best step (``metric_for_best_model``) are read from coci."""
        trainer, checkpointer = self._trainer(), self._checkpointer()
        self._best_tried = True
        if checkpointer.preempted is not None:
            return  # the process ends on the notice: no final save, no weights to load
        self._final_save()
        checkpointer.wait(retention=True)  # the steps listed next stay while they are read
        if trainer.args.world_size > 1:  # retention is process 0's: all list after it
            trainer.accelerator.wait_for_everyone()
        run = checkpointer.manager.run_id  # this run's steps: not another's of the same number
        kept = checkpointer.manager.runs().get(run, [])
        keep_last = checkpointer.manager.keep_last
        if keep_last is not None:  # those retention keeps (a kill before it ran leaves more)
            also = checkpointer.manager.kept_also  # the best step, kept besides them
            kept = [s for i, s in enumerate(kept) if i >= len(kept) - keep_last or s in also]
        best = best_to_load(trainer, kept)  # said either way
        # a best step that retention removed since is named no more: the one loaded is
        path = None if best is None else self._step_dir(best[0], run)
        trainer.state.best_model_checkpoint = path
        if path is not None:  # read, not restored: no restart for the planner and the report
            loaded, _ = read_checkpoint(
                checkpointer.manager.storage,
                os.path.basename(path.rstrip("/")),
                rank=trainer.args.process_index,
            )
            _state.load_model(trainer, loaded.state)

    # -- stopping: Optuna's pruning ----------------------------------------------------------

    def _report_to_hp_search(
        self, original: Callable[..., Any], trial: Any, step: int, metrics: dict[str, float]
    ) -> None:
        # The Trainer calls on_train_end before it raises TrialPruned: no final save then.
        record_step(trial, step)
        self._pruning = True
        try:
            original(trial, step, metrics)
        finally:
            self._pruning = False
        if self.checkpointer is not None and not self._closed:
            # re-estimated from the study as it is now, and from how this trial ranks
            self.checkpointer.set_termination("optuna", trial_termination(trial))

    # -- internals ----------------------------------------------------------------------------

    def _trainer(self) -> Trainer:
        if self.trainer is None:
            raise ConfigError(
                "CociCallback is not attached to a Trainer: pass it as "
                "Trainer(..., callbacks=[CociCallback()]), or call callback.attach(trainer)"
            )
        return self.trainer

    def _checkpointer(self) -> Checkpointer:
        if self.checkpointer is None:
            raise ConfigError("CociCallback: training has not started (call trainer.train())")
        return self.checkpointer

    def _preempted(self) -> bool:
        return self.checkpointer is not None and self.checkpointer.preempted is not None

    def _announce_plan(self) -> None:
        """One log line at the first step: what coci plans and how to change it."""
        outline = self._checkpointer().plan_outline()
        line, warn = outline.line(
            outline.report.step,
            adapter="CociCallback",
            objective=self.options.objective,
            total_source=self._total_source,
            final_save=self.save_on_train_end,
        )
        (logger.warning if warn else logger.info)(line)


def _warn_weights_only_requeue(save: str) -> None:
    """A run saving with ``save_only_model=True`` stops on a notice, exiting 143 ("requeue
    me"): the requeued run cannot resume from that save."""
    logger.warning(
        "coci: save_only_model=True: %s holds the model's weights and the TrainerState only "
        "(no optimizer, scheduler or random states), so the requeued run cannot resume from "
        "it: train(resume_from_checkpoint=True) resumes from the newest step saved without "
        "save_only_model if one is kept (training again the steps since), else raises "
        "CheckpointError and the run starts over only with resume_from_checkpoint=None. For "
        "a run that is requeued after a notice to go on, train with save_only_model=False",
        save,
    )


def _own_saves_off(args: TrainingArguments, policy: object) -> str:
    """The line that says the Trainer's own saves are off: with the arguments of those saves
    (``save_steps`` only for ``save_strategy="steps"``) and, for ``"epoch"`` or ``"steps"``
    under coci's own plan, the policy that saves where the Trainer would have: advice, so that
    the line does not read as if coci saved there."""
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    own = f"save_strategy={strategy!r}"
    if strategy == "steps":
        own += f", save_steps={args.save_steps}"
    line = (
        f"coci: the Trainer's own checkpoint saves are off while CociCallback is attached "
        f"({own}); coci saves when its plan says so"
    )
    if strategy == "epoch" and policy != "epoch":
        line += (
            "; for a save at each epoch's end, as the Trainer's, pass CociCallback(policy='epoch')"
        )
    elif strategy == "steps" and policy == "coci":
        line += (
            "; for a save every save_steps, as the Trainer's, pass "
            "CociCallback(policy='every_n_steps') (it takes save_steps)"
        )
    return line


def _when_restoring(
    callback: CociCallback, original: Callable[..., Any], replacement: Callable[..., None]
) -> Callable[..., Any]:
    """``original`` (a Trainer loader of checkpoint files), or ``replacement`` when it is asked
    for the directory of coci's resume."""

    def load(checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if callback._resume_dir is not None and checkpoint == callback._resume_dir:
            return replacement(callback._trainer(), *args)
        return original(checkpoint, *args, **kwargs)

    return load


def _check_resume_path(resume: str | os.PathLike[str]) -> None:
    """A ``resume_from_checkpoint`` path that is neither coci's nor an existing directory (a
    typo) is refused by name, before anything is opened; the Trainer's own error ("Can't find
    a valid checkpoint at ...") named no argument, and came after coci had made
    ``<output_dir>/coci`` and marked the run failed."""
    if is_url(resume):
        return  # read where it is
    if os.path.isdir(resume):
        inside = os.path.join(resume, "coci")
        if not os.path.isfile(os.path.join(resume, "trainer_state.json")) and (
            coci_directory(inside) or get_last_checkpoint(os.fspath(resume)) is not None
        ):  # a run's output_dir (the Trainer: "Can't find a valid checkpoint at ...")
            raise ConfigError(
                f"resume_from_checkpoint={str(resume)!r} is a run's output directory, not a "
                f"checkpoint: give True (its newest: coci's in {inside!r}, else the Trainer's "
                "newest checkpoint-N), that coci directory, or one of its checkpoint-N"
            )
        return  # a Trainer checkpoint-N, read by the Trainer
    if os.path.exists(resume):  # a file: a checkpoint's weights, a step's manifest
        raise ConfigError(
            f"resume_from_checkpoint={str(resume)!r} is a file, not a checkpoint: give the "
            "directory of a checkpoint (a coci step directory or a Trainer checkpoint-N), a "
            "coci directory (its newest intact step) or True"
        )
    parent = os.path.dirname(os.path.abspath(resume))
    if coci_directory(parent):
        raise ConfigError(
            f"resume_from_checkpoint={str(resume)!r} is not a committed checkpoint of the coci "
            f"directory {parent!r}: give one of its step directories, the directory itself "
            "(its newest intact step) or True"
        )
    raise ConfigError(
        f"resume_from_checkpoint={str(resume)!r} does not exist: give True (coci's newest "
        "checkpoint, else the Trainer's newest checkpoint-N, else a fresh start), a coci "
        "directory or one of its step directories, or a Trainer checkpoint-N directory"
    )
