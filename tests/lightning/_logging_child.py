"""A Lightning run with no logging configured, for the tests of what its user reads.

Run as ``python -m tests.lightning._logging_child DIR DEVICES [basicConfig]``: CociCheckpoint
with ``verbose=True`` saves every 5 of 12 steps, on 1 process or with ``strategy="ddp"`` on 2
(gloo; Lightning starts rank 1 by running the same command, its output going to the same
stderr). With ``basicConfig`` the script calls ``logging.basicConfig(level=INFO)`` after its
imports, as a user configuring logging would.
"""

from __future__ import annotations

import logging
import sys

import lightning.pytorch as pl

from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel


def main() -> None:
    directory, devices = sys.argv[1], int(sys.argv[2])
    if sys.argv[3:] == ["basicConfig"]:
        logging.basicConfig(level=logging.INFO)
    pl.seed_everything(3, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=12,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=directory,
        callbacks=[CociCheckpoint(policy="every_n_steps", every_n_steps=5, verbose=True)],
    )
    trainer.fit(DigitsModel(batch_size=8, distributed=devices > 1))


if __name__ == "__main__":
    main()
