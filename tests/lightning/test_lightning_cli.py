"""CociCheckpoint configured from LightningCLI YAML."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

from coci_lightning import CociCheckpoint
from tests.lightning.models import DigitsModel


# Lightning 2.6 calls jsonargparse APIs that jsonargparse now deprecates: not ours to fix.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_configured_from_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A YAML config builds the callback with its arguments, replacing ModelCheckpoint."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  max_steps: 3\n"
        "  logger: false\n"
        f"  default_root_dir: {tmp_path}\n"
        "  callbacks:\n"
        "    - class_path: coci_lightning.CociCheckpoint\n"
        "      init_args: {policy: every_n_steps, every_n_steps: 500, keep_last: 2}\n"
    )
    monkeypatch.setattr(sys, "argv", ["train.py"])  # as if run from the command line
    cli = LightningCLI(
        DigitsModel,
        run=False,
        save_config_callback=None,
        seed_everything_default=0,
        args=["--config", str(config)],
    )
    callbacks = [cb for cb in cli.trainer.callbacks if isinstance(cb, CociCheckpoint)]
    assert len(callbacks) == 1
    assert callbacks[0].policy == "every_n_steps"
    assert callbacks[0].planner_options == {"every_n_steps": 500}
    assert callbacks[0].keep_last == 2
    assert [type(cb).__name__ for cb in cli.trainer.checkpoint_callbacks] == ["CociCheckpoint"]
