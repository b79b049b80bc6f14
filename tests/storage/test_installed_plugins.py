"""A backend and a codec from another package, declared only as entry points (``coci.storage``,
``coci.codecs``) in its installed metadata: CheckpointManager saves and restores through them,
and the ``coci`` command lists and verifies the checkpoints in a process of its own."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from coci_core import CheckpointManager
from coci_core.codecs import registry as codec_registry
from coci_core.storage import Storage, registry
from tests.harness.processes import child_env, module, run
from tests.storage.contract import StorageContract

PLUGIN = "coci_mem2_plugin"
ENTRY_POINTS = f"""\
[coci.storage]
mem2 = {PLUGIN}:Mem2Storage

[coci.codecs]
zlib = {PLUGIN}:ZLIB
"""


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The plugin installed on a directory of sys.path (its module and its dist-info), registries
    as if nothing were loaded yet; the environment a ``coci`` process needs to see it."""
    site = tmp_path / "site"
    info = site / f"{PLUGIN}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    shutil.copy(Path(__file__).with_name("_mem2_plugin.py"), site / f"{PLUGIN}.py")
    root = tmp_path / "mem2"
    monkeypatch.setenv("COCI_MEM2_ROOT", str(root))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry, "_FACTORIES", {})
    monkeypatch.setattr(registry, "_INSTALLED", None)
    monkeypatch.setattr(codec_registry, "_CODECS", dict(codec_registry._CODECS))
    monkeypatch.setattr(codec_registry, "_installed_loaded", False)
    env = child_env({"COCI_MEM2_ROOT": str(root)})
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    yield env
    sys.modules.pop(PLUGIN, None)


class TestInstalledBackend(StorageContract):
    @pytest.fixture
    def storage(self, installed: dict[str, str]) -> Storage:
        from coci_core.storage import open_storage

        return open_storage("mem2://contract")


def test_an_installed_backend_and_codec_save_restore_list_and_verify(
    installed: dict[str, str],
) -> None:
    """Saved through mem2:// with the zlib codec (float32 pieces under "lossless"), restored
    equal; `coci ls` and `coci verify` open the same store and decode every piece."""
    state = {"w": torch.randn(4096), "ids": torch.arange(4096)}
    with CheckpointManager("mem2://run", compression="lossless") as mgr:
        type_name = type(mgr.storage).__name__
        for step in (1, 2):
            mgr.save(step, {**state, "step": step}).wait()
        codecs = {entry.key: entry.codec for entry in mgr.manifest(2).tensors}
        restored = mgr.restore()
    assert type_name == "Mem2Storage"
    assert codecs["/w"] == "mem2plugin.zlib/1" and codecs["/ids"] != "mem2plugin.zlib/1"
    assert restored["step"] == 2
    assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["ids"], state["ids"])

    ls = run(module("coci_core.commands.cli", "ls", "mem2://run"), env=installed)
    assert ls.returncode == 0, ls.stderr
    assert [line.split()[0] for line in ls.stdout.splitlines()[1:]] == ["1", "2"], ls.stdout
    verify = run(module("coci_core.commands.cli", "verify", "mem2://run"), env=installed)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "step 2: ok" in verify.stdout, verify.stdout
