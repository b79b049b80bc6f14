"""Two ranks (threads of this process) agreeing through a real ``TCPStore`` on loopback, as
the ranks of a job agree through its rendezvous store."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from coci_core.engine.agreement import RestoreAgreement
from tests.harness.processes import free_port


def on_two_ranks(restore: Callable[[int, RestoreAgreement], Any]) -> list[Any]:
    """``restore(rank, agreement)`` on ranks 0 and 1 at once: what each returned, or the
    exception it raised."""
    port = free_port()
    stores = [
        TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False),
        TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30)),
    ]
    outcome: list[Any] = [None, None]

    def rank(r: int) -> None:
        try:
            outcome[r] = restore(r, RestoreAgreement(stores[r], r, 2, timeout_s=30))
        except Exception as e:  # the finding
            outcome[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcome
