"""Lightning's resume of 2 DDP ranks (gloo) agrees on the step through coci's
``read_checkpoint``: a rank SIGKILLed during it fails the other's resume once it has been
silent for ``RANK_SILENT_S``, not after the agreement's timeout (30 min)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from tests.harness.processes import Child, free_port, module, rank_env

pytestmark = [pytest.mark.dist, pytest.mark.faults]

SILENT_S = 2.0


def test_a_rank_killed_during_a_lightning_resume_fails_the_others_once_silent(
    tmp_path: Path,
) -> None:
    """Rank 1 killed before it says which step it read: rank 0's ``fit`` raises the agreed
    error naming it within seconds (before: it waited in the agreement for 1800 s)."""
    cfg = {"dir": str(tmp_path), "victim": 1, "silent_s": SILENT_S}
    command = module("tests.lightning._resume_kill_child", json.dumps(cfg))
    port = free_port()
    with contextlib.ExitStack() as stack:
        ranks = [
            stack.enter_context(
                Child(command, env=rank_env(r, 2, port, {"LOCAL_RANK": str(r), "NODE_RANK": "0"}))
            )
            for r in range(2)
        ]
        assert any(line.startswith("KILLME") for line in ranks[1].lines())
        ranks[1].kill()
        out, _ = ranks[0].communicate(timeout_s=60)
        assert ranks[0].wait() == 0
    (result,) = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert "rank 1 stopped giving signs of life before saying which checkpoint" in (
        result["error"] or ""
    ), result
    assert result["error"].startswith("CheckpointError: ")
    assert SILENT_S <= result["seconds"] < 30, result
