"""Writes to saved tensors right after ``save()``, in each way a training loop makes them (an
EMA or weight clipping through ``.data``, ``arr += 1`` on a numpy array, ``p.copy_()`` under
``no_grad``, ``detach()``, views, ``_foreach`` ops, ``out=``, an optimizer step), with the
default settings and with ``block=False``: the checkpoint holds the state of the ``save()``
call, or a ``block=False`` save is given up (``StateChangedError``); never newer values.

torch bumps a tensor's version counter (shared by its views and ``detach()``) after an
in-place kernel has written it; writes through ``.data``, numpy or the storage bump none. A
background copy can therefore see the first kind only through a check on the saving thread
after the write returned, and cannot see the second: the defaults copy before ``save()``
returns, and ``block=False`` copies numpy arrays at once and documents the rest as unseen.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coci_core import CheckpointManager, StateChangedError
from coci_core.training import Checkpointer
from tests.harness.held_writer import HeldWriter


class Loop:
    """A model (256 KiB of weights: copied in the background with ``block=False``), its
    optimizer with a gradient ready, and a numpy array, all in the saved state."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(256, 256)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.model(torch.randn(4, 256)).square().mean().backward()
        self.arr = np.linspace(0.0, 1.0, 1 << 16)  # 512 KiB
        self.weight = self.model.weight

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "arr": self.arr}

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.state())


def _no_grad(write: Callable[[Loop], object]) -> Callable[[Loop], None]:
    def run(loop: Loop) -> None:
        with torch.no_grad():
            write(loop)

    return run


def _fill_storage(loop: Loop) -> None:
    storage: Any = loop.weight.untyped_storage()  # fill_ is missing from torch's stubs
    storage.fill_(0)


@dataclass(frozen=True)
class Write:
    """A way to change the saved state in place; ``counted``: it moves the version counter
    of the saved tensor (so a ``block=False`` save sees it)."""

    name: str
    apply: Callable[[Loop], object]
    counted: bool


WRITES = [
    Write("data", lambda loop: loop.weight.data.mul_(0.5), counted=False),  # EMA, clipping
    Write("data-slice", lambda loop: loop.weight.data[0].fill_(7.0), counted=False),
    Write("numpy-view", lambda loop: loop.weight.detach().numpy().__iadd__(1.0), counted=False),
    Write("storage", _fill_storage, counted=False),
    Write("numpy-array", lambda loop: loop.arr.__iadd__(1.0), counted=False),
    Write("copy", _no_grad(lambda loop: loop.weight.copy_(torch.ones(256, 256))), counted=True),
    Write("in-place", _no_grad(lambda loop: loop.weight.mul_(0.5)), counted=True),
    Write("lerp", _no_grad(lambda loop: loop.weight.lerp_(torch.zeros(256, 256), 0.1)), True),
    Write("detach", lambda loop: loop.weight.detach().add_(1.0), counted=True),
    Write("view", lambda loop: loop.weight.detach()[0].fill_(7.0), counted=True),
    Write(
        "foreach",
        _no_grad(lambda loop: torch._foreach_mul_(list(loop.model.parameters()), 0.5)),
        counted=True,
    ),
    Write(
        "out",
        _no_grad(lambda loop: torch.add(torch.ones(256, 256), 1.0, out=loop.weight)),
        counted=True,
    ),
    Write("optimizer", lambda loop: loop.opt.step(), counted=True),
]
#: what ``block=False`` never stores newer values of: counted writes, and numpy arrays in the
#: state (copied by ``save()`` itself)
SEEN_BY_BLOCK_FALSE = [w for w in WRITES if w.counted or w.name == "numpy-array"]


def _assert_state_equal(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got["model"].keys() == expected["model"].keys()
    for key, value in expected["model"].items():
        assert torch.equal(got["model"][key], value), key
    np.testing.assert_array_equal(got["arr"], expected["arr"])


@pytest.mark.parametrize("write", WRITES, ids=lambda w: w.name)
def test_every_write_is_counted_or_not_as_the_docs_say(write: Write) -> None:
    """The version counter moves for in-place torch ops on a saved tensor, its views and
    ``detach()`` (which share it), and not for ``.data``, numpy or storage writes."""
    loop = Loop()
    saved = loop.state()["model"]["weight"]  # what the state holds: weight.detach()
    before = saved._version
    write.apply(loop)
    assert (saved._version != before) is write.counted


@pytest.mark.parametrize("saver", ["CheckpointManager", "Checkpointer"])
@pytest.mark.parametrize("write", WRITES, ids=lambda w: w.name)
def test_the_default_save_holds_the_state_of_the_call(
    tmp_path: Path, write: Write, saver: str
) -> None:
    """Any write right after a save with the default settings (the manager's, and the
    adapters' through their shared ``Checkpointer``) is not in the checkpoint."""
    loop = Loop()
    expected = loop.snapshot()
    if saver == "CheckpointManager":
        with CheckpointManager(tmp_path, compression="none") as mgr:
            mgr.save(1, loop.state())
            write.apply(loop)
    else:
        ckpt = Checkpointer(tmp_path, policy="every_n_steps", every_n_steps=1, compression="none")
        ckpt.save(1, loop.state())
        write.apply(loop)
        ckpt.close()
    with CheckpointManager(tmp_path) as reader:
        _assert_state_equal(reader.restore(1), expected)


@pytest.mark.parametrize("write", SEEN_BY_BLOCK_FALSE, ids=lambda w: w.name)
def test_block_false_holds_the_state_of_the_call_or_gives_the_save_up(
    tmp_path: Path, write: Write
) -> None:
    """The write comes before the background copy reads the state (the writer thread is held
    until then): the save stores the state of the call or fails with StateChangedError."""
    loop = Loop()
    expected = loop.snapshot()
    storage = HeldWriter(tmp_path)
    with CheckpointManager(storage, compression="none", keep_last=1) as mgr:
        mgr.save(1, {"other": torch.zeros(4)})
        storage.hold_next_removal()
        mgr.save(2, {"other": torch.zeros(4)}).wait()  # its removal of step 1 is held
        assert storage.holding.wait(60)
        handle = mgr.save(3, loop.state(), block=False)  # its copy waits for the removal
        if write.name == "optimizer":  # the step's pre-hook waits for the copy: let it run
            storage.release.set()
        write.apply(loop)
        storage.release.set()
        error = handle.exception()
        if error is None:
            _assert_state_equal(mgr.restore(3), expected)
        else:
            assert isinstance(error, StateChangedError), error
            assert write.counted  # a numpy array in the state is copied by save() itself
            assert 3 not in mgr.steps()


def test_a_copy_still_running_when_the_background_copy_ends_is_never_saved(
    tmp_path: Path,
) -> None:
    """50 times: ``p.copy_(master.t())`` under no_grad (56 ms here for 16 MiB) starts right
    after a block=False save; the writer thread is let go to copy once the first values are
    written, so that its copy ends while the write still runs, before torch bumps the
    version counter. Each save stores the zeros of the call or is given up."""
    p = torch.nn.Parameter(torch.zeros(2048, 2048))
    master = torch.ones(2048, 2048, dtype=torch.float64)
    first = p.detach().numpy().reshape(-1)
    storage = HeldWriter(tmp_path)
    outcomes = {"given up": 0, "exact": 0}
    with CheckpointManager(storage, compression="none", keep_last=1, worker_niceness=0) as mgr:
        mgr.save(0, {"other": torch.zeros(4)})
        for trial in range(50):
            with torch.no_grad():
                p.zero_()
            storage.hold_next_removal()
            mgr.save(2 * trial + 1, {"other": torch.zeros(4)}).wait()
            assert storage.holding.wait(60)
            key = f"p{trial}"  # a new key each time: not one that save() now copies itself
            handle = mgr.save(2 * trial + 2, {key: p.detach()}, block=False)
            watcher = threading.Thread(target=_release_once_written, args=(first, storage))
            watcher.start()
            with torch.no_grad():
                p.copy_(master.t())
            watcher.join()
            error = handle.exception()
            if error is None:
                assert torch.equal(mgr.restore(2 * trial + 2)[key], torch.zeros(2048, 2048))
                outcomes["exact"] += 1
            else:
                assert isinstance(error, StateChangedError), error
                outcomes["given up"] += 1
    assert sum(outcomes.values()) == 50


def _release_once_written(first: np.ndarray[Any, Any], storage: HeldWriter) -> None:
    deadline = time.monotonic() + 60
    while first[0] == 0.0 and time.monotonic() < deadline:
        pass
    storage.release.set()
