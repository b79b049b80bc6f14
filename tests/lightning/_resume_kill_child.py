"""One of two Lightning DDP ranks (gloo, started by the test with ``LOCAL_RANK``) whose partner
is SIGKILLed during the resume (see test_resume_agreement.py): both fit 2 steps with a
``CociCheckpoint`` (step 2 saved); a second fit resumes (``ckpt_path="last"``); rank
``cfg["victim"]`` prints ``KILLME`` when it is about to say which step it read (with
``cfg["at"] == "read"``: when its read begins, after the callback's setup agreed that every rank
reads), and waits to be killed. With ``cfg["empty"]``, the victim's ``CociCheckpoint`` names
another, empty directory instead (and rank 0 committed a step with a plain manager, not a
fit: both fail at the callback's setup, before reading). With ``cfg["lightning_file"]``, no
coci step is committed and rank 0's own directory (a node's disk) holds an
``OnExceptionCheckpoint`` file, rank 1's none. Each prints ``RESULT`` with its error and how long
its resume took.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from coci_core import CheckpointManager, RankGroup
from coci_core.engine import agreement
from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel


def _trainer(
    directory: str, steps: int, dirpath: str | None = None, *extra: pl.Callback
) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=directory,
        callbacks=[
            CociCheckpoint(dirpath=dirpath, policy="every_n_steps", every_n_steps=2, block=True),
            *extra,
        ],
    )


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    with contextlib.suppress(ImportError):
        from coci_core.engine import pulse

        pulse.RANK_SILENT_S = cfg["silent_s"]  # the knob, shortened for the test
    pl.seed_everything(11, verbose=False)
    rank = int(os.environ["RANK"])
    dirpath = None
    extra: list[pl.Callback] = []
    if cfg.get("empty"):  # the victim sees another, empty directory; rank 0 a committed step
        if rank == 0:
            with CheckpointManager(os.path.join(cfg["dir"], "coci"), group=RankGroup.single()) as m:
                m.save(2, {"w": torch.zeros(2)}).wait()
        else:
            dirpath = os.path.join(cfg["dir"], "elsewhere")
    elif cfg.get("lightning_file"):  # no coci step; an OnExceptionCheckpoint file on node 0
        node = os.path.join(cfg["dir"], f"node{rank}")
        os.makedirs(node)
        if rank == 0:
            with open(os.path.join(node, "on_exception.ckpt"), "wb") as f:
                f.write(b"a crashed run's file")
        extra.append(OnExceptionCheckpoint(dirpath=node))
    else:
        _trainer(cfg["dir"], 2).fit(DigitsModel(batch_size=8, distributed=True))
    if rank == cfg["victim"] and cfg.get("at") == "read":
        # after the callback's setup agreed that every rank reads: killed before the read
        for_job = agreement.RestoreAgreement.for_job.__func__  # type: ignore[attr-defined]

        def stop_read(cls: Any, **kwargs: Any) -> Any:
            print("KILLME", flush=True)
            time.sleep(600)
            return for_job(cls, **kwargs)

        agreement.RestoreAgreement.for_job = classmethod(stop_read)  # type: ignore[assignment]
    elif rank == cfg["victim"] and not cfg.get("empty") and not cfg.get("lightning_file"):
        exchange = agreement.RestoreAgreement.exchange

        def stop(self: Any, report: dict[str, Any]) -> Any:
            print("KILLME", flush=True)
            time.sleep(600)
            return exchange(self, report)

        agreement.RestoreAgreement.exchange = stop  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        model = DigitsModel(batch_size=8, distributed=True)
        _trainer(cfg["dir"], 4, dirpath, *extra).fit(model, ckpt_path="last")
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
