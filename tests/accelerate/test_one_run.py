"""Accelerate on a CPU machine (issue 42): ``torchrun --nproc-per-node 2`` (as
``accelerate launch --multi_gpu``) without ``Accelerator(cpu=True)`` starts two runs of one
process each, both writing into one checkpoint directory; coci says so once, and what to pass."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from coci_accelerate import CociCheckpointer
from tests.harness.processes import child_env, free_port, module, run

WARNING = r"coci: WORLD_SIZE=2 but the Accelerator runs one process"
_CHILD = "tests.accelerate._world_child"


def _torchrun(directory: Path, *, cpu: bool) -> tuple[list[str], str]:
    port = str(free_port())  # not torchrun's default 29500, which another test may hold
    command = module(
        "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port, "-m", _CHILD
    )
    # no GPU for the children, as on a CPU machine (where Accelerate finds none by itself)
    env = child_env({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    out = run([*command, str(directory), "cpu" if cpu else "default"], env=env, timeout_s=120)
    assert out.returncode == 0, out.stderr
    # the two children share torchrun's stdout: one's line may land inside the other's
    results = sorted(re.findall(r"RESULT \d+ \d+", out.stdout))
    return results, out.stderr


@pytest.mark.slow
@pytest.mark.dist
def test_two_processes_without_cpu_true_are_warned_once(tmp_path: Path) -> None:
    """Each process sees one process of its own: one warning for the job, naming cpu=True.
    (With cpu=True the same job is one run of two processes: tests/accelerate/test_user_output.py
    and the other two-process tests.)"""
    results, stderr = _torchrun(tmp_path, cpu=False)
    assert results == ["RESULT 0 1", "RESULT 0 1"]  # two runs of one process
    warned = re.findall(WARNING + r"[^\n]*", stderr)
    assert len(warned) == 1, stderr
    assert "pass Accelerator(cpu=True)" in warned[0]


def test_world_size_above_one_with_one_process_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process: WORLD_SIZE=2 from a launcher, an Accelerator of one process (no
    LOCAL_RANK, so that Accelerate starts no GPU process group either): the warning; with
    WORLD_SIZE=1, none."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    accelerator = Accelerator(project_dir=str(tmp_path), dataloader_config=config)
    assert accelerator.num_processes == 1
    with pytest.warns(UserWarning, match=WARNING) as caught:
        CociCheckpointer(accelerator, preemption=None, save_on_close=False).close()
    assert len([w for w in caught if re.search(WARNING, str(w.message))]) == 1
    monkeypatch.setenv("WORLD_SIZE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CociCheckpointer(accelerator, preemption=None, save_on_close=False).close()
