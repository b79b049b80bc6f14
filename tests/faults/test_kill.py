"""Process death: SIGKILL inside a persist, then a new process resumes bit-exactly."""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path
from typing import Any

import pytest

from coci_core import CheckpointManager
from coci_core.commands.demo import PAUSE_MARK, train
from tests.harness.processes import Child, module, run, script

pytestmark = pytest.mark.faults

TOTAL, EVERY, KILL = 120, 20, 80


def run_child(args: list[str], *, kill_on_pause: bool) -> tuple[int, dict[str, Any] | None, str]:
    """``coci_core.commands.demo.run_child``'s trainer and protocol, forked from the harness's
    torch zygote (the demo's own starts a fresh interpreter: torch imported again, each time):
    SIGKILLed when it says it is paused in a persist; its exit status, result and stage."""
    result, paused_at = None, ""
    with Child(module("coci_core.commands.demo", *args)) as child:
        for line in child.lines():
            if line.startswith(PAUSE_MARK) and kill_on_pause:
                paused_at = line.split()[-1]
                child.kill()
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
        return child.wait(), result, paused_at


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Final weights of an uninterrupted run."""
    digests: dict[str, str] = train(None, total_steps=TOTAL, save_every=EVERY)["digests"]
    return digests


@pytest.mark.parametrize(
    ("stage", "block"),
    [("data", True), ("manifest", True), ("publish", True), ("manifest", False)],
    ids=["mid-data-write", "before-manifest", "before-publish", "before-manifest-nonblocking"],
)
def test_sigkill_during_persist_then_exact_resume(
    tmp_path: Path, reference: dict[str, str], stage: str, block: bool
) -> None:
    """Killed inside the persist of step 80: step 60 is the newest, the resume ends bit-exact."""
    common = ["--dir", str(tmp_path), "--total-steps", str(TOTAL), "--save-every", str(EVERY)]
    if not block:
        common.append("--no-block")
    code, result, paused_at = run_child(
        [*common, "--pause-step", str(KILL), "--pause-stage", stage], kill_on_pause=True
    )
    assert code == -signal.SIGKILL
    assert result is None
    assert paused_at == stage
    leftovers = [n for n in os.listdir(tmp_path) if ".coci-tmp-" in n]
    assert len(leftovers) == 1  # the unpublished step 80
    with CheckpointManager(tmp_path, keep_last=None) as mgr:
        assert mgr.steps() == [20, 40, 60]

    code, resumed, _ = run_child(common, kill_on_pause=False)
    assert code == 0
    assert resumed is not None
    assert not [n for n in os.listdir(tmp_path) if ".coci-tmp-" in n]  # its first save's work
    assert resumed["restored_step"] == 60
    assert [s["step"] for s in resumed["saves"]] == [80, 100, 120]
    assert resumed["digests"] == reference


def test_disk_full_in_background_surfaces_and_keeps_previous(tmp_path: Path) -> None:
    """A real write failure (file size limit, EFBIG) in the writer thread is raised to the
    caller, nothing is published, and the earlier checkpoint restores intact."""
    code = textwrap.dedent(
        f"""
        import resource, signal, torch
        from coci_core import CheckpointManager, BackgroundSaveError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
        mgr = CheckpointManager({str(tmp_path)!r}, keep_last=None)
        mgr.save(1, {{"w": torch.ones(1000)}}).wait()
        mgr.save(2, {{"w": torch.zeros(1_000_000)}})
        try:
            mgr.wait()
        except BackgroundSaveError as e:
            print("ERROR", e.step, type(e.__cause__).__name__, e.__cause__.errno)
        print("STEPS", mgr.steps())
        print("W1", bool(torch.equal(mgr.restore()["w"], torch.ones(1000))))
        mgr.close()
        """
    )
    out = run(script(code), check=True).stdout
    assert "ERROR 2 StorageError 27" in out  # 27 = EFBIG
    assert "STEPS [1]" in out
    assert "W1 True" in out
    assert not [n for n in os.listdir(tmp_path) if ".coci-tmp-" in n]
