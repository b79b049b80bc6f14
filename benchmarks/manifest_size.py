"""A manifest's bytes per rank (``python -m benchmarks.manifest_size``).

Saves a small Accelerate run (one process, CPU, the shape of Accelerate's checkpointing
example) and prints the JSON size of the rank's entry in ``per_rank`` (its tree and its arrays'
records: what each further rank adds to a manifest, mostly its random states: Python's,
NumPy's and torch's), of the part of it that is Python's random state, and of the whole
manifest, with what the rank entries come to at 4,096 ranks."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from tests.accelerate.example import train_like_example

from coci_core.engine.format.manifest import MANIFEST_NAME


def _doc(manifest_path: Path) -> Any:
    data = manifest_path.read_bytes()
    return json.loads(data[: data.rindex(b',"checksum"')] + b"}")


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())


def sizes(manifest_path: Path) -> dict[str, int]:
    """The JSON sizes of the first rank's ``per_rank`` entry, of its Python random state, and
    of the whole manifest, with the manifest's format."""
    doc = _doc(manifest_path)
    rank = doc["per_rank"][0]
    python = _find_python_state(rank["tree"])
    return {
        "format_version": doc["format_version"],
        "per_rank_entry": _size(rank),
        "python_random_state": _size(python) if python is not None else 0,
        "manifest": manifest_path.stat().st_size,
    }


def _find_python_state(tree: Any) -> Any:
    """The tree node under a ``"python"`` key (the adapters' name for ``random.getstate()``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("v"), dict) and "python" in node["v"]:
                return node["v"]["python"]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        train_like_example(d, epochs=1, every_n_steps=4, explicit=True)
        got = sizes(sorted(Path(d).rglob(MANIFEST_NAME))[-1])
    print(json.dumps(got))
    print(
        f"per rank: {got['per_rank_entry']:,} bytes (Python's random state "
        f"{got['python_random_state']:,}); at 4,096 ranks: "
        f"{got['per_rank_entry'] * 4096 / 2**20:.1f} MiB of rank entries",
        flush=True,
    )


if __name__ == "__main__":
    main()
