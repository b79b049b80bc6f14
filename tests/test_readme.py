"""What running the README's blocks as written (conftest.py, pytest-markdown-docs) does not
check: the plain-loop quick start resumes exactly, the Lightning quick start resumes instead of
training again, the test command is the one CI runs, and what it says of torch is true. The
blocks are read with the plugin's own Markdown parser."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from markdown_it import MarkdownIt
from pytest_markdown_docs.plugin import extract_fence_tests

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _block(title: str) -> str:
    """The first Python block under the README's section ``title``."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    blocks = list(extract_fence_tests(MarkdownIt("commonmark"), text, 0, README))
    line = text[:start].count("\n") + 2
    last = text[:end].count("\n") + 1 if end != -1 else len(text.splitlines())
    for block in blocks:
        if line <= block.start_line <= last:
            return block.source
    raise AssertionError(f"no python block under {title!r}")


def _run(code: str, total: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    namespace: dict[str, Any] = {"model": model, "opt": opt, "total": total}

    def train_one_step() -> None:
        g = torch.Generator().manual_seed(int(namespace["step"]))  # the data of this step
        x = torch.randn(32, 8, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    namespace["train_one_step"] = train_one_step
    exec(compile(code, str(README), "exec"), namespace)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_plain_loop_quick_start_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped after 250 of 400 steps (last checkpoint: 200 steps done) and run again, the
    README's loop ends with the weights of an uninterrupted run (it used to train the restored
    step twice)."""
    code = _block("Quick start: any training loop")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    reference = _run(code, 400)
    monkeypatch.chdir(tmp_path / "b")
    _run(code, 250)
    resumed = _run(code, 400)
    for key, value in reference.items():
        assert torch.equal(resumed[key], value), key


def test_lightning_quick_start_resumes_instead_of_training_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's Lightning quick start, its Trainer bounded to 20 steps: the first fit ends
    with a coci checkpoint, and the second resumes from it (its 20 steps are done) instead of
    training again from scratch."""
    import lightning.pytorch as pl

    from coci_core import CheckpointManager
    from tests.docs_blocks import my_model_class

    code = _block("Quick start: Lightning")
    code = code.replace("from lightning.pytorch import Trainer\n", "")
    assert "from lightning.pytorch import Trainer" not in code
    monkeypatch.chdir(tmp_path)
    pl.seed_everything(1, verbose=False)
    model = my_model_class()()
    trainer_factory = functools.partial(
        pl.Trainer, max_steps=20, logger=False, enable_progress_bar=False
    )
    namespace: dict[str, Any] = {"Trainer": trainer_factory, "model": model}
    exec(compile(code, str(README), "exec"), namespace)
    with CheckpointManager(tmp_path / "coci") as mgr:
        assert mgr.latest_step() == 20  # the final save of the first fit
    # the second fit resumed at step 20 (max_steps): it trained no further step
    assert namespace["trainer"].global_step == 20
    assert model.seen == 20


def test_accelerate_quick_start_run_again_after_its_end_trains_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's Accelerate quick start run to its end, then again (a requeue after it
    ended, or after a SIGTERM at its last step): the second run resumes at the last step and
    trains nothing. Its loop was a bare ``for x, y in dataloader:``, and the stateful loader
    saved at the epoch's end started the next epoch: the whole epoch was trained again."""
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader, TensorDataset

    from coci_core import CheckpointManager

    code = _block("Quick start: Accelerate")
    monkeypatch.chdir(tmp_path)

    def run() -> int:
        AcceleratorState._reset_state(True)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        namespace: dict[str, Any] = {
            "model": model,
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2),
            "dataloader": DataLoader(data, batch_size=8, shuffle=True),
        }
        exec(compile(code, str(README), "exec"), namespace)
        return int(namespace["done"])

    try:
        assert run() == 4
        assert run() == 4  # was 8: the epoch trained again
    finally:
        AcceleratorState._reset_state(True)
    with CheckpointManager(tmp_path / "runs" / "exp1" / "coci") as mgr:
        assert mgr.latest_step() == 4


def _commands(kind: str) -> list[str]:
    tokens = MarkdownIt("commonmark").parse(README.read_text())
    return [t.content.strip() for t in tokens if t.type == "fence" and t.info.strip() == kind]


def test_the_test_command_is_the_one_ci_runs_and_runs_the_blocks() -> None:
    """The README's test command is `.ci/run`'s, and its pytest collects the README's and the
    docs' blocks (testpaths)."""
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(c for c in _commands("bash") if c.endswith("python -m pytest"))
    assert test_command in ci
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'testpaths = ["tests", "README.md", "docs"]' in pyproject


def test_what_the_readme_says_of_torch_is_what_pip_installs() -> None:
    """The set-up commands pin torch==2.13.0, and the README says which build pip's default
    index gives (a CUDA build on Linux) and how to get the CPU build, instead of claiming
    that the pin is the CPU build."""
    text = README.read_text()
    setup = text.split("## Set up and run", 1)[1].split("\n## ", 1)[0]
    assert "pinned to the CPU build" not in text
    assert all("pip install torch==2.13.0 " in c for c in _commands("bash") if "venv" in c)
    assert re.search(r"CUDA build", setup)
    assert "--index-url https://download.pytorch.org/whl/cpu" in setup
