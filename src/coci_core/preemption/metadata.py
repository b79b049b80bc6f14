"""Notices in the cloud's instance metadata, polled on a thread of their own a few seconds
apart, each request with a short timeout, only at the configured endpoint (by default the
link-local metadata address; never through a proxy).

* AWS spot: ``/latest/meta-data/spot/instance-action`` (404 until a stop is scheduled, then
  ``{"action": "terminate", "time": "2025-01-01T12:00:00Z"}``, two minutes ahead), with an
  IMDSv2 token from ``/latest/api/token`` (IMDSv1 when the token is refused).
* GCE: ``/computeMetadata/v1/instance/preempted`` (``TRUE`` once preempted; about 30 s left).
* Azure: Scheduled Events (``/metadata/scheduledevents``): an event of type ``Preempt`` whose
  ``Resources`` name this VM (``/metadata/instance/compute/name``) and its ``NotBefore`` time
  (at least 30 s ahead).
"""

from __future__ import annotations

import calendar
import contextlib
import datetime
import email.utils
import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from coci_core.errors import ConfigError
from coci_core.knobs import METADATA_POLL_S, METADATA_TIMEOUT_S
from coci_core.preemption.notice import Notice, NoticeBoard, NoticeSource, check_lead_s

__all__ = [
    "LINK_LOCAL",
    "AwsSpotNotice",
    "AzureNotice",
    "GceNotice",
    "MetadataPoller",
    "detect_cloud",
]

logger = logging.getLogger(__name__)

#: The clouds' instance metadata address.
LINK_LOCAL = "http://169.254.169.254"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuses redirects: an endpoint answers itself (a redirect would send the IMDS token
    to another host)."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, *args: Any) -> None:
        raise urllib.error.HTTPError(req.full_url, code, f"redirect refused ({msg})", {}, fp)  # type: ignore[arg-type]


class _Sockets:
    """The sockets of one request's connections, shut down by :meth:`cut` once the request's
    whole time is up: a socket's timeout bounds each read alone, so an endpoint that sends a
    byte now and then (a header line, a body) held the poller's thread for hours."""

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []
        self.cut_off = False

    def cut(self) -> None:
        self.cut_off = True
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # a blocked read returns at once


class _TimedHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """http(s) whose connections are recorded in ``sockets`` as they connect."""

    def __init__(self, sockets: _Sockets) -> None:
        urllib.request.HTTPHandler.__init__(self)
        urllib.request.HTTPSHandler.__init__(self)
        self._sockets = sockets

    def _recording(self, base: type[http.client.HTTPConnection]) -> Any:
        sockets = self._sockets

        class Recording(base):  # type: ignore[valid-type,misc]
            def connect(self) -> None:
                super().connect()
                sockets.sockets.append(self.sock)

        return Recording

    def http_open(self, req: Any) -> Any:
        return self.do_open(self._recording(http.client.HTTPConnection), req)

    def https_open(self, req: Any) -> Any:
        return self.do_open(
            self._recording(http.client.HTTPSConnection),
            req,
            context=self._context,  # type: ignore[attr-defined]
        )


def _open(request: urllib.request.Request, timeout_s: float) -> bytes:
    """The first 64 KiB of the answer to ``request``, the whole request within ``timeout_s``
    (else TimeoutError); never through a proxy (the metadata address is this machine's own),
    never following a redirect."""
    sockets = _Sockets()
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), _NoRedirect(), _TimedHandler(sockets)
    )
    timer = threading.Timer(timeout_s, sockets.cut)
    timer.daemon = True
    timer.start()
    try:
        with opener.open(request, timeout=timeout_s) as response:
            body = bytes(response.read(65536))
    except (OSError, http.client.HTTPException):
        if sockets.cut_off:
            raise TimeoutError(f"no whole answer within {timeout_s:g} s") from None
        raise
    finally:
        timer.cancel()
    if sockets.cut_off:
        raise TimeoutError(f"no whole answer within {timeout_s:g} s")
    return body


# what a garbled answer raises when read (JSON of another shape, a field missing or of
# another type) besides ValueError: it is no notice, and the poller goes on
_GARBLED = (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError)


class MetadataPoller(NoticeSource):
    """Asks ``endpoint`` every ``interval_s`` seconds (each request at most ``timeout_s``) on a
    daemon thread whether the instance will be stopped, until a notice is posted or
    :meth:`stop`. Subclasses implement :meth:`check`."""

    def __init__(
        self,
        endpoint: str = LINK_LOCAL,
        *,
        interval_s: float = METADATA_POLL_S,
        timeout_s: float = METADATA_TIMEOUT_S,
    ) -> None:
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            raise ConfigError(
                f"the {self.name} metadata endpoint must be an http(s) URL: {endpoint!r}"
            )
        for option, value in (("interval_s", interval_s), ("timeout_s", timeout_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"the {self.name} poller's {option} must be > 0: {value!r}")
        self.endpoint = endpoint.rstrip("/")
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.polls = 0  # requests answered (for tests and the log)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint!r}, interval_s={self.interval_s:g})"

    def start(self, board: NoticeBoard) -> bool:
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, args=(board,), name=f"coci-{self.name}-notice", daemon=True
        )
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.timeout_s + 1)

    def _run(self, board: NoticeBoard) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                notice = self.check()
                self.polls += 1
                failures = 0
            # unreachable, timed out, not HTTP (http.client.HTTPException is no OSError), or
            # garbled
            except (OSError, http.client.HTTPException, *_GARBLED) as e:
                notice = None
                failures += 1
                if failures == 3:
                    logger.warning(
                        "coci: the %s metadata endpoint %s %s: %s: %s (still asking)",
                        self.name,
                        self.endpoint,
                        "answers garbled" if isinstance(e, _GARBLED) else "does not answer",
                        type(e).__name__,
                        e,
                    )
            if notice is not None:
                board.post_from_thread(notice)
                return
            self._stop.wait(self.interval_s)

    def check(self) -> Notice | None:
        """One request: the notice, or None while no stop is scheduled."""
        raise NotImplementedError

    def _get(self, path: str, headers: dict[str, str], method: str = "GET") -> bytes | None:
        """The body at ``path``, None on 404."""
        request = urllib.request.Request(self.endpoint + path, headers=headers, method=method)
        try:
            return _open(request, self.timeout_s)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise


def _monotonic_at(unix: float) -> float:
    return time.monotonic() + (unix - time.time())


#: seconds a stated end may lie past the notice period unsaid (the clocks a little apart)
_CLOCK_SLACK_S = 5.0


def _stated_end(
    name: str, stated: str, unix: float, now: float, notice_s: float
) -> tuple[float, str, bool]:
    """The deadline of a cloud notice whose end is stated as ``unix`` (seen at ``now``), its
    words for the log, and whether it is a known end to plan for. The cloud stops the machine
    at most ``notice_s`` after the notice appears: a stated end later than that (this
    machine's clock set wrong, a garbled time) is taken as ``now + notice_s``, else training
    would go on past the real end unsaved; one already past is no end to plan for (the stop
    may come at any moment): the next step boundary saves, within ``notice_s``, and stops."""
    deadline = _monotonic_at(unix)
    if now < deadline <= now + notice_s:
        return deadline, stated, True
    if now + notice_s < deadline <= now + notice_s + _CLOCK_SLACK_S:  # clocks a little apart
        return now + notice_s, stated, True
    past = deadline <= now
    if past:
        when, then = f"{now - deadline:.0f} s ago", "saving at the next step boundary"
    else:
        when = f"{deadline - now:.0f} s from now, later than the {notice_s:g} s {name} gives"
        then = f"planning for {notice_s:g} s"
    logger.warning(
        "coci: the %s notice says the machine stops at %s, %s: %s (is this machine's clock right?)",
        name,
        stated,
        when,
        then,
    )
    if past:
        return now + notice_s, f"{stated} (past: the next step boundary saves)", False
    return now + notice_s, f"{stated} (taken as {notice_s:g} s from the notice)", True


class AwsSpotNotice(MetadataPoller):
    """EC2 spot instance interruption notices (two minutes ahead)."""

    name = "aws"
    #: seconds from the notice's appearance to the stop (AWS: two minutes)
    notice_s = 120.0

    def __init__(self, endpoint: str = LINK_LOCAL, **options: float) -> None:
        super().__init__(endpoint, **options)
        self._token: str | None = None

    def check(self) -> Notice | None:
        headers = {}
        token = self._imds_token()
        if token:
            headers["X-aws-ec2-metadata-token"] = token
        try:
            body = self._get("/latest/meta-data/spot/instance-action", headers)
        except urllib.error.HTTPError as e:
            if e.code == 401:  # the token expired
                self._token = None
            raise
        if body is None:
            return None
        action = json.loads(body)
        when = calendar.timegm(time.strptime(action["time"], "%Y-%m-%dT%H:%M:%SZ"))
        now = time.monotonic()
        deadline, said, known = _stated_end("aws", action["time"], when, now, self.notice_s)
        return Notice(
            "aws", now, deadline, f"spot instance-action {action['action']!r} at {said}", known
        )

    def _imds_token(self) -> str | None:
        if self._token is None:
            try:
                body = self._get(
                    "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "21600"}, "PUT"
                )
                self._token = body.decode().strip() if body else ""
            except urllib.error.HTTPError:
                self._token = ""  # IMDSv1 only
        return self._token or None


class GceNotice(MetadataPoller):
    """GCE preemptible and spot VMs: ``instance/preempted`` turns ``TRUE``; the VM stops
    about ``lead_s`` (30) seconds later."""

    name = "gce"

    def __init__(
        self, endpoint: str = LINK_LOCAL, *, lead_s: float = 30.0, **options: float
    ) -> None:
        super().__init__(endpoint, **options)
        self.lead_s = check_lead_s(lead_s, "the gce notice")

    def check(self) -> Notice | None:
        body = self._get("/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
        if body is None:
            return None
        if body.strip().upper() not in (b"TRUE", b"FALSE"):  # an error page, a proxy's
            raise ValueError(f"instance/preempted is neither TRUE nor FALSE: {body[:40]!r}")
        if body.strip().upper() != b"TRUE":
            return None
        now = time.monotonic()
        return Notice("gce", now, now + self.lead_s, "instance/preempted is TRUE")


class AzureNotice(MetadataPoller):
    """Azure Scheduled Events: a ``Preempt`` event (spot eviction) and its ``NotBefore``."""

    name = "azure"
    api_version = "2020-07-01"
    #: seconds from a Preempt event's appearance to the eviction (Azure spot: 30 s)
    notice_s = 30.0

    def __init__(self, endpoint: str = LINK_LOCAL, **options: float) -> None:
        super().__init__(endpoint, **options)
        self._vm: str | None = None  # this VM's name; "" when the endpoint does not say

    def check(self) -> Notice | None:
        if self._vm is None:
            try:
                name = self._get(
                    "/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                    {"Metadata": "true"},
                )
            except urllib.error.HTTPError:
                name = None
            self._vm = name.decode().strip() if name else ""
        body = self._get(
            f"/metadata/scheduledevents?api-version={self.api_version}", {"Metadata": "true"}
        )
        if body is None:
            return None
        # a scale set's document lists every VM's events: another VM's eviction (its
        # Resources name other VMs) is not this one's; without names, every one is
        events = [
            e
            for e in json.loads(body).get("Events", [])
            if e.get("EventType") == "Preempt"
            and (
                not self._vm
                or not isinstance(e.get("Resources"), list)
                or not e["Resources"]
                or self._vm in e["Resources"]
            )
        ]
        if not events:
            return None
        event = events[0]
        now = time.monotonic()
        not_before = event.get("NotBefore") or ""
        parsed = email.utils.parsedate_to_datetime(not_before) if not_before else None
        if parsed is not None and parsed.tzinfo is None:  # no zone given: UTC, as Azure's
            parsed = parsed.replace(tzinfo=datetime.timezone.utc)  # are (not local time)
        if parsed is not None:
            deadline, said, known = _stated_end(
                "azure", not_before, parsed.timestamp(), now, self.notice_s
            )
        else:
            deadline, said, known = now + self.notice_s, "?", False
        return Notice(
            "azure",
            now,
            deadline,
            f"Scheduled Event Preempt {event.get('EventId', '')} not before {said}",
            known_end=known,
        )


_DMI = Path("/sys/class/dmi/id")


def detect_cloud(dmi: Path = _DMI) -> str | None:
    """``"aws"``, ``"gce"`` or ``"azure"`` when this machine's firmware says it runs there
    (DMI vendor strings: no request is made), else None."""
    found = []
    for name in ("sys_vendor", "bios_vendor", "product_name", "chassis_asset_tag"):
        try:
            found.append((dmi / name).read_text(errors="replace").strip())
        except OSError:
            continue
    text = " ".join(found)
    if "Amazon EC2" in text:
        return "aws"
    if "Google" in text:
        return "gce"
    # Azure's chassis asset tag; "Microsoft Corporation" alone is also Hyper-V on premises
    if "7783-7084-3265-9085-8269-3286-77" in text:
        return "azure"
    return None
