"""The engine against a real S3 server (SeaweedFS on loopback; see tests/harness/s3.py)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.engine.directory import lease as lease_module
from coci_core.engine.directory.lease import LEASE_NAME
from coci_core.errors import (
    CorruptCheckpointError,
    DirectoryInUseError,
    StepExistsError,
    StorageError,
)
from coci_core.storage import FsspecStorage, Storage
from tests.harness.processes import child_env, module, run, script
from tests.harness.s3 import SECRET_KEY, S3Server
from tests.storage.contract import StorageContract

_S3_VARIABLES = ("AWS_", "FSSPEC_")  # a child reaches the server through the ones it is given


class TestFsspecS3(StorageContract):
    @pytest.fixture
    def storage(self, s3_server: S3Server, s3_prefix: str) -> Storage:
        return FsspecStorage(f"s3://{s3_prefix}/root", **s3_server.storage_options)


def test_a_missing_prefix_is_an_empty_directory(s3_server: S3Server, s3_prefix: str) -> None:
    """A prefix never written to, in a bucket that exists: empty, no error (a fresh run)."""
    fresh = FsspecStorage(f"s3://{s3_prefix}/never-written", **s3_server.storage_options)
    assert fresh.list_dir("") == [] and fresh.list_dir("step-1") == []
    assert not fresh.exists("step-1/manifest.json")
    assert fresh.read_record(LEASE_NAME) is None


@pytest.mark.parametrize("refusal", ["missing-bucket", "wrong-secret"])
@pytest.mark.parametrize("operation", ["list_dir", "exists", "read_record", "put_record"])
def test_a_missing_bucket_or_refused_credentials_are_an_error(
    s3_server: S3Server, s3_prefix: str, refusal: str, operation: str
) -> None:
    """A bucket that does not exist, or credentials the server refuses, raise a StorageError
    naming the URL and the cause (s3fs reports a missing bucket as FileNotFoundError, as it
    does a missing prefix, and lets botocore's own errors through)."""
    opts = s3_server.storage_options
    if refusal == "missing-bucket":
        storage, cause = FsspecStorage("s3://coci-no-such-bucket/run", **opts), "does not exist"
    else:
        storage = FsspecStorage(f"s3://{s3_prefix}/run", **{**opts, "secret": "wrong"})
        cause = "access denied"
    calls: dict[str, Callable[[], object]] = {
        "list_dir": lambda: storage.list_dir(""),
        "exists": lambda: storage.exists("step-1/manifest.json"),
        "read_record": lambda: storage.read_record(LEASE_NAME),
        "put_record": lambda: storage.put_record(LEASE_NAME, b"{}", if_absent=True),
    }
    with pytest.raises(StorageError, match=cause) as refused:
        calls[operation]()
    assert storage.url in str(refused.value)
    assert SECRET_KEY not in str(refused.value)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)},
        "optim": {
            "exp_avg": torch.randn(256, 64, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(256, 64, generator=g) * 1e-6 + 1e-9,
            "step": torch.tensor(seed, dtype=torch.int64),
        },
        "meta": {"epoch": seed, "name": "run"},
    }


def _close(a: Any, b: Any, exact: bool) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], exact) for k in a)
    if isinstance(a, torch.Tensor):
        if exact or not a.is_floating_point():
            return torch.equal(a, b)
        return bool(torch.allclose(a, b, rtol=0.05, atol=1e-3))
    return bool(a == b)


def _keys(server: S3Server, url: str) -> list[str]:
    fs = server.filesystem()
    root = url.removeprefix("s3://")
    return sorted(p.removeprefix(root + "/") for p in fs.find(root))


@pytest.mark.parametrize("compression", ["none", "lossless", "lossy", "auto"])
def test_round_trip_every_compression_mode(
    s3_server: S3Server, s3_prefix: str, compression: str
) -> None:
    """Saves of a drifting state restore exactly (bounded error for lossy deltas) from S3, and
    only committed steps and the owner record are left in the bucket."""
    url = f"s3://{s3_prefix}/run"
    states = [_state(1)]
    for i in range(2, 5):  # small updates, so that delta codecs have something to encode
        s = _state(i)
        s["model"] = {k: v + 1e-3 * s["model"][k] for k, v in states[-1]["model"].items()}
        states.append(s)
    with CheckpointManager(
        url, storage_options=s3_server.storage_options, compression=compression, keep_last=None
    ) as mgr:
        for i, s in enumerate(states, start=1):
            mgr.save(i, s, block=False)
        mgr.wait()
        assert mgr.steps() == [1, 2, 3, 4]
    with CheckpointManager(url, storage_options=s3_server.storage_options) as reader:
        assert reader.verify() == {1: [], 2: [], 3: [], 4: []}
        for i, s in enumerate(states, start=1):
            restored = reader.restore(step=i)
            assert _close(restored, s, exact=compression != "lossy" or i == 1)
    keys = _keys(s3_server, url)
    assert all(k.startswith("step-000000000") for k in keys), keys  # owner record released
    assert {k.split("/")[0] for k in keys} == {f"step-000000000{i}" for i in range(1, 5)}
    assert all(".coci-tmp-" not in k for k in keys)


def test_overwrite_retention_and_damage(s3_server: S3Server, s3_prefix: str) -> None:
    """Re-save with overwrite replaces a step's objects; keep_last deletes older steps only
    behind newer commits; a flipped byte in an object is found by verify and skipped by
    restore."""
    url = f"s3://{s3_prefix}/run"
    opts = s3_server.storage_options
    with CheckpointManager(url, storage_options=opts, keep_last=2, compression="none") as mgr:
        mgr.save(1, {"w": torch.ones(1000)}).wait()
        with pytest.raises(StepExistsError):
            mgr.save(1, {"w": torch.zeros(1000)})
        old = [k for k in _keys(s3_server, url) if k.startswith("step-0000000001/data-")]
        mgr.save(1, {"w": torch.full((1000,), 7.0)}, overwrite=True).wait()
        new = [k for k in _keys(s3_server, url) if k.startswith("step-0000000001/data-")]
        assert old and new and not set(old) & set(new)  # the old objects are gone
        assert torch.equal(mgr.restore(step=1)["w"], torch.full((1000,), 7.0))
        for step in (2, 3, 4):
            mgr.save(step, {"w": torch.full((1000,), float(step))}).wait()
    # Retention runs after each commit, behind it: close() lets it finish.
    assert {k.split("/")[0] for k in _keys(s3_server, url)} == {
        "step-0000000003",
        "step-0000000004",
    }
    # Damage one data object of the newest step in place (S3 has no partial writes: rewrite it).
    fs = s3_server.filesystem()
    data = next(k for k in _keys(s3_server, url) if k.startswith("step-0000000004/data-"))
    path = f"{s3_prefix}/run/{data}"
    blob = bytearray(fs.cat_file(path))
    blob[100] ^= 0xFF
    fs.pipe_file(path, bytes(blob))
    with CheckpointManager(url, storage_options=opts) as mgr:
        assert mgr.verify() == {3: [], 4: ["/w"]}
        assert torch.equal(mgr.restore()["w"], torch.full((1000,), 3.0))
        assert mgr.last_restore is not None and mgr.last_restore.skipped_steps == (4,)
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(strict=True)


def test_cli_reads_s3_through_the_environment(
    s3_server: S3Server, s3_prefix: str, tmp_path: Path
) -> None:
    """``coci ls/verify/export s3://...`` reach the server through the AWS_* variables that
    s3fs (botocore) honours; the secret never appears in the output."""
    url = f"s3://{s3_prefix}/run"
    with CheckpointManager(url, storage_options=s3_server.storage_options) as mgr:
        mgr.save(5, {"w": torch.arange(10.0)}).wait()
    env = child_env(s3_server.env, drop_prefixes=_S3_VARIABLES)

    def coci(*args: str) -> subprocess.CompletedProcess[str]:
        return run(module("coci_core.commands.cli", *args), env=env)

    ls = coci("ls", url)
    assert ls.returncode == 0, ls.stderr
    assert "5" in ls.stdout
    verify = coci("verify", url)
    assert verify.returncode == 0, verify.stderr
    out = tmp_path / "s5.pt"
    export = coci("export", url, str(out))
    assert export.returncode == 0, export.stderr
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.arange(10.0))
    for proc in (ls, verify, export):
        assert SECRET_KEY not in proc.stdout + proc.stderr
    # fsspec's own variables (FSSPEC_S3_<option>) work as well.
    env = child_env(
        {
            "FSSPEC_S3_ENDPOINT_URL": s3_server.endpoint,
            "FSSPEC_S3_KEY": s3_server.storage_options["key"],
            "FSSPEC_S3_SECRET": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        },
        drop_prefixes=_S3_VARIABLES,
    )
    ls2 = coci("ls", url)
    assert ls2.returncode == 0 and ls2.stdout == ls.stdout, ls2.stderr
    # Without the variables, the CLI cannot reach the server: the test above is not vacuous.
    env = child_env(
        {
            "AWS_ACCESS_KEY_ID": "nobody",
            "AWS_SECRET_ACCESS_KEY": "wrong",
            "AWS_ENDPOINT_URL": s3_server.endpoint,
        },
        drop_prefixes=_S3_VARIABLES,
    )
    denied = coci("ls", url)
    assert denied.returncode != 0
    assert "5" not in denied.stdout.split()


_SECOND_WRITER = """
import json, sys
import torch
from coci_core import CheckpointManager
from coci_core.engine.directory import lease as lease_module
from coci_core.errors import DirectoryInUseError
opts = json.loads(sys.argv[2])
with CheckpointManager(sys.argv[1], storage_options=opts) as mgr:
    try:
        mgr.save(99, {"w": torch.zeros(3)})
    except DirectoryInUseError as e:
        print("REFUSED", e)
        sys.exit(3)
print("SAVED")
"""


def test_two_writers_on_one_prefix(s3_server: S3Server, s3_prefix: str) -> None:
    """While one process writes to an S3 prefix, another process's save there is refused (the
    owner record is created with a conditional put); after close, the prefix is free."""
    url = f"s3://{s3_prefix}/run"
    opts = s3_server.storage_options
    cmd = script(_SECOND_WRITER, url, json.dumps(opts))
    with CheckpointManager(url, storage_options=opts) as first:
        first.save(1, {"w": torch.ones(3)}).wait()
        record = json.loads(s3_server.filesystem().cat_file(f"{s3_prefix}/run/{LEASE_NAME}"))
        assert record["session"] == first.group.session
        assert record["pid"] == os.getpid()
        proc = run(cmd)
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert f"process {os.getpid()}" in proc.stdout
        first.save(2, {"w": torch.ones(3) * 2}).wait()  # the first writer goes on
        assert first.steps() == [1, 2]
    assert not s3_server.filesystem().exists(f"{s3_prefix}/run/{LEASE_NAME}")
    proc = run(cmd)
    assert proc.returncode == 0 and "SAVED" in proc.stdout, proc.stdout + proc.stderr


_KILLED_WRITER = """
import json, os, signal, sys
import torch
from coci_core import CheckpointManager
mgr = CheckpointManager(sys.argv[1], storage_options=json.loads(sys.argv[2]))
mgr.save(1, {"w": torch.ones(3)}).wait()
print(os.getpid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_writer_killed_on_this_machine_does_not_hold_the_prefix(
    s3_server: S3Server, s3_prefix: str
) -> None:
    """A writer SIGKILLed on this machine leaves its owner record behind, but a new writer here
    sees that its process is gone and takes over at once (a restarted job need not wait for
    the lease time); its committed step is intact."""
    url = f"s3://{s3_prefix}/run"
    opts = s3_server.storage_options
    proc = run(script(_KILLED_WRITER, url, json.dumps(opts)))
    assert proc.returncode == -9, proc.stderr
    fs = s3_server.filesystem()
    left = json.loads(fs.cat_file(f"{s3_prefix}/run/{LEASE_NAME}"))
    assert left["pid"] == int(proc.stdout.split()[0])
    assert left["renewed"] + left["ttl"] > time.time()  # not expired: only "died here" frees it
    with CheckpointManager(url, storage_options=opts) as mgr:
        assert torch.equal(mgr.restore()["w"], torch.ones(3))
        mgr.save(2, {"w": torch.ones(3) * 2}).wait()
        assert mgr.steps() == [1, 2]


@pytest.mark.parametrize("pid", ["2**70", "Infinity"])
def test_a_live_owner_record_of_this_machine_with_no_pid_refuses_the_writer(
    s3_server: S3Server, s3_prefix: str, pid: str
) -> None:
    """A live owner record naming this machine and a PID no process can have (forged) was a
    raw OverflowError out of the save ("Python int too large to convert to C long"): the
    writer is refused as by any live record, and the record is left as it was."""
    url = f"s3://{s3_prefix}/run"
    fs = s3_server.filesystem()
    forged = (
        json.dumps(
            {"host": "x", "session": "s", "since": 0.0, "renewed": time.time(), "ttl": 600}
            | {"machine": lease_module._machine()}
        )[:-1]
        + f', "pid": {2**70 if pid == "2**70" else pid}}}'
    )
    fs.pipe_file(f"{s3_prefix}/run/{LEASE_NAME}", forged.encode())
    with (
        CheckpointManager(url, storage_options=s3_server.storage_options) as mgr,
        pytest.raises(DirectoryInUseError, match="another coci writer"),
    ):
        mgr.save(1, {"w": torch.ones(3)})
    assert fs.cat_file(f"{s3_prefix}/run/{LEASE_NAME}") == forged.encode()


def _poll(condition: Any, timeout_s: float = 20.0) -> None:
    """Wait until ``condition()`` holds (checked every 20 ms), or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        pause.wait(0.02)


def test_stale_owner_record_is_taken_over_renewed_and_its_writer_fenced(
    s3_server: S3Server, s3_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record nobody renewed for the lease time (a writer that died) is taken over; the
    heartbeat renews it; a writer whose record another one took refuses its next save instead
    of writing beside the new owner, and leaves the new owner's record alone."""
    monkeypatch.setattr(lease_module, "LEASE_TTL_S", 1.5)  # renewed every 0.5 s
    url = f"s3://{s3_prefix}/run"
    key = f"{s3_prefix}/run/{LEASE_NAME}"
    opts = s3_server.storage_options
    fs = s3_server.filesystem()

    def record() -> dict[str, Any]:
        fs.invalidate_cache(key)
        return dict(json.loads(fs.cat_file(key)))

    dead = {"pid": 1, "host": "gone", "session": "dead", "since": 0.0, "renewed": 0.0, "ttl": 60}
    fs.pipe_file(key, json.dumps(dead).encode())
    with CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()  # took the stale lease
        taken = record()
        assert taken["session"] == mgr.group.session and taken["ttl"] == 1.5
        _poll(lambda: record()["renewed"] > taken["renewed"])  # the heartbeat renews it
        # Another writer takes the record over (as if this one had stalled past the TTL):
        # the heartbeat's conditional renewal fails, and saves are refused from then on.
        fs.pipe_file(key, json.dumps(dict(taken, session="usurper", renewed=1e12)).encode())
        lease = mgr._owner.lease
        assert lease is not None
        _poll(lambda: lease.lost is not None)
        with pytest.raises(DirectoryInUseError, match="no longer owns"):
            mgr.save(2, {"w": torch.ones(3)})
    assert record()["session"] == "usurper"  # close() left the new owner's record alone
    assert mgr.steps() == [1]


def test_credentials_stay_out_of_reprs_and_logs(
    s3_server: S3Server, s3_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The secret of storage_options appears in no repr, log record or telemetry file."""
    caplog.set_level("DEBUG", logger="coci_core")
    url = f"s3://{s3_prefix}/run"
    with CheckpointManager(url, storage_options=s3_server.storage_options) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
        mgr.restore()
        texts = [repr(mgr), repr(mgr.storage), str(mgr.storage.url)]
    with CheckpointManager(url, storage_options=s3_server.storage_options) as a:
        a.save(2, {"w": torch.ones(3)})
        b = CheckpointManager(url, storage_options=s3_server.storage_options)
        with pytest.raises(DirectoryInUseError):
            b.save(3, {"w": torch.ones(3)})
        b.close()
    texts += [r.getMessage() for r in caplog.records]
    assert caplog.records  # the refusal above was logged
    fs = s3_server.filesystem()
    texts += [fs.cat_file(p).decode("utf-8", "replace") for p in fs.find(s3_prefix)]
    assert not [t for t in texts if SECRET_KEY in t]
