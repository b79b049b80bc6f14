"""A full disk, a re-save on storage without rename, and a save below the delta base."""

from __future__ import annotations

import errno
import os
import textwrap
from pathlib import Path

import pytest
import torch

from coci_core import BackgroundSaveError, CheckpointManager, FsspecStorage
from tests.harness.faults import FaultyStorage
from tests.harness.processes import run, script

# A tmpfs of 11 MiB in a private mount namespace (root, or an unprivileged user namespace):
# a real ENOSPC, no mock. Each save of the 4 MiB state takes 4 MiB + a manifest.
_FULL_DISK = textwrap.dedent(
    """
    import json, os, subprocess, sys, torch
    from coci_core import BackgroundSaveError, CheckpointManager
    mnt = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=11m", "tmpfs", mnt], check=True)
    out = {"saves": [], "errors": []}
    mgr = CheckpointManager(mnt, keep_last=2, compression="none")
    for step in range(1, 7):
        try:
            mgr.save(step, {"w": torch.full((1 << 20,), float(step))}).wait()
            out["saves"].append(step)
        except BackgroundSaveError as e:
            out["errors"].append([step, e.__cause__.errno, str(e)])
    out["steps"] = mgr.steps()
    out["exact"] = all(
        torch.equal(mgr.restore(step=s)["w"], torch.full((1 << 20,), float(s)))
        for s in out["steps"]
    )
    try:  # a state that cannot fit even alone: the error says what is kept and why
        mgr.save(7, {"w": torch.zeros(4 << 20)}).wait()
    except BackgroundSaveError as e:
        out["too_big"] = [e.__cause__.errno, str(e)]
    out["after_too_big"] = mgr.steps()
    mgr.close()
    print("RESULT", json.dumps(out))
    """
)


def _namespace_prefix() -> list[str]:
    if os.geteuid() == 0:
        return ["unshare", "--mount", "--propagation", "private"]
    return ["unshare", "--mount", "--user", "--map-root-user", "--propagation", "private"]


def test_full_disk_makes_room_and_explains(tmp_path: Path) -> None:
    """With room for exactly keep_last checkpoints, every later save used to fail with ENOSPC
    for ever; now the step that retention would delete after the save goes first (never the
    newest), and a save that cannot fit says why."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = run([*_namespace_prefix(), *script(_FULL_DISK, str(mnt))], timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["errors"] == []
    assert out["saves"] == [1, 2, 3, 4, 5, 6]
    assert out["steps"] == [5, 6]
    assert out["exact"] is True
    code, message = out["too_big"]
    assert code == errno.ENOSPC
    assert "storage is full" in message
    assert "keep_last=2" in message
    assert out["after_too_big"] == [6]  # the newest intact step is never deleted


def test_fsspec_resave_that_fails_keeps_the_committed_step() -> None:
    """On storage without rename a re-save used to delete the committed step first; a failed
    re-save now leaves it whole, and a good one replaces it."""
    inner = FsspecStorage("memory://coci-adversarial-resave")
    try:
        with CheckpointManager(inner, keep_last=None) as mgr:
            mgr.save(3, {"w": torch.ones(1000)}).wait()
        faulty = FaultyStorage(inner, fail={"write_file": [0]})
        with CheckpointManager(faulty, keep_last=None) as mgr:
            with pytest.raises(BackgroundSaveError):
                mgr.save(3, {"w": torch.zeros(1000)}, overwrite=True).wait()
            assert torch.equal(mgr.restore(step=3)["w"], torch.ones(1000))
        with CheckpointManager(inner, keep_last=None) as mgr:
            mgr.save(3, {"w": torch.full((1000,), 2.0)}, overwrite=True).wait()
            assert torch.equal(mgr.restore(step=3)["w"], torch.full((1000,), 2.0))
            names = inner.list_dir("step-0000000003")
            assert len([n for n in names if n.startswith("data-")]) == 1  # the old files went
            assert mgr.verify() == {3: []}
    finally:
        inner.remove_dir("")


@pytest.mark.parametrize("compression", ["lossless", "auto"])
def test_save_below_the_delta_base_is_restorable(tmp_path: Path, compression: str) -> None:
    """A rollback (a step below the current base) and a re-save of the base step used to
    commit a delta against a later (or the same) step, which restore rejects."""
    opts = {"auto_min_bytes": 0} if compression == "auto" else {}
    states = {}
    with CheckpointManager(
        tmp_path, keep_last=None, compression=compression, compression_options=opts
    ) as mgr:
        for step in (10, 11, 12, 5, 10, 13):
            g = torch.Generator().manual_seed(step)
            states[step] = {"w": torch.randn(1 << 18, generator=g)}
            states[step]["w"][: 1 << 16] = 0.5
            mgr.save(step, states[step], overwrite=True).wait()
        # Re-saving step 10 replaced the base of 11 and 12 (deltas against the old 10): they
        # are removed rather than left to fail their base checks.
        survivors = mgr.steps()
        assert {5, 10, 13} <= set(survivors)
        if compression == "lossless":
            assert survivors == [5, 10, 13]
        for step in survivors:
            assert torch.equal(mgr.restore(step=step)["w"], states[step]["w"]), step
        assert all(not bad for bad in mgr.verify().values())
