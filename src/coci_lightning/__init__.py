"""coci for PyTorch Lightning: ``Trainer(callbacks=[CociCheckpoint()])``."""

from coci_lightning.callback import CociCheckpoint

__all__ = ["CociCheckpoint"]
