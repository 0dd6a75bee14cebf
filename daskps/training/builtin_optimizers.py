"""The optimizers Keras users expect, on the parameter servers: SGD, Adagrad, Adam, AdamW, RMSprop, Ftrl,
Adamax, Nadam and Lion.

Each class checks its arguments (messages name the argument, as Keras'
checks do) and makes the pure transform of :mod:`daskps._core.transforms`
that the servers run; :class:`~daskps.training.optimizers.Optimizer` does
the rest (clipping on the trainer, one call per server). The numbers are
Keras 3's, checked against Keras' own output in
``tests/test_keras_optimizers.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np  # noqa: F401  (the examples in the docstrings use it)

from daskps._core import transforms
from daskps.training.optimizers import (
    Optimizer,
    check_flag,
    check_optional,
    check_positive,
    check_rate,
    check_unit,
    is_number,
)

__all__ = ["Adagrad", "Adam", "AdamW", "Adamax", "Ftrl", "Lion", "Nadam", "RMSprop", "SGD"]


_COMMON = """
    Other Parameters
    ----------------
    learning_rate : float or LearningRateSchedule
        A schedule of :mod:`daskps.optimizers.schedules` is evaluated on the
        servers at each variable's step (the updates it has had so far).
    weight_decay : float, optional
        Decoupled, as Keras 3: before each step the variable is multiplied by
        ``1 - weight_decay * lr``, with that step's learning rate.
    clipnorm, clipvalue, global_clipnorm : float, optional
        Gradient clipping, on the trainer (see :class:`Optimizer`).
    lazy_sparse : bool
        Row-local updates for ``IndexedSlices`` gradients (see :class:`Optimizer`).
    name : str"""


class SGD(Optimizer):
    """Gradient descent, with optional (Nesterov) momentum, as ``keras.optimizers.SGD``.

    >>> opt = SGD(0.1, momentum=0.9)
    >>> updates, state = opt.update(np.ones(2, np.float32), opt.init(np.zeros(2, np.float32)), np.zeros(2, np.float32))
    >>> updates, state.momentum
    (array([-0.1, -0.1], dtype=float32), array([-0.1, -0.1], dtype=float32))
    """

    def __init__(self, learning_rate: Any = 0.01, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float | None = None, clipnorm: float | None = None, clipvalue: float | None = None,
                 global_clipnorm: float | None = None, lazy_sparse: bool = True, name: str = "SGD"):
        momentum = check_positive(momentum, "momentum", allow_zero=True)
        if momentum > 1:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
        transform = transforms.SGDTransform(check_rate(learning_rate), momentum, check_flag(nesterov, "nesterov"),
                                            check_optional(weight_decay, "weight_decay"))
        super().__init__(transform, lazy_sparse, name, clipnorm, clipvalue, global_clipnorm)


class Adagrad(Optimizer):
    """Adagrad, as ``keras.optimizers.Adagrad``: ``p -= lr * g / sqrt(acc + epsilon)``.

    >>> opt = Adagrad(0.1, initial_accumulator_value=0.0)
    >>> opt.update(np.ones(1, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))[0]
    array([-0.1], dtype=float32)
    """

    def __init__(self, learning_rate: Any = 0.001, initial_accumulator_value: float = 0.1,
                 epsilon: float = 1e-7, weight_decay: float | None = None, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None,
                 lazy_sparse: bool = True, name: str = "Adagrad"):
        transform = transforms.AdagradTransform(
            check_rate(learning_rate),
            check_positive(initial_accumulator_value, "initial_accumulator_value", True),
            check_positive(epsilon, "epsilon"),
            check_optional(weight_decay, "weight_decay"),
        )
        super().__init__(transform, lazy_sparse, name, clipnorm, clipvalue, global_clipnorm)


def _betas(beta_1: Any, beta_2: Any) -> tuple[float, float]:
    return check_unit(beta_1, "beta_1"), check_unit(beta_2, "beta_2")


class Adam(Optimizer):
    """Adam, as ``keras.optimizers.Adam`` (``amsgrad`` included).

    The bias correction uses the number of updates the variable has had,
    which equals Keras' ``iterations + 1`` when every step updates it.

    >>> opt = Adam(0.1)
    >>> opt.update(np.ones(1, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))[0].round(4)
    array([-0.1], dtype=float32)
    """

    def __init__(self, learning_rate: Any = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, amsgrad: bool = False, weight_decay: float | None = None,
                 clipnorm: float | None = None, clipvalue: float | None = None,
                 global_clipnorm: float | None = None, lazy_sparse: bool = True, name: str = "Adam"):
        transform = transforms.AdamTransform(check_rate(learning_rate), *_betas(beta_1, beta_2),
                                             check_positive(epsilon, "epsilon"), check_flag(amsgrad, "amsgrad"),
                                             check_optional(weight_decay, "weight_decay"))
        super().__init__(transform, lazy_sparse, name, clipnorm, clipvalue, global_clipnorm)


class AdamW(Adam):
    """Adam with decoupled weight decay, as ``keras.optimizers.AdamW`` (``weight_decay`` 0.004 unless given).

    >>> opt = AdamW(0.1, weight_decay=0.5)
    >>> opt.update(np.zeros(1, np.float32), opt.init(np.ones(1, np.float32)), np.ones(1, np.float32))[0].round(4)
    array([-0.05], dtype=float32)
    """

    def __init__(self, learning_rate: Any = 0.001, weight_decay: float = 0.004, beta_1: float = 0.9,
                 beta_2: float = 0.999, epsilon: float = 1e-7, amsgrad: bool = False,
                 clipnorm: float | None = None, clipvalue: float | None = None,
                 global_clipnorm: float | None = None, lazy_sparse: bool = True, name: str = "AdamW"):
        if weight_decay is None:
            raise ValueError("weight_decay must be a non-negative number for AdamW, got None (use Adam for none)")
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad, weight_decay, clipnorm, clipvalue,
                         global_clipnorm, lazy_sparse, name)


class RMSprop(Optimizer):
    """RMSprop, as ``keras.optimizers.RMSprop``: steps divided by a moving root mean square of the gradients.

    ``rho`` is the moving average's decay; ``momentum > 0`` accumulates the
    steps; ``centered`` divides by an estimate of the gradients' variance
    instead (the moving mean's square subtracted).

    >>> opt = RMSprop(0.1, rho=0.0)
    >>> opt.update(np.full(1, 2.0, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))[0]
    array([-0.1], dtype=float32)
    """

    def __init__(self, learning_rate: Any = 0.001, rho: float = 0.9, momentum: float = 0.0, epsilon: float = 1e-7,
                 centered: bool = False, weight_decay: float | None = None, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None,
                 lazy_sparse: bool = True, name: str = "RMSprop"):
        transform = transforms.RMSpropTransform(
            check_rate(learning_rate), check_unit(rho, "rho", high_open=False), check_positive(momentum, "momentum", True),
            check_positive(epsilon, "epsilon", True), check_flag(centered, "centered"),
            check_optional(weight_decay, "weight_decay"))
        super().__init__(transform, lazy_sparse, name, clipnorm, clipvalue, global_clipnorm)


class Ftrl(Optimizer):
    """Follow The Regularized Leader, as ``keras.optimizers.Ftrl``.

    Arguments and their checks are Keras': ``learning_rate_power <= 0``;
    the accumulator's start and the three regularisation strengths >= 0;
    ``beta`` adds ``beta / (2 * lr)`` to the L2 strength.

    >>> opt = Ftrl(0.1, l1_regularization_strength=1.0)
    >>> opt.update(np.full(1, 0.5, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))[0]
    array([0.], dtype=float32)
    """

    def __init__(self, learning_rate: Any = 0.001, learning_rate_power: float = -0.5,
                 initial_accumulator_value: float = 0.1, l1_regularization_strength: float = 0.0,
                 l2_regularization_strength: float = 0.0, l2_shrinkage_regularization_strength: float = 0.0,
                 beta: float = 0.0, weight_decay: float | None = None, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None,
                 lazy_sparse: bool = True, name: str = "Ftrl"):
        if not is_number(learning_rate_power) or learning_rate_power > 0:
            raise ValueError(f"learning_rate_power must be a number <= 0, got {learning_rate_power!r}")
        transform = transforms.FtrlTransform(
            check_rate(learning_rate), float(learning_rate_power),
            check_positive(initial_accumulator_value, "initial_accumulator_value", True),
            check_positive(l1_regularization_strength, "l1_regularization_strength", True),
            check_positive(l2_regularization_strength, "l2_regularization_strength", True),
            check_positive(l2_shrinkage_regularization_strength, "l2_shrinkage_regularization_strength", True),
            check_positive(beta, "beta", True), check_optional(weight_decay, "weight_decay"))
        super().__init__(transform, lazy_sparse, name, clipnorm, clipvalue, global_clipnorm)


class Adamax(Optimizer):
    """Adamax, as ``keras.optimizers.Adamax``: Adam with an infinity norm of the gradients in place of ``v``.

    >>> opt = Adamax(0.1)
    >>> opt.update(np.ones(1, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))[0].round(4)
    array([-0.1], dtype=float32)
    """

    def __init__(self, learning_rate: Any = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, weight_decay: float | None = None, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None,
                 lazy_sparse: bool = True, name: str = "Adamax"):
        transform = transforms.AdamaxTransform(check_rate(learning_rate), *_betas(beta_1, beta_2),
                                               check_positive(epsilon, "epsilon"), check_optional(weight_decay, "weight_decay"))
        super().__init__(transform, lazy_sparse, name, clipnorm, clipvalue, global_clipnorm)


class Nadam(Optimizer):
    """Nadam (Adam with Nesterov momentum), as ``keras.optimizers.Nadam``.

    Keras keeps a running product of momentum-decay terms (``u_product``),
    multiplied once per step. Here it is computed from each variable's (or
    shard's) own step count, which lives in its state on its server, so
    sharding, checkpoints and re-created servers need nothing more; it is
    Keras' product when every step updates every variable.

    >>> opt = Nadam(0.1)
    >>> updates, state = opt.update(np.ones(1, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))
    >>> state.count, bool(updates[0] < 0)
    (1, True)
    """

    def __init__(self, learning_rate: Any = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, weight_decay: float | None = None, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None,
                 lazy_sparse: bool = True, name: str = "Nadam"):
        transform = transforms.NadamTransform(check_rate(learning_rate), *_betas(beta_1, beta_2),
                                              check_positive(epsilon, "epsilon"), check_optional(weight_decay, "weight_decay"))
        super().__init__(transform, lazy_sparse, name, clipnorm, clipvalue, global_clipnorm)


class Lion(Optimizer):
    """Lion, as ``keras.optimizers.Lion``: steps of size ``learning_rate`` along the sign of a momentum mix.

    As Keras, ``beta_1`` must be in (0, 1] (at 0 it would be sign descent).

    >>> opt = Lion(0.1)
    >>> opt.update(np.full(1, -3.0, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))[0]
    array([0.1], dtype=float32)
    """

    def __init__(self, learning_rate: Any = 0.001, beta_1: float = 0.9, beta_2: float = 0.99,
                 weight_decay: float | None = None, clipnorm: float | None = None, clipvalue: float | None = None,
                 global_clipnorm: float | None = None, lazy_sparse: bool = True, name: str = "Lion"):
        transform = transforms.LionTransform(
            check_rate(learning_rate), check_unit(beta_1, "beta_1", low_open=True, high_open=False),
            check_unit(beta_2, "beta_2", high_open=False), check_optional(weight_decay, "weight_decay"))
        super().__init__(transform, lazy_sparse, name, clipnorm, clipvalue, global_clipnorm)


# The arguments every optimizer shares are described once, and shown by help() on each.
for _cls in (SGD, Adagrad, Adam, AdamW, RMSprop, Ftrl, Adamax, Nadam, Lion):
    _cls.__doc__ = (_cls.__doc__ or "").rstrip() + "\n" + _COMMON + "\n    "
