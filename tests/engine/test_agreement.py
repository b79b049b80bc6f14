"""The ranks' exchange of restore reports through a real TCPStore, the store hosted by rank 0."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from coci_core.engine.agreement import RestoreAgreement
from tests.harness.processes import free_port


class _Observed:
    """A store that calls ``before_get`` and ``after_get`` around each ``get``, and
    ``after_get_wait`` on a ``wait`` that follows a ``get``."""

    def __init__(
        self,
        store: Any,
        *,
        before_get: Any = None,
        after_get: Any = None,
        after_get_wait: Any = None,
    ):
        self._store = store
        self._before_get = before_get
        self._after_get = after_get
        self._after_get_wait = after_get_wait
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
