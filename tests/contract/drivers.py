"""The adapter contract's drivers: one small class per framework adapter, each a thin wrapper
over that framework's existing training child, so that one suite (test_contract.py) runs every
adapter alike.

A driver says which adapter it drives, how big an epoch of its child's run is, the command that
trains the child to ``total`` steps with the adapter made from given options (any of the shared
ones, ``dirpath`` and ``storage_options`` included, as JSON; killed at step ``kill_at`` if given:
the child prints ``AT <step>`` there and waits to be killed; resumed from the newest committed
checkpoint if ``resume``; in ``processes`` processes, gloo, each writing its share), and how to
read process 0's ``RESULT <json>`` line as an :class:`Outcome`. A new adapter writes one more
driver here and adds it to :data:`DRIVERS`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from coci_accelerate import CociCheckpointer
from coci_lightning import CociCheckpoint
from coci_transformers import CociCallback
from tests.harness.processes import free_port, module
from tests.harness.results import result_rows


@dataclass(frozen=True)
class Outcome:
    """What a training child reports at its end (process 0's)."""

    state: str  # a digest of the model's and the optimizer's final state
    seen: list[int]  # the index of each sample this process trained on, in order
    start: int  # the step it started from: 0, or the step of the checkpoint it resumed
    history: Any  # what the framework records of the run that a resumed run repeats, or None


class AdapterDriver(Protocol):
    """How the contract runs one framework adapter."""

    name: str  # the framework, as the test ids show it
    adapter: type  # the adapter class, which takes the shared options
    batch: int  # samples per step
    steps_per_epoch: int

    def command(
        self,
        directory: Path,
        total: int,
        options: dict[str, Any],
        *,
        kill_at: int | None = None,
        resume: bool = False,
        processes: int = 1,
    ) -> list[str]:
        """The command that trains in ``directory`` (checkpoints in ``directory / "coci"``) to
        ``total`` steps, the adapter made with ``options``, in ``processes`` processes."""
        ...

    def outcome(self, stdout: str) -> Outcome:
        """The child's result, read from its output."""
        ...


def _launch(name: str, processes: int, args: list[str]) -> list[str]:
    """``python -m name args``, or torchrun of it in ``processes`` processes on a free port."""
    if processes == 1:
        return module(name, *args)
    run = ["--nproc-per-node", str(processes), "--master-port", str(free_port())]
    return module("torch.distributed.run", *run, "-m", name, *args)


def _result(stdout: str) -> dict[str, Any]:
    rows = [row for row in result_rows(stdout) if row.get("rank", 0) == 0]
    assert len(rows) == 1, stdout[-2000:]
    return rows[0]


class Lightning:
    """``CociCheckpoint`` on a Lightning Trainer: tests/lightning/_child.py (always resumes)."""

    name = "lightning"
    adapter = CociCheckpoint
    batch = 16
    steps_per_epoch = 16

    def command(
        self,
        directory: Path,
        total: int,
        options: dict[str, Any],
        *,
        kill_at: int | None = None,
        resume: bool = False,
        processes: int = 1,
    ) -> list[str]:
        kill = [] if kill_at is None else [str(kill_at)]
        coci = ["--coci", json.dumps(options), "--devices", str(processes)]
        return module("tests.lightning._child", str(directory), str(total), *kill, *coci)

    def outcome(self, stdout: str) -> Outcome:
        row = _result(stdout)
        return Outcome(row["state"], row["seen"], row["start"], None)


class Accelerate:
    """``CociCheckpointer`` in an Accelerate loop: tests/accelerate/loop.py (always resumes)."""

    name = "accelerate"
    adapter = CociCheckpointer
    batch = 16
    steps_per_epoch = 16  # 256 digits

    def command(
        self,
        directory: Path,
        total: int,
        options: dict[str, Any],
        *,
        kill_at: int | None = None,
        resume: bool = False,
        processes: int = 1,
    ) -> list[str]:
        kill = [] if kill_at is None else [str(kill_at)]
        flags = ["--coci", json.dumps(options), "--samples", str(self.steps_per_epoch * self.batch)]
        args = [str(directory), str(total), *kill, *flags]
        return _launch("tests.accelerate.loop", processes, args)

    def outcome(self, stdout: str) -> Outcome:
        row = _result(stdout)
        return Outcome(row["state"], row["seen"], row["start"], None)


class Transformers:
    """``CociCallback`` on a ``transformers.Trainer``: tests/transformers/run.py; its history
    is the Trainer's log history without the losses (a loss logged after a resume averages the
    steps since the resume, as with the Trainer's own checkpoints)."""

    name = "transformers"
    adapter = CociCallback
    batch = 4
    steps_per_epoch = 8

    def command(
        self,
        directory: Path,
        total: int,
        options: dict[str, Any],
        *,
        kill_at: int | None = None,
        resume: bool = False,
        processes: int = 1,
    ) -> list[str]:
        kill = [] if kill_at is None else [str(kill_at)]
        flags = ["--coci", json.dumps(options), *(["--resume"] if resume else [])]
        args = [str(directory), str(total), *kill, *flags]
        return _launch("tests.transformers.run", processes, args)

    def outcome(self, stdout: str) -> Outcome:
        row = _result(stdout)
        history = [
            {k: v for k, v in entry.items() if k not in ("loss", "train_loss")}
            for entry in row["log"]
        ]
        return Outcome(row["digest"], row["seen"], row["start"] or 0, history)


DRIVERS: list[AdapterDriver] = [Lightning(), Accelerate(), Transformers()]
