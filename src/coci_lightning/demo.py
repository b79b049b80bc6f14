"""``coci demo``: a Lightning run on scikit-learn's digits, SIGKILLed, resumed, checked, reported.

Three processes train the same small CNN with ``CociCheckpoint`` (policy ``"coci"``): an
uninterrupted run; a run killed with SIGKILL at a random step, as a node failure would (once
its first checkpoint is committed, so that there is one to resume from); and a run that
resumes it. The resumed run must end with weights bit-identical to the uninterrupted
one, having trained on exactly the samples the uninterrupted run trained on after the restored
step. Then the report: planned against actual checkpoints, their costs, the lost work, and the
plan's expected overhead against Daly and CheckFreq.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["run"]

BATCH = 32
TRAIN_SAMPLES = 1500


def _quiet() -> None:
    """No third-party noise in the demo's output: Lightning's info lines (accelerator, tips,
    restoring), and the deprecation warnings its dependencies raise about each other, each by
    its message and module: torchdata's ``StatefulDataLoader`` calls ``torch.set_vital`` and
    Lightning's pytree helper makes a ``LeafSpec``, both deprecated by torch. Every other
    warning, coci's and its dependencies', still shows."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings(
        "ignore", message="'set_vital' is deprecated", category=UserWarning, module="torchdata"
    )
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module="lightning",
    )


def _child(argv: list[str]) -> None:
    """One training process: ``python -m coci_lightning.demo DIR TOTAL RESULT_FILE [KILL FD]``."""
    _quiet()
    import logging

    import lightning.pytorch as pl
    import torch
    from sklearn.datasets import load_digits
    from torchdata.stateful_dataloader import StatefulDataLoader

    from coci_lightning import CociCheckpoint

    directory, total, result_file = argv[0], int(argv[1]), argv[2]
    kill = int(argv[3]) if len(argv) > 3 else None
    marker_fd = int(argv[4]) if len(argv) > 4 else None
    torch.set_num_threads(1)
    pl.seed_everything(2026, verbose=False)
    x, y = load_digits(return_X_y=True)
    images = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    labels = torch.tensor(y)
    train = list(
        zip(
            images[:TRAIN_SAMPLES], labels[:TRAIN_SAMPLES], torch.arange(TRAIN_SAMPLES), strict=True
        )
    )

    class DigitsCNN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Conv2d(1, 16, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(16, 32, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.Flatten(),
                torch.nn.Dropout(0.25),
                torch.nn.Linear(32 * 16, 10),
            )
            self.seen: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            xb, yb, idx = batch
            self.seen.extend(idx.tolist())
            loss = torch.nn.functional.cross_entropy(self.net(xb), yb)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=2e-3)

        def train_dataloader(self) -> Any:
            return StatefulDataLoader(train, batch_size=BATCH, shuffle=True)

    class Progress(pl.Callback):
        """One progress bar for the whole run (on stderr), not one per epoch."""

        def __init__(self) -> None:
            self.bar: Any = None

        def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
            from tqdm import tqdm  # type: ignore[import-untyped]  # (a Lightning dependency)

            self.bar = tqdm(
                total=total,
                initial=trainer.global_step,
                desc="      training",
                unit="step",
                mininterval=0.5,
                dynamic_ncols=True,
            )

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if self.bar is not None:
                self.bar.update(trainer.global_step - self.bar.n)

        def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self.close()

        def close(self) -> None:
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    progress = Progress()

    model = DigitsCNN()
    callback = CociCheckpoint(resume=True, mtbf_s=20.0, keep_last=3)

    class KillPoint(pl.Callback):
        # Step `kill` (or the first after it at which a checkpoint is committed: a kill
        # before any would show no resume) has ended; coci's own batch-end hook (checkpoint
        # callbacks run last) has not run: no save of this step begins, as in a crash right
        # after the update.
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            step = trainer.global_step
            if kill is None or marker_fd is None or step < kill:
                return
            assert callback.checkpointer is not None
            if step < total - 1 and not callback.checkpointer.manager.steps():
                return  # the first save is not committed yet
            progress.close()  # the bar ends where the run is killed
            os.write(marker_fd, f"AT {step}\n".encode())
            os.read(sys.stdin.fileno(), 1)  # the parent SIGKILLs this process here

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=total,
        logger=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        default_root_dir=directory,
        callbacks=[callback, progress, KillPoint()],
        log_every_n_steps=10,
    )
    from tqdm.contrib.logging import logging_redirect_tqdm  # type: ignore[import-untyped]

    with logging_redirect_tqdm(loggers=[logging.getLogger("coci_lightning")]):
        trainer.fit(model)  # coci's own lines are written above the progress bar
    with torch.no_grad():
        model.eval()
        accuracy = (
            (model.net(images[TRAIN_SAMPLES:]).argmax(1) == labels[TRAIN_SAMPLES:])
            .float()
            .mean()
            .item()
        )
    digest = hashlib.sha256()
    for name, t in model.state_dict().items():
        digest.update(name.encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
    Path(result_file).write_text(
        json.dumps({"digest": digest.hexdigest(), "seen": model.seen, "accuracy": accuracy})
    )


def _train(directory: Path, total: int, result: Path, kill: int | None = None) -> int:
    """Train in a new process (killed as :func:`_train_killed` says when ``kill`` is given);
    its exit code."""
    command = [sys.executable, "-m", "coci_lightning.demo", str(directory), str(total), str(result)]
    if kill is None:
        return subprocess.run(command, stdin=subprocess.DEVNULL).returncode
    return _train_killed(directory, total, result, kill)[0]


def _train_killed(directory: Path, total: int, result: Path, kill: int) -> tuple[int, int | None]:
    """Train in a new process and SIGKILL it at step ``kill``, or at the first step after it at
    which a checkpoint is committed (at the latest the step before the last); its exit code
    and the step it was killed at (None: it was not)."""
    command = [sys.executable, "-m", "coci_lightning.demo", str(directory), str(total), str(result)]
    read_fd, write_fd = os.pipe()
    killed = None
    with subprocess.Popen(
        [*command, str(kill), str(write_fd)], stdin=subprocess.PIPE, pass_fds=(write_fd,)
    ) as proc:
        os.close(write_fd)
        with os.fdopen(read_fd) as markers:
            for line in markers:
                if line.startswith("AT "):
                    killed = int(line.split()[1])
                    proc.send_signal(signal.SIGKILL)
                    break
        return proc.wait(), killed


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code (0 when the resumed run matches)."""
    from coci_core import CheckpointManager
    from coci_core.training import compare_policies, render, render_policies, summarize

    total = args.total_steps or 600
    if total < 50:
        print("coci demo: --total-steps must be at least 50")
        return 2
    kill = args.kill_step
    if kill is None:
        kill = random.Random(args.seed).randint(total // 3, 2 * total // 3)
    if not 0 < kill < total:
        print(f"coci demo: --kill-step must be inside the run (1..{total - 1})")
        return 2
    root = Path(args.dir or tempfile.mkdtemp(prefix="coci-demo-"))
    if root.exists() and any(root.iterdir()):
        print(f"coci demo: --dir must be a new or empty directory: {root}")
        return 2
    started = time.perf_counter()
    print(
        f"coci demo: a CNN on scikit-learn's digits, {total} steps, CociCheckpoint(policy='coci');"
        f" files in {root}"
    )
    print("[1/3] the uninterrupted run, for reference")
    if _train(root / "reference", total, root / "reference.json") != 0:
        return 1
    print(
        f"[2/3] the protected run, killed with SIGKILL at step {kill} (or, if coci has not "
        "committed a checkpoint by then, just after its first)"
    )
    code, killed = _train_killed(root / "run", total, root / "killed.json", kill)
    if code != -signal.SIGKILL or killed is None:
        print(f"coci demo: FAILED: the run exited with {code} instead of being killed")
        return 1
    kill = killed
    ckpt_dir = root / "run" / "coci"
    restored = CheckpointManager(ckpt_dir, keep_last=None).latest_step()
    steps = CheckpointManager(ckpt_dir).steps()
    print(f"      killed at step {kill}; committed checkpoints at the kill: {steps}")
    print("[3/3] a new process resumes the run")
    if _train(root / "run", total, root / "resumed.json") != 0:
        return 1
    reference = json.loads((root / "reference.json").read_text())
    resumed = json.loads((root / "resumed.json").read_text())
    resumed_from = restored or 0
    same_weights = resumed["digest"] == reference["digest"]
    epochs, rest = divmod(resumed_from, -(-TRAIN_SAMPLES // BATCH))
    consumed = epochs * TRAIN_SAMPLES + rest * BATCH  # samples trained on before the restored step
    same_samples = resumed["seen"] == reference["seen"][consumed:]
    print()
    summary = summarize(ckpt_dir)
    # one expected overhead per policy: the table below (the plan's own figure over its
    # re-planned horizon would be a second, different number for the same policy)
    print(render(summary, tensorboard_dir=str(root / "run"), with_overhead=False))
    print()
    print(
        f"each policy's plan over this run's {total} steps, made afresh with the costs "
        "measured by its end, and its expected overhead (the run itself followed coci's plan "
        "as it measured them: the checkpoints planned above; the final save not counted):"
    )
    print(render_policies(compare_policies(summary, total)))
    print()
    # the work lost as the report and the tab count it (the telemetry has the step reached)
    lost = sum(summary.lost_steps)
    noun = "step" if lost == 1 else "steps"
    print(f"killed at step {kill}, resumed from step {resumed_from}: {lost} {noun} of work lost")
    print(f"final weights bit-identical to the uninterrupted run: {same_weights}")
    print(f"each remaining sample trained on exactly once, in the same order: {same_samples}")
    print(
        f"test accuracy {resumed['accuracy']:.4f} (uninterrupted {reference['accuracy']:.4f}); "
        f"demo took {time.perf_counter() - started:.0f} s"
    )
    print(
        f"files in {root}: reference/ (the uninterrupted run), run/coci/ (the killed and "
        "resumed run's checkpoints, telemetry.jsonl, tensorboard/)"
    )
    return 0 if same_weights and same_samples else 1


if __name__ == "__main__":
    _child(sys.argv[1:])
