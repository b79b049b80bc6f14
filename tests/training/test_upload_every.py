"""The planner chooses how often a checkpoint is also uploaded to the remote tier, from the
measured cost of an upload to the training loop (the two-level model), and the adapters' shared
Checkpointer applies it (``remote_upload_every="auto"``)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from coci_core import ConfigError
from coci_core.planner import Planner
from coci_core.planner.two_level import TierCosts, plan_two_levels
from coci_core.storage import LocalStorage
from coci_core.training.checkpointer import Checkpointer

TAU, SLOW, STALL = 0.1, 0.5, 0.05


def _warm(planner: Planner, steps: int = 100) -> None:
    for k in range(1, steps + 1):
        planner.observe(k, step_time_s=TAU)
    planner.record_save(stall_s=STALL, persist_s=0.2)


def test_without_a_measured_upload_every_checkpoint_is_uploaded() -> None:
    planner = Planner()
    assert planner.upload_every() == 1
    assert planner.two_level_plan() is None
    assert "remote tier" not in planner.explain(10)


def test_an_upload_that_slows_the_loop_is_uploaded_less_often() -> None:
    """Twenty steps slowed by 0.4 s during one upload: an upload costs the loop 8 s against
    0.05 s for a local save; with half the failures losing the node, the two-level period is
    sqrt(8 / 0.05), about 12."""
    planner = Planner(node_loss_share=0.5)
    _warm(planner)
    for k in range(101, 121):
        planner.observe(k, step_time_s=SLOW)
    planner.record_upload(3600.0)  # it ran while all of those steps did
    plan = planner.two_level_plan()
    assert plan is not None
    mtbf = planner.report().mtbf_s
    assert mtbf is not None
    expected = plan_two_levels(
        TierCosts(
            local_cost_s=STALL,
            remote_cost_s=20 * (SLOW - TAU),
            local_restart_s=planner.report().costs["restart_s"] or 0.0,
            remote_restart_s=(planner.report().costs["restart_s"] or 0.0) + 3600.0,
            crash_rate=0.5 / mtbf,
            node_loss_rate=0.5 / mtbf,
        )
    )
    assert planner.upload_every() == expected.upload_every
    assert 12 <= planner.upload_every() <= 13
    assert "remote tier: upload every" in planner.explain(120)


def test_a_free_upload_goes_with_every_checkpoint_and_the_share_of_node_losses_counts() -> None:
    free = Planner()
    _warm(free)
    free.record_upload(3600.0)  # the steps during it were as fast as usual
    assert free.upload_every() == 1
    rare = Planner(node_loss_share=0.02)
    common = Planner(node_loss_share=0.9)
    for planner in (rare, common):
        _warm(planner)
        for k in range(101, 104):
            planner.observe(k, step_time_s=SLOW)
        planner.record_upload(3600.0)
    assert rare.upload_every() > common.upload_every() >= 1


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half", float("nan"), True])
def test_node_loss_share_is_checked(bad: object) -> None:
    with pytest.raises(ConfigError, match="'node_loss_share' must be a number in \\[0, 1\\]"):
        Planner(node_loss_share=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, "often", 1.5, None])
def test_remote_upload_every_is_checked(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="'remote_upload_every' must be 'auto' or an integer"):
        Checkpointer(tmp_path / "a", remote=str(tmp_path / "b"), remote_upload_every=bad)


class _HeldUploads(LocalStorage):
    """A remote tier whose uploads wait until the test lets them finish."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.started = threading.Event()
        self.release = threading.Event()

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        if path.endswith(".bin"):
            self.started.set()
            assert self.release.wait(60)
        return super().write_file(path, chunks, aligned=aligned)


def test_the_checkpointer_applies_the_measured_period_to_its_remote_tier(tmp_path: Path) -> None:
    """A real upload (held open while the loop runs slowly), measured by the planner through
    the upload event: the remote tier then uploads every k-th checkpoint; a fixed period given
    by the user is kept."""
    ckpt = Checkpointer(
        tmp_path / "local",
        remote=str(tmp_path / "remote"),
        planner_options={"node_loss_share": 0.5},
    )
    assert ckpt.manager.remote is not None and ckpt.manager.remote.upload_every == 1
    remote = ckpt.manager.remote.remote = _HeldUploads(tmp_path / "remote")
    _warm(ckpt.planner)
    ckpt.save(100, {"w": torch.ones(1000)})
    ckpt.wait()
    assert remote.started.wait(60)
    for k in range(101, 121):  # the loop, slowed while the upload runs
        ckpt.observe(k, step_time_s=SLOW)
    remote.release.set()
    assert ckpt.manager.remote.flush(60)
    # 8 s of loop time per upload against a local save's measured stall (milliseconds)
    assert ckpt.manager.remote.upload_every == ckpt.planner.upload_every() >= 10
    ckpt.close()

    ckpt = Checkpointer(
        tmp_path / "local2", remote=str(tmp_path / "remote2"), remote_upload_every=2, keep_last=None
    )
    assert ckpt.manager.remote is not None and ckpt.manager.remote.upload_every == 2
    fixed = ckpt.manager.remote.remote = _HeldUploads(tmp_path / "remote2")
    fixed.release.set()
    _warm(ckpt.planner)
    for step in (1, 2, 3, 4):
        ckpt.save(step, {"w": torch.full((10,), float(step))})
        ckpt.wait()
    for k in range(101, 121):
        ckpt.observe(k, step_time_s=SLOW)
    assert ckpt.manager.remote.flush(60)
    ckpt.close()
    assert sorted(int(n[5:]) for n in fixed.list_dir("") if n.startswith("step-")) == [2, 4]
