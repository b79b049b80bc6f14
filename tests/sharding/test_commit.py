"""The commit across ranks, with every rank's manager in this process (the real-process tests
are in test_processes.py): pieces, per-rank state, failures, timeouts, clean-up."""

from __future__ import annotations

import errno
import json
import os
import uuid
from pathlib import Path

import pytest
import torch

from coci_core import (
    BackgroundSaveError,
    CheckpointManager,
    CommitError,
    ConfigError,
    CorruptCheckpointError,
    LocalStorage,
    RankGroup,
)
from coci_core.engine.format.manifest import MANIFEST_NAME, step_dir_name
from coci_core.engine.restore.restore import load_checkpoint
from coci_core.engine.save.commit import ABORT_NAME, await_outcome
from coci_core.storage import FsspecStorage
from tests.harness.faults import FaultyStorage

CHUNK = 4096


def _state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(300, 64, generator=g),
        "w": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "flags": torch.rand(33, generator=g) > 0.5,
        "empty": torch.zeros(0, 3),
        "step": 7,
        "nested": {"b": torch.arange(10, dtype=torch.int64)[::2]},
    }


def _managers(
    path: Path, world: int, *, session: str = "s1", timeout_s: float = 30.0, **kwargs: object
) -> list[CheckpointManager]:
    return [
        CheckpointManager(
            path,
            group=RankGroup(rank, world, session, timeout_s=timeout_s),
            chunk_bytes=CHUNK,
            **kwargs,  # type: ignore[arg-type]
        )
        for rank in range(world)
    ]


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_writes_its_share_and_any_world_size_restores(
    tmp_path: Path, world: int
) -> None:
    managers = _managers(tmp_path, world)
    state = _state()
    handles = [
        m.save(5, state, per_rank={"rng": torch.full((4,), float(m.group.rank))}) for m in managers
    ]
    events = [h.wait(timeout_s=60) for h in handles]
    assert all(e.outcome == "committed" for e in events)
    manifest = managers[0].manifest(5)
    assert manifest.world_size == world
    assert [f.name for f in manifest.files] == [f"data-r{r}.bin" for r in range(world)]
    shared_by_file = {f.name: 0 for f in manifest.files}
    for entry in manifest.tensors:
        for piece in entry.pieces:
            shared_by_file[piece.file] += piece.length
    assert sum(shared_by_file.values()) == sum(e.nbytes for e in manifest.tensors)
    assert max(shared_by_file.values()) - min(shared_by_file.values()) <= CHUNK + 64 * 6
    assert len(manifest.tensors[0].pieces) > 1  # the large array is split over ranks
    # each rank restores the shared state and its own per-rank state
    for m in managers:
        restored = m.restore()
        assert _same({k: v for k, v in restored.items() if k != "rng"}, state)
        assert torch.equal(restored["rng"], torch.full((4,), float(m.group.rank)))
    # on fewer ranks (and on one, as for export): the shared state, and rank r's own state
    for rank in range(world):
        loaded = load_checkpoint(LocalStorage(tmp_path), 5, rank=rank)
        assert _same({k: v for k, v in loaded.state.items() if k != "rng"}, state)
        assert torch.equal(loaded.state["rng"], torch.full((4,), float(rank)))
    # a rank the checkpoint does not have gets no per-rank state, and is told so
    with CheckpointManager(tmp_path, group=RankGroup(world, world + 1, "s2")) as extra:
        restored = extra.restore()
        assert "rng" not in restored
        assert extra.last_restore is not None and not extra.last_restore.rank_state_restored
    for m in managers:
        m.close()
    assert not [n for n in os.listdir(tmp_path) if "coci-tmp" in n]


def test_a_rank_that_fails_to_write_aborts_the_save_on_every_rank(tmp_path: Path) -> None:
    r0, r1 = _managers(tmp_path, 2, keep_last=None)
    for m in (r0, r1):
        m.save(1, _state())
    r0.wait(timeout_s=60)
    r1.wait(timeout_s=60)
    # rank 1's disk is full on its next data file
    faulty = FaultyStorage(LocalStorage(tmp_path), fail={"write_file": [0]})
    r1.close()
    r1 = CheckpointManager(faulty, group=RankGroup(1, 2, "s1"), chunk_bytes=CHUNK)
    r1._saves = r0._saves  # the same save count on both ranks, as in a real job
    h0, h1 = r0.save(2, _state(1)), r1.save(2, _state(1))
    with pytest.raises(BackgroundSaveError) as on_r1:
        h1.wait(timeout_s=60)
    assert isinstance(on_r1.value.__cause__, OSError)
    assert on_r1.value.__cause__.errno == errno.ENOSPC
    with pytest.raises(BackgroundSaveError, match=r"rank\(s\) \[1\] failed") as on_r0:
        h0.wait(timeout_s=60)
    assert isinstance(on_r0.value.__cause__, CommitError)
    assert on_r0.value.__cause__.ranks == [1]
    assert r0.steps() == [1]  # nothing published, the previous one intact
    assert _same(r0.restore(), _state())
    for m in (r0, r1):
        m.close()  # each failure was reported once, by the handle's wait()


def test_a_rank_that_never_reports_times_out_instead_of_hanging(tmp_path: Path) -> None:
    (r0,) = _managers(tmp_path, 1)
    r0.close()
    r0 = CheckpointManager(tmp_path, group=RankGroup(0, 3, "s1", timeout_s=0.5), chunk_bytes=CHUNK)
    r1 = CheckpointManager(tmp_path, group=RankGroup(1, 3, "s1", timeout_s=0.5), chunk_bytes=CHUNK)
    h0, h1 = r0.save(3, _state()), r1.save(3, _state())  # rank 2 never saves
    with pytest.raises(BackgroundSaveError, match=r"rank\(s\) \[2\] did not report within 0.5 s"):
        h0.wait(timeout_s=30)
    with pytest.raises(BackgroundSaveError, match=r"abandoned: CommitError: rank\(s\) \[2\]"):
        h1.wait(timeout_s=30)
    assert r0.steps() == []
    leftovers = [n for n in os.listdir(tmp_path) if "coci-tmp" in n]
    assert len(leftovers) == 1 and "ABORT.json" in os.listdir(tmp_path / leftovers[0])
    r0.close()
    r1.close()


def test_ranks_that_save_different_states_do_not_commit(tmp_path: Path) -> None:
    r0, r1 = _managers(tmp_path, 2)
    h0 = r0.save(1, {"w": torch.ones(100)})
    h1 = r1.save(1, {"w": torch.ones(101)})
    with pytest.raises(BackgroundSaveError, match=r"rank\(s\) \[1\] saved a state of another"):
        h0.wait(timeout_s=30)
    with pytest.raises(BackgroundSaveError, match="abandoned"):
        h1.wait(timeout_s=30)
    assert r0.steps() == []
    r0.close()
    r1.close()


def test_another_sessions_leftovers_are_removed_but_not_this_ones(tmp_path: Path) -> None:
    stale = tmp_path / "step-0000000009.coci-tmp-deadrun-4"
    stale.mkdir()
    (stale / "rank-00001.json").write_text("{}")
    r0, r1 = _managers(tmp_path, 2)
    r0.save(10, _state())  # rank 0's first save takes the lease and removes leftovers first
    assert not stale.exists()  # a killed attempt's markers can never join this session's save
    mine = tmp_path / "step-0000000011.coci-tmp-s1-1"
    mine.mkdir()  # as if rank 1 had started the next save already
    r1.save(10, _state())
    r0.wait(timeout_s=60)
    r1.wait(timeout_s=60)
    r0.close()  # retention ran after the commit
    r1.close()
    assert mine.exists()
    assert r0.steps() == [10]


def test_only_rank_zero_deletes_old_checkpoints(tmp_path: Path) -> None:
    managers = _managers(tmp_path, 2, keep_last=1)
    for step in (1, 2, 3):
        handles = [m.save(step, _state(step)) for m in managers]
        for h in handles:
            h.wait(timeout_s=60)
    for m in managers:
        m.close()
    assert managers[0].steps() == [3]


def test_format_1_manifests_are_refused(tmp_path: Path) -> None:
    """A manifest in the layout of format 1 (one piece per array, no checksum) is refused
    naming its version: coci reads formats 3, 4 and 5 only."""
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(4, {"w": torch.arange(6.0), "n": 2}).wait()
    path = tmp_path / step_dir_name(4) / "manifest.json"
    doc = json.loads(path.read_text())
    doc["format_version"] = 1
    for t in doc["tensors"]:
        (piece,) = t.pop("pieces")
        t.update(file=piece["file"], offset=piece["offset"], nbytes=piece["nbytes"])
        t["crc32c"] = piece["crc32c"]
    doc.pop("per_rank")
    path.write_text(json.dumps(doc))
    with pytest.raises(
        CorruptCheckpointError, match="format_version 1; this coci reads formats 3, 4 and 5"
    ):
        load_checkpoint(LocalStorage(tmp_path), 4)


def test_bad_group_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'rank' must be an integer in"):
        RankGroup(2, 2, "s")
    with pytest.raises(ConfigError, match="'session' must be 1-64 letters or digits"):
        RankGroup(0, 2, "a/b")
    with pytest.raises(ConfigError, match="'on_busy' must be 'wait'"):
        CheckpointManager(tmp_path, group=RankGroup(0, 2, "s"), on_busy="skip")
    with pytest.raises(ConfigError, match="'per_rank' keys"):
        CheckpointManager(tmp_path).save(1, {"a": 1}, per_rank={"a": 2})
    with pytest.raises(ConfigError, match="'group' must be a RankGroup"):
        CheckpointManager(tmp_path, group=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["lossless", "lossy"])
def test_compressed_sharded_saves_round_trip(tmp_path: Path, mode: str) -> None:
    """Every rank encodes its own pieces (deltas against its own share of the base); the
    checkpoint restores on one rank through the base, and retention keeps the base."""
    r0, r1 = _managers(
        tmp_path, 2, keep_last=1, compression=mode, compression_options={"full_every": 4}
    )
    states = [_state(0)]
    for i in range(1, 3):
        nxt = dict(states[-1])
        nxt["emb"] = states[-1]["emb"] + 1e-3 * i  # type: ignore[operator]
        states.append(nxt)
    for step, state in enumerate(states, start=1):
        handles = [m.save(step, state) for m in (r0, r1)]
        events = [h.wait(timeout_s=60) for h in handles]
        assert all(e.outcome == "committed" for e in events)
    r0.close()
    r1.close()
    with CheckpointManager(tmp_path) as one:
        # lossless: 3 is an XOR delta of the base 1; lossy: of 2's reconstruction, itself of 1
        chain = (1,) if mode == "lossless" else (1, 2)
        assert one.steps() == [*chain, 3]
        assert one.manifest(3).bases == chain
        restored = one.restore()
    if mode == "lossless":
        assert _same(restored, states[-1])
    else:
        assert torch.allclose(restored["emb"], states[-1]["emb"], atol=1e-3)  # type: ignore[arg-type]
        assert torch.equal(restored["nested"]["b"], states[-1]["nested"]["b"])  # type: ignore[index]


def test_a_tensor_with_raw_and_compressed_pieces_restores(tmp_path: Path) -> None:
    """A chunk boundary leaves one rank a piece under 4 KiB (stored raw) and the other a large
    one (compressed): the entry is "mixed" and restores exactly."""
    w = torch.zeros(CHUNK // 4 + 256)  # rank 0: one chunk (compressed); rank 1: 1 KiB (raw)
    r0, r1 = _managers(tmp_path, 2, compression="lossless")
    for h in [m.save(1, {"w": w}) for m in (r0, r1)]:
        h.wait(timeout_s=60)
    r0.close()
    r1.close()
    with CheckpointManager(tmp_path) as one:
        (entry,) = one.manifest(1).tensors
        assert entry.codec == "mixed"
        assert {p.params["codec"] if p.params else "raw" for p in entry.pieces} == {
            "coci.zstd/1",
            "raw",
        }
        assert torch.equal(one.restore()["w"], w)
        assert one.verify() == {1: []}


def test_sharded_saves_to_storage_without_rename_commit_in_place() -> None:
    """On a storage without rename the ranks write into the step's own directory; a save that
    a rank failed leaves its abort record under that save's name only, so the next save of the
    same step commits, and the commit removes the abandoned save's objects."""
    url = f"memory://sharded-{uuid.uuid4().hex[:8]}"
    r0 = CheckpointManager(url, group=RankGroup(0, 2, "s1"), chunk_bytes=CHUNK, keep_last=None)
    faulty = FaultyStorage(FsspecStorage(url), fail={"write_file": [0]})
    r1 = CheckpointManager(faulty, group=RankGroup(1, 2, "s1"), chunk_bytes=CHUNK, keep_last=None)
    h0, h1 = r0.save(1, _state()), r1.save(1, _state())
    with pytest.raises(BackgroundSaveError):
        h1.wait(timeout_s=60)
    with pytest.raises(BackgroundSaveError, match=r"rank\(s\) \[1\] failed"):
        h0.wait(timeout_s=60)
    assert r0.steps() == []
    h0, h1 = r0.save(1, _state(1)), r1.save(1, _state(1))
    h0.wait(timeout_s=60)
    h1.wait(timeout_s=60)
    assert r0.steps() == [1]
    manifest = r0.manifest(1)
    assert manifest.world_size == 2
    assert _same(r0.restore(), _state(1))
    storage = FsspecStorage(url)
    assert sorted(storage.list_dir(step_dir_name(1))) == sorted(
        [MANIFEST_NAME, *(f.name for f in manifest.files)]
    )
    r0.close()
    r1.close()
    assert [n for n in storage.list_dir("") if ".coci-tmp-" in n] == []


def test_a_waiting_rank_whose_records_another_writer_removed_fails_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 has written its share and waits for rank 0's commit; another writer's clean-up
    removes the save's staging directory (as the holder of the directory's lease does with what
    it takes for an abandoned save): rank 1 says so at once (before: it waited twice the
    group's timeout, then blamed a silent rank 0)."""
    import shutil

    from coci_core.engine.save import commit

    real = commit.report_share

    def then_removed(storage: object, staging: str, share: object) -> None:
        real(storage, staging, share)  # type: ignore[arg-type]
        shutil.rmtree(tmp_path / staging)

    monkeypatch.setattr(commit, "report_share", then_removed)
    r1 = CheckpointManager(
        tmp_path, group=RankGroup(1, 2, "s1", timeout_s=600), chunk_bytes=CHUNK
    )  # rank 0 never commits
    with pytest.raises(BackgroundSaveError, match=r"records .* were removed before rank 0"):
        r1.save(3, _state()).wait(timeout_s=60)
    r1.close()


@pytest.mark.parametrize(
    "record",
    [b'{"ranks": [1e400], "reason": "x"}', b"[" * 100_000 + b"]" * 100_000, b'{"ranks": 5}'],
    ids=["infinite rank", "nested past the parser", "ranks not a list"],
)
def test_an_abort_record_no_coordinator_writes_is_a_commit_error(
    tmp_path: Path, record: bytes
) -> None:
    """A waiting rank reads an ``ABORT.json`` that rank 0 did not write (forged, damaged): the
    save fails with a ``CommitError`` naming the unreadable record (before: a raw
    ``OverflowError`` or ``RecursionError`` out of the rank's save)."""
    storage = LocalStorage(tmp_path)
    staging = "step-0000000001.coci-tmp-x-1"
    (tmp_path / staging).mkdir()
    (tmp_path / staging / "rank-00001.json").write_bytes(b"{}")
    (tmp_path / staging / ABORT_NAME).write_bytes(record)
    group = RankGroup(1, 2, "s", timeout_s=5)
    with pytest.raises(CommitError, match="unreadable abort record"):
        await_outcome(storage, staging, "step-0000000001", "token", group)
