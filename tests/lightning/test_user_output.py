"""What a Lightning user reads with no logging configured: coci's plan line, a line per save
with ``verbose=True`` and the end-of-run summary, each once, on stderr as Lightning's own
messages are; the same once when the user configures logging. (From rank 0 only, with two
processes: tests/contract, for every adapter.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness.processes import module, run

_CHILD = "tests.lightning._logging_child"


def _lines(stderr: str, pattern: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.search(pattern, line)]


def _check_each_line_once(stderr: str) -> None:
    (plan,) = _lines(stderr, r"coci: plan at step \d+ \(")
    assert "first save at step 5" in plan and "then every 5 steps" in plan
    # a fixed interval, which no MTBF moves: said so, with how to change it
    assert "MTBF assumed" not in plan and "mtbf_s" not in plan, plan
    assert "a fixed interval" in plan and "CociCheckpoint(every_n_steps=N)" in plan
    for step in (5, 10, 12):  # one line per save: the verbose one, no second from the engine
        (line,) = _lines(stderr, rf"(\bstep {step} saved\b|\bsaved step {step}\b)")
        assert f"coci: step {step} saved: stall " in line and " MB written" in line
    (summary,) = _lines(stderr, r"checkpoints committed")
    assert "coci: 3 checkpoints committed (newest step 12)" in summary


@pytest.mark.slow
@pytest.mark.parametrize("configured", [False, True], ids=["default-logging", "basicConfig"])
def test_one_process(tmp_path: Path, configured: bool) -> None:
    """Lightning's own messages and coci's reach stderr alike; with ``logging.basicConfig``
    (after the imports) coci's lines still appear once, through the user's handler."""
    extra = ["basicConfig"] if configured else []
    out = run(module(_CHILD, str(tmp_path), "1", *extra), timeout_s=300)
    assert out.returncode == 0, out.stderr
    assert "`Trainer.fit` stopped: `max_steps=12` reached." in out.stderr  # Lightning's own
    _check_each_line_once(out.stderr)
    assert "coci:" not in out.stdout
    prefixed = _lines(out.stderr, r"^INFO:coci_lightning\.callback:coci: ")
    assert len(prefixed) == (5 if configured else 0)  # the user's format, when configured
