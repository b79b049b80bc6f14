"""TensorBoard's coci tab, end to end: a real killed-and-resumed demo run, a real TensorBoard
server on loopback, the plugin's JSON routes, and the tab in headless Chromium."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coci_core.telemetry import read_jsonl
from coci_core.telemetry.report import facts, summarize
from tests.harness.processes import module, run
from tests.harness.tb import (
    TensorBoard,
    browser_available,
    open_browser,
    open_coci_tab,
    shared_killed_and_resumed_run,
    start_tensorboard,
)

pytestmark = pytest.mark.slow

TOTAL, KILL = 200, 120


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The log directory ``coci demo`` prints, of a run killed at step 120 (or just after its
    first checkpoint) and resumed, and the step it was killed at."""
    return shared_killed_and_resumed_run(
        tmp_path_factory, tmp_path_factory.mktemp("demo"), TOTAL, KILL
    )


@pytest.fixture(scope="module")
def logdir(demo: tuple[Path, int]) -> Path:
    return demo[0]


@pytest.fixture(scope="module")
def server(logdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TensorBoard]:
    """TensorBoard serving ``logdir`` on a free loopback port, stopped by its PID."""
    tb = start_tensorboard(logdir, tmp_path_factory.mktemp("tb") / "tensorboard.log")
    try:
        yield tb
    finally:
        tb.stop()
    assert tb.proc.poll() is not None


@pytest.fixture(scope="module")
def telemetry(logdir: Path) -> list[dict[str, Any]]:
    return read_jsonl(logdir / "coci" / "telemetry.jsonl")


def test_routes_serve_the_run_as_one_timeline(
    server: TensorBoard, demo: tuple[Path, int], telemetry: list[dict[str, Any]]
) -> None:
    """One run across the kill and the resume; its markers, restart and lost work match the
    telemetry; the summary is `coci report`'s numbers."""
    logdir, killed = demo
    listing = server.get_json("/data/plugins_listing")["coci"]
    assert listing["tab_name"] == "coci"
    assert listing["loading_mechanism"]["module_path"] == "/data/plugin/coci/index.js"
    assert b"export async function render" in server.get("/data/plugin/coci/index.js")

    runs = server.get_json("/data/plugin/coci/runs")["runs"]
    assert [r["name"] for r in runs] == ["coci"]
    assert Path(runs[0]["dir"]) == (logdir / "coci").resolve()
    data = server.get_json("/data/plugin/coci/timeline?run=coci")

    planned = sorted({s for r in telemetry if r["type"] == "plan" for s in r["next_steps"]})
    committed = [
        r["step"] for r in telemetry if r["type"] == "save" and r["outcome"] == "committed"
    ]
    restores = [r for r in telemetry if r["type"] == "restore"]
    assert [p["step"] for p in data["planned"]] == planned and planned
    assert [s["step"] for s in data["saves"] if s["outcome"] == "committed"] == committed
    assert committed[-1] == TOTAL
    assert len(restores) == 1 and len(data["restarts"]) == 1
    restart = data["restarts"][0]
    assert restart["restored"] == restores[0]["step"] < killed
    assert restart["restored"] < restart["failed_at"] == killed  # the step the run reached
    assert restart["lost_steps"] == restart["failed_at"] - restart["restored"]
    # the resumed process measured its whole restart: its start to its first step
    assert restart["restart_since"] == "process start"
    assert restart["restart_s"] > restart["restore_s"] > 0
    # loss points trained again after the restart are the lost ones
    lost = [p["step"] for p in data["loss"] if p["lost"]]
    assert all(restart["restored"] < s <= restart["failed_at"] for s in lost)
    # the run records a loss point every 50 steps: more lost steps than that lose a point
    # (the plan may have saved just before the kill, and then none was lost)
    assert lost or restart["lost_steps"] <= 50
    assert data["has_time"] and data["last_step"] == TOTAL

    summary = summarize(logdir / "coci")
    expected = facts(summary)
    assert data["summary"] == json.loads(json.dumps(expected))  # the same numbers, same code
    assert data["summary"]["lost_steps"] == restart["lost_steps"]
    report = run(
        module("coci_core.commands.cli", "report", str(logdir / "coci")), check=True
    ).stdout
    assert f"checkpoints committed: {len(committed)} at steps {committed}" in report
    assert f"checkpoints planned over the {TOTAL} steps run: {expected['planned']} at" in report
    assert f"lost work: {restart['lost_steps']} steps over 1 restart after a failure" in report
    for row in data["summary"]["policies"]:
        assert re.search(rf"{row['policy']}\s+{row['checkpoints']}\s+{row['wall_s']:.2f}", report)
    assert {r["policy"] for r in data["summary"]["policies"]} == {"coci", "daly", "checkfreq"}


def test_unknown_run_is_404(server: TensorBoard) -> None:
    with pytest.raises(OSError, match="404"):
        server.get("/data/plugin/coci/timeline?run=nope")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not browser_available():
        if os.environ.get("CI") or os.environ.get("COCI_BROWSER_TESTS"):
            pytest.fail("the browser tests need selenium, chromium and chromedriver (.ci/run)")
        pytest.skip("selenium, chromium or chromedriver is not installed")
    with open_browser() as driver:
        yield driver


def _artifact_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = os.environ.get("COCI_TEST_ARTIFACTS")
    directory = Path(path) if path else tmp_path_factory.mktemp("artifacts")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def test_tab_in_a_real_browser(
    server: TensorBoard,
    logdir: Path,
    browser: Any,
    telemetry: list[dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The DOM of the coci tab: as many planned and committed markers as the telemetry has,
    one restart, the lost work span, units in every cost label; a screenshot is kept."""
    from selenium.webdriver.common.by import By

    open_coci_tab(browser, server.url)

    def kind(name: str) -> list[Any]:
        return list(browser.find_elements(By.CSS_SELECTOR, f"svg [data-kind={name}]"))

    planned = {s for r in telemetry if r["type"] == "plan" for s in r["next_steps"]}
    saves = [r for r in telemetry if r["type"] == "save"]
    committed = [r for r in saves if r["outcome"] == "committed"]
    restore = next(r for r in telemetry if r["type"] == "restore")
    assert len(kind("planned")) == len(planned)
    assert {int(e.get_attribute("data-step")) for e in kind("planned")} == planned
    assert len(kind("committed")) == len(committed)
    assert len(kind("skipped")) + len(kind("failed")) == len(saves) - len(committed)
    assert len(kind("restart")) == 1
    assert kind("restart")[0].get_attribute("data-step") == str(restore["step"])
    assert len(kind("failure")) == 1
    (lost,) = kind("lost")
    assert lost.get_attribute("data-from") == str(restore["step"])
    steps = int(lost.get_attribute("data-steps"))
    assert steps == int(lost.get_attribute("data-to")) - restore["step"] > 0
    assert f"lost work: {steps} step{'' if steps == 1 else 's'}" in lost.text
    # the shade spans the lost steps (at least 2 px: the plan may save just before the kill)
    assert lost.find_element(By.CSS_SELECTOR, "rect").size["width"] > (10 if steps >= 20 else 1)

    # hover text of a committed save: stall, persist, bytes, compression, with units
    hover = kind("committed")[0].find_element(By.TAG_NAME, "title").get_attribute("textContent")
    assert re.search(r"stall [\d.]+ ms, persist [\d.]+ s, [\d.]+ MB, (compression|not comp)", hover)

    labels = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".axis-label")]
    for unit in ("stall per save (ms)", "persist per save (s)", "(MB)", "(x smaller)", "(s)"):
        assert any(unit in label for label in labels), (unit, labels)
    assert "training step" in labels

    facts_shown = {
        e.get_attribute("data-fact"): e.text
        for e in browser.find_elements(By.CSS_SELECTOR, "[data-fact]")
    }
    # planned: the steps run that the plan in force had (not every step a re-plan proposed)
    expected = facts(summarize(logdir / "coci"))
    assert facts_shown["planned"] == str(expected["planned"]) != "0"
    assert facts_shown["steps"] == str(TOTAL)
    assert facts_shown["committed"] == str(len(committed))
    assert facts_shown["restarts"] == "1"
    assert facts_shown["lost_steps"] == str(steps)
    assert facts_shown["taken"] == str(expected["taken"])
    # each number says what it counts: the policy rows are plans made afresh, not this plan
    rows = browser.find_elements(By.CSS_SELECTOR, "#coci-policies tr[data-policy]")
    assert [r.find_element(By.TAG_NAME, "td").text for r in rows] == ["coci", "daly", "checkfreq"]
    note = browser.find_element(By.ID, "coci-policies-note").text
    assert "made afresh with the costs measured by its end" in note

    browser.switch_to.default_content()
    shot = _artifact_dir(tmp_path_factory) / "coci-tab.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000


def test_wall_time_axis(server: TensorBoard, browser: Any) -> None:
    """The wall-time toggle redraws the same run against seconds since it started."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    open_coci_tab(browser, server.url)
    browser.find_element(By.CSS_SELECTOR, "input[value=time]").click()
    WebDriverWait(browser, 10).until(
        lambda d: d.find_element(By.ID, "coci-view").get_attribute("data-axis") == "time"
    )
    labels = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".axis-label")]
    assert "wall time (s since the run started)" in labels
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg [data-kind=restart]")) == 1
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg [data-kind=lost]")) == 1


def _path_points(browser: Any, kind: str) -> list[tuple[float, float]]:
    """The (x, y) points of the timeline's paths of ``kind`` (data-kind)."""
    from selenium.webdriver.common.by import By

    points = []
    for path in browser.find_elements(By.CSS_SELECTOR, f"svg path[data-kind={kind}]"):
        for x, y in re.findall(r"[ML]([-\d.]+),([-\d.]+)", path.get_attribute("d")):
            points.append((float(x), float(y)))
    return points


def test_the_legend_names_what_is_drawn_and_the_loss_has_a_log_scale(
    server: TensorBoard, browser: Any, logdir: Path
) -> None:
    """The legend lists what the timeline draws, no more: the demo's run (objective "time")
    fits no loss curve, so no "planner's fitted curve" (listed before, never drawn); a checkbox
    draws the loss on a log scale, which spreads the later steps' losses that a linear axis
    flattens under the first ones."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    data = server.get_json("/data/plugin/coci/timeline?run=coci")
    open_coci_tab(browser, server.url)
    legend = {
        e.get_attribute("data-legend")
        for e in browser.find_elements(By.CSS_SELECTOR, "#coci-legend [data-legend]")
    }
    assert all(p["fitted"] is None for p in data["loss"])  # the time objective fits no curve
    assert browser.find_elements(By.CSS_SELECTOR, "svg [data-kind=fitted]") == []
    assert "fitted" not in legend
    assert {"loss", "committed", "lost"} <= legend
    states = {p["state"] for p in data["planned"]}
    assert ("unreached" in legend) == ("unreached" in states)
    assert ("revised" in legend) == ("revised" in states)

    label = browser.find_element(By.CSS_SELECTOR, ".axis-label[data-scale]")
    assert (label.get_attribute("data-scale"), label.text) == ("linear", "loss")
    linear = _path_points(browser, "loss")
    browser.find_element(By.ID, "coci-logy").click()
    WebDriverWait(browser, 10).until(
        lambda d: (
            d.find_element(By.CSS_SELECTOR, ".axis-label[data-scale]").get_attribute("data-scale")
            == "log"
        )
    )
    label = browser.find_element(By.CSS_SELECTOR, ".axis-label[data-scale]")
    assert label.text == "loss (log scale)"
    ticks = [float(e.text) for e in browser.find_elements(By.CSS_SELECTOR, "[data-tick=loss]")]
    assert len(ticks) >= 2 and all(
        any(abs(t / (m * 10**k) - 1) < 1e-6 for m in (1, 2, 5) for k in range(-6, 7)) for t in ticks
    ), ticks
    log = _path_points(browser, "loss")
    # how many losses the demo logs before its kill depends on timing (9 to 12 seen)
    assert len(log) == len(linear) >= 6

    def later_spread(points: list[tuple[float, float]]) -> float:
        xs = sorted(x for x, _ in points)
        later = [y for x, y in points if x > xs[len(xs) // 4]]
        return max(later) - min(later)

    assert later_spread(log) > 1.2 * later_spread(linear)
