"""Beats an agreement leaves on for the job's next restore (``restore_watched``'s Carry)."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from coci_core.engine import pulse as pulse_module
from coci_core.engine.agreement import RestoreAgreement
from coci_core.engine.pulse import restore_watched


def _count(store: dist.Store, key: str) -> int:
    return int(store.add(key, 0))


def test_carried_beats_that_no_restore_takes_stop_and_a_later_read_beats_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error between Lightning's setup agreement and its read (a process that goes on):
    the carried beats stopped only at the next restore, a thread and a store connection for
    ever; they stop after CARRY_S, and a read that takes them later beats again under the same
    key, which its watch follows."""
    monkeypatch.setattr(pulse_module, "PULSE_S", 0.01)
    monkeypatch.setattr(pulse_module, "CARRY_S", 0.2, raising=False)
    monkeypatch.setattr(pulse_module, "_carried", [])
    store = dist.HashStore()
    with restore_watched(RestoreAgreement(store, 0, 2, name="alike")) as watched:
        watched.carry = True
    ((_, session, pulse),) = pulse_module._carried
    key = pulse_module._key(session, 0)
    deadline = time.monotonic() + 3
    while pulse._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not pulse._thread.is_alive()
    stopped = _count(store, key)
    time.sleep(0.1)
    assert _count(store, key) == stopped
    read = RestoreAgreement(store, 0, 2)
    with restore_watched(read):
        assert read.watch is not None and read.watch._session == session
        time.sleep(0.1)
        assert _count(store, key) > stopped  # beating again, under the carried key
    assert pulse_module._carried == []
