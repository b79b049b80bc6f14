"""What CociCheckpoint does for Lightning's FSDPStrategy, which refuses a CPU accelerator: its
code run on FSDP1 modules on 2 CPU processes with gloo (``_fsdp1_child``), and its refusal of
an FSDPStrategy without a device mesh."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from coci_core import ConfigError
from coci_lightning._sharded import check_sharded
from tests.harness.processes import Child, free_port, module, rank_env

MODULE = "tests.lightning._fsdp1_child"
WORLD = 2


def _run(directory: Path, mesh: str) -> list[dict[str, Any]]:
    port = free_port()
    results: dict[int, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        procs = [
            stack.enter_context(
                Child(module(MODULE, str(directory), mesh), env=rank_env(r, WORLD, port))
            )
            for r in range(WORLD)
        ]
        for p in procs:
            for line in p.lines():
                if line.startswith("RESULT "):
                    row = json.loads(line[len("RESULT ") :])
                    results[row["rank"]] = row
            assert p.wait(120) == 0
    assert sorted(results) == list(range(WORLD))
    return [results[r] for r in range(WORLD)]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["1d", "hybrid"])
def test_fsdp1_with_a_device_mesh_saves_shards_and_restores_exactly(
    tmp_path: Path, mesh: str
) -> None:
    results = _run(tmp_path, mesh)
    for r in results:
        assert r["kinds"] == ["DTensor"]
        assert r["global_step"] == 3
        assert r["trained_on"] != r["saved"]  # training on changed the state
        assert r["restored"] == r["saved"]  # model and optimizer back as saved
        assert r["trained_again"] == r["trained_on"]  # and training on from it is the same
    # each rank wrote its own rows (17 and 16 of 33), nobody the whole tensor
    manifest = json.loads((tmp_path / "step-0000000003" / "manifest.json").read_text())
    entries = {e["key"]: e for e in manifest["tensors"]}
    for key in ("/state_dict/net.0.weight", "/optimizer_states/0/state/net.0.weight/exp_avg"):
        assert sorted((p["file"], p["length"]) for p in entries[key]["pieces"]) == [
            ("data-r0.bin", 17 * 16 * 4),
            ("data-r1.bin", 16 * 16 * 4),
        ]


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp1_without_a_device_mesh_is_refused_by_name(tmp_path: Path) -> None:
    for r in _run(tmp_path, "none"):
        assert r["kinds"] == ["ShardedTensor"]
        assert r["error"].startswith(
            "UnsupportedValueError: state value at '/state_dict/net.0.weight' is a ShardedTensor"
        )
        assert "device_mesh=" in r["error"]
    assert not (tmp_path / "step-0000000003").exists()


def test_fsdp_strategy_without_a_device_mesh_is_refused_at_setup() -> None:
    with pytest.raises(ConfigError, match=r"FSDPStrategy\(device_mesh=\.\.\.\)"):
        check_sharded(FSDPStrategy())
    check_sharded(FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(1, 2)))
    check_sharded(ModelParallelStrategy())
