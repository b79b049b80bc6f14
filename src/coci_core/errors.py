"""The CociError tree: every error coci raises.

::

    CociError(Exception)
    ├── ConfigError(CociError, ValueError)        bad argument or configuration
    ├── UnsupportedValueError(CociError, TypeError) a state value coci cannot store
    ├── StorageError(CociError, OSError)           reading or writing the storage failed
    ├── CheckpointError(CociError)                 a checkpoint cannot be used
    │   ├── NoCheckpointError                      there is no committed checkpoint
    │   ├── StateMismatchError                     it lacks a key, or has another shape,
    │   │                                          than the live state to restore into
    │   └── CorruptCheckpointError                 checksum, size or manifest mismatch
    │       └── UnsafeCheckpointError              loading it would run code from it (refused)
    ├── BackgroundSaveError(CociError)             a background persist failed
    ├── DirectoryInUseError(CociError)             another writer owns the directory
    └── CommitError(CociError)                     a rank of a sharded save failed (its cause)

    Preempted(SystemExit)                          training stopped on a preemption notice
"""

from __future__ import annotations

__all__ = [
    "BackgroundSaveError",
    "CheckpointError",
    "CociError",
    "CommitError",
    "ConfigError",
    "CorruptCheckpointError",
    "DirectoryInUseError",
    "NoCheckpointError",
    "Preempted",
    "StateMismatchError",
    "StepExistsError",
    "StorageError",
    "UnsafeCheckpointError",
    "UnsupportedValueError",
]


class CociError(Exception):
    """Base class of every error raised by coci."""


class ConfigError(CociError, ValueError):
    """An argument or configuration value is not allowed."""


class UnsupportedValueError(CociError, TypeError):
    """A value in the state cannot be stored without executing code on load."""


class StorageError(CociError, OSError):
    """Reading from or writing to the checkpoint storage failed (``errno`` kept when known)."""

    @classmethod
    def wrap(cls, message: str, cause: BaseException) -> StorageError:
        """A StorageError with ``message`` that keeps the errno of ``cause`` if it has one."""
        code = getattr(cause, "errno", None)
        return cls(code, message) if isinstance(code, int) else cls(message)


class CheckpointError(CociError):
    """A checkpoint cannot be used."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """There is no committed checkpoint (at the requested step)."""


class StateMismatchError(CheckpointError):
    """The live state a restore fills (``restore(targets=...)``, ``restore(into=...)``, the
    adapters' resume) does not match the checkpoint: ``missing`` names the live tensors it has
    no value for (allowed with ``partial=True``), ``mismatched`` the stored arrays of another
    shape than their live tensor (never allowed). Raised before anything is read."""

    def __init__(
        self,
        message: str,
        *,
        missing: list[str] | None = None,
        mismatched: list[str] | None = None,
        step: int | None = None,
    ):
        super().__init__(message)
        self.missing = list(missing or ())
        self.mismatched = list(mismatched or ())
        self.step = step


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's manifest or data does not match what was committed."""

    def __init__(self, message: str, *, step: int | None = None, bad: list[str] | None = None):
        super().__init__(message)
        self.step = step
        self.bad = list(bad or [])


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint (or a file being imported) could only be loaded by running code from it: a
    pickle in it names a function or class outside what coci allows. It is refused; coci never
    runs code from a checkpoint."""


class BackgroundSaveError(CociError):
    """A save that ran in the background failed; nothing committed was touched."""

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step


class StateChangedError(CociError):
    """A tensor of a ``block=False`` save was changed in place before its background copy was
    checked (the copy may hold the newer values): that save is given up (nothing is
    committed), never stored with them. ``keys`` names the changed tensors."""

    def __init__(self, message: str, *, keys: list[str] | None = None):
        super().__init__(message)
        self.keys = list(keys or ())


class DirectoryInUseError(CociError):
    """Another manager (in this process or another) is writing checkpoints to the directory."""


class StepExistsError(CociError, FileExistsError):
    """``save`` of a step that the directory already holds, without ``overwrite=True``.

    ``own`` says whether the existing checkpoint belongs to the saving manager's run;
    ``elsewhere`` whether another process committed it after this manager restored the run's
    newest checkpoint (two processes continued one run)."""

    def __init__(self, message: str, *, step: int, run: str, own: bool, elsewhere: bool = False):
        super().__init__(message)
        self.step = step
        self.run = run
        self.own = own
        self.elsewhere = elsewhere


class CommitError(CociError):
    """The ranks of a sharded save did not all succeed, so nothing was published."""

    def __init__(self, message: str, *, ranks: list[int]):
        super().__init__(message)
        self.ranks = sorted(ranks)


class Preempted(SystemExit):
    """Training stopped on a preemption notice (raised by ``CociCheckpointer.step()`` and
    :meth:`Checkpointer.stop_if_preempted <coci_core.training.Checkpointer.stop_if_preempted>`
    at the step all ranks agreed on, after its save, or without one that could not fit).

    A ``SystemExit``: ``except Exception`` does not catch it, ``finally`` blocks run, and the
    process exits with ``code`` (default 143, as a process ended by SIGTERM reports), which
    schedulers count as a failure to retry (Kubernetes, torchelastic, SLURM ``--requeue``).
    ``step``: the step saved (None: no save fitted the time left); ``source``: the notice."""

    def __init__(self, message: str, *, code: int, step: int | None, source: str):
        super().__init__(code)
        self.message = message
        self.step = step
        self.source = source

    def __str__(self) -> str:
        return self.message
