"""verbose=True: each save is told once, whatever its outcome (committed, skipped, failed), and
nothing is told of a save without it but a failure."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from coci_core import BackgroundSaveError
from coci_core.storage import open_storage
from coci_core.training.checkpointer import Checkpointer
from tests.harness.faults import FaultyStorage


def _told(caplog: pytest.LogCaptureFixture, step: int) -> list[str]:
    """Every record of any logger that speaks of ``step``'s save."""
    words = (f"step {step} ", f"step {step}:")
    return [r.getMessage() for r in caplog.records if any(w in r.getMessage() for w in words)]


@pytest.mark.parametrize("verbose", [True, False])
def test_each_save_told_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, verbose: bool
) -> None:
    # the first write of the third save fails (no space left)
    storage = FaultyStorage(open_storage(tmp_path), fail={"write_file": [2]})
    ckpt = Checkpointer(storage, verbose=verbose, log=logging.getLogger("adapter"))
    with caplog.at_level(logging.DEBUG, logger="adapter"), caplog.at_level(logging.INFO):
        ckpt.save(4, {"w": torch.ones(100)}).wait()
        ckpt.manager.skip(6, "the previous persist is still running")
        with pytest.raises(BackgroundSaveError):
            ckpt.save(8, {"w": torch.zeros(100)}).wait()
        ckpt.close()
    committed, skipped, failed = _told(caplog, 4), _told(caplog, 6), _told(caplog, 8)
    (failure,) = failed  # from the engine, verbose or not
    assert failure.startswith("coci: save of step 8 failed:")
    if verbose:
        (line,) = committed
        assert line.startswith("coci: step 4 saved: stall ")
        (line,) = skipped
        assert line.startswith("coci: step 6 not saved (skipped")
        names = {r.name for r in caplog.records if "step 4 saved" in r.getMessage()}
        assert names == {"adapter"}  # on the logger the adapter gave
    else:
        assert committed == [] and skipped == []
