"""CociCallback with a real transformers.Trainer (tiny GPT-2 from a config, CPU): coci's saves
replace the Trainer's and are asynchronous; resumes from a step directory, refusals. (A run
SIGKILLed mid-epoch resuming bit-identical is tests/contract's, for every adapter.)"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import Trainer, TrainerCallback

from coci_core import CheckpointManager
from coci_core.commands import cli
from coci_core.errors import CheckpointError, ConfigError
from coci_transformers import CociCallback
from coci_transformers._trainer import check_arguments
from tests.transformers.run import BATCH, STEPS_PER_EPOCH, Tokens, arguments, tiny_model, train


@pytest.fixture(autouse=True)
def _reset_accelerate_state() -> Any:
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_coci_saves_in_place_of_the_trainer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """save_steps=3 as coci's every_n_steps: coci commits 3, 6, 9, 12 (keeps the last 3), each
    save returned before it was durable, and the Trainer writes no checkpoint-N of its own."""
    callback = CociCallback(policy="every_n_steps")
    handles: list[Any] = []
    original = callback._save_checkpoint

    def save(*args: Any) -> Any:
        handle = original(*args)
        handles.append((handle.step, handle.done()))
        return handle

    callback._save_checkpoint = save  # type: ignore[method-assign]
    # the Trainer reads the bound method it was given at on_init_end: patch before
    result = train(tmp_path, 12, callback=callback)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coci"]  # no checkpoint-N
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [6, 9, 12]
    assert [s for s, _ in handles] == [3, 6, 9, 12]
    assert not all(done for _, done in handles)  # written in the background
    assert len(result["seen"]) == 12 * BATCH
    # coci report and the TensorBoard tab read the run's telemetry
    assert cli.main(["report", str(tmp_path / "coci")]) == 0
    assert "checkpoints committed: 4 at steps [3, 6, 9, 12]" in capsys.readouterr().out
    assert list((tmp_path / "coci" / "tensorboard").glob("events.out.tfevents.*"))


def test_bad_options_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keep_last"):
        CociCallback(keep_last=-1)
    with pytest.raises(ConfigError, match="save_strategy"):
        train(
            tmp_path, 4, save_strategy="best", eval_strategy="steps", metric_for_best_model="loss"
        )
    with pytest.raises(ConfigError, match="save_total_limit"):
        train(tmp_path, 4, callback=CociCallback(keep_last=5), save_total_limit=2)
    # 3 given is told from 3 by default (which save_total_limit replaces): it was overridden
    with pytest.raises(ConfigError, match="keep_last=3 and save_total_limit=1 disagree"):
        train(tmp_path, 4, callback=CociCallback(keep_last=3), save_total_limit=1)
    # FSDP2 is saved (contract/test_contract.py, test_fsdp2.py); FSDP1 is refused (on CPU
    # Accelerate cannot make its plugin, so the check that train() runs is called here itself)
    fsdp1 = arguments(tmp_path, 4, fsdp="full_shard", fsdp_config={"version": 1})
    with pytest.raises(ConfigError, match=r"fsdp=.*not FSDP1"):
        check_arguments(fsdp1)
    check_arguments(arguments(tmp_path, 4, fsdp="full_shard", fsdp_config={"version": 2}))


def test_a_new_machine_resumes_from_the_remote_tier_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The output directory gone (a new spot machine), ``train(resume_from_checkpoint=True)``
    restores the remote tier's newest step, and the log line names the remote tier, not the
    empty local directory."""
    remote = tmp_path / "remote"
    coci = {"policy": "every_n_steps", "remote": str(remote)}
    train(tmp_path / "out", 4, callback=CociCallback(**coci))  # saves 3 and 4
    shutil.rmtree(tmp_path / "out")
    AcceleratorState._reset_state(True)
    with caplog.at_level("INFO", logger="coci_transformers"):
        resumed = train(tmp_path / "out", 6, resume=True, callback=CociCallback(**coci))
    assert resumed["start"] == 4
    assert f"coci: the Trainer restores step 4 from {remote} (the remote tier)" in caplog.text


def test_resume_from_a_step_directory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """resume_from_checkpoint=<coci step dir> resumes that step, says so, and the run
    continues saving into its directory; going back to a step on purpose is no failure for
    the MTBF (it counted one)."""
    reference = train(tmp_path / "a", 8)  # saves 3, 6 and 8
    AcceleratorState._reset_state(True)
    step_dir = tmp_path / "a" / "coci" / "step-0000000003"
    callback = CociCallback(policy="every_n_steps")
    with caplog.at_level("INFO", logger="coci_transformers"):
        resumed = train(tmp_path / "b", 8, resume=str(step_dir), callback=callback)
    assert resumed["start"] == 3
    assert callback.checkpointer is not None and callback.checkpointer.planner.failures == 0
    assert f"coci: the Trainer restores step 3 from {tmp_path / 'a' / 'coci'}" in caplog.text
    assert resumed["digest"] == reference["digest"]
    with CheckpointManager(tmp_path / "a" / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [3, 6, 8]  # 6 and 8 saved again by the resumed run
    assert not (tmp_path / "b" / "coci").exists()
    assert _without_loss(resumed["log"]) == _without_loss(reference["log"])
    # the directory itself: its newest step (8), where the run ends: nothing left to train
    AcceleratorState._reset_state(True)
    again = train(tmp_path / "c", 8, resume=str(tmp_path / "a" / "coci"))
    assert again["start"] == 8 and again["seen"] == []
    assert not (tmp_path / "c" / "coci").exists()


def test_a_resume_with_another_optimizer_or_model_is_refused_by_name(tmp_path: Path) -> None:
    """A checkpoint of an AdamW run resumed with ``optim="sgd"``: a ConfigError naming both
    optimizers' settings and what to do; it was torch's ``KeyError: 'momentum'`` at the first
    step, after the state had been loaded. With another model, torch's ``Missing key(s)``
    without what to do."""
    train(tmp_path, 3)  # AdamW (the Trainer's default), step 3
    AcceleratorState._reset_state(True)
    with pytest.raises(ConfigError, match=r"this run's optimizer \(SGD\).*lacks .*momentum"):
        train(tmp_path, 4, resume=True, optim="sgd")
    # another architecture (a third layer) into the same output_dir: named, with what to do
    AcceleratorState._reset_state(True)
    model = tiny_model()
    model = type(model)(type(model.config)(**{**model.config.to_dict(), "n_layer": 3}))
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path, 4),
        train_dataset=Tokens(),
        callbacks=[CociCallback(policy="every_n_steps")],
    )
    with pytest.raises(
        ConfigError, match=r"(?s)this run's model \(GPT2LMHeadModel\).*Missing key.*output_dir"
    ):
        trainer.train(resume_from_checkpoint=True)


def test_a_resume_path_that_does_not_exist_is_refused_by_name(tmp_path: Path) -> None:
    """``resume_from_checkpoint`` naming nothing (a typo, a step never committed): refused by
    the argument's name before anything is opened; it was the Trainer's "Can't find a valid
    checkpoint at some/typo" (no argument named), after coci had made ``<output_dir>/coci``."""
    with pytest.raises(ConfigError, match=r"resume_from_checkpoint='some/typo' does not exist"):
        train(tmp_path / "a", 4, resume="some/typo")
    assert not (tmp_path / "a" / "coci").exists()
    train(tmp_path / "b", 3)  # step 3
    missing = tmp_path / "b" / "coci" / "step-0000000009"
    with pytest.raises(ConfigError, match="not a committed checkpoint of the coci directory"):
        train(tmp_path / "c", 4, resume=str(missing))
    assert not (tmp_path / "c" / "coci").exists()
    # a file (a step's manifest): named as one, not as a path that does not exist
    manifest = tmp_path / "b" / "coci" / "step-0000000003" / "manifest.json"
    assert manifest.is_file()
    with pytest.raises(ConfigError, match=r"manifest.json' is a file, not a checkpoint"):
        train(tmp_path / "c", 4, resume=str(manifest))
    assert not (tmp_path / "c" / "coci").exists()
    # the run's output_dir itself (its coci directory inside): not a checkpoint
    with pytest.raises(ConfigError, match="is a run's output directory, not a checkpoint"):
        train(tmp_path / "d", 4, resume=str(tmp_path / "b"))
    assert not (tmp_path / "d" / "coci").exists()


class _SaveAt2(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2:
            control.should_save = True


def test_a_save_asked_by_a_callback_before_coci_is_taken(tmp_path: Path) -> None:
    """A user's callback given before CociCallback that asks for a save
    (``control.should_save = True`` at step 2) gets it, as one given after it does and as
    with the Trainer's own saves: coci's step end overwrote it with its plan's answer (no
    save), the Trainer's DefaultFlowCallback's ask being indistinguishable from it. That
    callback's schedule (``save_steps`` 3, the last step) still saves nothing of its own."""
    callback = CociCallback(policy="every_n_steps", every_n_steps=100)
    trainer = Trainer(
        model=tiny_model(),
        args=arguments(tmp_path, 4),  # save_steps 3: the DefaultFlowCallback's ask
        train_dataset=Tokens(),
        callbacks=[_SaveAt2(), callback],
    )
    trainer.train()
    with CheckpointManager(tmp_path / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [2, 4]  # asked, then the final save (not 3)


def test_a_second_coci_callback_on_one_trainer_is_refused(tmp_path: Path) -> None:
    """The second took the saves over from the first (each replaces the Trainer's
    _save_checkpoint), which then saved only at the end, or both failed there on one
    directory: refused when the Trainer is made, as Lightning refuses two CociCheckpoints."""
    with pytest.raises(ConfigError, match="a Trainer takes one CociCallback"):
        train(tmp_path, 4, extra_callbacks=(CociCallback(tmp_path / "b"),))


@pytest.mark.parametrize("spelling", ["trailing-slash", "absolute", "absolute-step"])
def test_resume_from_the_callbacks_own_dirpath_spelled_another_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    """``resume_from_checkpoint`` naming the callback's own dirpath with a trailing slash or
    as an absolute path was refused as "not in CociCallback's dirpath"."""
    monkeypatch.chdir(tmp_path)
    train("out", 4, callback=CociCallback("out/coci", policy="every_n_steps"))
    AcceleratorState._reset_state(True)
    resume = {
        "trailing-slash": "out/coci/",
        "absolute": str(tmp_path / "out" / "coci"),
        "absolute-step": str(tmp_path / "out" / "coci" / "step-0000000003"),
    }[spelling]
    resumed = train(
        "out", 4, callback=CociCallback("out/coci", policy="every_n_steps"), resume=resume
    )
    assert resumed["start"] == (3 if spelling == "absolute-step" else 4)


def test_push_to_hub_at_every_save_is_said_to_push_at_the_end_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``hub_strategy="every_save"`` (the default) pushed nothing during training, silently:
    the Trainer pushes at its own saves, which coci replaces. (The Hub is not reached: its
    repository is never made here.)"""
    from transformers import Trainer

    monkeypatch.setattr(Trainer, "init_hf_repo", lambda self, *a, **k: None)
    with caplog.at_level("WARNING", logger="coci_transformers"):
        Trainer(
            model=tiny_model(),
            args=arguments(tmp_path, 4, push_to_hub=True, hub_model_id="me/tiny"),
            callbacks=[CociCallback()],
        )
    assert "nothing is pushed during training" in caplog.text


def test_a_weights_only_save_is_not_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """save_only_model=True: coci saves the weights and TrainerState only, and a resume from
    such a step is refused, saying why; the summary line does not claim the refused resume as
    a finished run (it said "resumed at step 3, the newest checkpoint; no step to train after
    it" of a run with steps left)."""
    train(tmp_path, 3, save_only_model=True)
    with CheckpointManager(tmp_path / "coci") as mgr:
        state = mgr.restore(3)
    assert "optimizer" not in state and state["weights_only"] is True
    AcceleratorState._reset_state(True)
    caplog.clear()
    with (
        caplog.at_level("INFO", logger="coci_transformers"),
        pytest.raises(CheckpointError, match="save_only_model"),
    ):
        train(tmp_path, 6, resume=True)
    assert "no step to train after it" not in caplog.text
    assert "coci: no checkpoint committed" in caplog.text


def _without_loss(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k not in ("loss", "train_loss")} for e in log]


def test_the_epoch_policy_is_made_as_the_options_table_writes_it(tmp_path: Path) -> None:
    """``CociCallback(policy="epoch")`` (the table's match for ``save_strategy="epoch"``) is
    made without ``steps_per_epoch`` (the Trainer gives it when training starts) and saves at
    each epoch's end; given in ``planner_options``, it is the user's."""
    callback = CociCallback(policy="epoch")
    train(tmp_path / "a", 2 * STEPS_PER_EPOCH, callback=callback, save_strategy="epoch")
    with CheckpointManager(tmp_path / "a" / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    AcceleratorState._reset_state(True)
    given = CociCallback(policy="epoch", planner_options={"steps_per_epoch": 2})
    train(tmp_path / "b", 6, callback=given, save_strategy="epoch")
    with CheckpointManager(tmp_path / "b" / "coci", keep_last=None) as mgr:
        assert mgr.steps() == [2, 4, 6]


@pytest.mark.parametrize(
    ("strategy", "policy", "said", "not_said"),
    [
        ("steps", "coci", "(save_strategy='steps', save_steps=3);", "policy='epoch'"),
        (
            "steps",
            "coci",
            "; for a save every save_steps, as the Trainer's, pass "
            "CociCallback(policy='every_n_steps') (it takes save_steps)",
            "policy='epoch'",
        ),
        ("steps", "every_n_steps", "save_steps=3); coci saves when its plan says so", "pass"),
        (
            "epoch",
            "coci",
            "coci saves when its plan says so; for a save at each epoch's end, as the "
            "Trainer's, pass CociCallback(policy='epoch')",
            "save_steps",
        ),
        ("epoch", "epoch", "(save_strategy='epoch'); coci saves", "CociCallback(policy="),
        ("no", "coci", "(save_strategy='no');", "save_steps"),
    ],
)
def test_the_line_on_the_trainers_own_saves_names_what_applies(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    strategy: str,
    policy: str,
    said: str,
    not_said: str,
) -> None:
    """The line that says the Trainer's own saves are off names ``save_steps`` only for
    ``save_strategy="steps"`` (it named ``save_steps=500`` for "epoch" and "no" too), and for
    "epoch" and "steps" under coci's plan the policy that saves where the Trainer would have
    (the options table's match), as advice: "coci saves when its plan says so (at each
    epoch's end, ...)" read as if coci's plan saved at each epoch's end."""
    caplog.set_level("INFO", logger="coci_transformers.callback")
    args = arguments(tmp_path, 4, save_strategy=strategy)
    Trainer(model=tiny_model(), args=args, callbacks=[CociCallback(policy=policy)])
    (line,) = [r.getMessage() for r in caplog.records if "own checkpoint saves" in r.getMessage()]
    assert said in line and not_said not in line, line


def test_fsdp_that_the_trainer_does_not_apply_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """TrainingArguments(fsdp=True, fsdp_config={"version": 2}) on CPU: Accelerate ignores the
    FSDP plugin there and the Trainer trains with DDP, saying nothing; coci says so when the
    Trainer is made (its checkpoints hold whole tensors, which a run with FSDP refuses),
    instead of nothing. (The Trainer takes fsdp only in a distributed job: a job of one
    process, made here in this process.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {
        "LOCAL_RANK": "0",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),  # else Accelerate sets it
    }.items():
        monkeypatch.setenv(name, value)
    args = arguments(tmp_path, 2, fsdp=True, fsdp_config={"version": 2})
    try:
        with caplog.at_level("WARNING", logger="coci_transformers"):
            trainer = Trainer(
                model=tiny_model(), args=args, train_dataset=Tokens(), callbacks=[CociCallback()]
            )
        assert not trainer.is_fsdp_enabled
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    said = [r.getMessage() for r in caplog.records if "fsdp" in r.getMessage()]
    assert said and "without FSDP" in said[0] and "DDP" in said[0]
