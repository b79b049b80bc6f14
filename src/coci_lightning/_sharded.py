"""Strategies whose model and optimizer state is sharded over the ranks: ``ModelParallelStrategy``
(FSDP2's ``fully_shard``, tensor parallelism, 2-D meshes) and ``FSDPStrategy`` (FSDP1).

**Saving.** coci takes every rank's own shards, as DTensors, from
``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` and
``get_optimizer_state_dict``, sharded, without a CPU copy by Lightning), whatever the strategy's
setting for its own files (``save_distributed_checkpoint=False`` or ``state_dict_type="full"``
would gather the whole state on rank 0): each rank then writes the bytes it holds, replicas
split between the ranks holding them.

**Loading.** These strategies read checkpoints themselves (their ``load_checkpoint``, not their
CheckpointIO), after the model is sharded and the optimizers made. For a coci step directory
coci reads the model's and the optimizers' shards in place into the live sharded state (on any
mesh: each rank reads only the boxes it holds) and hands them to ``set_model_state_dict`` and
``set_optimizer_state_dict``; Lightning restores the rest (loops, schedulers, callbacks) from
what it returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy

from coci_core.errors import ConfigError


class _CociReader(Protocol):
    """What the sharded load needs of :class:`~coci_lightning._io.CociCheckpointIO`."""

    def is_coci(self, path: Any) -> bool: ...

    def read(
        self,
        path: Any,
        live: Mapping[str, Any] | None,
        replaced: Iterable[tuple[Any, ...]] = (),
        *,
        partial: bool = False,
    ) -> dict[str, Any]: ...


__all__ = ["check_sharded", "is_sharded", "sharded_state", "use_sharded_load"]

_ORIGINAL_LOAD = "_coci_original_load_checkpoint"


def is_sharded(strategy: Strategy) -> bool:
    """Whether ``strategy`` holds the model and optimizer state sharded over its ranks."""
    return isinstance(strategy, (ModelParallelStrategy, FSDPStrategy))


def check_sharded(strategy: Strategy) -> None:
    """Refuse a strategy whose sharded state coci cannot store.

    Raises:
        ConfigError: an ``FSDPStrategy`` without a ``device_mesh`` (FSDP1 then gives its
            shards as ``ShardedTensor``, not DTensors).
    """
    if isinstance(strategy, FSDPStrategy) and strategy.kwargs.get("device_mesh") is None:
        raise ConfigError(
            "CociCheckpoint with FSDPStrategy needs FSDPStrategy(device_mesh=...): without a "
            "device mesh FSDP gives its sharded state as ShardedTensor, which coci does not "
            "store (with one, as DTensors). E.g. FSDPStrategy(sharding_strategy='HYBRID_SHARD', "
            "device_mesh=(num_nodes, devices_per_node)), or ModelParallelStrategy with "
            "fully_shard in configure_model"
        )


def _raw(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's optimizer


@contextlib.contextmanager
def sharded_state(strategy: Strategy) -> Iterator[None]:
    """While it is open, Lightning's ``dump_checkpoint`` takes the sharded state: each rank's
    own shards of the model and of each optimizer (no gather, no copy)."""
    if not is_sharded(strategy):
        yield
        return
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = strategy.model
    assert model is not None
    # instance attributes shadow the strategy's methods for the one dump
    vars(strategy)["lightning_module_state_dict"] = lambda: get_model_state_dict(model)
    vars(strategy)["optimizer_state"] = lambda optimizer: get_optimizer_state_dict(
        model, _raw(optimizer)
    )
    try:
        yield
    finally:
        vars(strategy).pop("lightning_module_state_dict", None)
        vars(strategy).pop("optimizer_state", None)


def use_sharded_load(strategy: Strategy, io: _CociReader) -> None:
    """Make ``strategy.load_checkpoint`` read coci step directories into the live sharded state
    (once; anything else goes to the strategy's own reader)."""
    if not is_sharded(strategy) or _ORIGINAL_LOAD in vars(strategy):
        return
    original = strategy.load_checkpoint

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if not io.is_coci(checkpoint_path):
            return original(checkpoint_path, weights_only=weights_only)
        return _load_sharded(strategy, io, checkpoint_path)

    vars(strategy)[_ORIGINAL_LOAD] = original
    vars(strategy)["load_checkpoint"] = load_checkpoint


def _load_sharded(strategy: Strategy, io: _CociReader, path: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = strategy.model
    assert model is not None
    assert strategy.lightning_module is not None
    optimizers = [_raw(o) for o in strategy.optimizers]
    # the live shards (an optimizer's state is made by a step with zero lr if it has none yet)
    live = {
        "state_dict": get_model_state_dict(model),
        "optimizer_states": [get_optimizer_state_dict(model, o) for o in optimizers],
    }
    strict = strategy.lightning_module.strict_loading
    checkpoint = io.read(path, live, replaced=[("optimizer_states",)], partial=not strict)
    set_model_state_dict(model, checkpoint["state_dict"], options=StateDictOptions(strict=strict))
    saved = checkpoint.get("optimizer_states", [])
    if optimizers and len(saved) != len(optimizers):
        raise ValueError(
            f"the coci checkpoint {path} holds the state of {len(saved)} optimizer(s); the "
            f"module configures {len(optimizers)}"
        )
    for optimizer, state in zip(optimizers, saved[: len(optimizers)], strict=True):
        set_optimizer_state_dict(model, optimizer, state)
    return checkpoint
