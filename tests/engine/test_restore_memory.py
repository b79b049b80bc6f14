"""Peak resident memory of a save and of restore(into=...), measured in a real process.

Each child builds a model and an Adam optimizer after one update (~400 MB of state), then
saves it, or restores it into them, and reports how far its peak resident memory (VmHWM, reset
just before) rose above what it held before. The promises (docs/engine.md): a save adds the
arena (one copy of the state) and little else (with compression, also the copy of the base
that deltas need); a restore into the live objects adds no copy of
the state; restoring to a new state and then calling load_state_dict, as before, adds one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.harness.processes import module, run

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs"
)

MARGIN = 0.25  # of the state's size


def _child(*args: str) -> dict[str, Any]:
    done = run(module("tests.engine._memory_child", *args), timeout_s=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("compression", ["none", "lossless"])
def test_peak_memory_of_save_and_in_place_restore(tmp_path: Path, compression: str) -> None:
    saved = _child("save", str(tmp_path), compression)
    state = saved["state_bytes"]
    assert state > 350e6
    # the save: the arena (one copy of the state), and with compression the copy of the base
    # that the next saves' deltas are taken against (docs/compression.md); the margin besides
    copies = 1 if compression == "none" else 2
    assert 0.9 * copies * state < saved["extra_bytes"] < (copies + MARGIN) * state

    into = _child("restore", str(tmp_path), "into")
    assert into["same_tensors"]
    assert into["weight_sum"] == saved["weight_sum"]
    assert into["extra_bytes"] < MARGIN * state  # no second copy of the state

    if compression == "none":  # the probe sees the copy that the old way made
        copied = _child("restore", str(tmp_path), "copy")
        assert copied["weight_sum"] == saved["weight_sum"]
        assert copied["extra_bytes"] > 0.9 * state
