"""Every kind of notice source by name, and the ``preemption`` option checked.

A source is named in the ``preemption`` option as ``name`` or ``name@argument``: ``"TERM@30"``
(SIGTERM, killed 30 s later), ``"USR1@90"`` (SLURM's ``--signal=USR1@90``), ``"aws"``,
``"gce"``, ``"azure"`` (the argument: the metadata endpoint; default the link-local address).
``"auto"`` is SIGTERM with the default grace period, plus the poller of the cloud this machine
runs in (read from its firmware's vendor strings).

To add a source: subclass :class:`~coci_core.preemption.NoticeSource` (``start(board)`` posts
a :class:`~coci_core.preemption.Notice` when told; a handler only posts; a poller runs on a
thread of its own) and ``register_notice_source("<name>", factory)``, where
``factory(argument)`` makes it from the text after ``@`` (None without one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from coci_core.errors import ConfigError
from coci_core.knobs import PREEMPTED_EXIT_CODE, PREEMPTION_MARGIN_S, SIGTERM_GRACE_S
from coci_core.preemption.metadata import AwsSpotNotice, AzureNotice, GceNotice, detect_cloud
from coci_core.preemption.notice import NoticeSource
from coci_core.preemption.signals import SignalNotice

__all__ = [
    "NoticeFactory",
    "Preemption",
    "check_preemption",
    "notice_source",
    "notice_source_names",
    "register_notice_source",
]

#: Makes a source from the text after ``@`` in its name (None without one).
NoticeFactory = Callable[[str | None], NoticeSource]

_FACTORIES: dict[str, NoticeFactory] = {}


def register_notice_source(name: str, factory: NoticeFactory) -> None:
    """Name a kind of notice source in the ``preemption`` option (case-insensitive).
    Registering a name again replaces its factory.

    Raises:
        ConfigError: ``name`` is empty or holds ``@``, or ``factory`` is not callable.
    """
    if not isinstance(name, str) or not name or "@" in name or name.lower() == "auto":
        raise ConfigError(f"not a notice source name: {name!r}")
    if not callable(factory):
        raise ConfigError(f"the factory of notice source {name!r} is not callable: {factory!r}")
    _FACTORIES[name.lower()] = factory


def notice_source_names() -> list[str]:
    """The registered names."""
    return sorted(_FACTORIES)


def notice_source(spec: str) -> NoticeSource:
    """The source ``spec`` names (``"name"`` or ``"name@argument"``).

    Raises:
        ConfigError: no source has that name, or its argument is wrong.
    """
    name, _, argument = spec.partition("@")
    factory = _FACTORIES.get(name.strip().lower())
    if factory is None:
        raise ConfigError(
            f"unknown preemption notice source {spec!r}: the sources are "
            f"{', '.join(notice_source_names())} (as 'name' or 'name@argument'), or 'auto'"
        )
    if "@" in spec and not argument.strip():  # "aws@": the default endpoint was taken
        raise ConfigError(
            f"'preemption' source {spec!r}: nothing after '@': give its argument "
            f"('{name.strip()}@<argument>') or the name alone ('{name.strip()}')"
        )
    try:
        return factory(argument.strip() if "@" in spec else None)
    except ConfigError as e:
        if str(e).startswith("'preemption'"):
            raise
        raise ConfigError(f"'preemption' source {spec!r}: {e}") from None


def _seconds(spec: str, default: float) -> Callable[[str | None], float]:
    def parse(argument: str | None) -> float:
        if argument is None:
            return default
        try:
            return float(argument)
        except ValueError:
            raise ConfigError(
                f"'preemption' source '{spec}@{argument}': give the seconds from the signal to "
                f"the end as a number, e.g. "
                f"'{spec}@90'"
            ) from None

    return parse


def _signal(signame: str, default_s: float, spelled: str) -> NoticeFactory:
    lead = _seconds(spelled, default_s)
    return lambda argument: SignalNotice(signame, lead(argument))


for _names, _signame, _default in (
    (("sigterm", "term"), "SIGTERM", SIGTERM_GRACE_S),
    # SLURM's --signal=USR1 without @ sends it 60 s before the end
    (("sigusr1", "usr1"), "SIGUSR1", 60.0),
    (("sigusr2", "usr2"), "SIGUSR2", 60.0),
):
    for _name in _names:
        register_notice_source(_name, _signal(_signame, _default, _name.upper()))
register_notice_source("aws", lambda url: AwsSpotNotice(url) if url else AwsSpotNotice())
register_notice_source("gce", lambda url: GceNotice(url) if url else GceNotice())
register_notice_source("azure", lambda url: AzureNotice(url) if url else AzureNotice())


@dataclasses.dataclass(frozen=True)
class Preemption:
    """What to listen to for preemption notices, and how to stop on one.

    Args:
        sources: source names (``"TERM@30"``, ``"USR1@90"``, ``"aws"``...; ``"auto"``) or
            :class:`NoticeSource` objects.
        margin_s: seconds kept in reserve before the deadline: a save is taken only when
            its measured time fits in the time left less this.
        exit_code: the process's exit status after stopping on a notice, 1 to 255 (not 0:
            a requeue reads success as done and would never resume the job).
    """

    sources: tuple[str | NoticeSource, ...] = ("auto",)
    margin_s: float = PREEMPTION_MARGIN_S
    exit_code: int = PREEMPTED_EXIT_CODE

    def __post_init__(self) -> None:
        sources = self.sources
        if isinstance(sources, str | NoticeSource):
            sources = (sources,)
        if not isinstance(sources, Sequence) or not sources:
            raise ConfigError(f"'preemption' sources must be a non-empty list: {sources!r}")
        signals: dict[str, list[object]] = {}
        for s in sources:
            if isinstance(s, str):
                if s.lower() != "auto":
                    made = notice_source(s)  # checks the name and its argument now
                    if isinstance(made, SignalNotice):
                        signals.setdefault(made.name, []).append(s)
            elif not isinstance(s, NoticeSource):
                raise ConfigError(f"a 'preemption' source must be a name or a NoticeSource: {s!r}")
            elif isinstance(s, SignalNotice):
                signals.setdefault(s.name, []).append(s)
        for signame, given in signals.items():
            # both would record each notice, and the earliest deadline (the shorter lead) wins
            if len(given) > 1:
                raise ConfigError(
                    f"'preemption' gives {signame} {len(given)} times "
                    f"({', '.join(repr(g) for g in given)}): give each signal once, with its "
                    "lead time (a SIGTERM's grace period, e.g. 'TERM@120')"
                )
        object.__setattr__(self, "sources", tuple(sources))
        m = self.margin_s
        if isinstance(m, bool) or not isinstance(m, int | float) or not m >= 0:
            raise ConfigError(f"'preemption' margin_s must be a number of seconds >= 0: {m!r}")
        code = self.exit_code
        if type(code) is not int or not 1 <= code <= 255:
            # 0 reads as "done" to a requeue (SLURM --requeue, Kubernetes' OnFailure, torchrun's
            # restarts): the preempted job would never resume
            raise ConfigError(
                f"'preemption' exit_code must be an integer in [1, 255] (0 is success: a "
                f"requeue reads it as done and never resumes the job): {code!r}"
            )

    def make_sources(self) -> list[NoticeSource]:
        """The sources to start (``"auto"`` expanded for this machine)."""
        made: list[NoticeSource] = []
        auto = False
        for s in self.sources:
            if isinstance(s, NoticeSource):
                made.append(s)
            elif s.lower() == "auto":
                auto = True
            else:
                made.append(notice_source(s))
        if auto:  # what the list does not give itself: ["auto", "TERM@120"] keeps its 120 s
            if not any(isinstance(m, SignalNotice) and m.name == "SIGTERM" for m in made):
                made.insert(0, notice_source("sigterm"))
            cloud = detect_cloud()
            if cloud is not None and not any(m.name == cloud for m in made):
                made.append(notice_source(cloud))
        return made


def check_preemption(value: object) -> Preemption | None:
    """The ``preemption`` option: None (no notices), ``"auto"``, a source name, a
    :class:`NoticeSource`, a list of them, or a :class:`Preemption`.

    Raises:
        ConfigError: naming what is wrong and what is allowed.
    """
    if value is None or value is False:
        return None
    if isinstance(value, Preemption):
        return value
    if isinstance(value, str | NoticeSource):
        return Preemption((value,))
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        return Preemption(tuple(value))
    raise ConfigError(
        "'preemption' must be None, 'auto', a source name ('TERM@30', 'USR1@90', 'aws', 'gce', "
        f"'azure'), a NoticeSource, a list of them, or a Preemption: {value!r}"
    )
