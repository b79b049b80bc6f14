"""The object store down, or refusing us, on a real S3 server (SeaweedFS on loopback).

Outages longer than the owner record's lease time (a remote tier, an ``s3://`` primary
directory, a store that is down when the run starts, one that never comes back before
``close()``), and credentials or buckets that are wrong, for every entry point that lists or
reads a checkpoint directory: none of them may read as an empty directory, nor make an adapter
start fresh.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration

from coci_accelerate import CociCheckpointer
from coci_core import BackgroundSaveError, CheckpointManager, DirectoryInUseError, StorageError
from coci_core.engine.directory import lease as lease_module
from coci_core.engine.directory.lease import LEASE_NAME
from coci_core.telemetry import Event, UploadEvent
from coci_lightning import CociCheckpoint
from tests.harness.processes import run, script
from tests.harness.s3 import SECRET_KEY, S3Server, start_s3_server
from tests.lightning.models import DigitsModel

pytestmark = pytest.mark.timeout(300)

#: The lease time of these tests: an outage of a few seconds outlasts it.
_TTL_S = 1.5


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "step": torch.tensor(seed)}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _poll(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Wait until ``condition()`` holds, or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        pause.wait(0.05)


# -- outages longer than the lease ----------------------------------------------------------


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A server of this module's own, that its tests stop and start again."""
    server = start_s3_server(tmp_path_factory.mktemp("seaweedfs-outages"))
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def server(own_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """The module's server, running, with a short lease time; running again afterwards."""
    monkeypatch.setattr(lease_module, "LEASE_TTL_S", _TTL_S)
    if own_server.process.poll() is not None:
        own_server.restart()
    yield own_server
    if own_server.process.poll() is not None:
        own_server.restart()


def _fast_failing(server: S3Server) -> dict[str, Any]:
    """The server's options with one attempt per request: a stopped server fails at once
    (botocore would retry a refused connection for seconds)."""
    return {**server.storage_options, "config_kwargs": {"retries": {"max_attempts": 1}}}


def _record(server: S3Server, prefix: str) -> dict[str, Any] | None:
    fs = server.filesystem()
    try:
        return dict(json.loads(fs.cat_file(f"{prefix}/{LEASE_NAME}")))
    except FileNotFoundError:
        return None


def _remote_steps(server: S3Server, url: str) -> list[int]:
    with CheckpointManager(url, storage_options=server.storage_options) as reader:
        return reader.steps()


def test_remote_tier_uploads_again_after_an_outage_longer_than_the_lease(
    tmp_path: Path, server: S3Server
) -> None:
    """The bucket is down for longer than the lease time: saves commit locally, uploads fail
    and are reported; once it is back, the run takes its own owner record again (nobody else
    took it) and the newest step reaches the bucket, intact."""
    prefix = server.fresh_prefix()
    url = f"s3://{prefix}/run"
    events: list[Event] = []
    with CheckpointManager(
        tmp_path / "local",
        remote=url,
        remote_storage_options=_fast_failing(server),
        listeners=[events.append],
    ) as mgr:
        assert mgr.remote is not None
        mgr.save(1, _state(1)).wait()
        assert mgr.remote.flush(timeout_s=60)
        lease = mgr.remote._lease
        assert lease is not None
        server.kill()
        mgr.save(2, _state(2)).wait()  # committed locally: training goes on
        _poll(lambda: lease.lapsed is not None, "the lease lapsed")
        server.restart()
        mgr.save(3, _state(3)).wait()
        assert mgr.remote.flush(timeout_s=60), "no upload after the outage"
        assert mgr.remote.not_uploaded == []
        record = _record(server, f"{prefix}/run")
        assert record is not None and record["session"] == mgr.group.session
    assert _remote_steps(server, url)[-1] == 3
    with CheckpointManager(url, storage_options=server.storage_options) as reader:
        assert _equal(reader.restore(), _state(3))
    uploads = [e for e in events if isinstance(e, UploadEvent)]
    assert any(e.outcome == "failed" for e in uploads)
    assert uploads[-1].outcome == "committed" and uploads[-1].step == 3
    # close() gave the record up: at once, or, when an upload attempt was still running at
    # close(), by the upload thread as that attempt ends (never while it may still write)
    _poll(lambda: _record(server, f"{prefix}/run") is None, "the owner record was given up")


def test_remote_tier_down_when_the_run_starts_uploads_once_it_is_up(
    tmp_path: Path, server: S3Server
) -> None:
    """The bucket cannot be reached when the manager starts (no owner record can be taken):
    the run goes on, and once the bucket answers the next upload takes the record and goes
    through."""
    url = f"s3://{server.fresh_prefix()}/run"
    server.kill()
    with CheckpointManager(
        tmp_path / "local", remote=url, remote_storage_options=_fast_failing(server)
    ) as mgr:
        assert mgr.remote is not None
        mgr.save(1, _state(1)).wait()
        server.restart()
        mgr.save(2, _state(2)).wait()
        assert mgr.remote.flush(timeout_s=60)
    assert _remote_steps(server, url)[-1] == 2


def test_close_gives_up_on_a_bucket_that_stays_down_and_names_what_was_not_uploaded(
    tmp_path: Path, server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """The bucket goes down for good (past the lease time): close() makes one last attempt
    instead of waiting out its timeout, logs an error naming the steps that did not reach the
    bucket and its URL, and the local checkpoints stay committed."""
    caplog.set_level(logging.ERROR, logger="coci_core")
    url = f"s3://{server.fresh_prefix()}/run"
    mgr = CheckpointManager(
        tmp_path / "local", remote=url, remote_storage_options=_fast_failing(server)
    )
    assert mgr.remote is not None
    mgr.save(1, _state(1)).wait()
    assert mgr.remote.flush(timeout_s=60)
    lease = mgr.remote._lease
    assert lease is not None
    server.kill()
    for step in (2, 3):
        mgr.save(step, _state(step)).wait()
    _poll(lambda: lease.lapsed is not None, "the lease lapsed")
    closer = threading.Thread(target=mgr.close)
    closer.start()
    closer.join(timeout=120)  # the default close timeout is 600 s
    assert not closer.is_alive(), "close() waited for an upload that cannot succeed"
    assert mgr.remote.not_uploaded == [2, 3]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("2, 3" in m and "were not uploaded" in m and url in m for m in errors), errors
    with CheckpointManager(tmp_path / "local") as local:
        assert local.steps() == [1, 2, 3]
        assert _equal(local.restore(), _state(3))
    server.restart()
    assert _remote_steps(server, url) == [1]  # the bucket keeps what it had


def _failed_save(mgr: CheckpointManager, step: int) -> StorageError:
    """The StorageError that the save of ``step`` fails with: raised by ``save`` itself (it
    looks the step up in the directory), or in the background (then a BackgroundSaveError
    caused by it)."""
    with pytest.raises((StorageError, BackgroundSaveError)) as failed:
        mgr.save(step, _state(step)).wait()
    error = failed.value
    if isinstance(error, BackgroundSaveError):
        error = error.__cause__  # type: ignore[assignment]
    assert isinstance(error, StorageError), repr(error)
    return error


def test_s3_directory_outage_longer_than_the_lease(tmp_path: Path, server: S3Server) -> None:
    """An ``s3://`` checkpoint directory down for longer than the lease time: the saves meanwhile
    fail with a StorageError naming the URL (or a BackgroundSaveError caused by one), the
    committed step is untouched, and the first save after the outage commits (the writer
    takes its own owner record again)."""
    prefix = server.fresh_prefix()
    url = f"s3://{prefix}/run"
    with CheckpointManager(url, storage_options=_fast_failing(server), keep_last=None) as mgr:
        mgr.save(1, _state(1)).wait()
        lease = mgr._owner.lease
        assert lease is not None
        server.kill()
        during = _failed_save(mgr, 2)
        assert url in str(during) and "cannot be reached" in str(during)
        _poll(lambda: lease.lapsed is not None, "the lease lapsed")
        _failed_save(mgr, 3)
        server.restart()
        mgr.save(4, _state(4)).wait()
        assert mgr.steps() == [1, 4]
        record = _record(server, f"{prefix}/run")
        assert record is not None and record["session"] == mgr.group.session
    with CheckpointManager(url, storage_options=server.storage_options) as reader:
        assert reader.verify() == {1: [], 4: []}
        assert _equal(reader.restore(step=1), _state(1))
        assert _equal(reader.restore(), _state(4))


def test_a_record_another_writer_took_during_the_outage_is_not_taken_back(
    server: S3Server,
) -> None:
    """While the store was down past the lease time another writer took the owner record:
    once the store is back, the first writer does not take it back (its saves are refused
    with DirectoryInUseError), and the other writer's record stays."""
    prefix = server.fresh_prefix()
    url = f"s3://{prefix}/run"
    with CheckpointManager(url, storage_options=_fast_failing(server)) as mgr:
        mgr.save(1, _state(1)).wait()
        lease = mgr._owner.lease
        assert lease is not None
        server.kill()
        _poll(lambda: lease.lapsed is not None, "the lease lapsed")
        server.restart()
        # what another writer that found the record stale writes (unconditionally here: if
        # the first writer renewed just before, this overwrites it all the same)
        mine = _record(server, f"{prefix}/run")
        assert mine is not None
        usurper = dict(mine, session="usurper", pid=1, renewed=time.time() + 3600)
        server.filesystem().pipe_file(f"{prefix}/run/{LEASE_NAME}", json.dumps(usurper).encode())
        _poll(lambda: lease.lost is not None, "the first writer saw the record taken")
        with pytest.raises(DirectoryInUseError, match="no longer owns"):
            mgr.save(2, _state(2))
    assert _record(server, f"{prefix}/run") == usurper
    assert _remote_steps(server, url) == [1]


_OTHER_WRITER = """
import json
import sys

import torch
from coci_core import CheckpointManager
with CheckpointManager(sys.argv[1], storage_options=json.loads(sys.argv[2])) as mgr:
    mgr.restore()
    torch.manual_seed(5)
    mgr.save(5, {"w": torch.randn(64, 64), "b": torch.randn(64)}).wait()
"""


def test_a_record_taken_again_after_another_writer_committed_orders_after_it(
    server: S3Server,
) -> None:
    """While the first writer's lease had lapsed, another writer took the stale record over,
    restored, committed a higher step and released the record: the first writer takes the free
    record again, and its next save (of a lower step) is numbered after the other's commit, so
    it is the newest (it re-reads the directory's highest sequence when the lease is taken
    again)."""
    prefix = server.fresh_prefix()
    url = f"s3://{prefix}/run"
    with CheckpointManager(url, storage_options=_fast_failing(server)) as first:
        first.save(1, _state(1)).wait()
        lease = first._owner.lease
        assert lease is not None and lease._remote is not None
        # a zombie: the first writer renews nothing until the other writer is done
        with lease._remote._renewing:
            server.kill()
            _poll(lambda: lease.lapsed is not None, "the lease lapsed")
            server.restart()
            # another process: this one's registry refuses a second
            other = run(script(_OTHER_WRITER, url, json.dumps(server.storage_options)))
            assert other.returncode == 0, other.stderr[-2000:]
            assert _record(server, f"{prefix}/run") is None  # released
        first.save(2, _state(2)).wait()
        assert lease.generation == 1
    with CheckpointManager(url, storage_options=server.storage_options) as reader:
        assert reader.latest_step() == 2
        assert _equal(reader.restore(), _state(2))


# -- wrong credentials, a missing bucket ------------------------------------------------------


def _wrong_secret(server: S3Server, prefix: str) -> tuple[str, dict[str, Any]]:
    return f"s3://{prefix}/run", {**server.storage_options, "secret": "not-the-secret"}


def _unknown_key(server: S3Server, prefix: str) -> tuple[str, dict[str, Any]]:
    return f"s3://{prefix}/run", {**server.storage_options, "key": "nobody"}


def _missing_bucket(server: S3Server, prefix: str) -> tuple[str, dict[str, Any]]:
    return f"s3://coci-missing-{prefix.rsplit('-', 1)[-1]}/run", server.storage_options


_REFUSALS = {
    "wrong-secret": (_wrong_secret, "access denied"),
    "unknown-key": (_unknown_key, "access denied"),
    "missing-bucket": (_missing_bucket, "does not exist"),
}


@pytest.fixture
def committed(s3_server: S3Server, s3_prefix: str) -> str:
    """``bucket/prefix`` holding a committed step 1, written with the right credentials."""
    with CheckpointManager(f"s3://{s3_prefix}/run", storage_options=s3_server.storage_options) as m:
        m.save(1, _state(1)).wait()
    return s3_prefix


@pytest.mark.parametrize("refusal", sorted(_REFUSALS))
def test_a_store_that_refuses_us_is_an_error_for_every_manager_read(
    s3_server: S3Server, committed: str, refusal: str
) -> None:
    """steps(), latest_step(), runs(), verify() and restore() raise a StorageError naming the
    URL and the cause: never an empty directory, never NoCheckpointError."""
    make, cause = _REFUSALS[refusal]
    url, options = make(s3_server, committed)
    with CheckpointManager(url, storage_options=options) as mgr:
        reads: list[Callable[[], object]] = [
            mgr.steps,
            mgr.latest_step,
            mgr.runs,
            mgr.verify,
            mgr.restore,
            lambda: mgr.restore(step=1),
        ]
        for read in reads:
            with pytest.raises(StorageError) as refused:
                read()
            assert url in str(refused.value) and cause in str(refused.value)
            assert SECRET_KEY not in str(refused.value)


def test_an_empty_prefix_in_an_existing_bucket_is_an_empty_directory(
    s3_server: S3Server, s3_prefix: str
) -> None:
    """A fresh run's directory: nothing committed, no error."""
    with CheckpointManager(f"s3://{s3_prefix}/run", storage_options=s3_server.storage_options) as m:
        assert m.steps() == [] and m.latest_step() is None
    listed = s3_server.run_coci("ls", f"s3://{s3_prefix}/run")
    assert listed.returncode == 1 and "coci: no committed checkpoints" in listed.stderr


@pytest.mark.parametrize("refusal", ["wrong-secret", "missing-bucket"])
def test_a_remote_tier_that_refuses_us_is_an_error_unless_the_local_tier_has_steps(
    s3_server: S3Server, committed: str, refusal: str, tmp_path: Path
) -> None:
    """With a remote tier that cannot be read, a restore takes the local tier's newest step
    (with a warning) when there is one; with an empty local disk (a new node) it raises the
    StorageError instead of NoCheckpointError, which an adapter would take for a fresh run."""
    make, cause = _REFUSALS[refusal]
    url, options = make(s3_server, committed)
    with CheckpointManager(tmp_path / "node", remote=url, remote_storage_options=options) as m:
        with pytest.raises(StorageError, match=cause):
            m.latest_step()
        with pytest.raises(StorageError, match=cause):
            m.restore()
    with CheckpointManager(tmp_path / "old-node") as local:
        local.save(7, _state(7)).wait()
    with CheckpointManager(tmp_path / "old-node", remote=url, remote_storage_options=options) as m:
        assert m.latest_step() == 7
        assert _equal(m.restore(), _state(7))
        assert m.last_restore is not None and m.last_restore.tier == "local"


@pytest.mark.parametrize("refusal", ["wrong-secret", "missing-bucket"])
@pytest.mark.parametrize("command", ["ls", "verify", "export"])
def test_the_cli_reports_a_store_that_refuses_us(
    s3_server: S3Server, committed: str, refusal: str, command: str, tmp_path: Path
) -> None:
    """``coci ls|verify|export`` with wrong credentials or a missing bucket print the URL and
    the cause on stderr and exit 1, instead of "no committed checkpoints"."""
    make, cause = _REFUSALS[refusal]
    url, options = make(s3_server, committed)
    env = {"AWS_SECRET_ACCESS_KEY": options["secret"]}
    args = {"ls": [url], "verify": [url], "export": [url, str(tmp_path / "out.pt")]}[command]
    done = s3_server.run_coci(command, *args, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no committed checkpoints" not in done.stdout + done.stderr
    assert url in done.stderr and cause in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("refusal", ["wrong-secret", "missing-bucket"])
def test_lightning_resume_from_a_store_that_refuses_us_raises(
    s3_server: S3Server, committed: str, refusal: str, tmp_path: Path
) -> None:
    """CociCheckpoint(dirpath=s3://..., resume=True) on a real Trainer: fit raises the
    StorageError instead of training from scratch."""
    make, cause = _REFUSALS[refusal]
    url, options = make(s3_server, committed)
    model = DigitsModel()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[CociCheckpoint(dirpath=url, storage_options=options, resume=True)],
    )
    with pytest.raises(StorageError, match=cause):
        trainer.fit(model)
    assert model.seen == []  # not one step trained


@pytest.mark.parametrize("refusal", ["wrong-secret", "missing-bucket"])
def test_accelerate_resume_from_a_store_that_refuses_us_raises(
    s3_server: S3Server, committed: str, refusal: str, tmp_path: Path
) -> None:
    """CociCheckpointer.resume() on a real Accelerator raises the StorageError instead of
    returning 0 (a fresh start)."""
    make, cause = _REFUSALS[refusal]
    url, options = make(s3_server, committed)
    AcceleratorState._reset_state(True)
    accelerator = Accelerator(
        cpu=True,
        project_dir=str(tmp_path),
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, use_stateful_dataloader=True
        ),
    )
    model = torch.nn.Linear(64, 10)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    ckpt = CociCheckpointer(accelerator, url, storage_options=options)
    try:
        with pytest.raises(StorageError, match=cause):
            ckpt.resume()
    finally:
        ckpt.close(save=False)
        AcceleratorState._reset_state(True)


_FORGED_RECORDS = {
    "nested past the parser": b"[" * 100_000 + b"]" * 100_000,
    "a field nested past the parser": b'{"renewed":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "renewed beyond a float": b'{"renewed": 1e400, "ttl": 60, "pid": 1, "since": 1e300}',
    "a lifetime beyond a float": b'{"renewed": 1, "ttl": 1e400, "pid": 1, "since": 1}',
    "renewed in a thousand years": json.dumps(
        {"renewed": time.time() + 3e10, "ttl": 60, "pid": 1, "host": "h", "since": 1}
    ).encode(),
    "not an object": b"[1, 2]",
}


@pytest.mark.parametrize("forged", sorted(_FORGED_RECORDS))
def test_a_forged_owner_record_is_taken_over_as_stale(server: S3Server, forged: str) -> None:
    """An owner record no writer makes (JSON nested past the parser, numbers beyond a float,
    a lease that would last a thousand years) neither crashes a save with a raw error nor locks
    the directory for ever: it is stale, taken over with a warning, and the save commits."""
    prefix = server.fresh_prefix()
    url = f"s3://{prefix}/run"
    server.filesystem().pipe_file(f"{prefix}/run/{LEASE_NAME}", _FORGED_RECORDS[forged])
    with CheckpointManager(url, storage_options=server.storage_options) as mgr:
        mgr.save(1, _state(1)).wait()
        assert mgr.steps() == [1]
    assert _remote_steps(server, url) == [1]
