"""Lightning's resume of 2 DDP ranks (gloo; ``_resume_kill_child``): the ranks agree on the
step through coci's ``read_checkpoint``. A rank SIGKILLed during it fails the other's resume
once it has been silent for ``RANK_SILENT_S``, not after the agreement's timeout (30 min); a rank
that resolved ``ckpt_path="last"`` to no coci checkpoint (another directory) fails every
rank's at once, instead of training fresh while the others wait for it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.processes import Child, free_port, module, rank_env

pytestmark = [pytest.mark.dist, pytest.mark.faults, pytest.mark.slow]

SILENT_S = 2.0


@contextlib.contextmanager
def _ranks(cfg: dict[str, Any]) -> Iterator[list[Child]]:
    command = module("tests.lightning._resume_kill_child", json.dumps(cfg))
    port = free_port()
    extra = [{"LOCAL_RANK": str(r), "NODE_RANK": "0"} for r in range(2)]
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(Child(command, env=rank_env(r, 2, port, extra[r])))
            for r in range(2)
        ]


def _result(child: Child) -> dict[str, Any]:
    out, _ = child.communicate(timeout_s=60)
    assert child.wait() == 0
    (result,) = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return dict(result)


def test_a_rank_killed_during_a_lightning_resume_fails_the_others_once_silent(
    tmp_path: Path,
) -> None:
    """Rank 1 killed before it says which step it read: rank 0's ``fit`` raises the agreed
    error naming it within seconds (before: it waited in the agreement for 1800 s)."""
    with _ranks({"dir": str(tmp_path), "victim": 1, "silent_s": SILENT_S}) as ranks:
        assert any(line.startswith("KILLME") for line in ranks[1].lines())
        ranks[1].kill()
        result = _result(ranks[0])
    assert "rank 1 stopped giving signs of life before saying which checkpoint" in (
        result["error"] or ""
    ), result
    assert result["error"].startswith("CheckpointError: ")
    assert SILENT_S <= result["seconds"] < 30, result


def test_a_rank_killed_between_the_setup_agreement_and_its_read_fails_the_others_once_silent(
    tmp_path: Path,
) -> None:
    """Rank 1 killed after the callback's setup agreed that every rank reads, before its read
    began: rank 0's ``fit`` raises naming it once silent (before: rank 1 never beat in the
    read's agreement and rank 0 waited for it there for 1800 s)."""
    cfg = {"dir": str(tmp_path), "victim": 1, "silent_s": SILENT_S, "at": "read"}
    with _ranks(cfg) as ranks:
        assert any(line.startswith("KILLME") for line in ranks[1].lines())
        ranks[1].kill()
        result = _result(ranks[0])
    assert "rank 1 stopped giving signs of life before saying which checkpoint" in (
        result["error"] or ""
    ), result
    assert SILENT_S <= result["seconds"] < 30, result


def test_a_rank_that_resolves_no_checkpoint_fails_every_ranks_resume_at_once(
    tmp_path: Path,
) -> None:
    """Rank 1's ``CociCheckpoint`` names another, empty directory: both ranks raise the same
    error at once (before: rank 1 started fresh and rank 0 waited in the agreement)."""
    cfg = {"dir": str(tmp_path), "victim": 1, "empty": True, "silent_s": SILENT_S}
    with _ranks(cfg) as ranks:
        results = [_result(rank) for rank in ranks]
    assert results[0]["error"] == results[1]["error"], results
    error = results[0]["error"] or ""
    assert error.startswith("CorruptCheckpointError: no checkpoint can be restored on every")
    assert "rank 1: NoCheckpointError: no committed checkpoint in" in error
    assert "rank(s) [0] hold one" in error and "every process must see the same" in error
    assert all(r["seconds"] < 10 for r in results), results


def test_a_lightning_file_on_one_ranks_disk_only_fails_every_ranks_resume_at_once(
    tmp_path: Path,
) -> None:
    """No coci step; rank 0's own directory holds an ``OnExceptionCheckpoint`` file, rank 1's
    none: both ranks raise one error at once (before: rank 0 resumed from the file while rank
    1 started fresh)."""
    cfg = {"dir": str(tmp_path), "victim": 1, "lightning_file": True, "silent_s": SILENT_S}
    with _ranks(cfg) as ranks:
        results = [_result(rank) for rank in ranks]
    assert results[0]["error"] == results[1]["error"], results
    error = results[0]["error"] or ""
    assert error.startswith("CorruptCheckpointError: the processes would resume from different")
    assert "process 0: Lightning's on_exception.ckpt, process 1: nothing" in error, error
