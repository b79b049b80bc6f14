"""coci for the Hugging Face ``transformers.Trainer``: ``CociCallback``."""

from coci_core.training import show_by_default
from coci_transformers.callback import CociCallback

__all__ = ["CociCallback"]

# the plan line and end-of-run summary show with no logging configured (main process only)
show_by_default(__name__)
