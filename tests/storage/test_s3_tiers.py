"""Two tiers against a real S3 server (SeaweedFS on loopback): a local directory first, then
the bucket in the background."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.telemetry import Event, UploadEvent
from tests.harness.s3 import SECRET_KEY, S3Server, start_s3_server


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(256, 128, generator=g)},
        "optim": {"exp_avg_sq": torch.rand(256, 128, generator=g) * 1e-6},
        "step": torch.tensor(seed),
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(torch.equal(a, b))


def test_a_new_node_resumes_from_the_bucket(
    tmp_path: Path, s3_server: S3Server, s3_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Lossless deltas committed locally reach the bucket; with the local disk wiped, a new
    manager restores the newest step from the bucket, exactly; the secret is never logged."""
    caplog.set_level(logging.DEBUG)
    url = f"s3://{s3_prefix}/run"
    options = s3_server.storage_options
    with CheckpointManager(
        tmp_path / "local",
        remote=url,
        remote_storage_options=options,
        compression="lossless",
        compression_options={"full_every": 2},
    ) as mgr:
        assert mgr.remote is not None
        for step in (1, 2, 3):
            mgr.save(step, _state(step), block=True).wait()
            assert mgr.remote.flush(timeout_s=120)
    with CheckpointManager(url, storage_options=options) as remote:
        assert remote.steps() == [1, 2, 3]
    shutil.rmtree(tmp_path / "local")
    with CheckpointManager(
        tmp_path / "new-node", remote=url, remote_storage_options=options
    ) as mgr:
        restored = mgr.restore()
        assert mgr.last_restore is not None
        assert (mgr.last_restore.step, mgr.last_restore.tier) == (3, "remote")
    assert _equal(restored, _state(3))
    assert SECRET_KEY not in caplog.text


def test_the_server_going_down_mid_run_stops_nothing_and_loses_nothing(tmp_path: Path) -> None:
    """The S3 server is stopped while a run saves: every save still commits locally, each
    failed upload is reported, and once the server is back the newest step is uploaded and
    restores exactly from the bucket."""
    server = start_s3_server(tmp_path / "seaweedfs")
    try:
        url = f"s3://{server.fresh_prefix()}/run"
        events: list[Event] = []
        failed = threading.Event()

        def listen(event: Event) -> None:
            events.append(event)
            if isinstance(event, UploadEvent) and event.outcome == "failed":
                failed.set()

        with CheckpointManager(
            tmp_path / "local",
            remote=url,
            # one attempt per request: the stopped server's refusals fail an upload at once
            # (botocore retries a refused connection for 5 to 15 s, for the same outcome)
            remote_storage_options={
                **server.storage_options,
                "config_kwargs": {"retries": {"max_attempts": 1}},
            },
            listeners=[listen],
            keep_last=2,
        ) as mgr:
            assert mgr.remote is not None
            mgr.save(1, _state(1), block=True).wait()
            assert mgr.remote.flush(timeout_s=120)
            server.stop()
            for step in (2, 3, 4):
                event = mgr.save(step, _state(step), block=True).wait()
                assert event.outcome == "committed"  # training goes on
            assert failed.wait(timeout=120)
            server.restart()
            assert mgr.remote.flush(timeout_s=180)
        uploads = [e for e in events if isinstance(e, UploadEvent)]
        assert uploads[-1].outcome == "committed" and uploads[-1].step == 4
        assert any(e.outcome == "failed" and e.step > 1 for e in uploads)
        assert all(SECRET_KEY not in (e.error or "") for e in uploads)
        with CheckpointManager(url, storage_options=server.storage_options) as remote:
            assert remote.steps()[-1] == 4
            assert _equal(remote.restore(), _state(4))
    finally:
        server.stop()
