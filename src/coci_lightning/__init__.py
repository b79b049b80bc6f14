"""coci for PyTorch Lightning: ``Trainer(callbacks=[CociCheckpoint()])``."""

from coci_core.training import show_by_default
from coci_lightning._habits import install_checkpointing_message
from coci_lightning._resume import install_last_resolution
from coci_lightning.callback import CociCheckpoint

# ckpt_path="last" and coci step directories work for every Trainer entry point once
# coci_lightning is imported, with or without a CociCheckpoint made (docs/lightning.md).
install_last_resolution()
# Trainer(enable_checkpointing=False) beside a CociCheckpoint: an error in coci's words
install_checkpointing_message()
# coci's plan line and end-of-run summary show as Lightning's own messages do, with no logging
# configured (on rank 0: the callback logs them there only)
show_by_default(__name__)

__all__ = ["CociCheckpoint"]
