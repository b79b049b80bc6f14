"""CociCheckpoint: convergence-aware, asynchronous checkpoints for a Lightning Trainer."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Checkpoint, EarlyStopping
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from coci_core.errors import CociError, ConfigError
from coci_core.hpo import (
    combine_terminations,
    improvement_probability,
    patience_stops,
    threshold_stops,
)
from coci_core.planner import Termination
from coci_core.telemetry import RestoreEvent
from coci_core.training import (
    Checkpointer,
    CheckpointOptions,
    LoadedCheckpoint,
    RankGroup,
    SavePolicy,
    is_url,
    open_storage,
    resume_order,
    shared_options,
    step_dir_name,
)
from coci_lightning._epoch_end import (
    as_after_the_batch,
    epoch_end_metrics,
    run_ends_with_this_epoch,
    validation_follows,
)
from coci_lightning._hparams import check_hyperparameters
from coci_lightning._resume import (
    coci_step_of,
    install_last_resolution,
    tier_options,
    use_coci_io,
)
from coci_lightning._rng import collect_plain_rng_states, set_plain_rng_states
from coci_lightning._telemetry import LoggerRelay, make_sinks

__all__ = ["CociCheckpoint"]


logger = logging.getLogger(__name__)

RANK_STATE_KEY = "coci_rank_state"  # per-rank state in coci's saves: {"rng": ...}
# in the callback's state of a save at an epoch's last step: the metrics its epoch end sees
EPOCH_END_KEY = "epoch_end_metrics"


class CociCheckpoint(Checkpoint):
    """Checkpoints a Lightning run when coci's planner says so; resumes it exactly.

    Args:
        dirpath: where checkpoints go (a str path, an os.PathLike, or an fsspec URL string
            such as ``"s3://bucket/run"``, kept a string); default ``<default_root_dir>/coci``.
        policy: ``"coci"`` or a baseline of the planner (e.g. ``"every_n_steps"``), or a
            policy object of :mod:`coci_core.planner` (e.g. ``EveryNSteps(every_n_steps=500)``).
        objective: ``"convergence"`` (default), ``"time"`` or ``"progress"``.
        mtbf_s: mean time between failures of one node, in seconds (None: estimated).
        keep_last: committed checkpoints to keep.
        compression: ``"auto"`` (default: compress only where it shortens the time to
            durable; raw on a fast local disk), ``"none"``, ``"lossless"`` or ``"lossy"``
            (opt-in, bounded error); see docs/compression.md.
        compression_options: the knobs of ``coci_core.engine.compress.CompressionPolicy``
            (``full_every``, ``lossy_bits``, ``max_lossy_generations``, ...).
        resume: continue from the newest committed checkpoint when ``fit`` gets no ckpt_path.
        every_n_steps: the interval of that policy (a cap on the interval for ``coci``).
        every_n_seconds: the interval of that policy (a cap on the interval for ``coci``).
        every_n_epochs: also save after every N-th training epoch (as
            ``ModelCheckpoint(every_n_epochs=N)``), at the epoch's last step.
            ``policy="epoch"`` saves only there (every epoch by default), with the steps per
            epoch taken from the Trainer.
        monitor: a logged metric to use as the loss (default: the training step's loss).
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
        early_stopping_hazard: when the Trainer has an ``EarlyStopping`` callback, plan with
            the probability that it stops the run at each coming validation (see
            :mod:`coci_core.hpo.early_stopping`); ``explain()`` shows it.
        save_when_stopped: also take the final save (``save_on_train_end``,
            ``save_on_exception``) when the run is stopped early: by ``EarlyStopping``, or
            pruned by Optuna (``optuna.TrialPruned``, or optuna-integration's pruning callback
            stopping the Trainer). By default a stopped run is done and takes none (a run
            stopped by ``max_time`` still takes its final save).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        policy: str | SavePolicy = "coci",
        objective: str = "convergence",
        mtbf_s: float | None = None,
        keep_last: int | None = 3,
        compression: str | None = "auto",
        compression_options: dict[str, Any] | None = None,
        resume: bool = False,
        every_n_steps: int | None = None,
        every_n_seconds: float | None = None,
        every_n_epochs: int | None = None,
        monitor: str | None = None,
        block: bool = True,
        save_on_train_end: bool = True,
        save_on_exception: bool = True,
        planner_options: dict[str, Any] | None = None,
        verbose: bool = False,
        storage_options: dict[str, Any] | None = None,
        remote: str | os.PathLike[str] | None = None,
        remote_keep_last: int | None = 10,
        remote_storage_options: dict[str, Any] | None = None,
        remote_upload_every: int | Literal["auto"] = "auto",
        early_stopping_hazard: bool = True,
        save_when_stopped: bool = False,
    ) -> None:
        super().__init__()
        dirpath = _check_dirpath(dirpath)
        for name, flag in (
            ("resume", resume),
            ("save_on_train_end", save_on_train_end),
            ("save_on_exception", save_on_exception),
            ("early_stopping_hazard", early_stopping_hazard),
            ("save_when_stopped", save_when_stopped),
        ):
            if not isinstance(flag, bool):
                raise ConfigError(f"'{name}' must be a bool (True or False): {flag!r}")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ConfigError(
                f"'monitor' must be the name of a logged metric (a non-empty str) or None: "
                f"{monitor!r}"
            )
        if every_n_epochs is not None and (type(every_n_epochs) is not int or every_n_epochs < 1):
            raise ConfigError(
                f"'every_n_epochs' must be an integer >= 1 or None: {every_n_epochs!r}"
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
        self._monitor_warned = False
        self.save_on_train_end = save_on_train_end
        self.save_on_exception = save_on_exception
        self.early_stopping_hazard = early_stopping_hazard
        self.save_when_stopped = save_when_stopped
        # termination models by source ("early_stopping", "optuna"), combined with the user's
        self._terminations: dict[str, Termination] = {}
        # (global step, improved, monitored value) per EarlyStopping check
        self._validations: list[tuple[int, bool, float]] = []
        self.checkpointer: Checkpointer | None = None
        self._planner_state: dict[str, Any] | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._last_end: float | None = None
        self._last_saved_step: int | None = None
        self._fallback_for: str | None = None
        self._rng_in_state = True
        self._deferred = False  # save at the next step (a planned save that could not be taken)
        # the step of an epoch's last batch whose save waits for the validation after it
        self._at_validation_end: int | None = None
        self._epoch_end_metrics: dict[str, torch.Tensor] | None = None  # saved with the state
        # from a checkpoint of an epoch's last step: its random states and logged metrics go
        # back in on_train_start, before the epoch's end runs
        self._rng_at_train_start = False
        self._pending_metrics: dict[str, Any] | None = None
        self._start_step: int | None = None  # global_step at on_train_start (None: not started)
        self._plan_told = False
        self._warmed = False  # the save buffers were mapped in this fit
        self._relay = LoggerRelay()
        install_last_resolution()

    def __getstate__(self) -> dict[str, Any]:
        # The live Checkpointer (an open directory lease, a writer thread) belongs to this
        # process's run: a copy (copy.deepcopy, pickle for strategy="ddp_spawn") gets none and
        # opens its own in ``setup``. Its planner estimates travel as ``_planner_state``.
        state = self.__dict__.copy()
        if self.checkpointer is not None:
            state["_planner_state"] = self.checkpointer.state_dict()
        state["checkpointer"] = None
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

    def storage_options_for(self, path: object) -> dict[str, Any]:
        """The fsspec options of the tier that ``path`` is in (``remote`` or ``dirpath``)."""
        o = self.options
        return tier_options(path, o.storage_options, o.remote, o.remote_storage_options)

    def newest_step_dir(self, trainer: pl.Trainer) -> Path | str | None:
        """The step directory a resume tries first (the newest checkpoint of the newest run,
        by commit sequence, in ``dirpath`` or the ``remote`` tier); or None."""
        root = self.resolve_dirpath(trainer)
        remote_url = self.options.remote
        remote = None
        if remote_url is not None:
            remote = open_storage(remote_url, **dict(self.options.remote_storage_options))
        candidates = resume_order(open_storage(str(root), **self.storage_options), remote)
        if not candidates:
            return None
        newest = candidates[0]
        base: Path | str = root if newest.tier == "local" or remote_url is None else remote_url
        if isinstance(base, str):
            return base.rstrip("/") + "/" + step_dir_name(newest.step)
        return base / step_dir_name(newest.step)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Every entry point (fit, validate, test, predict) reads coci step directories.
        io = use_coci_io(trainer)
        io.on_restore = self._on_restore
        io.fallback_for = self._fallback_for
        io.rank = trainer.global_rank
        io.storage_options = self.storage_options
        io.directory = str(self.resolve_dirpath(trainer))
        io.remote = self.options.remote
        io.remote_storage_options = dict(self.options.remote_storage_options)
        # a resume reads the module's tensors in place (no second copy of them); Lightning
        # creates the optimizers after it reads the checkpoint, and they adopt its tensors.
        # Not when the module's on_load_checkpoint may change what it loads (keep a weight).
        own_hook = type(pl_module).on_load_checkpoint is not pl.LightningModule.on_load_checkpoint
        io.live_state = None if own_hook else lambda: {"state_dict": pl_module.state_dict()}
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
            broadcast=(lambda obj: trainer.strategy.broadcast(obj, src=0))
            if trainer.world_size > 1
            else None,
            manager_options={"group": _rank_group(trainer)},
        )
        if self._planner_state is not None:
            self.checkpointer.load_state_dict(self._planner_state)
        self._validations = []
        if self._terminations:
            self._apply_terminations()

    def set_termination(self, source: str, model: Termination | None) -> None:
        """Plan with ``model`` as the termination hazard from ``source`` (e.g. ``"optuna"``;
        None removes it), combined with the others and the one in ``planner_options``
        (independent causes: the survivals multiply). The plan is re-made at the next step."""
        if model is None:
            self._terminations.pop(source, None)
        else:
            self._terminations[source] = model
        self._apply_terminations()

    def _apply_terminations(self) -> None:
        if self.checkpointer is None:
            return
        own = self.options.planner.settings.termination
        self.checkpointer.planner.set_termination(
            combine_terminations([own, *self._terminations.values()])
        )

    def _on_restore(self, loaded: LoadedCheckpoint, event: RestoreEvent) -> None:
        if self.checkpointer is not None:
            manifest = loaded.manifest
            self.checkpointer.restored_elsewhere(manifest.run, event, manifest.sequence)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_step = trainer.global_step
        self._plan_told = False
        self._warmed = False
        self._deferred = False
        self._at_validation_end = None
        if self._rng_at_train_start:  # resumed from an epoch's last step: see _epoch_end.py
            self._rng_at_train_start = False
            self._restore_rng(trainer)
            if self._pending_metrics is not None:
                # the live dict that the epoch-end hooks read (Lightning saves no metrics)
                trainer.callback_metrics.update(self._pending_metrics)
        self._pending_metrics = None
        if self.checkpointer is not None:
            self.checkpointer.warn_if_not_empty()  # a fresh run into another run's directory
        planner = self.checkpointer.planner if self.checkpointer is not None else None
        if planner is not None and self.policy == "epoch":
            planner.set_steps_per_epoch(self._steps_per_epoch(trainer) * (self.every_n_epochs or 1))
        if planner is not None and planner.total_steps is None:
            # max_epochs without max_steps: the Trainer's estimate of the run's optimizer steps
            estimated = trainer.estimated_stepping_batches
            if math.isfinite(estimated) and int(estimated) > max(planner.start_step, 0):
                planner.total_steps = int(estimated)
        # Private: the Trainer exposes its train loaders publicly only as the user's objects,
        # not as the flattened loaders it iterates, which are what must be stateful.
        loaders = trainer.fit_loop._combined_loader
        for loader in loaders.flattened if loaders is not None else []:
            if not hasattr(loader, "state_dict"):
                rank_zero_warn(
                    "coci: the train DataLoader is not stateful, so a run resumed mid-epoch sees "
                    "some samples twice and some never. Use torchdata's StatefulDataLoader "
                    "(pip install torchdata; from torchdata.stateful_dataloader import "
                    "StatefulDataLoader) for exactly-once resumes."
                )
            elif trainer.world_size > 1 and not hasattr(
                getattr(getattr(loader, "batch_sampler", None), "sampler", None), "state_dict"
            ):
                rank_zero_warn(
                    "coci: with several processes the train sampler must be stateful and "
                    "seeded for exactly-once resumes: pass sampler=StatefulDistributedSampler("
                    "dataset, shuffle=True, seed=...) (from torchdata.stateful_dataloader."
                    "sampler) to the StatefulDataLoader instead of shuffle=True."
                )

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
            self.checkpointer.before_update()

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
        ckpt.observe(trainer.global_step, loss=self._loss(trainer, outputs), step_time_s=step_time)
        planned = ckpt.should_save(trainer.global_step)  # every rank asks (shared decision)
        if self.policy == "epoch":
            planned = False  # the epoch saves are the every_n_epochs ones below
        self._check_monitor(trainer, planned)
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
        elif not self._warmed and trainer.global_step > (self._start_step or 0):
            self._warm_up(trainer)
        if trainer.is_global_zero:
            self._relay.drain(trainer)
            if not self._plan_told and ckpt.planner.report(with_overhead=False).replans > 0:
                self._plan_told = True
                self._tell_plan(trainer, ckpt)
        self._last_end = time.perf_counter()

    def _save_at_epoch_end(self, trainer: pl.Trainer) -> None:
        """A save at the step of an epoch's last batch, taken at that step in the state that
        Lightning resumes exactly (see :mod:`coci_lightning._epoch_end`)."""
        if self.save_on_train_end and run_ends_with_this_epoch(trainer):
            return  # on_train_end saves this step, after the epoch's end (the final state)
        if validation_follows(trainer):
            self._at_validation_end = trainer.global_step
        else:
            self._save(trainer, epoch_end=True, after_the_batch=True)

    def _tell_plan(self, trainer: pl.Trainer, ckpt: Checkpointer) -> None:
        """One log line (rank 0) once the first plan is made: what it is and how to change it."""
        report = ckpt.planner.report(with_overhead=False)
        step = trainer.global_step
        total = ckpt.planner.total_steps
        ahead = [s for s in report.next_steps if s > step]
        first = ahead[0] if ahead else None
        interval = ahead[1] - ahead[0] if len(ahead) > 1 else report.interval_steps
        if first is not None and total is not None and first > total:
            first = None
        step_time = report.costs.get("step_time_s") or 0.0
        mtbf = report.mtbf_s if report.mtbf_s is not None else float("nan")
        source = {
            "user": "given as mtbf_s",
            "estimated": "estimated from this run's restarts",
            "default": "default: no mtbf_s given and no failure seen yet",
        }.get(report.mtbf_source, report.mtbf_source)
        length = f"of {total} steps" if total is not None else "over a rolling horizon"
        if first is None:
            when = "no save planned before the end" + (
                " (only the final save)" if self.save_on_train_end else ""
            )
        else:
            when = f"first save at step {first} (in ~{(first - step) * step_time:.3g} s)"
        every = (
            f"then every {interval} steps (~{interval * step_time:.3g} s)"
            if interval
            else "no further save planned yet"
        )
        message = (
            f"coci: plan ({report.policy} policy, {self.objective} objective) {length}: {when}, "
            f"{every}; MTBF assumed {mtbf:.6g} s ({source}). Change it with "
            "CociCheckpoint(mtbf_s=..., every_n_steps=N (a cap on the interval), "
            "policy='every_n_steps'); the plan is re-made as costs are measured."
        )
        if first is None:
            logger.warning(message)
        else:
            logger.info(message)

    @staticmethod
    def _steps_per_epoch(trainer: pl.Trainer) -> int:
        """Optimizer steps per training epoch, from the Trainer."""
        batches = trainer.num_training_batches  # known once training starts
        if not math.isfinite(batches) or batches < 1:
            raise ConfigError(
                "policy='epoch' needs the number of batches per epoch, and the train "
                f"DataLoader has no length ({batches}); use policy='every_n_steps' instead"
            )
        return max(1, math.ceil(int(batches) / trainer.accumulate_grad_batches))

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stopper = self._early_stopping(trainer)
        if stopper is not None and getattr(stopper, "_check_on_train_epoch_end", False):
            self._early_stopping_check(trainer, stopper)  # it checked in this hook, before us
        if self._at_validation_end is not None:
            # the validation the save waited for did not run: the next step saves instead (a
            # checkpoint taken between epochs does not resume exactly)
            self._at_validation_end = None
            self._deferred = True

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._check_monitor(trainer, planned=False)  # where ModelCheckpoint checks
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
        found = [cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping)]  # type: ignore[attr-defined]
        return found[0] if found else None

    def _early_stopping_check(self, trainer: pl.Trainer, stopper: EarlyStopping) -> None:
        """After ``EarlyStopping`` judged a validation (Checkpoint callbacks run after the
        others): the probability that it stops the run at each coming validation, from its
        patience and wait count and how often the metric improved lately, as the plan's
        termination hazard (see :mod:`coci_core.hpo.early_stopping`)."""
        if self.checkpointer is None:
            return
        if stopper.monitor not in trainer.callback_metrics:
            return  # EarlyStopping did not judge this validation
        step = trainer.global_step
        if self._validations and self._validations[-1][0] == step:
            return
        value = trainer.callback_metrics[stopper.monitor]
        self._validations.append((step, stopper.wait_count == 0, float(value)))
        steps = [k for k, _, _ in self._validations]
        start = self._start_step or 0
        gaps = np.diff([start, *steps])
        interval = max(1, int(np.median(gaps[gaps > 0]))) if np.any(gaps > 0) else 1
        total = self.checkpointer.planner.total_steps
        last = total if total is not None else step + 256 * interval
        coming = list(range(step + interval, last + 1, interval))[:512]
        patience = max(1, int(stopper.patience))
        p = improvement_probability(
            [improved for _, improved, _ in self._validations], window=max(2 * patience, 4)
        )
        source = (
            f"EarlyStopping(monitor={stopper.monitor!r}, patience {patience}, wait "
            f"{stopper.wait_count}, min_delta {abs(float(stopper.min_delta)):g}; P(improve) "
            f"{p:.2f} per validation, every {interval} steps)"
        )
        model: Termination = patience_stops(
            patience=patience,
            wait_count=int(stopper.wait_count),
            improve_probability=p,
            validation_steps=coming,
            source=source,
        )
        good, bad = stopper.stopping_threshold, stopper.divergence_threshold
        if good is not None or bad is not None:
            limits = ", ".join(
                f"{name} {float(t):g}"
                for name, t in (("stopping_threshold", good), ("divergence_threshold", bad))
                if t is not None
            )
            crossing = threshold_stops(
                [v for _, _, v in self._validations],
                mode="max" if stopper.mode == "max" else "min",
                validation_steps=coming,
                stopping_threshold=None if good is None else float(good),
                divergence_threshold=None if bad is None else float(bad),
                source=f"its {limits}, from the trend of the last values",
            )
            model = combine_terminations(
                [model, crossing], source=f"{source[:-1]}; {crossing.source})"
            )
        self.set_termination("early_stopping", model)

    def _check_monitor(self, trainer: pl.Trainer, planned: bool) -> None:
        """As ``ModelCheckpoint(monitor=...)``: a missing metric is an error once a validation
        has run (the metric may be a validation one, logged only then), and a warning (once) at
        a save before that."""
        if not self.monitor or self.monitor in trainer.callback_metrics:
            return
        message = (
            f"`CociCheckpoint(monitor={self.monitor!r})` could not find the monitored key in "
            f"the logged metrics: {list(trainer.callback_metrics)}. HINT: Did you call "
            f"`log({self.monitor!r}, value)` in the `LightningModule`?"
        )
        # Private: whether a validation ran yet is what ModelCheckpoint's own check uses.
        if trainer.fit_loop.epoch_loop.val_loop._has_run:
            raise MisconfigurationException(message)
        if planned and not self._monitor_warned:
            self._monitor_warned = True
            rank_zero_warn(message)

    def _loss(self, trainer: pl.Trainer, outputs: Any) -> float | None:
        value = trainer.callback_metrics.get(self.monitor) if self.monitor else outputs
        if isinstance(value, dict):
            value = value.get("loss")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value.detach())
        return float(value) if isinstance(value, (int, float)) else None

    def _warm_up(self, trainer: pl.Trainer) -> None:
        # After the run's first optimizer step the state has its final shapes (the optimizer
        # made its state): map the save buffers now, in the background, not in the first save.
        self._warmed = True
        if self.checkpointer is None:
            return
        self._rng_in_state = False
        try:
            state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)  # see _save
        finally:
            self._rng_in_state = True
        rank_state = {RANK_STATE_KEY: {"rng": collect_plain_rng_states()}}
        self.checkpointer.warm_up(state, per_rank=rank_state)

    def _save(
        self,
        trainer: pl.Trainer,
        *,
        block: bool | None = None,
        alone: bool = False,
        epoch_end: bool = False,
        after_the_batch: bool = False,
    ) -> None:
        # Every rank gets here at the same steps (the decision is shared) and writes its share
        # of the state, and its own random states; ``alone``: only rank 0 got here.
        # ``epoch_end``: after an epoch's last batch, before the epoch's end (resumed with the
        # metrics that end sees); ``after_the_batch``: from on_train_batch_end of that batch.
        if self.checkpointer is None or self._last_saved_step == trainer.global_step:
            return
        alone = alone and trainer.world_size > 1
        if alone and not trainer.is_global_zero:
            return
        self._rng_in_state = False
        self._epoch_end_metrics = epoch_end_metrics(trainer) if epoch_end else None
        try:
            # Private: the exact dict trainer.save_checkpoint writes, without writing a file
            # (Lightning has no public way to get it).
            state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            self._rng_in_state = True
            self._epoch_end_metrics = None
        if after_the_batch and not as_after_the_batch(state, trainer):
            # an unknown loop layout: the next step saves (a state Lightning resumes exactly)
            self._deferred = True
            return
        self._last_saved_step = trainer.global_step
        self.checkpointer.save(
            trainer.global_step,
            state,
            block=block,
            per_rank={RANK_STATE_KEY: {"rng": collect_plain_rng_states()}},
            alone=alone,
        )

    def _restore_rng(self, trainer: pl.Trainer) -> None:
        """Put back the random states a resumed checkpoint holds for this rank (once)."""
        if self._pending_rng is not None:
            set_plain_rng_states(self._rng_for_rank(trainer, self._pending_rng))
            self._pending_rng = None

    @staticmethod
    def _rng_for_rank(trainer: pl.Trainer, saved: dict[str, Any]) -> dict[str, Any]:
        per_rank = saved.get("per_rank")
        if per_rank is None:
            return saved
        if len(per_rank) != trainer.world_size:
            rank_zero_warn(
                f"coci: the checkpoint has random states of {len(per_rank)} ranks, this run has "
                f"{trainer.world_size}; every rank continues rank 0's streams"
            )
            return dict(per_rank[0])
        return dict(per_rank[trainer.global_rank])

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run stopped early (EarlyStopping, a pruner) is done: no final save by default.
        if self.save_on_train_end and (self.save_when_stopped or not _stopped_early(trainer)):
            self._save(trainer, block=True)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        if trainer.is_global_zero:
            self._relay.drain(trainer, final=True)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Nothing trained in this run (the sanity check failed, or training failed before its
        # first optimizer step): there is nothing new to save, and a step-0 save would be what
        # "last" resumes from next time.
        trained = self._start_step is not None and trainer.global_step > self._start_step
        pruned = _is_trial_pruned(exception) and not self.save_when_stopped
        if self.save_on_exception and trainer.state.fn == "fit" and trained and not pruned:
            # Another rank may not be here (the exception may be this rank's own): rank 0
            # saves by itself instead of waiting for the others' shares.
            try:
                self._save(trainer, block=True, alone=True)
            except CociError as e:  # never hide the exception that stopped training
                rank_zero_warn(f"coci: no checkpoint saved on the exception: {e}")
        self.teardown(trainer, pl_module, "fit")  # Lightning skips teardown hooks on errors

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.checkpointer is not None:
            ckpt, self.checkpointer = self.checkpointer, None
            try:
                ckpt.close()
            finally:  # the end of fit: one summary line (also after an exception)
                if trainer.is_global_zero:
                    _log_summary(ckpt)
        self._start_step = None
        # what a checkpoint read by this stage left for a resumed fit is not for the next fit
        self._pending_rng = self._pending_metrics = None
        self._rng_at_train_start = False

    @override
    def state_dict(self) -> dict[str, Any]:
        # In coci's own saves the random states are per-rank state (written by each rank);
        # in a Lightning checkpoint made by anything else, they are this rank's.
        state: dict[str, Any] = {"rng": collect_plain_rng_states()} if self._rng_in_state else {}
        if self.checkpointer is not None:
            state.update(self.checkpointer.state_dict())
        if self._epoch_end_metrics is not None:
            state[EPOCH_END_KEY] = self._epoch_end_metrics
        return state

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        own = checkpoint.get(RANK_STATE_KEY)
        if isinstance(own, dict) and "rng" in own:
            self._pending_rng = own["rng"]
        elif (
            trainer.world_size > 1
            and coci_step_of(trainer.ckpt_path, self.storage_options) is not None
            and "rng" not in checkpoint.get("callbacks", {}).get(self.state_key, {})
        ):
            warnings.warn(
                f"coci: the checkpoint has no random states for rank {trainer.global_rank} (it "
                "was written by fewer ranks); this rank continues its own seeded streams",
                stacklevel=2,
            )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "rng" in state_dict:  # older coci checkpoints, and Lightning's own
            self._pending_rng = state_dict["rng"]
        metrics = state_dict.get(EPOCH_END_KEY)
        self._rng_at_train_start = isinstance(metrics, dict)  # taken at an epoch's last step
        self._pending_metrics = dict(metrics) if isinstance(metrics, dict) else None
        self._planner_state = state_dict
        if self.checkpointer is not None:
            self.checkpointer.load_state_dict(state_dict)


def _stopped_early(trainer: pl.Trainer) -> bool:
    """Whether ``EarlyStopping`` stopped the run, or optuna-integration's pruning callback did
    (with several processes it stops the Trainer instead of raising); not ``max_time``."""
    if not trainer.should_stop:
        return False
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, EarlyStopping):
            reason = getattr(cb, "stopping_reason", None)  # Lightning >= 2.5.1
            if reason is not None and getattr(reason, "name", "") != "NOT_STOPPED":
                return True
            if reason is None and cb.wait_count >= cb.patience:
                return True
        if type(cb).__name__ == "PyTorchLightningPruningCallback":
            return True
    return False


def _is_trial_pruned(exception: BaseException) -> bool:
    """Whether ``exception`` is Optuna's ``TrialPruned`` (without importing Optuna)."""
    return any(
        c.__name__ == "TrialPruned" and c.__module__.startswith("optuna")
        for c in type(exception).__mro__
    )


def _log_summary(ckpt: Checkpointer) -> None:
    line = ckpt.summary_line()
    if ckpt.summary.failed:
        logger.warning(line)
    else:
        logger.info(line)


def _check_dirpath(dirpath: Any) -> Any:
    """``dirpath`` is None, a str path, an os.PathLike or an fsspec URL string (kept a str)."""
    if dirpath is None or isinstance(dirpath, os.PathLike):
        return dirpath
    if isinstance(dirpath, str) and dirpath.strip():
        return dirpath
    raise ConfigError(
        "'dirpath' must be a directory path (a str or an os.PathLike such as pathlib.Path), "
        f"an fsspec URL string (e.g. 's3://bucket/run'), or None: {dirpath!r}"
    )


def _rank_group(trainer: pl.Trainer) -> RankGroup:
    """Every rank writes its share; the session name comes from rank 0 (one broadcast)."""
    if trainer.world_size == 1:
        return RankGroup.single()
    session = trainer.strategy.broadcast(uuid.uuid4().hex[:16], src=0)
    return RankGroup(trainer.global_rank, trainer.world_size, str(session))
