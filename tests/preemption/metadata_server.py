"""A stand-in for the clouds' instance metadata endpoints on 127.0.0.1 (a real HTTP server on
a thread): AWS's IMDSv2 token and spot ``instance-action``, GCE's ``instance/preempted`` and
Azure's Scheduled Events, each answering what the test sets, and every request recorded."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOKEN = "test-token"


class MetadataServer:
    """``aws_action`` (a dict, None: 404), ``gce_preempted``, ``azure_events`` (a list) say
    what the endpoints answer; ``raw`` (path with its query: status, body, headers) answers a
    path as given instead (status 0: the body is the whole answer, as it is, no HTTP status
    line or headers); a path in ``trickle`` is answered a byte of a header line every 20 ms
    until the client goes away; ``requests`` holds (method, path, headers) per request, and
    ``asked`` is set at every request."""

    def __init__(self) -> None:
        self.aws_action: dict[str, str] | None = None
        self.aws_token_required = True
        self.gce_preempted = False
        self.azure_events: list[dict[str, Any]] = []
        self.azure_vm_name: str | None = None  # None: /metadata/instance/compute/name is 404
        self.raw: dict[str, tuple[int, bytes, dict[str, str]]] = {}
        self.trickle: set[str] = set()
        self.stopped = threading.Event()
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.asked = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, code: int, body: bytes = b"") -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:
                server.requests.append(("PUT", self.path, _lower(self.headers)))
                if self.path == "/latest/api/token" and self.headers.get(
                    "X-aws-ec2-metadata-token-ttl-seconds"
                ):
                    self._answer(200, TOKEN.encode())
                else:
                    self._answer(400)

            def do_GET(self) -> None:
                server.requests.append(("GET", self.path, _lower(self.headers)))
                server.asked.set()
                h = self.headers
                if self.path in server.trickle:  # a header byte now and then, never done
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                    try:
                        while not server.stopped.wait(0.02):
                            self.wfile.write(b"a")
                            self.wfile.flush()
                    except OSError:  # the client went away
                        pass
                    self.close_connection = True
                elif self.path in server.raw:
                    code, body, headers = server.raw[self.path]
                    if code == 0:  # not HTTP: the body alone
                        self.wfile.write(body)
                        self.close_connection = True
                        return
                    self.send_response(code)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == "/latest/meta-data/spot/instance-action":
                    if server.aws_token_required and h.get("X-aws-ec2-metadata-token") != TOKEN:
                        self._answer(401)
                    elif server.aws_action is None:
                        self._answer(404)
                    else:
                        self._answer(200, json.dumps(server.aws_action).encode())
                elif self.path == "/computeMetadata/v1/instance/preempted":
                    if h.get("Metadata-Flavor") != "Google":
                        self._answer(403)
                    else:
                        self._answer(200, b"TRUE" if server.gce_preempted else b"FALSE")
                elif self.path.startswith("/metadata/instance/compute/name?"):
                    if h.get("Metadata") != "true":
                        self._answer(400)
                    elif server.azure_vm_name is None:
                        self._answer(404)
                    else:
                        self._answer(200, server.azure_vm_name.encode())
                elif self.path.startswith("/metadata/scheduledevents?api-version="):
                    if h.get("Metadata") != "true":
                        self._answer(400)
                    else:
                        body = {"DocumentIncarnation": 1, "Events": server.azure_events}
                        self._answer(200, json.dumps(body).encode())
                else:
                    self._answer(404)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> MetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self._httpd.shutdown()
        self._httpd.server_close()


def _lower(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}
