"""coci for Hugging Face Accelerate: ``CociTracker`` (metrics in) and ``CociCheckpointer``."""

from accelerate.tracking import register_tracker_class

from coci_accelerate.checkpointer import CociCheckpointer
from coci_accelerate.tracker import CociTracker

__all__ = ["CociCheckpointer", "CociTracker"]

register_tracker_class(CociTracker)  # so that log_with=["coci"] works too
