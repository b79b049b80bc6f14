"""Every order of exit, close and destroy: the process ends with status 0 and a quiet stderr,
and what was saved is durable (or, when the storage is gone, one line says what is not).

Scripts end in all the ways real ones do: without ``close()``, after
``dist.destroy_process_group()`` (torchrun's examples), with the manager freed when a
function returns, with one rank calling ``sys.exit`` while the other goes on, with the S3
server or the directory gone before exit. Each runs in real processes (gloo for two ranks, a
SeaweedFS server of its own for S3); the checkpoint is then restored by a fresh manager.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from coci_core import BackgroundSaveError, CheckpointManager, RankGroup
from tests.adversarial._exit_child import state
from tests.harness.processes import Child, child_env, free_port, module, rank_env, run
from tests.harness.s3 import S3Server, start_s3_server

_CHILD = "tests.adversarial._exit_child"
_BAD = ("Traceback", "terminate called", "Exception ignored", "Fatal Python error")


def _env() -> dict[str, str]:
    return child_env({"OMP_NUM_THREADS": "1"})


def _coci_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("coci")]


def _assert_clean(code: int, stderr: str, *, max_coci_lines: int = 0) -> None:
    assert code == 0, f"exit status {code}:\n{stderr}"
    for bad in _BAD:
        assert bad not in stderr, stderr
    assert len(_coci_lines(stderr)) <= max_coci_lines, stderr


def _assert_restores(directory: Path, step: int) -> None:
    """A fresh manager restores ``step`` as the newest step, exactly, and it verifies."""
    with CheckpointManager(directory) as reader:
        assert reader.latest_step() == step
        restored = reader.restore()
        assert reader.last_restore is not None and reader.last_restore.step == step
        for key, value in state(step).items():
            assert torch.equal(restored[key], value), key
        assert reader.verify() == {s: [] for s in reader.steps()}


def _run_two_ranks(tmp_path: Path, order: str) -> list[tuple[int, str]]:
    cfg = json.dumps({"kind": "two_ranks", "dir": str(tmp_path / "ckpt"), "order": order})
    port = free_port()
    with contextlib.ExitStack() as stack:
        ranks = []
        for rank in range(2):
            err = stack.enter_context(open(tmp_path / f"rank{rank}.err", "w"))
            env = rank_env(rank, 2, port)
            child = Child(module(_CHILD, cfg), env=env, stdout=None, stderr=err)
            ranks.append(stack.enter_context(child))
        codes = [child.wait(timeout_s=180) for child in ranks]
    return [(code, (tmp_path / f"rank{r}.err").read_text()) for r, code in enumerate(codes)]


_TWO_RANK_ORDERS = [
    "exit",
    "freed",
    "destroy",
    "close-destroy",
    "destroy-close",
    "nonblocking-destroy",
    "rank0-exits-first",
]


@pytest.mark.dist
@pytest.mark.parametrize("order", _TWO_RANK_ORDERS)
def test_two_ranks_end_cleanly_and_durably_in_every_exit_order(tmp_path: Path, order: str) -> None:
    """Both ranks exit with status 0, no traceback or C++ abort, no coci line; step 2 (still
    being persisted when the order began) is committed and restores exactly."""
    results = _run_two_ranks(tmp_path, order)
    for code, stderr in results:
        _assert_clean(code, stderr)
    _assert_restores(tmp_path / "ckpt", 2)


def test_exit_during_warm_up_does_not_abort(tmp_path: Path) -> None:
    """The warm-up thread fills the arena with a torch op: the interpreter waits for it
    instead of finalizing under it (which aborted the process with SIGABRT)."""
    cfg = {"kind": "one_process", "dir": str(tmp_path), "order": "warm_up"}
    cfg_json = json.dumps({**cfg, "warm_up_bytes": 1 << 28})
    proc = run(module(_CHILD, cfg_json), env=_env())
    _assert_clean(proc.returncode, proc.stderr)


def test_a_thread_saving_after_the_main_thread_ended_gets_a_clear_error(tmp_path: Path) -> None:
    """The main thread's pending save is made durable when it ends, and the manager is closed
    then: a non-daemon thread's later save raises an error that says so."""
    cfg = {"kind": "one_process", "dir": str(tmp_path), "order": "late-thread"}
    proc = run(module(_CHILD, json.dumps(cfg)), env=_env())
    _assert_clean(proc.returncode, proc.stderr)
    assert "RAISED CociError" in proc.stdout, proc.stdout
    assert "closed at interpreter exit" in proc.stdout, proc.stdout
    _assert_restores(tmp_path, 1)


def test_a_forked_child_ends_without_waiting_for_the_parents_save(tmp_path: Path) -> None:
    """A child forked while a save is pending (a DataLoader worker, say) ends at once: at its
    exit it does not wait for the parent's save, whose writer thread it does not have."""
    group = RankGroup(0, 2, "forkedchild", timeout_s=3)  # rank 1 never reports: still pending
    mgr = CheckpointManager(tmp_path, group=group)
    handle = mgr.save(1, state(1))
    assert not handle.done()
    child = multiprocessing.get_context("fork").Process(target=int)
    child.start()
    child.join(timeout=30)
    stuck = child.is_alive()
    if stuck:
        child.kill()
        child.join()
    assert not stuck and child.exitcode == 0
    with pytest.raises(BackgroundSaveError, match="rank"):
        mgr.close()


class _GoneStorage:
    """A child whose storage goes away after it printed READY: an S3 server stopped, or a
    local directory removed."""

    def __init__(self, tmp_path: Path, server: S3Server | None) -> None:
        self.server = server
        self.local = str(tmp_path / "ckpt")
        if server is None:
            self.url = self.local
            self.options: dict[str, Any] = {}
        else:
            self.url = f"s3://{server.fresh_prefix()}"
            # fail fast once the server is gone (s3fs and botocore retry otherwise)
            self.options = {**server.storage_options, "config_kwargs": _NO_RETRIES}

    def run(self, order: str, *, as_remote: bool = False) -> subprocess.CompletedProcess[str]:
        """Run the child (``as_remote``: with a local directory and this storage as its remote
        tier); the storage goes away once it is READY."""
        cfg: dict[str, Any] = {"kind": "one_process", "dir": self.url, "order": order}
        if as_remote:
            cfg.update(dir=self.local, remote=self.url)
        cfg["storage_options"] = self.options
        with Child(module(_CHILD, json.dumps(cfg)), env=_env(), stderr="pipe") as child:
            ready = child.readline()
            assert ready.startswith("READY"), child.communicate(timeout_s=60)[1]
            self.go_away()
            out, err = child.communicate("go\n", timeout_s=120)
            return subprocess.CompletedProcess(child.proc.args, child.wait(), out, err)

    def go_away(self) -> None:
        if self.server is None:
            shutil.rmtree(self.url)
        else:  # the server dies (a graceful stop takes seconds and changes nothing here)
            self.server.process.kill()
            self.server.process.wait()


_NO_RETRIES = {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5}


@pytest.fixture
def gone_s3(tmp_path: Path) -> Iterator[_GoneStorage]:
    """A SeaweedFS server of the test's own (the test stops it; a fresh one starts faster
    than a stopped one restarts), and a child that uses it."""
    server = start_s3_server(tmp_path / "seaweedfs")
    try:
        yield _GoneStorage(tmp_path, server)
    finally:
        server.stop()


@pytest.mark.parametrize("order", ["unclosed", "freed"])
def test_exit_after_the_s3_server_went_away_is_quiet(gone_s3: _GoneStorage, order: str) -> None:
    """Nothing was pending: no line at all (the owner record that cannot be removed expires by
    itself), and no traceback from the finalizer or the exit hook."""
    proc = gone_s3.run(order)
    _assert_clean(proc.returncode, proc.stderr)


def test_a_save_pending_when_the_s3_server_went_away_is_one_line(gone_s3: _GoneStorage) -> None:
    """A save that cannot become durable at exit: status 0 and one line, naming its step."""
    proc = gone_s3.run("pending")
    _assert_clean(proc.returncode, proc.stderr, max_coci_lines=1)
    assert re.search(r"\bstep 2\b", proc.stderr), proc.stderr


@pytest.mark.parametrize("order", ["unclosed", "freed", "pending"])
def test_exit_after_the_directory_was_removed_is_quiet(tmp_path: Path, order: str) -> None:
    """The local directory removed under an unclosed manager: status 0, no traceback, at most
    one line (the pending save's)."""
    gone = _GoneStorage(tmp_path, None)
    proc = gone.run(order)
    _assert_clean(proc.returncode, proc.stderr, max_coci_lines=1)


def test_an_upload_pending_when_the_remote_went_away_is_one_attempt_and_one_line(
    gone_s3: _GoneStorage,
) -> None:
    """The remote tier's S3 server is gone: the exit does not retry the upload for minutes (it
    used to, with a warning per attempt), it makes one attempt and says so in one line; the
    local step 2 is committed and restores exactly."""
    proc = gone_s3.run("upload-pending", as_remote=True)
    _assert_clean(proc.returncode, proc.stderr, max_coci_lines=2)
    at_exit = proc.stderr.split("EXITING\n", 1)[1]
    assert len(_coci_lines(at_exit)) <= 1, proc.stderr
    assert re.search(r"upload of step 2 .*failed", proc.stderr), proc.stderr
    _assert_restores(Path(gone_s3.local), 2)
