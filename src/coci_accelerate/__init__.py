"""coci for Hugging Face Accelerate: ``CociTracker`` (metrics in) and ``CociCheckpointer``."""

from accelerate.tracking import register_tracker_class

from coci_accelerate.checkpointer import CociCheckpointer
from coci_accelerate.tracker import CociTracker
from coci_core.training import show_by_default

__all__ = ["CociCheckpointer", "CociTracker"]

register_tracker_class(CociTracker)  # so that log_with=["coci"] works too
# the plan line and end-of-run summary show with no logging configured (main process only:
# CociCheckpointer logs them there only)
show_by_default(__name__)
