"""coci: convergence-aware, asynchronous, verified checkpoints for PyTorch training."""

from coci_core.errors import (
    BackgroundSaveError,
    CheckpointError,
    CociError,
    CommitError,
    ConfigError,
    CorruptCheckpointError,
    DirectoryInUseError,
    NoCheckpointError,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from coci_core.group import RankGroup
from coci_core.manager import CheckpointManager, SaveHandle
from coci_core.manifest import Manifest
from coci_core.partition import Share, partition
from coci_core.sampler import GlobalSampler
from coci_core.stateful import Stateful
from coci_core.storage import FsspecStorage, LocalStorage, Storage
from coci_core.telemetry import RestoreEvent, SaveEvent

__all__ = [
    "BackgroundSaveError",
    "CheckpointError",
    "CheckpointManager",
    "CociError",
    "CommitError",
    "ConfigError",
    "CorruptCheckpointError",
    "DirectoryInUseError",
    "FsspecStorage",
    "GlobalSampler",
    "LocalStorage",
    "Manifest",
    "NoCheckpointError",
    "RankGroup",
    "RestoreEvent",
    "SaveEvent",
    "SaveHandle",
    "Share",
    "Stateful",
    "Storage",
    "StorageError",
    "UnsafeCheckpointError",
    "UnsupportedValueError",
    "partition",
]

__version__ = "0.1.0.dev0"
