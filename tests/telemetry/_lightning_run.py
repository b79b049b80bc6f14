"""A Lightning run for tests/telemetry/test_numbers.py: ``python -m
tests.telemetry._lightning_run ROOT TOTAL KILL [OPTIONS]``, waiting on stdin at step KILL (or,
with ``kill_after_a_save``, at the first step after a committed save) to be SIGKILLed there."""

import json
import sys
from typing import Any

import lightning.pytorch as pl

from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel


def main() -> None:
    root, total, kill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    after_save = options.pop("kill_after_a_save", False)
    ckpt = CociCheckpoint(resume=True, **options)

    class KillPoint(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            step = trainer.global_step
            saved = step > kill and bool(ckpt.checkpointer.manager.steps())
            if saved if after_save else step == kill:
                print(f"AT {step}", flush=True)
                sys.stdin.readline()  # SIGKILLed here

    pl.seed_everything(0, verbose=False)
    pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[ckpt, KillPoint()],
        max_steps=total,
    ).fit(DigitsModel())


if __name__ == "__main__":
    main()
