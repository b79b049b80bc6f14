"""The options every framework adapter takes, checked once when the adapter is made.

An adapter (``CociCheckpoint``, ``CociCheckpointer``) turns its keyword arguments into one
:class:`CheckpointOptions` in its constructor, so that a bad argument fails there (naming it),
long before training starts; the :class:`~coci_core.training.Checkpointer` it later opens takes
the options as they are, without checking them again.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from coci_core.engine.directory.retention import check_keep_last
from coci_core.engine.save.compress import CompressionPolicy, check_policy
from coci_core.errors import ConfigError
from coci_core.planner import Planner, PlannerConfig, planner_config
from coci_core.planner.policies import SavePolicy
from coci_core.planner.settings import policy_arguments
from coci_core.preemption import NoticeSource, Preemption, check_preemption
from coci_core.storage import Storage, check_storage_options, check_url, is_url

__all__ = [
    "SHARED_ARGUMENTS",
    "CheckpointOptions",
    "check_bool",
    "check_keep_last",
    "check_dirpath",
    "check_storage_options",
    "check_verbose",
    "shared_options",
    "signature_drift",
]


def check_bool(name: str, value: object) -> bool:
    """``value`` is a bool, or a ConfigError naming the argument ``name``."""
    if not isinstance(value, bool):
        raise ConfigError(f"'{name}' must be a bool (True or False): {value!r}")
    return value


def check_verbose(verbose: object) -> bool:
    """``verbose`` is a bool, or a ConfigError naming it."""
    return check_bool("verbose", verbose)


def check_upload_every(value: object) -> int | Literal["auto"]:
    """``remote_upload_every`` is ``"auto"`` or an integer >= 1, or a ConfigError."""
    if value == "auto" and isinstance(value, str):
        return "auto"
    if type(value) is int and value >= 1:
        return value
    raise ConfigError(f"'remote_upload_every' must be 'auto' or an integer >= 1: {value!r}")


def check_remote(remote: object) -> str | None:
    """``remote`` is None, a path or an fsspec URL (kept a string), or a ConfigError."""
    if remote is None:
        return None
    path: object = os.fspath(remote) if isinstance(remote, os.PathLike) else remote
    if isinstance(path, str) and path:
        if not is_url(path) and os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(
                f"'remote' {path!r} exists and is not a directory: give a directory (or an "
                "fsspec URL) for the second tier"
            )
        if is_url(path):
            check_url("remote", path)
        return path
    raise ConfigError(
        "'remote' must be an fsspec URL string (e.g. 's3://bucket/run'), a directory path, or "
        f"None: {remote!r}"
    )


def check_dirpath(dirpath: Any) -> Any:
    """``dirpath`` is None, a str path, an os.PathLike or an fsspec URL string (kept as given);
    a local one that exists is a directory.

    Raises:
        ConfigError: naming ``dirpath`` and what it may be.
    """
    if isinstance(dirpath, Storage):  # the core Checkpointer's own storage
        return dirpath
    if not (dirpath is None or isinstance(dirpath, os.PathLike)) and not (
        isinstance(dirpath, str) and dirpath.strip()
    ):
        raise ConfigError(
            "'dirpath' must be a directory path (a str or an os.PathLike such as "
            "pathlib.Path), an fsspec URL string (e.g. 's3://bucket/run'), or None: "
            f"{dirpath!r:.100}"
        )
    if dirpath is not None and not is_url(dirpath):
        try:
            local = os.fspath(dirpath)
        except TypeError:
            raise ConfigError(f"'dirpath' must be a str path: {dirpath!r:.100}") from None
        if not isinstance(local, str) or not local.strip():
            raise ConfigError(f"'dirpath' must be a non-empty str path: {dirpath!r:.100}")
        if os.path.exists(local) and not os.path.isdir(local):
            raise ConfigError(f"'dirpath' {local!r} exists and is not a directory")
    if is_url(dirpath):
        check_url("dirpath", dirpath)
    return dirpath


def _check_planner_options(options: object) -> dict[str, Any]:
    if options is not None and not (
        isinstance(options, Mapping) and all(isinstance(k, str) for k in options)
    ):
        raise ConfigError(
            f"'planner_options' must be a dict of keyword arguments (str keys) or None: {options!r}"
        )
    return dict(options or {})


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """What an adapter was asked for, checked: made by :meth:`check`.

    Attributes:
        policy: the policy as given (a name or a policy object).
        planner_options: the Planner's keyword arguments beyond policy, objective and MTBF
            (with ``every_n_steps``/``every_n_seconds`` when given on their own).
        planner: the Planner's arguments, checked.
        compression: the compression policy.
        keep_last: committed checkpoints to keep (None: all).
        block: copy the state before ``save`` returns (the default; False: in the background,
            see ``CheckpointManager.save`` for which writes it then sees).
        verbose: log a line per save.
        storage_options: fsspec options of a URL directory (credentials: never logged).
        remote: a second tier, written in the background (see ``CheckpointManager``).
        remote_keep_last: checkpoints kept on the remote tier.
        remote_storage_options: fsspec options of ``remote``.
        remote_upload_every: copy every this many checkpoints to ``remote``, or ``"auto"``:
            the planner's two-level period for the measured costs (1 until measured).
        preemption: the preemption notices watched and how to stop on one (None: none;
            see ``docs/preemption.md``).
    """

    policy: str | SavePolicy
    objective: str
    mtbf_s: float | None
    planner_options: Mapping[str, Any]
    planner: PlannerConfig
    compression: CompressionPolicy
    keep_last: int | None
    block: bool
    verbose: bool
    storage_options: Mapping[str, Any] = dataclasses.field(repr=False)
    remote: str | None = None
    remote_keep_last: int | None = 10
    remote_storage_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    remote_upload_every: int | Literal["auto"] = "auto"
    preemption: Preemption | None = None

    def manager_arguments(self) -> dict[str, Any]:
        """The CheckpointManager's keyword arguments that these options give."""
        return {
            "keep_last": self.keep_last,
            "compression": self.compression,
            "storage_options": self.storage_options,
            "remote": self.remote,
            "remote_keep_last": self.remote_keep_last,
            "remote_storage_options": self.remote_storage_options,
            "remote_upload_every": (
                1 if self.remote_upload_every == "auto" else self.remote_upload_every
            ),
        }

    @classmethod
    def check(
        cls,
        *,
        dirpath: object,
        policy: str | SavePolicy = "coci",
        objective: str = "time",
        mtbf_s: float | None = None,
        keep_last: int | None = 3,
        compression: str | CompressionPolicy | None = "auto",
        compression_options: Mapping[str, Any] | None = None,
        every_n_steps: int | None = None,
        every_n_seconds: float | None = None,
        block: bool = True,
        planner_options: Mapping[str, Any] | None = None,
        verbose: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        remote: str | os.PathLike[str] | None = None,
        remote_keep_last: int | None = 10,
        remote_storage_options: Mapping[str, Any] | None = None,
        remote_upload_every: int | Literal["auto"] = "auto",
        preemption: str | Sequence[str | NoticeSource] | Preemption | None = "auto",
    ) -> CheckpointOptions:
        """Check each argument once (see the adapters' docstrings for their meaning).

        Raises:
            ConfigError: naming the first bad argument and what it allows.
        """
        check_dirpath(dirpath)
        policy_arguments(policy)
        options = _check_planner_options(planner_options)
        own = ("policy", "objective", "mtbf_s")  # the adapters' arguments, refused there
        planner_takes = set(inspect.signature(Planner).parameters)
        unknown = sorted(set(options) - planner_takes)
        if unknown:  # the Planner's own message would list the callback's arguments too
            takes = sorted(planner_takes - set(own))
            raise ConfigError(
                f"'planner_options' holds arguments the Planner does not take: {unknown} (it "
                f"takes {', '.join(takes)}; {', '.join(own)} are arguments of their own)"
            )
        for name in own:
            if name in options:  # it would override the argument silently
                raise ConfigError(
                    f"'planner_options' must not hold {name!r}: give {name}=... to the callback"
                )
        for name, value in (("every_n_steps", every_n_steps), ("every_n_seconds", every_n_seconds)):
            if value is not None:
                if name in options:
                    raise ConfigError(
                        f"{name!r} is given twice, as an argument and in 'planner_options': "
                        "give it once"
                    )
                options[name] = value
        check_bool("block", block)
        return cls(
            policy=policy,
            objective=objective,
            mtbf_s=mtbf_s,
            planner_options=options,
            planner=planner_config(
                {"policy": policy, "objective": objective, "mtbf_s": mtbf_s, **options}
            ),
            compression=check_policy(compression, compression_options),
            keep_last=check_keep_last(keep_last),
            block=block,
            verbose=check_verbose(verbose),
            storage_options=check_storage_options(storage_options, dirpath),
            remote=check_remote(remote),
            remote_keep_last=check_keep_last(remote_keep_last, "remote_keep_last"),
            remote_storage_options=check_storage_options(
                remote_storage_options, remote, names=("remote_storage_options", "remote")
            ),
            remote_upload_every=check_upload_every(remote_upload_every),
            preemption=check_preemption(preemption),
        )


#: the keyword arguments of :meth:`CheckpointOptions.check` that every adapter takes as its own:
#: the one declaration of the shared options (names, defaults and annotations)
SHARED_ARGUMENTS: tuple[str, ...] = tuple(
    name for name in inspect.signature(CheckpointOptions.check).parameters if name != "dirpath"
)


def shared_options(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of an adapter's constructor (its ``locals()``) that
    :meth:`CheckpointOptions.check` takes, so that each adapter passes them on without
    spelling out the list again."""
    return {name: arguments[name] for name in SHARED_ARGUMENTS}


def signature_drift(adapter: Callable[..., Any]) -> list[str]:
    """How ``adapter``'s signature (a class or its ``__init__``) differs from the declaration of
    the shared options, :meth:`CheckpointOptions.check`: each shared argument it lacks, or takes
    positionally, or with another default or annotation. An adapter's test asserts it is empty,
    so that its explicit signature (for IDEs and LightningCLI) cannot drift."""
    declared = inspect.signature(CheckpointOptions.check).parameters
    taken = inspect.signature(adapter).parameters
    drift = []
    for name in SHARED_ARGUMENTS:
        want, got = declared[name], taken.get(name)
        if got is None:
            drift.append(f"{name}: missing")
            continue
        if got.kind is not inspect.Parameter.KEYWORD_ONLY:
            drift.append(f"{name}: not keyword-only")
        if got.default != want.default:
            drift.append(f"{name}: default {got.default!r}, declared {want.default!r}")
        if str(got.annotation) != str(want.annotation):
            drift.append(f"{name}: annotation {got.annotation}, declared {want.annotation}")
    return drift
