"""The manifest's bytes per rank of a typical adapter save (``python -m benchmarks.manifest_size``).

Saves a small Accelerate run (one process, CPU) and prints the JSON size of the rank's entry in
``per_rank`` (its tree and arrays: what each further rank adds to a manifest) and of the whole
manifest."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.accelerate.example import train_like_example

from coci_core.engine.format.manifest import MANIFEST_NAME


def per_rank_bytes(manifest_path: Path) -> tuple[int, int]:
    """(bytes of the first rank's ``per_rank`` entry, bytes of the whole manifest)."""
    data = manifest_path.read_bytes()
    body = data[: data.rindex(b',"checksum"')] + b"}"
    doc = json.loads(body)
    rank = json.dumps(doc["per_rank"][0], separators=(",", ":"))
    return len(rank.encode()), len(data)


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        train_like_example(d, epochs=1, every_n_steps=4, explicit=True)
        manifest = sorted(Path(d).rglob(MANIFEST_NAME))[-1]
        rank, whole = per_rank_bytes(manifest)
    print(f"per rank: {rank} bytes; whole manifest (1 rank): {whole} bytes")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
