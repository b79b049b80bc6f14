"""Preemption notices: the signals and cloud metadata that tell a job it will be stopped, and
when (see docs/preemption.md). :class:`Preemption` is the adapters' ``preemption`` option;
how to add a kind of source: see :mod:`coci_core.preemption.registry`."""

from coci_core.preemption.metadata import (
    LINK_LOCAL,
    AwsSpotNotice,
    AzureNotice,
    GceNotice,
    MetadataPoller,
    detect_cloud,
)
from coci_core.preemption.notice import Notice, NoticeBoard, NoticeSource
from coci_core.preemption.registry import (
    Preemption,
    check_preemption,
    notice_source,
    notice_source_names,
    register_notice_source,
)
from coci_core.preemption.signals import SIGNALS, SignalNotice
from coci_core.preemption.workers import ShieldedWorkerInit, loaders_in, shield_loader_workers

__all__ = [
    "LINK_LOCAL",
    "SIGNALS",
    "AwsSpotNotice",
    "AzureNotice",
    "GceNotice",
    "MetadataPoller",
    "Notice",
    "NoticeBoard",
    "NoticeSource",
    "Preemption",
    "ShieldedWorkerInit",
    "SignalNotice",
    "check_preemption",
    "detect_cloud",
    "notice_source",
    "notice_source_names",
    "loaders_in",
    "register_notice_source",
    "shield_loader_workers",
]
