"""The one door the framework adapters use: a planner and a manager together
(:class:`Checkpointer`), the checks every adapter makes of its arguments, and the few engine
names an adapter needs to find and read checkpoints (Lightning restores through its own path).
"""

from coci_core.engine.compress import check_policy
from coci_core.engine.group import RankGroup
from coci_core.engine.inplace import InPlaceTargets
from coci_core.engine.manager import SaveHandle
from coci_core.engine.manifest import MANIFEST_NAME, parse_step_dir, step_dir_name
from coci_core.engine.restore import (
    LoadedCheckpoint,
    newest_first,
    restore_newest,
    resume_order,
)
from coci_core.planner.policies import SavePolicy
from coci_core.storage import is_url, open_storage
from coci_core.training.checkpointer import Checkpointer
from coci_core.training.options import (
    CheckpointOptions,
    check_storage_options,
    check_verbose,
    shared_options,
)

__all__ = [
    "MANIFEST_NAME",
    "CheckpointOptions",
    "Checkpointer",
    "InPlaceTargets",
    "LoadedCheckpoint",
    "RankGroup",
    "SaveHandle",
    "SavePolicy",
    "check_policy",
    "check_storage_options",
    "check_verbose",
    "is_url",
    "newest_first",
    "open_storage",
    "parse_step_dir",
    "restore_newest",
    "resume_order",
    "shared_options",
    "step_dir_name",
]
