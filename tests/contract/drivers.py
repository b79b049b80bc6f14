"""The adapter contract's drivers: one small class per framework adapter, each a thin wrapper
over that framework's existing training child, so that one suite (test_contract.py) runs every
adapter alike.

A driver says which adapter it drives, how big an epoch of its child's run is (in one
process), the command that trains the child to ``total`` steps with the adapter made from given
options (any of the shared ones, ``dirpath`` and ``storage_options`` included, as JSON; killed
at step ``kill_at`` if given: the child prints ``AT <step>`` there and waits to be killed;
resumed from the newest committed checkpoint if ``resume``; in ``processes`` processes, gloo,
each writing its share; with ``fsdp2``, the model sharded by FSDP2's ``fully_shard`` as the
framework's users do it), and how to read the processes' ``RESULT <json>`` lines as an
:class:`Outcome`. A new adapter writes one more driver here and adds it to :data:`DRIVERS`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from coci_accelerate import CociCheckpointer
from coci_lightning import CociCheckpoint
from coci_transformers import CociCallback
from tests.harness.processes import module
from tests.harness.results import result_rows


@dataclass(frozen=True)
class Outcome:
    """What a training child reports at its end (process 0's, but for ``seen``)."""

    state: str  # a digest of the model's and the optimizer's final state (the full tensors)
    # the index of each sample trained on, in order: step by step, each step's samples of
    # process 0, then of process 1, ...
    seen: list[int]
    start: int  # the step it started from: 0, or the step of the checkpoint it resumed
    history: Any  # what the framework records of the run that a resumed run repeats, or None
    sharded: bool  # the model's parameters were DTensors (sharded) on every process


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
        fsdp2: bool = False,
    ) -> list[str]:
        """The command that trains in ``directory`` (checkpoints in ``directory / "coci"``) to
        ``total`` steps, the adapter made with ``options``, in ``processes`` processes (with
        ``fsdp2``, at least 2), each taking ``batch`` samples a step."""
        ...

    def outcome(self, stdout: str) -> Outcome:
        """The child's result, read from its processes' output."""
        ...


def _launch(name: str, processes: int, args: list[str]) -> list[str]:
    """``python -m name args``, or in ``processes`` processes as torchrun starts them (forked
    with their imports done: :mod:`tests.harness.ranks`)."""
    if processes == 1:
        return module(name, *args)
    return module("tests.harness.ranks", str(processes), name, *args)


def _result(stdout: str, batch: int) -> tuple[dict[str, Any], list[int], bool]:
    """Process 0's result row, the samples trained on by all processes (step by step, as
    :attr:`Outcome.seen`) and whether every process's model was sharded."""
    rows = {row.get("rank", 0): row for row in result_rows(stdout)}
    assert sorted(rows) == list(range(len(rows))), stdout[-2000:]
    shares = [rows[rank]["seen"] for rank in sorted(rows)]
    assert len({len(share) for share in shares}) == 1, shares
    seen = [i for at in range(0, len(shares[0]), batch) for s in shares for i in s[at : at + batch]]
    return rows[0], seen, all(row.get("sharded", False) for row in rows.values())


class Lightning:
    """``CociCheckpoint`` on a Lightning Trainer: tests/lightning/_child.py (always resumes;
    FSDP2: ``ModelParallelStrategy`` and ``fully_shard`` in ``configure_model``)."""

    name = "lightning"
    adapter: type = CociCheckpoint
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
        fsdp2: bool = False,
    ) -> list[str]:
        kill = [] if kill_at is None else [str(kill_at)]
        coci = ["--coci", json.dumps(options), "--devices", str(processes)]
        args = [str(directory), str(total), *kill, *coci, *(["--fsdp2"] if fsdp2 else [])]
        return _launch("tests.lightning._child", processes, args)

    def outcome(self, stdout: str) -> Outcome:
        row, seen, sharded = _result(stdout, self.batch)
        return Outcome(row["state"], seen, row["start"], None, sharded)


class Accelerate:
    """``CociCheckpointer`` in an Accelerate loop: tests/accelerate/loop.py (always resumes;
    FSDP2: the FSDP plugin's ``fsdp_version=2``, which Accelerate applies on CPU only when the
    child forces the FSDP type, :func:`tests.accelerate.loop.force_fsdp`)."""

    name = "accelerate"
    adapter: type = CociCheckpointer
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
        fsdp2: bool = False,
    ) -> list[str]:
        kill = [] if kill_at is None else [str(kill_at)]
        flags = ["--coci", json.dumps(options), "--samples", str(self.steps_per_epoch * self.batch)]
        args = [str(directory), str(total), *kill, *flags, *(["--fsdp2"] if fsdp2 else [])]
        return _launch("tests.accelerate.loop", processes, args)

    def outcome(self, stdout: str) -> Outcome:
        row, seen, sharded = _result(stdout, self.batch)
        return Outcome(row["state"], seen, row["start"], None, sharded)


class Transformers:
    """``CociCallback`` on a ``transformers.Trainer``: tests/transformers/run.py; its history
    is the Trainer's log history without the losses (a loss logged after a resume averages the
    steps since the resume, as with the Trainer's own checkpoints). FSDP2: the Trainer's
    ``fsdp="full_shard"``, ``fsdp_config={"version": 2}`` (``--fsdp``; the child forces the FSDP
    type on CPU, :class:`tests.transformers.run.FSDP2Trainer`)."""

    name = "transformers"
    adapter: type = CociCallback
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
        fsdp2: bool = False,
    ) -> list[str]:
        kill = [] if kill_at is None else [str(kill_at)]
        flags = ["--coci", json.dumps(options), *(["--resume"] if resume else [])]
        args = [str(directory), str(total), *kill, *flags, *(["--fsdp"] if fsdp2 else [])]
        return _launch("tests.transformers.run", processes, args)

    def outcome(self, stdout: str) -> Outcome:
        row, seen, sharded = _result(stdout, self.batch)
        history = [
            {k: v for k, v in entry.items() if k not in ("loss", "train_loss")}
            for entry in row["log"]
        ]
        return Outcome(row["digest"], seen, row["start"] or 0, history, sharded)


DRIVERS: list[AdapterDriver] = [Lightning(), Accelerate(), Transformers()]
