"""Lightning's CociCheckpoint (default ``preemption="auto"``) gets a real SIGTERM: every rank
saves the step after it, the process exits 143 (Lightning saves nothing of its own), and the
restarted run resumes from that step, bit-identical to a run never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from coci_core import CheckpointManager
from tests.harness.processes import Child, module, run

CHILD = "tests.preemption._lightning_child"


def _rows(lines: list[str], mark: str) -> list[dict[str, Any]]:
    """Every ``<mark> <json>`` the ranks printed: two ranks share the pipe, and one's line may
    run into the other's (``print`` writes the text and the newline apart)."""
    decoder, rows = json.JSONDecoder(), []
    for line in lines:
        if mark + " " not in line:
            continue
        for part in line.split(mark + " ")[1:]:
            rows.append(decoder.raw_decode(part.strip())[0])
    return rows


def _preempt(directory: Path, *args: str, kill_scope: Any = "process") -> tuple[int, list[str]]:
    """Run the child with ``--notice 3``; at its READY, SIGTERM the process it names, then
    let it go on. Its exit status and output lines."""
    command = module(CHILD, str(directory), "40", "--notice", "3", *args)
    with Child(command, stderr=subprocess.DEVNULL, kill_scope=kill_scope) as child:
        lines = []
        while line := child.readline():
            lines.append(line)
            if line.startswith("READY "):
                os.kill(int(line.split()[1]), signal.SIGTERM)
                child.send("go\n")  # after the signal: the handler ran before the step goes on
                break
        lines.extend(child.lines())
        code = child.wait(60)
    return code, lines


def test_lightning_stops_on_sigterm_saves_the_next_step_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    code, lines = _preempt(tmp_path / "run")
    assert code == 143
    (stop,) = _rows(lines, "PREEMPTED")
    # SIGTERM after step 3: step 4 is the boundary every rank learns of it at, and is saved
    assert stop == {"rank": 0, "saved": 4, "code": 143, "should_stop": True}
    assert not _rows(lines, "RESULT")  # nothing after trainer.fit ran
    with CheckpointManager(tmp_path / "run" / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [2, 4]  # the planned save at step 2, the notice's at 4
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["coci"]  # no .ckpt
    done = run(
        module(CHILD, str(tmp_path / "run"), "12", "--reference", str(tmp_path / "ref")),
        timeout_s=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    (result,), (reference,) = _rows(lines, "RESULT"), _rows(lines, "REFERENCE")
    assert result["start"] == 4 and reference["start"] == 0
    assert result["digest"] == reference["digest"]


@pytest.mark.parametrize(
    ("grace", "saved"),
    [("0.001", None), ("2", 4)],
    ids=["cannot-fit", "within-the-margin"],
)
def test_lightning_short_grace_saves_only_what_can_fit(
    tmp_path: Path, grace: str, saved: int | None
) -> None:
    """A grace period shorter than the margin (3 s): a save that cannot fit even at the pace
    of the fastest save so far is not started, and the previous checkpoint stays the newest;
    one that fits at that pace is tried (on a local directory a save cut short costs nothing)
    and committed. Either way the process exits 143."""
    code, lines = _preempt(tmp_path, "--preemption", f"TERM@{grace}")
    assert code == 143
    (stop,) = _rows(lines, "PREEMPTED")
    assert stop["saved"] == saved and stop["code"] == 143
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == ([2] if saved is None else [2, saved])


@pytest.mark.dist
def test_lightning_ddp_sigterm_to_rank_1_alone(tmp_path: Path) -> None:
    """Two gloo processes; only rank 1 gets SIGTERM: both learn of it at the same step
    boundary, both save their share of step 4, and both exit 143."""
    code, lines = _preempt(tmp_path, "--ddp", "--rank", "1", kill_scope="group")
    stops = {row["rank"]: row for row in _rows(lines, "PREEMPTED")}
    assert sorted(stops) == [0, 1]
    assert stops[0]["saved"] == stops[1]["saved"] == 4
    assert code == 143  # rank 0, the process the launcher runs as
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [2, 4]
        assert mgr.manifest(4).world_size == 2


def test_lightning_puts_the_signal_handlers_back_after_an_exception(tmp_path: Path) -> None:
    """A fit that fails: Lightning puts back the handlers it found (coci's, stopped by then)
    after the callbacks' on_exception; coci has them put back what coci replaced instead, so
    that no stopped handler is left to swallow a later SIGTERM."""
    import lightning.pytorch as pl

    from coci_lightning import CociCheckpoint
    from tests.lightning.models import DigitsModel

    seen: list[Any] = []

    class Failing(DigitsModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            seen.append(signal.getsignal(signal.SIGTERM))
            if self.global_step == 2:
                raise RuntimeError("a failing step")
            return super().training_step(batch, batch_idx)

    before = signal.getsignal(signal.SIGTERM)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=5,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[CociCheckpoint(save_on_exception=False)],
    )
    with pytest.raises(RuntimeError, match="a failing step"):
        trainer.fit(Failing())
    assert seen and seen[0] is not before  # Lightning's handler, coci's chained after it
    assert signal.getsignal(signal.SIGTERM) is before
