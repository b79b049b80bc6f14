"""Whether saved random states are ones their generators take back, before they are put back.

Each adapter saves every process's random states (Python's, NumPy's, torch's CPU generator and
CUDA's) under names of its own and puts them back with its framework's setter
(``random.setstate``, ``numpy.random.set_state``, ``torch.set_rng_state``), which raises its
own error on a forged value, on the forged process only. :func:`check_random_states` tries each
on a generator of its own (never the process's), so that an adapter can call it inside the
restore and have a forged state passed over as damage by every process together.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["UnfitRandomState", "check_random_states", "check_saved_random_states"]

_MAX_INT = 2**63 - 1


class UnfitRandomState(ValueError):
    """A saved random state is not one its generator takes (the message says which)."""


def check_random_states(
    *, python: Any, numpy: Any, torch_cpu: Any, cuda: Any = None, numpy_required: bool = True
) -> None:
    """Python's (``random.getstate()``'s tuple), NumPy's (``numpy.random.get_state()``'s tuple;
    None is allowed unless ``numpy_required``), torch's CPU generator's (a byte tensor) and,
    unless None, CUDA's (a list of byte tensors) saved random states are each of their form and
    taken by a generator of their own.

    Raises:
        UnfitRandomState: one is not; the message names which ("Python random state ...").
    """
    if (
        not isinstance(python, tuple)
        or len(python) != 3
        or python[0] != 3
        or not isinstance(python[1], tuple)
        or not all(type(v) is int for v in python[1])
        or not (python[2] is None or type(python[2]) is float)
    ):
        raise UnfitRandomState("Python random state is not random.getstate()'s")
    try:
        random.Random().setstate(python)
    except (TypeError, ValueError, OverflowError) as e:
        raise UnfitRandomState(f"Python random state: {e}") from None
    if numpy is None and not numpy_required:
        pass
    elif (
        not isinstance(numpy, tuple)
        or len(numpy) != 5
        or numpy[0] != "MT19937"
        or not isinstance(numpy[1], np.ndarray)
        or numpy[1].dtype != np.uint32
        or numpy[1].shape != (624,)
        or not _int(numpy[2])
        or not _int(numpy[3])
        or not _float(numpy[4])
    ):
        raise UnfitRandomState("NumPy random state is not numpy.random.get_state()'s")
    else:
        try:
            np.random.RandomState().set_state(numpy)
        except (TypeError, ValueError, KeyError, IndexError, OverflowError) as e:
            raise UnfitRandomState(f"NumPy random state: {e}") from None
    if not _byte_tensor(torch_cpu):
        raise UnfitRandomState("torch random state is not a byte tensor")
    try:
        torch.Generator().set_state(torch_cpu)
    except (RuntimeError, TypeError, ValueError) as e:
        raise UnfitRandomState(f"torch random state: {str(e)[:100]}") from None
    if cuda is not None and (
        not isinstance(cuda, (list, tuple)) or not all(_byte_tensor(t) for t in cuda)
    ):
        raise UnfitRandomState("CUDA random states are not a list of byte tensors")


def _int(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _MAX_INT


def _float(value: Any) -> bool:
    return type(value) in (int, float)


def _byte_tensor(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.uint8
        and value.dim() == 1
        and value.device.type == "cpu"
    )


def check_saved_random_states(rng: Any, *, torch_key: str) -> None:
    """:func:`check_random_states` of the dict an adapter saves: ``python``, ``numpy`` and
    ``cuda`` under those keys, torch's CPU generator's under ``torch_key``.

    Raises:
        UnfitRandomState: ``rng`` is not a dict, or one of its states is not of its form.
    """
    if not isinstance(rng, dict):
        raise UnfitRandomState("random states are not a dict")
    check_random_states(
        python=rng.get("python"),
        numpy=rng.get("numpy"),
        torch_cpu=rng.get(torch_key),
        cuda=rng.get("cuda"),
    )
