"""One rank of the standard 2-D recipe: tensor parallelism on some layers
(``parallelize_module`` over ``mesh["tp"]``), then FSDP2 over ``mesh["dp"]`` for the whole model,
so that the layers that are not tensor-parallel (an embedding, a norm, a head) hold DTensors of
the ``dp`` sub-mesh, one copy per ``tp`` rank; AdamW; checkpointed with coci through
``get_state_dict`` / ``set_state_dict``.

Trains on ``cfg["mesh"]``, resuming from ``cfg["dir"]`` when it has a checkpoint (``AT
<step>`` after each step; the digests of the full state at each save). Then, with
``cfg["check"]``: restore its ``step`` of its ``dir`` onto each mesh of its ``meshes``, load
the DCP export ``dcp`` with DCP, restore with ``into=`` objects given in another key order on
odd ranks, and restore into targets the checkpoint does not match. Prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from coci_core import CheckpointManager, RankGroup
from coci_core.engine.restore.inplace import InPlaceTargets
from coci_core.errors import CociError
from tests.harness.states import full_digest


class Net(torch.nn.Module):
    """An MLP block between layers that are not tensor-parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 16)  # 10 rows: uneven over 4
        self.up = torch.nn.Linear(16, 36)
        self.down = torch.nn.Linear(36, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 6)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(self.norm(h))


def build(mesh_shape: list[int]) -> tuple[Net, torch.optim.Optimizer, int]:
    """The model on a ``(dp, tp)`` mesh (``(dp,)``: FSDP2 alone), AdamW, the dp index."""
    torch.manual_seed(0)
    model = Net()
    if len(mesh_shape) == 2:
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("dp",))
    fully_shard(model, mesh=dp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, dp_mesh.get_local_rank()


def digests(model: Net, optimizer: torch.optim.Optimizer) -> list[str]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return [full_digest(model_sd), full_digest(optim_sd)]


def _train(cfg: dict[str, Any]) -> dict[str, Any]:
    model, optimizer, dp = build(cfg["mesh"])
    mgr = CheckpointManager(cfg["dir"], group=RankGroup.from_torch_distributed())
    start = 0
    if mgr.latest_step() is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = mgr.restore(targets=InPlaceTargets({"model": model_sd, "optim": optim_sd}))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        start = state["step"]
    saved = {}
    for step in range(start, cfg["steps"]):
        g = torch.Generator().manual_seed(1000 * step + dp)
        idx, y = torch.randint(0, 10, (4, 5), generator=g), torch.randn(4, 5, 6, generator=g)
        torch.nn.functional.mse_loss(model(idx), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % cfg["every"] == 0:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            mgr.save(step + 1, {"model": model_sd, "optim": optim_sd, "step": step + 1})
            saved[step + 1] = digests(model, optimizer)
        print(f"AT {step + 1}", flush=True)
    mgr.close()
    return {"start": start, "final": digests(model, optimizer), "saved": saved}


class _Collective:
    """An object whose ``load_state_dict`` runs collectives (``set_model_state_dict`` and
    ``set_optimizer_state_dict`` may): every rank must load the same key at the same time."""

    def __init__(self, key: str, load: Any) -> None:
        self.key, self.load = key, load

    def load_state_dict(self, state: Any) -> None:
        keys: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(keys, self.key)
        if len(set(keys)) != 1:
            raise RuntimeError(f"the ranks load {keys} at the same time")
        self.load(state)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _check(cfg: dict[str, Any]) -> dict[str, Any]:
    mgr = CheckpointManager(cfg["dir"], group=RankGroup.from_torch_distributed())
    out: dict[str, Any] = {"meshes": [], "step": cfg["step"]}
    for mesh in cfg["meshes"]:
        model, optimizer, _ = build(mesh)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = mgr.restore(
            cfg["step"], targets=InPlaceTargets({"model": model_sd, "optim": optim_sd})
        )
        in_place = all(state["model"][k] is v for k, v in model_sd.items())
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        out["meshes"].append({"digests": digests(model, optimizer), "in_place": in_place})

    # the export loaded by DCP itself, onto FSDP2 over the 4 ranks
    import torch.distributed.checkpoint as dcp

    model, optimizer, _ = build([4])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp_state = {"model": model_sd, "optim": optim_sd}
    dcp.load(dcp_state, checkpoint_id=cfg["dcp"])
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    out["dcp"] = digests(model, optimizer)

    # into= objects given in another order on odd ranks, whose load_state_dict runs collectives
    model, optimizer, _ = build(cfg["meshes"][0])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    into = {
        "model": _Collective("model", lambda sd: set_model_state_dict(model, sd)),
        "optim": _Collective("optim", lambda sd: set_optimizer_state_dict(model, optimizer, sd)),
    }
    if dist.get_rank() % 2:
        into = dict(reversed(into.items()))
    try:
        mgr.restore(
            cfg["step"],
            into=into,
            targets=InPlaceTargets({"model": model_sd, "optim": optim_sd}),
        )
        out["key_order"] = digests(model, optimizer)
    except Exception as e:
        out["key_order"] = _error(e)

    # targets the checkpoint does not match: a key it lacks, a shape it does not have
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, optimizer, _ = build([dist.get_world_size()])
    model_sd = dict(get_state_dict(model, optimizer)[0])
    model_sd["extra.weight"] = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
    before = model_sd["head.weight"].to_local().clone()
    out["missing"] = _refused(mgr, cfg["step"], model_sd)
    out["untouched"] = bool(torch.equal(model_sd["head.weight"].to_local(), before))
    state = mgr.restore(cfg["step"], targets=InPlaceTargets({"model": model_sd}), partial=True)
    out["partial"] = bool(
        state["model"]["head.weight"] is model_sd["head.weight"]
        and torch.equal(model_sd["extra.weight"].full_tensor(), torch.zeros(4, 3))
    )
    del model_sd["extra.weight"]
    model_sd["head.weight"] = distribute_tensor(torch.zeros(7, 16), mesh, [Shard(0)])
    out["shape"] = _refused(mgr, cfg["step"], model_sd)
    mgr.close()
    return out


def _refused(mgr: CheckpointManager, step: int, model_sd: dict[str, DTensor]) -> str:
    try:
        mgr.restore(step, targets=InPlaceTargets({"model": model_sd}))
    except CociError as e:
        return _error(e)
    return "restored"


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = _train(cfg)
    if "check" in cfg:
        out["check"] = _check(cfg["check"])
    out["rank"] = dist.get_rank()
    dist.barrier()
    return out


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)
