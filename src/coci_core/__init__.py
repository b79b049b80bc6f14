"""coci: convergence-aware, asynchronous, verified checkpoints for PyTorch training."""

from coci_core.errors import (
    BackgroundSaveError,
    CheckpointError,
    CociError,
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    StorageError,
    UnsupportedValueError,
)
from coci_core.manager import CheckpointManager, SaveHandle
from coci_core.manifest import Manifest
from coci_core.stateful import Stateful
from coci_core.storage import FsspecStorage, LocalStorage, Storage
from coci_core.telemetry import RestoreEvent, SaveEvent

__all__ = [
    "BackgroundSaveError",
    "CheckpointError",
    "CheckpointManager",
    "CociError",
    "ConfigError",
    "CorruptCheckpointError",
    "FsspecStorage",
    "LocalStorage",
    "Manifest",
    "NoCheckpointError",
    "RestoreEvent",
    "SaveEvent",
    "SaveHandle",
    "Stateful",
    "Storage",
    "StorageError",
    "UnsupportedValueError",
]

__version__ = "0.1.0.dev0"
