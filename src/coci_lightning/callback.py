"""CociCheckpoint: convergence-aware, asynchronous checkpoints for a Lightning Trainer.

Why one module: it is one callback's hooks, and the documentation of each of its arguments
(LightningCLI's help). What every adapter shares is in :mod:`coci_core.training`;
what the callback reads from the Trainer, its EarlyStopping hazard, its CheckpointIO and the
``"last"``/``"best"`` resolution are in the private modules beside it.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint, EarlyStopping
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from coci_core import CompressionPolicy, Preempted, SaveHandle
from coci_core.errors import CociError, ConfigError
from coci_core.planner import SavePolicy, Termination
from coci_core.preemption import NoticeSource, Preemption
from coci_core.storage import is_url
from coci_core.telemetry import RestoreEvent
from coci_core.training import (
    Checkpointer,
    CheckpointOptions,
    PlanOutline,
    ValidationHistory,
    check_bool,
    check_dirpath,
    check_optimizer_fits,
    is_trial_pruned,
    newest_step_dir,
    shared_options,
    step_dir_of,
)
from coci_lightning._best import SCORES_KEY, MonitorScores, monitored
from coci_lightning._epoch_end import (
    after_a_finished_epoch,
    as_after_the_batch,
    epoch_end_metrics,
    hold_for_last_validation,
    release_last_validation,
    run_ends_with_this_epoch,
    settle_resumed_validation,
    start_next_epoch,
    validation_follows,
)
from coci_lightning._habits import model_checkpoint_arguments
from coci_lightning._hparams import check_hyperparameters
from coci_lightning._io import agree_on_resume, tier_options, use_coci_io
from coci_lightning._preemption import (
    Handlers,
    forget_coci_handlers,
    give_loaders_back,
    give_sigterm_back,
    rank_minimum,
    shield_loader_workers,
    signal_handlers,
    take_sigterm_over,
)
from coci_lightning._rng import (
    RANK_STATE_KEY,
    RANK_STATES_KEY,
    collect_plain_rng_states,
    rng_for_rank,
    set_plain_rng_states,
)
from coci_lightning._sharded import check_sharded, is_sharded, sharded_state
from coci_lightning._stopping import early_stopping_hazard, early_stopping_of, stopped_early
from coci_lightning._telemetry import LoggerRelay, make_sinks
from coci_lightning._trainer import (
    check_monitor,
    loss_of,
    plan_horizon,
    warn_unless_stateful_loaders,
)

if TYPE_CHECKING:
    from coci_core.training import LoadedCheckpoint

__all__ = ["CociCheckpoint"]


logger = logging.getLogger(__name__)

# in the callback's state of a save at an epoch's last step: the metrics its epoch end sees
EPOCH_END_KEY = "epoch_end_metrics"


class CociCheckpoint(Checkpoint):
    """Checkpoints a Lightning run when coci's planner says so; resumes it exactly.

    Args:
        dirpath: where checkpoints go (a str path, an os.PathLike, or an fsspec URL string
            such as ``"s3://bucket/run"``, kept a string); default ``<default_root_dir>/coci``.
        policy: ``"coci"`` or a baseline of the planner (e.g. ``"every_n_steps"``), or a
            policy object of :mod:`coci_core.planner` (e.g. ``EveryNSteps(every_n_steps=500)``).
        objective: ``"time"`` (default: a lost step costs its wall time), ``"convergence"``
            (lost work weighted by its progress) or ``"progress"``; see docs/planner.md.
        mtbf_s: mean time between failures of one node, in seconds (None: estimated).
        keep_last: committed checkpoints to keep.
        compression: ``"auto"`` (default: compress only where it shortens the time to
            durable without slowing a restore; raw on a fast local disk), ``"none"``,
            ``"lossless"`` or ``"lossy"`` (opt-in, bounded error); see docs/compression.md.
        compression_options: the knobs of ``coci_core.engine.save.compress.CompressionPolicy``
            (``full_every``, ``lossy_bits``, ``max_lossy_generations``, ...).
        resume: continue from the newest committed checkpoint when ``fit`` gets no ckpt_path.
        every_n_steps: the interval of that policy (a cap on the interval for ``coci``).
        every_n_seconds: the interval of that policy (a cap on the interval for ``coci``).
        every_n_epochs: also save after every N-th training epoch (as
            ``ModelCheckpoint(every_n_epochs=N)``), at the epoch's last step.
            ``policy="epoch"`` saves only there (every epoch by default), with the steps per
            epoch taken from the Trainer.
        monitor: a logged metric to use as the loss (default: the training step's loss).
            Each save records its value, and ``ckpt_path="best"`` is the kept checkpoint with
            the lowest one (:attr:`best_model_path`). Without it, "best" is the newest kept
            checkpoint, as for ``ModelCheckpoint()`` without a monitor.
        mode: ``"min"`` (default) or ``"max"``, as ``ModelCheckpoint``'s: with ``"max"`` the
            best checkpoint is the one with the highest value of ``monitor`` (an accuracy),
            and the planner plans with the training step's loss instead of it.
        block: copy the state before the save returns (default), so that what the checkpoint
            holds is the state of the step whatever changes the tensors next (an EMA or
            weight clipping through ``.data``, numpy). False overlaps the copy with the next
            step: the save then sees only in-place torch ops and optimizer steps, not writes
            through ``.data`` or numpy (see ``CheckpointManager.save``).
        save_on_train_end: also save when training ends.
        save_on_exception: also save on an exception (or SIGTERM) that stops training.
        planner_options: further keyword arguments of :class:`coci_core.planner.Planner`.
        verbose: rank 0 logs a line per save (step, stall, MB written, compression, when
            durable). One summary line is logged at the end of ``fit`` either way.
        storage_options: for an fsspec URL ``dirpath``: the file system's options (s3fs:
            ``key``, ``secret``, ``client_kwargs={"endpoint_url": ...}``), used to save, to
            find ``"last"`` and to restore. Never logged. None: the environment's (AWS_* ...).
        remote: a second tier (e.g. ``"s3://bucket/run"``): each checkpoint committed in
            ``dirpath`` is copied there in the background; a resume takes the newest intact
            checkpoint from ``dirpath``, else from ``remote`` (a new node resumes from it).
        remote_keep_last: checkpoints kept on the remote tier.
        remote_storage_options: the fsspec options of ``remote``, never logged.
        remote_upload_every: copy every this many checkpoints to ``remote`` (and the newest
            at the end), or ``"auto"`` (default): the planner's two-level period for the
            measured upload cost and ``planner_options={"node_loss_share": ...}`` (every
            checkpoint until an upload is measured, and while uploads cost the loop little).
        preemption: the preemption notices to act on (default ``"auto"``: SIGTERM with a
            30 s grace period, and the metadata of the cloud the machine runs in; None: none,
            Lightning's own SIGTERM handling stays; see docs/preemption.md). On a notice every
            rank learns of it at the next training step's end, saves that step when the save
            fits the time left (none otherwise: the previous checkpoint stays the newest),
            sets ``trainer.should_stop`` and, once the save is durable, raises
            :class:`~coci_core.Preempted` out of ``trainer.fit`` (a ``SystemExit``, exit
            status 143, which schedulers restart on). While coci watches SIGTERM, Lightning
            does not act on it (no ``SIGTERMException``, no save on it).
        early_stopping_hazard: when the Trainer has an ``EarlyStopping`` callback, plan with
            the probability that it stops the run at each coming validation (see
            :mod:`coci_core.hpo.early_stopping`); ``explain()`` shows it.
        save_when_stopped: also take the final save (``save_on_train_end``,
            ``save_on_exception``) when the run is stopped early: by ``EarlyStopping``, or
            pruned by Optuna (``optuna.TrialPruned``, or optuna-integration's pruning callback
            stopping the Trainer). By default a stopped run is done and takes none (a run
            stopped by ``max_time`` still takes its final save).
        every_n_train_steps: ``ModelCheckpoint``'s name: ``every_n_train_steps=N`` is
            ``policy="every_n_steps", every_n_steps=N`` (a save every N steps).
        save_weights_only: ``ModelCheckpoint``'s; only False: coci's checkpoints hold the
            whole training state, for an exact resume (``True`` is a ConfigError that says
            how to get the weights alone: ``coci export DIR OUT --weights-only``).
        filename: ``ModelCheckpoint``'s; only None: coci names its checkpoints by step (a
            name is a ConfigError that says why).
        save_top_k: ``ModelCheckpoint``'s; coci keeps the ``keep_last`` newest checkpoints:
            a ConfigError that says so (for the best k, a ``ModelCheckpoint`` beside it).
        save_last: ``ModelCheckpoint``'s; coci always keeps the newest: ``True`` is what
            coci does, ``False`` a ConfigError that says so.
        train_time_interval: ``ModelCheckpoint``'s name: a ``timedelta`` is
            ``policy="every_n_seconds", every_n_seconds=`` its seconds.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        policy: str | SavePolicy = "coci",
        objective: str = "time",
        mtbf_s: float | None = None,
        keep_last: int | None = 3,
        compression: str | CompressionPolicy | None = "auto",
        compression_options: Mapping[str, Any] | None = None,
        resume: bool = False,
        every_n_steps: int | None = None,
        every_n_seconds: float | None = None,
        every_n_epochs: int | None = None,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        block: bool = True,
        save_on_train_end: bool = True,
        save_on_exception: bool = True,
        planner_options: Mapping[str, Any] | None = None,
        verbose: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        remote: str | os.PathLike[str] | None = None,
        remote_keep_last: int | None = 10,
        remote_storage_options: Mapping[str, Any] | None = None,
        remote_upload_every: int | Literal["auto"] = "auto",
        preemption: str | Sequence[str | NoticeSource] | Preemption | None = "auto",
        early_stopping_hazard: bool = True,
        save_when_stopped: bool = False,
        every_n_train_steps: int | None = None,
        save_weights_only: bool = False,
        filename: str | None = None,
        save_top_k: int | None = None,
        save_last: bool | None = None,
        train_time_interval: datetime.timedelta | None = None,
    ) -> None:
        super().__init__()
        dirpath = check_dirpath(dirpath)
        if dirpath is not None and not is_url(dirpath):
            # as ModelCheckpoint: a relative path is the one from where the callback is made,
            # whatever directory the process is in at fit (or test) time
            local = os.path.abspath(os.path.expanduser(os.fspath(dirpath)))
            dirpath = local if isinstance(dirpath, str) else Path(local)
        for name, flag in (
            ("resume", resume),
            ("save_on_train_end", save_on_train_end),
            ("save_on_exception", save_on_exception),
            ("early_stopping_hazard", early_stopping_hazard),
            ("save_when_stopped", save_when_stopped),
        ):
            check_bool(name, flag)
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ConfigError(
                f"'monitor' must be the name of a logged metric (a non-empty str) or None: "
                f"{monitor!r}"
            )
        if every_n_epochs is not None and (type(every_n_epochs) is not int or every_n_epochs < 1):
            raise ConfigError(
                f"'every_n_epochs' must be an integer >= 1 or None: {every_n_epochs!r}"
            )
        policy, every_n_steps, every_n_seconds = model_checkpoint_arguments(
            policy=policy,
            every_n_steps=every_n_steps,
            every_n_seconds=every_n_seconds,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            mode=mode,
            save_weights_only=save_weights_only,
            filename=filename,
            save_top_k=save_top_k,
            save_last=save_last,
        )
        self.every_n_epochs = every_n_epochs
        if policy == "epoch":
            self.every_n_epochs = every_n_epochs or 1
            if planner_options is None or isinstance(planner_options, Mapping):
                # the steps per epoch come from the Trainer in on_train_start: a stand-in
                planner_options = {"steps_per_epoch": 1, **dict(planner_options or {})}
        # The options both adapters share, each checked once, here (see CheckpointOptions).
        self.options = CheckpointOptions.check(dirpath=dirpath, **shared_options(locals()))
        self.dirpath = dirpath
        self.resume = resume
        self.monitor = monitor
        self.mode = mode
        self._monitor_warned = False
        self._scores = MonitorScores(maximize=mode == "max")  # for ckpt_path="best"
        self._directory: Path | str | None = None  # resolve_dirpath at the last setup
        self._best_path_given = ""  # best_model_path as set from outside (ddp_spawn)
        self._newest_saved = ""  # the step directory of this callback's newest committed save
        self._run: str | None = None  # the run of its saves (for a step two runs hold)
        self.save_on_train_end = save_on_train_end
        self.save_on_exception = save_on_exception
        self.early_stopping_hazard = early_stopping_hazard
        self.save_when_stopped = save_when_stopped
        # termination models by source ("early_stopping", "optuna"): kept for the next fit
        self._terminations: dict[str, Termination] = {}
        self._validations = ValidationHistory()  # EarlyStopping's checks in this fit
        self.checkpointer: Checkpointer | None = None
        self._planner_state: dict[str, Any] | None = None
        self._pending_rng: dict[str, Any] | None = None
        # the restored checkpoint's optimizer states, checked against the fit's optimizers
        # once both exist (on_fit_start, or on_load_checkpoint after the strategy's setup)
        self._saved_optimizers: list[Any] | None = None
        self._last_end: float | None = None
        self._last_saved_step: int | None = None
        self._fallback_for: str | None = None
        # the ckpt_path Lightning resolved for the coming run, once (see _resume.py)
        self.resolved_ckpt_path: tuple[Any] | None = None
        self._rng_in_state = True
        self._deferred = False  # save at the next step (a planned save that could not be taken)
        # the step of an epoch's last batch whose save waits for the validation after it
        self._at_validation_end: int | None = None
        self._epoch_end_metrics: dict[str, torch.Tensor] | None = None  # saved with the state
        # from a checkpoint of an epoch's last step: its random states and logged metrics go
        # back in on_train_start, before the epoch's end runs
        self._rng_at_train_start = False
        # from the final save of a max_steps run that ended with an epoch: see _epoch_end.py
        self._next_epoch_at_train_start = False
        self._pending_metrics: dict[str, Any] | None = None
        self._start_step: int | None = None  # global_step at on_train_start (None: not started)
        self._plan_told = False
        self._relay = LoggerRelay()
        # the signal handlers before and after coci's watch started (this fit's)
        self._handlers: tuple[Handlers, Handlers] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The live Checkpointer (an open directory lease, a writer thread) belongs to this
        # process's run: a copy (copy.deepcopy, pickle for strategy="ddp_spawn") gets none and
        # opens its own in ``setup``. Its planner estimates travel as ``_planner_state``.
        state = self.__dict__.copy()
        if self.checkpointer is not None:
            state["_planner_state"] = self.checkpointer.state_dict()
        state["checkpointer"] = None
        state["_handlers"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    policy = property(lambda self: self.options.policy, doc="The save policy as given.")
    objective = property(lambda self: self.options.objective, doc="The planner's objective.")
    mtbf_s = property(lambda self: self.options.mtbf_s, doc="The MTBF given, or None.")
    keep_last = property(lambda self: self.options.keep_last, doc="Checkpoints kept.")
    block = property(lambda self: self.options.block, doc="Whether snapshots block.")
    verbose = property(lambda self: self.options.verbose, doc="A log line per save.")
    compression = property(lambda self: self.options.compression, doc="The CompressionPolicy.")
    planner_options = property(
        lambda self: dict(self.options.planner_options), doc="The Planner's further arguments."
    )
    storage_options = property(
        lambda self: dict(self.options.storage_options), doc="The fsspec options (secret)."
    )

    @property
    @override
    def state_key(self) -> str:
        return "CociCheckpoint"

    def resolve_dirpath(self, trainer: pl.Trainer) -> Path | str:
        """The checkpoint directory: ``dirpath`` (an fsspec URL stays a string) or
        ``<default_root_dir>/coci``."""
        if is_url(self.dirpath):
            return self.dirpath
        if self.dirpath is not None:
            return Path(self.dirpath)
        return Path(trainer.default_root_dir) / "coci"

    @property
    def best_model_path(self) -> str:
        """The step directory of the kept checkpoint with the best value of ``monitor`` (the
        lowest; the highest for ``mode="max"``), or without a monitor the newest kept
        checkpoint (as ``ModelCheckpoint()`` without one): what ``ckpt_path="best"`` loads;
        or ``""`` (as ``ModelCheckpoint.best_model_path``)."""
        if self.monitor is None:
            return self._newest_kept() or self._best_path_given
        best = self._best()
        return self._best_path_given if best is None else best[0]

    @best_model_path.setter
    def best_model_path(self, path: str) -> None:
        # Lightning's ddp_spawn hands the worker's best_model_path back to the main process
        self._best_path_given = str(path)

    @property
    def best_model_score(self) -> float | None:
        """The value of ``monitor`` at :attr:`best_model_path`'s save, or None."""
        best = self._best()
        return None if best is None else best[1]

    def _best(self) -> tuple[str, float] | None:
        if self.monitor is None or self._directory is None:
            return None
        return self._scores.best(self._directory, self.storage_options_for, self._run)

    def _newest_kept(self) -> str:
        """This callback's newest committed save while it is kept; else the checkpoint a
        resume takes (the newest commit of the directory, as after a resume that saved
        nothing); ``""`` when there is none."""
        if self._directory is None:
            return ""
        if self._newest_saved:
            path = f"{str(self._directory).rstrip('/')}/{self._newest_saved}"
            if step_dir_of(path, self.storage_options_for(path)) is not None:
                return path
        o = self.options
        try:
            newest = newest_step_dir(
                self._directory,
                o.storage_options,
                remote=o.remote,
                remote_storage_options=o.remote_storage_options,
            )
        except Exception:  # an unreadable directory has no best model to offer
            return ""
        return "" if newest is None else str(newest)

    def storage_options_for(self, path: object) -> dict[str, Any]:
        """The fsspec options of the tier that ``path`` is in (``remote`` or ``dirpath``)."""
        o = self.options
        return tier_options(path, o.storage_options, o.remote, o.remote_storage_options)

    def newest_step_dir(self, trainer: pl.Trainer) -> Path | str | None:
        """The step directory a resume tries first (the newest checkpoint of the newest run,
        by commit sequence, in ``dirpath`` or the ``remote`` tier); or None."""
        o = self.options
        return newest_step_dir(
            self.resolve_dirpath(trainer),
            o.storage_options,
            remote=o.remote,
            remote_storage_options=o.remote_storage_options,
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Every entry point (fit, validate, test, predict) reads coci step directories.
        check_sharded(trainer.strategy)
        self._saved_optimizers = None  # not another entry point's checkpoint (validate's)
        o = self.options
        self._directory = self.resolve_dirpath(trainer)
        use_coci_io(trainer).configure(
            pl_module,
            rank=trainer.global_rank,
            directory=str(self.resolve_dirpath(trainer)),
            storage_options=o.storage_options,
            remote=o.remote,
            remote_storage_options=o.remote_storage_options,
            on_restore=lambda loaded, event: self._on_restore(trainer, loaded, event),
            fallback_for=self._fallback_for,
        )
        resolved, self.resolved_ckpt_path = self.resolved_ckpt_path, None
        if resolved is not None:  # every rank reads a coci checkpoint, or none does
            path = resolved[0]
            path_options = {} if path is None else self.storage_options_for(path)
            agree_on_resume(path, str(self._directory), path_options)
        if stage != "fit":
            return
        check_hyperparameters(trainer)  # refused now, not at the first save after training
        options = self.options
        if "total_steps" not in self.planner_options and trainer.max_steps > 0:
            planner = options.planner.with_total_steps(trainer.max_steps)
            options = dataclasses.replace(options, planner=planner)
        self.checkpointer = Checkpointer(
            self.resolve_dirpath(trainer),
            options,
            rank=trainer.global_rank,
            sinks=make_sinks(trainer, self.resolve_dirpath(trainer), self.storage_options),
            listeners=[self._relay],
            world_size=trainer.world_size,
            broadcast=(lambda obj: trainer.strategy.broadcast(obj, src=0))
            if trainer.world_size > 1
            else None,
            min_over_ranks=rank_minimum(trainer, options),
            log=logger,
        )
        if self._planner_state is not None:
            self.checkpointer.load_state_dict(self._planner_state)
        # before Lightning registers its signal handlers (they chain coci's after its own)
        before = signal_handlers()
        if "SIGTERM" in self.checkpointer.watch_preemption():
            take_sigterm_over(trainer)
        shield_loader_workers(trainer, self.checkpointer.shield_loader_workers)
        self._handlers = (before, signal_handlers())
        self._validations = ValidationHistory()
        for source, model in self._terminations.items():
            self.checkpointer.set_termination(source, model)

    def set_termination(self, source: str, model: Termination | None) -> None:
        """Plan with ``model`` as the termination hazard from ``source`` (e.g. ``"optuna"``;
        None removes it), combined with the others and the one in ``planner_options``
        (independent causes: the survivals multiply). The plan is re-made at the next step."""
        if model is None:
            self._terminations.pop(source, None)
        else:
            self._terminations[source] = model
        if self.checkpointer is not None:
            self.checkpointer.set_termination(source, model)

    def _on_restore(
        self, trainer: pl.Trainer, loaded: LoadedCheckpoint, event: RestoreEvent
    ) -> None:
        restored = use_coci_io(trainer).restored_path
        connector = trainer._checkpoint_connector
        if restored is not None and connector._ckpt_path not in (None, restored):
            # "last" fell back past a damaged step: Lightning's "Restored all states from
            # the checkpoint at ..." and trainer.ckpt_path name the step restored
            connector._ckpt_path = restored
        if self.checkpointer is not None:
            manifest = loaded.manifest
            self.checkpointer.restored_elsewhere(manifest.run, event, manifest.sequence)
            self._run = manifest.run

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_step = trainer.global_step
        self._plan_told = False
        self._deferred = False
        self._at_validation_end = None
        if self._next_epoch_at_train_start:  # resumed after an epoch's end: see _epoch_end.py
            self._next_epoch_at_train_start = False
            start_next_epoch(trainer)
            self._restore_rng(trainer)  # before the next epoch's loader draws its order
        if self._rng_at_train_start:  # resumed from an epoch's last step: see _epoch_end.py
            self._rng_at_train_start = False
            self._restore_rng(trainer)  # before the validation, if one is resumed first
            if settle_resumed_validation(trainer) and self.checkpointer is not None:
                # a save at this step once its validation has run replaces the one before it
                self.checkpointer.resumed_unfinished()
            if self._pending_metrics is not None:
                # the live dict that the epoch-end hooks read (Lightning saves no metrics)
                trainer.callback_metrics.update(self._pending_metrics)
        self._pending_metrics = None
        if self.checkpointer is not None:
            # a fresh run into another run's directory (a rerun of the script)
            self.checkpointer.warn_if_not_empty(
                'fit(ckpt_path="last") or CociCheckpoint(resume=True)'
            )
        if self.checkpointer is not None:
            epochs = (self.every_n_epochs or 1) if self.policy == "epoch" else None
            plan_horizon(self.checkpointer.planner, trainer, save_every_epochs=epochs)
        warn_unless_stateful_loaders(trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._restore_rng(trainer)  # after a resume: continue the saved random streams
        if self._last_end is None:
            self._last_end = time.perf_counter()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.checkpointer is not None:
            # the step this update completes counts as reached: a kill before this callback's
            # batch end (checkpoint callbacks run last) still tells the work it lost
            self.checkpointer.before_update(trainer.global_step + 1)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        ckpt = self.checkpointer
        if ckpt is None:
            return
        now = time.perf_counter()
        step_time = None if self._last_end is None else now - self._last_end
        # a metric to maximise is no loss: plan with the training step's then
        loss = loss_of(trainer, self.monitor if self.mode == "min" else None, outputs)
        ckpt.observe(trainer.global_step, loss=loss, step_time_s=step_time)
        planned = ckpt.should_save(trainer.global_step)  # every rank asks (shared decision)
        if ckpt.preempted is not None:
            self._stop_on_notice(trainer, ckpt, save=planned)
        if self.policy == "epoch":
            planned = False  # the epoch saves are the every_n_epochs ones below
        self._check_monitor(trainer, planned=planned)
        last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        epoch_save = (
            last_batch
            and self.every_n_epochs is not None
            and (trainer.current_epoch + 1) % self.every_n_epochs == 0
        )
        if planned or epoch_save or self._deferred:
            self._deferred = False
            if last_batch:
                self._save_at_epoch_end(trainer)
            else:
                self._save(trainer)
        elif not ckpt.warmed and trainer.global_step > (self._start_step or 0):
            self._warm_up(trainer, ckpt)
        if trainer.is_global_zero:
            self._relay.drain(trainer)
            outline = None if self._plan_told else ckpt.plan_outline()
            if outline is not None and outline.report.replans > 0:
                self._plan_told = True
                self._tell_plan(trainer.global_step, outline)
        self._last_end = time.perf_counter()

    def _stop_on_notice(self, trainer: pl.Trainer, ckpt: Checkpointer, *, save: bool) -> None:
        """The ranks agreed on a preemption notice at this step: save it if the save fits
        (every rank), stop, wait for the save to be durable, and raise ``Preempted`` out of
        ``fit`` (through Lightning's exception handling: no validation, epoch end or final
        save runs in the time left)."""
        if save:
            last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
            if last_batch:  # in the state Lightning resumes after the epoch's last batch
                # and, when a validation follows it (which the time left may not fit), before
                # that validation: the resumed run runs it (see _epoch_end.py)
                self._save(
                    trainer,
                    epoch_end=True,
                    after_the_batch=True,
                    before_validation=validation_follows(trainer),
                )
            else:
                self._save(trainer)
        trainer.should_stop = True
        self.checkpointer = None  # closed by end_preempted: nothing more for the hooks to do
        stop = ckpt.end_preempted()
        if trainer.is_global_zero:
            ckpt.log_summary(logger)
            self._relay.drain(trainer, final=True)
        raise stop

    def _save_at_epoch_end(self, trainer: pl.Trainer) -> None:
        """A save at the step of an epoch's last batch, taken at that step in the state that
        Lightning resumes exactly (see :mod:`coci_lightning._epoch_end`)."""
        if self.save_on_train_end and run_ends_with_this_epoch(trainer):
            return  # on_train_end saves this step, after the epoch's end (the final state)
        if validation_follows(trainer):
            self._at_validation_end = trainer.global_step
        else:
            self._save(trainer, epoch_end=True, after_the_batch=True)

    def _tell_plan(self, step: int, outline: PlanOutline) -> None:
        """One log line (rank 0) once the first plan is made: what it is and how to change it."""
        line, warn = outline.line(
            step,
            adapter="CociCheckpoint",
            objective=self.objective,
            final_save=self.save_on_train_end,
        )
        (logger.warning if warn else logger.info)(line)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stopper = self._early_stopping(trainer)
        if stopper is not None and getattr(stopper, "_check_on_train_epoch_end", False):
            self._early_stopping_check(trainer, stopper)  # it checked in this hook, before us
        release_last_validation(trainer)  # had the held validation not run, no more epochs
        if self._at_validation_end is not None:
            # the validation the save waited for did not run: the next step saves instead (a
            # checkpoint taken between epochs does not resume exactly)
            self._at_validation_end = None
            self._deferred = True

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            release_last_validation(trainer)  # the validation it was held open for has run
            self._check_monitor(trainer, planned=False)  # where ModelCheckpoint checks
            if self.monitor is not None and self._last_saved_step == trainer.global_step:
                score = monitored(trainer.callback_metrics, self.monitor)
                self._scores.validated(trainer.global_step, score)
            stopper = self._early_stopping(trainer)
            if stopper is not None and not getattr(stopper, "_check_on_train_epoch_end", False):
                self._early_stopping_check(trainer, stopper)
            if self._at_validation_end == trainer.global_step:
                self._at_validation_end = None
                self._save(trainer, epoch_end=True)  # after the epoch's last batch

    def _early_stopping(self, trainer: pl.Trainer) -> EarlyStopping | None:
        if not self.early_stopping_hazard or self.checkpointer is None:
            return None
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return None
        return early_stopping_of(trainer)

    def _early_stopping_check(self, trainer: pl.Trainer, stopper: EarlyStopping) -> None:
        """After ``EarlyStopping`` judged a validation: its stop hazard enters the plan."""
        if self.checkpointer is None:
            return
        model = early_stopping_hazard(
            self._validations,
            trainer,
            stopper,
            start=self._start_step or 0,
            total=self.checkpointer.planner.total_steps,
        )
        if model is not None:
            self.set_termination("early_stopping", model)

    def _check_monitor(self, trainer: pl.Trainer, *, planned: bool) -> None:
        if check_monitor(trainer, self.monitor, warn=planned and not self._monitor_warned):
            self._monitor_warned = True

    def _warm_up(self, trainer: pl.Trainer, ckpt: Checkpointer) -> None:
        # the state that _save takes, for Checkpointer.warm_up
        self._rng_in_state = False
        try:
            with sharded_state(trainer.strategy):  # see _save
                state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            self._rng_in_state = True
        ckpt.warm_up(state, per_rank={RANK_STATE_KEY: {"rng": collect_plain_rng_states()}})

    def _save(
        self,
        trainer: pl.Trainer,
        *,
        block: bool | None = None,
        alone: bool = False,
        epoch_end: bool = False,
        after_the_batch: bool = False,
        before_validation: bool = False,
    ) -> None:
        # Every rank gets here at the same steps (the decision is shared) and writes its share
        # of the state, and its own random states; ``alone``: only rank 0 got here.
        # ``epoch_end``: after an epoch's last batch, before the epoch's end (resumed with the
        # metrics that end sees); ``after_the_batch``: from on_train_batch_end of that batch;
        # ``before_validation``: and before the validation that follows it (resumed with it).
        if self.checkpointer is None or self._last_saved_step == trainer.global_step:
            return
        alone = alone and trainer.world_size > 1
        if alone and not trainer.is_global_zero:
            return
        if alone and is_sharded(trainer.strategy):
            # rank 0 holds only its own shards, and collecting the others' would wait for
            # ranks that may have failed
            rank_zero_warn(
                f"coci: no checkpoint saved on the exception: {type(trainer.strategy).__name__} "
                "shards the state over the ranks, and rank 0 cannot save the others' shards alone"
            )
            return
        self._rng_in_state = False
        self._epoch_end_metrics = epoch_end_metrics(trainer) if epoch_end else None
        if self.monitor is not None:
            score = monitored(trainer.callback_metrics, self.monitor)
            self._scores.taking(trainer.global_step, score)
        try:
            # Private: the exact dict trainer.save_checkpoint writes, without writing a file
            # (Lightning has no public way to get it); with sharded state, each rank's shards.
            with sharded_state(trainer.strategy):
                state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            self._rng_in_state = True
            self._epoch_end_metrics = None
        if after_the_batch and not as_after_the_batch(
            state, trainer, before_validation=before_validation
        ):
            # an unknown loop layout: the next step saves (a state Lightning resumes exactly)
            self._deferred = True
            return
        self._last_saved_step = trainer.global_step
        state[RANK_STATES_KEY] = 1 if alone else trainer.world_size  # each writes its own
        handle = self.checkpointer.save(
            trainer.global_step,
            state,
            block=block,
            per_rank={RANK_STATE_KEY: {"rng": collect_plain_rng_states()}},
            alone=alone,
        )
        self._scores.taken(handle)
        self._run = self.checkpointer.manager.run_id
        handle.add_done_callback(self._note_saved)

    def _note_saved(self, handle: SaveHandle) -> None:
        """A save finished: its step directory is the newest kept, if it committed."""
        event = handle.event
        if event is not None and event.outcome == "committed" and event.path:
            self._newest_saved = str(event.path)

    def _restore_rng(self, trainer: pl.Trainer) -> None:
        """Put back the random states a resumed checkpoint holds for this rank (once)."""
        if self._pending_rng is not None:
            set_plain_rng_states(rng_for_rank(trainer, self._pending_rng))
            self._pending_rng = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run stopped early (EarlyStopping, a pruner) is done: no final save by default.
        if self.save_on_train_end and (self.save_when_stopped or not stopped_early(trainer)):
            self._save(trainer, block=True)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        if trainer.is_global_zero:
            self._relay.drain(trainer, final=True)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if isinstance(exception, Preempted):  # saved (or not) at the notice, and closed
            self.teardown(trainer, pl_module, "fit")
            return
        # Nothing trained in this run (the sanity check failed, or training failed before its
        # first optimizer step): there is nothing new to save, and a step-0 save would be what
        # "last" resumes from next time.
        trained = self._start_step is not None and trainer.global_step > self._start_step
        pruned = is_trial_pruned(exception) and not self.save_when_stopped
        if self.save_on_exception and trainer.state.fn == "fit" and trained and not pruned:
            # Another rank may not be here (the exception may be this rank's own): rank 0
            # saves by itself instead of waiting for the others' shares.
            try:
                self._save(trainer, block=True, alone=True)
            except CociError as e:  # never hide the exception that stopped training
                rank_zero_warn(f"coci: no checkpoint saved on the exception: {e}")
        if self.checkpointer is not None:
            self.checkpointer.mark_failed()  # a resume of this run is a restart after a failure
        self.teardown(trainer, pl_module, "fit")  # Lightning skips teardown hooks on errors

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        give_sigterm_back(trainer)
        give_loaders_back(trainer)
        release_last_validation(trainer)
        if self._handlers is not None:
            forget_coci_handlers(trainer, *self._handlers)
            self._handlers = None
        if self.checkpointer is not None:
            ckpt, self.checkpointer = self.checkpointer, None
            try:
                # Lightning itself goes on after a SIGTERM past the last batch: so does coci
                ckpt.close(stop_late=False)
                if ckpt.stopped_late is not None:
                    logger.warning(
                        "coci: %s came after the last training step; the final save is "
                        "durable, and Lightning goes on (as it does without coci)",
                        ckpt.stopped_late,
                    )
            finally:  # the end of fit: one summary line (also after an exception)
                if trainer.is_global_zero:
                    ckpt.log_summary(logger)
        self._start_step = None
        # what a checkpoint read by this stage left for a resumed fit is not for the next fit
        self._pending_rng = self._pending_metrics = None
        self._rng_at_train_start = False
        self._next_epoch_at_train_start = False

    @override
    def state_dict(self) -> dict[str, Any]:
        # In coci's own saves the random states are per-rank state (written by each rank);
        # in a Lightning checkpoint made by anything else, they are this rank's.
        state: dict[str, Any] = {"rng": collect_plain_rng_states()} if self._rng_in_state else {}
        if self.checkpointer is not None:
            state.update(self.checkpointer.state_dict())
        if self._epoch_end_metrics is not None:
            state[EPOCH_END_KEY] = self._epoch_end_metrics
        if self.monitor is not None:
            state[SCORES_KEY] = self._scores.state()
        return state

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # a save before the validation after the run's last step: Lightning would stop on
        # max_steps without running it (see _epoch_end.py)
        hold_for_last_validation(trainer, checkpoint)
        saved = checkpoint.get("optimizer_states")
        self._saved_optimizers = saved if isinstance(saved, list) else None
        self._check_optimizers(trainer)
        self._next_epoch_at_train_start = after_a_finished_epoch(trainer, checkpoint)
        own = checkpoint.get(RANK_STATE_KEY)
        if isinstance(own, dict) and "rng" in own:
            self._pending_rng = own["rng"]
        elif (
            trainer.world_size > 1
            and step_dir_of(trainer.ckpt_path, self.storage_options) is not None
            and "rng" not in checkpoint.get("callbacks", {}).get(self.state_key, {})
        ):
            warnings.warn(
                f"coci: the checkpoint has no random states for rank {trainer.global_rank} (it "
                "was written by fewer ranks); this rank continues its own seeded streams",
                stacklevel=2,
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_optimizers(trainer)

    def _check_optimizers(self, trainer: pl.Trainer) -> None:
        """The checkpoint's optimizer states fit the fit's optimizers (another optimizer's
        failed in torch: ``KeyError: 'momentum'`` at the first step), once both exist."""
        saved, optimizers = self._saved_optimizers, trainer.strategy.optimizers
        if saved is None or not optimizers:
            return
        self._saved_optimizers = None
        for optimizer, state in zip(optimizers, saved, strict=False):
            check_optimizer_fits(
                optimizer,
                state,
                fix="train the changed module as a new run, in a directory of its own "
                "(CociCheckpoint(dirpath=...)) without ckpt_path or resume=True",
            )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "rng" in state_dict:  # older coci checkpoints, and Lightning's own
            self._pending_rng = state_dict["rng"]
        self._scores.load(state_dict.get(SCORES_KEY))
        if self._scores.scores:  # the module logged the monitored key before the resume
            self._monitor_warned = True
        metrics = state_dict.get(EPOCH_END_KEY)
        self._rng_at_train_start = isinstance(metrics, dict)  # taken at an epoch's last step
        self._pending_metrics = dict(metrics) if isinstance(metrics, dict) else None
        self._planner_state = state_dict
        if self.checkpointer is not None:
            self.checkpointer.load_state_dict(state_dict)
