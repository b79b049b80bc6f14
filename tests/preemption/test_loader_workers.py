"""A SIGTERM sent to every process of the job (SLURM, a service stopped, ``kill -TERM
-<pgid>``) reaches the data loader's workers too: shielded (each adapter shields its loaders;
a plain loop calls ``Checkpointer.shield_loader_workers``), they leave it to the training
process, which saves the next step and exits with the notice's status 143 within the grace
period. Before, the workers died and the next batch raised ``DataLoader worker (pid N) is
killed by signal: Terminated``: nothing saved, and Accelerate's process hung until SIGKILL."""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from coci_core import CheckpointManager
from coci_core.preemption import ShieldedWorkerInit, shield_loader_workers
from tests.harness.processes import Child, module, script
from tests.preemption.test_loop import _preempt

pytestmark = [pytest.mark.faults]

GRACE_S = 30.0


def _sigterm_to_the_job(cfg: dict[str, Any]) -> tuple[int, list[str]]:
    """Run the child in a process group of its own; once its two workers run, SIGTERM the
    whole group; SIGKILL it ``GRACE_S`` later (the end of the grace period). Its status and
    its lines."""
    command = module("tests.preemption._workers_child", json.dumps(cfg))
    with Child(command, kill_scope="group") as child:
        notify = functools.partial(os.killpg, child.pid, signal.SIGTERM)
        code, lines = _preempt(child, GRACE_S, notify, mark="WORKERS")
    (workers,) = [json.loads(x.split(" ", 1)[1]) for x in lines if x.startswith("WORKERS")]
    assert len(workers) == 2, lines
    return code, lines


@pytest.mark.parametrize(
    ("kind", "context"),
    [
        ("loop", None),
        ("loop", "spawn"),
        ("lightning", None),
        ("accelerate", None),
        ("transformers", None),
    ],
)
def test_a_job_wide_sigterm_saves_the_next_step_and_exits_143(
    tmp_path: Path, kind: str, context: str | None
) -> None:
    cfg = {"dir": str(tmp_path), "kind": kind, "shield": True, "context": context}
    code, lines = _sigterm_to_the_job(cfg)
    assert code == 143, lines
    directory = tmp_path / "coci" if kind == "transformers" else tmp_path
    with CheckpointManager(directory) as reader:
        (step,) = reader.steps()
        assert step >= 4


_STUCK = """
import ctypes, signal, sys
import torch
from torch.utils.data import DataLoader, Dataset
from coci_core.preemption import shield_loader_workers

class Stuck(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        print("STUCK", flush=True)
        mutex = ctypes.create_string_buffer(64)  # a pthread_mutex_t, zeroed: unlocked
        libc = ctypes.CDLL(None)
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # a deadlock in C: no Python handler runs again
        return torch.zeros(1)

loader = DataLoader(Stuck(), num_workers=1)
assert shield_loader_workers(loader, [signal.SIGTERM]) == 1
batches = iter(loader)  # the worker starts and gets stuck on the first sample
sys.stdin.readline()
print("EXIT", flush=True)
"""


def test_the_exit_ends_a_shielded_worker_stuck_in_a_c_call() -> None:
    """A shielded worker deadlocked in C never runs its Python handler: the training
    process's exit SIGKILLs it after ``WORKER_EXIT_S`` (before: Python's exit joined it
    without a timeout, and the process never ended)."""
    with Child(script(_STUCK)) as child:
        assert child.readline().startswith("STUCK")
        assert child.proc.stdin is not None
        child.proc.stdin.write("\n")
        child.proc.stdin.flush()
        assert child.readline().startswith("EXIT")
        assert child.wait(20) == 0


def test_a_shielded_loader_copies_and_pickles() -> None:
    """``copy.deepcopy`` and ``pickle`` of a shielded loader work as of one not shielded
    (the event the workers share goes along only to a worker being started)."""
    loader = DataLoader(TensorDataset(torch.zeros(4, 1)), num_workers=2, worker_init_fn=print)
    assert shield_loader_workers(loader, [signal.SIGTERM]) == 1
    assert shield_loader_workers(loader, [signal.SIGTERM]) == 0  # once
    for copied in (copy.deepcopy(loader), pickle.loads(pickle.dumps(loader))):
        shield = copied.worker_init_fn
        assert isinstance(shield, ShieldedWorkerInit) and shield.inner is print
        assert shield.exiting is loader.worker_init_fn.exiting


@pytest.mark.filterwarnings("ignore:coci. the train DataLoader is not stateful")
def test_lightning_keeps_seed_everything_workers_seeding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``seed_everything(workers=True)`` gives each loader without a ``worker_init_fn``
    Lightning's seeding of the workers (by rank); the shield wraps it rather than taking its
    place (before: Lightning saw a ``worker_init_fn`` and added none)."""
    import lightning.pytorch as pl
    from lightning.fabric.utilities.seed import pl_worker_init_function

    from coci_lightning import CociCheckpoint

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            return DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=4, num_workers=1)

    pl.seed_everything(0, workers=True)
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    trainer = pl.Trainer(
        max_steps=1,
        accelerator="cpu",
        callbacks=[CociCheckpoint(tmp_path, policy="every_n_steps", every_n_steps=100)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model())
    shield = trainer.train_dataloader.worker_init_fn
    assert isinstance(shield, ShieldedWorkerInit)
    assert shield.inner.func is pl_worker_init_function and shield.inner.keywords == {"rank": 0}
