"""coci: asynchronous, verified checkpoints for PyTorch training, planned to save time."""

import typing as _typing

# Eager: the function shares its name with its module, which a submodule import would bind.
from coci_core.engine.save.partition import Share, partition
from coci_core.errors import (
    BackgroundSaveError,
    CheckpointError,
    CociError,
    CommitError,
    ConfigError,
    CorruptCheckpointError,
    DirectoryInUseError,
    NoCheckpointError,
    Preempted,
    StateChangedError,
    StateMismatchError,
    StepExistsError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)

if _typing.TYPE_CHECKING:
    from coci_core.engine.format.manifest import Manifest
    from coci_core.engine.group import RankGroup
    from coci_core.engine.manager import CheckpointManager, SaveHandle
    from coci_core.engine.restore.inplace import InPlaceTargets
    from coci_core.engine.save.compress import CompressionPolicy
    from coci_core.engine.stateful import Stateful
    from coci_core.storage import FsspecStorage, LocalStorage, Storage
    from coci_core.telemetry import RestoreEvent, SaveEvent
    from coci_core.training.sampler import GlobalSampler

# Imported on first use, so that `coci --help` and the errors need no torch.
_LAZY = {
    "CompressionPolicy": "coci_core.engine.save.compress",
    "RankGroup": "coci_core.engine.group",
    "InPlaceTargets": "coci_core.engine.restore.inplace",
    "CheckpointManager": "coci_core.engine.manager",
    "SaveHandle": "coci_core.engine.manager",
    "Manifest": "coci_core.engine.format.manifest",
    "GlobalSampler": "coci_core.training.sampler",
    "Stateful": "coci_core.engine.stateful",
    "FsspecStorage": "coci_core.storage",
    "LocalStorage": "coci_core.storage",
    "Storage": "coci_core.storage",
    "RestoreEvent": "coci_core.telemetry",
    "SaveEvent": "coci_core.telemetry",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'coci_core' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "BackgroundSaveError",
    "CheckpointError",
    "CheckpointManager",
    "CociError",
    "CommitError",
    "CompressionPolicy",
    "ConfigError",
    "CorruptCheckpointError",
    "DirectoryInUseError",
    "FsspecStorage",
    "GlobalSampler",
    "InPlaceTargets",
    "LocalStorage",
    "Manifest",
    "NoCheckpointError",
    "Preempted",
    "RankGroup",
    "RestoreEvent",
    "SaveEvent",
    "SaveHandle",
    "Share",
    "StateChangedError",
    "StateMismatchError",
    "Stateful",
    "StepExistsError",
    "Storage",
    "StorageError",
    "UnsafeCheckpointError",
    "UnsupportedValueError",
    "partition",
]

__version__ = "0.1.0.dev0"
