"""Several ranks writing one checkpoint to a real S3 server (SeaweedFS on loopback): each rank
uploads its share, rank 0 commits with the manifest, a checkpoint restores on another number of
ranks (or, one rank's object lost, the step before on both), and a rank killed during its upload
publishes nothing."""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.engine.restore.restore import load_checkpoint
from coci_core.storage import FsspecStorage
from tests.harness.s3 import SECRET_KEY, S3Server
from tests.sharding._dist_child import SAMPLES, digest, launch, model_digest

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _ok(results: list[tuple[int, dict[str, Any] | None]]) -> list[dict[str, Any]]:
    assert [code for code, _ in results] == [0] * len(results), results
    return [r for _, r in results if r is not None]


def _keys(server: S3Server, url: str) -> list[str]:
    fs = server.filesystem()
    root = url.removeprefix("s3://")
    return sorted(k.removeprefix(root + "/") for k in fs.find(root))


@pytest.mark.parametrize("compression", ["none", "lossless", "lossy"])
def test_two_ranks_write_one_checkpoint_to_s3_and_it_restores_exactly(
    s3_server: S3Server, s3_prefix: str, compression: str
) -> None:
    url = f"s3://{s3_prefix}/ckpt"
    cfg = {
        "url": url,
        "storage_options": s3_server.storage_options,
        "every": 10,
        "stop_step": 30,
        "compression": compression,
    }
    first = _ok(launch(2, cfg))
    options = s3_server.storage_options
    with CheckpointManager(url, storage_options=options) as mgr:
        assert mgr.steps() == [10, 20, 30]
        manifest = mgr.manifest(30)
        assert mgr.verify() == {10: [], 20: [], 30: []}
    assert manifest.world_size == 2
    assert len(manifest.files) == 2  # each rank uploaded its own share
    keys = _keys(s3_server, url)
    # nothing but the steps' manifests and data objects (and the owner record) is left
    assert [k for k in keys if ".coci-tmp-" in k or "rank-" in k] == []
    assert {k.split("/")[0] for k in keys} == {f"step-{s:010d}" for s in (10, 20, 30)}
    for r in first:
        loaded = load_checkpoint(FsspecStorage(url, **options), 30, rank=r["rank"])
        assert digest(loaded.state["rng"]) == r["rng_at_save"]["30"]
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        )
        model.load_state_dict(loaded.state["model"])
        if compression != "lossy":
            assert model_digest(model) == r["model_at_save"]["30"]
    if compression != "none":
        return  # the resume reads through the same codecs as the restore above
    # rank 1's data object of step 30 (its share, its own random state) lost from the bucket:
    # resumed on two ranks, both from step 20, the rest of the epoch, each sample once
    (lost,) = [k for k in _keys(s3_server, url) if k.startswith(f"step-{30:010d}/data-r1-")]
    s3_server.filesystem().rm(f"{url.removeprefix('s3://')}/{lost}")
    again = _ok(launch(2, {**cfg, "every": 1000, "stop_step": None}))
    assert [r["restored_step"] for r in again] == [20, 20]
    seen = [i for r in first for s, ids in r["steps"].items() if int(s) <= 20 for i in ids]
    seen += [i for r in again for ids in r["steps"].values() for i in ids]
    assert sorted(seen) == list(range(SAMPLES))
    assert all(SECRET_KEY not in str(r) for r in first + again)


def test_a_rank_killed_during_its_upload_publishes_nothing(
    s3_server: S3Server, s3_prefix: str
) -> None:
    """Rank 1 is SIGKILLed with its upload of step 20 begun: rank 0 gives the save up within
    the timeout, step 20 stays invisible, step 10 intact; a relaunch resumes from step 10, saves
    step 20 anew and leaves no object of the abandoned save, nor a multipart upload a killed
    rank left open (rank 0 aborts them at the first save's check that the ranks share the
    directory, before any rank writes; they were left, billed, when it took the lease after)."""
    url = f"s3://{s3_prefix}/ckpt"
    options = s3_server.storage_options
    cfg = {"url": url, "storage_options": options, "every": 10, "timeout_s": 3}
    results = launch(2, {**cfg, "pause_rank": 1, "pause_step": 20}, kill_rank=1)
    assert results[1] == (-signal.SIGKILL, None)
    code, survivor = results[0]
    assert code == 0 and survivor is not None
    assert re.search(r"rank\(s\) \[1\] did not report within 3 s", survivor["save_error"])
    with CheckpointManager(url, storage_options=options) as mgr:
        assert mgr.steps() == [10]
        assert mgr.verify() == {10: []}
    fs = s3_server.filesystem()
    bucket, key, _ = fs.split_path(f"{url}/step-0000000020.coci-tmp-killed/data-r1.bin")
    fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)  # as a killed upload leaves
    resumed = _ok(launch(2, {**cfg, "stop_step": 20}))
    assert [r["restored_step"] for r in resumed] == [10, 10]
    open_uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key.split("/")[0])
    assert open_uploads.get("Uploads", []) == []
    assert resumed[0]["restored_rng"] == survivor["rng_at_save"]["10"]
    with CheckpointManager(url, storage_options=options) as mgr:
        assert mgr.steps() == [10, 20]
        manifest = mgr.manifest(20)
    names = {f.name for f in manifest.files}
    step20 = [k.split("/", 1)[1] for k in _keys(s3_server, url) if k.startswith("step-0000000020")]
    assert sorted(step20) == sorted([*names, "manifest.json"])  # the abandoned save's are gone
    assert [k for k in _keys(s3_server, url) if ".coci-tmp-" in k] == []


def test_two_ranks_with_a_remote_tier_resume_from_the_bucket_on_an_empty_disk(
    s3_server: S3Server, s3_prefix: str, tmp_path: Path
) -> None:
    """Two ranks commit on a local directory they share; rank 0 copies every rank's files to
    the bucket. With the local directory gone (a new node), both ranks resume from the bucket,
    bit for bit, each with its own random state."""
    url = f"s3://{s3_prefix}/ckpt"
    options = s3_server.storage_options
    local = tmp_path / "local"
    cfg = {"dir": str(local), "remote": url, "storage_options": options, "every": 10}
    first = _ok(launch(2, {**cfg, "stop_step": 20}))
    with CheckpointManager(url, storage_options=options) as mgr:
        assert mgr.steps() == [10, 20]  # close() waited for the upload
        manifest = mgr.manifest(20)
        assert mgr.verify() == {10: [], 20: []}
    assert manifest.world_size == 2 and len(manifest.files) == 2
    shutil.rmtree(local)
    resumed = _ok(launch(2, {**cfg, "stop_step": 21}))
    assert [(r["restored_step"], r["restored_tier"]) for r in resumed] == [(20, "remote")] * 2
    for before, after in zip(first, resumed, strict=True):
        assert after["restored_rng"] == before["rng_at_save"]["20"]
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model.load_state_dict(load_checkpoint(FsspecStorage(url, **options), 20).state["model"])
    assert model_digest(model) == first[0]["model_at_save"]["20"]
