"""Sharded state (a 2x2 mesh, every placement) on a real S3 server (SeaweedFS on loopback):
written straight to an ``s3://`` directory and through the remote tier, restored onto another
mesh from either."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from tests.harness.s3 import S3Server
from tests.sharding._dist_child import launch
from tests.sharding._mesh_child import SAVE_STEP, full_state

pytestmark = [pytest.mark.dist, pytest.mark.slow]
MODULE = "tests.sharding._mesh_child"
LAYOUTS = [[[2], ["S1"]], [[2], ["S0"]]]


def _ok(results: list[tuple[int, dict[str, Any] | None]]) -> list[dict[str, Any]]:
    assert all(code == 0 and r is not None for code, r in results), results
    return sorted((r for _, r in results if r is not None), key=lambda r: r["rank"])


def _restored_exactly(results: list[dict[str, Any]], tier: str) -> None:
    for rank in results:
        for r in rank["layouts"]:
            assert all(r["in_place"].values()) and all(r["equal"].values()), r
            assert r["plain"] and r["tier"] == tier


def test_sharded_state_in_an_s3_directory(s3_server: S3Server, s3_prefix: str) -> None:
    url = f"s3://{s3_prefix}/ckpt"
    options = {"storage_options": s3_server.storage_options}
    _ok(launch(4, {"mode": "save", "dir": url, "options": options}, module=MODULE))
    with CheckpointManager(url, **options) as mgr:
        assert mgr.verify() == {SAVE_STEP: []}
        assert len(mgr.manifest(SAVE_STEP).files) == 4  # each rank uploaded its own part
        state = mgr.restore()
    for key, tensor in full_state().items():
        assert torch.equal(state["model"][key], tensor), key
    cfg = {"mode": "restore", "dir": url, "options": options, "layouts": LAYOUTS}
    _restored_exactly(_ok(launch(2, cfg, module=MODULE)), "local")


def test_sharded_state_through_the_remote_tier(
    s3_server: S3Server, s3_prefix: str, tmp_path: Path
) -> None:
    url = f"s3://{s3_prefix}/remote"
    options = {"remote": url, "remote_storage_options": s3_server.storage_options}
    cfg = {"mode": "save", "dir": str(tmp_path / "node-a"), "options": options}
    _ok(launch(4, cfg, module=MODULE))
    with CheckpointManager(url, storage_options=s3_server.storage_options) as remote:
        assert remote.steps() == [SAVE_STEP]
        assert remote.verify() == {SAVE_STEP: []}
    # a new node: nothing on its disk, the checkpoint comes from the remote tier
    cfg = {"mode": "restore", "dir": str(tmp_path / "node-b"), "options": options}
    _restored_exactly(_ok(launch(2, {**cfg, "layouts": LAYOUTS}, module=MODULE)), "remote")
