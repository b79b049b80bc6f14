"""The one door the framework adapters use: a planner and a manager together
(:class:`Checkpointer`), the options every adapter takes, checked once
(:class:`CheckpointOptions`), the plan an adapter tells its user (:class:`PlanOutline`), runs
stopped on purpose (:class:`ValidationHistory`, :func:`is_trial_pruned`), saved random states
checked before they are put back (:func:`check_random_states`), and, for a framework
that restores by path itself, finding and reading step directories (:func:`read_checkpoint`);
an export directory written beside its place and swapped in whole (:func:`directory_beside`).

It is also the public line for the adapters: a ``coci_*`` package imports from coci_core only
the names in the ``__all__`` of this module, of ``coci_core`` and of the other public modules
that docs/architecture.md lists (tests/test_layering.py checks it); the engine's and the
telemetry's internals stay behind them.

How to add a framework adapter: see docs/architecture.md.
"""

from coci_core.engine.format.manifest import MANIFEST_NAME, parse_step_dir, step_dir_name
from coci_core.engine.format.tree import flatten_state
from coci_core.engine.manager import SaveHandle
from coci_core.engine.restore.restore import LoadedCheckpoint
from coci_core.interop.swap import directory_beside
from coci_core.planner.planner import check_planner_state
from coci_core.telemetry.objects import report_sink
from coci_core.telemetry.report import compare_policies, render, render_policies, summarize
from coci_core.telemetry.tensorboard import TensorBoardTelemetry
from coci_core.training.checkpointer import Checkpointer
from coci_core.training.console import show_by_default
from coci_core.training.fits import check_optimizer_fits, model_misfit
from coci_core.training.options import (
    SHARED_ARGUMENTS,
    CheckpointOptions,
    check_bool,
    check_dirpath,
    check_storage_options,
    check_verbose,
    shared_options,
    signature_drift,
)
from coci_core.training.outline import PlanOutline
from coci_core.training.preemption import min_over_ranks
from coci_core.training.random_states import (
    UnfitRandomState,
    check_random_states,
    check_saved_random_states,
)
from coci_core.training.reading import (
    newest_step_dir,
    ranks_read_alike,
    read_checkpoint,
    read_torch_file,
    run_step_dir,
    step_dir_of,
)
from coci_core.training.stopping import ValidationHistory, is_trial_pruned

__all__ = [
    "MANIFEST_NAME",
    "SHARED_ARGUMENTS",
    "CheckpointOptions",
    "Checkpointer",
    "check_planner_state",
    "LoadedCheckpoint",
    "PlanOutline",
    "SaveHandle",
    "TensorBoardTelemetry",
    "UnfitRandomState",
    "ValidationHistory",
    "check_bool",
    "check_dirpath",
    "check_optimizer_fits",
    "model_misfit",
    "check_random_states",
    "check_saved_random_states",
    "check_storage_options",
    "check_verbose",
    "compare_policies",
    "directory_beside",
    "flatten_state",
    "is_trial_pruned",
    "min_over_ranks",
    "newest_step_dir",
    "parse_step_dir",
    "ranks_read_alike",
    "read_checkpoint",
    "read_torch_file",
    "render",
    "render_policies",
    "report_sink",
    "run_step_dir",
    "shared_options",
    "show_by_default",
    "signature_drift",
    "step_dir_name",
    "step_dir_of",
    "summarize",
]
