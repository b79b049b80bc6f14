"""One rank of a data-parallel digits job that saves with every rank writing its share.

Run by ``launch`` as ``python -m tests.sharding._dist_child JSON`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. The job resumes from the newest checkpoint, trains until
``stop_step`` (or the end of epoch 0), saving every ``every`` steps, and prints ``RESULT
<json>``: the samples it took per step, digests of its per-rank random state at each save and
after the restore, and the model's digest. With ``pause_rank``/``pause_step`` that rank stops in
the middle of writing its data file of that step and prints ``PAUSED``; the others wait for the
save and report its error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from coci_core import (
    BackgroundSaveError,
    CheckpointError,
    CheckpointManager,
    ConfigError,
    FsspecStorage,
    GlobalSampler,
    LocalStorage,
    NoCheckpointError,
    RankGroup,
    UnsupportedValueError,
)
from tests.harness import processes
from tests.harness.processes import Child, free_port, rank_env

SAMPLES, BATCH = 1536, 16


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def model_digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(
        "".join(digest(v) for v in model.state_dict().values()).encode()
    ).hexdigest()


class _PausingStorage(LocalStorage):
    def __init__(self, root: str, step: int) -> None:
        super().__init__(root)
        self._dir = f"step-{step:010d}"

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        if path.startswith(self._dir) and path.endswith(".bin"):
            first = next(iter(chunks))
            super().write_file(path, [first[: len(first) // 2]])
            print("PAUSED", flush=True)
            os.read(sys.stdin.fileno(), 1)  # the parent never writes: wait for SIGKILL
            raise SystemExit("not killed")
        return super().write_file(path, chunks, aligned=aligned)


class _PausingFsspec(FsspecStorage):
    """An object store whose writer stops half-way through the data file of ``step``."""

    def __init__(self, url: str, step: int, **options: Any) -> None:
        super().__init__(url, **options)
        self._dir = f"step-{step:010d}/"

    def write_file(self, path: str, chunks: Iterable[memoryview], *, aligned: bool = False) -> int:
        if path.startswith(self._dir) and path.endswith(".bin"):
            return super().write_file(path, self._pause_after_first(chunks), aligned=aligned)
        return super().write_file(path, chunks, aligned=aligned)

    @staticmethod
    def _pause_after_first(chunks: Iterable[memoryview]) -> Iterator[memoryview]:
        it = iter(chunks)
        yield next(it)  # the upload has begun
        print("PAUSED", flush=True)
        os.read(sys.stdin.fileno(), 1)  # the parent never writes: wait for SIGKILL
        raise SystemExit("not killed")


def _storage(cfg: dict[str, Any], rank: int) -> Any:
    pausing = cfg.get("pause_rank") == rank
    if "url" in cfg:
        options = cfg.get("storage_options", {})
        if pausing:
            return _PausingFsspec(cfg["url"], cfg["pause_step"], **options)
        return FsspecStorage(cfg["url"], **options)
    directory = cfg["dir"].replace("{rank}", str(rank))  # "{rank}": a disk of each node's own
    return _PausingStorage(directory, cfg["pause_step"]) if pausing else LocalStorage(directory)


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data[:SAMPLES], dtype=torch.float32) / 16
    y = torch.tensor(data.target[:SAMPLES])
    dataset = TensorDataset(torch.arange(SAMPLES), x, y)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = GlobalSampler(dataset, seed=5)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    torch.manual_seed(100 + rank)  # per-rank random streams
    group = RankGroup.from_torch_distributed(timeout_s=cfg.get("timeout_s", 60.0))
    mgr = CheckpointManager(
        _storage(cfg, rank),
        keep_last=cfg.get("keep_last"),
        group=group,
        chunk_bytes=64 * 1024,
        compression=cfg.get("compression", "auto"),
        remote=cfg.get("remote"),
        remote_storage_options=cfg.get("storage_options") if cfg.get("remote") else None,
    )
    out: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "steps": {},
        "rng_at_save": {},
        "model_at_save": {},
    }
    step = 0
    try:
        state = mgr.restore(into={"model": model, "optim": optimizer, "sampler": sampler})
        step = int(state["step"])
        out["restored_step"] = step
        out["restored_tier"] = mgr.last_restore.tier if mgr.last_restore else None
        if "rng" in state:
            torch.set_rng_state(state["rng"])
            out["restored_rng"] = digest(state["rng"])
    except NoCheckpointError:
        out["restored_step"] = None
    sampler.set_epoch(0)
    for ids, xb, yb in loader:
        torch.rand(3)  # advances this rank's random stream
        loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        step += 1
        out["steps"][step] = ids.tolist()
        if step % cfg["every"] == 0:
            rng = torch.get_rng_state()
            out["rng_at_save"][step] = digest(rng)
            out["model_at_save"][step] = model_digest(model)
            state = {
                "model": model.state_dict(),
                "optim": optimizer.state_dict(),
                "sampler": sampler.state_dict(),
                "step": step,
            }
            if rank == cfg.get("bad_rank"):
                state["extra"] = object()  # refused by this rank's input checks only
            try:
                mgr.save(step, state, per_rank={"rng": rng})
            except (ConfigError, CheckpointError, UnsupportedValueError) as e:
                out["save_error"] = str(e)
                mgr.close()
                return out
            if step == cfg.get("pause_step"):
                try:
                    mgr.wait()
                except BackgroundSaveError as e:
                    out["save_error"] = f"{e} <- {e.__cause__}"
                    mgr.close()
                    return out
        if step == cfg.get("stop_step"):
            break
    mgr.close()
    out["model"] = model_digest(model)
    dist.barrier()
    return out


def launch(
    world: int,
    cfg: dict[str, Any],
    *,
    kill_rank: int | None = None,
    timeout_s: float = 240,
    module: str = "tests.sharding._dist_child",
) -> list[tuple[int, dict[str, Any] | None]]:
    """Run ``world`` ranks of ``module``; SIGKILL ``kill_rank`` when it says PAUSED. Exit codes
    and results."""
    port = free_port()
    command = processes.module(module, json.dumps(cfg))
    results: dict[int, tuple[int, dict[str, Any] | None]] = {}
    order = sorted(range(world), key=lambda r: r != kill_rank)  # the rank to kill first
    with contextlib.ExitStack() as stack:
        ranks = [
            stack.enter_context(Child(command, env=rank_env(rank, world, port)))
            for rank in range(world)
        ]
        for rank in order:
            result = None
            for line in ranks[rank].lines():
                if line.startswith("PAUSED") and rank == kill_rank:
                    ranks[rank].kill()
                elif line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT ") :])
            results[rank] = (ranks[rank].wait(timeout_s), result)
    return [results[r] for r in range(world)]


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
