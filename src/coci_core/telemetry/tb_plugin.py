"""The **coci** tab of TensorBoard: a dynamic plugin (entry point group ``tensorboard_plugins``).

TensorBoard finds it once coci is installed with tensorboard; nothing is built. It serves one
ES module (``static/coci_tab.js``, plain JavaScript drawing inline SVG) and two JSON routes
under ``/data/plugin/coci/``:

- ``runs``: ``{"runs": [{"name": ..., "dir": ...}]}``, the runs under the log directory
  (:func:`~coci_core.telemetry.timeline.find_runs`);
- ``timeline?run=NAME``: the run's :func:`~coci_core.telemetry.timeline.timeline`;
- ``reason?run=NAME``: why the run's plan is what it is, in words (:func:`plan_reason`), and
  ``skipped_lines``.

Telemetry lines that cannot be read are skipped and counted (``skipped_lines``, see
:mod:`~coci_core.telemetry.records`): the routes show the rest.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tensorboard.plugins import base_plugin
from werkzeug import Request, Response, exceptions

from coci_core.planner.objectives import OBJECTIVES
from coci_core.telemetry.events import TELEMETRY_FILE, _finite_or_none
from coci_core.telemetry.report import RunSummary, summarize
from coci_core.telemetry.timeline import find_runs, timeline

_WSGI = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

__all__ = ["PLUGIN_NAME", "CociPlugin", "plan_reason"]

#: The plugin's name: its routes are under ``/data/plugin/coci/`` and its tab is "coci".
PLUGIN_NAME = "coci"

_STATIC = Path(__file__).with_name("static")


class CociPlugin(base_plugin.TBPlugin):  # type: ignore[misc]  # tensorboard is untyped
    """The coci tab: each run's checkpoints on a timeline, their costs and a summary."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: Any) -> None:
        self._logdir: str = getattr(context, "logdir", "") or ""
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[float, int], dict[str, Any]]] = {}
        self._reasons: dict[str, tuple[tuple[float, int], dict[str, Any]]] = {}

    def get_plugin_apps(self) -> dict[str, Any]:
        return {
            "/index.js": _wsgi(self._serve_js),
            "/runs": _wsgi(self._serve_runs),
            "/timeline": _wsgi(self._serve_timeline),
            "/reason": _wsgi(self._serve_reason),
        }

    def is_active(self) -> bool:
        return bool(self._runs())

    def frontend_metadata(self) -> Any:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="coci")

    def _runs(self) -> dict[str, str]:
        if not self._logdir or "://" in self._logdir or not os.path.isdir(self._logdir):
            return {}
        return find_runs(self._logdir)

    def _timeline(self, name: str, directory: str) -> dict[str, Any]:
        """The run's timeline, read again only when its telemetry file changed."""
        key: tuple[float, int] = (-1.0, -1)
        if "://" not in directory:
            st = os.stat(os.path.join(directory, TELEMETRY_FILE))
            key = (st.st_mtime, st.st_size)
        with self._lock:
            cached = self._cache.get(directory)
        if cached is not None and cached[0] == key and key != (-1.0, -1):
            data = cached[1]
        else:
            data = _finite_or_none(timeline(directory, name))
            with self._lock:
                self._cache[directory] = (key, data)
        return {**data, "run": name}

    def _reason(self, name: str, directory: str) -> dict[str, Any]:
        """The run's :func:`plan_reason`, read again only when its telemetry file changed."""
        key: tuple[float, int] = (-1.0, -1)
        if "://" not in directory:
            st = os.stat(os.path.join(directory, TELEMETRY_FILE))
            key = (st.st_mtime, st.st_size)
        with self._lock:
            cached = self._reasons.get(directory)
        if cached is not None and cached[0] == key and key != (-1.0, -1):
            data = cached[1]
        else:
            summary = summarize(directory)
            data = _finite_or_none(plan_reason(summary))
            data["skipped_lines"] = summary.skipped_lines
            with self._lock:
                self._reasons[directory] = (key, data)
        return {**data, "run": name}

    def _serve_reason(self, request: Request) -> Response:
        name = request.args.get("run")
        runs = self._runs()
        if name is None or name not in runs:
            raise exceptions.NotFound(f"no coci run {name!r} under the log directory")
        try:
            return _json(self._reason(name, runs[name]))
        except FileNotFoundError as e:
            raise exceptions.NotFound(str(e)) from e

    def _serve_js(self, request: Request) -> Response:
        del request
        text = (_STATIC / "coci_tab.js").read_text(encoding="utf-8")
        return _nosniff(Response(text, content_type="application/javascript; charset=utf-8"))

    def _serve_runs(self, request: Request) -> Response:
        del request
        runs = [{"name": name, "dir": d} for name, d in self._runs().items()]
        return _json({"runs": runs})

    def _serve_timeline(self, request: Request) -> Response:
        name = request.args.get("run")
        runs = self._runs()
        if name is None or name not in runs:
            raise exceptions.NotFound(f"no coci run {name!r} under the log directory")
        try:
            return _json(self._timeline(name, runs[name]))
        except FileNotFoundError as e:
            raise exceptions.NotFound(str(e)) from e


def _wsgi(handler: Callable[[Request], Response]) -> _WSGI:
    """``handler`` as a WSGI application (an HTTP error it raises is the response)."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        try:
            response: Any = handler(Request(environ))
        except exceptions.HTTPException as e:
            response = e
        return response(environ, start_response)  # type: ignore[no-any-return]

    return app


def _nosniff(response: Response) -> Response:
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


def _json(data: Any) -> Response:
    text = json.dumps(data, allow_nan=False, default=str)
    return _nosniff(Response(text, content_type="application/json"))


# -- why the plan is what it is ------------------------------------------------------------

_MTBF_SOURCES = {
    "user": "user-given (mtbf_s)",
    "estimated": "coci's default, counted as one failure, averaged with this run's failures: "
    "(default + time run) / (failures + 1)",
    "default": "coci's default: no mtbf_s given and no failure seen yet",
}
_COST_SOURCES = {
    "user": "user-given",
    "measured": "measured",
    "default": "coci's default, not measured yet",
    "unknown": "not measured yet",
}


def _number(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def _duration(seconds: float | None) -> str:
    """``seconds`` in the unit a person reads best (ms, s, min, h, days)."""
    if seconds is None:
        return "unknown"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms"
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def _cost(plan: dict[str, Any], name: str) -> tuple[float | None, str]:
    costs, sources = plan.get("costs") or {}, plan.get("cost_sources") or {}
    source = str(sources.get(name, "unknown"))
    return _number(costs.get(name)), _COST_SOURCES.get(source, source)


def _versus_daly(plan_s: float, daly_s: float) -> str:
    if daly_s <= 0 or abs(plan_s - daly_s) <= 1e-9 * max(1.0, daly_s):
        return "the same as Daly's"
    share = (daly_s - plan_s) / daly_s
    return f"{abs(share):.1%} {'less' if share > 0 else 'more'} than Daly's"


def plan_reason(summary: RunSummary) -> dict[str, Any]:
    """Why the run's newest plan is what it is, from its telemetry, in words: ``plan_step``
    (the step it was made at, None before the first plan), ``lines`` (each ``key``,
    ``label``, ``text``: the policy and how it planned, the objective, the MTBF and its
    source, the save and restart costs and their sources, the next checkpoint, the interval,
    the termination hazard when there is one, and the expected overhead against Daly's
    interval) and ``note``. Plans recorded by older versions lack the horizon and the method:
    their lines say less."""
    plans = summary.plans
    if not plans:
        return {
            "plan_step": None,
            "lines": [],
            "note": "no plan recorded yet: coci plans once it has measured a few steps",
        }
    plan = plans[-1]
    lines: list[dict[str, str]] = []

    def add(key: str, label: str, text: str) -> None:
        lines.append({"key": key, "label": label, "text": text})

    policy = str(plan.get("policy") or "?")
    method = plan.get("plan_method")
    how = f": {method}" if method and method != f"the {policy} policy" else ""
    add("policy", "policy", f"{policy}{how}")
    objective = str(plan.get("objective") or "?")
    known = OBJECTIVES.get(objective)
    meaning = known.description if known is not None else None
    add("objective", "objective", f"{objective}: {meaning}" if meaning else objective)

    mtbf = _number(plan.get("mtbf_s"))
    source = str(plan.get("mtbf_source") or "unknown")
    add("mtbf", "MTBF", f"{_duration(mtbf)}, {_MTBF_SOURCES.get(source, source)}")

    stall, stall_from = _cost(plan, "stall_s")
    persist, persist_from = _cost(plan, "persist_s")
    add(
        "save_cost",
        "save cost",
        f"training stalls {_duration(stall)} per save ({stall_from}); the write then takes "
        f"{_duration(persist)} in the background ({persist_from})",
    )
    restart, restart_from = _cost(plan, "restart_s")
    step_time, step_from = _cost(plan, "step_time_s")
    add(
        "restart_cost",
        "restart cost",
        f"{_duration(restart)} ({restart_from}); a training step takes "
        f"{_duration(step_time)} ({step_from})",
    )

    last = summary.last_step
    ahead = sorted(int(s) for s in plan.get("next_steps", []) if int(s) > last)
    committed = [int(s["step"]) for s in summary.committed]
    if ahead:
        when = f" (~{_duration((ahead[0] - last) * step_time)})" if step_time else ""
        text = f"step {ahead[0]}, {ahead[0] - last} steps after step {last}{when}"
    elif committed and committed[-1] == last:
        text = f"none ahead: the newest checkpoint is step {last}, the last step recorded"
    else:
        text = f"none planned after step {last}, the last step recorded"
    add("next", "next checkpoint", text)

    spaced = [p for p in plans if isinstance(p.get("interval_steps"), int)]
    if spaced:
        interval = int(spaced[-1]["interval_steps"])
        every = f"every {interval} steps"
        if step_time:
            every += f" (~{_duration(interval * step_time)})"
        if spaced[-1] is not plan:
            every += f", as planned at step {spaced[-1]['step']}"
        add("interval", "interval", every)

    termination = plan.get("termination")
    if isinstance(termination, str) and termination != "none":
        add("termination", "termination hazard", termination)

    costed = [p for p in plans if isinstance(p.get("expected_overhead"), dict)]
    if costed:  # the newest plan costed (costing runs behind the plans, on its own thread)
        chosen = costed[-1]
        ov = chosen["expected_overhead"]
        wall, daly_wall = _number(ov.get("wall_s")), _number(ov.get("daly_wall_s"))
        if wall is not None and daly_wall is not None:
            end = chosen.get("horizon_end_step")
            span = f"over the rest of the run from step {chosen['step']}" + (
                (f" to step {end}" + (" (a rolling horizon)" if chosen.get("rolling") else ""))
                if isinstance(end, int) and end > int(chosen["step"])
                else ""
            )
            text = (
                f"{_duration(wall)} of wall-clock time {span}, against Daly's "
                f"{_duration(daly_wall)}: {_versus_daly(wall, daly_wall)}"
            )
            obj, daly_obj = _number(ov.get("objective_s")), _number(ov.get("daly_objective_s"))
            goal = ov.get("objective")
            if goal != "time" and obj is not None and daly_obj is not None:
                text += (
                    f"; by the {goal} objective {_duration(obj)} against "
                    f"{_duration(daly_obj)}: {_versus_daly(obj, daly_obj)}"
                )
            add("overhead", "expected overhead", text)
    return {"plan_step": int(plan["step"]), "lines": lines, "note": ""}
