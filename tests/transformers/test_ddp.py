"""Two processes (torchrun and ``accelerate launch``, gloo, DDP through the Trainer): SIGKILLed
mid-epoch and resumed with ``train(resume_from_checkpoint=True)``, bit-identical on both;
SIGTERM to one of them: both save at the next step, stop with exit status 143, and resume
bit-identical; the killed run's checkpoint also resumes onto one process; with no coci
checkpoint and a Trainer checkpoint on process 0's own disk only, both raise one error; past a
newest weights-only step, both resume the same older full step (one from the remote tier) or
both raise one error."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from accelerate.state import AcceleratorState

from coci_core import CheckpointManager
from coci_transformers import CociCallback
from tests.harness.processes import Child, child_env, free_port, module, run
from tests.transformers.run import train


def _torchrun() -> list[str]:
    """torchrun of two processes on a port of their own (its default 29500 may be taken)."""
    return module(
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "tests.transformers.run",
    )


BATCH = 4  # per process


def _results(stdout: str, mark: str = "RESULT ") -> dict[int, dict[str, Any]]:
    lines = stdout.splitlines()
    results = [json.loads(line[len(mark) :]) for line in lines if line.startswith(mark)]
    return {r["rank"]: r for r in results}


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.faults
def test_two_processes_sigkill_sigterm_and_resume_onto_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    total, kill = 12, 7  # 4 steps an epoch (32 samples, 2 x 4 a step); saves at 3, 6, 9, 12
    env = child_env({"OMP_NUM_THREADS": "1"})
    with Child(
        [*_torchrun(), str(tmp_path / "run"), str(total), str(kill)],
        env=env,
        stderr=subprocess.DEVNULL,
        kill_scope="tree",
    ) as child:
        child.kill_at(f"AT {kill}")
    with CheckpointManager(tmp_path / "run" / "coci", keep_last=None) as mgr:
        steps = mgr.steps()
        manifest = mgr.manifest(steps[-1])
    assert steps and steps[-1] <= kill and steps[-1] % 3 == 0
    start = steps[-1]
    # both processes wrote their share, and each its own random states
    assert manifest.world_size == 2
    assert len(manifest.per_rank) == 2 and all(r.tree for r in manifest.per_rank)
    shutil.copytree(tmp_path / "run", tmp_path / "one")

    # the same processes first train a run never stopped, then resume the killed one, then
    # train a run that gets SIGTERM
    command = [*_torchrun(), str(tmp_path / "run"), str(total), "--resume"]
    reference, sigterm = ["--reference", str(tmp_path / "ref")], ["--sigterm", str(tmp_path / "t")]
    # no coci checkpoint, and a Trainer checkpoint in process 0's own output_dir only
    (tmp_path / "apart" / "node0" / "checkpoint-3").mkdir(parents=True)
    apart = ["--apart", str(tmp_path / "apart")]
    # resume_from_checkpoint=True whose newest step (6) is weights-only: in "kept" the remote
    # tier alone holds full step 3 and process 1's disk nothing (a new node): both resume 3; in
    # "alone" process 0's disk holds 3 and process 1's step 6 only, no remote: both refuse
    fallback = []
    for name, remote in (("kept", True), ("alone", False)):
        node0 = tmp_path / name / "node0"
        coci = {"policy": "every_n_steps"} | (
            {"remote": str(node0.parent / "remote")} if remote else {}
        )
        train(node0, 3, callback=CociCallback(**coci))
        AcceleratorState._reset_state(True)
        train(node0, 6, resume=True, callback=CociCallback(**coci), save_only_model=True)
        AcceleratorState._reset_state(True)
        (six,) = (node0 / "coci").glob("step-0000000006*")
        if remote:  # process 0's disk lost step 3 too: the remote tier alone holds it
            (three,) = (node0 / "coci").glob("step-0000000003*")
            shutil.rmtree(three)
        else:
            shutil.copytree(six, tmp_path / name / "node1" / "coci" / six.name)
        fallback += ["--fallback", str(tmp_path / name)]
    out = run([*command, *reference, *apart, *fallback, *sigterm], env=env, timeout_s=300)
    # both raise one error (before: process 0 resumed from its checkpoint-3, process 1 started
    # fresh, and their collectives no longer matched)
    errors = [r["error"] for r in _results(out.stdout, "APART ").values()]
    assert len(errors) == 2 and errors[0] == errors[1], errors
    assert "no Trainer checkpoint in" in errors[0] and "rank(s) [0] hold one" in errors[0]
    rows = [json.loads(x[9:]) for x in out.stdout.splitlines() if x.startswith("FALLBACK ")]
    kept = [r.get("start", r.get("error")) for r in rows if r["dir"] == "kept"]
    assert kept == [3, 3], rows  # each process the same step, one from the remote tier
    alone = [r.get("error") for r in rows if r["dir"] == "alone"]
    assert len(alone) == 2 and alone[0] == alone[1], rows  # one error, on both
    assert "save_only_model" in alone[0], alone
    # the workers exit 143 on the notice (the SIGTERM run, last): torchrun reports a failure
    assert out.returncode != 0 and "exitcode  : 143" in out.stderr, out.stderr[-3000:]
    expected, resumed = _results(out.stdout, "REFERENCE "), _results(out.stdout)
    for rank in (0, 1):
        assert resumed[rank]["start"] == start
        assert resumed[rank]["digest"] == expected[rank]["digest"]
        assert resumed[rank]["seen"] == expected[rank]["seen"][start * BATCH :]

    # SIGTERM to process 1 alone after step 4: both save step 5, the next boundary, and stop
    # (each raises Preempted out of train(), exit status 143)
    stopped = _results(out.stdout, "SIGTERM ")
    assert stopped[0]["saved"] == stopped[1]["saved"] == 5
    assert stopped[0]["code"] == stopped[1]["code"] == 143
    assert sum(x.startswith("RESULT ") for x in out.stdout.splitlines()) == 2  # the resume's
    with CheckpointManager(tmp_path / "t" / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [3, 5]
        assert mgr.manifest(5).world_size == 2
    # restarted (by `accelerate launch` this time), both resume step 5 and end bit-identical to
    # the run never stopped
    launch = module(
        "accelerate.commands.launch",
        *("--multi_gpu", "--num_processes", "2", "--num_machines", "1"),
        *("--mixed_precision", "no", "--dynamo_backend", "no"),
        *("--main_process_port", str(free_port()), "-m", "tests.transformers.run"),
    )
    again = run([*launch, str(tmp_path / "t"), str(total), "--resume"], env=env, timeout_s=300)
    assert again.returncode == 0, again.stderr[-3000:]
    after = _results(again.stdout)
    for rank in (0, 1):
        assert after[rank]["start"] == 5
        assert after[rank]["digest"] == expected[rank]["digest"]
        assert after[rank]["seen"] == expected[rank]["seen"][5 * BATCH :]

    # onto one process: the same step, the run goes on to its end (batches by count)
    AcceleratorState._reset_state(True)
    with caplog.at_level("WARNING", logger="coci_transformers"):
        one = train(tmp_path / "one", total, resume=True)
    assert one["start"] == start
    # said, though process 0 has its saved random state: the samples skipped are not those
    # trained on (it said nothing then)
    said = [r.getMessage() for r in caplog.records if "saved by 2 processes" in r.getMessage()]
    assert said and "by count" in said[0], [r.getMessage() for r in caplog.records]
    assert len(one["seen"]) == (total - start) * BATCH
    history = [e for e in expected[0]["log"] if e.get("step", 0) <= start]
    assert one["log"][: len(history)] == history
