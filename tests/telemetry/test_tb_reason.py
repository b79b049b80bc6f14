"""Why the plan is what it is, in words beside the timeline of TensorBoard's coci tab: from the
run's telemetry (records of older versions included), through the plugin's route, to the page
in headless Chromium at a narrow and a wide window, every line visible and none cut."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coci_core.telemetry import read_jsonl
from coci_core.telemetry.report import RunSummary
from coci_core.telemetry.tb_plugin import plan_reason
from tests.harness.tb import (
    TensorBoard,
    browser_available,
    open_browser,
    open_coci_tab,
    shared_killed_and_resumed_run,
    start_tensorboard,
)

TOTAL, KILL = 200, 120
#: the demo's run (killed mid-run and resumed), and one written here as an older version would
#: have recorded it, whose failure and restart labels meet the timeline's two edges
RUNS = ("demo/run/coci", "edge/coci")

_COSTS = {"step_time_s": 0.5, "stall_s": 0.02, "persist_s": 1.5, "restart_s": 30.0}


def _plan(step: int, **fields: Any) -> dict[str, Any]:
    """A plan record as the JSON-lines telemetry of an older version wrote it (no horizon,
    method or termination), updated with ``fields``."""
    record: dict[str, Any] = {
        "type": "plan",
        "step": step,
        "policy": "coci",
        "objective": "time",
        "next_steps": [],
        "interval_steps": None,
        "mtbf_s": 7200.0,
        "mtbf_source": "user",
        "costs": dict(_COSTS),
        "cost_sources": dict.fromkeys(_COSTS, "measured"),
        "expected_overhead": None,
        "time": 1.0 + step,
    }
    record.update(fields)
    return record


def _lines(records: list[dict[str, Any]]) -> dict[str, str]:
    reason = plan_reason(RunSummary(records))
    return {line["key"]: line["text"] for line in reason["lines"]}


def test_no_plan_yet() -> None:
    reason = plan_reason(RunSummary([{"type": "progress", "step": 3, "time": 1.0}]))
    assert reason["plan_step"] is None and reason["lines"] == []
    assert "no plan recorded yet" in reason["note"]


def test_an_older_runs_plan_reads() -> None:
    """A plan record without the fields added since still gives every line it can: policy,
    objective, MTBF and its source, costs and their sources, the next checkpoint."""
    records = [_plan(10, next_steps=[40, 70], interval_steps=30)]
    lines = _lines(records)
    assert lines["policy"] == "coci"
    assert lines["objective"].startswith("time: wall-clock time lost")
    assert lines["mtbf"] == "2 h, user-given (mtbf_s)"
    assert lines["save_cost"] == (
        "training stalls 20 ms per save (measured); the write then takes 1.5 s in the "
        "background (measured)"
    )
    assert lines["restart_cost"] == "30 s (measured); a training step takes 500 ms (measured)"
    assert lines["next"] == "step 40, 30 steps after step 10 (~15 s)"
    assert lines["interval"] == "every 30 steps (~15 s)"
    assert "overhead" not in lines and "termination" not in lines  # not costed yet


def test_sources_and_the_comparison_with_daly() -> None:
    """Each MTBF source in words; default costs said to be unmeasured; the newest costed
    plan's overhead against Daly's, with its horizon, by wall-clock and by the objective."""
    overhead = {
        "objective": "convergence",
        "objective_s": 40.0,
        "wall_s": 90.0,
        "daly_objective_s": 50.0,
        "daly_wall_s": 100.0,
    }
    records = [
        _plan(5, next_steps=[30], expected_overhead=overhead),
        _plan(
            20,
            objective="convergence",
            mtbf_source="default",
            mtbf_s=86400.0,
            next_steps=[30, 60],
            interval_steps=30,
            cost_sources={**dict.fromkeys(_COSTS, "measured"), "restart_s": "default"},
            expected_overhead=overhead,
            horizon_end_step=500,
            rolling=False,
            plan_method="dp for the convergence objective",
            termination="ASHA rungs at steps [100, 300] (eta 3)",
        ),
    ]
    lines = _lines(records)
    assert lines["policy"] == "coci: dp for the convergence objective"
    assert lines["mtbf"] == "24 h, coci's default: no mtbf_s given and no failure seen yet"
    assert lines["restart_cost"].startswith("30 s (coci's default, not measured yet)")
    assert lines["termination"] == "ASHA rungs at steps [100, 300] (eta 3)"
    assert lines["overhead"] == (
        "90 s of wall-clock time over the rest of the run from step 20 to step 500, against "
        "Daly's 100 s: 10.0% less than Daly's; by the convergence objective 40 s against "
        "50 s: 20.0% less than Daly's"
    )
    estimated = _lines([_plan(5, mtbf_source="estimated", mtbf_s=600.0)])
    assert estimated["mtbf"] == (
        "10 min, coci's default, counted as one failure, averaged with this run's failures: "
        "(default + time run) / (failures + 1)"
    )


def test_the_end_of_a_run() -> None:
    """No checkpoint ahead: the line says where the run stands."""
    saved = {"type": "save", "step": 50, "outcome": "committed", "time": 60.0}
    assert _lines([_plan(40, next_steps=[50]), saved])["next"] == (
        "none ahead: the newest checkpoint is step 50, the last step recorded"
    )
    progress = {"type": "progress", "step": 55, "time": 70.0}
    assert _lines([_plan(40, next_steps=[50]), saved, progress])["next"] == (
        "none planned after step 55, the last step recorded"
    )


# -- a real run, its telemetry through TensorBoard, the tab in a browser --------------------


def _edge_run(directory: Path) -> None:
    """Telemetry of a run restored from step 2 after failing at step 199 of 200."""
    records: list[dict[str, Any]] = [_plan(1, next_steps=[2, 120])]
    save = {"type": "save", "outcome": "committed", "stall_s": 0.01, "persist_s": 0.2}
    records.append({**save, "step": 2, "bytes_written": 1000, "raw_bytes": 1000})
    records += [{"type": "loss", "step": k, "loss": 2.0 - k / 200} for k in range(3, 200, 4)]
    records.append({"type": "progress", "step": 199})
    records.append({"type": "restore", "step": 2, "seconds": 0.5, "bytes_read": 1000})
    records += [{"type": "loss", "step": k, "loss": 2.0 - k / 200} for k in range(3, 201, 4)]
    records.append(_plan(3, next_steps=[120]))
    records.append({**save, "step": 200, "bytes_written": 1000, "raw_bytes": 1000})
    directory.mkdir(parents=True)
    with open(directory / "telemetry.jsonl", "w", encoding="utf-8") as f:
        for i, r in enumerate(records):
            f.write(json.dumps({**r, "time": 1000.0 + i}) + "\n")


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log directory with the two runs of ``RUNS``."""
    root = tmp_path_factory.mktemp("logs")
    shared_killed_and_resumed_run(tmp_path_factory, root / "demo", TOTAL, KILL)
    _edge_run(root / "edge" / "coci")
    return root


@pytest.fixture(scope="module")
def server(logdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TensorBoard]:
    tb = start_tensorboard(logdir, tmp_path_factory.mktemp("tb") / "tensorboard.log")
    try:
        yield tb
    finally:
        tb.stop()


@pytest.mark.slow
def test_the_route_words_the_recorded_plan(server: TensorBoard, logdir: Path) -> None:
    """The plan records carry the horizon and the method; the route says the policy,
    objective, MTBF and source, the costs and their sources, the next checkpoint and the
    overhead against Daly, from the newest plan."""
    records = read_jsonl(logdir / "demo" / "run" / "coci" / "telemetry.jsonl")
    plans = [r for r in records if r["type"] == "plan"]
    newest = plans[-1]
    assert {"horizon_end_step", "rolling", "plan_method", "termination"} <= newest.keys()
    assert isinstance(newest["plan_method"], str) and newest["plan_method"]
    assert [r["name"] for r in server.get_json("/data/plugin/coci/runs")["runs"]] == sorted(RUNS)
    reason = server.get_json("/data/plugin/coci/reason?run=demo/run/coci")
    assert reason["run"] == "demo/run/coci" and reason["plan_step"] == newest["step"]
    lines = {line["key"]: line["text"] for line in reason["lines"]}
    assert {"policy", "objective", "mtbf", "save_cost", "next", "overhead"} <= lines.keys()
    assert lines["policy"].startswith(newest["policy"])
    assert lines["objective"].startswith(newest["objective"] + ":")
    assert lines["mtbf"] == "20 s, user-given (mtbf_s)"  # the demo gives mtbf_s=20
    assert "(measured)" in lines["save_cost"]
    assert "against Daly's" in lines["overhead"]
    with pytest.raises(OSError, match="404"):
        server.get("/data/plugin/coci/reason?run=nope")


@pytest.fixture(scope="module")
def browsers() -> Iterator[dict[str, Any]]:
    """A narrow and a wide headless Chromium."""
    if not browser_available():
        if os.environ.get("CI") or os.environ.get("COCI_BROWSER_TESTS"):
            pytest.fail("the browser tests need selenium, chromium and chromedriver (.ci/run)")
        pytest.skip("selenium, chromium or chromedriver is not installed")
    with open_browser(width=800, height=1200) as narrow, open_browser(width=1600) as wide:
        yield {"narrow": narrow, "wide": wide}


# In the page: the reason panel's box, its lines, anything in it wider than its box, the page's
# own overflow, and every chart label outside its chart.
_MEASURE = """
const panel = document.getElementById('coci-reason');
const box = panel.getBoundingClientRect();
const lines = [...panel.querySelectorAll('[data-reason]')].map((e) => {
  const r = e.getBoundingClientRect();
  return {key: e.getAttribute('data-reason'), text: e.textContent,
          width: r.width, height: r.height, right: r.right};
});
const cut = [...panel.querySelectorAll('*')]
  .filter((e) => e.scrollWidth > e.clientWidth + 1 || e.scrollHeight > e.clientHeight + 1)
  .filter((e) => e.clientWidth > 0)
  .map((e) => e.tagName + ' ' + e.textContent.slice(0, 60));
const outside = [];
for (const chart of document.querySelectorAll('svg[data-chart]')) {
  const W = chart.width.baseVal.value;
  for (const t of chart.querySelectorAll('text')) {
    if (t.hasAttribute('transform')) continue;
    const b = t.getBBox();
    const out = b.x < 0 || b.x + b.width > W + 0.5;
    if (out) outside.push(chart.dataset.chart + ': ' + t.textContent);
  }
}
const timeline = document.querySelector('svg[data-chart=timeline]').getBoundingClientRect();
const label = (kind) => {
  const t = document.querySelector(`svg [data-kind=${kind}] text`);
  return t && {left: t.getBoundingClientRect().left, right: t.getBoundingClientRect().right};
};
return {layout: panel.dataset.layout, left: box.left, right: box.right, top: box.top,
        bottom: box.bottom, lines, cut, outside,
        timeline: {left: timeline.left, right: timeline.right, top: timeline.top,
                   bottom: timeline.bottom},
        failure_label: label('failure'), restart_label: label('restart'),
        viewport: document.documentElement.clientWidth,
        scrollWidth: document.documentElement.scrollWidth};
"""


def _show_run(browser: Any, name: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    Select(browser.find_element(By.ID, "coci-run")).select_by_value(name)
    WebDriverWait(browser, 30).until(
        lambda d: (
            d.find_element(By.ID, "coci-view").get_attribute("data-run") == name
            and d.find_elements(By.CSS_SELECTOR, "#coci-reason [data-reason]")
        )
    )


@pytest.mark.slow
@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("window", ["narrow", "wide"])
def test_the_reason_in_a_real_browser(
    server: TensorBoard, browsers: dict[str, Any], window: str, run: str
) -> None:
    """Each line of the route's reason is shown, in full: no element of the panel is wider or
    taller than its box, the panel lies within the page, which does not scroll sideways, and
    no chart label sticks out of its chart. Wide: the panel beside the timeline; narrow:
    below it."""
    browser = browsers[window]
    open_coci_tab(browser, server.url)
    _show_run(browser, run)
    page = browser.execute_script(_MEASURE)
    reason = server.get_json(f"/data/plugin/coci/reason?run={run}")
    shown = {line["key"]: line["text"] for line in page["lines"]}
    for line in reason["lines"]:
        assert shown[line["key"]] == line["text"]
    if run == "demo/run/coci":
        assert "overhead_run" in shown and "against Daly's" in shown["overhead_run"]
    assert all(line["width"] > 50 and line["height"] > 10 for line in page["lines"]), page
    assert page["cut"] == [], page["cut"]
    assert page["outside"] == [], page["outside"]
    assert page["scrollWidth"] <= page["viewport"]
    assert page["left"] >= 0 and page["right"] <= page["viewport"]
    timeline = page["timeline"]
    assert timeline["right"] <= page["viewport"]
    if window == "wide":
        assert page["layout"] == "beside"
        assert page["left"] >= timeline["right"] and page["top"] < timeline["bottom"]
    else:
        assert page["layout"] == "below"
        assert page["top"] >= timeline["bottom"]
    if run == "edge/coci":  # the labels that would stick out, moved inside
        assert page["failure_label"]["right"] <= timeline["right"]
        assert page["restart_label"]["left"] >= timeline["left"]
    browser.switch_to.default_content()
