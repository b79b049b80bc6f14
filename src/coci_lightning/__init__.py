"""coci for PyTorch Lightning: ``Trainer(callbacks=[CociCheckpoint()])``."""

from coci_lightning._resume import install_last_resolution
from coci_lightning.callback import CociCheckpoint

# ckpt_path="last" and coci step directories work for every Trainer entry point once
# coci_lightning is imported, with or without a CociCheckpoint made (docs/lightning.md).
install_last_resolution()

__all__ = ["CociCheckpoint"]
