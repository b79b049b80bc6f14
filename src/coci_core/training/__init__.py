"""The one door the framework adapters use: a planner and a manager together
(:class:`Checkpointer`), the options every adapter takes, checked once
(:class:`CheckpointOptions`), the plan an adapter tells its user (:class:`PlanOutline`), runs
stopped on purpose (:class:`ValidationHistory`, :func:`is_trial_pruned`), and, for a framework
that restores by path itself, finding and reading step directories (:func:`read_checkpoint`).

How to add a framework adapter: see docs/architecture.md.
"""

from coci_core.engine.manager import SaveHandle
from coci_core.engine.manifest import step_dir_name
from coci_core.training.checkpointer import Checkpointer
from coci_core.training.options import (
    SHARED_ARGUMENTS,
    CheckpointOptions,
    check_bool,
    check_storage_options,
    check_verbose,
    shared_options,
    signature_drift,
)
from coci_core.training.outline import PlanOutline
from coci_core.training.reading import (
    newest_step_dir,
    read_checkpoint,
    read_torch_file,
    run_step_dir,
    step_dir_of,
)
from coci_core.training.stopping import ValidationHistory, is_trial_pruned

__all__ = [
    "SHARED_ARGUMENTS",
    "CheckpointOptions",
    "Checkpointer",
    "PlanOutline",
    "SaveHandle",
    "ValidationHistory",
    "check_bool",
    "check_storage_options",
    "check_verbose",
    "is_trial_pruned",
    "newest_step_dir",
    "read_checkpoint",
    "read_torch_file",
    "run_step_dir",
    "shared_options",
    "signature_drift",
    "step_dir_name",
    "step_dir_of",
]
