"""A Lightning training process for kill tests.

Run as ``python -m tests.lightning._child DIR TOTAL [KILL]``.

With KILL it prints ``AT <step>`` after that step and waits to be killed; at the end it prints
``RESULT <json>`` with the final weights' digest and the sample indices this process trained on.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning.pytorch as pl

from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel, digest


class _StopHere(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            print(f"AT {self.step}", flush=True)
            os.read(sys.stdin.fileno(), 1)  # the parent never writes: wait for SIGKILL
            raise SystemExit("not killed")


def main() -> None:
    directory, total = sys.argv[1], int(sys.argv[2])
    kill = int(sys.argv[3]) if len(sys.argv) > 3 else None
    pl.seed_everything(7, verbose=False)
    model = DigitsModel()
    callbacks: list[pl.Callback] = [
        CociCheckpoint(policy="every_n_steps", every_n_steps=6, resume=True)
    ]
    if kill is not None:
        callbacks.append(_StopHere(kill))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=total,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=directory,
        callbacks=callbacks,
        log_every_n_steps=1,
    )
    trainer.fit(model)
    print("RESULT " + json.dumps({"digest": digest(model), "seen": model.seen}), flush=True)


if __name__ == "__main__":
    main()
