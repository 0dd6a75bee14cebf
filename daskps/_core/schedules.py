"""Learning-rate schedules: a learning rate as a function of the step, in numpy.

Each schedule is a small frozen dataclass with ``__call__(step) -> float``:
it pickles with the optimizer's transform, so a parameter server evaluates
it beside the variable, at that variable's step (the number of updates it
has had before this one; Keras' ``iterations`` when every step updates every
variable). The formulas are Keras 3's for the schedule of the same name and
arguments; they are evaluated in float64 (Keras: float32), and the optimizer
rounds the rate to the variable's dtype.

>>> ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)(20)
0.025
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "CosineDecay",
    "ExponentialDecay",
    "InverseTimeDecay",
    "LearningRateSchedule",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
]

_F = np.float64


def _number(value: Any, arg: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{arg} must be a number, got {value!r}")
    return float(value)


def _non_negative(value: Any, arg: str) -> float:
    if _number(value, arg) < 0:
        raise ValueError(f"{arg} must be >= 0, got {value!r}")
    return float(value)


def _steps(value: Any, arg: str) -> float:
    if _number(value, arg) <= 0:
        raise ValueError(f"{arg} must be > 0, got {value!r}")
    return float(value)


class LearningRateSchedule:
    """Base class: a learning rate that depends on the step.

    Subclasses implement ``__call__(step)``, returning the rate for a
    variable's ``step``-th update (counted from 0), and must pickle: the
    schedule travels to the parameter servers inside the optimizer. The
    frozen dataclasses below declare their arguments' checks once, in
    ``CHECKS`` (field -> check), run when one is made, and their
    ``get_config()`` is their fields, as Keras'.
    """

    CHECKS: dict[str, Any] = {}

    def __post_init__(self) -> None:
        for field, check in self.CHECKS.items():
            check(getattr(self, field), field)

    def __call__(self, step: int) -> float:
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


def _exponent(step: int, decay_steps: float, staircase: bool) -> Any:
    """``step / decay_steps``, rounded down with ``staircase``."""
    p = _F(step) / _F(decay_steps)
    return np.floor(p) if staircase else p


_DECAY = {"initial_learning_rate": _number, "decay_steps": _steps, "decay_rate": _number}


@dataclasses.dataclass(frozen=True)
class ExponentialDecay(LearningRateSchedule):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)``, as Keras'.

    With ``staircase``, the exponent is rounded down (the rate changes every
    ``decay_steps`` steps).

    >>> s = ExponentialDecay(1.0, decay_steps=2, decay_rate=0.5, staircase=True)
    >>> [s(k) for k in range(4)]
    [1.0, 1.0, 0.5, 0.5]
    """

    initial_learning_rate: float
    decay_steps: float
    decay_rate: float
    staircase: bool = False
    name: str = "ExponentialDecay"
    CHECKS = _DECAY

    def __call__(self, step: int) -> float:
        p = _exponent(step, self.decay_steps, self.staircase)
        return float(_F(self.initial_learning_rate) * np.power(_F(self.decay_rate), p))


@dataclasses.dataclass(frozen=True)
class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[0]`` up to and including ``boundaries[0]``, ``values[1]`` up to ``boundaries[1]``, ...

    >>> s = PiecewiseConstantDecay([2, 4], [1.0, 0.5, 0.1])
    >>> [s(k) for k in (0, 2, 3, 4, 5)]
    [1.0, 1.0, 0.5, 0.5, 0.1]
    """

    boundaries: Sequence[float]
    values: Sequence[float]
    name: str = "PiecewiseConstant"

    def __post_init__(self) -> None:  # (its own checks: two sequences)
        if len(self.boundaries) != len(self.values) - 1:
            raise ValueError(
                f"boundaries must have one item fewer than values, got {len(self.boundaries)} boundaries "
                f"and {len(self.values)} values"
            )
        for b in self.boundaries:
            _number(b, "boundaries")
        for v in self.values:
            _number(v, "values")
        object.__setattr__(self, "boundaries", tuple(self.boundaries))  # hashable and immutable
        object.__setattr__(self, "values", tuple(self.values))

    def __call__(self, step: int) -> float:
        for boundary, value in zip(self.boundaries, self.values):
            if step <= boundary:
                return float(_F(value))
        return float(_F(self.values[-1]))


@dataclasses.dataclass(frozen=True)
class PolynomialDecay(LearningRateSchedule):
    """From ``initial_learning_rate`` to ``end_learning_rate`` in ``decay_steps``, along ``(1 - p) ** power``.

    After ``decay_steps`` the rate stays at ``end_learning_rate``; with
    ``cycle``, the decay restarts over the next multiple of ``decay_steps``.

    >>> s = PolynomialDecay(1.0, decay_steps=4, end_learning_rate=0.0)
    >>> [s(k) for k in (0, 2, 4, 8)]
    [1.0, 0.5, 0.0, 0.0]
    """

    initial_learning_rate: float
    decay_steps: float
    end_learning_rate: float = 0.0001
    power: float = 1.0
    cycle: bool = False
    name: str = "PolynomialDecay"
    CHECKS = {"initial_learning_rate": _number, "decay_steps": _steps, "end_learning_rate": _number,
              "power": _number}

    def __call__(self, step: int) -> float:
        s, decay_steps = _F(step), _F(self.decay_steps)
        if self.cycle:
            decay_steps = decay_steps * (_F(1) if s == 0 else np.ceil(s / decay_steps))
        else:
            s = min(s, decay_steps)
        end = _F(self.end_learning_rate)
        p = s / decay_steps
        return float((_F(self.initial_learning_rate) - end) * np.power(_F(1) - p, _F(self.power)) + end)


@dataclasses.dataclass(frozen=True)
class InverseTimeDecay(LearningRateSchedule):
    """``initial_learning_rate / (1 + decay_rate * step / decay_steps)``, as Keras'.

    >>> InverseTimeDecay(1.0, decay_steps=1, decay_rate=0.5)(2)
    0.5
    """

    initial_learning_rate: float
    decay_steps: float
    decay_rate: float
    staircase: bool = False
    name: str = "InverseTimeDecay"
    CHECKS = _DECAY

    def __call__(self, step: int) -> float:
        p = _exponent(step, self.decay_steps, self.staircase)
        return float(_F(self.initial_learning_rate) / (_F(1) + _F(self.decay_rate) * p))


@dataclasses.dataclass(frozen=True)
class CosineDecay(LearningRateSchedule):
    """Half a cosine from the rate down to ``alpha`` times it, over ``decay_steps``; optional linear warm-up.

    With ``warmup_target``, the rate first goes linearly from
    ``initial_learning_rate`` to ``warmup_target`` over ``warmup_steps``,
    then decays from ``warmup_target``.

    >>> s = CosineDecay(0.0, decay_steps=2, warmup_target=1.0, warmup_steps=2)
    >>> [round(s(k), 6) for k in range(5)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
    """

    initial_learning_rate: float
    decay_steps: float
    alpha: float = 0.0
    name: str = "CosineDecay"
    warmup_target: float | None = None
    warmup_steps: float = 0
    CHECKS = {"initial_learning_rate": _number, "decay_steps": _steps, "alpha": _number,
              "warmup_target": lambda v, arg: v is None or _number(v, arg), "warmup_steps": _non_negative}

    def _decay(self, step: Any, start: Any) -> float:
        alpha = _F(self.alpha)
        cosine = _F(0.5) * (_F(1) + np.cos(_F(math.pi) * (step / _F(self.decay_steps))))
        return float(start * ((_F(1) - alpha) * cosine + alpha))

    def __call__(self, step: int) -> float:
        s, initial, decay_steps = _F(step), _F(self.initial_learning_rate), _F(self.decay_steps)
        if self.warmup_target is None:
            return self._decay(min(s, decay_steps), initial)
        target, warmup = _F(self.warmup_target), _F(self.warmup_steps)
        s = min(s, decay_steps + warmup)
        if s < warmup:
            return float((target - initial) * (s / warmup) + initial)
        return self._decay(s - warmup, target)
