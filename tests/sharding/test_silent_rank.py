"""A rank SIGKILLed before it writes its share of a save: the other ranks' save fails as soon
as the dead rank has been silent for ``RANK_SILENT_S`` (its sign of life through the job's
store stopped), naming it, instead of after the commit timeout (600 s, twice that for ranks
> 0), which a survivor whose loop already failed on a collective also waited at exit. Two real
processes, gloo, the default commit timeout."""

from __future__ import annotations

import contextlib
import json
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore

from coci_core import CheckpointManager
from coci_core.engine import pulse
from coci_core.engine.agreement import unset
from coci_core.engine.pulse import Watch
from tests.harness.processes import Child, free_port, module, rank_env, run, script

pytestmark = [pytest.mark.dist, pytest.mark.faults]

SILENT_S = 2.0


def _kill_one(victim: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Two ranks of ``tests.sharding._silent_child``; ``victim`` SIGKILLed when it says
    KILLME; the survivor's result (it must end within 60 s, not a timeout of minutes)."""
    command = module("tests.sharding._silent_child", json.dumps({**cfg, "victim": victim}))
    port = free_port()
    with contextlib.ExitStack() as stack:
        ranks = [stack.enter_context(Child(command, env=rank_env(r, 2, port))) for r in range(2)]
        assert any(line.startswith("KILLME") for line in ranks[victim].lines())
        ranks[victim].kill()
        survivor = ranks[1 - victim]
        out, _ = survivor.communicate(timeout_s=60)
        assert survivor.wait() == 0
    (result,) = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return dict(result)


@pytest.mark.parametrize(
    ("victim", "says"),
    [
        (1, "rank(s) [1] stopped giving signs of life before writing their share"),
        (0, "rank 0 (the coordinator) stopped giving signs of life before committing"),
    ],
    ids=["rank-1-killed", "rank-0-killed"],
)
def test_a_killed_rank_fails_the_save_once_silent_not_after_the_timeout(
    tmp_path: Path, victim: int, says: str
) -> None:
    result = _kill_one(victim, {"dir": str(tmp_path), "silent_s": SILENT_S})
    assert result["error"].startswith("CommitError: ") and says in result["error"], result
    assert result["ranks"] == [victim]
    assert SILENT_S <= result["seconds"] < 30, result
    with CheckpointManager(tmp_path) as reader:  # nothing published; step 1 intact
        assert reader.steps() == [1]
        assert reader.verify() == {1: []}


@pytest.mark.parametrize(
    ("victim", "says"),
    [
        (1, "rank 1 stopped giving signs of life before saying which checkpoint"),
        (0, "the job's key-value store stopped answering"),  # rank 0 hosts it here
    ],
    ids=["rank-1-killed", "rank-0-killed"],
)
def test_a_rank_killed_before_it_reports_in_a_restore_fails_it_once_silent(
    tmp_path: Path, victim: int, says: str
) -> None:
    """A rank SIGKILLed before it says which step it can restore: the other's restore fails
    as soon as it has been silent for ``RANK_SILENT_S``, naming it (before: rank 0 waited in
    the agreement for its timeout, 1800 s, where a save waits only the silence)."""
    result = _kill_one(victim, {"dir": str(tmp_path), "silent_s": SILENT_S, "restore": True})
    assert result["error"].startswith("CheckpointError: ") and says in result["error"], result
    assert result["seconds"] < 30, result


def test_a_rank_killed_after_it_reports_in_a_restore_is_waited_for_only_until_silent(
    tmp_path: Path,
) -> None:
    """Rank 1 killed once it said which step it holds, before it read the others' reports:
    rank 0 (which waits until every rank has read them, to keep the store it hosts up)
    restores once rank 1 is silent (before: it waited 60 s for it)."""
    cfg = {"dir": str(tmp_path), "silent_s": SILENT_S, "restore": True, "after_report": True}
    result = _kill_one(1, cfg)
    assert result["error"] is None, result
    assert SILENT_S <= result["seconds"] < 30, result


def test_a_rank_killed_before_the_first_saves_check_fails_it_once_silent(tmp_path: Path) -> None:
    """Rank 1 killed before the first save: rank 0's check that the ranks share the directory
    (an exchange through the job's store) fails once rank 1 is silent, naming it (before: it
    waited for the commit timeout, 600 s, then blamed the exchange's timeout)."""
    result = _kill_one(1, {"dir": str(tmp_path), "silent_s": SILENT_S, "first": True})
    assert result["error"].startswith(
        "CheckpointError: the ranks did not all reach the first save's check"
    ), result
    assert "rank 1 stopped giving signs of life" in result["error"], result
    assert SILENT_S <= result["seconds"] < 30, result
    assert CheckpointManager(tmp_path).steps() == []


_JOB_TIMEOUT = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from coci_core.engine.agreement import RestoreAgreement

timeout_s = float(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
agreement = RestoreAgreement.for_job()
print("TIMEOUT", agreement.timeout_s, flush=True)
if dist.get_rank() == 1 and sys.argv[2] == "never":
    sys.stdin.read()  # never comes to the restore: held here until the test ends
else:
    began = time.monotonic()
    try:
        agreement.exchange({"found": [1, 0.0, 3, "run"]})
        print("AGREED", flush=True)
    except Exception as e:
        print("ERROR", round(time.monotonic() - began, 1), e, flush=True)
"""


@pytest.mark.parametrize(("timeout_s", "rank_1"), [(4.0, "never"), (7200.0, "comes")])
def test_a_restores_agreement_waits_for_a_rank_that_never_came_the_jobs_timeout(
    timeout_s: float, rank_1: str
) -> None:
    """A rank that never reaches the restore (killed before its first sign of life, or stuck)
    was waited for 30 min whatever the job's timeout: the agreement now waits the timeout
    given to ``init_process_group`` (4 s here: the survivor's error after about 4 s, not
    1800), and a job that gave its collectives 2 h (a rank preprocessing long) is given as
    long before coci calls a late rank missing."""
    port = free_port()
    with Child(
        script(_JOB_TIMEOUT, str(timeout_s), rank_1), env=rank_env(1, 2, port), stdout="pipe"
    ) as late:
        rank0 = run(script(_JOB_TIMEOUT, str(timeout_s), rank_1), env=rank_env(0, 2, port))
        assert rank0.returncode == 0, rank0.stderr[-2000:]
        assert f"TIMEOUT {timeout_s}" in rank0.stdout, rank0.stdout
        if rank_1 == "never":
            said = next(x for x in rank0.stdout.splitlines() if x.startswith("ERROR"))
            seconds = float(said.split()[1])
            assert timeout_s <= seconds < 30, said
            assert "rank(s) [1] did not say within 4 s" in said, said
        else:
            assert "AGREED" in rank0.stdout, rank0.stdout
            assert any(line.startswith("AGREED") for line in late.lines()), "rank 1"


_BLOCKED_CLIENT = """
import sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from coci_core.engine.agreement import job_store
from coci_core.engine.group import RankGroup
from coci_core.engine.pulse import Pulse, Watch

dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1
)
store = job_store()
pulse = Pulse.start(RankGroup(1, 2, "s"))
watch = Watch(store.clone(), "s", 2.0)  # rank 0's watch, on a client of its own

def blocked():
    try:
        store.wait(["never"], timedelta(seconds=5))
    except RuntimeError:
        pass

waiter = threading.Thread(target=blocked)
waiter.start()
seen = []
while waiter.is_alive():
    seen += watch.silent([1])
    time.sleep(0.1)
print("SILENT", seen)
pulse.stop()
dist.destroy_process_group()
"""


def test_a_rank_blocked_in_the_jobs_store_still_gives_signs_of_life() -> None:
    """A thread of the rank waits 5 s in the job's store (as NCCL's set-up or a restore's
    agreement do): the rank's pulse beats on a connection of its own, so a watch with a 2 s
    silence never takes it for dead (before: the pulse shared the blocked client, and the
    rank was declared dead while alive and writing its share)."""
    proc = run(script(_BLOCKED_CLIENT, str(free_port())), timeout_s=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SILENT []" in proc.stdout, proc.stdout


_CONNECTIONS = """
import sys
import psutil
import torch.distributed as dist
from coci_core.engine.agreement import RestoreAgreement
from coci_core.engine.group import RankGroup
from coci_core.engine.pulse import Pulse, Watch, restore_watched

port = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

def to_store():
    return sum(
        1 for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == port
    )

before = to_store()
pulses = [Pulse.start(RankGroup(0, 2, name)) for name in ("first", "second", "third")]
watches = [Watch.of(RankGroup(0, 2, name)) for name in ("first", "second")]
with restore_watched(RestoreAgreement.for_job()):
    during = to_store()
print("CONNECTIONS", before, during, flush=True)
for p in pulses:
    p.stop()
dist.destroy_process_group()
"""


def test_the_pulses_and_watches_of_a_process_share_one_connection_to_the_store() -> None:
    """Three managers' pulses, two watches and a restore's beats of one process: one
    connection of their own to the job's store between them (before: one per pulse and one
    for the watches, each a socket on rank 0's store and a DNS lookup that can stall)."""
    proc = run(script(_CONNECTIONS, str(free_port())), timeout_s=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("CONNECTIONS"))
    before, during = map(int, line.split()[1:])
    assert before >= 1 and during == before + 1, proc.stdout


class _Counted:
    """A store that counts the calls made of it."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def call(*args: Any) -> Any:
            self.calls += 1
            return method(*args)

        return call


def test_a_watch_of_thousands_of_ranks_asks_the_store_once_a_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 watching 4,096 ranks asks a real TCPStore for their counters in one call a
    look, not one each (4,096 requests a second on the job's store, before); the rank that
    stopped beating is still named, and one that never beat is left to the timeout."""
    monkeypatch.setattr(pulse, "PULSE_S", 0.0)  # a look at every call
    master = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    ranks = list(range(4096))
    for rank in ranks[:-1]:  # the last never beats
        master.add(f"coci/pulse/s/r{rank}", 1)
    store = _Counted(master)
    watch = Watch(store, "s", 0.0)
    assert watch.silent(ranks) == []  # every rank seen for the first time
    assert store.calls <= len(ranks) + 1
    for rank in ranks[:-1]:
        if rank != 1234:
            master.add(f"coci/pulse/s/r{rank}", 1)
    store.calls = 0
    assert watch.silent(ranks) == [1234]
    assert store.calls <= 2


def test_the_restores_look_for_ranks_not_reported_asks_the_store_a_few_dozen_times() -> None:
    """Rank 0 of 4,096 waiting in a restore's agreement for two ranks that have not reported
    finds them in a few dozen calls of a real TCPStore a look, not one call a rank."""
    master = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    keys = [f"coci/restore/s/1/r{rank}" for rank in range(4096)]
    for rank, key in enumerate(keys):
        if rank not in (7, 3000):
            master.set(key, "{}")
    store = _Counted(master)
    assert unset(store, keys, range(1, 4096)) == [7, 3000]
    assert store.calls <= 2 * 2 * 12 + 1
    store.calls = 0
    master.set(keys[7], "{}")
    master.set(keys[3000], "{}")
    assert unset(store, keys, range(4096)) == [] and store.calls == 1


def test_a_connection_to_a_store_whose_host_was_killed_is_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank's writer thread that makes its own connection to the job's store just after
    rank 0, which hosts it, was SIGKILLed (rank 0 committed the save and went on) gives up
    after ``RANK_SILENT_S`` and uses the job's client, whose calls fail at once (before: the
    clone retried for the store's timeout, 30 min, and the rank's save never ended)."""
    monkeypatch.setattr(pulse, "RANK_SILENT_S", 1.0)
    port = free_port()
    host = script(
        "import sys, time; from datetime import timedelta; from torch.distributed import TCPStore;"
        "s = TCPStore('127.0.0.1', int(sys.argv[1]), 2, True, timeout=timedelta(seconds=60),"
        " wait_for_workers=False);"
        "print('READY', flush=True); time.sleep(600)",
        str(port),
    )
    with Child(host) as server:
        assert any(line.startswith("READY") for line in server.lines())
        client = TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=1800))
        server.kill()
        server.wait()
        made: list[Any] = []
        thread = threading.Thread(target=lambda: made.append(pulse._own_connection(client)))
        thread.daemon = True
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), "still connecting to a store whose host is gone"
    assert made == [client]
    with pytest.raises(RuntimeError):
        client.add("k", 1)
