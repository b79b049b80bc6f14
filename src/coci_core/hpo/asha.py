"""ASHA-style schedulers (Ray Tune's ``ASHAScheduler``) as the planner's rungs."""

from __future__ import annotations

from coci_core.errors import ConfigError
from coci_core.planner.checks import check_int
from coci_core.planner.model import AshaRungs

__all__ = ["asha_rungs"]


def asha_rungs(
    *,
    grace_period: int,
    reduction_factor: float,
    max_t: int,
    steps_per_unit: int = 1,
    brackets_offset: int = 0,
) -> AshaRungs:
    """The rungs of an ASHA scheduler, in training steps.

    Ray Tune's ``ASHAScheduler(grace_period=g, reduction_factor=eta, max_t=T)`` judges a trial
    when its time attribute reaches ``g * eta**k`` (``k = 0, 1, ...``) below ``T``, and keeps
    the best ``1/eta`` of the trials that reached that rung; at ``T`` every trial ends (that
    is the job's end, not a termination). ``brackets_offset`` is the bracket's ``s`` (its
    rungs start at ``g * eta**s``).

    Args:
        grace_period: the first rung, in units of the scheduler's time attribute.
        reduction_factor: eta (> 1).
        max_t: the time attribute's last value.
        steps_per_unit: training steps per unit of the time attribute (e.g. steps per
            epoch when the time attribute is ``training_iteration`` reported once an epoch).
        brackets_offset: the bracket's ``s`` (0: the first bracket).

    Raises:
        ConfigError: on a bad argument, or when no rung lies below ``max_t``.
    """
    check_int("grace_period", grace_period, minimum=1)
    check_int("max_t", max_t, minimum=1)
    check_int("steps_per_unit", steps_per_unit, minimum=1)
    check_int("brackets_offset", brackets_offset, minimum=0)
    if not isinstance(reduction_factor, (int, float)) or not reduction_factor > 1:
        raise ConfigError(f"'reduction_factor' must be > 1: {reduction_factor!r}")
    rungs: list[int] = []
    r = float(grace_period) * reduction_factor**brackets_offset
    while r < max_t:
        step = round(r) * steps_per_unit
        if not rungs or step > rungs[-1]:
            rungs.append(step)
        r *= reduction_factor
    if not rungs:
        raise ConfigError(
            f"no ASHA rung lies below max_t={max_t} (grace_period={grace_period}): the "
            "scheduler never stops a trial early; plan without a termination model"
        )
    return AshaRungs(rung_steps=tuple(rungs), reduction_factor=float(reduction_factor))
