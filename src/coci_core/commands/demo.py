"""``coci demo``: train on scikit-learn's digits, SIGKILL the trainer mid-persist, resume exactly.

The parent process runs an uninterrupted reference, then a trainer that saves every few steps;
the trainer's storage pauses inside the persist of one step (data written, manifest not yet),
says so on stdout, and the parent kills it with SIGKILL right there. A new process restores the
newest committed step and trains to the end; its final weights must equal the reference's bit
for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from coci_core.engine.format.manifest import MANIFEST_NAME
from coci_core.engine.manager import CheckpointManager
from coci_core.errors import NoCheckpointError
from coci_core.storage import LocalStorage
from coci_core.telemetry import TELEMETRY_FILE, Event, JsonlTelemetry, SaveEvent

__all__ = ["run", "run_child", "train"]

PAUSE_MARK = "COCI-DEMO-PERSISTING"
PAUSE_STAGES = ("data", "manifest", "publish")


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: nothing is downloaded

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


class _PausingStorage(LocalStorage):
    """Local storage that stops forever at one point inside the persist of ``pause_step``."""

    def __init__(self, root: str, pause_step: int, stage: str) -> None:
        super().__init__(root)
        self._pause_dir = f"step-{pause_step:010d}"
        self._stage = stage

    def _pause(self) -> None:
        print(f"{PAUSE_MARK} {self._stage}", flush=True)
        os.read(sys.stdin.fileno(), 1)  # the parent never writes: we wait here for SIGKILL
        raise SystemExit("coci demo: the parent did not kill the trainer")

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        if path.startswith(self._pause_dir):
            if self._stage == "data" and not path.endswith(MANIFEST_NAME):
                first = next(iter(chunks))
                super().write_file(path, [first[: len(first) // 2]])
                self._pause()
            if self._stage == "manifest" and path.endswith(MANIFEST_NAME):
                self._pause()
        return super().write_file(path, chunks, aligned=aligned)

    def publish(self, staging: str, final: str) -> None:
        if self._stage == "publish" and final == self._pause_dir:
            self._pause()
        super().publish(staging, final)


def train(
    directory: str | None,
    *,
    total_steps: int,
    save_every: int,
    seed: int = 0,
    pause_step: int | None = None,
    pause_stage: str = "manifest",
    block: bool = True,
) -> dict[str, Any]:
    """Train the digits MLP, saving every ``save_every`` steps, resuming from ``directory``.

    Returns the final parameters' bytes as hex digests and the save statistics. Training uses
    one intra-op thread, so that the result does not depend on the machine's load.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(directory, total_steps, save_every, seed, pause_step, pause_stage, block)
    finally:
        torch.set_num_threads(threads)


def _train(
    directory: str | None,
    total_steps: int,
    save_every: int,
    seed: int,
    pause_step: int | None,
    pause_stage: str,
    block: bool,
) -> dict[str, Any]:
    torch.manual_seed(seed)
    x, y = _digits()
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    events: list[SaveEvent] = []

    def collect(event: Event) -> None:
        if isinstance(event, SaveEvent):
            events.append(event)

    manager = None
    telemetry = None
    start = 0
    restored = None
    if directory is not None:
        storage = (
            _PausingStorage(directory, pause_step, pause_stage)
            if pause_step is not None
            else LocalStorage(directory)
        )
        # what `coci report DIR` reads: the saves, the restore and how far each process got
        telemetry = JsonlTelemetry(Path(directory) / TELEMETRY_FILE)
        manager = CheckpointManager(storage, keep_last=3, listeners=[collect, telemetry])
        try:
            state = manager.restore(into={"model": model, "optim": optimizer})
            torch.set_rng_state(state["rng"])
            start = int(state["step"])
            restored = start
        except NoCheckpointError:
            pass
    for step in range(start, total_steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        idx = torch.randint(0, len(x), (64,), generator=g)
        model.train()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        if manager is not None:
            manager.before_update()
        optimizer.step()
        done = step + 1
        if telemetry is not None:
            telemetry.record_progress(done)
        if manager is not None and done % save_every == 0:
            state = {
                "model": model.state_dict(),
                "optim": optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "step": done,
            }
            manager.save(done, state, block=block)
    if manager is not None:
        manager.close()
    if telemetry is not None:
        telemetry.close()
    model.eval()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    return {
        "digests": {k: _digest(v) for k, v in model.state_dict().items()},
        "accuracy": accuracy,
        "restored_step": restored,
        "saves": [
            {
                "step": e.step,
                "outcome": e.outcome,
                "stall_s": e.stall_s,
                "time_to_durable_s": e.time_to_durable_s,
                "bytes": e.bytes_written,
                "first": e.first_save,
            }
            for e in events
        ],
    }


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m coci_core.commands.demo")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--total-steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--pause-step", type=int)
    parser.add_argument("--pause-stage", choices=PAUSE_STAGES, default="manifest")
    parser.add_argument("--no-block", action="store_true")
    args = parser.parse_args(argv)
    result = train(
        args.dir,
        total_steps=args.total_steps,
        save_every=args.save_every,
        pause_step=args.pause_step,
        pause_stage=args.pause_stage,
        block=not args.no_block,
    )
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def run_child(args: list[str], *, kill_on_pause: bool) -> tuple[int, dict[str, Any] | None, str]:
    """Run the trainer in a new process; SIGKILL it when it says it is paused in a persist."""
    result = None
    paused_at = ""
    with subprocess.Popen(
        [sys.executable, "-m", "coci_core.commands.demo", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        if proc.stdout is None:
            raise AssertionError("no stdout pipe")
        for line in proc.stdout:
            if line.startswith(PAUSE_MARK) and kill_on_pause:
                paused_at = line.split()[-1]
                proc.send_signal(signal.SIGKILL)
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
        returncode = proc.wait()
    return returncode, result, paused_at


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed options; returns the exit code."""
    args.total_steps = args.total_steps or 300
    args.kill_step = args.kill_step or args.total_steps // 2
    args.save_every = args.save_every or 25
    if (
        args.save_every < 1
        or args.kill_step % args.save_every
        or not 0 < args.kill_step < args.total_steps
    ):
        print("coci demo: --kill-step must be a multiple of --save-every inside the run")
        return 2
    directory = args.dir or tempfile.mkdtemp(prefix="coci-demo-")
    Path(directory).mkdir(parents=True, exist_ok=True)
    if os.listdir(directory):
        print(f"coci demo: --dir must be a new or empty directory: {directory}")
        return 2
    print(f"coci demo: digits MLP, {args.total_steps} steps, a save every {args.save_every}")
    started = time.perf_counter()
    reference = train(None, total_steps=args.total_steps, save_every=args.save_every)
    print(
        f"  uninterrupted run: accuracy {reference['accuracy']:.4f} "
        f"({time.perf_counter() - started:.1f} s)"
    )

    common = [
        "--dir",
        directory,
        "--total-steps",
        str(args.total_steps),
        "--save-every",
        str(args.save_every),
    ]
    code, _, paused_at = run_child(
        [*common, "--pause-step", str(args.kill_step)], kill_on_pause=True
    )
    if code != -signal.SIGKILL:
        print(f"  FAILED: the trainer exited with {code} instead of being killed")
        return 1
    leftovers = [n for n in os.listdir(directory) if ".coci-tmp-" in n]
    steps = CheckpointManager(directory, keep_last=None).steps()
    print(
        f"  trainer killed with SIGKILL during the persist of step {args.kill_step} "
        f"(stage: {paused_at}); committed steps: {steps}; unpublished leftover: {leftovers}, "
        "which the next run's first save removes"
    )

    code, resumed, _ = run_child(common, kill_on_pause=False)
    if code != 0 or resumed is None:
        print(f"  FAILED: the resumed trainer exited with {code}")
        return 1
    saves = resumed["saves"]
    steady = [s for s in saves if not s["first"]] or saves
    from coci_core.telemetry.report import summarize

    lost = sum(summarize(directory).lost_steps)  # as `coci report` counts it
    print(
        f"  resumed in a new process from step {resumed['restored_step']} ({lost} steps of "
        f"work lost and redone); saved steps {[s['step'] for s in saves]}"
    )
    print(
        f"  stall per save (median, steady state): "
        f"{1e3 * statistics.median(s['stall_s'] for s in steady):.2f} ms; "
        f"time to durable (median): "
        f"{1e3 * statistics.median(s['time_to_durable_s'] for s in steady):.2f} ms; "
        f"bytes per checkpoint: {saves[-1]['bytes']:,}"
    )
    same = resumed["digests"] == reference["digests"]
    print(
        f"  final weights bit-identical to the uninterrupted run: {same}; "
        f"accuracy {resumed['accuracy']:.4f}"
    )
    print(f"  checkpoints are in {directory} (see them with: coci report {directory})")
    return 0 if same and resumed["restored_step"] == steps[-1] else 1


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
