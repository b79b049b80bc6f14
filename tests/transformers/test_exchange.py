"""The Trainer's own checkpoints and coci's, both ways: a coci step exported with
``--format transformers`` is read natively by ``from_pretrained`` and by a plain Trainer's
resume; a Trainer ``checkpoint-N`` resumes a run with ``CociCallback``; both end bit-identical
to a run never stopped."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors import safe_open
from transformers import GPT2LMHeadModel

from coci_core import CheckpointManager, NoCheckpointError
from coci_transformers.export import export_step
from tests.transformers.run import Recording, Tokens, arguments, tiny_model, train


@pytest.fixture(autouse=True)
def _reset_accelerate_state() -> Any:
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_export_and_import_both_ways(tmp_path: Path) -> None:
    reference = train(tmp_path / "coci_run", 12)  # coci saves 6, 9, 12 (keeps 3)
    out = tmp_path / "plain" / "checkpoint-6"
    summary = export_step(str(tmp_path / "coci_run" / "coci"), out, 6)
    assert "exported step 6" in summary and "rng_state.pth" in summary
    # a step no longer kept (keep_last 3: 6, 9, 12) is an error, not another step in its place
    with pytest.raises(NoCheckpointError, match="step 3"):
        export_step(str(tmp_path / "coci_run" / "coci"), tmp_path / "gone" / "checkpoint-3", 3)
    assert not (tmp_path / "gone").exists()
    with CheckpointManager(tmp_path / "coci_run" / "coci") as mgr:
        saved = mgr.restore(6)["model"]
    loaded = GPT2LMHeadModel.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)

    # a plain Trainer (no coci) resumes from the exported directory, saving its own
    AcceleratorState._reset_state(True)
    plain = Recording(
        model=tiny_model(), args=arguments(tmp_path / "plain", 12), train_dataset=Tokens()
    )
    plain.seen = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as train() runs (the sums' order depends on the threads)
    try:
        plain.train(resume_from_checkpoint=str(out))
    finally:
        torch.set_num_threads(threads)
    assert plain.seen == reference["seen"][6 * 4 :]
    assert (tmp_path / "plain" / "checkpoint-9").is_dir()
    for k, v in plain.model.state_dict().items():
        assert torch.equal(v, reference["best_model"][k])

    # and CociCallback resumes from the Trainer's checkpoint-9, then saves with coci
    AcceleratorState._reset_state(True)
    resumed = train(tmp_path / "plain", 12, resume=str(tmp_path / "plain" / "checkpoint-9"))
    assert resumed["digest"] == reference["digest"]
    assert resumed["seen"] == reference["seen"][9 * 4 :]
    with CheckpointManager(tmp_path / "plain" / "coci") as mgr:
        assert mgr.steps() == [12]


FORMAT = ("--format", "transformers")


def test_coci_export_format_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``coci export DIR OUT --format transformers`` runs the exporter coci_transformers
    registers (entry point ``coci.exports``; looked up here without an installed package)."""
    from coci_core.commands import cli

    train(tmp_path / "run", 4)
    monkeypatch.setattr(cli, "adapter_exporter", lambda fmt: export_step)
    out = tmp_path / "checkpoint-4"
    assert (
        cli.main(["export", str(tmp_path / "run" / "coci"), str(out), "--format", "transformers"])
        == 0
    )
    said = capsys.readouterr().out
    assert "exported step 4" in said
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    # the tied lm_head is written as save_pretrained writes it: not at all (it was a copy of
    # the embeddings); from_pretrained ties it back
    model = GPT2LMHeadModel.from_pretrained(out)
    model.save_pretrained(tmp_path / "pretrained")
    keys = []
    for file in (out / "model.safetensors", tmp_path / "pretrained" / "model.safetensors"):
        with safe_open(file, "pt") as weights:
            keys.append(sorted(weights.keys()))
    assert keys[0] == keys[1] and "lm_head.weight" not in keys[0]
    assert model.lm_head.weight is model.transformer.wte.weight
    listed = said.split("(transformers: ")[1].strip().rstrip(")").split(", ")
    assert sorted(listed) == sorted(p.name for p in out.iterdir())  # each file it wrote
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask  # as mkdir makes it (not 0700)
    # an export over an earlier one replaces it whole (written beside, swapped in): no file
    # of the earlier one stays beside this step's (before: written in place, so an earlier
    # export's rng_state_1.pth, of a run of two processes, stayed under this step's files)
    (out / "rng_state_1.pth").write_bytes(b"an earlier export's")
    (out / "config.json").write_text("{}")
    assert cli.main(["export", str(tmp_path / "run" / "coci"), str(out), *FORMAT]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(listed)
    assert (out / "config.json").read_text() != "{}"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # a directory of other files is refused, never replaced
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep me")
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "run" / "coci"), str(mine), *FORMAT]) == 2
    assert (
        "is not an earlier coci export (no trainer_state.json of its own)"
        in capsys.readouterr().err
    )
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"]
    # a --step the directory does not hold is a wrong input, as for the other formats: exit
    # code 2, naming the steps it holds (it was exit code 1 without them)
    missing = ["export", str(tmp_path / "run" / "coci"), str(tmp_path / "x"), "--step", "99"]
    assert cli.main([*missing, "--format", "transformers"]) == 2
    assert "step 99 is not committed in" in (err := capsys.readouterr().err)
    assert "(its steps: " in err and not (tmp_path / "x").exists()
    monkeypatch.setattr(cli, "adapter_exporter", lambda fmt: None)
    assert (
        cli.main(["export", str(tmp_path / "run" / "coci"), str(out), "--format", "transformers"])
        == 2
    )
    assert "pip install 'coci[transformers]'" in capsys.readouterr().err
