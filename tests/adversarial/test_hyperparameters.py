"""Hyper-parameter values of every kind Lightning users put in
``save_hyperparameters`` are stored exactly (without pickle) or refused when ``fit`` starts,
before any training, with a message naming the value and what to store instead; and a crafted
manifest cannot make coci build anything but the few types it stores by name (nothing is
imported or run).

Stored exactly: OmegaConf ``DictConfig``/``ListConfig`` (nested, interpolations kept, missing
values, struct/readonly flags), ``argparse.Namespace``, pathlib paths, nested in dicts, lists and
each other. Refused: enum members (``Enum``, ``IntEnum``, ``StrEnum``), dataclass instances,
structured configs (also nested in a plain one), an enum inside a config, sets, functions,
other objects.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from coci_core import CheckpointManager, CorruptCheckpointError, UnsupportedValueError
from coci_lightning import CociCheckpoint
from tests.adversarial.craft import edit_manifest
from tests.harness.processes import run, script
from tests.lightning.models import DigitsModel

pytestmark = pytest.mark.timeout(120)


class Color(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


class Mode(enum.StrEnum):
    TRAIN = "train"


@dataclass
class Optim:
    lr: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])


class _Opaque:
    pass


def _config(flags: bool = False) -> DictConfig:
    config = OmegaConf.create(
        {"lr": 0.1, "net": {"width": 64, "acts": ["relu", "gelu"]}, "tag": "w${net.width}"}
    )
    if flags:
        OmegaConf.set_struct(config, True)
        OmegaConf.set_readonly(config, True)
    return config


# name -> the hyper-parameter value (saved as ``value``, an __init__ argument)
STORED: dict[str, Any] = {
    "DictConfig": _config(),
    "DictConfig, struct and readonly": _config(flags=True),
    "DictConfig with a missing value": OmegaConf.create({"lr": "???", "n": 1}),
    "ListConfig": OmegaConf.create([1, {"a": "${0}"}, [2.5, None]]),
    "configs nested in a dict and a list": {"a": {"cfg": _config()}, "b": [_config()]},
    "config holding a path and bytes": OmegaConf.create({"root": Path("/data"), "b": b"\x00"}),
    "argparse.Namespace": argparse.Namespace(lr=0.1, layers=[64, 10], name="mlp"),
    "Namespace in a Namespace": argparse.Namespace(optim=argparse.Namespace(lr=0.1)),
    "pathlib.Path": Path("/data/run-3"),
    "pure paths": (PurePosixPath("a/b"), PureWindowsPath("C:\\data")),
    "plain nested values": {"t": (1, 2.5, None, "x"), "d": {3: [True, b"raw"]}},
}

# name -> (value, what the message must say)
REFUSED: dict[str, tuple[Any, str]] = {
    "Enum member": (Color.RED, "store its .value or .name"),
    "IntEnum member": (Level.HIGH, "store its .value or .name"),
    "StrEnum member": (Mode.TRAIN, "store its .value or .name"),
    "dataclass instance": (Optim(), "dataclasses.asdict"),
    "structured config": (OmegaConf.structured(Optim), "OmegaConf.to_container(cfg)"),
    "structured config in a plain one": (
        OmegaConf.create({"optim": OmegaConf.structured(Optim)}),
        "OmegaConf.to_container(cfg)",
    ),
    "enum in a config": (OmegaConf.create({"color": Color.RED}), "store its .value or .name"),
    "set": ({"a", "b"}, "builtins.set"),
    "function": (len, "builtin_function_or_method"),
    "other object": (_Opaque(), "_Opaque"),
}


class _Holder(DigitsModel):
    """Saves its ``value`` argument as a hyper-parameter."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.save_hyperparameters()


class _ConfigHolder(DigitsModel):
    """``save_hyperparameters(cfg)``: the config itself is ``hparams``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)


def _fit(root: Path, model: DigitsModel) -> None:
    pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[CociCheckpoint()],
    ).fit(model)


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (configs: equal content, interpolations,
    missing values and flags)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (DictConfig, ListConfig)):
        plain = [OmegaConf.to_container(c, resolve=False) for c in (a, b)]
        flags = [(OmegaConf.is_struct(c), OmegaConf.is_readonly(c)) for c in (a, b)]
        return _same(plain[0], plain[1]) and flags[0] == flags[1]
    if isinstance(a, argparse.Namespace):
        return _same(vars(a), vars(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("name", list(STORED))
def test_hyperparameters_are_stored_exactly(tmp_path: Path, name: str) -> None:
    """Saved with the module, the value comes back equal and of the same types."""
    value = STORED[name]
    _fit(tmp_path, _Holder(value))
    saved = CheckpointManager(tmp_path / "coci").restore(1)["hyper_parameters"]
    assert type(saved) is dict and _same(saved["value"], value)


def test_a_config_that_is_the_hyperparameters_is_stored_with_its_class(tmp_path: Path) -> None:
    """save_hyperparameters(cfg): the config, and the class Lightning records beside it."""
    config = _config(flags=True)
    _fit(tmp_path, _ConfigHolder(config))
    state = CheckpointManager(tmp_path / "coci").restore(1)
    assert _same(state["hyper_parameters"], config)
    assert state["hparams_type"] is DictConfig


@pytest.mark.parametrize("name", list(REFUSED))
def test_unstorable_hyperparameters_are_refused_before_training(tmp_path: Path, name: str) -> None:
    """fit() raises when it starts: the message names the hyper-parameter and what to store;
    no batch was trained and no checkpoint written."""
    value, advice = REFUSED[name]
    model = _Holder(value)
    with pytest.raises(UnsupportedValueError) as info:
        _fit(tmp_path, model)
    message = str(info.value)
    assert "save_hyperparameters" in message and "before training" in message
    assert "'/hyper_parameters/value" in message
    assert advice in message
    assert model.seen == []
    assert not (tmp_path / "coci").exists() or CheckpointManager(tmp_path / "coci").steps() == []


def _saved_config(root: Path) -> None:
    with CheckpointManager(root, keep_last=None) as mgr:
        mgr.save(1, {"w": torch.ones(2), "hp": _config(), "type": DictConfig}).wait()
        mgr.save(2, {"w": torch.zeros(2), "hp": _config(), "type": DictConfig}).wait()


def _node(doc: dict[str, Any], key: str) -> dict[str, Any]:
    node: dict[str, Any] = doc["tree"]["v"][key]
    return node


@pytest.mark.parametrize(
    ("key", "edit"),
    [
        ("type", lambda n: n.update(v="this.s")),  # importing `this` prints; never imported
        ("type", lambda n: n.update(v="builtins.eval")),
        ("type", lambda n: n.update(v="omegaconf.OmegaConf")),
        ("hp", lambda n: n.update(type="Node")),
        ("hp", lambda n: n.update(flags={"allow_objects": True})),
        ("hp", lambda n: n.update(flags={"readonly": "yes"})),
        ("hp", lambda n: n.update(v={"t": "list", "v": []})),  # a DictConfig of a list
        ("hp", lambda n: n.update(t="namespace", v={"t": "list", "v": [1]})),
        ("hp", lambda n: n["v"]["v"].update(bad="${oops")),  # not an interpolation
        ("hp", lambda n: n.update(t="path", type="os.PathLike", v="/x")),
        ("hp", lambda n: n.update(t="path", type="Path", v=["/x"])),
    ],
    ids=[
        "class this.s",
        "class builtins.eval",
        "class omegaconf.OmegaConf",
        "config type Node",
        "flag allow_objects",
        "flag not a bool",
        "DictConfig of a list",
        "Namespace of a list",
        "bad interpolation",
        "path type os.PathLike",
        "path of a list",
    ],
)
def test_a_crafted_manifest_builds_only_the_named_types(
    tmp_path: Path, key: str, edit: Any
) -> None:
    """A manifest (checksum recomputed) naming another class, config type, flag or content is
    damage: strict restore raises CorruptCheckpointError, restore() falls back to the older
    step, and nothing named is imported."""
    _saved_config(tmp_path)
    edit_manifest(tmp_path, 2, lambda doc: edit(_node(doc, key)))
    modules = set(sys.modules)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(2, strict=True)
        state = mgr.restore()
        assert mgr.last_restore is not None and mgr.last_restore.step == 1
    assert _same(state["hp"], _config()) and state["type"] is DictConfig
    assert "this" not in set(sys.modules) - modules


def test_without_omegaconf_configs_come_back_as_plain_containers(tmp_path: Path) -> None:
    """Restored in a process where omegaconf cannot be imported, a config is its plain
    content (interpolations unresolved) and its class its name, which Lightning reads as its
    own dict type; with a warning saying so."""
    _saved_config(tmp_path)
    code = (
        "import sys, json\n"
        "sys.modules['omegaconf'] = None\n"  # import omegaconf raises ImportError
        "from coci_core import CheckpointManager\n"
        f"state = CheckpointManager({str(tmp_path)!r}).restore()\n"
        "print(json.dumps([type(state['hp']).__name__, state['hp'], state['type']]))\n"
    )
    out = run(script(code))
    assert out.returncode == 0, out.stderr[-3000:]
    kind, content, name = json.loads(out.stdout.strip().splitlines()[-1])
    assert kind == "dict" and name == "DictConfig"
    assert content == OmegaConf.to_container(_config(), resolve=False)
    assert "omegaconf is not installed" in out.stderr
