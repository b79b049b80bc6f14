"""The ranks' exchange of restore reports through a real TCPStore, the store hosted by rank 0."""

from __future__ import annotations

import shutil
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from coci_core import CheckpointManager, ConfigError
from coci_core.engine.agreement import RestoreAgreement
from coci_core.engine.format.manifest import step_dir_name
from coci_core.engine.restore.restore import restore_newest
from coci_core.errors import CheckpointError
from coci_core.storage import open_storage
from tests.harness.agreement import on_two_ranks
from tests.harness.processes import free_port


class _Observed:
    """A store that calls ``before_get`` and ``after_get`` around each ``get``,
    ``before_wait`` before each ``wait`` and ``after_get_wait`` on a ``wait`` that follows a
    ``get``."""

    def __init__(
        self,
        store: Any,
        *,
        before_get: Any = None,
        after_get: Any = None,
        after_get_wait: Any = None,
        before_wait: Any = None,
    ):
        self._store = store
        self._before_get = before_get
        self._after_get = after_get
        self._after_get_wait = after_get_wait
        self._before_wait = before_wait
        self._got = False

    def get(self, key: str) -> bytes:
        if self._before_get is not None:
            self._before_get()
        value = self._store.get(key)
        self._got = True
        if self._after_get is not None:
            self._after_get()
        return value

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        if self._before_wait is not None:
            self._before_wait()
        if self._got and self._after_get_wait is not None:
            self._after_get_wait()
        self._store.wait(keys, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_rank_0_that_hosts_the_store_stays_until_every_rank_has_read_the_reports() -> None:
    """Rank 0 hosts the store (a job started with env:// or mp.spawn) and leaves as soon as its
    exchange returns, taking the store with it, as a rank raising the agreed error does. A rank
    that reads a moment later must still get every report (before: rank 0 returned at once and
    the slower rank failed with the store's "connection reset" instead of the agreed error)."""
    port = free_port()
    host = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    client = TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    rank_0_waits_or_left = threading.Event()
    order: list[str] = []
    results: dict[int, Any] = {}

    def rank_0() -> None:
        nonlocal host
        store = _Observed(host, after_get_wait=rank_0_waits_or_left.set)
        results[0] = RestoreAgreement(store, 0, 2, timeout_s=30).exchange({"found": 0})
        order.append("rank 0 returned")
        rank_0_waits_or_left.set()
        del store
        host = None  # the store's server stops with its last reference, as when rank 0 exits

    def rank_1() -> None:
        store = _Observed(
            client,
            before_get=lambda: rank_0_waits_or_left.wait(30),
            after_get=lambda: order.append("rank 1 read a report"),
        )
        try:
            results[1] = RestoreAgreement(store, 1, 2, timeout_s=30).exchange({"found": 1})
        except Exception as e:  # what the slower rank met is the finding
            results[1] = e

    threads = [threading.Thread(target=rank_0), threading.Thread(target=rank_1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[1] == [{"found": 0}, {"found": 1}], results[1]
    assert results[0] == results[1]
    assert order == ["rank 1 read a report"] * 2 + ["rank 0 returned"]


def test_a_store_that_went_away_is_named_not_a_timeout_nor_a_torch_error() -> None:
    """Rank 0, which hosts the store, exits (its own error, a kill): the other rank says that
    the job's store stopped answering, at once, with coci's error (before: torch's
    DistNetworkError from the first call, or "rank(s) [0, 1] did not say within 1800 s"
    after a fraction of a second)."""
    port = free_port()
    host = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    client = TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    agreement = RestoreAgreement(client, 1, 2, timeout_s=1800)
    waiting = threading.Event()
    outcome: list[BaseException] = []

    def rank_1() -> None:
        store = _Observed(client, before_wait=waiting.set)
        agreement.store = store
        try:
            agreement.exchange({"found": 1})
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=rank_1)
    thread.start()
    waiting.wait(30)
    del host  # rank 0 exits while rank 1 waits for its report
    thread.join(60)
    assert not thread.is_alive()
    (error,) = outcome
    assert isinstance(error, CheckpointError), repr(error)
    assert "stopped answering" in str(error) and "1800" not in str(error)
    with pytest.raises(CheckpointError, match="stopped answering"):
        RestoreAgreement(client, 1, 2)  # the next restore: not torch's error either


def _restore_on_two_ranks(directory: Path, steps: tuple[Any, Any]) -> list[Any]:
    """restore_newest(step=steps[r]) on two ranks (threads) agreeing through a real store:
    what each returned (the step restored) or raised."""

    def restore(r: int, agreement: RestoreAgreement) -> int:
        loaded, _ = restore_newest(open_storage(str(directory)), steps[r], agreement=agreement)
        return loaded.step

    return on_two_ranks(restore)


def test_ranks_that_ask_for_different_steps_are_told_so(tmp_path: Path) -> None:
    """restore(step=6) on rank 0 and restore(step=4) on rank 1, both intact: both ranks raise
    one ConfigError naming what each asked for (before: "no checkpoint can be restored on
    every rank (rank 0: no step 6 ...)", a CorruptCheckpointError on a healthy directory)."""
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        for step in (2, 4, 6):
            mgr.save(step, {"w": torch.full((3,), float(step))}).wait()
    apart = _restore_on_two_ranks(tmp_path, (6, 4))
    for error in apart:
        assert isinstance(error, ConfigError), repr(error)
        assert "rank 0: step 6, rank 1: step 4" in str(error)
    assert _restore_on_two_ranks(tmp_path, (4, 4)) == [4, 4]
    assert _restore_on_two_ranks(tmp_path, (4, "step-0000000004")) == [4, 4]  # one checkpoint
    assert _restore_on_two_ranks(tmp_path, (None, None)) == [6, 6]
    (error, _) = _restore_on_two_ranks(tmp_path, (None, 2))
    assert isinstance(error, ConfigError) and "rank 0: the newest, rank 1: step 2" in str(error)


def test_newer_steps_only_one_rank_holds_are_not_called_another_runs(tmp_path: Path) -> None:
    """Node-local directories of two runs, rank 0's at steps 8 and 12, rank 1's at step 4:
    rank 0 passes over both its steps as not intact on every rank (rank 1 holds no step 8 or
    12 of any run), and the one error says so (before: "of another run than the other ranks'
    checkpoint of that step", of steps no other rank holds)."""
    for name, steps in (("a", (8, 12)), ("b", (4,))):
        with CheckpointManager(tmp_path / name, keep_last=None) as mgr:
            for step in steps:
                mgr.save(step, {"w": torch.full((3,), float(step))}).wait()

    def restore(r: int, agreement: RestoreAgreement) -> int:
        storage = open_storage(str(tmp_path / ("a", "b")[r]))
        loaded, _ = restore_newest(storage, None, agreement=agreement)
        return loaded.step

    errors = on_two_ranks(restore)
    assert all(isinstance(e, CheckpointError) for e in errors), errors
    said = str(errors[0])
    assert "step 12: passed over: not intact on every rank" in said, said
    assert "step 8: passed over: not intact on every rank" in said, said
    assert "of another run" not in said, said


def _chained(step: int) -> torch.Tensor:
    return torch.full((4096,), 1.5) + step * (torch.arange(4096) % 3 == 0)


def test_ranks_whose_copies_of_a_delta_chain_differ_end_on_one_step_or_one_error(
    tmp_path: Path,
) -> None:
    """Node-local copies of one run whose steps 2 to 4 are deltas against step 1: rank 1's
    copy without step 4 restores step 3 on both ranks; rank 1's copy without the base (its
    deltas cannot be read) is one error on both, naming the missing base."""
    with CheckpointManager(tmp_path / "a", keep_last=None, compression="lossless") as mgr:
        for step in range(1, 5):
            mgr.save(step, {"w": _chained(step)}).wait()
    assert mgr.manifest(4).bases == (1,)
    for name, gone in (("newest", 4), ("base", 1)):
        shutil.copytree(tmp_path / "a", tmp_path / name)
        shutil.rmtree(tmp_path / name / step_dir_name(gone))

    def restore(name: str) -> list[Any]:
        def on(r: int, agreement: RestoreAgreement) -> int:
            storage = open_storage(str(tmp_path / ("a", name)[r]))
            loaded, _ = restore_newest(storage, None, agreement=agreement)
            assert torch.equal(loaded.state["w"], _chained(loaded.step))
            return loaded.step

        return on_two_ranks(on)

    assert restore("newest") == [3, 3]
    errors = restore("base")
    assert all(isinstance(e, CheckpointError) for e in errors), errors
    assert str(errors[0]) == str(errors[1]) and "on every rank" in str(errors[0])
    assert "delta against step 1, which cannot be read" in str(errors[0])
