"""CociCheckpointer: coci's planned, asynchronous checkpoints for an Accelerate training loop."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from coci_accelerate import _state
from coci_accelerate.tracker import CociTracker
from coci_core.checkpointer import Checkpointer, adapter_planner_options
from coci_core.errors import CociError, ConfigError, NoCheckpointError
from coci_core.group import RankGroup
from coci_core.manager import SaveHandle
from coci_core.telemetry import JsonlTelemetry, TelemetrySink
from coci_core.tensorboard import TensorBoardTelemetry

__all__ = ["CociCheckpointer"]

logger = logging.getLogger(__name__)

TELEMETRY_FILE = "telemetry.jsonl"


class CociCheckpointer:
    """Saves an Accelerate run when coci's planner says so, on every process; resumes it.

    Registers itself with ``accelerator.register_for_checkpointing``, so that
    ``accelerator.save_state()`` / ``load_state()`` also carry the planner's state.

    Args:
        accelerator: the run's Accelerator.
        dirpath: where checkpoints go; default ``<project_dir>/coci``.
        policy, objective, mtbf_s, keep_last, compression, every_n_steps, every_n_seconds,
        block, planner_options: as for ``coci_lightning.CociCheckpoint``.
        loss_key: the logged value ``CociTracker`` passes to the planner as the loss.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        dirpath: str | Path | None = None,
        *,
        policy: str = "coci",
        objective: str = "convergence",
        mtbf_s: float | None = None,
        keep_last: int | None = 3,
        compression: str | None = "auto",
        compression_options: dict[str, Any] | None = None,
        every_n_steps: int | None = None,
        every_n_seconds: float | None = None,
        block: bool = False,
        planner_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(accelerator, Accelerator):
            raise ConfigError(
                f"'accelerator' must be an Accelerator, got {type(accelerator).__name__}"
            )
        options = adapter_planner_options(
            policy=policy,
            objective=objective,
            mtbf_s=mtbf_s,
            keep_last=keep_last,
            compression=compression,
            block=block,
            every_n_steps=every_n_steps,
            every_n_seconds=every_n_seconds,
            planner_options=planner_options,
        )
        self.accelerator = accelerator
        root = Path(accelerator.project_dir) if accelerator.project_dir else Path.cwd()
        self.dirpath = Path(dirpath) if dirpath is not None else root / "coci"
        is_main = accelerator.is_main_process
        sinks: list[TelemetrySink] = []
        if is_main:
            sinks.append(JsonlTelemetry(self.dirpath / TELEMETRY_FILE))
            with contextlib.suppress(ConfigError):  # tensorboard is not installed
                sinks.append(_tensorboard_sink(accelerator, self.dirpath / "tensorboard"))
        self.checkpointer = Checkpointer(
            self.dirpath,
            policy=policy,
            objective=objective,
            mtbf_s=mtbf_s,
            keep_last=keep_last,
            compression=compression,
            compression_options=compression_options,
            block=block,
            planner_options=options,
            rank=accelerator.process_index,
            broadcast=_broadcast if accelerator.num_processes > 1 else None,
            sinks=sinks,
            manager_options={"group": _rank_group(accelerator)},
        )
        self._tracker = _find_tracker(accelerator)
        config = accelerator.dataloader_config
        if not (config.use_seedable_sampler and getattr(config, "use_stateful_dataloader", False)):
            warnings.warn(
                "coci: a run resumed mid-epoch sees each remaining sample exactly once only with "
                "Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, "
                "use_stateful_dataloader=True)) (the stateful loader needs torchdata); with this "
                "configuration the resumed epoch may repeat or skip samples",
                UserWarning,
                stacklevel=2,
            )
        self._last_step_end: float | None = None
        self._hooked: set[int] = set()
        accelerator.register_for_checkpointing(self)

    # -- the training loop ----------------------------------------------------------------

    def step(self, step: int, *, loss: float | None = None) -> SaveHandle | None:
        """Call once per training step, after ``optimizer.step()``; saves when the plan says so.

        ``loss`` is only needed without a ``CociTracker`` in ``log_with``.
        Returns the save's handle on the process that writes, else None.
        """
        self._check_prepared()
        if not self._hooked:  # first step of this process
            _state.own_loader_generators(self.accelerator)
            self._hook_optimizers()
        now = time.perf_counter()
        step_time = None if self._last_step_end is None else now - self._last_step_end
        if loss is None and self._tracker is not None:
            loss = self._tracker.pop_loss(step)
        self.checkpointer.observe(step, loss=loss, step_time_s=step_time)
        handle = None
        if self.checkpointer.should_save(step):
            handle = self.save(step)
        self._last_step_end = time.perf_counter()
        return handle

    def save(self, step: int) -> SaveHandle:
        """Save now; call it on every process at the same step: each writes its share of the
        state and its own random states and registered objects (no collective)."""
        self._check_prepared()
        state = _state.collect(self.accelerator, step)
        state["coci"] = self.checkpointer.state_dict()
        own = _state.collect_own(self.accelerator, skip=self)
        return self.checkpointer.save(step, state, per_rank={_state.PROCESS_KEY: own})

    def wait(self) -> None:
        """Block until pending saves are durable (re-raises background errors)."""
        self.checkpointer.wait()

    def close(self) -> None:
        """Wait for pending saves and stop the writer."""
        self.checkpointer.close()

    def resume(self) -> int:
        """Restore the newest committed checkpoint, if any, into everything Accelerate
        prepared and registered; returns the step to continue from (0 when starting fresh)."""
        self._check_prepared()
        _state.own_loader_generators(self.accelerator)
        try:
            state = self.checkpointer.restore()
        except NoCheckpointError:
            logger.info("coci: no committed checkpoint in %s; starting fresh", self.dirpath)
            return 0
        _state.apply(self.accelerator, state, skip=self)
        self.checkpointer.load_state_dict(state.get("coci", {}))
        self._last_step_end = None
        return int(state["step"]) + 1

    # -- Accelerate's register_for_checkpointing ------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The planner's state, for ``accelerator.save_state``."""
        return self.checkpointer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the planner's state, from ``accelerator.load_state``."""
        self.checkpointer.load_state_dict(state_dict)

    # -- internals ------------------------------------------------------------------------

    def _check_prepared(self) -> None:
        acc = self.accelerator
        if not acc._models and not acc._optimizers:
            raise CociError(
                "CociCheckpointer: nothing is prepared yet; call accelerator.prepare(model, "
                "optimizer, ...) before ckpt.step() or ckpt.resume()"
            )

    def _hook_optimizers(self) -> None:
        # The snapshot may overlap the next forward/backward: wait for it before any update.
        for opt in self.accelerator._optimizers:
            inner = getattr(opt, "optimizer", opt)
            if id(inner) not in self._hooked:
                inner.register_step_pre_hook(lambda *_: self.checkpointer.before_update())
                self._hooked.add(id(inner))


def _tensorboard_sink(accelerator: Accelerator, own_dir: Path) -> TensorBoardTelemetry:
    """The panel goes through Accelerate's TensorBoard tracker when the run has one (after
    ``init_trackers``), else to coci's own writer under ``own_dir``."""
    for tracker in accelerator.trackers:
        if type(tracker).__name__ == "TensorBoardTracker":
            return TensorBoardTelemetry(writer=tracker.writer)
    return TensorBoardTelemetry(own_dir)


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


def _rank_group(accelerator: Accelerator) -> RankGroup:
    """Every process writes its share; the session name comes from the main process."""
    if accelerator.num_processes == 1:
        return RankGroup.single()
    return RankGroup(
        accelerator.process_index,
        accelerator.num_processes,
        str(_broadcast(uuid.uuid4().hex[:16])),
    )
