"""A loop in the shape of Accelerate's own checkpointing example (examples/by_feature/
checkpointing.py): ``overall_step`` counts optimizer steps after the update, labels the
checkpoint, and on resume the first ``overall_step % len(dataloader)`` batches of the epoch are
skipped with ``accelerator.skip_first_batches``; a seedable sampler, no stateful loader."""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

from coci_accelerate import CociCheckpointer

SAMPLES = 96
BATCH = 8
STEPS_PER_EPOCH = SAMPLES // BATCH


class Stop(Exception):
    """Raised by the loop at ``kill_at`` (a crash mid-epoch)."""


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(SAMPLES, 8, generator=g),
        torch.randint(0, 3, (SAMPLES,), generator=g),
        torch.arange(SAMPLES),
    )


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_like_example(
    directory: str,
    *,
    epochs: int = 3,
    kill_at: int | None = None,
    on_kill: Any = None,
    every_n_steps: int = 4,
    explicit: bool = True,
    resume: bool = True,
    seen: list[int] | None = None,
    ballast_mb: int = 0,
    skip: bool = True,
    stateful: bool = False,
    **ckpt_options: Any,
) -> dict[str, Any]:
    """Train; ``explicit``: ``ckpt.step(overall_step)``, else ``ckpt.step()``; ``resume``:
    call ``ckpt.resume()`` first (else start at 0). After step ``kill_at``: ``on_kill()``, or
    raise ``Stop``. ``ballast_mb``: the model carries a random buffer of that size (a large
    state to save, not trained). ``skip``: a resumed epoch skips the batches it gave out
    (``accelerator.skip_first_batches``), else gives them again. ``stateful``: the loader is
    stateful (``use_stateful_dataloader=True``), which resumes mid-epoch by itself."""
    set_seed(7)
    accelerator = Accelerator(
        cpu=True,
        project_dir=directory,
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, use_stateful_dataloader=stateful
        ),
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3)
    )
    if ballast_mb:
        g = torch.Generator().manual_seed(1)
        model.register_buffer("ballast", torch.randn(ballast_mb * 2**18, generator=g))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
    train_dataloader = DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    model, optimizer, train_dataloader, scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, scheduler
    )
    ckpt = CociCheckpointer(
        accelerator,
        policy="every_n_steps",
        every_n_steps=every_n_steps,
        keep_last=None,
        **ckpt_options,
    )
    overall_step = ckpt.resume() if resume else 0
    start = overall_step
    starting_epoch = overall_step // len(train_dataloader)
    resume_step = overall_step - starting_epoch * len(train_dataloader)
    seen = [] if seen is None else seen
    try:
        for epoch in range(starting_epoch, epochs):
            model.train()
            if epoch == starting_epoch and resume_step and skip:
                active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
            else:
                active_dataloader = train_dataloader
            for x, y, idx in active_dataloader:
                seen.extend(idx.tolist())
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                overall_step += 1
                if explicit:
                    ckpt.step(overall_step, loss=loss.item())
                else:
                    ckpt.step(loss=loss.item())
                if overall_step == kill_at:
                    if on_kill is None:
                        raise Stop
                    on_kill()
    finally:
        ckpt.close()
    return {"digest": digest(accelerator.unwrap_model(model)), "seen": seen, "start": start}


def _wait_for_kill(step: int) -> None:
    print(f"AT {step}", flush=True)
    threading.Event().wait()


def _hold_upload(step: int) -> None:
    print(f"UPLOADING {step}", flush=True)
    threading.Event().wait()


def main() -> None:
    """``python -m tests.accelerate.example DIR EPOCHS [KILL]``: with KILL, prints ``AT KILL``
    after that step and waits to be killed; at the end prints ``RESULT <json>``.

    Options: ``--dirpath URL`` checkpoints to an fsspec URL (``s3://bucket/run``), reached with
    ``--storage-options JSON`` or else the environment's ``AWS_*`` variables;
    ``--ballast-mb MB`` (see :func:`train_like_example`); ``--compression``;
    ``--hold-upload STEP``: the S3 upload of that step's data prints ``UPLOADING STEP`` after
    two parts and waits to be killed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("epochs", type=int)
    parser.add_argument("kill", type=int, nargs="?")
    parser.add_argument("--dirpath", default=None)
    parser.add_argument("--storage-options", type=json.loads, default=None)
    parser.add_argument("--ballast-mb", type=int, default=0)
    parser.add_argument("--compression", default="auto")
    parser.add_argument("--hold-upload", type=int, default=None)
    args = parser.parse_args()
    if args.hold_upload is not None:
        from coci_core.engine.format.manifest import step_dir_name
        from tests.harness.faults import hold_s3_uploads

        step = args.hold_upload
        hold_s3_uploads(step_dir_name(step), 2, lambda: _hold_upload(step))
    result = train_like_example(
        args.directory,
        epochs=args.epochs,
        kill_at=args.kill,
        on_kill=lambda: _wait_for_kill(args.kill or 0),
        ballast_mb=args.ballast_mb,
        dirpath=args.dirpath,
        storage_options=args.storage_options,
        compression=args.compression,
    )
    print("RESULT " + json.dumps({"rank": 0, **result}), flush=True)


if __name__ == "__main__":
    main()
