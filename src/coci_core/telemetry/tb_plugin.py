"""The **coci** tab of TensorBoard: a dynamic plugin (entry point group ``tensorboard_plugins``).

TensorBoard finds it once coci is installed with tensorboard; nothing is built. It serves one
ES module (``static/coci_tab.js``, plain JavaScript drawing inline SVG) and two JSON routes
under ``/data/plugin/coci/``:

- ``runs``: ``{"runs": [{"name": ..., "dir": ...}]}``, the runs under the log directory
  (:func:`~coci_core.telemetry.timeline.find_runs`);
- ``timeline?run=NAME``: the run's :func:`~coci_core.telemetry.timeline.timeline`.
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

from coci_core.telemetry.events import TELEMETRY_FILE, _finite_or_none
from coci_core.telemetry.timeline import find_runs, timeline

_WSGI = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

__all__ = ["PLUGIN_NAME", "CociPlugin"]

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

    def get_plugin_apps(self) -> dict[str, Any]:
        return {
            "/index.js": _wsgi(self._serve_js),
            "/runs": _wsgi(self._serve_runs),
            "/timeline": _wsgi(self._serve_timeline),
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
