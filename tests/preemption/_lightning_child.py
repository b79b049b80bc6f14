"""A Lightning run (tests/lightning/models.py's DigitsModel) with CociCheckpoint's
``preemption=`` option, for the preemption tests.

Run as ``python -m tests.preemption._lightning_child DIR TOTAL [--notice AT] [--preemption P]
[--ddp] [--reference DIR]``: checkpoints every 2 steps to ``DIR/coci`` (resuming from the
newest). ``--notice AT``: before the step after step AT, the rank given by ``--rank``
(default 0) prints ``READY <pid>`` and reads a line from its stdin (the parent sends SIGTERM
first, then the line), and on ``Preempted`` every rank prints ``PREEMPTED <json>`` before the
exception ends the process. Else it trains to TOTAL and prints ``RESULT <json>`` (rank, the
step it started from, the weights' digest); ``--reference DIR`` then trains a run never
stopped to TOTAL in DIR and prints ``REFERENCE <json>``. ``--ddp``: two processes over gloo
(Lightning starts rank 1 by running the same command).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import lightning.pytorch as pl

from coci_core import Preempted
from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel, digest


class _Notice(pl.Callback):
    """Before the step after step ``at``: rank ``rank`` says READY and waits for its line."""

    def __init__(self, at: int, rank: int) -> None:
        self.at, self.rank = at, rank

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at and trainer.global_rank == self.rank:
            print(f"READY {os.getpid()}", flush=True)
            sys.stdin.readline()  # the parent sent SIGTERM before this line


class _Start(pl.Callback):
    start = -1

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.start = trainer.global_step


def _fit(directory: str, total: int, args: argparse.Namespace, notice: bool) -> dict[str, Any]:
    pl.seed_everything(7, verbose=False)
    model = DigitsModel(batch_size=8, distributed=args.ddp)
    start = _Start()
    callbacks: list[pl.Callback] = [
        CociCheckpoint(
            policy="every_n_steps", every_n_steps=2, resume=True, preemption=args.preemption
        ),
        start,
    ]
    if notice:
        callbacks.append(_Notice(args.notice, args.rank))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 if args.ddp else 1,
        strategy="ddp" if args.ddp else "auto",
        max_steps=total,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=directory,
        callbacks=callbacks,
        log_every_n_steps=1,
    )
    try:
        trainer.fit(model)
    except Preempted as stop:
        result = {"rank": trainer.global_rank, "saved": stop.step, "code": stop.code}
        result["should_stop"] = trainer.should_stop
        print("PREEMPTED " + json.dumps(result), flush=True)
        raise
    return {"rank": trainer.global_rank, "start": start.start, "digest": digest(model)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("total", type=int)
    parser.add_argument("--notice", type=int, default=None)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--preemption", default="auto")
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--reference", default=None)
    args = parser.parse_args()
    result = _fit(args.directory, args.total, args, notice=args.notice is not None)
    print("RESULT " + json.dumps(result), flush=True)
    if args.reference is not None:
        reference = _fit(args.reference, args.total, args, notice=False)
        print("REFERENCE " + json.dumps(reference), flush=True)


if __name__ == "__main__":
    main()
