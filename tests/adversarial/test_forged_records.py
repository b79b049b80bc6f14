"""Forged records (manifests relabelled and resealed, planted files) can neither crash nor
poison: every record that reaches an unpickler is measured first, or refused as damage; the
writer never commits what its reader refuses; a step beyond the reader's bound is refused at
the call.
"""

from __future__ import annotations

import io
import os
import pickle
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import crc32c
import pytest
import torch

from coci_core import BackgroundSaveError, CheckpointManager, ConfigError, StorageError
from coci_core.commands.cli import main
from coci_core.engine.format.manifest import step_dir_name
from coci_core.engine.save import persist
from coci_core.interop.foreign import read_foreign
from coci_core.telemetry import JsonlTelemetry
from tests.adversarial.craft import edit_manifest
from tests.harness.processes import run, script

# a dict keyed by a tuple nested 200,000 deep: CPython hashes the key in C while unpickling
# it, and the stack overflows (SIGSEGV)
DEEP_KEY = b"\x80\x02}K\x01" + b"\x85" * 200_000 + b"K\x01s."

# the highest commit sequence a manifest may record (coci_core.engine.format.manifest.MAX_SEQUENCE;
# written out so that these tests also run against a coci without it)
HIGHEST_SEQUENCE = 2**62


def _two_steps(root: Path) -> None:
    """Steps 1 and 2 of tensors only (allow_torch_save off: nothing stored with torch.save)."""
    with CheckpointManager(root, compression="none") as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((4,), float(step)), "b": torch.zeros(8)}).wait()


def _relabel_as_torch_saved(root: Path, step: int, key: str, data: bytes) -> None:
    """Store ``data`` as ``key``'s bytes and relabel that array a torch.save'd value, the
    manifest resealed: every checksum passes, only the bytes can tell."""

    def edit(doc: dict[str, Any]) -> None:
        entry = next(t for t in doc["tensors"] if t["key"] == f"/{key}")
        (piece,) = entry["pieces"]
        path = root / step_dir_name(step) / piece["file"]
        offset = path.stat().st_size
        with path.open("ab") as f:
            f.write(data)
        piece.update(offset=offset, nbytes=len(data), length=len(data), crc32c=crc32c.crc32c(data))
        entry.update(kind="torch_save", dtype="uint8", shape=[len(data)])
        for file in doc["files"]:
            if file["name"] == piece["file"]:
                file["nbytes"] = path.stat().st_size
        doc["tree"]["v"][key]["t"] = "torch_save"

    edit_manifest(root, step, edit)


_RESTORE_AND_COMMANDS = """
import sys
from coci_core import CheckpointManager
from coci_core.commands.cli import main
root, out = sys.argv[1], sys.argv[2]
with CheckpointManager(root) as mgr:
    state = mgr.restore()
    print("RESTORED", mgr.last_restore.step, state["w"].tolist(), flush=True)
for args in (["ls", root], ["verify", root], ["export", root, out]):
    print("STATUS", args[0], main(args), flush=True)
"""


def test_a_legacy_format_value_is_damage_for_restore_and_every_command(tmp_path: Path) -> None:
    """An array relabelled a torch.save'd value whose bytes are a bare pickle (torch.load's
    legacy, non-zip format: before, unmeasured, and the process died of SIGSEGV): step 2 is
    damaged; restore falls back to step 1, ls lists it damaged, verify names it, export takes
    step 1 (all in a real process: a segfault would end it)."""
    root = tmp_path / "ckpt"
    _two_steps(root)
    _relabel_as_torch_saved(root, 2, "b", DEEP_KEY)
    child = run(script(_RESTORE_AND_COMMANDS, str(root), str(tmp_path / "out.pt")))
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "RESTORED 1 [1.0, 1.0, 1.0, 1.0]" in child.stdout
    assert "STATUS ls 0" in child.stdout and "STATUS export 0" in child.stdout
    assert "STATUS verify 1" in child.stdout  # step 2 damaged
    assert "'/b' cannot be read: it is not a torch.save zip archive" in child.stdout
    assert torch.load(tmp_path / "out.pt", weights_only=True)["w"].tolist() == [1.0] * 4


def test_a_genuine_legacy_file_still_imports(tmp_path: Path) -> None:
    """What coci import may read in the legacy format: measured, then loaded as before."""
    state = {"w": torch.arange(5.0), "n": 3, "t": (1, "x")}
    torch.save(state, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    got = read_foreign(tmp_path / "old.pt")
    assert torch.equal(got["w"], state["w"]) and got["n"] == 3 and got["t"] == (1, "x")


_GLOBAL_STEP = """
import sys
import fsspec
from coci_lightning._resume import _global_step
head, tail = bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2])
fsspec.filesystem("memory").pipe("/ckpt/last.ckpt", head + b"\\x85" * 200_000 + tail)
print("STEP", _global_step("memory://ckpt/last.ckpt"))
"""


def test_a_planted_lightning_file_does_not_crash_the_resume() -> None:
    """A file among Lightning's "last" candidates (in an fsspec store) whose pickle would
    crash torch.load (before: SIGSEGV): its step is unknown (compared by time), the resume
    goes on."""
    head, tail = DEEP_KEY[:5], DEEP_KEY[-4:]
    assert head + b"\x85" * 200_000 + tail == DEEP_KEY
    child = run(script(_GLOBAL_STEP, head.hex(), tail.hex()))
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert "STEP None" in child.stdout


def _forge_sequence(root: Path, step: int, sequence: int) -> None:
    edit_manifest(root, step, lambda doc: doc.update(sequence=sequence))


def test_a_forged_commit_sequence_does_not_poison_later_saves(tmp_path: Path) -> None:
    """Step 1's sequence forged to 2**63-1 (beyond what a commit may record): step 1 is
    damaged, the next save is committed with a sequence the reader reads, and a resume takes
    it (before: numbered 2**63, refused, and every resume fell back to the forged step)."""
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
    _forge_sequence(root, 1, 2**63 - 1)
    with CheckpointManager(root) as mgr:
        assert mgr.save(2, {"w": torch.full((3,), 2.0)}).wait().outcome == "committed"
    with CheckpointManager(root) as mgr:
        state = mgr.restore()
        assert mgr.last_restore is not None and mgr.last_restore.step == 2
        assert mgr.last_restore.skipped_steps == ()  # step 1 is not even a candidate
        assert torch.equal(state["w"], torch.full((3,), 2.0))


def test_a_save_after_the_highest_sequence_fails_and_is_not_committed(tmp_path: Path) -> None:
    """A forged record at the highest sequence a reader accepts: no save can be numbered
    after it, so the save fails loudly, names the step, and commits nothing."""
    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
    _forge_sequence(root, 1, HIGHEST_SEQUENCE)
    with CheckpointManager(root) as mgr:
        handle = mgr.save(2, {"w": torch.full((3,), 2.0)})
        with pytest.raises(BackgroundSaveError, match=r"step 1 of .* records commit sequence"):
            handle.wait()
        assert handle.event is not None and handle.event.outcome == "failed"
        assert mgr.steps() == [1]
    assert not (root / step_dir_name(2)).exists()


def test_a_manifest_the_reader_would_refuse_is_never_reported_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clock before 1970 (a manifest's creation time must be in [0, 2**37]): before, the
    save was reported committed and no resume could read it; now it fails."""
    clock = SimpleNamespace(time=lambda: -5.0, perf_counter=time.perf_counter)
    monkeypatch.setattr(persist, "time", clock)  # the writer's clock only
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        handle = mgr.save(1, {"w": torch.ones(3)})
        with pytest.raises(BackgroundSaveError, match="created_unix"):
            handle.wait()
        assert mgr.steps() == []


def test_continue_run_refuses_what_a_manifest_cannot_record(tmp_path: Path) -> None:
    """A run id or a commit sequence that no manifest can hold is refused at the call (before,
    every later save was committed and unreadable)."""
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(ConfigError, match="'run' must be 1-64 ASCII letters or digits"):
            mgr.continue_run("my-run", 3)
        with pytest.raises(ConfigError, match=r"'sequence' must be an integer in \[0, 2\*\*62\]"):
            mgr.continue_run("abc", 2**63)
        mgr.continue_run("abc", 3)
        mgr.save(1, {"w": torch.ones(1)}).wait()
        state = mgr.restore()
        assert mgr.last_restore is not None and mgr.last_restore.step == 1
        assert torch.equal(state["w"], torch.ones(1))


@pytest.mark.parametrize("step", [2**63, 10**20, -1])
def test_a_step_beyond_the_readers_bound_is_refused_at_the_call(tmp_path: Path, step: int) -> None:
    """save(2**63) was reported committed, then no such step existed (its directory left
    behind): refused at the call, naming 'step' and the range; skip too; nothing written."""
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(ConfigError, match=r"'step' must be an integer in \[0, 2\*\*63-1\]"):
            mgr.save(step, {"w": torch.ones(1)})
        with pytest.raises(ConfigError, match=r"'step' must be an integer in \[0, 2\*\*63-1\]"):
            mgr.skip(step, "busy")
        assert mgr.save(2**63 - 1, {"w": torch.ones(1)}).wait().outcome == "committed"
        assert mgr.steps() == [2**63 - 1]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == [step_dir_name(2**63 - 1)]


def test_import_refuses_a_step_beyond_the_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """coci import --step 10**20 printed "imported ... as step" and exited 0, then ls listed
    nothing: now a usage error naming --step and the range; nothing is written."""
    src = tmp_path / "x.pt"
    torch.save({"w": torch.ones(2)}, src)
    assert main(["import", str(src), str(tmp_path / "ckpt"), "--step", str(10**20)]) == 2
    assert "--step" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


def test_the_legacy_stream_is_measured_pickle_by_pickle() -> None:
    """The pickles after the first are measured too (the object is the fourth)."""
    from coci_core.engine.format.torch_saved import check_saved_pickle
    from coci_core.errors import CorruptCheckpointError

    buffer = io.BytesIO()
    torch.save({"a": 1}, buffer, _use_new_zipfile_serialization=False)
    stream = io.BytesIO(buffer.getvalue())
    head = b"".join(pickle.dumps(pickle.load(stream), protocol=2) for _ in range(3))
    check_saved_pickle(buffer.getvalue(), what="x", legacy=True)
    with pytest.raises(CorruptCheckpointError, match="nests objects 200002 levels deep"):
        check_saved_pickle(head + DEEP_KEY + b"].", what="x", legacy=True)
    with pytest.raises(CorruptCheckpointError, match=r"not a torch\.save zip archive"):
        check_saved_pickle(buffer.getvalue(), what="x")


def test_a_head_field_given_twice_is_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 2's manifest forged with ``"sequence"`` given again at its end (validly sealed):
    a listing reads the head from the manifest's start and JSON keeps the last value, so the
    two would order the steps differently. The restore refuses it by name and falls back to
    step 1; ``coci verify`` names it; ``coci ls`` lists both."""
    from coci_core.engine.format.manifest import seal

    root = tmp_path / "ckpt"
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
        mgr.save(2, {"w": torch.full((3,), 2.0)}).wait()
    path = root / step_dir_name(2) / "manifest.json"
    body = path.read_bytes()
    body = body[: body.rindex(b',"checksum"')] + b',"sequence":99}'
    path.write_bytes(seal(body))
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [1, 2]
        state = mgr.restore()
        assert mgr.last_restore is not None and mgr.last_restore.step == 1
        assert mgr.last_restore.skipped_steps == (2,)
        assert torch.equal(state["w"], torch.ones(3))
    assert main(["verify", str(root)]) == 1
    assert "gives a field of its head twice" in capsys.readouterr().out
    assert main(["ls", str(root)]) == 0


@pytest.mark.parametrize("link", ["symbolic", "hard"])
@pytest.mark.parametrize("planted", [".coci-owner", "telemetry.jsonl", "telemetry.progress"])
def test_a_link_planted_for_cocis_own_file_is_not_written_through(
    tmp_path: Path, planted: str, link: str
) -> None:
    """Anyone who can write into a shared checkpoint directory plants a link where coci keeps
    its lease or its telemetry (a symbolic link, or a second name of a file of theirs): coci
    refuses it by name and the file it points to is left as it was (before: truncated and
    rewritten, or appended to)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious " * 200)
    if link == "symbolic":
        (root / planted).symlink_to(victim)
    else:
        os.link(victim, root / planted)
    said = "symbolic link" if link == "symbolic" else "2 names"
    if planted == ".coci-owner":
        with CheckpointManager(root) as mgr, pytest.raises(StorageError, match=said):
            mgr.save(1, {"w": torch.ones(3)})
    else:
        with pytest.raises(StorageError, match=f"{planted}.*{said}"):
            JsonlTelemetry(root / "telemetry.jsonl")
    assert victim.read_bytes() == b"precious " * 200
    assert (root / planted).is_symlink() == (link == "symbolic")


def test_a_fifo_planted_for_the_lease_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    os.mkfifo(root / ".coci-owner")
    with CheckpointManager(root) as mgr, pytest.raises(StorageError, match="not a regular file"):
        mgr.save(1, {"w": torch.ones(3)})
