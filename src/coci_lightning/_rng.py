"""Random states as plain values (tensors, numbers, strings, lists, dicts).

Lightning's ``_collect_rng_states`` returns numpy's state as a tuple holding an ndarray, which
``torch.load(weights_only=True)`` (torch's default) refuses. The callback's state goes into every
``.ckpt`` file the Trainer writes (``ModelCheckpoint``, ``trainer.save_checkpoint``), so it must
only hold what a weights-only load accepts.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.utilities import rank_zero_warn

from coci_core.errors import CorruptCheckpointError
from coci_core.training import check_planner_state, check_random_states

#: this rank's state in coci's saves (``per_rank``): ``{"rng": ...}``
RANK_STATE_KEY = "coci_rank_state"
#: in coci's saves (the shared state): how many ranks wrote their own (``RANK_STATE_KEY``)
RANK_STATES_KEY = "coci_rank_states"


def collect_plain_rng_states() -> dict[str, Any]:
    """This process's random states (torch, CUDA, numpy, Python), as plain values."""
    states = _collect_rng_states()
    numpy_state = states.get("numpy")
    if numpy_state is not None:
        name, keys, pos, has_gauss, cached = numpy_state
        states["numpy"] = [
            str(name),
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ]
    version, internal, gauss = states["python"]
    states["python"] = [int(version), [int(x) for x in internal], gauss]
    return states


def set_plain_rng_states(states: dict[str, Any]) -> None:
    """Restore states from :func:`collect_plain_rng_states` (or Lightning's own form)."""
    states = dict(states)
    numpy_state = states.get("numpy")
    if numpy_state is not None:
        name, keys, pos, has_gauss, cached = numpy_state
        if isinstance(keys, torch.Tensor):
            keys = keys.numpy()
        states["numpy"] = (
            str(name),
            np.asarray(keys, dtype=np.uint32),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    _set_rng_states(states)


def rng_for_rank(trainer: pl.Trainer, saved: dict[str, Any]) -> dict[str, Any]:
    """This rank's random states from a checkpoint's (per rank, or one set for every rank)."""
    per_rank = saved.get("per_rank")
    if per_rank is None:
        return saved
    if len(per_rank) != trainer.world_size:
        rank_zero_warn(
            f"coci: the checkpoint has random states of {len(per_rank)} ranks, this run has "
            f"{trainer.world_size}; every rank continues rank 0's streams"
        )
        return dict(per_rank[0])
    return dict(per_rank[trainer.global_rank])


def check_saved_rng(step: int, state: Any, rank: int | None = None) -> None:
    """This rank's random states in ``state`` (read for ``step``), if it holds any, are ones
    :func:`set_plain_rng_states` puts back: each is tried on a generator of its own (never
    the process's), inside the restore, so that a forged one (a resealed manifest) is damage
    passed over by every rank together, not Lightning's raw error on that rank alone.
    ``rank``: the rank that read it, whose own states a step that as many ranks or more
    wrote holds (``RANK_STATES_KEY``; none: not checked).

    Raises:
        CorruptCheckpointError: one is not a random state of its generator, or this rank's
            are missing.
    """
    callbacks = state.get("callbacks") if isinstance(state, dict) else None
    ours = callbacks.get("CociCheckpoint") if isinstance(callbacks, dict) else None
    if isinstance(ours, dict) and ours.get("planner") is not None:
        why = check_planner_state(ours["planner"])
        if why is not None:  # CociCheckpoint.load_state_dict would raise it from fit()
            raise CorruptCheckpointError(
                f"step {step}: coci's planner state cannot be loaded ({why[:200]})", step=step
            )
    own = state.get(RANK_STATE_KEY) if isinstance(state, dict) else None
    if own is None:
        wrote = state.get(RANK_STATES_KEY) if isinstance(state, dict) else None
        if rank is not None and type(wrote) is int and rank < wrote:
            # it would train on from its current random states, the others from theirs saved
            raise CorruptCheckpointError(
                f"step {step}: the random states of rank {rank} are missing ({wrote} ranks "
                "wrote theirs)",
                step=step,
            )
        return
    try:
        rng = own["rng"]
        version, internal, gauss = rng["python"]
        numpy = rng.get("numpy")
        if numpy is not None:
            name, keys, pos, has_gauss, cached = numpy
            keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
            numpy = (str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss))
            numpy += (float(cached),)
        check_random_states(
            python=(version, tuple(internal), gauss),
            numpy=numpy,
            torch_cpu=rng["torch"],
            # the key Lightning's _set_rng_states reads (it clones each state it is given)
            cuda=rng.get("torch.cuda"),
            # Lightning's _set_rng_states puts back whatever is there
            numpy_required="numpy" in rng,
        )
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, RuntimeError) as e:
        raise CorruptCheckpointError(
            f"step {step}: this rank's random states are not ones coci saved "
            f"({type(e).__name__}: {str(e)[:100]})",
            step=step,
        ) from None
