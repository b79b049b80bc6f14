"""The commit across ranks, coordinated through the storage alone.

Every rank writes and syncs its data file into the shared staging directory (on a storage
without rename: the step's own directory, with the markers in a directory of the save's own,
:func:`records_dir`), then (ranks > 0) a marker ``rank-<r>.json`` naming its pieces, or
``rank-<r>.failed`` with the reason. Rank 0 waits for every marker; only when all ranks
succeeded does it write the manifest and publish.
Otherwise it writes ``ABORT.json`` naming the failed ranks, which the other ranks wait for.
No collective runs on any process group, so a killed rank costs the others a timeout, not a
hang. The waits poll the storage with a short, growing interval (a storage has no
notifications).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from coci_core.engine.format.manifest import (
    MANIFEST_NAME,
    MAX_TOKEN,
    MAX_WORLD_SIZE,
    DataFile,
    Manifest,
    Piece,
    RankState,
    RecordChecker,
    load_sealed,
    parse_step_dir,
    seal,
)
from coci_core.engine.group import RankGroup
from coci_core.engine.pulse import Watch
from coci_core.errors import CommitError, CorruptCheckpointError, StorageError
from coci_core.knobs import COMMIT_POLL_MAX_S, COMMIT_POLL_START_S
from coci_core.storage.base import staging_name

__all__ = [
    "RankShare",
    "await_outcome",
    "collect_shares",
    "fail",
    "records_dir",
    "report_share",
]

ABORT_NAME = "ABORT.json"
_T = TypeVar("_T")


def records_dir(final: str, token: str) -> str:
    """Where the ranks of one save leave their commit records when the storage writes the
    data in the step's own directory (no rename): beside it, named after the save, and
    removed with the other leftovers of uncommitted saves."""
    return staging_name(final, token)


def _share_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _failed_name(rank: int) -> str:
    return f"rank-{rank:05d}.failed"


@dataclass(frozen=True)
class RankShare:
    """What one rank wrote: its pieces of the shared arrays (by leaf index), its own state,
    its data file, and the layout digest every rank must agree on."""

    rank: int
    token: str
    layout: str
    pieces: tuple[tuple[int, Piece], ...]
    per_rank: RankState
    file: DataFile

    def with_file(self, file: DataFile) -> RankShare:
        return replace(self, file=file)

    def to_json(self) -> bytes:
        """The marker as JSON, sealed with its checksum like a manifest."""
        doc = {
            "rank": self.rank,
            "token": self.token,
            "layout": self.layout,
            "pieces": [[leaf, p.to_dict()] for leaf, p in self.pieces],
            "per_rank": self.per_rank.to_dict(),
            "file": self.file.to_dict(),
        }
        return seal(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8"))

    @classmethod
    def from_json(cls, data: bytes, *, where: str = "rank marker") -> RankShare:
        """Parse a marker, checked like a manifest (its checksum, then every field).

        Raises:
            CorruptCheckpointError: the marker is damaged, incomplete or malformed.
        """
        doc = load_sealed(data, where=where)
        c = RecordChecker(where, None)
        fields = ("rank", "token", "layout", "pieces", "per_rank", "file")
        doc = c.obj(doc, "(the document)", fields, fields)
        f = c.obj(doc["file"], "file", ("name", "nbytes"), ("name", "nbytes"))
        file = DataFile(c.file_name(f["name"], "file.name"), c.int_(f["nbytes"], "file.nbytes"))
        files = {file.name: file.nbytes}
        pieces = []
        for i, pair in enumerate(c.list_(doc["pieces"], "pieces")):
            if type(pair) is not list or len(pair) != 2:
                c.fail(f"pieces[{i}]", "must be a pair [array, piece]")
            piece = c.piece(pair[1], f"pieces[{i}][1]")
            if piece.file != file.name or piece.offset + piece.nbytes > file.nbytes:
                c.fail(f"pieces[{i}][1]", f"is not within {file.name} ({file.nbytes} bytes)")
            pieces.append((c.int_(pair[0], f"pieces[{i}][0]"), piece))
        rank_state = c.obj(doc["per_rank"], "per_rank", ("tree", "tensors"), ("tree", "tensors"))
        own = c.entries(rank_state["tensors"], "per_rank.tensors", files)
        if rank_state["tree"] is not None or own:
            c.tree(rank_state["tree"], "per_rank.tree", own, root=True)
        return cls(
            rank=c.int_(doc["rank"], "rank", 0, MAX_WORLD_SIZE - 1),
            token=c.str_(doc["token"], "token", MAX_TOKEN),
            layout=c.str_(doc["layout"], "layout", MAX_TOKEN),
            pieces=tuple(pieces),
            per_rank=RankState(tree=rank_state["tree"], tensors=own),
            file=file,
        )


def _poll(check: Callable[[], _T | None], timeout_s: float) -> _T | None:
    deadline = time.monotonic() + timeout_s
    delay = COMMIT_POLL_START_S
    while True:
        result = check()
        if result is not None:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(delay, left))
        delay = min(delay * 2, COMMIT_POLL_MAX_S)


def _read_text(storage: Any, path: str) -> str:
    try:
        return bytes(storage.read_bytes(path)).decode("utf-8", "replace")
    except StorageError as e:
        return f"(unreadable: {e})"


def report_share(storage: Any, staging: str, share: RankShare) -> None:
    """Tell the coordinator that this rank's data file is durable (ranks > 0)."""
    storage.write_file(f"{staging}/{_share_name(share.rank)}", [memoryview(share.to_json())])


def collect_shares(
    storage: Any, staging: str, own: RankShare, group: RankGroup, watch: Watch | None = None
) -> list[RankShare]:
    """Every rank's share, in rank order, once all have reported (the coordinator).
    ``watch``: the ranks' signs of life (a rank gone silent fails the save at once).

    Raises:
        CommitError: a rank reported a failure, went silent, did not report within
            ``group.timeout_s``, or saved a state of another layout.
    """
    shares: dict[int, RankShare] = {0: own}
    failed: dict[int, str] = {}
    silent: list[int] = []
    pending = set(range(1, group.world_size))

    def check() -> bool | None:
        for rank in sorted(pending):
            if storage.exists(f"{staging}/{_failed_name(rank)}"):
                failed[rank] = _read_text(storage, f"{staging}/{_failed_name(rank)}")
                pending.discard(rank)
            elif storage.exists(f"{staging}/{_share_name(rank)}"):
                try:
                    share = RankShare.from_json(
                        storage.read_bytes(f"{staging}/{_share_name(rank)}")
                    )
                except (ValueError, KeyError, TypeError, CorruptCheckpointError, StorageError):
                    continue  # still being written: read it again on the next poll
                shares[rank] = share
                pending.discard(rank)
        if pending and not failed and watch is not None:
            silent.extend(watch.silent(sorted(pending)))
        return True if failed or silent or not pending else None

    _poll(check, group.timeout_s)
    if failed:
        reasons = "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
        raise CommitError(f"rank(s) {sorted(failed)} failed: {reasons}", ranks=sorted(failed))
    if silent:
        raise CommitError(
            f"rank(s) {silent} stopped giving signs of life before writing their share "
            "(killed, or their node lost): nothing was published",
            ranks=silent,
        )
    if pending:
        raise CommitError(
            f"rank(s) {sorted(pending)} did not report within {group.timeout_s:g} s "
            "(killed, hung or much slower)",
            ranks=sorted(pending),
        )
    strangers = [r for r, s in shares.items() if s.layout != own.layout or s.token != own.token]
    if strangers:
        reordered = [r for r in strangers if _same_keys(shares[r].layout, own.layout)]
        why = (
            f"; rank(s) {reordered} hold the same keys in another order: build the shared "
            "state's dicts in the same order on every rank (not from a set, whose order "
            "differs between processes)"
            if reordered
            else ""
        )
        raise CommitError(
            f"rank(s) {strangers} saved a state of another layout than rank 0 (every rank "
            f"must pass the same shared state){why}",
            ranks=strangers,
        )
    return [shares[r] for r in range(group.world_size)]


def _same_keys(layout: str, other: str) -> bool:
    """Whether two layout digests (see ``save_inputs.layout_digest``) differ only in the order
    of the keys."""
    a, b = layout.partition("-")[2], other.partition("-")[2]
    return bool(a) and a == b


def pieces_by_leaf(shares: Sequence[RankShare], n_leaves: int) -> list[list[Piece]]:
    """Every rank's pieces of each shared leaf."""
    out: list[list[Piece]] = [[] for _ in range(n_leaves)]
    for share in shares:
        for leaf, piece in share.pieces:
            if not 0 <= leaf < n_leaves:
                raise CommitError(
                    f"rank {share.rank} wrote a piece of array {leaf}, the state has {n_leaves}",
                    ranks=[share.rank],
                )
            out[leaf].append(piece)
    return out


def await_outcome(
    storage: Any,
    staging: str,
    final: str,
    token: str,
    group: RankGroup,
    watch: Watch | None = None,
) -> None:
    """Wait until the coordinator published this save or gave it up (ranks > 0). ``watch``:
    the ranks' signs of life (a coordinator gone silent fails the save at once).

    Raises:
        CommitError: the coordinator aborted the save (naming the failed ranks), went silent,
            or did not decide within twice ``group.timeout_s``.
    """
    manifest_path = f"{final}/{MANIFEST_NAME}"
    own_marker = f"{staging}/{_share_name(group.rank)}"

    def committed() -> bool:
        if storage.exists(manifest_path):
            try:
                return Manifest.from_json(storage.read_bytes(manifest_path)).token == token
            except (CorruptCheckpointError, StorageError):
                return False
        return False

    def check() -> str | None:
        if storage.exists(f"{staging}/{ABORT_NAME}"):
            return "abort"
        if committed():
            return "committed"
        if not storage.exists(own_marker):
            # moved by the commit (a rename) just now, or removed by another writer's
            # clean-up of what it took for an abandoned save: then nobody will commit it
            return "committed" if committed() else "removed"
        if watch is not None and watch.silent([0]):
            return "silent"
        return None

    outcome = _poll(check, 2 * group.timeout_s)
    if outcome == "committed":
        return
    if outcome == "removed":
        raise CommitError(
            f"this save's records ({staging}) were removed before rank 0 committed it: another "
            f"writer cleaned them up (is another job writing to {storage.url}?)",
            ranks=[0],
        )
    if outcome == "silent":
        raise CommitError(
            "rank 0 (the coordinator) stopped giving signs of life before committing this "
            "save (killed, or its node lost): nothing was published",
            ranks=[0],
        )
    if outcome == "abort":
        try:
            doc = json.loads(storage.read_bytes(f"{staging}/{ABORT_NAME}"))
            ranks, reason = [int(r) for r in doc["ranks"]], str(doc["reason"])
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError, StorageError) as e:
            ranks, reason = [0], f"unreadable abort record: {type(e).__name__}: {str(e)[:200]}"
        raise CommitError(f"the save was abandoned: {reason}", ranks=ranks)
    raise CommitError(
        f"rank 0 (the coordinator) did not commit within {2 * group.timeout_s:g} s", ranks=[0]
    )


def fail(storage: Any, staging: str, group: RankGroup, error: BaseException) -> None:
    """Record this rank's failure where the others look for it (best effort).

    One rank alone removes its staging directory. The coordinator of several writes
    ``ABORT.json`` and leaves the directory to a later clean-up (the other ranks read it);
    another rank writes ``rank-<r>.failed`` unless the save was already abandoned.
    """
    try:
        if group.world_size == 1:
            # A storage that writes in place (no rename) stages in the step's own directory:
            # when an earlier save of that step is committed there, its files stay (this
            # save's are named after it, and the next commit of the step removes them).
            in_place = parse_step_dir(staging) is not None
            if not (in_place and storage.exists(f"{staging}/{MANIFEST_NAME}")):
                storage.remove_dir(staging)
        elif group.is_coordinator:
            ranks = error.ranks if isinstance(error, CommitError) else [0]
            doc = {"ranks": ranks, "reason": f"{type(error).__name__}: {error}"}
            storage.write_file(f"{staging}/{ABORT_NAME}", [memoryview(json.dumps(doc).encode())])
        elif not isinstance(error, CommitError):
            reason = f"{type(error).__name__}: {error}".encode()
            storage.write_file(f"{staging}/{_failed_name(group.rank)}", [memoryview(reason)])
    except Exception:  # the original error is what the caller reports
        pass
