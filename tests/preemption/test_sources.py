"""Notice sources in this process: a real signal to itself, the pollers against a real local
HTTP server standing in for AWS, GCE and Azure, the registry and the option's errors, and the
fit decision."""

from __future__ import annotations

import email.utils
import os
import signal
import time
import urllib.error
from pathlib import Path

import pytest

from coci_core import ConfigError
from coci_core.preemption import (
    AwsSpotNotice,
    AzureNotice,
    GceNotice,
    Notice,
    NoticeBoard,
    Preemption,
    SignalNotice,
    check_preemption,
    detect_cloud,
    notice_source,
    register_notice_source,
)
from coci_core.preemption.signals import launcher_warnings
from coci_core.training.preemption import (
    NoticePlan,
    PreemptionDecision,
    PreemptionWatch,
    fit_save,
)
from tests.preemption.metadata_server import MetadataServer


def test_a_signal_only_records_the_notice_and_its_lead_time() -> None:
    board = NoticeBoard()
    source = SignalNotice("USR1", lead_s=90)
    before = signal.getsignal(signal.SIGUSR1)
    assert source.start(board)
    try:
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR1)
        for _ in range(1000):  # the handler runs at the next bytecode boundary
            if board.first() is not None:
                break
        notice = board.first()
        assert notice is not None and notice.source == "SIGUSR1"
        assert 89 < notice.deadline - t0 <= 90 + (time.monotonic() - t0)
    finally:
        source.stop()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_previous_python_handler_is_still_called() -> None:
    called: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: called.append(signum))
    try:
        board = NoticeBoard()
        source = SignalNotice("SIGUSR2", lead_s=5)
        source.start(board)
        os.kill(os.getpid(), signal.SIGUSR2)
        for _ in range(1000):
            if called:
                break
        source.stop()
        assert called == [signal.SIGUSR2] and board.first() is not None
    finally:
        signal.signal(signal.SIGUSR2, previous)


def _poll(source: AwsSpotNotice | GceNotice | AzureNotice) -> float:
    board = NoticeBoard()
    source.start(board)
    try:
        notice = board.wait(10)
    finally:
        source.stop()
    assert notice is not None
    return notice.time_left()


def test_the_aws_poller_reads_the_spot_instance_action_with_an_imdsv2_token() -> None:
    with MetadataServer() as server:
        source = AwsSpotNotice(server.url, interval_s=0.05, timeout_s=1)
        assert source.check() is None  # 404: nothing scheduled
        when = time.gmtime(time.time() + 120)
        server.aws_action = {
            "action": "terminate",
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", when),
        }
        left = _poll(source)
        assert 115 < left <= 120
        gets = [r for r in server.requests if r[0] == "GET"]
        assert gets and all(r[2].get("x-aws-ec2-metadata-token") == "test-token" for r in gets)
        assert {r[1] for r in server.requests} <= {
            "/latest/api/token",
            "/latest/meta-data/spot/instance-action",
        }


def test_the_gce_poller_reads_instance_preempted() -> None:
    with MetadataServer() as server:
        source = GceNotice(server.url, lead_s=30, interval_s=0.05)
        assert source.check() is None
        server.gce_preempted = True
        assert 29 < _poll(source) <= 30


def test_the_azure_poller_reads_a_preempt_scheduled_event() -> None:
    with MetadataServer() as server:
        source = AzureNotice(server.url, interval_s=0.05)
        server.azure_events = [{"EventId": "a", "EventType": "Freeze", "NotBefore": ""}]
        assert source.check() is None  # not a preemption
        not_before = email.utils.formatdate(time.time() + 25, usegmt=True)
        server.azure_events.append(
            {"EventId": "b", "EventType": "Preempt", "NotBefore": not_before}
        )
        assert 23 < _poll(source) <= 25


def test_an_azure_not_before_without_a_zone_is_utc(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``NotBefore`` that names no time zone was read as this machine's local time (hours
    off where it is not UTC): it is UTC, as Azure's times are."""
    monkeypatch.setenv("TZ", "Etc/GMT+5")  # local time 5 hours behind UTC
    time.tzset()
    try:
        with MetadataServer() as server:
            source = AzureNotice(server.url, interval_s=0.05)
            not_before = time.strftime("%a, %d %b %Y %H:%M:%S", time.gmtime(time.time() + 20))
            server.azure_events = [{"EventType": "Preempt", "NotBefore": not_before}]
            assert 18 < _poll(source) <= 20
    finally:
        monkeypatch.undo()
        time.tzset()


def _state_end(server: MetadataServer, when: float) -> None:
    """``server``'s AWS spot action and Azure Preempt event both state the end ``when`` (UTC
    seconds since the epoch)."""
    server.aws_action = {
        "action": "terminate",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when)),
    }
    not_before = email.utils.formatdate(when, usegmt=True)
    server.azure_events = [{"EventType": "Preempt", "NotBefore": not_before}]


def _stated_end_notices(when: float, caplog: pytest.LogCaptureFixture) -> tuple[Notice, Notice]:
    """The notices of AWS and Azure (a local stand-in) both stating the end ``when``, their
    WARNINGs in ``caplog``."""
    with MetadataServer() as server:
        server.aws_token_required = False
        _state_end(server, when)
        with caplog.at_level("WARNING", logger="coci_core.preemption"):
            aws = AwsSpotNotice(server.url, timeout_s=1).check()
            azure = AzureNotice(server.url, timeout_s=1).check()
    assert aws is not None and azure is not None
    return aws, azure


@pytest.mark.parametrize("ahead_s", [365 * 86400.0, 600.0], ids=["a-year", "ten-minutes"])
def test_a_stated_end_past_the_clouds_notice_period_is_taken_as_that_period(
    ahead_s: float, caplog: pytest.LogCaptureFixture
) -> None:
    """AWS stops a spot instance two minutes after its notice appears, Azure evicts 30 s
    after a Preempt event. A stated end further ahead (this machine's clock set wrong, a
    garbled time) was planned for as given: training went on to the last step before it,
    unsaved, past the real end. It is taken as the notice period, and a WARNING says so."""
    when = time.time() + ahead_s
    aws, azure = _stated_end_notices(when, caplog)
    assert aws.known_end and 119 < aws.time_left() <= 120, aws
    assert azure.known_end and 29 < azure.time_left() <= 30, azure
    assert "(taken as 120 s from the notice)" in aws.detail
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("is this machine's clock right?" in m for m in said), said
    with MetadataServer() as server:  # clocks a second or two apart: taken as is, unsaid
        server.azure_events = [
            {"EventType": "Preempt", "NotBefore": email.utils.formatdate(time.time() + 32)}
        ]
        caplog.clear()
        with caplog.at_level("WARNING", logger="coci_core.preemption"):
            azure = AzureNotice(server.url, timeout_s=1).check()
    assert azure is not None and azure.known_end and 29 < azure.time_left() <= 30
    assert not caplog.records


def test_a_stated_end_already_past_saves_at_the_next_step_boundary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An AWS time or Azure NotBefore already past when seen (this machine's clock ahead) was
    a known end with negative time left: no save was even tried and training stopped, the
    work since the last checkpoint lost while the machine ran on. The stop may come at any
    moment: the next step boundary saves within the notice period, and a WARNING says so."""
    when = time.time() - 3600
    aws, azure = _stated_end_notices(when, caplog)
    assert not aws.known_end and 119 < aws.time_left() <= 120, aws
    assert not azure.known_end and 29 < azure.time_left() <= 30, azure
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("s ago: saving at the next step boundary" in m for m in said)
    watch = PreemptionWatch(Preemption(["TERM@20"], margin_s=2))
    watch.board.post(aws)
    decision = watch.check(7, lambda: 1.0)
    assert isinstance(decision, PreemptionDecision) and decision.step == 7 and decision.save


def test_an_azure_preempt_event_of_another_vm_of_the_scale_set_is_not_this_ones() -> None:
    """A scale set's Scheduled Events document lists the events of all its VMs: another
    VM's eviction (its ``Resources``) stopped this one too, which went on running with its
    training cut short. Only a Preempt naming this VM (IMDS ``compute/name``) is a notice."""
    not_before = email.utils.formatdate(time.time() + 25, usegmt=True)
    other = {"EventId": "o", "EventType": "Preempt", "Resources": ["pool_7"], "NotBefore": ""}
    with MetadataServer() as server:
        server.azure_vm_name = "pool_3"
        server.azure_events = [other]
        source = AzureNotice(server.url, timeout_s=1)
        assert source.check() is None
        mine = {"EventId": "m", "EventType": "Preempt", "Resources": ["pool_3"]}
        server.azure_events.append({**mine, "NotBefore": not_before})
        notice = source.check()
        assert notice is not None and "Preempt m " in notice.detail and notice.known_end
    with MetadataServer() as server:  # no name known: every Preempt is this VM's
        server.azure_events = [other]
        assert AzureNotice(server.url, timeout_s=1).check() is not None


AWS_ACTION = "/latest/meta-data/spot/instance-action"
AZURE_EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
GCE_PREEMPTED = "/computeMetadata/v1/instance/preempted"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (AWS_ACTION, b'{"action": "terminate"}'),  # no time
        (AWS_ACTION, b"[]"),
        (AWS_ACTION, b'{"action": "terminate", "time": 5}'),
        (AWS_ACTION, b"\xff\xfe"),
        (AZURE_EVENTS, b"[]"),
        (AZURE_EVENTS, b'{"Events": ["Preempt"]}'),
        (AZURE_EVENTS, b'{"Events": [{"EventType": "Preempt", "NotBefore": 7}]}'),
        (GCE_PREEMPTED, b"<html><body>Service Unavailable</body></html>"),
    ],
    ids=[
        "no-time",
        "list",
        "number-time",
        "not-utf8",
        "azure-list",
        "event-str",
        "number-nb",
        "gce-html",
    ],
)
def test_a_garbled_answer_is_no_notice_and_the_poller_goes_on(
    path: str, body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer of another shape (a field missing, a list for a dict, a number for a time)
    raised KeyError, TypeError or AttributeError in the poller's thread: the thread died with
    a traceback and no notice was watched from then on. It is no notice, said once, and the
    poller goes on: the stop told later is posted."""
    with MetadataServer() as server:
        server.aws_token_required = False
        server.raw[path] = (200, body, {})
        make = {AWS_ACTION: AwsSpotNotice, AZURE_EVENTS: AzureNotice}.get(path, GceNotice)
        source = make(server.url, interval_s=0.01, timeout_s=1)
        board = NoticeBoard()
        with caplog.at_level("WARNING", logger="coci_core.preemption"):
            source.start(board)
            for _ in range(4):  # the fourth request comes after the third's warning
                assert server.asked.wait(5)
                server.asked.clear()
            del server.raw[path]
            _state_end(server, time.time() + 120)
            server.gce_preempted = True
            notice = board.wait(5)
        source.stop()
        assert notice is not None and notice.source == make.name
        said = [r.getMessage() for r in caplog.records if "answers garbled" in r.getMessage()]
        assert len(said) == 1 and "(still asking)" in said[0], caplog.text


@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH_9.6\r\n",  # another service on the port: no HTTP status line
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",  # a header line too long
        b"HTTP/1.1 200 OK\r\n" + b"X: a\r\n" * 101 + b"\r\nTRUE",  # too many headers
    ],
    ids=["not-http", "long-header", "many-headers"],
)
def test_an_answer_that_is_not_http_is_no_notice_and_the_poller_goes_on(
    answer: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """An endpoint that answers something other than HTTP (another service on the port, a
    header line or count over http.client's limits) raised http.client.HTTPException, which
    is no OSError: the poller's thread died with a traceback and no notice was watched from
    then on. It is said once as an endpoint that does not answer, and the poller goes on."""
    path = "/computeMetadata/v1/instance/preempted"
    with MetadataServer() as server:
        server.raw[path] = (0, answer, {})
        source = GceNotice(server.url, interval_s=0.01, timeout_s=1)
        board = NoticeBoard()
        with caplog.at_level("WARNING", logger="coci_core.preemption"):
            source.start(board)
            for _ in range(4):  # the fourth request comes after the third's warning
                assert server.asked.wait(5)
                server.asked.clear()
            del server.raw[path]
            server.gce_preempted = True
            notice = board.wait(5)
        source.stop()
        assert notice is not None and notice.source == "gce"
        said = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
        assert len(said) == 1 and "(still asking)" in said[0], caplog.text


def test_an_endpoint_that_answers_a_byte_now_and_then_is_cut_off_and_the_poller_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The request's timeout bounded each read of the socket alone: an endpoint that sent a
    byte of its answer every 20 ms held the poller's one request (up to 64 KiB of a header
    line, hours), no notice was watched and nothing was said. The whole request is cut off
    at its timeout: an endpoint that does not answer, said once, and the poller goes on."""
    path = "/computeMetadata/v1/instance/preempted"
    with MetadataServer() as server:
        server.trickle.add(path)
        source = GceNotice(server.url, interval_s=0.01, timeout_s=0.2)
        board = NoticeBoard()
        with caplog.at_level("WARNING", logger="coci_core.preemption"):
            source.start(board)
            for _ in range(4):  # the fourth request comes after the third's warning
                assert server.asked.wait(5), "the first request never ended"
                server.asked.clear()
            server.trickle.clear()
            server.gce_preempted = True
            notice = board.wait(5)
        source.stop()
        assert notice is not None and notice.source == "gce"
        said = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
        assert len(said) == 1 and "no whole answer within 0.2 s" in said[0], caplog.text


def test_a_redirect_is_not_followed() -> None:
    """A metadata endpoint that redirects (to another host: the IMDS token would go with
    the request) is refused, not followed."""
    with MetadataServer() as server:
        server.aws_token_required = False
        target = f"{server.url}/elsewhere"
        server.raw[AWS_ACTION] = (302, b"", {"Location": target})
        with pytest.raises(urllib.error.HTTPError, match="redirect refused"):
            AwsSpotNotice(server.url, timeout_s=1).check()
        assert [r[1] for r in server.requests if r[0] == "GET"] == [AWS_ACTION]


def test_a_poller_that_gets_no_answer_posts_nothing() -> None:
    with MetadataServer() as server:
        url = server.url
    board = NoticeBoard()
    source = GceNotice(url, interval_s=0.05, timeout_s=0.2)  # the server is gone
    source.start(board)
    assert board.wait(0.5) is None
    source.stop()


def test_auto_watches_sigterm_and_no_cloud_here(tmp_path: Path) -> None:
    sources = Preemption().make_sources()
    assert sources[0].name == "SIGTERM"
    (tmp_path / "sys_vendor").write_text("Amazon EC2\n")
    assert detect_cloud(tmp_path) == "aws"
    (tmp_path / "sys_vendor").write_text("Google\n")
    assert detect_cloud(tmp_path) == "gce"
    (tmp_path / "sys_vendor").write_text("QEMU\n")
    assert detect_cloud(tmp_path) is None


def test_the_option_names_sources_and_rejects_bad_ones() -> None:
    config = check_preemption(["TERM@45", "USR1@90", "aws"])
    assert config is not None
    made = config.make_sources()
    assert [(s.name, getattr(s, "lead_s", None)) for s in made] == [
        ("SIGTERM", 45.0),
        ("SIGUSR1", 90.0),
        ("aws", None),
    ]
    assert check_preemption(None) is None
    with pytest.raises(ConfigError, match="unknown preemption notice source 'slurm'"):
        check_preemption("slurm")
    with pytest.raises(ConfigError, match=r"^'preemption' source 'USR1@soon'.*USR1@90"):
        check_preemption("USR1@soon")
    with pytest.raises(ConfigError, match="margin_s"):
        Preemption(margin_s=-1)
    with pytest.raises(ConfigError, match="'preemption' must be None"):
        check_preemption(3)
    with pytest.raises(ConfigError, match="lead time"):
        SignalNotice("TERM", lead_s=0)


def test_an_exit_code_a_requeue_reads_as_done_is_refused(tmp_path: Path) -> None:
    """``exit_code=0`` was taken: a preempted job then exits with success, which SLURM's
    ``--requeue``, Kubernetes' ``OnFailure`` and torchrun read as done, and never resumes.
    0 is refused naming ``exit_code`` and 1-255; a code in that range is the process's exit
    status on a notice."""
    import torch

    from coci_core import Preempted
    from coci_core.training import Checkpointer

    for bad in (0, 256, -1, True, "143"):
        with pytest.raises(ConfigError, match=r"exit_code must be an integer in \[1, 255\]"):
            Preemption(["TERM@30"], exit_code=bad)  # type: ignore[arg-type]
    ckpt = Checkpointer(tmp_path, preemption=Preemption(["TERM@30"], exit_code=1))
    try:
        ckpt.watch_preemption()
        ckpt.observe(1)
        signal.raise_signal(signal.SIGTERM)  # its handler has run when this returns
        ckpt.observe(2)
        assert ckpt.should_save(2)
        ckpt.save(2, {"w": torch.zeros(2)})
        with pytest.raises(Preempted) as stopped:
            ckpt.stop_if_preempted()
        assert stopped.value.code == 1 and stopped.value.step == 2
    finally:
        ckpt.close()


def test_auto_beside_a_grace_period_keeps_it_and_a_signal_given_twice_is_refused() -> None:
    """``["auto", "TERM@120"]`` (auto's cloud poller, a pod's 120 s grace period) watched
    SIGTERM twice, auto's with 30 s: each SIGTERM posted both notices and the earliest
    deadline won, so a save of 40 s was declined with 120 s left. The list's own SIGTERM
    stands; the same signal given twice ('TERM@30', 'SIGTERM@60') is a ConfigError."""
    for value in (["auto", "TERM@120"], ["TERM@120", "auto"]):
        config = check_preemption(value)
        assert config is not None
        made = config.make_sources()
        assert [(m.name, getattr(m, "lead_s", None)) for m in made] == [("SIGTERM", 120.0)]
    with pytest.raises(ConfigError, match=r"gives SIGTERM 2 times \('TERM@30', 'SIGTERM@60'\)"):
        check_preemption(["TERM@30", "SIGTERM@60"])
    with pytest.raises(ConfigError, match=r"gives SIGUSR1 2 times.*give each signal once"):
        check_preemption(["USR1@90", SignalNotice("USR1", lead_s=30)])


def test_a_registered_source_is_named_in_the_option() -> None:
    register_notice_source("test-usr2", lambda arg: SignalNotice("USR2", float(arg or 7)))
    source = notice_source("test-usr2@12")
    assert isinstance(source, SignalNotice) and source.lead_s == 12.0
    with pytest.raises(ConfigError, match="not a notice source name"):
        register_notice_source("a@b", lambda arg: source)


def test_the_fit_decision() -> None:
    assert fit_save(30, 10, 3)[0]
    ok, why = fit_save(10, 8, 3)
    assert not ok and "not started" in why
    assert fit_save(10, None, 3)[0]  # not measured: tried
    assert not fit_save(2, None, 3)[0]


def test_a_save_that_may_fit_is_tried_only_where_cut_short_it_costs_nothing() -> None:
    """The slowest of the last saves does not fit, the fastest does: tried when nothing waits
    for the time (no remote upload), else not started; one that cannot fit even at the
    fastest pace, counting the save still being written, is never started."""
    ok, why = fit_save(10, 12, 3, fastest_s=8, try_uncertain=True)
    assert ok and "may not finish" in why and "8.00 to 12.00 s" in why
    # what happens if cut short, not that it was ("tried (cut short, ...)" read as the latter)
    assert "tried (if the kill cuts it short, the previous checkpoint stays the newest)" in why
    assert not fit_save(10, 12, 3, fastest_s=8)[0]  # an upload waits: not started
    ok, why = fit_save(10, 12, 3, fastest_s=11, try_uncertain=True)
    assert not ok and "not started" in why
    ok, why = fit_save(30, 10, 3, fastest_s=10, wait_s=25, try_uncertain=True)
    assert not ok and "after 25.00 s for the save being written" in why
    ok, why = fit_save(30, 10, 3, wait_s=15)
    assert ok and "it fits" in why and "after 15.00 s" in why
    # not measured yet: tried while any time is left, where a cut-short save costs nothing
    assert fit_save(2, None, 3, try_uncertain=True)[0]
    assert not fit_save(-0.1, None, 3, try_uncertain=True)[0]


def test_the_watch_decides_from_the_fastest_and_the_wait() -> None:
    from coci_core.training.preemption import SaveTimes

    def decide(times: SaveTimes) -> tuple[bool, str]:
        watch = PreemptionWatch(Preemption(["TERM@10"], margin_s=2))
        now = time.monotonic()
        watch.board.post(Notice("SIGTERM", now, now + 10))
        decision = watch.check(1, lambda: times)
        assert decision is not None and not isinstance(decision, NoticePlan)
        assert decision.needed_s == times.longest_s
        return decision.save, decision.reason

    assert decide(SaveTimes(12.0, 6.0))[0]
    assert decide(SaveTimes(None, None))[0]  # none measured: tried
    assert not decide(SaveTimes(12.0, 6.0, try_uncertain=False))[0]
    assert not decide(SaveTimes(12.0, 6.0, wait_s=5.0))[0]
    assert decide(SaveTimes(5.0, 4.0, wait_s=2.0))[0]
    assert "after" not in decide(SaveTimes(5.0, 4.0))[1]


def test_one_process_decides_once_at_the_first_boundary_after_the_notice() -> None:
    watch = PreemptionWatch(Preemption(["TERM@20"], margin_s=2))
    assert watch.check(1, lambda: 1.0) is None
    now = time.monotonic()
    watch.board.post(Notice("SIGTERM", now, now + 20))
    decision = watch.check(2, lambda: 1.0)
    assert decision is not None and decision.step == 2 and decision.save
    assert watch.check(3, lambda: 100.0) is decision  # made once


def test_a_known_end_is_planned_for_and_a_later_sigterm_takes_the_save_at_once() -> None:
    """A SIGUSR1 30 s ahead: the save is planned many steps later, the same plan at the next
    boundaries; a SIGTERM then takes the save at once, at that boundary."""
    from coci_core.training.preemption import plan_save_step

    watch = PreemptionWatch(Preemption(["USR1@30"], margin_s=2))
    for step in range(1, 4):
        assert watch.check(step, lambda: 1.0) is None
    now = time.monotonic()
    watch.board.post(Notice("SIGUSR1", now, now + 30, known_end=True))
    plan = watch.check(4, lambda: 1.0)
    assert isinstance(plan, NoticePlan) and plan.noticed_at == 4 and plan.save_at > 100
    assert watch.check(5, lambda: 1.0) is plan  # its pace is checked after a few steps
    watch.board.post(Notice("SIGTERM", time.monotonic(), time.monotonic() + 20))
    decision = watch.check(6, lambda: 1.0)
    assert not isinstance(decision, NoticePlan) and decision is not None
    assert decision.save and decision.step == 6 and decision.noticed_at == 4 and decision.moved
    assert decision.source == "SIGTERM" and decision.noticed_source == "SIGUSR1"
    # the plan: the last boundary at which the save still fits
    # (20 s left, a 4 s save, a quarter of it in reserve: 5 s, 2 s of margin: 13 s to train)
    assert plan_save_step(10, 20.0, 0.5, 4.0, 2.0) == 10 + 26
    assert plan_save_step(10, 20.0, None, 4.0, 2.0) == 10  # no step time: at once
    assert plan_save_step(10, 6.5, 0.5, 4.0, 2.0) == 10  # it fits, not with its reserve: now
    assert plan_save_step(10, 7.5, 0.5, 4.0, 2.0) == 11  # a step to spare


def test_a_plan_made_again_keeps_the_time_left_at_the_notice() -> None:
    """A second notice of an earlier end: once the pace since the plan shows its step no
    longer fits, the plan is made again, earlier; the plan and the decision report the step
    and the time that was left where the ranks learned of the notice in force (the second
    source's), not at the new plan."""
    from coci_core.training.preemption import PACE_MIN_STEPS

    watch = PreemptionWatch(Preemption(["USR1@30"], margin_s=2))
    for step in range(1, 4):
        assert watch.check(step, lambda: 1.0) is None
    now = time.monotonic()
    watch.board.post(Notice("SIGUSR1", now, now + 30, known_end=True))
    first = watch.check(4, lambda: 1.0)
    assert isinstance(first, NoticePlan) and 29 < first.time_left_s <= 30
    watch.board.post(Notice("SIGUSR2", now, now + 5, known_end=True))
    step, again = 4, first
    while again is first and step < 4 + 10 * PACE_MIN_STEPS:
        step += 1
        again = watch.check(step, lambda: 1.0)
    assert isinstance(again, NoticePlan) and again.save_at < first.save_at
    # another source's notice: the plan names the step and time left where it was learned
    assert again.noticed_at == 5 and again.time_left_s <= again.noticed_left_s <= 5
    assert first.noticed_left_s == first.time_left_s
    watch.board.post(Notice("SIGTERM", time.monotonic(), time.monotonic() + 4))
    decision = watch.check(step + 1, lambda: 1.0)
    assert not isinstance(decision, NoticePlan) and decision is not None
    assert decision.noticed_at == 5 and decision.noticed_source == "SIGUSR2"
    assert decision.noticed_left_s == again.noticed_left_s
    assert decision.time_left_s <= 4


def test_the_report_names_both_notices_when_a_sigterm_cuts_a_moved_save_short(
    tmp_path: Path,
) -> None:
    """A SIGUSR1 30 s ahead moves the save; a SIGTERM two steps later takes it at once. The
    telemetry record, read back as ``coci report`` reads it, says which notice came when."""
    from coci_core.telemetry import JsonlTelemetry
    from coci_core.telemetry.records import parse_records
    from coci_core.telemetry.report import preemption_line
    from coci_core.training import Checkpointer

    watch = PreemptionWatch(Preemption(["USR1@30"], margin_s=2))
    assert watch.check(3, lambda: 1.0) is None
    now = time.monotonic()
    watch.board.post(Notice("SIGUSR1", now, now + 30, known_end=True))
    assert isinstance(watch.check(4, lambda: 1.0), NoticePlan)
    watch.board.post(Notice("SIGTERM", time.monotonic(), time.monotonic() + 20))
    decision = watch.check(6, lambda: 1.0)
    assert not isinstance(decision, NoticePlan) and decision is not None
    # through the Checkpointer's own recorder, as a run's notice reaches the sinks
    ckpt = Checkpointer(tmp_path / "ckpt", sinks=[JsonlTelemetry(tmp_path / "telemetry.jsonl")])
    try:
        ckpt._record_preemption(decision, 6, 1.0)
    finally:
        ckpt.close()
    records, skipped = parse_records((tmp_path / "telemetry.jsonl").read_bytes())
    (record,) = [r for r in records if r["type"] == "preemption"]
    assert skipped == 0 and record["noticed_source"] == "SIGUSR1"
    line = preemption_line(record)
    assert line.startswith("preemption notice (SIGUSR1) at step 4, "), line
    assert ": then SIGTERM at step 6, " in line and "moved" not in line, line
    assert line.endswith(": saved step 6 (the save took 1.00 s)"), line
    # a record of an older version, without the field: the one source it names
    del record["noticed_source"]
    assert preemption_line(record).startswith("preemption notice (SIGTERM) at step 4, ")


def test_a_known_end_signal_that_torchruns_agent_would_die_of_is_warned_about(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SLURM's --signal=USR1@90 reaches torchrun's (accelerate launch's) agent too: one that
    does not handle SIGUSR1 dies of it and its workers with it, before any save; one that
    does SIGKILLs them after its shutdown timeout. The worker's start says what to set."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT", raising=False)
    watch = PreemptionWatch(Preemption(["TERM@30", "USR1@90"]))
    try:
        with pytest.warns(UserWarning, match=r"PET_SIGNALS_TO_HANDLE=.*,SIGUSR1 and .*=90"):
            watch.start()
    finally:
        watch.stop()
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1")
    watch = PreemptionWatch(Preemption(["USR1@90"]))
    try:
        with pytest.warns(UserWarning, match=r"SIGKILLs the workers 30 s later"):
            watch.start()
    finally:
        watch.stop()
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "90")
    for env in ({}, {"TORCHELASTIC_RUN_ID": None}):  # told enough; not under torchrun
        for k in env:
            monkeypatch.delenv(k)
        watch = PreemptionWatch(Preemption(["TERM@30", "USR1@90"]))
        try:
            assert [s.name for s in watch.start()] == ["SIGTERM", "SIGUSR1"]  # no warning
        finally:
            watch.stop()


def test_a_torch_whose_agent_takes_no_signals_or_timeout_is_not_told_to_set_them() -> None:
    """torchrun took --signals-to-handle from torch 2.9 and --shutdown-timeout later: before,
    its agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT only and waits 30 s, whatever the
    environment says, so the warning must not name settings that change nothing (nor trust a
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT that this torch ignores)."""
    sources = [SignalNotice("SIGUSR1", lead_s=90.0)]
    env = {"TORCHELASTIC_RUN_ID": "none", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}
    (line,) = launcher_warnings(sources, env, options=(False, False))
    assert "cannot be told to handle it" in line and "PET_SIGNALS_TO_HANDLE" not in line
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGUSR1"
    (line,) = launcher_warnings(sources, env, options=(True, False))
    assert "SIGKILLs the workers 30 s later" in line, line
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in line and "at most 30 s before" in line
    del env["TORCHELASTIC_SIGNALS_TO_HANDLE"]
    (line,) = launcher_warnings(sources, env, options=(True, False))
    assert "PET_SIGNALS_TO_HANDLE=" in line and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in line
    assert launcher_warnings(sources, env, options=(True, True)) != []  # USR1 not handled
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGUSR1"
    assert launcher_warnings(sources, env, options=(True, True)) == []  # told enough
