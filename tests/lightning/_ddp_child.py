"""Two-process DDP training for kill tests.

Run as ``python -m tests.lightning._ddp_child DIR TOTAL [KILL]``; Lightning starts rank 1 by
running the same command. With KILL, rank 0 prints ``AT <step>`` after that step and every rank
waits to be killed; at the end every rank prints ``RESULT <json>`` (rank, weights digest, the
sample indices it trained on).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import lightning.pytorch as pl

from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel, digest


class _StopHere(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            if trainer.is_global_zero:
                print(f"AT {self.step}", flush=True)
            threading.Event().wait()  # every rank stops here until the process group is killed


def main() -> None:
    directory, total = sys.argv[1], int(sys.argv[2])
    kill = int(sys.argv[3]) if len(sys.argv) > 3 else None
    pl.seed_everything(11, verbose=False)
    model = DigitsModel(batch_size=8, distributed=True)
    callbacks: list[pl.Callback] = [
        CociCheckpoint(policy="every_n_steps", every_n_steps=5, resume=True, block=True)
    ]
    if kill is not None:
        callbacks.append(_StopHere(kill))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=total,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=directory,
        callbacks=callbacks,
        log_every_n_steps=1,
    )
    trainer.fit(model)
    result = {"rank": trainer.global_rank, "digest": digest(model), "seen": model.seen}
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
