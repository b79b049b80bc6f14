"""The documentation site builds with warnings as errors (broken links, bad references), and
what a reader of getting-started types after its loop works."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]


def test_docs_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    core = (site / "api" / "core" / "index.html").read_text()
    assert "CheckpointManager" in core
    assert "ConfigError" in core
    assert ":class:" not in core  # docs/_hooks.py renders the docstrings' Sphinx roles
    assert "CociCheckpoint" in (site / "api" / "lightning" / "index.html").read_text()
    assert "CociCheckpointer" in (site / "api" / "accelerate" / "index.html").read_text()
    planner = (site / "api" / "planner" / "index.html").read_text()
    for name in ("Planner", "plan_schedule", "simulate", "plan_two_levels", "TierCosts"):
        assert f'id="coci_core.planner.{name}"' in planner, name
    assert 'id="coci_core.telemetry.objects.ObjectTelemetry"' in core
    # a Python block's test options are not shown, and it is still highlighted as Python
    getting_started = (site / "getting-started" / "index.html").read_text()
    assert "fixture:" not in getting_started
    assert "notest" not in (site / "storage" / "index.html").read_text()
    assert getting_started.count('class="highlight"') >= 4
    for page in [*site.rglob("*.html"), site / "search" / "search_index.json"]:
        text = page.read_text()
        for machine_path in ("/work/", "/tmp/", "/home/"):
            assert machine_path not in text, (page, machine_path)  # user docs, not lab notes


def _fences(page: Path, lang: str) -> list[str]:
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    return [t.content for t in tokens if t.type == "fence" and t.info.split()[:1] == [lang]]


def test_getting_started_commands_work_after_its_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The page's loop and its telemetry block, then every `coci` command it shows, as
    written: each exits 0 (`coci report` reads the telemetry the page says to write)."""
    import torch

    from coci_core.commands.cli import main
    from tests.docs_blocks import my_model_class

    page = ROOT / "docs" / "getting-started.md"
    loop, telemetry = _fences(page, "python")
    monkeypatch.chdir(tmp_path)
    model = my_model_class()()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_one_step() -> None:
        x = torch.randn(8, 8)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()

    names: dict[str, Any] = {"model": model, "opt": opt, "train_one_step": train_one_step}
    exec(compile(loop, str(page), "exec"), {**names, "total": 300})
    exec(compile(telemetry, str(page), "exec"), {**names, "step": 400})
    commands = [
        line.split("#")[0].split()
        for block in _fences(page, "bash")
        for line in block.splitlines()
        if line.startswith("coci ") and not line.startswith("coci demo")
    ]
    assert [c[1] for c in commands] == ["ls", "verify", "export", "export", "report"]
    for command in commands:
        capsys.readouterr()
        assert main(command[1:]) == 0, (command, capsys.readouterr())
    assert "checkpoints committed: 1 at steps [400]" in capsys.readouterr().out
