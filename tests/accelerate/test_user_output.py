"""What an Accelerate user reads with no logging configured: coci's plan line, a line per save
with ``verbose=True`` and the end-of-run summary, each once on stderr (Accelerate itself shows
nothing below WARNING then). From the main process only, with two processes: tests/contract."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness.processes import module, run

_CHILD = "tests.accelerate._logging_child"


def _lines(stderr: str, pattern: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.search(pattern, line)]


def _check_each_line_once(stderr: str) -> None:
    (fresh,) = _lines(stderr, r"starting fresh")
    assert fresh.startswith("coci: no committed checkpoint in ")
    (plan,) = _lines(stderr, r"coci: plan at step")
    assert "first save at step 5" in plan and "then every 5 steps" in plan
    assert "of 12 steps (given as total_steps)" in plan
    for step in (5, 10, 12):  # one line per save: the verbose one, no second from the engine
        (line,) = _lines(stderr, rf"(\bstep {step} saved\b|\bsaved step {step}\b)")
        assert f"coci: step {step} saved: stall " in line and " MB written" in line
    (summary,) = _lines(stderr, r"checkpoints committed")
    assert "coci: 3 checkpoints committed (newest step 12)" in summary


@pytest.mark.slow
def test_one_process(tmp_path: Path) -> None:
    out = run(module(_CHILD, str(tmp_path)), timeout_s=300)
    assert out.returncode == 0, out.stderr
    _check_each_line_once(out.stderr)
    assert "coci:" not in out.stdout
