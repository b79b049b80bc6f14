"""Options as objects, each checked once: a CompressionPolicy object on both adapters,
planner arguments checked when the adapter is made, planners made from one checked config."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration

from coci_accelerate import CociCheckpointer
from coci_core import CheckpointManager, CompressionPolicy, ConfigError
from coci_core.planner import Planner, planner_config
from coci_core.training import (
    SHARED_ARGUMENTS,
    Checkpointer,
    CheckpointOptions,
    signature_drift,
)
from coci_lightning import CociCheckpoint
from coci_transformers import CociCallback
from tests.lightning.models import DigitsModel

# full_every=2: saves alternate between a base (zstd) and an XOR delta against it
POLICY = CompressionPolicy(mode="lossless", full_every=2)


def _accelerator(directory: Path) -> Accelerator:
    config = DataLoaderConfiguration(use_seedable_sampler=True)
    return Accelerator(cpu=True, project_dir=str(directory), dataloader_config=config)


def _codecs(directory: Path, step: int, key: str) -> str:
    with CheckpointManager(directory) as mgr:
        manifest = mgr.manifest(step)
    (entry,) = [t for t in manifest.tensors if t.key == key]
    return entry.codec


def test_lightning_takes_a_compression_policy_object(tmp_path: Path) -> None:
    """CociCheckpoint(compression=CompressionPolicy(...)) compresses as that policy says on a
    real Trainer: the second save is an XOR delta of the first, and the run resumes exactly."""
    callback = CociCheckpoint(
        tmp_path / "ckpt", policy="every_n_steps", every_n_steps=4, compression=POLICY
    )
    assert callback.compression is POLICY
    pl.seed_everything(1, verbose=False)
    model = DigitsModel()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=8,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[callback],
    )
    trainer.fit(model)
    weight = "/state_dict/net.0.weight"
    assert _codecs(tmp_path / "ckpt", 4, weight) == "coci.zstd/1"
    assert _codecs(tmp_path / "ckpt", 8, weight) == "coci.xor-zstd/1"
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        restored = mgr.restore(step=8)["state_dict"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(restored[name], tensor), name


def test_accelerate_takes_a_compression_policy_object(tmp_path: Path) -> None:
    """CociCheckpointer(compression=CompressionPolicy(...)) on a real Accelerator: the manager
    uses that very policy, and the delta save restores exactly."""
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = _accelerator(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    ckpt = CociCheckpointer(
        accelerator, policy="every_n_steps", every_n_steps=1, compression=POLICY
    )
    assert ckpt.checkpointer.manager.compression is POLICY
    for step in (1, 2):
        loss = model(torch.ones(8, 256)).square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        ckpt.step(step)
    ckpt.close(save=False)
    directory = tmp_path / "coci"
    assert _codecs(directory, 2, "/models/0/weight") == "coci.xor-zstd/1"
    with CheckpointManager(directory) as mgr:
        restored = mgr.restore(step=2)
    assert torch.equal(restored["models"][0]["weight"], model.weight.detach())
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"compression": POLICY, "compression_options": {"full_every": 3}}, "compression_options"),
        ({"compression_options": {"full_evry": 3}}, "full_evry"),
        ({"compression": 5}, "'compression'"),
        ({"compression_options": ["full_every"]}, "compression_options"),
        (  # the Planner's arguments that the adapters take as their own are not offered
            {"planner_options": {"total_step": 10}},
            r"'planner_options' holds arguments the Planner does not take: \['total_step'\] "
            r"\(it takes checkfreq_overhead_bound, default_mtbf_s, default_restart_s, "
            r"default_stall_s, every_n_seconds, every_n_steps, grid_points, ",
        ),
        ({"planner_options": {"total_steps": 0}}, "'total_steps'"),
        ({"objective": "speed"}, "'objective'"),
        ({"keep_last": 0}, "'keep_last'"),
        ({"block": "no"}, "'block'"),
    ],
)
def test_bad_options_fail_where_both_adapters_are_made(
    tmp_path: Path, arguments: dict[str, object], named: str
) -> None:
    """Each bad option is refused by CheckpointOptions.check, by both adapters' constructors
    (before any run) and by Checkpointer, naming it."""
    with pytest.raises(ConfigError, match=named):
        CheckpointOptions.check(dirpath=tmp_path, **arguments)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=named):
        CociCheckpoint(tmp_path, **arguments)  # type: ignore[arg-type]
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = _accelerator(tmp_path)
    with pytest.raises(ConfigError, match=named):
        CociCheckpointer(accelerator, **arguments)  # type: ignore[arg-type]
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(ConfigError, match=named):
        CociCallback(tmp_path, **arguments)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=named):
        Checkpointer(tmp_path, **arguments)
    assert not (tmp_path / "coci").exists()


def test_options_and_keyword_arguments_are_not_mixed(tmp_path: Path) -> None:
    options = CheckpointOptions.check(dirpath=tmp_path)
    with pytest.raises(ConfigError, match="not both"):
        Checkpointer(tmp_path, options, keep_last=2)


def test_planners_from_one_config_do_not_share_settings() -> None:
    """A config checked once makes any number of planners; setting one planner's total steps
    (as an adapter does when the run starts) changes neither the config nor another planner."""
    config = planner_config({"policy": "every_n_steps", "every_n_steps": 5})
    first, second = Planner.from_config(config), Planner.from_config(config)
    first.total_steps = 100
    assert second.total_steps is None and config.settings.total_steps is None
    assert config.with_total_steps(50).settings.total_steps == 50
    with pytest.raises(ConfigError, match="'total_steps'"):
        config.with_total_steps(0)
    assert [s for s in range(1, 16) if first.should_save(s)] == [5, 10, 15]
    assert [s for s in range(1, 16) if second.should_save(s)] == [5, 10, 15]


def test_signature_drift_names_each_difference() -> None:
    """A missing option, a positional one, another default or annotation: each is named."""

    def adapter(policy: str = "coci", *, objective: int = 0, **_: object) -> None: ...

    drift = signature_drift(adapter)
    assert "policy: not keyword-only" in drift
    assert "objective: default 0, declared 'time'" in drift
    assert "objective: annotation int, declared str" in drift
    missing = {d.split(":")[0] for d in drift if d.endswith(": missing")}
    assert missing == set(SHARED_ARGUMENTS) - {"policy", "objective"}
    policy = [d for d in drift if d.startswith("policy")]
    assert policy == [
        "policy: not keyword-only",
        "policy: annotation str, declared str | SavePolicy",
    ]
